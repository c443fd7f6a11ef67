"""How far a freshly built engine's RSS sits above its host store, and how much of that malloc holds free.

    python benchmarks/probes/load_rss.py --shape qwen3-30b-a3b --layers 4 [--quantize nf4] [--workers 16]
        [--device cpu|cuda] [--emulate-device-packing]

Builds the engine as the bench does (``Engine.from_config``: the random draw, then packing a quantized base),
LoRA r16 on q_proj and v_proj, and prints one JSON line: the RSS growth over the build, the store's bytes
(``memory_report``), the excess, glibc's free lists (``mallinfo2``) and the excess left after ``malloc_trim``.
``--workers`` sets the random draw's thread count (the machine's cores otherwise; the H200 box has 16).
``--emulate-device-packing`` replaces the CPU's bitsandbytes packing by writing the packed parts in place, so
that a CPU run leaves the host what a CUDA engine's load does (there the quantization's temporaries are on the
GPU). The bench row of the same shape records the same quantities after its timed steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from horizon_ray.bench.metrics import host_rss  # noqa: E402
from horizon_ray.bench.shapes import hf_config, resolve_shape  # noqa: E402
from horizon_ray.engine import Engine, EngineConfig, LoraConfig, heap  # noqa: E402
from horizon_ray.engine import engine as engine_module  # noqa: E402
from horizon_ray.engine import quant as quant_mod  # noqa: E402

MiB = 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--quantize", default="none", choices=("none", "nf4", "fp4", "int8"))
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--emulate-device-packing", action="store_true")
    a = p.parse_args()
    if a.workers:
        engine_module.init_workers = lambda: a.workers
    if a.emulate_device_packing:
        def write_parts(self, flat, key, w, device):
            for lo, nbytes in self.parts[key][1].values():
                flat[lo:lo + nbytes].zero_()
        quant_mod.PackedLayout.pack = write_parts
    if a.quantize != "none":
        import bitsandbytes  # noqa: F401 (imported before the baseline: its own RSS is not the load's)
    config = hf_config(resolve_shape(a.shape, a.layers))
    cfg = EngineConfig(device=a.device, compute_dtype="bfloat16",
                       lora=LoraConfig(r=16, targets=("q_proj", "v_proj"), quantize=a.quantize))
    rss0, t0 = host_rss(), time.perf_counter()
    eng = Engine.from_config(config, cfg)
    built_s, grown = time.perf_counter() - t0, host_rss() - rss0
    store = sum(eng.memory_report()["host"].values())
    free = heap.free_bytes()
    heap.give_back()  # what is left once every free page is returned (the load has done so already)
    print(json.dumps({"shape": a.shape, "layers": a.layers, "quantize": a.quantize,
                      "workers": engine_module.init_workers(),
                      "emulated_packing": a.emulate_device_packing, "build_s": round(built_s, 1),
                      "store_MiB": round(store / MiB), "excess_MiB": round((grown - store) / MiB),
                      "heap_free_MiB": None if free is None else round(free / MiB),
                      "excess_after_trim_MiB": round((host_rss() - rss0 - store) / MiB)}))


if __name__ == "__main__":
    main()
