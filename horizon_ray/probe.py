"""Measure the ceilings the planner plans a node with, on the node itself, in seconds.

    probe = cached_probe()          # $HORIZON_RAY_HOME/probe.json, measured now if absent or of another machine
    probe.ceilings()                # planner.Ceilings: the measured fields in place of the defaults
    horizon-ray probe [--refresh] [--json]

What it measures (each the best of a few repetitions: a ceiling is what the machine can do, and a loaded
machine only ever adds time):
- ``cpu_flops``: the engine itself training a small reference model on the CPU (``REFERENCE_MODEL``, 1,024
  tokens a step), the planner's FLOP count of that step divided by its seconds less the update's. This is the
  rate a CPU job's step time is planned with: small layers never reach the GEMM rate, and the engine's
  elementwise work and per-layer overheads count in it as they do in a job;
- ``cpu_matmul_flops``: an fp32 GEMM of 1024^3 on the host's cores (shown beside it, not planned with);
- ``adam_params_per_s``: torch's fused CPU AdamW over 16 M fp32 parameters (28 bytes a parameter, the
  traffic ``Ceilings.adam_bytes_per_param`` counts);
- with a CUDA GPU: ``matmul_flops`` (a bf16 GEMM of 8192^3), ``h2d_bytes_per_s`` / ``d2h_bytes_per_s``
  (pinned 512 MiB copies), ``duplex_bytes_per_s`` (both at once, on two streams; also the node's
  ``host_copy_bytes_per_s`` for its one GPU), ``adam_params_per_s_with_copies`` (the AdamW while duplex copies
  run).
Nothing else is measured: ``compute_efficiency`` stays the value calibrated on the H200 box, and a plan lists
every ceiling it took from the defaults as assumed.

The node agent runs ``python -m horizon_ray probe --json`` once when it starts (a child process: the agent
never imports torch) and reports the result with its node; the cache makes later starts free. The cache
belongs to a machine: its fingerprint (host, CPU model, the cores torch may use, GPUs, torch and probe
versions) must match, or the probe runs again.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from horizon_ray.home import horizon_home

PROBE_VERSION = 1
CACHE_NAME = "probe.json"

# A small Llama-style model: two layers of a width CPU jobs run at, 1,024 tokens a step, each row packed with
# four documents as the runner packs them (training.packing, the default): the masked attention path.
REFERENCE_MODEL: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "_name_or_path": "probe-reference",
}
REFERENCE_BATCH = (8, 128)  # micro-batch size, sequence length: one micro-batch a step
REFERENCE_DOCUMENT = 32  # tokens of each packed document


@dataclass
class Probe:
    """One node's measured ceilings."""

    values: dict[str, float]  # Ceilings field -> measured rate
    details: dict[str, str]  # field -> what was measured
    machine: dict[str, Any]  # the fingerprint the cache is valid for
    seconds: float  # how long the probe took
    time: float = field(default_factory=time.time)  # when (unix seconds)

    def ceilings(self):
        """The planner's Ceilings of this node: the measured fields, the defaults for the rest."""
        from horizon_ray.planner.node import Ceilings

        return Ceilings.from_measured(self.values, source=self.source)

    @property
    def source(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.time))
        return f"probe of {self.machine.get('host', '?')} at {when}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Probe:
        return cls(values={k: float(v) for k, v in d["values"].items()}, details=dict(d.get("details") or {}),
                   machine=dict(d["machine"]), seconds=float(d.get("seconds", 0.0)), time=float(d["time"]))

    def wire(self) -> dict[str, Any]:
        """What a node agent reports with its node (NodeInfo.ceilings), as NodeSpec.from_node_info reads it."""
        return {"values": dict(self.values), "source": self.source}


def machine_fingerprint() -> dict[str, Any]:
    """What the measured rates depend on; a cache of another fingerprint is measured again."""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {"host": socket.gethostname(), "cpu": _cpu_model(), "threads": torch.get_num_threads(),
            "gpus": gpus, "torch": torch.__version__, "probe_version": PROBE_VERSION}


def probe_path() -> Path:
    """``$HORIZON_RAY_HOME/probe.json``."""
    return horizon_home() / CACHE_NAME


