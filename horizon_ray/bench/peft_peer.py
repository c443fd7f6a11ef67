"""The in-GPU peers of LoRA: HF transformers + PEFT with the whole model on the GPU.

``in-gpu-peft``: HF's model of the shape, random init, the base frozen in the compute dtype (bf16 on a GPU),
PEFT LoRA adapters with the horizon-ray LoRA row's settings (rank ``--lora-r``, alpha 2 r, dropout 0, no
bias, on ``--lora-targets`` of every layer) kept in fp32, the forward under autocast to the compute dtype,
non-reentrant activation checkpointing with the embedding's output requiring a gradient, fused
``torch.optim.AdamW`` over the adapters, global-norm clipping at 1.0. It runs on the CPU too (fp32, no
autocast): a smoke test, and its ``device`` field says so.

``in-gpu-peft-liger``: the same with Liger-Kernel's kernels patched in first (hf.apply_liger). It needs a
GPU and the liger_kernel package; without either it is recorded ``skipped``, as both are without peft.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from horizon_ray.bench import hf
from horizon_ray.bench.metrics import Unavailable, unavailable
from horizon_ray.bench.planning import lora_alpha, lora_settings
from horizon_ray.bench.runtime import device_and_dtype, sync
from horizon_ray.bench.shapes import resolve_shape


def run(args, emit: Callable[[dict], None]) -> list[dict]:
    shape = resolve_shape(args.shape, args.layers)
    dev, dtype = device_and_dtype(args)
    why = unavailable(args.system, dev)
    if why:
        raise Unavailable(why)
    lora = lora_settings(args, "lora", shape)
    lora.check()
    extra = {"peft": hf.require_peft()}
    model, device, every, t0 = hf.prepare_peer(args, shape, dev, dtype, extra)
    model = hf.peft_lora(model, lora.r, lora_alpha(lora.r), lora.targets)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = hf.FallbackAdamW(params)
    sync(device)
    extra.update(init_s=round(time.perf_counter() - t0, 1), lora_r=lora.r,
                 lora_alpha=lora_alpha(lora.r), lora_targets=list(lora.targets))
    compute = getattr(torch, dtype)
    return hf.measure(args.system, shape, model, opt, args, emit, device=device, dtype=dtype, mode="lora",
                      checkpoint_every=every, gpu_budget_bytes=None, extra=extra, params=params,
                      autocast=compute if compute != torch.float32 else None,
                      after=lambda: {"optimizer": f"{opt.name} ({device.type})", "optimizer_fallback": opt.fell_back})
