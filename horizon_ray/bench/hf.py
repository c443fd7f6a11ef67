"""HF transformers pieces the peers share: the model of a shape, Liger-Kernel and PEFT on it, activation
checkpointing, random batches, the step and its measurement. Imported only by the peers' children."""

from __future__ import annotations

import contextlib
import functools
import inspect
import statistics
import time
from collections.abc import Callable
from importlib import metadata

import torch

from horizon_ray.bench.metrics import (
    LIGER,
    Unavailable,
    base_record,
    error_reason,
    host_peak_rss,
    host_rss,
    is_out_of_memory,
    timed_summary,
)
from horizon_ray.bench.runtime import (
    GpuTelemetry,
    device_name,
    free_memory,
    gpu_peaks,
    profile_gemms,
    profile_step,
    sync,
)
from horizon_ray.bench.shapes import hf_config, model_flops_per_token
from horizon_ray.engine.model import EXPERT_TARGETS


def transformers_config(shape):
    """The shape as a transformers config (Qwen2Config / LlamaConfig / MistralConfig), SDPA attention."""
    from transformers import AutoConfig

    cfg = hf_config(shape)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    return AutoConfig.for_model(model_type, use_cache=False, **cfg)


def build_model(shape, dtype: torch.dtype):
    """A random-init causal LM of the shape, built on the current default device (``with torch.device``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(transformers_config(shape), dtype=dtype, attn_implementation="sdpa")


def apply_liger(shape, extra: dict, adapted_experts: bool = False) -> None:
    """Liger-Kernel's kernels for the shape's family (RoPE, RMSNorm, SwiGLU, and the fused linear
    cross-entropy that never materialises the logits), patched into transformers' classes: call it before
    the model is built. Records Liger-Kernel's version (``liger``) and the kernels it patched in
    (``liger_kernels``) in ``extra``. Raises Unavailable when it cannot be imported.

    ``adapted_experts``: PEFT adapts the experts' stacked parameters. Liger's SwiGLU on a MoE family replaces
    transformers' experts module with its own fused MoE; with it the PEFT + Liger peer made no step in 200-500 s
    on qwen3-30b-a3b and mixtral-8x7b (Liger-Kernel 0.8.5: a SIGABRT put it in its routing metadata), so the
    experts stay transformers' own, as PEFT adapts them, and the record says so (``liger_unpatched``)."""
    try:
        import liger_kernel.transformers as liger
    except ImportError as exc:
        raise Unavailable(f"liger_kernel is not importable ({error_reason(exc)}); benchmarks/README.md says how "
                          "to carry its wheel to the GPU box") from exc
    name = f"apply_liger_kernel_to_{shape.arch}"
    apply = getattr(liger, name, None)
    if apply is None:
        raise Unavailable(f"this Liger-Kernel has no {name} for the {shape.arch} family of {shape.name}")
    kwargs = liger_kwargs(apply)
    if adapted_experts and kwargs.get("swiglu"):
        kwargs["swiglu"] = False
        extra["liger_unpatched"] = {"swiglu": "its fused MoE experts replace the experts PEFT adapts, and made no "
                                              "step in 200-500 s (Liger-Kernel 0.8.5)"}
    try:
        apply(**kwargs)
    except Exception as exc:  # a patch that does not fit this transformers' classes: no peer, said why
        raise Unavailable(f"{name}({', '.join(kwargs)}) failed on this transformers: {error_reason(exc)}") from exc
    extra["liger"] = version("liger-kernel")
    extra["liger_kernels"] = sorted(k for k, on in kwargs.items() if on)


# Each Liger kernel a family's patch may take, on: its gated MLP under the family's own name (swiglu for
# SiLU-gated MLPs, geglu for Gemma's GELU-tanh), RoPE, RMSNorm, layer norm, the fused linear cross-entropy
# (which never materialises the logits) in place of the plain one.
LIGER_KERNELS = {"rope": True, "rms_norm": True, "layer_norm": True, "swiglu": True, "geglu": True,
                 "cross_entropy": False, "fused_linear_cross_entropy": True}


