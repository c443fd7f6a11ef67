"""What one benchmark run measures, and the arithmetic on it. Pure Python (no torch import).

Every run is one flat dict (a *record*) that crosses the child -> parent boundary as a ``RESULT {json}``
line and lands in ``benchmarks/results/*.json``. ``REQUIRED_KEYS`` are present in every record of every
system, ``None`` where a system does not have the quantity (a baseline has no plan) or a run did not
measure it (it did not fit).
"""

from __future__ import annotations

import os
import resource
import statistics
from typing import Any

from horizon_ray.engine.model import UPDATES as UPDATE_MODES  # the engine's table

# bf16 dense matmul rate measured on the H200 box, and the datasheet's.
MEASURED_BF16_FLOPS = 786.5e12
DATASHEET_BF16_FLOPS = 989.5e12

# horizon-ray's tokens per row group unless --layer-chunk says otherwise: EngineConfig.layer_chunk_tokens (a unit
# test keeps them equal); RESULTS.md names a row's row groups where they differ
LAYER_CHUNK_TOKENS = 8192
SYSTEMS = ("horizon-ray", "in-gpu-baseline", "in-gpu-liger", "in-gpu-peft", "in-gpu-peft-liger", "fsdp2-offload")
BASELINE = "in-gpu-baseline"
# The in-GPU peers a run is held against, by what it trains: (plain HF, HF with Liger-Kernel). Full
# fine-tuning against HF transformers with everything on the GPU; LoRA against HF + PEFT with the same
# adapters on a bf16 base on the GPU.
PEERS = {"full": (BASELINE, "in-gpu-liger"), "lora": ("in-gpu-peft", "in-gpu-peft-liger")}
IN_GPU = (*PEERS["full"], *PEERS["lora"])  # the whole model on the GPU, no budget
LIGER = (PEERS["full"][1], PEERS["lora"][1])  # need Liger-Kernel (Triton kernels: a GPU)
PEFT = PEERS["lora"]  # need PEFT
# horizon-ray's host update, the engine's EngineConfig.update: exact (every unit updated with the step's
# clipped gradient before the next step uses it), delayed (step n+1 runs on the weights after step n-1: the
# update overlaps a whole step), speculative (units updated as their gradients land, before the global
# norm is known, rolled back when clipping turns out active).

# ok: measured; did-not-fit: GPU or host memory ran out; timeout: killed at the time limit; error: failed
# otherwise; skipped: not attempted on this machine (the reason says why); not-run: a placeholder for a
# system the session did not run on the box.
STATUSES = ("ok", "did-not-fit", "timeout", "error", "skipped", "not-run")

REQUIRED_KEYS = (
    "system",  # one of SYSTEMS
    "status",  # one of STATUSES
    "reason",  # why status is not ok (None when it is)
    "shape",  # shape name (shapes.resolve_shape)
    "mode",  # precision mode: exact (fp32 master + fp32 AdamW state), bf16-state (bf16 master and state)
    "seq_len",  # tokens per sequence
    "tokens_per_step",  # non-padding tokens per optimizer step: seq_len x micro x accum
    "tokens_per_s",  # tokens_per_step / median step time of the timed steps
    "baseline_tokens_per_s",  # tokens/s of the plain in-GPU peer (ratio_peer) in the same run and tokens/step
    "ratio",  # tokens_per_s / baseline_tokens_per_s (1.0 for the peer itself); report.compute_ratios
    "gpu_budget_bytes",  # GPU memory the run was capped at (None: the whole GPU)
    "peak_gpu_bytes",  # torch.cuda.max_memory_allocated over the run (0 on cpu)
    "host_rss_bytes",  # resident set size of the process after the timed steps
    "planned_host_bytes",  # horizon_ray.planner.plan(...).host_bytes of these settings (horizon-ray only)
    "date",  # YYYY-MM-DD (UTC) of the run
    "box",  # machine kind: h200, cpu, ...
    "commit",  # git commit of the code that ran
)


def parse_updates(spec: str) -> list[str]:
    """--update's comma list -> the update modes in the order given, each once."""
    modes = list(dict.fromkeys(m.strip() for m in str(spec).split(",") if m.strip()))
    bad = [m for m in modes if m not in UPDATE_MODES]
    if bad or not modes:
        raise ValueError(f"--update takes a comma list of {', '.join(UPDATE_MODES)}; got {spec!r}")
    return modes


