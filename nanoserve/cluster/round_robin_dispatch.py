"""Round-robin dispatch: the paper-era baselines' load balancer in KunServe's experiment (ours).

KunServe's vLLM (v0.6.3) and InferCept serve data-parallel replicas with no dispatcher of their
own, and the paper describes none for them (kunserve.txt §5.1); only KunServe says it
"incorporates the load-balancing design from Llumnix" (§3). assumption: their requests are
spread by a plain round-robin balancer, as a front proxy in front of independent replicas does.
It reads no load, so a burst lands evenly by count whatever each instance holds.

Same calls as `cluster.Dispatcher` (`pick`, `reported`, `prefix_routed`), so the simulated
cluster takes either.
"""
from __future__ import annotations

from collections.abc import Sequence

from nanoserve.cluster.load import InstanceLoad
from nanoserve.memory.prefix_cache import BlockHash


class RoundRobinDispatcher:
    """Each new request to the next instance in id order, whatever their loads."""

    prefix_routed = 0  # never routes by prefix

    def __init__(self) -> None:
        self._next = 0  # the turn, counted over every request dispatched

    def pick(self, loads: Sequence[InstanceLoad], request_blocks: int, hashes: Sequence[BlockHash] = ()) -> int:
        if not loads:
            raise ValueError("no instance to dispatch to")
        instances = sorted(load.instance for load in loads)
        chosen = instances[self._next % len(instances)]
        self._next += 1
        return chosen

    def reported(self, instance: int) -> None:
        """Loads are not read: nothing to update."""