def cached_probe(path: str | Path | None = None, *, refresh: bool = False,
                 log: Callable[[str], None] | None = None) -> Probe:
    """The cached probe of this machine, measured (and cached) now when there is none, it is of another
    machine, or `refresh`. Concurrent callers (the agents of simulated nodes on one machine) wait for the one
    that measures, so that they never measure each other's load."""
    path = Path(path) if path is not None else probe_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fingerprint = machine_fingerprint()
        if not refresh and path.is_file():
            try:
                found = Probe.from_dict(json.loads(path.read_text()))
                if found.machine == fingerprint:
                    return found
            except (ValueError, KeyError, TypeError):
                pass  # an older or torn cache: measure again
        probe = run_probe(log=log)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(probe.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)
        return probe


def run_probe(*, log: Callable[[str], None] | None = None) -> Probe:
    """Measure this machine now (seconds on a CPU, a few more with a GPU)."""
    import torch

    say = log or (lambda _msg: None)
    t0 = time.perf_counter()
    values: dict[str, float] = {}
    details: dict[str, str] = {}
    threads = torch.get_num_threads()

    say("fp32 GEMM on the CPU")
    values["cpu_matmul_flops"] = _cpu_gemm(1024)
    details["cpu_matmul_flops"] = f"fp32 GEMM 1024^3 on {threads} threads"

    say("torch's fused CPU AdamW")
    values["adam_params_per_s"] = _cpu_adamw(16 * 2**20)
    details["adam_params_per_s"] = f"torch fused CPU AdamW, 16 M fp32 parameters, {threads} threads"

    say("the engine on a small reference model")
    values["cpu_flops"] = _engine_cpu_flops(values["adam_params_per_s"])
    b, t = REFERENCE_BATCH
    details["cpu_flops"] = (f"the engine's CPU step of a {REFERENCE_MODEL['num_hidden_layers']}-layer, hidden "
                            f"{REFERENCE_MODEL['hidden_size']} model at {b} x {t} packed tokens: the planner's "
                            "FLOPs over its seconds less the update's")

    if torch.cuda.is_available():
        say("the GPU: bf16 GEMM, pinned copies, AdamW under copies")
        values.update(_gpu_rates(values["adam_params_per_s"]))
        name = torch.cuda.get_device_name(0)
        details.update({
            "matmul_flops": f"bf16 GEMM 8192^3 on {name}",
            "h2d_bytes_per_s": "pinned 512 MiB host -> device",
            "d2h_bytes_per_s": "pinned 512 MiB device -> host",
            "duplex_bytes_per_s": "both directions at once on two streams, in total",
            "host_copy_bytes_per_s": "the duplex rate (one GPU's copies)",
            "adam_params_per_s_with_copies": "the fused CPU AdamW while duplex copies run",
        })
    return Probe(values=values, details=details, machine=machine_fingerprint(),
                 seconds=round(time.perf_counter() - t0, 2))


# ---- measurements --------------------------------------------------------------------------------------------


def _best_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _cpu_gemm(n: int) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    reps = 3
    seconds = _best_seconds(lambda: [torch.mm(a, b, out=out) for _ in range(reps)], repeats=5)
    return 2 * n**3 * reps / seconds


def _cpu_adamw(n: int) -> float:
    import torch

    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    seconds = _best_seconds(opt.step, repeats=5, warmup=2)
    del opt, p
    return n / seconds


def _engine_cpu_flops(adam_params_per_s: float) -> float:
    """The planner's FLOPs of the reference step over the engine's seconds for it, less its update's."""
    import torch

    from horizon_ray.engine import Engine, EngineConfig
    from horizon_ray.planner import plan

    b, t = REFERENCE_BATCH
    cfg = EngineConfig(device="cpu", compute_dtype="float32", seed=0)
    eng = Engine.from_config(dict(REFERENCE_MODEL), cfg)
    try:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, REFERENCE_MODEL["vocab_size"], (b, t), generator=gen)
        positions = torch.arange(t).remainder(REFERENCE_DOCUMENT).expand(b, t).contiguous()
        batch = [(ids, ids.clone(), positions)]
        seconds = _best_seconds(lambda: eng.train_step(batch), repeats=6, warmup=2)
        params = eng.num_params
    finally:
        eng.close()
    p = plan(REFERENCE_MODEL, seq_len=t, micro_batch_size=b, grad_accum=1, checkpoint_every=cfg.checkpoint_every,
             loss_chunk_tokens=cfg.loss_chunk_tokens, device="cpu", compute_dtype="float32", packed=True,
             suggest=False)
    flops = p.timing["fwd_flops"] + p.timing["bwd_flops"]
    update = params / adam_params_per_s
    return flops / max(seconds - update, seconds / 10)


