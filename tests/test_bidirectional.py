"""BidirectionalBlockManager (BROS §5): unit checks, and a hypothesis state machine that runs
every returned KVCopy on real tensors and checks, after every step, that each position still on
the device reads back exactly the value written for it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.memory.bidirectional import BidirectionalBlockManager
from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.host import HostKVStore

B, LAYERS = 4, 2


class Harness:
    """A manager plus tiny real caches: writes a unique value per (sequence, position) and
    executes every copy the manager asks for."""

    def __init__(self, num_blocks: int, host_blocks: int):
        self.store = HostKVStore(host_blocks, B, LAYERS, 1, 2, torch.float32, pin_memory=False)
        self.manager = BidirectionalBlockManager(num_blocks, B, self.store)
        self.caches = [(torch.zeros(num_blocks, B, 1, 2), torch.zeros(num_blocks, B, 1, 2)) for _ in range(LAYERS)]
        self.ids: dict[str, int] = {}

    def value(self, seq: str, position: int, layer: int, v: bool) -> torch.Tensor:
        base = (self.ids.setdefault(seq, len(self.ids) + 1) * 1000 + position) * 8 + layer * 2 + v
        return torch.tensor([base, -base], dtype=torch.float32)

    def run(self, copies) -> None:
        self.store.execute(copies, self.caches)

    def write(self, seq: str, start: int, end: int) -> None:
        """The forward pass: store K/V for positions [start, end) at their slots."""
        for position, slot in zip(range(start, end), self.manager.slot_mapping(seq, start, end)):
            for layer, (k, v) in enumerate(self.caches):
                k.view(-1, 1, 2)[slot] = self.value(seq, position, layer, False)
                v.view(-1, 1, 2)[slot] = self.value(seq, position, layer, True)

    def grow(self, seq: str, num_tokens: int, *, best_effort: bool, victims=()) -> None:
        start = self.manager.num_tokens(seq) if self.manager.has(seq) else 0
        self.run(self.manager.allocate(seq, num_tokens, best_effort=best_effort, victims=victims))
        self.write(seq, start, num_tokens)

    def restore(self, seq: str) -> None:
        self.run(self.manager.ensure_resident(seq))

    def check_values(self, seq: str) -> None:
        missing = set(self.manager.missing_positions(seq))
        n = self.manager.num_tokens(seq)
        resident = [p for p in range(n) if p not in missing]
        if not resident:
            return
        slots = {p: s for p, s in zip(range(n), self.manager.slot_mapping(seq, 0, n))} if not missing else None
        for position in resident:
            slot = slots[position] if slots else self.manager.slot_mapping(seq, position, position + 1)[0]
            for layer, (k, v) in enumerate(self.caches):
                assert torch.equal(k.view(-1, 1, 2)[slot, 0], self.value(seq, position, layer, False)), (seq, position)
                assert torch.equal(v.view(-1, 1, 2)[slot, 0], self.value(seq, position, layer, True)), (seq, position)


def test_slot_mapping_follows_direction():
    h = Harness(num_blocks=4, host_blocks=0)
    h.grow("rt", 5, best_effort=False)
    h.grow("be", 5, best_effort=True)
    m = h.manager
    rt, be = m.block_table("rt"), m.block_table("be")
    assert m.slot_mapping("rt", 0, 5) == [rt[0] * B + i for i in range(4)] + [rt[1] * B]
    assert m.slot_mapping("be", 0, 5) == [be[0] * B + 3 - i for i in range(4)] + [be[1] * B + 3]
    assert not m.is_best_effort("rt") and m.is_best_effort("be")
    m.check_invariants()


def test_be_takes_the_block_with_most_empty_slots():
    h = Harness(num_blocks=3, host_blocks=0)
    m = h.manager
    h.grow("a", 4, best_effort=False)  # fills a block
    h.grow("b", 1, best_effort=False)  # 3 empty slots
    h.grow("c", 2, best_effort=False)  # 2 empty slots
    h.grow("x", 2, best_effort=True)
    assert m.block_table("x") == m.block_table("b")  # no free block: b's block has the most room
    assert m.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        m.allocate("y", 3, best_effort=True)  # c's block has room for 2 only
    h.grow("y", 2, best_effort=True)
    assert m.block_table("y") == m.block_table("c")
    m.check_invariants()


def test_be_prefers_a_free_block():
    h = Harness(num_blocks=2, host_blocks=0)
    h.grow("r", 1, best_effort=False)
    h.grow("x", 1, best_effort=True)
    assert h.manager.block_table("x") != h.manager.block_table("r")


def test_rt_preempts_the_emptiest_be_block_and_saves_only_overwritten_slots():
    h = Harness(num_blocks=2, host_blocks=2)
    m = h.manager
    h.grow("full", 4, best_effort=True)
    h.grow("part", 2, best_effort=True)  # slots 3, 2 of its block; slots 0, 1 empty
    h.grow("rt", 2, best_effort=False)  # no free block: shares part's block without overwriting
    assert m.block_table("rt") == m.block_table("part") and m.preemptions == 1
    assert m.checkpointed_slots == 0
    assert h.store.num_free_blocks == 2
    h.grow("rt", 3, best_effort=False)  # slot 2 held part's position 1: saved, then overwritten
    assert m.checkpointed_slots == 1 and m.overwrites == 1
    assert m.missing_positions("part") == [1] and m.missing_positions("full") == []
    entry = m.preemption_table[("part", 0)]
    assert entry.block == m.block_table("rt")[0] and list(entry.host_slots) == [1]
    assert h.store.num_free_blocks == 1
    h.check_values("part")
    h.check_values("rt")
    m.check_invariants()


def test_restore_moves_survivors_and_loads_lost_slots():
    h = Harness(num_blocks=3, host_blocks=2)
    m = h.manager
    h.grow("full", 4, best_effort=True)
    h.grow("other", 4, best_effort=True)
    h.grow("be", 3, best_effort=True)
    h.grow("rt", 3, best_effort=False)  # overwrites be's positions 1 and 2 (slots 2, 1)
    assert m.missing_positions("be") == [1, 2]
    m.free("full")
    h.run(m.ensure_resident("be"))
    assert m.missing_positions("be") == [] and m.relocated_pages == 1 and m.restored_pages == 1
    assert m.block_table("be") != m.block_table("rt")
    assert h.store.num_free_blocks == 2 and not m.preemption_table
    h.check_values("be")
    h.check_values("rt")
    m.check_invariants()


def test_restore_in_place_once_the_rt_page_left():
    h = Harness(num_blocks=1, host_blocks=1)
    m = h.manager
    h.grow("be", 4, best_effort=True)
    h.grow("rt", 2, best_effort=False)
    m.free("rt")
    block = m.block_table("be")
    h.restore("be")
    assert m.block_table("be") == block and m.relocated_pages == 0
    h.check_values("be")
    m.check_invariants()


def test_be_growth_into_rt_slots_relocates_the_page():
    h = Harness(num_blocks=2, host_blocks=0)
    m = h.manager
    h.grow("rt", 2, best_effort=False)
    h.grow("filler", 4, best_effort=True)  # takes the free block
    h.grow("be", 2, best_effort=True)  # shares rt's block
    h.grow("be", 1, best_effort=True)  # no-op: never shrinks
    shared = m.block_table("be")[0]
    assert shared == m.block_table("rt")[0]
    m.free("filler")
    h.grow("be", 3, best_effort=True)  # slot 1 is RT's: the page moves to the free block
    assert m.block_table("be")[0] != shared and m.relocated_pages == 1
    h.check_values("be")
    m.check_invariants()


def test_last_resort_drops_only_the_victims_it_needs_and_restores_them():
    h = Harness(num_blocks=2, host_blocks=4)
    m = h.manager
    h.grow("be", 4, best_effort=True)
    h.grow("old_rt", 4, best_effort=False)
    h.grow("rt", 1, best_effort=False)  # preempts be's block, saving be's position 3
    assert m.missing_positions("be") == [3]
    with pytest.raises(NoFreeBlocksError):
        m.allocate("urgent", 4, best_effort=False)  # every block has an RT page
    h.grow("urgent", 4, best_effort=False, victims=["be", "old_rt"])
    # Dropping be frees no RT side, so only old_rt goes, swapped out to the host.
    assert m.swap_outs == 1 and m.missing_positions("old_rt") == [0, 1, 2, 3]
    assert m.missing_positions("be") == [3]
    with pytest.raises(ValueError):
        m.block_table("old_rt")
    m.free("urgent")
    h.restore("old_rt")
    h.check_values("old_rt")
    m.check_invariants()


def test_last_resort_drops_be_first_when_the_host_cannot_take_a_checkpoint():
    h = Harness(num_blocks=2, host_blocks=0)
    m = h.manager
    h.grow("be", 4, best_effort=True)
    h.grow("old_rt", 4, best_effort=False)
    with pytest.raises(NoFreeBlocksError):
        m.allocate("urgent", 2, best_effort=False)  # overwriting be needs a host block
    h.grow("urgent", 2, best_effort=False, victims=["old_rt", "be"])
    assert not m.has("be") and m.recomputes == 1 and m.missing_positions("old_rt") == []
    h.check_values("old_rt")
    m.check_invariants()


def test_a_be_request_swapped_out_whole_restores_exactly_when_enough_blocks_have_a_free_be_side():
    """`can_grow`'s count before its what-if (`_be_restore_out_of_reach`): each page swapped out
    whole needs a block whose BE side is unused, a free one or an RT-only one with room. At
    exactly as many such blocks as pages it must say yes, and the restore succeed."""
    h = Harness(num_blocks=4, host_blocks=4)
    m = h.manager
    h.grow("be", 6, best_effort=True)  # pages of 4 and 2 positions
    h.run(m.drop("be").copies)  # swapped out whole
    h.grow("other", 4, best_effort=True)
    h.grow("x", 1, best_effort=True)
    h.grow("rt", 1, best_effort=False)  # an RT-only block: room for be's 2-position page
    assert m.num_free_blocks == 1 and m.missing_positions("be") == list(range(6))
    assert m.can_grow("be", 6, best_effort=True)  # page 0 to the free block, page 1 beside rt
    h.grow("y", 1, best_effort=True)  # the free block: one block short
    assert not m.can_grow("be", 6, best_effort=True)
    m.free("y")
    h.run(m.grow("be", 6, best_effort=True))  # restores both pages, in one execute
    assert m.missing_positions("be") == []
    h.check_values("be")
    m.check_invariants()


def test_drop_reports_recompute_when_host_is_full():
    h = Harness(num_blocks=2, host_blocks=0)
    m = h.manager
    h.grow("a", 3, best_effort=False)
    result = m.drop("a")
    assert result.recompute and not result.copies and not m.has("a") and m.recomputes == 1
    m.check_invariants()


def test_freeing_everything_frees_every_block_and_host_block():
    h = Harness(num_blocks=3, host_blocks=3)
    m = h.manager
    h.grow("be", 9, best_effort=True)
    h.grow("rt", 6, best_effort=False)
    h.run(m.drop("be").copies)
    h.grow("rt2", 4, best_effort=False)
    for seq in ("be", "rt", "rt2"):
        m.free(seq)
    m.check_invariants()
    assert m.num_free_blocks == 3 and h.store.num_free_blocks == 3 and not m.preemption_table


def test_grow_restores_with_room_to_grow_so_one_execute_is_safe():
    h = Harness(num_blocks=2, host_blocks=2)
    m = h.manager
    h.grow("be", 3, best_effort=True)  # block 0, slots 3, 2, 1
    h.grow("filler", 4, best_effort=True)  # block 1
    h.grow("rt", 2, best_effort=False)  # shares block 0 and overwrites be's position 2 (slot 1)
    assert m.missing_positions("be") == [2]
    m.free("rt")
    h.grow("rt2", 1, best_effort=False)  # block 0 again, slot 0 only: be could load in place...
    m.free("filler")
    assert m.can_grow("be", 4, best_effort=True) and not m.can_allocate("be", 4, best_effort=True)
    h.run(m.grow("be", 4, best_effort=True))  # ...but must grow to 4: restore to block 1, in ONE execute
    h.write("be", 3, 4)
    assert m.block_table("be") == [1] and m.missing_positions("be") == []
    h.check_values("be")
    h.check_values("rt2")
    m.check_invariants()


def test_rt_never_overwrites_a_pinned_sequence():
    h = Harness(num_blocks=1, host_blocks=2)
    m = h.manager
    h.grow("be", 4, best_effort=True)
    m.pinned.add("be")  # this step's forward reads be's slots
    assert not m.can_grow("rt", 1, best_effort=False)
    with pytest.raises(NoFreeBlocksError):
        m.grow("rt", 1, best_effort=False)
    m.pinned.clear()
    assert m.can_grow("rt", 1, best_effort=False)  # nothing else changed: the remembered miss is stale
    h.run(m.grow("rt", 1, best_effort=False))
    assert m.missing_positions("be") == [3]
    m.check_invariants()


RT_NAMES, BE_NAMES = ["r0", "r1", "r2"], ["b0", "b1", "b2"]
RT_SEQS, BE_SEQS = st.sampled_from(RT_NAMES), st.sampled_from(BE_NAMES)


class BidirectionalMachine(RuleBasedStateMachine):
    """Random RT/BE growth, frees, restores and drops, with every copy executed on real caches."""

    def __init__(self):
        super().__init__()
        self.h = Harness(num_blocks=5, host_blocks=5)
        self.m = self.h.manager

    def live(self) -> list[str]:
        return [s for s in RT_NAMES + BE_NAMES if self.m.has(s)]

    def _grow(self, seq, extra, best_effort, victims=()):
        m = self.m
        if m.has(seq) and m.missing_positions(seq):
            with pytest.raises(ValueError):
                m.allocate(seq, m.num_tokens(seq) + extra, best_effort=best_effort)
            return
        target = (m.num_tokens(seq) if m.has(seq) else 0) + extra
        can = m.can_allocate(seq, target, best_effort=best_effort)
        before = (m.num_free_blocks, self.h.store.num_free_blocks, dict(m.preemption_table))
        try:
            self.h.grow(seq, target, best_effort=best_effort, victims=victims)
        except NoFreeBlocksError:
            assert not can
            assert (m.num_free_blocks, self.h.store.num_free_blocks, dict(m.preemption_table)) == before
            return
        assert can or victims
        assert m.num_tokens(seq) == target

    @rule(seq=RT_SEQS, extra=st.integers(0, 7), data=st.data())
    def grow_rt(self, seq, extra, data):
        victims = ()
        if data.draw(st.booleans(), label="may drop others"):
            victims = data.draw(st.permutations([s for s in RT_NAMES + BE_NAMES if s != seq]))
        self._grow(seq, extra, best_effort=False, victims=victims)

    @rule(seq=BE_SEQS, extra=st.integers(0, 7))
    def grow_be(self, seq, extra):
        self._grow(seq, extra, best_effort=True)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def decode_one(self, data):
        """One more token: partial pages grow in place, into their neighbours' slots."""
        seq = data.draw(st.sampled_from(self.live()))
        if self.m.missing_positions(seq):
            self.restore(seq)
        if not self.m.missing_positions(seq):
            self._grow(seq, 1, best_effort=self.m.is_best_effort(seq))

    @rule(seq=st.one_of(RT_SEQS, BE_SEQS), extra=st.integers(0, 5))
    def restore_and_grow(self, seq, extra):
        """`grow`: restore then allocate, all copies in ONE execute; `can_grow` is exact."""
        m, best_effort = self.m, seq in BE_NAMES
        target = (m.num_tokens(seq) if m.has(seq) else 0) + extra
        pinned = {s: m.missing_positions(s) for s in m.pinned}
        can = m.can_grow(seq, target, best_effort=best_effort)
        before = (m.num_free_blocks, self.h.store.num_free_blocks, dict(m.preemption_table))
        start = m.num_tokens(seq) if m.has(seq) else 0
        try:
            self.h.run(m.grow(seq, target, best_effort=best_effort))
        except NoFreeBlocksError:
            assert not can
            assert (m.num_free_blocks, self.h.store.num_free_blocks, dict(m.preemption_table)) == before
            return
        assert can and m.num_tokens(seq) == target and not m.missing_positions(seq)
        self.h.write(seq, start, target)
        assert all(m.missing_positions(s) == lost for s, lost in pinned.items() if s != seq), "pinned overwritten"

    @rule(seq=st.one_of(RT_SEQS, BE_SEQS), extra=st.integers(0, 5))
    def try_grow(self, seq, extra):
        """`try_grow`: `grow` where `can_grow` says yes, None and no change where it says no."""
        m, best_effort = self.m, seq in BE_NAMES
        target = (m.num_tokens(seq) if m.has(seq) else 0) + extra
        can = m.can_grow(seq, target, best_effort=best_effort)
        before = (m.num_free_blocks, self.h.store.num_free_blocks, dict(m.preemption_table))
        start = m.num_tokens(seq) if m.has(seq) else 0
        copies = m.try_grow(seq, target, best_effort=best_effort)
        if copies is None:
            assert not can
            assert (m.num_free_blocks, self.h.store.num_free_blocks, dict(m.preemption_table)) == before
            return
        assert can
        self.h.run(copies)
        assert m.num_tokens(seq) == max(start, target) and not m.missing_positions(seq)
        self.h.write(seq, start, max(start, target))

    @rule(asks=st.lists(st.tuples(RT_SEQS, st.integers(0, 40)), min_size=2, max_size=8))
    def ask_rt_in_a_row(self, asks):
        """RT questions with nothing changing between them, as BROS asks its waiting queue: an
        answer taken from a remembered miss is the one a full search gives."""
        m = self.m
        answers = [(seq, target, m.can_grow(seq, target, best_effort=False))
                   for seq, extra in asks for target in [(m.num_tokens(seq) if m.has(seq) else 0) + extra]]
        for seq, target, can in answers:
            m._rt_miss = None  # forget, so that this answer comes from a search
            assert m.can_grow(seq, target, best_effort=False) == can, (seq, target)
        m._rt_miss = None
        if not m.can_place_rt_page():  # then no new or swapped-out RT sequence gains a page
            assert not m.can_grow("a new one", 1, best_effort=False)
            for seq, target, can in answers:
                swapped = m.has(seq) and all(block is None for block in m.pool.seqs[seq].pages)
                assert not (can and target > 0 and (swapped or not m.has(seq))), (seq, target)

    @rule(seq=st.one_of(RT_SEQS, BE_SEQS), pin=st.booleans())
    def pin(self, seq, pin):
        if pin and self.m.has(seq):
            self.m.pinned.add(seq)
        else:
            self.m.pinned.discard(seq)

    @rule(seq=st.one_of(RT_SEQS, BE_SEQS))
    def finish(self, seq):
        self.m.free(seq)
        assert not self.m.has(seq)

    @rule(seq=st.one_of(RT_SEQS, BE_SEQS))
    def restore(self, seq):
        if not self.m.has(seq):
            return
        missing = self.m.missing_positions(seq)
        try:
            self.h.restore(seq)
        except NoFreeBlocksError:
            assert self.m.missing_positions(seq) == missing
            return
        assert self.m.missing_positions(seq) == []

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def drop(self, data):
        seq = data.draw(st.sampled_from(self.live()))
        result = self.m.drop(seq)
        self.h.run(result.copies)
        assert result.recompute != self.m.has(seq)

    @invariant()
    def manager_invariants(self):
        self.m.check_invariants()

    @invariant()
    def every_resident_position_reads_back_its_own_value(self):
        for seq in self.live():
            self.h.check_values(seq)

    def teardown(self):
        for seq in self.live():
            self.m.free(seq)
        self.m.check_invariants()
        assert self.m.num_free_blocks == self.m.num_blocks
        assert self.h.store.num_free_blocks == self.h.store.num_blocks


