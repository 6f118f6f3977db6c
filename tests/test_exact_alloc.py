"""ExactAllocator (EcoServe): unit checks of each mechanism, plus a hypothesis state machine that
writes a unique value into every KV slot it is given, runs every returned KVCopy on real tensors
and checks, after every step, every invariant and that every resident position reads back its own
value."""
from __future__ import annotations

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.exact import ExactAllocator, ExactAllocConfig
from nanoserve.memory.host import HostKVStore


def _store(num_blocks: int, block_size: int) -> HostKVStore:
    return HostKVStore(num_blocks, block_size, num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                       pin_memory=False)


def test_reservation_is_prompt_plus_padded_prediction_up_front():
    alloc = ExactAllocator(16, ExactAllocConfig(block_size=4, padding_ratio=0.15, reserved_fraction=0.125))
    assert alloc.reservation_tokens(5, 20) == 5 + 20 + 3
    assert alloc.reservation_tokens(0, 20) == 20 + 3
    # No float-noise token:
    assert ExactAllocator(8, ExactAllocConfig(block_size=4, padding_ratio=0.1)).reservation_tokens(0, 20) == 22
    assert alloc.admit("a", 5, 20, allow_hosting=False) is None
    assert len(alloc.block_table("a")) == 7  # ceil(28 / 4)
    assert alloc.num_free_blocks == 16 - 7 and alloc.reserve_left == 2 and alloc.num_admission_blocks == 16 - 2 - 7
    assert alloc.grow("a", 5) == [] and alloc.grow("a", 23) == []  # growth inside the reservation never allocates
    assert len(alloc.block_table("a")) == 7 and alloc.reserved_pool_draws == 0
    table = alloc.block_table("a")
    assert alloc.slot_mapping("a", 3, 6) == [table[0] * 4 + 3, table[1] * 4, table[1] * 4 + 1]
    with pytest.raises(IndexError):
        alloc.slot_mapping("a", 0, 29)  # past the write head
    alloc.check_invariants()


def test_admission_never_touches_the_reserved_pool():
    alloc = ExactAllocator(8, ExactAllocConfig(block_size=4, padding_ratio=0.0, reserved_fraction=0.25))
    alloc.admit("a", 0, 24, allow_hosting=False)
    with pytest.raises(NoFreeBlocksError):
        alloc.admit("b", 0, 1, allow_hosting=False)
    assert not alloc.has("b") and alloc.reserve_left == 2 and alloc.num_free_blocks == 2
    alloc.check_invariants()


def test_growth_past_the_prediction_draws_on_the_reserved_pool_then_preempts():
    alloc = ExactAllocator(8, ExactAllocConfig(block_size=4, padding_ratio=0.0, reserved_fraction=0.125))
    alloc.admit("a", 2, 10, allow_hosting=False)  # 12 tokens: 3 blocks
    alloc.grow("a", 2)
    alloc.grow("a", 10)
    assert alloc.reserved_pool_draws == 0
    assert alloc.can_grow("a", 4)
    alloc.grow("a", 4)  # 16 > 12: the one reserved block
    assert alloc.reserved_pool_draws == 1 and alloc.reserve_left == 0 and len(alloc.block_table("a")) == 4
    alloc.check_invariants()
    assert not alloc.can_grow("a", 1)  # the pool is dry
    with pytest.raises(NoFreeBlocksError):
        alloc.grow("a", 1)  # all or nothing: the caller picks whom to preempt
    assert alloc.num_written("a") == 16 and len(alloc.block_table("a")) == 4
    assert alloc.preempt("a", 14) == 1  # offload-free preemption; predicted - generated < 1: clamped
    assert not alloc.has("a") and alloc.preemptions == 1
    assert alloc.reserve_left == 1 and alloc.num_free_blocks == 8  # the charge went with the blocks
    alloc.check_invariants()


