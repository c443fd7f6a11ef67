"""The ``horizon-ray`` console script: one thin layer over the functions the API and the service call.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so ``horizon-ray --help`` stays fast and a
command that needs Ray does not import it for one that does not.
"""

from __future__ import annotations

import argparse
import importlib

from horizon_ray.errors import refusing_bad_input

# name -> (module, one-line help). Order is the order `--help` shows.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("horizon_ray.commands.demo", "fine-tune the embedded tiny model end to end through the local service"),
    "finetune": ("horizon_ray.commands.finetune", "run one fine-tuning job (a YAML job spec) on this node"),
    "serve": ("horizon_ray.commands.serve", "run the service: Ray cluster, node agents, coordinator, API"),
    "submit": ("horizon_ray.commands.submit", "submit a job spec to the running service's coordinator"),
    "status": ("horizon_ray.commands.status", "show the service's nodes, jobs and queue, or one job"),
    "drain": ("horizon_ray.commands.drain", "checkpoint and stop this node's jobs (a worker pod's preStop hook)"),
    "chat": ("horizon_ray.commands.chat", "chat with a finished model (a job's final/, or any model directory)"),
    "generate": ("horizon_ray.commands.generate", "answer a JSONL file of prompts with a model, JSONL out"),
    "plan": ("horizon_ray.commands.plan", "plan host RAM, GPU memory and step time of a job on a node"),
    "probe": ("horizon_ray.commands.probe", "measure this node's ceilings: the rates planned step times come from"),
    "bench": ("horizon_ray.commands.bench", "benchmark the engine against in-GPU training on a random-init model"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="horizon-ray",
        description="Fine-tune large language models where host RAM, not GPU memory, is the limit.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    return refusing_bad_input(lambda: int(module.run(args) or 0))


