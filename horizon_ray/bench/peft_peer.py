"""The in-GPU peers of LoRA: HF transformers + PEFT with the whole model on the GPU.

``in-gpu-peft``: HF's model of the shape, random init, the base frozen in the compute dtype (bf16 on a GPU),
PEFT LoRA adapters with the horizon-ray LoRA row's settings (rank ``--lora-r``, alpha 2 r, dropout 0, no
bias, on ``--lora-targets`` of every layer) kept in fp32, the forward under autocast to the compute dtype,
non-reentrant activation checkpointing with the embedding's output requiring a gradient, fused
``torch.optim.AdamW`` over the adapters, global-norm clipping at 1.0. It runs on the CPU too (fp32, no
autocast): a smoke test, and its ``device`` field says so.

``in-gpu-peft-liger``: the same with Liger-Kernel's kernels patched in first (hf.apply_liger). It needs a
GPU and the liger_kernel package; without either it is recorded ``skipped``, as both are without peft.

With ``--quantize`` (nf4, fp4, int8) the peers are PEFT + bitsandbytes QLoRA: every nn.Linear of the decoder
layers is bitsandbytes' Linear4bit (block 64, double-quantized scales, compute dtype bf16) or Linear8bitLt
(threshold 6.0, what BitsAndBytesConfig(load_in_8bit=True) builds), as transformers' BitsAndBytesConfig
replaces them. The model is built layer by layer on the device (a 70B base in bf16 would not fit the GPU
before it is quantized): the rest of the model first on the meta device, then each decoder layer in bf16 on
the GPU, its projections quantized by bitsandbytes as they move there, the bf16 copy freed. A MoE block's fused
experts (3D parameters, not nn.Linear) stay in bf16, as transformers' BitsAndBytesConfig leaves them: the record's
``unquantized_params`` counts them, and a base whose bf16 experts alone exceed the GPU is recorded ``skipped``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from horizon_ray.bench import hf
from horizon_ray.bench.metrics import LIGER, Unavailable, unavailable
from horizon_ray.bench.planning import lora_alpha, lora_settings
from horizon_ray.bench.runtime import device_and_dtype, sync
from horizon_ray.bench.shapes import resolve_shape
from horizon_ray.engine.model import EXPERT_TARGETS


def run(args, emit: Callable[[dict], None]) -> list[dict]:
    shape = resolve_shape(args.shape, args.layers)
    dev, dtype = device_and_dtype(args)
    why = unavailable(args.system, dev)
    if why:
        raise Unavailable(why)
    lora = lora_settings(args, "lora", shape)
    assert lora is not None, "mode lora has adapters"
    lora.check()
    extra: dict[str, Any] = {"peft": hf.require_peft()}
    if lora.quantize != "none":
        extra["bitsandbytes"] = hf.version("bitsandbytes")
        model, device, every, t0 = _prepare_quantized(args, shape, dev, dtype, lora.quantize, extra,
                                                      _adapts_experts(lora.targets))
    else:
        model, device, every, t0 = hf.prepare_peer(args, shape, dev, dtype, extra, _adapts_experts(lora.targets))
    model = hf.peft_lora(model, lora.r, lora_alpha(lora.r), lora.targets)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = hf.FallbackAdamW(params)
    sync(device)
    extra.update(init_s=round(time.perf_counter() - t0, 1), lora_r=lora.r,
                 lora_alpha=lora_alpha(lora.r), lora_targets=list(lora.targets), quantize=lora.quantize)
    compute = getattr(torch, dtype)
    return hf.measure(args.system, shape, model, opt, args, emit, device=device, dtype=dtype, mode="lora",
                      checkpoint_every=every, gpu_budget_bytes=None, extra=extra, params=params,
                      autocast=compute if compute != torch.float32 else None,
                      after=lambda: {"optimizer": f"{opt.name} ({device.type})", "optimizer_fallback": opt.fell_back})


def _adapts_experts(targets) -> bool:
    return any(t in EXPERT_TARGETS for t in targets)


def _prepare_quantized(args, shape, dev: str, dtype: str, quantize: str, extra: dict,
                       adapted_experts: bool = False):
    """hf.prepare_peer for a bitsandbytes-quantized base (see the module's docstring)."""
    from transformers import AutoModelForCausalLM

    if args.system in LIGER:
        hf.apply_liger(shape, extra, adapted_experts)
    device = torch.device(dev)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    compute = getattr(torch, dtype)
    cfg = hf.transformers_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=compute, attn_implementation="sdpa")
    layers = model.model.layers
    kept = _kept_unquantized(layers)
    extra["unquantized_params"] = kept  # fused MoE experts: bitsandbytes replaces nn.Linear modules only
    capacity = _device_bytes(device)
    if capacity is not None and kept * compute.itemsize > capacity:
        raise Unavailable(
            f"PEFT + bitsandbytes keeps {kept / 1e9:.1f} B parameters of {shape.name} unquantized (its fused MoE "
            f"experts are 3D parameters, not the nn.Linear modules bitsandbytes replaces, as transformers' "
            f"BitsAndBytesConfig leaves them too): {kept * compute.itemsize / 2**30:.0f} GiB in {dtype}, more than "
            f"the GPU's {capacity / 2**30:.0f} GiB")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    for i in range(len(layers)):
        with device:
            layer = type(layers[i])(model.config, i).to(compute)
        _quantize_linears(layer, quantize, compute, device)
        layers[i] = layer
    _materialize(model, device, compute)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    every = hf.enable_checkpointing(model, args.checkpoint_every)
    return model, device, every, t0


