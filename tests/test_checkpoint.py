"""IncrementalCheckpointer (ConServe §4.4): unit checks, plus a hypothesis state machine that
writes a unique value for every (sequence, position) into small real KV caches and checks after
every operation that each resident position and each checkpointed position reads back exactly.
In the machine copies are in flight: they move their data only when the test lands them, in
issue order, as one copy stream would, while forwards keep writing."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_harness import StandInStream

from nanoserve.memory.blocks import BlockPool, NoFreeBlocksError
from nanoserve.memory.checkpoint import CheckpointConfig, IncrementalCheckpointer
from nanoserve.memory.host import HostKVStore, KVCopy

B = 4
LAYERS, HEADS, HEAD_DIM = 2, 1, 2
SEQ_NAMES = [f"s{i}" for i in range(5)]


def make_store(num_blocks: int) -> HostKVStore:
    return HostKVStore(num_blocks, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)


def make_caches(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(num_blocks, B, HEADS, HEAD_DIM), torch.zeros(num_blocks, B, HEADS, HEAD_DIM))
            for _ in range(LAYERS)]


def expected(seq: str, pos: int, layer: int, is_v: bool) -> torch.Tensor:
    # Distinct per sequence, position, layer and K/V, and exact in float32.
    base = 1 + SEQ_NAMES.index(seq) * 1000 + pos + layer * 100_000
    base = -base if is_v else base
    return torch.tensor([[base, base + 0.5]], dtype=torch.float32)


def write_tokens(pool: BlockPool, caches, seq: str, start: int, end: int) -> None:
    """Stand-in for the forward pass: store K/V of positions [start, end)."""
    for pos, slot in zip(range(start, end), pool.slot_mapping(seq, start, end)):
        for layer, (k, v) in enumerate(caches):
            k.view(-1, HEADS, HEAD_DIM)[slot] = expected(seq, pos, layer, False)
            v.view(-1, HEADS, HEAD_DIM)[slot] = expected(seq, pos, layer, True)


def assert_device_holds(pool: BlockPool, caches, seq: str, num_tokens: int) -> None:
    for pos, slot in zip(range(num_tokens), pool.slot_mapping(seq, 0, num_tokens)):
        for layer, (k, v) in enumerate(caches):
            assert torch.equal(k.view(-1, HEADS, HEAD_DIM)[slot], expected(seq, pos, layer, False)), (seq, pos)
            assert torch.equal(v.view(-1, HEADS, HEAD_DIM)[slot], expected(seq, pos, layer, True)), (seq, pos)


def assert_host_holds(store: HostKVStore, seq: str, num_tokens: int, host_blocks: list[int] | None = None) -> None:
    """`host_blocks` defaults to the ones `store` says `seq` owns."""
    blocks = store.blocks_of(seq) if host_blocks is None else host_blocks
    slots = [s for b in blocks for s in store.slots(b)][:num_tokens]
    assert len(slots) == num_tokens
    for pos, slot in enumerate(slots):
        for layer in range(LAYERS):
            assert torch.equal(store.k[layer, slot], expected(seq, pos, layer, False)), (seq, pos)
            assert torch.equal(store.v[layer, slot], expected(seq, pos, layer, True)), (seq, pos)


def setup(device_blocks: int, host_blocks: int, **config):
    pool, store = BlockPool(device_blocks, B), make_store(host_blocks)
    return pool, store, make_caches(device_blocks), IncrementalCheckpointer(pool, store, CheckpointConfig(**config))


def run(store: HostKVStore, copies: list[KVCopy], caches) -> None:
    """Issue a step's copies, and poll at the next step's start (on a CPU they land at once)."""
    store.execute(copies, caches)
    store.inflight.poll()


def grow(pool, caches, seq, start, end):
    pool.allocate(seq, end)
    write_tokens(pool, caches, seq, start, end)


def saved_seqs(copies: list[KVCopy]) -> int:
    assert all(c.kind == "save" for c in copies)
    return len(copies)  # one save op per chosen sequence


# -- unit tests ---------------------------------------------------------------------------
def test_nothing_checkpointed_below_threshold():
    pool, store, caches, ckpt = setup(10, 10)
    grow(pool, caches, "s0", 0, 16)  # 4 of 10 blocks: 40%
    assert ckpt.plan_step({"s0": 16}) == []
    assert ckpt.blocks_checkpointed == 0 and store.num_free_blocks == 10
    grow(pool, caches, "s1", 0, 4)  # 50%: checkpointing starts
    assert ckpt.plan_step({"s0": 16, "s1": 4})
    assert ckpt.blocks_checkpointed > 0
    ckpt.check_invariants()


@pytest.mark.parametrize("blocks_each, chosen", [(2, 0), (3, 1), (4, 3), (5, 4)])
def test_more_sequences_checkpointed_as_usage_climbs(blocks_each, chosen):
    # 4 sequences in 20 blocks: 40%, 60%, 80%, 100% usage -> share 0, 0.2, 0.6, 1 of 4.
    pool, store, caches, ckpt = setup(20, 40, max_blocks_per_step=100)
    tokens = {s: blocks_each * B for s in SEQ_NAMES[:4]}
    for seq, n in tokens.items():
        grow(pool, caches, seq, 0, n)
    assert saved_seqs(ckpt.plan_step(tokens)) == chosen
    ckpt.check_invariants()


def test_chosen_set_is_stable_and_caller_order_comes_first():
    pool, store, caches, ckpt = setup(10, 10, max_blocks_per_step=100)
    grow(pool, caches, "s0", 0, 12)
    grow(pool, caches, "s1", 0, 8)  # 5 of 10 blocks: exactly one sequence is chosen
    copies = ckpt.plan_step({"s0": 12, "s1": 8}, order=["s1"])
    assert saved_seqs(copies) == 1 and ckpt.saved_blocks("s1") == 2 and ckpt.saved_blocks("s0") == 0
    # Without an order, the sequence already checkpointed stays the one kept current.
    grow(pool, caches, "s1", 8, 12)
    copies = ckpt.plan_step({"s0": 12, "s1": 12})
    assert saved_seqs(copies) == 1 and ckpt.saved_blocks("s1") == 3 and ckpt.saved_blocks("s0") == 0


def test_only_full_computed_blocks_are_saved_and_per_step_cap_holds():
    pool, store, caches, ckpt = setup(8, 16, threshold=0.0, max_blocks_per_step=2)
    grow(pool, caches, "s0", 0, 22)  # 5 full blocks and a partial one
    copies = ckpt.plan_step({"s0": 22})
    assert sum(len(c.src) for c in copies) == 2 * B and ckpt.saved_blocks("s0") == 2
    ckpt.plan_step({"s0": 22})
    ckpt.plan_step({"s0": 22})
    assert ckpt.saved_blocks("s0") == 5  # never the partial tail
    assert ckpt.plan_step({"s0": 22}) == []
    ckpt.check_invariants()


def test_host_exhaustion_checkpoints_less_and_never_fails():
    pool, store, caches, ckpt = setup(8, 2, threshold=0.0)
    grow(pool, caches, "s0", 0, 16)
    grow(pool, caches, "s1", 0, 16)
    ckpt.plan_step({"s0": 16, "s1": 16})
    assert store.num_free_blocks == 0 and ckpt.blocks_checkpointed == 2
    assert ckpt.plan_step({"s0": 16, "s1": 16}) == []
    ckpt.check_invariants()


def test_preempt_fully_saved_frees_device_at_once_and_prefetch_is_bit_identical():
    pool, store, caches, ckpt = setup(8, 8, threshold=0.0)
    grow(pool, caches, "s0", 0, 12)
    run(store, ckpt.plan_step({"s0": 12}), caches)
    assert ckpt.saved_tokens("s0") == 12
    host_before = (store.k.clone(), store.v.clone())
    saved_before = ckpt.blocks_checkpointed
    assert ckpt.preempt("s0") == 12
    # No copy at preemption: nothing new checkpointed, host untouched, device blocks back.
    assert ckpt.blocks_checkpointed == saved_before and ckpt.preemptions_with_checkpoint == 1
    assert torch.equal(store.k, host_before[0]) and torch.equal(store.v, host_before[1])
    assert pool.num_free_blocks == 8 and not pool.has("s0") and ckpt.is_preempted("s0")
    ckpt.check_invariants()
    # Someone else dirties the freed blocks before the resume.
    for k, v in caches:
        k.fill_(7.0), v.fill_(7.0)
    loads = ckpt.prefetch("s0")
    assert [c.kind for c in loads] == ["load"] and ckpt.prefetches == 1 and ckpt.blocks_prefetched == 3
    run(store, loads, caches)
    assert_device_holds(pool, caches, "s0", 12)
    ckpt.check_invariants()


def test_preempt_keeps_only_saved_prefix_and_tail_is_recomputed():
    pool, store, caches, ckpt = setup(8, 8, threshold=0.0)
    grow(pool, caches, "s0", 0, 10)
    run(store, ckpt.plan_step({"s0": 10}), caches)
    assert ckpt.preempt("s0") == 8  # the partial third block is not on host
    run(store, ckpt.prefetch("s0"), caches)
    grow(pool, caches, "s0", 8, 10)  # recompute the tail
    assert_device_holds(pool, caches, "s0", 10)
    assert ckpt.preempt("s0") == 8  # the host copy survived the resume: preempting again is free
    ckpt.check_invariants()


def test_preempt_without_checkpoint_forgets_the_sequence():
    pool, store, caches, ckpt = setup(8, 8)
    grow(pool, caches, "s0", 0, 10)
    assert ckpt.preempt("s0") == 0 and not pool.has("s0") and not ckpt.is_preempted("s0")
    assert ckpt.preemptions_with_checkpoint == 0
    with pytest.raises(ValueError):
        ckpt.prefetch("s0")


def test_prefetch_is_all_or_nothing():
    pool, store, caches, ckpt = setup(4, 8, threshold=0.0)
    grow(pool, caches, "s0", 0, 8)
    run(store, ckpt.plan_step({"s0": 8}), caches)
    ckpt.preempt("s0")
    grow(pool, caches, "s1", 0, 12)  # 3 of 4 blocks: no room for s0's 2
    with pytest.raises(NoFreeBlocksError):
        ckpt.prefetch("s0")
    assert ckpt.is_preempted("s0") and not pool.has("s0")
    ckpt.check_invariants()


def test_a_save_in_flight_holds_its_blocks_and_delays_the_resume_until_it_lands():
    pool, store, caches, ckpt = setup(4, 8, threshold=0.0)
    grow(pool, caches, "s0", 0, 8)
    step = ckpt.plan_step({"s0": 8})  # planned this step, not yet issued
    assert ckpt.preempt("s0") == 8  # the tokens count: their save will land
    # The blocks the save reads are held, not free: nobody's forward may overwrite them.
    assert pool.num_held_blocks == 2 and pool.num_free_blocks == 2 and not ckpt.can_resume("s0")
    with pytest.raises(ValueError, match="in flight"):
        ckpt.prefetch("s0")
    ckpt.check_invariants()
    store.execute(step, caches)  # issued; it lands, but the checkpointer learns it at the poll
    assert pool.num_held_blocks == 2
    assert [c.ticket for c in store.inflight.poll()] == [c.ticket for c in step]
    assert pool.num_held_blocks == 0 and pool.num_free_blocks == 4 and ckpt.can_resume("s0")
    for k, v in caches:  # someone else dirties the freed blocks
        k.fill_(7.0), v.fill_(7.0)
    run(store, ckpt.prefetch("s0"), caches)
    assert_device_holds(pool, caches, "s0", 8)
    assert_host_holds(store, "s0", 8)
    ckpt.check_invariants()


def test_release_with_copies_in_flight_holds_device_blocks_until_they_land():
    pool, store, caches, ckpt = setup(4, 8, threshold=0.0)
    grow(pool, caches, "s0", 0, 8)
    step = ckpt.plan_step({"s0": 8})
    store.execute(step, caches)
    ckpt.release("s0")  # before the poll: the save is not known to have landed
    assert pool.num_held_blocks == 2 and store.num_free_blocks == 8
    ckpt.check_invariants()
    store.inflight.poll()
    assert pool.num_free_blocks == 4 and ckpt.num_in_flight == 0
    ckpt.check_invariants()


def test_release_frees_everything_in_both_pools():
    pool, store, caches, ckpt = setup(8, 8, threshold=0.0)
    grow(pool, caches, "s0", 0, 9)
    grow(pool, caches, "s1", 0, 12)
    run(store, ckpt.plan_step({"s0": 9, "s1": 12}), caches)
    ckpt.preempt("s1")
    ckpt.release("s0")
    ckpt.release("s1")
    assert pool.num_free_blocks == 8 and store.num_free_blocks == 8
    ckpt.check_invariants()


def test_config_is_validated_and_frozen():
    with pytest.raises(ValueError):
        CheckpointConfig(threshold=1.5)
    with pytest.raises(ValueError):
        CheckpointConfig(max_blocks_per_step=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CheckpointConfig().threshold = 0.1  # type: ignore[misc]


# -- state machine ------------------------------------------------------------------------
SEQS = st.sampled_from(SEQ_NAMES)
DEVICE_BLOCKS, HOST_BLOCKS = 12, 8


class CheckpointMachine(RuleBasedStateMachine):
    """Grow, checkpoint, preempt, prefetch and release in any order against real caches, with
    copies in flight.

    A step's copies are planned (`planned`), then issued (`issue`: filed in the store's ledger,
    their data not yet moved), then land when the test says so (`land`: a prefix of the issue
    order, as one copy stream delivers them; only then is their data moved). The checkpointer
    learns what landed at `poll`, the step start. A forward (`grow`) first waits for the loads
    its sequence reads, as the runner does, and writes while other copies are still in flight:
    had a block an in-flight save reads been handed to it, the save would read the new data and
    the host check below would fail.
    """

    THRESHOLD = 0.3

    def __init__(self):
        super().__init__()
        self.pool, self.store = BlockPool(DEVICE_BLOCKS, B), make_store(HOST_BLOCKS)
        self.caches = make_caches(DEVICE_BLOCKS)
        config = CheckpointConfig(threshold=self.THRESHOLD, max_blocks_per_step=3)
        self.ckpt = IncrementalCheckpointer(self.pool, self.store, config)
        self.computed: dict[str, int] = {}  # resident sequences: tokens whose K/V is (or will be) on device
        self.preempted: dict[str, int] = {}  # tokens kept on host
        # Prefetching ahead (§4.4): device blocks back, loads issued a few blocks per step.
        self.restoring: dict[str, int] = {}  # tokens kept on host
        self.stream = StandInStream(self.store, self.caches)
        self.owner: dict[int, str] = {}  # ticket -> the sequence whose K/V the copy carries

    @rule()
    def issue(self):
        self.stream.issue()

    @rule(count=st.integers(0, 4))
    def land(self, count):
        self.stream.land(count)

    @rule()
    def poll(self):
        self.ckpt.check_invariants()
        self.store.inflight.poll()
        self.stream.scrub(self.pool._free)  # blocks a landed save held are free now

    @rule(seq=SEQS, extra=st.integers(1, 9))
    def grow(self, seq, extra):
        if seq in self.preempted or seq in self.restoring:
            return
        # A prefetched block is never read before its load lands: every load still in flight
        # into this sequence's blocks, whichever step issued it, is one its forward waits for.
        mine = set(self.pool.block_table(seq)) if seq in self.computed else set()
        assert all(c.needed_by({seq}) for c in self.stream.unlanded()
                   if c.kind == "load" and {s // B for s in c.dst} & mine)
        self.stream.issue()  # the executor issues the step's copies, then runs the forward,
        self.stream.land_what({seq})  # which waits for the loads it reads:
        if seq in self.computed:  # what it reads is there now, with other copies still in flight
            assert_device_holds(self.pool, self.caches, seq, self.computed[seq])
        start = self.computed.get(seq, 0)
        if not self.pool.can_allocate(seq, start + extra):
            return
        self.pool.allocate(seq, start + extra)
        self.no_block_an_unlanded_copy_touches_is_anyone_elses()  # the forward writes these blocks now
        write_tokens(self.pool, self.caches, seq, start, start + extra)
        self.computed[seq] = start + extra

    @precondition(lambda self: self.computed)
    @rule(data=st.data(), use_order=st.booleans())
    def plan(self, data, use_order):
        reported = data.draw(st.lists(st.sampled_from(sorted(self.computed)), unique=True, min_size=1))
        order = data.draw(st.permutations(reported)) if use_order else None
        usage = self.pool.num_used_blocks / self.pool.num_blocks
        before = self.ckpt.blocks_checkpointed
        copies = self.ckpt.plan_step({s: self.computed[s] for s in reported}, order)
        if usage < self.THRESHOLD:
            assert copies == []
        saved = sum(len(c.src) for c in copies) // B
        assert saved == self.ckpt.blocks_checkpointed - before <= 3
        assert all(c.kind == "save" and not c.blocking for c in copies)  # checkpoints never block
        for c in copies:
            self.owner[c.ticket] = next(s for s in reported if c.src[0] // B in self.pool.block_table(s))
        self.stream.planned += copies

    @precondition(lambda self: self.computed or self.restoring)
    @rule(data=st.data())
    def preempt(self, data):
        seq = data.draw(st.sampled_from(sorted({*self.computed, *self.restoring})))
        table = len(self.pool.block_table(seq))
        free_before, held_before = self.pool.num_free_blocks, self.pool.num_held_blocks
        saved = self.ckpt.saved_tokens(seq)
        kept = self.ckpt.preempt(seq)
        self.stream.scrub(self.pool._free)
        had = self.computed.pop(seq, None)
        assert kept == saved <= (had if had is not None else self.restoring.pop(seq))
        assert self.pool.num_free_blocks + self.pool.num_held_blocks == free_before + held_before + table
        if kept:
            self.preempted[seq] = kept

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def prefetch(self, data):
        seq = data.draw(st.sampled_from(sorted(self.preempted)))
        kept = self.preempted[seq]
        if not self.ckpt.can_resume(seq):
            with pytest.raises(ValueError):
                self.ckpt.prefetch(seq)
            return
        if not self.pool.can_allocate(seq, kept):
            with pytest.raises(NoFreeBlocksError):
                self.ckpt.prefetch(seq)
            return
        loads = self.ckpt.prefetch(seq)
        # A host copy is never read before its save landed.
        unlanded = {s for c in self.stream.unlanded() if c.kind == "save" for s in c.dst}
        assert not unlanded & {s for c in loads for s in c.src}
        assert all(c.reader == seq for c in loads)
        self.owner.update((c.ticket, seq) for c in loads)
        self.stream.planned += loads
        self.computed[seq] = self.preempted.pop(seq)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def start_prefetch(self, data):
        seq = data.draw(st.sampled_from(sorted(self.preempted)))
        if not self.ckpt.can_resume(seq) and data.draw(st.booleans()):  # let its saves land first
            self.stream.drain()
            self.poll()
        if not self.ckpt.can_resume(seq) or not self.pool.can_allocate(seq, self.preempted[seq]):
            return
        self.ckpt.start_prefetch(seq)
        assert self.ckpt.unloaded_blocks(seq) == self.preempted[seq] // B
        self.restoring[seq] = self.preempted.pop(seq)
        self.load_ahead(seq, data.draw(st.integers(0, 2)))  # the first slice, in the same step

    @precondition(lambda self: self.restoring)
    @rule(data=st.data(), count=st.integers(0, 3))
    def load_more(self, data, count):
        self.load_ahead(data.draw(st.sampled_from(sorted(self.restoring))), count)

    def load_ahead(self, seq, count):
        before = self.ckpt.unloaded_blocks(seq)
        loads = self.ckpt.load(seq, count)
        assert sum(len(c.src) for c in loads) // B == min(count, before) == before - self.ckpt.unloaded_blocks(seq)
        unlanded = {s for c in self.stream.unlanded() if c.kind == "save" for s in c.dst}
        assert not unlanded & {s for c in loads for s in c.src}
        assert all(c.reader == seq and c.kind == "load" for c in loads)
        self.owner.update((c.ticket, seq) for c in loads)
        self.stream.planned += loads
        if self.ckpt.unloaded_blocks(seq) == 0:  # every load issued: it may run (and wait for them)
            assert not self.ckpt.is_restoring(seq)
            self.computed[seq] = self.restoring.pop(seq)

    @precondition(lambda self: self.computed or self.preempted or self.restoring)
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from(sorted({*self.computed, *self.preempted, *self.restoring})))
        self.ckpt.release(seq)
        self.stream.scrub(self.pool._free)
        self.computed.pop(seq, None)
        self.preempted.pop(seq, None)
        self.restoring.pop(seq, None)

    @invariant()
    def checkpointer_invariants(self):
        self.ckpt.check_invariants()
        for seq, kept in self.preempted.items():
            assert self.ckpt.is_preempted(seq) and self.ckpt.saved_tokens(seq) == kept
        for seq, kept in self.restoring.items():
            assert self.ckpt.is_restoring(seq) and self.ckpt.saved_tokens(seq) == kept
            assert 0 < self.ckpt.unloaded_blocks(seq) <= kept // B

    @invariant()
    def no_block_an_unlanded_copy_touches_is_anyone_elses(self):
        """A device block a save (not yet landed) reads, or a load writes, is still its own
        sequence's, or held: never free, never another sequence's."""
        held = set(self.pool._held)
        for c in self.stream.unlanded():
            seq = self.owner[c.ticket]
            mine = set(self.pool.block_table(seq)) if seq in self.computed or seq in self.restoring else set()
            for block in {s // B for s in (c.src if c.kind == "save" else c.dst)}:
                assert block in mine or block in held, f"block {block} of an unlanded copy of {seq} was handed on"

    @invariant()
    def every_resident_and_saved_position_reads_back(self):
        # Land everything still planned or in flight on scratch copies of both caches.
        caches = [(k.clone(), v.clone()) for k, v in self.caches]
        store = make_store(HOST_BLOCKS)
        store.k.copy_(self.store.k), store.v.copy_(self.store.v)
        self.stream.replay(caches, store)
        for seq, n in self.computed.items():
            assert_device_holds(self.pool, caches, seq, n)
        for seq, n in self.restoring.items():  # the blocks whose loads were issued
            assert_device_holds(self.pool, caches, seq, n - self.ckpt.unloaded_blocks(seq) * B)
        for seq in [*self.computed, *self.preempted, *self.restoring]:
            assert_host_holds(store, seq, self.ckpt.saved_tokens(seq), self.store.blocks_of(seq))

    def teardown(self):
        self.stream.drain()
        self.store.inflight.poll()
        for seq in [*self.computed, *self.preempted, *self.restoring]:
            self.ckpt.release(seq)
        assert self.pool.num_free_blocks == DEVICE_BLOCKS and self.store.num_free_blocks == HOST_BLOCKS
        self.ckpt.check_invariants()


TestCheckpointMachine = CheckpointMachine.TestCase
TestCheckpointMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)


class EagerCheckpointMachine(CheckpointMachine):
    """The same, checkpointing from the first block on, so that most preemptions keep a
    checkpoint and the prefetch-ahead states (start_prefetch, then loads split over steps) are
    reached often."""
    THRESHOLD = 0.0


TestEagerCheckpointMachine = EagerCheckpointMachine.TestCase
TestEagerCheckpointMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
