# ruff: noqa: B023  (each closure runs within its own loop iteration)
"""Times the pieces of a streamed step on one GPU, variant by variant, and checks each against the torch path.

Run on the GPU box from the repository root (Liger-Kernel importable for its variants):
    PYTHONPATH=$PWD python3 benchmarks/kernel_probe.py [--shape qwen2.5-7b] [--rows 8] [--json $OUT/probe.json]

Measures, for one decoder layer of the shape at rows x seq tokens (one row group of the engine):
- the layer's forward without autograd and its backward (forward under autograd + autograd.grad), for the
  template's kernel sets (torch, liger, torch.compile of the torch kernels), with q/k/v and gate/up fused or
  not, and weight gradients added into fp32 sinks or returned by autograd and added after (the old path);
- scaled_dot_product_attention forward + backward per backend (flash, cuDNN, memory-efficient);
- the LM head + cross-entropy of the same tokens, torch vs Liger's cross-entropy kernel, by chunk size;
- the host AdamW one-pass kernel alone and while pinned copies run both ways.
Prints one JSON line per measurement and a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from horizon_ray.bench.shapes import hf_config, resolve_shape
from horizon_ray.engine.kernels import Kernels, accumulate_mm, liger_available
from horizon_ray.engine.layers import MicroBatch, Template, inv_frequencies, rope_tables
from horizon_ray.engine.model import ModelConfig, unit_layouts

ROWS = []


def emit(**rec):
    ROWS.append(rec)
    print("PROBE", json.dumps(rec), flush=True)


def timed(fn, reps=8, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


class Compiled(Kernels):
    """The torch kernels, each compiled by torch.compile (inductor fuses the elementwise chains)."""

    def __init__(self):
        super().__init__("torch")
        base = Kernels("torch")
        object.__setattr__(self, "_rms", torch.compile(base.rms_norm, dynamic=False))
        object.__setattr__(self, "_rope", torch.compile(base.rope, dynamic=False))
        object.__setattr__(self, "_swiglu", torch.compile(base.swiglu, dynamic=False))

    def rms_norm(self, x, weight, eps):
        return self._rms(x, weight, eps)

    def rope(self, q, k, cos, sin):
        return self._rope(q, k, cos, sin)

    def swiglu(self, gate_up):
        return self._swiglu(gate_up)


def layer_probe(cfg: ModelConfig, rows: int, seq: int):
    dev = torch.device("cuda")
    layout = unit_layouts(cfg)[1]
    g = torch.Generator(device=dev).manual_seed(0)
    flat = (torch.randn(layout.numel, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    for t in layout.tensors:
        if t.key.startswith("ln"):
            flat[t.offset:t.offset + t.numel] = 1.0
    x = torch.randn(rows, seq, cfg.hidden_size, generator=g, device=dev).to(torch.bfloat16)
    dy = (torch.randn(rows, seq, cfg.hidden_size, generator=g, device=dev) * 1e-3).to(torch.bfloat16)
    pos = torch.arange(seq, device=dev).expand(rows, seq)
    cos, sin = rope_tables(inv_frequencies(cfg), pos, torch.bfloat16)
    ids = torch.zeros(rows, seq, dtype=torch.long, device=dev)
    mb = MicroBatch(ids.cpu(), ids, ids, cos, sin, None, rows * seq)
    acc = torch.zeros(layout.numel, device=dev)
    variants = [("torch", False, False), ("torch", True, True)]
    if liger_available():
        variants += [("liger", False, True), ("liger", True, True)]
    variants.append(("compile", True, True))
    ref = None
    for kname, fused, sink in variants:
        try:
            ops = Compiled() if kname == "compile" else Kernels(kname)
            tpl = Template(cfg, ops)
            w = layout.views(flat, fused)
            sinks = layout.views(acc, fused) if sink else None

            def fwd():
                with torch.no_grad():
                    return tpl.layer(x, w, mb)

            def bwd():
                leaves_keys = tpl.leaf_keys(w) if sink else list(w)
                leaves = {k: w[k].detach().requires_grad_() for k in leaves_keys}
                xl = x.detach().requires_grad_()
                with torch.enable_grad():
                    y = tpl.layer(xl, {**w, **leaves}, mb, sinks=sinks)
                grads = torch.autograd.grad(y, [xl, *leaves.values()], dy)
                target = sinks if sink else layout.views(acc, fused)
                for k, gk in zip(leaves, grads[1:]):
                    target[k].add_(gk)
                return grads[0]

            t_f = timed(fwd)
            t_b = timed(bwd)
            acc.zero_()
            dx = bwd()
            grads = acc.clone()
            if ref is None:
                ref = (dx.float(), grads)
            err_dx = float((dx.float() - ref[0]).norm() / ref[0].norm())
            err_g = float((grads - ref[1]).norm() / ref[1].norm())
            emit(what="layer", kernels=kname, fused=fused, sink=sink, tokens=rows * seq, fwd_ms=round(t_f, 3),
                 bwd_ms=round(t_b, 3), step_ms=round(2 * t_f + t_b, 3), rel_err_dx=err_dx, rel_err_dw=err_g,
                 peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        except Exception as exc:  # a variant that fails is a result too
            emit(what="layer", kernels=kname, fused=fused, sink=sink, error=f"{type(exc).__name__}: {exc}"[:300])
        torch.cuda.reset_peak_memory_stats()


def sdpa_probe(cfg: ModelConfig, rows: int, seq: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    hd = cfg.head_dim
    q = torch.randn(rows, cfg.num_heads, seq, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(rows, cfg.num_kv_heads, seq, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    do = torch.randn(rows, cfg.num_heads, seq, hd, device=dev, dtype=torch.bfloat16)
    gqa = cfg.num_heads != cfg.num_kv_heads
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        be = getattr(SDPBackend, name)
        try:
            def run():
                with sdpa_kernel([be]):
                    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                torch.autograd.grad(o, [q, k, v], do)

            def fwd():
                with sdpa_kernel([be]), torch.no_grad():
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

            emit(what="sdpa", backend=name, fwd_ms=round(timed(fwd), 3), fwd_bwd_ms=round(timed(run), 3))
        except Exception as exc:
            emit(what="sdpa", backend=name, error=f"{type(exc).__name__}: {exc}"[:200])


def head_probe(cfg: ModelConfig, tokens: int):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    V, H = cfg.vocab_size, cfg.hidden_size
    w = {"norm": torch.ones(H, device=dev, dtype=torch.bfloat16),
         "lm_head": (torch.randn(V, H, generator=g, device=dev) * 0.02).to(torch.bfloat16)}
    h = torch.randn(tokens, H, generator=g, device=dev).to(torch.bfloat16)
    t = torch.randint(0, V, (tokens,), generator=g, device=dev)
    sinks = {"norm": torch.zeros(H, device=dev), "lm_head": torch.zeros(V, H, device=dev)}
    ref = None
    kinds = ["torch"] + (["liger"] if liger_available() else [])
    for kname in kinds:
        for chunk in (1024, 2048, 4096):
            try:
                tpl = Template(cfg, Kernels(kname))
                run = lambda: tpl.head_loss(h, w, t, 1.0 / tokens, chunk, sinks, need_dh=True)  # noqa: E731
                ms = timed(run, reps=5, warmup=2)
                for s in sinks.values():
                    s.zero_()
                loss, dh = run()
                if ref is None:
                    ref = (float(loss), dh.float(), sinks["lm_head"].clone())
                emit(what="head", kernels=kname, chunk=chunk, tokens=tokens, ms=round(ms, 3),
                     loss=float(loss), rel_err_loss=abs(float(loss) - ref[0]) / ref[0],
                     rel_err_dh=float((dh.float() - ref[1]).norm() / ref[1].norm()),
                     rel_err_dw=float((sinks["lm_head"] - ref[2]).norm() / ref[2].norm()),
                     peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
                for s in sinks.values():
                    s.zero_()
            except Exception as exc:
                emit(what="head", kernels=kname, chunk=chunk, error=f"{type(exc).__name__}: {exc}"[:300])
            torch.cuda.reset_peak_memory_stats()
    # the bare matmul work of the head (3 GEMMs), the floor of any implementation
    lg = torch.empty(4096, V, device=dev, dtype=torch.bfloat16)
    acc = sinks["lm_head"]

    def gemms():
        for lo in range(0, tokens, 4096):
            torch.mm(h[lo:lo + 4096], w["lm_head"].t(), out=lg)
            torch.mm(lg, w["lm_head"])
            accumulate_mm(acc, lg.t(), h[lo:lo + 4096])

    emit(what="head", kernels="gemms-only", tokens=tokens, ms=round(timed(gemms, reps=5, warmup=2), 3))


def adam_probe(params: int = 1 << 30, units: int = 4):
    from horizon_ray.engine.model import _unit
    from horizon_ray.engine.optimizer import HostAdamW
    from horizon_ray.engine.store import HostStore

    n = params // units
    store = HostStore([_unit(f"u{i}", [(f"w{i}", "w", (n,))]) for i in range(units)], torch.bfloat16,
                      torch.float32, pin=True)
    for u in store.units:
        u.master.normal_()
        u.wire.normal_()
    opt = HostAdamW(store, (0.9, 0.95), 1e-8, 0.01)
    t0 = time.perf_counter()
    opt.update(store.units[0], 1e-5, 1.0)
    emit(what="adam", case="first call (kernel build)", s=round(time.perf_counter() - t0, 2))
    import os

    host_a = torch.empty(1 << 29, dtype=torch.bfloat16).pin_memory()
    host_b = torch.empty(1 << 29, dtype=torch.bfloat16).pin_memory()
    dev_a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dev_b = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    for threads in (8, 14, 16):
        for copies in (False, True):
            stop = threading.Event()
            moved = [0]

            def copier():
                s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
                while not stop.is_set():
                    with torch.cuda.stream(s1):
                        dev_a.copy_(host_a, non_blocking=True)
                    with torch.cuda.stream(s2):
                        host_b.copy_(dev_b, non_blocking=True)
                    s1.synchronize()
                    s2.synchronize()
                    moved[0] += 2 * host_a.nbytes

            th = threading.Thread(target=copier) if copies else None
            torch.set_num_threads(threads)
            if th:
                th.start()
                time.sleep(0.2)
            t = time.perf_counter()
            c0 = moved[0]
            for u in store.units:
                opt.update(u, 1e-5, 0.5)
            dt = time.perf_counter() - t
            c1 = moved[0]
            stop.set()
            if th:
                th.join()
            emit(what="adam", threads=threads, copies=copies, g_params_per_s=round(params / dt / 1e9, 3),
                 copy_gb_per_s=round((c1 - c0) / dt / 1e9, 1) if copies else None)
    torch.set_num_threads(os.cpu_count() or 16)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--json", default=None)
    p.add_argument("--skip", default="", help="comma list of layer,sdpa,head,adam")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig.from_hf(hf_config(resolve_shape(a.shape)))
    skip = set(a.skip.split(","))
    emit(what="env", torch=torch.__version__, device=torch.cuda.get_device_name(), liger=liger_available())
    sections = (("layer", lambda: layer_probe(cfg, a.rows, a.seq)), ("sdpa", lambda: sdpa_probe(cfg, a.rows, a.seq)),
                ("head", lambda: head_probe(cfg, a.rows * a.seq)), ("adam", adam_probe))
    for name, fn in sections:
        if name not in skip:
            t = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # the other sections still run
                emit(what="section-error", name=name, error=f"{type(exc).__name__}: {exc}"[:300])
            emit(what="section", name=name, s=round(time.perf_counter() - t, 1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    for r in ROWS:
        print(" ".join(f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
