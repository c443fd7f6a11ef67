"""Run one fine-tuning job in this process: spec -> data -> engine -> steps, evals, checkpoints -> final/.

The run is a pure function of the spec: the data of step N comes from ``StepSampler.batches_for_step(N)``,
the learning rate from ``lr_at(N)``, and the engine's state round-trips exactly through a checkpoint, so
a job killed at any point and resumed with ``resume=True`` ends with the same weights as one that never
stopped. Output files follow docs/CONTRACTS.md. With ``method: lora`` final/ holds the adapter in PEFT's
format (adapter_config.json + adapter_model.safetensors, naming the base model directory) and, with
``lora.merge``, final/merged/ the merged full model in HF format; both with the tokenizer.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from horizon_ray.atomic import atomic_path, write_atomic
from horizon_ray.errors import BadInput
from horizon_ray.job import checkpoints as ckpt_io
from horizon_ray.job import dpo, lease, ranks
from horizon_ray.job.events import Checkpoint, CheckpointBegin, Done, Error, Eval, Metrics, Start
from horizon_ray.job.inputs import load_data
from horizon_ray.job.lease import Fence, Fenced
from horizon_ray.job.metrics import METRICS_FILE, SPEC_FILE, MetricsWriter, plot_loss_curve
from horizon_ray.job.progress import Progress, format_rewards
from horizon_ray.job.schedule import lr_at
from horizon_ray.job.trackers import Trackers
from horizon_ray.jobspec import JobSpec

DONE = "DONE"  # in output_dir, written after final/ and before the "done" event: the job is finished
# How long an engine the node agent started waits for an earlier engine of its job to let go of the output
# directory (that one stops at its next step once the lease is this engine's), before it gives up (exit 75).
OUTPUT_DIR_WAIT_S = 120.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                   "generation_config.json")


class OutputDirBusy(RuntimeError):
    """Another runner holds the job's output directory (its flock): exit_codes.OUTPUT_DIR_BUSY."""


# Set by SIGUSR1 (the node agent's drain: its pod is stopping): checkpoint at the end of the current step and
# stop, resumable, instead of losing the steps since the last periodic checkpoint.
STOP_AFTER_STEP = threading.Event()


class JobTerminated(BaseException):
    """Raised in the job's thread when the process is asked to stop (SIGTERM from the node agent or Ray).
    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` swallows it."""


@dataclass
class JobResult:
    output_dir: Path  # the spec's output_dir
    final_dir: Path  # the trained model in HF format (tokenizer included)
    total_steps: int  # optimizer steps of the whole job
    start_step: int  # step the run started from (> 0 when resumed)
    first_eval_loss: float | None  # eval loss of the first evaluation of this run (None: no eval data)
    final_eval_loss: float | None  # eval loss after the last step
    final_loss: float | None  # training loss of the last step run here
    wall_s: float  # seconds this run took


def engine_config(spec: JobSpec) -> Any:
    """The EngineConfig a spec asks for on this node (every "auto" resolved by the spec's one rule)."""
    from horizon_ray.engine import EngineConfig

    cfg = EngineConfig.from_spec(spec)
    planned = None
    if cfg.device.startswith("cuda") and spec.engine.layer_chunk_tokens == "auto":
        planned = local_plan(spec, cuda=True)
        cfg = EngineConfig.from_spec(spec, layer_chunk_tokens=planned.layer_chunk_tokens)
    # the node agent's share of the cores when several engines run on one node (0: the engine's default)
    cfg.optimizer_threads = int(os.environ.get("HORIZON_RAY_OPTIMIZER_THREADS") or 0)
    if cfg.update == "speculative" and cfg.lora is None:
        # how many units it may update during the backward: the planner's choice for this machine's RAM (each
        # such unit keeps its gradient apart from its wire)
        cfg.speculate_units = (planned or local_plan(spec, cuda=cfg.device.startswith("cuda"))).speculate_units
    return cfg


