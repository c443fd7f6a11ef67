"""The fine-tuning job spec: one tree of pydantic models that the job runner, the planner and the API consume.

Every default lives in the models below, and their JSON schema is what the API documents. Loading is
strict: an unknown key is an error that names the key, the valid keys and the closest match; a value of the
wrong type or an impossible value is an error that names the fix (``BadInput``, with ``field``). Numbers that
YAML reads as strings (``1e-4``) are numbers.

Two steps, so that a spec another side completes can be checked early: ``JobSpec.parse`` (shape: keys,
types, ranges of integers) and ``JobSpec.check`` (what makes a job: required paths, values that cannot
train); ``JobSpec.from_dict`` does both. Paths are kept as written and checked for existence by the job
runner on the node that runs the job (``check_paths``), not here: the machine that validates a spec need
not see the node's disks. ``~`` means the home directory only in specs read from files on this machine
(``from_dict`` / ``from_yaml``), never in a spec that came over HTTP.

The settings the planner reads take their defaults from ``horizon_ray.workload``, whose plain view of a
job the planner plans (``JobSpec.workload``), and whose ``resolve`` decides every "auto" of a spec for a node
for the runner (``JobSpec.resolve``, ``EngineConfig.from_spec``), the planner and placement alike.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictStr,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from horizon_ray.engine.hyper import ADAMW
from horizon_ray.engine.model import DTYPE_BYTES, KERNELS, LORA_TARGETS, PRECISIONS, QUANTIZE, UPDATES, quantize_for
from horizon_ray.engine.objective import LOSSES as DPO_LOSSES
from horizon_ray.engine.objective import OBJECTIVES, DpoConfig
from horizon_ray.errors import BadInput
from horizon_ray.home import HOME_VARIABLE, horizon_home
from horizon_ray.strings import MAX_PATH_BYTES, OUTPUT_ROOM_BYTES, fix, problem, shown
from horizon_ray.workload import Adapters, Resolved, Workload, check_lora_scaling, resolve

_W, _A = Workload, Adapters  # the defaults of what the planner reads

METHODS = ("full", "lora")
# Bounds on what a spec may ask for, so that every job ends: a step count or an epoch count past these is a
# typo or an attack (`max_steps: 1e30` runs forever, `epochs: 1e308` overflows the step count), not a job. A
# tenant's own caps (the tenants file: max_steps_per_job, max_tokens_per_job) may be lower.
MAX_STEPS = 100_000_000  # optimizer steps of one job: years of any real run
MAX_EPOCHS = 100_000  # passes over the training split
MAX_INT = 2**63 - 1  # any integer of a spec: what the job table and every reader hold exactly
DATA_FORMATS = ("auto", "alpaca", "messages", "sharegpt", "text", "preference")
SCHEDULES = ("constant", "linear", "cosine")
COMPUTE_DTYPES = ("auto", *DTYPE_BYTES)


# ---- value types -------------------------------------------------------------------------------------


def _number(value: Any) -> Any:
    # PyYAML reads `1e-4` (no dot) as a string; any string that is a plain number is that number.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _integer(value: Any) -> Any:
    value = _number(value)
    value = int(value) if isinstance(value, float) and value.is_integer() else value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise PydanticCustomError("number_too_large", "{value} is too large; give a number below 2**63",
                                  {"value": shown(value, 40)})
    return value


def _float(value: Any) -> Any:
    value = _number(value)
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # 10**400: JSON holds it, a float does not
            raise PydanticCustomError("number_too_large", "{value} is too large for a floating-point number; "
                                      "give a finite number", {"value": shown(value, 40)}) from None
    return value


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise PydanticCustomError("number_not_finite", "{value} is not a finite number; give a finite one",
                                  {"value": str(value)})
    return value


def expand_path(value: str) -> str:
    """A path as a spec file on this machine may write it: a leading ``~`` is the home directory, a leading
    ``$HORIZON_RAY_HOME`` (or ``${HORIZON_RAY_HOME}``) is ``horizon_home()``, set or not."""
    for var in (f"${{{HOME_VARIABLE}}}", f"${HOME_VARIABLE}"):
        if value == var or value.startswith(var + "/"):
            return str(horizon_home()) + value[len(var):]
    return os.path.expanduser(value) if value.startswith("~") else value


def _expand_user(value: str, info: ValidationInfo) -> str:
    # A spec read from a file on this machine may write ~ or $HORIZON_RAY_HOME; one that came over HTTP may not
    # (the API refuses it: the server's home is nobody's business).
    if info.context and info.context.get("expand_user"):
        return expand_path(value)
    return value


def _safe_text(value: str) -> str:
    # Every string of a spec is checked where it comes in (horizon_ray.strings): a lone surrogate or a control
    # character stored in a job would break every later read of it.
    bad = problem(value)
    if bad:
        raise PydanticCustomError("unsafe_string", "{problem}; {fix}", {"problem": bad, "fix": fix(bad)})
    return value


def _safe_template(value: str) -> str:
    # A Jinja chat template spans lines and is longer than a label; any other control character is refused.
    bad = problem(value.replace("\n", " ").replace("\t", " "), max_bytes=64 << 10)
    if bad:
        raise PydanticCustomError("unsafe_string", "{problem}; {fix}", {"problem": bad, "fix": fix(bad)})
    return value


def _safe_path(value: str) -> str:
    bad = problem(value, max_bytes=MAX_PATH_BYTES, path=True)
    if bad:
        raise PydanticCustomError("unsafe_string", "{problem}; {fix}", {"problem": bad, "fix": fix(bad)})
    return value


Int = Annotated[int, BeforeValidator(_integer), Strict()]
Float = Annotated[float, BeforeValidator(_float), Strict(), AfterValidator(_finite)]
Text = Annotated[StrictStr, AfterValidator(_safe_text)]
PathStr = Annotated[StrictStr, AfterValidator(_safe_path), AfterValidator(_expand_user)]
ChatRole = Literal["system", "user", "assistant"]
TemplateText = Annotated[StrictStr, AfterValidator(_safe_template)]
if typing.TYPE_CHECKING:
    # the option tables are tuples, and mypy cannot read a Literal built from one: to it these are strings
    Method = str
    Objective = str
    DpoLoss = str
    DataFormat = str
    Schedule = str
    ComputeDtype = str
    Precision = str
    Update = str
    Kernels = str
    Projection = str
    Quantize = str
else:
    Method = Literal[METHODS]
    Objective = Literal[OBJECTIVES]
    DpoLoss = Literal[DPO_LOSSES]
    DataFormat = Literal[DATA_FORMATS]
    Schedule = Literal[SCHEDULES]
    ComputeDtype = Literal[COMPUTE_DTYPES]
    Precision = Literal[PRECISIONS]
    Update = Literal[UPDATES]
    Kernels = Literal[KERNELS]
    # every family's LoRA targets (Phi-3's fused ones, the experts'); a model's plan checks that it has them
    Projection = Literal[tuple(LORA_TARGETS)]
    Quantize = Literal[QUANTIZE]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- the spec ----------------------------------------------------------------------------------------


class ModelSpec(_Section):
    path: PathStr = Field("", description=(
        "the base model: an HF model directory (config.json + *.safetensors); over the API a catalogue name, or a "
        "directory relative to (or inside) a model root. Required"))
    tokenizer_path: PathStr | None = Field(None, description=(
        "directory with tokenizer.json, like path; null: the model directory"))


class DataColumns(_Section):
    messages: Text | None = Field(None, description="messages / sharegpt: the list of turns")
    role: Text | None = Field(None, description="messages / sharegpt: a turn's role")
    content: Text | None = Field(None, description="messages / sharegpt: a turn's text")
    weight: Text | None = Field(None, description="messages / sharegpt: a turn's weight (0: not trained)")
    system: Text | None = Field(None, description="alpaca / sharegpt: a system prompt beside the turns")
    instruction: Text | None = Field(None, description="alpaca: the instruction")
    input: Text | None = Field(None, description="alpaca: the input after the instruction")
    output: Text | None = Field(None, description="alpaca: the answer")
    text: Text | None = Field(None, description="text: the document")


class DataSpec(_Section):
    path: PathStr = Field("", description=(
        "training data, JSONL (a file or a folder of them); over the API an uploaded file id (file-...), or a file "
        "relative to (or inside) a data root. Required"))
    format: DataFormat = Field("auto", description=(
        "alpaca | messages | sharegpt | text | preference (objective dpo) | auto (detected from the first record); "
        "JSONL or a .json array"))
    eval_fraction: Float = Field(0.05, description=(
        "share of path held out for eval when eval_path is not given; 0: no eval"))
    eval_path: PathStr | None = Field(None, description=(
        "separate eval file in the same format, like path; overrides eval_fraction"))
    columns: DataColumns | None = Field(None, description=(
        "the file's keys for the format's fields (LLaMA-Factory's dataset_info columns, axolotl's field_messages), "
        "e.g. {messages: chat, role: speaker, content: text}"))
    roles: dict[Text, ChatRole] | None = Field(None, description=(
        "the file's role values -> system | user | assistant (sharegpt knows human, gpt, system), e.g. {bot: "
        "assistant}"))
    chat_template: TemplateText | None = Field(None, description=(
        "chat and alpaca data: a template name (chatml, llama3) or a Jinja chat template; default: the "
        "tokenizer's own"))
    train_on_inputs: StrictBool = Field(False, description=(
        "chat and alpaca data: train on every token (prompts too), not only the assistant turns"))


class ScheduleSpec(_Section):
    type: Schedule = Field("cosine", description=(
        "constant | linear | cosine (linear and cosine decay after the warmup)"))
    warmup_steps: Int = Field(0, ge=0, description="steps of linear warmup from ~0 to training.lr")
    min_lr_ratio: Float = Field(0.0, description="lr at the end of the decay, as a fraction of training.lr")


class TrainingSpec(_Section):
    seq_len: Int = Field(_W.seq_len, ge=1, description="tokens per sequence (packed rows or padded examples)")
    micro_batch_size: Int = Field(_W.micro_batch_size, ge=1, description="sequences per micro-batch")
    grad_accum: Int = Field(_W.grad_accum, ge=1, description="micro-batches per optimizer step")
    epochs: Float | None = Field(None, le=MAX_EPOCHS, description=(
        "passes over the training split; with max_steps, whichever ends first"))
    max_steps: Int | None = Field(None, ge=1, le=MAX_STEPS, description=(
        "optimizer steps; one of epochs / max_steps is required"))
    lr: Float = Field(ADAMW.lr, description="peak learning rate")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    weight_decay: Float = Field(ADAMW.weight_decay, description="decoupled (AdamW) weight decay")
    max_grad_norm: Float | None = Field(ADAMW.max_grad_norm, description="global-norm clipping; null: no clipping")
    betas: list[Float] = Field(default_factory=lambda: list(ADAMW.betas), description="AdamW betas")
    eps: Float = Field(ADAMW.eps, description="AdamW epsilon")
    seed: Int = Field(0, ge=0, description="data order and shuffling; the whole run is a function of it")
    packing: StrictBool = Field(_W.packed, description=(
        "pack several examples per row (no cross-attention between them)"))
    update: Update = Field(_W.update, description=(
        "when the host AdamW of step n runs: exact (once the step's global grad norm is known, overlapping step "
        "n+1's forward); delayed (overlapping all of step n+1's GPU work, so step n+1 trains on the weights after "
        "step n-1: NOT exact); speculative (each unit as soon as its gradient is final, assuming clipping will not "
        "trigger; redone when it did: exact whenever clipping is inactive)"))
    kernels: Kernels = Field("auto", description=(
        "the layer template's kernels: torch, liger (Liger-Kernel's fused ops, CUDA only) or auto (liger on CUDA "
        "when installed, torch elsewhere)"))


# How evaluation by generation scores an answer against the held-out reference (both stripped of surrounding
# whitespace): the same text, or the reference found inside the answer.
GENERATE_METRICS = ("exact_match", "contains")
if typing.TYPE_CHECKING:
    GenerateMetric = str  # as the option tables above
else:
    GenerateMetric = Literal[GENERATE_METRICS]


class EvalGenerateSpec(_Section):
    max_tokens: Int = Field(32, ge=1, le=4096, description="new tokens per held-out prompt at most (greedy)")
    metric: GenerateMetric = Field("exact_match", description=(
        "exact_match (the answer is the reference) or contains (the reference occurs in the answer)"))
    max_prompts: Int = Field(64, ge=1, description="held-out examples scored per evaluation, the first ones")
    batch_size: Int = Field(16, ge=1, description="prompts generated together")


class EvalSpec(_Section):
    every_steps: Int = Field(0, ge=0, description=(
        "evaluate every N optimizer steps; 0: only before the first and after the last"))
    max_batches: Int | None = Field(None, ge=1, description=(
        "cap on eval micro-batches per evaluation; null: the whole eval split"))
    generate: EvalGenerateSpec | None = Field(None, description=(
        "also answer held-out prompts by greedy generation at each eval and log the share answered right "
        "(the prompt: an example's tokens before its first trained token; the reference: its trained tokens)"))


class CheckpointSpec(_Section):
    every_steps: Int = Field(0, ge=0, description="job checkpoint (resumable training state) every N steps; 0: none")
    keep: Int = Field(2, ge=1, description="newest complete checkpoints kept on disk")


class EngineSpec(_Section):
    device: Text = Field(_W.device, description=(
        "auto (cuda when the node has a GPU, else cpu) | cpu | cuda | cuda:N"))
    compute_dtype: ComputeDtype = Field(_W.compute_dtype, description=(
        "auto (bfloat16 on cuda or with precision bf16-state, else float32) | float32 | bfloat16"))
    precision: Precision = Field("exact", description=(
        "exact: fp32 master + fp32 AdamW moments | bf16-state: half the host RAM, updates below bf16 resolution "
        "are lost"))
    activation_checkpoint_every: Int = Field(_W.checkpoint_every, ge=1, description=(
        "keep one layer input every K layers (recomputed in backward)"))
    loss_chunk_tokens: Int = Field(_W.loss_chunk_tokens, ge=1, description=(
        "tokens per chunk of the LM head + cross-entropy"))
    layer_chunk_tokens: Literal["auto"] | Annotated[Int, Field(ge=1)] = Field(_W.layer_chunk_tokens, description=(
        "micro-batches run through a layer in row groups of at most this many tokens (bounds the GPU workspace, "
        "not the math); auto: on cuda the largest of 16,384, 8,192, 4,096, 2,048 and 1,024 that the plan fits in "
        "the GPU's memory (larger groups make larger GEMMs), 8,192 on the cpu"))
    offload_checkpoints: Literal["auto"] | StrictBool = Field(_W.offload_checkpoints, description=(
        "keep activation checkpoints in pinned host memory instead of GPU memory; auto: on cuda (on the cpu there "
        "is nothing to offload)"))
    fuse_projections: Literal["auto"] | StrictBool = Field("auto", description=(
        "full fine-tuning runs q, k, v and gate, up as one GEMM each (true) or every projection as its own "
        "(false): the same math, other GEMM shapes; auto: false on cuda where a row group holds 16,384 tokens or "
        "more (there split GEMMs ran faster on the H200), true elsewhere (docs/engine.md)"))


class ResourcesSpec(_Section):
    gpus: Int = Field(1, ge=1, description=(
        "GPUs of one node the job uses, one rank each over one host copy of the model; each rank runs "
        "training.grad_accum micro-batches a step, so a step has gpus x grad_accum of them (on a CPU node: that "
        "many ranks)"))


class LoraSpec(_Section):
    r: Int = Field(_A.r, ge=1, description="rank of every adapter")
    alpha: Float = Field(16.0, description="the adapters' output is scaled by alpha / r")
    dropout: Float = Field(0.0, description="dropout on each adapter's input while training")
    targets: list[Projection] = Field(default_factory=lambda: list(_A.targets), description=(
        "projections of every layer that get an adapter; empty (the default): the family's, PEFT's defaults "
        "(q_proj and v_proj; qkv_proj where the checkpoint fuses them, as Phi-3's does)"))
    modules_to_save: list[Text] = Field(default_factory=lambda: list(_A.modules_to_save), description=(
        "norms trained beside the adapters, by PEFT's modules_to_save names: norm (every norm), input_layernorm, "
        "post_attention_layernorm, model.norm (the final one)"))
    merge: StrictBool = Field(False, description=(
        "also write the merged full model (W + alpha/r x B A, HF format) to final/merged"))
    quantize: Quantize = Field(_A.quantize, description=(
        "how the frozen base's projections are kept in host RAM and streamed: none (the compute dtype), nf4 or "
        "fp4 (bitsandbytes' 4-bit with double-quantized scales, QLoRA: ~0.52 bytes a parameter), int8 "
        "(LLM.int8's rows, ~1 byte); the adapters train in fp32 either way"))

    def adapters(self) -> Adapters:
        """What a plan counts of this section."""
        return Adapters(r=self.r, targets=tuple(self.targets), modules_to_save=tuple(self.modules_to_save),
                        quantize=self.quantize)

    def check(self) -> None:
        """Raise BadInput naming the fix for the first value that cannot train adapters."""
        check_lora_scaling(self.alpha, self.dropout)
        self.adapters().check()


class DpoSpec(_Section):
    beta: Float = Field(0.1, description=(
        "strength of the pull towards the reference (the model before training); IPO: its regulariser tau"))
    loss: DpoLoss = Field("sigmoid", description=(
        "sigmoid: DPO (TRL's sigmoid) | ipo: IPO, each row's log-ratio divided by its completion length (TRL's ipo) "
        "| robust: robust DPO for noisy preference labels (TRL's robust)"))
    label_smoothing: Float = Field(0.0, description=(
        "in [0, 0.5): with loss sigmoid, conservative DPO's label smoothing; with robust, the probability that a "
        "pair's preference is flipped (TRL's label_smoothing); ipo: none"))
    sft_weight: Float = Field(0.0, description=(
        "adds this weight x the chosen completions' mean token NLL to the loss (RPO); 0: none"))

    def config(self) -> DpoConfig:
        """The engine's settings of this section."""
        return DpoConfig(beta=self.beta, loss=self.loss, label_smoothing=self.label_smoothing,
                         sft_weight=self.sft_weight)


