"""Prometheus metrics, rendered by hand in the text exposition format (version 0.0.4).

The format is small enough that a dependency (prometheus_client) would cost more than it saves:

    # HELP nanoserve_kv_blocks_used KV cache blocks held by requests.
    # TYPE nanoserve_kv_blocks_used gauge
    nanoserve_kv_blocks_used 12

Two sources feed it. Engine-wide gauges and counters come from the `EngineStats` snapshot the
engine thread publishes after every step, so a scrape never touches engine state from the
event loop. Per-request latencies (TTFT, TPOT, end-to-end) are observed by the server as each
request finishes and kept here as histograms, because that is the only place that sees them.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from nanoserve.engine import EngineStats
from nanoserve.outputs import RequestOutput
from nanoserve.slo import PRIORITIES, RequestClass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
request_log = logging.getLogger("nanoserve.requests")

# Seconds. Wide on purpose: a CPU serves a token in tens of ms, a busy queue takes minutes.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""

    def escape(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels.items()) + "}"


@dataclass
class Histogram:
    """Cumulative buckets, as Prometheus expects: bucket `le=x` counts observations <= x."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def copy(self) -> Histogram:
        twin = Histogram(self.buckets)
        twin.counts, twin.total, twin.count = list(self.counts), self.total, self.count
        return twin

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str, labels: dict[str, str] | None = None) -> Iterable[str]:
        labels = labels or {}
        for bound, n in zip(self.buckets, self.counts):
            yield f"{name}_bucket{_labels({**labels, 'le': _number(bound)})} {n}"
        yield f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {self.count}"
        yield f"{name}_sum{_labels(labels)} {_number(self.total)}"
        yield f"{name}_count{_labels(labels)} {self.count}"


@dataclass
class ClassLatencies:
    """The latency histograms of one request class."""

    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))


class ServerMetrics:
    """Request-level metrics the server observes; rendered together with the engine's stats."""

    def __init__(self) -> None:
        self.by_class = {cls: ClassLatencies() for cls in PRIORITIES}
        self.prompt_len = Histogram(TOKEN_BUCKETS)
        self.output_len = Histogram(TOKEN_BUCKETS)
        self.finished: dict[str, int] = {}  # by finish reason
        self.errors: dict[str, int] = {}  # by OpenAI error type, for requests refused or failed
        self._step_seconds = Histogram(STEP_BUCKETS)  # observed by the engine thread
        self._step_lock = threading.Lock()

    def observe_step(self, seconds: float) -> None:
        with self._step_lock:
            self._step_seconds.observe(seconds)

    def step_seconds(self) -> Histogram:
        """A consistent copy, safe to render while the engine thread observes."""
        with self._step_lock:
            return self._step_seconds.copy()

    def observe_finished(self, output: RequestOutput, priority: RequestClass = RequestClass.ONLINE) -> None:
        m, latencies = output.metrics, self.by_class.setdefault(priority, ClassLatencies())
        reason = output.finish_reason or "unknown"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if m.ttft is not None:
            latencies.ttft.observe(m.ttft)
        if m.tpot is not None:
            latencies.tpot.observe(m.tpot)
        if m.e2e is not None:
            latencies.e2e.observe(m.e2e)
        self.prompt_len.observe(m.num_prompt_tokens)
        self.output_len.observe(m.num_output_tokens)

    def observe_aborted(self, count: int) -> None:
        """Requests cut short by the server (client gone, a sibling choice failed)."""
        if count:
            self.finished["abort"] = self.finished.get("abort", 0) + count

    def observe_error(self, error_type: str) -> None:
        self.errors[error_type] = self.errors.get(error_type, 0) + 1


