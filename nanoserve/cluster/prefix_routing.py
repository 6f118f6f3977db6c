"""Prefix-aware routing (ours, after SGLang's cache-aware router and llm-d's prefix scorer): the
dispatcher remembers which prompt blocks it sent to each instance, so that a request whose
prefix an instance is likely to hold cached goes there when loads allow.

The dispatcher cannot see the instances' caches (they live in other processes, and a cache
changes every step), so, like SGLang's router, it keeps an approximation: per instance, the
chain hashes of the full prompt blocks of the requests routed to it (memory/prefix_cache.py's
hashes, the ones the instance's own cache uses), least recently routed first, at most as many
as the instance has KV blocks. An instance evicts what it has not used for longest, and so does
this record; it is right as long as the instance's cache holds what was routed to it lately.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from nanoserve.memory.prefix_cache import BlockHash


class RoutedPrefixes:
    def __init__(self) -> None:
        self._routed: dict[int, OrderedDict[BlockHash, None]] = {}

    def match(self, instance: int, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `hashes` routed to `instance` lately (its likely cache hit)."""
        routed = self._routed.get(instance)
        if not routed:
            return 0
        n = 0
        for h in hashes:
            if h not in routed:
                break
            n += 1
        return n

    def record(self, instance: int, hashes: Sequence[BlockHash], capacity_blocks: int) -> None:
        """`hashes` went to `instance`: the most recently used, beyond the oldest over capacity."""
        routed = self._routed.setdefault(instance, OrderedDict())
        for h in hashes:
            routed[h] = None
            routed.move_to_end(h)
        while len(routed) > max(0, capacity_blocks):
            routed.popitem(last=False)

    def forget(self, instance: int) -> None:
        """`instance` lost its cache (it died, or its layers were dropped and its KV re-carved)."""
        self._routed.pop(instance, None)
