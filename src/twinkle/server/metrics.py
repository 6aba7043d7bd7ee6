"""``ServerMetrics``: what the server tells its operator and each tenant about load (the routes
that show it are ``twinkle.server.routes.metrics``).

- ``GET /metrics``: Prometheus' text format, for the operator only. It answers 404 unless the
  server was started with operator keys (``--operator-keys FILE`` or ``$TWINKLE_OPERATOR_KEYS``),
  and 401 without one of them (``Authorization: Bearer KEY``, as Prometheus' scrape config sends
  it, or ``X-API-Key: KEY``). Its figures are the server's totals, never labelled by tenant: queue
  depth per lane, request latency histograms per lane (queued to answered), requests by outcome,
  tokens trained and sampled (a counter: ``rate(twinkle_server_tokens_total[1m])`` is tokens/s),
  adapter slots in use, live and parked runs.
- ``GET /api/v1/usage``: a tenant's own figures (its key): requests waiting or running, its live
  and parked runs, its requests and tokens so far, and its limits.

The figures live in a ``CollectorRegistry`` of the app's own, so two servers in one process (the
tests) keep theirs apart."""

import collections
import threading
from typing import Any

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)


class ServerMetrics:
    """The server's counters (updated by the queue's worker and the routes), and per-tenant tallies."""

    def __init__(self, server: Any):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.server = server
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "twinkle_server_request_seconds",
            "Seconds from a queued request's arrival to its answer, by lane",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "twinkle_server_requests",
            "Queued requests answered, by lane and outcome",
            ["lane", "outcome"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "twinkle_server_tokens",
            "Tokens trained (forward_backward) and sampled",
            ["kind"],
            registry=self.registry,
        )
        depth = Gauge(
            "twinkle_server_queue_depth",
            "Requests waiting or under way, by lane",
            ["lane"],
            registry=self.registry,
        )
        for lane in ("train", "sample"):
            depth.labels(lane).set_function(lambda lane=lane: server.queue.depth(lane=lane))
        slots = Gauge(
            "twinkle_server_adapter_slots", "Adapter slots on the model", ["state"], registry=self.registry
        )
        slots.labels("used").set_function(lambda: len(server.engine.in_use))
        slots.labels("total").set_function(lambda: server.config.max_loras)
        runs = Gauge("twinkle_server_runs", "Training runs by state", ["state"], registry=self.registry)
        runs.labels("live").set_function(lambda: self._runs()[0])
        runs.labels("parked").set_function(lambda: self._runs()[1])
        self.lock = threading.Lock()
        self.per_tenant: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def _runs(self) -> tuple[int, int]:
        runs = self.server.registry.runs_of()
        return sum(r.live for r in runs), sum(not r.live and r.parked is not None for r in runs)

    def done(self, tenant: str, lane: str, seconds: float, ok: bool) -> None:
        self.latency.labels(lane).observe(seconds)
        self.requests.labels(lane, "ok" if ok else "error").inc()
        with self.lock:
            self.per_tenant[tenant][f"{lane}_requests"] += 1

    def counted(self, tenant: str, kind: str, tokens: int) -> None:
        """``tokens`` trained (``kind`` "trained") or sampled ("sampled") for ``tenant``."""
        self.tokens.labels(kind).inc(tokens)
        with self.lock:
            self.per_tenant[tenant][f"tokens_{kind}"] += tokens

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
