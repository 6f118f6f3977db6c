"""KunServe's cluster (nanoserve/cluster/cluster.py, instance.py): the dispatcher balances KV
demand (held plus the whole queue's, Llumnix's virtual usage), the monitor reports throttling
(held plus the head of the queue, kunserve.txt §2.2) as blocks short, and a cluster of real instance
processes serves greedy outputs identical to a single engine, throttled or not."""
from __future__ import annotations

import pytest
from conftest import build_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.cluster.cluster import Cluster, Dispatcher, ThrottleMonitor
from nanoserve.cluster.load import InstanceLoad
from nanoserve.config import EngineArgs

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

def queue_load(instance: int, total: int, used: int, queue: list[int], running: int = 0) -> InstanceLoad:
    """An instance's load with `queue` the blocks each of its queued requests needs, head first."""
    return InstanceLoad(instance, total, used, queue[0] if queue else 0, sum(queue), len(queue), running)


loads_strategy = st.lists(st.tuples(st.integers(1, 64), st.integers(0, 64), st.lists(st.integers(1, 16), max_size=4)),
                          min_size=1, max_size=6).map(
    lambda rows: [queue_load(i, total, min(used, total), queue) for i, (total, used, queue) in enumerate(rows)])


@settings(max_examples=300, deadline=None)
@given(loads_strategy, st.lists(st.integers(1, 8), min_size=1, max_size=10))
def test_dispatcher_sends_each_request_where_kv_demand_stays_lowest(loads, requests):
    dispatcher, booked = Dispatcher(), {load.instance: 0 for load in loads}
    for blocks in requests:
        chosen = dispatcher.pick(loads, blocks)
        # An independent recount: the fill each instance would reach with this request on top,
        # every queued request counted (Llumnix's virtual usage).
        fills = {load.instance: (load.used_blocks + load.queued_blocks + booked[load.instance] + blocks)
                 / load.total_blocks for load in loads}
        assert fills[chosen] == min(fills.values())
        assert chosen == min(i for i, f in fills.items() if f == fills[chosen])  # ties: lowest id
        booked[chosen] += blocks


def test_an_instance_whose_queue_waits_for_compute_does_not_look_free():
    # Instance 0 holds little and its head is small, but eight requests wait behind it (for
    # compute, or max_num_seqs); instance 1 holds more and has no queue. Counting the head only,
    # 0 looks emptier (12 of 64 against 20) and gets every new request while its queue grows.
    loads = [queue_load(0, 64, 10, [2] * 9), queue_load(1, 64, 20, [])]
    assert Dispatcher().pick(loads, 2) == 1
    assert ThrottleMonitor().short_blocks(loads) == {}  # the monitor still reads the head only


def test_a_burst_is_spread_until_the_next_report():
    loads = [queue_load(i, 64, 0, []) for i in range(3)]
    dispatcher = Dispatcher()
    assert [dispatcher.pick(loads, 4) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    dispatcher.reported(0)  # instance 0's next load report includes what it was given
    assert dispatcher.pick(loads, 4) == 0


def test_throttling_is_demand_over_capacity():
    monitor = ThrottleMonitor()
    loads = [queue_load(0, 64, 60, [10, 30], 5), queue_load(1, 64, 60, [4, 30], 5), queue_load(2, 64, 64, [], 9)]
    assert monitor.short_blocks(loads) == {0: 6}  # 60 held + 10 for the head > 64; the rest of a queue waits


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cluster-llama")
    build_tiny_model("llama", directory)
    return directory


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [300, 20, 5], [9] * 30, [40, 41] * 9, [77] * 3]


def test_two_instances_serve_what_one_engine_serves(llama_dir):
    expected = LLM(str(llama_dir), device="cpu", dtype="float32", kv_cache_tokens=1024).generate(
        PROMPTS, PARAMS, use_tqdm=False)
    with Cluster(EngineArgs(model=str(llama_dir), device="cpu", dtype="float32", kv_cache_tokens=1024), 2) as cluster:
        outputs = cluster.generate(PROMPTS, PARAMS)
        assert set(cluster.dispatched) == {0, 1}  # both instances served
        assert not cluster.placement  # finished requests are placed nowhere
        assert not cluster.throttle_events
        processes = cluster.processes
    for ref, out in zip(expected, outputs):
        assert_close_greedy(ref, out, f"cluster {out.request_id}", max_tokens=PARAMS.max_tokens)
    assert all(p.poll() is not None for p in processes)


def test_a_burst_into_small_pools_is_seen_as_throttling(llama_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [[i + 1] * 30 for i in range(8)]
    expected = LLM(str(llama_dir), device="cpu", dtype="float32", kv_cache_tokens=4096).generate(
        prompts, params, use_tqdm=False)
    args = EngineArgs(model=str(llama_dir), device="cpu", dtype="float32", kv_cache_tokens=96, block_size=16)
    with Cluster(args, 2) as cluster:
        outputs = cluster.generate(prompts, params)
        events = cluster.throttle_events
    assert events, "8 requests of 54 tokens into two 96-token pools must throttle"
    assert all(short > 0 for event in events for short in event.values())
    for ref, out in zip(expected, outputs):  # served anyway, by preemption: same answers
        assert_close_greedy(ref, out, f"throttled {out.request_id}", max_tokens=params.max_tokens)


def test_each_group_steps_on_its_own_with_an_asynchronous_front(llama_dir):
    """`stepping="group_lockstep"`: a replica with no work gets no step, and the answers are a
    single engine's; in lockstep every instance steps every time."""
    expected = LLM(str(llama_dir), device="cpu", dtype="float32", kv_cache_tokens=1024).generate(
        PROMPTS[:1], PARAMS, use_tqdm=False)
    sent = {}
    for stepping in ("lockstep", "group_lockstep"):
        args = EngineArgs(model=str(llama_dir), device="cpu", dtype="float32", kv_cache_tokens=1024)
        with Cluster(args, 2, stepping=stepping) as cluster:
            outputs = cluster.generate(PROMPTS[:1], PARAMS)  # one request: instance 0 alone has work
            assert not cluster.has_unfinished_requests() and not cluster.channels.in_flight
            sent[stepping] = dict(cluster.steps_sent)
        assert_close_greedy(expected[0], outputs[0], f"{stepping} {outputs[0].request_id}",
                            max_tokens=PARAMS.max_tokens)
    assert sent["lockstep"][0] == sent["lockstep"][1] >= PARAMS.max_tokens
    assert sent["group_lockstep"][0] >= PARAMS.max_tokens and 1 not in sent["group_lockstep"]


def test_an_unknown_stepping_is_refused(llama_dir):
    with pytest.raises(ValueError, match="stepping must be one of"):
        Cluster(EngineArgs(model=str(llama_dir), device="cpu"), 2, stepping="free")
