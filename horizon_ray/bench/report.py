"""Result files and the markdown table: ratios against the in-GPU peers, ``benchmarks/RESULTS.md`` regenerated
from every ``benchmarks/results/*.json``. Pure Python; the output depends only on the files' contents
(never on the clock or the order files are listed in), so regenerating it twice gives the same bytes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from horizon_ray.bench.metrics import (
    IN_GPU,
    LAYER_CHUNK_TOKENS,
    PEERS,
    REQUIRED_KEYS,
    SYSTEMS,
    UPDATE_MODES,
    bound_line,
    kind,
    outside_plan,
    steady_bound,
)

GiB = 2**30
MEASURED_TFLOPS = 786.5
DATASHEET_TFLOPS = 989.5


# ---- runs ---------------------------------------------------------------------------------------------------


def missing_keys(run: dict) -> list[str]:
    return [k for k in REQUIRED_KEYS if k not in run]


def group_key(run: dict) -> tuple:
    """Runs compared with each other: one invocation of the suite (run_id), one shape, sequence length and
    number of tokens per step."""
    inv = run.get("run_id") or (run.get("date"), run.get("box"), run.get("commit"))
    return (inv, run.get("shape"), run.get("seq_len"), run.get("tokens_per_step"))


# (ratio field, the peer's tokens/s field, index in PEERS[kind]): plain in-GPU, and in-GPU with Liger-Kernel
RATIOS = (("ratio", "baseline_tokens_per_s", 0), ("ratio_liger", "liger_tokens_per_s", 1))


def compute_ratios(runs: list[dict]) -> list[dict]:
    """Set every run's ratios against the in-GPU peers of its kind (PEERS: full fine-tuning against
    in-gpu-baseline and in-gpu-liger, LoRA against in-gpu-peft and in-gpu-peft-liger) measured in its group:
    the same invocation and tokens per step (group_key). Per ratio: the peer's tokens/s, the ratio, the peer's
    name (``<ratio>_peer``) and, when the ratio is None, why (``<ratio>_reason``). In place; also returned."""
    measured: dict[tuple, float] = {}
    failed: dict[tuple, str] = {}
    for r in runs:
        key = (group_key(r), r.get("system"))
        if r.get("status") == "ok" and r.get("tokens_per_s"):
            measured[key] = r["tokens_per_s"]
        else:
            failed[key] = f"{r.get('system')} {r.get('status')}" + (f": {r['reason']}" if r.get("reason") else "")
    for r in runs:
        tps = r.get("tokens_per_s") if r.get("status") == "ok" else None
        for field, peer_field, i in RATIOS:
            peer = PEERS[kind(r)][i]
            key = (group_key(r), peer)
            base = measured.get(key)
            r[peer_field] = base
            r[field] = round(tps / base, 3) if base and tps else None
            r[f"{field}_peer"] = peer
            if r[field] is not None:
                r[f"{field}_reason"] = None
            elif not tps:
                r[f"{field}_reason"] = f"this run was not measured ({r.get('status')})"
            else:
                r[f"{field}_reason"] = failed.get(key) or (
                    f"{peer} was not run in this invocation at {r.get('tokens_per_step') or 0:,} tokens per step")
    return runs


def load_results(results_dir: str | Path) -> list[tuple[str, dict]]:
    """(file name, run) of every run of every ``*.json`` in the directory."""
    out = []
    for path in sorted(Path(results_dir).glob("*.json")):
        runs = json.loads(path.read_text())
        if not isinstance(runs, list):
            raise ValueError(f"{path}: a result file holds a JSON list of runs")
        for r in runs:
            bad = missing_keys(r)
            if bad:
                raise ValueError(f"{path}: a run lacks {bad}; every run carries {list(REQUIRED_KEYS)}")
            out.append((path.name, r))
    return out


def write_json(path: Path, runs: list[dict]) -> None:
    """Atomically: a reader never sees half a file, a crash never leaves one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(runs, indent=1) + "\n")
    os.replace(tmp, path)