def local_plan(spec: JobSpec, *, cuda: bool) -> Any:
    """The planner's plan of the spec on this machine: its RAM, and its GPUs when the job runs on CUDA (the
    row groups of engine.layer_chunk_tokens auto are the largest it fits in the GPU's memory)."""
    import psutil
    import torch

    from horizon_ray.planner import NodeSpec, plan_for_spec

    node = NodeSpec(ram_bytes=psutil.virtual_memory().total, gpus=torch.cuda.device_count() if cuda else 0,
                    gpu_mem_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else 0, name="this node")
    return plan_for_spec(spec, node, suggest=False)



# delayed update: steps run exact before the engine switches to it (at least; the schedule's warmup too)
DELAYED_AFTER_STEPS = 40


def delayed_from(spec: JobSpec) -> int:
    """The first step a delayed-update job runs delayed: after the schedule's warmup and DELAYED_AFTER_STEPS."""
    return max(DELAYED_AFTER_STEPS, spec.training.schedule.warmup_steps)


def run_job(spec: JobSpec, resume: bool = False, progress: bool = True) -> JobResult:
    """Run the job described by ``spec`` to completion. BadInput: the spec, its model, data or output
    directory cannot work (the message names the fix; nothing trained); anything else escaping is a crash."""
    spec.check()
    spec.check_paths()
    out = Path(spec.output_dir).expanduser()
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _run_in(out, spec, resume, progress)
    except BadInput:
        if made and not any((out / name).exists() for name in ("checkpoints", "final")):
            shutil.rmtree(out, ignore_errors=True)  # refused before anything trained: no half-made directory
        raise


def _run_in(out: Path, spec: JobSpec, resume: bool, progress: bool) -> JobResult:
    # Started by a node agent: the job's lease says whether this engine may still write (see job.lease).
    fence = Fence.from_env(out)
    if fence is not None:
        fence.check("starting")
    guard = _guard(fence)
    with _exclusive(out, fence), MetricsWriter(out / METRICS_FILE, guard) as metrics:
        with guard("starting the trackers"):  # they write in the output directory (tensorboard/, run ids)
            trackers = Trackers(spec, out, run_id=os.environ.get(lease.ENV_JOB) or _run_id(out))
        metrics.sinks.append(trackers)  # fed under the same guard as each metrics line
        job = _Job(spec, out, metrics, progress, fence)
        try:
            return job.run(resume)
        except Fenced:
            raise  # it may write nothing, not even why it stopped (its log has that)
        except BaseException as exc:
            # KeyboardInterrupt too: the cluster should see why the job stopped. SIGKILL leaves no line.
            if isinstance(exc, JobTerminated | KeyboardInterrupt):
                # stopped from outside: say what a rerun would continue from (a cancel before the first
                # checkpoint has nothing to resume)
                why = str(exc) if isinstance(exc, JobTerminated) else "interrupted"
                exc.args = (f"{why} at step {job.step}; {resume_hint(out)}",)
                message = exc.args[0]
            else:
                message = str(exc) if isinstance(exc, BadInput) else f"{type(exc).__name__}: {exc}"
            metrics.write(Error(step=job.step, message=message))
            raise
        finally:
            try:
                with guard("closing the trackers"):
                    trackers.close()
            except Fenced:
                pass  # a fenced engine writes nothing more, its trackers' last words neither


def resume_hint(out: Path) -> str:
    """What `--resume` would do for the job in `out`: continue from its newest complete checkpoint, or, with
    none, start from the beginning."""
    latest = ckpt_io.latest_checkpoint(out / "checkpoints")
    if latest is None:
        return "no checkpoint was written, so a rerun (--resume) starts from the beginning"
    return f"rerun with --resume to continue from the checkpoint of step {latest.step}"


def _run_id(out: Path) -> str:
    """A tracker's run id for a job run outside the service: stable for its output directory, so that a resumed
    job continues its run."""
    import hashlib

    return "hr-" + hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]


def _guard(fence: Fence | None):
    """`guard(what)`: held around each write of the job (the fence's check and shared lock; none by hand)."""
    return fence.guard if fence is not None else (lambda what: nullcontext())


@contextmanager
def _reading(what: str) -> Iterator[None]:
    """The engine's refusals while it reads `what` (a model directory, a checkpoint) name that input: the
    engine raises BadInput (a ValueError) for files it cannot use."""
    try:
        yield
    except ValueError as exc:
        raise BadInput(f"{what}: {exc}", field=getattr(exc, "field", None)) from exc


