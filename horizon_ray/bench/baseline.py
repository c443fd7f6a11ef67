"""The in-GPU peers of full fine-tuning: what a user gets when the whole model fits on the GPU.

``in-gpu-baseline``: HF transformers' model of the shape, random init, weights, gradients and AdamW state on
the device in the compute dtype (bf16 on a GPU: the planner's "bf16-state" precision), activation
checkpointing, SDPA, ``torch.optim.AdamW(fused=True)``, global-norm clipping at 1.0, random token batches of
the same micro-batch, accumulation and sequence length as the engine's run. It always has the whole GPU (no
budget). With ``--device cpu`` it runs on the CPU: a smoke test, and its ``device`` field says so.

``in-gpu-liger``: the same with Liger-Kernel's kernels patched into transformers before the model is built
(RoPE, RMSNorm, SwiGLU, fused linear cross-entropy; hf.apply_liger): the strongest in-GPU stack. It needs a
GPU and the liger_kernel package; without either it is recorded ``skipped``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from horizon_ray.bench import hf
from horizon_ray.bench.metrics import Unavailable, unavailable
from horizon_ray.bench.runtime import device_and_dtype, sync
from horizon_ray.bench.shapes import resolve_shape


def run(args, emit: Callable[[dict], None]) -> list[dict]:
    shape = resolve_shape(args.shape, args.layers)
    dev, dtype = device_and_dtype(args)
    why = unavailable(args.system, dev)
    if why:
        raise Unavailable(why)
    extra: dict = {}
    model, device, every, t0 = hf.prepare_peer(args, shape, dev, dtype, extra)
    model.train()
    opt = hf.FallbackAdamW(model.parameters())
    sync(device)
    extra["init_s"] = round(time.perf_counter() - t0, 1)
    return hf.measure(args.system, shape, model, opt, args, emit, device=device, dtype=dtype,
                      mode="bf16-state" if dtype == "bfloat16" else "exact", checkpoint_every=every,
                      gpu_budget_bytes=None, extra=extra,
                      after=lambda: {"optimizer": f"{opt.name} ({device.type})", "optimizer_fallback": opt.fell_back})
