"""Moving a running request between engines (Llumnix's migration, the KunServe experiment's
Llumnix-like baseline): `Engine.detach_request` / `attach_request` on real engines leave greedy
output unchanged once the K/V blocks are copied, and the simulated migrator
(nanoserve/sim/migration.py) moves a request live, in stages, or gives it up."""
from __future__ import annotations

import pytest
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.engine import Handover
from nanoserve.request import Request
from nanoserve.sim.cluster import ClusterConfig, SimCluster
from nanoserve.sim.migration import MigrationConfig
from nanoserve.sim.simulation import SimConfig
from nanoserve.sim.workloads import TraceRequest

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9] * 21, [300, 20, 5, 17]]


def test_a_request_moved_mid_decode_with_its_kv_gives_the_same_greedy_output(tiny_llama_dir):
    def llm(tokens: int) -> LLM:
        return LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_tokens=tokens)

    expected = llm(1024).generate(PROMPTS, PARAMS, use_tqdm=False)
    source, target = llm(1024).engine, llm(512).engine  # different pools: different block ids
    ids = [source.add_request(p, PARAMS).request_id for p in PROMPTS]
    while min(source.requests[i].num_output_tokens for i in ids) < 4:  # every one mid-decode
        source.step()
    moving = source.requests[ids[1]]
    target.kv.reserve(moving, moving.num_computed_tokens)  # the destination's blocks, then the copy
    for (k_src, v_src), (k_dst, v_dst) in zip(source.executor.kv_caches, target.executor.kv_caches):
        src_blocks, dst_blocks = source.kv.block_table(moving), target.kv.block_table(moving)
        k_dst[dst_blocks] = k_src[src_blocks]
        v_dst[dst_blocks] = v_src[src_blocks]
    used = source.kv.num_used_blocks
    target.attach_request(source.detach_request(ids[1]))
    assert source.kv.num_used_blocks == used - len(target.kv.block_table(moving))  # its blocks freed here
    assert ids[1] not in source.requests and moving in target.scheduler.running
    with pytest.raises(ValueError, match="already here"):  # one engine serves a request once
        target.attach_request(Handover(moving, None))
    finished = {}
    for engine in (source, target):
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
    assert source.kv.num_used_blocks == target.kv.num_used_blocks == 0
    for request_id, ref in zip(ids, expected):
        assert_close_greedy(ref, finished[request_id], f"migrated {request_id}", max_tokens=PARAMS.max_tokens)
    assert finished[ids[1]].metrics.ttft == pytest.approx(moving.first_token_time - moving.arrival_time)


def test_attach_needs_the_kv_reserved_first(tiny_llama_dir):
    source = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_tokens=512).engine
    target = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_tokens=512).engine
    request_id = source.add_request(PROMPTS[0], PARAMS).request_id
    source.step()
    with pytest.raises(ValueError, match="not reserved"):
        target.attach_request(source.detach_request(request_id))


GPU, MODEL = "A100-80G", "Qwen2.5-14B"


def test_the_migrator_moves_the_shortest_decoding_request_live_from_a_full_instance():
    # Instance 0 serves eight long requests and instance 1 nothing: 0's freeness falls under
    # three blocks per request, 1's is unbounded, so every poll pairs them.
    trace = [TraceRequest(0.0, 1500 + 100 * i, 400) for i in range(8)]
    config = ClusterConfig(SimConfig(policy="fcfs", gpu=GPU, model=MODEL, kv_blocks=1000), 2,
                           migration=MigrationConfig())
    cluster = SimCluster(config, trace)
    for request_id in cluster.ids:
        cluster.members[0].engine.add_request([1] * cluster.trace[request_id].prompt_len,
                                              SamplingParams(max_tokens=400, ignore_eos=True), request_id)
        cluster.placement[request_id] = 0
    cluster.run()
    result = cluster.result()
    moved = [r for r, i in cluster.placement.items() if i == 1]
    assert result.events["migrations"] == len(moved) >= 1
    assert result.events["migrated_blocks"] >= sum(-(-1500 // 16) for _ in moved)  # at least their prompts
    # The first to move was the shortest one decoding: the 1,500-token request.
    assert "sim-0" in moved
    assert all(r.finish_reason is not None and r.preemptions == 0 for r in result.records)
    for member in cluster.members.values():
        member.engine.kv.check_invariants()
        assert member.engine.kv.num_used_blocks == 0


def test_a_migration_the_destination_cannot_hold_is_given_up():
    trace = [TraceRequest(0.0, 1500, 400), TraceRequest(0.0, 1500, 400)]
    config = ClusterConfig(SimConfig(policy="fcfs", gpu=GPU, model=MODEL, kv_blocks=192), 2,
                           migration=MigrationConfig())
    cluster = SimCluster(config, trace)
    source, target = cluster.members[0], cluster.members[1]
    for request_id in cluster.ids:
        source.engine.add_request([1] * 1500, SamplingParams(max_tokens=400, ignore_eos=True), request_id)
        cluster.placement[request_id] = 0
    while any(r.num_computed_tokens < 1500 for r in source.engine.requests.values()):
        source.engine.step()  # both prefilled: 2 x 94 of 192 blocks, 1.5 free per request
    # Instance 1 runs nothing but holds 172 blocks for something else: it looks free (no
    # request runs there) yet has 20 blocks, too few for a 94-block request.
    target.engine.kv.reserve(Request("blocker", [1] * 16, SamplingParams()), 172 * 16)
    assert cluster.migrator.freeness(source) < 3 < cluster.migrator.freeness(target)
    cluster.migrator.advance(source.clock.now)
    assert cluster.migrator.events["aborted_dst"] == 1 and not cluster.migrator.in_flight
    assert set(source.engine.requests) == {"sim-0", "sim-1"} and len(source.engine.scheduler.running) == 2
    assert target.engine.kv.num_used_blocks == 172  # nothing left reserved for the request