def test_preemption_re_predicts_predicted_minus_generated():
    alloc = ExactAllocator(8, ExactAllocConfig(block_size=4, padding_ratio=0.0, reserved_fraction=0.0))
    alloc.admit("a", 2, 10, allow_hosting=False)
    alloc.grow("a", 2)
    alloc.grow("a", 6)
    assert not alloc.can_grow("a", 5)  # a 5-token chunk past the 12 reserved slots, no reserved pool at all
    assert alloc.preempt("a", 6) == 10 - 6
    assert alloc.num_free_blocks == 8
    alloc.check_invariants()


def test_hosted_placement_nests_and_eviction_saves_then_restore_loads():
    store = _store(16, 2)
    alloc = ExactAllocator(40, ExactAllocConfig(block_size=2, padding_ratio=0.0, reserved_fraction=0.1,
                                                pipeline_buffer_ratio=0.0), store)
    alloc.admit("h", 0, 32)  # 32 tokens, 16 blocks, nothing to host it
    assert alloc.host_of("h") is None and alloc.hosted_placements == 0
    assert alloc.admit("g", 2, 14) == "h"  # 16 tokens: the second half of h, as in Fig. 9a
    assert alloc.block_table("g") == alloc.block_table("h")[8:16]
    free_before = alloc.num_free_blocks
    alloc.grow("g", 2)  # g's prompt: a request hosts only once it writes one token a step
    alloc.grow("h", 6)  # h's gap now [6, 16): its second half, 2 blocks, is too small for 6 tokens
    assert alloc.admit("n", 0, 6) == "g"  # nested: in g's second half, h's last quarter
    assert alloc.host_of(alloc.host_of("n")) == "h" and alloc.block_table("n") == alloc.block_table("h")[13:16]
    assert alloc.num_free_blocks == free_before and alloc.hosted_placements == 2
    alloc.grow("g", 1)
    alloc.grow("n", 2)
    alloc.check_invariants()

    copies = alloc.grow("h", 10)  # h's writes reach g's region at token 16
    assert copies == [] and alloc.is_resident("g")
    copies = alloc.grow("h", 1)
    assert sorted(c.kind for c in copies) == ["save", "save"]  # g and n, which lived inside g
    assert not alloc.is_resident("g") and not alloc.is_resident("n") and alloc.hosted_by("h") == []
    assert alloc.hosted_evictions == 2 and alloc.hosted_drops == 0
    assert len(store.blocks_of("g")) == 2 and len(store.blocks_of("n")) == 1
    alloc.check_invariants()
    with pytest.raises(NoFreeBlocksError):
        alloc.grow("g", 1)  # must be restored first
    assert alloc.can_grow("g", 1)  # restore, then grow: fits

    (load,) = alloc.ensure_resident("g")
    assert load.kind == "load" and load.dst == tuple(alloc.slot_mapping("g", 0, 3))
    assert alloc.host_of("g") is None and alloc.restores == 1
    alloc.check_invariants()
    for seq in ("h", "g", "n"):
        alloc.free(seq)
    assert store.num_free_blocks == 16 and alloc.num_free_blocks == 40
    alloc.check_invariants()


def test_eviction_without_host_room_drops_for_recompute():
    alloc = ExactAllocator(20, ExactAllocConfig(block_size=2, padding_ratio=0.0, reserved_fraction=0.0,
                                                pipeline_buffer_ratio=0.0), _store(0, 2))
    alloc.admit("h", 0, 16)
    assert alloc.admit("g", 1, 3) == "h"
    alloc.grow("g", 3)
    assert alloc.grow("h", 9) == []  # no host space: nothing to save, the KV is dropped
    assert not alloc.is_resident("g") and alloc.num_written("g") == 0 and alloc.hosted_drops == 1
    assert alloc.ensure_resident("g") == [] and alloc.num_written("g") == 0  # recompute from scratch
    alloc.check_invariants()


