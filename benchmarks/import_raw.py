"""Turn raw output of a GPU-box run into a result file of the harness's schema, then regenerate RESULTS.md.

For runs made before the suite wrote result files itself: the engine's ``RESULT`` lines (one JSON object
per line, ``python -m horizon_ray.bench --system horizon-ray ... --out bench.jsonl``) and the reference
in-GPU baseline's ``gpu_baseline_<size>.json`` (a plain HF script run on the box), measured in the same device
call. Systems that did not run are recorded ``not-run`` with the reason given.

    .venv/bin/python benchmarks/import_raw.py --engine .ref/device_runs/run8/bench.jsonl \\
        --baseline .ref/device_runs/run8/gpu_baseline_7B.json --shape qwen2.5-7b --seq 1024 --date 2026-11-29 \\
        --box h200 --commit 59969c9 --run-id 2026-11-29-h200-run8 --loss-chunk 1024 \\
        --engine-command "..." --baseline-command "..." --not-run fsdp2-offload="not run on the GPU box this session"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from horizon_ray.bench.metrics import BASELINE, base_record, throughput
from horizon_ray.bench.planning import planned_bytes
from horizon_ray.bench.report import compute_ratios, write_json, write_report
from horizon_ray.bench.shapes import model_flops_per_token, resolve_shape

HERE = Path(__file__).resolve().parent


def engine_runs(path: Path, args) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        raw = json.loads(line.removeprefix("RESULT "))
        shape = resolve_shape(raw["shape"], raw.get("layers"))
        rec = base_record("horizon-ray", shape, mode=raw.get("mode", "exact"), dtype=raw["dtype"], device="cuda",
                          device_name=args.device_name, seq=raw["seq_len"], micro=raw["micro"], accum=raw["accum"],
                          checkpoint_every=raw["checkpoint_every"], gpu_budget_bytes=raw.get("gpu_budget_bytes"),
                          offload_checkpoints=raw.get("offload_checkpoints", "auto"),
                          flops_per_token=model_flops_per_token(shape, raw["seq_len"]))
        rec.update(raw)
        rec.update(status="ok", reason=None, warmup=args.engine_warmup,
                   # offload "auto" is the host on CUDA; host checkpoint buffers prove where they lived
                   offload_resolved=bool(raw.get("host_checkpoint_bytes")))
        rec.update(planned_bytes(shape, mode=rec["mode"], seq=rec["seq_len"], micro=rec["micro"], accum=rec["accum"],
                                 checkpoint_every=rec["checkpoint_every"], dtype=rec["dtype"], device="cuda",
                                 gpu_budget_bytes=rec["gpu_budget_bytes"], loss_chunk=args.loss_chunk,
                                 offload=rec["offload_checkpoints"]))
        rec["command"] = args.engine_command
        out.append(rec)
    return out


def baseline_runs(path: Path, args) -> list[dict]:
    out = []
    shape = resolve_shape(args.shape)
    for raw in json.loads(path.read_text()):
        if raw["N"] != shape.num_params:
            raise ValueError(f"{path}: N={raw['N']} is not {args.shape}'s {shape.num_params} parameters")
        flops = model_flops_per_token(shape, args.seq)
        rec = base_record(BASELINE, shape, mode="bf16-state", dtype="bfloat16", device="cuda",
                          device_name=args.device_name, seq=args.seq, micro=raw["micro"], accum=raw["accum"],
                          checkpoint_every=1, gpu_budget_bytes=None, flops_per_token=flops)
        assert rec["tokens_per_step"] == raw["tokens_per_step"], (rec["tokens_per_step"], raw["tokens_per_step"])
        # the script rounds step_s to 3 digits; its tokens/s carries the precise step time
        rec.update(throughput(rec["tokens_per_step"], rec["tokens_per_step"] / raw["tokens_per_s"], flops))
        rec.update(step_s=raw["step_s"], tokens_per_s=raw["tokens_per_s"], warmup=1,
                   peak_gpu_bytes=round(raw["peak_gpu_gib"] * 2**30),
                   peak_gpu_note="the reference script rounds max_memory_allocated to 0.1 GiB",
                   host_rss_bytes=None, optimizer="AdamW fused (GPU)", command=args.baseline_command,
                   source_tflops_model=raw.get("tflops_model"))
        out.append(rec)
    return out


def not_run(system: str, reason: str, accums: list[int], args) -> list[dict]:
    shape = resolve_shape(args.shape)
    out = []
    for accum in accums:
        rec = base_record(system, shape, mode="exact", dtype="bfloat16", device="cuda", device_name=args.device_name,
                          seq=args.seq, micro=args.micro, accum=accum, checkpoint_every=1, gpu_budget_bytes=None,
                          flops_per_token=model_flops_per_token(shape, args.seq))
        rec.update(status="not-run", reason=reason, command=None)
        out.append(rec)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, required=True, help="the engine's RESULT lines (JSON lines)")
    p.add_argument("--baseline", type=Path, required=True, help="gpu_baseline_<size>.json of the same device call")
    p.add_argument("--shape", required=True)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--loss-chunk", type=int, default=1024, help="the engine run's --loss-chunk")
    p.add_argument("--engine-warmup", type=int, default=2)
    p.add_argument("--date", required=True)
    p.add_argument("--box", required=True)
    p.add_argument("--device-name", default="NVIDIA H200")
    p.add_argument("--commit", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--engine-command", required=True)
    p.add_argument("--baseline-command", required=True)
    p.add_argument("--not-run", action="append", default=[], metavar="SYSTEM=REASON")
    p.add_argument("--results-dir", type=Path, default=HERE / "results")
    args = p.parse_args(argv)

    runs = engine_runs(args.engine, args) + baseline_runs(args.baseline, args)
    accums = sorted({r["accum"] for r in runs})
    for item in args.not_run:
        system, _, reason = item.partition("=")
        runs += not_run(system, reason, accums, args)
    for r in runs:
        r.update(date=args.date, box=args.box, commit=args.commit, run_id=args.run_id)
    compute_ratios(runs)
    path = args.results_dir / f"{args.date}-{args.box}-{args.shape}.json"
    write_json(path, runs)
    print(f"wrote {path} ({len(runs)} runs)")
    print(f"wrote {write_report(args.results_dir, args.results_dir.parent / 'RESULTS.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
