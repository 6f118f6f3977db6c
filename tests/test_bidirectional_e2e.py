"""BROS end to end (bros.txt §5): online (RT) and offline (BE) requests share KV blocks.

1. A tiny random Llama (fp32, CPU) serves a mix of online and offline prompts under a KV pool so
   small that RT pages overwrite BE slots (lazily checkpointed), BE pages are restored and
   moved, and BE requests are swapped out or recomputed; every greedy output must match an
   uninterrupted paged run (vLLM's near-tie rule), with both attention backends.
2. Model-free: the real FCFS scheduler and Engine drive `BidirectionalKV` over tiny real caches
   with random arrivals; the executor runs every copy group, then checks that each chunk's
   positions read back the values written for them and that no two chunks share a slot.
"""
from __future__ import annotations

import random

import pytest
import torch
from conftest import backend_device, build_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.executor import Executor, ExecutorOutput
from nanoserve.memory.bidirectional import BidirectionalBlockManager
from nanoserve.memory.bidirectional_kv import BidirectionalKV
from nanoserve.memory.host import HostKVStore
from nanoserve.sched import SchedulerOutput
from nanoserve.sched.fcfs import FCFSScheduler

B, MAX_TOKENS = 4, 12
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
# Offline prompts first, so they hold the pool when the online ones arrive.
PRIORITIES = ["offline"] * 3 + ["online"] * 3
LENGTHS = [15, 15, 15, 3, 3, 3]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-bros")
    build_tiny_model("llama", directory)
    return str(directory)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(llama_dir, prompts):
    llm = LLM(llama_dir, device="cpu", dtype="float32", kv_cache_tokens=1024, block_size=B)
    return llm.generate(prompts, PARAMS, use_tqdm=False)


def run_bidirectional(llama_dir, prompts, backend: str, host_kv_tokens: int, layerwise: bool = False):
    # 16 blocks of 4: the three offline requests alone need 21 pages by their end.
    llm = LLM(llama_dir, device=backend_device(backend), dtype="float32", kv_manager="bidirectional",
              kv_cache_tokens=64, host_kv_tokens=host_kv_tokens, block_size=B, attention_backend=backend,
              layerwise_kv_copies=layerwise)
    outputs = llm.generate(prompts, PARAMS, priority=PRIORITIES, use_tqdm=False)
    return llm.engine, outputs


@pytest.mark.parametrize("backend, layerwise", [("torch", False), ("triton", False), ("torch", True)])
def test_rt_overwrites_and_be_restores_keep_greedy_output(llama_dir, prompts, reference, backend, layerwise):
    engine, outputs = run_bidirectional(llama_dir, prompts, backend, host_kv_tokens=64, layerwise=layerwise)
    for ref, out, priority in zip(reference, outputs, PRIORITIES):
        assert_close_greedy(ref, out, f"{backend} {priority} {out.request_id}", max_tokens=MAX_TOKENS)
    events = engine.kv.events
    assert events["overwrites"] > 0 and events["checkpointed_slots"] > 0, events  # lazy checkpoint
    assert events["restored_pages"] > 0 and events["relocated_pages"] > 0, events
    assert events["swap_outs"] > 0 and events["recomputes"] == 0, events  # the host had room
    assert all(o.metrics.num_preemptions == 0 for o, p in zip(outputs, PRIORITIES) if p == "online")
    assert engine.stats().kv_blocks_used == 0
    assert engine.kv.blocks.host.num_free_blocks == engine.kv.blocks.host.num_blocks


def test_no_host_room_means_no_overwrites_and_recompute(llama_dir, prompts, reference):
    engine, outputs = run_bidirectional(llama_dir, prompts, "torch", host_kv_tokens=0)
    for ref, out in zip(reference, outputs):
        assert_close_greedy(ref, out, f"no host: {out.request_id}", max_tokens=MAX_TOKENS)
    events = engine.kv.events
    assert events["overwrites"] == 0 and events["swap_outs"] == 0 and events["recomputes"] > 0, events
    assert engine.stats().kv_blocks_used == 0


# -- model-free: the scheduler, the adapter and real copies ----------------------------------
class CheckingExecutor(Executor):
    """Runs each step's copy groups on tiny caches, then plays the forward pass: every position
    of every chunk must read back its own value, at a slot no other chunk uses."""

    def __init__(self, kv: BidirectionalKV, store: HostKVStore, num_blocks: int):
        self.kv, self.store = kv, store
        self.caches = [(torch.zeros(num_blocks, B, 1, 1), torch.zeros(num_blocks, B, 1, 1))]
        self.ids: dict[str, int] = {}

    def value(self, request_id: str, position: int) -> float:
        return float(self.ids.setdefault(request_id, len(self.ids) + 1) * 1000 + position)

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        for group in batch.kv_copies:
            self.store.execute(group, self.caches)
        k = self.caches[0][0].view(-1)
        owner: dict[int, tuple[str, int]] = {}
        for c in batch.chunks:
            rid = c.request.request_id
            assert c.block_table == self.kv.block_table(c.request), f"{rid}: table changed after its chunk"
            for p in range(c.end):
                # The runner's slot mapping, including BROS's right-to-left BE layout.
                slot = c.block_table[p // B] * B + (B - 1 - p % B if c.right_to_left else p % B)
                assert slot not in owner, f"slot {slot}: {owner[slot]} and {(rid, p)}"
                owner[slot] = (rid, p)
                if p < c.start:
                    assert k[slot] == self.value(rid, p), f"{rid} position {p} lost its K/V"
        for slot, (rid, p) in owner.items():
            k[slot] = self.value(rid, p)
        return ExecutorOutput(sampled={c.request.request_id: 7 for c in batch.chunks if c.samples})


ARRIVAL = st.tuples(st.integers(0, 6), st.sampled_from(["online", "offline"]), st.integers(1, 14),
                    st.integers(1, 10))


@settings(max_examples=60, deadline=None)
@given(arrivals=st.lists(ARRIVAL, min_size=1, max_size=8), num_blocks=st.integers(4, 10),
       host_blocks=st.integers(0, 8), budget=st.sampled_from([3, 8, 64]))
def test_scheduler_steps_never_lose_or_share_kv(arrivals, num_blocks, host_blocks, budget):
    store = HostKVStore(host_blocks, B, 1, 1, 1, torch.float32, pin_memory=False)
    kv = BidirectionalKV(BidirectionalBlockManager(num_blocks, B, store))
    executor = CheckingExecutor(kv, store, num_blocks)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=num_blocks * B)
    engine = Engine(FCFSScheduler(config, kv), executor, tokenizer=None)
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    finished = {}
    for step in range(2000):
        while pending and pending[0][1][0] <= step:
            i, (_, priority, prompt_len, max_tokens) = pending.pop(0)
            prompt = [1] * min(prompt_len, num_blocks * B - 1)
            max_tokens = min(max_tokens, num_blocks * B - len(prompt))
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"r{i}",
                               priority=priority)
        if not pending and not engine.has_unfinished_requests():
            break
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(finished) == len(arrivals), "requests did not finish"
    assert kv.num_used_blocks == 0 and store.num_free_blocks == store.num_blocks
    kv.check_invariants()
