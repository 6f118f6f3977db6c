"""The simulator's link (nanoserve/sim/executor.py): KV copies queue on one FIFO link beside the
forwards, a forward waits only for the copies it reads, and each copy lands in the host store's
ledger once virtual time passes its end. Hand-made batches on Llama-2-7B / A100-80G, where a
4,096-token copy over PCIe outlasts a decode step several times over."""
from __future__ import annotations

import math

import pytest
import torch

from nanoserve.memory.host import HostKVStore, KVCopy
from nanoserve.request import Request
from nanoserve.sampling import SamplingParams
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput
from nanoserve.sim import simulation
from nanoserve.sim.executor import SimExecutor, VirtualClock
from nanoserve.sim.hardware import gpu
from nanoserve.sim.models import model
from nanoserve.sim.roofline import Roofline
from nanoserve.sim.simulation import SimConfig, simulate
from nanoserve.sim.workloads import TraceRequest

ROOFLINE = Roofline(gpu("A100-80G"), model("Llama-2-7B"))
T0 = 10.0
BIG, SMALL = 4096, 512  # tokens a copy carries


def pcie(tokens: int) -> float:
    return ROOFLINE.kv_copy_seconds(tokens, "pcie")


def copy(kind: str, tokens: int, reader: str | None = None, blocking: bool = False) -> KVCopy:
    return KVCopy(kind, tuple(range(tokens)), tuple(range(tokens)), reader=reader, blocking=blocking)


def request(request_id: str, priority: str = "online", prompt: int = 100) -> Request:
    return Request(request_id, [7] * prompt, SamplingParams(max_tokens=10), priority=priority)


def decode(*requests: Request, copies: list[list[KVCopy]] | None = None) -> SchedulerOutput:
    """One decode chunk per request (each samples), with `copies` as the step's copy groups."""
    return SchedulerOutput([ScheduledChunk(r, r.num_tokens - 1, 1, []) for r in requests], kv_copies=copies or [])


@pytest.fixture
def store() -> HostKVStore:
    return HostKVStore(0, 16, 0, 1, 1, torch.float16)  # bookkeeping only, as simulation.build's


@pytest.fixture
def executor(store) -> SimExecutor:
    lens = {f"r{i}": 100 for i in range(10)}
    return SimExecutor(VirtualClock(T0), ROOFLINE, lens, host_store=store)


def test_two_saves_queue_back_to_back_and_never_delay_a_forward(executor, store):
    r1 = request("r1")
    batch = decode(r1, copies=[[copy("save", BIG)], [copy("save", BIG)]])
    forward = executor.forward_seconds(batch)
    assert forward < pcie(BIG)  # the saves outlast the forward
    executor.execute(batch)
    assert executor.clock.now == T0 + forward  # exactly the forward: nobody waits for a save
    assert executor.stats.forward_stall_seconds == 0
    first, second = executor.on_link()
    assert (first.start, first.end) == (T0, T0 + pcie(BIG))
    assert second.start == first.end and second.end == pytest.approx(T0 + 2 * pcie(BIG), rel=1e-12)
    assert executor.stats.link_busy_seconds == pytest.approx(2 * pcie(BIG), rel=1e-12)
    # The next step is not delayed either: its forward starts when it starts.
    executor.execute(decode(r1))
    assert executor.clock.now == pytest.approx(T0 + 2 * forward, rel=1e-12)
    assert executor.stats.forward_stall_seconds == 0 and len(store.inflight.pending()) == 2


def test_a_blocking_save_delays_its_own_step_by_exactly_its_unfinished_part(executor):
    r1 = request("r1")
    # Alone on an idle link: the forward waits for the whole save.
    alone = decode(r1, copies=[[copy("save", SMALL, blocking=True)]])
    forward = executor.forward_seconds(alone)
    executor.execute(alone)
    assert executor.stats.forward_stall_seconds == pytest.approx(pcie(SMALL), rel=1e-12)
    assert executor.clock.now == pytest.approx(T0 + pcie(SMALL) + forward, rel=1e-12)
    # Behind a background save still on the link (FIFO): it waits for both, minus what has
    # already passed by the time its step starts.
    start = executor.clock.now
    executor.execute(decode(r1, copies=[[copy("save", BIG)]]))
    step2 = executor.clock.now
    assert step2 == pytest.approx(start + forward, rel=1e-12)
    stall = executor.stats.forward_stall_seconds
    executor.execute(decode(r1, copies=[[copy("save", SMALL, blocking=True)]]))
    lands = start + pcie(BIG) + pcie(SMALL)
    assert executor.stats.forward_stall_seconds - stall == pytest.approx(lands - step2, rel=1e-9)
    assert executor.clock.now == pytest.approx(lands + forward, rel=1e-12)


