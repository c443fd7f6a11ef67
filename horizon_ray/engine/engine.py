"""The streaming trainer: host RAM holds the model, the device runs one unit at a time.

A step, in layer-major order (every micro-batch passes a layer while its weights are on the device):
  forward   embedding, then each layer; the input of every K-th layer is kept as a checkpoint
  loss      final norm + LM head + cross-entropy in chunks of tokens, fused with its own backward
  backward  block by block from the top: recompute the block's inputs from its checkpoint, then each
            layer's forward under autograd and torch.autograd.grad with the incoming dL/dy
  update    the global norm is known once the sweep ends; AdamW runs on the host in the background
            (optimizer.py: exact, delayed or speculative) and the next step's forward streams each unit as
            soon as the update it needs is committed

The parts: ``weights`` (slots.py: units on the device), ``stash`` (stash.py: activation checkpoints),
``grad_sink`` (grads.py: accumulators, copies to the host, the norm) and the host optimizer; the training
thread and the optimizer's worker meet only at the two fences (fence.py): ``updates`` and ``grads``.

With ``EngineConfig(lora=LoraConfig(...))`` the same step trains only the adapters (see lora.py): the
base streams as above but is frozen, each layer's backward asks autograd for dL/d(input) and the adapter
gradients only (the base weights are no leaves, so no base gradient is ever computed; the bottom layer
skips dL/d(input), as the frozen embedding needs none), the head gives dL/dh alone, and the norm, the
clipping and AdamW cover the adapters. Dropout masks come from a generator seeded by (seed, step, layer,
row group), so the forward, the recompute and the backward draw the same ones.
"""

from __future__ import annotations

import math
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from horizon_ray.engine import heap, io, preference
from horizon_ray.engine import lora as lora_io
from horizon_ray.engine.config import DTYPES, EngineConfig, resolve_device
from horizon_ray.engine.fence import Fence
from horizon_ray.engine.grads import DeviceGrads, HostGrads
from horizon_ray.engine.kernels import Kernels, gemms_in_mode, resolve_kernels
from horizon_ray.engine.layers import Deferred, LoraCall, MicroBatch, Template
from horizon_ray.engine.model import NORM_KEYS, ModelConfig, quantize_for, stored_nested, unit_layouts
from horizon_ray.engine.objective import DpoConfig, DpoMetrics
from horizon_ray.engine.optimizer import HostAdamW
from horizon_ray.engine.pinned import HostBuffers
from horizon_ray.engine.ranks import Ranks, SharedFence
from horizon_ray.engine.slots import DeviceWeights, HostWeights
from horizon_ray.engine.stash import KeptStash, OffloadStash
from horizon_ray.engine.store import HostStore
from horizon_ray.engine.units import Units
from horizon_ray.errors import BadInput

# from_config draws its random matrices in chunks of this many elements, in parallel
_INIT_CHUNK = 1 << 22
# how many updates behind the weights a step reads may be, by update mode
_LAG = {"exact": 0, "speculative": 0, "delayed": 1}


@dataclass(frozen=True)
class EngineStats:
    """What a benchmark or a job reports about the engine, read between steps without waiting: the update
    fields describe the updates that have finished (``synchronize()`` first for the last step's)."""

    step: int  # optimizer steps done
    update: str  # "exact" | "delayed" | "speculative"
    waited_s: float  # time the training thread has spent blocked on the host update, summed over the run
    last_update_s: float  # wall time of the last step's whole host update
    rollbacks: int  # speculative steps rolled back and redone because clipping triggered
    speculated_units: int  # units the last step updated during its backward (speculative)
    host_checkpoint_bytes: int  # pinned host buffers of offloaded checkpoints and gathered embedding rows
    host_bytes: dict  # the store's bytes by kind
    device_bytes: dict  # the device buffers the engine holds, by kind


