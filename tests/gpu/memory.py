"""The device memory a piece of work takes: its peak allocation above what was allocated before it started.

What earlier tests leave allocated (cuBLAS keeps a workspace for every stream it ran on until the process ends,
a module fixture's tensors) is not the work's, so a test that holds one run's peak against its plan measures
from there; what generation leaves behind has its own test (test_cuda_generate)."""

import gc

import torch


def peak_added(work) -> int:
    gc.collect()  # the previous engine's device buffers must not count
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    work()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
