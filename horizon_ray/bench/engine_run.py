"""The horizon-ray system: the streaming engine on a random-init model, warm-up plus timed steps.

One engine serves every accumulation of ``--accum`` and every update mode of ``--update`` (building a 7B
store and pinning it takes a minute of GPU time): accumulations smallest first, and at each accumulation
every update mode in turn (``Engine.set_update`` lets the pending update finish before it switches).

Why that order: the host buffers a step grows (offloaded checkpoints) stay resident for the later steps, so
the host RSS after a step is compared with the plan of the largest step the process has run so far
(``rss_plan_host_bytes``, ``rss_plan_tokens_per_step``). Smallest accumulation first makes that the step's
own plan; modes inside an accumulation keep it so for every mode (the planner plans the same bytes for every
update mode). Modes outside would run the second mode's small step after the first mode's large one, and
compare it with the large step's plan.

Each step is timed on the host around ``train_step``; the engine's optimizer runs in the background, so a
step's time includes what it had to wait for the host update (``exposed_optimizer_s``, from
``Engine.stats()``'s ``waited_s``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from horizon_ray.bench.metrics import (
    STEADY_SHARE,
    base_record,
    error_reason,
    host_peak_rss,
    host_rss,
    host_rss_parts,
    is_out_of_memory,
    parse_updates,
    timed_summary,
)
from horizon_ray.bench.planning import OFFLOAD, lora_alpha, lora_settings, planned_bytes
from horizon_ray.bench.runtime import (
    GpuTelemetry,
    cap_gpu_memory,
    device_and_dtype,
    device_name,
    free_memory,
    gpu_peaks,
    memory_at_peak,
    profile_gemms,
    profile_step,
)
from horizon_ray.bench.shapes import hf_config, model_flops_per_token, resolve_shape
from horizon_ray.engine import Engine, EngineConfig, LoraConfig, heap
from horizon_ray.workload import DEFAULT_LAYER_CHUNK_TOKENS, Workload, fuse_projections_for


def run(args, emit: Callable[[dict], None]) -> list[dict]:
    """Build the engine once, measure each accumulation of ``args.accum`` in each update mode of
    ``args.update``; emit each record as it lands."""
    shape = resolve_shape(args.shape, args.layers)
    device, dtype = device_and_dtype(args)
    updates = parse_updates(args.update)
    t0 = time.perf_counter()
    rss0 = host_rss()
    lora = None
    planned_lora = lora_settings(args, args.mode, shape)
    if planned_lora is not None:  # the base is frozen; only the adapters (exact fp32 AdamW) train
        lora = LoraConfig(r=planned_lora.r, alpha=lora_alpha(planned_lora.r), targets=planned_lora.targets,
                          quantize=planned_lora.quantize)
    layer_chunk = resolved_layer_chunk(args, shape, device, dtype, planned_lora, updates)
    projections = resolved_projections(args, device, layer_chunk)
    eng = Engine.from_config(hf_config(shape), EngineConfig(
        lr=1e-5, weight_decay=0.01, max_grad_norm=args.max_grad_norm, checkpoint_every=args.checkpoint_every,
        device=device,
        compute_dtype=dtype, precision="exact" if lora else args.mode, loss_chunk_tokens=args.loss_chunk,
        layer_chunk_tokens=layer_chunk, offload_checkpoints=OFFLOAD[args.offload], lora=lora, update=updates[0],
        fuse_projections=projections == "fused"))
    init_s = time.perf_counter() - t0
    cuda = eng.device.type == "cuda"
    budget = int(args.gpu_budget_gib * 2**30) if args.gpu_budget_gib else None
    cap_gpu_memory(budget, eng.device)
    results = []
    largest: dict | None = None  # the record of the largest plan run so far in this process
    for accum in accumulations(args.accum):
        batches = _batches(shape.vocab_size, args.micro, args.seq, accum)
        for update in updates:
            rec = base_record("horizon-ray", shape, mode=args.mode, dtype=dtype, device=eng.device.type,
                              device_name=device_name(eng.device), seq=args.seq, micro=args.micro, accum=accum,
                              checkpoint_every=args.checkpoint_every, gpu_budget_bytes=budget,
                              offload_checkpoints=args.offload,
                              flops_per_token=model_flops_per_token(shape, args.seq),
                              trainable_params=eng.trainable_params, update=update)
            rec.update(planned_bytes(shape, mode=args.mode, seq=args.seq, micro=args.micro, accum=accum,
                                     checkpoint_every=args.checkpoint_every, dtype=dtype, device=eng.device.type,
                                     gpu_budget_bytes=budget, loss_chunk=args.loss_chunk, offload=args.offload,
                                     lora=planned_lora, update=update, layer_chunk=layer_chunk))
            largest = rss_plan(rec, largest)
            rec.update(init_s=round(init_s, 1), params=eng.num_params,
                       offload_resolved=eng.offload_checkpoints,  # where checkpoints lived: host or device
                       kernels=eng.template.ops.name,  # the layer template's kernels: torch or liger
                       layer_chunk_tokens=layer_chunk,
                       projections=None if lora is not None else projections)  # LoRA: always split
            if lora is not None:
                rec.update(lora_r=lora.r, lora_alpha=lora.alpha, lora_targets=list(lora.targets),
                           quantize=lora.quantize)
            _switch_and_measure(eng, rec, batches, args, rss0)
            emit(rec)
            results.append(rec)
            if rec["status"] == "ok" and cuda and args.profile:
                emit(_profiled(eng, rec, batches))
    eng.close()
    return results


def _switch_and_measure(eng: Engine, rec: dict, batches, args, rss0: int) -> None:
    """Switch to the record's update mode and measure it; a mode the engine refuses, or a step that runs out
    of memory, is recorded and the next one still runs."""
    if rec["update"] != "exact" and rec.get("plan_host_fits") is False:
        # the mode's extra host buffers would not fit this host: the kernel's OOM killer would end the child
        # (the GPU side of a plan is conservative and the budget is enforced by the allocator: it is tried)
        rec.update(status="did-not-fit", reason=f"planned: {rec.get('plan_reason', '')}"[:500])
        return
    try:
        eng.set_update(rec["update"], speculate_units=rec.get("planned_speculate_units"))
    except ValueError as exc:  # a refusal (e.g. a mode these settings do not allow), before anything ran
        rec.update(status="error", reason=error_reason(exc))
        return
    try:
        _measure(eng, rec, batches, args, rss0)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        rec.update(status="did-not-fit", reason=error_reason(exc), host_peak_rss_bytes=host_peak_rss())
    if rec["status"] != "ok":  # outside the except: its traceback no longer pins the step's tensors
        free_memory()


def resolved_layer_chunk(args, shape, device: str, dtype: str, lora, updates: list[str]) -> int:
    """--layer-chunk decided as the job spec's engine.layer_chunk_tokens is: a number stays; auto is the
    planner's choice (on a GPU the largest row group whose plan fits the budget) for the largest accumulation the
    run measures, which the one engine of every accumulation must hold."""
    if args.layer_chunk != "auto":
        return int(args.layer_chunk)
    if not device.startswith("cuda"):
        return DEFAULT_LAYER_CHUNK_TOKENS
    budget = int(args.gpu_budget_gib * 2**30) if args.gpu_budget_gib else None
    planned = planned_bytes(shape, mode=args.mode, seq=args.seq, micro=args.micro, accum=max(accumulations(args.accum)),
                            checkpoint_every=args.checkpoint_every, dtype=dtype, device=device,
                            gpu_budget_bytes=budget, loss_chunk=args.loss_chunk, offload=args.offload, lora=lora,
                            update=updates[-1], layer_chunk="auto")
    return planned.get("planned_layer_chunk_tokens") or DEFAULT_LAYER_CHUNK_TOKENS


def resolved_projections(args, device: str, layer_chunk: int) -> str:
    """--projections decided as the job spec's engine.fuse_projections is (workload.fuse_projections_for):
    "fused" or "split"."""
    if args.projections != "auto":
        return args.projections
    group = Workload(seq_len=args.seq, micro_batch_size=args.micro, layer_chunk_tokens=layer_chunk).group_tokens
    fused = fuse_projections_for("auto", cuda=device.startswith("cuda"), group_tokens=group)
    return "fused" if fused else "split"


def engine_stats(eng) -> tuple[float, float, int]:
    """(waited_s, last_update_s, rollbacks) of ``Engine.stats()``: seconds the training thread has blocked on
    the host update so far, wall time of the last finished update, speculative rollbacks so far."""
    s = eng.stats()
    return s.waited_s, s.last_update_s, s.rollbacks


def accumulations(spec) -> list[int]:
    """--accum's list, smallest first (see the module's docstring)."""
    return sorted(int(a) for a in str(spec).split(","))


def rss_plan(rec: dict, largest: dict | None) -> dict | None:
    """Set the plan the record's host RSS is compared with: the largest planned host bytes of the steps this
    process has run, this one included, counting the update mode's own buffers (set_update adds and frees
    them) for this record's mode only. Returns the record that holds the largest plan."""
    def base(r):
        return r["planned_host_bytes"] - (r.get("planned_update_buffers_bytes") or 0)

    if rec.get("planned_host_bytes") is not None and (largest is None or base(rec) >= base(largest)):
        largest = rec
    if largest is not None:
        own = rec.get("planned_update_buffers_bytes") or 0
        rec.update(rss_plan_host_bytes=base(largest) + own, rss_plan_tokens_per_step=largest["tokens_per_step"])
    return largest


