"""The KV moves of a drop or restore (cluster/member.py `Relayout.moves`), checked without processes
over random sequences of drops and restores: every block of every layer of every request that
holds KV goes exactly once from the member that held that layer for its owner to the member
that holds it now, and both ends of a pair enumerate the same list."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanoserve.cluster.drop_plan import Cluster, Group, plan_drop, plan_restore
from nanoserve.cluster.group import GroupLayout
from nanoserve.cluster.member import Relayout


def layouts(groups) -> dict[int, GroupLayout]:
    return {i: GroupLayout.of(g) for g in groups for i in g.instances}


def check_relayout(before, after, tables: dict[int, list[int]]) -> int:
    """Builds the Relayout the cluster would send and checks its moves; returns how many."""
    old, new = layouts(before), layouts(after)
    involved = sorted(i for i in new if new[i] != old.get(i))
    for i in involved:  # a change moves whole groups: nothing outside it holds their KV
        assert set(old[i].members) <= set(involved) and set(new[i].members) <= set(involved)
    manifests = {i: tuple((f"r{i}-{k}", tuple(range(n))) for k, n in enumerate(tables.get(i, [])))
                 for i in involved}
    relayout = Relayout({i: old[i] for i in involved}, {i: new[i] for i in involved}, manifests)
    seen: dict[tuple[int, str, int, int], tuple[int, int]] = {}
    for src in involved:
        for dst in involved:
            for owner, request_id, j, layer in relayout.moves(src, dst):
                key = (owner, request_id, j, layer)
                assert key not in seen, f"{key} moves twice: {seen[key]} and {(src, dst)}"
                seen[key] = (src, dst)
                assert old[owner].holder(layer) == src and new[owner].holder(layer) == dst
    num_layers = max(stage.stop for layout in new.values() for stage in layout.stages)
    expected = {(owner, request_id, j, layer) for owner in involved for request_id, table in manifests[owner]
                for j in range(len(table)) for layer in range(num_layers)}
    assert seen.keys() == expected, "a block-layer was not moved (or one was invented)"
    return len(seen)


class DropsAndRestores(RuleBasedStateMachine):
    @initialize(num_instances=st.integers(1, 6), layer_bytes=st.lists(st.integers(1, 50), min_size=1, max_size=7),
                data=st.data())
    def start(self, num_instances, layer_bytes, data):
        self.layer_bytes = layer_bytes
        self.groups = tuple(Group.replica(i, len(layer_bytes)) for i in range(num_instances))
        self.data = data

    def _tables(self) -> dict[int, list[int]]:
        members = [i for g in self.groups for i in g.instances]
        return {i: self.data.draw(st.lists(st.integers(1, 4), max_size=3), label=f"tables of {i}") for i in members}

    @rule(bytes_to_free=st.integers(1, 400))
    def drop(self, bytes_to_free):
        plan = plan_drop(self.groups, self.layer_bytes, bytes_to_free)
        check_relayout(self.groups, plan.after.groups, self._tables())
        self.groups = plan.after.groups

    @precondition(lambda self: any(g.size > 1 for g in self.groups))
    @rule(data=st.data())
    def restore(self, data):
        pipelines = [g for g in self.groups if g.size > 1]
        chosen = data.draw(st.lists(st.sampled_from(pipelines), min_size=1, unique=True))
        plan = plan_restore(self.groups, self.layer_bytes, instances=[i for g in chosen for i in g.instances])
        check_relayout(self.groups, plan.after.groups, self._tables())
        self.groups = plan.after.groups

    @invariant()
    def one_copy_per_group(self):
        Cluster(tuple(self.layer_bytes), self.groups).check_invariants()


DropsAndRestores.TestCase.settings = settings(max_examples=150, stateful_step_count=8, deadline=None)
TestDropsAndRestores = DropsAndRestores.TestCase


def test_a_two_instance_drop_sends_each_owner_the_other_half():
    before = (Group.replica(0, 4), Group.replica(1, 4))
    after = (Group((0, 1), (range(0, 2), range(2, 4))),)
    # Instance 0: one request of 3 blocks; instance 1: two of 1 and 2 blocks. 4 layers each.
    assert check_relayout(before, after, {0: [3], 1: [1, 2]}) == (3 + 1 + 2) * 4
    relayout = Relayout(layouts(before), layouts(after),
                        {0: (("a", (7, 8, 9)),), 1: (("b", (4,)), ("c", (5, 6)))})
    sent = list(relayout.moves(0, 1))
    assert sent == [(0, "a", j, layer) for j in range(3) for layer in (2, 3)]  # block-major, then layer
    assert list(relayout.moves(1, 0)) == [(1, r, j, layer) for r, n in (("b", 1), ("c", 2))
                                          for j in range(n) for layer in (0, 1)]
