"""What the planner says of a benchmarked run (planned host and GPU bytes), and the largest shape the host
holds. Pure Python: the parent process uses it without importing torch."""

from __future__ import annotations

import argparse
import shlex

from horizon_ray.bench.metrics import LAYER_CHUNK_TOKENS
from horizon_ray.engine.model import family_projections
from horizon_ray.planner import Adapters, NodeSpec, max_model, plan

OFFLOAD: dict[str, bool | str] = {"auto": "auto", "true": True, "false": False}  # --offload -> offload_checkpoints


def lora_settings(args, mode: str | None, shape=None) -> Adapters | None:
    """The run's LoRA settings (--lora-r, --lora-targets, --quantize) when its mode is lora, else None. Without
    --lora-targets: every projection of `shape`'s family (without a shape: the planner's family default)."""
    if mode != "lora":
        return None
    lora = Adapters.of({"r": args.lora_r, "targets": args.lora_targets,
                        "quantize": args.quantize})
    if lora.targets or shape is None:
        return lora
    return Adapters(r=lora.r, targets=tuple(family_projections(shape)), quantize=lora.quantize)


def lora_alpha(rank: int) -> float:
    """The adapters' alpha in every LoRA run of the bench, horizon-ray's and the PEFT peers': 2 r (a scaling
    of 2, the common choice)."""
    return 2.0 * rank


def planned_bytes(shape, *, mode: str, seq: int, micro: int, accum: int, checkpoint_every: int, dtype: str,
                  device: str, gpu_budget_bytes: int | None, loss_chunk: int, offload: str,
                  lora: Adapters | None = None, update: str = "exact", layer_chunk: int | str | None = None) -> dict:
    """``planned_host_bytes``, ``planned_gpu_bytes`` and the planner's verdict for these engine settings
    (``lora``: the adapters of a mode-lora run; absent, the planner's defaults). The plan reads the job spec's
    defaults (PyYAML); without it, or when the planner refuses the settings, the run still counts, unplanned,
    with ``plan_error`` saying why."""
    try:
        p = _plan(shape, mode, seq, micro, accum, checkpoint_every, dtype, device, gpu_budget_bytes, loss_chunk,
                  offload, lora, update, layer_chunk)
    except Exception as exc:  # a plan is context for the measurement: its failure must not lose the run
        return {"planned_host_bytes": None, "planned_gpu_bytes": None,
                "plan_error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"planned_host_bytes": p.host_bytes, "planned_gpu_bytes": p.gpu_bytes, "plan_fits": p.fits,
            "planned_step_s": round(p.step_time_s, 3), "planned_speculate_units": p.speculate_units,
            "bound": bound_arithmetic(p.timing),
            "planned_update_buffers_bytes": p.breakdown["host"].get("update_buffers", 0),
            "planned_gpu_items": dict(p.breakdown["gpu"]),  # the plan's GPU bytes item by item (planner.memory)
            "planned_layer_chunk_tokens": p.layer_chunk_tokens,  # the row groups planned (auto decided)
            "plan_host_fits": p.host_bytes <= p.host_limit_bytes,
            "plan_reason": p.reason}


def replan(record: dict) -> dict | None:
    """What this commit's planner says of a measured horizon-ray run (``planned_bytes`` of its settings: its
    record's fields, and the flags of its command for what the record does not keep), or None for a record
    without the settings to plan it (older records, CPU runs)."""
    from horizon_ray.bench.cli import add_arguments
    from horizon_ray.bench.shapes import resolve_shape

    argv = shlex.split(record.get("command") or "")
    if record.get("system") != "horizon-ray" or record.get("device") != "cuda" or "horizon_ray.bench" not in argv:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    args, _ = parser.parse_known_args(argv[argv.index("horizon_ray.bench") + 1:])
    shape = resolve_shape(record["shape"])
    lora = None
    if record.get("mode") == "lora":  # the targets it ran with: the bench's defaults have changed since some runs
        lora = Adapters(r=record.get("lora_r") or args.lora_r, quantize=record.get("quantize") or "none",
                        targets=tuple(record.get("lora_targets") or family_projections(shape)))
    return planned_bytes(shape, mode=record["mode"], seq=record["seq_len"], micro=record["micro"],
                         accum=record["accum"], checkpoint_every=record["checkpoint_every"], dtype=record["dtype"],
                         device="cuda", gpu_budget_bytes=record.get("gpu_budget_bytes"), loss_chunk=args.loss_chunk,
                         offload=record.get("offload_checkpoints") or "auto", lora=lora,
                         update=record.get("update") or "exact",
                         # rows before --layer-chunk auto ran the bench's 8,192 unless their command set it
                         layer_chunk=record.get("layer_chunk_tokens") or (
                             LAYER_CHUNK_TOKENS if args.layer_chunk == "auto" else args.layer_chunk))


def bound_arithmetic(t: dict) -> dict:
    """What bounds the step, from the planner's roofline (planner.timing.step_time): the bytes each way over
    PCIe, the bytes the host update moves, the GPU's FLOPs and the LoRA adapters' passes over activations, the
    seconds each takes at the node's ceilings, and which of them bounds the step."""
    out = {"h2d_bytes": int(t["h2d_bytes"]), "d2h_bytes": int(t["d2h_bytes"]),
           "host_update_bytes": int(t["optimizer_bytes"]), "gpu_flops": float(t["fwd_flops"] + t["bwd_flops"]),
           "adapter_bytes": int(t.get("adapter_bytes", 0)), "bound": t.get("bound")}
    for key in ("pcie_s", "optimizer_s", "compute_s", "exposed_s", "step_s"):
        if t.get(key) is not None:
            out[key] = round(float(t[key]), 3)
    return out


def _plan(shape, mode, seq, micro, accum, checkpoint_every, dtype, device, gpu_budget_bytes, loss_chunk, offload,
          lora=None, update="exact", layer_chunk=None):
    return plan(shape, method="lora" if mode == "lora" else "full", mode=mode, seq_len=seq,
                micro_batch_size=micro, grad_accum=accum, checkpoint_every=checkpoint_every, compute_dtype=dtype,
                device="cuda" if device.startswith("cuda") else "cpu", gpu_budget_bytes=gpu_budget_bytes,
                loss_chunk_tokens=loss_chunk, suggest=False, lora=lora, update=update,
                offload_checkpoints=OFFLOAD[offload], layer_chunk_tokens=layer_chunk)


def largest_shape(ram_bytes: int, *, mode: str, seq: int, micro: int, accum: int, checkpoint_every: int,
                  lora: Adapters | None = None) -> str:
    """The largest Qwen2.5 preset, or deeper stack of the next preset's layer, whose plan fits the host RAM
    of a node with this much (planner.max_model, depth scan on). The GPU is the H200's whole memory: the
    question is what the host holds; a GPU budget applies to the run, not to the choice."""
    extra = {"lora": lora} if lora is not None else {}
    best = max_model("qwen2.5", NodeSpec(ram_bytes=ram_bytes), mode=mode, scan_depth=True, seq_len=seq,
                     micro_batch_size=micro, grad_accum=accum, checkpoint_every=checkpoint_every, **extra)
    if best.shape is None:
        raise ValueError(f"no shape fits a host of {ram_bytes / 2**30:.1f} GiB in mode {mode}")
    return best.shape.name
