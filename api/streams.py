"""Server-sent event streams of jobs: one follower per job, whatever the number of streams open on it.

A stream no longer asks the coordinator for its job's events itself. The first stream of a job starts a
`Feed`: one task that polls the coordinator for the job's new events (every ``sse_poll_s``; for its status
only when nothing happened) and wakes every stream of that job. A thousand streams on one job cost the
coordinator what one does. The feeds make their coordinator calls on threads of their own
(``stream_poll_threads``), so that however many streams are open, requests keep the server's threads.

A feed keeps the events it fetched (the newest ``FEED_WINDOW``); a stream that starts before them (an older
Last-Event-ID) reads that gap from the coordinator once. A feed stops when its last stream closes.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request

from api.schemas import event_object
from horizon_ray.cluster.client import CoordinatorClient
from horizon_ray.cluster.errors import HorizonError
from horizon_ray.cluster.messages import JobEvent, JobStatus

log = logging.getLogger("api")

FEED_WINDOW = 4096  # events a feed keeps for streams that fall behind or join late
FEED_IDLE_POLL_S = 1.0  # the longest pause of a feed between two polls of a quiet job
STATUS_EVERY_S = 1.0  # how often a feed of a quiet job asks whether it ended
_DISCONNECT_CHECK_S = 1.0  # how often a waiting stream asks whether its client is still there


@dataclass
class Feed:
    """The follower of one job: what it has fetched, and the signal that wakes the job's streams."""

    tenant: str
    job_id: str
    last_seq: int  # newest seq fetched (the feed asks for events after it)
    events: list[JobEvent] = field(default_factory=list)  # fetched events, oldest first (at most FEED_WINDOW)
    status: JobStatus | None = None  # the job's status once it is terminal and every event is fetched
    failed: HorizonError | None = None  # the coordinator refused or did not answer: the streams end
    readers: int = 0  # streams open on it
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # replaced after each wake-up
    task: asyncio.Task | None = None

    @property
    def first_seq(self) -> int:
        """Every event with a seq above this is in `events` (or not yet fetched)."""
        return self.events[0].seq - 1 if self.events else self.last_seq

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class EventHub:
    """The feeds of one app, by (tenant, job)."""

    def __init__(self, client: CoordinatorClient, *, poll_s: float, threads: int):
        self.client = client
        self.poll_s = poll_s
        self._limiter = anyio.CapacityLimiter(threads)
        self._feeds: dict[tuple[str, str], Feed] = {}

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A coordinator call on the feeds' own threads."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def feeds(self) -> int:
        return len(self._feeds)

    async def stream(self, request: Request, tenant: str, job_id: str, after: int,
                     heartbeat_s: float) -> AsyncIterator[str]:
        """The SSE text of a job's events with seq > `after` (at most the job's newest seq), then an `end` event
        once the job is terminal and all were sent."""
        key = (tenant, job_id)
        feed = self._feeds.get(key)
        if feed is None:
            feed = self._feeds[key] = Feed(tenant, job_id, last_seq=after)
            feed.task = asyncio.create_task(self._follow(feed), name=f"feed-{job_id}")
        feed.readers += 1
        last = after
        try:
            yield "retry: 2000\n\n"
            idle = 0.0
            while True:
                if last < feed.first_seq:  # joined before the feed's window, or fell behind it
                    gap = await self.call(self.client.events, tenant, job_id, last)
                    for event in gap:
                        if event.seq > feed.first_seq:
                            break
                        yield sse_message(event)
                        last = event.seq
                    if last < feed.first_seq:  # the coordinator has no more of the gap: skip to the window
                        last = feed.first_seq
                    continue
                fresh = feed.events[bisect.bisect_right(feed.events, last, key=_seq):]
                if fresh:
                    for event in fresh:
                        yield sse_message(event)
                    last = fresh[-1].seq
                    idle = 0.0
                    continue
                if feed.status is not None:
                    end = {"job_id": job_id, "status": feed.status.value, "last_seq": last}
                    yield f"event: end\ndata: {json.dumps(end)}\n\n"
                    return
                if feed.failed is not None:
                    # The response has started: no status code can change now. The client reconnects with
                    # Last-Event-ID and gets the JSON error then.
                    return
                changed = feed.changed
                with anyio.move_on_after(_DISCONNECT_CHECK_S):
                    await changed.wait()
                if changed.is_set():
                    continue
                # Under ASGI 2.4 servers Starlette stops watching for the client leaving, and a quiet stream
                # writes nothing that could fail: ask.
                if await request.is_disconnected():
                    return
                idle += _DISCONNECT_CHECK_S
                if idle >= heartbeat_s:
                    idle = 0.0
                    yield ": keep-alive\n\n"
        finally:
            feed.readers -= 1
            if feed.readers == 0 and self._feeds.get(key) is feed:
                del self._feeds[key]
                if feed.task is not None:
                    feed.task.cancel()

    async def _follow(self, feed: Feed) -> None:
        """Poll the coordinator for the feed's job until it is terminal or nobody reads it."""
        pause, asked = self.poll_s, 0.0
        try:
            while feed.readers > 0:
                events = await self.call(self.client.events, feed.tenant, feed.job_id, feed.last_seq)
                self._add(feed, events)
                if events:
                    pause = self.poll_s
                else:
                    pause = min(FEED_IDLE_POLL_S, max(pause * 2, self.poll_s))
                    now = time.monotonic()
                    if now - asked >= STATUS_EVERY_S:
                        asked = now
                        record = await self.call(self.client.get, feed.tenant, feed.job_id)
                        if record.status.is_terminal():
                            # the events of its last moments, then the end
                            self._add(feed, await self.call(self.client.events, feed.tenant, feed.job_id,
                                                            feed.last_seq))
                            feed.status = record.status
                            feed.wake()
                            return
                await anyio.sleep(pause)
        except HorizonError as exc:
            log.warning("event feed of %s ended early: %s", feed.job_id, exc.message)
            feed.failed = exc
            feed.wake()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a feed that dies must still end its streams
            log.exception("event feed of %s failed", feed.job_id)
            feed.failed = HorizonError(f"{type(exc).__name__}")
            feed.wake()
        finally:
            if feed.status is None and feed.failed is None:
                feed.failed = HorizonError("the feed stopped")

    @staticmethod
    def _add(feed: Feed, events: list[JobEvent]) -> None:
        if not events:
            return
        feed.events.extend(events)
        del feed.events[:-FEED_WINDOW]
        feed.last_seq = events[-1].seq
        feed.wake()


def _seq(event: JobEvent) -> int:
    return event.seq


def sse_message(event: JobEvent) -> str:
    data = json.dumps(event_object(event).model_dump(), separators=(",", ":"))
    return f"id: {event.seq}\nevent: {event.type.value}\ndata: {data}\n\n"
