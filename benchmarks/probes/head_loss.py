"""The LM head with its loss, forward and backward, horizon-ray's chunked head against Liger-Kernel's fused
linear cross-entropy, over a step's tokens, GEMM by GEMM.

horizon-ray (``Template.head_loss``): the final norm, then for each chunk of ``--chunks`` tokens the logits GEMM,
the in-place cross-entropy that leaves dL/dlogits, dL/dh's GEMM and the LM head's weight gradient added into an
fp32 accumulator inside its GEMM; row groups of ``--rows`` x 1,024 tokens, as the engine's step runs them.
Liger (what HF + Liger runs): per micro-batch of 16 x 1,024 tokens RMSNorm then ``LigerFusedLinearCrossEntropy``
(its own chunking) with a bf16 weight gradient. Prints the seconds a step of ``--tokens`` for each, then the GEMMs.

On the H200 (2026-12-04, c031dc9, qwen3-4b, 65,536 tokens): Liger 289.2 ms, ours 257.5 ms at the bench's
2,048-token loss chunks and 243.6 ms at 8,192 (results/2026-12-04-h200-head-loss-c031dc9.log). The head is not
where the dense step trails HF + Liger: its fused forward GEMMs are (benchmarks/README.md).

    python3 benchmarks/probes/head_loss.py --shape qwen3-4b --tokens 65536 --rows 8,16 --chunks 1024,2048,4096,8192
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from layer_gemms import SEQ, gemm_table, timed

from horizon_ray.bench.shapes import hf_config, resolve_shape
from horizon_ray.engine import Engine, EngineConfig


def ours(eng, V: int, D: int, tokens: int, rows: int, chunk: int, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    w = {"norm": torch.ones(D, device=dev, dtype=torch.bfloat16),
         "lm_head": (torch.randn(V, D, device=dev, generator=g) * 0.02).to(torch.bfloat16)}
    sinks = {"norm": torch.zeros(D, device=dev), "lm_head": torch.zeros(V, D, device=dev)}
    N = rows * SEQ
    hs = [torch.randn(N, D, device=dev, generator=g).to(torch.bfloat16) for _ in range(tokens // N)]
    ts = [torch.randint(0, V, (N,), device=dev, generator=g) for _ in hs]

    def step():
        for h, t in zip(hs, ts):
            eng.template.head_loss(h, w, t, 1.0 / tokens, chunk, sinks, need_dh=True)

    return step


def liger(V: int, D: int, tokens: int, dev):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    g = torch.Generator(device=dev).manual_seed(0)
    lm = torch.nn.Parameter((torch.randn(V, D, device=dev, generator=g) * 0.02).to(torch.bfloat16))
    norm = torch.nn.Parameter(torch.ones(D, device=dev, dtype=torch.bfloat16))
    N = 16 * SEQ
    hs = [torch.randn(N, D, device=dev, generator=g).to(torch.bfloat16) for _ in range(tokens // N)]
    ts = [torch.randint(0, V, (N,), device=dev, generator=g) for _ in hs]
    lce = LigerFusedLinearCrossEntropyLoss()

    def step():
        for h, t in zip(hs, ts):
            h = h.detach().requires_grad_()
            hn = F.rms_norm(h, (D,), norm, 1e-6)
            lce(lm, hn, t).backward()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--rows", default="8,16")
    p.add_argument("--chunks", default="1024,2048,4096,8192")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    dev = torch.device("cuda")
    shape = resolve_shape(args.shape)
    cfg = hf_config(shape.with_layers(1))
    V, D = cfg["vocab_size"], cfg["hidden_size"]
    step = liger(V, D, args.tokens, dev)
    print(f"Liger {shape.name} (V {V}, D {D}): head + loss {timed(step, args.reps) * 1e3:.1f} ms a step of "
          f"{args.tokens} tokens", flush=True)
    gemm_table(step, "Liger")
    eng = Engine.from_config(cfg, EngineConfig(device="cuda", compute_dtype="bfloat16", seed=0))
    for rows in (int(r) for r in args.rows.split(",")):
        for chunk in (int(c) for c in args.chunks.split(",")):
            if chunk > rows * SEQ:
                continue
            step = ours(eng, V, D, args.tokens, rows, chunk, dev)
            t = timed(step, args.reps)
            print(f"horizon-ray rows {rows * SEQ}, loss chunk {chunk}: head + loss {t * 1e3:.1f} ms", flush=True)
            if chunk == 2048 or chunk == 8192:
                gemm_table(step, f"horizon-ray rows {rows * SEQ} chunk {chunk}")
            del step
            torch.cuda.empty_cache()
    eng.close()


if __name__ == "__main__":
    main()