def _batches(vocab: int, micro: int, seq: int, accum: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Two steps of random tokens, alternated (labels = inputs: the engine shifts them)."""
    g = torch.Generator().manual_seed(0)
    return [[(ids, ids) for ids in (torch.randint(0, vocab, (micro, seq), generator=g) for _ in range(accum))]
            for _ in range(2)]


# Untimed steps at most while a lagging update's pipeline settles (``settling``).
MAX_WARMUP = 8


def warmup_steps(warmup: int, update_lag: int) -> int:
    """Untimed steps before the timed ones: ``--warmup``, at least 1, and at least lag + 2 under a lagging update.
    The first step after a drained pipeline (a new engine, set_update) waits for no update. Under the delayed
    update (lag 1) a step waits for the update of the step two before it, unit by unit, its forward trailing that
    update: the second step waits for none, the third for an update that began a whole step before it (so it is
    shorter by its forward), and from the fourth on each starts a backward's length after its update began, as
    every later step does, when the update is longer than the step by a forward or more (``settling`` covers the
    rest). olmoe-1b-7b at 16,384 tokens on the H200: 0.77 and 1.47 s timed after one warm-up against a 1.9 s
    update; 1.45 and 1.51 s after two, against 1.6 s."""
    return max(warmup, 1 if not update_lag else update_lag + 2)


def settling(times: list[float], updates: list[float], update_lag: int) -> bool:
    """Whether a lagging update's pipeline is still settling after the warm-up's steps: its last step shorter
    than the last whole host update. Where the update is longer than the GPU's step by less than a forward, each
    step waits a little longer than the one before (the backlog grows by their difference) until steps are as
    long as the update; until then a step is not what every later step takes. Never past MAX_WARMUP steps."""
    return bool(update_lag) and 0 < len(times) < MAX_WARMUP and times[-1] < STEADY_SHARE * updates[-1]


def _measure(eng: Engine, rec: dict, batches, args, rss0: int) -> None:
    cuda = eng.device.type == "cuda"
    times: list[float] = []
    waits: list[float] = []
    updates: list[float] = []
    lag, w = eng.update_lag, None  # w: the first timed step, once the warm-up is over
    least = warmup_steps(args.warmup, lag)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rollbacks0 = 0
    telemetry = GpuTelemetry(eng.device)
    try:
        step = 0
        while w is None or step < w + args.steps:
            if cuda:
                torch.cuda.synchronize()
            waited0, _, rollbacks = engine_stats(eng)
            if w is None and step >= least and not settling(times, updates, lag):
                w, rollbacks0 = step, rollbacks
                telemetry.start()  # the timed steps' clock, power and temperature
            s = time.perf_counter()
            eng.train_step(batches[step % 2])
            times.append(time.perf_counter() - s)
            waited, last_update, rollbacks = engine_stats(eng)
            waits.append(waited - waited0)
            updates.append(last_update)
            step += 1
    finally:
        telemetry.stop()
    # no wait for the last update here: a profiled step that follows must find it running, as any step does
    mem = eng.memory_report()
    rec.update(timed_summary(times, w, rec["tokens_per_step"], rec["model_flops_per_token"]))
    rec.update(
        exposed_optimizer_s=round(statistics.median(waits[w:] or waits), 4),
        # the last full update when the step ended; the step after the last timed one is still its own
        optimizer_update_s=round(statistics.median(updates[w:] or updates), 4),
        rollbacks=rollbacks - rollbacks0,
        # speculative: units the last timed step updated during its backward (0: it ran as exact, e.g. after a
        # step that clipped)
        speculated_units=eng.stats().speculated_units if rec["update"] == "speculative" else None,
        warmup_steps=w,  # untimed steps run (engine_run.warmup_steps, and more while settling)
        **gpu_peaks(eng.device),
        host_rss_bytes=host_rss(), host_rss_growth_bytes=host_rss() - rss0, host_peak_rss_bytes=host_peak_rss(),
        host_heap_free_bytes=heap.free_bytes(),  # malloc's free lists, resident or not (None: not glibc)
        **host_rss_parts(),
        store_bytes=mem["host"], device_bytes=mem["device"],
        host_checkpoint_bytes=eng.stats().host_checkpoint_bytes,
        **telemetry.summary(),
    )


def _profiled(eng: Engine, rec: dict, batches) -> dict:
    """The record again, with the time split of one more step run under the profiler (then its GEMMs by
    shape, and what held the GPU memory at a step's peak, each from one more step). It follows the timed
    steps at once, so it waits for the previous update as they did (counted in gpu_idle_s)."""
    out = dict(rec)
    try:
        waited0 = engine_stats(eng)[0]
        out.update(profile_step(lambda: eng.train_step(batches[0])))
        out["profiled_exposed_optimizer_s"] = round(engine_stats(eng)[0] - waited0, 4)
    except Exception as exc:  # the split is a bonus: a profiler failure must not lose the measured run
        out["split_error"] = f"{type(exc).__name__}: {exc}"[:300]
    out.update(profile_gemms(lambda: eng.train_step(batches[0])))
    out.update(memory_at_peak(lambda: eng.train_step(batches[0]), eng.device))
    return out


def optimizer_probe(params: int = 1 << 30, units: int = 4) -> list[dict]:
    """Host AdamW throughput in the store's real layout (bf16 wire/gradient, fp32 master and moments),
    by thread placement, thread count, chunk size and clipping."""
    import threading

    from horizon_ray.engine.model import _unit
    from horizon_ray.engine.optimizer import HostAdamW
    from horizon_ray.engine.store import HostStore

    n = params // units
    store = HostStore([_unit(f"u{i}", [(f"w{i}", "w", (n,))]) for i in range(units)], torch.bfloat16,
                      torch.float32, pin=torch.cuda.is_available())
    for u in store.units:
        u.master.normal_()
        u.wire.normal_()
    opt = HostAdamW(store, (0.9, 0.95), 1e-8, 0.01)
    out = []
    for where in ("main", "thread"):
        for threads in (0, max(1, (os.cpu_count() or 4) - 2)):
            for chunk in (1 << 19, 1 << 21, 1 << 23):
                for clip in (1.0, 0.5):
                    opt.chunk = chunk

                    def work(threads=threads, clip=clip):
                        if threads:
                            torch.set_num_threads(threads)
                        for u in store.units:
                            opt.update(u, 1e-5, clip)

                    t = time.perf_counter()
                    if where == "main":
                        work()
                    else:
                        th = threading.Thread(target=work)
                        th.start()
                        th.join()
                    dt = time.perf_counter() - t
                    torch.set_num_threads(os.cpu_count() or 1)
                    out.append(dict(where=where, threads=threads or torch.get_num_threads(), chunk=chunk, clip=clip,
                                    g_params_per_s=round(params / dt / 1e9, 3)))
                    print("OPT", json.dumps(out[-1]), flush=True)
    return out
