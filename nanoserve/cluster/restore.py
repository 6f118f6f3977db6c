"""KunServe's restore in the background, the cluster's side (kunserve.txt §4.4): "we overlap
restoring with the normal request processing".

A group is restorable once its demand is at most half of what its members hold without the
drop (cluster/regroup.py). Instead of switching at once, and copying the dropped layers' weights
while every member waits, the cluster first lets each member pull them while the group goes on
serving as a pipeline:

    step k     begin: each member reserves the home pages of the layers it lacks (the free ones
               now) and names the logical blocks of each owner's pool that lie on them; each
               owner retires those (no request gets them again)
    step k+1.. each owner reports which retired blocks its requests have freed; the cluster
               relays them to every member of the group, which hands their pages to the pull;
               each member fills a chunk of reserved pages per step (cluster/member.py `step`)
    switch     when no member has a reserved page left to fill: the usual restore (reweigh,
               allocate, exchange), whose reweigh copies only the pages that live KV still held

Throttling before the switch cancels the pull (the pages and blocks return to the KV), as in the
simulated cluster (sim/cluster.py `_restore_when_pulled`). A group that stopped being restorable
by the switch is cancelled too; the others switch.

Ours, where the paper is silent: the switch does not wait for the blocks requests still hold on
the weights' homes (their pages are copied at the switch, as before); the pull reads the host
copy, not a peer (the paper pulls from peers "whenever possible").
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from nanoserve.cluster.drop_plan import Group
from nanoserve.cluster.regroup import CallAll, expect_replies

if TYPE_CHECKING:
    from nanoserve.cluster.load import InstanceLoad


class BackgroundRestore:
    """One pull in progress for `groups`: begun on construction, polled with `ready` each step,
    then the cluster switches (cluster/regroup.py) or `cancel`s it."""

    def __init__(self, groups: Sequence[Group], chunk_bytes: int, loads: Mapping[int, InstanceLoad], call: CallAll):
        self.groups = tuple(groups)
        self.members = sorted(i for g in self.groups for i in g.instances)
        self.steps = 0
        self._pulled_before = sum(loads[i].pulled_bytes for i in self.members)
        wanted = expect_replies(call({i: ("begin_restore", chunk_bytes) for i in self.members}))
        retire: dict[int, set[int]] = {i: set() for i in self.members}
        for per_owner in wanted.values():
            for owner, logical in per_owner.items():
                retire[owner].update(logical)
        self.retired = {owner: frozenset(ids) for owner, ids in retire.items()}
        expect_replies(call({owner: ("retire", ids) for owner, ids in self.retired.items() if ids}))
        self.released: dict[int, frozenset[int]] = {i: frozenset() for i in self.members}

    def ready(self, loads: Mapping[int, InstanceLoad], call: CallAll) -> bool:
        """Relay each owner's newly freed retired blocks to its group; True once no member has a
        page it could still fill (its owners' in-use blocks are left to the switch)."""
        self.steps += 1
        messages: dict[int, list[tuple[int, frozenset[int]]]] = {}
        for group in self.groups:
            for owner in group.instances:
                freed = loads[owner].retired_free - self.released[owner]
                if freed:
                    self.released[owner] |= freed
                    for member in group.instances:
                        messages.setdefault(member, []).append((owner, freed))
        if messages:
            expect_replies(call({member: ("release", freed) for member, freed in messages.items()}))
            return False  # the released pages fill from the next step
        return all(loads[i].pull_pages_left == 0 for i in self.members)

    def pulled_bytes(self, loads: Mapping[int, InstanceLoad]) -> int:
        return sum(loads[i].pulled_bytes for i in self.members) - self._pulled_before

    def cancel(self, call: CallAll, groups: Sequence[Group], skip: AbstractSet[int] = frozenset()) -> None:
        """Give back what `groups` pulled; `skip` the members that are gone."""
        members = [i for g in groups for i in g.instances if i not in skip]
        expect_replies(call({i: ("cancel_restore",) for i in members}))
