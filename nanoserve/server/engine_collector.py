"""`EngineCollector`: the engine's state as Prometheus metrics, read when /metrics is scraped.

A prometheus_client custom collector: at each scrape it takes the `EngineStats` snapshot the
engine thread published after its latest step (never the engine's live state: the scrape runs
on the event loop) and the admission queue's counts, and yields them as metric families --
gauges for what is now, counters for what has added up. Names as in metrics.py: vLLM's under
`nanoserve:`, nanoserve's own as `nanoserve_...`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nanoserve.engine_stats import EngineStats
from nanoserve.server.metrics import VLLM, model_counter, model_gauge
from nanoserve.slo import RequestClass


class EngineCollector(Collector):
    """Yields the engine's gauges and counters from its latest snapshot."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineStats], alive: Callable[[], bool],
                 queued: Callable[[], Mapping[RequestClass, int]], rejected: Callable[[], int]) -> None:
        self.model_name = model_name
        self.snapshot, self.alive, self.queued, self.rejected = snapshot, alive, queued, rejected

    def collect(self) -> Iterator[Metric]:
        stats, model = self.snapshot(), [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return model_gauge(model, name, doc, value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return model_counter(model, name, doc, value)

        events = stats.kv_events
        queries, hits = events.get("prefix_cache_queries", 0), events.get("prefix_cache_hits", 0)
        # vLLM's, under its names.
        yield gauge(VLLM + "num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge(VLLM + "num_requests_waiting", "Requests waiting for KV memory or a slot.", stats.num_waiting)
        yield gauge(VLLM + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", stats.kv_cache_usage)
        yield counter(VLLM + "prompt_tokens", "Prompt tokens of all requests admitted.", stats.prompt_tokens_total)
        yield counter(VLLM + "generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter(VLLM + "num_preemptions", "Times a running request was preempted.", stats.num_preemptions)
        yield counter(VLLM + "prefix_cache_queries",
                      "Prompt tokens looked up in the prefix cache when their requests got KV blocks.", queries)
        yield counter(VLLM + "prefix_cache_hits", "Of those, the tokens the prefix cache supplied.", hits)
        # nanoserve's own.
        yield gauge("nanoserve_engine_alive", "1 while the engine thread runs, else 0.", int(self.alive()))
        queued = GaugeMetricFamily("nanoserve_requests_queued", "Requests admitted with no first token yet, "
                                   "per class (what --max-queued bounds).", labels=["model_name", "priority"])
        for cls, n in sorted(self.queued().items()):
            queued.add_metric([self.model_name, RequestClass(cls).value], n)
        yield queued
        yield counter("nanoserve_requests_rejected", "Requests turned away with 429 (queue full) or 503 "
                      "(shutting down).", self.rejected())
        yield gauge("nanoserve_kv_blocks_used", "KV cache blocks held by requests.", stats.kv_blocks_used)
        yield gauge("nanoserve_kv_blocks_total", "KV cache blocks in the pool.", stats.kv_blocks_total)
        yield counter("nanoserve_requests_finished", "Requests finished (any reason, aborts included).",
                      stats.requests_finished_total)
        yield gauge("nanoserve_prefix_cache_hit_ratio", "Prefix-cache hits over queries since start.",
                    stats.prefix_cache_hit_rate)
        for name, doc in (("host_hits", "Prefix-cache hits loaded from its host tier (--prefix-cache-host-tokens)."),
                          ("host_saves", "Cached blocks evicted from the device and saved to the host tier."),
                          ("host_loads", "Blocks loaded back from the host tier on a hit.")):
            yield counter(f"nanoserve_prefix_cache_{name}", doc, events.get(f"prefix_cache_{name}", 0))
        mechanisms = CounterMetricFamily("nanoserve_kv_events", "Mechanisms of the KV memory manager (checkpoints, "
                                         "overwrites, restores, ...), by event.", labels=["model_name", "event"])
        for event, n in sorted(events.items()):
            if not event.startswith("prefix_cache_"):
                mechanisms.add_metric([self.model_name, event], n)
        yield mechanisms
        attainment = GaugeMetricFamily("nanoserve_slo_attainment_ratio", "Share of finished requests of a class "
                                       "that met their TTFT and TPOT targets.", labels=["model_name", "priority"])
        for cls, summary in sorted(stats.per_class.items()):
            if summary.get("slo_attainment") is not None:
                attainment.add_metric([self.model_name, RequestClass(cls).value], summary["slo_attainment"])
        yield attainment
        yield counter("nanoserve_step_seconds", "Wall-clock seconds of engine steps that ran a batch.",
                      stats.step_seconds_total)
        yield counter("nanoserve_predicted_step_seconds", "The policy's cost model's prediction for the same "
                      "steps (compare with the measured total).", stats.predicted_step_seconds_total)
