"""Flags of ``python -m horizon_ray.bench`` and ``horizon-ray bench`` (one definition for both)."""

from __future__ import annotations

import argparse
import os
import sys

from horizon_ray.bench.metrics import SYSTEMS, UPDATE_MODES, parse_updates
from horizon_ray.bench.shapes import SHAPES
from horizon_ray.commands.plan import layer_chunk_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what to run")
    what.add_argument("--systems", default=None,
                      help=f"comma list of {', '.join(SYSTEMS)}, each in its own process (default: horizon-ray "
                           "and the in-GPU peers of its modes: in-gpu-baseline,in-gpu-liger for full fine-tuning, "
                           "in-gpu-peft,in-gpu-peft-liger for --mode lora; fsdp2-offload only when named; with "
                           "--find-largest: fsdp2-offload,in-gpu-baseline)")
    what.add_argument("--system", choices=SYSTEMS, default=None,
                      help="run one system in this process and print its RESULT lines (what the suite's "
                           "children run)")
    what.add_argument("--shape", default="qwen2.5-7b",
                      help=f"a shape ({', '.join(SHAPES)}), NAME@<layers>L, or 'largest': the largest Qwen2.5 "
                           "shape the planner fits in this host's RAM")
    what.add_argument("--layers", type=int, default=None, help="override the layer count of the shape")
    what.add_argument("--find-largest", action="store_true",
                      help="try --shapes smallest first and stop after the first that does not fit")
    what.add_argument("--shapes", default=None,
                      help="with --find-largest: comma list of shapes (default: qwen2.5-1.5b,3b,7b,14b)")
    what.add_argument("--report", action="store_true",
                      help="only regenerate RESULTS.md from the result files, run nothing")
    what.add_argument("--merge", metavar="DIR", default=None,
                      help="add the result files of DIR (a GPU box's $OUT/results) to --results-dir, then "
                           "regenerate RESULTS.md; run nothing")
    what.add_argument("--optimizer-probe", action="store_true", help="only measure the host AdamW variants")

    job = p.add_argument_group("the step")
    job.add_argument("--seq", "--seq-len", dest="seq", type=int, default=1024, help="tokens per sequence")
    job.add_argument("--micro", "--micro-batch-size", dest="micro", type=int, default=16,
                     help="sequences per micro-batch")
    job.add_argument("--accum", "--grad-accum", dest="accum", default="1",
                     help="micro-batches per optimizer step; a comma list runs each on one model")
    job.add_argument("--checkpoint-every", type=int, default=1, help="keep one layer input every K layers")
    job.add_argument("--mode", "--precision", dest="mode", default="exact",
                     help="horizon-ray's mode: exact, bf16-state or lora (frozen bf16 base, fp32 adapters); a "
                          "comma list runs each")
    job.add_argument("--update", default="exact",
                     help=f"horizon-ray's host update: {', '.join(UPDATE_MODES)}; a comma list runs each in the same "
                          "engine process, all of them at one accumulation before the next accumulation")
    job.add_argument("--lora-r", type=int, default=16,
                     help="with --mode lora and the PEFT peers: adapter rank (alpha is 2 r, dropout 0)")
    job.add_argument("--lora-targets", default="",
                     help="with --mode lora and the PEFT peers: comma list of projections that get adapters "
                          "(default: every projection of the shape's family: attention and MLP, the experts' "
                          "stacked projections on a mixture of experts, Phi-3's fused qkv_proj and gate_up_proj)")
    job.add_argument("--quantize", default="none", choices=("none", "nf4", "fp4", "int8"),
                     help="with --mode lora: the frozen base quantized (QLoRA: nf4); the PEFT peers then run on "
                          "bitsandbytes' Linear4bit / Linear8bitLt layers (PEFT + bitsandbytes QLoRA)")
    job.add_argument("--offload", default="auto",
                     help="horizon-ray's activation checkpoints on the host: auto, true, false; a comma list "
                          "runs each (auto: host on CUDA)")
    job.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                     help="compute dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    job.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    job.add_argument("--loss-chunk", type=int, default=1024, help="horizon-ray's tokens per loss chunk")
    job.add_argument("--layer-chunk", type=layer_chunk_arg, default="auto",
                     help="horizon-ray's tokens per row group: a micro-batch runs through a layer in row groups of "
                          "at most this many tokens (the job spec's layer_chunk_tokens: larger groups make larger "
                          "GEMMs and take more GPU memory); auto, as a job: on a GPU the largest of 16384 ... 1024 "
                          "whose plan fits --gpu-budget-gib at the largest --accum, 8192 on the CPU")
    job.add_argument("--projections", default="auto", choices=("auto", "fused", "split"),
                     help="horizon-ray's full fine-tuning: q, k, v and gate, up each one GEMM (fused) or every "
                          "projection its own GEMM (split), the job spec's engine.fuse_projections; auto: split on "
                          "a GPU where a row group holds 16,384 tokens or more, fused elsewhere")
    job.add_argument("--max-grad-norm", type=float, default=1.0,
                     help="global-norm clipping of every system (the speculative update's benchmarks set it high "
                          "enough that clipping stays inactive)")
    job.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    job.add_argument("--steps", type=int, default=3, help="timed steps (the median is reported)")
    job.add_argument("--gpu-budget-gib", type=float, default=None,
                     help="cap horizon-ray's GPU memory (the baseline always has the whole GPU)")
    job.add_argument("--fsdp-gpu-budget-gib", type=float, default=None,
                     help="cap the FSDP2 peer's GPU memory (default: the whole GPU)")
    job.add_argument("--no-profile", dest="profile", action="store_false",
                     help="skip the extra profiled step that splits GPU compute / exposed copies / idle")
    job.add_argument("--fsdp-on-cpu", action="store_true",
                     help="run the FSDP2 peer on the CPU (gloo, no pinning): tests its code without a GPU")

    out = p.add_argument_group("where results go")
    out.add_argument("--results-dir", default="benchmarks/results", help="result JSON files")
    out.add_argument("--results-md", default=None, help="the markdown table (default: RESULTS-DIR/../RESULTS.md)")
    out.add_argument("--out", default=None, help="also append each run as a JSON line to this file")
    out.add_argument("--box", default="auto", help="machine name in file names and tables (auto: h200, cpu, ...)")
    out.add_argument("--commit", default=None,
                     help="commit that runs (default: $HORIZON_RAY_COMMIT, else git HEAD, else unknown)")
    out.add_argument("--child-timeout-s", type=float, default=3600, help="kill a system's process after this")
    out.add_argument("--time-limit-s", type=float, default=None,
                     help="the whole suite's time limit: children that would start later are recorded not-run")


