"""BlockPool: unit checks plus a hypothesis state machine that checks every invariant after
every operation."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.memory.blocks import BlockPool, NoFreeBlocksError


def test_allocate_grows_block_by_block():
    pool = BlockPool(num_blocks=4, block_size=4)
    assert pool.allocate("a", 3) and len(pool.block_table("a")) == 1
    assert pool.allocate("a", 4) == []  # still fits in the first block
    assert len(pool.allocate("a", 5)) == 1
    assert pool.num_free_blocks == 2
    table = pool.block_table("a")
    assert pool.slot_mapping("a", 0, 5) == [table[0] * 4 + i for i in range(4)] + [table[1] * 4]
    pool.check_invariants()


def test_allocation_is_all_or_nothing():
    pool = BlockPool(num_blocks=2, block_size=4)
    pool.allocate("a", 4)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate("b", 9)  # needs 3 blocks, 1 free
    assert not pool.has("b") and pool.num_free_blocks == 1
    pool.check_invariants()


def test_slot_mapping_refuses_unreserved_positions():
    pool = BlockPool(num_blocks=2, block_size=4)
    pool.allocate("a", 3)
    with pytest.raises(IndexError):
        pool.slot_mapping("a", 0, 4)


SEQS = st.sampled_from([f"s{i}" for i in range(6)])


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate/grow/free sequences against a model of what each sequence reserved."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(num_blocks=16, block_size=4)
        self.reserved: dict[str, int] = {}
        self.retiring: set[int] = set()

    @rule(seq=SEQS, extra=st.integers(0, 24))
    def allocate(self, seq, extra):
        target = self.reserved.get(seq, 0) + extra
        free_before = self.pool.num_free_blocks
        need = self.pool.blocks_needed(seq, target)
        if need > free_before:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(seq, target)
            assert self.pool.num_free_blocks == free_before
        else:
            added = self.pool.allocate(seq, target)
            assert len(added) == need
            self.reserved[seq] = target

    @rule(seq=SEQS, extra=st.integers(0, 24))
    def try_allocate(self, seq, extra):
        """One call, the same outcome as can_allocate then allocate; None changes nothing."""
        target = self.reserved.get(seq, 0) + extra
        free_before, table_before = self.pool.num_free_blocks, list(self.pool.block_table(seq))
        fits = self.pool.can_allocate(seq, target)
        added = self.pool.try_allocate(seq, target)
        if not fits:
            assert added is None and self.pool.num_free_blocks == free_before
            assert self.pool.block_table(seq) == table_before
        else:
            assert added is not None and self.pool.block_table(seq) == table_before + added
            self.reserved[seq] = target

    @precondition(lambda self: self.reserved)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.reserved)))
        owned = len(self.pool.block_table(seq))
        free_before = self.pool.num_free_blocks
        retiring = len(set(self.pool.block_table(seq)) & self.retiring)
        assert self.pool.free(seq) == owned
        assert self.pool.num_free_blocks == free_before + owned - retiring  # retired ones stay out
        del self.reserved[seq]

    @rule(blocks=st.sets(st.integers(0, 15), max_size=6))
    def retire(self, blocks):
        """KunServe's background restore retires the blocks the returning weights need."""
        free = set(self.pool._free)
        self.pool.retire(blocks)
        self.retiring |= blocks
        assert self.pool.num_retiring_blocks == len(self.retiring)
        assert free & blocks <= self.pool.retired_free and not set(self.pool._free) & blocks
        owned = {b for s in self.reserved for b in self.pool.block_table(s)}
        assert self.pool.retired_free == frozenset(self.retiring - owned)

    @rule()
    def unretire(self):
        self.pool.unretire()
        self.retiring = set()
        assert self.pool.num_retiring_blocks == 0 and not self.pool.retired_free

    @rule(seq=SEQS)
    def free_unknown_is_noop(self, seq):
        if seq not in self.reserved:
            assert self.pool.free(seq) == 0

    @invariant()
    def pool_invariants(self):
        self.pool.check_invariants()

    @invariant()
    def owned_plus_free_is_total(self):
        owned = sum(len(self.pool.block_table(s)) for s in self.reserved)
        retired = len(self.pool.retired_free)
        assert owned + self.pool.num_free_blocks + retired == self.pool.num_blocks
        assert self.pool.num_used_blocks == owned

    @invariant()
    def slot_mapping_matches_tables(self):
        size = self.pool.block_size
        seen: set[int] = set()
        for seq, n in self.reserved.items():
            table = self.pool.block_table(seq)
            slots = self.pool.slot_mapping(seq, 0, n)
            assert [s // size for s in slots] == [table[p // size] for p in range(n)]
            assert [s % size for s in slots] == [p % size for p in range(n)]
            assert not seen & set(slots), "two sequences map to the same slot"
            seen.update(slots)

    def teardown(self):
        for seq in list(self.reserved):
            self.pool.free(seq)
        self.pool.unretire()
        assert self.pool.num_free_blocks == self.pool.num_blocks  # all free once all are gone
        self.pool.check_invariants()


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
