"""`ClusterStats`: a snapshot of KunServe's cluster (cluster/cluster.py) beside the `EngineStats`
of its instances together: what the server's cluster metrics read (server/cluster_collector.py).
Taken on the serving loop's thread after each step, like `EngineStats`. Instances are named by
their id (the rank in the cluster's gloo world); a dead instance leaves the per-instance maps.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClusterStats:
    kv_blocks_used: Mapping[int, int]  # live instance -> KV blocks its requests hold
    kv_blocks_total: Mapping[int, int]  # live instance -> blocks its requests can have (a drop enlarges it)
    num_running: Mapping[int, int]  # live instance -> requests running (those waiting for their K/V too)
    num_waiting: Mapping[int, int]  # live instance -> requests queued
    throttled: frozenset[int] = frozenset()  # instances whose head-of-line request lacked KV after the step
    in_pipelines: frozenset[int] = frozenset()  # instances serving as a stage of a group (layers dropped)
    layout_changes: Mapping[str, int] = field(default_factory=dict)  # "drop", "restore", "recover" -> count
    throttled_steps: int = 0  # steps after which some instance was throttled
    requests_redispatched: int = 0  # queued requests moved after a drop (§3)
    requests_retried: int = 0  # requests restarted after their instance died (§4.4)
    instances_lost: int = 0

    @property
    def num_instances(self) -> int:
        """Live instances."""
        return len(self.kv_blocks_total)

    def kv_cache_usage(self, instance: int) -> float:
        """Share of the instance's blocks in use (0..1)."""
        total = self.kv_blocks_total[instance]
        return self.kv_blocks_used[instance] / total if total else 0.0
