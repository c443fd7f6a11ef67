"""The job runner's reports, one JSON object a line of ``<output_dir>/metrics.jsonl``: the protocol between
the runner (which writes them), the node agent (which reads the new lines of each job) and the coordinator
(which turns them into progress, checkpoints and the job's event log). Defined once, here, with
``encode`` / ``decode``; the in-process twin of the agent (``cluster.fake``) emits the same objects.

Every event carries ``step`` (optimizer steps done when it happened) and ``time`` (unix seconds). Plain
Python, no torch: the cluster imports it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass(kw_only=True)
class Event:
    TYPE: ClassVar[str]

    step: int  # optimizer steps done when it happened
    time: float = field(default_factory=lambda: round(_time.time(), 3))  # unix seconds

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the line: {"type", "step", "time", the event's fields}; a non-finite float (a
        diverged loss) becomes null, which JSON can hold."""
        return {"type": self.TYPE, **{k: _finite(v) for k, v in dataclasses.asdict(self).items()}}


@dataclass(kw_only=True)
class Start(Event):
    """The run started (or resumed: resumed_from is the checkpoint's step)."""

    TYPE: ClassVar[str] = "start"
    total_steps: int  # optimizer steps of the whole job
    resumed_from: int | None = None  # step of the checkpoint it resumed from
    name: str | None = None  # the spec's name
    device: str = ""  # the engine's device
    compute_dtype: str = ""
    method: str = "full"  # full | lora
    num_params: int = 0  # parameters of the model
    trainable_params: int = 0  # parameters the optimizer updates (the adapters with LoRA)
    train_examples: int = 0  # examples of the data as written: a preference job's pairs
    eval_examples: int = 0
    steps_per_epoch: int = 0
    training_hash: str = ""  # JobSpec.training_hash: which checkpoints this run may resume
    # training.update: exact | speculative (exact while clipping does not trigger; a step that clips is rolled
    # back and redone) | delayed (NOT exact AdamW: every gradient is taken on weights one update old)
    update: str = "exact"
    gpus: int = 1  # resources.gpus: ranks of the job over one host copy of the model


@dataclass(kw_only=True)
class Metrics(Event):
    """One optimizer step done."""

    TYPE: ClassVar[str] = "metrics"
    loss: float | None  # mean loss of the step over its non-ignored tokens
    lr: float | None = None  # the step's learning rate
    grad_norm: float | None = None  # global gradient norm before clipping
    tokens_per_s: float | None = None  # non-padding tokens per second over the latest steps
    host_rss_bytes: int | None = None  # the runner's resident set
    total_steps: int | None = None
    eta_s: float | None = None  # estimated seconds to the end of training
    rollbacks: int | None = None  # update speculative: steps rolled back and redone so far in this run
    tokens_seen: int | None = None  # non-padding tokens trained on from the job's first step through this one
    # objective dpo: TRL's metrics of the step ("rewards/accuracies", "rewards/margins", ..., means over its pairs)
    preference: dict[str, float] | None = None


@dataclass(kw_only=True)
class Eval(Event):
    TYPE: ClassVar[str] = "eval"
    eval_loss: float | None  # mean loss over the eval split's non-ignored tokens
    eval_tokens: int = 0  # tokens it counted
    # evaluation by generation (eval.generate): its metric, the share of held-out prompts answered right by
    # it, and how many were scored; None / 0 when the spec asks for none
    generate_metric: str | None = None
    generate_score: float | None = None
    generate_prompts: int = 0
    # objective dpo: TRL's metrics over the eval pairs (eval_loss is their DPO loss; eval_tokens counts the pairs)
    eval_preference: dict[str, float] | None = None


@dataclass(kw_only=True)
class CheckpointBegin(Event):
    """A checkpoint of this step is being written (a ``Checkpoint``, or the run's end, follows)."""

    TYPE: ClassVar[str] = "checkpoint-begin"


@dataclass(kw_only=True)
class Checkpoint(Event):
    """A checkpoint is complete."""

    TYPE: ClassVar[str] = "checkpoint"
    path: str  # its directory
    pruned: list[int] = field(default_factory=list)  # steps of the checkpoints deleted to keep checkpoint.keep


@dataclass(kw_only=True)
class Done(Event):
    TYPE: ClassVar[str] = "done"
    final_dir: str  # the trained model
    eval_loss: float | None = None  # after the last step
    wall_s: float = 0.0  # seconds this run took (0: it had finished before)


@dataclass(kw_only=True)
class Error(Event):
    """The run stops: bad input (the message names the fix), a signal, or a crash (its traceback is in the
    job's log, not here)."""

    TYPE: ClassVar[str] = "error"
    message: str


EVENTS: dict[str, type[Event]] = {cls.TYPE: cls for cls in (Start, Metrics, Eval, CheckpointBegin, Checkpoint,
                                                             Done, Error)}


def encode(event: Event) -> str:
    """The event as one line of metrics.jsonl (with its newline)."""
    return json.dumps(event.to_dict()) + "\n"


def decode(obj: Any) -> Event | None:
    """The event of one parsed line; None for what is not one (another writer's line, or a type or a field
    this version does not know: skipped, not fatal, so that one odd line never hides the rest)."""
    if not isinstance(obj, dict) or obj.get("type") not in EVENTS:
        return None
    cls = EVENTS[obj["type"]]
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in obj.items() if k in names})
    except TypeError:  # a required field is missing
        return None


def read_events(path: str | os.PathLike) -> list[Event]:
    """Every event of a metrics.jsonl; a torn last line (the writer was killed) is skipped."""
    p = Path(path)
    if not p.exists():
        return []
    events = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            event = decode(json.loads(line))
        except json.JSONDecodeError:
            continue
        if event is not None:
            events.append(event)
    return events


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value
