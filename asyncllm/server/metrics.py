"""Prometheus metrics of the server (``GET /metrics``), named after vLLM's.

Histograms and request counters are observed by the server as its requests run; the engine
gauges and counters are read from :meth:`AsyncEngine.stats` at each scrape. Every series
carries a ``model_name`` label.

What counts as one request: one prompt with its ``n`` parallel samples (an HTTP call with a
list of prompts is one request per prompt, as in vLLM, whose batched completions are one
engine request per prompt). Request-level metrics count each request once, whatever its
``n``; token counters add what was computed: the prompt once (its samples share its KV
blocks), generated tokens over all samples, so ``prompt_tokens_total`` and
``generation_tokens_total`` grow by the response's ``usage.prompt_tokens`` and
``usage.completion_tokens``. (vLLM records ``request_params_n`` once per parent request
the same way; its v1 engine counts each sample as a child request in most other metrics,
which this server does not, so that its counters agree with ``usage``.)

Histograms, observed once per finished request: ``asyncllm:time_to_first_token_seconds``
(arrival to the first token of any sample), ``asyncllm:request_queue_time_seconds`` (arrival
to first scheduled), ``asyncllm:e2e_request_latency_seconds`` (arrival to the last sample's
finish), ``asyncllm:request_prompt_tokens`` (the prompt's tokens),
``asyncllm:request_generation_tokens`` (summed over the samples) and
``asyncllm:request_params_n`` (``n``). Per sample: ``asyncllm:inter_token_latency_seconds``
(between consecutive tokens of one sample).

Counters: ``asyncllm:prompt_tokens_total`` (prompt tokens, once per request, counted when its
first output shows the prefill done), ``asyncllm:generation_tokens_total`` (every generated
token of every sample, as it streams), ``asyncllm:request_success_total`` (once per request,
by ``finished_reason``: stop, length, timeout, abort: the client went away, error: the engine
failed; a request whose samples ended differently is counted under the least successful
reason, in that order; a request that failed before its first output, refused by the
engine, is not counted),
and from the engine ``asyncllm:prefix_cache_queries_total`` and
``asyncllm:prefix_cache_hits_total`` (prompt tokens looked up / served from the prefix cache),
``asyncllm:prefix_cache_host_hits_total`` (of those hits, the tokens swapped in from the host
tier), ``asyncllm:num_preemptions_total``, ``asyncllm:spec_decode_num_draft_tokens_total`` and
``asyncllm:spec_decode_num_accepted_tokens_total`` (speculative decoding's proposals and
those accepted; zero while ``EngineConfig.speculative_tokens`` is 0).

Gauges, from the engine: ``asyncllm:num_requests_running``, ``asyncllm:num_requests_waiting``
(preempted requests included; these two count samples, each of which the scheduler runs as a
sequence), ``asyncllm:kv_cache_usage_perc`` and ``asyncllm:cpu_offload_usage_perc``
(fractions of blocks in use, 1 = 100%), ``asyncllm:prefix_cache_hit_rate`` (hits / queries
since start), and ``asyncllm:compiled_forward_state{state=...}``: 1 for the compiled
forward's current state (``off``; ``compiling``, steps eager meanwhile; ``ready``, steps
compiled; ``failed``, eager for good), 0 for the other three (see tuning.md, "Compiled
forward").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
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
_N_BUCKETS = (1, 2, 5, 10, 20, 50, 100)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


def _cpu_offload_usage(s: Mapping[str, Any]) -> float:
    total = s.get("num_total_cpu_blocks", 0)
    return 1.0 - s["num_free_cpu_blocks"] / total if total else 0.0


#: The metrics read from ``AsyncEngine.stats()`` at each scrape: (kind, name without the
#: ``asyncllm:`` prefix, help, the stats key or a function of the stats).
_ENGINE_METRICS: tuple[tuple[str, str, str, str | Callable[[Mapping[str, Any]], float]], ...] = (
    ("gauge", "num_requests_running", "Requests in the running batch.", "num_running"),
    ("gauge", "num_requests_waiting",
     "Requests waiting to be scheduled (preempted ones included).", "num_waiting"),
    ("gauge", "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%).",
     "kv_cache_usage"),
    ("gauge", "cpu_offload_usage_perc",
     "Fraction of the CPU offload block pool in use (1 = 100%).", _cpu_offload_usage),
    ("counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("counter", "prefix_cache_hits", "Prompt tokens served from the prefix cache.",
     "prefix_cache_hits"),
    ("counter", "prefix_cache_host_hits",
     "Prompt tokens of prefix cache hits swapped in from the host tier.",
     "prefix_cache_host_hits"),
    ("gauge", "prefix_cache_hit_rate", "Prefix cache hits / queries since start.",
     "prefix_cache_hit_rate"),
    ("counter", "num_preemptions", "Preemptions of running requests.", "num_preemptions"),
    ("counter", "spec_decode_num_draft_tokens",
     "Speculative decoding: tokens proposed (n-gram).", "spec_num_draft_tokens"),
    ("counter", "spec_decode_num_accepted_tokens",
     "Speculative decoding: proposed tokens accepted.", "spec_num_accepted_tokens"),
)  # fmt: skip

_FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}

#: ``stats()["compile"]``'s values (:attr:`asyncllm.worker.compiled.CompiledForward.state`,
#: or "off"): one series each, 1 for the current one (Prometheus' state-set pattern; over
#: Ray Serve replicas, the number in each).
_COMPILE_STATES = ("off", "compiling", "ready", "failed")


class _EngineCollector(Collector):
    """Yields :data:`_ENGINE_METRICS` from one ``stats()`` call per scrape."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        for kind, name, doc, source in _ENGINE_METRICS:
            family = _FAMILIES[kind](f"asyncllm:{name}", doc, labels=["model_name"])
            family.add_metric([self._model], s[source] if isinstance(source, str) else source(s))
            yield family
        # Whether steps run the compiled forward yet: it builds for about a minute after a
        # first start, and a failed one leaves the engine eager with only a log warning.
        # One engine's stats name its state; a Ray Serve ingress's count its replicas' states.
        compile_state = s.get("compile", "off")
        counts = compile_state if isinstance(compile_state, dict) else {compile_state: 1}
        state = GaugeMetricFamily(
            "asyncllm:compiled_forward_state",
            "The compiled forward (EngineConfig.compile): engines in each state (off; "
            "compiling, steps eager meanwhile; ready, steps compiled; failed, eager for "
            "good): 1 or 0 for one engine, a count over Ray Serve replicas.",
            labels=["model_name", "state"],
        )
        for name in _COMPILE_STATES:
            state.add_metric([self._model, name], float(counts.get(name, 0)))
        yield state


