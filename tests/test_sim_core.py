"""The simulator's core (nanoserve/sim/): named models and GPUs, the roofline's two regimes, the
executor's virtual clock and EOS, and a whole simulated run through the real engine."""
from __future__ import annotations

import pytest

from nanoserve.sched.cost_model import CostModel
from nanoserve.sim.executor import VirtualClock
from nanoserve.sim.hardware import GPUS, gpu
from nanoserve.sim.models import MODELS, ModelCost, model
from nanoserve.sim.roofline import Roofline, fitted_cost_model
from nanoserve.sim.simulation import SimConfig, kv_blocks, simulate
from nanoserve.sim.workloads import ClosedLoopBatches, TraceRequest

PUBLISHED_PARAMS = {"Llama-2-7B": 6.74e9, "Qwen2.5-14B": 14.7e9, "Qwen2.5-72B": 72.7e9, "OPT-13B": 12.9e9,
                    "OPT-30B": 30.0e9, "Llama-3-70B": 70.6e9, "OPT-175B": 175e9}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_named_models_weigh_what_their_model_cards_say(name):
    assert ModelCost(model(name)).total_params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02)


def test_kv_bytes_per_token_follow_the_kv_heads():
    # Llama-2-7B: 32 layers x 2 (K, V) x 32 heads x 128 dims x 2 bytes = 512 KiB a token;
    # Qwen2.5-14B's grouped-query attention keeps 8 KV heads of its 40: 48 x 2 x 8 x 128 x 2.
    assert ModelCost(model("Llama-2-7B")).kv_bytes_per_token == 512 * 1024
    assert ModelCost(model("Qwen2.5-14B")).kv_bytes_per_token == 48 * 2 * 8 * 128 * 2


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="A100-80G"):
        gpu("V100")
    with pytest.raises(ValueError, match="OPT-13B"):
        model("GPT-5")


@pytest.mark.parametrize("gpu_name", sorted(GPUS))
def test_prefill_is_compute_bound_and_decode_memory_bound(gpu_name):
    r = Roofline(gpu(gpu_name), model("Llama-2-7B"))
    overhead = r.gpu.efficiency.iteration_overhead_s + r.model.num_layers * r.gpu.efficiency.layer_overhead_s
    # Prefill: time grows in proportion to tokens (compute roof): 4x the tokens, ~4x the time.
    t512, t2048 = r.iteration_seconds([(0, 512)]) - overhead, r.iteration_seconds([(0, 2048)]) - overhead
    assert 3.5 < t2048 / t512 < 4.6
    # ...and matches the compute roof: 2 x params x tokens FLOPs at the achieved rate.
    compute_s = 2 * ModelCost(r.model).layer_params * 2048 * r.model.num_layers / r.gpu.compute_rate
    assert t2048 == pytest.approx(compute_s, rel=0.25)
    # Decode: one sequence reads every weight for a single token: the memory roof.
    weights_s = ModelCost(r.model).weight_bytes / r.gpu.memory_rate
    assert r.iteration_seconds([(511, 1)]) - overhead == pytest.approx(weights_s, rel=0.1)
    # Batching decodes is nearly free while the weights dominate: 32 sequences cost far less than 32x one.
    assert r.iteration_seconds([(127, 1)] * 32) < 2 * r.iteration_seconds([(127, 1)])
    # Context makes decode dearer (K/V read), prefix makes prefill dearer (attention).
    assert r.iteration_seconds([(4095, 1)] * 32) > r.iteration_seconds([(127, 1)] * 32)
    assert r.iteration_seconds([(2048, 512)]) > r.iteration_seconds([(0, 512)])


def test_tensor_parallelism_splits_the_work_and_pays_all_reduces():
    one, two = (Roofline(gpu("A100-40G"), model("OPT-13B"), tp) for tp in (1, 2))
    assert two.iteration_seconds([(0, 2048)]) < 0.6 * one.iteration_seconds([(0, 2048)])
    assert two.layer_seconds([(0, 2048)]) > one.layer_seconds([(0, 2048)]) / 2  # the all-reduces


def test_the_policies_profile_of_the_simulated_gpu_predicts_it():
    r = Roofline(gpu("A100-80G"), model("Llama-2-7B"))
    fitted = fitted_cost_model(r)
    for batch in ([(0, 1024)], [(1023, 1)] * 64, [(0, 256)] + [(511, 1)] * 16):
        assert fitted.predict(batch) == pytest.approx(r.iteration_seconds(batch), rel=0.35)


