"""Layer-wise preemption in the simulator (conserve.txt §4.3; nanoserve/sim/executor.py): an
online arrival in the middle of a pure-offline forward is admitted at the next safe point, and
ConServe's Alg. 2 stops the forward there, as the real runner's `PreemptionFlag` does."""
from __future__ import annotations

import math
import os

import pytest

from nanoserve.sim.executor import SimExecutor
from nanoserve.sim.hardware import gpu
from nanoserve.sim.models import model
from nanoserve.sim.roofline import Roofline
from nanoserve.sim.simulation import SimConfig, simulate
from nanoserve.sim.workloads import TraceRequest
from nanoserve.slo import SLO

# Three offline prompts fill the first step's 2048-token budget (a pure-offline prefill, ~0.15 s
# on an A100-80G); an online request arrives 60 ms into it with a TTFT target (0.1 s) that
# waiting for the rest of the forward would miss, so Alg. 2 asks to stop it.
ARRIVAL = 0.06
TRACE = [TraceRequest(0.0, 1000, 4, "offline"), TraceRequest(0.0, 1000, 4, "offline"),
         TraceRequest(0.0, 1000, 4, "offline"), TraceRequest(ARRIVAL, 200, 6, "online")]
TIGHT = SLO(ttft=0.1, tpot=0.1)
ROOFLINE = Roofline(gpu("A100-80G"), model("Llama-2-7B"))


@pytest.fixture
def steps(monkeypatch):
    """Every executed step: (clock before, clock after, stopped?, [(id, priority, start, tokens)]),
    for steps without KV copies (a forward may wait for the copies it reads)."""
    monkeypatch.setenv("NANOSERVE_CHECK_INVARIANTS", "1")  # the engine checks the KV manager every step
    seen = []
    execute = SimExecutor.execute

    def recording(self, batch):
        before = self.clock.now
        chunks = [(c.request.request_id, c.request.priority, c.start, c.num_tokens) for c in batch.chunks]
        assert not any(batch.kv_copies), "the scenarios here have no memory pressure"
        out = execute(self, batch)
        seen.append((before, self.clock.now, out.preempted, chunks, sum(c.samples for c in batch.chunks)))
        return out

    monkeypatch.setattr(SimExecutor, "execute", recording)
    return seen


def run(policy: str, **config) -> object:
    return simulate(SimConfig(policy=policy, gpu="A100-80G", model="Llama-2-7B", online_slo=TIGHT, **config), TRACE)


def test_an_online_arrival_stops_the_offline_forward_at_the_next_safe_point(steps):
    result = run("conserve")
    assert os.environ["NANOSERVE_CHECK_INVARIANTS"] == "1"
    start, end, stopped, chunks, _ = steps[0]
    assert stopped and {p for _, p, _, _ in chunks} == {"offline"}
    assert sum(n for *_, n in chunks) == 2048  # the offline batching mode's full budget
    # The first safe point (every 8 of the 32 layers) at or after the arrival: the clock stops
    # exactly there: the iteration overhead, then that many layers of this batch.
    per_layer = ROOFLINE.layer_seconds([(s, n) for *_, s, n in chunks])
    before = ROOFLINE.gpu.efficiency.iteration_overhead_s
    layers = 8 * math.ceil((ARRIVAL - start - before) / per_layer / 8)
    assert 0 < layers < 32
    assert end == pytest.approx(start + before + layers * per_layer, rel=1e-12)
    assert start + before + (layers - 8) * per_layer < ARRIVAL <= end
    assert result.extra["layerwise_preemptions"] == 1
    assert result.extra["discarded_forward_seconds"] == pytest.approx(end - start, rel=1e-12)

    # The stopped step is discarded: the next one serves the online request first, and the
    # offline requests resume from where they were (nothing advanced, nothing recomputed).
    _, _, stopped2, chunks2, _ = steps[1]
    assert not stopped2 and chunks2[0][:3] == ("sim-3", "online", 0)
    resumed = {rid: start for rid, _, start, _ in chunks2[1:]}
    assert all(resumed.get(rid, 0) == 0 for rid, *_ in chunks)

    # No token lost or duplicated: every request finished with its workload's length.
    assert all(r.finish_reason == "stop" for r in result.records)
    assert result.generated[-1][1] == sum(r.output_len for r in TRACE)
    online = result.records[3]
    assert online.ttft < end + ROOFLINE.iteration_seconds([(0, 200)] + [(0, 1000)] * 2) - ARRIVAL


def test_priority_never_stops_a_forward_and_its_online_request_waits(steps):
    conserve_ttft = run("conserve").records[3].ttft
    steps.clear()
    result = run("priority")
    assert not any(step[2] for step in steps)
    assert result.extra["layerwise_preemptions"] == 0
    first_start, first_end, _, first_chunks, _ = steps[0]
    assert first_end - first_start == pytest.approx(
        ROOFLINE.iteration_seconds([(s, n) for *_, s, n in first_chunks], steps[0][4]), rel=1e-12)
    # vLLM++ sees the arrival only when the whole 2048-token forward has ended.
    assert result.records[3].ttft > first_end - ARRIVAL > 0
    assert result.records[3].ttft > conserve_ttft
    assert result.generated[-1][1] == sum(r.output_len for r in TRACE)


def test_a_batch_with_online_work_is_never_stopped(steps):
    # The online request is already there when the step is built: a co-serving batch, which
    # only the SLO budget bounds (§4.3), runs to its end however the flag is set.
    trace = [TraceRequest(0.0, 200, 3, "online"), TraceRequest(0.0, 1800, 3, "offline"),
             TraceRequest(0.01, 100, 3, "online")]
    result = simulate(SimConfig(policy="conserve", gpu="A100-80G", online_slo=TIGHT), trace)
    assert not any(step[2] for step in steps)
    assert result.extra["layerwise_preemptions"] == 0 and all(r.finish_reason == "stop" for r in result.records)


def test_safe_points_every_k_layers_follow_the_config(steps):
    run("conserve", preempt_every_layers=4)
    start, end, stopped, chunks, _ = steps[0]
    per_layer = ROOFLINE.layer_seconds([(s, n) for *_, s, n in chunks])
    layers = (end - start - ROOFLINE.gpu.efficiency.iteration_overhead_s) / per_layer
    assert stopped and layers == pytest.approx(round(layers)) and round(layers) % 4 == 0
    steps.clear()
    # A safe point only between layers, never after the last: with k = 32, nothing can stop it.
    result = run("conserve", preempt_every_layers=32)
    assert not any(step[2] for step in steps) and result.extra["layerwise_preemptions"] == 0


def test_without_arrivals_mid_forward_conserve_runs_as_before(steps):
    # Safe points with nothing arriving change no time: the same clock as one roofline call.
    trace = [TraceRequest(0.0, 1500, 5, "offline"), TraceRequest(0.0, 900, 5, "offline")]
    simulate(SimConfig(policy="conserve", gpu="A100-80G"), trace)
    assert steps
    for start, end, stopped, chunks, sampled in steps:
        assert not stopped
        expected = ROOFLINE.iteration_seconds([(s, n) for *_, s, n in chunks], sampled)
        assert end - start == pytest.approx(expected, rel=1e-12)