def test_a_departing_host_leaves_its_guests_in_place():
    alloc = ExactAllocator(40, ExactAllocConfig(block_size=2, padding_ratio=0.0, reserved_fraction=0.0,
                                                pipeline_buffer_ratio=0.0))
    alloc.admit("h", 0, 32)
    alloc.admit("g", 0, 16)
    alloc.grow("h", 1)
    alloc.admit("n", 0, 8)  # nested in g
    assert alloc.host_of("n") == "g"
    g_table, n_table = alloc.block_table("g"), alloc.block_table("n")
    assert alloc.free("g") == 0  # g owned nothing: the region was h's
    assert alloc.host_of("n") == "h" and alloc.block_table("n") == n_table  # re-lent by h, no copy
    alloc.check_invariants()
    alloc.grow("n", 3)
    assert not alloc.can_grow("h", 64)
    alloc.preempt("h", 1)  # no reserved pool: h is preempted, n keeps its blocks
    assert alloc.host_of("n") is None and alloc.block_table("n") == n_table
    assert alloc.num_free_blocks == 40 - len(n_table) and set(n_table) < set(g_table)
    alloc.check_invariants()
    alloc.free("n")
    assert alloc.num_free_blocks == 40
    alloc.check_invariants()


def test_a_pt_holds_its_prompt_in_the_reserved_pool_and_its_gt_gets_its_rl_from_a_kvc():
    # §3.2.1: "The KVC size allocated to a PT equals its prompt length, and that allocated to a GT
    # equals to its predicted RL"; §2.2: the reserved pool is "for adding PTs at each iteration".
    alloc = ExactAllocator(20, ExactAllocConfig(block_size=4, padding_ratio=0.0, reserved_fraction=0.2))
    alloc.admit("big", 0, 64, allow_hosting=False)  # A_KVC is full: 16 of 20 blocks
    assert alloc.num_admission_blocks == 0 and not alloc.can_admit(1, 1, allow_hosting=False)
    assert alloc.can_admit_prompt(8) and not alloc.can_admit_prompt(17)
    alloc.admit_prompt("p", 6)  # a PT still fits: 2 pool blocks
    assert alloc.reserve_left == 2 and not alloc.is_batched("p") and alloc.num_queued == 0
    assert alloc.can_grow("p", 6) and not alloc.can_grow("p", 7)  # only its prompt
    alloc.grow("p", 4)
    assert alloc.num_queued == 0 and alloc.write_within("p", 6) and alloc.num_queued == 1  # its GT waits in Q_G
    assert not alloc.write_within("p", 7) and not alloc.can_batch("p", 6, 10)
    alloc.free("big")
    assert alloc.can_batch("p", 6, 10)
    assert alloc.batch("p", 6, 10) == [] and alloc.is_batched("p") and alloc.num_queued == 0
    # 6 + 10 tokens: 4 blocks, the prompt's 2 now A_KVC's: the pool is whole again.
    assert len(alloc.block_table("p")) == 4 and alloc.reserve_left == 4 and alloc.num_admission_blocks == 12
    alloc.check_invariants()


def test_a_prompt_longer_than_the_pool_takes_a_kvc_only_when_allowed():
    # §3.2.1: "prompts are selected sequentially to form a batch until the available KVC space is
    # fully allocated": a PT the pool cannot hold takes its prompt's blocks (only) from A_KVC.
    alloc = ExactAllocator(20, ExactAllocConfig(block_size=4, padding_ratio=0.0, reserved_fraction=0.2))
    assert not alloc.can_admit_prompt(20) and alloc.can_admit_prompt(20, from_available=True)
    with pytest.raises(NoFreeBlocksError):
        alloc.admit_prompt("long", 20)
    alloc.admit_prompt("long", 20, from_available=True)  # 5 blocks, uncharged: the pool is untouched
    assert alloc.reserve_left == 4 and alloc.num_admission_blocks == 11 and alloc.prompt_admissions_available == 1
    alloc.grow("long", 20)
    assert alloc.num_queued == 1 and alloc.can_batch("long", 20, 44) and not alloc.can_batch("long", 20, 45)
    alloc.batch("long", 20, 44)  # its RL: 11 more blocks from A_KVC, all that is left
    assert alloc.num_admission_blocks == 0 and alloc.reserve_left == 4
    assert not alloc.can_admit_prompt(17, from_available=True)  # neither the pool nor A_KVC holds it now
    alloc.check_invariants()


