"""What one optimizer step of a job computes and keeps, as plain data: the planner's view of a job spec, the
defaults of the settings it reads, and the one rule that decides every "auto" of a spec for a node.

Plain Python (no pydantic, no torch): the planner runs where neither is installed (the benchmark's parent
process on the GPU box). The job spec (``horizon_ray.jobspec``) takes its defaults for these settings from
here and derives the view in one place (``JobSpec.workload``, ``LoraSpec.adapters``); ``planner.plan``
builds it from its keywords. ``resolve`` is what the job runner (``EngineConfig.from_spec``), the planner
and the coordinator's placement call to turn "auto" into a device, a dtype and an offload decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from horizon_ray.engine.model import (
    DTYPE_BYTES,
    LORA_TARGETS,
    QUANTIZE,
    UPDATES,
    default_lora_targets,
    quantize_for,
)
from horizon_ray.errors import BadInput


@dataclass(frozen=True)
class Resolved:
    """The engine settings of a job with every "auto" decided for one node."""

    device: str  # "cuda", "cuda:N" or "cpu"
    compute_dtype: str  # "float32" | "bfloat16"
    offload_checkpoints: bool  # activation checkpoints wait in pinned host memory (CUDA only)

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"


def resolve(*, gpu: bool, device: str = "auto", compute_dtype: str = "auto", precision: str = "exact",
            offload_checkpoints: bool | str = "auto") -> Resolved:
    """The one rule for "auto". `gpu`: the node has a GPU (the runner asks torch, the planner and the
    coordinator the node's GPU count).

    device auto: cuda on a node with a GPU, else cpu. compute_dtype auto: bfloat16 on cuda, and with any
    precision but exact (its weights are bf16, so is its arithmetic), else float32. offload_checkpoints auto:
    on cuda; on the cpu there is no device memory to spare, so never.
    """
    head, _, index = device.partition(":")
    if device not in ("auto", "cpu", "cuda") and not (head == "cuda" and index.isdigit()):
        raise BadInput(f"engine.device is {device!r}; use one of auto, cpu, cuda, cuda:N", field="engine.device")
    if device == "auto":
        device = "cuda" if gpu else "cpu"
    cuda = device != "cpu"
    if compute_dtype == "auto":
        compute_dtype = "bfloat16" if cuda or precision != "exact" else "float32"
    offload = cuda if offload_checkpoints == "auto" else bool(offload_checkpoints) and cuda
    return Resolved(device=device, compute_dtype=compute_dtype, offload_checkpoints=offload)


# engine.layer_chunk_tokens: auto, the row groups a job's layers run in: on CUDA the largest of these that the
# plan fits in the GPU's memory (larger groups make larger GEMMs: on the H200 qwen3-4b ran 0.9-2.4 % faster and
# olmoe-1b-7b 8.4 % faster at 16,384 tokens than at 8,192)
LAYER_CHUNK_CHOICES = (16_384, 8_192, 4_096, 2_048, 1_024)
DEFAULT_LAYER_CHUNK_TOKENS = 8_192  # auto where no plan decides it: the CPU, an engine built without the planner

# Row groups of at least this many tokens run q, k, v and gate, up as their own GEMMs under
# ``engine.fuse_projections: auto`` (on CUDA). On the H200 (qwen3-4b, delayed, 65,536 tokens a step) split GEMMs
# ran 1.4 % faster than fused at 16,384-token row groups, where they get the kernels cuBLAS picks for HF's shapes,
# and alike at 8,192; below that, fused keeps the larger GEMM.
SPLIT_PROJECTIONS_FROM_TOKENS = 16_384


def fuse_projections_for(setting: bool | str, *, cuda: bool, group_tokens: int) -> bool:
    """engine.fuse_projections decided: a bool stays; "auto" fuses unless a CUDA row group (``group_tokens``,
    ``Workload.group_tokens``) reaches SPLIT_PROJECTIONS_FROM_TOKENS."""
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise BadInput(f"engine.fuse_projections is {setting!r}; use auto, true or false",
                       field="engine.fuse_projections")
    return not (cuda and group_tokens >= SPLIT_PROJECTIONS_FROM_TOKENS)


@dataclass(frozen=True)
class Adapters:
    """LoRA as a plan counts it: the job spec's lora section (``LoraSpec``), whose defaults these are."""

    r: int = 8  # rank of every adapter
    # projections of every layer that get an adapter; empty: the family's (model.default_lora_targets),
    # resolved by for_shape where the model is known
    targets: tuple[str, ...] = ()
    modules_to_save: tuple[str, ...] = ()  # norms trained beside the adapters (PEFT's names)
    quantize: str = "none"  # how the frozen base's projections are kept (model.QUANTIZE): nf4 ~0.52 B/param

    # The section's keys that change no byte and no FLOP of a plan.
    IGNORED_KEYS = ("alpha", "dropout", "merge")

    @classmethod
    def of(cls, lora: Any) -> Adapters:
        """From Adapters, None (the defaults), the spec's LoraSpec, or the section as plain data, where a
        command line may give targets and modules_to_save as one comma-separated string."""
        if lora is None or isinstance(lora, cls):
            return lora or cls()
        if hasattr(lora, "adapters"):  # the job spec's LoraSpec
            return lora.adapters()
        if not isinstance(lora, dict):
            raise BadInput(f"lora must be a mapping like {{'r': 8, 'targets': ['q_proj', 'v_proj']}}, not "
                           f"{type(lora).__name__}")
        unknown = sorted(set(lora) - {"r", "targets", "modules_to_save", "quantize", *cls.IGNORED_KEYS})
        if unknown:
            raise BadInput(f"lora keys {unknown} are not known; give r, targets, modules_to_save, quantize "
                           f"({', '.join(cls.IGNORED_KEYS)} change nothing a plan counts)")
        d = cls()
        return cls(r=lora.get("r", d.r), targets=_names(lora.get("targets", d.targets)),
                   modules_to_save=_names(lora.get("modules_to_save", d.modules_to_save)),
                   quantize=lora.get("quantize", d.quantize))

    def for_shape(self, shape) -> Adapters:
        """These adapters on `shape` (a ModelShape or ModelConfig): the family's default targets where none are
        named, so that one default serves Phi's fused projections as well as Llama's; a pre-quantized
        checkpoint's quantize (model.quantize_for)."""
        return replace(self, targets=self.targets or default_lora_targets(shape),
                       quantize=quantize_for(shape.hf, self.quantize))

    def check(self) -> None:
        """Refuse what no model can take (the targets a family lacks are refused at its plan). The one place of
        these rules: the spec's LoraSpec and the engine's LoraConfig call it."""
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise BadInput(f"lora.r must be an integer >= 1 (e.g. 8), got {self.r!r}", field="lora.r")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad:
            raise BadInput(f"lora.targets {bad} are not valid; choose one or more of {', '.join(LORA_TARGETS)}",
                           field="lora.targets")
        if len(set(self.targets)) != len(self.targets):
            raise BadInput(f"lora.targets {list(self.targets)} names a projection twice; list each once",
                           field="lora.targets")
        if not all(isinstance(m, str) and m for m in self.modules_to_save):
            raise BadInput(f"lora.modules_to_save {list(self.modules_to_save)} holds an entry that is not a module "
                           "name; name norms: norm (every norm), input_layernorm, post_attention_layernorm or "
                           "model.norm", field="lora.modules_to_save")
        if self.quantize not in QUANTIZE:
            raise BadInput(f"lora.quantize is {self.quantize!r}; use one of {', '.join(QUANTIZE)} (nf4: QLoRA's "
                           "4-bit base)", field="lora.quantize")


def check_lora_scaling(alpha: Any, dropout: Any) -> None:
    """The rules of what an adapter scales its input and output by (the spec's and the engine's LoRA)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (alpha > 0 and math.isfinite(alpha)):
        raise BadInput(f"lora.alpha is {alpha!r}; set it > 0 (e.g. 16; the adapters' scaling is alpha / r)",
                       field="lora.alpha")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise BadInput(f"lora.dropout is {dropout!r}; set it in [0, 1) (e.g. 0.05, or 0 for none)",
                       field="lora.dropout")


def _names(value: Any) -> tuple[str, ...]:
    """A list of names, or one comma-separated string of them."""
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return tuple(value)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step of a job computes and keeps. The defaults are the job spec's."""

    seq_len: int = 512  # tokens per sequence (training.seq_len)
    micro_batch_size: int = 4  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    packed: bool = True  # packed rows: an attention mask per micro-batch (training.packing)
    checkpoint_every: int = 1  # K: one layer input kept every K layers (engine.activation_checkpoint_every)
    loss_chunk_tokens: int = 1024  # tokens per chunk of LM head + cross-entropy
    # micro-batches run through a layer in row groups of at most this many tokens; "auto" until planned for a node
    # (``resolved`` on the CPU, the planner on CUDA: LAYER_CHUNK_CHOICES)
    layer_chunk_tokens: int | Literal["auto"] = "auto"
    device: str = "auto"  # engine.device; "cuda" or "cpu" once resolved
    compute_dtype: str = "auto"  # engine.compute_dtype; "float32" or "bfloat16" once resolved
    offload_checkpoints: bool | Literal["auto"] = "auto"  # checkpoints wait in pinned host memory; a bool once resolved
    update: str = "exact"  # training.update: when the host AdamW runs
    gpus: int = 1  # resources.gpus: ranks of the job on one node, each with grad_accum micro-batches a step

    _POSITIVE = ("seq_len", "micro_batch_size", "grad_accum", "checkpoint_every", "loss_chunk_tokens",
                 "layer_chunk_tokens", "gpus")

    def __post_init__(self) -> None:
        for name in self._POSITIVE:
            value = getattr(self, name)
            if name == "layer_chunk_tokens" and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInput(f"{name} must be an integer >= 1, got {value!r}", field=name)
        if self.compute_dtype not in ("auto", *DTYPE_BYTES):
            raise BadInput(f"compute_dtype must be one of auto, {', '.join(DTYPE_BYTES)}; got "
                           f"{self.compute_dtype!r}", field="engine.compute_dtype")
        if self.offload_checkpoints not in ("auto", True, False):
            raise BadInput(f"offload_checkpoints must be auto, true or false; got {self.offload_checkpoints!r}",
                           field="engine.offload_checkpoints")
        if self.update not in UPDATES:
            raise BadInput(f"update must be one of {', '.join(UPDATES)}; got {self.update!r}",
                           field="training.update")

    def resolved(self, *, gpu: bool, precision: str = "exact") -> Workload:
        """This workload on a node that has a GPU (`gpu`) or not, by `resolve`'s rule; device is "cuda" or
        "cpu" (the GPU index is the node agent's choice, not the plan's). layer_chunk_tokens auto is decided
        here for the CPU; on CUDA it stays for the planner, which knows the GPU's memory."""
        r = resolve(gpu=gpu, device=self.device, compute_dtype=self.compute_dtype, precision=precision,
                    offload_checkpoints=self.offload_checkpoints)
        chunk = self.layer_chunk_tokens
        if chunk == "auto" and not r.cuda:
            chunk = DEFAULT_LAYER_CHUNK_TOKENS
        return replace(self, device="cuda" if r.cuda else "cpu", compute_dtype=r.compute_dtype,
                       offload_checkpoints=r.offload_checkpoints, layer_chunk_tokens=chunk)

    def layer_chunk_choices(self) -> list[Workload]:
        """This workload at each of the row groups layer_chunk_tokens auto may take on CUDA
        (LAYER_CHUNK_CHOICES), largest first, one per distinct row group (a micro-batch smaller than a choice
        makes its group no larger)."""
        out: list[Workload] = []
        for chunk in LAYER_CHUNK_CHOICES:
            job = replace(self, layer_chunk_tokens=chunk)
            if not out or job.rows_per_group != out[-1].rows_per_group:
                out.append(job)
        return out

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one rank's share of a step (the whole step with one GPU)."""
        return self.seq_len * self.micro_batch_size * self.grad_accum

    @property
    def step_tokens(self) -> int:
        """Tokens of the whole optimizer step, every rank's."""
        return self.tokens_per_step * self.gpus

    @property
    def rows_per_group(self) -> int:
        if self.layer_chunk_tokens == "auto":
            raise ValueError("layer_chunk_tokens auto has no row groups until planned for a node")
        return min(self.micro_batch_size, max(1, self.layer_chunk_tokens // self.seq_len))

    @property
    def group_tokens(self) -> int:
        """Tokens of one row group: what one layer call processes at once."""
        return self.rows_per_group * self.seq_len

    def row_groups(self) -> list[int]:
        """Rows of each row group of the step (every micro-batch split at layer_chunk_tokens)."""
        r, mb = self.rows_per_group, self.micro_batch_size
        return [min(r, mb - lo) for lo in range(0, mb, r)] * self.grad_accum

