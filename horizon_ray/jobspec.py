"""The fine-tuning job spec: one dataclass tree, loaded strictly from YAML (CLI) or a dict (REST API).

Every default lives in the dataclasses below. Loading is strict: an unknown key is an error that names the
key, the valid keys and the closest match; an impossible value is an error that names the fix. The spec is
JSON-friendly both ways (``to_dict()`` / ``from_dict()``), so the REST API accepts the same schema as JSON.

Paths are kept as written (``~`` is expanded) and are checked for existence by the job runner on the node
that runs the job, not here: the machine that validates a spec need not see the node's disks.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DATA_FORMATS = ("auto", "alpaca", "messages", "text")
# Spec keys that hold paths: the only strings in which a leading ~ means the home directory.
PATH_KEYS = ("model.path", "model.tokenizer_path", "data.path", "data.eval_path", "output_dir")
METHODS = ("full", "lora")
SCHEDULES = ("constant", "linear", "cosine")
DEVICES = ("auto", "cpu", "cuda")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
PRECISIONS = ("exact", "bf16-state")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ModelSpec:
    path: str = ""  # HF model directory: config.json + *.safetensors (required)
    tokenizer_path: str | None = None  # directory with tokenizer.json; None: the model directory


@dataclass
class DataSpec:
    path: str = ""  # training data, JSONL (required)
    format: str = "auto"  # alpaca | messages | text | auto (detected from the first record)
    eval_fraction: float = 0.05  # share of `path` held out for eval when eval_path is not given; 0: no eval
    eval_path: str | None = None  # separate eval file in the same format; overrides eval_fraction


@dataclass
class ScheduleSpec:
    type: str = "cosine"  # constant | linear | cosine (linear and cosine decay after the warmup)
    warmup_steps: int = 0  # steps of linear warmup from ~0 to training.lr
    min_lr_ratio: float = 0.0  # lr at the end of the decay, as a fraction of training.lr


@dataclass
class TrainingSpec:
    seq_len: int = 512  # tokens per sequence (packed rows or padded examples)
    micro_batch_size: int = 4  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    epochs: float | None = None  # passes over the training split; with max_steps, whichever ends first
    max_steps: int | None = None  # optimizer steps; one of epochs / max_steps is required
    lr: float = 2e-5  # peak learning rate
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    max_grad_norm: float | None = 1.0  # global-norm clipping; null: no clipping
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    seed: int = 0  # data order and shuffling; the whole run is a function of it
    packing: bool = True  # pack several examples per row (no cross-attention between them)


@dataclass
class EvalSpec:
    every_steps: int = 0  # evaluate every N optimizer steps; 0: only before the first and after the last
    max_batches: int | None = None  # cap on eval micro-batches per evaluation; null: the whole eval split


@dataclass
class CheckpointSpec:
    every_steps: int = 0  # job checkpoint (resumable training state) every N steps; 0: none
    keep: int = 2  # newest complete checkpoints kept on disk


@dataclass
class EngineSpec:
    device: str = "auto"  # auto (cuda when present, else cpu) | cpu | cuda | cuda:N
    compute_dtype: str = "auto"  # auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16
    precision: str = "exact"  # exact: fp32 master + fp32 AdamW moments | bf16-state: half the host RAM
    activation_checkpoint_every: int = 1  # keep one layer input every K layers (recomputed in backward)
    loss_chunk_tokens: int = 1024  # tokens per chunk of the LM head + cross-entropy


@dataclass
class LoraSpec:
    r: int = 8  # rank of every adapter
    alpha: float = 16.0  # scaling of the adapters' output is alpha / r
    dropout: float = 0.0  # dropout on each adapter's input while training
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])  # projections that get an adapter
    # norms trained beside the adapters, by PEFT's modules_to_save names: "norm" (every norm),
    # "input_layernorm", "post_attention_layernorm", "model.norm" (the final one)
    modules_to_save: list[str] = field(default_factory=list)
    merge: bool = False  # also write the merged full model (W + alpha/r x B A, HF format) to final/merged


@dataclass
class JobSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    method: str = "full"  # full: every weight trains | lora: adapters on the frozen base (see lora)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    lora: LoraSpec | None = None  # method lora only; absent: LoraSpec's defaults
    output_dir: str = ""  # metrics.jsonl, checkpoints/, final/ go here (required)
    name: str | None = None  # free-form label shown in logs

    # ---- loading -------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any) -> JobSpec:
        """Build and validate a spec from plain data (parsed YAML or JSON). Strict: unknown keys fail."""
        spec = _build(cls, data, prefix="")
        if spec.method == "lora" and spec.lora is None:
            spec.lora = LoraSpec()
        spec.validate()
        return spec

    @classmethod
    def check_shape(cls, data: Any) -> None:
        """The strict parse of from_dict without its validation: every section a mapping, every key known,
        every value of its type. For a spec that another side completes (the coordinator names output_dir)."""
        _build(cls, data, prefix="")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
        """Load a YAML file, apply ``key.sub=value`` overrides (values parsed as YAML), validate."""
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"job spec {str(p)!r} does not exist; pass the path of a YAML job spec")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{p}: not valid YAML ({exc}); fix the syntax") from None
        if data is None:
            data = {}
        data = apply_overrides(data, overrides)
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def training_hash(self) -> str:
        """Hash of everything that determines the trained weights; a checkpoint only resumes the same job.

        Leaves out what may legitimately change between an interrupted run and its resume: the name, the
        output directory, eval and checkpoint cadence, and the engine's device and memory knobs.
        """
        d = self.to_dict()
        for key in ("name", "output_dir", "eval", "checkpoint", "engine"):
            d.pop(key)
        if d["lora"] is None:
            d.pop("lora")  # full fine-tuning hashes as it did before LoRA existed
        else:
            d["lora"].pop("merge")  # an output option: the trained adapters do not depend on it
            if not d["lora"]["modules_to_save"]:
                d["lora"].pop("modules_to_save")  # LoRA without trained norms hashes as it did before them
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # ---- validation ----------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ValueError naming the fix for the first impossible value."""
        _require(self.model.path, "model.path is required: set it to an HF model directory "
                                  "(config.json + *.safetensors)")
        _require(self.data.path, "data.path is required: set it to a JSONL training file")
        _require(self.output_dir, "output_dir is required: set it to a directory for metrics, "
                                  "checkpoints and the final model")
        _one_of("data.format", self.data.format, DATA_FORMATS)
        _one_of("method", self.method, METHODS)
        if self.method == "lora":
            self._validate_lora()
        elif self.lora is not None:
            raise ValueError("a lora section is given but method is full; set method: lora to train adapters, "
                             "or remove the lora section")
        _one_of("training.schedule.type", self.training.schedule.type, SCHEDULES)
        if not (self.engine.device in DEVICES or _is_cuda_index(self.engine.device)):
            raise ValueError(f"engine.device is {self.engine.device!r}; use one of auto, cpu, cuda, cuda:N")
        _one_of("engine.compute_dtype", self.engine.compute_dtype, COMPUTE_DTYPES)
        _one_of("engine.precision", self.engine.precision, PRECISIONS)
        if self.engine.precision == "bf16-state" and self.engine.compute_dtype == "float32":
            raise ValueError("engine.precision bf16-state computes in bfloat16; set engine.compute_dtype to "
                             "bfloat16 (or auto on a GPU), or use precision exact")

        if not 0.0 <= self.data.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction is {self.data.eval_fraction}; set it in [0, 1) "
                             "(e.g. 0.05), or give data.eval_path")
        if self.data.eval_path and Path(self.data.eval_path).expanduser().resolve() == \
                Path(self.data.path).expanduser().resolve():
            raise ValueError("data.eval_path is the training file itself: its eval loss would measure "
                             "memorisation; give a separate file, or drop eval_path to hold out eval_fraction")
        t = self.training
        if t.seq_len < 8:
            raise ValueError(f"training.seq_len is {t.seq_len}; set it to at least 8 (e.g. 512)")
        _at_least("training.micro_batch_size", t.micro_batch_size, 1)
        _at_least("training.grad_accum", t.grad_accum, 1)
        if t.epochs is None and t.max_steps is None:
            raise ValueError("neither training.epochs nor training.max_steps is set; set one "
                             "(e.g. training.epochs=1 or training.max_steps=1000)")
        if t.epochs is not None and not (t.epochs > 0 and math.isfinite(t.epochs)):
            raise ValueError(f"training.epochs is {t.epochs}; set it > 0 or remove it and set max_steps")
        if t.max_steps is not None:
            _at_least("training.max_steps", t.max_steps, 1)
        if not (t.lr > 0 and math.isfinite(t.lr)):
            raise ValueError(f"training.lr is {t.lr}; set a positive learning rate (e.g. 2e-5)")
        _at_least("training.schedule.warmup_steps", t.schedule.warmup_steps, 0)
        if t.max_steps is not None and t.schedule.warmup_steps >= t.max_steps:
            raise ValueError(f"training.schedule.warmup_steps ({t.schedule.warmup_steps}) must be smaller "
                             f"than training.max_steps ({t.max_steps}); lower the warmup")
        if not 0.0 <= t.schedule.min_lr_ratio <= 1.0:  # NaN fails this too
            raise ValueError(f"training.schedule.min_lr_ratio is {t.schedule.min_lr_ratio}; set it in [0, 1]")
        if not (t.weight_decay >= 0 and math.isfinite(t.weight_decay)):
            raise ValueError(f"training.weight_decay is {t.weight_decay}; set it >= 0 (0 disables it)")
        if len(t.betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in t.betas):
            raise ValueError(f"training.betas is {t.betas}; give two numbers in [0, 1) (e.g. [0.9, 0.999])")
        if not (t.eps > 0 and math.isfinite(t.eps)):
            raise ValueError(f"training.eps is {t.eps}; set a small positive number (e.g. 1e-8)")
        if t.max_grad_norm is not None and not (t.max_grad_norm > 0 and math.isfinite(t.max_grad_norm)):
            raise ValueError(f"training.max_grad_norm is {t.max_grad_norm}; set it > 0, or null for "
                             "no clipping")
        if len(t.betas) != 2 or not all(0.0 <= b < 1.0 for b in t.betas):
            raise ValueError(f"training.betas is {t.betas}; give two numbers in [0, 1), e.g. [0.9, 0.999]")
        if not t.eps > 0:
            raise ValueError(f"training.eps is {t.eps}; set it > 0 (e.g. 1e-8)")
        _at_least("training.seed", t.seed, 0)
        _at_least("eval.every_steps", self.eval.every_steps, 0)
        if self.eval.max_batches is not None:
            _at_least("eval.max_batches", self.eval.max_batches, 1)
        _at_least("checkpoint.every_steps", self.checkpoint.every_steps, 0)
        _at_least("checkpoint.keep", self.checkpoint.keep, 1)
        _at_least("engine.activation_checkpoint_every", self.engine.activation_checkpoint_every, 1)
        _at_least("engine.loss_chunk_tokens", self.engine.loss_chunk_tokens, 1)

    def _validate_lora(self) -> None:
        lo = self.lora if self.lora is not None else LoraSpec()
        _at_least("lora.r", lo.r, 1)
        if not (lo.alpha > 0 and math.isfinite(lo.alpha)):
            raise ValueError(f"lora.alpha is {lo.alpha}; set it > 0 (e.g. 16; the adapters' scaling is alpha / r)")
        if not 0.0 <= lo.dropout < 1.0:
            raise ValueError(f"lora.dropout is {lo.dropout}; set it in [0, 1) (e.g. 0.05, or 0 for none)")
        if not lo.targets:
            raise ValueError(f"lora.targets is empty; list one or more of {', '.join(LORA_TARGETS)}")
        for t in lo.targets:
            _one_of("lora.targets", t, LORA_TARGETS)
        if len(set(lo.targets)) != len(lo.targets):
            raise ValueError(f"lora.targets {lo.targets} names a projection twice; list each once")
        for m in lo.modules_to_save:
            if not isinstance(m, str) or not m:
                raise ValueError(f"lora.modules_to_save entry {m!r} is not a module name; name norms: "
                                 "norm (every norm), input_layernorm, post_attention_layernorm or model.norm")
        if self.engine.precision != "exact":
            raise ValueError(f"engine.precision {self.engine.precision} applies to full fine-tuning; with method "
                             "lora the base is frozen and the adapters are exact fp32: leave precision exact")

    def check_paths(self) -> None:
        """Check, on the node that runs the job, that the inputs exist. Raises ValueError naming the fix."""
        model = Path(self.model.path).expanduser()
        if not (model / "config.json").is_file():
            raise ValueError(f"model.path {str(model)!r} is not an HF model directory (no config.json); "
                             "point it at a directory written by save_pretrained")
        tok = Path(self.model.tokenizer_path or self.model.path).expanduser()
        if not any((tok / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"no tokenizer.json in {str(tok)!r}; set model.tokenizer_path to the directory "
                             "that holds the tokenizer")
        for key, value in (("data.path", self.data.path), ("data.eval_path", self.data.eval_path)):
            if value is not None and not Path(value).expanduser().exists():
                raise ValueError(f"{key} {value!r} does not exist; point it at a JSONL file (or a folder "
                                 "of them)")


# ---- overrides ---------------------------------------------------------------------------------------


def apply_overrides(data: Any, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to nested plain data; values are parsed as YAML (``null``, lists)."""
    if not isinstance(data, dict):
        raise ValueError(f"a job spec must be a mapping at the top level, not {type(data).__name__}")
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value; write e.g. training.lr=1e-4")
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
                raise ValueError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return data


# ---- strict building ---------------------------------------------------------------------------------


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the job spec"
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of keys to values, not {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            raise ValueError(_unknown_key_message(str(key), prefix, names))
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        assert len(args) == 1, tp
        return _coerce(args[0], value, key)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, f"{key}.")
    if value is None:
        raise ValueError(f"{key} cannot be null; give a value or remove the key to use the default")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list, e.g. [0.9, 0.999]; got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key} must be true or false; got {value!r}")
    if tp is int:
        number = _number(value)
        if number is not None and float(number).is_integer():
            return int(number)
        raise ValueError(f"{key} must be an integer; got {value!r}")
    if tp is float:
        number = _number(value)
        if number is not None:
            return float(number)
        raise ValueError(f"{key} must be a number; got {value!r}")
    if tp is str:
        if isinstance(value, str):
            if key in PATH_KEYS and value.startswith("~"):
                return os.path.expanduser(value)
            return value
        raise ValueError(f"{key} must be a string; got {value!r}")
    raise AssertionError(f"unhandled spec type {tp!r} for {key}")


def _number(value: Any) -> int | float | None:
    # PyYAML reads `1e-4` (no dot) as a string; accept any string that is a plain number.
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _all_keys(cls: type = JobSpec, prefix: str = "") -> dict[str, str]:
    """Every leaf key of the schema: short name -> dotted path (for 'it belongs in ...' hints)."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _section_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            out.update(_all_keys(tp, f"{prefix}{f.name}."))
        else:
            out.setdefault(f.name, f"{prefix}{f.name}")
    return out


def _section_type(tp: Any) -> Any:
    """The dataclass of an optional section (``LoraSpec | None`` -> LoraSpec); other types as they are."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0]
    return tp


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
    "optimizer": "training",
}


def _unknown_key_message(key: str, prefix: str, valid: list[str]) -> str:
    where = f"in {prefix.rstrip('.')}" if prefix else "at the top level"
    msg = f"unknown key {prefix + key!r}"
    # Misspellings of another trainer's name count too ("lerning_rate" -> learning_rate -> lr).
    near_alias = difflib.get_close_matches(key, list(_ALIASES), n=1, cutoff=0.8)
    alias = _ALIASES.get(key) or (_ALIASES[near_alias[0]] if near_alias else None)
    elsewhere = _all_keys().get(key) or _all_keys().get(alias or "")
    if alias in valid:
        close = [alias]
    elif _all_keys().get(key):  # the exact name of a key in another section: say where it goes
        close = []
    else:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        msg += f"; did you mean {prefix + close[0]!r}?"
    elif elsewhere:
        msg += f"; it belongs at {elsewhere!r}"
    return msg + f" (valid keys {where}: {', '.join(valid)})"


def _require(value: str, message: str) -> None:
    if not value:
        raise ValueError(message)


def _one_of(key: str, value: str, allowed: tuple[str, ...], hint: str = "") -> None:
    if value not in allowed:
        close = difflib.get_close_matches(value, allowed, n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        extra = f"; {hint}" if hint else ""
        raise ValueError(f"{key} is {value!r}{guess}; use one of {', '.join(allowed)}{extra}")


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{key} is {value}; set it to {low} or more")


def _is_cuda_index(device: str) -> bool:
    head, _, idx = device.partition(":")
    return head == "cuda" and idx.isdigit()
