"""Torch-side helpers every system's child shares: device and dtype, GPU budget, memory, the profiled step."""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from horizon_ray.bench.metrics import peak_holders, split_from_trace


def device_and_dtype(args) -> tuple[str, str]:
    """``--device auto``: cuda when there is one (as ``cuda:N``); ``--dtype auto``: bfloat16 on cuda,
    float32 on cpu."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} asked for but CUDA is not available here; use --device cpu")
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"  # torch.cuda.set_device wants an index
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def cap_gpu_memory(budget_bytes: int | None, device: torch.device) -> None:
    """Make an allocation past the budget fail as it would on a GPU of that size."""
    if budget_bytes and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_peaks(device: torch.device) -> dict:
    """The run's peak GPU memory: allocated (``max_memory_allocated``, which stops counting a block when its
    tensor is freed), active (which counts it until the allocator may hand it out again: a block used by another
    stream, record_stream, waits for the GPU to pass the free) and reserved."""
    if device.type != "cuda":
        return {"peak_gpu_bytes": 0, "peak_gpu_active_bytes": 0, "peak_gpu_reserved_bytes": 0}
    return {"peak_gpu_bytes": torch.cuda.max_memory_allocated(device),
            "peak_gpu_active_bytes": torch.cuda.memory_stats(device)["active_bytes.all.peak"],
            "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(device)}


# Sampled every 200 ms during a system's timed steps: the SM clock the GPU held, its power and temperature. An
# H200's matmuls run at its power cap, so the clock can differ between two systems' steps and between two calls
# (runs of one command on two machines of this kind differed by up to 9 %); the record says which clock it ran.
TELEMETRY_QUERY = "clocks.sm,power.draw,temperature.gpu"


class GpuTelemetry:
    """nvidia-smi's samples of the device between ``start()`` and ``stop()`` (or over a ``with`` block), then
    ``summary()``: its SM clock in MHz (median and lowest), its median power in W and highest temperature in C.
    Empty off CUDA or without nvidia-smi: telemetry never fails a run."""

    def __init__(self, device: torch.device, interval_ms: int = 200):
        self.device, self.interval_ms = device, interval_ms
        self.samples: list[tuple[float, float, float]] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def _gpu_id(self) -> str:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        # nvidia-smi numbers GPUs its own way (not CUDA_VISIBLE_DEVICES'): the UUID names this one
        return "GPU-" + str(uuid).removeprefix("GPU-") if uuid is not None else str(index)

    def start(self) -> None:
        smi = shutil.which("nvidia-smi")
        if self.device.type != "cuda" or smi is None or self._proc is not None:
            return
        try:
            self._proc = subprocess.Popen(
                [smi, f"--query-gpu={TELEMETRY_QUERY}", "--format=csv,noheader,nounits", f"--id={self._gpu_id()}",
                 f"--loop-ms={self.interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except Exception:  # no device properties, no nvidia-smi to start: a row without telemetry, not a failure
            self._proc = None
            return
        self._reader = threading.Thread(target=self._read, args=(self._proc,), daemon=True)
        self._reader.start()

    def __enter__(self) -> GpuTelemetry:
        self.start()
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                clock, power, temp = (float(v) for v in line.split(","))
            except ValueError:  # "[N/A]" or a partial line
                continue
            self.samples.append((clock, power, temp))

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self._proc is None or self._proc.returncode is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks, powers, temps = zip(*self.samples, strict=True)
        return {"gpu_sm_clock_mhz": round(statistics.median(clocks)), "gpu_sm_clock_min_mhz": round(min(clocks)),
                "gpu_power_w": round(statistics.median(powers), 1), "gpu_temp_max_c": round(max(temps)),
                "gpu_telemetry_samples": len(self.samples)}


def free_memory() -> None:
    """After an out-of-memory failure: drop what the failed step left behind."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# GEMM ops whose FLOPs follow from their input shapes; addmm and addmm_ (acc += a @ b) multiply their 2nd and 3rd
GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm")


def gemm_shapes(prof, top: int = 20) -> list[list]:
    """The GEMM ops of a profile taken with record_shapes, grouped by their input shapes, slowest first:
    [op, input shapes, calls, device seconds, TFLOP/s]. Two systems that run the same FLOPs at different
    speeds name the shapes (and so the kernels cuBLAS picked for them) where the time goes."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key not in GEMM_OPS:
            continue
        shapes = [list(s) for s in e.input_shapes if s]
        a, b = (shapes[0], shapes[1]) if e.key in ("aten::mm", "aten::bmm") else (shapes[1], shapes[2])
        flops = 2 * math.prod(a) * b[-1] * e.count
        sec = e.self_device_time_total / 1e6
        # no device time: calls that launched no kernel (HF's checkpointing stops its recompute inside one)
        rows.append([e.key, shapes, e.count, round(sec, 4), round(flops / sec / 1e12) if sec > 0 else None])
    rows.sort(key=lambda r: -r[3])
    return rows[:top]


def profile_step(step: Callable[[], object]) -> dict:
    """Run one step under torch.profiler (CUDA activity only) and split its wall time into GPU compute,
    exposed copies and GPU idle (metrics.split_from_trace)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    fd, path = tempfile.mkstemp(suffix=".json", prefix="horizon-bench-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    return split_from_trace(events, wall)


def memory_at_peak(step: Callable[[], object], device: torch.device) -> dict:
    """One more step with the caching allocator's history recorded (Python stacks): what held the GPU memory
    at the step's peak, by the code that allocated it (``metrics.peak_holders``); or ``gpu_peak_holders_error``
    (a bonus: it never fails the run).

    The history records each block at the size asked for, and its free when the allocator may reuse the block
    (for a block another stream used, once the GPU has passed the free), as the allocator's requested bytes
    count it; ``max_memory_allocated`` counts the blocks handed out (rounded to 512 bytes, and a large block's
    unsplit tail of up to 1 MiB) until their tensors are freed. So the replay starts from, and is checked
    against, the requested bytes (``gpu_peak_requested_bytes``, their peak); ``gpu_peak_step_bytes`` is the
    step's ``max_memory_allocated`` beside it, and can be below them."""
    try:
        torch.cuda.synchronize(device)
        torch.empty(1, device=device)  # an allocation settles the frees the GPU has passed
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_stats(device)["requested_bytes.all.current"]
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python", device=device)
        try:
            step()
            torch.cuda.synchronize(device)
            snap = torch.cuda.memory._snapshot(device)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None, device=device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        out = peak_holders(snap["device_traces"][index], before)
        stats = torch.cuda.memory_stats(device)
        out["gpu_peak_requested_bytes"] = stats["requested_bytes.all.peak"]
        out["gpu_peak_active_bytes"] = stats["active_bytes.all.peak"]
        out["gpu_peak_step_bytes"] = stats["allocated_bytes.all.peak"]  # max_memory_allocated
        return out
    except Exception as exc:
        return {"gpu_peak_holders_error": f"{type(exc).__name__}: {exc}"[:300]}


def profile_gemms(step: Callable[[], object]) -> dict:
    """One more step under the CPU profiler too (whose launch overhead would blur profile_step's split), for
    its GEMMs by shape: ``gemm_shapes``, or ``gemm_shapes_error`` (a bonus: it never fails the run)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            step()
            torch.cuda.synchronize()
        return {"gemm_shapes": gemm_shapes(prof)}
    except Exception as exc:
        return {"gemm_shapes_error": f"{type(exc).__name__}: {exc}"[:300]}
