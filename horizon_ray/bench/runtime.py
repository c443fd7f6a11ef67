"""Torch-side helpers every system's child shares: device and dtype, GPU budget, memory, the profiled step."""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from collections.abc import Callable

import torch

from horizon_ray.bench.metrics import split_from_trace


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
    if device.type != "cuda":
        return {"peak_gpu_bytes": 0, "peak_gpu_reserved_bytes": 0}
    return {"peak_gpu_bytes": torch.cuda.max_memory_allocated(device),
            "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(device)}


def free_memory() -> None:
    """After an out-of-memory failure: drop what the failed step left behind."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