def canonical_argv(args) -> list[str]:
    """The flags that differ from their defaults, in definition order: the command a result records."""
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    out = []
    for action in p._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value == action.default or value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out.append(flag)
        else:
            out += [flag, format(value, "g") if isinstance(value, float) else str(value)]
    return out


def run(args) -> int:
    # set before anything initialises CUDA in this process (the --system path runs torch here)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for name in ("seq", "micro", "warmup", "steps", "checkpoint_every", "loss_chunk", "layer_chunk"):
        if getattr(args, name) != "auto" and getattr(args, name) < (0 if name == "warmup" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}")
    parse_updates(args.update)
    if args.report or args.merge:
        from horizon_ray.bench.report import merge_results, write_report

        if args.merge:
            if not os.path.isdir(args.merge):
                raise ValueError(f"--merge {args.merge}: no such directory")
            print(f"added {merge_results(args.merge, args.results_dir)} runs to {args.results_dir}")
        md = args.results_md or os.path.join(os.path.dirname(os.path.abspath(args.results_dir)), "RESULTS.md")
        print(f"wrote {write_report(args.results_dir, md)}")
        return 0
    if args.optimizer_probe:
        from horizon_ray.bench.engine_run import optimizer_probe

        optimizer_probe()
        return 0
    if args.system:
        if "," in args.mode or "," in args.offload:
            raise ValueError("--system runs one variant: give one --mode and one --offload")
        from horizon_ray.bench.child import run_child

        return run_child(args)
    from horizon_ray.bench.suite import run_suite

    return run_suite(args, canonical_argv(args))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m horizon_ray.bench", description=_doc(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _doc() -> str:
    import horizon_ray.bench

    return horizon_ray.bench.__doc__ or ""
