"""Engine configuration: one dataclass, validated once when the engine is built."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from horizon_ray.engine.hyper import ADAMW
from horizon_ray.engine.lora import LoraConfig
from horizon_ray.engine.model import DTYPE_BYTES, KERNELS, PRECISIONS, UPDATES
from horizon_ray.errors import BadInput
from horizon_ray.workload import DEFAULT_LAYER_CHUNK_TOKENS, fuse_projections_for

DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}


@dataclass
class EngineConfig:
    # AdamW hyper-parameters, with torch.optim.AdamW's meaning (defaults: the job spec's, hyper.py).
    lr: float = ADAMW.lr
    betas: tuple[float, float] = ADAMW.betas
    eps: float = ADAMW.eps
    weight_decay: float = ADAMW.weight_decay
    # Global-norm clipping with torch.nn.utils.clip_grad_norm_'s semantics; None or <= 0 disables it.
    max_grad_norm: float | None = ADAMW.max_grad_norm
    # Keep the input of every K-th layer; the backward recomputes the rest of each block of K layers.
    checkpoint_every: int = 1
    # "cpu", "cuda", "cuda:N" or "auto" (cuda when available).
    device: str = "cpu"
    # Dtype of the layer template's arithmetic and of the weights streamed to the device.
    compute_dtype: str = "float32"
    # "exact": fp32 master weights and fp32 AdamW moments (torch.optim.AdamW semantics).
    # "bf16-state": bf16 master and moments, half the host RAM, updates below bf16 resolution are lost.
    precision: str = "exact"
    # Keep activation checkpoints in pinned host memory instead of device memory ("auto": on CUDA).
    offload_checkpoints: bool | str = "auto"
    # Micro-batches are split into row groups of at most this many tokens for the layer template, which
    # bounds the device workspace (MLP intermediates) without changing the step's math.
    layer_chunk_tokens: int = 8192
    # Full fine-tuning runs q, k, v (and gate, up) as one GEMM over their adjacent rows when True, each
    # projection as its own GEMM when False (LoRA always does: it adapts them one by one). The same math;
    # cuBLAS picks its kernels by shape, so the faster choice depends on the widths and the row groups.
    fuse_projections: bool = True
    # Tokens per chunk of the LM-head + cross-entropy, so full logits [tokens x vocab] never exist.
    loss_chunk_tokens: int = 1024
    # Dtype of the tensors written by save_pretrained and save_merged; None: float32, but the compute dtype for
    # a quantized base's merged model (its dequantized base holds no more: fp32 would double the files).
    save_dtype: str | None = None
    # save_pretrained writes shards of at most this many bytes (plus an index) above it.
    max_shard_bytes: int = 5 * 2**30
    # Seed of random initialisation (Engine.from_config).
    seed: int = 0
    # CPU threads of the optimizer (0: all cores but two on CUDA, which keep the training thread's kernel
    # launches prompt; torch's default on the CPU).
    optimizer_threads: int = 0
    # LoRA on the frozen, streamed base (see lora.py): only the adapters train; None: full fine-tuning.
    lora: LoraConfig | None = None
    # The layer template's kernels: "torch" ops everywhere, "liger" (Liger-Kernel's fused Triton kernels, CUDA
    # only), or "auto": liger on CUDA when the package is installed, torch otherwise (kernels.py).
    kernels: str = "auto"
    # When the host AdamW of a step runs (optimizer.py): "exact" after the step's global norm is known,
    # overlapping the next forward; "speculative" each unit as soon as its gradient is on the host, assuming
    # no clipping, rolled back and redone when clipping triggers (exact whenever it does not); "delayed"
    # overlapping all of the next step, which then trains on weights one update old (not exact).
    update: str = "exact"
    # Speculative: how many units (head first, then layers from the top) may be updated during the backward;
    # None: all but the embedding. Each costs a bf16 gradient buffer of its own (2 bytes a parameter).
    speculate_units: int | None = None

    def validate(self) -> None:
        if not self.lr > 0:
            raise BadInput(f"lr must be > 0, got {self.lr}")
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise BadInput(f"betas must lie in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise BadInput(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise BadInput(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.checkpoint_every < 1:
            raise BadInput(
                f"checkpoint_every must be >= 1 (1 keeps every layer's input), got {self.checkpoint_every}")
        if self.compute_dtype not in DTYPES:
            raise BadInput(f"compute_dtype must be one of {sorted(DTYPES)}, got {self.compute_dtype!r}")
        if self.save_dtype is not None and self.save_dtype not in DTYPES:
            raise BadInput(f"save_dtype must be one of {sorted(DTYPES)}, got {self.save_dtype!r}")
        if self.precision not in PRECISIONS:
            raise BadInput(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision == "bf16-state" and self.compute_dtype != "bfloat16":
            raise BadInput("precision 'bf16-state' needs compute_dtype='bfloat16'")
        if self.offload_checkpoints not in (True, False, "auto"):
            raise BadInput(f"offload_checkpoints must be true, false or 'auto', got {self.offload_checkpoints!r}")
        if self.layer_chunk_tokens < 1:
            raise BadInput(f"layer_chunk_tokens must be >= 1, got {self.layer_chunk_tokens}")
        if not isinstance(self.fuse_projections, bool):
            raise BadInput(f"fuse_projections must be true or false, got {self.fuse_projections!r}")
        if self.loss_chunk_tokens < 1:
            raise BadInput(f"loss_chunk_tokens must be >= 1, got {self.loss_chunk_tokens}")
        if self.max_shard_bytes < 1:
            raise BadInput(f"max_shard_bytes must be >= 1, got {self.max_shard_bytes}")
        if self.lora is not None:
            if not isinstance(self.lora, LoraConfig):
                raise BadInput("lora must be a horizon_ray.engine.LoraConfig or None, got "
                               f"{type(self.lora).__name__}")
            self.lora.validate()
            if self.precision != "exact":
                raise BadInput(f"precision {self.precision!r} applies to full fine-tuning; with lora the base is "
                               "frozen in the compute dtype and the adapters are always exact fp32: leave "
                               "precision='exact'")
        if self.kernels not in KERNELS:
            raise BadInput(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.update not in UPDATES:
            raise BadInput(f"update must be one of {UPDATES} (exact keeps torch.optim.AdamW's step order), got "
                           f"{self.update!r}")
        if self.speculate_units is not None and (isinstance(self.speculate_units, bool) or self.speculate_units < 0):
            raise BadInput(f"speculate_units must be an integer >= 0 or None, got {self.speculate_units!r}")
        if self.lora is not None and self.update != "exact":
            raise BadInput(f"update {self.update!r} hides the host update of full fine-tuning; with lora the "
                           "adapters' update takes milliseconds: leave update='exact'")
        resolve_device(self.device)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.compute_dtype]

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-state" else torch.float32

    @property
    def clipping(self) -> bool:
        return self.max_grad_norm is not None and self.max_grad_norm > 0

    @classmethod
    def from_spec(cls, spec, *, device: str | None = None, layer_chunk_tokens: int | None = None) -> EngineConfig:
        """The engine a job spec (``horizon_ray.jobspec.JobSpec``) asks for on this machine: every "auto"
        decided by ``JobSpec.resolve`` (the rule the planner plans with), `device` (default: the spec's
        engine.device) included. engine.layer_chunk_tokens auto is `layer_chunk_tokens`, the plan's choice for
        this node's GPU (job.runner asks the planner), else DEFAULT_LAYER_CHUNK_TOKENS. The learning rate is the
        spec's peak; a schedule sets it before each step."""
        t, e = spec.training, spec.engine
        chunk = e.layer_chunk_tokens if e.layer_chunk_tokens != "auto" else (
            layer_chunk_tokens or DEFAULT_LAYER_CHUNK_TOKENS)
        workload = replace(spec.workload(), layer_chunk_tokens=chunk)
        r = spec.resolve(gpu=torch.cuda.is_available(), device=device)
        if r.cuda and not torch.cuda.is_available():
            # before any rank starts: torch without CUDA fails deep inside (torch._C has no _cuda_setDevice)
            raise BadInput(f"engine.device {device or e.device} needs CUDA, and torch {torch.__version__} here sees no "
                           "CUDA GPU (a CPU build, no driver, or a simulated node that declares GPUs it lacks); set "
                           "engine.device to cpu (or auto, which runs on the CPU here)", field="engine.device")
        if r.cuda and spec.resources.gpus > torch.cuda.device_count():
            raise BadInput(f"resources.gpus {spec.resources.gpus} needs as many GPUs; torch sees "
                           f"{torch.cuda.device_count()} here; ask for at most that many", field="resources.gpus")
        lora = spec.lora if spec.method == "lora" else None
        return cls(
            lr=t.lr, betas=(t.betas[0], t.betas[1]), eps=t.eps, weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm, checkpoint_every=e.activation_checkpoint_every, device=r.device,
            compute_dtype=r.compute_dtype, precision=e.precision, offload_checkpoints=r.offload_checkpoints,
            layer_chunk_tokens=chunk, loss_chunk_tokens=e.loss_chunk_tokens, seed=t.seed,
            fuse_projections=fuse_projections_for(e.fuse_projections, cuda=r.cuda, group_tokens=workload.group_tokens),
            kernels=t.kernels, update=t.update,
            lora=None if lora is None else LoraConfig(r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                                                      targets=tuple(lora.targets),
                                                      modules_to_save=tuple(lora.modules_to_save),
                                                      quantize=lora.quantize),
        )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise BadInput(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {name!r}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BadInput(f"device {name!r} asked for but CUDA is not available here; use device='cpu' or 'auto'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise BadInput(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {name!r}")
    return dev
