"""DPO on the H200 box: horizon-ray's streamed engine against TRL's DPOTrainer loss in-GPU, same pairs, same
tokens a step, in the same call (one child process per system, so each has the GPU to itself).

    python benchmarks/dpo.py --shape qwen2.5-7b --method lora --tokens-per-step 16384,65536 --out results.json
    python benchmarks/dpo.py --shape tiny --device cpu --steps 2          # a smoke run anywhere

Systems:
- ``horizon-ray``: ``Engine.from_config`` of the shape (random init; full: exact fp32 master and AdamW on the
  host; lora: the bf16 base frozen, fp32 adapters), ``sequence_logps`` for the reference pass, then
  ``train_step(..., dpo=...)``; no second model anywhere.
- ``trl``: the shape's HF model wholly on the GPU (bf16; lora: PEFT with fp32 adapters under bf16 autocast; full:
  bf16 weights and fused ``torch.optim.AdamW``), non-reentrant activation checkpointing, the loss of TRL's
  ``DPOTrainer._compute_loss`` (its fused LM head, ``precompute_ref_log_probs``: the reference is one
  no-grad pass first, as ours is), HF Trainer's step (loss / accumulation, ``clip_grad_norm_`` at 1.0). TRL must
  be importable (carry its wheels); without it the system is recorded ``skipped``.

Both see the same pairs: rows of ``--seq`` tokens (a prompt of a quarter of them shared by the pair, the
completions filling the rest), ``--micro`` rows a micro-batch, as many micro-batches as make the tokens a
step. tokens/s counts chosen + rejected non-pad tokens (every token of a row here); the reference pass's time
is reported apart (``reference_s``) and in total (``total_s``: reference + the timed steps). Plain torch,
transformers, peft (no pydantic): it runs with the GPU box's packages.

Each system checkpoints as it runs best: the engine keeps every layer's input (``--checkpoint-every 1``, its
default; the checkpoints go to host memory when the GPU budget asks) and runs each layer forward once more in
the backward; a block of K layers would cost K - 1 more forwards to rebuild its inputs. TRL checkpoints only
every ``--peer-checkpoint-every``-th decoder layer (transformers' ``every_n_layers``; 4 by default): the rest
keep their activations on the GPU and are not run again; a transformers without ``every_n_layers``
checkpoints every layer, and ``checkpoint_every`` records the interval in effect, not the one asked for.
``recomputed_layers`` records each system's layer forwards in the backward per layer: 1.0 for the engine at 1
(1.75 at 4 on 28 layers), 0.25 for TRL at 4 (1.0 where every layer is checkpointed), so a token costs the
engine 4 forward-equivalents (forward, backward 2, recompute 1) and TRL 3.25 to 4.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from horizon_ray.bench.metrics import host_peak_rss, host_rss  # noqa: E402
from horizon_ray.bench.runtime import cap_gpu_memory  # noqa: E402
from horizon_ray.bench.shapes import hf_config, resolve_shape  # noqa: E402

SYSTEMS = ("horizon-ray", "trl")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pairs(vocab: int, rows: int, seq: int, seed: int) -> torch.Tensor:
    """[rows, seq] token ids, rows 2i and 2i+1 a pair sharing the prompt (the first seq // 4 tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    ids[1::2, : seq // 4] = ids[0::2, : seq // 4]
    return ids


def step_batches(args, vocab: int, tokens: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step's micro-batches as the engine takes them: (ids, labels on the completions only)."""
    rows = tokens // args.seq
    ids = pairs(vocab, rows, args.seq, seed=1000 * tokens + step)
    labels = ids.clone()
    labels[:, : args.seq // 4] = -100
    return [(ids[i:i + args.micro], labels[i:i + args.micro]) for i in range(0, rows, args.micro)]


def run_ours(args, tokens: int) -> dict:
    from horizon_ray.engine import DpoConfig, Engine, EngineConfig, LoraConfig

    shape = resolve_shape(args.shape)
    lora = LoraConfig(r=args.lora_r, alpha=2 * args.lora_r, targets=LORA_TARGETS) if args.method == "lora" else None
    eng = Engine.from_config(hf_config(shape), EngineConfig(
        lr=1e-6, max_grad_norm=1.0, checkpoint_every=args.checkpoint_every, device=args.device,
        compute_dtype="bfloat16" if args.device != "cpu" else "float32", lora=lora))
    cap_gpu_memory(_budget(args), eng.device)  # an allocation past the budget fails as on a GPU of that size
    steps = [step_batches(args, shape.vocab_size, tokens, s) for s in range(args.steps + 1)]
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    refs = [eng.sequence_logps(mbs) for mbs in steps]
    sync()
    reference_s = time.perf_counter() - t0
    dpo = DpoConfig(beta=0.1)
    eng.train_step(steps[0], dpo=dpo, ref_logps=refs[0])  # warm-up
    eng.synchronize()
    sync()
    t0 = time.perf_counter()
    losses = [eng.train_step(mbs, dpo=dpo, ref_logps=ref) for mbs, ref in zip(steps[1:], refs[1:])]
    eng.synchronize()
    sync()
    timed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if eng.device.type == "cuda" else 0
    rss = host_rss()  # with every buffer of the step still resident, as the bench measures it
    eng.close()
    planned = _planned_host_bytes(args, shape, len(steps[0]))
    L, K = shape.num_layers, args.checkpoint_every
    recomputed = 1 + (L - -(-L // K)) / L  # every layer once with grad, and the blocks' other inputs rebuilt
    return {"losses": losses, "reference_s": reference_s, "timed_s": timed, "peak_gpu_bytes": peak,
            "gpu_budget_bytes": _budget(args), "checkpoint_every": K, "recomputed_layers": round(recomputed, 4),
            "host_rss_bytes": rss,
            "host_peak_rss_bytes": host_peak_rss(), **planned,
            "rss_vs_plan": round(rss / planned["planned_host_bytes"], 4) if planned.get("planned_host_bytes") else None}


def _budget(args) -> int | None:
    return int(args.gpu_budget_gib * 2**30) if args.gpu_budget_gib else None


def _planned_host_bytes(args, shape, accum: int) -> dict:
    """The planner's host bytes for this engine (a DPO job's are SFT's with the same settings, plus 4 bytes a row
    of reference log-probs: planner.planning._with_preference), with its error where it cannot plan."""
    from horizon_ray.bench.planning import planned_bytes
    from horizon_ray.engine import EngineConfig
    from horizon_ray.workload import Adapters

    lora = Adapters(r=args.lora_r, targets=LORA_TARGETS) if args.method == "lora" else None
    plan = planned_bytes(shape, mode="lora" if lora else "exact", seq=args.seq, micro=args.micro, accum=accum,
                         checkpoint_every=args.checkpoint_every,
                         dtype="bfloat16" if args.device != "cpu" else "float32", device=args.device,
                         gpu_budget_bytes=_budget(args), loss_chunk=EngineConfig().loss_chunk_tokens, offload="auto",
                         lora=lora)
    return {k: plan[k] for k in ("planned_host_bytes", "plan_error") if k in plan}


def _trl_stub(model, beta: float):
    """The attributes of a DPOTrainer that _compute_loss reads (sigmoid loss, precomputed references)."""
    from collections import defaultdict

    accel = SimpleNamespace(device=next(model.parameters()).device, gather=lambda t: t,
                            gather_for_metrics=lambda t: t, unwrap_model=lambda m: m)
    return SimpleNamespace(accelerator=accel, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
                           f_divergence_type="reverse_kl", loss_types=["sigmoid"], loss_weights=[1.0], beta=beta,
                           label_smoothing=0.0, use_weighting=False, model=model, ref_model=None,
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                           _tp_size=1, args=SimpleNamespace())


def _trl_inputs(ids: torch.Tensor, seq: int, device) -> dict:
    order = torch.cat([torch.arange(0, ids.shape[0], 2), torch.arange(1, ids.shape[0], 2)])
    ids = ids[order].to(device)
    mask = torch.ones_like(ids)
    mask[:, : seq // 4] = 0
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask}


def run_trl(args, tokens: int) -> dict:
    try:
        from trl.trainer.dpo_trainer import DPOTrainer
        from trl.trainer.utils import add_fused_lm_head
    except ImportError as exc:
        return {"status": "skipped", "reason": f"trl is not importable here ({exc}); carry its wheels"}
    from horizon_ray.bench import hf

    shape = resolve_shape(args.shape)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = hf.build_model(shape, dtype)
    # transformers checkpoints only every peer_checkpoint_every-th decoder layer where it can (the rest keep
    # their activations and are not run again in the backward); an older one checkpoints every layer, and the
    # record says the interval that ran, not the one asked for
    every = hf.enable_checkpointing(model, args.peer_checkpoint_every)
    layers = model.get_decoder().layers
    recompute = sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers) / len(layers)
    # TRL's fused head (the outputs its loss reads), added before PEFT wraps the model as TRL's docs ask
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    if args.method == "lora":
        model = hf.peft_lora(model, args.lora_r, 2 * args.lora_r, LORA_TARGETS)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else None
    trainer = _trl_stub(model, 0.1)
    steps = [step_batches(args, shape.vocab_size, tokens, s) for s in range(args.steps + 1)]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def logps(ids):
        inputs = _trl_inputs(ids, args.seq, device)
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        with torch.no_grad(), autocast or torch.autocast("cpu", enabled=False):
            lp = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                       fused_lm_head=True).log_probs.sum(1)
        return lp.chunk(2)

    def step(mbs, refs):
        opt.zero_grad(set_to_none=True)
        model.train()
        for (ids, _), (rc, rr) in zip(mbs, refs):
            inputs = {**_trl_inputs(ids, args.seq, device), "ref_chosen_logps": rc, "ref_rejected_logps": rr}
            with autocast or torch.autocast("cpu", enabled=False):
                loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
            (loss / len(mbs)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss.detach())

    sync()
    t0 = time.perf_counter()
    refs = [[logps(ids) for ids, _ in mbs] for mbs in steps]
    sync()
    reference_s = time.perf_counter() - t0
    step(steps[0], refs[0])  # warm-up
    sync()
    t0 = time.perf_counter()
    losses = [step(mbs, ref) for mbs, ref in zip(steps[1:], refs[1:])]
    sync()
    timed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return {"losses": losses, "reference_s": reference_s, "timed_s": timed, "peak_gpu_bytes": peak,
            "checkpoint_every": every, "recomputed_layers": round(recompute, 4)}


def child(args) -> None:
    """One system at one token count, its record on stdout's last line."""
    tokens = int(args.tokens_per_step)
    rec = {"system": args.system, "shape": args.shape, "method": args.method, "tokens_per_step": tokens,
           "seq": args.seq, "micro": args.micro, "steps": args.steps, "device": args.device}
    try:
        out = (run_ours if args.system == "horizon-ray" else run_trl)(args, tokens)
        rec.update(out)
        if "timed_s" in out:
            # chosen + rejected non-pad tokens (every row is full), the timed steps only; the reference apart
            rec.update(status="ok", tokens_per_s=round(tokens * args.steps / out["timed_s"], 1),
                       total_s=round(out["reference_s"] / (args.steps + 1) * args.steps + out["timed_s"], 3),
                       reference_tokens_per_s=round(tokens * (args.steps + 1) / out["reference_s"], 1))
    except torch.cuda.OutOfMemoryError as exc:
        rec.update(status="oom", reason=str(exc).splitlines()[0])
    print(json.dumps(rec), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--method", default="lora,full", help="lora, full or both (comma-separated)")
    p.add_argument("--tokens-per-step", default="16384,65536")
    p.add_argument("--seq", type=int, default=1024, help="tokens a row (a pair is two rows)")
    p.add_argument("--micro", type=int, default=16, help="rows a micro-batch (even: whole pairs)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    p.add_argument("--checkpoint-every", type=int, default=1,
                   help="horizon-ray: keep one layer input every K layers (1: every layer's, the engine's default)")
    p.add_argument("--gpu-budget-gib", type=float, default=None,
                   help="horizon-ray: the GPU memory it may allocate (the in-GPU peer has the whole GPU)")
    p.add_argument("--peer-checkpoint-every", type=int, default=4,
                   help="TRL: checkpoint every K-th decoder layer, the others keep their activations on the GPU")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--out", default=None, help="write the records (a JSON list) here")
    p.add_argument("--system", help=argparse.SUPPRESS)  # a child's one system
    args = p.parse_args(argv)
    if args.micro % 2 or args.micro < 2:
        p.error("--micro counts rows, two a pair: give an even number")
    if args.system:
        child(args)
        return 0
    records = []
    for method in args.method.split(","):
        for tokens in (int(t) for t in args.tokens_per_step.split(",")):
            if tokens % args.seq or (tokens // args.seq) % args.micro:
                p.error(f"--tokens-per-step {tokens} must be a multiple of --seq x --micro ({args.seq * args.micro})")
            by_system = {}
            for system in args.systems.split(","):
                cmd = [sys.executable, __file__, "--system", system, "--shape", args.shape, "--method", method,
                       "--tokens-per-step", str(tokens), "--seq", str(args.seq), "--micro", str(args.micro),
                       "--steps", str(args.steps), "--checkpoint-every", str(args.checkpoint_every),
                       "--peer-checkpoint-every", str(args.peer_checkpoint_every),
                       *(["--gpu-budget-gib", str(args.gpu_budget_gib)] if args.gpu_budget_gib else []),
                       "--lora-r", str(args.lora_r), "--device", args.device]
                # the repo first, then what the caller had on its path (carried wheels: TRL on the GPU box)
                path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
                proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
                lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
                rec = json.loads(lines[-1]) if lines else {"system": system, "status": "error",
                                                           "reason": proc.stderr[-2000:]}
                by_system[system] = rec
                records.append(rec)
                print(json.dumps(rec), flush=True)
            ours, peer = by_system.get("horizon-ray", {}), by_system.get("trl", {})
            if ours.get("status") == peer.get("status") == "ok":
                ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
                ours["ratio_trl"] = round(ratio, 3)
                print(f"{method} {tokens} tokens/step: horizon-ray {ours['tokens_per_s']:,.0f} tokens/s, trl "
                      f"{peer['tokens_per_s']:,.0f}: {ratio:.2f}x; reference pass {ours['reference_s']:.1f} s vs "
                      f"{peer['reference_s']:.1f} s; loss {ours['losses'][-1]:.4f} vs {peer['losses'][-1]:.4f}; "
                      f"layers run again in the backward {ours['recomputed_layers']:.0%} vs "
                      f"{peer['recomputed_layers']:.0%}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=2) + "\n")
    return 0 if all(r.get("status") in ("ok", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