def kind(run: dict) -> str:
    """What a run trains, the key of PEERS: ``lora`` (adapters on a frozen base) or ``full``."""
    return "lora" if run.get("mode") == "lora" else "full"


class Unavailable(Exception):
    """A system this machine cannot run (a library that is not installed, no GPU): the run is recorded
    ``skipped`` with the message as its reason, never as an error."""


def unavailable(system: str, device: str, fsdp_on_cpu: bool = False) -> str | None:
    """Why ``system`` cannot run on ``device`` (cpu, cuda, cuda:N), or None. The parent asks before it starts a
    child; the child asks again (a ``--system`` run of its own). Missing libraries are found by the child."""
    if device.startswith("cuda"):
        return None
    if system in LIGER:
        return "Liger-Kernel's kernels are Triton kernels for a GPU; this machine ran on the CPU"
    if system == "fsdp2-offload" and not fsdp_on_cpu:
        return "FSDP2 CPU offload moves parameters between the host and a GPU; this machine ran on the CPU"
    return None


def throughput(tokens_per_step: int, step_s: float, flops_per_token: float) -> dict:
    """tokens/s, model TFLOP/s and MFU (against the measured and the datasheet bf16 rate)."""
    flops = flops_per_token * tokens_per_step / step_s
    return {"tokens_per_s": round(tokens_per_step / step_s, 1), "model_tflops": round(flops / 1e12, 1),
            "mfu_measured": round(flops / MEASURED_BF16_FLOPS, 4),
            "mfu_datasheet": round(flops / DATASHEET_BF16_FLOPS, 4)}


def timed_summary(step_times: list[float], warmup: int, tokens_per_step: int, flops_per_token: float) -> dict:
    """Median of the steps after the warm-up, and what follows from it."""
    timed = step_times[warmup:] or step_times
    step_s = statistics.median(timed)
    return {"step_s": round(step_s, 4), "step_times": [round(t, 4) for t in timed],
            **throughput(tokens_per_step, step_s, flops_per_token)}


def host_rss() -> int:
    """Resident set size of this process now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def host_rss_parts() -> dict[str, int]:
    """This process's RSS by kind (Linux's /proc/self/status), for a row whose RSS is off its plan: anonymous
    memory (the store, the heap, pinned buffers), file pages mapped in (the CUDA and kernel libraries' code, a
    checkpoint read through mmap) and shared memory (a multi-rank job's store)."""
    kinds = {"RssAnon:": "host_rss_anon_bytes", "RssFile:": "host_rss_file_bytes", "RssShmem:": "host_rss_shmem_bytes"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, *value = line.split()
            if name in kinds:
                out[kinds[name]] = int(value[0]) * 1024  # kB
    return out


def host_peak_rss() -> int:
    """Highest resident set size of this process so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_ram_bytes() -> int:
    """MemTotal of this machine."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


# ---- the time split of a profiled step --------------------------------------------------------------------


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of [start, end) intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def length(merged: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in merged)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def split_from_trace(events: list[dict], step_s: float) -> dict:
    """GPU compute, exposed copy and GPU idle seconds of one step from its Chrome trace (torch.profiler).

    Compute: the union of kernel and memset intervals on every stream. Exposed copy: the union of memcpy
    intervals (host <-> device, on any stream) not covered by compute: the time the step waits for PCIe.
    Idle: the rest of the step's wall time (the host is behind: a blocking optimizer wait, launch latency,
    a host sync).
    """
    compute, copies = [], []
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat = str(ev.get("cat", "")).lower()
        span = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))  # microseconds
        if cat in ("kernel", "gpu_memset"):
            compute.append(span)
        elif cat == "gpu_memcpy":
            copies.append(span)
    c, m = merge(compute), merge(copies)
    compute_s = length(c) / 1e6
    exposed_copy_s = (length(m) - overlap(c, m)) / 1e6
    return {"profiled_step_s": round(step_s, 4), "gpu_compute_s": round(compute_s, 4),
            "exposed_copy_s": round(exposed_copy_s, 4),
            "gpu_idle_s": round(max(0.0, step_s - compute_s - exposed_copy_s), 4), **kernel_tables(events),
            "idle_gaps": idle_gaps(events, step_s)}


