"""Prometheus metrics of the API: request counts and latency by route, plus the coordinator's view of the
cluster (nodes' RAM ledger, jobs waiting), read at scrape time. One registry per app, so several apps in
one process (tests) never collide."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from horizon_ray.cluster.client import CoordinatorClient

log = logging.getLogger("api")


class ApiMetrics:
    def __init__(self, client: CoordinatorClient):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "horizon_api_requests", "HTTP requests answered", ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "horizon_api_request_seconds", "Time to the first byte of the response", ["method", "route"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.registry.register(ClusterCollector(client))


class ClusterCollector(Collector):
    """Gauges of the coordinator's state, collected on each scrape (skipped if it does not answer)."""

    def __init__(self, client: CoordinatorClient):
        self.client = client

    def describe(self):
        return []

    def collect(self):
        try:
            nodes = self.client.nodes()
            waiting = self.client.queue(None)
            ready = bool(self.client.ready())
        except Exception as exc:  # a scrape must not fail because the coordinator is down
            log.warning("metrics: coordinator did not answer: %s", exc)
            up = GaugeMetricFamily("horizon_coordinator_up", "Whether the coordinator answered the scrape")
            up.add_metric([], 0)
            yield up
            return
        up = GaugeMetricFamily("horizon_coordinator_up", "Whether the coordinator answered the scrape")
        up.add_metric([], 1 if ready else 0)
        yield up
        gauges = {
            "ram": GaugeMetricFamily("horizon_node_ram_bytes", "Host RAM a node offers to jobs", labels=["node"]),
            "reserved": GaugeMetricFamily("horizon_node_reserved_bytes", "Host RAM held by a node's ledger",
                                          labels=["node"]),
            "free": GaugeMetricFamily("horizon_node_free_bytes", "Host RAM not held by the ledger",
                                      labels=["node"]),
            "jobs": GaugeMetricFamily("horizon_node_running_jobs", "Reservations in a node's ledger",
                                      labels=["node"]),
            "alive": GaugeMetricFamily("horizon_node_alive", "Whether a node's agent is alive", labels=["node"]),
        }
        for n in nodes:
            gauges["ram"].add_metric([n.node_id], n.ram_bytes)
            gauges["reserved"].add_metric([n.node_id], n.reserved_bytes)
            gauges["free"].add_metric([n.node_id], n.free_bytes)
            gauges["jobs"].add_metric([n.node_id], len(n.ledger))
            gauges["alive"].add_metric([n.node_id], 1 if n.alive else 0)
        yield from gauges.values()
        queue = GaugeMetricFamily("horizon_jobs_waiting", "Jobs waiting for a node, every tenant")
        queue.add_metric([], len(waiting))
        yield queue


class MetricsMiddleware:
    """Counts every HTTP request by method, route template and status, and times it to the first byte."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_timed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.metrics.latency.labels(scope["method"], _route(scope)).observe(time.perf_counter() - start)
            await send(message)

        try:
            await self.app(scope, receive, send_timed)
        finally:
            self.metrics.requests.labels(scope["method"], _route(scope), str(status)).inc()


def _route(scope: Scope) -> str:
    # The router leaves the matched route in the scope; unmatched paths share one label (no cardinality
    # blow-up from scanners).
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
