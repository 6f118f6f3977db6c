"""The cluster's side of KunServe's parameter-centric memory management (kunserve.txt §3, §4.1,
§4.2, §4.4): when to drop and restore, and the four phases that carry out a change of layout
on the instances (cluster/member.py does each instance's part).

- Drop (§3, §4.1). The monitor reports which instances are throttled (their head-of-line
  request cannot start). Fig. 6's R is "the memory demand of all queuing requests" (§4.1):
  with `drop_demand="queue"` (the default), the blocks each throttled instance's whole queue
  lacks (held plus every queued request's, over its capacity), summed, in bytes (one block of
  every layer's K and V). assumption: "all queuing requests" are the throttled instances'
  (a queue that fits its own instance asks for no drop); "head" is the head-of-line shortfall
  alone (the rule before issue 46, an ablation). `plan_drop` merges the smallest groups,
  throttled ones first among equals, until R is freed, or as far as it can (an infeasible plan
  still runs every merge it found: the paper would also scale out, §4.4).
- Restore (§4.4). A group splits back into replicas once its demand is at most
  `restore_fraction` (default 50%) of what its members hold without the drop, and each member's
  own requests fit its replica again.
- Faults (§4.4). The live members of a group that lost one recover from the host copy
  (`ClusterMember.recover`); `plan_restore(..., failed=...)` gives the groups after.

Each phase is sent to every involved member before any reply is read, so the members run it
at once: the exchange phase needs that, as members send to and receive from each other.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.cluster.drop_plan import Group, plan_drop, plan_restore
from nanoserve.cluster.group import GroupLayout
from nanoserve.cluster.member import Manifest, Relayout

if TYPE_CHECKING:
    from nanoserve.cluster.load import InstanceLoad

# Fig. 6's R (`Regrouper.blocks_to_free`): every queued request's blocks (§4.1), or the head's.
DROP_DEMANDS = ("queue", "head")
CallAll = Callable[[Mapping[int, tuple]], dict[int, object]]  # instance -> message, in one round


@dataclass(frozen=True)
class LayoutChange:
    """One drop, restore or recovery as it ran."""

    kind: str  # "drop", "restore" or "recover"
    before: tuple[Group, ...]
    after: tuple[Group, ...]
    seconds: float  # drop (or restore) and remap: from the first phase sent to the last reply
    blocks_in_use: int  # blocks the involved members' running requests held when it began
    kv_bytes_sent: int  # between members (the §4.2 exchange), one chunk per step after the change
    exchange_steps: int  # steps the exchange takes: a request stalls until its own chunks are in
    kv_bytes_kept: int  # staged and installed on the same member
    capacity_before: int  # blocks of the involved members' pools, before and after
    capacity_after: int
    weights_copied: int = 0  # weight bytes loaded back during the change (not pulled before it)


def split_pool(pool: int, used: Mapping[int, int], members: Sequence[int]) -> dict[int, int]:
    """Each owner keeps the blocks its requests hold, and the rest of the group's pool is shared
    out equally (the earlier members take the remainder)."""
    spare = pool - sum(used.values())
    if spare < 0:
        raise RuntimeError(f"the group's pool of {pool} blocks cannot hold the {sum(used.values())} in use")
    share, extra = divmod(spare, len(members))
    return {m: used.get(m, 0) + share + (k < extra) for k, m in enumerate(members)}


class Regrouper:
    def __init__(self, num_instances: int, layer_bytes: Sequence[int], block_bytes: int,
                 chunk_bytes: int = 32 << 20, restore_fraction: float = 0.5, drop_demand: str = "queue"):
        if drop_demand not in DROP_DEMANDS:
            raise ValueError(f"drop_demand must be one of {', '.join(DROP_DEMANDS)}, not {drop_demand!r}")
        self.drop_demand = drop_demand
        self.layer_bytes = tuple(layer_bytes)
        self.block_bytes = block_bytes  # one KV block with every layer (a replica's block)
        self.chunk_bytes = chunk_bytes
        self.restore_fraction = restore_fraction
        self.groups: tuple[Group, ...] = tuple(Group.replica(i, len(layer_bytes)) for i in range(num_instances))
        self.history: list[LayoutChange] = []

    # -- when ------------------------------------------------------------------------------
    def drop(self, short: Mapping[int, int], loads: Mapping[int, InstanceLoad], call: CallAll) -> LayoutChange | None:
        """Fig. 6 for the throttled instances of `short` (instance -> head-of-line blocks short)."""
        plan = plan_drop(self.groups, self.layer_bytes, self.blocks_to_free(short, loads) * self.block_bytes,
                         prefer=frozenset(short))
        if not plan.merges:
            return None  # nothing left to merge: the throttled instances preempt as usual
        return self._run("drop", plan.after.groups, loads, call)

    def blocks_to_free(self, short: Mapping[int, int], loads: Mapping[int, InstanceLoad]) -> int:
        """Fig. 6's R in blocks: "the memory demand of all queuing requests" (§4.1) on the
        throttled instances, or their head-of-line shortfall (`drop_demand="head"`)."""
        if self.drop_demand == "head":
            return sum(short.values())
        return sum(max(blocks, loads[i].virtual_blocks - loads[i].total_blocks) if i in loads else blocks
                   for i, blocks in short.items())

    def restorable(self, loads: Mapping[int, InstanceLoad]) -> list[Group]:
        out = []
        for group in self.groups:
            if group.size == 1:
                continue
            members = [loads[i] for i in group.instances]
            demand = sum(load.demand_blocks for load in members)
            if (demand <= self.restore_fraction * sum(load.replica_blocks for load in members)
                    and all(load.demand_blocks <= load.replica_blocks for load in members)):
                out.append(group)
        return out

    def restore(self, groups: Sequence[Group], loads: Mapping[int, InstanceLoad], call: CallAll) -> LayoutChange:
        members = [i for g in groups for i in g.instances]
        plan = plan_restore(self.groups, self.layer_bytes, instances=members)
        return self._run("restore", plan.after.groups, loads, call)

    def recover(self, dead: set[int], lost: set[int], loads: Mapping[int, InstanceLoad], call: CallAll) -> LayoutChange:
        """Split every group that lost a member, or that has a member whose step or KV exchange
        failed on a peer (`lost`); every live member of those groups reloads from the host copy
        (`ClusterMember.recover` makes each a whole replica, so its group must split even when
        no one died)."""
        started = time.perf_counter()
        before = self.groups
        broken = {i for g in before if set(g.instances) & (dead | lost) for i in g.instances}
        survivors = sorted(broken - dead)
        plan = plan_restore(before, self.layer_bytes, instances=survivors, failed=dead)
        call({i: ("recover",) for i in survivors})
        self.groups = plan.after.groups
        change = LayoutChange("recover", before, self.groups, time.perf_counter() - started, 0, 0, 0, 0,
                              sum(loads[i].total_blocks for i in survivors if i in loads),
                              sum(loads[i].replica_blocks for i in survivors if i in loads))
        self.history.append(change)
        return change

    # -- how -------------------------------------------------------------------------------
    def _run(self, kind: str, after: Sequence[Group], loads: Mapping[int, InstanceLoad], call: CallAll) -> LayoutChange:
        started = time.perf_counter()
        old = {i: GroupLayout.of(g) for g in self.groups for i in g.instances}
        new = {i: GroupLayout.of(g) for g in after for i in g.instances}
        involved = sorted(i for i in new if new[i] != old.get(i))
        manifests: dict[int, Manifest] = expect_replies(call({i: ("manifest",) for i in involved}))
        relayout = Relayout({i: old[i] for i in involved}, {i: new[i] for i in involved}, manifests)
        free = expect_replies(call({i: ("reweigh", relayout) for i in involved}))
        used = {i: sum(len(table) for _, table in manifests[i]) for i in involved}  # blocks each owner holds
        pools: dict[int, dict[int, int] | None] = {}
        for group in {new[i] for i in involved}:
            if group.solo:
                pools[group.members[0]] = None
                continue
            split = split_pool(min(free[m] for m in group.members), {m: used[m] for m in group.members},
                               group.members)
            pools.update({m: split for m in group.members})
        new_manifests = expect_replies(call({i: ("allocate", pools[i]) for i in involved}))
        moved = expect_replies(call({i: ("exchange", new_manifests, self.chunk_bytes) for i in involved}))
        before, self.groups = self.groups, tuple(after)
        capacity_after = sum(pool[i] if (pool := pools[i]) else loads[i].replica_blocks for i in involved)
        change = LayoutChange(kind, before, self.groups, time.perf_counter() - started, sum(used.values()),
                              sum(m["sent"] for m in moved.values()), max(m["rounds"] for m in moved.values()),
                              sum(m["kept"] for m in moved.values()),
                              sum(loads[i].total_blocks for i in involved), capacity_after,
                              sum(m["weights_copied"] for m in moved.values()))
        self.history.append(change)
        return change


def expect_replies(replies: dict[int, object]) -> dict:
    for instance, reply in replies.items():
        if isinstance(reply, BaseException):
            raise RuntimeError(f"instance {instance} failed a layout change: {reply!r}") from reply
    return replies
