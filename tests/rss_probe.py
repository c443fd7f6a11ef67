"""Host RSS of one CPU training step, measured in a fresh interpreter.

A pytest process that ran other tests holds freed heap the allocator hands out again, so RSS growth
measured there undercounts (by 10 % and more, depending on which tests ran before). The planner tests run
this module in a child process instead:

    python -m tests.rss_probe '{"config": {...}, "engine": {...}, "lora": {...} | null,
                                 "seq": 64, "micro": 2, "accum": 2}'

and read one JSON line: RSS growth after the model is built and after the step, its peak, the loss and the
engine's host bytes by kind. ``init_workers`` sets how many threads draw the random model (the machine's cores
otherwise): a node with many cores draws on as many threads, each with its own malloc arena.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(config: dict, engine: dict, seq: int, micro: int, accum: int, lora: dict | None = None,
            steps: int = 1, init_workers: int | None = None) -> dict:
    """Run the probe in a child process; its JSON result (with `steps` > 1 also the RSS after each step)."""
    arg = json.dumps({"config": config, "engine": engine, "lora": lora, "seq": seq, "micro": micro, "accum": accum,
                      "steps": steps, "init_workers": init_workers})
    proc = subprocess.run([sys.executable, "-m", "tests.rss_probe", arg], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _main(arg: str) -> None:
    import psutil
    import torch

    from horizon_ray.engine import Engine, EngineConfig, LoraConfig

    a = json.loads(arg)
    if a.get("init_workers"):
        import horizon_ray.engine.engine as engine_module

        workers = a["init_workers"]
        engine_module.init_workers = lambda: workers
    gen = torch.Generator().manual_seed(0)
    vocab = a["config"]["vocab_size"]
    batches = []
    for _ in range(a["accum"]):
        ids = torch.randint(0, vocab, (a["micro"], a["seq"]), generator=gen)
        batches.append((ids, ids.clone()))
    lora = LoraConfig(**{**a["lora"], "targets": tuple(a["lora"]["targets"])}) if a["lora"] else None
    cfg = EngineConfig(**a["engine"], lora=lora)
    proc = psutil.Process()
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    rss0 = proc.memory_info().rss  # torch and the engine imported: the process baseline is behind us
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    after = []  # RSS after each step (its update finished)
    try:
        eng = Engine.from_config(a["config"], cfg)
        built = proc.memory_info().rss - rss0
        for _ in range(a.get("steps", 1)):
            loss = eng.train_step(batches)
            eng.synchronize()  # the update runs in the background
            after.append(proc.memory_info().rss - rss0)
        eng.close()
        grown = proc.memory_info().rss - rss0
    finally:
        stop.set()
        sampler.join()
    print(json.dumps({"built": built, "grown": grown, "peak": peak[0] - rss0, "after_each_step": after, "loss": loss,
                      "num_params": eng.num_params,
                      "trainable_params": eng.trainable_params, "host": eng.memory_report()["host"],
                      "loss_chunk_tokens": cfg.loss_chunk_tokens}))


if __name__ == "__main__":
    _main(sys.argv[1])
