"""Per-tenant limits of the API process, so that one tenant's load cannot slow the others: a request rate
(a token bucket per tenant), event streams open at once, and uploads in flight. Each refusal is a 429 with
Retry-After (``ApiError``), naming the setting that sets the limit.

The state is this process's: behind several API replicas each enforces its own share.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from api.errors import ApiError
from api.settings import ApiSettings


@dataclass
class _Bucket:
    tokens: float  # requests the tenant may still make at once
    updated: float  # when `tokens` was last refilled (monotonic seconds)


class TenantLimits:
    """The per-tenant counters of one app. Thread-safe (uploads count from worker threads too)."""

    def __init__(self, settings: ApiSettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}
        self._streams: dict[str, int] = {}
        self._uploads: dict[str, int] = {}

    def request(self, tenant: str) -> None:
        """Count one request of `tenant`; 429 when it is over its rate (rate_limit_per_s, burst
        rate_limit_burst). A rate of 0 turns the limit off."""
        rate, burst = self.settings.rate_limit_per_s, self.settings.rate_limit_burst
        if rate <= 0:
            return
        now = self._clock()
        with self._lock:
            b = self._buckets.get(tenant)
            if b is None:
                b = self._buckets[tenant] = _Bucket(tokens=float(burst), updated=now)
            b.tokens = min(float(burst), b.tokens + (now - b.updated) * rate)
            b.updated = now
            if b.tokens >= 1.0:
                b.tokens -= 1.0
                return
            wait = (1.0 - b.tokens) / rate
        raise ApiError(429, "rate_limited",
                       f"tenant {tenant} sends more than {rate:g} requests a second (burst {burst}); retry after "
                       f"{math.ceil(wait)} s (settings rate_limit_per_s, rate_limit_burst)",
                       headers={"Retry-After": str(max(1, math.ceil(wait)))})

    def open_stream(self, tenant: str) -> Callable[[], None]:
        """Admit one more event stream of `tenant` (429 beyond max_streams_per_tenant); returns the call that
        closes it (idempotent)."""
        cap = self.settings.max_streams_per_tenant
        with self._lock:
            held = self._streams.get(tenant, 0)
            if held >= cap:
                raise ApiError(429, "too_many_streams",
                               f"tenant {tenant} has {held} event streams open, its limit "
                               f"(setting max_streams_per_tenant); close one, or poll GET .../events?after=N",
                               headers={"Retry-After": "5"})
            self._streams[tenant] = held + 1
        closed = False

        def close() -> None:
            nonlocal closed
            with self._lock:
                if not closed:
                    closed = True
                    self._streams[tenant] -= 1

        return close

    def streams(self, tenant: str) -> int:
        with self._lock:
            return self._streams.get(tenant, 0)

    @contextmanager
    def upload(self, tenant: str) -> Iterator[None]:
        """Hold one of `tenant`'s upload slots (429 beyond max_uploads_in_flight) while the body streams in."""
        cap = self.settings.max_uploads_in_flight
        with self._lock:
            held = self._uploads.get(tenant, 0)
            if held >= cap:
                raise ApiError(429, "too_many_uploads",
                               f"tenant {tenant} has {held} uploads in flight, its limit (setting "
                               "max_uploads_in_flight); wait for one to finish",
                               headers={"Retry-After": "5"})
            self._uploads[tenant] = held + 1
        try:
            yield
        finally:
            with self._lock:
                self._uploads[tenant] -= 1
