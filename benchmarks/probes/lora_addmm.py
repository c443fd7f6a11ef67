"""One adapted projection's forward and backward: the adapter's products added inside the GEMMs against added
afterwards, at a real layer's widths.

    python3 benchmarks/probes/lora_addmm.py [--shape qwen3-4b] [--rows 8192] [--ranks 8,16,64] [--device cuda]

For each projection of the shape (q, k, v, o, gate, up, down: its input and output widths) and each rank, three
timings of forward + backward on ``--rows`` tokens in bf16, with dL/dx and the adapters' gradients:

- frozen: the projection alone (F.linear), what any adapter adds to;
- after: the adapter's product added to the projection's output by a separate op, and its input gradient summed
  with the projection's by autograd (the engine before d26656a; the scaling applied to the [tokens, r] product,
  as it did);
- inside: ``layers._LoraLinear``, both products added inside GEMMs (``addmm_``).

It prints each one's milliseconds and what the adapter costs beyond the frozen projection, after against inside:
the question is whether cuBLAS's GEMM with K = r and beta = 1 runs at the bandwidth the saved passes assume.

Then, for each group of projections that read one input (q, k, v; gate, up: ``model.LORA_SHARED_INPUTS``), the
group's forward and backward, frozen, with an adapter on each apart (``_LoraLinear`` each, autograd summing their
input gradients) and together (``layers._LoraLinears``: one GEMM over the stacked A's, input gradients summed
inside the GEMMs).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from horizon_ray.bench.shapes import resolve_shape  # noqa: E402
from horizon_ray.engine.layers import _LoraLinear, _LoraLinears  # noqa: E402
from horizon_ray.engine.model import LORA_SHARED_INPUTS, projection_shapes  # noqa: E402


def seconds(fn, device: torch.device, reps: int) -> float:
    """Mean seconds of fn() over reps, after two warm-up calls."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def frozen(x, w, dy) -> None:
    F.linear(x, w).backward(dy)


def after(x, w, a, b, scaling, dy) -> None:
    u = F.linear(x, a.to(x.dtype)) * scaling
    (F.linear(x, w) + F.linear(u, b.to(x.dtype))).backward(dy)


def inside(x, w, a, b, scaling, dy) -> None:
    _LoraLinear.apply(x, w, None, a, b, scaling, 0.0, 0).backward(dy)


def group_frozen(x, ws, dys) -> None:
    torch.autograd.backward([F.linear(x, w) for w in ws], dys)


def group_apart(x, ws, adapters, scaling, dys) -> None:
    torch.autograd.backward([_LoraLinear.apply(x, w, None, a, b, scaling, 0.0, 0)
                             for w, (a, b) in zip(ws, adapters)], dys)


def group_together(x, ws, adapters, scaling, dys) -> None:
    weights = [t for w, (a, b) in zip(ws, adapters) for t in (w, None, a, b)]
    torch.autograd.backward(list(_LoraLinears.apply(x, scaling, *weights)), dys)


def groups(shape, rows: int, ranks: list[int], dev: torch.device, dt: torch.dtype, scaling: float, reps: int) -> None:
    """Each group of projections of one input: frozen, adapters apart, adapters together."""
    widths = projection_shapes(shape)
    for names in LORA_SHARED_INPUTS:
        if not all(n in widths for n in names):
            continue
        g = torch.Generator(device=dev).manual_seed(0)
        width_in = widths[names[0]][0]
        x = torch.randn(rows, width_in, device=dev, dtype=dt, generator=g).requires_grad_()
        ws = [torch.randn(widths[n][1], width_in, device=dev, dtype=dt, generator=g) * width_in**-0.5 for n in names]
        dys = [torch.randn(rows, widths[n][1], device=dev, dtype=dt, generator=g) for n in names]
        frozen_s = seconds(partial(group_frozen, x, ws, dys), dev, reps)
        for r in ranks:
            adapters = [((torch.randn(r, width_in, device=dev, generator=g) * 0.01).requires_grad_(),
                         (torch.randn(widths[n][1], r, device=dev, generator=g) * 0.01).requires_grad_())
                        for n in names]
            apart_s = seconds(partial(group_apart, x, ws, adapters, scaling, dys), dev, reps)
            together_s = seconds(partial(group_together, x, ws, adapters, scaling, dys), dev, reps)
            print(f"{'+'.join(n.removesuffix('_proj') for n in names):10s} in {width_in:6d} r {r:3d}: frozen "
                  f"{frozen_s * 1e3:7.3f}  apart {apart_s * 1e3:7.3f}  together {together_s * 1e3:7.3f}  "
                  f"adapters apart {(apart_s - frozen_s) * 1e3:6.3f} together {(together_s - frozen_s) * 1e3:6.3f}",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--ranks", default="8,16,64")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    dev, dt, scaling = torch.device(a.device), torch.bfloat16, 2.0
    shape = resolve_shape(a.shape)
    print(f"{a.shape}, {a.rows} rows, bf16, {dev}: ms of forward + backward; adapter = beyond frozen")
    for target, (width_in, width_out) in projection_shapes(shape).items():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(a.rows, width_in, device=dev, dtype=dt, generator=g).requires_grad_()
        w = torch.randn(width_out, width_in, device=dev, dtype=dt, generator=g) * width_in**-0.5
        dy = torch.randn(a.rows, width_out, device=dev, dtype=dt, generator=g)

        frozen_s = seconds(partial(frozen, x, w, dy), dev, a.reps)
        for r in (int(v) for v in a.ranks.split(",")):
            lora_a = (torch.randn(r, width_in, device=dev, generator=g) * 0.01).requires_grad_()
            lora_b = (torch.randn(width_out, r, device=dev, generator=g) * 0.01).requires_grad_()
            args = (x, w, lora_a, lora_b, scaling, dy)
            after_s = seconds(partial(after, *args), dev, a.reps)
            inside_s = seconds(partial(inside, *args), dev, a.reps)
            print(f"{target:10s} in {width_in:6d} out {width_out:6d} r {r:3d}: frozen {frozen_s * 1e3:7.3f}  "
                  f"after {after_s * 1e3:7.3f}  inside {inside_s * 1e3:7.3f}  adapter after "
                  f"{(after_s - frozen_s) * 1e3:6.3f} inside {(inside_s - frozen_s) * 1e3:6.3f}", flush=True)
    groups(shape, a.rows, [int(v) for v in a.ranks.split(",")], dev, dt, scaling, a.reps)


if __name__ == "__main__":
    main()
