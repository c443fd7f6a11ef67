"""Generation on a local Ray cluster of simulated nodes (cluster/generation.py): the model's actor runs on the node
whose RAM holds it, reserved in that node's ledger (what the planner places jobs around), answers as the engine
does in-process, and is ended with its reservation once idle."""

from __future__ import annotations

import time

import pytest

from horizon_ray.engine.sampling import SamplingParams
from horizon_ray.generation import GenerationRequest
from tests.tiny import JOB_LLAMA

pytestmark = pytest.mark.integration
GiB = 1 << 30


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from horizon_ray.data import build_demo_tokenizer
    from horizon_ray.engine import Engine, EngineConfig

    out = tmp_path_factory.mktemp("gen") / "model"
    eng = Engine.from_config(JOB_LLAMA, EngineConfig(device="cpu", seed=7))
    eng.save_pretrained(out)
    eng.close()
    build_demo_tokenizer(out)
    return out


def test_the_model_runs_on_the_node_that_holds_it_and_leaves_when_idle(tmp_path, model):
    """Where the model runs and what it answers are asserted on a backend whose models never idle out during
    the test (idle_s 600): a short idle time would race the assertions on a loaded machine. Leaving when idle
    is asserted on a second backend and a copy of the model (its own actor) with idle_s 1, by waiting for it."""
    import shutil

    from horizon_ray.cluster.client import RayClient
    from horizon_ray.cluster.generation import RayGeneration, generation_key, model_host_bytes
    from horizon_ray.cluster.local import simulated_service
    from horizon_ray.engine.generate import Generator, Request

    messages = (("user", "add 2 and 3"),)
    with simulated_service(tmp_path / "svc", {"a": 1 * GiB, "b": 3 * GiB},
                           agent_env={"OMP_NUM_THREADS": "1"}) as _:
        client = RayClient()

        def ledgers() -> dict[str, dict[str, int]]:
            return {n.node_id: {r.job_id: r.host_bytes for r in n.ledger} for n in client.nodes()}

        def wait_for(what: str, met, timeout_s: float = 60) -> None:
            deadline = time.monotonic() + timeout_s
            while not met():
                assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
                time.sleep(0.5)

        backend = RayGeneration(client, idle_s=600.0)
        try:
            req = GenerationRequest(str(model), SamplingParams(max_tokens=8), messages=messages)
            events = list(backend.submit(req))
            key = generation_key(str(model))
            assert backend.loaded() == {key: "b"}  # a (1 GiB) cannot hold 1 GiB + the weights
            # the coordinator's view of the ledgers is refreshed each tick
            wait_for("the reservation in b's ledger", lambda: ledgers()["b"] == {key: model_host_bytes(model)})
            assert ledgers()["a"] == {}
            text = "".join(d.text for ev in events for d in ev.deltas)
            gen = Generator.from_pretrained(model, device="cpu")
            want = gen.generate([Request(gen.chat_prompt([{"role": "user", "content": "add 2 and 3"}]),
                                         SamplingParams(max_tokens=8))])[0].text
            assert text == want and events[-1].done and events[0].prompt_tokens > 0
        finally:
            backend.close()
        assert not backend.loaded()
        wait_for("the ledgers freed after close", lambda: not any(ledgers().values()))

        # idle: the pool unloads the model, the actor is ended and the node's ledger freed
        copy = shutil.copytree(model, tmp_path / "model-copy")
        idling = RayGeneration(client, idle_s=1.0)
        try:
            req = GenerationRequest(str(copy), SamplingParams(max_tokens=8), messages=messages)
            assert "".join(d.text for ev in idling.submit(req) for d in ev.deltas) == want  # it ran, on an actor
            wait_for("the idle model unloaded", lambda: not idling.loaded())
            wait_for("the ledgers freed once idle", lambda: not any(ledgers().values()))
        finally:
            idling.close()
