"""``horizon-ray demo``: a real fine-tune of the embedded tiny model, end to end, in minutes on a CPU.

Builds (once, deterministically) a random-init Llama-style model, the byte-level demo tokenizer and a
generated instruction dataset with checkable answers. By default it then starts the service on a local
Ray cluster (one node declaring this machine's RAM, its agent, the coordinator, the REST API and the
dashboard), submits the demo job over REST as tenant "demo", follows its server-sent events, and prints
the eval loss and the held-out exact-match accuracy before and after, a few generations before and after,
where the outputs are and the dashboard's URL. ``--local`` runs the same job in this process instead.
"""

from __future__ import annotations

import argparse
import shutil
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from horizon_ray.errors import BadInput
from horizon_ray.job.metrics import METRICS_FILE, SPEC_FILE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where the run goes, replaced each time: the local service's root (default "
                             "$HORIZON_RAY_HOME/demo/service; the job's outputs land in <it>/jobs/demo/<job id>), "
                             "or with --local the job's output directory (default $HORIZON_RAY_HOME/demo/run)")
    parser.add_argument("--device", default=None, help="auto (default) | cpu | cuda")
    parser.add_argument("--samples", type=int, default=6, help="generations to show before/after")
    parser.add_argument("--rebuild-assets", action="store_true", help="regenerate the model and data")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    parser.add_argument("--local", action="store_true",
                        help="run the job in this process instead of through the local Ray service")
    parser.add_argument("--port", type=int, default=None,
                        help="port of the demo service's API and dashboard on 127.0.0.1 (default: a free one)")
    parser.add_argument("--keep-serving", action="store_true",
                        help="keep the service and its dashboard running after the job, until Ctrl-C (without it "
                             "they stop when the demo ends, and the demo says so)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override the demo job spec, e.g. training.max_steps=100")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from horizon_ray.home import horizon_home
    from horizon_ray.job.demo import demo_spec, prepare_demo_assets
    from horizon_ray.job.runner import run_job

    console = Console(highlight=False, soft_wrap=True)
    t0 = time.monotonic()
    with console.status("preparing the demo model, tokenizer and data"):
        assets, built = prepare_demo_assets(rebuild=args.rebuild_assets)
    console.print(f"demo assets {'built in' if built else 'found in'} {assets.root}")

    overrides = list(args.overrides) + ([f"engine.device={args.device}"] if args.device else [])
    from horizon_ray.data import read_demo_items

    items = read_demo_items(assets.eval_path)
    before = _score(assets.model_dir, items)
    if args.local:
        out = (args.output_dir or horizon_home() / "demo" / "run").expanduser()
        spec = demo_spec(assets, out, overrides)
        _clear_previous_run(out)
        result = run_job(spec, progress=not args.no_progress)
        summary = _Summary(result.total_steps, result.wall_s, result.first_eval_loss, result.final_eval_loss,
                           result.output_dir, result.final_dir)
    else:
        root = (args.output_dir or horizon_home() / "demo" / "service").expanduser().resolve()
        spec = demo_spec(assets, root / "unused", overrides)
        summary = _through_service(console, assets, spec, root, args)
    after = _score(summary.final_dir, items)
    _report(console, spec, summary, items, before, after, args.samples, time.monotonic() - t0)
    return 0


@dataclass
class _Summary:
    total_steps: int
    wall_s: float
    first_eval_loss: float | None
    final_eval_loss: float | None
    output_dir: Path
    final_dir: Path