def _device_bytes(device: torch.device) -> int | None:
    """The GPU's memory in bytes; None on the CPU."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def _kept_unquantized(layers: torch.nn.ModuleList) -> int:
    """Parameters of the decoder layers (built on the meta device) that _quantize_linears leaves in the compute
    dtype: the weight matrices outside nn.Linear modules (the stacked experts of transformers' MoE blocks)."""
    return sum(p.numel() for layer in layers for module in layer.modules()
               if not isinstance(module, torch.nn.Linear)
               for p in module.parameters(recurse=False) if p.dim() >= 2)


def _quantize_linears(module: torch.nn.Module, quantize: str, compute: torch.dtype, device: torch.device) -> None:
    """Every nn.Linear under ``module`` replaced by bitsandbytes' quantized layer holding its weights."""
    import bitsandbytes as bnb

    for name, child in list(module.named_children()):
        if not isinstance(child, torch.nn.Linear):
            _quantize_linears(child, quantize, compute, device)
            continue
        bias = child.bias is not None
        q: torch.nn.Module
        # Built on the meta device: bitsandbytes' constructors otherwise draw a full fp32 weight on the CPU that
        # the line after replaces (a 70B base drew 280 GB of them, minutes of a device call's ten)
        if quantize == "int8":
            with torch.device("meta"):
                q = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=bias, has_fp16_weights=False,
                                        threshold=6.0)
            q.weight = bnb.nn.Int8Params(child.weight.data.cpu(), requires_grad=False, has_fp16_weights=False)
        else:
            with torch.device("meta"):
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=bias, compute_dtype=compute,
                                      compress_statistics=True, quant_type=quantize)
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                         quant_type=quantize, blocksize=64)
        if bias:
            q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
        setattr(module, name, q.to(device))  # bitsandbytes quantizes on the way to the device
        del child


def _materialize(model: torch.nn.Module, device: torch.device, compute: torch.dtype) -> None:
    """What the meta build left: embeddings and the LM head N(0, 0.02), norms 1, the rotary tables rebuilt."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            t = torch.empty(p.shape, dtype=compute, device=device)
            t.fill_(1.0) if "norm" in type(module).__name__.lower() else t.normal_(0.0, 0.02)
            module._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None:
        with device:
            # torch's stub types a module's attribute Tensor | Module
            model.model.rotary_emb = type(rotary)(config=model.config)  # type: ignore[union-attr]  # torch stub
