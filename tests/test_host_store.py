"""HostKVStore: host block ownership under any sequence of operations, and copies that bring
K/V back bit-identical."""
from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.memory.blocks import NoFreeBlocksError
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

    @precondition(lambda self: any(self.owned.values()))
    @rule(data=st.data())
    def save(self, data):
        blocks = [b for held in self.owned.values() for b in held]
        host_slots = data.draw(st.lists(st.sampled_from([s for b in blocks for s in self.store.slots(b)]),
                                        min_size=1, max_size=6, unique=True))
        device_slots = data.draw(st.lists(st.integers(0, DEVICE_BLOCKS * BLOCK - 1), min_size=len(host_slots),
                                          max_size=len(host_slots)))
        self.store.execute([KVCopy("save", tuple(device_slots), tuple(host_slots))], self.caches)
        for d, h in zip(device_slots, host_slots):
            self.saved[h] = self.device_slot(d)

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def load(self, data):
        host_slots = data.draw(st.lists(st.sampled_from(sorted(self.saved)), min_size=1, max_size=6, unique=True))
        device_slots = data.draw(st.lists(st.integers(0, DEVICE_BLOCKS * BLOCK - 1), min_size=len(host_slots),
                                          max_size=len(host_slots), unique=True))
        self.store.execute([KVCopy("load", tuple(host_slots), tuple(device_slots))], self.caches)
        for d, h in zip(device_slots, host_slots):
            assert all(torch.equal(a, b) for a, b in zip(self.device_slot(d), self.saved[h]))

    @invariant()
    def ownership_is_consistent(self):
        self.store.check_invariants()
        for owner, blocks in self.owned.items():
            assert sorted(self.store.blocks_of(owner)) == sorted(blocks)

    def teardown(self):
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