def test_a_paused_gt_keeps_its_written_blocks_and_is_batched_again_with_l_new():
    alloc = ExactAllocator(12, ExactAllocConfig(block_size=4, padding_ratio=0.0, reserved_fraction=1 / 6))
    alloc.admit_prompt("a", 3)
    alloc.grow("a", 3)
    alloc.batch("a", 3, 5)  # 8 tokens: 2 blocks
    alloc.grow("a", 5)
    alloc.grow("a", 4)  # 12 > 8: a pool block
    assert alloc.reserve_left == 1 and not alloc.can_grow("a", 5)
    table = list(alloc.block_table("a"))
    assert alloc.pause("a") == [] and alloc.num_queued == 1 and alloc.pauses == 1
    assert alloc.block_table("a") == table and alloc.num_written("a") == 12  # §2.4: it keeps its KV
    assert alloc.reserve_left == 1  # its overrun block stays charged while it waits
    assert not alloc.can_grow("a", 1)  # unbatched: it writes nothing until batched
    assert alloc.batch("a", 12, 6) == [] and alloc.block_table("a")[:3] == table  # L_new = 6 more
    assert len(alloc.block_table("a")) == 5 and alloc.reserve_left == 2  # 18 tokens; the charge moved
    alloc.check_invariants()


@pytest.mark.parametrize("guest_rl, hosted", [(14, True), (15, False)])
def test_a_gt_is_hosted_when_its_rl_is_below_half_the_hosts_minus_b(guest_rl, hosted):
    # §3.4: "a hosted GT that has RL less than but closest to half of the hosing GT's RL
    # subtracting b tokens", b = 15% of the host's predicted RL (40: b = 6): 40 / 2 - 6 = 14. The
    # region starts at the middle of the host's RL part, position 24 (block 6), 20 steps ahead of
    # its writes; the guest (whose last token's K/V is never written) must be done b before that.
    # Decoupled: the guest's prompt is already in its own blocks.
    alloc = ExactAllocator(40, ExactAllocConfig(block_size=4, padding_ratio=0.0, reserved_fraction=0.25,
                                                pipeline_buffer_ratio=0.15))
    for seq, prompt, _rl in (("h", 4, 40), ("g", 3, guest_rl)):
        alloc.admit_prompt(seq, prompt)
        alloc.grow(seq, prompt)
    alloc.batch("h", 4, 40)  # 44 tokens: 11 blocks; its gap is [4, 44), its midpoint 24: block 6
    assert alloc.batch("g", 3, guest_rl) == [] and (alloc.host_of("g") == "h") == hosted
    if hosted:  # the guest's RL part sits in h's region, past its own prompt block
        assert alloc.block_table("g")[1:] == alloc.block_table("h")[6:11]
        assert alloc.hosted_placements == 1 and alloc.num_admission_blocks == 30 - 11 - 1  # g's prompt block
    alloc.check_invariants()


def test_a_paused_guest_moves_to_host_memory():
    store = _store(8, 4)
    alloc = ExactAllocator(40, ExactAllocConfig(block_size=4, padding_ratio=0.0, reserved_fraction=0.0,
                                                pipeline_buffer_ratio=0.0), store)
    alloc.admit("h", 0, 64)
    alloc.admit("g", 0, 8)
    assert alloc.host_of("g") == "h"
    alloc.grow("g", 8)
    (save,) = alloc.pause("g")  # §3.4: "r_2 is preempted and its occupied cache will be moved to the main memory"
    assert save.kind == "save" and not alloc.is_resident("g") and alloc.hosted_by("h") == []
    assert alloc.num_queued == 1 and alloc.num_written("g") == 8
    assert alloc.batch("g", 8, 4)[0].kind == "load" and alloc.host_of("g") is None  # back in fresh blocks
    alloc.check_invariants()


