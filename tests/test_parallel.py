"""Tensor and pipeline parallelism (nanoserve/model/parallel.py, stages.py; parallel/pipeline.py,
executor.py, launch.py).

Two levels: in one process, each rank's shard or stage is loaded (a `TPGroup` with a rank but
no process group: loading needs no collectives) and compared with the slices of the HF tensors
it should hold, micro-batch cutting is checked with hypothesis, and a step survives the trip
through its wire message; across 2 and 4 real gloo processes on the CPU, greedy outputs match a
single process for every architecture under TP, PP and TP x PP, a dead worker is an error and
not a hang, and shutdown leaves no process behind.
"""
from __future__ import annotations

import time

import pytest
import torch
from conftest import build_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.memory.copies import KVCopy
from nanoserve.model.loader import load_model
from nanoserve.model.parallel import TPGroup, kv_head_shard, local_kv_heads
from nanoserve.model.stages import MissingLayer, partition_layers, stage_layouts
from nanoserve.parallel.executor import StepMessage, WorkerFailure
from nanoserve.parallel.pipeline import split_microbatches
from nanoserve.request import Request
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [300, 20, 5]]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    dirs = {}
    for arch in ("llama", "qwen2", "qwen3", "opt"):
        dirs[arch] = tmp_path_factory.mktemp(f"tp-{arch}")
        build_tiny_model(arch, dirs[arch])
    return dirs


# -- one process: shard arithmetic and loading -------------------------------------------------
def test_kv_heads_split_or_replicate():
    assert local_kv_heads(8, 2) == 4 and local_kv_heads(2, 4) == 1
    # Four ranks over two KV heads: ranks 0-1 keep head 0, ranks 2-3 head 1 (their query heads').
    assert [kv_head_shard(2, 16, TPGroup(r, 4)) for r in range(4)] == [(0, 16), (0, 16), (16, 16), (16, 16)]
    with pytest.raises(ValueError, match="divisible"):
        local_kv_heads(3, 2)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_loads_exactly_its_slices(tiny_dirs, tp_size):
    hf = load_file(str(tiny_dirs["llama"] / "model.safetensors"))
    q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    o, down = hf["model.layers.1.self_attn.o_proj.weight"], hf["model.layers.1.mlp.down_proj.weight"]
    embed, head_dim = hf["model.embed_tokens.weight"], 16
    rows = -(-embed.shape[0] // tp_size)
    for rank in range(tp_size):
        model, cfg = load_model(tiny_dirs["llama"], torch.device("cpu"), torch.float32, TPGroup(rank, tp_size))
        layer0, layer1 = model.model.layers[0], model.model.layers[1]
        qkv = layer0.self_attn.qkv_proj.weight
        q_rows, kv_start = q.shape[0] // tp_size, kv_head_shard(cfg.num_kv_heads, head_dim, TPGroup(rank, tp_size))[0]
        assert torch.equal(qkv[:q_rows], q[rank * q_rows:(rank + 1) * q_rows])
        assert torch.equal(qkv[q_rows:q_rows + head_dim * layer0.self_attn.num_kv_heads],
                           k[kv_start:kv_start + head_dim * layer0.self_attn.num_kv_heads])
        cols = o.shape[1] // tp_size
        assert torch.equal(layer1.self_attn.o_proj.weight, o[:, rank * cols:(rank + 1) * cols])
        cols = down.shape[1] // tp_size
        assert torch.equal(layer1.mlp.down_proj.weight, down[:, rank * cols:(rank + 1) * cols])
        assert torch.equal(model.model.embed_tokens.weight, embed[rank * rows:(rank + 1) * rows])


def test_layers_split_into_contiguous_stages():
    assert partition_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert partition_layers(2, 2) == [range(0, 1), range(1, 2)]
    with pytest.raises(ValueError):
        partition_layers(2, 3)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_a_stage_loads_only_its_layers(tiny_dirs, arch):
    first, last = stage_layouts(2, 2)
    for layout in (first, last):
        model, _ = load_model(tiny_dirs[arch], torch.device("cpu"), torch.float32, stage=layout)
        body = model.model.decoder if arch == "opt" else model.model
        held = [not isinstance(layer, MissingLayer) for layer in body.layers]
        assert held == [layout.is_first, layout.is_last]
        assert (body.embed_tokens is not None) == (layout.is_first or model.lm_head is None)
        names = {n for n, _ in model.named_parameters()}
        assert (all(".layers.1." not in n for n in names) if layout.is_first
                else all(".layers.0." not in n for n in names))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=8), st.integers(1, 6))
