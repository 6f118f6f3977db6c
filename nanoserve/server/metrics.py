"""Prometheus metrics through `prometheus_client`, under vLLM's names where they mean the same.

vLLM's Grafana dashboard and alert rules read `vllm:num_requests_running`,
`vllm:time_to_first_token_seconds`, ...; nanoserve exports the same metrics with the same labels
(`model_name`, `finished_reason`) under its own prefix, `nanoserve:` (so the dashboard in
`docs/grafana/nanoserve.json` is vLLM's queries with the prefix changed). What is nanoserve's own
-- request classes, SLO attainment, the KV managers' mechanism counters, the admission queue --
keeps its own names, `nanoserve_...`, so no one mistakes them for vLLM's.

Two sources feed the page. Engine-wide values come from the `EngineStats` snapshot the engine
thread publishes after every step, read at scrape time by `EngineCollector`
(engine_collector.py), so a scrape never touches engine state from the event loop. Per-request
latencies are observed here as each request finishes (`ServerMetrics.observe_finished`): the
server is the only place that sees them; step times and tokens are observed by the engine thread.
Each app has its own registry, so several servers can live in one process (the tests).
"""
from __future__ import annotations

import json
import logging
import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoserve.outputs import RequestOutput
from nanoserve.slo import PRIORITIES, RequestClass

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
request_log = logging.getLogger("nanoserve.requests")
prometheus_client.disable_created_metrics()  # no `_created` series beside each counter (vLLM's choice too)

# Seconds. Wide on purpose: a CPU serves a token in tens of ms, a busy queue takes minutes.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
VLLM = "nanoserve:"  # the prefix of the metrics that are vLLM's under its names


class ServerMetrics:
    """The request- and step-level metrics the server observes, in the app's registry."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        model = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...], labels: list[str] = model) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        # vLLM's, same names after the prefix and the same labels.
        self.ttft = histogram(VLLM + "time_to_first_token_seconds", "Time to the first token.", LATENCY_BUCKETS)
        self.e2e = histogram(VLLM + "e2e_request_latency_seconds", "Arrival to the last token.", LATENCY_BUCKETS)
        self.tpot = histogram(VLLM + "request_time_per_output_token_seconds",
                              "A request's mean time per output token after the first.", LATENCY_BUCKETS)
        self.queue = histogram(VLLM + "request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.prefill = histogram(VLLM + "request_prefill_time_seconds", "First scheduled to the first token.",
                                 LATENCY_BUCKETS)
        self.decode = histogram(VLLM + "request_decode_time_seconds", "The first token to the last.", LATENCY_BUCKETS)
        self.prompt_len = histogram(VLLM + "request_prompt_tokens", "Prompt tokens of finished requests.",
                                    TOKEN_BUCKETS)
        self.output_len = histogram(VLLM + "request_generation_tokens", "Output tokens of finished requests.",
                                    TOKEN_BUCKETS)
        self.iteration_tokens = histogram(VLLM + "iteration_tokens_total", "Tokens scheduled by one engine step.",
                                          TOKEN_BUCKETS)
        self.success = Counter(VLLM + "request_success", "Requests finished, by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        # nanoserve's own.
        per_class = ["model_name", "priority"]
        self.class_ttft = histogram("nanoserve_time_to_first_token_seconds", "Time to the first token, per class.",
                                    LATENCY_BUCKETS, per_class)
        self.class_tpot = histogram("nanoserve_time_per_output_token_seconds",
                                    "Mean gap between output tokens, per class.", LATENCY_BUCKETS, per_class)
        self.class_e2e = histogram("nanoserve_e2e_request_latency_seconds", "Arrival to the last token, per class.",
                                   LATENCY_BUCKETS, per_class)
        self.step_seconds = histogram("nanoserve_scheduler_step_seconds",
                                      "Wall-clock time of one engine step (schedule + forward).", STEP_BUCKETS)
        self.errors = Counter("nanoserve_request_errors", "Requests refused or failed, by error type.",
                              ["model_name", "type"], registry=self.registry)
        for cls in PRIORITIES:  # every class's series exist from the start (a dashboard's queries do)
            for h in (self.class_ttft, self.class_tpot, self.class_e2e):
                h.labels(model_name, cls.value)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)

    def observe_step(self, seconds: float, tokens: int) -> None:
        """The engine thread, after each step (prometheus_client's metrics are thread-safe)."""
        self.step_seconds.labels(self.model_name).observe(seconds)
        self.iteration_tokens.labels(self.model_name).observe(tokens)

    def observe_finished(self, output: RequestOutput, priority: RequestClass = RequestClass.ONLINE) -> None:
        m, name, cls = output.metrics, self.model_name, RequestClass(priority).value
        self.success.labels(name, output.finish_reason or "unknown").inc()
        for value, vllm_name, ours in ((m.ttft, self.ttft, self.class_ttft), (m.tpot, self.tpot, self.class_tpot),
                                       (m.e2e, self.e2e, self.class_e2e)):
            if value is not None:
                vllm_name.labels(name).observe(value)
                ours.labels(name, cls).observe(value)
        for value, hist in ((m.queue_time, self.queue), (m.prefill_time, self.prefill)):
            if value is not None:
                hist.labels(name).observe(value)
        if m.e2e is not None and m.ttft is not None:
            self.decode.labels(name).observe(m.e2e - m.ttft)
        self.prompt_len.labels(name).observe(m.num_prompt_tokens)
        self.output_len.labels(name).observe(m.num_output_tokens)

    def observe_aborted(self, count: int) -> None:
        """Requests cut short by the server (client gone, a sibling choice failed)."""
        if count:
            self.success.labels(self.model_name, "abort").inc(count)

    def observe_error(self, error_type: str) -> None:
        self.errors.labels(self.model_name, error_type).inc()

    def render(self) -> bytes:
        """The whole /metrics page, in Prometheus's text format."""
        return prometheus_client.generate_latest(self.registry)


def model_gauge(model: list[str], name: str, doc: str, value: float) -> GaugeMetricFamily:
    """One gauge labelled with the served model's name (a collector's snapshot value)."""
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(model, value)
    return family


def model_counter(model: list[str], name: str, doc: str, value: float) -> CounterMetricFamily:
    """One counter labelled with the served model's name (a collector's snapshot total)."""
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(model, value)
    return family


def log_request(request_id: str, priority: RequestClass, prompt_tokens: int, last: RequestOutput | None,
                cut_short: str | None, http_request_id: str | None = None) -> None:
    """One JSON line per request, when it ends: `finish_reason` is the engine's (stop, length),
    or `cut_short` (abort: the client left, a sibling choice failed, a deadline passed);
    `request_id` is the HTTP request's X-Request-Id (a proxy's log finds it), `id` the choice's."""
    if not request_log.isEnabledFor(logging.INFO):
        return
    m = last.metrics if last is not None else None
    request_log.info(json.dumps({
        "ts": round(time.time(), 3), "event": "request", "id": request_id, "request_id": http_request_id,
        "class": priority,
        "prompt_tokens": prompt_tokens,
        "output_tokens": len(last.token_ids) if last is not None else 0,
        "ttft_s": _rounded(m.ttft if m else None), "tpot_s": _rounded(m.tpot if m else None),
        "e2e_s": _rounded(m.e2e if m else None), "preemptions": m.num_preemptions if m else 0,
        "finish_reason": cut_short or (last.finish_reason if last is not None else None),
    }))


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)
