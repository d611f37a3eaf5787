"""Prometheus metrics of one gateway (a registry per gateway, so several can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)


class GatewayMetrics:
    """Counters for parked / answered / timed-out / withdrawn requests and answer latency."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._parked_total = Counter("ares_gateway_requests_parked", "Agent requests parked", registry=r)
        self._answered = Counter("ares_gateway_requests_answered", "Requests answered by the policy", registry=r)
        self._timed_out = Counter("ares_gateway_requests_timed_out", "Requests that timed out unanswered", registry=r)
        self._withdrawn = Counter(
            "ares_gateway_requests_withdrawn", "Requests withdrawn because the agent disconnected", registry=r
        )
        self._rejected = Counter(
            "ares_gateway_requests_rejected", "Agent requests rejected before parking", ["status"], registry=r
        )
        self.parked_now = Gauge("ares_gateway_requests_parked_now", "Requests parked right now", registry=r)
        self._latency = Histogram(
            "ares_gateway_answer_latency_seconds",
            "Time from parking a request to its answer",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def parked(self) -> None:
        self._parked_total.inc()

    def answered(self, latency: float) -> None:
        self._answered.inc()
        self._latency.observe(latency)

    def timed_out(self) -> None:
        self._timed_out.inc()

    def withdrawn(self) -> None:
        self._withdrawn.inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(status=str(status)).inc()

    def render(self, parked_now: int) -> bytes:
        self.parked_now.set(parked_now)
        return generate_latest(self.registry)