#: The histograms the server observes: (attribute of :class:`ServerMetrics`, name without
#: the ``asyncllm:`` prefix, help, buckets).
_HISTOGRAMS = (
    ("ttft", "time_to_first_token_seconds",
     "Time from arrival to the first generated token (of any sample).", _LATENCY_BUCKETS),
    ("itl", "inter_token_latency_seconds",
     "Time between consecutive generated tokens of one sample.", _ITL_BUCKETS),
    ("queue_time", "request_queue_time_seconds",
     "Time from arrival to first being scheduled (of any sample).", _LATENCY_BUCKETS),
    ("e2e", "e2e_request_latency_seconds",
     "Time from arrival to finish (of the last sample).", _E2E_BUCKETS),
    ("prompt_hist", "request_prompt_tokens",
     "Prompt tokens per finished request (once, whatever its n).", _TOKEN_BUCKETS),
    ("gen_hist", "request_generation_tokens",
     "Generated tokens per finished request (summed over its n samples).", _TOKEN_BUCKETS),
    ("params_n", "request_params_n",
     "The n parameter (parallel samples) of finished requests.", _N_BUCKETS),
)  # fmt: skip

#: The token counters: (attribute, name without prefix and ``_total``, help).
_COUNTERS = (
    ("prompt_tokens", "prompt_tokens",
     "Prompt tokens prefilled (once per request, whatever its n)."),
    ("generation_tokens", "generation_tokens", "Generated tokens (all samples)."),
)  # fmt: skip


