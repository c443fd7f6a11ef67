"""Where the CUDA and CPU QLoRA paths part at a real width (tests/gpu/test_cuda_qlora.py's checks).

    python benchmarks/probes/qlora_cuda_vs_cpu.py [--quantize nf4] [--steps 3] [--units 1] [--bases shared,own]

Builds the test's model (llama, hidden 2048, 3 layers, HF's initialisation, fp32) and the same model quantized
by transformers + bitsandbytes on CUDA and saved pre-quantized. Then:

1. the bases: the engine's packing of the fp32 weights on the CPU against its packing on CUDA (which
   test_cuda_packed_bytes_equal_transformers_bitsandbytes_on_cuda pins to transformers'), per quantized tensor
   of the first ``--units`` layers: per part (codes, absmax, absmax2, offset; cb, scb) how many elements differ
   and by how much; the dequantized weights (each side's bytes dequantized on its own device) as max |W_cpu -
   W_cuda| and the norm of the difference, both against the RMS of W; and the CUDA bytes dequantized on the CPU
   against on CUDA (the same bytes: what remains is the dequantize kernels'); for 4-bit, how many block-scale
   codes of each side are not the nearest code to what they quantize (the CPU's quantize_blockwise, a binary
   search, lands off the nearest for ~0.2 % of them; CUDA's kernel compares against the midpoints);
2. training (the test's: r 4 on every projection, fp32 compute, TF32 off, AdamW eps 1e-6) on the CPU and on
   CUDA, each ``--bases``: "shared" both engines over the pre-quantized checkpoint's bytes (the test's
   setting), "own" each over its own device's quantization of the fp32 weights; after each step, per adapter
   tensor, the largest gradient difference against the tensor's RMS gradient, the norm of the gradients'
   difference against the gradient's and of the weights' against how far they moved (the test's measures),
   and the largest weight difference (in units of lr), with the element that holds it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from horizon_ray.engine import Engine, EngineConfig, LoraConfig  # noqa: E402
from horizon_ray.engine.model import QUANT_BLOCK, QUANT_NESTED_BLOCK  # noqa: E402
from tests.tiny import bnb_prequantized, llama_checkpoint, llama_config, random_batches, step_grads  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WIDE = dict(hidden=2048, inter=5632, vocab=512, heads=16, kv=4)
LR = 1e-3


def engine(model_dir, device: str, quantize: str):
    """The test's engine (tests/gpu/test_cuda_qlora.py's _engine) over ``model_dir``."""
    torch.backends.cuda.matmul.allow_tf32 = False
    lora = LoraConfig(r=4, alpha=8, targets=ALL, quantize=quantize)
    return Engine.from_pretrained(model_dir, EngineConfig(lr=LR, eps=1e-6, weight_decay=0.1, max_grad_norm=0.5,
                                                          device=device, compute_dtype="float32", seed=0, lora=lora))


def off_nearest(w: torch.Tensor, parts: dict[str, torch.Tensor]) -> int:
    """How many of a 4-bit weight's block-scale codes are not the nearest code of the dynamic map to what they
    quantize: (block absmax - offset) x (1 / absmax2 of its group of 256), from the fp32 weights ``w`` and the
    side's own offset and absmax2 (bitsandbytes' CUDA kernel (dQuantize) rounds to the nearest by midpoints)."""
    import bitsandbytes.functional as F  # noqa: N812 (bitsandbytes' own name)

    code = F.create_dynamic_map()
    absmax = w.reshape(-1, QUANT_BLOCK).abs().amax(1) - parts["offset"].view(torch.float32)
    groups = -(-absmax.numel() // QUANT_NESTED_BLOCK)
    scale = 1 / parts["absmax2"].view(torch.float32)[:groups]
    normed = absmax * scale.repeat_interleave(QUANT_NESTED_BLOCK)[:absmax.numel()]
    nearest = torch.bucketize(normed, (code[1:] + code[:-1]) * 0.5)
    return int((nearest != parts["absmax"].long()).sum())


def compare_bases(cpu, cuda, n_units: int, fp32_dir: Path) -> None:
    """Part by part and dequantized, the first ``n_units`` packed units of two engines' bases."""
    from safetensors import safe_open

    weights = safe_open(fp32_dir / "model.safetensors", "pt")
    shown = 0
    for u, unit in enumerate(cpu.store.units):
        packed = cpu.store.packed[u]
        if packed is None:
            continue
        if shown == n_units:
            break
        shown += 1
        theirs = cuda.store.units[u].master
        w_cpu = packed.views(unit.master)
        w_cuda = {k: v.cpu() for k, v in cuda.store.packed[u].views(theirs.to(cuda.device)).items()}
        w_cuda_on_cpu = cuda.store.packed[u].views(theirs)
        for t in unit.layout.tensors:
            kind, where = packed.parts[t.key]
            if kind == "none":
                continue
            cells, mine, yours = [], {}, {}
            for part, (lo, n) in where.items():
                mine[part], yours[part] = unit.master[lo:lo + n], theirs[lo:lo + n]
                a, b = unit.master[lo:lo + n], theirs[lo:lo + n]
                if part in ("absmax2", "offset", "scb"):
                    a, b = a.view(torch.float32).double(), b.view(torch.float32).double()
                    how = f"max rel {((a - b).abs().max() / b.abs().max()).item():.2g}"
                else:
                    a, b = (a.view(torch.int8), b.view(torch.int8)) if part == "cb" else (a, b)
                    how = f"max |dq| {(a.int() - b.int()).abs().max().item()}"
                cells.append(f"{part} {int((a != b).sum())}/{a.numel()} {how}")
            wc, wg, wx = w_cpu[t.key].double(), w_cuda[t.key].double(), w_cuda_on_cpu[t.key].double()
            rms = wc.square().mean().sqrt().item()
            if "absmax2" in where:
                w = weights.get_tensor(t.name)
                cells.append(f"absmax codes off the nearest: cpu {off_nearest(w, mine)} cuda {off_nearest(w, yours)}")
            print(f"{t.name:40s} " + "; ".join(cells))
            print(f"{'':40s} dequantized: differ {int((wc != wg).sum())}/{wc.numel()} max|W_cpu - W_cuda|/rms "
                  f"{(wc - wg).abs().max().item() / rms:.3g} |W_cpu - W_cuda|/|W| "
                  f"{((wc - wg).norm() / wc.norm()).item():.3g}; cuda bytes on cpu vs cuda: max|dW|/rms "
                  f"{(wx - wg).abs().max().item() / rms:.3g}")


