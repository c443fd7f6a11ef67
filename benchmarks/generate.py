"""Generation on the streamed engine against HF ``generate`` in-GPU, on the same prompts in the same run.

    python benchmarks/generate.py [--shape qwen2.5-7b] [--batch 64] [--prompt-len 512] [--new-tokens 256]
                                  [--stream-budget 12GiB] [--latency-shape qwen2.5-0.5b] [--out FILE.json]

One random-init model of the shape (bf16, nothing downloaded) feeds both sides. Four measurements:
1. HF: ``model.generate`` with the whole model on the GPU (greedy, exactly --new-tokens new tokens).
2. resident: the engine's generator with the model on the GPU (it fits the budget), the same prompts, its decode
   steps as CUDA graphs (engine/decode_graphs.py); then ``resident_eager``: the same steps launched kernel by
   kernel (what the graphs take off the host).
3. streamed: the engine under a GPU budget of --stream-budget (the weights stream layer by layer once for the
   prompts and once per decode step; the KV cache on the GPU as far as the budget leaves room, in pinned
   host memory beyond), with its PCIe bound: bytes that cross per decode step / the H2D bandwidth measured
   here (pinned, 1 GiB copies) -> the decode tokens/s the link allows; ours as a share of it.
4. first-token latency of a resident --latency-shape model: one --prompt-len prompt, one new token (median
   of 5 after a warm-up), ours and HF's.
Output tokens/s count new tokens of the whole batch over the whole call (prefill included); decode tokens/s
exclude the prompts' pass. Also the share of rows whose greedy tokens equal HF's (bf16: batches of different
shapes may round differently, so this is reported, not asserted; tests/gpu pins equality in fp32).

Runs where the GPU box has torch and transformers only: it imports neither ray, fastapi nor pydantic.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from horizon_ray.bench.shapes import hf_config, resolve_shape  # noqa: E402
from horizon_ray.engine.generate import Generator, KVCache  # noqa: E402
from horizon_ray.engine.sampling import Request, SamplingParams  # noqa: E402

GiB = 1 << 30


def _hf_model(cfg: dict, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    c = dict(cfg)
    model_type = c.pop("model_type")
    c.pop("architectures", None)
    config = AutoConfig.for_model(model_type, **c)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def _sync():
    torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def h2d_bandwidth(nbytes: int = GiB, reps: int = 5) -> float:
    """Bytes/s of a pinned host -> device copy (the median of ``reps``)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 1):
        _, t = _timed(lambda: dst.copy_(src, non_blocking=True))
        times.append(t)
    return nbytes / statistics.median(times[1:])


def _hf_generate(model, prompts_BT: torch.Tensor, new: int) -> tuple[torch.Tensor, float]:
    ids = prompts_BT.cuda()
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    model.generate(ids[:, :8], **{**kw, "attention_mask": mask[:, :8], "max_new_tokens": 2, "min_new_tokens": 2})
    out, t = _timed(lambda: model.generate(ids, **kw))
    return out[:, ids.shape[1]:].cpu(), t


def _ours(gen: Generator, prompts_BT: torch.Tensor, new: int) -> tuple[list[list[int]], float, float]:
    """(tokens, seconds of the whole call, seconds of its first step: the prompts' pass and one token)."""
    reqs = [Request(tuple(row.tolist()), SamplingParams(max_tokens=new)) for row in prompts_BT]
    gen.generate([Request(r.prompt_ids[:8], SamplingParams(max_tokens=2)) for r in reqs])  # warm-up
    tokens: list[list[int]] = [[] for _ in reqs]
    _sync()
    t0 = time.perf_counter()
    first = None
    for step in gen.stream(reqs):
        for d in step:
            if d.token_id is not None:
                tokens[d.row].append(d.token_id)
        if first is None:
            first = time.perf_counter() - t0
    _sync()
    return tokens, time.perf_counter() - t0, first


def _match(ours: list[list[int]], hf: torch.Tensor) -> float:
    return sum(o == h for o, h in zip(ours, hf.tolist())) / len(ours)


def _rates(B: int, new: int, total_s: float, first_s: float) -> dict:
    decode_s = total_s - first_s
    return {"seconds": total_s, "first_step_s": first_s, "output_tokens_per_s": B * new / total_s,
            "decode_tokens_per_s": B * (new - 1) / decode_s if decode_s > 0 else None}


def _report(what: str, record: dict) -> None:
    """Each measurement as it lands: a call cut short by its time limit still shows what it measured."""
    print(f"{what}: {json.dumps(record)}", flush=True)