TestBidirectionalMachine = BidirectionalMachine.TestCase
TestBidirectionalMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get", "read", "set", "setdefault", "pop", "contains"]),
                          st.integers(0, 5), st.integers(0, 99)), max_size=30))
def test_what_if_table_acts_as_a_deep_copy_and_leaves_the_real_one_alone(ops):
    """`CopyOnRead`, the what-if twin's overlay, answers every question as a deep copy of the
    real table would, and never changes the real table or its records."""
    import copy

    from nanoserve.memory.bidirectional_index import CopyOnRead

    real = {k: [k] for k in range(0, 6, 2)}  # mutable records, as SeqState and PreemptedPage are
    before = copy.deepcopy(real)
    model, twin = copy.deepcopy(real), CopyOnRead(real, lambda record: list(record))
    for op, key, value in ops:
        if op == "get":
            assert twin.get(key, "none") == model.get(key, "none")
        elif op == "read":
            if key in model:
                twin[key].append(value)  # a trial mutates the record it read
                model[key].append(value)
            else:
                with pytest.raises(KeyError):
                    twin[key]
        elif op == "set":
            twin[key] = model[key] = [value]
        elif op == "setdefault":
            assert twin.setdefault(key, [value]) == model.setdefault(key, [value])
        elif op == "pop":
            assert twin.pop(key, None) == model.pop(key, None)
        else:
            assert (key in twin) == (key in model)
        assert dict(twin.items()) == model and len(twin) == len(model) and sorted(twin) == sorted(model)
    assert real == before
