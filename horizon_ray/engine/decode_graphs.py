"""A resident model's decode step as a CUDA graph: one token of every row through every layer, replayed.

On the H200 a decode step of a 7B model over 64 rows is 11.7 ms of GPU work and took 64.8 ms of wall time
(benchmarks/probes/decode_step.py): the layer template's Python, several hundred kernel launches and the RoPE
and mask tables built on the host bound the step, and HF ``generate`` ran at 2.2x ours. A graph captured once
per batch layout (the cache, its rows and the attention bucket) replays the whole step as one launch.

What changes from step to step lives in static device buffers the graph reads: the rows' embeddings, their
positions and validity, and the slot the step writes (the keys and values go in by ``index_copy_`` at a
device index, not a Python slice, which a graph would freeze); RoPE and the masks are computed inside the graph
from them, by the eager path's own expressions (``step_tables``).

Only where a step is a fixed sequence of kernels: a resident model (weights in slots that never change), every
layer's cache on the device, no mixture-of-experts layer (routing counts each expert's tokens on the host), no
quantized base. Anything else, or a capture that fails, runs the eager step. On the CPU the same static-buffer
step runs without a graph (``Generator.decode_graphs = True``), so that tests pin its arithmetic to the eager
step's and HF's.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from horizon_ray.engine.layers import MicroBatch, rope_tables

log = logging.getLogger(__name__)

# Decode steps a batch layout runs eagerly before it is captured. A service's batch that requests join or leave
# at every step is laid out anew each time, and capturing each layout (a warm-up step and the capture) would
# cost more than its replays save; a layout that lasts this long is likely to last (one bucket is 256 steps).
CAPTURE_AFTER_STEPS = 4
# One capture at a time in a process: the pool's worker threads (one per model) may reach a capture together,
# and a capture's entry synchronises the device and collects garbage.
_CAPTURE = threading.Lock()
# The stream each device's warm-ups and captures run on, made once (under _CAPTURE). cuBLAS keeps a workspace
# for every stream it runs on (32 MiB on the H200) in the caching allocator until the process ends: a new
# stream for each capture (one for each generate call's cache layout) grew a serving process's allocated GPU
# memory by the workspaces of up to torch's pool of 32 streams, memory no plan counts (on the H200, after the
# generation tests' six captures, a training run's peak stood 173 MiB above its plan, as five or six would).
_STREAMS: dict[torch.device, Any] = {}


def step_tables(cfg: Any, inv_freq: dict[str, torch.Tensor], kind: str, q_pos_BT: torch.Tensor,
                k_pos_BS: torch.Tensor, k_valid_BS: torch.Tensor, self_TS: torch.Tensor, dtype: torch.dtype):
    """(cos, sin, mask [B, 1, T, S]) of a layer of this kind for T queries at positions ``q_pos_BT`` over S
    cached and new slots: a slot is seen when it holds a token of the row (``k_valid_BS``) at a position not
    after the query's (and inside the sliding window of the layers that have one); each query sees its own slot
    (``self_TS``) whatever else is masked, so that a padding row is never empty (NaN)."""
    cos, sin = rope_tables(inv_freq[kind], q_pos_BT, dtype)
    allowed = k_valid_BS[:, None, :] & (k_pos_BS[:, None, :] <= q_pos_BT[:, :, None])
    if kind == "sliding_attention" and cfg.sliding_window is not None:
        allowed &= q_pos_BT[:, :, None] - k_pos_BS[:, None, :] < cfg.sliding_window
    return cos, sin, (allowed | self_TS[None])[:, None]


def step_microbatch(cfg: Any, inv_freq: dict[str, torch.Tensor], q_pos_BT: torch.Tensor, k_pos_BS: torch.Tensor,
                    k_valid_BS: torch.Tensor, self_TS: torch.Tensor, dtype: torch.dtype, ids_host_BT: torch.Tensor,
                    ids_BT: torch.Tensor, cache: Any, to: Any = None) -> MicroBatch:
    """A generation call's MicroBatch: the tables (``step_tables``) of its layers' kinds, each through ``to``
    (the eager step's copy to the device; none for the static step, whose tables are built there)."""
    kinds = set(cfg.layer_types)
    main = "full_attention" if "full_attention" in kinds else "sliding_attention"

    def tables(kind: str) -> tuple:
        tabs = step_tables(cfg, inv_freq, kind, q_pos_BT, k_pos_BS, k_valid_BS, self_TS, dtype)
        return tuple(to(t) for t in tabs) if to is not None else tabs

    cos, sin, mask = tables(main)
    return MicroBatch(input_ids_host=ids_host_BT, input_ids_BT=ids_BT, targets_BT=ids_BT.new_full(ids_BT.shape, -100),
                      cos_BTd=cos, sin_BTd=sin, mask_B1TT=mask, n_targets=0,
                      sliding=tables("sliding_attention") if len(kinds) > 1 else None, cache=cache)


def applies(gen: Any) -> bool:
    """Whether this generator's decode steps can run as static steps (the module doc's conditions, but the
    cache's and the device's): resident weights, no mixture of experts, no quantized base."""
    return gen.resident and not gen.model.num_experts and gen.store.quantize == "none"


class _GraphCache:
    """The cache as a captured step writes it: slot ``n`` (a one-element device tensor) of every row."""

    def __init__(self, cache: Any, n_1: torch.Tensor, seen: int):
        self.cache, self.n_1, self.seen = cache, n_1, seen

    def extend(self, j: int, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        K, V = self.cache.k[j], self.cache.v[j]
        K.index_copy_(2, self.n_1, k_BHTd)
        V.index_copy_(2, self.n_1, v_BHTd)
        return K[:, :, :self.seen], V[:, :, :self.seen]


class DecodeStep:
    """The decode step of one batch layout: B rows of ``cache`` attending to ``seen`` slots. ``capture``:
    record it as a CUDA graph (replayed by ``run``); otherwise ``run`` executes the same step directly."""

    def __init__(self, gen: Any, cache: Any, seen: int, capture: bool):
        """``gen``: a weak proxy of the generator (the generator holds its steps; they must not keep it alive:
        the pool frees an unloaded model's GPU memory by dropping it)."""
        cfg, dev = gen.model, gen.device
        B = cache.rows
        self.gen, self.cache, self.seen, self.cfg = gen, cache, seen, cfg
        self.h_B1D = torch.zeros(B, 1, cfg.hidden_size, dtype=gen.dtype, device=dev)
        self.q_pos_B1 = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.k_pos_BS = torch.zeros(B, seen, dtype=torch.long, device=dev)
        self.k_valid_BS = torch.zeros(B, seen, dtype=torch.bool, device=dev)
        self.n_1 = torch.zeros(1, dtype=torch.long, device=dev)
        self.slots_S = torch.arange(seen, device=dev)
        self.inv_freq = gen.template.inv_freq_on(dev)
        W, units, k = gen.weights, gen.units, 0  # resident weights: version 0 is the only one
        self.layer_weights = [W.weights(units.of_layer(j), k) for j in range(cfg.num_layers)]
        self.head_weights = W.head_weights(k)
        self.lora = gen._lora_call()
        self.logits_BV: torch.Tensor | None = None
        self.capture = capture
        self.graph: Any = None

    def _capture(self) -> None:
        """Warm up (on this step's real inputs: the warm-up is a step) and record the graph."""
        dev = self.gen.device
        with _CAPTURE:
            stream = _STREAMS.get(dev)
            if stream is None:
                stream = _STREAMS[dev] = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):  # warm-up outside the capture: Triton builds, cuDNN plans, cuBLAS
                self._body()
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # a private memory pool of its own: a pool handle shared by graphs is released with the last of them,
            # and a capture into a released pool fails an allocator assert (seen on the H200 once a re-laid-out
            # cache dropped the old graphs); a step's intermediates are a few rows of activations and the logits.
            # The module's stream, not torch's default capture stream (one per process, whose workspace the
            # warm-up would not have made).
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self._body()
        self.graph = graph

    def _body(self) -> None:
        """The step, reading only the static buffers (the capture's warm-up writes the step's keys and values
        once more than the replay: the same values into the same slot)."""
        cfg, gen = self.cfg, self.gen
        self_1S = (self.slots_S == self.n_1)[None, :]
        mb = step_microbatch(cfg, self.inv_freq, self.q_pos_B1, self.k_pos_BS, self.k_valid_BS, self_1S, gen.dtype,
                             self.q_pos_B1, self.q_pos_B1, _GraphCache(self.cache, self.n_1, self.seen))
        h = self.h_B1D
        for j in range(cfg.num_layers):
            h = gen.template.layer(h, self.layer_weights[j], mb, self.lora, j=j)
        self.logits_BV = gen.template.logits(h[:, -1], self.head_weights)

    def run(self, h_B1D: torch.Tensor, pos_BS: torch.Tensor, valid_BS: torch.Tensor, n: int) -> torch.Tensor:
        """The float32 logits [B, V] of the step writing slot n (valid until the next ``run``)."""
        S = self.seen
        self.h_B1D.copy_(h_B1D)
        self.q_pos_B1.copy_(pos_BS[:, n:n + 1])
        self.k_pos_BS.copy_(pos_BS[:, :S])
        self.k_valid_BS.copy_(valid_BS[:, :S])
        self.n_1.fill_(n)
        if self.capture and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
        assert self.logits_BV is not None, "the step ran"
        return self.logits_BV


class DecodeGraphs:
    """A generator's decode steps by batch layout, for the cache in use: the steps of one cache and its newest
    bucket (a cache's length only grows; a cache laid out again, or a session that ended, ``release``s them and
    the buffers they hold)."""

    def __init__(self, gen: Any, capture: bool):
        self.gen = weakref.proxy(gen)  # the generator holds this; this must not keep it alive (DecodeStep)
        self.capture = capture
        self.cache: Any = None
        self.steps: dict[int, DecodeStep] = {}
        self.eager_steps: dict[int, int] = {}  # bucket -> steps of the current cache run eagerly before capture
        self.failed = False
        self.replays = 0  # steps run through a DecodeStep (counted for tests and the bench)
        self.captured = 0  # CUDA graphs captured

    def release(self) -> None:
        """Drop the steps (their graphs, memory pools and hold on the cache): the cache is about to go."""
        self.cache, self.steps, self.eager_steps = None, {}, {}

    def step_for(self, cache: Any) -> DecodeStep | None:
        """The step of the cache's current layout, made once the layout has run CAPTURE_AFTER_STEPS eager steps;
        None where the eager step runs (a layout not yet captured, host layers, a capture that failed)."""
        if self.failed or cache.on_device < self.gen.model.num_layers:
            return None
        if cache is not self.cache:
            self.release()
            self.cache = cache
        seen = cache.visible(1)
        step = self.steps.get(seen)
        if step is None:
            waited = self.eager_steps[seen] = self.eager_steps.get(seen, 0) + 1
            if waited <= CAPTURE_AFTER_STEPS:
                return None
            # the smaller buckets' steps never run again: the cache's length only grows
            self.steps = {seen: DecodeStep(self.gen, cache, seen, self.capture)}
            step = self.steps[seen]
        return step

    def run(self, step: DecodeStep, h_B1D: torch.Tensor, pos_BS: torch.Tensor,
            valid_BS: torch.Tensor) -> torch.Tensor | None:
        """The logits of ``step`` (step_for's) writing its cache's next slot; None when its capture failed (the
        eager step then runs, from now on: the warm-up wrote this step's keys and values, the eager step
        writes the same)."""
        fresh = step.capture and step.graph is None
        try:
            logits = step.run(h_B1D, pos_BS, valid_BS, step.cache.length)
        except Exception as exc:
            if not step.capture or step.graph is not None:
                raise
            log.warning("the decode step was not captured as a CUDA graph (%s: %s); it runs eagerly",
                        type(exc).__name__, exc)
            self.release()
            self.failed = True
            return None
        self.replays += 1
        self.captured += fresh
        return logits