def train(eng, steps: int):
    """(initial adapters, per-step gradients, per-step adapters, losses, (name, offset, numel) per tensor)."""
    init = torch.cat([u.master for u in eng.store.adapters]).clone()
    grads, weights, losses = [], [], []
    for mbs in random_batches(steps, 2, B=2, T=64, prompt=4, vocab=WIDE["vocab"]):
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


def compare_training(cpu, cuda, steps: int, lr: float) -> None:
    print(f"init equal: {torch.equal(cpu[0], cuda[0])}; losses cpu {cpu[3]} cuda {cuda[3]}")
    for s in range(steps):
        print(f"-- step {s + 1}")
        for name, lo, n in cpu[4]:
            gc, gg = cpu[1][s][lo:lo + n].double(), cuda[1][s][lo:lo + n].double()
            wc, wg = cpu[2][s][lo:lo + n].double(), cuda[2][s][lo:lo + n].double()
            rms = gc.square().mean().sqrt().item()
            dg = (gc - gg).abs()
            dw = (wc - wg).abs()
            i = int(dw.argmax())
            gnorm = max(gc.norm().item(), 1e-30)
            print(f"{name:48s} rms_g {rms:9.3g} max|dg|/rms {dg.max().item() / max(rms, 1e-30):9.3g} "
                  f"|dg|/|g| {dg.norm().item() / gnorm:9.3g} |dw|/|w - w0| "
                  f"{dw.norm().item() / max((wc - cpu[0][lo:lo + n].double()).norm().item(), 1e-30):9.3g} "
                  f"zeros cpu {int((gc == 0).sum())} cuda {int((gg == 0).sum())} max|dw|/lr "
                  f"{dw.max().item() / lr:7.3f} at {i} (g cpu {gc[i].item():.3g} cuda {gg[i].item():.3g})")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quantize", default="nf4", choices=["nf4", "fp4", "int8"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--units", type=int, default=1, help="layers whose bases are compared tensor by tensor")
    p.add_argument("--bases", default="shared,own", help="which trainings to compare: shared, own or both")
    p.add_argument("--device", default="cuda", help="the side compared with the CPU (cpu: a dry run)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = llama_checkpoint(Path(tmp) / "fp32", llama_config(3, **WIDE))
        qdir = bnb_prequantized(fp32, Path(tmp) / a.quantize, a.quantize, a.device)
        print(f"== bases: the engine's packing of the same fp32 weights, cpu vs {a.device}")
        own = engine(fp32, "cpu", a.quantize), engine(fp32, a.device, a.quantize)
        compare_bases(*own, a.units, fp32)
        for base in a.bases.split(","):
            print(f"== training, {base} base" + (" (the pre-quantized checkpoint's bytes on both)" if base == "shared"
                                                  else " (each device's own quantization)"))
            engines = own if base == "own" else (engine(qdir, "cpu", a.quantize), engine(qdir, a.device, a.quantize))
            compare_training(train(engines[0], a.steps), train(engines[1], a.steps), a.steps, LR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
