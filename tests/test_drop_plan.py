"""KunServe's drop plan (Fig. 6) and restore plan (§4.4): nanoserve/cluster/drop_plan.py.

Examples from the paper, then hypothesis over clusters of 1-64 instances and 1-80 layers (full
replicas, or pipelines an earlier plan built), checked against independent recounts, a brute-force
merge order, and an instrumented count of heap comparisons for the O(N log N) claim."""
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.cluster import drop_plan
from nanoserve.cluster.drop_plan import HOST, Cluster, Group, plan_drop, plan_restore

FAST = settings(max_examples=200, deadline=None)


def pipeline(instances, num_layers):
    """A balanced pipeline by layer count: stage k gets layers [k*L//n, (k+1)*L//n)."""
    n = len(instances)
    return Group(tuple(instances), tuple(range(k * num_layers // n, (k + 1) * num_layers // n) for k in range(n)))


def held_layers(cluster):
    return {i: set(r) for i, r in cluster.holdings().items()}


# --- examples from the paper ----------------------------------------------------------------

def test_two_replicas_become_one_two_stage_pipeline():
    """Fig. 3 (d): GPU0 drops the second half of the layers, GPU1 the first."""
    cluster = Cluster.replicas(2, [10] * 4)
    plan = plan_drop(cluster.groups, cluster.layer_bytes, bytes_to_free=1)
    plan.check_invariants()
    assert plan.after.groups == (Group((0, 1), (range(0, 2), range(2, 4))),)
    assert plan.dropped == {0: (range(2, 4),), 1: (range(0, 2),)}
    assert plan.fetched == {0: (), 1: ()}
    assert plan.freed_bytes == 40 and plan.feasible  # one model copy


def test_four_replicas_merge_smallest_first_and_stop_when_enough():
    cluster = Cluster.replicas(4, [5] * 8)
    one = plan_drop(cluster.groups, cluster.layer_bytes, 40)  # one copy: a single merge
    assert [m.merged.instances for m in one.merges] == [(0, 1)] and one.freed_bytes == 40
    assert one.after.groups[1:] == (Group.replica(2, 8), Group.replica(3, 8))
    two = plan_drop(cluster.groups, cluster.layer_bytes, 41)  # more than one copy: pairs, not a triple
    assert [m.merged.instances for m in two.merges] == [(0, 1), (2, 3)] and two.freed_bytes == 80
    three = plan_drop(cluster.groups, cluster.layer_bytes, 120)
    assert [m.merged.size for m in three.merges] == [2, 2, 4]
    assert three.after.groups == (Group((0, 2, 1, 3), (range(0, 2), range(2, 4), range(4, 6), range(6, 8))),)
    for plan in (one, two, three):
        plan.check_invariants()
        assert not any(plan.fetched.values())


def test_ties_in_size_go_to_groups_holding_a_throttled_instance():
    """Fig. 6 leaves ties open; ours: a throttled instance's group merges first, so the drop
    enlarges the pool where the queue is (ties otherwise go to the lowest id)."""
    cluster = Cluster.replicas(4, [5] * 8)
    plan = plan_drop(cluster.groups, cluster.layer_bytes, 40, prefer=frozenset({3}))
    assert [sorted(m.merged.instances) for m in plan.merges] == [[0, 3]]
    both = plan_drop(cluster.groups, cluster.layer_bytes, 40, prefer=frozenset({1, 3}))
    assert [sorted(m.merged.instances) for m in both.merges] == [[1, 3]]
    # Size still comes first: a throttled member of a larger group waits for the replicas.
    groups = [pipeline((0, 1), 8), Group.replica(2, 8), Group.replica(3, 8)]
    later = plan_drop(groups, [5] * 8, 40, prefer=frozenset({0}))
    assert [sorted(m.merged.instances) for m in later.merges] == [[2, 3]]
    for p in (plan, both, later):
        p.check_invariants()


def test_one_instance_group_merges_with_a_two_stage_group_drop_only():
    groups = [Group.replica(0, 6), pipeline((1, 2), 6)]  # 1 holds [0, 3), 2 holds [3, 6)
    plan = plan_drop(groups, [1] * 6, 1)
    plan.check_invariants()
    assert plan.after.groups == (Group((1, 0, 2), (range(0, 2), range(2, 4), range(4, 6))),)
    assert plan.dropped == {1: (range(2, 3),), 0: (range(0, 2), range(4, 6)), 2: (range(3, 4),)}
    assert not any(plan.fetched.values()) and plan.freed_bytes == 6


def test_stages_are_balanced_by_bytes_not_layers():
    plan = plan_drop(Cluster.replicas(2, [1, 1, 1, 1, 4]).groups, [1, 1, 1, 1, 4], 1)
    assert plan.after.groups[0].stages == (range(0, 4), range(4, 5))  # 4 bytes each side


def test_infeasible_request_frees_what_it_can():
    plan = plan_drop(Cluster.replicas(2, [3] * 4).groups, [3] * 4, 25)  # two copies from two replicas
    plan.check_invariants()
    assert not plan.feasible and plan.freed_bytes == 12 and len(plan.after.groups) == 1


def test_a_stage_keeps_at_least_one_layer():
    plan = plan_drop(Cluster.replicas(4, [1, 1]).groups, [1, 1], 100)
    plan.check_invariants()  # two 2-stage pipelines; 2 + 2 stages > 2 layers, so no further merge
    assert [g.size for g in plan.after.groups] == [2, 2] and not plan.feasible


def test_unequal_bytes_can_force_a_fetch():
    """The module docstring's example: four one-layer stages, three inside [1, 4) held by two."""
    groups = [Group((0, 1), (range(0, 1), range(1, 4))), Group((2, 3), (range(0, 1), range(1, 4)))]
    plan = plan_drop(groups, [100, 1, 1, 1], 1)
    plan.check_invariants()
    assert [len(s) for s in plan.after.groups[0].stages] == [1, 1, 1, 1]
    assert sum(len(r) for rs in plan.fetched.values() for r in rs) == 1
    assert plan.freed_bytes == 103  # dropped - fetched: still one copy


def test_restore_splits_a_pipeline_into_replicas_pulling_from_peers():
    cluster = Cluster.replicas(3, [2] * 6)
    drop = plan_drop(cluster.groups, cluster.layer_bytes, 12)
    restore = plan_restore(drop.after.groups, cluster.layer_bytes)
    restore.check_invariants()
    assert restore.after == cluster
    assert {(p.instance, p.layers, p.source) for p in restore.pulls} == {(0, range(3, 6), 1), (1, range(0, 3), 0)}
    assert restore.restored_bytes == drop.freed_bytes


def test_restore_after_a_failure_uses_a_replica_then_the_host():
    groups = [Group((0, 1), (range(0, 2), range(2, 4))), Group.replica(2, 4)]
    with_replica = plan_restore(groups, [1] * 4, instances=(), failed={1})
    with_replica.check_invariants()
    assert with_replica.after.groups == (Group.replica(0, 4), Group.replica(2, 4))
    assert [(p.instance, p.layers, p.source) for p in with_replica.pulls] == [(0, range(2, 4), 2)]
    host_only = plan_restore(groups[:1], [1] * 4, failed={1})
    host_only.check_invariants()
    assert [(p.instance, p.layers, p.source) for p in host_only.pulls] == [(0, range(2, 4), HOST)]


def test_bad_input_is_refused():
    with pytest.raises(AssertionError):
        plan_drop([Group((0, 1), (range(0, 2), range(3, 4)))], [1] * 4, 1)  # layer 2 missing
    with pytest.raises(AssertionError):
        plan_drop([Group.replica(0, 4), Group.replica(0, 4)], [1] * 4, 1)  # instance twice


# --- properties ---------------------------------------------------------------------------

@st.composite
def clusters(draw, max_instances=64, max_layers=80, equal_bytes=None):
    n, num_layers = draw(st.integers(1, max_instances)), draw(st.integers(1, max_layers))
    if equal_bytes if equal_bytes is not None else draw(st.booleans()):
        layer_bytes = [draw(st.integers(1, 1000))] * num_layers
    else:
        layer_bytes = draw(st.lists(st.integers(0, 1000), min_size=num_layers, max_size=num_layers))
    cluster = Cluster.replicas(n, layer_bytes)
    if draw(st.booleans()):  # a second burst: start from the pipelines an earlier plan built
        cluster = plan_drop(cluster.groups, layer_bytes, draw(st.integers(0, n * sum(layer_bytes)))).after
    return cluster


def required(draw, cluster):
    return draw(st.integers(0, (len(cluster.holdings()) + 1) * sum(cluster.layer_bytes)))


def reference_merges(cluster, bytes_to_free):
    """Fig. 6 by brute force: re-sort the whole list every turn, merge the two smallest."""
    live = sorted((g.size, min(g.instances)) for g in cluster.groups)
    merges, freed = [], 0
    while len(live) >= 2 and freed < bytes_to_free:
        live.sort()
        (s0, f0), (s1, f1) = live[0], live[1]
        if s0 + s1 > cluster.num_layers:
            break
        live = live[2:] + [(s0 + s1, min(f0, f1))]
        merges.append(((s0, f0), (s1, f1)))
        freed += sum(cluster.layer_bytes)
    return merges


@FAST
@given(st.data())
def test_drop_plan_properties(data):
    cluster = data.draw(clusters())
    bytes_to_free = required(data.draw, cluster)
    plan = plan_drop(cluster.groups, cluster.layer_bytes, bytes_to_free)
    plan.check_invariants()
    # every group holds a complete copy: each layer in exactly one member
    for group in plan.after.groups:
        assert Counter(layer for stage in group.stages for layer in stage) == Counter(range(cluster.num_layers))
    # freed bytes, recounted layer by layer: bytes no longer held minus bytes newly held
    old, new = held_layers(plan.before), held_layers(plan.after)
    recount = sum(cluster.layer_bytes[layer] for i in old for layer in old[i] - new[i]) \
        - sum(cluster.layer_bytes[layer] for i in old for layer in new[i] - old[i])
    assert plan.freed_bytes == recount == len(plan.merges) * sum(cluster.layer_bytes)
    # the smallest groups merge first, in Fig. 6's order
    assert [((m.first.size, min(m.first.instances)), (m.second.size, min(m.second.instances)))
            for m in plan.merges] == reference_merges(cluster, bytes_to_free)
    # stops as soon as enough is freed; short only when no pair can merge any more
    assert plan.feasible == (plan.freed_bytes >= bytes_to_free)
    if plan.merges:
        assert plan.freed_bytes - plan.merges[-1].freed_bytes < bytes_to_free
    if not plan.feasible:
        sizes = sorted(g.size for g in plan.after.groups)
        assert len(sizes) == 1 or sizes[0] + sizes[1] > cluster.num_layers
    # instances no merge touched keep what they held
    assert all(old[i] == new[i] for i in old if i not in plan.new_layers)


@FAST
@given(st.data())
def test_drop_only_from_replicas_and_with_equal_layers(data):
    """From full replicas every plan is drop-only; with layers of equal bytes, so is a second
    plan over the pipelines the first built (the module docstring's claim)."""
    cluster = data.draw(clusters(equal_bytes=data.draw(st.booleans())))
    plan = plan_drop(cluster.groups, cluster.layer_bytes, required(data.draw, cluster))
    if all(g.size == 1 for g in cluster.groups) or len(set(cluster.layer_bytes)) == 1:
        assert not any(plan.fetched.values())


@FAST
@given(st.data())
def test_restore_returns_every_instance_to_a_full_replica(data):
    cluster = data.draw(clusters())
    plan = plan_drop(cluster.groups, cluster.layer_bytes, required(data.draw, cluster))
    restore = plan_restore(plan.after.groups, cluster.layer_bytes)
    restore.check_invariants()
    instances = sorted(cluster.holdings())
    assert restore.after.holdings() == {i: range(cluster.num_layers) for i in instances}
    missing = sum(sum(cluster.layer_bytes) - sum(cluster.layer_bytes[x] for x in r)
                  for r in plan.after.holdings().values())
    assert restore.restored_bytes == missing
    # with failures: failed instances leave, and nothing is pulled from them
    failed = data.draw(st.sets(st.sampled_from(instances), max_size=len(instances)))
    restore = plan_restore(plan.after.groups, cluster.layer_bytes, failed=failed)
    restore.check_invariants()
    assert restore.after.holdings().keys() == set(instances) - failed
    assert all(r == range(cluster.num_layers) for r in restore.after.holdings().values())
    assert not {p.source for p in restore.pulls} & failed


# --- O(N log N) -------------------------------------------------------------------------

def count_work(groups, layer_bytes):
    """Heap comparisons (counted through the heap entries' __lt__) and Σ merged group sizes."""
    comparisons = 0
    compare = drop_plan._Queued.__lt__

    def counting_lt(a, b):
        nonlocal comparisons
        comparisons += 1
        return compare(a, b)

    drop_plan._Queued.__lt__ = counting_lt
    try:
        plan = plan_drop(groups, layer_bytes, 10**18)  # never enough: merge all the way
    finally:
        drop_plan._Queued.__lt__ = compare
    return comparisons, sum(m.merged.size for m in plan.merges), plan


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 1024), group_sizes=st.lists(st.integers(1, 64), max_size=64))
def test_plan_is_n_log_n(n, group_sizes):
    # instances 0..n-1 cut into pipelines of the drawn sizes (the rest replicas): skewed on purpose
    groups, next_instance = [], 0
    for size in group_sizes:
        size = min(size, n - next_instance)
        if size:
            groups.append(pipeline(range(next_instance, next_instance + size), n))
        next_instance += size
    groups += [Group.replica(i, n) for i in range(next_instance, n)]
    comparisons, merge_work, plan = count_work(groups, [1] * n)
    assert len(plan.after.groups) == 1  # L = N layers: every merge fits
    bound = 8 * n * math.log2(max(n, 2)) + 8
    assert comparisons <= bound and merge_work <= bound


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 100, 257, 1000, 1024])
def test_replicas_plan_is_n_log_n(n):
    comparisons, merge_work, _ = count_work(Cluster.replicas(n, [1] * n).groups, [1] * n)
    assert comparisons <= 8 * n * math.log2(max(n, 2)) + 8
    assert merge_work <= 2 * n * math.log2(max(n, 2)) + 2  # replicas: a balanced merge tree
