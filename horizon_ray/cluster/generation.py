"""Generation on the cluster: one Ray actor per loaded model, on a node whose RAM holds it, reserved in that
node's ledger beside its jobs.

``RayGeneration`` is the API's generation backend on a Ray cluster (``create_app(client, settings,
generation=RayGeneration(client))``; the in-process ``ModelPool`` is its twin). For a model it has no actor for,
it sizes the model (``model_host_bytes``: its weights in the compute dtype, plus a process baseline), picks a
node (``pick_node``: best fit by free RAM among the live nodes, a node with a free GPU first), asks that node's
agent to reserve the bytes in its ledger (the planner then places jobs around them; a refusal tries the next
node), and starts a ``GenerationActor`` pinned there (NodeAffinitySchedulingStrategy) that holds a ModelPool
of one model. Requests cross as ``GenerationRequest``; their events come back as ``Event`` lists, polled. An
actor whose model went idle (the pool unloaded it) is ended and its reservation released.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, cast

from horizon_ray.cluster.messages import NodeInfo, Reservation
from horizon_ray.errors import BadInput
from horizon_ray.generation import Event, GenerationRequest, Handle, Limits, ModelPool

log = logging.getLogger("horizon_ray.cluster")
GENERATION_PREFIX = "generate:"  # + a hash of the model directory: the ledger key and the actor's name
BASELINE_BYTES = 1 << 30  # a generation process besides its weights (torch, the tokenizer, the KV cache's share)
POLL_S = 0.05


def model_host_bytes(model_dir: str | Path, dtype_bytes: int = 2) -> int:
    """Host RAM a generation actor of this model holds: its parameters in the compute dtype (bfloat16 on a GPU
    node; the decoder layers packed as the generator keeps them where the base is quantized: an adapter trained
    on a quantized base, a pre-quantized checkpoint), an adapter's in fp32, plus BASELINE_BYTES."""
    import torch

    from horizon_ray.engine import lora as lora_io
    from horizon_ray.engine.model import ModelConfig, stored_nested, unit_layouts
    from horizon_ray.engine.store import packed_layouts

    path = base = Path(model_dir)
    lora = None
    if lora_io.is_adapter_dir(path):
        lora, named = lora_io.read_adapter_config(path)
        base = Path(named or "")
    model = ModelConfig.load(base)
    adapter = 4 * sum(a.numel for a in lora_io.adapter_layouts(model, lora)) if lora is not None else 0  # fp32
    layouts = unit_layouts(model)
    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    quantize = lora_io.generation_quantize(model.hf, path if lora is not None else None)
    packed = packed_layouts(layouts, quantize, dtype, stored_nested(model.hf))
    weights_bytes = sum(p.nbytes if p is not None else u.numel * dtype_bytes for u, p in zip(layouts, packed))
    return weights_bytes + adapter + BASELINE_BYTES


def pick_node(nodes: list[NodeInfo], host_bytes: int, tried: AbstractSet[str] = frozenset()) -> NodeInfo | None:
    """The live node that holds ``host_bytes`` now with the least RAM left over, one with a free GPU before one
    without; None when none holds it."""
    fits = [n for n in nodes if n.alive and n.node_id not in tried and n.free_bytes >= host_bytes]
    if not fits:
        return None

    def free_gpu(n: NodeInfo) -> bool:
        busy = {i for r in n.ledger for i in r.gpu_indices}
        return n.gpu_count > len(busy)

    return min(fits, key=lambda n: (not free_gpu(n), n.free_bytes - host_bytes))


def generation_key(model_dir: str) -> str:
    return GENERATION_PREFIX + hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]


class GenerationActor:
    """The Ray actor of one model: a ModelPool, its requests' events kept until polled."""

    def __init__(self, limits: Limits, idle_s: float, gpu_index: int | None = None):
        import os

        if gpu_index is not None:  # the GPU its reservation holds, alone
            os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu_index)
        self.pool = ModelPool(limits, idle_s=idle_s)
        self.idle_s = idle_s
        self._handles: dict[str, Handle] = {}
        self._n = 0
        self._submitting = 0  # submits under way (loading the model, tokenising): the actor is not idle
        self._active = time.monotonic()  # the last submit or poll
        self._lock = threading.Lock()

    def submit(self, req: GenerationRequest) -> tuple[str | None, int, str | None]:
        """(request id, prompt tokens, None), or (None, 0, the refusal) for a BadInput."""
        with self._lock:
            self._submitting += 1
            self._active = time.monotonic()
        try:
            handle = self.pool.submit(req)
        except BadInput as exc:
            return None, 0, exc.message
        finally:
            with self._lock:
                self._submitting -= 1
        with self._lock:
            self._n += 1
            rid = str(self._n)
            self._handles[rid] = handle
        return rid, handle.prompt_tokens, None

    def poll(self, rid: str, wait_s: float = 1.0) -> list[Event]:
        """The request's events so far (waiting up to wait_s for the first); its handle is dropped once done."""
        import queue

        handle = self._handles[rid]
        self._active = time.monotonic()
        out: list[Event] = []
        try:
            out.append(handle.events.get(timeout=wait_s))
            while True:
                out.append(handle.events.get_nowait())
        except queue.Empty:
            pass
        if out and out[-1].done:
            with self._lock:
                del self._handles[rid]
        return out

    def cancel(self, rid: str) -> None:
        """The caller is gone: the pool ends the request at its next step (its last events are still polled)."""
        with self._lock:
            handle = self._handles.get(rid)
        if handle is not None:
            handle.cancel()

    def idle(self) -> bool:
        """No model loaded (the pool unloaded it), no request open or being submitted, none for idle_s: the actor
        may end."""
        with self._lock:
            quiet = not self._handles and not self._submitting and time.monotonic() - self._active >= self.idle_s
        return quiet and not self.pool.loaded()


