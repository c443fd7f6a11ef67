"""Streaming-engine benchmark on a random-init model of a named shape (no downloads).

    python -m horizon_ray.bench --shape qwen2.5-7b --seq 1024 --micro 16 --accum 4 --checkpoint-every 4

Prints one RESULT line of JSON per run: tokens/s (non-padding tokens), model TFLOP/s and MFU in the house
convention (6 N tokens + 6 L heads head_dim seq tokens, recompute not counted; MFU against the measured
786.5 TFLOP/s bf16 rate and the 989.5 datasheet), peak GPU memory, host RSS, step-time split.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from horizon_ray.engine import Engine, EngineConfig

MEASURED_BF16_FLOPS = 786.5e12
DATASHEET_BF16_FLOPS = 989.5e12

SHAPES = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2"),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2"),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2"),
}


def shape_config(name: str, layers: int | None = None) -> dict:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    cfg = dict(SHAPES[name], architectures=[{"qwen2": "Qwen2ForCausalLM"}[SHAPES[name]["model_type"]]],
               rms_norm_eps=1e-6, rope_theta=1e6)
    if layers:
        cfg["num_hidden_layers"] = layers
    return cfg


def model_flops_per_token(cfg: dict, seq: int) -> float:
    H, I, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = H // heads
    layer = H * heads * hd * 2 + H * kv * hd * 2 + 3 * H * I
    n = L * layer + V * H  # parameters that multiply: layers and the LM head (the embedding is a lookup)
    return 6 * n + 6 * L * heads * hd * seq


def host_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(args) -> list[dict]:
    cfg = shape_config(args.shape, args.layers)
    t0 = time.perf_counter()
    rss0 = host_rss()
    eng = Engine.from_config(cfg, EngineConfig(lr=1e-5, weight_decay=0.01, max_grad_norm=1.0,
                                               checkpoint_every=args.checkpoint_every, device=args.device,
                                               compute_dtype=args.dtype, loss_chunk_tokens=args.loss_chunk,
                                               offload_checkpoints={"auto": "auto", "true": True,
                                                                    "false": False}[args.offload]))
    init_s = time.perf_counter() - t0
    cuda = eng.device.type == "cuda"
    if cuda and args.gpu_budget_gib:
        # enforce the budget: an allocation past it fails as it would on a smaller GPU
        total = torch.cuda.get_device_properties(eng.device).total_memory
        torch.cuda.set_per_process_memory_fraction(args.gpu_budget_gib * 2**30 / total, eng.device)
    results = []
    for accum in [int(a) for a in str(args.accum).split(",")]:
        results.append(_measure(eng, cfg, args, accum, rss0, init_s))
    eng.close()
    return results


def _measure(eng, cfg, args, accum, rss0, init_s) -> dict:
    V = cfg["vocab_size"]
    g = torch.Generator().manual_seed(0)
    batches = [[(ids, ids) for ids in (torch.randint(0, V, (args.micro, args.seq), generator=g)
                                      for _ in range(accum))] for _ in range(2)]
    cuda = eng.device.type == "cuda"
    times, waits, updates = [], [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        eng.optimizer.waited_s = 0.0
        s = time.perf_counter()
        eng.train_step(batches[step % 2])
        times.append(time.perf_counter() - s)
        waits.append(eng.optimizer.waited_s)
        updates.append(eng.optimizer.update_s)
    eng.optimizer.wait_all()
    timed = times[args.warmup:]
    step_s = statistics.median(timed)
    tokens = args.micro * accum * args.seq
    flops = model_flops_per_token(cfg, args.seq) * tokens / step_s
    mem = eng.memory_report()
    return dict(
        system="horizon-ray", shape=args.shape, layers=cfg["num_hidden_layers"], params=eng.num_params,
        mode="exact", dtype=args.dtype, seq_len=args.seq, micro=args.micro, accum=accum,
        checkpoint_every=args.checkpoint_every, tokens_per_step=tokens, step_s=round(step_s, 4),
        step_times=[round(t, 4) for t in timed], tokens_per_s=round(tokens / step_s, 1),
        model_tflops=round(flops / 1e12, 1), mfu_measured=round(flops / MEASURED_BF16_FLOPS, 4),
        mfu_datasheet=round(flops / DATASHEET_BF16_FLOPS, 4),
        peak_gpu_bytes=torch.cuda.max_memory_allocated() if cuda else 0,
        host_rss_bytes=host_rss(), host_rss_growth_bytes=host_rss() - rss0, store_bytes=mem["host"],
        device_bytes=mem["device"], init_s=round(init_s, 1),
        exposed_optimizer_s=round(statistics.median(waits[args.warmup:]), 4),
        optimizer_update_s=round(statistics.median(updates[args.warmup:]), 4),
        gpu_budget_bytes=int(args.gpu_budget_gib * 2**30) if args.gpu_budget_gib else None,
        host_checkpoint_bytes=eng.streamer.host_checkpoint_bytes(),
    )


def optimizer_probe(params: int = 1 << 30, units: int = 4) -> list[dict]:
    """Host AdamW throughput in the store's real layout (bf16 wire/gradient, fp32 master and moments),
    by thread placement, thread count, chunk size and clipping."""
    import threading

    from horizon_ray.engine.model import _unit
    from horizon_ray.engine.optimizer import HostAdamW
    from horizon_ray.engine.store import HostStore

    n = params // units
    store = HostStore([_unit(f"u{i}", [(f"w{i}", "w", (n,))]) for i in range(units)], torch.bfloat16,
                      torch.float32, pin=torch.cuda.is_available())
    for u in store.units:
        u.master.normal_()
        u.wire.normal_()
    opt = HostAdamW(store, (0.9, 0.95), 1e-8, 0.01, on_updated=lambda u: None)
    out = []
    for where in ("main", "thread"):
        for threads in (0, max(1, (os.cpu_count() or 4) - 2)):
            for chunk in (1 << 19, 1 << 21, 1 << 23):
                for clip in (1.0, 0.5):
                    opt.chunk = chunk

                    def work(threads=threads, clip=clip):
                        if threads:
                            torch.set_num_threads(threads)
                        for u in store.units:
                            opt.update(u, 1e-5, clip)

                    t = time.perf_counter()
                    if where == "main":
                        work()
                    else:
                        th = threading.Thread(target=work)
                        th.start()
                        th.join()
                    dt = time.perf_counter() - t
                    torch.set_num_threads(os.cpu_count() or 1)
                    out.append(dict(where=where, threads=threads or torch.get_num_threads(), chunk=chunk, clip=clip,
                                    g_params_per_s=round(params / dt / 1e9, 3)))
                    print("OPT", json.dumps(out[-1]), flush=True)
    return out


def main(argv=None) -> int:
    # a streaming step allocates and frees tensors of many sizes; segments that grow avoid fragmentation
    # eating into a tight GPU budget (must be set before CUDA initialises)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="override the layer count of the shape")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--accum", default="1", help="gradient accumulation; a comma list runs each on one engine")
    p.add_argument("--checkpoint-every", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--loss-chunk", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--gpu-budget-gib", type=float, default=None, help="cap the process's GPU memory")
    p.add_argument("--offload", default="auto", choices=["auto", "true", "false"])
    p.add_argument("--out", default=None, help="append the result as a JSON line to this file")
    p.add_argument("--optimizer-probe", action="store_true", help="only measure the host AdamW variants")
    args = p.parse_args(argv)
    if args.optimizer_probe:
        optimizer_probe()
        return 0
    for result in run(args):
        line = json.dumps(result)
        print("RESULT", line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