def test_a_prefetch_delays_only_the_step_that_runs_its_reader(executor):
    r1, r2 = request("r1"), request("r2")
    first = decode(r1, copies=[[copy("load", BIG, reader="r2")]])
    forward1 = executor.forward_seconds(first)
    executor.execute(first)  # r2 is not in this batch: the load runs under the forward
    assert executor.clock.now == T0 + forward1 and executor.stats.forward_stall_seconds == 0
    second = decode(r1, r2)
    forward2 = executor.forward_seconds(second)
    executor.execute(second)  # r2 reads it now: the forward waits for what is left of it
    assert executor.stats.forward_stall_seconds == pytest.approx(pcie(BIG) - forward1, rel=1e-9)
    assert executor.clock.now == pytest.approx(T0 + pcie(BIG) + forward2, rel=1e-12)
    assert executor.next_landing() is None  # it has landed


def test_a_load_for_the_batch_and_any_blocking_copy_on_the_link_are_waited_for(executor):
    r1 = request("r1")
    # A copies-only step: it issues its copies and leaves the clock where it is.
    executor.execute(SchedulerOutput(kv_copies=[[copy("save", SMALL, blocking=True)]]))
    assert executor.clock.now == T0 and executor.stats.steps == 1 and executor.stats.forwards == 0
    # The next forward waits for that blocking save still in flight (the runner's wait_for asks
    # the whole ledger), then for its own request's load behind it.
    batch = decode(r1, copies=[[copy("load", SMALL, reader="r1")]])
    forward = executor.forward_seconds(batch)
    executor.execute(batch)
    assert executor.stats.forward_stall_seconds == pytest.approx(2 * pcie(SMALL), rel=1e-12)
    assert executor.clock.now == pytest.approx(T0 + 2 * pcie(SMALL) + forward, rel=1e-12)


def test_a_group_issues_saves_then_moves_then_loads_and_a_move_crosses_hbm(executor, store):
    load, move, save = copy("load", SMALL, reader="r9"), copy("move", SMALL, reader="r9"), copy("save", SMALL)
    executor.execute(SchedulerOutput(kv_copies=[[load, move, save]]))
    assert store.inflight.pending() == [save, move, load]  # the ledger's order is the link's
    slots = executor.on_link()
    assert [s.copy for s in slots] == [save, move, load]
    assert slots[1].end - slots[1].start == pytest.approx(ROOFLINE.kv_copy_seconds(SMALL, "hbm"), rel=1e-12)
    assert ROOFLINE.kv_copy_seconds(SMALL, "hbm") < pcie(SMALL)
    assert all(a.end == b.start for a, b in zip(slots, slots[1:]))  # never two at once


def test_link_busy_and_stall_add_up(executor):
    r1, r2 = request("r1"), request("r2")
    steps = [decode(r1, copies=[[copy("save", BIG)], [copy("load", SMALL, reader="r1")]]),
             decode(r1, copies=[[copy("load", SMALL, reader="r2")]]),
             decode(r1, r2, copies=[[copy("save", SMALL, blocking=True), copy("move", SMALL, reader="r2")]])]
    forwards, start = 0.0, executor.clock.now
    for batch in steps:
        forwards += executor.forward_seconds(batch)
        executor.execute(batch)
    stats = executor.stats
    assert stats.link_busy_seconds == pytest.approx(
        pcie(BIG) + 3 * pcie(SMALL) + ROOFLINE.kv_copy_seconds(SMALL, "hbm"), rel=1e-12)
    assert 0 < stats.forward_stall_seconds <= stats.link_busy_seconds
    assert stats.busy_seconds == pytest.approx(forwards, rel=1e-12)
    # Back-to-back steps: the clock is the forwards plus the stalls, nothing else.
    assert executor.clock.now - start == pytest.approx(stats.busy_seconds + stats.forward_stall_seconds, rel=1e-12)