class RayGeneration:
    """The API's generation backend over the cluster (see the module)."""

    def __init__(self, client: Any, limits: Limits | None = None, idle_s: float = 600.0, tenant: str | None = None):
        self.client = client  # a CoordinatorClient: the nodes and their ledgers
        self.limits = limits or Limits()
        self.idle_s = idle_s
        self.tenant = tenant
        self._actors: dict[str, tuple[Any, str]] = {}  # model key -> (actor, node id)
        self._lock = threading.Lock()
        self._reaper = threading.Thread(target=self._reap_loop, name="generation-reaper", daemon=True)
        self._stop = threading.Event()
        self._reaper.start()

    def submit(self, req: GenerationRequest) -> Handle:
        import ray

        actor = self._actor_for(req.model_dir)
        rid, prompt_tokens, refused = ray.get(actor.submit.remote(req))
        if refused is not None:
            raise BadInput(refused)
        handle = Handle(prompt_tokens=prompt_tokens, on_cancel=lambda: actor.cancel.remote(rid))
        threading.Thread(target=self._pump, args=(actor, rid, handle), daemon=True).start()
        return handle

    def loaded(self) -> dict[str, str]:
        """Model key -> the node its actor runs on."""
        with self._lock:
            return {k: node for k, (_, node) in self._actors.items()}

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            keys = list(self._actors)
        for key in keys:
            self._end(key)

    # ---- actors --------------------------------------------------------------------------------------------

    def _actor_for(self, model_dir: str) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from horizon_ray.cluster.client import NAMESPACE
        from horizon_ray.cluster.ray_actors import AGENT_PREFIX

        key = generation_key(model_dir)
        with self._lock:
            if key in self._actors:
                return self._actors[key][0]
            need = model_host_bytes(model_dir)
            tried: set[str] = set()
            while True:
                node = pick_node(self.client.nodes(), need, tried)
                if node is None:
                    raise BadInput(f"no node has {need / (1 << 30):.1f} GiB of host RAM free for this model now "
                                   "(jobs hold the rest); try again when a job has finished")
                tried.add(node.node_id)
                agent = ray.get_actor(AGENT_PREFIX + node.node_id, namespace=NAMESPACE)
                try:
                    # what NodeAgent.reserve_generation returns (ray's stubs know no actor method's result)
                    res = cast(Reservation, ray.get(agent.reserve_generation.remote(key, need, node.gpu_count > 0,
                                                                                    self.tenant)))
                except Exception as exc:  # noqa: BLE001 - its ledger refused (stale view): the next node
                    log.info("node %s refused a generation reservation: %s", node.node_id, exc)
                    continue
                break
            remote = ray.remote(GenerationActor).options(
                # threads: a request's polls and another's submit run side by side (the pool batches them)
                name=key, namespace=NAMESPACE, num_cpus=0, lifetime=None, max_concurrency=16,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.ray_node_id, soft=False)
                if node.ray_node_id else "DEFAULT")
            actor = remote.remote(self.limits, self.idle_s, res.gpu_index)
            self._actors[key] = (actor, node.node_id)
            return actor

    def _end(self, key: str) -> None:
        import ray

        from horizon_ray.cluster.client import NAMESPACE
        from horizon_ray.cluster.ray_actors import AGENT_PREFIX

        with self._lock:
            entry = self._actors.pop(key, None)
        if entry is None:
            return
        actor, node_id = entry
        ray.kill(actor)
        try:
            ray.get(ray.get_actor(AGENT_PREFIX + node_id, namespace=NAMESPACE).release_generation.remote(key))
        except Exception as exc:  # noqa: BLE001 - the node is gone: so is its ledger
            log.warning("could not release generation reservation %s on %s: %s", key, node_id, exc)

    def _pump(self, actor: Any, rid: str, handle: Handle) -> None:
        import ray

        while True:
            try:
                events = ray.get(actor.poll.remote(rid))
            except Exception as exc:  # noqa: BLE001 - the actor died: the request ends with the reason
                handle.events.put(Event(error=f"generation failed: {type(exc).__name__}", done=True))
                return
            for ev in events:
                handle.events.put(ev)
                if ev.done:
                    return

    def _reap_loop(self) -> None:
        import ray

        while not self._stop.wait(max(1.0, min(self.idle_s / 4, 30.0))):
            with self._lock:
                items = list(self._actors.items())
            for key, (actor, _) in items:
                try:
                    idle = ray.get(actor.idle.remote(), timeout=10)
                except ray.exceptions.GetTimeoutError:
                    continue  # busy (loading the model, or a long call): asked again next time
                except ray.exceptions.RayActorError:
                    idle = True  # dead: its reservation is released all the same
                if idle:
                    self._end(key)
