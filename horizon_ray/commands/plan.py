"""``horizon-ray plan``: host RAM, GPU memory and step time of a job on a node, before anything runs.

    horizon-ray plan --model qwen2.5-7b [--mode exact] [--seq-len 1024 --micro-batch-size 16 ...]
                     [--node-ram 125.9GiB --gpu-mem 141GB] [--json]
    horizon-ray plan --config job.yaml            # a job spec, as `horizon-ray finetune` would run it
    horizon-ray plan --config job.yaml --here     # ... on this machine, with its probed ceilings
    horizon-ray plan --max-model qwen2.5 --node-ram 512GiB [--mode exact | --method lora --lora-rank 16]
    horizon-ray plan --list-presets

Exit codes: 0 the job fits (or the listing worked), 1 it does not fit (or no model of the family fits),
2 bad input.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from horizon_ray.errors import BadInput


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from horizon_ray.engine.model import QUANTIZE
    from horizon_ray.planner import Adapters, Ceilings

    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", metavar="NAME|PATH",
                      help="a preset (see --list-presets), one stacked to another depth (qwen2.5-72b@64L, as "
                           "--max-model --scan-depth names it), an HF model directory or a config.json")
    what.add_argument("--config", metavar="JOB.yaml", help="plan a job spec (model, training and engine fields)")
    what.add_argument("--max-model", metavar="FAMILY",
                      help="the largest model of a family of presets that fits the node: "
                           f"{', '.join(planner_families())}")
    what.add_argument("--list-presets", action="store_true", help="list the known model shapes")

    job = parser.add_argument_group("job (defaults: the job spec's)")
    job.add_argument("--method", choices=("full", "lora"), default=None,
                     help="full (default) or lora (mode lora: adapters on the frozen base)")
    job.add_argument("--mode", help="precision mode: exact (default), bf16-state, lora, or bf16-weights (planned "
                                    "only: the engine does not implement it)")
    job.add_argument("--seq-len", type=int)
    job.add_argument("--micro-batch-size", type=int)
    job.add_argument("--grad-accum", type=int)
    job.add_argument("--checkpoint-every", type=int, metavar="K", help="keep one layer input every K layers")
    job.add_argument("--loss-chunk-tokens", type=int)
    job.add_argument("--layer-chunk-tokens", type=layer_chunk_arg,
                     help="the job spec's engine.layer_chunk_tokens: a micro-batch runs through each layer in row "
                          "groups of at most this many tokens; auto (the default): on cuda the largest of 16384, "
                          "8192, 4096, 2048 and 1024 that fits the GPU, 8192 on the cpu")
    job.add_argument("--packed", action="store_true", help="packed rows (an attention mask per micro-batch)")
    job.add_argument("--compute-dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    job.add_argument("--device", default="auto", help="auto (cuda when the node has a GPU), cuda, cpu")
    lora, ceil = Adapters(), Ceilings()  # the job spec's defaults, the planner's node
    job.add_argument("--lora-rank", type=int, default=lora.r, help=f"adapter rank r (default {lora.r})")
    job.add_argument("--lora-targets", default=",".join(lora.targets),
                     help="comma-separated projections that get an adapter (default: each model's family's, "
                          "q_proj,v_proj or Phi-3's qkv_proj)")
    job.add_argument("--lora-modules-to-save", default="",
                     help="comma-separated norms trained beside the adapters (PEFT's names; norm: every norm; "
                          "default none)")
    job.add_argument("--quantize", default=lora.quantize, choices=QUANTIZE,
                     help="with --method lora: how the frozen base is kept, none (the compute dtype), nf4 / fp4 "
                          "(QLoRA's 4-bit, ~0.52 B/param), int8 (default none)")

    node = parser.add_argument_group("node (defaults: the measured H200 box)")
    node.add_argument("--here", action="store_true",
                      help="this machine: its RAM, GPUs and the ceilings `horizon-ray probe` measures (cached; "
                           "measured first when absent)")
    node.add_argument("--node-ram", metavar="BYTES", help="host RAM, e.g. 125.9GiB, 1.5TiB, 512Gi")
    node.add_argument("--gpu-mem", metavar="BYTES", help="memory of one GPU, e.g. 141GB, 80GiB")
    node.add_argument("--gpus", type=int, help="GPUs on the node (0: a CPU node)")
    node.add_argument("--gpu-budget", metavar="BYTES",
                      help="GPU memory the job may use (default: all of it; a larger budget is capped at the GPU's)")
    node.add_argument("--reserve", type=float, help="share of RAM kept free (default 0.05)")
    node.add_argument("--efficiency", type=float, help=f"share of the {ceil.matmul_flops / 1e12:.1f} TFLOP/s a "
                                                       f"layer sustains ({ceil.compute_efficiency})")
    node.add_argument("--pinned", choices=("pow2", "exact"),
                      help="how pinned buffers are sized: exact (the default and what the engine does: "
                           "cudaHostRegister at the exact size for buffers of 1 MiB and more) or pow2 (every "
                           "buffer through torch's caching host allocator, rounded up to a power of two)")

    parser.add_argument("--scan-depth", action="store_true",
                        help="with --max-model: also stack the next larger preset's layer as deep as fits")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="with --config: job spec overrides, as `finetune` takes them (e.g. model.path=qwen2.5-7b "
                             "plans an example's job on a preset's shape, without its weights)")


def planner_families() -> list[str]:
    from horizon_ray.planner import FAMILIES

    return list(FAMILIES)


def _node(args):
    from dataclasses import replace

    from horizon_ray.planner import H200_NODE

    node = _this_machine() if args.here else H200_NODE
    kw: dict[str, Any] = {}
    if args.node_ram is not None:
        kw["ram_bytes"] = _flag_bytes("--node-ram", args.node_ram)
    if args.gpu_mem is not None:
        kw["gpu_mem_bytes"] = _flag_bytes("--gpu-mem", args.gpu_mem)
    if args.gpus is not None:
        kw["gpus"] = args.gpus
    if args.reserve is not None:
        kw["reserve_fraction"] = args.reserve
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise BadInput(f"--efficiency must lie in (0, 1], got {args.efficiency}")
        kw["ceilings"] = replace(node.ceilings, compute_efficiency=args.efficiency)
    if kw:
        node = replace(node, name="custom", **kw)
    return node


def _this_machine():
    """This machine as a node: the RAM and GPUs its agent would offer, the probe's ceilings."""
    import os
    import sys

    from horizon_ray.cluster.cgroups import node_ram_bytes
    from horizon_ray.cluster.gpus import detect_gpus
    from horizon_ray.planner import NodeSpec
    from horizon_ray.probe import cached_probe

    gpus, gpu_mem = detect_gpus()
    probe = cached_probe(log=lambda msg: print(f"probing this machine: {msg} ...", file=sys.stderr, flush=True))
    return NodeSpec(ram_bytes=node_ram_bytes(dict(os.environ)), gpus=len(gpus), gpu_mem_bytes=gpu_mem,
                    ceilings=probe.ceilings(), name="this machine")


