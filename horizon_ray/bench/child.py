"""One system in one process: ``python -m horizon_ray.bench --system X ...``.

The protocol to the parent is plain text on stdout: ``RESULT {json}`` per run (a run may be printed
again, completed with its profiled time split: the last line of a run wins; a run is one accumulation, and
for horizon-ray one update mode of it), and ``FAILED {json}`` (status, reason) when the system failed as a
whole, e.g. building a model that does not fit, or could not run here at all (``skipped``: a library that
is not installed, no GPU). A host out-of-memory kill prints nothing: the parent reads it from the exit
status.
"""

from __future__ import annotations

import importlib
import json
import traceback

from horizon_ray.bench.metrics import Unavailable, error_reason, is_out_of_memory

RUNNERS = {
    "horizon-ray": "horizon_ray.bench.engine_run",
    "in-gpu-baseline": "horizon_ray.bench.baseline",
    "in-gpu-liger": "horizon_ray.bench.baseline",
    "in-gpu-peft": "horizon_ray.bench.peft_peer",
    "in-gpu-peft-liger": "horizon_ray.bench.peft_peer",
    "fsdp2-offload": "horizon_ray.bench.fsdp2",
}


def run_key(rec: dict) -> tuple[int, str | None]:
    """What tells a child's runs apart: the accumulation, and horizon-ray's update mode (None for a peer)."""
    return rec["accum"], rec.get("update")


def run_child(args) -> int:
    final: dict[tuple, dict] = {}

    def emit(rec: dict) -> None:
        final[run_key(rec)] = rec
        print("RESULT", json.dumps(rec), flush=True)

    try:
        importlib.import_module(RUNNERS[args.system]).run(args, emit)
    except Unavailable as exc:
        print("FAILED", json.dumps({"status": "skipped", "reason": str(exc)}), flush=True)
        return 0
    except Exception as exc:
        traceback.print_exc()
        status = "did-not-fit" if is_out_of_memory(exc) else "error"
        print("FAILED", json.dumps({"status": status, "reason": error_reason(exc)}), flush=True)
        return 0 if status == "did-not-fit" else 1
    finally:
        if args.out and final:
            with open(args.out, "a") as f:
                for rec in final.values():
                    f.write(json.dumps(rec) + "\n")
    return 0


def parse_output(lines: list[str]) -> tuple[dict[tuple, dict], dict | None]:
    """A child's stdout -> (the last record of each run by run_key, the FAILED payload or None)."""
    records: dict[tuple, dict] = {}
    failed = None
    for line in lines:
        if line.startswith("RESULT "):
            rec = json.loads(line[len("RESULT "):])
            records[run_key(rec)] = rec
        elif line.startswith("FAILED "):
            failed = json.loads(line[len("FAILED "):])
    return records, failed