# Gaps in a step's GPU activity by length, in microseconds: a launch's latency, the host running behind by a few
# launches, the host waiting (a fence, a sync, the optimizer).
GAP_BUCKETS = (("under 20 us", 20.0), ("20 us to 1 ms", 1e3), ("1 ms and more", float("inf")))


def idle_gaps(events: list[dict], step_s: float, top: int = 8) -> dict:
    """Where a step's GPU idle time goes: the gaps between its activity (kernels, memsets and copies on every
    stream), their seconds by GAP_BUCKETS, the time before the first and after the last activity (``edges_s``:
    the step's host work outside the GPU's), and the ``top`` longest gaps as [ms, the activity that ended it
    began, the activity after it]: many short gaps point at launch overhead, a few long ones at a wait."""
    spans = sorted((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]), str(ev.get("name", "?"))[:80])
                   for ev in events if ev.get("ph") == "X" and "dur" in ev
                   and str(ev.get("cat", "")).lower() in ("kernel", "gpu_memset", "gpu_memcpy"))
    by_bucket = dict.fromkeys((name for name, _ in GAP_BUCKETS), 0.0)
    if not spans:
        return {"by_length_s": by_bucket, "edges_s": round(step_s, 4), "longest": []}
    gaps = []
    end, last = spans[0][1], spans[0][2]
    for s, e, name in spans[1:]:
        if s > end:
            gaps.append((s - end, last, name))
        if e > end:
            end, last = e, name
    for us, _, _ in gaps:
        bucket = next(name for name, bound in GAP_BUCKETS if us < bound)
        by_bucket[bucket] += us / 1e6
    busy_s = (end - spans[0][0]) / 1e6
    return {"by_length_s": {k: round(v, 6) for k, v in by_bucket.items()},
            "edges_s": round(max(0.0, step_s - busy_s), 4),
            "longest": [[round(us / 1e3, 3), before, after] for us, before, after in sorted(gaps, reverse=True)[:top]]}


