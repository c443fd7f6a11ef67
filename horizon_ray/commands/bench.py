"""``horizon-ray bench``: the streaming engine against in-GPU training (and FSDP2 CPU offload) on a
random-init model of a named shape; the same flags as ``python -m horizon_ray.bench``.

    horizon-ray bench --shape qwen2.5-7b --micro 16 --accum 1,4 --gpu-budget-gib 12
    horizon-ray bench --shape tiny --device cpu --seq 128 --micro 2 --accum 1,2
    horizon-ray bench --report

Exit codes: 0 every run was measured, skipped or did not fit (a finding, not a failure), 1 a run failed or
timed out, 2 bad input.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from horizon_ray.bench.cli import add_arguments as bench_arguments

    bench_arguments(parser)


def run(args) -> int:
    from horizon_ray.bench.cli import run as bench_run

    return bench_run(args)
