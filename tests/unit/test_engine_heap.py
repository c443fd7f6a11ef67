"""A load leaves no freed heap resident (horizon_ray/engine/heap.py)."""

import subprocess
import sys
import textwrap

import pytest

from horizon_ray.engine import Engine, EngineConfig, LoraConfig, heap
from tests.tiny import llama_checkpoint, llama_config


@pytest.mark.skipif(heap.free_bytes() is None, reason="needs glibc's malloc_trim and mallinfo2")
def test_give_back_returns_freed_heap_to_the_os():
    """What a load relies on: blocks of a few MiB freed from a thread's arena stay resident until give_back.
    In a fresh interpreter, so that no other test's heap is counted."""
    child = textwrap.dedent("""
        import threading, psutil, torch
        from horizon_ray.engine import heap
        torch.empty(8 << 20, dtype=torch.uint8)  # freed at once: glibc's mmap threshold rises to 8 MiB
        kept = []
        def churn():
            blocks = [torch.ones(1 << 20) for _ in range(64)]  # 64 x 4 MiB from this thread's arena
            kept.append(torch.ones(16))  # allocated after them: the arena's top is not free
            del blocks
        t = threading.Thread(target=churn); t.start(); t.join()
        rss = psutil.Process().memory_info().rss
        free = heap.free_bytes()
        heap.give_back()
        print(free, rss - psutil.Process().memory_info().rss)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True)
    free, returned = (int(v) for v in out.stdout.split())
    assert free >= 200 * 2**20, free  # the 256 MiB freed are still the process's
    assert returned >= 200 * 2**20, returned  # and leave it with give_back


@pytest.fixture
def trims(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "give_back", lambda: calls.append(1))
    return calls


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_every_load_gives_its_heap_back(tmp_path, trims, quantize):
    """from_config's random draw and from_pretrained's checkpoint read (quantizing on the way under QLoRA) each
    end by giving the freed heap back."""
    if quantize:
        pytest.importorskip("bitsandbytes")
    lora = LoraConfig(r=4, targets=("q_proj", "v_proj"), quantize=quantize or "none")
    cfg = EngineConfig(device="cpu", compute_dtype="bfloat16", lora=lora)
    config = llama_config(2, hidden=128, inter=256)
    Engine.from_config(config, cfg).close()
    assert len(trims) == 1
    Engine.from_pretrained(llama_checkpoint(tmp_path / "m", config), cfg).close()
    assert len(trims) == 2
