"""KunServe end to end on one device (§3, §4.1, §4.2, §4.4): a tiny random 4-layer Llama served
from a `MemoryArena` (kv_manager="arena"), with half its layers dropped in the middle of
generation, served by the in-process pipeline peer (`LayerPeer`), and restored afterwards.

The engine is driven step by step. Every greedy output must match an uninterrupted run with the
plain paged manager and a KV cache large enough never to preempt (vLLM's near-tie rule). The
arena starts small enough that requests queue and get preempted; the drop must turn weight
bytes into exactly the KV capacity they hold, which the scheduler must then use.
"""
from __future__ import annotations

import pytest
import torch
from test_invariance import assert_close_greedy

from nanoserve import SamplingParams
from nanoserve.builder import build_engine
from nanoserve.config import EngineArgs
from nanoserve.engine import Engine
from nanoserve.memory.arena import BlocksInUseError
from nanoserve.model.layer_peer import PeerStage

NUM_LAYERS, BLOCK, ARENA_TOKENS, MAX_TOKENS = 4, 4, 48, 16
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
FIRST = [[(7 * i + 3 * j) % 500 + 1 for j in range(9 + i)] for i in range(4)]  # 9..12 tokens each
LATER = [[(11 * i + 5 * j) % 500 + 1 for j in range(6 + 3 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers

    torch.manual_seed(4321)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so a norm loaded wrongly cannot hide
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    directory = tmp_path_factory.mktemp("tiny-llama-4l")
    model.save_pretrained(directory)
    return directory


def make_engine(model_dir, kv_manager: str, tokens: int) -> Engine:
    return build_engine(EngineArgs(model=str(model_dir), device="cpu", dtype=torch.float32, kv_manager=kv_manager,
                                   kv_cache_tokens=tokens, block_size=BLOCK, attention_backend="torch"))


def run_to_end(engine: Engine, prompts: list[list[int]], prefix: str) -> dict:
    ids = [engine.add_request(p, PARAMS, request_id=f"{prefix}{i}").request_id for i, p in enumerate(prompts)]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    return {rid: finished[rid] for rid in ids}


@pytest.fixture(scope="module")
def reference(model_dir):
    """Each prompt alone-ish, never preempted: the uninterrupted run."""
    engine = make_engine(model_dir, "paged", 4096)
    return {**run_to_end(engine, FIRST, "a"), **run_to_end(engine, LATER, "b")}


def weight_bytes_of(engine: Engine, layers) -> int:
    """Bytes of `layers`' parameters, counted from the host copy rather than from the arena."""
    host = engine.executor.host_weights
    return sum(t.numel() * t.element_size() for n, t in host.items()
               if any(f"layers.{layer}." in n for layer in layers))


@pytest.mark.parametrize("dropped", [(2, 3), (0, 1), (1, 3)], ids=["second-half", "first-half", "interleaved"])
def test_drop_mid_generation_then_restore_keeps_greedy_output(model_dir, reference, dropped):
    engine = make_engine(model_dir, "arena", ARENA_TOKENS)
    runner, kv, arena = engine.executor, engine.kv, engine.executor.arena
    kv_before, weights_before = kv.num_blocks, arena.weight_bytes
    assert kv_before == ARENA_TOKENS // BLOCK

    for i, prompt in enumerate(FIRST):
        engine.add_request(prompt, PARAMS, request_id=f"a{i}")
    outputs = {}
    for _ in range(6):  # prefills and a few decodes: the small arena already preempts
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions > 0 or engine.scheduler.num_waiting > 0, "meant to be throttled"
    assert arena.num_used_blocks > 0 and engine.scheduler.num_running > 0  # live K/V to exchange

    # -- drop half the layers mid-generation (§4.1, §4.2) --------------------------------------
    change = runner.drop_layers(dropped)
    arena.check_invariants()
    freed = weights_before - arena.weight_bytes
    assert freed == change.weight_bytes
    param_bytes = weight_bytes_of(engine, dropped)
    assert param_bytes <= freed < param_bytes + 2 * arena.config.page_bytes + 256 * len(runner.host_weights)
    bpt = arena.kv_bytes_per_token
    assert bpt == engine.executor.model_config.kv_bytes_per_token(torch.float32) // 2  # resident layers only
    # Capacity gained by the freed bytes alone, up to whole blocks...
    assert freed / bpt - BLOCK < change.tokens <= freed / bpt
    # ...and in all: the old KV bytes also hold twice the tokens at the new geometry.
    kv_bytes = kv_before * BLOCK * 2 * bpt
    assert change.capacity_after == (kv_bytes + freed) // (bpt * BLOCK) * BLOCK == kv.num_blocks * BLOCK
    assert kv.num_blocks > 2 * kv_before
    assert runner.peer.layers == tuple(dropped)
    assert all(isinstance(runner.model.model.layers[i], PeerStage) for i in dropped)
    assert all(runner.kv_caches[i] is None for i in dropped)
    assert kv.events["layer_drops"] == 1 and kv.events["kv_tokens_gained"] == change.capacity_after - ARENA_TOKENS

    # The scheduler sees the new capacity through can_reserve: everyone runs, nobody is preempted.
    preemptions = engine.scheduler.num_preemptions
    outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == len(FIRST) - len(outputs)

    # -- a restore while requests hold blocks is refused and changes nothing -------------------
    with pytest.raises(BlocksInUseError, match="a"):
        runner.restore_layers(dropped)
    assert runner.peer.layers == tuple(dropped) and arena.resident_layers == tuple(
        i for i in range(NUM_LAYERS) if i not in dropped)
    arena.check_invariants()

    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions == preemptions
    for rid, out in outputs.items():
        assert_close_greedy(reference[rid], out, f"drop {dropped}: {rid}", max_tokens=MAX_TOKENS)

    # -- restore once no block is owned (§4.4), then serve more prompts at the old capacity ------
    back = runner.restore_layers(dropped)
    assert back.capacity_after == ARENA_TOKENS and kv.num_blocks == kv_before
    assert arena.weight_bytes == weights_before and runner.peer.layers == ()
    assert not any(isinstance(layer, PeerStage) for layer in runner.model.model.layers)
    host = runner.host_weights
    assert all(torch.equal(p, host[n]) for n, p in runner.model.named_parameters())
    assert kv.events["layer_restores"] == 1 and kv.events["layers_dropped_now"] == 0
    arena.check_invariants(check_weight_bytes=True)

    later = run_to_end(engine, LATER, "b")
    for rid, out in later.items():
        assert_close_greedy(reference[rid], out, f"after restore of {dropped}: {rid}", max_tokens=MAX_TOKENS)

    # -- nothing leaked ----------------------------------------------------------------------
    assert kv.num_used_blocks == 0 and arena.owned_blocks() == []
    assert arena.num_free_blocks == arena.capacity_blocks == kv_before
    arena.check_invariants(check_weight_bytes=True)


def test_two_drops_rekey_the_peer_and_one_restore_brings_both_back(model_dir, reference):
    """A second drop while the peer already holds live K/V changes the block geometry again:
    the peer must re-key what it holds without losing a token."""
    engine = make_engine(model_dir, "arena", ARENA_TOKENS)
    runner, kv, arena = engine.executor, engine.kv, engine.executor.arena
    for i, prompt in enumerate(FIRST):
        engine.add_request(prompt, PARAMS, request_id=f"a{i}")
    outputs = {}
    for step in range(MAX_TOKENS * 4):
        if step == 3:
            runner.drop_layers([1])
        if step == 8:
            assert arena.num_used_blocks > 0
            runner.drop_layers([3])
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert runner.peer.layers == (1, 3) and kv.events["layer_drops"] == 2
    for rid, out in outputs.items():
        assert_close_greedy(reference[rid], out, f"two drops: {rid}", max_tokens=MAX_TOKENS)
    runner.restore_layers([1, 3])
    assert kv.num_blocks == ARENA_TOKENS // BLOCK and kv.events["layer_restores"] == 1
    later = run_to_end(engine, LATER[:1], "b")
    assert_close_greedy(reference["b0"], later["b0"], "after restore", max_tokens=MAX_TOKENS)
    assert kv.num_used_blocks == 0
    arena.check_invariants(check_weight_bytes=True)


def test_bad_drops_change_nothing(model_dir):
    engine = make_engine(model_dir, "arena", ARENA_TOKENS)
    runner = engine.executor
    with pytest.raises(ValueError):
        runner.drop_layers(range(NUM_LAYERS))  # some layer must stay on this device
    with pytest.raises(ValueError):
        runner.restore_layers([0])  # not dropped
    runner.drop_layers([2])
    with pytest.raises(ValueError):
        runner.drop_layers([2])
    assert runner.peer.layers == (2,) and engine.executor.arena.resident_layers == (0, 1, 3)
    engine.kv.check_invariants()


def test_a_drop_without_room_for_the_peer_is_refused_before_anything_changes(model_dir):
    """Issue 22, defect 3: on a full device the single-process peer's replica and KV do not fit
    beside the arena; the drop is refused up front with PeerRoomError, and serving goes on."""
    from nanoserve.model.layer_peer import PeerRoomError

    engine = make_engine(model_dir, "arena", ARENA_TOKENS)
    runner, arena = engine.executor, engine.executor.arena
    assert runner.peer.free_bytes() is None  # a CPU's RAM is not checked
    needed = runner.peer.bytes_needed([2, 3], arena, block_pages_after=4)
    # The replicas alone are the dropped layers' weights; KV comes on top.
    assert needed > weight_bytes_of(engine, (2, 3))
    runner.peer.free_bytes = lambda: needed - 1
    ids = [engine.add_request(p, PARAMS).request_id for p in FIRST[:2]]
    engine.step()
    with pytest.raises(PeerRoomError, match="needs .* GiB"):
        runner.drop_layers([2, 3])
    assert arena.resident_layers == (0, 1, 2, 3) and runner.peer.layers == ()
    arena.check_invariants(check_weight_bytes=True)
    runner.peer.free_bytes = lambda: needed  # exactly enough: the drop goes ahead
    runner.drop_layers([2, 3])
    assert runner.peer.layers == (2, 3)
    finished = set()
    while engine.has_unfinished_requests():
        finished.update(o.request_id for o in engine.step() if o.finished)
    assert finished == set(ids)
