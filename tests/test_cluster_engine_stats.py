"""`ClusterEngine.stats` (nanoserve/cluster/cluster_engine.py): the instances' counters summed,
the policy's own included, over a cluster that reports fixed numbers (no processes start)."""
from __future__ import annotations

from nanoserve.cluster.cluster_engine import ClusterEngine
from nanoserve.cluster.engine_facts import EngineFacts
from nanoserve.cluster_stats import ClusterStats
from nanoserve.config import SchedulerConfig
from nanoserve.engine_stats import EngineStats


class ReportingCluster:
    """Two instances that describe themselves and report the stats they are given."""

    def __init__(self, parts: list[EngineStats]):
        self.parts = parts
        self.loads = {0: None, 1: None}

    def call_all(self, calls):
        facts = EngineFacts("m", SchedulerConfig(), None, {}, 10, "xgrammar", False)
        return {i: facts for i in calls}

    def stats(self) -> ClusterStats:
        return ClusterStats(kv_blocks_used={0: 1, 1: 2}, kv_blocks_total={0: 8, 1: 8},
                            num_running={0: 1, 1: 1}, num_waiting={0: 0, 1: 3})

    def engine_stats(self) -> list[EngineStats]:
        return self.parts


def part(**counters: int) -> EngineStats:
    return EngineStats(num_running=1, num_waiting=0, kv_blocks_used=1, kv_blocks_total=8, num_preemptions=2,
                       prompt_tokens_total=0, generation_tokens_total=5, requests_finished_total=0,
                       kv_events={"swap_out": 1}, policy_counters=counters)


def test_the_instances_counters_are_summed_the_policys_own_included():
    engine = ClusterEngine(ReportingCluster([part(steps=3, microbatches=6), part(steps=4, request_cuts=1)]),
                           tokenizer=None)  # type: ignore[arg-type]
    stats = engine.stats()
    assert stats.policy_counters == {"steps": 7, "microbatches": 6, "request_cuts": 1}
    assert stats.kv_events == {"swap_out": 2}
    assert (stats.num_preemptions, stats.generation_tokens_total) == (4, 10)
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used, stats.kv_blocks_total) == (2, 3, 3, 16)