def test_a_second_eviction_is_restored_from_its_own_save_not_the_first():
    """Evicted, restored, written further, hosted and evicted again: the restore must load the
    latest save. (Hypothesis found the first save, which lacked the later tokens, loaded instead.)"""
    store = _store(8, 2)
    alloc = ExactAllocator(48, ExactAllocConfig(block_size=2, padding_ratio=0.25, reserved_fraction=0.125,
                                                pipeline_buffer_ratio=0.15), store)
    assert alloc.admit("host", 0, 7) is None
    assert alloc.admit("guest", 1, 1) == "host"
    alloc.grow("guest", 1)
    first_save = alloc.pause("guest")  # a guest's pause evicts it: position 0 saved
    alloc.batch("guest", 1, 1, allow_hosting=False)  # restored into fresh blocks
    alloc.free("host")
    alloc.grow("guest", 1)  # position 1
    alloc.pause("guest")  # top-level: keeps its KV
    assert alloc.admit("host2", 0, 2) is None
    alloc.batch("guest", 2, 1)
    assert alloc.host_of("guest") == "host2"
    (second_save,) = alloc.pause("guest")  # evicted again: positions 0 and 1 saved
    (load,) = alloc.batch("guest", 2, 1, allow_hosting=False)
    assert load.kind == "load" and load.src == second_save.dst != first_save[0].dst
    alloc.check_invariants()


NUM_BLOCKS, BLOCK, HOST_BLOCKS = 48, 2, 8


def _value(seq_no: int, pos: int, layer: int) -> float:
    return float(seq_no * 1000 + pos + 1 + layer * 100_000)