def test_microbatches_cut_by_token_count(chunks, count):
    requests = [Request(f"r{i}", list(range(1, n + 2 + (not samples))), PARAMS)
                for i, (n, samples) in enumerate(chunks)]
    scheduled = [ScheduledChunk(r, 1, n, [0]) for r, (n, _) in zip(requests, chunks)]
    microbatches = split_microbatches(scheduled, count)
    total = sum(n for n, _ in chunks)
    assert 1 <= len(microbatches) <= min(count, total)
    sizes = [sum(c.num_tokens for c in mb) for mb in microbatches]
    assert sum(sizes) == total and max(sizes) - min(sizes) <= max(n for n, _ in chunks)
    pieces = [c for mb in microbatches for c in mb]  # in order: each request's pieces contiguous
    for request, chunk in zip(requests, scheduled):
        mine = [p for p in pieces if p.request is request]
        assert mine[0].start == chunk.start and mine[-1].end == chunk.end
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
        assert [p.samples for p in mine] == [False] * (len(mine) - 1) + [chunk.samples]


def test_a_step_survives_its_wire_message(tiny_dirs):
    from nanoserve.builder import build_engine
    from nanoserve.config import EngineArgs

    engine = build_engine(EngineArgs(model=str(tiny_dirs["llama"]), device="cpu", kv_cache_tokens=256))
    runner = engine.executor
    requests = [Request(f"r{i}", list(range(1, 20 + i)), PARAMS) for i in range(2)]
    batch = SchedulerOutput([ScheduledChunk(requests[0], 4, 15, [3, 7]),
                             ScheduledChunk(requests[1], 19, 1, [1, 2], True)])
    sent, received = runner.prepare(batch), runner.prepare(StepMessage.of(batch).batch())
    for a, b in [(sent.input_ids, received.input_ids), (sent.positions, received.positions),
                 (sent.ctx.slot_mapping, received.ctx.slot_mapping), (sent.ctx.block_tables, received.ctx.block_tables),
                 (sent.ctx.directions, received.ctx.directions)]:
        assert torch.equal(a, b)
    assert sent.sample_rows == received.sample_rows == [14, 15]
    # The step's copies travel with their tickets, and so do those of earlier copies that landed.
    copy = KVCopy("load", (0, 1), (4, 5), reader="r0")
    batch.kv_copies, batch.landed_copies = [[copy]], (7, 9)
    wired = StepMessage.of(batch).batch()
    assert wired.kv_copies == [[copy]] and wired.kv_copies[0][0].ticket == copy.ticket
    assert wired.kv_copies[0][0].reader == "r0" and wired.landed_copies == (7, 9)


# -- several processes: same answers, failures, shutdown -----------------------------------------
@pytest.mark.parametrize("arch,tp_size,pp_size,async_pipeline", [
    ("llama", 2, 1, False), ("llama", 4, 1, False), ("qwen2", 2, 1, False), ("qwen3", 2, 1, False),
    ("opt", 2, 1, False), ("llama", 1, 2, False), ("qwen2", 1, 2, False), ("opt", 1, 2, False),
    ("llama", 2, 2, False), ("llama", 1, 2, True), ("qwen2", 1, 2, True), ("llama", 2, 2, True),
])
def test_greedy_outputs_match_a_single_process(tiny_dirs, arch, tp_size, pp_size, async_pipeline):
    directory = str(tiny_dirs[arch])
    expected = LLM(directory, device="cpu", dtype="float32", kv_cache_tokens=1024,
                   max_num_batched_tokens=8).generate(PROMPTS, PARAMS, use_tqdm=False)
    # A small token budget chunks the prompts, so micro-batches cut chunks and mix prefill pieces
    # with decodes; in flight, a prompt's next chunk runs while its previous one is still in
    # the pipeline.
    with LLM(directory, device="cpu", dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=8,
             tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size, async_pipeline=async_pipeline) as llm:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        executor = llm.engine.executor
        stats = executor.pipeline_stats() if pp_size > 1 else None
    for ref, out in zip(expected, outputs):
        assert_close_greedy(ref, out, f"{arch} tp={tp_size} pp={pp_size} async={async_pipeline}",
                            max_tokens=PARAMS.max_tokens)
    assert executor.failed == "the engine was shut down"
    if stats is not None:
        assert len(stats["stage_busy_seconds"]) == pp_size and all(b > 0 for b in stats["stage_busy_seconds"])
        assert 0.0 <= stats["bubble_ratio"] < 1.0
        assert stats["most_in_flight"] == (pp_size if async_pipeline else 0)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(pipeline_parallel_size=2, async_pipeline=True)])