class Engine:
    def __init__(self, model: ModelConfig, cfg: EngineConfig, store: HostStore | None = None,
                 ranks: Ranks | None = None):
        """``store`` and ``ranks``: one rank of a job of several on one node (ranks.py), over a store that
        ``Engine.new_store(..., world=N)`` made in shared memory and filled; None: a job of one."""
        cfg.validate()
        if cfg.lora is not None:  # the family's default targets where the config names none, the checkpoint's quantize
            cfg = replace(cfg, lora=cfg.lora.for_model(model))
        else:
            quantize_for(model.hf, None)  # a pre-quantized checkpoint is refused for full fine-tuning
        self.cfg = cfg
        self.model = model
        self.device = resolve_device(cfg.device)
        self.dtype = cfg.dtype
        self.L = model.num_layers
        self.units = Units(self.L, min(cfg.checkpoint_every, max(self.L, 1)))
        self.K = self.units.K
        self.lr = cfg.lr
        self.last_grad_norm = math.nan
        self.lora = cfg.lora
        self.update_mode = cfg.update
        self.ranks = ranks or Ranks()
        if self.ranks.many and cfg.update == "speculative":
            raise BadInput("update speculative needs the partial gradient norm after every unit, which several "
                           "ranks would have to all-reduce unit by unit: use update exact or delayed with several "
                           "GPUs", field="training.update")
        self.base_model_path: str | None = None  # the model directory the base came from (from_pretrained)
        self._steps = 0  # optimizer steps launched: the index k of the next step, and of its dropout seeds
        self._last_clipped = False  # the last step's gradient was clipped (speculation skips the next one)
        self._row_groups = 0  # row groups of the micro-batches being run (numbers dropout masks across ranks)
        self.last_dpo: DpoMetrics | None = None  # the last preference step's metrics (train_step with dpo)
        cuda = self.device.type == "cuda"
        self._spec_order = self._speculation_order(cfg.update, cfg.speculate_units, self._n_trained(model, cfg))
        if store is None:
            self.store = Engine.new_store(model, cfg, pin=cuda)
        else:
            if store.world != self.ranks.world or [u.layout for u in store.units] != unit_layouts(model):
                raise BadInput(f"the shared store was made for {store.world} rank(s) and another layout; this "
                               f"engine is rank {self.ranks.rank} of {self.ranks.world}")
            self.store = store
            store.attach(pin=cuda)
        n_trained = len(self.store.trained)
        # the optimizer marks: a unit's update is committed (with several ranks: every rank's shard of it)
        if self.ranks.many:
            assert self.store.versions is not None, "a store made for several ranks holds their table of versions"
            self._updates: Fence = SharedFence(self.store.versions, self.ranks.rank, "updates")
        else:
            self._updates = Fence(n_trained, "updates")
        self._grads = Fence(n_trained, "grads")  # the training thread marks: a unit's gradient is on the host
        threads = cfg.optimizer_threads or (max(1, (os.cpu_count() or 4) - 2) if cuda else 0)
        self._optimizer = HostAdamW(self.store, cfg.betas, cfg.eps, cfg.weight_decay, self._updates, self._grads,
                                    threads=threads, ranks=self.ranks)
        offload = cfg.offload_checkpoints if cfg.offload_checkpoints != "auto" else cuda
        lag = _LAG[cfg.update]
        self._buffers = HostBuffers(self.store.pool)
        self._weights: HostWeights
        self._grad_sink: HostGrads
        if cuda:
            h2d, d2h = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
            self._weights = DeviceWeights(self.store, self.units, self._updates, lag, self.device, self._buffers, h2d,
                                          cfg.fuse_projections)
            self._stash = OffloadStash(self.device, self._buffers, h2d, d2h) if offload else KeptStash()
            self._grad_sink = DeviceGrads(self.store, self.units, self._grads, self.device, self.ranks, self._buffers,
                                          d2h)
        else:
            self._weights = HostWeights(self.store, self.units, self._updates, lag, cfg.fuse_projections)
            self._stash = KeptStash()
            self._grad_sink = HostGrads(self.store, self.units, self._grads, self.device, self.ranks)
        self.offload_checkpoints = isinstance(self._stash, OffloadStash)
        self.template = Template(model, Kernels(resolve_kernels(cfg.kernels, self.device)))

    # ---- construction --------------------------------------------------------------------------------

    @staticmethod
    def _n_trained(model: ModelConfig, cfg: EngineConfig) -> int:
        if cfg.lora is None:
            return model.num_layers + 2
        return len(lora_io.adapter_layouts(model, cfg.lora))

    @staticmethod
    def new_store(model: ModelConfig, cfg: EngineConfig, pin: bool, world: int = 1) -> HostStore:
        """The host store this engine keeps for these settings (LoRA adapters initialised); ``world`` > 1: in
        shared memory for that many ranks (each then builds ``Engine(model, cfg, store, Ranks(r, world))``)."""
        lora = cfg.lora.for_model(model) if cfg.lora is not None else None
        adapters = lora_io.adapter_layouts(model, lora) if lora is not None else None
        units = Units(model.num_layers, min(cfg.checkpoint_every, max(model.num_layers, 1)))
        spec = Engine._speculation_order_of(units, cfg.update, cfg.speculate_units, Engine._n_trained(model, cfg))
        store = HostStore(unit_layouts(model), cfg.dtype, cfg.master_dtype, pin=pin, adapter_layouts=adapters,
                          wires=2 if cfg.update == "delayed" else 1, own_grads=frozenset(spec), world=world,
                          quantize=lora.quantize if lora is not None else "none", nested=stored_nested(model.hf))
        if lora is not None:
            lora_io.init_adapters(store.adapters, cfg.seed)
        return store

    @classmethod
    def shared_store(cls, source: str | Path | dict, cfg: EngineConfig, world: int) -> tuple[ModelConfig, HostStore]:
        """The model (an HF model directory, or a config for random initialisation as from_config draws it)
        and its store in shared memory, filled, for ``world`` ranks of one job."""
        model = ModelConfig.load(source)
        store = cls.new_store(model, cfg, pin=False, world=world)
        if isinstance(source, dict) or not (Path(source).is_dir()):
            _init_random(store, model, cfg)
        else:
            io.load_into(store, Path(source), model.tie_word_embeddings)
        if cfg.lora is not None:
            lora_io.copy_base_norms(store)
        return model, store

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, cfg: EngineConfig) -> Engine:
        """An HF model directory; or a PEFT LoRA adapter directory (adapter_config.json +
        adapter_model.safetensors), whose base_model_name_or_path is loaded as the frozen base with the
        adapter on it (cfg.lora None: the adapter's own r, alpha, dropout and targets)."""
        model_dir = Path(model_dir)
        if lora_io.is_adapter_dir(model_dir):
            return cls._from_adapter(model_dir, cfg)
        eng = cls(ModelConfig.load(model_dir), cfg)
        io.load_into(eng.store, model_dir, eng.model.tie_word_embeddings, eng.device)
        eng.base_model_path = str(model_dir.resolve())
        eng._base_loaded()
        return eng

    @classmethod
    def _from_adapter(cls, adapter_dir: Path, cfg: EngineConfig) -> Engine:
        lora, base = lora_io.read_adapter_config(adapter_dir)
        if cfg.lora is None:
            cfg = replace(cfg, lora=lora)
        elif _shape_of(cfg.lora) != _shape_of(lora):
            raise BadInput(f"the adapter in {adapter_dir} has r={lora.r}, alpha={lora.alpha}, targets "
                             f"{list(lora.ordered_targets)}, modules_to_save {list(lora.modules_to_save)} but the "
                             f"engine's lora config asks for r={cfg.lora.r}, alpha={cfg.lora.alpha}, targets "
                             f"{list(cfg.lora.ordered_targets)}, modules_to_save {list(cfg.lora.modules_to_save)}; "
                             "pass lora=None to take the adapter's")
        if not base or lora_io.is_adapter_dir(Path(base)) or not (Path(base) / "config.json").is_file():
            raise BadInput(f"the adapter in {adapter_dir} names base model {base!r}, which is not an HF model "
                             "directory here; load the base with from_pretrained and call load_adapter")
        eng = cls.from_pretrained(base, cfg)
        eng.load_adapter(adapter_dir)
        return eng

    @classmethod
    def from_config(cls, config: dict | str | Path, cfg: EngineConfig) -> Engine:
        """Random initialisation with HF's conventions: N(0, initializer_range) matrices, zero biases,
        unit norms."""
        eng = cls(ModelConfig.load(config), cfg)
        _init_random(eng.store, eng.model, cfg, eng.device)
        eng._base_loaded()
        return eng

    def _base_loaded(self) -> None:
        if self.lora is not None:
            lora_io.copy_base_norms(self.store)  # trained norms start from the base's

    # ---- public API ----------------------------------------------------------------------------------

    @property
    def hf_config(self) -> dict:
        return dict(self.model.hf)

    @property
    def num_params(self) -> int:
        """Parameters of the model (with LoRA: of the base, adapters not counted)."""
        return self.store.num_params

    @property
    def trainable_params(self) -> int:
        """Parameters the optimizer updates: the model's, or with LoRA the adapters'."""
        return self.store.trainable_params

    @property
    def step(self) -> int:
        """Optimizer steps done (launched: the update of the last one may still run in the background)."""
        return self._steps

    @property
    def update_lag(self) -> int:
        """Steps by which a step's reads trail the updates: 1 under the delayed update (step k reads the weights
        after the update of step k - 2, which runs beside step k - 1), 0 otherwise (step k reads step k - 1's)."""
        return _LAG[self.update_mode]

    def set_lr(self, lr: float) -> None:
        if not lr >= 0:
            raise BadInput(f"learning rate must be >= 0, got {lr}")
        self.lr = float(lr)

    @gemms_in_mode
    def train_step(self, micro_batches, dpo: DpoConfig | None = None, ref_logps: torch.Tensor | None = None) -> float:
        """One optimizer step over the micro-batches; the mean loss over their non-ignored tokens. With ``dpo``, a
        preference step (preference.py): rows 2i and 2i+1 of the step are a pair's chosen and rejected, labelled
        on their completions only, ``ref_logps`` the reference's summed completion log-prob of each row
        (``sequence_logps`` with the starting weights); the loss is the mean over the step's pairs and
        ``last_dpo`` holds the step's metrics."""
        mbs, n_targets = self._prepare(micro_batches, pairs=dpo is not None)
        # several ranks: the loss is the mean over every rank's targets (each rank's backward scales by it)
        n_targets = self.ranks.all_reduce_int(n_targets, self.device)
        if n_targets == 0:
            raise BadInput("every label of this step is -100 (ignored): nothing to train on; check the "
                           "loss mask and that sequences are longer than their prompt")
        self._optimizer.check()  # a failed update leaves inconsistent weights: no step may train on them
        k = self._steps
        try:
            if self._spec_order and not self._last_clipped:
                # the worker updates units as their gradients land; not right after a step that clipped, whose
                # successor is likely to clip too (a rollback costs more than the overlap gains)
                self._optimizer.speculate(k, self.lr, self._spec_order, self._max_norm())
            hs = self._forward(mbs, k, train=True)
            self._stash.prefetch(self.K * ((self.L - 1) // self.K))  # the top block's checkpoint
            if dpo is None:
                loss, dhs, tied_acc = self._loss(hs, mbs, n_targets, k, backward=True)
            else:
                loss, dhs, tied_acc = self._dpo_loss(hs, mbs, dpo, ref_logps, k)
            del hs
            if self.model.router_aux_coef:  # MoE: the routers' load-balancing loss, over every rank's micro-batches
                loss = loss + self.template.router_loss(mbs, self.ranks.all_reduce_int(len(micro_batches), self.device))
            dhs = self._backward(dhs, mbs, k)
            if self.lora is None:  # with LoRA the embedding is frozen
                self._embedding_backward(dhs, mbs, tied_acc, k)
            norm = self._grad_sink.finish()  # the step's one host sync
            loss = float(self.ranks.all_reduce(loss))
            self.last_grad_norm = norm
            if not math.isfinite(norm):
                raise FloatingPointError(f"gradient norm is {norm} at step {k + 1}: the update was skipped; "
                                         "lower the learning rate or check the data")
        except BaseException:
            self._abandon_step(k)
            raise
        coef = min(1.0, self._max_norm() / (norm + 1e-6)) if self.cfg.clipping else 1.0
        self._last_clipped = coef < 1.0
        self._optimizer.launch(k, self.lr, coef)
        self._steps += 1
        return loss

    @gemms_in_mode
    @torch.no_grad()
    def eval_loss(self, micro_batches) -> tuple[float, int]:
        """Summed CE over the non-ignored tokens of the micro-batches, and their count, on the newest weights."""
        mbs, n_targets = self._prepare(micro_batches)
        k = self._newest()
        hs = self._forward(mbs, k, train=False)
        loss_sum, _, _ = self._loss(hs, mbs, max(n_targets, 1), k, backward=False)
        return float(loss_sum), n_targets

    @gemms_in_mode
    @torch.no_grad()
    def sequence_logps(self, micro_batches) -> torch.Tensor:
        """Each row's log-probability summed over its non-ignored labels (float32, on the host, rows in the order
        of the micro-batches) on the newest weights: a preference job's reference pass, one streamed forward."""
        mbs, _ = self._prepare(micro_batches)
        k = self._newest()
        hs = self._forward(mbs, k, train=False)
        w = self._weights.head_weights(k)
        logps_R = torch.cat([self.template.row_logps(h, w, mb.targets_BT, self.cfg.loss_chunk_tokens)
                             for h, mb in zip(hs, mbs)])
        self._weights.release_head()
        return logps_R.cpu()

    def eval_dpo(self, micro_batches, dpo: DpoConfig, ref_logps: torch.Tensor) -> DpoMetrics:
        """A preference evaluation: the metrics' sums over the pairs of the micro-batches (rows as train_step's)."""
        dpo.validate()
        logps_R = self.sequence_logps(micro_batches)
        preference.check_pairs(logps_R.shape[0], ref_logps)
        counts_R = torch.cat([(lab[:, 1:] != -100).sum(1) for _, lab, *_ in micro_batches])
        n_pairs = logps_R.shape[0] // 2
        loss, per = preference.objective(dpo, logps_R, ref_logps.float(), counts_R, n_pairs,
                                         int(counts_R[0::2].sum()))
        sums = per.sum(0).tolist()
        sums[0] = float(loss) * n_pairs
        return DpoMetrics(n_pairs, tuple(sums))

    @gemms_in_mode
    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        batch: tuple[torch.Tensor, ...] = (input_ids, torch.full_like(input_ids, -100))
        if position_ids is not None:
            batch = (*batch, position_ids)
        mbs, _ = self._prepare([batch])
        k = self._newest()
        h = torch.cat(self._forward(mbs, k, train=False))
        w = self._weights.head_weights(k)
        logits = self.template.logits(h, w).cpu()
        self._weights.release_head()
        return logits

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """The model in HF format; with LoRA the adapter in PEFT's format (adapter_config.json +
        adapter_model.safetensors, fp32), which peft.PeftModel.from_pretrained loads onto the base."""
        self.synchronize()
        if self.lora is not None:
            return lora_io.save_adapter(self.store.adapters, self.lora, self.base_model_path, Path(out_dir),
                                        base_quantize=self.store.quantize)
        return io.save_pretrained(self.store, self.model.hf, Path(out_dir), DTYPES[self.cfg.save_dtype or "float32"],
                                  self.cfg.max_shard_bytes, self.model.tie_word_embeddings)

    def save_merged(self, out_dir: str | Path) -> Path:
        """LoRA only: the full model in HF format with every adapter merged, W + scaling x B A (computed in
        fp32, written in save_dtype; by default float32, or for a quantized base the compute dtype)."""
        if self.lora is None:
            raise BadInput("save_merged merges LoRA adapters; this engine fine-tunes the whole model, whose "
                             "save_pretrained already writes the full model")
        self._optimizer.wait_all()
        dtype = self.cfg.save_dtype or (self.cfg.compute_dtype if self.store.quantize != "none" else "float32")
        return io.save_pretrained(self.store, self.model.hf, Path(out_dir), DTYPES[dtype],
                                  self.cfg.max_shard_bytes, self.model.tie_word_embeddings,
                                  merge=lora_io.merge_fn(self.store.adapters, self.lora, self.model))

    def load_adapter(self, adapter_dir: str | Path) -> None:
        """LoRA only: set the adapters' weights from a PEFT adapter directory (same r and targets). The
        AdamW state is left as it is: to resume training exactly, use load_state."""
        if self.lora is None:
            raise BadInput("load_adapter needs an engine built with EngineConfig(lora=LoraConfig(...))")
        self._optimizer.wait_all()
        self._sync_device()  # no copy of the adapters to the device may still read them
        lora_io.load_adapter(self.store.adapters, Path(adapter_dir))
        for a in self.store.adapters:
            a.wire_written(0)  # the device copies are stale

    def save_state(self, out_dir: str | Path) -> None:
        """Several ranks: the shared store is saved once, by whichever rank calls this (the job's first)."""
        self.synchronize()
        io.save_state(self.store, Path(out_dir))

    def load_state(self, state_dir: str | Path) -> None:
        """Several ranks: every rank calls it; the first writes the shared store, every rank takes the step."""
        self.synchronize()
        self._sync_device()  # no copy to the device may still read the host buffers about to change
        if self.ranks.rank == 0:
            io.load_state(self.store, Path(state_dir))
        else:
            io.load_steps(self.store, Path(state_dir))
        self.ranks.barrier()  # the shared store is whole before any rank reads it
        self._steps = int(self.store.trained[0].step)
        self._restart_fences()

    def set_update(self, update: str, speculate_units: int | None = None) -> None:
        """Switch the update mode between steps (benchmarks run every mode on one model): waits for the pending
        update, then adds or frees the host buffers the new mode keeps (store.py)."""
        replace(self.cfg, update=update, speculate_units=speculate_units).validate()
        if self.ranks.many:
            raise BadInput("set_update changes the host buffers, which the ranks of a job share: build the "
                           "engines with the update mode instead")
        self._optimizer.wait_all()
        self._sync_device()  # no copy may still read a buffer about to be freed
        self._spec_order = self._speculation_order(update, speculate_units, len(self.store.trained))
        if self.lora is None:
            self.store.relayout(2 if update == "delayed" else 1, frozenset(self._spec_order))
        self.update_mode = update
        self.cfg = replace(self.cfg, update=update, speculate_units=speculate_units)
        self._weights.lag = _LAG[update]
        self._restart_fences()

    def synchronize(self) -> None:
        """Wait until the last step's update is on the host (the weights, moments and wires are final; with
        several ranks, every rank's shard of it)."""
        self._optimizer.wait_all()
        if self.ranks.many:
            for u in range(len(self.store.trained)):
                self._updates.wait(u, self._steps)

    def memory_report(self) -> dict[str, dict[str, int]]:
        return {"host": self.store.bytes_by_kind(), "device": self._device_bytes()}

    def stats(self) -> EngineStats:
        opt = self._optimizer
        return EngineStats(step=self._steps, update=self.update_mode, waited_s=self._updates.waited_s,
                           last_update_s=opt.last_update_s, rollbacks=opt.rollbacks,
                           speculated_units=opt.speculated_units, host_checkpoint_bytes=self._buffers.nbytes,
                           host_bytes=self.store.bytes_by_kind(), device_bytes=self._device_bytes())

    def close(self) -> None:
        """Wait for the last update, stop the optimizer's worker and unlock the pinned host memory (also when
        that update failed, whose error is raised after)."""
        try:
            self._optimizer.shutdown()
        finally:
            self._sync_device()
            self.store.pool.close()

    # ---- the step's parts ----------------------------------------------------------------------------

    def _speculation_order(self, update: str, limit: int | None, n_trained: int) -> list[int]:
        return self._speculation_order_of(self.units, update, limit, n_trained)

    @staticmethod
    def _speculation_order_of(units: Units, update: str, limit: int | None, n_trained: int) -> list[int]:
        """The units the speculative update may update during the backward, head first; never the embedding
        (its gradient comes last, when the norm is known anyway)."""
        if update != "speculative":
            return []
        return units.backward_order(n_trained)[:-1][:limit]

    def _max_norm(self) -> float:
        max_norm = self.cfg.max_grad_norm
        return max_norm if max_norm is not None and self.cfg.clipping else math.inf

    def _newest(self) -> int:
        """The step index whose reads see the newest weights (evaluation): under the delayed update the wire
        of the last update, once it has finished."""
        if self.update_mode != "delayed":
            return self._steps
        self._optimizer.wait_all()
        return self._steps + 1

    def _device_bytes(self) -> dict[str, int]:
        return {**self._weights.device_bytes(), **self._grad_sink.device_bytes()}

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _restart_fences(self) -> None:
        """Every trained unit's weights are those of step ``self._steps``; the device copies are stale."""
        for unit in self.store.trained:
            self.store.refresh_wire(unit)
        n = len(self.store.trained)
        self._updates.reset([self._steps] * n)
        self._grads.reset([self._steps] * n)
        self._weights.reset()

    def _abandon_step(self, k: int) -> None:
        """Step k failed after it began: gradients may sit in wire buffers, and units may have been updated
        speculatively."""
        try:
            # the previous step's update may still be reading its gradients from the wires: let it finish
            # before the wires are rebuilt (its own failure, if any, is raised from here); roll back what
            # this step speculated
            self._optimizer.abandon(k)
        finally:
            self._sync_device()
            self._stash.reset()
            self._grad_sink.reset()
            self._restart_fences()

    def _lora_call(self, j: int, i: int, train: bool) -> LoraCall | None:
        """How layer j applies its adapters to row group i: dropout only while training, with masks seeded
        by (seed, step, layer, row group), so every pass over the same layer and rows draws the same."""
        if self.lora is None:
            return None
        if not (train and self.lora.dropout > 0):
            return LoraCall(self.lora.scaling, 0.0)
        # several ranks: row groups numbered across the ranks, as one process with all their rows would
        seed = lora_io.mix_seed(self.cfg.seed, self._steps, j, i + self.ranks.rank * self._row_groups)
        return LoraCall(self.lora.scaling, self.lora.dropout, seed)

    def _prepare(self, micro_batches, pairs: bool = False) -> tuple[list[MicroBatch], int]:
        if not micro_batches:
            raise BadInput("train_step needs at least one micro-batch")
        V = self.model.vocab_size
        out, total = [], 0
        for i, item in enumerate(micro_batches):
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise BadInput(f"micro-batch {i} must be (input_ids, labels) or (input_ids, labels, position_ids)")
            ids, labels = item[0], item[1]
            pos = item[2] if len(item) == 3 else None
            for name, t in (("input_ids", ids), ("labels", labels), ("position_ids", pos)):
                if t is None:
                    continue
                if not isinstance(t, torch.Tensor) or t.dtype != torch.long or t.dim() != 2:
                    got = f"{t.dtype} with {t.dim()} dims" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise BadInput(f"micro-batch {i}: {name} must be a 2-D torch.long tensor [B, T], got {got}")
                if t.shape != ids.shape:
                    raise BadInput(
                        f"micro-batch {i}: {name} has shape {tuple(t.shape)}, input_ids {tuple(ids.shape)}")
            if ids.numel() == 0:
                raise BadInput(f"micro-batch {i} is empty")
            if int(ids.min()) < 0 or int(ids.max()) >= V:
                raise BadInput(f"micro-batch {i}: token ids must lie in [0, {V}) (the model's vocab_size)")
            bad = (labels != -100) & ((labels < 0) | (labels >= V))
            if bool(bad.any()):
                raise BadInput(f"micro-batch {i}: labels must be -100 or lie in [0, {V})")
            B, T = ids.shape
            targets = torch.cat([labels[:, 1:], torch.full((B, 1), -100, dtype=torch.long)], dim=1)
            positions = pos if pos is not None else torch.arange(T).expand(B, T)
            # the loss is token-weighted over the whole step, so splitting rows changes nothing but the
            # size of the layer template's workspace
            rows = max(1, self.cfg.layer_chunk_tokens // T)
            if pairs:  # a pair's two rows stay in one row group (the loss needs both; one pass of the layers)
                preference.check_pairs(B, None)
                rows = max(2, rows - rows % 2)
            for lo in range(0, B, rows):
                part = slice(lo, lo + rows)
                mb = self._micro_batch(ids[part], targets[part], positions[part], None if pos is None else pos[part],
                                       self.template.router_stats(i, ids[part].numel()))
                total += mb.n_targets
                out.append(mb)
        self._row_groups = len(out)
        return out, total

    def _micro_batch(self, ids, targets, positions, pos, router) -> MicroBatch:
        return self.template.micro_batch(ids, targets, positions, pos, self.device, self.dtype, router)

    def _forward(self, mbs: list[MicroBatch], k: int, train: bool):
        """The layers' forward of step k without autograd; with train, the checkpoints are kept and dropout
        is on."""
        W = self._weights
        if W.host_embed:
            assert isinstance(W, DeviceWeights), "only a device's slots take rows gathered on the host"
            W.prefetch(1, k)  # the first layer's copy overlaps the gather of the embedding rows
            hs = [W.embed_rows(i, mb.input_ids_host, k) for i, mb in enumerate(mbs)]
        else:
            embed = W.weights(0, k)["embed"]
            W.prefetch(1, k)  # the first layer's copy overlaps the embedding lookup
            hs = [F.embedding(mb.input_ids_BT, embed) for mb in mbs]
            W.release(0)
        for j in range(self.L):
            u = self.units.of_layer(j)
            w = W.weights(u, k)
            W.prefetch(u + 1, k)  # the next layer (or the head) streams in while this one computes
            if train and j % self.K == 0:
                self._stash.stash(j, hs)
            with torch.no_grad():
                hs = [self.template.layer(h, w, mb, self._lora_call(j, i, train), j=j)
                      for i, (h, mb) in enumerate(zip(hs, mbs))]
            W.release(u)
        return hs

    def _loss(self, hs, mbs, n_targets: int, k: int, backward: bool, scales: list | None = None):
        """The step's mean CE (a device scalar; the plain sum without backward) and, with backward, dL/dh of
        the last layer's output, the head's gradient sent to the host (unless it is frozen under LoRA), and
        the tied embedding's accumulator holding the LM head's share of its gradient. ``scales``: a weight per
        token of each micro-batch instead of 1 / n_targets (a preference step's)."""
        G = self._grad_sink
        head_u = self.units.head
        w = self._weights.head_weights(k)
        head_adapter = self._weights.head_adapter
        scale = 1.0 / n_targets if backward else 1.0
        sinks, tied_acc = {}, None
        if backward and self.lora is None:
            acc = G.accumulator(head_u, k)
            sinks = self.store.units[head_u].layout.views(acc)
            if self.model.tie_word_embeddings:
                tied_acc = G.accumulator(self.units.embed, k)
                sinks["lm_head"] = self.store.units[0].layout.views(tied_acc)["embed"]
        elif backward and head_adapter is not None:  # LoRA with the final norm trained
            sinks = {"norm": G.adapter_grads(head_adapter, k)["norm"]}
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        dhs = []
        for i, (h, mb) in enumerate(zip(hs, mbs)):
            part, dh = self.template.head_loss(h.reshape(-1, h.shape[-1]), w, mb.targets_BT.reshape(-1),
                                               scale if scales is None else scales[i], self.cfg.loss_chunk_tokens,
                                               sinks, need_dh=backward)
            loss += part
            if backward:
                dhs.append(dh.view_as(h))
        self._weights.release_head()
        if backward and self.lora is None:
            G.flush(head_u, acc, k)
        elif backward and head_adapter is not None:
            G.flush_adapter(head_adapter, k)
        return loss, dhs, tied_acc

    def _dpo_loss(self, hs, mbs, dpo: DpoConfig, ref_logps: torch.Tensor | None, k: int):
        """The preference loss of step k (a device scalar), dL/dh of the last layer's output, the head's gradient
        sent to the host and the tied embedding's accumulator, as _loss returns them: a first pass through the
        head sums each row's completion log-probs, the objective gives dL/d(row's log-prob), and _loss's
        backward pass sends it to each completion token as the weight of its cross-entropy (dCE/dlogp = -1)."""
        dpo.validate()
        rows = sum(mb.targets_BT.shape[0] for mb in mbs)
        if ref_logps is None:
            raise BadInput("a preference step needs ref_logps: the reference's sequence_logps of the step's rows")
        preference.check_pairs(rows, ref_logps)
        w = self._weights.head_weights(k)
        with torch.no_grad():
            logps_R = torch.cat([self.template.row_logps(h, w, mb.targets_BT, self.cfg.loss_chunk_tokens)
                                 for h, mb in zip(hs, mbs)])
        self._weights.release_head()
        counts_R = torch.cat([(mb.targets_BT != -100).sum(1) for mb in mbs])
        n_pairs = self.ranks.all_reduce_int(rows // 2, self.device)
        n_chosen = self.ranks.all_reduce_int(int(counts_R[0::2].sum()), self.device)
        leaf_R = logps_R.detach().requires_grad_()
        with torch.enable_grad():
            loss, per = preference.objective(dpo, leaf_R, ref_logps.to(self.device, torch.float32), counts_R, n_pairs,
                                             n_chosen)
            (dlogps_R,) = torch.autograd.grad(loss, [leaf_R])
        # the weight of each token's CE: -dL/dlogp_t, the gradient of its row (zero where the label is ignored)
        scales, lo = [], 0
        for mb in mbs:
            B = mb.targets_BT.shape[0]
            scales.append((-dlogps_R[lo:lo + B, None] * (mb.targets_BT != -100)).reshape(-1))
            lo += B
        _, dhs, tied_acc = self._loss(hs, mbs, 1, k, backward=True, scales=scales)
        loss = loss.detach()
        sums = self.ranks.all_reduce(per.sum(0))
        self.last_dpo = DpoMetrics(n_pairs, tuple([float(self.ranks.all_reduce(loss.clone())) * n_pairs]
                                                  + sums[1:].tolist()))
        return loss, dhs, tied_acc

    def _backward(self, dhs, mbs, k: int):
        W = self._weights
        blocks = self.units.blocks()
        for b in reversed(range(len(blocks))):
            s, e = blocks[b]
            ws = {j: W.weights(self.units.of_layer(j), k) for j in range(s, e)}
            inputs = {s: self._stash.unstash(s)}
            if b > 0:  # the block below streams into the other slot group during this block's work
                for j in range(*blocks[b - 1]):
                    W.prefetch(self.units.of_layer(j), k)
                self._stash.prefetch(blocks[b - 1][0])
            with torch.no_grad():  # recompute the inputs of the block's other layers
                for j in range(s, e - 1):
                    inputs[j + 1] = [self.template.layer(x, ws[j], mb, self._lora_call(j, i, True), j=j)
                                     for i, (x, mb) in enumerate(zip(inputs[j], mbs))]
            for j in reversed(range(s, e)):
                if self.lora is None:
                    dhs = self._layer_backward(j, ws[j], inputs.pop(j), dhs, mbs, k)
                else:
                    dhs = self._adapter_backward(j, ws[j], inputs.pop(j), dhs, mbs, k)
                W.release(self.units.of_layer(j))
        return dhs

    def _layer_backward(self, j, w, xs, dys, mbs, k: int):
        """Layer j: dL/dx, with every weight's gradient summed over the micro-batches into the unit's fp32
        accumulator (the projections' backward adds into it; the norms come back as autograd leaves)."""
        G = self._grad_sink
        u = self.units.of_layer(j)
        acc = G.accumulator(u, k)
        sinks = self.store.units[u].layout.views(acc, fused=self._weights.fused)  # keyed as the weights are
        leaves = {key: w[key].detach().requires_grad_() for key in self.template.leaf_keys(w)}
        w = {**w, **leaves}
        dxs = []
        for x, dy, mb in zip(xs, dys, mbs):
            x = x.detach().requires_grad_()
            grads = self._recompute_grads(j, x, w, mb, None, sinks, dy, [x, *leaves.values()])
            dxs.append(grads[0])
            for key, g in zip(leaves, grads[1:]):
                sinks[key].add_(g)
        G.flush(u, acc, k)
        return dxs

    def _adapter_backward(self, j, w, xs, dys, mbs, k: int):
        """Layer j under LoRA: dL/dx and the adapters' gradients. The frozen base weights are no leaves, so
        autograd computes no gradient for them; the bottom layer's dL/dx is skipped (nothing uses it)."""
        G = self._grad_sink
        g = G.adapter_grads(j, k)
        leaves = {key: w[key].detach().requires_grad_() for key in g}
        w = {**w, **leaves}
        need_dx = j > 0
        dxs = []
        for i, (x, dy, mb) in enumerate(zip(xs, dys, mbs)):
            x = x.detach().requires_grad_(need_dx)
            grads = self._recompute_grads(j, x, w, mb, self._lora_call(j, i, True), None, dy,
                                          [x, *leaves.values()] if need_dx else list(leaves.values()))
            if need_dx:
                dxs.append(grads[0])
                grads = grads[1:]
            for key, gk in zip(leaves, grads):
                g[key].add_(gk)
        G.flush_adapter(j, k)
        return dxs

    def _recompute_grads(self, j, x, w, mb, lora, sinks, dy, inputs):
        """Layer j's forward again under autograd (``Template.layer_for_backward``) and the gradients of
        ``inputs``; a deferred last projection runs only its gradients' GEMMs. Nothing of the recompute outlives
        the call: the next row group's must not hold this one's tensors."""
        with torch.enable_grad():
            y = self.template.layer_for_backward(x, w, mb, lora, sinks=sinks, j=j)
        outs, douts = y.grad_pairs(w, sinks, dy) if isinstance(y, Deferred) else ([y], [dy])
        del y  # the stand-in's saved input is freed as its backward runs, not held through the layer's
        return torch.autograd.grad(outs, inputs, douts)

    def _embedding_backward(self, dhs, mbs, tied_acc, k: int):
        G = self._grad_sink
        acc = tied_acc if tied_acc is not None else G.accumulator(self.units.embed, k)
        g = self.store.units[0].layout.views(acc)["embed"]
        pad = self.model.padding_idx
        for dh, mb in zip(dhs, mbs):
            ids, rows = mb.input_ids_BT.reshape(-1), dh.reshape(-1, dh.shape[-1]).to(g.dtype)
            if pad is not None:  # HF's padding_idx: lookups of the padding token give its row no gradient
                rows = rows.masked_fill((ids == pad)[:, None], 0.0)
            g.index_add_(0, ids, rows)
        G.flush(self.units.embed, acc, k)


def _init_random(store: HostStore, model: ModelConfig, cfg: EngineConfig,
                 device: torch.device | None = None) -> None:
    """Random initialisation with HF's conventions: N(0, initializer_range) matrices, zero biases, unit norms;
    the matrices drawn in chunks on every core, each chunk from its own seed (deterministic whatever the cores).
    A quantized base is drawn in its compute dtype a layer at a time and packed on ``device``."""
    device = device or torch.device("cpu")
    std = model.initializer_range
    normal = []  # (flat view, seed)
    for u, unit in enumerate(store.units):
        packed = store.packed[u]
        # a packed (quantized) layer is drawn unpacked, then packed tensor by tensor
        master = unit.master if packed is None else torch.empty(unit.layout.numel, dtype=store.compute_dtype)
        for i, t in enumerate(unit.layout.tensors):
            flat = master[t.offset:t.offset + t.numel]
            if len(t.shape) == 2:
                normal += [(flat[lo:lo + _INIT_CHUNK], lora_io.mix_seed(cfg.seed, u, i, lo))
                           for lo in range(0, t.numel, _INIT_CHUNK)]
            elif t.key in NORM_KEYS:  # 1, or 0 where norms scale by (1 + w) (Gemma)
                flat.fill_(1.0 - model.norm_offset)
            else:
                flat.zero_()
        if packed is not None:
            _draw_all(normal, std)
            normal = []
            for t in unit.layout.tensors:
                packed.pack(unit.master, t.key, t.view_of(master), device)
    _draw_all(normal, std)
    for unit in store.units:
        store.refresh_wire(unit)
    heap.give_back()  # (a quantized base's CPU packing chunks)


def init_workers() -> int:
    """Threads the random initialisation draws on: every core."""
    return os.cpu_count() or 1


def _draw_all(normal: list, std: float) -> None:
    """Each chunk drawn in fp32 from its own seed, then rounded into its view's dtype: the random model is
    the same whatever dtype holds it. torch's CPU normal_ draws a bf16 tensor by another algorithm than an fp32
    one (a tail not a multiple of 16 elements on torch 2.13, the whole tensor on others), which made a bf16
    LoRA base another model than the fp32 one it is compared with.

    The fp32 draws of the other dtypes go through one scratch row a worker, allocated at once: a block that
    large is mapped and unmapped whole. A fresh fp32 temporary a chunk would come from each thread's malloc
    arena once glibc's mmap threshold has risen past a chunk (heap.py), and its freed fragments would stay
    resident, more than malloc_trim gives back (test_random_init_gives_its_scratch_back)."""
    workers = init_workers()
    rounded = [item for item in normal if item[0].dtype != torch.float32]
    width = max((view.numel() for view, _ in rounded), default=0)
    scratch = torch.empty(min(workers, len(rounded)), width, dtype=torch.float32) if rounded else None
    rows: queue.SimpleQueue[int] = queue.SimpleQueue()
    for row in range(len(scratch) if scratch is not None else 0):
        rows.put(row)

    def draw(item):
        view, seed = item
        gen = torch.Generator().manual_seed(seed)
        if view.dtype == torch.float32:
            view.normal_(0.0, std, generator=gen)
            return
        assert scratch is not None
        row = rows.get()
        try:
            view.copy_(scratch[row, :view.numel()].view(view.shape).normal_(0.0, std, generator=gen))
        finally:
            rows.put(row)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(draw, normal))


def _shape_of(lora):
    """What must agree between an adapter on disk and the engine's LoRA config (dropout may differ)."""
    return lora.r, lora.alpha, set(lora.targets), set(lora.modules_to_save)

