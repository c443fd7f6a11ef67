"""Where LoRA at a real layer width leaves the fp32 reference: one family, two layers, random init, the same
batch twice (lr 1, eps 1: a step moves each weight by about its gradient), each adapter tensor's change over the
two steps against an fp32 run with torch's kernels. Variants isolate the cause: the fp32 run again (is the
device path deterministic?), bf16 with torch's kernels, bf16 with the default kernels (Liger on CUDA).

    python3 benchmarks/probes/lora_real_width.py --shape qwen3-4b --device cuda --tokens 4608

What it found on the H200 (torch 2.11, 2026-12-04): at fb8f26d the fp32 run repeated itself bit for bit, bf16
with torch's kernels and with Liger's agreed with each other, and both missed the fp32 run by a relative 1.6-2.2
on every adapter, the first loss (B = 0: the base alone) by 1.3e-3. The bf16 base was another random model: torch
2.11's CPU ``normal_`` draws a bf16 tensor by another algorithm than an fp32 one (the same generator gives
values 1.41 apart, relatively: uncorrelated), and a LoRA base is held, so drawn, in the compute dtype. With the
draws in fp32 (``engine._draw_all``) the worst adapter is 0.026 apart and the first losses 1.4e-5.
"""

from __future__ import annotations

import argparse
import time

import torch

from horizon_ray.bench.shapes import hf_config, resolve_shape
from horizon_ray.engine import Engine, EngineConfig, LoraConfig
from horizon_ray.engine.model import ModelConfig, family_projections

V = 65_536


def config(name: str) -> dict:
    cfg = dict(hf_config(resolve_shape(name)))
    cfg.update(num_hidden_layers=2, vocab_size=V, initializer_range=0.02)
    for key in ("layer_types", "bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(key, None)
    return cfg


def train(cfg: dict, lora: LoraConfig, device: str, dtype: str, kernels: str, tokens: int):
    """(losses, first gradient norm, {tensor name: change over the two steps})."""
    t = time.perf_counter()
    eng = Engine.from_config(cfg, EngineConfig(lr=1.0, eps=1.0, weight_decay=0.0, device=device, compute_dtype=dtype,
                                               kernels=kernels, seed=0, lora=lora, max_grad_norm=1e9))
    before = [u.master.float().clone() for u in eng.store.trained]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (1, tokens), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    losses, norms = [], []
    for _ in range(2):
        losses.append(eng.train_step([(ids, labels)]))
        norms.append(eng.last_grad_norm)
    eng.synchronize()
    deltas = {}
    for u, b in zip(eng.store.trained, before):
        for key, d in u.layout.views(u.master.float() - b).items():
            deltas[f"{u.layout.name}.{key}"] = d.clone()
    eng.close()
    print(f"{dtype:9s} {kernels:5s} losses {[round(x, 6) for x in losses]} norm {norms[0]:.6g} "
          f"({time.perf_counter() - t:.0f} s)", flush=True)
    return losses, norms[0], deltas


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=4608)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = config(args.shape)
    lora = LoraConfig(r=16, alpha=32, targets=tuple(family_projections(ModelConfig.load(cfg))))
    ref = train(cfg, lora, args.device, "float32", "torch", args.tokens)
    variants = [("float32", "torch"), ("bfloat16", "torch")]
    if args.device != "cpu":
        variants.append(("bfloat16", "auto"))
    for dtype, kernels in variants:
        _, _, deltas = train(cfg, lora, args.device, dtype, kernels, args.tokens)
        errs = {k: float((d - ref[2][k]).norm() / ref[2][k].norm().clamp_min(1e-30)) for k, d in deltas.items()}
        worst = sorted(errs.items(), key=lambda kv: -kv[1])[:6]
        print(f"  {dtype} {kernels}: max rel. error {max(errs.values()):.4f}; "
              f"worst {[(k, round(e, 4)) for k, e in worst]}", flush=True)
        print("  |ref change| of those:", [(k, f"{float(ref[2][k].norm()):.3e}") for k, _ in worst], flush=True)


if __name__ == "__main__":
    main()
