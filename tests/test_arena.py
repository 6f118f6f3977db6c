"""MemoryArena (KunServe §4.1): a real tiny Llama moved into the arena, drop/restore unit checks,
and a hypothesis state machine that interleaves KV traffic with drops and restores."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from torch import nn

from nanoserve.config import ModelConfig
from nanoserve.kernels.reference import store_kv
from nanoserve.memory.arena import ArenaConfig, BlocksInUseError, MemoryArena
from nanoserve.memory.arena_layout import PageRuns, as_pair, fingerprint, fingerprint_on_device
from nanoserve.memory.blocks import NoFreeBlocksError

NUM_LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


def tiny_llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
                                      num_key_value_heads=KV_HEADS, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


def arena_config(kv_blocks: int = 8, align: int = 64) -> ArenaConfig:
    return ArenaConfig(BLOCK, KV_HEADS, HEAD_DIM, torch.float32, kv_blocks, weight_align=align)


def host_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def logits(model: nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 33, 77, 2, 100]])
    with torch.no_grad():
        return model(ids).logits


def layer_param_bytes(model: nn.Module, layer: int) -> tuple[int, int]:
    """(bytes, parameter count) of one decoder layer, counted from the model, not the arena."""
    params = [p for n, p in model.named_parameters() if f"layers.{layer}." in n]
    return sum(p.numel() * p.element_size() for p in params), len(params)


def test_moving_weights_into_the_arena_keeps_output_bit_identical():
    model = tiny_llama()
    expected = logits(model)
    arena = MemoryArena(model, arena_config())
    assert torch.equal(logits(model), expected)
    base, end = arena._arena.data_ptr(), arena._arena.data_ptr() + arena.total_bytes
    assert all(base <= p.data_ptr() < end for p in model.parameters())
    arena.check_invariants()


def test_dropping_half_the_layers_gains_the_theoretical_capacity():
    model = tiny_llama()
    arena = MemoryArena(model, arena_config(align=64))
    bpt_full = 2 * NUM_LAYERS * KV_HEADS * HEAD_DIM * 4
    assert arena.kv_bytes_per_token == bpt_full
    assert arena.capacity_tokens == 8 * BLOCK
    param_bytes, param_count = map(sum, zip(*(layer_param_bytes(model, layer) for layer in (2, 3))))

    change = arena.drop_layers([2, 3])
    arena.check_invariants()
    assert arena.resident_layers == (0, 1)
    bpt = bpt_full // 2
    assert arena.kv_bytes_per_token == change.kv_bytes_per_token == bpt
    # Freed pages hold the parameters plus alignment padding and a partial last page.
    page = arena.config.page_bytes
    assert param_bytes <= change.weight_bytes < param_bytes + 2 * page + param_count * 64
    theoretical = change.weight_bytes / bpt
    assert theoretical - BLOCK < change.tokens <= theoretical
    # The old KV region also holds twice the tokens now that a token needs half the bytes.
    assert change.capacity_after == (8 * BLOCK * bpt_full + change.weight_bytes) // (bpt * BLOCK) * BLOCK
    assert change.capacity_before == 8 * BLOCK
    assert arena.num_free_blocks == arena.capacity_blocks  # one contiguous stretch: no fragmentation
    assert all(p.numel() == 0 for n, p in model.named_parameters() if "layers.2." in n or "layers.3." in n)


@given(st.binary(min_size=8, max_size=400).map(lambda b: b[: len(b) // 8 * 8]), st.data())
def test_pages_fingerprints_add_up_to_their_regions(data, draw):
    """A background restore fingerprints each run of pages as it fills it, on the device, and
    adds them up (fill_restore): the sum must be the whole region's fingerprint, and any one
    changed byte must change it."""
    region = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    words = len(data) // 8
    cut = draw.draw(st.integers(0, words)) * 8
    pieces = fingerprint_on_device(region[:cut]) + fingerprint_on_device(region[cut:], first=cut // 8)
    assert as_pair(pieces) == fingerprint(region)
    changed = region.clone()
    at = draw.draw(st.integers(0, len(data) - 1))
    changed[at] ^= 1 << draw.draw(st.integers(0, 7))
    assert fingerprint(changed) != fingerprint(region)


def test_restore_from_host_copy_is_bit_identical():
    model = tiny_llama()
    expected, host = logits(model), host_copy(model)
    arena = MemoryArena(model, arena_config())
    arena.drop_layers([0, 2])
    blocks = arena.allocate("s", arena.num_free_blocks * BLOCK)  # KV over the dropped layers' bytes
    for k, v in arena.kv_caches().values():
        k[blocks] = float("nan")
        v[blocks] = float("nan")
    arena.check_invariants()
    arena.free("s")
    change = arena.restore_layers([0, 2], host)
    arena.check_invariants()
    assert arena.resident_layers == tuple(range(NUM_LAYERS))
    assert change.capacity_after == 8 * BLOCK
    assert all(torch.equal(p, host[n]) for n, p in model.named_parameters())
    assert torch.equal(logits(model), expected)


def test_a_background_restore_fills_pages_as_their_blocks_leave():
    """§4.4's overlapped restore: the free home pages are filled while KV still lives on the
    others; a page under a live block waits for its block to be freed; the switch copies only
    what the pull did not reach, and the model is bit-identical to before the drop."""
    model = tiny_llama()
    expected, host = logits(model), host_copy(model)
    arena = MemoryArena(model, arena_config())
    arena.drop_layers([1, 2])
    free_after_drop = arena.num_free_blocks
    first = arena.allocate("a", 2 * BLOCK)  # lowest pages first: on layer 1's old home
    arena.allocate("b", BLOCK)
    assert any(arena.overlaps_restore(b) for b in first) is False  # no restore yet
    arena.begin_restore([1, 2], host)
    assert any(arena.overlaps_restore(b) for b in first)
    assert arena.num_free_blocks < free_after_drop - 3  # the free home pages are reserved
    with pytest.raises(NoFreeBlocksError):
        arena.allocate("c", (free_after_drop - 2) * BLOCK)  # ... so no block is carved there
    left = arena.pull_pages_left
    assert left > 0 and arena.fill_restore(arena.config.page_bytes) > 0
    assert arena.pull_pages_left == left - 1
    arena.fill_restore(None)
    arena.check_invariants()
    arena.release_blocks("a", first[:1])  # a group member gives a block back: its pages join the pull
    assert arena.pull_pages_left > 0
    arena.free("a")
    arena.free("b")
    arena.check_invariants()
    pulled = arena.pulled_bytes
    change = arena.restore_layers([1, 2], host)
    arena.check_invariants()
    weights = sum(host[n].numel() * host[n].element_size() for n in host if ".1." in n or ".2." in n)
    assert 0 < change.copied_bytes < weights and pulled + change.copied_bytes == weights
    assert torch.equal(logits(model), expected)


def test_a_cancelled_restore_gives_the_pages_back():
    model = tiny_llama()
    host = host_copy(model)
    arena = MemoryArena(model, arena_config())
    arena.drop_layers([2])
    free_after_drop = arena.num_free_blocks
    blocks = arena.allocate("a", 3 * BLOCK)
    arena.begin_restore([2], host)
    arena.fill_restore(None)
    arena.release_blocks("a", blocks[:1])
    arena.cancel_restore()
    arena.adopt("a", blocks[0])  # the member takes its block back
    arena.check_invariants()
    assert arena.num_free_blocks == free_after_drop - 3 and not arena.restoring
    arena.drop_layers([1])  # a drop is allowed again


def test_a_stray_write_into_a_live_weight_is_caught():
    model = tiny_llama()
    arena = MemoryArena(model, arena_config())
    k_cache, _ = arena.kv_caches()[0]
    k_cache[0, 0, 0, 0] += 1.0  # block id 0 is a page of the shared weights, never handed out
    with pytest.raises(AssertionError, match="overwritten"):
        arena.check_invariants()


def test_restore_is_refused_while_blocks_are_in_use():
    model = tiny_llama()
    host = host_copy(model)
    arena = MemoryArena(model, arena_config())
    arena.drop_layers([1])
    arena.allocate("busy", 1)
    arena.allocate("empty", 0)  # a sequence that owns no block does not block a restore
    with pytest.raises(BlocksInUseError, match="busy"):
        arena.restore_layers([1], host)
    assert arena.resident_layers == (0, 2, 3)
    arena.check_invariants()
    arena.free("busy")
    arena.restore_layers([1], host)
    arena.check_invariants()
    assert all(torch.equal(p, host[n]) for n, p in model.named_parameters())


def test_bad_requests_are_refused_without_change():
    model = tiny_llama()
    arena = MemoryArena(model, arena_config(kv_blocks=2))
    with pytest.raises(ValueError):
        arena.drop_layers(range(NUM_LAYERS))
    with pytest.raises(ValueError):
        arena.restore_layers([0], host_copy(model))
    arena.drop_layers([3])
    with pytest.raises(ValueError):
        arena.drop_layers([3])
    with pytest.raises(KeyError):
        arena.restore_layers([3], {})
    free = arena.num_free_blocks
    with pytest.raises(NoFreeBlocksError):
        arena.allocate("a", (free + 1) * BLOCK)
    assert not arena.has("a") and arena.num_free_blocks == free
    arena.check_invariants()


def test_config_from_model_config():
    cfg = ModelConfig("llama", 128, 32, 64, NUM_LAYERS, 4, KV_HEADS, HEAD_DIM, 64)
    config = ArenaConfig.from_model_config(cfg, BLOCK, torch.float32, kv_blocks=3)
    assert config.page_bytes * 2 * NUM_LAYERS == cfg.kv_bytes_per_token(torch.float32) * BLOCK


def test_page_runs_merge_and_refuse_double_free():
    runs = PageRuns()
    runs.release(10, 5)
    runs.release(0, 4)
    runs.release(4, 6)
    assert list(runs) == [(0, 15)]
    with pytest.raises(ValueError):
        runs.release(3, 2)
    runs.take(5, 3)
    assert list(runs) == [(0, 5), (8, 7)] and runs.fits(4) == 2 and runs.first_fit(6) == 8
    with pytest.raises(ValueError):
        runs.take(4, 2)
    runs.check()


class StackModel(nn.Module):
    """Decoder-layer-shaped parameters of uneven sizes (so alignment and page rounding vary),
    plus shared ones, named like an HF model."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.embed = nn.Embedding(16, 12)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(12, 12 + 5 * i), nn.LayerNorm(12 + 5 * i), nn.Linear(12 + 5 * i, 12, bias=False))
            for i in range(num_layers))
        self.head = nn.Linear(12, 16, bias=False)