class ExactAllocMachine(RuleBasedStateMachine):
    """Random admit (coupled) / admit_prompt, prefill, batch (PT -> GT, hosted or not), grow, pause,
    finish and restore sequences on real tensors; all copies are executed. Beyond the allocator's
    own invariants: every resident position reads back its own value (so a host's lent region
    never overlaps its own future tokens, and no copy lands in the wrong place), and a paused GT's
    blocks stay owned and unchanged until it is batched again."""

    def __init__(self):
        super().__init__()
        config = ExactAllocConfig(block_size=BLOCK, padding_ratio=0.25, reserved_fraction=0.125,
                                  pipeline_buffer_ratio=0.15)
        self.store = _store(HOST_BLOCKS, BLOCK)
        self.alloc = ExactAllocator(NUM_BLOCKS, config, self.store)
        self.caches = [(torch.zeros(NUM_BLOCKS, BLOCK, 1, 2), torch.zeros(NUM_BLOCKS, BLOCK, 1, 2)) for _ in range(2)]
        self.written: dict[str, int] = {}
        self.spec: dict[str, tuple[int, int, int]] = {}  # seq -> (number, tokens when predicted, predicted RL)
        self.paused: dict[str, list[int]] = {}  # a paused resident GT's table when it paused
        self.next_no = 0

    def _live(self, resident: bool) -> list[str]:
        return sorted(s for s in self.written if self.alloc.is_resident(s) == resident)

    def _batched(self, batched: bool) -> list[str]:
        return [s for s in self._live(resident=True) if self.alloc.is_batched(s) == batched]

    def _write(self, seq: str, start: int, end: int) -> None:
        no = self.spec[seq][0]
        for pos, slot in zip(range(start, end), self.alloc.slot_mapping(seq, start, end)):
            for layer, (k, v) in enumerate(self.caches):
                val = _value(no, pos, layer)
                k.view(-1, 1, 2)[slot] = torch.tensor([val, -val])
                v.view(-1, 1, 2)[slot] = torch.tensor([val + 0.5, 2 * val])

    def _sync_evicted(self) -> None:
        for seq in self._live(resident=False):
            assert self.alloc.num_written(seq) in (self.written[seq], 0)  # saved whole, or dropped
            self.written[seq] = self.alloc.num_written(seq)

    def _new(self) -> str:
        self.next_no += 1
        return f"r{self.next_no - 1}"

    @rule(prompt_len=st.integers(0, 4), predicted=st.one_of(st.integers(1, 6), st.integers(7, 30)),
          allow_hosting=st.booleans())
    def admit(self, prompt_len, predicted, allow_hosting):
        seq, free_before = self._new(), self.alloc.num_free_blocks
        feasible = self.alloc.can_admit(prompt_len, predicted, allow_hosting=allow_hosting)
        try:
            host = self.alloc.admit(seq, prompt_len, predicted, allow_hosting=allow_hosting)
        except NoFreeBlocksError:
            assert not feasible and not self.alloc.has(seq) and self.alloc.num_free_blocks == free_before
            return
        assert feasible
        event("fresh admission" if host is None
              else "nested admission" if self.alloc.host_of(host) else "hosted admission")
        if host is None:
            need = self.alloc.reservation_tokens(prompt_len, predicted)
            assert len(self.alloc.block_table(seq)) == self.alloc.blocks_for(need)
            assert self.alloc.num_free_blocks == free_before - self.alloc.blocks_for(need)
        else:
            assert self.alloc.num_free_blocks == free_before  # a guest costs no free blocks
        self.spec[seq], self.written[seq] = (self.next_no - 1, prompt_len, predicted), 0
        draws = self.alloc.reserved_pool_draws
        assert self.alloc.grow(seq, prompt_len) == []  # the prefill fits and nobody is hosted yet
        assert self.alloc.reserved_pool_draws == draws
        self._write(seq, 0, prompt_len)
        self.written[seq] = prompt_len

    @rule(prompt_len=st.integers(0, 24), from_available=st.booleans())
    def admit_prompt(self, prompt_len, from_available):
        """A PT: its prompt's blocks, from the reserved pool, or (`from_available`, one the pool
        cannot hold) from A_KVC, uncharged (§3.2.1)."""
        seq, free_before, left_before = self._new(), self.alloc.num_free_blocks, self.alloc.reserve_left
        room_before = self.alloc.num_admission_blocks
        feasible = self.alloc.can_admit_prompt(prompt_len, from_available=from_available)
        try:
            self.alloc.admit_prompt(seq, prompt_len, from_available=from_available)
        except NoFreeBlocksError:
            assert not feasible and not self.alloc.has(seq) and self.alloc.reserve_left == left_before
            return
        assert feasible and not self.alloc.is_batched(seq)
        blocks = self.alloc.blocks_for(prompt_len)
        assert self.alloc.num_free_blocks == free_before - blocks
        if blocks <= left_before:  # the pool first, whenever it holds the prompt
            assert self.alloc.reserve_left == left_before - blocks and self.alloc.num_admission_blocks == room_before
            event("prompt admitted from the pool")
        else:
            assert from_available and self.alloc.reserve_left == left_before
            assert self.alloc.num_admission_blocks == room_before - blocks
            event("prompt admitted from A_KVC")
        self.spec[seq], self.written[seq] = (self.next_no - 1, prompt_len, 0), 0

    @precondition(lambda self: any(self.alloc.num_written(s) < self.alloc.reservation(s) for s in self._batched(False)))
    @rule(data=st.data())
    def prefill(self, data):
        seq = data.draw(st.sampled_from([s for s in self._batched(False)
                                         if self.alloc.num_written(s) < self.alloc.reservation(s)]))
        old, left = self.written[seq], self.alloc.reservation(seq) - self.written[seq]
        num_tokens = data.draw(st.integers(1, left))
        assert self.alloc.can_grow(seq, num_tokens) and not self.alloc.can_grow(seq, left + 1)
        assert self.alloc.grow(seq, num_tokens) == []
        self._write(seq, old, old + num_tokens)
        self.written[seq] = old + num_tokens
        if self.written[seq] == self.alloc.reservation(seq):
            event("prompt done: a GT in Q_G")

    @precondition(lambda self: self.alloc.num_queued)
    @rule(data=st.data(), predicted=st.one_of(st.integers(1, 6), st.integers(7, 30)), allow_hosting=st.booleans())
    def batch(self, data, predicted, allow_hosting):
        """A waiting GT gets its predicted RL (§3.2.1), in A_KVC or a host's region (§3.4)."""
        queued = sorted(s for s in self.written if not self.alloc.is_batched(s)
                        and self.alloc.num_written(s) >= self.alloc.reservation(s))
        seq = data.draw(st.sampled_from(queued))
        base, resident = self.written[seq], self.alloc.is_resident(seq)
        feasible = self.alloc.can_batch(seq, base, predicted, allow_hosting=allow_hosting)
        left_before = self.alloc.reserve_left
        try:
            copies = self.alloc.batch(seq, base, predicted, allow_hosting=allow_hosting)
        except NoFreeBlocksError:
            assert not feasible and not self.alloc.is_batched(seq) and self.alloc.reserve_left == left_before
            return
        assert feasible and self.alloc.is_batched(seq) and self.alloc.is_resident(seq)
        if seq in self.paused:
            assert self.alloc.block_table(seq)[:len(self.paused[seq])] == self.paused.pop(seq)
        event("batched, hosted" if self.alloc.host_of(seq) is not None else "batched, restored" if not resident
              else "batched")
        assert self.alloc.reservation(seq) >= self.alloc.reservation_tokens(base, predicted)
        self.store.execute(copies, self.caches)
        self.spec[seq] = (self.spec[seq][0], base, predicted)

    @precondition(lambda self: self._batched(True))
    @rule(data=st.data())
    def pause(self, data):
        seq = data.draw(st.sampled_from(self._batched(True)))
        guest = self.alloc.host_of(seq) is not None
        copies = self.alloc.pause(seq)
        self.store.execute(copies, self.caches)
        assert not self.alloc.is_batched(seq) and self.alloc.num_queued
        if guest:
            event("paused guest: to host memory")
            assert not self.alloc.is_resident(seq)
        else:
            event("paused, KV kept")
            assert self.alloc.block_table(seq)[:self.alloc.blocks_for(self.written[seq])] == self.alloc.block_table(seq)
            self.paused[seq] = list(self.alloc.block_table(seq))
        self._sync_evicted()

    @precondition(lambda self: self._batched(True))
    @rule(data=st.data(), num_tokens=st.integers(1, 5))
    def grow(self, data, num_tokens):
        self._grow(data.draw(st.sampled_from(self._batched(True))), num_tokens)

    @precondition(lambda self: self._hosts())
    @rule(data=st.data(), num_tokens=st.integers(1, 12))
    def grow_a_host(self, data, num_tokens):
        """Hosts racing ahead of their guests is what forces evictions; make it common."""
        self._grow(data.draw(st.sampled_from(self._hosts())), num_tokens)

    def _hosts(self) -> list[str]:
        return [s for s in self._batched(True) if self.alloc.hosted_by(s)]

    def _grow(self, seq: str, num_tokens: int) -> None:
        _, base, predicted = self.spec[seq]
        old, capacity = self.written[seq], len(self.alloc.block_table(seq)) * BLOCK
        draws, evictions = self.alloc.reserved_pool_draws, self.alloc.hosted_evictions
        if not self.alloc.can_grow(seq, num_tokens):  # offload-free preemption of the grower itself
            event("preempted")
            with pytest.raises(NoFreeBlocksError):
                self.alloc.grow(seq, num_tokens)
            assert old + num_tokens > capacity  # only a request past its blocks needs the pool
            generated = max(0, old - base)
            assert self.alloc.preempt(seq, generated) == max(1, predicted - generated)
            del self.written[seq]
            self.paused.pop(seq, None)
            self._sync_evicted()
            return
        copies = self.alloc.grow(seq, num_tokens)
        if old + num_tokens <= capacity:
            assert self.alloc.reserved_pool_draws == draws  # growth within the reservation never allocates
        else:
            event("reserved pool draw")
        if self.alloc.hosted_evictions > evictions:
            event("hosted eviction" if self.alloc.hosted_evictions == evictions + 1 else "nested eviction")
        self.store.execute(copies, self.caches)  # before the forward writes, as the runner does
        self._write(seq, old, old + num_tokens)
        self.written[seq] = old + num_tokens
        self._sync_evicted()

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.written)))
        self.alloc.free(seq)
        del self.written[seq]
        self.paused.pop(seq, None)
        assert not self.alloc.has(seq) and self.store.blocks_of(seq) == []

    @precondition(lambda self: [s for s in self._live(resident=False) if self.alloc.is_batched(s)])
    @rule(data=st.data())
    def restore(self, data):
        seq = data.draw(st.sampled_from([s for s in self._live(resident=False) if self.alloc.is_batched(s)]))
        feasible = self.alloc.can_grow(seq, 0)
        try:
            copies = self.alloc.ensure_resident(seq)
        except NoFreeBlocksError:
            assert not feasible and not self.alloc.is_resident(seq)
            return
        assert feasible
        event("restored" if copies else "restored for recompute")
        assert len(copies) == (1 if self.written[seq] else 0)
        self.store.execute(copies, self.caches)

    @invariant()
    def allocator_invariants(self):
        self.alloc.check_invariants()
        self.store.check_invariants()
        held = sum(len(self.store.blocks_of(s)) for s in self.written)
        assert held + self.store.num_free_blocks == HOST_BLOCKS  # no host block outlives its request
        assert all(self.alloc.has(s) for s in self.written)

    @invariant()
    def a_paused_gts_blocks_stay_owned_and_unchanged(self):
        for seq, table in self.paused.items():
            assert self.alloc.is_resident(seq) and not self.alloc.is_batched(seq)
            assert self.alloc.block_table(seq) == table and self.alloc.num_written(seq) == self.written[seq]

    @invariant()
    def every_resident_position_reads_back_its_own_value(self):
        for seq in self._live(resident=True):
            assert self.alloc.num_written(seq) == self.written[seq]
            no, slots = self.spec[seq][0], self.alloc.slot_mapping(seq, 0, self.written[seq])
            if not slots:
                continue
            index = torch.tensor(slots)
            expected = torch.arange(self.written[seq], dtype=torch.float32) + no * 1000 + 1
            for layer, (k, v) in enumerate(self.caches):
                got_k, got_v = k.view(-1, 1, 2)[index, 0], v.view(-1, 1, 2)[index, 0]
                val = expected + layer * 100_000
                assert torch.equal(got_k, torch.stack([val, -val], dim=1)), f"{seq}: K clobbered"
                assert torch.equal(got_v, torch.stack([val + 0.5, 2 * val], dim=1)), f"{seq}: V clobbered"

    def teardown(self):
        for seq in list(self.written):
            self.alloc.free(seq)
        self.written.clear()
        self.alloc.check_invariants()  # with no requests: nothing leaked
        assert self.alloc.num_free_blocks == NUM_BLOCKS and self.alloc.reserve_left == self.alloc.reserve_target
        assert self.store.num_free_blocks == HOST_BLOCKS


TestExactAllocMachine = ExactAllocMachine.TestCase
TestExactAllocMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
