"""A job with ``resources.gpus: N`` > 1: N rank processes on one node over one host copy of the model.

The job's process is rank 0, the leader: it builds the host store in shared memory (``Engine.shared_store``),
starts ranks 1..N-1 as child processes handed the store, and runs the job as a job of one would (metrics,
evaluations, checkpoints, final/). Every rank loads the same data and takes micro-batches
``[r x grad_accum, (r + 1) x grad_accum)`` of each step, whose sampler yields N x grad_accum of them. The
ranks meet in the engine's collectives (engine/ranks.py): a follower cannot begin step n + 1's backward
before the leader has finished whatever it does after step n (a checkpoint, an evaluation), so those see a
store no rank writes. On CUDA rank r runs on the r-th GPU given to the job (NCCL), on the CPU all ranks
share its cores (gloo: what the tests run).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from horizon_ray.job.inputs import load_data
from horizon_ray.job.schedule import lr_at
from horizon_ray.jobspec import JobSpec

# a collective that waits longer than this for a rank means the rank is gone: fail instead of hanging
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class RankGroup:
    """The leader's handle on the job's other ranks."""

    procs: list  # the follower processes, ranks 1..N-1


def finish(group: RankGroup) -> None:
    """The leader's last step is done: meet the followers once their last update is in the store."""
    import torch.distributed as dist

    dist.barrier()
    for p in group.procs:
        p.join(timeout=60)
    failed = [i + 1 for i, p in enumerate(group.procs) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"rank(s) {failed} of the job ended with an error; see the job's log")


def stop(group: RankGroup) -> None:
    """End the followers (after an error in the leader, or once they have finished) and leave the group."""
    import torch.distributed as dist

    for p in group.procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_config(cfg: Any, rank: int, world: int) -> Any:
    """Rank r's engine settings: the r-th GPU of the job's on CUDA, and 1/world of the job's optimizer threads
    (every rank updates its shard of each unit at the same time: together they use the job's share of the
    node's cores, not world times it)."""
    if cfg.device.startswith("cuda"):
        threads = cfg.optimizer_threads or max(1, (os.cpu_count() or 4) - 2)  # the engine's own default
        return replace(cfg, device=f"cuda:{rank}", optimizer_threads=max(1, threads // world))
    if cfg.optimizer_threads:
        return replace(cfg, optimizer_threads=max(1, cfg.optimizer_threads // world))
    return cfg


def start(spec: JobSpec, cfg: Any, model_dir: Path, resume_dir: Path | None, start_step: int, out: Path):
    """Build the shared store, start ranks 1..N-1 and join the group as rank 0; (rank 0's engine, handle).
    ``out``: the job's output directory (a preference job's followers read the leader's reference there)."""
    from horizon_ray.engine import Engine
    from horizon_ray.engine.ranks import Ranks

    world = spec.resources.gpus
    model, store = Engine.shared_store(str(model_dir), cfg, world)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_follower, name=f"horizon-rank-{r}", daemon=True,
                         args=(r, world, port, spec.to_dict(), cfg, str(model_dir), store,
                               str(resume_dir) if resume_dir else None, start_step, str(out)))
             for r in range(1, world)]
    for p in procs:
        p.start()
    group = RankGroup(procs)
    try:
        _join(0, world, port, cfg)
        eng = Engine(model, rank_config(cfg, 0, world), store=store, ranks=Ranks(0, world))
        eng.base_model_path = str(model_dir.resolve())
        if resume_dir is not None:
            eng.load_state(str(resume_dir))
    except BaseException:
        stop(group)
        raise
    return eng, group


def my_batches(batches: list, rank: int, world: int) -> list:
    """Rank r's micro-batches of a step of world x grad_accum of them."""
    per = len(batches) // world
    return batches[rank * per:(rank + 1) * per]


def _join(rank: int, world: int, port: int, cfg: Any) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    cuda = cfg.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)


def _follower(rank: int, world: int, port: int, spec_dict: dict, cfg: Any, model_dir: str, store: Any,
              resume_dir: str | None, start_step: int, out: str) -> None:
    """Rank r > 0: the same steps as the leader on its share of each step's micro-batches; nothing written. A
    preference job's follower waits for the reference the leader computes (or finds) in ``out``."""
    import torch.distributed as dist

    from horizon_ray.engine import Engine, ModelConfig
    from horizon_ray.engine.ranks import Ranks

    _join(rank, world, port, cfg)
    try:
        spec = JobSpec.parse(spec_dict)
        eng = Engine(ModelConfig.load(model_dir), rank_config(cfg, rank, world), store=store,
                     ranks=Ranks(rank, world))
        if resume_dir is not None:
            eng.load_state(resume_dir)
        data = load_data(spec)
        t = spec.training
        preference = None
        if spec.objective == "dpo":
            from horizon_ray.job.dpo import Preference

            preference = Preference(spec, Path(out), data.train_ds, data.eval_ds, data.sampler, data.evals)
            leader = os.getppid()
            preference.wait_for_reference(lambda: os.getppid() == leader)  # orphaned: the leader died
        for step in range(start_step, data.total):  # the leader's loop, without its writing
            eng.set_lr(lr_at(step, data.total, t.lr, data.schedule))
            mine = my_batches(data.sampler.batches_for_step(step), rank, world)
            if preference is None:
                eng.train_step(mine)
            else:
                preference.train_step(eng, step, mine, rank, world)
        eng.synchronize()  # this rank's shard of the last update is in the store before it leaves
        dist.barrier()  # the leader saves final/ after every rank's last update
        eng.close()
    finally:
        dist.destroy_process_group()
