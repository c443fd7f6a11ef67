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
    from horizon_ray.cluster.client import RayClient
    from horizon_ray.cluster.generation import RayGeneration, generation_key, model_host_bytes
    from horizon_ray.cluster.local import simulated_service
    from horizon_ray.engine.generate import Generator, Request

    messages = (("user", "add 2 and 3"),)
    with simulated_service(tmp_path / "svc", {"a": 1 * GiB, "b": 3 * GiB},
                           agent_env={"OMP_NUM_THREADS": "1"}) as _:
        client = RayClient()
        backend = RayGeneration(client, idle_s=3.0)
        try:
            req = GenerationRequest(str(model), SamplingParams(max_tokens=8), messages=messages)
            events = list(backend.submit(req))
            key = generation_key(str(model))
            assert backend.loaded() == {key: "b"}  # a (1 GiB) cannot hold 1 GiB + the weights
            ledger = {n.node_id: {r.job_id: r.host_bytes for r in n.ledger} for n in client.nodes()}
            assert ledger["b"] == {key: model_host_bytes(model)} and ledger["a"] == {}
            text = "".join(d.text for ev in events for d in ev.deltas)
            gen = Generator.from_pretrained(model, device="cpu")
            want = gen.generate([Request(gen.chat_prompt([{"role": "user", "content": "add 2 and 3"}]),
                                         SamplingParams(max_tokens=8))])[0].text
            assert text == want and events[-1].done and events[0].prompt_tokens > 0
            # idle: the pool unloads the model, the actor is ended and the node's ledger freed
            deadline = time.monotonic() + 60
            while backend.loaded() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not backend.loaded()
            while any(n.ledger for n in client.nodes()) and time.monotonic() < deadline:
                time.sleep(0.5)  # the coordinator's view of the ledgers is refreshed each tick
            assert all(not n.ledger for n in client.nodes())
        finally:
            backend.close()
