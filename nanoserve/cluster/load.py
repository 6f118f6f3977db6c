"""What an instance of KunServe's cluster reports after each step (`InstanceLoad`: its KV state,
which the dispatcher, the throttling monitor, the drop and the restore read), and the failure a
pipeline step reports when a peer is gone (`PeerLost`, §4.4).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceLoad:
    """One instance's KV state after its latest step, in blocks."""

    instance: int
    total_blocks: int
    used_blocks: int
    head_blocks: int  # what the request at the head of its queue needs to start (0: no queue)
    queued_blocks: int  # what every queued request needs to start, the head's included
    num_waiting: int
    num_running: int
    replica_blocks: int = 0  # capacity with every layer held (before any drop)
    exchanging: bool = False  # still moving KV after a drop or restore (no new change starts)
    retired_free: frozenset[int] = frozenset()  # its pool's blocks a background restore may take
    pull_pages_left: int = 0  # reserved pages its background restore can still fill now
    pulled_bytes: int = 0  # weight bytes pulled in the background, over its life
    steps_in_flight: int = 0  # its steps still on their way through its group (`async_pipeline`)

    @property
    def demand_blocks(self) -> int:
        """The monitor's demand (kunserve.txt §2.2): "a standard approach [41] that counts the
        memory demands by considering both the in-processing requests and head-of-line queuing
        requests". Over capacity means the head cannot start without a preemption."""
        return self.used_blocks + self.head_blocks

    @property
    def virtual_blocks(self) -> int:
        """The dispatcher's demand (Llumnix's virtual usage): held plus the whole queue's."""
        return self.used_blocks + self.queued_blocks

    def usage_with(self, blocks: int) -> float:
        """The KV fill if `blocks` more were asked of it, every queued request included."""
        return (self.virtual_blocks + blocks) / self.total_blocks


class PeerLost(RuntimeError):
    """An instance's pipeline step failed because a member of its group is gone (§4.4)."""