class _Job:
    def __init__(self, spec: JobSpec, out: Path, metrics: MetricsWriter, show_progress: bool,
                 fence: Fence | None = None) -> None:
        self.spec = spec
        self.out = out
        self.metrics = metrics
        self.show_progress = show_progress
        self.fence = fence  # the job's lease (a node agent started it), or None (run by hand)
        self.guard = _guard(fence)
        self.ckpt_root = out / "checkpoints"
        self.tokenizer_dir = Path(spec.model.tokenizer_path or spec.model.path).expanduser()
        self.step = 0  # optimizer steps done
        self._last_eval_preference: dict[str, float] | None = None  # a preference job's latest eval metrics

    def run(self, resume: bool) -> JobResult:
        from horizon_ray.engine import Engine

        t0 = time.monotonic()
        finished = self._finished_run(resume)
        if finished is not None:
            return finished
        latest = self._checkpoint_to_resume(resume)
        write_atomic(self.out / SPEC_FILE, self.spec.to_yaml().encode(), self._commit(f"writing {SPEC_FILE}"))
        self._load_data()
        cfg = engine_config(self.spec)
        model_dir = Path(self.spec.model.path).expanduser()
        self.world = self.spec.resources.gpus
        # delayed: the first steps run exact (ZeRO-Offload's practice: a one-step-stale gradient destabilises
        # AdamW while the gradients still change fast), then the engine switches to the delayed update
        self.delay_from = delayed_from(self.spec) if cfg.update == "delayed" and self.world == 1 else None
        if self.delay_from:
            cfg = replace(cfg, update="exact")
        group = None
        with _reading(f"model.path {model_dir}"):
            if self.world > 1:  # ranks 1..N-1 in child processes over one host store (job/ranks.py)
                eng, group = ranks.start(self.spec, cfg, model_dir, latest.engine_dir if latest else None,
                                         latest.step if latest else 0, self.out)
            else:
                eng = Engine.from_pretrained(str(model_dir), cfg)
        try:
            if latest is not None:
                if group is None:
                    with _reading(f"checkpoint {latest.path}"):
                        eng.load_state(str(latest.engine_dir))
                _restore_rng(latest.state())
                self.step = latest.step
                assert eng.step == self.step, (eng.step, self.step)
            self.preference = None
            if self.spec.objective == "dpo":  # the reference: the starting weights' log-probs, once per job
                self.preference = dpo.Preference(self.spec, self.out, self.train_ds, self.eval_ds, self.sampler,
                                                 self.evals)
                self.preference.prepare(eng, self.step, self._commit("writing the reference"),
                                        lambda line: print(line, flush=True))
            start = self.step
            if latest is not None and self.fence is None:
                self.metrics.drop_after(start)  # by hand: each step once in the file; an agent tails it by offset
            self.metrics.write(Start(
                step=start, total_steps=self.total, resumed_from=start if latest else None,
                name=self.spec.name, device=cfg.device, compute_dtype=cfg.compute_dtype,
                num_params=eng.num_params, trainable_params=eng.trainable_params, method=self.spec.method,
                train_examples=self._examples(self.train_ds),
                eval_examples=self._examples(self.eval_ds),
                steps_per_epoch=self.sampler.steps_per_epoch, training_hash=self.spec.training_hash(),
                update=cfg.update, gpus=self.world,
            ))
            if cfg.update == "delayed":
                print("note: training.update delayed is not exact AdamW: every step trains on the weights one "
                      "update old", flush=True)
            first_eval, final_eval, last_loss = self._train(eng)
            if group is not None:
                ranks.finish(group)  # every rank's last update is in the store
            final_dir = self._save_final(eng)
        finally:
            eng.close()
            if group is not None:
                ranks.stop(group)
        try:
            plot_loss_curve(self.out / METRICS_FILE, self.out / "loss_curve.png", self.spec.name or "",
                            self._commit("drawing the loss curve"))
        except Exception as exc:  # a missing plot must not fail a finished job
            print(f"warning: could not draw the loss curve: {exc}", flush=True)
        wall = time.monotonic() - t0
        done = {"training_hash": self.spec.training_hash(), "total_steps": self.total,
                "final_dir": str(final_dir), "eval_loss": final_eval}
        write_atomic(self.out / DONE, json.dumps(done, indent=2).encode() + b"\n", self._commit("writing DONE"))
        self.metrics.write(Done(step=self.total, final_dir=str(final_dir), eval_loss=final_eval,
                                wall_s=round(wall, 2)))
        return JobResult(self.out, final_dir, self.total, start, first_eval, final_eval, last_loss, wall)

    def _finished_run(self, resume: bool) -> JobResult | None:
        """A job that already finished here: with --resume there is nothing left to do (a requeued job
        that had completed just reports done again); without it, the output directory is taken."""
        path = self.out / DONE
        if not path.is_file():
            if not resume and (self.out / "final").exists():
                raise BadInput(f"{self.out} already holds a final model; choose another output_dir")
            return None
        done = json.loads(path.read_text())
        if not resume:
            raise BadInput(f"{self.out} already holds a finished run; choose another output_dir (or pass "
                           "--resume, which reports it as done)")
        if done.get("training_hash") != self.spec.training_hash():
            raise BadInput(f"{self.out} holds a finished run of a different job spec; choose another "
                           "output_dir")
        self.step = done["total_steps"]
        self.metrics.write(Done(step=self.step, final_dir=done["final_dir"], eval_loss=done["eval_loss"]))
        return JobResult(self.out, Path(done["final_dir"]), self.step, self.step, None, done["eval_loss"],
                         None, 0.0)

    def _commit(self, what: str) -> Any:
        """The `commit` of an atomic write: the fence's guard around its rename (see horizon_ray.atomic)."""
        return lambda: self.guard(what)

    def _check(self, what: str) -> None:
        if self.fence is not None:
            self.fence.check(what)

    def _checkpoint_to_resume(self, resume: bool) -> ckpt_io.Checkpoint | None:
        with self.guard("removing incomplete checkpoints"):
            ckpt_io.remove_incomplete(self.ckpt_root)
        latest = ckpt_io.latest_checkpoint(self.ckpt_root)
        if latest is None:
            return None
        if not resume:
            raise BadInput(f"{self.out} already holds checkpoints of a run (newest: step {latest.step}); "
                           "pass --resume to continue it, or choose another output_dir")
        if latest.state().get("training_hash") != self.spec.training_hash():
            raise BadInput(f"the checkpoint in {latest.path} belongs to a different job spec (model, data "
                           "or training settings changed); resume with the original spec, or choose "
                           "another output_dir")
        return latest

    def _load_data(self) -> None:
        data = load_data(self.spec)
        self.train_ds, self.eval_ds, self.sampler, self.total, self.evals, self.schedule = (
            data.train_ds, data.eval_ds, data.sampler, data.total, data.evals, data.schedule)

    def _train(self, eng: Any) -> tuple[float | None, float | None, float | None]:
        """The step loop. Returns (first eval loss of this run, final eval loss, last training loss)."""
        spec, t, total = self.spec, self.spec.training, self.total
        bar = Progress(total, start_step=self.step, enabled=self.show_progress, title=spec.name or "finetune")
        first_eval = last_loss = None
        window: deque[tuple[float, int]] = deque(maxlen=20)  # (seconds, tokens) of the latest steps
        seen: int | None = None  # tokens trained on through the latest step (a resumed run counts the steps before)
        try:
            if self.evals and self.step == 0:
                first_eval = self._evaluate(eng)
                bar.note(f"eval loss before training: {first_eval:.4f}{self._eval_rewards()}")
            for step in range(self.step, total):
                self._check(f"step {step + 1}")  # a stale engine does not even compute
                tick = time.monotonic()
                lr = lr_at(step, total, t.lr, self.schedule)
                eng.set_lr(lr)
                if step == self.delay_from and eng.update_mode != "delayed":
                    eng.set_update("delayed")  # past the early steps, whose gradients change too fast to lag
                batches = ranks.my_batches(self.sampler.batches_for_step(step), 0, self.world)
                if self.preference is None:
                    last_loss = float(eng.train_step(batches))
                else:
                    last_loss = self.preference.train_step(eng, step, batches, 0, self.world)
                self.step = done = step + 1

                tokens = self.sampler.tokens_for_step(step)
                window.append((time.monotonic() - tick, tokens))
                seen = (seen if seen is not None else sum(map(self.sampler.tokens_for_step, range(step)))) + tokens
                secs = sum(w[0] for w in window)
                tps = sum(w[1] for w in window) / secs if secs > 0 else 0.0
                eta = secs / len(window) * (total - done)
                self.metrics.write(Metrics(step=done, loss=last_loss, lr=lr, grad_norm=float(eng.last_grad_norm),
                                           tokens_per_s=round(tps, 1), host_rss_bytes=_rss(), total_steps=total,
                                           eta_s=round(eta, 1),
                                           rollbacks=eng.stats().rollbacks if t.update == "speculative" else None,
                                           tokens_seen=seen,
                                           preference=eng.last_dpo.mean() if self.preference else None))
                bar.update(done, last_loss, tps, eta,
                           rewards=format_rewards(eng.last_dpo.mean()) if self.preference else None)

                checkpointed = _due(spec.checkpoint.every_steps, done, total)
                evaluating = self.evals and _due(spec.eval.every_steps, done, total)
                if checkpointed or evaluating:
                    _drain(eng, window)
                if checkpointed:
                    self._checkpoint(eng, done)
                if evaluating:
                    loss = self._evaluate(eng)
                    first_eval = loss if first_eval is None else first_eval
                    bar.note(f"step {done}: eval loss {loss:.4f}{self._eval_rewards()}")
                if STOP_AFTER_STEP.is_set() and done < total:
                    if not checkpointed:
                        self._checkpoint(eng, done)
                    raise JobTerminated(f"stopped after step {done} to leave its node (drain); the checkpoint of "
                                        "that step is written: rerun with --resume to continue from it")
            final_eval = self._evaluate(eng) if self.evals else None
            if final_eval is not None:
                bar.note(f"eval loss after training: {final_eval:.4f}{self._eval_rewards()}")
        finally:
            bar.close()
        return first_eval, final_eval, last_loss

    def _checkpoint(self, eng: Any, done: int) -> None:
        spec = self.spec
        self.metrics.write(CheckpointBegin(step=done))
        saved = _save_checkpoint(eng, self.ckpt_root, done, spec, self._commit(f"checkpoint {done}"))
        # announced before they go: a kill in between leaves checkpoints unlisted, never listed gone
        stale = ckpt_io.complete_checkpoints(self.ckpt_root)[:-spec.checkpoint.keep]
        self.metrics.write(Checkpoint(step=done, path=str(saved.path), pruned=[c.step for c in stale]))
        with self.guard("pruning checkpoints"):
            ckpt_io.prune(self.ckpt_root, spec.checkpoint.keep)

    def _examples(self, ds) -> int:
        """A dataset's examples as the user counts them: a preference job's rows are pairs, two rows each."""
        if ds is None:
            return 0
        return len(ds.examples) // 2 if self.preference is not None else len(ds.examples)

    def _eval_rewards(self) -> str:
        """", reward accuracy 87.5 %, margin 0.412" of the latest eval of a preference job, for its eval lines."""
        shown = format_rewards(self._last_eval_preference)
        return f", {shown}" if shown else ""

    def _evaluate(self, eng: Any) -> float:
        if self.preference is not None:
            m = self.preference.evaluate(eng)
            means = self._last_eval_preference = m.mean()
            self.metrics.write(Eval(step=self.step, eval_loss=means["loss"], eval_tokens=m.pairs,
                                    eval_preference=means))
            return means["loss"]
        assert self.evals is not None, "evaluated only with eval micro-batches"
        loss_sum, n_tokens = 0.0, 0
        for mb in self.evals:
            s, n = eng.eval_loss([mb])
            loss_sum += float(s)
            n_tokens += int(n)
        loss = loss_sum / max(1, n_tokens)
        gen = self.spec.eval.generate
        scored: dict = {}
        if gen is not None and self.eval_ds is not None:
            scored = self._generate_eval(eng, gen)
        self.metrics.write(Eval(step=self.step, eval_loss=loss, eval_tokens=n_tokens, **scored))
        return loss

    def _generate_eval(self, eng: Any, gen: Any) -> dict:
        """eval.generate: the held-out prompts answered by the engine as it is now, scored (job/generate_eval.py)."""
        from horizon_ray.data import load_tokenizer
        from horizon_ray.job import generate_eval

        if getattr(self, "_held_out", None) is None:
            self._held_out = generate_eval.held_out(self.eval_ds, gen.max_prompts)
            self._eval_tokenizer = load_tokenizer(self.tokenizer_dir)
        if not self._held_out:
            return {}
        share, _ = generate_eval.evaluate(eng, self._eval_tokenizer, self._held_out, gen.max_tokens, gen.metric,
                                          gen.batch_size)
        return {"generate_metric": gen.metric, "generate_score": share, "generate_prompts": len(self._held_out)}

    def _save_final(self, eng: Any) -> Path:
        """final/ appears whole or not at all (``horizon_ray.atomic``)."""
        final = self.out / "final"
        with self.guard("removing a crashed attempt's final/"):
            for stale in self.out.glob("final.tmp-*"):  # a crashed attempt's (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
        with atomic_path(final, self._commit("writing final/")) as tmp:
            eng.save_pretrained(str(tmp))  # with LoRA: the adapter
            dirs = [tmp]
            if self.spec.method == "lora" and self.spec.lora is not None and self.spec.lora.merge:
                dirs.append(eng.save_merged(str(tmp / "merged")))
            for d in dirs:
                for name in TOKENIZER_FILES:
                    src = self.tokenizer_dir / name
                    if src.is_file() and not (d / name).exists():
                        shutil.copy2(src, d / name)
        return final


