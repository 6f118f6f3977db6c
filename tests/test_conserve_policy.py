"""ConServe (conserve.txt §4.2-4.5): SLO-budgeted co-serving, Alg. 2's preemption of a running
pure-offline batch at layer safe points, and resumption from incremental checkpoints.

Three levels: the scheduler alone over the real checkpointing KV manager with a model-free
executor (kv_harness) and a mock clock; the runner's layer-wise preemption on a tiny 4-layer
Llama, with the online arrival injected from inside the forward; and greedy outputs under a
tight pool with mixed online/offline arrivals, which must match fcfs.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from conftest import _tiny_config, build_tiny_model
from kv_harness import HEAD_DIM, HEADS, LAYERS, MockClock, TaggingExecutor
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.async_engine import AsyncEngine
from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.checkpoint import CheckpointConfig
from nanoserve.memory.checkpoint_kv import CheckpointKV
from nanoserve.memory.host import HostKVStore
from nanoserve.preemption import ForwardPreempted, PreemptionFlag
from nanoserve.sched.conserve import ConServeScheduler
from nanoserve.sched.cost_model import CostModel
from nanoserve.slo import SLO

B = 4
# Round numbers: 10 ms per step, per prefill token and per decode; nothing else.
COST = CostModel(prefill_tokens=0.01, decode_seqs=0.01, iteration=0.01)



class FlaggedExecutor(TaggingExecutor):
    """The model-free executor, recording batches and the preemption requests it receives."""

    def __init__(self, *args):
        super().__init__(*args)
        self.batches = []
        self.preemption_requests = 0

    def request_preemption(self) -> None:
        self.preemption_requests += 1

    def execute(self, batch):
        self.batches.append(batch)
        return super().execute(batch)


def build(num_blocks=32, budget=64, max_seqs=8, threshold=0.0, options=None):
    clock = MockClock()
    store = HostKVStore(64, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    kv = CheckpointKV(BlockPool(num_blocks, B), store, CheckpointConfig(threshold=threshold, max_blocks_per_step=64))
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=num_blocks * B,
                             policy="conserve", policy_options=dict(options or {}))
    executor = FlaggedExecutor(store, num_blocks, B)
    engine = Engine(ConServeScheduler(config, kv, cost_model=COST, clock=clock), executor, tokenizer=None)
    return engine, executor, clock


def add(engine, rid, prompt_len, max_tokens, priority, slo=None):
    return engine.add_request([7] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid,
                              priority=priority, slo=slo)


def run_to_end(engine, clock, limit=500):
    finished = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        clock.now += 0.01
    pytest.fail("requests did not finish")


# -- the scheduler (Alg. 1, §4.5) over the checkpointing manager, no model -------------------
@pytest.mark.parametrize("options, chunks", [
    ({"offline_batch_tokens": None}, [16, 16, 16]),  # Alg. 1 line 21: SLOAWARESCHEDULE(Q_off, Inf)
    ({}, [16, 16, 8]),  # the default: max_num_batched_tokens (a real engine's buffers); no time budget either
])
def test_offline_batching_mode_ignores_the_budget(options, chunks):
    engine, executor, _ = build(budget=40, options=options)
    for i in range(3):
        add(engine, f"off{i}", 16, 4, "offline")
    engine.step()
    assert [c.num_tokens for c in executor.batches[-1].chunks] == chunks
    assert engine.scheduler.num_offline_batching_steps == 1


def test_online_tpot_budgets_offline_work_and_preempts_the_rest():
    # 17 blocks: 5 offline prompts of 3 blocks use enough that every offline request is
    # checkpointed (the manager's adaptive rate, §4.4), and the 5th step runs out of blocks.
    engine, executor, clock = build(num_blocks=17)
    offline = [add(engine, f"off{i}", 9, 12, "offline") for i in range(5)]
    for _ in range(3):  # prefill, then decodes
        engine.step()
    add(engine, "on", 4, 6, "online", SLO(ttft=1.0, tpot=0.05))
    engine.step()  # the online prefill: the TTFT target leaves room for every offline decode
    assert len(executor.batches[-1].chunks) == 6 and not executor.batches[-1].preempted

    engine.step()  # online decoding: 10 ms step + 10 ms online decode leave 30 ms, 3 offline decodes
    batch = executor.batches[-1]
    assert [c.request.request_id for c in batch.chunks] == ["on", "off0", "off1", "off2"]
    assert COST.predict_output(batch) <= 0.05 + 1e-9
    # off4 makes room for off0's 4th block, off3 is over the budget (Alg. 1 line 16): newest first.
    assert batch.preempted == offline[:2:-1]
    assert [r.num_computed_tokens for r in offline[3:]] == [12, 12]  # kept their 3 checkpointed blocks
    assert engine.kv.events["preemptions_with_checkpoint"] == 2

    finished = run_to_end(engine, clock)
    assert set(finished) == {"on", *(r.request_id for r in offline)}
    assert finished["off4"] == [p % 100 for p in range(9, 21)]  # the executor samples position % 100
    assert engine.kv.events["tokens_saved_from_recompute"] >= 24  # off3, off4 resumed from host
    assert executor.positions_checked > 0 and engine.kv.num_used_blocks == 0


def test_online_prompt_is_never_chunked_for_ttft():
    engine, executor, _ = build(budget=64)
    add(engine, "off", 30, 4, "offline")
    add(engine, "on", 40, 4, "online", SLO(ttft=0.05, tpot=0.05))
    engine.step()
    chunks = {c.request.request_id: c.num_tokens for c in executor.batches[-1].chunks}
    assert chunks == {"on": 40}  # whole prompt (TTFT); no time left for offline work


# -- Alg. 2: an online arrival while a pure-offline batch is in flight ------------------------
@pytest.mark.parametrize("ttft, in_flight, expect", [
    (0.001, "offline", True),  # would miss its TTFT behind the batch: stop it
    (100.0, "offline", False),  # can wait
    (0.001, "mixed", False),  # co-serving batches are bounded by the budget, never stopped
    (0.001, None, False),  # nothing in flight (between steps)
])
def test_online_arrival_requests_preemption_of_the_running_batch(ttft, in_flight, expect):
    engine, executor, _ = build()
    for i in range(3):
        add(engine, f"off{i}", 20, 4, "offline")
    if in_flight == "mixed":
        add(engine, "on0", 4, 4, "online", SLO(ttft=10.0, tpot=10.0))
    if in_flight is not None:
        engine.scheduler.schedule()  # planned, handed to the executor, not finished yet
    add(engine, "on", 4, 4, "online", SLO(ttft=ttft))
    assert executor.preemption_requests == int(expect)  # the engine forwarded the policy's request
    assert engine.scheduler.num_running_batch_preemptions == int(expect)  # asked once, by the policy


# -- layer-wise preemption on a real model (§4.3) ---------------------------------------------
@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory):
    """The tiny random Llama of conftest with 4 layers, so a safe point every 2 is mid-model."""
    model_cls, config = _tiny_config("llama")
    config.num_hidden_layers = 4
    torch.manual_seed(4321)
    model = model_cls(config)
    model.generation_config.eos_token_id = None
    directory = tmp_path_factory.mktemp("tiny-llama-4")
    model.save_pretrained(directory)
    return str(directory)


PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
OFFLINE_PROMPTS = [[3 + i + 5 * j for j in range(11 + 3 * i)] for i in range(3)]
ONLINE_PROMPT = [9, 8, 7, 6, 5, 4, 3]


def test_preemption_flag_stops_only_at_safe_points():
    flag = PreemptionFlag(every=2, num_layers=4)
    flag.safe_point(1), flag.safe_point(2)  # nothing requested
    flag.request()
    flag.safe_point(1)  # not a safe point
    with pytest.raises(ForwardPreempted):
        flag.safe_point(2)
    assert flag.stopped_after == 2 and flag.num_preempted == 1 and not flag.requested
    flag.request()
    flag.safe_point(4)  # after the last layer the forward is done: never stopped there
    assert flag.num_preempted == 1


def test_a_safe_point_waits_for_the_device_before_it_reads_the_flag():
    """On a GPU the CPU runs ahead: the check must first let the device reach the safe point."""
    events = []
    flag = PreemptionFlag(every=2, num_layers=6, on_safe_point=lambda: events.append("arrivals"))
    flag.wait_for_device = lambda: events.append("sync")
    flag.safe_point(1)  # not checked: no sync
    flag.safe_point(2)
    flag.safe_point(6)  # after the last layer: nothing to stop, no sync
    assert events == ["sync", "arrivals"]


def test_online_arrival_stops_a_pure_offline_forward_within_k_layers(llama4_dir):
    llm = LLM(llama4_dir, device="cpu", dtype="float32", policy="conserve", kv_cache_tokens=512, block_size=B,
              preempt_every_layers=2)
    engine, runner = llm.engine, llm.engine.executor
    assert runner.preemption.every == 2
    offline = [engine.add_request(p, PARAMS, f"off{i}", priority="offline") for i, p in enumerate(OFFLINE_PROMPTS)]
    engine.step()  # the offline prefills
    engine.step()  # one decode each

    layers = runner.model.model.layers
    calls = [0] * len(layers)
    arrivals = []

    def count(i):
        def hook(module, args, output):
            calls[i] += 1
            if i == 0 and not arrivals:  # an online request arrives while layer 0 has just run
                arrivals.append(engine.add_request(ONLINE_PROMPT, PARAMS, "on", priority="online",
                                                   slo=SLO(ttft=1e-3, tpot=1.0)))
        return hook

    handles = [layer.register_forward_hook(count(i)) for i, layer in enumerate(layers)]
    try:
        before = [(r.num_computed_tokens, list(r.token_ids)) for r in offline]
        assert engine.step() == []  # stopped and discarded
    finally:
        for h in handles:
            h.remove()
    assert calls == [1, 1, 0, 0]  # stopped at the safe point after layer 2 of 4
    assert runner.preemption.stopped_after == 2 and runner.preemption.num_preempted == 1
    assert engine.scheduler.num_running_batch_preemptions == 1
    assert [(r.num_computed_tokens, list(r.token_ids)) for r in offline] == before  # nothing advanced, nothing lost

    chunks = []
    execute = runner.execute
    runner.execute = lambda batch: (chunks.append([c.request.request_id for c in batch.chunks]), execute(batch))[1]
    try:
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
    finally:
        del runner.execute
    assert chunks[0][0] == "on"  # the next step serves the online request first

    reference = LLM(llama4_dir, device="cpu", dtype="float32", kv_cache_tokens=4096, block_size=B)
    expected = reference.generate(OFFLINE_PROMPTS + [ONLINE_PROMPT], PARAMS, use_tqdm=False)
    for ref, rid in zip(expected, ["off0", "off1", "off2", "on"]):
        assert_close_greedy(ref, outputs[rid], f"after layer-wise preemption: {rid}", max_tokens=8)


def test_server_loop_admits_an_arrival_mid_forward_and_stops_the_offline_batch(llama4_dir):
    """The server's engine thread is inside a pure-offline forward when an online request comes
    in from the event loop: at the next safe point the loop adds it, Alg. 2 asks to stop, and
    the forward stops there instead of finishing first."""
    llm = LLM(llama4_dir, device="cpu", dtype="float32", policy="conserve", kv_cache_tokens=512, block_size=B,
              preempt_every_layers=2)
    runner = llm.engine.executor
    async_engine = AsyncEngine(llm.engine)
    in_forward, arrived = threading.Event(), threading.Event()

    def hold_first_forward(module, args, output):  # layer 0 of the first forward waits for the arrival
        if not in_forward.is_set():
            in_forward.set()
            assert arrived.wait(30)

    handle = runner.model.model.layers[0].register_forward_hook(hold_first_forward)

    async def collect(prompt, rid, **kwargs):
        final = None
        async for out in async_engine.generate(prompt, PARAMS, rid, **kwargs):
            final = out
        return final

    async def scenario():
        offline = [asyncio.create_task(collect(p, f"off{i}", priority="offline"))
                   for i, p in enumerate(OFFLINE_PROMPTS)]
        await asyncio.to_thread(in_forward.wait, 30)
        online = asyncio.create_task(collect(ONLINE_PROMPT, "on", priority="online", slo=SLO(ttft=1e-3, tpot=1.0)))
        await asyncio.sleep(0.2)  # let the handler put the request in the inbox
        arrived.set()
        return await asyncio.gather(*offline, online)

    async_engine.start()
    try:
        outputs = asyncio.run(scenario())
    finally:
        async_engine.shutdown()
        handle.remove()
    assert runner.preemption.num_preempted == 1 and runner.preemption.stopped_after == 2
    assert llm.engine.scheduler.num_running_batch_preemptions == 1
    reference = LLM(llama4_dir, device="cpu", dtype="float32", kv_cache_tokens=4096, block_size=B)
    expected = reference.generate(OFFLINE_PROMPTS + [ONLINE_PROMPT], PARAMS, use_tqdm=False)
    for ref, out in zip(expected, outputs):
        assert_close_greedy(ref, out, f"after a mid-forward arrival: {out.request_id}", max_tokens=8)


def test_a_batch_with_online_work_is_never_stopped(llama4_dir):
    llm = LLM(llama4_dir, device="cpu", dtype="float32", policy="conserve", kv_cache_tokens=512, block_size=B)
    engine, runner = llm.engine, llm.engine.executor
    runner.preemption.every = 1
    engine.add_request(OFFLINE_PROMPTS[0], PARAMS, "off", priority="offline")
    engine.add_request(ONLINE_PROMPT, PARAMS, "on", priority="online")
    runner.request_preemption()
    assert len(engine.step()) == 2  # both prefills sampled
    assert runner.preemption.num_preempted == 0 and not runner.preemption.requested


# -- same answers as fcfs, with checkpointed preemptions ---------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-conserve")
    build_tiny_model("llama", directory)
    return str(directory)


MIXED_OFFLINE = [[1 + (i * 7 + j) % 500 for j in range(9 + 4 * i)] for i in range(5)]
MIXED_ONLINE = [[2 + (i * 11 + j) % 500 for j in range(6 + 5 * i)] for i in range(3)]
MIXED_PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("online_slo", [None, SLO(ttft=10.0, tpot=1e-4)], ids=["default-slo", "tight-tpot"])
def test_greedy_outputs_match_fcfs_with_checkpointed_preemptions(llama_dir, online_slo):
    # 24 blocks of 4 for 8 requests of 18 to 37 tokens: offline work fills the pool, then online
    # requests arrive and take room; threshold 0 checkpoints every full block. With a TPOT target
    # no step can meet, every offline request is over budget while an online one decodes: it is
    # paused with its K/V, and an online request that needs the memory drops it (§4.4).
    llm = LLM(llama_dir, device="cpu", dtype="float32", policy="conserve", kv_cache_tokens=96, block_size=B,
              kv_manager_options={"threshold": 0.0, "max_blocks_per_step": 16}, host_kv_tokens=1024)
    engine = llm.engine
    chunks: list[tuple[str, int, int]] = []
    execute = engine.executor.execute
    engine.executor.execute = lambda batch: (
        chunks.extend((c.request.request_id, c.start, c.end) for c in batch.chunks), execute(batch))[1]
    ids = [engine.add_request(p, MIXED_PARAMS, f"off{i}", priority="offline").request_id
           for i, p in enumerate(MIXED_OFFLINE)]
    outputs = {}
    for step in range(1000):
        if step in (4, 6, 8):  # online arrivals while the offline work decodes
            i = (step - 4) // 2
            ids.append(engine.add_request(MIXED_ONLINE[i], MIXED_PARAMS, f"on{i}", priority="online",
                                          slo=online_slo).request_id)
        elif not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert sorted(outputs) == sorted(ids)

    fcfs = LLM(llama_dir, device="cpu", dtype="float32", policy="fcfs", kv_cache_tokens=4096, block_size=B)
    expected = fcfs.generate(MIXED_OFFLINE + MIXED_ONLINE, MIXED_PARAMS, use_tqdm=False)
    for ref, rid in zip(expected, ids):
        assert_close_greedy(ref, outputs[rid], f"conserve vs fcfs: {rid}", max_tokens=12)

    events = engine.kv.events
    assert engine.stats().num_preemptions > 0, "the pool was meant to force preemptions"
    assert events["preemptions_with_checkpoint"] > 0 and events["tokens_saved_from_recompute"] > 0
    # A resumed request restarts at its checkpoint (a whole number of blocks), not at 0.
    resumed = [(rid, start) for k, (rid, start, _) in enumerate(chunks)
               if any(r == rid and end > start for r, _, end in chunks[:k]) and start < max(
                   end for r, _, end in chunks[:k] if r == rid)]
    assert resumed and all(start > 0 and start % B == 0 for _, start in resumed)
    assert events["blocks_loaded_ahead"] > 0 and events["blocks_loaded_on_resume"] == 0  # prefetched ahead
    if online_slo is not None:
        assert events["pauses"] > 0 and events["pauses_resumed"] > 0 and events["paused_dropped"] > 0, events
    assert engine.kv.num_used_blocks == 0
