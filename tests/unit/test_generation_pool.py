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


class _Endless(_Recording):
    """A generator whose rows never finish: a step per call of next, counted."""

    def __init__(self):
        super().__init__()
        self.steps = 0
        self.closed = threading.Event()

    def stream(self, rows):
        self.batches.append(len(rows))
        try:
            while True:
                self.steps += 1
                yield [Delta(b, "x", 7, None) for b in range(len(rows))]
                time.sleep(0.001)
        finally:
            self.closed.set()


def test_a_cancelled_request_ends_its_batch_and_the_next_one_starts():
    fake = _Endless()
    pool = ModelPool(load=lambda d: fake)
    first = pool.submit(_req(max_tokens=1000))
    events = iter(first)
    assert next(events).prompt_tokens == 2
    assert next(events).deltas  # the batch runs
    waiting = pool.submit(_req("later", max_tokens=1000))  # queued behind the running batch
    gone = pool.submit(_req("gone", max_tokens=1000))
    gone.cancel()  # cancelled before its batch starts: it never runs
    first.cancel()
    assert list(events)[-1].done  # the cancelled request still ends with its done event
    assert fake.closed.wait(10)  # the engine's stream was closed, not left running
    rest = iter(waiting)
    assert next(rest).prompt_tokens == 5 and next(rest).deltas  # the waiting request started
    waiting.cancel()
    list(rest)
    assert fake.batches == [1, 1]  # the first, then the waiting one alone: the cancelled one never ran
    assert [ev.done for ev in iter(gone)] == [True]  # only its end
    pool.close()


@pytest.fixture
def served(tmp_path):
    """The API on a real uvicorn whose generation pool runs an endless generator for catalogue model "m"."""
    from api.app import create_app
    from api.server import running_server
    from api.testing import make_testbed

    bed = make_testbed(tmp_path)
    bed.settings.model_catalogue = {"m": bed.root / "models" / "1GiB"}
    fake = _Endless()
    pool = ModelPool(load=lambda d: fake)
    with running_server(create_app(bed.client, bed.settings, generation=pool)) as url:
        yield url, bed, fake
    pool.close()
    bed.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_a_client_that_hangs_up_cancels_its_generation(served, stream):
    """A closed stream, or a client that stops waiting for its answer, ends the request's batch in the pool
    (before this, the rows ran to max_tokens and held the model from the requests behind them)."""
    import httpx

    url, bed, fake = served
    tenant = next(iter(bed.keys))
    body = {"model": "m", "prompt": "hi", "max_tokens": 1000, "stream": stream}
    if stream:
        with httpx.Client(base_url=url, timeout=30) as http, \
                http.stream("POST", "/v1/completions", json=body, headers=bed.auth(tenant)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it streams
    else:
        with httpx.Client(base_url=url, timeout=1.0) as http, pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, headers=bed.auth(tenant))
    assert fake.closed.wait(10), "the generation ran on after its client left"
    assert fake.steps < 1000


def test_the_generation_actor_cancels_a_request_by_its_id():
    """The Ray actor's side (cluster/generation.py, run here as a plain object): the API's cancel reaches the
    pool inside the actor by the request's id, and its last events are still polled."""
    from horizon_ray.cluster.generation import GenerationActor

    fake = _Endless()
    actor = GenerationActor(Limits(), idle_s=600)
    actor.pool = ModelPool(load=lambda d: fake)
    rid, prompt_tokens, refused = actor.submit(_req(max_tokens=1000))
    assert refused is None and prompt_tokens == 2
    assert any(ev.deltas for ev in actor.poll(rid, wait_s=5) + actor.poll(rid, wait_s=5))
    actor.cancel(rid)
    assert fake.closed.wait(10)
    deadline = time.monotonic() + 10
    while rid in actor._handles and time.monotonic() < deadline:  # polled to its done event, then dropped
        actor.poll(rid, wait_s=0.5)
    assert rid not in actor._handles
    actor.cancel(rid)  # a cancel after the end is a no-op
    actor.pool.close()
