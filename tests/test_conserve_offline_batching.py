"""ConServe's offline batching mode (conserve.txt §4.2, Alg. 1 lines 20-22) and Fig. 8's
no-prefetch bar, at the scheduler and in the simulator.

- With no online request anywhere, a step ignores the token budget ("the scheduler ignores the
  budget limit and sets the largest batch size that can saturate GPU compute or memory
  capacity"); once an online request is in the system, the budget holds again.
- In the simulator, such a step is long enough that an online arrival stops it at a safe point
  (§4.3: "in offline batching mode, ConServe aggressively increases batch sizes and chunk sizes
  and relies on layer-wise preemption to maintain responsiveness"); capped at 2,048 tokens (the
  rule before issue 45) the same arrival waits for a short step instead.
- Without prefetch, a checkpointed request is loaded in the step that resumes it.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from test_conserve_resident import add, build, offline_work_then_an_online_request_that_takes_its_memory, run_to_end

from nanoserve.sim.simulation import SimConfig, simulate
from nanoserve.sim.workloads import TraceRequest
from nanoserve.slo import SLO, RequestClass


def test_the_budget_holds_again_once_an_online_request_arrives():
    engine, executor, _ = build(num_blocks=64, budget=32, options={"offline_batch_tokens": None})
    for i in range(4):
        add(engine, f"off{i}", 20, 8, "offline")
    engine.step()
    assert sum(c.num_tokens for c in executor.batches[-1].chunks) == 80  # four whole prompts, past 32
    add(engine, "on", 8, 4, "online")
    engine.step()
    batch = executor.batches[-1]
    assert batch.chunks[0].request.request_id == "on"
    assert sum(c.num_tokens for c in batch.chunks) <= 32  # co-serving: max_num_batched_tokens and the SLO
    assert engine.scheduler.num_offline_batching_steps == 1


@pytest.mark.parametrize("prefetch", [True, False])
def test_without_prefetch_a_checkpointed_request_loads_in_the_step_that_resumes_it(prefetch):
    engine, executor, clock = build(num_blocks=20, block_seconds=0.01, options={"prefetch": prefetch})
    offline_work_then_an_online_request_that_takes_its_memory(engine)
    assert engine.kv.events["preemptions_with_checkpoint"] > 0
    run_to_end(engine, clock)
    events = engine.kv.events
    if prefetch:
        assert events["blocks_loaded_ahead"] > 0 and events["blocks_loaded_on_resume"] == 0
    else:
        assert events["blocks_loaded_ahead"] == 0 and events["blocks_loaded_on_resume"] > 0
    assert events["tokens_saved_from_recompute"] > 0  # either way, the checkpoint is what resumes
    assert executor.positions_checked > 0 and engine.kv.num_used_blocks == 0


def _offline_pool_then_online(ttft: float) -> tuple[SimConfig, list[TraceRequest]]:
    """Twelve 3,000-token offline prompts at t = 0, one online request 0.5 s into the first step."""
    trace = [TraceRequest(0.0, 3000, 16, RequestClass.OFFLINE) for _ in range(12)]
    trace.append(TraceRequest(0.5, 512, 8, RequestClass.ONLINE))
    config = SimConfig(policy="conserve", gpu="A100-40G", model="Llama-2-7B", online_slo=SLO(ttft=ttft, tpot=0.1),
                       host_kv_tokens=200_000, policy_options={"offline_batch_tokens": None})
    return config, trace


def test_a_long_offline_batching_step_is_stopped_at_a_safe_point_for_an_online_arrival():
    config, trace = _offline_pool_then_online(ttft=0.3)
    uncapped = simulate(config, trace)
    capped = simulate(replace(config, policy_options={"offline_batch_tokens": 2048}), trace)
    # Uncapped, the first step prefills every prompt the KV holds (~36,000 tokens, ~2.6 s): the
    # arrival at 0.5 s stops it at its first safe point (8 of 32 layers, ~0.66 s), long before
    # the forward would end, though a quarter of such a forward is already past the 0.3 s target.
    assert uncapped.extra["layerwise_preemptions"] == 1 and 0.5 < uncapped.extra["discarded_forward_seconds"] < 1.0
    # Capped at 2,048 tokens, steps last ~0.2 s: the arrival waits for one, never stops it.
    assert capped.extra["layerwise_preemptions"] == 0 and capped.extra["discarded_forward_seconds"] == 0
    ttft = {}
    for name, result in (("uncapped", uncapped), ("capped", capped)):
        (online,) = [r for r in result.records if r.priority is RequestClass.ONLINE]
        assert online.ttft is not None
        ttft[name] = online.ttft
        assert all(r.finish_reason == "stop" for r in result.records)
    assert ttft["uncapped"] < 0.5 and ttft["capped"] < 0.3