# What a kernel does, by the words of its name (the first that matches): torch's, cuBLAS', CUTLASS', FlashAttention's
# and Liger-Kernel's Triton kernels all name their work.
KERNEL_CLASSES = (
    ("cross-entropy", ("cross_entropy", "crossentropy", "nll_loss", "log_softmax")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("norm", ("rms_norm", "rmsnorm", "layer_norm", "layernorm")),
    ("RoPE", ("rope", "rotary")),
    ("activation", ("swiglu", "geglu", "silu", "gelu")),
    ("GEMM", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "grouped_mm")),
    ("optimizer", ("adam",)),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, words in KERNEL_CLASSES:
        if any(w in low for w in words):
            return cls
    return "elementwise and other"


def kernel_tables(events: list[dict], top: int = 12) -> dict:
    """The GPU kernels' summed seconds by class (KERNEL_CLASSES) and the ``top`` kernels by summed time
    ([name, seconds, launches]): where two systems' kernel time differs, by what work."""
    by_name: dict[str, list] = {}
    for ev in events:
        if ev.get("ph") == "X" and "dur" in ev and str(ev.get("cat", "")).lower() == "kernel":
            entry = by_name.setdefault(str(ev.get("name", "?")), [0.0, 0])
            entry[0] += float(ev["dur"]) / 1e6
            entry[1] += 1
    by_class: dict[str, float] = {}
    for name, (secs, _) in by_name.items():
        cls = kernel_class(name)
        by_class[cls] = by_class.get(cls, 0.0) + secs
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernel_s_by_class": {k: round(v, 4) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "top_kernels": [[name[:120], round(secs, 4), n] for name, (secs, n) in ranked]}


def peak_holders(trace: list[dict], before: int, top: int = 14) -> dict:
    """What held the GPU memory at a step's peak, from the caching allocator's history of the step (the
    ``device_traces`` of ``torch.cuda.memory._snapshot()``, recorded with Python stacks): the blocks live when
    the bytes allocated peaked, summed by the code that allocated them (``peak_site``), largest first, as
    [site, bytes, blocks]. ``before``: the bytes allocated when the recording began (the engine's own buffers),
    one holder, less what the step freed of it. The rest beyond ``top`` holders is summed as "other"."""
    now, peak, at = before, before, -1
    for i, e in enumerate(trace):
        if e.get("action") == "alloc":
            now += e["size"]
            if now > peak:
                peak, at = now, i
        elif e.get("action") == "free_completed":
            now -= e["size"]
    live: dict[int, tuple[int, str]] = {}
    kept = before  # of the blocks allocated before the recording, those not freed by the peak
    for e in trace[:at + 1]:
        if e.get("action") == "alloc":
            live[e["addr"]] = (e["size"], peak_site(e.get("frames") or []))
        elif e.get("action") == "free_completed" and live.pop(e["addr"], None) is None:
            kept -= e["size"]
    sites: dict[str, list[int]] = {}
    for size, site in live.values():
        entry = sites.setdefault(site, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    holders = [["before the step (engine buffers)", kept, 0], *([s, b, n] for s, (b, n) in ranked[:top])]
    rest = ranked[top:]
    if rest:
        holders.append(["other", sum(b for _, (b, _) in rest), sum(n for _, (_, n) in rest)])
    return {"gpu_peak_traced_bytes": peak, "gpu_peak_holders": holders}


def peak_site(frames: list[dict]) -> str:
    """Where a block was allocated, for ``peak_holders``: the innermost two frames of horizon-ray's engine
    (the innermost with its line), else the innermost Python frame; frames come innermost first. An allocation
    with no Python frame (autograd's backward thread outside Python functions) is "backward (no Python frame)"."""
    ours = [f for f in frames if "horizon_ray" in f.get("filename", "") and "/bench/" not in f["filename"]]
    if ours:
        head = f"{os.path.basename(ours[0]['filename'])}:{ours[0]['name']}:{ours[0].get('line', '?')}"
        if len(ours) > 1:
            head += f" < {os.path.basename(ours[1]['filename'])}:{ours[1]['name']}"
        return head
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    if py:
        return f"{os.path.basename(py[0]['filename'])}:{py[0]['name']}"
    return "backward (no Python frame)"


def error_reason(exc: BaseException) -> str:
    """Type and first line of an error, for the reason of a record that was not measured."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def is_out_of_memory(exc: BaseException) -> bool:
    """GPU or host memory ran out (torch.OutOfMemoryError, a failed host allocation or pinning)."""
    if type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text


def base_record(system: str, shape, *, mode: str, dtype: str, device: str, device_name: str, seq: int,
                micro: int, accum: int, checkpoint_every: int, gpu_budget_bytes: int | None,
                offload_checkpoints: str | None = None, flops_per_token: float,
                trainable_params: int | None = None, update: str | None = None) -> dict:
    """A record with every key a run reports, before it is measured (REQUIRED_KEYS first).
    ``trainable_params``: what the optimizer updates (default: every parameter, full fine-tuning);
    ``update``: horizon-ray's update mode (UPDATE_MODES; None for the peers, whose update is synchronous)."""
    rec: dict[str, Any] = {k: None for k in REQUIRED_KEYS}
    rec.update(system=system, status="ok", shape=shape.name, mode=mode, seq_len=seq,
               tokens_per_step=seq * micro * accum, gpu_budget_bytes=gpu_budget_bytes)
    rec.update(
        params=shape.num_params,  # parameters of the model (embedding, layers, head)
        # parameters the optimizer updates: all of them, or the adapters (and any trained norms) in mode lora
        trainable_params=shape.num_params if trainable_params is None and mode != "lora" else trainable_params,
        layers=shape.num_layers,
        dtype=dtype,  # compute dtype
        device=device,  # cuda | cpu: where the step ran
        device_name=device_name,  # e.g. "NVIDIA H200"
        micro=micro, accum=accum,
        checkpoint_every=checkpoint_every,  # K: a layer input kept every K layers (HF: every K-th layer)
        offload_checkpoints=offload_checkpoints,  # horizon-ray's --offload (auto | true | false)
        update=update,  # horizon-ray's --update: exact | delayed | speculative
        # the ratios' peers (report.compute_ratios): the plain peer is ratio's (baseline_tokens_per_s), the
        # Liger one ratio_liger's (liger_tokens_per_s); *_reason says why a ratio is None
        ratio_peer=None, ratio_reason=None,
        liger_tokens_per_s=None, ratio_liger=None, ratio_liger_peer=None, ratio_liger_reason=None,
        model_flops_per_token=flops_per_token,  # house convention, see shapes.model_flops_per_token
        step_s=None, step_times=[], model_tflops=None, mfu_measured=None, mfu_datasheet=None,
        exposed_optimizer_s=None,  # seconds a step blocks on the optimizer (median of the timed steps)
        optimizer_update_s=None,  # seconds of the optimizer's own work per step, overlapped or not
        gpu_compute_s=None, exposed_copy_s=None, gpu_idle_s=None, profiled_step_s=None,  # split_from_trace
        peak_gpu_active_bytes=None, peak_gpu_reserved_bytes=None, host_peak_rss_bytes=None,
        init_s=None,  # seconds to build the model (random init, pinning, sharding)
        rollbacks=None,  # horizon-ray, speculative update: rollbacks during the timed steps
        speculated_units=None,  # horizon-ray, speculative update: units its last timed step updated in the backward
    )
    return rec


def bound_line(b: dict) -> str:
    """The bound's arithmetic in one line (printed beside each benchmark row)."""
    adapters = f" + adapters' passes {b['adapter_bytes'] / 1e12:.2f} TB" if b.get("adapter_bytes") else ""
    return (f"PCIe {b['h2d_bytes'] / 1e9:.1f} GB in + {b['d2h_bytes'] / 1e9:.1f} GB out = {b.get('pcie_s', 0):.2f} s; "
            f"host update {b['host_update_bytes'] / 1e9:.1f} GB = {b.get('optimizer_s', 0):.2f} s; "
            f"GPU {b['gpu_flops'] / 1e12:.0f} TFLOP{adapters} = {b.get('compute_s', 0):.2f} s; bound: {b['bound']}")


# A step at least this share of its host update counts as waiting for all of it (steady_bound, engine_run.settling).
STEADY_SHARE = 0.95


def steady_bound(r: dict) -> float | None:
    """The most tokens/s a delayed-update row can sustain when it was timed before its pipeline was steady, or
    None. A delayed step waits for the update of the step two before it, so the first steps after a drained
    pipeline wait for less than later ones (bench/engine_run.warmup_steps; before 2026-12-05 the bench warmed up
    as many steps as --warmup said, often one). Such a row's timed steps are shorter than its host update and
    waited on it (more than 0.05 s a step: a row whose steps barely waited ran its update within the step,
    whatever update time it recorded, which could then be an earlier mode's). Steps lengthen towards the steady
    one, so the longest timed step bounds it from below."""
    update, step, times = r.get("optimizer_update_s"), r.get("step_s"), r.get("step_times")
    if (r.get("status") != "ok" or r.get("update") != "delayed" or not update or not step or not times
            or step >= STEADY_SHARE * update or (r.get("exposed_optimizer_s") or 0) <= 0.05):
        return None
    return r["tokens_per_step"] / max(times)


def outside_plan(r: dict) -> str | None:
    """Why a run that finished ran outside its own plan, or None. The GPU side of a plan is conservative and
    the budget is enforced by the allocator, so the bench runs a step whose plan asks for more GPU memory than
    the budget; such a step may run at the allocator's cap, and its time is then not the plan's to explain."""
    if r.get("status") != "ok" or r.get("plan_fits") is not False:
        return None
    why = (r.get("plan_reason") or "").removeprefix("does not fit: ").rstrip(".")
    reserved, budget = r.get("peak_gpu_reserved_bytes"), r.get("gpu_budget_bytes")
    if not (reserved and budget):
        return f"outside its plan ({why})"
    held = f"it reserved {reserved / 2**30:.2f} GiB of the {budget / 2**30:.2f} GiB budget"
    if reserved >= 0.98 * budget:  # the caching allocator freed and retried at the cap: time the plan lacks
        return f"outside its plan ({why}); {held}, at the allocator's cap, so its step time is not the plan's"
    return f"outside its plan ({why}); {held}: the plan overstated the GPU memory it needed"