def test_copies_land_in_the_ledger_once_virtual_time_passes_their_end(executor, store):
    empty, a, b = copy("save", 0), copy("save", SMALL), copy("load", SMALL, reader="r1")
    executor.execute(SchedulerOutput(kv_copies=[[empty], [a], [b]]))
    # A copy issued and landed in the same instant counts as landed at once.
    assert store.inflight.poll() == [empty]
    assert executor.next_landing() == T0 + pcie(SMALL)
    executor.clock.advance_to(math.nextafter(T0 + pcie(SMALL), 0))  # a rounding error short of a's end
    assert store.inflight.poll() == [a]
    assert executor.next_landing() == pytest.approx(T0 + 2 * pcie(SMALL), rel=1e-12)
    executor.clock.advance_to(T0 + 1.5 * pcie(SMALL))
    assert store.inflight.poll() == [] and store.inflight.pending() == [b]
    executor.clock.advance_to(executor.next_landing())
    assert store.inflight.poll() == [b] and executor.next_landing() is None


def test_a_stopped_forward_walks_its_safe_points_from_after_its_loads(executor):
    offline = request("r1", "offline")
    batch = decode(offline, copies=[[copy("load", BIG, reader="r1")]])
    forward = executor.forward_seconds(batch)
    executor.preemption.on_safe_point = executor.request_preemption  # stop at the first safe point
    out = executor.execute(batch)
    assert out.preempted
    forward_start = T0 + pcie(BIG)
    before, per_layer = executor.layer_timing(batch, forward)
    assert executor.clock.now == pytest.approx(forward_start + before + 8 * per_layer, rel=1e-12)
    assert executor.stats.forward_stall_seconds == pytest.approx(pcie(BIG), rel=1e-12)
    assert executor.stats.discarded_seconds == pytest.approx(before + 8 * per_layer, rel=1e-9)


def test_without_a_host_store_copies_are_only_priced():
    executor = SimExecutor(VirtualClock(T0), ROOFLINE, {"r1": 100})
    executor.execute(decode(request("r1"), copies=[[copy("load", SMALL, reader="r1")]]))
    assert executor.stats.forward_stall_seconds == pytest.approx(pcie(SMALL), rel=1e-12)
    assert executor.next_landing() is None


def test_conserve_resumes_checkpointed_requests_through_the_link(monkeypatch):
    # Four long offline requests fill a small KV; online arrivals preempt them, and ConServe
    # brings each back from its checkpoint once its saves have landed: prefetched ahead, in the
    # background, so forwards wait only for the tail of a prefetch still on the link behind
    # saves when its request runs (§4.4, Fig. 4d), never for loads issued in their own step.
    monkeypatch.setenv("NANOSERVE_CHECK_INVARIANTS", "1")  # the engine checks the KV manager every step
    trace = ([TraceRequest(0.0, 600, 200, "offline") for _ in range(4)]
             + [TraceRequest(0.5 + 0.3 * i, 500, 40, "online") for i in range(6)])
    result = simulate(SimConfig(policy="conserve", kv_manager="checkpoint", kv_blocks=200), trace)
    assert all(r.finish_reason == "stop" for r in result.records) and result.unfinished == 0
    assert result.events["preemptions_with_checkpoint"] > 0 and result.events["prefetches"] > 0
    assert result.link_busy_seconds > 0
    assert result.events["blocks_loaded_ahead"] > 0 and result.events["blocks_loaded_on_resume"] == 0
    assert 0 <= result.forward_stall_seconds < 0.25 * result.link_busy_seconds
    assert result.busy_seconds + result.forward_stall_seconds <= result.duration + 1e-9


# -- the simulation loop: a step that runs no forward ------------------------------------------
REAL_BUILD = simulation.build


def scripted(monkeypatch, outputs) -> None:
    """Make the simulated scheduler return `outputs` (an iterator) before its own schedule."""
    def build(*args, **kwargs):
        engine, executor, roofline = REAL_BUILD(*args, **kwargs)
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda: next(outputs, None) or schedule()
        return engine, executor, roofline

    monkeypatch.setattr(simulation, "build", build)


def test_after_a_copies_only_step_the_clock_jumps_to_the_landing(monkeypatch):
    # Nothing can change before the save lands (or a request arrives), so the loop goes there.
    scripted(monkeypatch, iter([SchedulerOutput(kv_copies=[[copy("save", BIG)]])]))
    result = simulate(SimConfig(policy="fcfs"), [TraceRequest(0.0, 100, 2)])
    assert result.link_busy_seconds == pytest.approx(pcie(BIG), rel=1e-12)
    assert result.forward_stall_seconds == 0  # a save: the prefill never waited for it
    assert result.records[0].ttft == pytest.approx(pcie(BIG) + ROOFLINE.iteration_seconds([(0, 100)], 1), rel=1e-9)


