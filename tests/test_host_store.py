"""HostKVStore: host block ownership under any sequence of operations, copies that bring K/V
back bit-identical, and the ledger of copies in flight: a copy issued on a stand-in copy stream
moves its data only when the test lands it, in issue order, and the ledger reports exactly the
copies that landed, once each, in that order."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.copies import InflightCopies
from nanoserve.memory.host import HostKVStore, KVCopy

BLOCK, DEVICE_BLOCKS, HOST_BLOCKS, LAYERS = 4, 6, 5, 2
OWNERS = st.sampled_from(["a", "b", "c"])


class HostStoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store = HostKVStore(HOST_BLOCKS, BLOCK, LAYERS, 1, 2, torch.float32)
        g = torch.Generator().manual_seed(0)
        self.caches = [(torch.randn(DEVICE_BLOCKS, BLOCK, 1, 2, generator=g),
                        torch.randn(DEVICE_BLOCKS, BLOCK, 1, 2, generator=g)) for _ in range(LAYERS)]
        self.saved: dict[int, list[torch.Tensor]] = {}  # host slot -> what was saved there, per layer K and V
        self.owned: dict[str, list[int]] = {}
        # The stand-in copy stream: issued copies, in order, and what each will have moved.
        self.stream: list[tuple[KVCopy, dict[int, list[torch.Tensor]]]] = []
        self.landed: set[int] = set()
        self.reported: list[int] = []  # tickets the ledger's polls returned, in order
        self.actions_run: list[int] = []
        self.streamed: set[int] = set()  # tickets issued on the stand-in stream (with an action)

    def draw_save(self, data) -> KVCopy:
        """A save of up to 6 device slots into distinct host slots of owned blocks."""
        blocks = [b for held in self.owned.values() for b in held]
        host_slots = data.draw(st.lists(st.sampled_from([s for b in blocks for s in self.store.slots(b)]),
                                        min_size=1, max_size=6, unique=True))
        device_slots = data.draw(st.lists(st.integers(0, DEVICE_BLOCKS * BLOCK - 1), min_size=len(host_slots),
                                          max_size=len(host_slots)))
        return KVCopy("save", tuple(device_slots), tuple(host_slots))

    def device_slot(self, slot: int) -> list[torch.Tensor]:
        return [c.view(-1, 1, 2)[slot].clone() for pair in self.caches for c in pair]

    @rule(owner=OWNERS, n=st.integers(0, 3))
    def allocate(self, owner, n):
        free = self.store.num_free_blocks
        if n > free:
            with pytest.raises(NoFreeBlocksError):
                self.store.allocate(owner, n)
            assert self.store.num_free_blocks == free  # all or nothing
            return
        self.owned.setdefault(owner, []).extend(self.store.allocate(owner, n))

    @precondition(lambda self: any(self.owned.values()))
    @rule(data=st.data())
    def free_some(self, data):
        owner = data.draw(st.sampled_from(sorted(o for o, b in self.owned.items() if b)))
        blocks = data.draw(st.lists(st.sampled_from(self.owned[owner]), unique=True))
        assert self.store.free(owner, blocks) == len(blocks)
        self.owned[owner] = [b for b in self.owned[owner] if b not in blocks]
        for b in blocks:
            for s in self.store.slots(b):
                self.saved.pop(s, None)
        # A save still in flight into a freed block would land after this: drop its record too.
        self.stream = [(c, {h: v for h, v in values.items() if h // BLOCK not in blocks}) for c, values in self.stream]

    @precondition(lambda self: any(self.owned.values()))
    @rule(data=st.data())
    def save(self, data):
        copy = self.draw_save(data)
        device_slots, host_slots = copy.src, copy.dst
        if self.stream:  # one stream: what was issued before lands first
            self.land(len(self.stream))
        self.store.execute([copy], self.caches)  # a CPU store: landed when issued
        self.landed.add(copy.ticket)
        for d, h in zip(device_slots, host_slots):
            self.saved[h] = self.device_slot(d)

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def load(self, data):
        host_slots = data.draw(st.lists(st.sampled_from(sorted(self.saved)), min_size=1, max_size=6, unique=True))
        device_slots = data.draw(st.lists(st.integers(0, DEVICE_BLOCKS * BLOCK - 1), min_size=len(host_slots),
                                          max_size=len(host_slots), unique=True))
        copy = KVCopy("load", tuple(host_slots), tuple(device_slots), reader="r")
        if self.stream:  # one stream: what was issued before lands first
            self.land(len(self.stream))
        self.store.execute([copy], self.caches)
        self.landed.add(copy.ticket)
        for d, h in zip(device_slots, host_slots):
            assert all(torch.equal(a, b) for a, b in zip(self.device_slot(d), self.saved[h]))

    # -- copies in flight ----------------------------------------------------------------
    @precondition(lambda self: any(self.owned.values()))
    @rule(data=st.data())
    def issue_save(self, data):
        """Issue a save on the stand-in stream: filed in the ledger, no data moved yet."""
        copy = self.draw_save(data)
        device_slots, host_slots = copy.src, copy.dst
        before = [t.clone() for t in (self.store.k, self.store.v)]
        self.store.inflight.issue(copy, lambda t=copy.ticket: t in self.landed)
        self.store.inflight.when_landed(copy, lambda t=copy.ticket: self.actions_run.append(t))
        self.streamed.add(copy.ticket)
        # The device slots may be overwritten after the save lands, not before: take their value now.
        self.stream.append((copy, {h: self.device_slot(d) for d, h in zip(device_slots, host_slots)}))
        assert torch.equal(before[0], self.store.k) and torch.equal(before[1], self.store.v)

    @precondition(lambda self: self.stream)
    @rule(count=st.integers(1, 3))
    def land(self, count):
        """The stream reaches the next `count` copies: only now do they move their data."""
        for copy, values in self.stream[:count]:
            self.store.copy_now([copy], self.caches)
            self.landed.add(copy.ticket)
            self.saved.update(values)
        self.stream = self.stream[count:]

    @rule()
    def poll(self):
        done = self.store.inflight.poll()
        self.reported += [c.ticket for c in done]
        assert all(c.ticket in self.landed for c in done), "the ledger reported a copy that did not land"
        assert self.actions_run == [t for t in self.reported if t in self.streamed], \
            "each landing's actions run once, at the poll, in order"

    @invariant()
    def ledger_holds_exactly_what_did_not_land_or_was_not_polled(self):
        pending = [c.ticket for c in self.store.inflight.pending()]
        assert pending == sorted(pending), "in-flight copies out of issue order"
        assert {c.ticket for c, _ in self.stream} <= set(pending), "an unlanded copy left the ledger"
        assert not set(pending) & set(self.reported), "a reported copy is still in flight"

    @invariant()
    def ownership_is_consistent(self):
        self.store.check_invariants()
        for owner, blocks in self.owned.items():
            assert sorted(self.store.blocks_of(owner)) == sorted(blocks)

    def teardown(self):
        self.land(len(self.stream)) if self.stream else None
        self.poll()
        assert not self.store.inflight.pending()
        for owner in list(self.owned):
            self.store.free(owner)
        self.store.check_invariants()
        assert self.store.num_free_blocks == HOST_BLOCKS  # nothing leaked


TestHostStore = HostStoreMachine.TestCase
TestHostStore.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


def test_move_reads_every_source_before_writing():
    store = HostKVStore(0, 2, 1, 1, 1, torch.float32)
    k = torch.arange(4.0).view(2, 2, 1, 1)
    v = k.clone()
    store.execute([KVCopy("move", (0, 1, 2), (1, 2, 3))], [(k, v)])  # overlapping shift
    assert k.flatten().tolist() == [0.0, 0.0, 1.0, 2.0]


def test_bad_copies_and_foreign_frees_are_refused():
    store = HostKVStore(2, 2, 1, 1, 1, torch.float32)
    with pytest.raises(ValueError):
        KVCopy("swap", (1,), (2,))
    with pytest.raises(ValueError):
        KVCopy("save", (1, 2), (2,))
    store.allocate("a", 1)
    with pytest.raises(ValueError):
        store.free("b", store.blocks_of("a"))


def test_the_ledger_runs_actions_once_and_forgets_retired_copies():
    ledger = InflightCopies()
    first, second = KVCopy("save", (0,), (0,)), KVCopy("load", (0,), (1,), reader="r")
    landed: set[int] = set()
    seen: list[str] = []
    ledger.when_landed(first, lambda: seen.append("first"))  # registered while only planned
    for copy in (first, second):
        ledger.issue(copy, lambda t=copy.ticket: t in landed)
    with pytest.raises(ValueError):
        ledger.issue(first, lambda: True)  # a copy is issued once
    assert ledger.poll() == [] and seen == []
    landed.add(first.ticket)
    assert ledger.poll() == [first] and seen == ["first"] and ledger.pending() == [second]
    assert ledger.poll() == [] and seen == ["first"]
    assert second.needed_by({"r"}) and not second.needed_by({"x"}) and not first.needed_by({"r"})
    assert ledger.forget([second.ticket]) == [] and ledger.pending() == []  # no wait handle on a CPU
    ledger.check_invariants()


def test_a_cpu_store_lands_copies_when_they_are_issued():
    store = HostKVStore(2, 2, 1, 1, 1, torch.float32)
    k = torch.arange(4.0).view(2, 2, 1, 1)
    host = store.allocate("a", 1)
    copy = KVCopy("save", (2, 3), tuple(store.slots(host[0])))
    store.execute([copy], [(k, k.clone())])
    assert store.k[0, :2].flatten().tolist() == [2.0, 3.0]
    assert store.inflight.poll() == [copy]
    store.wait_for({"anyone"})  # nothing to wait for on a CPU
    store.retire([copy.ticket])


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_pipeline_stage_stores_only_its_layers(layerwise):
    """A stage holding layers 2-3 of 4 keeps two rows of K and V (its share of the pinned host
    budget, which is sized per stage), and a save then a load moves those layers' K/V."""
    store = HostKVStore(2, 2, 4, 1, 1, torch.float32, pin_memory=False, layerwise=layerwise, layers=range(2, 4))
    assert store.k.shape == store.v.shape == (2, 4, 1, 1)
    caches = [None, None] + [(torch.arange(8.0).view(4, 2, 1, 1) + 10 * i, -torch.arange(8.0).view(4, 2, 1, 1))
                             for i in (2, 3)]
    host = store.allocate("a", 1)
    store.execute_step([[KVCopy("save", (2, 3), tuple(store.slots(host[0])))]], caches)
    assert store.k[:, :2].flatten().tolist() == [22.0, 23.0, 32.0, 33.0]  # rows: layers 2 and 3
    store.execute_step([[KVCopy("load", tuple(store.slots(host[0])), (6, 7))]], caches)
    assert [caches[i][0].view(-1)[6:].tolist() for i in (2, 3)] == [[22.0, 23.0], [32.0, 33.0]]
    assert caches[3][1].view(-1)[6:].tolist() == [-2.0, -3.0]