class WandbSpec(_Section):
    project: Text = Field(description="the Weights & Biases project the run logs to")
    entity: Text | None = Field(None, description="team or user; null: the logged-in default")
    name: Text | None = Field(None, description="the run's name; null: the job's name or id")
    tags: list[Text] = Field(default_factory=list, description="tags of the run")


def _tracking_server(uri: str | None) -> str | None:
    """An MLflow tracking URI a tenant may name: a server's http(s) URL. A local store (file:, sqlite:, a path)
    would be written by the engine on the node, outside the job's output directory."""
    if uri is not None and not uri.lower().startswith(("http://", "https://")):
        raise PydanticCustomError(
            "tracking_uri", "{uri!r} is not an MLflow tracking server's http(s):// URL: a local store (file:, "
            "sqlite:, a path) would be written on the node outside the job's output directory; name the server, "
            "or leave tracking_uri null for a store in the job's output directory (./mlruns)", {"uri": uri})
    return uri


class MlflowSpec(_Section):
    experiment: Text = Field("horizon-ray", description="the MLflow experiment the run logs to")
    tracking_uri: Annotated[Text | None, AfterValidator(_tracking_server)] = Field(None, description=(
        "the tracking server, an http(s):// URL; null: MLFLOW_TRACKING_URI of the node, else ./mlruns in the "
        "job's output directory"))
    run_name: Text | None = Field(None, description="the run's name; null: the job's name or id")


