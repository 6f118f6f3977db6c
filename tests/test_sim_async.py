"""Asynchronous scheduling in the simulator (ours: `Efficiency.host_overlap`): a step launched
while the one before it still runs pays the larger of its device time and the host's per-step
work, not their sum; a step after the device idled pays both. Timing only: the policy, the
batches and the tokens are the synchronous engine's."""
from __future__ import annotations

from dataclasses import replace

import pytest

from nanoserve.sim.hardware import gpu
from nanoserve.sim.models import model
from nanoserve.sim.roofline import Roofline
from nanoserve.sim.simulation import SimConfig, simulate
from nanoserve.sim.workloads import TraceRequest

DECODES = [(1000, 1)] * 8


def roofline(host_s: float, overlap: bool) -> Roofline:
    return Roofline(gpu("H100-80G").with_efficiency(iteration_overhead_s=host_s, host_overlap=overlap),
                    model("Llama-2-7B"))


@pytest.mark.parametrize("host_s", [1e-4, 50e-3])  # under and over a 7B decode step's device time
def test_a_following_step_pays_the_larger_of_host_and_device(host_s):
    sync, overlapped = roofline(host_s, False), roofline(host_s, True)
    device = sync.iteration_seconds(DECODES) - host_s
    assert overlapped.iteration_seconds(DECODES, follows_step=True) == pytest.approx(max(device, host_s), rel=1e-12)
    # after an idle device, and without the overlap, a step pays both
    assert overlapped.iteration_seconds(DECODES) == sync.iteration_seconds(DECODES)
    assert sync.iteration_seconds(DECODES, follows_step=True) == sync.iteration_seconds(DECODES)
    assert overlapped.iteration_seconds([], follows_step=True) == 0.0


def run(host_s: float, overlap: bool, trace: list[TraceRequest]):
    efficiency = gpu("H100-80G").with_efficiency(iteration_overhead_s=host_s, host_overlap=overlap).efficiency
    return simulate(SimConfig(policy="fcfs", gpu="H100-80G", model="Llama-2-7B", efficiency=efficiency,
                              fitted_policy_model=False, calibrate_cost_model=False), trace)


def test_a_lone_request_pays_the_host_once_then_overlaps():
    """One request, 100 prompt tokens, 5 output tokens: the prefill follows an idle device (host
    + device), each of the 4 decodes follows a step (max of the two); a host slower than the
    device sets the decode pace."""
    host_s = 50e-3
    (sync,), (overlapped,) = run(host_s, False, [TraceRequest(0.0, 100, 5)]).records, \
        run(host_s, True, [TraceRequest(0.0, 100, 5)]).records
    assert overlapped.ttft == pytest.approx(sync.ttft, rel=1e-12)
    r = roofline(host_s, False)
    decodes = [r.iteration_seconds([(100 + i, 1)]) - host_s for i in range(4)]
    assert sync.e2e - sync.ttft == pytest.approx(sum(d + host_s for d in decodes), rel=1e-9)
    assert overlapped.e2e - overlapped.ttft == pytest.approx(sum(max(d, host_s) for d in decodes), rel=1e-9)
    assert overlapped.e2e - overlapped.ttft == pytest.approx(4 * host_s, rel=1e-9)  # host-bound here


def test_an_idle_gap_ends_the_overlap():
    """Two requests far apart: each one's prefill follows an idle device and pays both."""
    trace = [TraceRequest(0.0, 100, 2), TraceRequest(10.0, 100, 2)]
    sync, overlapped = run(1e-3, False, trace), run(1e-3, True, trace)
    assert [r.ttft for r in overlapped.records] == pytest.approx([r.ttft for r in sync.records], rel=1e-12)
    assert all(o.e2e < s.e2e for o, s in zip(overlapped.records, sync.records))


@pytest.mark.parametrize("policy", ["conserve", "kunserve", "priority"])
def test_refused_where_the_engine_refuses_asynchronous_scheduling(policy):
    efficiency = gpu("H100-80G").with_efficiency(host_overlap=True).efficiency
    with pytest.raises(ValueError, match="host_overlap"):
        simulate(SimConfig(policy=policy, gpu="H100-80G", model="Llama-2-7B", efficiency=efficiency),
                 [TraceRequest(0.0, 10, 2)])


def test_measured_scheduling_time_is_charged_only_when_asked():
    """`scheduling_time_scale` (ours): each step pays its scheduler's measured planning time times
    the factor, in series; None charges nothing beyond the flat overhead, and host_overlap refuses it."""
    trace = [TraceRequest(0.01 * i, 50, 20) for i in range(8)]
    config = SimConfig(policy="fcfs", gpu="H100-80G", model="Llama-2-7B", fitted_policy_model=False,
                       calibrate_cost_model=False)
    flat = simulate(config, trace)
    charged = simulate(replace(config, scheduling_time_scale=1000.0), trace)
    assert flat.extra["scheduling_seconds"] == 0.0 and flat.extra["plan_wall_seconds"] > 0
    assert charged.extra["scheduling_seconds"] == pytest.approx(1000.0 * charged.extra["plan_wall_seconds"])
    assert charged.duration > flat.duration
    with pytest.raises(ValueError, match="scheduling_time_scale"):
        simulate(replace(config, efficiency=gpu("H100-80G").with_efficiency(host_overlap=True).efficiency,
                         scheduling_time_scale=1.0), trace)
