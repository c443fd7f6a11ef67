"""A named handshake between two threads, one per direction of the engine's overlap.

The optimizer thread and the training thread meet at two fences:
- ``updates``: the optimizer marks a trained unit each time an update of it is committed (its new weights
  are on the host wire); the training thread waits for the version a step needs before it streams the unit.
- ``grads``: the training thread marks a trained unit when its gradient of the step has been sent to the
  host (with the CUDA event that says the copy landed and the partial gradient norm up to it); the
  optimizer waits for it before a speculative update of that unit.

Reading ``Engine.train_step`` with this in mind shows who waits on whom; no callbacks are wired between
the two sides.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class Fence:
    def __init__(self, n: int, name: str):
        self.name = name
        self._version = [0] * n
        self._payload: list[Any] = [None] * n
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self.waited_s = 0.0  # time callers of wait() spent blocked, summed

    def version(self, u: int) -> int:
        with self._cv:
            return self._version[u]

    def mark(self, u: int, payload: Any = None) -> None:
        """Unit u has one more version; payload travels with it to the waiter."""
        with self._cv:
            self._version[u] += 1
            self._payload[u] = payload
            self._cv.notify_all()

    def wait(self, u: int, version: int) -> Any:
        """Block until unit u has reached ``version``; the payload of its last mark. Raises the error of a
        failed producer instead of waiting for ever."""
        with self._cv:
            if self._version[u] < version and self._error is None:
                t0 = time.perf_counter()
                self._cv.wait_for(lambda: self._version[u] >= version or self._error is not None)
                self.waited_s += time.perf_counter() - t0
            if self._version[u] < version and self._error is not None:
                raise self._error
            return self._payload[u]

    def fail(self, error: BaseException) -> None:
        """The producer cannot go on: every present and future wait that is not met raises ``error``."""
        with self._cv:
            self._error = error
            self._cv.notify_all()

    def reset(self, versions: list[int]) -> None:
        """Start over from known versions (after a failed step, or a state loaded from disk)."""
        with self._cv:
            self._version = list(versions)
            self._payload = [None] * len(versions)
            self._error = None
            self._cv.notify_all()
