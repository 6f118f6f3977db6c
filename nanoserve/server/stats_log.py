"""A stats line in the log every few seconds, as vLLM writes it, so an operator watching the
console sees the engine between requests:

    Engine: avg prompt throughput 812.4 tokens/s, avg generation throughput 96.1 tokens/s,
    running 12 reqs, waiting 3 reqs, KV cache usage 41.2%, prefix cache hit rate 63.0%

Throughputs are over the interval since the last line (from the engine's token counters);
running, waiting and KV use are the latest snapshot; the hit rate is since the start. An idle
engine (nothing ran, nothing waits) writes nothing, so a quiet server leaves a quiet log.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nanoserve.engine_stats import EngineStats

log = logging.getLogger("nanoserve.stats")


class StatsLogger:
    """Turns successive `EngineStats` snapshots into vLLM's periodic stats line."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        if interval <= 0:
            raise ValueError(f"the stats interval must be positive, got {interval}")
        self.interval = interval
        self.clock = clock
        self._last: tuple[float, int, int] | None = None  # time, prompt tokens, generated tokens

    def line(self, stats: EngineStats) -> str | None:
        """The line for this snapshot, or None while the engine is idle (or for the first one)."""
        now = self.clock()
        last, self._last = self._last, (now, stats.prompt_tokens_total, stats.generation_tokens_total)
        if last is None:
            return None
        seconds = max(now - last[0], 1e-9)
        prompt = (stats.prompt_tokens_total - last[1]) / seconds
        generation = (stats.generation_tokens_total - last[2]) / seconds
        if not (prompt or generation or stats.num_running or stats.num_waiting):
            return None
        return (f"Engine: avg prompt throughput {prompt:.1f} tokens/s, avg generation throughput "
                f"{generation:.1f} tokens/s, running {stats.num_running} reqs, waiting {stats.num_waiting} reqs, "
                f"KV cache usage {stats.kv_cache_usage:.1%}, prefix cache hit rate {stats.prefix_cache_hit_rate:.1%}")

    async def run(self, snapshot: Callable[[], EngineStats]) -> None:
        """Log a line every `interval` seconds until cancelled."""
        self.line(snapshot())
        while True:
            await asyncio.sleep(self.interval)
            text = self.line(snapshot())
            if text is not None:
                log.info(text)