def _metric(name: str, kind: str, help_text: str, samples: Iterable[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def render(stats: EngineStats, server: ServerMetrics, model_name: str, engine_alive: bool,
           queued: Mapping[RequestClass, int], rejected: int) -> str:
    """The whole /metrics page."""
    model = {"model_name": model_name}

    def simple(name: str, kind: str, help_text: str, value: float) -> list[str]:
        return _metric(name, kind, help_text, [f"{name}{_labels(model)} {_number(value)}"])

    usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    queries, hits = stats.kv_events.get("prefix_cache_queries", 0), stats.kv_events.get("prefix_cache_hits", 0)
    lines = [
        *simple("nanoserve_engine_alive", "gauge", "1 while the engine thread runs, else 0.", int(engine_alive)),
        *simple("nanoserve_requests_running", "gauge", "Requests scheduled in the running batch.", stats.num_running),
        *simple("nanoserve_requests_waiting", "gauge", "Requests queued, waiting for KV memory or a slot.",
                stats.num_waiting),
        *_metric("nanoserve_requests_queued", "gauge",
                 "Requests admitted by the server that have no first token yet, per class (what --max-queued bounds).",
                 [f"nanoserve_requests_queued{_labels({**model, 'priority': c})} {n}"
                  for c, n in sorted(queued.items())]),
        *simple("nanoserve_requests_rejected_total", "counter",
                "Requests turned away with 429 (queue full) or 503 (shutting down).", rejected),
        *simple("nanoserve_kv_blocks_used", "gauge", "KV cache blocks held by requests.", stats.kv_blocks_used),
        *simple("nanoserve_kv_blocks_total", "gauge", "KV cache blocks in the pool.", stats.kv_blocks_total),
        *simple("nanoserve_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use (0..1).", usage),
        *simple("nanoserve_prompt_tokens_total", "counter", "Prompt tokens of all requests admitted.",
                stats.prompt_tokens_total),
        *simple("nanoserve_generation_tokens_total", "counter", "Tokens generated.",
                stats.generation_tokens_total),
        *simple("nanoserve_requests_finished_total", "counter", "Requests finished (any reason, aborts included).",
                stats.requests_finished_total),
        *simple("nanoserve_preemptions_total", "counter", "Times a running request was preempted.",
                stats.num_preemptions),
        *simple("nanoserve_prefix_cache_queries_total", "counter",
                "Prompt tokens of requests that looked the prefix cache up when they got their first KV blocks.",
                queries),
        *simple("nanoserve_prefix_cache_hits_total", "counter",
                "Of those, the tokens whose K/V the prefix cache supplied.", hits),
        *simple("nanoserve_prefix_cache_hit_ratio", "gauge",
                "Prefix-cache hits over queries since start (0 before any query).", hits / queries if queries else 0.0),
        *simple("nanoserve_prefix_cache_host_hits_total", "counter",
                "Of the prefix-cache hits, the tokens loaded from its host tier (--prefix-cache-host-tokens).",
                stats.kv_events.get("prefix_cache_host_hits", 0)),
        *simple("nanoserve_prefix_cache_host_saves_total", "counter",
                "Cached blocks evicted from the device and saved to the host tier.",
                stats.kv_events.get("prefix_cache_host_saves", 0)),
        *simple("nanoserve_prefix_cache_host_loads_total", "counter",
                "Blocks loaded back from the host tier on a hit.", stats.kv_events.get("prefix_cache_host_loads", 0)),
        *_metric("nanoserve_kv_events_total", "counter",
                 "Mechanisms of the KV memory manager (checkpoints, overwrites, restores, ...), by event.",
                 [f"nanoserve_kv_events_total{_labels({**model, 'event': e})} {n}"
                  for e, n in sorted(stats.kv_events.items()) if not e.startswith("prefix_cache_")]),
        *_metric("nanoserve_slo_attainment_ratio", "gauge",
                 "Share of finished requests of a class that met their TTFT and TPOT targets.",
                 [f"nanoserve_slo_attainment_ratio{_labels({**model, 'priority': c})} {_number(s['slo_attainment'])}"
                  for c, s in sorted(stats.per_class.items()) if s.get("slo_attainment") is not None]),
        *simple("nanoserve_step_seconds_total", "counter", "Wall-clock seconds of engine steps that ran a batch.",
                stats.step_seconds_total),
        *simple("nanoserve_predicted_step_seconds_total", "counter",
                "The policy's cost model's prediction for the same steps (compare with the measured total).",
                stats.predicted_step_seconds_total),
        *_metric("nanoserve_request_success_total", "counter", "Requests finished, by finish reason.",
                 [f"nanoserve_request_success_total{_labels({**model, 'finished_reason': r})} {n}"
                  for r, n in sorted(server.finished.items())]),
        *_metric("nanoserve_request_errors_total", "counter", "Requests refused or failed, by error type.",
                 [f"nanoserve_request_errors_total{_labels({**model, 'type': t})} {n}"
                  for t, n in sorted(server.errors.items())]),
    ]
    for name, attr, help_text in (
        ("nanoserve_time_to_first_token_seconds", "ttft", "Time from arrival to the first token, per class."),
        ("nanoserve_time_per_output_token_seconds", "tpot", "Mean gap between output tokens, per class."),
        ("nanoserve_e2e_request_latency_seconds", "e2e", "Time from arrival to the last token, per class."),
    ):
        samples = [line for c, latencies in sorted(server.by_class.items())
                   for line in getattr(latencies, attr).lines(name, {**model, "priority": c})]
        lines += _metric(name, "histogram", help_text, samples)
    for name, hist, help_text in (
        ("nanoserve_request_prompt_tokens", server.prompt_len, "Prompt length of finished requests."),
        ("nanoserve_request_generation_tokens", server.output_len, "Output length of finished requests."),
        ("nanoserve_scheduler_step_seconds", server.step_seconds(),
         "Wall-clock time of one engine step (schedule + forward)."),
    ):
        lines += _metric(name, "histogram", help_text, hist.lines(name, model))
    return "\n".join(lines) + "\n"


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