def _drain(eng: Any, window: deque[tuple[float, int]]) -> None:
    """Wait for the host update still running before a checkpoint or an eval pauses the step loop, and count the
    wait to the latest step's time: the next step would have waited for that update. Left out, it made the steps
    after every checkpoint and eval look faster than the run (their tokens/s and the ETA), most where the host
    update is long against the GPU's step."""
    t0 = time.monotonic()
    eng.synchronize()
    secs, tokens = window[-1]
    window[-1] = (secs + time.monotonic() - t0, tokens)


def _due(every: int, done: int, total: int) -> bool:
    # Nothing is due after the last step: the final eval and final/ cover it.
    return every > 0 and done % every == 0 and done < total


def _save_checkpoint(eng: Any, root: Path, step: int, spec: JobSpec,
                     commit: Any = None) -> ckpt_io.Checkpoint:
    state = {
        "step": step,
        "training_hash": spec.training_hash(),
        # The engine and the sampler draw no random numbers during training today; the generators are
        # saved anyway so that adding dropout or sampling later cannot silently break exact resume.
        "torch_rng_state": torch.get_rng_state().tolist(),
    }
    return ckpt_io.write_checkpoint(root, step, lambda d: eng.save_state(str(d)), state, commit)


def _restore_rng(state: dict[str, Any]) -> None:
    rng = state.get("torch_rng_state")
    if rng is not None:
        torch.set_rng_state(torch.tensor(rng, dtype=torch.uint8))


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class _exclusive:
    """An flock on ``<output_dir>/.lock``: two runners never write the same output directory.

    By hand the second runner gives up at once. An engine the node agent started (`fence`) waits, up to
    OUTPUT_DIR_WAIT_S with growing pauses, for an earlier engine of its job to stop (the lease is this
    engine's, so that one stops at its next step), and stops waiting if it is itself superseded."""

    def __init__(self, out: Path, fence: Fence | None = None) -> None:
        self.path = out / ".lock"
        self.fence = fence
        self.fd: int | None = None

    def __enter__(self) -> _exclusive:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + (OUTPUT_DIR_WAIT_S if self.fence is not None else 0.0)
        pause = 0.1
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                pass
            if time.monotonic() >= deadline:
                os.close(self.fd)
                self.fd = None
                waited = f" for {OUTPUT_DIR_WAIT_S:.0f} s" if self.fence is not None else ""
                raise OutputDirBusy(f"another job is running in {self.path.parent}{waited}; wait for it or choose "
                                    "another output_dir")
            if self.fence is not None:
                self.fence.check("taking the output directory")
            time.sleep(pause)
            pause = min(2.0, pause * 2)

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