class IntegrationsSpec(_Section):
    """Where the job's metrics go besides metrics.jsonl. A named tracker whose package is not installed on the
    node is skipped with a warning in the job's log (training does not depend on it)."""

    tensorboard: StrictBool = Field(True, description="TensorBoard event files in <output_dir>/tensorboard/")
    wandb: WandbSpec | None = Field(None, description="log to Weights & Biases (needs the wandb package)")
    mlflow: MlflowSpec | None = Field(None, description="log to MLflow (needs the mlflow package)")


class JobSpec(_Section):
    """A fine-tuning job: the YAML file `horizon-ray finetune` reads, and the body of POST /finetune."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    method: Method = Field("full", description=(
        "full: every weight trains | lora: adapters on the frozen base (see lora)"))
    objective: Objective = Field("sft", description=(
        "sft: next-token loss on the completions | dpo: preference pairs (prompt, chosen, rejected) against the "
        "starting model's log-probabilities (see dpo)"))
    dpo: DpoSpec | None = Field(None, description="objective dpo only; absent: the defaults")
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    lora: LoraSpec | None = Field(None, description="method lora only; absent: the defaults")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    integrations: IntegrationsSpec = Field(default_factory=IntegrationsSpec)
    output_dir: PathStr = Field("", description=(
        "metrics.jsonl, checkpoints/, final/ go here. Required in a file; over the API optional, relative to your "
        "output namespace (default: one directory per job)"))
    name: Text | None = Field(None, description="free-form label shown in logs (plain text, at most 1024 bytes)")

    @model_validator(mode="after")
    def _lora_defaults(self) -> JobSpec:
        if self.method == "lora" and self.lora is None:
            self.lora = LoraSpec()
        if self.objective == "dpo":
            self.dpo = self.dpo or DpoSpec()
            if "packing" not in self.training.model_fields_set:
                self.training.packing = False  # a completion's log-probability is the sum over its own row
        return self

    # ---- loading -------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any) -> JobSpec:
        """Build and check a spec from plain data (parsed YAML or JSON) read on this machine."""
        spec = cls.parse(data, expand_user=True)
        spec.check()
        return spec

    @classmethod
    def parse(cls, data: Any, *, expand_user: bool = False) -> JobSpec:
        """The strict parse of from_dict without its check: every section a mapping, every key known, every
        value of its type. For a spec another side completes (the coordinator names output_dir)."""
        return parse(cls, data, context={"expand_user": expand_user})

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
        """Load a YAML file, apply ``key.sub=value`` overrides (values parsed as YAML), check."""
        return cls.from_dict(read_yaml(path, overrides))

    def with_checkpoint_settings(self) -> JobSpec:
        """This spec with what its checkpoint decides written in, where this machine sees the model directory:
        a pre-quantized base's lora.quantize (model.quantize_for: the checkpoint's own, or a refusal naming the
        conflict), so that the job's record, and everything that shows it, says what trains."""
        path = Path(self.model.path).expanduser()
        config = path / "config.json"
        # an absolute path only: a relative one means the directory the job runs in, not this process's
        if self.method != "lora" or self.lora is None or not path.is_absolute() or not config.is_file():
            return self
        from horizon_ray.planner.shapes import load_model_shape

        quantize = quantize_for(load_model_shape(config.parent).hf, self.lora.quantize)
        if quantize == self.lora.quantize:
            return self
        return self.model_copy(update={"lora": self.lora.model_copy(update={"quantize": quantize})})

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def training_hash(self) -> str:
        """Hash of everything that determines the trained weights; a checkpoint only resumes the same job.

        Leaves out what may legitimately change between an interrupted run and its resume: the name, the
        output directory, eval and checkpoint cadence, the engine's device and memory knobs, the kernels
        (they agree to roundoff) and where metrics are logged (integrations). Settings added later hash as
        before at their defaults, so that an older checkpoint still resumes.
        """
        d = self.to_dict()
        for key in ("name", "output_dir", "eval", "checkpoint", "engine", "integrations"):
            d.pop(key)
        if d["resources"]["gpus"] == 1:
            d.pop("resources")  # one GPU hashes as it did before several existed
        d["training"].pop("kernels")
        if d["training"]["update"] == "exact":
            d["training"].pop("update")
        for key, default in (("columns", None), ("roles", None), ("chat_template", None), ("train_on_inputs", False)):
            if d["data"][key] == default:
                d["data"].pop(key)  # data read as before these existed hashes as before
        if d["objective"] == "sft":
            d.pop("objective")  # SFT hashes as it did before preference objectives existed
            d.pop("dpo")
        if d["lora"] is None:
            d.pop("lora")  # full fine-tuning hashes as it did before LoRA existed
        else:
            d["lora"].pop("merge")  # an output option: the trained adapters do not depend on it
            if not d["lora"]["modules_to_save"]:
                d["lora"].pop("modules_to_save")  # LoRA without trained norms hashes as it did before them
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def resolve(self, *, gpu: bool, device: str | None = None) -> Resolved:
        """This spec's "auto" settings decided for a node that has a GPU (`gpu`) or not; `device` overrides
        engine.device."""
        e = self.engine
        return resolve(gpu=gpu, device=device or e.device, compute_dtype=e.compute_dtype,
                       precision=e.precision, offload_checkpoints=e.offload_checkpoints)

    def workload(self) -> Workload:
        """The planner's view of this spec ("auto" still to resolve for a node: ``Workload.resolved``)."""
        t, e = self.training, self.engine
        return Workload(seq_len=t.seq_len, micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                        packed=t.packing, checkpoint_every=e.activation_checkpoint_every,
                        loss_chunk_tokens=e.loss_chunk_tokens, layer_chunk_tokens=e.layer_chunk_tokens,
                        device=e.device, compute_dtype=e.compute_dtype, offload_checkpoints=e.offload_checkpoints,
                        update=t.update, gpus=self.resources.gpus)

    # ---- checks --------------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise BadInput naming the fix for the first value that cannot make a job."""
        _require(self.model.path, "model.path", "model.path is required: set it to an HF model directory "
                                                "(config.json + *.safetensors)")
        _require(self.data.path, "data.path", "data.path is required: set it to a JSONL training file")
        _require(self.output_dir, "output_dir", "output_dir is required: set it to a directory for metrics, "
                                                "checkpoints and the final model")
        room = MAX_PATH_BYTES - OUTPUT_ROOM_BYTES
        if len(self.output_dir.encode("utf-8")) > room:
            raise BadInput(f"output_dir is {len(self.output_dir.encode('utf-8'))} bytes long; the files a job writes "
                           f"inside it need it at {room} bytes or fewer: choose a shorter path", field="output_dir")
        if self.method == "lora":
            self._check_lora()
        elif self.lora is not None:
            raise BadInput("a lora section is given but method is full; set method: lora to train adapters, or "
                           "remove the lora section", field="lora")
        if self.objective == "dpo":
            self._check_dpo()
        elif self.dpo is not None:
            raise BadInput("a dpo section is given but objective is sft; set objective: dpo to train on preference "
                           "pairs, or remove the dpo section", field="dpo")
        e = self.engine
        self.resolve(gpu=False)  # refuses a device that is none of auto, cpu, cuda, cuda:N
        if self.resources.gpus > 1 and self.training.update == "speculative":
            raise BadInput("training.update speculative needs the gradient norm after every unit, which several "
                           "ranks would have to all-reduce unit by unit; with resources.gpus > 1 use exact or "
                           "delayed", field="training.update")
        if self.resources.gpus > 1 and e.device.startswith("cuda:"):
            raise BadInput(f"engine.device {e.device} names one GPU but resources.gpus is {self.resources.gpus}; "
                           "set engine.device to cuda (or auto): rank r takes the r-th GPU given to the job",
                           field="engine.device")
        if e.precision == "bf16-state" and e.compute_dtype == "float32":
            raise BadInput("engine.precision bf16-state computes in bfloat16; set engine.compute_dtype to "
                           "bfloat16 (or auto), or use precision exact", field="engine.compute_dtype")

        d = self.data
        # the objective and the data's format name each other: a mismatch would fail on the node, after the queue
        if self.objective == "dpo" and d.format not in ("auto", "preference"):
            raise BadInput(f"objective dpo trains on preference pairs but data.format is {d.format!r}; give a file of "
                           "{\"prompt\", \"chosen\", \"rejected\"} pairs with data.format preference (or auto), or "
                           "set objective: sft", field="data.format")
        if self.objective == "sft" and d.format == "preference":
            raise BadInput("data.format is preference but objective is sft, which trains on demonstrations; set "
                           "objective: dpo to train on the pairs, or give SFT data", field="data.format")
        if not 0.0 <= d.eval_fraction < 1.0:
            raise BadInput(f"data.eval_fraction is {d.eval_fraction}; set it in [0, 1) (e.g. 0.05), or give "
                           "data.eval_path", field="data.eval_fraction")
        if d.eval_path and Path(d.eval_path).expanduser().resolve() == Path(d.path).expanduser().resolve():
            raise BadInput("data.eval_path is the training file itself: its eval loss would measure "
                           "memorisation; give a separate file, or drop eval_path to hold out eval_fraction",
                           field="data.eval_path")
        t = self.training
        if t.seq_len < 8:
            raise BadInput(f"training.seq_len is {t.seq_len}; set it to at least 8 (e.g. 512)",
                           field="training.seq_len")
        if t.epochs is None and t.max_steps is None:
            raise BadInput("neither training.epochs nor training.max_steps is set; set one "
                           "(e.g. training.epochs=1 or training.max_steps=1000)", field="training.max_steps")
        if t.epochs is not None and not (t.epochs > 0 and math.isfinite(t.epochs)):
            raise BadInput(f"training.epochs is {t.epochs}; set it > 0 or remove it and set max_steps",
                           field="training.epochs")
        if not (t.lr > 0 and math.isfinite(t.lr)):
            raise BadInput(f"training.lr is {t.lr}; set a positive learning rate (e.g. 2e-5)", field="training.lr")
        if not 0.0 <= t.schedule.min_lr_ratio <= 1.0:  # NaN fails this too
            raise BadInput(f"training.schedule.min_lr_ratio is {t.schedule.min_lr_ratio}; set it in [0, 1]",
                           field="training.schedule.min_lr_ratio")
        if not (t.weight_decay >= 0 and math.isfinite(t.weight_decay)):
            raise BadInput(f"training.weight_decay is {t.weight_decay}; set it >= 0 (0 disables it)",
                           field="training.weight_decay")
        if len(t.betas) != 2 or not all(0.0 <= b < 1.0 for b in t.betas):
            raise BadInput(f"training.betas is {t.betas}; give two numbers in [0, 1) (e.g. [0.9, 0.999])",
                           field="training.betas")
        if not (t.eps > 0 and math.isfinite(t.eps)):
            raise BadInput(f"training.eps is {t.eps}; set a small positive number (e.g. 1e-8)",
                           field="training.eps")
        if t.max_grad_norm is not None and not (t.max_grad_norm > 0 and math.isfinite(t.max_grad_norm)):
            raise BadInput(f"training.max_grad_norm is {t.max_grad_norm}; set it > 0, or null for no clipping",
                           field="training.max_grad_norm")

    def _check_dpo(self) -> None:
        assert self.dpo is not None, "_lora_defaults gives objective dpo its section"
        self.dpo.config().validate()
        if self.training.micro_batch_size % 2:
            raise BadInput(f"training.micro_batch_size is {self.training.micro_batch_size}; with objective dpo it "
                           "counts rows, and a pair's chosen and rejected are two rows of one micro-batch: set an "
                           "even number (2 x the pairs a micro-batch holds)", field="training.micro_batch_size")
        if self.training.packing:
            raise BadInput("training.packing packs examples into rows; objective dpo keeps each completion in a row "
                           "of its own (its log-probability is that row's sum): set training.packing false",
                           field="training.packing")
        # settings of SFT data that preference pairs have no use for: refused, not ignored without a word
        d = self.data
        for key, given, why in (
                ("data.columns", d.columns is not None, "pairs are read by their own keys (prompt, chosen, rejected, "
                                                        "or OpenAI's input, preferred_output, non_preferred_output)"),
                ("data.roles", d.roles is not None, "a pair's messages take the roles system, user and assistant"),
                ("data.train_on_inputs", d.train_on_inputs, "DPO scores the completions only, never the prompt"),
                ("eval.generate", self.eval.generate is not None,
                 "a DPO eval reports the held-out reward accuracy and margin instead")):
            if given:
                raise BadInput(f"{key} applies to SFT data, and objective dpo has no use for it: {why}; remove "
                               f"{key}", field=key)

    def _check_lora(self) -> None:
        assert self.lora is not None, "_lora_defaults gives method lora its section"
        self.lora.check()
        if self.engine.precision != "exact":
            raise BadInput(f"engine.precision {self.engine.precision} applies to full fine-tuning; with method "
                           "lora the base is frozen and the adapters are exact fp32: leave precision exact",
                           field="engine.precision")
        if self.training.update != "exact":
            raise BadInput(f"training.update {self.training.update} hides the host update of full fine-tuning; with "
                           "method lora the adapters' update takes milliseconds: leave update exact",
                           field="training.update")

    def check_paths(self) -> None:
        """Check, on the node that runs the job, that the inputs exist. Raises BadInput naming the fix."""
        model = Path(self.model.path).expanduser()
        if not (model / "config.json").is_file():
            raise BadInput(f"model.path {str(model)!r} is not an HF model directory (no config.json); point it "
                           "at a directory written by save_pretrained", field="model.path")
        tok = Path(self.model.tokenizer_path or self.model.path).expanduser()
        if not any((tok / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise BadInput(f"no tokenizer.json in {str(tok)!r}; set model.tokenizer_path to the directory that "
                           "holds the tokenizer", field="model.tokenizer_path")
        for key, value in (("data.path", self.data.path), ("data.eval_path", self.data.eval_path)):
            if value is not None and not Path(value).expanduser().exists():
                raise BadInput(f"{key} {value!r} does not exist; point it at a JSONL file (or a folder of them)",
                               field=key)


# ---- parsing and its errors --------------------------------------------------------------------------


def parse(cls: type[BaseModel], data: Any, *, prefix: str = "", context: dict | None = None) -> Any:
    """`cls` (JobSpec or one of its sections, whose keys are `prefix` + name) validated from plain data;
    BadInput naming the field and the fix otherwise."""
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the job spec"
        raise BadInput(f"{where} must be a mapping of keys to values, not {type(data).__name__}",
                       field=prefix.rstrip(".") or None)
    try:
        return cls.model_validate(data, context=context)
    except ValidationError as exc:
        raise spec_error(exc.errors()[0], cls, prefix) from None


def spec_error(err: Mapping[str, Any], root: type[BaseModel] = JobSpec, prefix: str = "") -> BadInput:
    """The BadInput for one pydantic error of `root` (the API turns request-body errors into the same)."""
    loc, kind, value = tuple(err.get("loc", ())), err.get("type", ""), err.get("input")
    if kind == "extra_forbidden":
        where = _walk(root, loc[:-1])
        section_prefix = prefix + (f"{where.key}." if where.key else "")
        return BadInput(_unknown_key_message(str(loc[-1]), section_prefix, list(where.model.model_fields), root),
                        field=section_prefix + str(loc[-1]))
    where = _walk(root, loc)
    key = prefix + where.key
    if kind == "literal_error":
        kinds = _other_kinds(where.annotation)  # a number or "auto": the number is as valid as the names
        if kinds:
            names = ", ".join(str(a) for a in _literal_values(where.annotation))
            return BadInput(f"{key} is {shown(value)}; give {' or '.join(kinds)}, or {names}", field=key)
        return BadInput(_one_of_message(key, value, _literal_values(where.annotation)), field=key)
    if kind == "unsafe_string":
        return BadInput(f"{key} {err.get('msg')}", field=key)
    if kind == "greater_than_equal":
        return BadInput(f"{key} is {value}; set it to {err['ctx']['ge']} or more", field=key)
    if value is None and kind != "missing":
        return BadInput(f"{key} cannot be null; give a value or remove the key to use the default", field=key)
    expected = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
                "string_type": "a string", "list_type": "a list"}.get(kind)
    if expected:
        return BadInput(f"{key} must be {expected}; got {shown(value)}", field=key)
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return BadInput(f"{key} must be a mapping of keys to values, not {type(value).__name__}", field=key)
    return BadInput(f"{key}: {err.get('msg', 'invalid value')}", field=key or None)


@dataclass
class _Place:
    model: type[BaseModel]  # the section that holds the field (or the section itself for an empty loc)
    key: str  # dotted key, list indices as [i]
    annotation: Any  # the field's type


def _walk(root: type[BaseModel], loc: tuple) -> _Place:
    """Follow a pydantic error location through the spec's sections (skipping union member tags)."""
    place = _Place(root, "", root)
    for part in loc:
        if isinstance(part, int):
            place.key += f"[{part}]"
            continue
        field = place.model.model_fields.get(str(part)) if isinstance(place.model, type) else None
        if field is None:
            continue  # a tag pydantic adds for a member of a union
        place.key += ("." if place.key else "") + str(part)
        place.annotation = field.annotation
        section = _section_type(field.annotation)
        if section is not None:
            place.model = section
    return place


def _section_type(tp: Any) -> type[BaseModel] | None:
    """The section model of a field's type (``LoraSpec | None`` -> LoraSpec), else None."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        found = _section_type(arg)
        if found is not None:
            return found
    return None


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _other_kinds(tp: Any) -> list[str]:
    """What a union of a Literal with plain types (``float | Literal["auto"]``, ``Annotated[int, Field(ge=1)]``)
    takes besides the Literal's values, with the plain type's lower bound."""
    kinds = []
    for arg in typing.get_args(tp):
        meta: tuple = ()
        if typing.get_origin(arg) is Annotated:
            arg, *rest = typing.get_args(arg)
            meta = tuple(rest)
        if arg in _KIND_NAMES:
            low = next((m.ge for m in _constraints(meta) if getattr(m, "ge", None) is not None), None)
            kinds.append(_KIND_NAMES[arg] + (f" of {low} or more" if low is not None else ""))
    return kinds


def _constraints(meta: tuple) -> list:
    """The constraint objects of an Annotated type's metadata, those inside a Field(...) included."""
    out: list = []
    for m in meta:
        out.extend(getattr(m, "metadata", None) or [m])
    return out


def _literal_values(tp: Any) -> tuple:
    """The values a field accepts when they are a fixed set: its Literal's, and true, false for a bool."""
    if tp is bool:
        return ("true", "false")
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return tuple(v for arg in typing.get_args(tp) for v in _literal_values(arg))


def _all_keys(cls: type[BaseModel] = JobSpec, prefix: str = "") -> dict[str, str]:
    """Every leaf key of the schema: short name -> dotted path (for 'it belongs in ...' hints)."""
    out: dict[str, str] = {}
    for name, field in cls.model_fields.items():
        section = _section_type(field.annotation)
        if section is not None:
            out.update(_all_keys(section, f"{prefix}{name}."))
        else:
            out.setdefault(name, f"{prefix}{name}")
    return out


# Names other trainers use, for the did-you-mean hint only (they are not accepted).
_ALIASES = {
    "learning_rate": "lr", "batch_size": "micro_batch_size",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum", "gradient_accumulation": "grad_accum",
    "max_seq_len": "seq_len", "max_seq_length": "seq_len", "seq_length": "seq_len", "max_length": "seq_len",
    "num_epochs": "epochs", "num_train_epochs": "epochs", "steps": "max_steps", "warmup": "warmup_steps",
    "lr_scheduler": "schedule", "lr_scheduler_type": "type", "clip_grad_norm": "max_grad_norm",
    "grad_clip": "max_grad_norm", "save_steps": "every_steps", "eval_steps": "every_steps",
    "save_total_limit": "keep", "output": "output_dir", "model_path": "path", "dataset": "data",
    "optimizer": "training", "rank": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
    "target_modules": "targets",
}


def _unknown_key_message(key: str, prefix: str, valid: list[str], root: type[BaseModel] = JobSpec) -> str:
    where = f"in {prefix.rstrip('.')}" if prefix else "at the top level"
    msg = f"unknown key {prefix + key!r}"
    # Misspellings of another trainer's name count too ("lerning_rate" -> learning_rate -> lr); the aliases are
    # the job spec's, and so are the hints for a key of another section
    aliases = _ALIASES if root is JobSpec else {}
    near_alias = difflib.get_close_matches(key, list(aliases), n=1, cutoff=0.8)
    alias = aliases.get(key) or (aliases[near_alias[0]] if near_alias else None)
    keys = _all_keys(root)
    elsewhere = keys.get(key) or keys.get(alias or "")
    if alias in valid:
        close = [alias]
    elif keys.get(key):  # the exact name of a key in another section: say where it goes
        close = []
    else:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        msg += f"; did you mean {prefix + close[0]!r}?"
    elif elsewhere:
        msg += f"; it belongs at {elsewhere!r}"
    return msg + f" (valid keys {where}: {', '.join(valid)})"


def _one_of_message(key: str, value: Any, allowed: tuple) -> str:
    close = difflib.get_close_matches(value, [str(a) for a in allowed], n=1) if isinstance(value, str) else []
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{key} is {shown(value)}{guess}; use one of {', '.join(str(a) for a in allowed)}"


def _require(value: str, field: str, message: str) -> None:
    if not value:
        raise BadInput(message, field=field)


# ---- files and overrides -----------------------------------------------------------------------------


def read_yaml(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A YAML job spec file as plain data, with ``key.sub=value`` overrides applied; not yet parsed."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise BadInput(f"job spec {str(p)!r} does not exist; pass the path of a YAML job spec")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise BadInput(f"{p}: not valid YAML ({exc}); fix the syntax") from None
    return apply_overrides({} if data is None else data, overrides)


def apply_overrides(data: Any, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to nested plain data; values are parsed as YAML (``null``, lists)."""
    if not isinstance(data, dict):
        raise BadInput(f"a job spec must be a mapping at the top level, not {type(data).__name__}")
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BadInput(f"override {item!r} is not key=value; write e.g. training.lr=1e-4")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise BadInput(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return data
