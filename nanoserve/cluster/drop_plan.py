"""KunServe's drop plan and restore plan (kunserve.txt §3, §4.1 Fig. 6, §4.4): which instances
of a cluster merge into pipelines, and which layers each one drops, keeps or pulls back. Plans
only: no tensors, no torch.distributed. `MemoryArena.drop_layers` / `restore_layers`
(nanoserve/memory/arena.py) carry a plan out on one instance; layers here are the same decoder
layer indices 0..L-1, and weights outside every layer (embeddings, norm, head) are never dropped.

A cluster is N instances in groups; a group runs as one pipeline holding one complete copy: member
k runs stage k, a contiguous run of layers, and the stages tile [0, L) in order. At start each
group is one instance holding every layer (a full replica). Merging two groups leaves one copy
where there were two (Fig. 3 (d): GPU0 drops the second half of the layers, GPU1 the first).

Paper → code (`plan_drop`, Fig. 6):

- line 1, `freed = 0`; line 2, the min-heap of groups by size: `_Queued`, ties to a group with a
  throttled instance (`prefer`; ours: the figure leaves ties open, and a merge that enlarges the
  throttled instance's pool serves its queue where it is), then to the group with the smallest
  instance id (groups are disjoint, so the order is total and plans deterministic).
- line 3, `while |Q| >= 2 and freed < R`; we also stop when the two smallest groups have more
  instances than the model has layers (a stage keeps a layer; every other pair is no smaller).
- line 4, pop the two smallest. Lines 5-7, their duplicated layers: each group holds exactly one
  copy, so L_g0 ∩ L_g1 is every layer and a merge frees one model's layer bytes.
- line 8, `merge(g0, g1)`: `_merge`. Line 9, `freed +=` the bytes the merged members no longer
  hold, counted from their ranges (= one copy). Line 10, push; line 11, the groups: `DropPlan`.

The merge (§4.1: each group "drops half of the redundant parameters"). A plan goes from `before`
to `after` at once (the groups built on the way never run), so a member may keep, without a
fetch, what it holds in `before` (`held`). Members take the stage order of their current
stages' byte midpoints (a stable merge of two sorted lists). Cut c_k, between stages k-1 and k,
is drop-only when start(held[k]) <= c_k <= stop(held[k-1]), and stages are non-empty when
c_{k-1} < c_k: chain constraints, so a forward and a backward pass give each cut's least and
greatest value and decide exactly whether this order is drop-only. Each cut is the layer
boundary nearest k/n of the bytes (balance), clamped into its window. From full replicas every
window is [0, L]: drop-only, balanced to a layer. Over pipelines an earlier plan built (a
second burst before restore) the windows bind; with layers of equal bytes they were always met
(exhaustive for N < 25, L < 40; the tests check it too), but unequal bytes can defeat them:
bytes [100, 1, 1, 1], both groups [0, 1) | [1, 4): four one-layer stages need three owners in
[1, 4), which two hold. Then (fallback) a cut takes its window's nearest point where the window
is not empty, else the balanced cut, and a member fetches the rest of its stage
(`DropPlan.fetched`; one layer here, not proven minimal). Freed = dropped - fetched bytes.

Cost. At most N-1 merges, each O(log N) heap work: O(N log N). Merging g0 and g1 costs
O(|g0| + |g1|) (plus a bisect per cut); summed over merges, Σ depths of the instances in the
merge tree, a Huffman tree (merge the two lightest) over leaves of weight >= 1 out of N, whose
depths are at most about log_φ N (Katona and Nemetz, 1976): O(N log N). The tests count both.

Restore (§4.4, `plan_restore`): once the burst passes, or a member of a pipeline fails, split its
group back into full replicas. Each live member pulls every other stage from the member that
runs it, from a live full replica when that member failed, or from the host copy (`HOST`).
Failed instances leave. §4.4's prioritising of activations over pulled weights is the runtime's.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import accumulate

HOST = -1  # a pull's source when no live instance holds the layers: the host DRAM/SSD copy


@dataclass(frozen=True)
class Group:
    """Instances that run as one pipeline: `instances[k]` runs stage k and holds `stages[k]`."""

    instances: tuple[int, ...]
    stages: tuple[range, ...]

    @classmethod
    def replica(cls, instance: int, num_layers: int) -> Group:
        return cls((instance,), (range(num_layers),))

    @property
    def size(self) -> int:
        return len(self.instances)

    def check_invariants(self, num_layers: int) -> None:
        """One complete copy: non-empty contiguous stages that tile [0, num_layers) in order."""
        assert self.instances and len(self.instances) == len(self.stages), f"{self}: one stage per member"
        stop = 0
        for stage in self.stages:
            assert stage.step == 1 and stage.start == stop and len(stage) > 0, f"{self}: stages must tile in order"
            stop = stage.stop
        assert stop == num_layers, f"{self}: stages miss layers [{stop}, {num_layers})"


@dataclass(frozen=True)
class Cluster:
    layer_bytes: tuple[int, ...]  # weight bytes of each decoder layer; layers may differ
    groups: tuple[Group, ...]

    @classmethod
    def replicas(cls, num_instances: int, layer_bytes: Sequence[int]) -> Cluster:
        """The starting state: every instance alone, holding every layer."""
        return cls(tuple(layer_bytes), tuple(Group.replica(i, len(layer_bytes)) for i in range(num_instances)))

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    def holdings(self) -> dict[int, range]:
        """Instance -> the layers it holds."""
        return {i: stage for g in self.groups for i, stage in zip(g.instances, g.stages)}

    def check_invariants(self) -> None:
        assert self.num_layers >= 1 and min(self.layer_bytes) >= 0, "need >= 1 layer, bytes >= 0"
        for group in self.groups:
            group.check_invariants(self.num_layers)
        members = [i for g in self.groups for i in g.instances]
        assert len(members) == len(set(members)), "an instance is in two groups (or twice in one)"


@dataclass(frozen=True)
class Merge:
    """One turn of Fig. 6's loop: `first` and `second`, popped in that order, became `merged`."""

    first: Group
    second: Group
    merged: Group
    freed_bytes: int