def test_a_dead_worker_is_an_error_not_a_hang(tiny_dirs, parallel):
    llm = LLM(str(tiny_dirs["llama"]), device="cpu", dtype="float32", kv_cache_tokens=1024, **parallel)
    try:
        assert len(llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)) == 1
        executor = llm.engine.executor
        (worker,) = executor.pool.processes
        worker.kill()
        worker.wait(30)
        started = time.monotonic()
        with pytest.raises(WorkerFailure, match="worker"):
            llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
        assert time.monotonic() - started < 60
        assert llm.engine.kv.num_used_blocks == 0  # the failed request was aborted, its blocks freed
        assert not llm.engine.has_unfinished_requests()  # nothing left waiting in flight
    finally:
        llm.shutdown()


def test_more_ranks_than_gpus_are_refused_before_any_worker_starts(monkeypatch, tmp_path):
    """NCCL runs one rank per GPU; on a one-GPU machine a TP/PP engine is refused up front (no
    GPU needed: the check reads only the device count)."""
    from nanoserve import builder
    from nanoserve.config import Topology
    from nanoserve.model.rank import RankPlan

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("RANK", raising=False)
    plan = RankPlan(builder.EngineArgs(tensor_parallel_size=2), str(tmp_path), 16, None, Topology(2, 1))
    with pytest.raises(ValueError, match="needs 2 GPUs, one a rank; this machine has 1"):
        builder._start_parallel(plan, torch.device("cuda", 0))


def test_shutdown_stops_every_worker(tiny_dirs):
    llm = LLM(str(tiny_dirs["qwen2"]), device="cpu", dtype="float32", kv_cache_tokens=1024, tensor_parallel_size=2)
    processes = llm.engine.executor.pool.processes
    llm.shutdown()
    assert all(p.poll() is not None for p in processes)
    llm.shutdown()  # twice is fine


