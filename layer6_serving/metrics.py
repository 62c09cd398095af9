"""Prometheus metrics, vLLM's names under the `llm_stack:` prefix, one label: model_name.

Histograms: time_to_first_token_seconds, inter_token_latency_seconds,
e2e_request_latency_seconds, request_queue_time_seconds. Gauges: num_requests_running,
num_requests_waiting, kv_cache_usage_perc, kv_cache_blocks_used, prefix_cache_hit_rate,
spec_decode_acceptance_rate, engine_up. Counters: prompt_tokens, generation_tokens,
request_success (by finished_reason), num_preemptions, prefix_cache_queries,
prefix_cache_hits, engine_restarts.

Each app has its own registry (several servers may live in one process, as in the tests);
engines report through listener callbacks from their threads (prometheus-client's metric
objects are thread-safe).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .engine_state import EngineSnapshot, FinishedRequest

P = "llm_stack:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0)


class ServingMetrics:
    """The server's metrics; `listener(model)` is what an AsyncEngine reports to."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between streamed tokens", m,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, arrival to end",
                             m, buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram(P + "request_queue_time_seconds", "Arrival to first scheduled", m,
                               buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge(P + "num_requests_running", "Sequences running in the engine", m,
                             registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Sequences waiting to run", m, registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "Fraction of KV blocks in use", m,
                              registry=r)
        self.kv_used = Gauge(P + "kv_cache_blocks_used", "KV blocks held by sequences", m,
                             registry=r)
        self.prefix_rate = Gauge(P + "prefix_cache_hit_rate", "Prompt tokens served by the "
                                 "prefix cache / prompt tokens looked up", m, registry=r)
        self.spec_rate = Gauge(P + "spec_decode_acceptance_rate", "Accepted / proposed draft "
                               "tokens", m, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens admitted", m, registry=r)
        self.gen_tokens = Counter(P + "generation_tokens", "Tokens generated", m, registry=r)
        self.success = Counter(P + "request_success", "Finished requests", m + ["finished_reason"],
                               registry=r)
        self.preemptions = Counter(P + "num_preemptions", "Preemptions", m, registry=r)
        self.prefix_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache", m, registry=r)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "Prompt tokens found in the prefix "
                                   "cache", m, registry=r)
        self.restarts = Counter(P + "engine_restarts", "Times the engine process was restarted "
                                "after it died", m, registry=r)
        self.up = Gauge(P + "engine_up", "1 while the engine serves, 0 while it is down", m,
                        registry=r)

    def listener(self, model: str) -> _Listener:
        return _Listener(self, model)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Listener:
    """One engine's reporter: turns cumulative snapshots into counter increments."""

    COUNTED = (("prompt_tokens", "prompt_tokens"), ("generation_tokens", "gen_tokens"),
               ("preemptions", "preemptions"), ("prefix_queried_tokens", "prefix_queries"),
               ("prefix_hit_tokens", "prefix_hits"))

    def __init__(self, metrics: ServingMetrics, model: str) -> None:
        self.m, self.model = metrics, model
        self.seen = dict.fromkeys((a for a, _ in self.COUNTED), 0)
        self._children: dict[str, object] = {}
        self._c("up").set(1)
        self._c("restarts").inc(0)  # the series exists from the start: rate() sees its first

    def on_engine_down(self) -> None:
        """The engine process died: nothing runs; a new process counts from zero."""
        self._c("up").set(0)
        self._c("running").set(0)
        self._c("waiting").set(0)
        self.seen = dict.fromkeys(self.seen, 0)

    def on_engine_up(self) -> None:
        self._c("restarts").inc()
        self._c("up").set(1)

    def _c(self, name: str):
        """The metric's series for this model, looked up once (on_step runs every engine
        step, on_finish once per ITL): created on first use, as labels() would."""
        child = self._children.get(name)
        if child is None:
            child = self._children[name] = getattr(self.m, name).labels(self.model)
        return child

    def on_step(self, s: EngineSnapshot) -> None:
        c = self._c
        c("running").set(s.running)
        c("waiting").set(s.waiting)
        c("kv_usage").set(s.kv_usage)
        c("kv_used").set(s.kv_blocks_used)
        if s.prefix_queried_tokens:
            c("prefix_rate").set(s.prefix_hit_tokens / s.prefix_queried_tokens)
        if s.spec_acceptance is not None:
            c("spec_rate").set(s.spec_acceptance)
        for attr, name in self.COUNTED:
            cur = getattr(s, attr)
            if cur > self.seen[attr]:
                c(name).inc(cur - self.seen[attr])
            self.seen[attr] = cur

    def on_finish(self, r: FinishedRequest) -> None:
        m, lab, c = self.m, self.model, self._c
        if r.ttft_s is not None:
            c("ttft").observe(r.ttft_s)
        if r.queue_s is not None:
            c("queue").observe(r.queue_s)
        c("e2e").observe(r.e2e_s)
        itl = c("itl")
        for gap in r.itls:
            itl.observe(gap)
        m.success.labels(lab, r.finish_reason or "unknown").inc()
