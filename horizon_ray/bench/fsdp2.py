"""The FSDP2 CPU-offload peer: what a user picks today when the model does not fit the GPU.

PyTorch FSDP2 on one GPU (a process group of world size 1): HF transformers' model built on the meta
device, ``fully_shard`` on every decoder layer and on the root with ``CPUOffloadPolicy`` (fp32 sharded
parameters, gradients and AdamW state in pinned host memory) and ``MixedPrecisionPolicy`` (bf16 compute,
fp32 gradient reduction), non-reentrant activation checkpointing, ``torch.optim.AdamW`` on the host
(fused where torch supports it on DTensors), global-norm clipping at 1.0. Every micro-batch's backward
reduces its gradients and accumulates them on the host, FSDP2's default. The precision is the engine's
"exact" mode: an fp32 master and fp32 moments.

It needs a GPU; on a CPU machine the suite skips it. ``--fsdp-on-cpu`` runs the same code on the CPU
(gloo, no pinning) to test it there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from horizon_ray.bench import hf
from horizon_ray.bench.runtime import cap_gpu_memory, device_and_dtype
from horizon_ray.bench.shapes import resolve_shape

SYSTEM = "fsdp2-offload"


def run(args, emit: Callable[[dict], None]) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    shape = resolve_shape(args.shape, args.layers)
    dev, dtype = device_and_dtype(args)
    device = torch.device(dev)
    cuda = device.type == "cuda"
    if not cuda and not args.fsdp_on_cpu:
        raise ValueError("fsdp2-offload offloads to the host from a GPU: it needs --device cuda "
                         "(--fsdp-on-cpu runs its code on the CPU for testing)")
    if cuda:
        torch.cuda.set_device(device)
    # one process: gloo and NCCL bootstrap over loopback
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    # world size 1 with an in-process store; CPU tensors (the norm of offloaded gradients) go through gloo
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        budget = int(args.fsdp_gpu_budget_gib * 2**30) if args.fsdp_gpu_budget_gib else None
        cap_gpu_memory(budget, device)
        t0 = time.perf_counter()
        mesh = init_device_mesh(device.type, (1,))
        torch.manual_seed(0)
        with torch.device("meta"):
            model = hf.build_model(shape, torch.float32)
        every = hf.enable_checkpointing(model, args.checkpoint_every)
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if dtype == "bfloat16" else MixedPrecisionPolicy())
        offload = CPUOffloadPolicy(pin_memory=cuda)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        # materialise the sharded parameters on the host; FSDP2 pins them at its lazy init (first forward)
        model.to_empty(device="cpu")
        _init_weights(model, device)
        model.train()
        opt = hf.FallbackAdamW(model.parameters())
        extra = {"init_s": round(time.perf_counter() - t0, 1)}

        def after() -> dict:
            p = next(model.parameters())
            return {"optimizer": f"{opt.name} (host)", "optimizer_fallback": opt.fell_back,
                    "fsdp_params_pinned": bool(cuda and p.to_local().is_pinned())}

        return hf.measure(SYSTEM, shape, model, opt, args, emit, device=device, dtype=dtype, mode="exact",
                          checkpoint_every=every, gpu_budget_bytes=budget, extra=extra, after=after)
    finally:
        dist.destroy_process_group()


@torch.no_grad()
def _init_weights(model, device: torch.device, std: float = 0.02) -> None:
    """HF's conventions on the local shards: N(0, std) matrices, unit norms, zero biases; and the rotary
    tables, which ``to_empty`` left uninitialised, rebuilt on the compute device."""
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if "norm" in name.rsplit(".", 2)[-2]:
            local.fill_(1.0)
        elif name.endswith(".bias"):
            local.zero_()
        else:
            local.normal_(0.0, std)
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(config=module.config)
            for key, buf in fresh.named_buffers(recurse=False):
                setattr(module, key, buf.to(device))
    leftover = [n for n, _ in model.named_buffers() if "rotary_emb" not in n]
    assert not leftover, f"buffers left uninitialised by to_empty: {leftover}"
