"""The generation pool (horizon_ray/generation.py): concurrent requests batched, idle models unloaded, limits."""

import threading
import time

import pytest

from horizon_ray.engine.sampling import Delta, SamplingParams
from horizon_ray.errors import BadInput
from horizon_ray.generation import GenerationRequest, Limits, ModelPool


class _Recording:
    """A generator that records each batch it runs and answers every row with its own row index, twice."""

    def __init__(self):
        self.batches: list[int] = []
        self.release = threading.Event()
        self.release.set()

    def text_prompt(self, text):
        return tuple(range(3, 3 + len(text)))

    def check(self, rows):
        pass

    def stream(self, rows):
        self.release.wait()
        self.batches.append(len(rows))
        yield [Delta(b, f"r{b}", 7, None) for b in range(len(rows))]
        yield [Delta(b, ".", 8, "length") for b in range(len(rows))]


def _req(text="hi", n=1, max_tokens=2):
    return GenerationRequest("/m", SamplingParams(max_tokens=max_tokens), prompt=text, n=n)


def test_requests_waiting_together_run_as_one_batch(tmp_path):
    fake = _Recording()
    pool = ModelPool(load=lambda d: fake)
    fake.release.clear()  # the first batch holds the worker while the next requests queue
    first = pool.submit(_req())
    time.sleep(0.1)
    later = [pool.submit(_req(n=2)), pool.submit(_req("abc"))]
    fake.release.set()
    outs = [list(h) for h in (first, *later)]
    assert fake.batches == [1, 3]  # the two waiting requests (3 rows) ran together
    # each request sees its own choices only, renumbered from 0
    second = [d for ev in outs[1] for d in ev.deltas]
    assert {d.row for d in second} == {0, 1} and [d.text for d in second if d.row == 1] == ["r1", "."]
    third = [d for ev in outs[2] for d in ev.deltas]
    assert [d.text for d in third] == ["r2", "."] and outs[2][0].prompt_tokens == 3
    assert all(ev[-1].done for ev in outs)
    pool.close()


def test_an_idle_model_is_unloaded_and_loaded_again_on_use():
    loads = []
    pool = ModelPool(idle_s=0.3, load=lambda d: loads.append(d) or _Recording())
    list(pool.submit(_req()))
    assert pool.loaded() and len(loads) == 1
    deadline = time.monotonic() + 5
    while pool.loaded() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pool.loaded()
    list(pool.submit(_req()))
    assert len(loads) == 2
    pool.close()


def test_limits_are_refused_before_anything_is_queued():
    fake = _Recording()
    pool = ModelPool(Limits(max_tokens=8, max_context=10, max_choices=2), load=lambda d: fake)
    with pytest.raises(BadInput, match="max_tokens 9 is over"):
        pool.submit(_req(max_tokens=9))
    with pytest.raises(BadInput, match="limit of 10 tokens"):
        pool.submit(_req("abcdef", max_tokens=5))
    with pytest.raises(BadInput, match="n must"):
        pool.submit(_req(n=3))
    assert fake.batches == []
    pool.close()


def test_a_failed_batch_ends_its_requests_with_the_error():
    class Broken(_Recording):
        def stream(self, rows):
            raise RuntimeError("boom")
            yield

    pool = ModelPool(load=lambda d: Broken())
    events = list(pool.submit(_req()))
    assert events[-1].done and events[-1].error == "generation failed: RuntimeError"
    assert [d.text for ev in list(pool.submit(_req())) for d in ev.deltas] == []  # the worker goes on
    pool.close()
