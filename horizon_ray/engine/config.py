"""Engine configuration: one dataclass, validated once when the engine is built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from horizon_ray.engine.kernels import KERNELS
from horizon_ray.engine.lora import LoraConfig
from horizon_ray.engine.optimizer import UPDATE_MODES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PRECISIONS = ("exact", "bf16-state")


@dataclass
class EngineConfig:
    # AdamW hyper-parameters, with torch.optim.AdamW's meaning.
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # Global-norm clipping with torch.nn.utils.clip_grad_norm_'s semantics; None or <= 0 disables it.
    max_grad_norm: float | None = 1.0
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
    # Tokens per chunk of the LM-head + cross-entropy, so full logits [tokens x vocab] never exist.
    loss_chunk_tokens: int = 1024
    # Dtype of the tensors written by save_pretrained.
    save_dtype: str = "float32"
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
            raise ValueError(f"lr must be > 0, got {self.lr}")
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.checkpoint_every < 1:
            raise ValueError(
                f"checkpoint_every must be >= 1 (1 keeps every layer's input), got {self.checkpoint_every}")
        if self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype must be one of {sorted(DTYPES)}, got {self.compute_dtype!r}")
        if self.save_dtype not in DTYPES:
            raise ValueError(f"save_dtype must be one of {sorted(DTYPES)}, got {self.save_dtype!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision == "bf16-state" and self.compute_dtype != "bfloat16":
            raise ValueError("precision 'bf16-state' needs compute_dtype='bfloat16'")
        if self.offload_checkpoints not in (True, False, "auto"):
            raise ValueError(f"offload_checkpoints must be true, false or 'auto', got {self.offload_checkpoints!r}")
        if self.layer_chunk_tokens < 1:
            raise ValueError(f"layer_chunk_tokens must be >= 1, got {self.layer_chunk_tokens}")
        if self.loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be >= 1, got {self.loss_chunk_tokens}")
        if self.max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {self.max_shard_bytes}")
        if self.lora is not None:
            if not isinstance(self.lora, LoraConfig):
                raise ValueError("lora must be a horizon_ray.engine.LoraConfig or None, got "
                                 f"{type(self.lora).__name__}")
            self.lora.validate()
            if self.precision != "exact":
                raise ValueError(f"precision {self.precision!r} applies to full fine-tuning; with lora the base is "
                                 "frozen in the compute dtype and the adapters are always exact fp32: leave "
                                 "precision='exact'")
        if self.update not in UPDATE_MODES:
            raise ValueError(f"update must be one of {UPDATE_MODES}, got {self.update!r}")
        if self.speculate_units is not None and (isinstance(self.speculate_units, bool) or self.speculate_units < 0):
            raise ValueError(f"speculate_units must be an integer >= 0 or None, got {self.speculate_units!r}")
        if self.lora is not None and self.update != "exact":
            raise ValueError(f"update {self.update!r} hides the host update of full fine-tuning; with lora the "
                             "adapters' update takes milliseconds: leave update='exact'")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {name!r}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for but CUDA is not available here; use device='cpu' or 'auto'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {name!r}")
    return dev