def merge_results(src_dir: str | Path, dst_dir: str | Path) -> int:
    """Add the runs of every result file of ``src_dir`` (e.g. what a GPU box wrote to $OUT) to the file of
    the same name in ``dst_dir``, keeping the runs already there; a run present in both is kept once.
    Returns the number of runs added."""
    added = 0
    for src in sorted(Path(src_dir).glob("*.json")):
        new = json.loads(src.read_text())
        for r in new:
            bad = missing_keys(r)
            if bad:
                raise ValueError(f"{src}: a run lacks {bad}")
        dst = Path(dst_dir) / src.name
        old = json.loads(dst.read_text()) if dst.exists() else []
        seen = {json.dumps(r, sort_keys=True) for r in old}
        fresh = [r for r in new if json.dumps(r, sort_keys=True) not in seen]
        if fresh:
            write_json(dst, old + fresh)
            added += len(fresh)
    return added


# ---- the markdown -------------------------------------------------------------------------------------------


def _gib(b) -> str:
    return "—" if b is None else f"{b / GiB:.1f}"


def _num(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _system_label(r: dict) -> str:
    return r["system"] + (" (ran on cpu)" if r.get("device") == "cpu" else "")


def _mode_label(r: dict) -> str:
    if r.get("device") == "cpu":
        return r["mode"]
    if r["system"] == "horizon-ray":
        off = r.get("offload_checkpoints") or "auto"
        resolved = r.get("offload_resolved")
        where = {True: "host", False: "GPU", None: "auto"}[resolved] if off == "auto" else \
            {"true": "host", "false": "GPU"}.get(str(off), str(off))
        label = f"{r['mode']}, ckpt {where}" + (" (auto)" if off == "auto" and resolved is not None else "")
        rows = r.get("layer_chunk_tokens")
        if rows is not None and rows != LAYER_CHUNK_TOKENS:
            label += f", rows {rows}"
        label += ", split GEMMs" if r.get("projections") == "split" else ""
        # a CUDA run without Liger-Kernel installed falls back to unfused torch ops: a row of its own, not the
        # newest of the fused ones
        return label + (", torch kernels" if r.get("kernels") == "torch" else "")
    if r["system"] in IN_GPU:
        return f"{r['mode']}, all on GPU"
    return f"{r['mode']}, host offload"


# --max-grad-norm at or above which the bench's speculative rows count as run without clipping (they pass 1e9)
SPECULATION_NORM = 1e6


def _update_label(r: dict) -> str:
    """horizon-ray's update mode; rows from before the flag ran the only one the engine had, exact."""
    if r["system"] != "horizon-ray":
        return "—"
    update = r.get("update") or "exact"
    if update != "speculative":
        return update
    norm = r.get("max_grad_norm")
    if norm is None:  # rows from before the record kept the norm: they clipped at 1 where they rolled back
        return f"{update}, rolled back" if r.get("rollbacks") else update
    # the speculative update is exact AdamW's only while clipping stays inactive: a step that clips is rolled back,
    # and the step after one that clipped does not speculate (it runs as exact)
    return f"{update}, clip at {norm:g}" if norm < SPECULATION_NORM else f"{update}, clipping off"


def _peers_label(r: dict) -> str:
    """The peers of the row's ratios (the fields compute_ratios sets; PEERS for rows that lack them)."""
    plain, liger = PEERS[kind(r)]
    return f"{r.get('ratio_peer') or plain} / {r.get('ratio_liger_peer') or liger}"


def _sorted(items: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Newest date first; then box, file, invocation, size, sequence, tokens per step, system, mode."""
    def rest(item):
        name, r = item
        order = SYSTEMS.index(r["system"]) if r["system"] in SYSTEMS else len(SYSTEMS)
        update = UPDATE_MODES.index(r["update"]) if r.get("update") in UPDATE_MODES else -1
        return (r.get("box") or "", name, r.get("run_id") or "", r.get("params") or 0, r.get("seq_len") or 0,
                r.get("tokens_per_step") or 0, order, _mode_label(r), update, json.dumps(r, sort_keys=True))

    out = sorted(items, key=rest)
    out.sort(key=lambda item: item[1].get("date") or "", reverse=True)  # stable: keeps the rest's order
    return out


def _trainable(r: dict) -> int | None:
    """Parameters the run's optimizer updated. Records before ``trainable_params`` existed: every parameter
    when the run fine-tuned fully, unknown for LoRA."""
    if r.get("trainable_params") is not None:
        return r["trainable_params"]
    return None if r.get("mode") == "lora" else r.get("params")


def _bound(r: dict, base: dict | None) -> str:
    """One paragraph: what sets this row's step time, from its measured fields."""
    step, upd, exp = r.get("step_s"), r.get("optimizer_update_s"), r.get("exposed_optimizer_s")
    parts = []
    bound = "GPU compute"
    if r["system"] in IN_GPU:
        where = "the CPU (a smoke test, not a GPU number)" if r.get("device") == "cpu" else "the GPU"
        parts.append(f"everything is resident on {where}")
        if r.get("liger"):
            parts.append(f"Liger-Kernel {r['liger']}'s RoPE, RMSNorm, SwiGLU and fused linear cross-entropy")
        if r.get("lora_r"):
            targets = ", ".join(r.get("lora_targets") or [])
            parts.append(f"PEFT {r.get('peft') or ''} LoRA rank {r['lora_r']} on {targets}, fp32 adapters on a "
                         "frozen base")
        if upd is not None and step:
            parts.append(f"the fused AdamW takes {upd:.2f} s of the {step:.2f} s step")
    else:
        if upd is not None and exp is not None and step:
            n = _trainable(r)
            overlap = "the next step's forward waits for it" if r["system"] == "horizon-ray" else "not overlapped"
            what = f"{n / 1e9:.2f} G params in {upd:.2f} s ({n / upd / 1e9 if upd else 0:.2f} G params/s)" \
                if n is not None else f"the adapters in {upd:.2f} s"
            parts.append(f"the host AdamW updates {what}; {exp:.2f} s of the {step:.2f} s step is exposed "
                         f"({overlap})")
            if exp >= 0.25 * step:
                bound = "the host optimizer"
            if r.get("kernels"):
                parts.append(f"the layer template ran {r['kernels']} kernels")
            if r.get("rollbacks"):
                parts.append(f"{r['rollbacks']} speculative updates were rolled back in the timed steps")
            if r.get("speculated_units") is not None:
                parts.append(f"its last timed step updated {r['speculated_units']} units during its backward")
            if base and base.get("step_s"):
                rest = step - exp
                whose = "the in-GPU baseline's" if base["system"] == PEERS["full"][0] else f"{base['system']}'s"
                parts.append(f"the rest of the step, {rest:.2f} s, is {rest / base['step_s']:.2f}x {whose} whole "
                             f"step ({base['step_s']:.2f} s) at the same tokens per step")
    if r.get("gpu_compute_s") is not None:
        x = r.get("exposed_copy_s") or 0.0
        parts.append(f"a profiled step of {r['profiled_step_s']:.2f} s had {r['gpu_compute_s']:.2f} s of GPU "
                     f"compute, {x:.2f} s of exposed copies and {r.get('gpu_idle_s') or 0:.2f} s of GPU idle")
        if bound == "GPU compute" and step and x >= 0.25 * r["profiled_step_s"]:
            bound = "PCIe copies"
    elif r["system"] not in IN_GPU and r.get("device") != "cpu":
        parts.append("GPU compute and exposed copies were not split (no profiled step)")
    if r.get("model_tflops") is not None and r.get("device") != "cpu":
        parts.append(f"{r['model_tflops']:.1f} model TFLOP/s ({r['model_tflops'] / MEASURED_TFLOPS:.1%} of "
                     f"{MEASURED_TFLOPS})")
    if r.get("planned_host_bytes") and r.get("host_rss_bytes"):
        rss, planned = r["host_rss_bytes"], r["planned_host_bytes"]
        against = r.get("rss_plan_host_bytes") or planned
        if against == planned:
            parts.append(f"host RSS {rss / GiB:.1f} GiB against {planned / GiB:.1f} GiB planned "
                         f"({rss / planned - 1:+.1%})")
        else:  # a larger step ran before in the same process and its buffers stayed resident
            tokens = r.get("rss_plan_tokens_per_step") or 0
            parts.append(f"host RSS {rss / GiB:.1f} GiB against {against / GiB:.1f} GiB planned for the "
                         f"{tokens:,}-token step that ran before it in the same process "
                         f"({rss / against - 1:+.1%}; this step's own plan: {planned / GiB:.1f} GiB)")
        if rss > 1.01 * against and r.get("host_rss_file_bytes") is not None:
            # what the plan's buffers are not: code and files mapped in, and heap malloc holds free
            free = r.get("host_heap_free_bytes")
            parts.append(f"of that RSS, {r['host_rss_file_bytes'] / GiB:.2f} GiB were mapped files"
                         + (f", and malloc's free lists held {free / GiB:.2f} GiB (resident or not)"
                            if free is not None else ""))
    if r.get("planned_gpu_bytes") and r.get("peak_gpu_bytes"):
        parts.append(f"peak GPU {r['peak_gpu_bytes'] / GiB:.1f} GiB allocated against "
                     f"{r['planned_gpu_bytes'] / GiB:.1f} GiB planned")
    if outside := outside_plan(r):
        parts.append(f"it ran {outside}")
    if r.get("device") == "cpu":
        bound = "the CPU"
    recorded = r.get("bound")
    if isinstance(recorded, dict):  # the planner's roofline for the run (bench/planning.bound_arithmetic)
        parts.append(f"the plan's arithmetic: {bound_line(recorded)}")
        if bound == "GPU compute" and r.get("gpu_compute_s") is None and recorded.get("bound"):
            bound = f"{recorded['bound']}, by the plan's roofline (no profiled step)"  # measured nothing better
    elif recorded:  # a diagnosis the fields cannot show (e.g. found after the run), recorded with the run itself
        bound = recorded
    if steady := steady_bound(r):
        parts.append(f"its timed steps ({', '.join(f'{t:.2f}' for t in r.get('step_times') or [])} s) were "
                     f"shorter than its host update ({r['optimizer_update_s']:.2f} s) and waited for it: timed "
                     f"before the pipeline was steady, its tokens/s overstates the run; steps lengthen towards the "
                     f"steady one, so it sustains at most {steady:,.0f} tok/s (its longest timed step)")
    if r.get("note"):
        parts.append(r["note"])
    return f"Bound by {bound}: " + "; ".join(parts) + "."


def render(results_dir: str | Path) -> str:
    """RESULTS.md from every result file of the directory."""
    items = _sorted(load_results(results_dir))
    runs = [r for _, r in items]
    compute_ratios(runs)
    ok = [(n, r) for n, r in items if r.get("status") == "ok"]
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m horizon_ray.bench --report` from `benchmarks/results/*.json`: edit or add the "
        "JSON, then regenerate; do not edit this file by hand. How to run the suite: `benchmarks/README.md`.",
        "",
        "House convention: tokens/s counts non-padding tokens; model FLOPs = 6 N tokens "
        "+ 6 L heads head_dim seq tokens (N: the weights of the layers' projections and the LM head; causal "
        "attention, forward and backward; recompute not counted); MFU against the H200's measured 786.5 "
        "TFLOP/s bf16 rate and the 989.5 datasheet rate. **ratio** and **ratio_liger** = tokens/s over the "
        "tokens/s of the plain and the Liger-Kernel in-GPU peer (**vs**) measured in the same invocation at the "
        "same tokens per step: full fine-tuning against in-gpu-baseline / in-gpu-liger, LoRA against "
        "in-gpu-peft / in-gpu-peft-liger; — where that peer was not measured (the row's note says why when it "
        "ran and was not). The in-GPU peers keep everything on the GPU: in-gpu-baseline weights, gradients and "
        "AdamW state in bf16 (bf16-state), in-gpu-liger the same with Liger-Kernel's kernels, in-gpu-peft a "
        "bf16 base with fp32 PEFT adapters, in-gpu-peft-liger that with Liger-Kernel; horizon-ray and FSDP2 keep "
        "an fp32 master and fp32 AdamW state on the host (exact). **update**: horizon-ray's host update (exact; "
        "delayed: step n+1 runs on the weights after step n-1; speculative: units updated before the global "
        "norm is known, rolled back when clipping acts; the label says the clipping its run had, and a step "
        "after one that clipped runs as exact); rows from before the choice existed are exact. peak "
        "GPU: torch's max_memory_allocated; budget: the cap the run was held to (— = the whole GPU); host RSS "
        "after the timed steps; planned host: horizon_ray.planner.plan of the same settings; exposed opt: "
        "seconds a step waits for the optimizer.",
        "",
        *_matrix(ok),  # each setting's newest row, citing the rows of the table below
        "| # | date | box | commit | system | shape | mode | update | seq | tokens/step | tokens/s | ratio "
        "| ratio_liger | vs | model TFLOP/s | MFU (786.5) | MFU (989.5) | peak GPU GiB | budget GiB "
        "| host RSS GiB | planned host GiB | exposed opt s |",
        "|" + "---|" * 22,
    ]
    for i, (_, r) in enumerate(ok, 1):
        gpu = r.get("device") != "cpu"
        lines.append("| " + " | ".join([
            str(i), r.get("date") or "—", r.get("box") or "—", f"`{r.get('commit') or '—'}`", _system_label(r),
            r["shape"], _mode_label(r), _update_label(r), str(r["seq_len"]), f"{r['tokens_per_step']:,}",
            _num(r.get("tokens_per_s"), ",.0f"), _num(r.get("ratio"), ".3f"), _num(r.get("ratio_liger"), ".3f"),
            _peers_label(r), _num(r.get("model_tflops"), ".1f"),
            _num(r.get("mfu_measured"), ".1%") if gpu else "—", _num(r.get("mfu_datasheet"), ".1%") if gpu else "—",
            _gib(r.get("peak_gpu_bytes")) if gpu else "—", _gib(r.get("gpu_budget_bytes")),
            _gib(r.get("host_rss_bytes")), _gib(r.get("planned_host_bytes")), _num(r.get("exposed_optimizer_s"), ".2f"),
        ]) + " |")
    if not ok:
        lines.append("| — | no measured run yet |" + " |" * 20)
    lines += ["", "## What bounds each row", ""]
    measured = {(group_key(r), r["system"]): r for r in runs if r.get("status") == "ok"}
    attempted = {(group_key(r), r["system"]) for r in runs}
    for i, (_, r) in enumerate(ok, 1):
        plain = PEERS[kind(r)][0]
        base = None if r["system"] in IN_GPU else measured.get((group_key(r), plain))
        update = f", {r['update']} update" if r.get("update") else ""
        # a peer that ran in the invocation and was not measured: say why the ratio is missing
        missing = "".join(f" No {field}: {r[f'{field}_reason']}." for field, _, j in RATIOS
                          if r.get(field) is None and (group_key(r), PEERS[kind(r)][j]) in attempted)
        lines.append(f"- **#{i}** {_system_label(r)}, {r['shape']}, {_mode_label(r)}{update}, "
                     f"{r['tokens_per_step']:,} tokens/step. {_bound(r, base)}{missing}")
    lines += _not_measured(items) + _largest(items) + _commands(items)
    return "\n".join(lines).rstrip() + "\n"


def _started(r: dict) -> tuple[str, str]:
    """When the row's invocation started, as far as its record says: its date, and the time of day its run_id
    carries (``<date>-<box>-HHMMSS-<pid>``; "" for ids without one, which rank below the same date's timed ids)."""
    m = re.fullmatch(r"\d{4}-\d\d-\d\d-.+-(\d{6})-\d+", r.get("run_id") or "")
    return r.get("date") or "", m.group(1) if m else ""


def _newest(ok: list[tuple[str, dict]]) -> list[tuple[tuple, tuple[int, dict]]]:
    """Per box, shape, method and its settings, update, base, sequence, GPU budget and tokens per step: horizon-ray's
    newest measured row on a GPU and its number in the table of every row, in the matrix's order (box, then the
    shape's parameters). Two rows of one invocation and setting: the first in the table's order."""
    newest: dict[tuple, tuple[int, dict]] = {}
    for i, (_, r) in enumerate(ok, 1):
        if r["system"] != "horizon-ray" or r.get("device") == "cpu":
            continue
        mode = _mode_label(r) + (f", r{r['lora_r']}" if r.get("mode") == "lora" and r.get("lora_r") else "")
        key = (r.get("box") or "", r["shape"], mode, _update_label(r), r.get("quantize") or "none",
               r["seq_len"], _gib(r.get("gpu_budget_bytes")), r["tokens_per_step"])
        held = newest.get(key)
        if held is None or _started(r) > _started(held[1]):
            newest[key] = (i, r)
    return sorted(newest.items(), key=lambda kv: (kv[0][0], kv[1][1].get("params") or 0, kv[0][1:]))


def _matrix(ok: list[tuple[str, dict]]) -> list[str]:
    """The newest rows (``_newest``) with their ratios to the peers of their own invocation and what their plan
    said of their step and host RSS."""
    ordered = _newest(ok)
    if not ordered:
        return []
    out = ["## The matrix: each setting's newest row on a GPU", "",
           "horizon-ray's newest measured row for each box, shape, mode (with its settings and LoRA rank), update, "
           "base, sequence, GPU budget and tokens per step; its "
           "ratios are against the peers of the same invocation (full fine-tuning: HF in-GPU plain and with "
           "Liger-Kernel; LoRA: PEFT plain and with Liger-Kernel), its plan is the planner's at the row's commit. "
           "**row**: the row of the table below, whose paragraph in \"What bounds each row\" says what bounds it. "
           "budget: the GPU memory the run was held to (— = the whole GPU). **steady <=**: a delayed-update row "
           "timed before its pipeline was steady (its steps shorter than its host update, and waiting for it); the "
           "most it sustains is its tokens per step over its longest timed step.",
           "",
           "| box | shape | mode | update | base | seq | budget GiB | tokens/step | tokens/s | vs plain peer "
           "| vs Liger peer | step s (planned) | host RSS GiB (planned) | row | commit |",
           "|" + "---|" * 15]
    for (box, shape, mode, update, base, seq, budget, tokens), (i, r) in ordered:
        planned_rss = r.get("rss_plan_host_bytes") or r.get("planned_host_bytes")
        steady = steady_bound(r)
        scale = steady / r["tokens_per_s"] if steady else None
        out.append("| " + " | ".join([
            box or "—", shape, mode, update, base, str(seq), budget, f"{tokens:,}",
            _capped(r.get("tokens_per_s"), ",.0f", scale),
            _capped(r.get("ratio"), ".3f", scale), _capped(r.get("ratio_liger"), ".3f", scale),
            f"{_num(r.get('step_s'), '.3f')} ({_num(r.get('planned_step_s'), '.3f')})",
            f"{_gib(r.get('host_rss_bytes'))} ({_gib(planned_rss)})", f"#{i}", f"`{r.get('commit') or '—'}`",
        ]) + " |")
    return out + [""] + _planner_check(ordered) + ["## Every row", ""]


def _planner_check(ordered: list[tuple[tuple, tuple[int, dict]]]) -> list[str]:
    """The matrix's rows planned again by this commit's planner (planning.replan): its step time against the
    measured one and the plan's of the row's own commit, and its GPU bytes against the peak the row allocated."""
    from horizon_ray.bench.planning import replan

    out = ["## The planner of this commit against the matrix", "",
           "Each row of the matrix planned again with the planner of the commit that generated this file "
           "(`horizon_ray.bench.planning.replan`: the row's settings), beside what the row measured and what the "
           "plan of its own commit said. **step now / measured**: above 1 the plan is slower than the engine ran, "
           "below 1 the engine ran slower than the plan allows. **GPU**: the plan's GPU bytes (CUDA context and "
           "allocator slack included) against the row's peak GPU memory held (`gpu_held`: torch's "
           "max_memory_allocated, or its active bytes where the row recorded them, which count a freed block "
           "until the allocator may reuse it); **fits**: whether the plan "
           "takes the row's GPU budget and host.", "",
           "| row | shape | mode | update | tokens/step | step s | planned then | planned now | now / measured "
           "| bound now | peak GPU GiB | planned GPU GiB | planned / peak | fits |",
           "|" + "---|" * 14]
    for (_, shape, mode, update, _, _, _, tokens), (i, r) in ordered:
        try:
            now = replan(r)
        except Exception:  # a record whose settings this commit no longer plans: say so, keep the table
            now = None
        if not now or now.get("planned_step_s") is None:
            out.append(f"| #{i} | {shape} | {mode} | {update} | {tokens:,} | {_num(r.get('step_s'), '.3f')} "
                       f"| {_num(r.get('planned_step_s'), '.3f')} | — | — | — | — | — | — | — |")
            continue
        peak, gpu = gpu_held(r), now["planned_gpu_bytes"]
        fits = now.get("plan_fits")
        out.append("| " + " | ".join([
            f"#{i}", shape, mode, update, f"{tokens:,}", _num(r.get("step_s"), ".3f"),
            _num(r.get("planned_step_s"), ".3f"), f"{now['planned_step_s']:.3f}",
            _num(now["planned_step_s"] / r["step_s"] if r.get("step_s") else None, ".2f"),
            (now.get("bound") or {}).get("bound") or "—", _gib(peak), _gib(gpu),
            _num(gpu / peak if peak else None, ".2f"), "yes" if fits else "no" if fits is False else "—",
        ]) + " |")
    return out + [""]


def _capped(x, fmt: str, scale: float | None) -> str:
    """A number of the matrix; for a row timed before it was steady (scale: the most it sustains over what it
    measured), that most beside it."""
    return _num(x, fmt) + (f" (steady <= {x * scale:{fmt}})" if scale and x is not None else "")


def _not_measured(items) -> list[str]:
    groups: dict[tuple, list[int]] = {}
    for _, r in items:
        if r.get("status") != "ok":
            mode = _mode_label(r) + (f", {r['update']} update" if r.get("update") else "")
            key = (r.get("date") or "", r.get("box") or "", r["shape"], _system_label(r), mode, r["status"],
                   r.get("reason") or "")
            groups.setdefault(key, []).append(r.get("tokens_per_step") or 0)
    out = ["", "## Not measured", ""]
    for (date, box, shape, system, mode, status, reason), tokens in groups.items():
        toks = " and ".join(f"{t:,}" for t in sorted(set(tokens)))
        out.append(f"- {date} {box} {shape}, {system} ({mode}; {toks} tokens/step): **{status}**"
                   + (f": {reason}" if reason else ""))
    if not any(r["system"] == "fsdp2-offload" and r.get("status") == "ok" and r.get("device") != "cpu"
               for _, r in items):
        out.append("- No FSDP2 CPU-offload numbers from a GPU exist yet; `benchmarks/README.md` has the command "
                   "that measures them.")
    return out if len(out) > 3 else []


def _largest(items) -> list[str]:
    """Per box and system: the largest shape that ran and the smallest that did not fit."""
    ran: dict[tuple, tuple] = {}
    failed: dict[tuple, tuple] = {}
    for _, r in items:
        key = (r.get("box") or "", _system_label(r))
        size = (r.get("params") or 0, r["shape"])
        if r.get("status") == "ok":
            ran[key] = max(ran.get(key, size), size)
        elif r.get("status") == "did-not-fit":
            failed[key] = min(failed.get(key, size), size)
    if not ran and not failed:
        return []
    out = ["", "## Largest shape per box and system", "",
           "| box | system | largest that ran | params | smallest that did not fit | params |",
           "|---|---|---|---|---|---|"]
    for key in sorted(set(ran) | set(failed)):
        r, f = ran.get(key), failed.get(key)
        out.append(f"| {key[0]} | {key[1]} | {r[1] if r else '—'} | {f'{r[0] / 1e9:.2f}B' if r else '—'} | "
                   f"{f[1] if f else '—'} | {f'{f[0] / 1e9:.2f}B' if f else '—'} |")
    return out


def _commands(items) -> list[str]:
    per_file: dict[str, set] = {}
    for name, r in items:
        if r.get("command"):
            per_file.setdefault(name, set()).add((r.get("commit") or "—", r["command"]))
    out = ["", "## Commands", ""]
    for name in sorted(per_file):
        for commit, command in sorted(per_file[name]):
            out.append(f"- `results/{name}` (commit `{commit}`): `{command}`")
    return out


def gpu_held(r: dict) -> int | None:
    """The GPU memory a row held at its peak: the allocator's active bytes where the row recorded them (a block
    another stream used stays held after its tensor's free until the GPU has passed it), else
    ``max_memory_allocated``, which rows from before 2026-12-05 recorded alone."""
    return max(r.get("peak_gpu_bytes") or 0, r.get("peak_gpu_active_bytes") or 0) or None


def write_report(results_dir: str | Path, md_path: str | Path) -> Path:
    md_path = Path(md_path)
    text = render(results_dir)
    tmp = md_path.with_name(md_path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, md_path)
    return md_path
