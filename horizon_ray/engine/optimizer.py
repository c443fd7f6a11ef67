"""CPU AdamW on the host store, unit by unit, in a background thread.

Clipping is exact by deferral: the step's global gradient norm is known when the backward sweep ends, so
the update of step n runs after it, in forward order (embedding, layers, head), while the forward of step
n+1 streams each unit as soon as its update is written. The update is torch's fused CPU AdamW kernel
(torch.optim.AdamW(fused=True) semantics), after the gradient chunk is multiplied by the clip coefficient.

It updates the store's trained units: every unit of the model, or with LoRA the adapter units only (unit
index u then means adapter u, the adapters of layer u).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from horizon_ray.engine import cpu_adam
from horizon_ray.engine.store import HostStore

# Units are updated in chunks small enough (16 MB of fp32) to stay in the last-level cache between the
# widening of the gradient, the update and the narrowing of the weights for the wire.
_CHUNK = 1 << 22
_STOP = ("stop",)


class HostAdamW:
    def __init__(self, store: HostStore, betas: tuple[float, float], eps: float, weight_decay: float,
                 on_updated: Callable[[int], None], threads: int = 0):
        self.store = store
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.on_updated = on_updated  # called with the unit index once its new weights are on the wire
        self.threads = threads
        self.chunk = _CHUNK
        self.one_pass = True  # use the compiled one-pass kernel where the layout allows (cpu_adam.py)
        self._cv = threading.Condition()
        self._done = len(store.trained)  # units of the current update already written
        self._todo: tuple[float, float] | None = None  # (lr, clip coefficient) of an update not yet started
        self._error: BaseException | None = None
        self._scratch: torch.Tensor | None = None
        self._worker: threading.Thread | None = None
        self.waited_s = 0.0  # time the training thread spent blocked on updates (exposed optimizer time)
        self.update_s = 0.0  # wall time of the last full update

    def launch(self, lr: float, clip_coef: float) -> None:
        """Start the update of every unit with this step's gradients; returns at once."""
        self.wait_all()
        if self._worker is None:
            # one long-lived worker: its OpenMP team is built once, not at every step
            self._worker = threading.Thread(target=self._serve, name="horizon-adamw", daemon=True)
            self._worker.start()
        with self._cv:
            self._done = 0
            self._todo = (lr, clip_coef)
            self._cv.notify_all()

    def wait_unit(self, u: int) -> None:
        with self._cv:
            if self._done <= u and self._error is None:
                t0 = time.perf_counter()
                self._cv.wait_for(lambda: self._done > u or self._error is not None)
                self.waited_s += time.perf_counter() - t0
        self._raise()

    def wait_all(self) -> None:
        self.wait_unit(len(self.store.trained) - 1)

    def _raise(self) -> None:
        # An update that failed partway left some units updated and others not (with LoRA, device copies
        # of adapters that no longer match the host): every later wait fails too, so that no step trains
        # on that state. The job resumes from its last checkpoint.
        if self._error is not None:
            raise RuntimeError("the host optimizer failed partway through an update; the weights and AdamW "
                               "state are inconsistent: restart from the last checkpoint") from self._error

    def shutdown(self) -> None:
        """Finish the pending update and stop the worker (a later launch starts a new one)."""
        try:
            self.wait_all()
        finally:
            if self._worker is not None:
                with self._cv:
                    self._todo = _STOP
                    self._cv.notify_all()
                self._worker.join()
                self._worker = None

    def _serve(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._todo is not None)
                todo, self._todo = self._todo, None
            if todo is _STOP:
                return
            self._run(*todo)

    def _run(self, lr: float, clip_coef: float) -> None:
        try:
            t0 = time.perf_counter()
            for u, unit in enumerate(self.store.trained):
                self.update(unit, lr, clip_coef)
                self.on_updated(u)
                with self._cv:
                    self._done = u + 1
                    self._cv.notify_all()
            self.update_s = time.perf_counter() - t0
        except BaseException as exc:  # surfaced to the training thread at its next wait
            with self._cv:
                self._error = exc
                self._done = len(self.store.trained)
                self._cv.notify_all()

    def update(self, unit, lr: float, clip_coef: float) -> None:
        """One AdamW step of a unit, then its wire copy, chunk by chunk so that each chunk is still in
        cache between the widening (and clipping) of its gradient, the update and the narrowing of its
        weights for the wire."""
        unit.step += 1
        if unit.grad is unit.wire and unit.master.dtype == torch.float32 and self.one_pass and \
                cpu_adam.adamw_bf16_wire(unit.master, unit.exp_avg, unit.exp_avg_sq, unit.wire, lr=lr,
                                         betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                                         step=float(unit.step), clip=min(clip_coef, 1.0)):
            return
        widen = unit.grad.dtype != unit.master.dtype
        narrow = unit.wire is not unit.master
        clip = clip_coef < 1.0
        n = unit.master.numel()
        step = self.chunk if widen or narrow or clip else n
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            grad = unit.grad[lo:hi]
            # clip_grad_norm_ multiplies every gradient by min(1, max_norm / (norm + 1e-6)); so does this,
            # in place, so the host keeps the clipped gradient as torch does. (The fused kernel's own
            # grad_scale divides in a separate, slower pass.)
            if widen:
                if self._scratch is None or self._scratch.numel() < hi - lo:
                    self._scratch = torch.empty(self.chunk, dtype=unit.master.dtype)
                wide = self._scratch[: hi - lo]
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
                unit.wire[lo:hi].copy_(unit.master[lo:hi])
