"""CPU AdamW on the host store, unit by unit, in a background worker, in one of three update modes.

- ``exact`` (the default): clipping is exact by deferral. The step's global gradient norm is known when the
  backward sweep ends, so the update of step k runs after it, in forward order (embedding, layers, head),
  while the forward of step k + 1 streams each unit as soon as its update is committed.
- ``delayed``: the same update, but step k + 1 does not wait for it: it trains on the weights after step
  k - 1 (the store keeps two wires that swap roles each step), so the update overlaps all of step k + 1's
  device work. Not torch.optim.AdamW semantics: every gradient is computed on weights one update old.
- ``speculative``: each unit is updated as soon as its gradient has reached the host during the backward
  (head first), assuming the clip coefficient will be 1 and the norm finite; the partial norm only grows, so
  once it passes max_grad_norm (or is not finite) speculation stops for the step. When the backward ends the
  step is validated: no clipping and a finite norm commit the speculated units as they are (bit-identical to
  exact mode), and the rest are updated in forward order; otherwise every speculated unit is rolled back by
  inverting its update arithmetically (see ``rollback``) and the step is redone with the right coefficient.

The update is torch.optim.AdamW (fused) arithmetic after the gradient is multiplied by the clip coefficient
(cpu_adam.py's one-pass kernels, or torch's fused kernel in chunks). It updates the store's trained units:
every unit of the model, or with LoRA the adapter units only (index u then means adapter u).

The two threads meet at the fences (fence.py): the worker marks ``updates`` when a unit's update of a step is
committed; the training thread marks ``grads`` when a unit's gradient of a step has landed on the host.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from typing import Any

import torch

from horizon_ray.engine import cpu_adam
from horizon_ray.engine.fence import Fence
from horizon_ray.engine.ranks import Ranks
from horizon_ray.engine.store import HostStore, UnitState

# Units are updated in chunks small enough (16 MB of fp32) to stay in the last-level cache between the
# widening of the gradient, the update and the narrowing of the weights for the wire (torch path).
_CHUNK = 1 << 22


class _Abandoned(Exception):
    """The step the worker was speculating on failed: no more gradients will come."""


class HostAdamW:
    def __init__(self, store: HostStore, betas: tuple[float, float], eps: float, weight_decay: float,
                 updates: Fence | None = None, grads: Fence | None = None, threads: int = 0,
                 ranks: Ranks | None = None):
        self.store = store
        self.ranks = ranks or Ranks()  # several ranks: each updates its shard of every unit (ranks.py)
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay
        n = len(store.trained)
        self.updates = updates or Fence(n, "updates")  # marked here: a unit's update of a step is committed
        self.grads = grads or Fence(n, "grads")  # marked by the training thread: a unit's gradient is on the host
        self.threads = threads
        self.chunk = _CHUNK
        self.one_pass = True  # use the compiled one-pass kernels where the layout allows (cpu_adam.py)
        # built (or loaded from torch's extensions cache) now, with the engine: a first build takes ~20 s, which
        # would otherwise land in the first step's update, inside a benchmark's timed steps when it warms up less.
        # Only where it will run: the one-pass kernels take bf16 gradients; an fp32-compute engine (the CPU's
        # default) never calls them, and need not pay a compiler's time and memory (~1.2 GiB) in its container.
        if getattr(store, "compute_dtype", None) == torch.bfloat16:
            cpu_adam.kernel()
        self._cv = threading.Condition()
        self._tasks: deque = deque()
        self._busy = False
        self._error: BaseException | None = None
        self._worker: threading.Thread | None = None
        self._speculated: list[int] = []  # units updated speculatively for the step in flight, in order
        self._spec_step: int | None = None  # that step
        self._spec_lr = 0.0  # and its learning rate
        self._spec_t0 = 0.0  # when its speculation began
        self.last_update_s = 0.0  # wall time of the last step's whole update (speculation included)
        self.rollbacks = 0  # steps whose speculative updates were rolled back
        self.speculated_units = 0  # units the last validated step had updated during its backward

    # ---- the training thread's side -------------------------------------------------------------------------

    def speculate(self, k: int, lr: float, order: list[int], max_norm: float) -> None:
        """Step k's backward begins: update the units of ``order`` (in that order) as their gradients land,
        with clip coefficient 1, while the partial norm stays within ``max_norm``."""
        self._submit(lambda: self._speculate(k, lr, order, max_norm), ("speculate", k))

    def launch(self, k: int, lr: float, clip_coef: float) -> None:
        """Step k's gradients are all on the host and its norm is finite: commit (or redo) what was speculated
        and update the rest, in forward order. Returns at once."""
        self._submit(lambda: self._finish(k, lr, clip_coef), ("finish", k))

    def wait_all(self) -> None:
        """Until every submitted task has run; raises the worker's failure."""
        with self._cv:
            self._cv.wait_for(lambda: (not self._tasks and not self._busy) or self._error is not None)
        self._raise()

    def abandon(self, k: int) -> None:
        """Step k failed before its launch: stop speculating on it, roll back what was speculated, and let
        the gradient fence start over at k. Waits for the worker (a previous step's update finishes first)."""
        self.grads.fail(_Abandoned())
        try:
            with self._cv:
                self._tasks = deque(t for t in self._tasks if t[1] != ("speculate", k))
                self._cv.wait_for(lambda: (not self._tasks and not self._busy) or self._error is not None)
            self._raise()
            lr = self._spec_lr
            for u in reversed(self._speculated):
                self.rollback(self._shard(self.store.trained[u]), lr, k)
            self._speculated = []
        finally:
            self.grads.reset([k] * len(self.store.trained))

    def shutdown(self) -> None:
        """Finish the pending work and stop the worker (a later submit starts a new one)."""
        try:
            self.wait_all()
        finally:
            if self._worker is not None:
                with self._cv:
                    self._tasks.append((None, "stop"))
                    self._cv.notify_all()
                self._worker.join()
                self._worker = None

    def _submit(self, fn, tag) -> None:
        self._raise()
        if self._worker is None:
            # one long-lived worker: its OpenMP team is built once, not at every step
            self._worker = threading.Thread(target=self._serve, name="horizon-adamw", daemon=True)
            self._worker.start()
        with self._cv:
            self._tasks.append((fn, tag))
            self._cv.notify_all()

    def check(self) -> None:
        """Raise if the worker has failed (see _raise)."""
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._failure()

    def _failure(self) -> RuntimeError:
        # An update that failed partway left some units updated and others not (with LoRA, device copies of
        # adapters that no longer match the host): every later step fails too, so that none trains on that
        # state. The job resumes from its last checkpoint.
        err = RuntimeError("the host optimizer failed partway through an update; the weights and AdamW state "
                           "are inconsistent: restart from the last checkpoint")
        err.__cause__ = self._error
        return err

    # ---- the worker ------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._tasks))
                fn, tag = self._tasks.popleft()
                self._busy = True
            try:
                if tag == "stop":
                    return
                fn()
            except _Abandoned:
                pass
            except BaseException as exc:  # surfaced to the training thread at its next wait or submit
                with self._cv:
                    self._error = exc
                    self._tasks.clear()
                self.updates.fail(self._failure())
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _finish_queued(self, k: int) -> bool:
        with self._cv:
            return any(tag == ("finish", k) for _, tag in self._tasks)

    def _speculate(self, k: int, lr: float, order: list[int], max_norm: float) -> None:
        self._speculated, self._spec_step, self._spec_lr = [], k, lr
        self._spec_t0 = time.perf_counter()
        for u in order:
            if self._finish_queued(k):
                break  # the backward has ended: the finish takes the rest in forward order
            event, norm_sq = self.grads.wait(u, k + 1)
            if event is not None:
                event.synchronize()  # the gradient (and the partial norm after it) has landed
            if not float(norm_sq) <= max_norm * max_norm:  # NaN compares false: stop as well
                break
            self.update(self._shard(self.store.trained[u]), lr, 1.0, k)
            self._speculated.append(u)

    def _finish(self, k: int, lr: float, clip_coef: float) -> None:
        t0 = self._spec_t0 if self._spec_step == k else time.perf_counter()
        done = set(self._speculated if self._spec_step == k else [])
        redo = clip_coef < 1.0 and bool(done)  # the norm passed max_grad_norm after these were updated
        self.rollbacks += redo
        self.speculated_units = 0 if redo else len(done)
        if not redo:
            for u in sorted(done):  # committed as they are: exactly exact mode's update
                self.updates.mark(u)
        for u, whole in enumerate(self.store.trained):  # forward order: what the next forward needs first
            unit = self._shard(whole)
            if u in done and redo:
                self.redo(unit, lr, clip_coef, k)
            elif u not in done:
                self.update(unit, lr, clip_coef, k)
            else:
                continue
            self.updates.mark(u)
        self._speculated, self._spec_step = [], None
        self.last_update_s = time.perf_counter() - t0

    # ---- one unit --------------------------------------------------------------------------------------------

    def _shard(self, unit: UnitState) -> UnitState:
        """The unit as this rank updates it: views of its share of every buffer (the whole unit alone)."""
        if not self.ranks.many:
            return unit
        s = self.ranks.shard(unit.layout.numel)
        master = unit.master[s]
        return dataclasses.replace(
            unit, master=master, exp_avg=unit.exp_avg[s], exp_avg_sq=unit.exp_avg_sq[s],
            wires=[master if w is unit.master else w[s] for w in unit.wires],
            grad_own=None if unit.grad_own is None else unit.grad_own[s])

    def update(self, unit: UnitState, lr: float, clip_coef: float, k: int = 0) -> None:
        """One AdamW step of a unit from step k's gradient, then the wire that step k + 2 (delayed) or k + 1
        reads. The one-pass kernels where the layout allows; else torch's fused kernel chunk by chunk, each
        chunk still in cache between the widening (and clipping) of its gradient, the update and the
        narrowing of its weights for the wire."""
        unit.step += 1
        grad, wire = unit.grad_of(k), unit.wire_of(k)
        kw: dict[str, Any] = dict(lr=lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                                  step=float(unit.step), clip=min(clip_coef, 1.0))
        if self.one_pass and grad.dtype == torch.bfloat16:
            if unit.master.dtype == torch.float32 and wire.dtype == torch.bfloat16:
                if cpu_adam.adamw_f32(unit.master, unit.exp_avg, unit.exp_avg_sq, grad, wire, **kw):
                    unit.wire_written(k)
                    return
            elif unit.master.dtype == torch.bfloat16 and wire is unit.master:
                if cpu_adam.adamw_bf16(unit.master, unit.exp_avg, unit.exp_avg_sq, grad, **kw):
                    unit.wire_written(k)
                    return
        self._torch_update(unit, grad, wire, lr, clip_coef)
        unit.wire_written(k)

    def _torch_update(self, unit: UnitState, grad_all, wire, lr: float, clip_coef: float) -> None:
        widen = grad_all.dtype != unit.master.dtype
        narrow = wire is not unit.master
        clip = clip_coef < 1.0
        n = unit.master.numel()
        step = self.chunk if widen or narrow or clip else n
        scratch = None
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            grad = grad_all[lo:hi]
            # clip_grad_norm_ multiplies every gradient by min(1, max_norm / (norm + 1e-6)); so does this. In
            # place when the gradient is the master's dtype, as torch leaves the clipped gradient (the fused
            # kernel's own grad_scale divides in a separate, slower pass).
            if widen:
                if scratch is None:
                    scratch = torch.empty(min(self.chunk, n), dtype=unit.master.dtype)
                wide = scratch[: hi - lo]
                if clip:
                    torch.mul(grad, clip_coef, out=wide)
                else:
                    wide.copy_(grad)
                grad = wide
            elif clip:
                grad.mul_(clip_coef)
            torch._fused_adamw_(
                [unit.master[lo:hi]], [grad], [unit.exp_avg[lo:hi]], [unit.exp_avg_sq[lo:hi]], [],
                [unit.step], lr=lr, beta1=self.betas[0], beta2=self.betas[1],
                weight_decay=self.weight_decay, eps=self.eps, amsgrad=False, maximize=False,
                grad_scale=None, found_inf=None,
            )
            if narrow:
                wire[lo:hi].copy_(unit.master[lo:hi])

    def redo(self, unit: UnitState, lr: float, clip_coef: float, k: int) -> None:
        """Undo a unit's unclipped speculative update of step k and redo it with the clip coefficient: one pass
        of the one-pass kernel where the layout allows, else rollback() and update()."""
        grad, wire = unit.grad_of(k), unit.wire_of(k)
        if self.one_pass and unit.master.dtype == torch.float32 and grad.dtype == wire.dtype == torch.bfloat16 \
                and grad is not wire:
            if cpu_adam.adamw_f32_redo(unit.master, unit.exp_avg, unit.exp_avg_sq, grad, wire, lr=lr,
                                       betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                                       step=float(unit.step), clip=min(clip_coef, 1.0)):
                unit.wire_written(k)
                return
        self.rollback(unit, lr, k)
        self.update(unit, lr, clip_coef, k)

    def rollback(self, unit: UnitState, lr: float, k: int) -> None:
        """Undo an unclipped update of step k by inverting its arithmetic from the kept gradient: the master,
        m and v come back to within a few units in the last place of fp32 (division by beta1, beta2 and the
        decay factor round; v is clamped at 0), not bit for bit. The wire is left for the redo to rewrite."""
        step = float(unit.step)
        b1, b2 = self.betas
        step_size = lr / (1.0 - b1 ** step)
        bc2_sqrt = math.sqrt(1.0 - b2 ** step)
        decay = 1.0 - lr * self.weight_decay
        grad = unit.grad_of(k)
        n = unit.master.numel()
        for lo in range(0, n, self.chunk):
            hi = min(n, lo + self.chunk)
            g = grad[lo:hi].float()
            m1, v1 = unit.exp_avg[lo:hi].float(), unit.exp_avg_sq[lo:hi].float()
            p1 = unit.master[lo:hi].float()
            denom = v1.sqrt().div_(bc2_sqrt).add_(self.eps)
            p1.addcdiv_(m1, denom, value=step_size).div_(decay)
            m1.sub_(g, alpha=1.0 - b1).div_(b1)
            v1.addcmul_(g, g, value=-(1.0 - b2)).div_(b2).clamp_(min=0.0)
            unit.master[lo:hi].copy_(p1)
            unit.exp_avg[lo:hi].copy_(m1)
            unit.exp_avg_sq[lo:hi].copy_(v1)
        unit.step -= 1
