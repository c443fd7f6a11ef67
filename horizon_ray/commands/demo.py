"""``horizon-ray demo``: a real fine-tune of the embedded tiny model, end to end, in minutes on a CPU.

Builds (once, deterministically) a random-init Llama-style model, the byte-level demo tokenizer and a
generated instruction dataset with checkable answers; fine-tunes with the same job runner as
``horizon-ray finetune``; then prints the eval loss and the held-out exact-match accuracy before and
after, a few generations before and after, and where the outputs are.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where the run goes (default: $HORIZON_RAY_HOME/demo/run, replaced each time)")
    parser.add_argument("--device", default=None, help="auto (default) | cpu | cuda")
    parser.add_argument("--samples", type=int, default=6, help="generations to show before/after")
    parser.add_argument("--rebuild-assets", action="store_true", help="regenerate the model and data")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override the demo job spec, e.g. training.max_steps=100")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from horizon_ray.job import run_job
    from horizon_ray.job.demo import demo_spec, horizon_home, prepare_demo_assets

    console = Console(highlight=False, soft_wrap=True)
    t0 = time.monotonic()
    with console.status("preparing the demo model, tokenizer and data"):
        assets, built = prepare_demo_assets(rebuild=args.rebuild_assets)
    console.print(f"demo assets {'built in' if built else 'found in'} {assets.root}")

    out = (args.output_dir or horizon_home() / "demo" / "run").expanduser()
    overrides = list(args.overrides) + ([f"engine.device={args.device}"] if args.device else [])
    spec = demo_spec(assets, out, overrides)
    _clear_previous_run(out)

    from horizon_ray.data import read_demo_items

    items = read_demo_items(assets.eval_path)
    before = _score(assets.model_dir, items)
    result = run_job(spec, progress=not args.no_progress)
    after = _score(result.final_dir, items)
    _report(console, spec, result, items, before, after, args.samples, time.monotonic() - t0)
    return 0


def _clear_previous_run(out: Path) -> None:
    """The demo starts fresh each time; it only deletes a directory that holds a previous job run."""
    if not out.exists():
        return
    if not any((out / name).exists() for name in ("metrics.jsonl", "job.yaml")) and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not a previous demo run; choose another --output-dir")
    shutil.rmtree(out)


def _score(model_dir: Path, items: list):
    """Greedy answers of the model in ``model_dir`` to the held-out prompts, scored by exact match."""
    from horizon_ray.data import evaluate_demo, greedy_answers, load_tokenizer
    from horizon_ray.engine import Engine, EngineConfig

    tok = load_tokenizer(model_dir)
    eng = Engine.from_pretrained(model_dir, EngineConfig(device="cpu"))
    try:
        preds = greedy_answers(eng.forward_logits, tok, [it.prompt for it in items], max_new_tokens=8)
    finally:
        eng.close()
    return evaluate_demo(items, preds)


def _report(console, spec, result, items, before, after, samples: int, wall_s: float) -> None:
    from rich.table import Table

    console.print()
    console.print(f"[bold]horizon-ray demo[/bold]: fine-tuned {spec.model.path} for {result.total_steps} "
                  f"steps in {result.wall_s:.0f} s (whole demo {wall_s:.0f} s)")
    if result.first_eval_loss is not None and result.final_eval_loss is not None:
        console.print(f"  held-out eval loss   {result.first_eval_loss:.3f} -> {result.final_eval_loss:.3f}")
    per_task = ", ".join(f"{task} {acc:.0%}" for task, acc in after.per_task.items())
    console.print(f"  held-out accuracy    {before.accuracy:.1%} -> {after.accuracy:.1%}  "
                  f"(exact match of greedy answers, {after.n} prompts never seen in training; {per_task})")

    table = Table(title="generations (greedy)", title_justify="left")
    for col in ("prompt", "expected", "before", "after"):
        table.add_column(col)
    shown = _pick_samples(items, samples)
    for i in shown:
        it = items[i]
        mark = "[green]✓[/green]" if after.predictions[i].strip() == it.answer else "[red]✗[/red]"
        table.add_row(it.prompt, it.answer, repr(before.predictions[i]), f"{after.predictions[i]!r} {mark}")
    console.print(table)

    out = result.output_dir
    console.print("outputs:")
    console.print(f"  final model (HF format)  {result.final_dir}")
    console.print(f"  metrics                  {out / 'metrics.jsonl'}")
    console.print(f"  loss curve               {out / 'loss_curve.png'}")
    console.print(f"  job spec                 {out / 'job.yaml'}")
    console.print(f"  checkpoints              {out / 'checkpoints'}")


def _pick_samples(items: list, n: int) -> list[int]:
    """Indices of ``n`` items spread over the tasks, in a fixed order."""
    by_task: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        by_task.setdefault(it.task, []).append(i)
    picked: list[int] = []
    for k in range(max((len(v) for v in by_task.values()), default=0)):
        for idx in by_task.values():
            if k < len(idx) and len(picked) < n:
                picked.append(idx[k])
    return picked
