"""The demo job under each host-update mode, its loss curves overlaid: what exact, speculative and delayed do to
training, not to speed.

    python benchmarks/update_modes_demo.py [--steps 400] [--device cpu|cuda] [--out benchmarks/update_modes_demo]

Writes <out>.json (per mode: final eval loss, the loss at every step, grad norms, rollbacks) and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from horizon_ray.job.demo import demo_spec, prepare_demo_assets
from horizon_ray.job.events import Eval, Metrics, read_events
from horizon_ray.job.metrics import METRICS_FILE
from horizon_ray.job.runner import delayed_from, run_job

MODES = ("exact", "speculative", "delayed")


def run_modes(steps: int, root: Path, modes=MODES, extra=(), device: str = "cpu") -> dict[str, dict]:
    assets, _ = prepare_demo_assets(root / "assets")
    out = {}
    for mode in modes:
        spec = demo_spec(assets, root / mode, [f"training.max_steps={steps}", f"training.update={mode}",
                                               f"engine.device={device}", "checkpoint.every_steps=0", *extra])
        run_job(spec, progress=False)
        events = read_events(root / mode / METRICS_FILE)
        metrics = [e for e in events if isinstance(e, Metrics)]
        evals = [e for e in events if isinstance(e, Eval)]
        out[mode] = {"final_eval_loss": evals[-1].eval_loss, "loss": [e.loss for e in metrics],
                     "grad_norm": [e.grad_norm for e in metrics],
                     "rollbacks": metrics[-1].rollbacks if mode == "speculative" else None,
                     "clipped_steps": sum(e.grad_norm > spec.training.max_grad_norm for e in metrics),
                     "device": device,
                     "exact_steps": delayed_from(spec) if mode == "delayed" else None}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", default="benchmarks/update_modes_demo")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        result = run_modes(a.steps, Path(d), device=a.device)
    Path(a.out + ".json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, r in result.items():
        label = f"{mode}: final eval loss {r['final_eval_loss']:.4f}"
        if r["rollbacks"] is not None:
            label += f", {r['rollbacks']} rollbacks"
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], label=label, linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"demo job by training.update ({a.device})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=110)
    for mode, r in result.items():
        print(mode, {k: v for k, v in r.items() if k not in ("loss", "grad_norm")})


if __name__ == "__main__":
    main()