def test_kv_capacity_is_what_the_weights_leave():
    config = SimConfig(gpu="A100-80G", model="Llama-2-7B")
    cost = ModelCost(model("Llama-2-7B"))
    expected = (80e9 * 0.9 - cost.weight_bytes - 2e9) / (cost.kv_bytes_per_token * 16)
    assert kv_blocks(config, Roofline(gpu("A100-80G"), model("Llama-2-7B"))) == int(expected)
    fixed = SimConfig(model="OPT-13B", kv_bytes=12e9)  # EcoServe's 12 GB of KV
    assert kv_blocks(fixed, Roofline(gpu("A100-80G"), model("OPT-13B"))) == int(12e9 // (819200 * 16))
    with pytest.raises(ValueError, match="no KV memory"):
        kv_blocks(SimConfig(gpu="A100-40G", model="OPT-175B"), Roofline(gpu("A100-40G"), model("OPT-175B")))


def test_the_virtual_clock_only_moves_forward():
    clock = VirtualClock(5.0)
    clock.advance(1.5)
    clock.advance_to(3.0)  # the past: no change
    assert clock() == 6.5
    with pytest.raises(ValueError):
        clock.advance(-1)


TRACE = [TraceRequest(0.0, 300, 20), TraceRequest(0.05, 40, 5), TraceRequest(0.05, 1000, 1),
         TraceRequest(3.0, 64, 64, "offline"), TraceRequest(3.0, 2000, 3)]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "ecoserve", "bros", "conserve", "kunserve"])
def test_every_policy_runs_the_trace_to_its_workload_lengths(policy):
    result = simulate(SimConfig(policy=policy, gpu="A100-80G", model="Llama-2-7B"), TRACE)
    assert [r.output_len for r in result.records] == [20, 5, 1, 64, 3]
    assert all(r.finish_reason == "stop" for r in result.records)  # the simulated EOS, not max_tokens
    for record, spec in zip(result.records, TRACE):
        assert record.arrival == spec.arrival and record.ttft > 0 and record.e2e >= record.ttft
    # Requests arriving at 3 s cannot finish before then: the clock jumped over the idle gap.
    assert min(r.arrival + r.e2e for r in result.records[3:]) > 3.0
    assert result.busy_seconds <= result.duration + 1e-9


@pytest.mark.parametrize("policy", ["fcfs", "bros"])
def test_closed_loop_batches_go_in_when_the_previous_batch_completes(policy):
    # BROS §7.1: BE requests "are periodically submitted in a batch manner when previous batched
    # requests are completed"; the open trace runs beside them.
    flat = CostModel(decode_seqs=0.01, prefill_tokens=0.001, iteration=0.005)
    batches = tuple(tuple(TraceRequest(0.0, 50 + 10 * i, 3 + i, "offline") for i in range(3)) for _ in range(5))
    loop = ClosedLoopBatches(batches, start=0.5, until=1.0)
    online = [TraceRequest(0.0, 100, 4), TraceRequest(0.7, 100, 4)]
    result = simulate(SimConfig(policy=policy), online, executor_cost=flat, closed_loop=loop)
    assert [r.arrival for r in result.records[:2]] == [0.0, 0.7]
    offline = result.records[2:]
    assert len(offline) % 3 == 0 and 3 <= len(offline) < loop.num_requests  # `until` stopped it early
    assert all(r.finish_reason == "stop" for r in result.records)
    groups = [offline[i:i + 3] for i in range(0, len(offline), 3)]
    assert {r.arrival for r in groups[0]} == {0.5}
    for before, after in zip(groups, groups[1:]):
        completed = max(r.arrival + r.e2e for r in before)
        assert [r.arrival for r in after] == pytest.approx([completed] * 3)  # the moment the last one finished
        assert completed <= 1.0  # none submitted after `until`
    assert max(r.arrival + r.e2e for r in groups[-1]) > 1.0 or len(groups) == len(batches)
    with pytest.raises(ValueError):
        ClosedLoopBatches(())


def test_the_executor_can_run_on_a_fitted_profile_instead_of_the_roofline():
    flat = CostModel(decode_seqs=0.01, prefill_tokens=0.001, iteration=0.005)
    result = simulate(SimConfig(policy="fcfs"), [TraceRequest(0.0, 100, 3)], executor_cost=flat)
    # One prefill step (0.1 + 0.005) yields the first token, then two decode steps (0.015 each).
    record = result.records[0]
    assert record.ttft == pytest.approx(0.105)
    assert record.e2e == pytest.approx(0.105 + 2 * 0.015)
