"""The parent: each system (and each horizon-ray variant) in a fresh child process, so host RAM and GPU
memory start clean and an out-of-memory death of one loses nothing of the others; then ratios against the
baseline, ``benchmarks/results/<date>-<box>-<shape>.json`` rewritten after every child, and RESULTS.md.

The parent imports no torch (it would hold host RAM the children need): it asks a short-lived child what
the device is, and plans with the pure-Python planner.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import horizon_ray
from horizon_ray.bench.child import parse_output
from horizon_ray.bench.metrics import (
    IN_GPU,
    PEERS,
    PEFT,
    SYSTEMS,
    base_record,
    bound_line,
    host_ram_bytes,
    outside_plan,
    parse_updates,
    unavailable,
)
from horizon_ray.bench.planning import largest_shape, lora_settings, planned_bytes
from horizon_ray.bench.report import compute_ratios, write_json, write_report
from horizon_ray.bench.shapes import FIND_LARGEST_SHAPES, model_flops_per_token, resolve_shape
from horizon_ray.planner.shapes import adapter_params

ROOT = Path(horizon_ray.__file__).resolve().parents[1]
HOST_OOM = ("killed by SIGKILL with no result: the host ran out of memory (the kernel's OOM killer) "
            "or something else killed it")


@dataclass
class Child:
    """What one child process left behind."""

    lines: list[str] = field(default_factory=list)  # its stdout and stderr, line by line
    returncode: int | None = None
    timed_out: bool = False  # the parent killed it at its time limit
    wall_s: float = 0.0


def run_suite(args, argv: list[str]) -> int:
    systems = _systems(args)
    shapes = _shapes(args)
    probe = _probe() if args.device == "auto" or (args.box == "auto" and args.device != "cpu") else {}
    device = args.device if args.device != "auto" else ("cuda" if probe.get("cuda") else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    box = args.box if args.box != "auto" else box_name(device, probe.get("name", ""))
    now = datetime.datetime.now(datetime.UTC)
    date = now.strftime("%Y-%m-%d")
    ctx = {"date": date, "box": box, "commit": resolve_commit(args.commit),
           "command": "python -m horizon_ray.bench " + shlex.join(argv),
           "run_id": f"{date}-{box}-{now.strftime('%H%M%S')}-{os.getpid()}",  # the invocation: ratios stay in it
           "max_grad_norm": args.max_grad_norm}
    results_dir = Path(args.results_dir)
    deadline = time.monotonic() + args.time_limit_s if args.time_limit_s else None
    print(f"bench: {', '.join(shapes)} on {device} ({box}), systems {', '.join(systems)}, commit {ctx['commit']}",
          flush=True)

    all_runs: list[dict] = []
    for shape_name in shapes:
        path = results_dir / _file_name(date, box, "find-largest" if args.find_largest else shape_name)
        prior = json.loads(path.read_text()) if path.exists() else []
        runs: list[dict] = []
        for system, mode, offload in _variants(systems, args, dtype):
            got = _run_system(system, shape_name, args, device, dtype, mode, offload, deadline)
            for r in got:
                r.update(ctx)
            runs += got
            compute_ratios(runs)
            write_json(path, prior + runs)
        all_runs += runs
        if args.find_largest and _target_failed(runs, systems):
            print(f"bench: {shape_name} did not fit; larger shapes are not tried", flush=True)
            break
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in all_runs)
    md = Path(args.results_md) if args.results_md else results_dir.parent / "RESULTS.md"
    write_report(results_dir, md)
    _summary(all_runs, md)
    return 1 if any(r["status"] in ("error", "timeout") for r in all_runs) else 0


def _run_system(system: str, shape: str, args, device: str, dtype: str, mode: str | None, offload: str | None,
                deadline: float | None) -> list[dict]:
    """One system (one horizon-ray variant, with every update mode of --update) in a child process; or why it
    did not run."""
    why = unavailable(system, device, args.fsdp_on_cpu)
    if why:
        return _placeholders(system, shape, args, device, dtype, mode, offload, "skipped", why)
    limit = args.child_timeout_s
    if deadline is not None:
        if deadline - time.monotonic() < 30:
            return _placeholders(system, shape, args, device, dtype, mode, offload, "not-run",
                                 f"the suite's --time-limit-s {args.time_limit_s:g} ran out before it started")
        limit = min(limit, deadline - time.monotonic() - 10)
    argv = child_argv(system, shape, args, device, dtype, mode, offload)
    print(f"bench: {system} {shape} {mode or ''} {offload or ''}: {shlex.join(argv)}", flush=True)
    return collect(spawn(argv, limit, system), system, shape, args, device, dtype, mode, offload)


# ---- what to run --------------------------------------------------------------------------------------------


def _systems(args) -> list[str]:
    systems = [s.strip() for s in (args.systems or ",".join(default_systems(args))).split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ValueError(f"--systems takes a comma list of {', '.join(SYSTEMS)}; got {args.systems!r}")
    return systems


def default_systems(args) -> list[str]:
    """horizon-ray and the in-GPU peers of what its modes train (PEERS: plain and Liger-Kernel; PEFT's for
    mode lora), the Liger-Kernel peer, the strongest, first: when --time-limit-s runs out before the last
    peer, the ratio left unmeasured is the weaker one. FSDP2 runs only when named. --find-largest: FSDP2 and
    the plain baseline."""
    if args.find_largest:
        return ["fsdp2-offload", PEERS["full"][0]]
    modes = [m.strip() for m in args.mode.split(",")]
    out = ["horizon-ray"]
    if any(m != "lora" for m in modes):
        out += reversed(PEERS["full"])
    if "lora" in modes:
        out += reversed(PEERS["lora"])
    return out


def _shapes(args) -> list[str]:
    if args.find_largest:
        names = [s.strip() for s in (args.shapes or ",".join(FIND_LARGEST_SHAPES)).split(",") if s.strip()]
        shapes = sorted((resolve_shape(n) for n in names), key=lambda s: s.num_params)
        return [s.name for s in shapes]
    if args.shape == "largest":
        accum = max(int(a) for a in str(args.accum).split(","))
        modes = args.mode.split(",")
        name = largest_shape(host_ram_bytes(), mode=modes[0], seq=args.seq, micro=args.micro, accum=accum,
                             checkpoint_every=args.checkpoint_every,
                             lora=lora_settings(args, modes[0], resolve_shape(FIND_LARGEST_SHAPES[0])))
        print(f"bench: the largest shape this host holds in mode {modes[0]} (planner): {name}", flush=True)
        return [name]
    return [resolve_shape(args.shape, args.layers).name]


def _variants(systems: list[str], args, dtype: str) -> list[tuple[str, str | None, str | None]]:
    """(system, precision mode, checkpoint offload): horizon-ray once per --mode x --offload value."""
    out = []
    for system in systems:
        if system == "horizon-ray":
            for mode in args.mode.split(","):
                if mode == "bf16-state" and dtype != "bfloat16":
                    raise ValueError("--mode bf16-state needs --dtype bfloat16")
                for offload in args.offload.split(","):
                    out.append((system, mode, offload))
        else:
            out.append((system, None, None))
    return out


def _target_failed(runs: list[dict], systems: list[str]) -> bool:
    """--find-largest stops at the first shape where the system it searches for (the first system that is
    not an in-GPU peer) did not fit."""
    target = next((s for s in systems if s not in IN_GPU), systems[0])
    return any(r["system"] == target and r["status"] == "did-not-fit" for r in runs)


def child_argv(system: str, shape: str, args, device: str, dtype: str, mode: str | None,
               offload: str | None) -> list[str]:
    argv = [sys.executable, "-m", "horizon_ray.bench", "--system", system, "--shape", shape,
            "--seq", str(args.seq), "--micro", str(args.micro), "--accum", str(args.accum),
            "--checkpoint-every", str(args.checkpoint_every), "--dtype", dtype, "--device", device,
            "--loss-chunk", str(args.loss_chunk), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--max-grad-norm", format(args.max_grad_norm, "g")]
    if system == "horizon-ray":
        assert mode is not None and offload is not None, "every horizon-ray variant names its mode and offload"
        argv += ["--mode", mode, "--offload", offload, "--update", ",".join(parse_updates(args.update)),
                 "--layer-chunk", str(args.layer_chunk), "--projections", args.projections]
        if args.gpu_budget_gib:
            argv += ["--gpu-budget-gib", f"{args.gpu_budget_gib:g}"]
    if mode == "lora" or system in PEFT:  # the same adapters for horizon-ray's LoRA and the PEFT peers
        argv += ["--lora-r", str(args.lora_r)] + (["--lora-targets", args.lora_targets] if args.lora_targets else [])
        if args.quantize != "none":  # horizon-ray's packed base, PEFT + bitsandbytes for the peers
            argv += ["--quantize", args.quantize]
    if system == "fsdp2-offload":
        if args.fsdp_gpu_budget_gib:
            argv += ["--fsdp-gpu-budget-gib", f"{args.fsdp_gpu_budget_gib:g}"]
        if args.fsdp_on_cpu:
            argv.append("--fsdp-on-cpu")
    if not args.profile:
        argv.append("--no-profile")
    return argv


# ---- children -----------------------------------------------------------------------------------------------


def spawn(argv: list[str], timeout_s: float, label: str) -> Child:
    """Run a child, echo its output as it comes, kill it at the time limit."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    # a streaming step allocates and frees tensors of many sizes; growing segments keep fragmentation from
    # eating a tight GPU budget (read when CUDA initialises)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    child = Child()
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)

    def pump():
        assert proc.stdout is not None, "stdout=PIPE"
        for line in proc.stdout:
            child.lines.append(line.rstrip("\n"))
            print(f"  [{label}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        child.timed_out = True
        proc.kill()
        proc.wait()
    reader.join(timeout=30)
    child.returncode = proc.returncode
    child.wall_s = time.monotonic() - t0
    return child


def collect(child: Child, system: str, shape: str, args, device: str, dtype: str, mode: str | None,
            offload: str | None) -> list[dict]:
    """The child's records, plus one for every run (accumulation, update mode) it did not report, saying
    why."""
    records, failed = parse_output(child.lines)
    if child.timed_out:
        status, reason = "timeout", f"killed after {child.wall_s:.0f} s (--child-timeout-s / --time-limit-s)"
    elif failed:
        status, reason = failed["status"], failed["reason"]
    elif child.returncode == -signal.SIGKILL:
        status, reason = "did-not-fit", HOST_OOM
    elif child.returncode != 0:
        tail = [ln for ln in child.lines if ln.strip()][-1:] or [""]
        status, reason = "error", f"exit status {child.returncode}: {tail[0][:300]}"
    else:
        status, reason = "error", "the child exited without a result for this accumulation"
    out = []
    for accum in _accums(args):
        for update in _updates(system, args):
            if (accum, update) in records:
                out.append(records[(accum, update)])
            else:
                out += _placeholders(system, shape, args, device, dtype, mode, offload, status, reason, [accum],
                                     [update])
    return out


def _accums(args) -> list[int]:
    return [int(a) for a in str(args.accum).split(",")]


def _updates(system: str, args) -> Sequence[str | None]:
    """The update modes a system's child runs: each of --update for horizon-ray, none for a peer."""
    return parse_updates(args.update) if system == "horizon-ray" else [None]


def _placeholders(system, shape_name, args, device, dtype, mode, offload, status, reason,
                  accums: list[int] | None = None, updates: list[str | None] | None = None) -> list[dict]:
    """Records of runs that did not produce one: same keys, nothing measured, status and reason."""
    shape = resolve_shape(shape_name)
    budget = None
    if system == "horizon-ray" and args.gpu_budget_gib:
        budget = int(args.gpu_budget_gib * 2**30)
    elif system == "fsdp2-offload" and args.fsdp_gpu_budget_gib:
        budget = int(args.fsdp_gpu_budget_gib * 2**30)
    if system in PEFT:
        mode = "lora"
    elif system != "horizon-ray":  # the peers' precision: what they keep their weights and AdamW state in
        mode = "exact" if system == "fsdp2-offload" or dtype != "bfloat16" else "bf16-state"
    lora = lora_settings(args, mode, shape)
    out = []
    for accum, update in [(a, u) for a in accums or _accums(args) for u in updates or _updates(system, args)]:
        rec = base_record(system, shape, mode=mode, dtype=dtype, device=device.split(":")[0],
                          device_name="", seq=args.seq, micro=args.micro, accum=accum,
                          checkpoint_every=args.checkpoint_every, gpu_budget_bytes=budget,
                          offload_checkpoints=offload, flops_per_token=model_flops_per_token(shape, args.seq),
                          trainable_params=_trainable(shape, lora), update=update)
        rec.update(status=status, reason=reason)
        if system == "horizon-ray":
            rec.update(planned_bytes(shape, mode=mode, seq=args.seq, micro=args.micro, accum=accum,
                                     checkpoint_every=args.checkpoint_every, dtype=dtype, device=device,
                                     gpu_budget_bytes=budget, loss_chunk=args.loss_chunk, offload=offload,
                                     lora=lora, layer_chunk=args.layer_chunk))
        out.append(rec)
    return out


def _trainable(shape, lora) -> int | None:
    """Parameters the run's optimizer updates: the adapters in mode lora (as the planner counts them), else
    all of them."""
    if lora is None:
        return shape.num_params
    try:
        lora.check()
        return adapter_params(lora, shape)
    except ValueError:  # settings the engine refuses too: the record says why it did not run
        return None


# ---- the machine --------------------------------------------------------------------------------------------


def _probe() -> dict:
    """Whether there is a GPU and its name, asked of a short-lived process (the parent stays torch-free)."""
    code = ("import json, torch; c = torch.cuda.is_available(); "
            "print(json.dumps({'cuda': c, 'name': torch.cuda.get_device_name(0) if c else 'cpu'}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return {"cuda": False, "name": "cpu"}


def box_name(device: str, gpu_name: str) -> str:
    """``NVIDIA H200`` -> ``h200``; ``cpu`` when the run is on the CPU."""
    if not device.startswith("cuda"):
        return "cpu"
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", gpu_name)
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"


def resolve_commit(given: str | None) -> str:
    """--commit, else $HORIZON_RAY_COMMIT, else the checkout's HEAD (``-dirty`` with uncommitted changes to
    tracked files), else ``unknown`` (the GPU box gets a copy of the tree without .git)."""
    if given:
        return given
    if os.environ.get("HORIZON_RAY_COMMIT"):
        return os.environ["HORIZON_RAY_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _file_name(date: str, box: str, what: str) -> str:
    """Only characters that travel everywhere (``qwen2.5-14b@26L`` -> ``qwen2.5-14b-26L``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{date}-{box}-{what}") + ".json"


def _summary(runs: list[dict], md: Path) -> None:
    print(f"bench: wrote {md}", flush=True)
    for r in runs:
        tps = f"{r['tokens_per_s']:,.0f} tok/s" if r.get("tokens_per_s") else r["status"]
        ratios = "".join(f" {field} {r[field]:.3f} vs {r[field + '_peer']}" for field in ("ratio", "ratio_liger")
                         if r.get(field) is not None)
        mode = r["mode"] + (f"/{r['update']}" if r.get("update") else "")
        print(f"SUMMARY {r['system']:<17} {r['shape']:<16} {mode:<18} {r['tokens_per_step']:>8,} tok/step "
              f"{tps}{ratios}" + (f" ({r['reason']})" if r.get("reason") else ""), flush=True)
        if outside := outside_plan(r):
            print(f"  PLAN {outside}", flush=True)
        if r.get("bound"):
            print(f"  BOUND planned {r.get('planned_step_s')} s/step: {bound_line(r['bound'])}", flush=True)
        if gaps := r.get("idle_gaps"):
            print(f"  IDLE {idle_line(r, gaps)}", flush=True)
        for op, shapes, calls, sec, rate in (r.get("gemm_shapes") or [])[:8]:
            print(f"  GEMM {op[6:]:<7} {' x '.join('x'.join(map(str, s)) for s in shapes):<44} {calls:>5} calls "
                  f"{sec:8.4f} s {rate if rate is not None else '-':>5} TFLOP/s", flush=True)
        for line in peak_lines(r):
            print(f"  PEAK {line}", flush=True)
        if r.get("gpu_sm_clock_mhz"):
            print(f"  GPU SM clock {r['gpu_sm_clock_mhz']:,} MHz (lowest {r['gpu_sm_clock_min_mhz']:,}), "
                  f"{r['gpu_power_w']} W, up to {r['gpu_temp_max_c']} C over the timed steps "
                  f"({r['gpu_telemetry_samples']} samples)", flush=True)


def peak_lines(r: dict) -> list[str]:
    """A profiled row's GPU peak by holder (metrics.peak_holders), against the plan's GPU items: one line
    each, in MiB."""
    if not r.get("gpu_peak_holders"):
        return []
    mib = 2**20
    items = r.get("planned_gpu_items") or {}
    plan = ", ".join(f"{k} {v / mib:,.0f}" for k, v in sorted(items.items(), key=lambda kv: -kv[1]) if v)
    lines = [f"{r['gpu_peak_traced_bytes'] / mib:,.0f} MiB allocated at the step's peak, planned "
             f"{(r.get('planned_gpu_bytes') or 0) / mib:,.0f} MiB" + (f" ({plan})" if plan else "")]
    lines += [f"{b / mib:9,.1f} MiB {n:>5} blocks  {site}" for site, b, n in r["gpu_peak_holders"]]
    return lines


def idle_line(r: dict, gaps: dict) -> str:
    """A profiled step's GPU idle time, by where it goes (metrics.idle_gaps), on one line."""
    buckets = ", ".join(f"{v:.3f} s in gaps {k}" for k, v in gaps["by_length_s"].items())
    longest = "; ".join(f"{ms} ms after {before} before {after}" for ms, before, after in gaps["longest"][:3])
    return (f"{r.get('gpu_idle_s')} s idle in the profiled step: {buckets}, {gaps['edges_s']:.3f} s before the first "
            f"and after the last GPU work; longest: {longest or 'none'}")