def liger_kwargs(apply: Callable) -> dict[str, bool]:
    """The arguments of a family's Liger patch: each of LIGER_KERNELS its signature takes."""
    params = inspect.signature(apply).parameters
    return {k: v for k, v in LIGER_KERNELS.items() if k in params}


def require_peft() -> str:
    """PEFT's version; Unavailable when it cannot be imported (asked before a model is built)."""
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        raise Unavailable(f"peft is not importable ({error_reason(exc)})") from exc
    return version("peft")


def peft_lora(model, rank: int, alpha: float, targets: tuple[str, ...]):
    """The model wrapped by PEFT with LoRA adapters (dropout 0, no bias) on ``targets`` of every layer, the
    base frozen in its dtype and the adapters in fp32; the experts' stacked projections through PEFT's
    target_parameters (as target_modules they match no module, and PEFT would silently adapt only the rest).
    Call it after enabling checkpointing."""
    from peft import LoraConfig, get_peft_model

    # with checkpointing, the embedding's output must require a gradient for the adapters' gradients to flow
    # back through a checkpointed layer whose own weights are all frozen
    model.enable_input_require_grads()
    modules = [t for t in targets if t not in EXPERT_TARGETS]
    stacked = [f"mlp.{t}" for t in targets if t in EXPERT_TARGETS]
    # peft's stub says lora_alpha is an int; its scaling alpha / r takes a float (lora_alpha is 2.0 r)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",  # type: ignore[arg-type]  # peft
                        target_modules=modules, target_parameters=stacked or None, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    # fp32 adapters whatever the base's dtype (PEFT upcasts bf16 adapters by default; this does not rely on it)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def version(dist: str) -> str:
    """The installed version of a distribution, or "unknown"."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def enable_checkpointing(model, every: int) -> int:
    """Activation checkpointing of the decoder layers, non-reentrant (what FSDP2 composes with). Newer
    transformers checkpoint every ``every``-th layer; older ones every layer. Returns the interval used."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        if "every_n_layers" in inspect.signature(enable).parameters:
            enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
            return every
        enable(activation_checkpointing_kwargs=kwargs)
        return 1
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return 1


def random_batches(vocab: int, micro: int, seq: int, accum: int, device: torch.device) -> list[list[torch.Tensor]]:
    """Two steps of random token ids on the device, alternated (labels = inputs: the model shifts them)."""
    g = torch.Generator().manual_seed(0)
    return [[torch.randint(0, vocab, (micro, seq), generator=g).to(device) for _ in range(accum)]
            for _ in range(2)]


