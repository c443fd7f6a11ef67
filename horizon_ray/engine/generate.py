"""Generation on the streamed engine: a batch of sequences passes the layers as in training, with a KV cache.

A model larger than the GPU streams layer by layer (the training engine's double-buffered weight slots,
slots.py), once for the prompts and once for every new token of the whole batch, so that the weight traffic
of a decode step is shared by every sequence of the batch (FlexGen's throughput-oriented shape). A model that
fits the budget stays resident: every layer has its own slot, filled once. The KV cache sits on the device
for as many layers as the budget leaves room for and in page-locked host memory beyond (a host layer's
cached keys and values cross to the device for its attention, and the new position's go back).

The layer math is the training template's (layers.py): ``Template.layer`` with a ``KVCache`` in the
micro-batch appends the call's keys and values and attends to every cached position through explicit masks
(causal, the sliding window of the layers that have one, padding). Prompts of a batch are left-padded; a
row's positions count its own tokens, so a batch gives each prompt what it would get alone. Attention reads
the cache up to a multiple of ``KV_BUCKET`` positions (the unwritten ones are zeros, masked as future
positions), so its shapes change once per bucket, not at every step: cuDNN's attention builds a plan per shape
(hundreds of milliseconds each), and a plan per decode step cost more than the step's arithmetic.

Sources: an HF model directory (a base model, a full fine-tune's final/), or a PEFT LoRA adapter directory
(its base is loaded frozen and the adapters are applied on it as PEFT applies them, ``base(x) + B(A(x)) x
scaling``). Sampling: greedy (temperature 0) or temperature, top-k, top-p with a per-request seed (each row
draws from its own generator, so a request's tokens do not depend on what it was batched with); stop at
the model's eos tokens, at stop sequences (the text is cut before them), or after max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from horizon_ray.engine import decode_graphs, io
from horizon_ray.engine import lora as lora_io
from horizon_ray.engine.config import resolve_device
from horizon_ray.engine.fence import Fence
from horizon_ray.engine.kernels import Kernels, gemms_in_mode, resolve_kernels
from horizon_ray.engine.layers import LoraCall, MicroBatch, Template
from horizon_ray.engine.model import ModelConfig, stored_nested, unit_layouts
from horizon_ray.engine.pinned import HostBuffers
from horizon_ray.engine.sampling import Completion, Delta, Request, SamplingParams, chat_turns
from horizon_ray.engine.slots import DeviceWeights, HostWeights
from horizon_ray.engine.store import HostStore
from horizon_ray.engine.units import Units
from horizon_ray.errors import BadInput

# Of the GPU budget, the share resident weights may take (the rest: KV cache and the layers' workspace).
RESIDENT_SHARE = 0.75
# Attention reads the cache in multiples of this many positions (the module doc): at most this many masked
# positions more per row than a step needs, in exchange for one attention shape per bucket.
KV_BUCKET = 256


class KVCache:
    """Keys and values of every layer for a batch of B rows and S positions (slots) at most.

    Device layers: [B, kvH, S, d] on the device. Host layers: [S, B, kvH, d] in (pinned) host memory, so
    that the first n positions are one contiguous block to copy; each host layer's cached positions cross to
    one device staging buffer for its attention (on the compute stream: the next layer's copy into it is
    queued after this layer's attention read it), and the new positions' keys and values come back."""

    def __init__(self, cfg: ModelConfig, B: int, S: int, dtype: torch.dtype, device: torch.device,
                 on_device: int, buffers: HostBuffers):
        shape = (B, cfg.num_kv_heads, S, cfg.head_dim)
        host_shape = (S, B, cfg.num_kv_heads, cfg.head_dim)
        self.on_device = on_device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        # zeros, not garbage: attention reads unwritten positions (up to the bucket's end, before a joining
        # row's prompt), masked, and a NaN there would still poison the weighted sum (0 x NaN)
        for j in range(cfg.num_layers):
            for store in (self.k, self.v):
                if j < on_device:
                    store.append(torch.zeros(shape, dtype=dtype, device=device))
                else:
                    store.append(buffers.pool.empty(host_shape, dtype, zero=True))
        self.stage: tuple[torch.Tensor, torch.Tensor] | None = None
        if on_device < cfg.num_layers:
            self.stage = (torch.zeros(host_shape, dtype=dtype, device=device),
                          torch.zeros(host_shape, dtype=dtype, device=device))
        self.rows = B
        self.capacity = S
        self.length = 0  # positions cached in every layer (this call's are appended by extend)

    @staticmethod
    def layer_bytes(cfg: ModelConfig, B: int, S: int, dtype: torch.dtype) -> int:
        return 2 * B * cfg.num_kv_heads * S * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()

    def visible(self, T: int) -> int:
        """Positions a call of T new tokens attends to: every cached and new one, rounded up to the bucket."""
        return _visible(self.capacity, self.length, T)

    def extend(self, j: int, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.write(j, k_BHTd, v_BHTd, 0, self.rows, self.length)

    def write(self, j: int, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor, lo: int, hi: int,
              n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer j's keys and values of rows lo..hi-1 at slots n .. n + T - 1; those rows' keys and values of
        the visible slots."""
        T = k_BHTd.shape[2]
        seen = _visible(self.capacity, n, T)
        if j < self.on_device:
            K, V = self.k[j][lo:hi], self.v[j][lo:hi]
            K[:, :, n:n + T] = k_BHTd
            V[:, :, n:n + T] = v_BHTd
            return K[:, :, :seen], V[:, :, :seen]
        out = []
        assert self.stage is not None, "a cache with host layers has its staging buffers"
        for host, new, stage in ((self.k[j], k_BHTd, self.stage[0]), (self.v[j], v_BHTd, self.stage[1])):
            host, stage = host[:, lo:hi], stage[:, lo:hi]
            new_TBHd = new.permute(2, 0, 1, 3)
            # non_blocking both ways on the compute stream: the stage is read by this layer's attention only
            # after the H2D landed, and the host buffer is read again only by a later step's H2D, queued after
            # this D2H on the same stream (the caller synchronises before the host reads anything)
            stage[:n].copy_(host[:n], non_blocking=True)
            stage[n:n + T] = new_TBHd
            host[n:n + T].copy_(new_TBHd, non_blocking=True)
            # beyond n + T the stage holds zeros or an earlier layer's finite keys, masked either way
            out.append(stage[:seen].permute(1, 2, 0, 3))
        return out[0], out[1]

    def advance(self, T: int) -> None:
        """Every layer has cached T more positions."""
        self.length += T

    def copy_rows(self, dst: KVCache, rows: torch.Tensor, first: int, to: int) -> None:
        """Into ``dst``'s first len(rows) rows, from slot ``to`` on: these rows' cached slots from ``first`` on
        (a batch that rows join or leave is laid out again; slots before ``first`` hold none of their tokens)."""
        n = self.length
        m = n - first
        for j in range(len(self.k)):
            for src, out in ((self.k[j], dst.k[j]), (self.v[j], dst.v[j])):
                if j < self.on_device:
                    part = src.index_select(0, rows.to(src.device))[:, :, first:n]  # [b, kvH, m, d]
                else:
                    part = src[first:n].index_select(1, rows).permute(1, 2, 0, 3)
                if j < dst.on_device:
                    out[:len(rows), :, to:to + m] = part.to(out.device)
                else:
                    out[to:to + m, :len(rows)] = part.permute(2, 0, 1, 3).to(out.device)


class _JoiningRows:
    """Rows lo..hi-1 of a cache, written from slot ``start`` on: the prompts' pass of rows that join a batch
    (their prompts end where the batch's cached slots do)."""

    def __init__(self, cache: KVCache, lo: int, hi: int, start: int):
        self.cache, self.lo, self.hi, self.length = cache, lo, hi, start

    def visible(self, T: int) -> int:
        return _visible(self.cache.capacity, self.length, T)

    def extend(self, j: int, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.write(j, k_BHTd, v_BHTd, self.lo, self.hi, self.length)

    def advance(self, T: int) -> None:
        pass  # the batch's length is the session's to set


def _visible(capacity: int, n: int, T: int) -> int:
    return min(capacity, -(-(n + T) // KV_BUCKET) * KV_BUCKET)


class _Resident(Units):
    """Every layer in a slot of its own (K = L): filled once, read by every step."""

    @property
    def layer_slots(self) -> int:
        return max(self.L, 1)


class Generator:
    """A model loaded for generation: weights on the host (frozen, in the compute dtype), streamed or resident
    on the device, the tokenizer when the directory has one."""

    def __init__(self, model: ModelConfig, store: HostStore, device: torch.device, lora: lora_io.LoraConfig | None,
                 tokenizer: Any = None, eos_ids: Sequence[int] = (), gpu_budget_bytes: int | None = None,
                 kernels: str = "auto", weights: tuple | None = None):
        """``weights``: (HostWeights, Units, template, step) of a training engine to generate with its current
        weights (``of_engine``); None: this generator's own, over ``store``."""
        self.model = model
        self.store = store
        self.device = device
        self.dtype = store.compute_dtype
        self.lora = lora
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self._buffers = HostBuffers(store.pool)
        self.weight_bytes = sum(u.master.nbytes for u in store.units) + sum(a.master.nbytes for a in store.adapters)
        # layers whose KV cache stays on the device: None, as the budget leaves room (``_device_kv_layers``);
        # a number caps it (0: every layer's cache in pinned host memory), for tests and measurements
        self.kv_layers_on_device: int | None = None
        # decode steps as CUDA graphs (decode_graphs.py): None, where they apply; False: never; True: on the CPU
        # too, as the static-buffer step without a graph (tests)
        self.decode_graphs: bool | None = None
        self._graphs: decode_graphs.DecodeGraphs | None = None
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            self.gpu_budget = int(gpu_budget_bytes if gpu_budget_bytes is not None else free * 0.9)
        else:
            self.gpu_budget = 0
        self.weights: HostWeights
        if weights is not None:
            self.weights, self.units, self.template, self._step = weights
            self.resident = False
            return
        self._step = lambda: 0  # nothing updates these weights: version 0 is the only one
        self.template = Template(model, Kernels(resolve_kernels(kernels, device)))
        L = model.num_layers
        n = max(len(store.units), len(store.adapters))
        fence = Fence(n, "updates")  # never marked: nothing updates these weights, version 0 is the only one
        if device.type == "cuda":
            self.resident = self.weight_bytes <= RESIDENT_SHARE * self.gpu_budget
            units = _Resident(L, max(L, 1)) if self.resident else Units(L, 1)
            h2d = torch.cuda.Stream(device)
            self.weights = DeviceWeights(store, units, fence, 0, device, self._buffers, h2d)
        else:
            self.resident = True  # the host buffers are the weights
            units = Units(L, 1)
            self.weights = HostWeights(store, units, fence, 0)
        self.units = units

    # ---- construction --------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "auto", dtype: str | None = None,
                        gpu_budget_bytes: int | None = None, kernels: str = "auto",
                        tokenizer: Any = "auto", quantize: str | None = None) -> Generator:
        """An HF model directory (a base, or a full fine-tune's final/) or a PEFT adapter directory. ``dtype``
        None: bfloat16 on CUDA, float32 on the CPU. ``tokenizer``: "auto" loads the one saved beside the model
        (the adapter's, else its base's), None: none (token ids in, token ids out). ``quantize``: how the
        frozen layers are kept (model.QUANTIZE, bitsandbytes' quantization on ``device``, as training packs
        them); None: as the adapter was trained (its quantized_base.json), a pre-quantized checkpoint as it is
        stored, else in the compute dtype."""
        path = Path(path)
        dev = resolve_device(device)
        dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        if dt not in (torch.float32, torch.bfloat16):
            raise BadInput(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        lora, base = None, path
        if lora_io.is_adapter_dir(path):
            lora, named = lora_io.read_adapter_config(path)
            if not named or not (Path(named) / "config.json").is_file():
                raise BadInput(f"the adapter in {path} names base model {named!r}, which is not an HF model "
                               "directory here; copy the base model there or fix base_model_name_or_path")
            base = Path(named)
        if not path.is_dir():
            raise BadInput(f"{path} is not a directory: point at an HF model directory or a PEFT adapter directory")
        model = ModelConfig.load(base)
        adapters = lora_io.adapter_layouts(model, lora) if lora is not None else []
        quantize = lora_io.generation_quantize(model.hf, path if lora is not None else None, quantize)
        store = HostStore(unit_layouts(model), dt, dt, pin=dev.type == "cuda", adapter_layouts=adapters,
                          quantize=quantize, nested=stored_nested(model.hf))
        io.load_into(store, base, model.tie_word_embeddings, device=dev)
        if lora is not None:
            lora_io.copy_base_norms(store)  # norms the adapter did not train are the base's
            lora_io.load_adapter(store.adapters, path)
        tok = None
        if tokenizer == "auto":
            tok = _tokenizer_of(path) or (_tokenizer_of(base) if base != path else None)
        elif tokenizer is not None:
            tok = tokenizer
        return cls(model, store, dev, lora, tok, _eos_ids(base, tok), gpu_budget_bytes, kernels)

    @classmethod
    def from_tensors(cls, hf_config: dict, tensors: dict, device: str = "auto", dtype: str | None = None,
                     gpu_budget_bytes: int | None = None, kernels: str = "auto") -> Generator:
        """A model from its config.json (a dict) and its tensors by HF name (an HF model's state_dict): the
        benchmark's random-init models, with no checkpoint on disk."""
        dev = resolve_device(device)
        dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        model = ModelConfig.load(hf_config)
        store = HostStore(unit_layouts(model), dt, dt, pin=dev.type == "cuda", adapter_layouts=[])
        for unit in store.units:
            for t in unit.layout.tensors:
                if t.name not in tensors:
                    raise BadInput(f"no tensor {t.name} among the given tensors: they are not of this config's model")
                t.view_of(unit.master).copy_(tensors[t.name])
        return cls(model, store, dev, None, None, (), gpu_budget_bytes, kernels)

    @classmethod
    def of_engine(cls, eng: Any, tokenizer: Any = None, eos_ids: Sequence[int] = ()) -> Generator:
        """Generation with a training engine's newest weights, through its own weight slots (evaluation by
        generation during a job: nothing is copied or loaded)."""
        return cls(eng.model, eng.store, eng.device, eng.lora, tokenizer, eos_ids,
                   weights=(eng._weights, eng.units, eng.template, eng._newest))

    # ---- prompts --------------------------------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict]) -> tuple[int, ...]:
        """The token ids of a conversation rendered by the tokenizer's chat template, with the generation
        prompt of the assistant's turn."""
        from jinja2 import TemplateError

        turns = chat_turns(messages)
        tok = self._need_tokenizer("a chat")
        if getattr(tok, "chat_template", None) is None:
            raise BadInput("this model's tokenizer has no chat template: send a plain prompt to /v1/completions")
        try:
            encoded = tok.apply_chat_template(turns, tokenize=True, add_generation_prompt=True)
        except TemplateError as exc:  # the template's own refusal: roles that must alternate, no system role ...
            raise BadInput(f"the model's chat template refuses these messages: {exc}; change the messages to what "
                           "it takes", field="messages") from None
        return tuple(encoded if isinstance(encoded, list) else encoded["input_ids"])

    def text_prompt(self, text: str) -> tuple[int, ...]:
        if not isinstance(text, str):
            raise BadInput(f"prompt must be a string, got {text!r}", field="prompt")
        tok = self._need_tokenizer("a text prompt")
        encoded = tok(text)
        return tuple(encoded["input_ids"] if not isinstance(encoded, list) else encoded)

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise BadInput(f"{what} needs the model's tokenizer, and its directory has none: save the tokenizer "
                           "beside the model (tokenizer.json), or send token ids")
        return self.tokenizer

    # ---- generation -----------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Every request run to its end, batched."""
        tokens: list[list[int]] = [[] for _ in requests]
        finish: list[str] = ["length"] * len(requests)
        for deltas in self.stream(requests):
            for d in deltas:
                if d.token_id is not None:
                    tokens[d.row].append(d.token_id)
                if d.finish_reason is not None:
                    finish[d.row] = d.finish_reason
        return [Completion(t, self._final_text(t, r.params.stop), f, len(r.prompt_ids))
                for t, f, r in zip(tokens, finish, requests)]

    def stream(self, requests: Sequence[Request]) -> Iterator[list[Delta]]:
        """The batch's steps: after the prompts' pass and after every decode step, what each row added (a
        finished row adds nothing more)."""
        session = self.session()
        first = session.admit(requests, range(len(requests)))
        yield [replace(d, row=key) for key, d in first]
        while len(session):
            yield [replace(d, row=key) for key, d in session.step()]

    def session(self) -> Session:
        """A batch that requests join and leave between its steps (continuous batching)."""
        return Session(self)

    def check(self, requests: Sequence[Request]) -> None:
        """Refuse what cannot run: bad parameters, ids outside the vocabulary, more positions than the model has."""
        if not requests:
            raise BadInput("no request to generate for")
        V = self.model.vocab_size
        limit = self.model.hf.get("max_position_embeddings")
        for i, r in enumerate(requests):
            r.params.validate()
            if not r.prompt_ids:
                raise BadInput(f"request {i}: the prompt is empty", field="prompt")
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= V:
                raise BadInput(f"request {i}: token ids must lie in [0, {V}) (the model's vocab_size)", field="prompt")
            if limit and len(r.prompt_ids) + r.params.max_tokens > int(limit):
                raise BadInput(f"request {i}: {len(r.prompt_ids)} prompt tokens + max_tokens {r.params.max_tokens} "
                               f"exceed the model's context of {limit} positions; shorten the prompt or lower "
                               "max_tokens", field="max_tokens")

    def _device_kv_layers(self, B: int, S: int, T0: int, held: int = 0) -> int:
        """Layers whose KV cache fits on the device beside the weights and the prompts' workspace; ``held``:
        device bytes of a cache still alive meanwhile (a batch laid out again copies from the old one)."""
        L = self.model.num_layers
        cap = L if self.kv_layers_on_device is None else max(0, min(L, self.kv_layers_on_device))
        if self.device.type != "cuda":
            return cap
        cfg, esize = self.model, torch.empty(0, dtype=self.dtype).element_size()
        slots = self.weights.device_bytes()["weight_slots"] + self.weights.device_bytes().get("adapter_slots", 0)
        width = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(cfg.experts_per_token, 1))
        # the prompts' pass: a few hidden-sized activations, the MLP's, q/k/v; the head's last-token logits
        workspace = B * T0 * (4 * cfg.hidden_size + 3 * width + cfg.q_dim + 2 * cfg.kv_dim) * esize \
            + 2 * B * cfg.vocab_size * 4
        per_layer = KVCache.layer_bytes(cfg, B, S, self.dtype)
        room = self.gpu_budget - slots - workspace - per_layer - held  # one layer's staging buffers
        return max(0, min(cap, room // per_layer))

    def _micro_batch(self, ids_BT, pos_BS, valid_BS, cache: KVCache | _JoiningRows) -> MicroBatch:
        """This call's T tokens at cache positions n .. n + T - 1, attending to cache positions 0 .. n + T - 1
        (the mask spans the cache's visible positions; those after n + T - 1 are later positions of each row,
        masked as the future). The tables and masks are built on the device from the positions, as in training
        and in the static decode step (a prefill's [B, 1, T, S] masks built on the host crossed as pageable
        copies while the GPU waited)."""
        cfg, dev, dt = self.model, self.device, self.dtype
        B, T = ids_BT.shape
        n, seen = cache.length, cache.visible(T)
        pos_dev, valid_dev = pos_BS[:, :seen].to(dev, non_blocking=True), valid_BS[:, :seen].to(dev, non_blocking=True)
        q_pos_BT = pos_dev[:, n:n + T]
        self_TS = torch.arange(seen, device=dev)[None, :] == (n + torch.arange(T, device=dev))[:, None]
        return decode_graphs.step_microbatch(cfg, self.template.inv_freq_on(dev), q_pos_BT, pos_dev, valid_dev, self_TS,
                                             dt, ids_BT, ids_BT.to(dev, non_blocking=True), cache)

    @gemms_in_mode
    def _forward(self, ids_BT, pos_BS, valid_BS, cache: KVCache | _JoiningRows) -> torch.Tensor:
        """One pass of T tokens per row through every layer; the float32 logits of each row's last token [B, V]
        (on the device)."""
        W, units, k = self.weights, self.units, self._step()
        graphs = self._decode_graphs() if ids_BT.shape[1] == 1 and isinstance(cache, KVCache) else None
        step = graphs.step_for(cache) if graphs is not None else None
        if graphs is not None and step is not None:
            h = self._embed(ids_BT, ids_BT.to(self.device, non_blocking=True), k)
            logits = graphs.run(step, h, pos_BS, valid_BS)
            if logits is not None:
                cache.advance(1)
                return logits
        mb = self._micro_batch(ids_BT, pos_BS, valid_BS, cache)
        h = self._embed(mb.input_ids_host, mb.input_ids_BT, k)
        lora = self._lora_call()
        for j in range(self.model.num_layers):
            u = units.of_layer(j)
            w = W.weights(u, k)
            W.prefetch(u + 1, k)  # the next layer (or the head) streams in while this one computes
            h = self.template.layer(h, w, mb, lora, j=j)
            W.release(u)
        cache.advance(ids_BT.shape[1])
        logits = self.template.logits(h[:, -1], W.head_weights(k))
        W.release_head()
        return logits

    def _embed(self, ids_host_BT: torch.Tensor, ids_BT: torch.Tensor, k: int) -> torch.Tensor:
        """The rows' embeddings [B, T, D] on the device (an untied table's rows gathered on the host), with the
        first layer's copy started behind them."""
        W, units = self.weights, self.units
        if W.host_embed:
            assert isinstance(W, DeviceWeights), "only a device's slots take rows gathered on the host"
            W.prefetch(units.of_layer(0), k)  # the first layer's copy overlaps the gather of the rows
            return W.embed_rows(0, ids_host_BT, k)
        embed = W.weights(units.embed, k)["embed"]
        W.prefetch(units.of_layer(0), k)
        h = F.embedding(ids_BT, embed)
        W.release(units.embed)
        return h

    def _lora_call(self) -> LoraCall | None:
        return LoraCall(self.lora.scaling, 0.0) if self.lora is not None else None

    def _decode_graphs(self) -> decode_graphs.DecodeGraphs | None:
        """Where decode steps run through decode_graphs.py (``decode_graphs``), its steps; else None."""
        # True lifts only the device's condition (the static step runs on the CPU without a graph)
        if self.decode_graphs is False or not decode_graphs.applies(self):
            return None
        if self.decode_graphs is None and not (self.device.type == "cuda" and hasattr(torch.cuda, "CUDAGraph")):
            return None
        if self._graphs is None:
            self._graphs = decode_graphs.DecodeGraphs(self, capture=self.device.type == "cuda")
        return self._graphs

    @staticmethod
    def _pick(logits_BV: torch.Tensor, rows: list[_Row], greedy: bool) -> list[int]:
        if greedy:  # one small copy to the host: the argmax of each row
            return logits_BV.argmax(-1).tolist()
        host = logits_BV.float().cpu()
        return [row.pick(host[b]) for b, row in enumerate(rows)]

    def _final_text(self, token_ids: list[int], stop: tuple[str, ...]) -> str:
        if self.tokenizer is None:
            return ""
        return _cut(self.tokenizer.decode(token_ids, skip_special_tokens=True), stop)[0]


class Session:
    """Rows generating together, changing between steps: ``admit`` runs the prompts' pass of new requests
    into the running batch (and gives each its first token), ``step`` decodes one token of every row,
    ``cancel`` ends rows. Each row is known by the key its caller gave it.

    A row's prompt ends where the batch's cached slots do (they are left-padded into the slots before; a
    prompt longer than the cached slots shifts the batch right), so every row's next token goes to the same
    slot and a decode step stays one pass of the whole batch. Finished and cancelled rows leave when a
    request joins, or once a quarter of the batch has finished; the cache is then laid out again for the
    rows that stay (their slots copied, on the device or the host). A row's positions and masks count its
    own tokens, so it makes the tokens it would make alone, whenever it joined."""

    def __init__(self, gen: Generator):
        self.gen = gen
        self._empty()

    def _empty(self) -> None:
        """No row: the cache goes (and the decode steps that hold it)."""
        if self.gen._graphs is not None:
            self.gen._graphs.release()
        self.cache: KVCache | None = None
        self.pos = torch.zeros(0, 0, dtype=torch.long)  # [B, S] each slot's position in its row
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [B, S] slots holding a token of the row
        self.rows: list[_Row] = []
        self.keys: list[Any] = []
        self.next_ids: list[int] = []  # the token each row feeds next (its newest)
        self.next_pos: list[int] = []  # and that token's position

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def admit(self, requests: Sequence[Request], keys: Iterable[Any]) -> list[tuple[Any, Delta]]:
        """The prompts' pass of ``requests`` (keys: one each), joining the batch; each one's first token."""
        gen = self.gen
        gen.check(requests)
        keys = list(keys)
        live = [b for b, row in enumerate(self.rows) if not row.done]
        n = self.cache.length if self.cache is not None else 0
        first = self._first_used(live)  # slots before it hold no token of a row that stays: they go
        T = max(len(r.prompt_ids) for r in requests)
        n2 = max(n - first, T)  # the slot every row's next token goes to
        # slots each row needs: its remaining tokens fed from n2 on (a joining row's first comes from its prompt)
        need = [n2 + self.rows[b].params.max_tokens - len(self.rows[b].tokens) for b in live]
        need += [n2 + r.params.max_tokens - 1 for r in requests]
        B0, B, S = len(live), len(live) + len(requests), max(need) + 1
        next_pos = [self.next_pos[b] for b in live] + [len(r.prompt_ids) for r in requests]
        cache, pos, valid = self._laid_out(live, B, S, n2, first, T, next_pos)
        ids_BT = torch.zeros(len(requests), T, dtype=torch.long)
        for i, r in enumerate(requests):
            p = len(r.prompt_ids)
            ids_BT[i, T - p:] = torch.tensor(r.prompt_ids, dtype=torch.long)
            pos[B0 + i, n2 - p:n2] = torch.arange(p)
            valid[B0 + i, n2 - p:n2] = True
        joining = [_Row(r.params, gen.tokenizer) for r in requests]
        logits = gen._forward(ids_BT, pos[B0:], valid[B0:], _JoiningRows(cache, B0, B, n2 - T))
        cache.length = n2
        picked = gen._pick(logits, joining, all(r.params.temperature == 0 for r in requests))
        self.cache, self.pos, self.valid = cache, pos, valid
        self.rows = [self.rows[b] for b in live] + joining
        self.keys = [self.keys[b] for b in live] + keys
        self.next_ids = [self.next_ids[b] for b in live] + picked
        self.next_pos = next_pos
        out = [(key, row.add(0, int(t), gen.eos_ids)) for key, row, t in zip(keys, joining, picked)]
        self._leave_if_finished()
        return out

    @torch.no_grad()
    def step(self) -> list[tuple[Any, Delta]]:
        """One decode step of every row still generating: the token each added."""
        gen = self.gen
        ids_BT = torch.tensor(self.next_ids, dtype=torch.long)[:, None]
        assert self.cache is not None, "a step runs rows that joined"
        logits = gen._forward(ids_BT, self.pos, self.valid, self.cache)
        picked = gen._pick(logits, self.rows, all(r.params.temperature == 0 for r in self.rows))
        out = []
        for b, (key, row, t) in enumerate(zip(self.keys, self.rows, picked)):
            if not row.done:
                out.append((key, row.add(0, int(t), gen.eos_ids)))
            self.next_ids[b] = int(t)
            self.next_pos[b] += 1
        self._leave_if_finished()
        return out

    def cancel(self, keys: Iterable[Any]) -> None:
        """These rows make no more tokens (they leave with the next layout)."""
        gone = set(keys)
        for key, row in zip(self.keys, self.rows):
            if key in gone:
                row.done = True
        self._leave_if_finished()

    def _leave_if_finished(self) -> None:
        done = [b for b, row in enumerate(self.rows) if row.done]
        if len(done) == len(self.rows):
            self._empty()  # nothing left
        elif len(done) * 4 >= len(self.rows):
            live = [b for b, row in enumerate(self.rows) if not row.done]
            assert self.cache is not None, "the rows that stay are in the cache"
            first = self._first_used(live)
            n2 = self.cache.length - first
            # the slots the rows that stay still need: what they hold, and their remaining tokens
            S = n2 + max(self.rows[b].params.max_tokens - len(self.rows[b].tokens) for b in live) + 1
            next_pos = [self.next_pos[b] for b in live]
            self.cache, self.pos, self.valid = self._laid_out(live, len(live), S, n2, first, 1, next_pos)
            self.cache.length = n2
            for name in ("rows", "keys", "next_ids", "next_pos"):
                setattr(self, name, [getattr(self, name)[b] for b in live])

    def _laid_out(self, live: list[int], B: int, S: int, n2: int, first: int, T: int,
                  next_pos: list[int]) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
        """A cache of B rows and S slots (sized for a pass of T tokens), its positions and validity: its first
        len(live) rows the cached slots of these rows from ``first`` on, moved to end at slot n2; every row's
        slots from n2 on its next tokens (at positions ``next_pos`` on). Rows past len(live) are the caller's
        to fill below n2 (the prompts of rows that join)."""
        gen = self.gen
        if gen._graphs is not None:  # the old cache's steps go before the new cache takes their room
            gen._graphs.release()
        on_device = gen._device_kv_layers(B, S, T, held=self._held())
        cache = KVCache(gen.model, B, S, gen.dtype, gen.device, on_device, gen._buffers)
        pos = torch.zeros(B, S, dtype=torch.long)
        valid = torch.zeros(B, S, dtype=torch.bool)
        if live:
            assert self.cache is not None, "rows that stay are in the cache"
            n = self.cache.length
            keep = torch.tensor(live, dtype=torch.long)
            to = n2 - (n - first)
            self.cache.copy_rows(cache, keep, first, to)
            pos[:len(live), to:n2] = self.pos[keep, first:n]
            valid[:len(live), to:n2] = self.valid[keep, first:n]
        pos[:, n2:] = torch.tensor(next_pos)[:, None] + torch.arange(S - n2)[None, :]
        valid[:, n2:] = True  # every generated position is a real token
        return cache, pos, valid

    def _held(self) -> int:
        """Device bytes of the current cache (alive while the next layout copies from it)."""
        if self.cache is None:
            return 0
        tensors = [*self.cache.k, *self.cache.v, *(self.cache.stage or ())]
        return sum(t.nbytes for t in tensors if t.device.type != "cpu")

    def _first_used(self, live: list[int]) -> int:
        """The first cached slot holding a token of one of these rows (the batch's length if none)."""
        n = self.cache.length if self.cache is not None else 0
        if not live or self.cache is None:
            return n
        used = self.valid[torch.tensor(live, dtype=torch.long), :n].any(0).nonzero()
        return int(used[0]) if len(used) else n


class _Row:
    """One request's progress: its tokens, its sampler, what of its text was already sent."""

    def __init__(self, params: SamplingParams, tokenizer: Any):
        self.params = params
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already sent
        self.done = False
        self.gen = torch.Generator().manual_seed(params.seed if params.seed is not None
                                                 else int(torch.randint(0, 2**62, ()).item()))

    def pick(self, logits_V: torch.Tensor) -> int:
        p = self.params
        if p.temperature == 0:
            return int(logits_V.argmax())
        z = logits_V / p.temperature
        if p.top_k and p.top_k < z.numel():  # HF's order: temperature, top-k, top-p
            kth = torch.topk(z, p.top_k).values[-1]
            z = z.masked_fill(z < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_z, order = torch.sort(z, descending=True)
            probs = torch.softmax(sorted_z, -1)
            # drop a token once the more likely ones already hold top_p (the most likely always stays)
            drop = (torch.cumsum(probs, -1) - probs) >= p.top_p
            z = z.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        return int(torch.multinomial(torch.softmax(z, -1), 1, generator=self.gen))

    def add(self, b: int, token: int, eos: frozenset[int]) -> Delta:
        if self.done:
            return Delta(b, "", None, None)
        self.tokens.append(token)
        finish = None
        if token in eos:
            finish = "stop"
        elif len(self.tokens) >= self.params.max_tokens:
            finish = "length"
        text = ""
        if self.tokenizer is not None:
            full, stopped = _cut(self.tokenizer.decode(self.tokens, skip_special_tokens=True), self.params.stop)
            if stopped:
                finish = "stop"
            # hold back what a stop sequence may still claim, and a character still being decoded
            upto = len(full) if finish is not None else len(full) - _held_back(full, self.params.stop)
            text, self.sent = full[self.sent:upto], max(self.sent, upto)
        if finish is not None:
            self.done = True
        return Delta(b, text, token, finish)


def _cut(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """The text before the earliest stop sequence, and whether one occurred."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that may be the start of a stop sequence or of a multi-byte character."""
    held = 1 if text.endswith("\ufffd") else 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                held = max(held, n)
                break
    return held


def _tokenizer_of(path: Path) -> Any:
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise BadInput(f"cannot load the tokenizer saved in {path} ({exc}); save it with the model "
                       "(tokenizer.save_pretrained), or pass tokenizer=None for token ids") from None


def _eos_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """The tokens that end a sequence: generation_config.json's, else config.json's, else the tokenizer's (what
    HF generate stops at)."""
    for name in ("generation_config.json", "config.json"):
        f = model_dir / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else [int(e) for e in eos]
    eos = getattr(tokenizer, "eos_token_id", None)
    return [] if eos is None else [int(eos)]
