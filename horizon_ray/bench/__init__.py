"""Benchmark of the streaming engine against in-GPU training, on random-init models of named shapes.

    python -m horizon_ray.bench --shape qwen2.5-7b --micro 16 --accum 1,4 --gpu-budget-gib 12
    horizon-ray bench --shape tiny --device cpu --seq 128 --micro 2 --accum 1,2     # anywhere, in seconds
    python -m horizon_ray.bench --find-largest                                     # FSDP2's largest shape
    python -m horizon_ray.bench --report                                           # RESULTS.md only

Each system runs in its own process (``--system X``, a fresh host and GPU memory, an OOM loses only
itself): ``horizon-ray`` (the engine, in each ``--update`` mode), the in-GPU peers ``in-gpu-baseline`` (HF
transformers, everything on the GPU), ``in-gpu-liger`` (the same with Liger-Kernel), ``in-gpu-peft`` and
``in-gpu-peft-liger`` (HF + PEFT LoRA, plain and with Liger-Kernel), and ``fsdp2-offload`` (PyTorch FSDP2
with CPUOffloadPolicy on one GPU). The parent collects their ``RESULT {json}`` lines, sets every run's
``ratio`` and ``ratio_liger`` against the plain and the Liger in-GPU peer of what it trains (full
fine-tuning or LoRA) in the same invocation at the same tokens per step, writes
``benchmarks/results/<date>-<box>-<shape>.json`` and regenerates ``benchmarks/RESULTS.md``.

Throughput in the house convention: non-padding tokens/s; model FLOPs = 6 N tokens + 6 L heads head_dim seq
tokens, recompute not counted; MFU against the H200's measured 786.5 TFLOP/s bf16 rate and the 989.5
datasheet rate. Each run also reports peak GPU memory, host RSS against the planner's host bytes, and the
step's split: exposed optimizer time, and from one profiled step GPU compute, exposed copies and GPU idle.

Modules: ``cli`` (flags), ``suite`` (the parent), ``child`` (one system in one process); the systems
``engine_run``, ``baseline`` (plain and Liger), ``peft_peer`` (PEFT, plain and Liger) and ``fsdp2``; ``hf``
(what the HF peers share), ``shapes``, ``metrics`` (records and arithmetic), ``runtime`` (torch helpers, the
profiled step), ``planning`` (planner calls), ``report`` (ratios, RESULTS.md). Only the systems import
torch; nothing in the engine imports this package.
"""