@dataclass(frozen=True)
class DropPlan:
    before: Cluster
    after: Cluster
    merges: tuple[Merge, ...]  # in the order Fig. 6 made them
    required_bytes: int
    freed_bytes: int
    new_layers: Mapping[int, range]  # each instance that merged -> the stage it keeps
    dropped: Mapping[int, tuple[range, ...]]  # ... -> the layers it gives to its KV cache
    fetched: Mapping[int, tuple[range, ...]]  # ... -> the layers it loads (none when drop-only)

    @property
    def feasible(self) -> bool:
        """False: even the plan's every merge frees too little (the caller may autoscale, §4.4)."""
        return self.freed_bytes >= self.required_bytes

    def check_invariants(self) -> None:
        self.before.check_invariants()
        self.after.check_invariants()
        assert self.before.layer_bytes == self.after.layer_bytes
        old, new = self.before.holdings(), self.after.holdings()
        assert old.keys() == new.keys(), "instances appeared or vanished"
        assert {i for i in old if old[i] != new[i]} <= self.new_layers.keys()
        prefix = _prefix(self.before.layer_bytes)
        dropped = fetched = 0
        for i, stage in self.new_layers.items():
            assert (new[i] == stage and self.dropped[i] == _minus(old[i], stage)
                    and self.fetched[i] == _minus(stage, old[i]))
            dropped += sum(_bytes(prefix, r) for r in self.dropped[i])
            fetched += sum(_bytes(prefix, r) for r in self.fetched[i])
        assert self.freed_bytes == dropped - fetched == sum(m.freed_bytes for m in self.merges)
        if self.merges:  # Fig. 6 line 3: stop as soon as enough is freed
            assert self.freed_bytes - self.merges[-1].freed_bytes < self.required_bytes


@dataclass(frozen=True, order=True)
class _Queued:
    """A heap entry (Fig. 6 line 2): smallest group first, ties to a group holding a preferred
    (throttled) instance, then to the smallest instance id."""

    size: int
    not_preferred: bool
    first_instance: int
    group: Group = field(compare=False)

    @classmethod
    def of(cls, group: Group, prefer: AbstractSet[int] = frozenset()) -> _Queued:
        return cls(group.size, not any(i in prefer for i in group.instances), min(group.instances), group)


