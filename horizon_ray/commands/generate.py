"""``horizon-ray generate``: answer a file of prompts with a model, in batches, JSONL out.

    horizon-ray generate ./runs/support-bot --prompts prompts.jsonl [--out answers.jsonl] [--batch-size 16]

Each input line is a JSON object with ``messages`` (a chat, rendered by the tokenizer's chat template) or
``prompt`` (plain text), and optionally its own ``max_tokens`` (or ``max_completion_tokens``), ``temperature``,
``top_p``, ``top_k``, ``seed``, ``stop`` (a string or a list); the command line gives the defaults (and a null
value). Other keys are copied to the answer; ``n`` and the other OpenAI parameters this command does not honour
are refused. Each output line is the input object with ``output``
(the generated text), ``finish_reason`` ("stop" or "length"), ``prompt_tokens`` and ``completion_tokens``,
in the input's order.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import replace
from pathlib import Path

from horizon_ray.errors import BadInput

_PER_LINE = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
# the OpenAI names a line may use as the API takes them
_ALIASES = {"max_completion_tokens": "max_tokens"}
# OpenAI parameters this command does not honour: refused, so that none is dropped without a word
_NOT_TAKEN = ("n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from horizon_ray.commands.chat import add_sampling_arguments
    from horizon_ray.commands.submit import add_connection_arguments

    parser.add_argument("model", metavar="JOB|DIR", help="as for `horizon-ray chat`")
    parser.add_argument("--prompts", required=True, metavar="FILE.jsonl", help="one {messages | prompt} per line")
    parser.add_argument("--out", default="-", metavar="FILE.jsonl", help="where the answers go (default stdout)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts generated together (default 16)")
    add_sampling_arguments(parser)
    add_connection_arguments(parser)


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise BadInput(f"--prompts {path} is not a file; give a JSONL file of {{\"messages\": [...]}} or "
                       "{\"prompt\": \"...\"} lines")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"--prompts {path} is not UTF-8 text; give a UTF-8 JSONL file") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or ("messages" in row) == ("prompt" in row):
            raise BadInput(f"{path}:{n}: each line needs exactly one of 'messages' (a chat) or 'prompt' (text)")
        rows.append(row)
    if not rows:
        raise BadInput(f"{path} holds no prompt")
    return rows


def _own_params(row: dict) -> dict:
    """The sampling parameters a line sets (null: the command line's); BadInput for one this command does not
    take or a misspelt one, which would otherwise be copied to the answer and not used."""
    from horizon_ray.engine.sampling import stop_sequences

    own = {}
    for key, value in row.items():
        name = _ALIASES.get(key, key)
        if name in _PER_LINE:
            if value is not None:
                own[name] = stop_sequences(value) if name == "stop" else value
        elif key in _NOT_TAKEN:
            raise BadInput(f"{key!r} is not taken by generate (one answer a line, its text only); remove it, or "
                           "repeat the line with another seed for more answers")
        elif close := difflib.get_close_matches(key, [*_PER_LINE, *_ALIASES], n=1, cutoff=0.8):
            raise BadInput(f"unknown parameter {key!r}; did you mean {close[0]!r}? (a line's own parameters: "
                           f"{', '.join(_PER_LINE)})")
    return own


def run(args: argparse.Namespace) -> int:
    from horizon_ray.commands.chat import load, sampling
    from horizon_ray.engine.sampling import Request

    if args.batch_size < 1:
        raise BadInput(f"--batch-size must be >= 1, got {args.batch_size}")
    rows = _rows(Path(args.prompts))
    if args.out != "-":  # checked before the model loads, not after it ran
        out_path = Path(args.out)
        if out_path.is_dir() or not out_path.parent.is_dir():
            raise BadInput(f"--out {args.out} is {'a directory' if out_path.is_dir() else 'in no existing directory'}"
                           "; give a file path in an existing directory (or - for stdout)")
    gen = load(args, args.model)
    default = sampling(args)
    requests = []
    for n, row in enumerate(rows, 1):
        try:
            params = replace(default, **_own_params(row))
            params.validate()
            ids = gen.chat_prompt(row["messages"]) if "messages" in row else gen.text_prompt(row["prompt"])
        except BadInput as exc:
            raise BadInput(f"{args.prompts}:{n}: {exc.message}") from None
        requests.append(Request(ids, params))
    out = sys.stdout if args.out == "-" else open(args.out, "w")
    try:
        for lo in range(0, len(requests), args.batch_size):
            for row, c in zip(rows[lo:lo + args.batch_size], gen.generate(requests[lo:lo + args.batch_size])):
                out.write(json.dumps({**row, "output": c.text, "finish_reason": c.finish_reason,
                                      "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids)})
                          + "\n")
            out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
    return 0
