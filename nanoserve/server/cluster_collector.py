"""`ClusterCollector`: KunServe's cluster (`nanoserve serve --instances N [--drop]`) as Prometheus
metrics, read when /metrics is scraped, from the `ClusterStats` snapshot the engine thread took
after its latest step (engine_collector.py does the same for `EngineStats`). A server of one
engine has no cluster: the collector then yields nothing. The instances together also appear
under the engine's metrics (kv_cache_usage_perc, num_requests_running, ...: sums).

    nanoserve_cluster_instances                  live instances
    nanoserve_cluster_instances_lost             instances that died (§4.4)
    nanoserve_cluster_instances_in_pipelines     instances serving as a pipeline stage (layers dropped)
    nanoserve_cluster_throttled_instances        instances whose head-of-line request lacks KV
    nanoserve_cluster_throttled_steps            steps after which some instance was throttled
    nanoserve_cluster_layout_changes{kind}       drops, restores and recoveries
    nanoserve_cluster_requests_redispatched      queued requests moved after a drop (§3)
    nanoserve_cluster_requests_retried           requests restarted after their instance died
    nanoserve_cluster_instance_kv_usage_perc{instance}, _kv_blocks_used, _kv_blocks_total,
    nanoserve_cluster_instance_requests{instance, state}   per instance (state: running, waiting)
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nanoserve.cluster_stats import ClusterStats
from nanoserve.server.metrics import model_counter, model_gauge

LAYOUT_CHANGES = ("drop", "restore", "recover")  # every kind's series exists from the start


class ClusterCollector(Collector):
    def __init__(self, model_name: str, snapshot: Callable[[], ClusterStats | None]) -> None:
        self.model_name = model_name
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot()
        if stats is None:
            return
        model = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return model_gauge(model, name, doc, value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return model_counter(model, name, doc, value)

        yield gauge("nanoserve_cluster_instances", "Live instances of the cluster.", stats.num_instances)
        yield counter("nanoserve_cluster_instances_lost", "Instances that died.", stats.instances_lost)
        yield gauge("nanoserve_cluster_instances_in_pipelines", "Instances serving as a stage of a pipeline "
                    "group (their dropped layers became KV).", len(stats.in_pipelines))
        yield gauge("nanoserve_cluster_throttled_instances", "Instances whose head-of-line request could not get "
                    "KV after the latest step (memory throttling).", len(stats.throttled))
        yield counter("nanoserve_cluster_throttled_steps", "Steps after which some instance was throttled.",
                      stats.throttled_steps)
        changes = CounterMetricFamily("nanoserve_cluster_layout_changes", "Layout changes of the cluster: drops "
                                      "(layers dropped, instances regrouped into pipelines), restores, recoveries.",
                                      labels=["model_name", "kind"])
        for kind in sorted({*LAYOUT_CHANGES, *stats.layout_changes}):
            changes.add_metric([self.model_name, kind], stats.layout_changes.get(kind, 0))
        yield changes
        yield counter("nanoserve_cluster_requests_redispatched", "Queued requests dispatched again after a drop "
                      "enlarged other instances' memory.", stats.requests_redispatched)
        yield counter("nanoserve_cluster_requests_retried", "Requests restarted on a live instance after theirs died.",
                      stats.requests_retried)
        per_instance = ["model_name", "instance"]
        usage = GaugeMetricFamily("nanoserve_cluster_instance_kv_usage_perc", "Fraction of an instance's KV "
                                  "blocks in use (0..1).", labels=per_instance)
        used = GaugeMetricFamily("nanoserve_cluster_instance_kv_blocks_used", "KV blocks an instance's requests "
                                 "hold.", labels=per_instance)
        total = GaugeMetricFamily("nanoserve_cluster_instance_kv_blocks_total", "KV blocks an instance's requests "
                                  "can have (a drop enlarges it).", labels=per_instance)
        requests = GaugeMetricFamily("nanoserve_cluster_instance_requests", "Requests on an instance, by state.",
                                     labels=[*per_instance, "state"])
        for instance in sorted(stats.kv_blocks_total):
            labels = [self.model_name, str(instance)]
            usage.add_metric(labels, stats.kv_cache_usage(instance))
            used.add_metric(labels, stats.kv_blocks_used[instance])
            total.add_metric(labels, stats.kv_blocks_total[instance])
            requests.add_metric([*labels, "running"], stats.num_running[instance])
            requests.add_metric([*labels, "waiting"], stats.num_waiting[instance])
        yield from (usage, used, total, requests)