SEQS = st.sampled_from([f"s{i}" for i in range(5)])
LAYER_SETS = st.sets(st.integers(0, NUM_LAYERS - 1), min_size=1, max_size=NUM_LAYERS)


class ArenaMachine(RuleBasedStateMachine):
    """KV writes, frees, drops and restores in any order, against a model of every live
    sequence's K/V per resident layer and of every original weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = StackModel(NUM_LAYERS)
        self.originals = host_copy(self.model)
        self.arena = MemoryArena(self.model, arena_config(kv_blocks=6, align=16))
        self.initial_weight_bytes = self.arena.weight_bytes
        self.kv: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # seq -> layer -> (K, V)
        self.counter = 0

    def _unique(self, n: int) -> torch.Tensor:
        values = torch.arange(self.counter, self.counter + n * KV_HEADS * HEAD_DIM, dtype=torch.float32)
        self.counter += values.numel()
        return values.view(n, KV_HEADS, HEAD_DIM)

    @rule(seq=SEQS, extra=st.integers(0, 9))
    def grow(self, seq, extra):
        arena = self.arena
        have = arena._reserved.get(seq, 0)
        need, free = arena.blocks_needed(seq, have + extra), arena.num_free_blocks
        if need > free:
            with pytest.raises(NoFreeBlocksError):
                arena.allocate(seq, have + extra)
            assert arena.num_free_blocks == free
            return
        assert len(arena.allocate(seq, have + extra)) == need
        assert arena.num_free_blocks == free - need
        slots = torch.tensor(arena.slot_mapping(seq, have, have + extra), dtype=torch.int64)
        stored = self.kv.setdefault(seq, {layer: (self._unique(0), self._unique(0)) for layer in arena.resident_layers})
        for layer, (k_cache, v_cache) in arena.kv_caches().items():
            k, v = self._unique(extra), self._unique(extra)
            store_kv(k, v, k_cache, v_cache, slots)
            stored[layer] = (torch.cat([stored[layer][0], k]), torch.cat([stored[layer][1], v]))

    @rule(seq=SEQS)
    def free(self, seq):
        self.arena.free(seq)
        self.kv.pop(seq, None)

    @rule(layers=LAYER_SETS)
    def drop(self, layers):
        arena = self.arena
        layers = layers & set(arena.resident_layers)
        if len(layers) == len(arena.resident_layers) or arena.restoring:
            with pytest.raises(ValueError):
                arena.drop_layers(layers)
            return
        change = arena.drop_layers(layers)
        block_bytes = arena.kv_bytes_per_token * BLOCK
        assert change.tokens == change.weight_bytes // block_bytes * BLOCK
        assert change.capacity_after == arena.capacity_tokens >= change.capacity_before + change.tokens
        for stored in self.kv.values():
            for layer in layers:
                del stored[layer]

    @rule(layers=LAYER_SETS)
    def restore(self, layers):
        arena = self.arena
        layers = layers - set(arena.resident_layers)
        if not layers:
            return
        resident_before = arena.resident_layers
        if arena.num_used_blocks:
            with pytest.raises(BlocksInUseError):
                arena.restore_layers(layers, self.originals)
            assert arena.resident_layers == resident_before
            return
        change = arena.restore_layers(layers, self.originals)
        assert not arena.restoring and change.copied_bytes <= change.weight_bytes
        for stored in self.kv.values():  # no sequence owns a block, so none has K/V
            stored.update({layer: (self._unique(0), self._unique(0)) for layer in layers})

    @rule(layers=LAYER_SETS)
    def begin_restore(self, layers):
        """§4.4's overlapped restore: reserve the dropped layers' home pages while KV lives on."""
        arena = self.arena
        layers = layers - set(arena.resident_layers)
        if not layers or arena.restoring:
            with pytest.raises(ValueError):
                arena.begin_restore(layers, self.originals)
            return
        free_before = arena.num_free_blocks
        arena.begin_restore(layers, self.originals)
        assert arena.restoring == tuple(sorted(layers))
        assert arena.num_free_blocks <= free_before  # reserved pages are carved no more

    @rule(pages=st.integers(1, 12))
    def fill_restore(self, pages):
        arena = self.arena
        left = arena.pull_pages_left
        copied = arena.fill_restore(pages * arena.config.page_bytes)
        assert arena.pull_pages_left == max(0, left - pages)
        assert copied <= pages * arena.config.page_bytes

    @rule()
    def cancel_restore(self):
        self.arena.cancel_restore()
        assert not self.arena.restoring and self.arena.pull_pages_left == 0

    @rule(seq=SEQS)
    def release_last_block(self, seq):
        """A group member gives back a lookup table's block (cluster/member.py): the last one here,
        so the sequence keeps its first tokens."""
        arena = self.arena
        table = arena.block_table(seq)
        if not table:
            return
        last = table[-1]
        arena.release_blocks(seq, [last])
        kept = len(arena.block_table(seq)) * BLOCK
        assert arena._reserved[seq] == kept
        for layer, (k, v) in self.kv.get(seq, {}).items():
            self.kv[seq][layer] = (k[:kept], v[:kept])
        if kept == 0:
            arena.free(seq)
            self.kv.pop(seq, None)

    @invariant()
    def arena_is_consistent(self):
        self.arena.check_invariants()

    @invariant()
    def live_kv_reads_back(self):
        caches = self.arena.kv_caches()
        for seq, stored in self.kv.items():
            slots = torch.tensor(self.arena.slot_mapping(seq, 0, self.arena._reserved[seq]), dtype=torch.int64)
            assert stored.keys() == caches.keys()
            for layer, (k, v) in stored.items():
                k_cache, v_cache = caches[layer]
                assert torch.equal(k_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots], k), (seq, layer)
                assert torch.equal(v_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots], v), (seq, layer)

    @invariant()
    def resident_weights_are_untouched(self):
        resident = {f"layers.{layer}." for layer in self.arena.resident_layers}
        for name, param in self.model.named_parameters():
            if not name.startswith("layers.") or any(name.startswith(prefix) for prefix in resident):
                assert torch.equal(param, self.originals[name]), name

    @invariant()
    def capacity_gain_matches_freed_bytes(self):
        arena = self.arena
        freed = self.initial_weight_bytes - arena.weight_bytes
        block_bytes = arena.kv_bytes_per_token * BLOCK
        kv_before = arena.total_bytes - self.initial_weight_bytes
        gained = arena.capacity_tokens - kv_before // block_bytes * BLOCK
        assert abs(gained - freed / arena.kv_bytes_per_token) <= BLOCK  # whole blocks only


TestArenaMachine = ArenaMachine.TestCase
TestArenaMachine.settings = settings(max_examples=75, stateful_step_count=30, deadline=None)
