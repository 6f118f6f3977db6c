"""`EngineStats`: a snapshot of an engine's state and counters, what the server's metrics, its
stats log and `LLM` read. An engine publishes one after each step (`ServingEngine.stats`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.slo import RequestClass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: int
    kv_events: dict[str, int] = field(default_factory=dict)  # the memory manager's mechanism counters
    # Per request class (keyed by RequestClass; "online"/"offline" look up the same entries):
    # finished, SLO attainment, TTFT/TPOT p50/p99, tok/s.
    per_class: dict[RequestClass, dict] = field(default_factory=dict)
    # Wall-clock seconds of the steps that ran a batch, and what the policy's cost model predicted
    # for them: the SLO-budgeting policies are only as good as this ratio is close to 1.
    step_seconds_total: float = 0.0
    predicted_step_seconds_total: float = 0.0
    policy_counters: dict[str, int] = field(default_factory=dict)  # the policy's own (`Scheduler.counters`)

    @property
    def kv_cache_usage(self) -> float:
        """Share of the KV cache's blocks in use (0..1)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens the prefix cache supplied over those looked up, since start (0 before any)."""
        queries = self.kv_events.get("prefix_cache_queries", 0)
        return self.kv_events.get("prefix_cache_hits", 0) / queries if queries else 0.0

    @property
    def cost_model_ratio(self) -> float | None:
        """Measured over predicted step time (None before any step ran)."""
        if self.predicted_step_seconds_total <= 0:
            return None
        return self.step_seconds_total / self.predicted_step_seconds_total
