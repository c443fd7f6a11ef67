"""Which way to multiply by a 4-bit weight is faster on this GPU: bitsandbytes' dequantize + torch's GEMM
(what the engine's layer template runs on a quantized base, quant.py), or ``bnb.matmul_4bit`` (what PEFT's
Linear4bit runs). Both ways, forward and dL/dx of one projection, at the widths of real shapes:

    python -m horizon_ray.bench.quant_kernels [--shapes qwen2.5-7b,llama-3.1-70b] [--tokens 16384,65536]

prints one JSON line per (shape, projection, tokens, way) with the median milliseconds of 10 timed calls.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from horizon_ray.bench.shapes import resolve_shape
from horizon_ray.engine.model import QUANT_BLOCK


def _time_ms(fn, reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compare(out_f: int, in_f: int, tokens: int, quant_type: str = "nf4") -> dict[str, float]:
    import bitsandbytes as bnb
    import bitsandbytes.functional as F  # noqa: N812 (bitsandbytes' own name)

    dev = torch.device("cuda")
    w = torch.randn(out_f, in_f, dtype=torch.bfloat16, device=dev) * 0.02
    packed, state = F.quantize_4bit(w, blocksize=QUANT_BLOCK, compress_statistics=True, quant_type=quant_type)
    del w
    x = torch.randn(tokens, in_f, dtype=torch.bfloat16, device=dev, requires_grad=True)
    dy = torch.randn(tokens, out_f, dtype=torch.bfloat16, device=dev)

    def dequantize_gemm():
        W = F.dequantize_4bit(packed, state)
        y = torch.nn.functional.linear(x, W)
        (dx,) = torch.autograd.grad(y, x, dy)

    def matmul_4bit():
        y = bnb.matmul_4bit(x, packed.t(), quant_state=state)
        (dx,) = torch.autograd.grad(y, x, dy)

    return {"dequantize+gemm": _time_ms(dequantize_gemm), "matmul_4bit": _time_ms(matmul_4bit)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen2.5-7b,llama-3.1-70b")
    p.add_argument("--tokens", default="16384,65536", help="tokens of one row group (layer_chunk_tokens caps it)")
    p.add_argument("--quant-type", default="nf4", choices=("nf4", "fp4"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA"}))
        return 0
    for name in args.shapes.split(","):
        shape = resolve_shape(name)
        H, I = shape.hidden_size, shape.intermediate_size
        for proj, (out_f, in_f) in {"q_proj": (shape.q_dim, H), "gate_proj": (I, H), "down_proj": (H, I)}.items():
            for tokens in (int(t) for t in args.tokens.split(",")):
                ms = compare(out_f, in_f, tokens, args.quant_type)
                print(json.dumps({"shape": name, "proj": proj, "out": out_f, "in": in_f, "tokens": tokens,
                                  **{k: round(v, 3) for k, v in ms.items()},
                                  "faster": min(ms, key=ms.__getitem__)}), flush=True)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