def layer_chunk_arg(text: str) -> int | str:
    """A row-group flag (this command's --layer-chunk-tokens, the bench's --layer-chunk): auto or a whole number
    of tokens, 1 or more."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a whole number of tokens of 1 or more")
    return value


def _flag_bytes(flag: str, text: str) -> int:
    """A byte size given on the command line: a unit is required (16 means 16 GiB to whoever typed it)."""
    from horizon_ray.planner import parse_bytes

    try:
        return parse_bytes(text, unit_required=True)
    except BadInput as exc:
        raise BadInput(f"{flag}: {exc.message}") from None


def _method_and_mode(args) -> tuple[str, str]:
    """--method and --mode, each defaulting from the other: lora goes with mode lora, full with exact."""
    method = args.method or ("lora" if args.mode == "lora" else "full")
    mode = args.mode or ("lora" if method == "lora" else "exact")
    if (method == "lora") != (mode == "lora"):
        raise BadInput(f"--method {method} does not go with --mode {mode}: LoRA is --method lora (mode lora); "
                       "full fine-tuning takes --mode exact, bf16-state or bf16-weights")
    return method, mode


def run(args: argparse.Namespace) -> int:
    from horizon_ray import planner

    if args.overrides and not args.config:
        raise BadInput(f"key=value overrides ({args.overrides[0]}) change a job spec: give it with --config, or use "
                       "the job options (--seq-len, --method ...) with --model")
    if args.list_presets:
        rows: list[dict[str, Any]] = [
            {"name": s.name, "params": s.num_params, "layers": s.num_layers, "hidden": s.hidden_size,
             "intermediate": s.intermediate_size, "heads": s.num_heads, "kv_heads": s.num_kv_heads,
             "vocab": s.vocab_size, "tied": s.tie_word_embeddings, "note": s.note, "family": s.arch,
             "experts": s.num_experts, "experts_per_token": s.experts_per_token,
             "expert_intermediate": s.moe_intermediate_size}
            for s in planner.PRESETS.values()]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                moe = (f" experts={r['experts']} top-{r['experts_per_token']} width {r['expert_intermediate']}"
                       if r["experts"] else "")
                print(f"{r['name']:<20} {planner.human_params(r['params']):>8}  L={r['layers']:<4} "
                      f"H={r['hidden']:<6} I={r['intermediate']:<6} heads={r['heads']}/{r['kv_heads']} "
                      f"V={r['vocab']}{' tied' if r['tied'] else ''} {r['family']}{moe}")
        return 0

    node = _node(args)
    budget = _flag_bytes("--gpu-budget", args.gpu_budget) if args.gpu_budget else None
    pinned = {} if args.pinned is None else {"pinned_pow2": args.pinned == "pow2"}
    job = {"seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size, "grad_accum": args.grad_accum,
           "checkpoint_every": args.checkpoint_every, "loss_chunk_tokens": args.loss_chunk_tokens,
           "layer_chunk_tokens": args.layer_chunk_tokens,
           "compute_dtype": args.compute_dtype, "device": args.device, "packed": args.packed,
           "gpu_budget_bytes": budget, **pinned}

    method, mode = _method_and_mode(args)
    if method == "lora":
        job["lora"] = planner.Adapters.of({"r": args.lora_rank, "targets": args.lora_targets,
                                           "modules_to_save": args.lora_modules_to_save,
                                           "quantize": args.quantize})
    elif args.quantize != "none":
        raise BadInput(f"--quantize {args.quantize} quantizes LoRA's frozen base: add --method lora")

    if args.max_model:
        found = planner.max_model(args.max_model, node, mode, scan_depth=args.scan_depth, **job)
        planned_only = "" if planner.get_mode(mode).engine_supported else \
            f" (mode {mode} is planned only: the engine does not implement it yet)"
        if args.json:
            print(json.dumps(found.to_dict(), indent=2))
        else:
            for t in found.tried:
                if "refused" in t:
                    print(f"{t['model']:<26} {planner.human_params(t['params']):>8}  refused: {t['refused']}")
                    continue
                print(f"{t['model']:<26} {planner.human_params(t['params']):>8}  host "
                      f"{planner.format_bytes(t['host_bytes']):>11}  gpu {planner.format_bytes(t['gpu_bytes']):>10}"
                      f"  {'fits' if t['fits'] else 'does not fit'}")
            lora = job.get("lora")
            what = f"mode {found.mode}" + (f" (rank {lora.r}, targets {','.join(lora.targets) or 'the family default'}"
                                           + (f", base {lora.quantize}" if lora.quantize != "none" else "") + ")"
                                           if lora else "")
            if found.shape is None:
                print(f"\nno model of family {found.family} fits this node in {what}")
            else:
                print(f"\nlargest that fits in {what}: {found.shape.name} "
                      f"({planner.human_params(found.shape.num_params)} params){planned_only}")
        return 0 if found.shape is not None else 1

    if args.config:
        from horizon_ray.jobspec import JobSpec

        spec = JobSpec.from_yaml(args.config, overrides=args.overrides)
        p = planner.plan_for_spec(spec, node, gpu_budget_bytes=budget)
    else:
        p = planner.plan(args.model, method=method, mode=mode, node=node, **job)
    print(json.dumps(p.to_dict(), indent=2) if args.json else planner.format_plan(p))
    return 0 if p.fits else 1
