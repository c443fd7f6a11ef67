"""The generation pool (horizon_ray/generation.py): concurrent requests batched, idle models unloaded, limits."""

import threading
import time

import pytest

from horizon_ray.engine.sampling import Delta, SamplingParams
from horizon_ray.errors import BadInput
from horizon_ray.generation import GenerationRequest, Limits, ModelPool


class _Recording:
    """A generator whose sessions record the rows each admission brings and answer each row with "r<i>" (i:
    the row's number among every row it was given) and then, after ``tokens - 1`` steps, "." (the end)."""

    def __init__(self, tokens: int | None = 2):
        self.tokens = tokens  # None: rows never finish
        self.batches: list[int] = []  # rows of each admission
        self.seen = 0
        self.steps = 0
        self.release = threading.Event()  # cleared: an admission waits for it
        self.release.set()
        self.emptied = threading.Event()  # set when a cancel left a session without rows

    def text_prompt(self, text):
        return tuple(range(3, 3 + len(text)))

    def check(self, rows):
        pass

    def session(self):
        return _FakeSession(self)


class _FakeSession:
    def __init__(self, gen):
        self.gen = gen
        self.made: dict = {}  # key -> tokens made

    def __len__(self):
        return len(self.made)

    def admit(self, rows, keys):
        self.gen.release.wait()
        self.gen.batches.append(len(rows))
        out = []
        for key in keys:
            self.made[key] = 1
            out.append((key, Delta(0, f"r{self.gen.seen}", 7, None)))
            self.gen.seen += 1
        return out

    def step(self):
        self.gen.steps += 1
        time.sleep(0.001)
        out = []
        for key in list(self.made):
            self.made[key] += 1
            end = self.gen.tokens is not None and self.made[key] >= self.gen.tokens
            out.append((key, Delta(0, "." if end else "x", 8, "length" if end else None)))
            if end:
                del self.made[key]
        return out

    def cancel(self, keys):
        for key in keys:
            self.made.pop(key, None)
        if not self.made:
            self.gen.emptied.set()


def _taken(pool, model="/m"):
    """Wait until the worker has taken every queued request of the model (a condition, not a sleep)."""
    deadline = time.monotonic() + 10
    while model not in pool._models or pool._models[model].pending:
        assert time.monotonic() < deadline, "the worker never took the queued requests"
        time.sleep(0.005)


def _req(text="hi", n=1, max_tokens=2):
    return GenerationRequest("/m", SamplingParams(max_tokens=max_tokens), prompt=text, n=n)


def test_requests_waiting_together_run_as_one_batch(tmp_path):
    fake = _Recording()
    pool = ModelPool(load=lambda d: fake)
    fake.release.clear()  # the first admission holds the worker while the next requests queue
    first = pool.submit(_req())
    _taken(pool)
    later = [pool.submit(_req(n=2)), pool.submit(_req("abc"))]
    fake.release.set()
    outs = [list(h) for h in (first, *later)]
    assert fake.batches == [1, 3]  # the two waiting requests (3 rows) joined together
    # each request sees its own choices only, renumbered from 0
    second = [d for ev in outs[1] for d in ev.deltas]
    assert {d.row for d in second} == {0, 1} and [d.text for d in second if d.row == 1] == ["r2", "."]
    third = [d for ev in outs[2] for d in ev.deltas]
    assert [d.text for d in third] == ["r3", "."] and outs[2][0].prompt_tokens == 3
    assert all(ev[-1].done for ev in outs)
    pool.close()


def test_an_idle_model_is_unloaded_and_loaded_again_on_use():
    """Loaded while a request runs (asserted then: after the request, a short idle time could run out before
    the assertion on a loaded machine), unloaded once idle (waited for), loaded again by the next request."""
    loads, fakes = [], [_Recording(tokens=None), _Recording()]  # the first model's rows run until cancelled

    def load(model_dir):
        loads.append(model_dir)
        return fakes[len(loads) - 1]

    pool = ModelPool(idle_s=0.3, load=load)
    running = pool.submit(_req(max_tokens=1000))
    events = iter(running)
    while not next(events).deltas:  # until it runs: a model with a request running is not idle
        pass
    assert pool.loaded() == ["/m"] and loads == ["/m"]
    running.cancel()
    assert fakes[0].emptied.wait(10)
    assert list(events)[-1].done
    deadline = time.monotonic() + 10
    while pool.loaded() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pool.loaded()
    assert list(pool.submit(_req()))[-1].done
    assert loads == ["/m", "/m"]
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
        def session(self):
            session = _FakeSession(self)
            session.admit = lambda rows, keys: (_ for _ in ()).throw(RuntimeError("boom"))
            return session

    pool = ModelPool(load=lambda d: Broken())
    events = list(pool.submit(_req()))
    assert events[-1].done and events[-1].error == "generation failed: RuntimeError"
    assert [d.text for ev in list(pool.submit(_req())) for d in ev.deltas] == []  # the worker goes on
    pool.close()