def _through_service(console, assets, spec, root: Path, args) -> _Summary:
    """Start the local service, submit the demo job over REST, follow its events until it ends."""
    import os
    import secrets

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import httpx
    import psutil

    from api.app import create_app
    from api.server import running_server
    from api.settings import ApiSettings
    from horizon_ray.cluster.client import RayClient
    from horizon_ray.cluster.local import simulated_service

    if root.exists():
        shutil.rmtree(root)  # the demo's service starts with an empty job table every time
    ram = {"local": psutil.virtual_memory().total}
    with ExitStack() as stack:
        with console.status("starting a local Ray cluster, its node agent, the coordinator and the API"):
            cluster, service = stack.enter_context(simulated_service(root, ram, logging_level="ERROR"))
        key = secrets.token_urlsafe(16)
        settings = ApiSettings(api_keys={key: "demo"}, jobs_root=service.jobs_root, uploads_dir=root / "uploads",
                               data_roots=[assets.root], model_roots=[assets.root])
        app = create_app(RayClient(cluster.address), settings)
        with running_server(app, port=args.port) as url:
            until = "until Ctrl-C" if args.keep_serving else "while the demo runs (--keep-serving: until Ctrl-C)"
            console.print(f"service up {until}: dashboard {url}/  (API key {key}), Ray at {cluster.address}")
            body = spec.to_dict()
            body.pop("output_dir", None)  # the coordinator gives it a place in the tenant's namespace
            auth = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=url, headers=auth, timeout=60) as http:
                created = http.post("/finetune", json=body)
                if created.status_code != 201:
                    raise BadInput(f"the service refused the demo job: {created.status_code} {created.text}")
                job = created.json()
                console.print(f"submitted job {job['id']} over REST ({created.headers['Location']}); "
                              f"placed by the planner, following its events")
                t0 = time.monotonic()
                first, last = _follow(console, http, job["id"], args.no_progress)
                job = http.get(f"/finetune/{job['id']}").json()
            if job["status"] != "succeeded":
                err = job.get("error") or {}
                raise RuntimeError(f"the demo job ended {job['status']}: {err.get('message', '')}")
            if args.keep_serving:
                console.print(f"the service keeps running: dashboard {url}/ (API key {key}); Ctrl-C stops it")
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass
        console.print("the demo's service has stopped (its dashboard with it); `horizon-ray demo --keep-serving` "
                      "keeps it up until Ctrl-C")
        out = Path(job["result"]["output_dir"])
        return _Summary(job["progress"]["total_steps"] or 0, time.monotonic() - t0, first, last, out, out / "final")


def _follow(console, http, job_id: str, quiet: bool) -> tuple[float | None, float | None]:
    """Print the job's server-sent events until the stream ends; the first and last eval losses."""
    import json

    first = last = None
    event = None
    with http.stream("GET", f"/finetune/{job_id}/events", headers={"Accept": "text/event-stream"},
                     timeout=None) as stream:
        for line in stream.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                payload = json.loads(line[6:])
                if event == "end":
                    break
                data = payload.get("data") or {}  # the event object: seq, job_id, time, type, data
                is_eval = event == "metrics" and "eval_loss" in data
                if is_eval:
                    first = data["eval_loss"] if first is None else first
                    last = data["eval_loss"]
                # every event but the per-step metrics, of which about one in ten
                every = max(1, int(data.get("total_steps") or 10) // 10)
                routine = event == "metrics" and not is_eval and int(data.get("step") or 0) % every
                if not quiet and not routine:
                    console.print(f"  [dim]{event}[/dim] {_brief(event, data)}")
    return first, last


def _brief(event: str | None, data: dict) -> str:
    from horizon_ray.cluster.follow import format_memory, format_progress

    if event == "metrics" and "loss" in data:
        return format_progress(data)
    if event == "memory":
        return format_memory(data)
    keys = {"status": ("node_id", "reason"), "metrics": ("step", "eval_loss"),
            "checkpoint": ("step", "path"), "error": ("code", "message")}.get(event or "", tuple(data))
    parts = [f"-> {data['to']}"] if event == "status" and data.get("to") else []
    for k in keys:
        if data.get(k) is not None:
            v = data[k]
            parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


def _clear_previous_run(out: Path) -> None:
    """The demo starts fresh each time; it only deletes a directory that holds a previous job run."""
    if not out.exists():
        return
    if not any((out / name).exists() for name in (METRICS_FILE, SPEC_FILE)) and any(out.iterdir()):
        raise BadInput(f"{out} exists and is not a previous demo run; choose another --output-dir")
    shutil.rmtree(out)


def _score(model_dir: Path, items: list):
    """The model's greedy answers to the held-out prompts (generation on the engine, as the job's eval.generate
    scores them at each eval), scored by exact match per task."""
    from horizon_ray.data import evaluate_demo
    from horizon_ray.engine.generate import Generator
    from horizon_ray.engine.sampling import Request, SamplingParams
    from horizon_ray.job.demo import DEMO_GENERATE

    gen = Generator.from_pretrained(model_dir, device="cpu")
    params = SamplingParams(max_tokens=DEMO_GENERATE["max_tokens"])
    done = gen.generate([Request(gen.chat_prompt([{"role": "user", "content": it.prompt}]), params) for it in items])
    return evaluate_demo(items, [c.text for c in done])


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
    console.print(f"  metrics                  {out / METRICS_FILE}")
    console.print(f"  loss curve               {out / 'loss_curve.png'}")
    console.print(f"  TensorBoard              {out / 'tensorboard'}  (tensorboard --logdir {out / 'tensorboard'})")
    console.print(f"  job spec                 {out / SPEC_FILE}")
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