def test_torchrun_runs_the_server_with_rank_0_serving(tiny_dirs, tmp_path):
    """The multi-process command of docs/reference/parallelism.md: every rank runs serve.py, rank 0 answers."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port, root = free_port(), Path(__file__).resolve().parents[1]
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "examples/serve.py", "--model", str(tiny_dirs["llama"]),
                             "--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "1024", "--port", str(port)],
                            cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("the server did not come up:\n" + (tmp_path / "torchrun.log").read_text()[-3000:])
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert "nanoserve_engine_alive" in metrics
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()


def test_kunserve_feeds_the_pipeline_its_lookahead_microbatches(tiny_dirs):
    directory = str(tiny_dirs["llama"])
    prompts = PROMPTS + [[9] * 30, [11] * 17]
    expected = LLM(directory, device="cpu", dtype="float32", kv_cache_tokens=1024).generate(
        prompts, PARAMS, use_tqdm=False)
    with LLM(directory, device="cpu", dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=16,
             policy="kunserve", pipeline_parallel_size=2) as llm:
        executor = llm.engine.executor
        cuts = []
        execute = executor.execute

        def spy(batch):
            cuts.append(batch.microbatches is not None)
            return execute(batch)

        executor.execute = spy
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert any(cuts), "the lookahead never cut a step"
    for ref, out in zip(expected, outputs):
        assert_close_greedy(ref, out, "kunserve pp=2", max_tokens=PARAMS.max_tokens)


@pytest.mark.parametrize("policy,kwargs,fired", [
    ("bros", dict(kv_cache_tokens=64, host_kv_tokens=64), ("overwrites", "checkpointed_slots")),
    ("conserve", dict(kv_cache_tokens=96, host_kv_tokens=1024,
                      kv_manager_options={"threshold": 0.0, "max_blocks_per_step": 16}), ("blocks_checkpointed",)),
    ("prefill-first", dict(kv_manager="swap", kv_cache_tokens=64, host_kv_tokens=1024), ("swap_outs", "swap_ins")),
])
def test_host_copies_run_on_every_stage(tiny_dirs, policy, kwargs, fired):
    """Managers that move K/V to the host (BROS's overwritten slots, ConServe's checkpoints)
    send their copies with the step; each stage runs them for its own layers."""
    import random

    from test_bros_policy import LENGTHS, MAX_TOKENS, PRIORITIES
    from test_bros_policy import PARAMS as MIXED

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in LENGTHS]
    directory = str(tiny_dirs["llama"])
    expected = LLM(directory, device="cpu", dtype="float32", kv_cache_tokens=1024, block_size=4).generate(
        prompts, MIXED, priority=PRIORITIES, use_tqdm=False)
    with LLM(directory, device="cpu", dtype="float32", policy=policy, block_size=4, pipeline_parallel_size=2,
             **kwargs) as llm:
        outputs = llm.generate(prompts, MIXED, priority=PRIORITIES, use_tqdm=False)
        events = llm.engine.kv.events
        stored_layers = llm.engine.executor.runner.host_store.k.shape[0]  # rank 0: stage 0's layers only
    for ref, out in zip(expected, outputs):
        assert_close_greedy(ref, out, f"{policy} pp=2 {out.request_id}", max_tokens=MAX_TOKENS)
    assert all(events[name] > 0 for name in fired), events
    assert stored_layers == 1  # of the tiny model's 2


def test_layer_wise_preemption_stops_every_tensor_parallel_rank_at_the_same_layer(tmp_path):
    """ConServe §4.3/§5 under TP: only rank 0 is asked to stop; the barrier at each safe point
    makes the worker stop at the same layer, so no collective is left waiting."""
    from conftest import _tiny_config

    from nanoserve.slo import SLO

    model_cls, config = _tiny_config("llama")
    config.num_hidden_layers = 4
    torch.manual_seed(4321)
    model = model_cls(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    offline_prompts = [[3 + i + 5 * j for j in range(11 + 3 * i)] for i in range(3)]
    online_prompt = [9, 8, 7, 6, 5, 4, 3]
    with LLM(str(tmp_path), device="cpu", dtype="float32", policy="conserve", kv_cache_tokens=512, block_size=4,
             preempt_every_layers=2, tensor_parallel_size=2) as llm:
        engine, runner = llm.engine, llm.engine.executor.runner
        for i, p in enumerate(offline_prompts):
            engine.add_request(p, PARAMS, f"off{i}", priority="offline")
        engine.step()  # the offline prefills
        arrivals = []

        def arrive(module, args, output):  # an online request arrives while layer 0 has just run
            if not arrivals:
                arrivals.append(engine.add_request(online_prompt, PARAMS, "on", priority="online",
                                                   slo=SLO(ttft=1e-3, tpot=1.0)))

        handle = runner.model.model.layers[0].register_forward_hook(arrive)
        try:
            assert engine.step() == []  # stopped on both ranks and discarded
        finally:
            handle.remove()
        assert runner.preemption.stopped_after == 2 and runner.preemption.num_preempted == 1
        outputs = {}
        while engine.has_unfinished_requests():  # the worker is still in step: this would hang if not
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
    reference = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_tokens=4096, block_size=4)
    expected = reference.generate(offline_prompts + [online_prompt], PARAMS, use_tqdm=False)
    for ref, rid in zip(expected, ["off0", "off1", "off2", "on"]):
        assert_close_greedy(ref, outputs[rid], f"tp=2 after layer-wise preemption: {rid}", max_tokens=8)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                      dict(pipeline_parallel_size=2, async_pipeline=True),
                                      dict(tensor_parallel_size=2, prefix_cache_host_tokens=512)])
def test_prefix_caching_shares_the_same_blocks_on_every_rank(tiny_dirs, parallel):
    """Rank 0 decides the hashes and the tables; every rank reads the shared blocks (and runs the
    host tier's copies) as told: outputs match one process without caching, and prompts hit."""
    directory = str(tiny_dirs["llama"])
    prefix = [(7 * i) % 500 + 1 for i in range(40)]
    first, rest = [prefix + [1]], [prefix + [2, 3], prefix + [4], prefix[:33]]
    kv_tokens = 128 if "prefix_cache_host_tokens" in parallel else 1024  # a small pool: the tier is used
    expected = LLM(directory, device="cpu", dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=16,
                   enable_prefix_caching=False)
    want = expected.generate(first, PARAMS, use_tqdm=False) + expected.generate(rest, PARAMS, use_tqdm=False)
    with LLM(directory, device="cpu", dtype="float32", kv_cache_tokens=kv_tokens, max_num_batched_tokens=16,
             enable_prefix_caching=True, **parallel) as llm:
        got = llm.generate(first, PARAMS, use_tqdm=False)
        if "prefix_cache_host_tokens" in parallel:  # evict the prefix to the host tier
            llm.generate([[400 + i for i in range(90)]], PARAMS, use_tqdm=False)
        got += llm.generate(rest, PARAMS, use_tqdm=False)
        if "prefix_cache_host_tokens" in parallel:
            assert llm.engine.stats().kv_events["prefix_cache_host_hits"] > 0
    for ref, out in zip(want, got):
        assert_close_greedy(ref, out, f"prefix caching {parallel}", max_tokens=PARAMS.max_tokens)
    assert [o.num_cached_tokens for o in got[-3:]] == [32, 32, 32]