def test_a_request_joins_the_running_batch_and_a_cancelled_one_leaves_it():
    """Continuous batching: a request submitted while another generates joins it at the next step (it does
    not wait for the other to end); a request cancelled while queued never runs; a cancelled row leaves and
    the others go on."""
    fake = _Recording(tokens=None)
    pool = ModelPool(load=lambda d: fake)
    first = pool.submit(_req(max_tokens=1000))
    events = iter(first)
    assert next(events).prompt_tokens == 2
    assert next(events).deltas  # it generates, and never finishes by itself
    fake.release.clear()  # the next admission waits: the worker holds the joining request
    later = pool.submit(_req("later", max_tokens=1000))
    _taken(pool)  # the worker holds it, blocked on release
    gone = pool.submit(_req("gone", max_tokens=1000))
    gone.cancel()  # cancelled while queued
    fake.release.set()
    rest = iter(later)
    assert next(rest).prompt_tokens == 5 and next(rest).deltas  # joined while the first still runs
    first.cancel()
    assert list(events)[-1].done  # the cancelled request ends with its done event
    steps, deadline = fake.steps, time.monotonic() + 10
    while fake.steps < steps + 3:  # the other row goes on
        assert time.monotonic() < deadline, "the batch stopped with the cancelled request"
        time.sleep(0.005)
    assert next(rest).deltas
    later.cancel()
    list(rest)
    assert fake.emptied.wait(10)  # the session has no row left
    assert fake.batches == [1, 1]  # the first, then the later one joining: the cancelled one never ran
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
    fake = _Recording(tokens=None)
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
    # the rows left the session (its rows never finish by themselves: only the cancel empties it)
    assert fake.emptied.wait(10), "the generation ran on after its client left"


def test_the_generation_actor_cancels_a_request_by_its_id():
    """The Ray actor's side (cluster/generation.py, run here as a plain object): the API's cancel reaches the
    pool inside the actor by the request's id, and its last events are still polled."""
    from horizon_ray.cluster.generation import GenerationActor

    fake = _Recording(tokens=None)
    actor = GenerationActor(Limits(), idle_s=600)
    actor.pool = ModelPool(load=lambda d: fake)
    rid, prompt_tokens, refused = actor.submit(_req(max_tokens=1000))
    assert refused is None and prompt_tokens == 2
    assert any(ev.deltas for ev in actor.poll(rid, wait_s=5) + actor.poll(rid, wait_s=5))
    actor.cancel(rid)
    assert fake.emptied.wait(10)
    deadline = time.monotonic() + 10
    while rid in actor._handles and time.monotonic() < deadline:  # polled to its done event, then dropped
        actor.poll(rid, wait_s=0.5)
    assert rid not in actor._handles
    actor.cancel(rid)  # a cancel after the end is a no-op
    actor.pool.close()


def test_continuous_batching_on_the_engine_gives_each_request_its_own_tokens(tmp_path):
    """The real engine behind the pool: a request submitted while another generates starts and finishes
    before it, and both get HF generate's greedy tokens of their prompts alone."""
    from horizon_ray.engine.generate import Generator
    from tests.tiny import tiny_llama
    from tests.unit.test_engine_generate import _hf_greedy, _reference

    path, cls = tiny_llama(tmp_path)
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()
    # the worker steps whether anyone reads or not: its third step waits until the short request is in, so the
    # long one cannot finish first however slowly this thread runs
    opened, steps = threading.Event(), [0]
    session = gen.session

    def held_session():
        s = session()
        step = s.step

        def held_step():
            steps[0] += 1
            if steps[0] == 3:
                assert opened.wait(60)
            return step()

        s.step = held_step
        return s

    gen.session = held_session
    pool = ModelPool(load=lambda d: gen)
    long_prompt, short_prompt = (5, 17, 33, 8, 91, 40, 12), (60, 61, 62)

    def submit(prompt, max_tokens):
        return pool.submit(GenerationRequest("/m", SamplingParams(max_tokens=max_tokens), prompt_ids=prompt))

    long_handle = submit(long_prompt, 60)
    long = iter(long_handle)
    tokens = {"long": [], "short": []}
    while len(tokens["long"]) < 3:
        tokens["long"] += [d.token_id for d in next(long).deltas]
    short_handle = submit(short_prompt, 5)
    opened.set()
    for ev in short_handle:
        tokens["short"] += [d.token_id for d in ev.deltas]
    # the short request ended while the long one was still generating: it did not wait behind it
    assert not any(ev.done for ev in list(long_handle.events.queue))
    for ev in long:
        tokens["long"] += [d.token_id for d in ev.deltas]
    ref = _reference(cls, path)
    assert tokens["short"] == _hf_greedy(ref, list(short_prompt), 5)
    assert tokens["long"] == _hf_greedy(ref, list(long_prompt), 60)
    pool.close()