def test_a_policy_stuck_with_nothing_in_flight_and_nothing_arriving_is_an_error(monkeypatch):
    scripted(monkeypatch, iter(lambda: SchedulerOutput(), None))  # always empty
    with pytest.raises(RuntimeError, match="scheduled nothing"):
        simulate(SimConfig(policy="fcfs"), [TraceRequest(0.0, 100, 2)])
    # Copies-only steps whose copies land at once get a few retries at that instant, not forever.
    scripted(monkeypatch, iter(lambda: SchedulerOutput(kv_copies=[[copy("save", 0)]]), None))
    with pytest.raises(RuntimeError, match="no KV copy in flight"):
        simulate(SimConfig(policy="fcfs"), [TraceRequest(0.0, 100, 2)])


# -- layer by layer (SimExecutor(layerwise_copies=True), BROS §4.1's max(T_exec, T_swap)) ---------

@pytest.fixture
def layerwise(store) -> SimExecutor:
    lens = {f"r{i}": 100 for i in range(10)}
    return SimExecutor(VirtualClock(T0), ROOFLINE, lens, host_store=store, layerwise_copies=True)


def test_layerwise_a_step_takes_about_the_longer_of_its_forward_and_its_copies(executor, layerwise):
    """The same step (a restore its request reads, beside a big batch) waits for the whole load
    before its forward with whole copies, and only per layer when they stream layer by layer:
    max(forward, copy) plus at most one layer's share of the copy, never the sum."""
    rows = [request(f"r{i}", prompt=2000) for i in range(8)]
    for tokens in (SMALL, BIG):  # a copy shorter and one longer than the forward
        whole = SimExecutor(VirtualClock(T0), ROOFLINE, {r.request_id: 100 for r in rows})
        streamed = SimExecutor(VirtualClock(T0), ROOFLINE, {r.request_id: 100 for r in rows}, layerwise_copies=True)
        batch = decode(*rows, copies=[[copy("load", tokens, reader="r0")]])
        forward, load, layers = whole.forward_seconds(batch), pcie(tokens), ROOFLINE.num_layers
        whole.execute(batch)
        streamed.execute(batch)
        assert whole.clock.now == pytest.approx(T0 + load + forward, rel=1e-9)
        took = streamed.clock.now - T0
        assert max(forward, load) <= took + 1e-12
        assert took <= max(forward, load) + load / layers + forward / layers + 1e-12
        assert streamed.stats.forward_stall_seconds == pytest.approx(took - forward, abs=1e-12)
        assert streamed.stats.link_busy_seconds == whole.stats.link_busy_seconds


def test_layerwise_a_step_runs_as_one_layer_major_run_landing_together(layerwise, store):
    slots = layerwise.issue_copies([[copy("save", SMALL, blocking=True)], [copy("load", BIG, reader="r1")]])
    total = pcie(SMALL) + pcie(BIG)
    assert [s.layer_major for s in slots] == [True, True]
    assert len({(s.start, s.end) for s in slots}) == 1  # one run: the same span for both
    assert slots[0].start == T0 and slots[0].end == pytest.approx(T0 + total, rel=1e-12)
    assert slots[0].layer_landed(0, 32) == pytest.approx(T0 + total / 32, rel=1e-12)
    assert layerwise.stats.link_busy_seconds == pytest.approx(total, rel=1e-12)
    # Neither copy lands in the ledger before the run's end, even though the clock is past layer 0's part.
    layerwise.clock.advance_to(T0 + total / 2)
    assert store.inflight.poll() == []
    layerwise.clock.advance_to(T0 + total)
    assert len(store.inflight.poll()) == 2


def test_layerwise_copies_nobody_reads_still_delay_nothing(layerwise):
    r1 = request("r1")
    batch = decode(r1, copies=[[copy("save", BIG)], [copy("load", BIG, reader="r9")]])
    forward = layerwise.forward_seconds(batch)
    layerwise.execute(batch)
    assert layerwise.clock.now == T0 + forward and layerwise.stats.forward_stall_seconds == 0


def test_layerwise_a_stopped_forward_reaches_its_safe_point_no_earlier_than_its_layers_copies(layerwise):
    """A pure-offline forward reading a long restore reaches its first safe point (after 8 of
    32 layers) only once the restore's first quarter has landed."""
    r1 = request("r1", priority="offline")
    batch = decode(r1, copies=[[copy("load", BIG, reader="r1")]])
    layerwise.request_preemption()
    out = layerwise.execute(batch)
    assert out.preempted
    assert layerwise.clock.now >= T0 + pcie(BIG) * 8 / ROOFLINE.num_layers
    assert layerwise.clock.now < T0 + pcie(BIG)  # the rest of the restore is still on the link