def plan_drop(groups: Sequence[Group], layer_bytes: Sequence[int], bytes_to_free: int,
              prefer: AbstractSet[int] = frozenset()) -> DropPlan:
    """Fig. 6: merge the smallest pipeline groups until `bytes_to_free` weight bytes are freed;
    among groups of one size, those holding an instance of `prefer` (the throttled ones) first.
    Infeasible requests come back with every merge Fig. 6 could make and `feasible` False."""
    before = Cluster(tuple(layer_bytes), tuple(groups))
    before.check_invariants()
    prefix, held = _prefix(before.layer_bytes), before.holdings()
    freed = 0  # line 1
    queue = [_Queued.of(g, prefer) for g in before.groups]  # line 2
    heapq.heapify(queue)
    merges: list[Merge] = []
    merged_groups: dict[int, Group] = {}  # first instance -> group made by a merge, still queued
    while len(queue) >= 2 and freed < bytes_to_free:  # line 3
        first, second = heapq.heappop(queue), heapq.heappop(queue)  # line 4
        if first.size + second.size > before.num_layers:  # more stages than layers: no pair fits
            heapq.heappush(queue, first)
            heapq.heappush(queue, second)
            break
        merged = _merge(first.group, second.group, held, prefix)  # lines 5-8
        held_before = sum(_bytes(prefix, r) for q in (first, second) for r in q.group.stages)
        merges.append(Merge(first.group, second.group, merged, held_before - _bytes(prefix, range(before.num_layers))))
        freed += merges[-1].freed_bytes  # line 9
        heapq.heappush(queue, _Queued.of(merged, prefer))  # line 10
        merged_groups.pop(first.first_instance, None)
        merged_groups.pop(second.first_instance, None)
        merged_groups[min(first.first_instance, second.first_instance)] = merged
    after = Cluster(before.layer_bytes, tuple(q.group for q in sorted(queue, key=lambda q: q.first_instance)))
    new_layers = {i: s for g in merged_groups.values() for i, s in zip(g.instances, g.stages)}
    return DropPlan(before, after, tuple(merges), bytes_to_free, freed, new_layers,
                    {i: _minus(held[i], s) for i, s in new_layers.items()},
                    {i: _minus(s, held[i]) for i, s in new_layers.items()})


def _merge(first: Group, second: Group, origin: Mapping[int, range], prefix: Sequence[int]) -> Group:
    """Fig. 6 line 8: one pipeline holding one copy; drop-only against `origin`, what each
    instance holds before the plan, when the windows allow (module docstring)."""
    num_layers = len(prefix) - 1
    members = list(heapq.merge(zip(first.instances, first.stages), zip(second.instances, second.stages),
                               key=lambda m: prefix[m[1].start] + prefix[m[1].stop]))  # 2 x byte midpoint
    n, held = len(members), [origin[i] for i, _ in members]
    # lo[k] / hi[k]: least / greatest drop-only cut k (a chain: c_{k-1} < c_k, each stage non-empty)
    lo, hi = [0] * (n + 1), [num_layers] * (n + 1)
    for k in range(1, n):
        lo[k] = max(held[k].start, k, lo[k - 1] + 1)
    for k in range(n - 1, 0, -1):
        hi[k] = min(held[k - 1].stop, num_layers - (n - k), hi[k + 1] - 1)
    drop_only = held[0].start == 0 and held[-1].stop == num_layers and all(lo[k] <= hi[k] for k in range(1, n))
    cuts = [0]
    for k in range(1, n):
        cut = _balanced_cut(prefix, k, n)
        if drop_only:
            cut = min(max(cut, lo[k], cuts[-1] + 1), hi[k])
        else:  # fallback: keep inside the window where there is one, else fetch (caller records)
            if held[k].start <= held[k - 1].stop:
                cut = min(max(cut, held[k].start), held[k - 1].stop)
            cut = min(max(cut, cuts[-1] + 1), num_layers - (n - k))
        cuts.append(cut)
    cuts.append(num_layers)
    return Group(tuple(i for i, _ in members), tuple(range(cuts[k], cuts[k + 1]) for k in range(n)))