class ServerMetrics:
    """The server's Prometheus registry (one per app, so several apps can share a process).

    Its histograms (:data:`_HISTOGRAMS`) and token counters (:data:`_COUNTERS`) are
    attributes of the names in those tables, each already labelled with ``model_name``.

    Args:
        engine: the :class:`AsyncEngine` whose ``stats()`` a scrape reads.
        model_name: the ``model_name`` label.
    """

    ttft: Histogram
    itl: Histogram
    queue_time: Histogram
    e2e: Histogram
    prompt_hist: Histogram
    gen_hist: Histogram
    params_n: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter

    def __init__(self, engine: Any, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        lab = ["model_name"]
        for attr, name, doc, buckets in _HISTOGRAMS:
            hist = Histogram(f"asyncllm:{name}", doc, lab, registry=r, buckets=buckets)
            setattr(self, attr, hist.labels(model_name))
        for attr, name, doc in _COUNTERS:
            setattr(
                self, attr, Counter(f"asyncllm:{name}", doc, lab, registry=r).labels(model_name)
            )
        self._success = Counter(
            "asyncllm:request_success",
            "Requests ended (once per request, whatever its n), by finish reason "
            "(abort: the client went away; error: the engine failed).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        r.register(_EngineCollector(engine, model_name))

    def request_ended(self, reason: str) -> None:
        """Count a request that ended with ``reason`` ("stop", "length", "abort"...)."""
        self._success.labels(self.model_name, reason).inc()

    def tracker(self, n: int = 1) -> RequestTracker:
        """A tracker for one engine request with ``n`` parallel samples."""
        return RequestTracker(self, n)

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


#: Finish reasons from most to least successful; a request with n samples is counted under
#: the least successful reason any of its samples ended with.
_REASON_ORDER = ("stop", "length", "timeout", "abort", "error")


def request_finish_reason(reasons: Iterable[str]) -> str:
    """The ``finished_reason`` label of a request whose samples ended with ``reasons``: the
    least successful of them (stop < length < timeout < abort < error; unknown reasons rank
    last)."""
    rank = {r: i for i, r in enumerate(_REASON_ORDER)}
    return max(reasons, key=lambda r: rank.get(r, len(_REASON_ORDER)))


class RequestTracker:
    """Observes one engine request: one prompt and its ``n`` parallel samples, whose delta
    outputs (tagged with ``RequestOutput.index``) interleave.

    Per request (once, however large ``n``): ``request_success_total``, ``prompt_tokens_total``
    (when the first output shows the prefill done), the histograms of prompt tokens, of
    generation tokens (summed over samples), of ``n``, TTFT (first token of any sample),
    queue time (first sample scheduled) and end-to-end latency (last sample finished). Per
    sample: ``generation_tokens_total`` (every token) and inter-token latency (between
    consecutive tokens of one sample).

    Args:
        metrics: the registry's metrics.
        n: the request's number of parallel samples.
    """

    def __init__(self, metrics: ServerMetrics, n: int = 1) -> None:
        self._m = metrics
        self._n = n
        self._last: dict[int, float] = {}  # sample index -> time of its last token
        self._finals: dict[int, RequestOutput] = {}  # sample index -> its last item
        self._started = False
        self.finished = False

    def on_output(self, out: RequestOutput) -> None:
        """Record the tokens of one delta item (and, once every sample has ended, the
        request's metrics)."""
        now = time.monotonic()
        if not self._started:  # the prompt was prefilled once for all samples
            self._started = True
            self._m.prompt_tokens.inc(out.num_prompt_tokens)
        k = len(out.token_ids)
        if k:
            self._m.generation_tokens.inc(k)
            last = self._last.get(out.index)
            if last is not None:
                gap = (now - last) / k
                for _ in range(k):
                    self._m.itl.observe(gap)
            self._last[out.index] = now
        if not out.finished or self.finished:
            return
        self._finals[out.index] = out
        if len(self._finals) < self._n:
            return
        self.finished = True
        finals = list(self._finals.values())
        self._m.request_ended(request_finish_reason(o.finish_reason or "abort" for o in finals))
        ms = [o.metrics for o in finals if o.metrics is not None]
        if not ms:
            return
        ttfts = [m.ttft for m in ms if m.ttft is not None]
        if ttfts:
            self._m.ttft.observe(min(ttfts))
        queue_times = [m.queue_time for m in ms if m.queue_time is not None]
        if queue_times:
            self._m.queue_time.observe(min(queue_times))
        self._m.e2e.observe(max(m.e2e_latency for m in ms))
        self._m.prompt_hist.observe(ms[0].num_prompt_tokens)
        self._m.gen_hist.observe(sum(m.num_generated_tokens for m in ms))
        self._m.params_n.observe(self._n)

    def on_close(self, error: BaseException | None = None) -> None:
        """The stream ended (``error``: what it raised). A request that has not ended every
        sample is counted once: "abort" when the stream was closed (the client went away),
        "error" when it failed after its first output; one that failed before any output
        (refused: bad input, a full queue, a dead engine) is not counted."""
        if self.finished:
            return
        self.finished = True
        if error is None:
            self._m.request_ended("abort")
        elif self._started:
            self._m.request_ended("error")
