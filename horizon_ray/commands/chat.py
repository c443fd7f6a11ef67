"""``horizon-ray chat JOB|DIR``: talk to a finished model at a prompt, on this machine.

    horizon-ray chat ./runs/support-bot             # a job's output directory (its final/), or final/ itself
    horizon-ray chat job-0123abcd                   # a job of the running service (its output directory)
    horizon-ray chat ./models/base --system "Be brief." --max-tokens 128 --temperature 0.7

Each line read from stdin is a user turn; the model's answer (the tokenizer's chat template renders the whole
conversation so far) is printed and streamed as it is generated. An empty line, EOF or /exit ends the chat;
/reset starts the conversation over. The model runs on the streamed engine (engine/generate.py): a model
larger than the GPU streams layer by layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from horizon_ray.errors import BadInput


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per answer at most (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sampled")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop sequence (repeatable)")
    parser.add_argument("--device", default="auto", help="auto (cuda when there is a GPU), cuda, cpu")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                        help="compute dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--gpu-budget", default=None, metavar="BYTES",
                        help="GPU memory generation may use, e.g. 12GiB (default: 90%% of what is free); a model "
                             "larger than 3/4 of it streams layer by layer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="JOB|DIR",
                        help="a job's output directory or final/, an HF model or PEFT adapter directory, or the id "
                             "of a job of the running service")
    parser.add_argument("--system", default=None, help="a system message before the conversation")
    add_sampling_arguments(parser)
    from horizon_ray.commands.submit import add_connection_arguments

    add_connection_arguments(parser)


def model_dir(ref: str, args: argparse.Namespace) -> Path:
    """The model directory a JOB|DIR argument names: DIR/final when DIR is a job's output directory (``args``:
    how to reach the service that ran a job id)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path / "final" if (path / "final").is_dir() else path
    if not ref.startswith("job-"):
        raise BadInput(f"{ref} is neither a directory nor a job id (job-...): name a job's output directory, its "
                       "final/, or a model directory")
    from horizon_ray.cluster.errors import HorizonError
    from horizon_ray.commands.submit import connect

    try:
        client, tenant = connect(args)
        record = client.get(tenant, ref)
    except HorizonError as exc:
        raise BadInput(f"job {ref}: {exc.message}") from None
    final = Path(record.output_dir or "") / "final"
    if not final.is_dir():
        raise BadInput(f"job {ref} is {record.status.value} and has no final model at {final} on this machine; "
                       "chat with it once it has succeeded, where its output directory is")
    return final


def load(args: argparse.Namespace, ref: str):
    from horizon_ray.engine.generate import Generator

    budget = None
    if args.gpu_budget:
        from horizon_ray.cluster.tenants import parse_bytes

        budget = parse_bytes(args.gpu_budget, what="--gpu-budget")
    return Generator.from_pretrained(model_dir(ref, args), device=args.device, dtype=args.dtype,
                                     gpu_budget_bytes=budget)


def sampling(args: argparse.Namespace):
    from horizon_ray.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


def run(args: argparse.Namespace) -> int:
    from horizon_ray.engine.sampling import Request

    gen = load(args, args.model)
    params = sampling(args)
    params.validate()
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        text = line.strip()
        if not line or not text or text == "/exit":
            return 0
        if text == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": text})
        try:
            request = Request(gen.chat_prompt(messages), params)
            gen.check([request])
        except BadInput as exc:  # this turn cannot run (the template refuses it, the context is full): say why and
            messages.pop()      # go on with the conversation so far, which the user need not type again
            print(f"error: {exc.message}", file=sys.stderr, flush=True)
            continue
        print("model> ", end="", flush=True)
        answer = []
        for step in gen.stream([request]):
            for d in step:
                answer.append(d.text)
                print(d.text, end="", flush=True)
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(answer)})
