"""One decoder layer's GPU work, horizon-ray's template against HF + Liger-Kernel's layer, GEMM by GEMM.

The same shape, the same tokens a step (--tokens), bf16: a forward pass without autograd (the step's forward,
whose outputs are the checkpoints), then for each row group / micro-batch the recompute under autograd and the
backward, as both systems run a checkpointed layer. horizon-ray adds every weight gradient into fp32
accumulators inside the GEMM (``accumulate_mm``); HF's autograd writes bf16 ``.grad`` and adds the later
micro-batches' into it. horizon-ray runs twice: with every projection its own GEMM (what the engine runs under
LoRA) and with q, k, v and gate, up each one GEMM over their adjacent rows (``UnitLayout.views(fused=True)``,
what it runs in full fine-tuning). Prints the layer's time per step for each, then every GEMM op by shape: calls,
device time, TFLOP/s, so that the slower shapes name themselves.

On the H200 (2026-12-04, qwen3-4b, 65,536 tokens): HF + Liger's layer 94.1-95.7 ms, ours 95.7 ms fused and 97.2
against 97.6 ms split vs fused in a slower call (results/2026-12-04-h200-layer-gemms-*.log).

    python3 benchmarks/probes/layer_gemms.py --shape qwen3-4b --tokens 65536 --rows 8,16
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from horizon_ray.bench.hf import apply_liger, transformers_config
from horizon_ray.bench.runtime import gemm_shapes
from horizon_ray.bench.shapes import hf_config, resolve_shape
from horizon_ray.engine import Engine, EngineConfig

SEQ = 1024
def timed(fn, reps: int) -> float:
    """Mean seconds of fn() over reps, after two warm-up calls."""
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def gemm_table(fn, label: str) -> None:
    """fn() once under the profiler: each GEMM op by input shapes, its calls, device seconds and TFLOP/s."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    rows = gemm_shapes(prof, top=64)
    total_s = sum(r[3] for r in rows)
    total_f = sum(r[3] * r[4] for r in rows if r[4] is not None)
    print(f"{label}: GEMMs {total_s * 1e3:.2f} ms, {total_f / max(total_s, 1e-12):.0f} TFLOP/s", flush=True)
    for key, shapes, count, s, rate in rows:
        print(f"  {key:12s} {str(shapes):52s} x{count:<3d} {s * 1e3:8.3f} ms {rate or 0:6.0f} TFLOP/s")
    kernels = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and ("nvjet" in e.key or "gemm" in e.key.lower()):
            kernels[e.key[:70]] += e.self_device_time_total / 1e6
    for k, s in sorted(kernels.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    kernel {k:70s} {s * 1e3:8.3f} ms")


def ours(shape, tokens: int, rows: int, fused: bool, dev):
    cfg = hf_config(shape.with_layers(2))
    eng = Engine.from_config(cfg, EngineConfig(device=str(dev), compute_dtype="bfloat16", seed=0))
    u = eng.units.of_layer(0)
    layout = eng.store.units[u].layout
    wire = eng.store.units[u].wire_of(0).to(dev)
    w = layout.views(wire, fused=fused)
    acc = torch.zeros(layout.numel, device=dev)
    sinks = layout.views(acc, fused=fused)
    leaves = {k: w[k].detach().requires_grad_() for k in eng.template.leaf_keys(w)}
    w = {**w, **leaves}
    D = shape.hidden_size
    groups = tokens // (rows * SEQ)
    pos = torch.arange(SEQ).expand(rows, SEQ)
    ids = torch.zeros(rows, SEQ, dtype=torch.long)
    mb = eng.template.micro_batch(ids, ids, pos, None, dev, torch.bfloat16)
    xs = [torch.randn(rows, SEQ, D, device=dev, dtype=torch.bfloat16) for _ in range(groups)]
    dy = torch.randn(rows, SEQ, D, device=dev, dtype=torch.bfloat16) * 1e-3

    def forward():
        with torch.no_grad():
            for x in xs:
                eng.template.layer(x, w, mb, j=0)

    def backward():
        for x in xs:
            x = x.detach().requires_grad_()
            with torch.enable_grad():
                y = eng.template.layer(x, w, mb, sinks=sinks, j=0)
            grads = torch.autograd.grad(y, [x, *leaves.values()], dy)
            for key, g in zip(leaves, grads[1:]):
                sinks[key].add_(g)

    def step():
        forward()
        backward()

    return step, eng


def hf_liger(shape, tokens: int, dev):
    from transformers import AutoModelForCausalLM

    extra: dict = {}
    apply_liger(shape, extra)
    liger = extra["liger"]
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(transformers_config(shape.with_layers(1)), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    layer = model.model.layers[0]
    rows = 16  # the peers' micro-batch
    D = shape.hidden_size
    pos = torch.arange(SEQ, device=dev).expand(rows, SEQ)
    xs = [torch.randn(rows, SEQ, D, device=dev, dtype=torch.bfloat16) for _ in range(tokens // (rows * SEQ))]
    dy = torch.randn(rows, SEQ, D, device=dev, dtype=torch.bfloat16) * 1e-3
    pe = model.model.rotary_emb(xs[0], pos)

    def step():
        with torch.no_grad():
            for x in xs:
                layer(x, position_embeddings=pe, position_ids=pos)
        for x in xs:
            x = x.detach().requires_grad_()
            y = layer(x, position_embeddings=pe, position_ids=pos)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(dy)

    return step, liger


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--rows", default="8,16", help="horizon-ray's row groups, in rows of 1,024 tokens")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    dev = torch.device("cuda")
    shape = resolve_shape(args.shape)
    step, liger = hf_liger(shape, args.tokens, dev)
    t = timed(step, args.reps)
    print(f"HF + Liger {liger} {shape.name}: layer {t * 1e3:.2f} ms a step of {args.tokens} tokens", flush=True)
    gemm_table(step, "HF + Liger")
    for rows in (int(r) for r in args.rows.split(",")):
        for fused in (False, True):
            step, eng = ours(shape, args.tokens, rows, fused, dev)
            t = timed(step, args.reps)
            what = "q, k, v and gate, up fused (one GEMM each)" if fused else "every projection its own GEMM"
            print(f"horizon-ray {shape.name}, row groups of {rows * SEQ} tokens, {what}: layer {t * 1e3:.2f} ms",
                  flush=True)
            gemm_table(step, f"horizon-ray rows {rows}{' fused' if fused else ''}")
            eng.close()


if __name__ == "__main__":
    main()