def _balanced_cut(prefix: Sequence[int], k: int, n: int) -> int:
    """The layer boundary whose bytes before it are nearest k/n of the model's (ties: earlier)."""
    target = k * prefix[-1]  # compared with n * prefix[c]: integers, no rounding
    c = bisect_left(prefix, target, key=lambda p: n * p)
    if c == len(prefix) or (c > 0 and target - n * prefix[c - 1] <= n * prefix[c] - target):
        c -= 1
    return c


def _prefix(layer_bytes: Sequence[int]) -> list[int]:
    return list(accumulate(layer_bytes, initial=0))  # prefix[c]: bytes of layers [0, c)


def _bytes(prefix: Sequence[int], layers: range) -> int:
    return prefix[layers.stop] - prefix[layers.start]


def _minus(a: range, b: range) -> tuple[range, ...]:
    """The layers of run `a` outside run `b`: at most a run before `b` and one after it."""
    parts = (range(a.start, min(a.stop, b.start)), range(max(a.start, b.stop), a.stop))
    return tuple(p for p in parts if len(p) > 0)


@dataclass(frozen=True)
class Pull:
    """§4.4: `instance` loads `layers` from `source`, a live instance holding them, or HOST."""

    instance: int
    layers: range
    source: int


@dataclass(frozen=True)
class RestorePlan:
    before: Cluster
    after: Cluster
    pulls: tuple[Pull, ...]
    failed: frozenset[int]

    @property
    def restored_bytes(self) -> int:
        prefix = _prefix(self.before.layer_bytes)
        return sum(_bytes(prefix, p.layers) for p in self.pulls)

    def check_invariants(self) -> None:
        self.before.check_invariants()
        self.after.check_invariants()
        old, new = self.before.holdings(), self.after.holdings()
        assert new.keys() == old.keys() - self.failed, "only failed instances leave"
        pulled: dict[int, list[int]] = {}
        for p in self.pulls:
            assert p.source == HOST or (p.source not in self.failed and p.layers.start >= old[p.source].start
                                        and p.layers.stop <= old[p.source].stop), f"{p}: source lacks the layers"
            assert p.instance in new, f"{p}: pulls into an instance that left"
            pulled.setdefault(p.instance, []).extend(p.layers)
        for i, layers in new.items():  # what it held and what it pulls: each layer once, exactly `layers`
            got = list(old[i]) + pulled.get(i, [])
            assert len(got) == len(set(got)) and set(got) == set(layers), f"instance {i}: pulls do not fill {layers}"


def plan_restore(groups: Sequence[Group], layer_bytes: Sequence[int], instances: Iterable[int] | None = None,
                 failed: Iterable[int] = ()) -> RestorePlan:
    """§4.4: split every group holding one of `instances` (default: every pipeline) or a `failed`
    instance into full replicas of its live members, and list the layers each pulls."""
    before = Cluster(tuple(layer_bytes), tuple(groups))
    before.check_invariants()
    failed = frozenset(failed)
    split = set(failed) | (set(instances) if instances is not None
                           else {i for g in before.groups if g.size > 1 for i in g.instances})
    # a live full replica can serve the stage of a failed member; else the host copy
    spare = next((g.instances[0] for g in before.groups if g.size == 1 and g.instances[0] not in failed), HOST)
    kept: list[Group] = []
    pulls: list[Pull] = []
    for group in before.groups:
        if split.isdisjoint(group.instances):
            kept.append(group)
            continue
        for instance in group.instances:
            if instance in failed:
                continue
            kept.append(Group.replica(instance, before.num_layers))
            pulls += [Pull(instance, stage, owner if owner not in failed else spare)
                      for owner, stage in zip(group.instances, group.stages) if owner != instance]
    after = Cluster(before.layer_bytes, tuple(sorted(kept, key=lambda g: min(g.instances))))
    return RestorePlan(before, after, tuple(pulls), failed)