# -- layer by layer (HostKVStore(layerwise=True)) ---------------------------------------------

def _fresh(layerwise: bool) -> tuple[HostKVStore, list[tuple[torch.Tensor, torch.Tensor]]]:
    store = HostKVStore(HOST_BLOCKS, BLOCK, LAYERS, 1, 2, torch.float32, pin_memory=False, layerwise=layerwise)
    g = torch.Generator().manual_seed(0)
    store.k.copy_(torch.randn(store.k.shape, generator=g))
    store.v.copy_(torch.randn(store.v.shape, generator=g))
    caches = [(torch.randn(DEVICE_BLOCKS, BLOCK, 1, 2, generator=g),
               torch.randn(DEVICE_BLOCKS, BLOCK, 1, 2, generator=g))
              for _ in range(LAYERS)]
    return store, caches


@st.composite
def copy_groups(draw) -> list[list[KVCopy]]:
    """1-3 groups of saves, moves and loads over the same few slots, so later copies read what
    earlier ones wrote (a save then a load of one host slot, a move then a save of its target)."""
    device, host = st.integers(0, 7), st.integers(0, 7)
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        group = []
        for kind in draw(st.lists(st.sampled_from(["save", "move", "load"]), min_size=1, max_size=4)):
            n = draw(st.integers(1, 3))
            dst = draw(st.lists(host if kind == "save" else device, min_size=n, max_size=n, unique=True))
            src = draw(st.lists(device if kind != "load" else host, min_size=n, max_size=n, unique=True))
            group.append(KVCopy(kind, tuple(src), tuple(dst)))
        # One destination slot per kind in a group, as the managers plan them: no write races.
        seen: dict[str, set[int]] = {}
        group = [c for c in group if not seen.setdefault(c.kind, set()) & set(c.dst) and not seen[c.kind].update(c.dst)]
        groups.append(group)
    return groups


@settings(max_examples=150, deadline=None)
@given(groups=copy_groups())
def test_layer_by_layer_leaves_device_and_host_exactly_as_group_after_group(groups):
    """Layer-major issue (every group's layer-0 part, then layer 1's, ...) keeps each layer's
    order of saves, moves and loads group after group, so the caches end bit-identical."""
    whole, whole_kv = _fresh(False)
    streamed, streamed_kv = _fresh(True)
    whole.execute_step(groups, whole_kv)
    streamed.execute_step(groups, streamed_kv)
    assert torch.equal(whole.k, streamed.k) and torch.equal(whole.v, streamed.v)
    for (k1, v1), (k2, v2) in zip(whole_kv, streamed_kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    issued = [c for g in groups for c in g]
    assert streamed.inflight.poll() == issued  # on a CPU every copy has landed, in issue order
    streamed.wait_for({"anyone"})  # no CUDA events: nothing to wait for, per layer or whole
    assert not streamed.has_layer_waits