def forward_backward(model, micro_batches: list[torch.Tensor], autocast: torch.dtype | None = None) -> torch.Tensor:
    """Gradients of the step's mean loss (every micro-batch has as many tokens, so the mean of their means).
    ``autocast``: run the forward under torch.autocast to this dtype (fp32 adapters on a bf16 base)."""
    total = None
    for ids in micro_batches:
        ctx = torch.autocast(ids.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss / len(micro_batches)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None, "a step has micro-batches"
    return total


def adamw(params) -> torch.optim.Optimizer:
    """torch.optim.AdamW, fused (one kernel over all tensors) where the parameters' device supports it."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, foreach=True)


class FallbackAdamW:
    """A fused AdamW that turns into a foreach one if its first step fails (a fused kernel that a tensor
    subclass, e.g. FSDP2's DTensor, does not support), so the peer still gets measured."""

    def __init__(self, params) -> None:
        self.params = list(params)
        self.opt = adamw(self.params)
        self.fell_back: str | None = None  # why the fused optimizer was replaced
        self.steps = 0

    @property
    def name(self) -> str:
        return "AdamW fused" if self.opt.defaults.get("fused") else "AdamW foreach"

    def step(self) -> None:
        self.steps += 1
        try:
            self.opt.step()
        except (RuntimeError, NotImplementedError) as exc:
            if self.steps > 1 or not self.opt.defaults.get("fused") or is_out_of_memory(exc):
                raise
            self.fell_back = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            self.opt = torch.optim.AdamW(self.params, lr=1e-5, weight_decay=0.01, foreach=True)
            self.opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)


def optimizer_step(params: list[torch.Tensor], opt, max_norm: float = 1.0) -> None:
    """Global-norm clipping, the update, and the gradients freed, as the engine's step does."""
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(system: str, shape, model, opt, args, emit: Callable[[dict], None], *, device: torch.device,
            dtype: str, mode: str, checkpoint_every: int, gpu_budget_bytes: int | None, extra: dict,
            after: Callable[[], dict] | None = None, params: list[torch.Tensor] | None = None,
            autocast: torch.dtype | None = None) -> list[dict]:
    """Warm-up plus timed steps of each accumulation of ``args.accum``; one record each, emitted as it
    lands, then again with the time split of a profiled step (CUDA, ``--profile``).

    A step is timed on the host between device syncs; a sync between the backward and the update splits off
    the update (the optimizer's time: for these systems it never overlaps anything, so all of it is exposed).
    ``after``: more fields, read once the timed steps ran. ``params``: what is clipped and trained (default:
    every parameter); ``autocast``: see forward_backward.
    """
    # what the optimizer updates: counted when only some parameters train, else the shape's count
    trainable = None if params is None else sum(p.numel() for p in params)
    params = list(model.parameters()) if params is None else params
    results = []
    for accum in [int(a) for a in str(args.accum).split(",")]:
        rec = base_record(system, shape, mode=mode, dtype=dtype, device=device.type,
                          device_name=device_name(device), seq=args.seq, micro=args.micro, accum=accum,
                          checkpoint_every=checkpoint_every, gpu_budget_bytes=gpu_budget_bytes,
                          flops_per_token=model_flops_per_token(shape, args.seq), trainable_params=trainable)
        rec.update(extra)
        batches = random_batches(shape.vocab_size, args.micro, args.seq, accum, device)

        def step(mbs) -> float:
            forward_backward(model, mbs, autocast)
            sync(device)
            t = time.perf_counter()
            optimizer_step(params, opt, args.max_grad_norm)
            sync(device)
            return time.perf_counter() - t

        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times, updates = [], []
            telemetry = GpuTelemetry(device)
            try:
                for i in range(args.warmup + args.steps):
                    if i == args.warmup:
                        telemetry.start()  # the timed steps' clock, power and temperature
                    sync(device)
                    t0 = time.perf_counter()
                    updates.append(step(batches[i % 2]))
                    times.append(time.perf_counter() - t0)
            finally:
                telemetry.stop()
            rec.update(timed_summary(times, args.warmup, rec["tokens_per_step"], rec["model_flops_per_token"]))
            rec.update(telemetry.summary())
            upd = round(statistics.median(updates[args.warmup:] or updates), 4)
            rec.update(gpu_peaks(device), exposed_optimizer_s=upd, optimizer_update_s=upd, host_rss_bytes=host_rss(),
                       host_peak_rss_bytes=host_peak_rss())
            if after is not None:
                rec.update(after())
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            rec.update(status="did-not-fit", reason=error_reason(exc), host_peak_rss_bytes=host_peak_rss())
        if rec["status"] != "ok":  # outside the except: its traceback no longer pins the step's tensors
            opt.zero_grad(set_to_none=True)
            free_memory()
        emit(rec)
        results.append(rec)
        if rec["status"] == "ok" and device.type == "cuda" and args.profile:
            out = dict(rec)
            try:
                out.update(profile_step(functools.partial(step, batches[0])))
            except Exception as exc:  # the split is a bonus: a profiler failure must not lose the run
                out["split_error"] = f"{type(exc).__name__}: {exc}"[:300]
            out.update(profile_gemms(functools.partial(step, batches[0])))
            emit(out)
    return results


def prepare_peer(args, shape, dev: str, dtype: str, extra: dict, adapted_experts: bool = False):
    """An in-GPU peer's model on its device: Liger patched in first for the Liger peers, seeded, built,
    checkpointed. Returns (model, device, checkpoint interval, build start time)."""
    if args.system in LIGER:
        apply_liger(shape, extra, adapted_experts)
    device = torch.device(dev)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with device:
        model = build_model(shape, getattr(torch, dtype))
    every = enable_checkpointing(model, args.checkpoint_every)
    return model, device, every, t0
