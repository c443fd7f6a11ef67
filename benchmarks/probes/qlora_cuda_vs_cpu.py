"""Where the CUDA and CPU QLoRA paths part at a real width (tests/gpu/test_cuda_qlora.py's adapter check).

    python benchmarks/probes/qlora_cuda_vs_cpu.py [--quantize nf4] [--steps 3]

Runs the test's model (llama, hidden 2048, 3 layers, r 4 on every projection, fp32 compute, TF32 off) on the
CPU and on CUDA, and after each step prints, per adapter tensor: the largest gradient difference against the
tensor's RMS gradient, and the largest weight difference (in units of lr), with the element that holds it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from horizon_ray.engine import Engine, EngineConfig, LoraConfig  # noqa: E402
from tests.tiny import llama_config, random_batches, step_grads  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WIDE = dict(hidden=2048, inter=5632, vocab=512, heads=16, kv=4)


def run(device: str, quantize: str, steps: int, lr: float):
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = llama_config(3, **WIDE)
    lora = LoraConfig(r=4, alpha=8, targets=ALL, quantize=quantize)
    eng = Engine.from_config(cfg, EngineConfig(lr=lr, weight_decay=0.1, max_grad_norm=0.5, device=device,
                                               compute_dtype="float32", seed=0, lora=lora))
    init = torch.cat([u.master for u in eng.store.adapters]).clone()
    grads, weights, losses = [], [], []
    for mbs in random_batches(steps, 2, B=2, T=64, prompt=4, vocab=cfg["vocab_size"]):
        losses.append(eng.train_step(mbs))
        grads.append(step_grads(eng))
        weights.append(torch.cat([u.master for u in eng.store.adapters]).clone())
    names = [(t.name, u_off + t.offset, t.numel) for u_off, u in _offsets(eng.store.adapters)
             for t in u.layout.tensors]
    eng.close()
    return init, grads, weights, losses, names


def _offsets(units):
    off = 0
    for u in units:
        yield off, u
        off += u.layout.numel


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quantize", default="nf4")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    cpu = run("cpu", a.quantize, a.steps, a.lr)
    cuda = run("cuda", a.quantize, a.steps, a.lr)
    print(f"init equal: {torch.equal(cpu[0], cuda[0])}; losses cpu {cpu[3]} cuda {cuda[3]}")
    for s in range(a.steps):
        print(f"-- step {s + 1}")
        for name, lo, n in cpu[4]:
            gc, gg = cpu[1][s][lo:lo + n].double(), cuda[1][s][lo:lo + n].double()
            wc, wg = cpu[2][s][lo:lo + n].double(), cuda[2][s][lo:lo + n].double()
            rms = gc.square().mean().sqrt().item()
            dg = (gc - gg).abs()
            dw = (wc - wg).abs()
            i = int(dw.argmax())
            print(f"{name:48s} rms_g {rms:9.3g} max|dg|/rms {dg.max().item() / max(rms, 1e-30):9.3g} "
                  f"zeros cpu {int((gc == 0).sum())} cuda {int((gg == 0).sum())} max|dw|/lr "
                  f"{dw.max().item() / a.lr:7.3f} at {i} (g cpu {gc[i].item():.3g} cuda {gg[i].item():.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
