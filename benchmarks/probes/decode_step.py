"""Where a resident decode step's time goes (the generation bench's 7B resident row ran at 0.31x HF generate).

    python benchmarks/probes/decode_step.py [--shape qwen2.5-7b] [--batch 64] [--prompt-len 512] [--steps 12]

1. SDPA at a decode step's shapes (one query per row, a growing cached length, a boolean mask, grouped heads)
   under each backend, the length changing every call as it does in decoding: the median and the first call.
2. The engine's resident generator over --steps decode steps under torch.profiler: the CUDA kernels and the CPU
   ops that take the time, and the wall time of a step against the GPU's busy time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.generate import _hf_model  # noqa: E402
from horizon_ray.bench.shapes import hf_config, resolve_shape  # noqa: E402
from horizon_ray.engine.generate import Generator  # noqa: E402
from horizon_ray.engine.sampling import Request, SamplingParams  # noqa: E402


def sdpa_at_decode(B: int, H: int, kvH: int, d: int, S0: int, n: int) -> None:
    q = torch.randn(B, H, 1, d, device="cuda", dtype=torch.bfloat16)
    K = torch.randn(B, kvH, S0 + n, d, device="cuda", dtype=torch.bfloat16)
    V = torch.randn_like(K)
    for name, backends in [("cudnn-first (ours)", [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                                   SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
                           ("flash", [SDPBackend.FLASH_ATTENTION]), ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                           ("math", [SDPBackend.MATH]), ("default", None)]:
        for masked in (True, False):
            times = []
            for i in range(n):
                S = S0 + i
                k, v = K[:, :, :S], V[:, :, :S]
                kw = {"attn_mask": torch.ones(B, 1, 1, S, dtype=torch.bool, device="cuda")} if masked else {}
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                try:
                    if backends is None:
                        F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
                    else:
                        with sdpa_kernel(backends, set_priority=True):
                            F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
                except RuntimeError as exc:
                    print(f"sdpa {name:20s} mask={masked}: refused ({str(exc).splitlines()[0][:80]})")
                    break
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            if times:
                print(f"sdpa {name:20s} mask={masked}: first {times[0] * 1e3:8.2f} ms, median "
                      f"{statistics.median(times[1:]) * 1e3:8.3f} ms over {len(times) - 1} lengths", flush=True)


def profile_decode(shape: str, B: int, T: int, steps: int) -> None:
    cfg = hf_config(resolve_shape(shape))
    cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings") or 0), T + steps + 8)
    model = _hf_model(cfg, "cuda")
    tensors = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    del model
    torch.cuda.empty_cache()
    gen = Generator.from_tensors(cfg, tensors, device="cuda", dtype="bfloat16")
    prompts = torch.randint(3, int(cfg["vocab_size"]), (B, T), generator=torch.Generator().manual_seed(1))
    reqs = [Request(tuple(r.tolist()), SamplingParams(max_tokens=steps + 4)) for r in prompts]
    gen.generate([Request(r.prompt_ids[:8], SamplingParams(max_tokens=2)) for r in reqs])
    it = gen.stream(reqs)
    next(it)  # the prompts' pass
    next(it)
    torch.cuda.synchronize()
    walls = []
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            next(it)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    print(f"decode step wall: median {statistics.median(walls) * 1e3:.1f} ms over {steps} steps "
          f"(B={B}, prompt {T})", flush=True)
    ka = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in ka) / steps
    print(f"GPU busy per step: {gpu_us / 1e3:.1f} ms")
    print(ka.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=70))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=70))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    sdpa_at_decode(a.batch, 28, 4, 128, a.prompt_len, 24)
    profile_decode(a.shape, a.batch, a.prompt_len, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