def throughput(shape_name: str, B: int, T: int, new: int, stream_budget: int) -> dict:
    shape = resolve_shape(shape_name)
    cfg = hf_config(shape)
    cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings") or 0), T + new)
    model = _hf_model(cfg, "cuda")  # a 7B random init on the CPU takes minutes; on the GPU, seconds
    tensors = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, int(cfg["vocab_size"]), (B, T), generator=g)
    out: dict = {"shape": shape_name, "batch": B, "prompt_len": T, "new_tokens": new,
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    hf_tokens, hf_s = _hf_generate(model, prompts, new)
    out["hf"] = {"seconds": hf_s, "output_tokens_per_s": B * new / hf_s}
    _report("hf", out["hf"])
    model.cpu()
    gc.collect()
    torch.cuda.empty_cache()

    gen = Generator.from_tensors(cfg, tensors, device="cuda", dtype="bfloat16")
    assert gen.resident, "the model does not fit this GPU: no resident measurement"
    toks, total, first = _ours(gen, prompts, new)
    graphs = gen._graphs
    out["resident"] = {**_rates(B, new, total, first), "vs_hf": (B * new / total) / out["hf"]["output_tokens_per_s"],
                       "rows_equal_to_hf": _match(toks, hf_tokens),
                       "decode_graphs": bool(graphs is not None and not graphs.failed and graphs.replays)}
    _report("resident", out["resident"])
    gen.decode_graphs = False  # the same steps launched kernel by kernel: what the graphs take off the host
    eager_toks, total, first = _ours(gen, prompts, new)
    out["resident_eager"] = {**_rates(B, new, total, first),
                             "vs_hf": (B * new / total) / out["hf"]["output_tokens_per_s"],
                             "rows_equal_to_graphs": _match(eager_toks, torch.tensor(toks))}
    _report("resident_eager", out["resident_eager"])
    del gen
    gc.collect()
    torch.cuda.empty_cache()

    gen = Generator.from_tensors(cfg, tensors, device="cuda", dtype="bfloat16", gpu_budget_bytes=stream_budget)
    assert not gen.resident
    toks, total, first = _ours(gen, prompts, new)
    kv_layers = gen._device_kv_layers(B, T + new, T)
    L = gen.model.num_layers
    # what crosses PCIe per decode step: every decoder layer's weights (the head's and a tied embedding's slots
    # keep theirs; an untied embedding is gathered on the host: only its rows cross), and the cached keys and
    # values of the layers kept on the host (the mean cache length of a step)
    streamed = sum(u.master.nbytes for u in gen.store.units[1:-1])
    kv_host = (L - kv_layers) * KVCache.layer_bytes(gen.model, B, T + new // 2, gen.dtype)
    per_step = streamed + kv_host
    bw = h2d_bandwidth()
    bound = B / (per_step / bw)
    rates = _rates(B, new, total, first)
    out["streamed"] = {**rates, "gpu_budget_bytes": stream_budget, "kv_layers_on_gpu": kv_layers, "layers": L,
                       "bytes_per_decode_step": per_step, "h2d_bytes_per_s": bw, "pcie_bound_tokens_per_s": bound,
                       "vs_pcie_bound": (rates["decode_tokens_per_s"] or 0) / bound,
                       "rows_equal_to_hf": _match(toks, hf_tokens)}
    _report("streamed", out["streamed"])
    del gen, model, tensors
    gc.collect()
    torch.cuda.empty_cache()
    return out


def first_token_latency(shape_name: str, T: int, reps: int = 5) -> dict:
    cfg = hf_config(resolve_shape(shape_name))
    model = _hf_model(cfg, "cuda")
    tensors = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    gen = Generator.from_tensors(cfg, tensors, device="cuda", dtype="bfloat16")
    prompt = torch.randint(3, int(cfg["vocab_size"]), (1, T), generator=torch.Generator().manual_seed(2))
    req = [Request(tuple(prompt[0].tolist()), SamplingParams(max_tokens=1))]
    gen.generate(req)
    ours = [_timed(lambda: gen.generate(req))[1] for _ in range(reps)]
    ids = prompt.cuda()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)
    model.generate(ids, **kw)
    hf = [_timed(lambda: model.generate(ids, **kw))[1] for _ in range(reps)]
    return {"shape": shape_name, "prompt_len": T, "ours_s": statistics.median(ours), "hf_s": statistics.median(hf),
            "target_s": 0.2}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--stream-budget", default="12GiB", help="GPU budget of the streamed run (GiB)")
    p.add_argument("--latency-shape", default="qwen2.5-0.5b")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    budget = int(float(args.stream_budget.removesuffix("GiB")) * GiB)
    first = first_token_latency(args.latency_shape, args.prompt_len)  # small and quick: first
    _report("first_token", first)
    result = {"first_token": first,
              "throughput": throughput(args.shape, args.batch, args.prompt_len, args.new_tokens, budget)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
