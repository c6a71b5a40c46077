"""Prometheus metrics of the server (``GET /metrics``), named after vLLM's.

Histograms and request counters are observed by the server as its requests run; the engine
gauges and counters are read from :meth:`AsyncEngine.stats` at each scrape. Every series
carries a ``model_name`` label.

Histograms (finished requests): ``asyncllm:time_to_first_token_seconds`` (arrival to first
token), ``asyncllm:inter_token_latency_seconds`` (between consecutive tokens of a request),
``asyncllm:request_queue_time_seconds`` (arrival to first scheduled),
``asyncllm:e2e_request_latency_seconds`` (arrival to finish),
``asyncllm:request_prompt_tokens`` and ``asyncllm:request_generation_tokens``.

Counters: ``asyncllm:prompt_tokens_total``, ``asyncllm:generation_tokens_total``,
``asyncllm:request_success_total`` (by ``finished_reason``: stop, length, abort: the client
went away), and from the engine ``asyncllm:prefix_cache_queries_total`` and
``asyncllm:prefix_cache_hits_total`` (prompt tokens looked up / served from the prefix cache),
``asyncllm:num_preemptions_total``.

Gauges, from the engine: ``asyncllm:num_requests_running``, ``asyncllm:num_requests_waiting``
(preempted requests included), ``asyncllm:kv_cache_usage_perc`` and
``asyncllm:cpu_offload_usage_perc`` (fractions of blocks in use, 1 = 100%),
``asyncllm:prefix_cache_hit_rate`` (hits / queries since start).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from asyncllm.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class _EngineCollector(Collector):
    def __init__(self, engine: Any, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        labels = ["model_name"]
        value = [self._model]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"asyncllm:{name}", doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"asyncllm:{name}", doc, labels=labels)
            c.add_metric(value, v)
            return c

        total_cpu = s.get("num_total_cpu_blocks", 0)
        yield gauge("num_requests_running", "Requests in the running batch.", s["num_running"])
        yield gauge(
            "num_requests_waiting",
            "Requests waiting to be scheduled (preempted ones included).",
            s["num_waiting"],
        )
        yield gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%).",
            s["kv_cache_usage"],
        )  # fmt: skip
        yield gauge(
            "cpu_offload_usage_perc",
            "Fraction of the CPU offload block pool in use (1 = 100%).",
            1.0 - s["num_free_cpu_blocks"] / total_cpu if total_cpu else 0.0,
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s["prefix_cache_queries"],
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens served from the prefix cache.",
            s["prefix_cache_hits"],
        )  # fmt: skip
        yield gauge(
            "prefix_cache_hit_rate", "Prefix cache hits / queries since start.",
            s["prefix_cache_hit_rate"],
        )  # fmt: skip
        yield counter("num_preemptions", "Preemptions of running requests.", s["num_preemptions"])


class ServerMetrics:
    """The server's Prometheus registry (one per app, so several apps can share a process).

    Args:
        engine: the :class:`AsyncEngine` whose ``stats()`` a scrape reads.
        model_name: the ``model_name`` label.
    """

    def __init__(self, engine: Any, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        lab = ["model_name"]
        self.ttft = Histogram(
            "asyncllm:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            lab, registry=r, buckets=_LATENCY_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.itl = Histogram(
            "asyncllm:inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            lab, registry=r, buckets=_ITL_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.queue_time = Histogram(
            "asyncllm:request_queue_time_seconds",
            "Time from arrival to first being scheduled.",
            lab, registry=r, buckets=_LATENCY_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.e2e = Histogram(
            "asyncllm:e2e_request_latency_seconds",
            "Time from arrival to finish.",
            lab, registry=r, buckets=_E2E_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.prompt_hist = Histogram(
            "asyncllm:request_prompt_tokens",
            "Prompt tokens per finished request.",
            lab, registry=r, buckets=_TOKEN_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.gen_hist = Histogram(
            "asyncllm:request_generation_tokens",
            "Generated tokens per finished request.",
            lab, registry=r, buckets=_TOKEN_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.prompt_tokens = Counter(
            "asyncllm:prompt_tokens", "Prompt tokens of finished requests.", lab, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "asyncllm:generation_tokens", "Generated tokens.", lab, registry=r
        ).labels(model_name)
        self._success = Counter(
            "asyncllm:request_success",
            "Requests ended, by finish reason (abort: the client went away).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        r.register(_EngineCollector(engine, model_name))

    def request_ended(self, reason: str) -> None:
        """Count a request that ended with ``reason`` ("stop", "length", "abort"...)."""
        self._success.labels(self.model_name, reason).inc()

    def tracker(self) -> RequestTracker:
        """A tracker for one engine request."""
        return RequestTracker(self)

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


class RequestTracker:
    """Observes one request's stream of delta outputs."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._last: float | None = None
        self.finished = False

    def on_output(self, out: RequestOutput) -> None:
        """Record the tokens of one delta item (and, on the last, the request's metrics)."""
        now = time.monotonic()
        k = len(out.token_ids)
        if k:
            self._m.generation_tokens.inc(k)
            if self._last is not None:
                gap = (now - self._last) / k
                for _ in range(k):
                    self._m.itl.observe(gap)
            self._last = now
        if not out.finished:
            return
        self.finished = True
        self._m.request_ended(out.finish_reason or "abort")
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self._m.ttft.observe(m.ttft)
        if m.queue_time is not None:
            self._m.queue_time.observe(m.queue_time)
        self._m.e2e.observe(m.e2e_latency)
        self._m.prompt_hist.observe(m.num_prompt_tokens)
        self._m.gen_hist.observe(m.num_generated_tokens)
        self._m.prompt_tokens.inc(m.num_prompt_tokens)

    def on_close(self) -> None:
        """The stream ended without its last item (the client went away, or an error)."""
        if not self.finished:
            self.finished = True
            self._m.request_ended("abort")
