"""Prometheus metrics of one gateway.

The request path only bumps plain integers (a few nanoseconds each, no locks);
``prometheus_client`` builds the exposition from them when ``/metrics`` is scraped.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                    300, 900)
#: The per-turn timing histograms (``ares_gateway_turn_<name>_seconds``) and their help.
_TIMINGS = {
    "parked": "Time a recorded turn's request waited before the policy took it",
    "policy": "Time from the policy taking a recorded turn's request to its answer's end",
    "ttft": "Time from a streamed turn's request to the first piece of its answer",
}


def _histogram(name: str, doc: str, counts: list[int], total: float) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, count in zip((*_LATENCY_BUCKETS, float("inf")), counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class GatewayMetrics:
    """Counters for parked / answered / timed-out / withdrawn / rejected requests and answer latency."""

    def __init__(self) -> None:
        self.parked_total = 0
        self.answered_total = 0
        self.timed_out_total = 0
        self.withdrawn_total = 0
        self.rejected_by_status: dict[int, int] = {}
        self._bucket_counts = [0] * (len(_LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self._parked_now = 0
        #: Reads the data dir's count of turns whose record was lost (set by the gateway with its store).
        self.turns_lost: Callable[[], int] = lambda: 0
        # The weight-update fence: pauses that returned, resumes, the seconds spent draining and paused.
        self.fence_pauses_total = 0
        self.fence_resumes_total = 0
        self.fence_drain_seconds_total = 0.0
        self.fence_last_drain_seconds = 0.0
        self.fence_paused_seconds_total = 0.0
        self._drain_buckets = [0] * (len(_LATENCY_BUCKETS) + 1)
        #: Whether sampling is paused now (read when scraped; set by the gateway with its fence).
        self.fence_paused_now: Callable[[], bool] = lambda: False
        #: Reads the body bytes parked (or being read) now, every session's (set by the gateway).
        self.parked_bytes_now: Callable[[], int] = lambda: 0
        # Per recorded turn: seconds parked before the policy took it, seconds the policy took, time to a
        # streamed answer's first piece (each: bucket counts and sum), and the tokens that were counted.
        self._timing = {name: ([0] * (len(_LATENCY_BUCKETS) + 1), [0.0]) for name in _TIMINGS}
        self.prompt_tokens_total = 0
        self.completion_tokens_total = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]

    def parked(self) -> None:
        self.parked_total += 1

    def answered(self, latency: float) -> None:
        self.answered_total += 1
        self._latency_sum += latency
        self._bucket_counts[bisect_left(_LATENCY_BUCKETS, latency)] += 1

    def turn(self, *, parked: float | None, policy: float | None, ttft: float | None,
             prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """One recorded turn's timing and token counts (``None``: not known, not counted)."""
        for name, value in (("parked", parked), ("policy", policy), ("ttft", ttft)):
            if value is not None:
                counts, total = self._timing[name]
                counts[bisect_left(_LATENCY_BUCKETS, value)] += 1
                total[0] += value
        if prompt_tokens is not None:
            self.prompt_tokens_total += prompt_tokens
        if completion_tokens is not None:
            self.completion_tokens_total += completion_tokens

    def timed_out(self) -> None:
        self.timed_out_total += 1

    def withdrawn(self) -> None:
        self.withdrawn_total += 1

    def fence_paused(self, drain_seconds: float) -> None:
        self.fence_pauses_total += 1
        self.fence_drain_seconds_total += drain_seconds
        self.fence_last_drain_seconds = drain_seconds
        self._drain_buckets[bisect_left(_LATENCY_BUCKETS, drain_seconds)] += 1

    def fence_resumed(self, paused_seconds: float) -> None:
        self.fence_resumes_total += 1
        self.fence_paused_seconds_total += paused_seconds

    def rejected(self, status: int) -> None:
        self.rejected_by_status[status] = self.rejected_by_status.get(status, 0) + 1

    def collect(self) -> Iterator[Metric]:
        """The prometheus_client collector protocol."""
        yield CounterMetricFamily("ares_gateway_requests_parked", "Agent requests parked",
                                  value=self.parked_total)
        yield CounterMetricFamily(
            "ares_gateway_requests_answered", "Requests answered by the policy", value=self.answered_total
        )
        yield CounterMetricFamily(
            "ares_gateway_requests_timed_out", "Requests that timed out unanswered",
            value=self.timed_out_total
        )
        yield CounterMetricFamily(
            "ares_gateway_requests_withdrawn",
            "Requests withdrawn because the agent disconnected",
            value=self.withdrawn_total,
        )
        rejected = CounterMetricFamily(
            "ares_gateway_requests_rejected", "Agent requests rejected before parking", labels=["status"]
        )
        for status, count in sorted(self.rejected_by_status.items()):
            rejected.add_metric([str(status)], count)
        yield rejected
        yield CounterMetricFamily(
            "ares_gateway_turns_lost",
            "Answered turns whose record did not reach the data dir (a full disk, an I/O error, an "
            "unencodable body)", value=self.turns_lost(),
        )
        yield GaugeMetricFamily("ares_gateway_requests_parked_now", "Requests parked right now",
                                value=self._parked_now)
        yield GaugeMetricFamily("ares_gateway_parked_bytes_now",
                                "Body bytes of requests parked or being read right now, every "
                                "session's together", value=self.parked_bytes_now())
        cumulative, buckets = 0, []
        for bound, count in zip((*_LATENCY_BUCKETS, float("inf")), self._bucket_counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        yield HistogramMetricFamily(
            "ares_gateway_answer_latency_seconds",
            "Time from parking a request to its answer",
            buckets=buckets,
            sum_value=self._latency_sum,
        )

        for name, (counts, total) in self._timing.items():
            yield _histogram(f"ares_gateway_turn_{name}_seconds", _TIMINGS[name], counts, total[0])
        yield CounterMetricFamily("ares_gateway_turn_prompt_tokens",
                                  "Prompt tokens of recorded turns (token records, else the upstream's "
                                  "usage)", value=self.prompt_tokens_total)
        yield CounterMetricFamily("ares_gateway_turn_completion_tokens",
                                  "Completion tokens of recorded turns (token records, else the "
                                  "upstream's usage)", value=self.completion_tokens_total)

        yield CounterMetricFamily("ares_gateway_fence_pauses", "Weight-update pauses that returned (drained)",
                                  value=self.fence_pauses_total)
        yield CounterMetricFamily("ares_gateway_fence_paused_seconds",
                                  "Seconds sampling was paused for weight updates, over every resumed pause",
                                  value=self.fence_paused_seconds_total)
        yield GaugeMetricFamily("ares_gateway_fence_paused_now",
                                "1 while sampling is paused for a weight update",
                                value=1 if self.fence_paused_now() else 0)
        yield GaugeMetricFamily("ares_gateway_fence_last_drain_seconds",
                                "Seconds the last weight-update pause waited for the generations in flight",
                                value=self.fence_last_drain_seconds)
        cumulative, buckets = 0, []
        for bound, count in zip((*_LATENCY_BUCKETS, float("inf")), self._drain_buckets, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        yield HistogramMetricFamily(
            "ares_gateway_fence_drain_seconds",
            "Time a weight-update pause waited for the generations in flight",
            buckets=buckets,
            sum_value=self.fence_drain_seconds_total,
        )

    def render(self, parked_now: int) -> bytes:
        self._parked_now = parked_now
        return generate_latest(self.registry)