def _gpu_rates(adam_params_per_s: float) -> dict[str, float]:
    import torch

    dev = torch.device("cuda", 0)
    out: dict[str, float] = {}
    out["matmul_flops"] = _gpu_gemm(dev, 8192)
    size = 512 * 2**20
    host_in = torch.empty(size, dtype=torch.uint8).pin_memory()
    host_out = torch.empty(size, dtype=torch.uint8).pin_memory()
    dev_in = torch.empty(size, dtype=torch.uint8, device=dev)
    dev_out = torch.empty(size, dtype=torch.uint8, device=dev)
    out["h2d_bytes_per_s"] = size / _cuda_seconds(lambda: dev_in.copy_(host_in, non_blocking=True))
    out["d2h_bytes_per_s"] = size / _cuda_seconds(lambda: host_out.copy_(dev_out, non_blocking=True))
    up, down = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def duplex() -> None:
        # each direction on its own stream, so that both links' DMA engines run at once
        with torch.cuda.stream(up):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(down):
            host_out.copy_(dev_out, non_blocking=True)
        up.synchronize()
        down.synchronize()

    out["duplex_bytes_per_s"] = 2 * size / _best_seconds(duplex, repeats=5)
    out["host_copy_bytes_per_s"] = out["duplex_bytes_per_s"]

    stop = threading.Event()

    def copies() -> None:
        while not stop.is_set():
            duplex()

    thread = threading.Thread(target=copies, daemon=True)
    thread.start()
    try:
        out["adam_params_per_s_with_copies"] = min(_cpu_adamw(16 * 2**20), adam_params_per_s)
    finally:
        stop.set()
        thread.join()
    return out


def _gpu_gemm(dev, n: int) -> float:
    import torch

    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    return 2 * n**3 * 10 / _cuda_seconds(lambda: [torch.mm(a, b, out=c) for _ in range(10)])


def _cuda_seconds(fn: Callable[[], Any], repeats: int = 5) -> float:
    """The best of `repeats` timings of `fn`'s GPU work, between CUDA events on the current stream."""
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # the host waits for the GPU's end event before reading the time
        best = min(best, start.elapsed_time(end) / 1000)
    return best


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(probe: Probe) -> list[str]:
    """The probe as lines for a person: every ceiling a plan uses, measured or assumed."""
    from horizon_ray.planner.node import Ceilings

    ceil = probe.ceilings()
    rows = [f"ceilings of {probe.machine.get('host')} ({probe.machine.get('cpu')}, {probe.machine.get('threads')} "
            f"threads{', ' + ', '.join(probe.machine['gpus']) if probe.machine.get('gpus') else ', no GPU'}), "
            f"probed {time.strftime('%Y-%m-%d %H:%M', time.localtime(probe.time))} in {probe.seconds:.1f} s"]
    for name in (*Ceilings.MEASURABLE, "compute_efficiency"):
        value = getattr(ceil, name)
        shown = _unit(name, value)
        if name in probe.values:
            rows.append(f"  {name:<30}{shown:>16}  measured: {probe.details.get(name, '')}")
        else:
            why = ("calibrated against the engine on the H200 box" if name == "compute_efficiency"
                   else "the H200 box's (not measured here)")
            rows.append(f"  {name:<30}{shown:>16}  assumed: {why}")
    return rows


def _unit(name: str, value: float) -> str:
    if name.endswith("flops"):
        return f"{value / 1e12:.2f} TFLOP/s" if value >= 1e12 else f"{value / 1e9:.1f} GFLOP/s"
    if name.endswith("bytes_per_s"):
        return f"{value / 1e9:.1f} GB/s"
    if "params_per_s" in name:
        return f"{value / 1e9:.2f} G/s"
    return f"{value:g}"

