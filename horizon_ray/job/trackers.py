"""Where a job's metrics go besides metrics.jsonl: TensorBoard event files, Weights & Biases, MLflow.

The spec's ``integrations`` section names them (``IntegrationsSpec``): TensorBoard event files are written to
``<output_dir>/tensorboard/`` unless turned off; W&B and MLflow log when named and their package is installed
on the node. The runner hands every event it writes to metrics.jsonl to ``Trackers.log`` (the metrics file
stays the record; a tracker is a copy): step metrics as scalars (``train/loss``, ``train/lr``,
``train/grad_norm``, ``train/tokens_per_s``, ``train/host_rss_gib``), evals as ``eval/loss``, the resolved spec
as the run's configuration. A tracker that is missing or fails is reported once on stderr (the job's log) and
left out; training never waits for one. A resumed job continues the same W&B run and MLflow run (their ids
are kept in the output directory).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from horizon_ray.job.events import Done, Error, Eval, Event, Metrics, Start

GiB = 2**30


def scalars(event: Event) -> dict[str, float]:
    """The numbers of an event, by the names every tracker logs them under."""
    if isinstance(event, Metrics):
        values = {"train/loss": event.loss, "train/lr": event.lr, "train/grad_norm": event.grad_norm,
                  "train/tokens_per_s": event.tokens_per_s,
                  "train/host_rss_gib": event.host_rss_bytes / GiB if event.host_rss_bytes else None}
        values.update({f"train/{k}": v for k, v in (event.preference or {}).items() if k != "loss"})
    elif isinstance(event, Eval):
        values = {"eval/loss": event.eval_loss}
        if event.generate_metric:  # eval.generate: the share answered right, as eval/exact_match or eval/contains
            values[f"eval/{event.generate_metric}"] = event.generate_score
        values.update({f"eval/{k}": v for k, v in (event.eval_preference or {}).items() if k != "loss"})
    else:
        return {}
    return {k: float(v) for k, v in values.items() if v is not None}


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"training": {"lr": 1e-5}} -> {"training.lr": 1e-5}: a spec as the parameters a tracker keeps."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, out: Path, spec: Any, run_id: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        self.writer.add_text("job/spec", "```\n" + spec.to_yaml() + "```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # the event file is readable while the job runs

    def close(self, ok: bool) -> None:
        self.writer.close()


class _Wandb:
    name = "wandb"

    def __init__(self, out: Path, spec: Any, run_id: str):
        import wandb

        cfg = spec.integrations.wandb
        self.wandb = wandb
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or spec.name or run_id,
                              tags=list(cfg.tags), config=flat(spec.to_dict()), dir=str(out), id=run_id,
                              resume="allow")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class _Mlflow:
    name = "mlflow"
    ID_FILE = "mlflow_run_id"

    def __init__(self, out: Path, spec: Any, run_id: str):
        import mlflow

        cfg = spec.integrations.mlflow
        self.mlflow = mlflow
        if cfg.tracking_uri:
            mlflow.set_tracking_uri(cfg.tracking_uri)
        mlflow.set_experiment(cfg.experiment)
        id_file = out / self.ID_FILE
        if id_file.is_file():  # a resumed job: the run it started before
            self.run = mlflow.start_run(run_id=id_file.read_text().strip())
        else:
            self.run = mlflow.start_run(run_name=cfg.run_name or spec.name or run_id)
            id_file.write_text(self.run.info.run_id + "\n")
            mlflow.log_params({k: str(v)[:500] for k, v in flat(spec.to_dict()).items()})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics({k.replace("/", "_"): v for k, v in values.items()}, step=step)

    def close(self, ok: bool) -> None:
        self.mlflow.end_run(status="FINISHED" if ok else "FAILED")


class Trackers:
    """The trackers a spec names, each fed every event the runner writes (``log``); ``close`` at the end."""

    def __init__(self, spec: Any, out: Path, run_id: str):
        self.active: list[Any] = []
        wanted = spec.integrations
        for kind, on in ((_TensorBoard, wanted.tensorboard), (_Wandb, wanted.wandb is not None),
                         (_Mlflow, wanted.mlflow is not None)):
            if not on:
                continue
            try:
                self.active.append(kind(out, spec, run_id))
            except ImportError as exc:
                _warn(f"integrations.{kind.name}: its package is not installed on this node ({exc}); the job "
                      f"logs to metrics.jsonl without it (pip install {kind.name})")
            except Exception as exc:  # noqa: BLE001 - a tracker must never fail the job
                _warn(f"integrations.{kind.name}: could not start ({type(exc).__name__}: {exc}); left out")
        self.ok = False

    def log(self, event: Event) -> None:
        if isinstance(event, Done):
            self.ok = True
        if isinstance(event, Start | Error | Done):
            return
        values = scalars(event)
        if values:
            self._each(lambda t: t.log(event.step, values))

    def close(self) -> None:
        self._each(lambda t: t.close(self.ok))
        self.active = []

    def _each(self, call) -> None:
        for tracker in list(self.active):
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001 - a tracker must never fail the job
                _warn(f"integrations.{tracker.name}: {type(exc).__name__}: {exc}; left out from here on")
                self.active.remove(tracker)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
