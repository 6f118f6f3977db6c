"""KunServe in the simulator: the simulated cluster (nanoserve/sim/cluster.py and
cluster_layout.py: drop, KV exchange and restore of cluster/ on virtual time, pipeline stages) and
the ci-scale run of the paper's comparison (experiments/kunserve.py)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from experiments import run_experiment
from experiments.report import replot, save_json, save_plots
from nanoserve import SamplingParams
from nanoserve.cluster.cluster import ThrottleMonitor
from nanoserve.sim.cluster import ClusterConfig, SimCluster, simulate_cluster
from nanoserve.sim.cluster_layout import StagePipeline, bubble_ratio
from nanoserve.sim.hardware import gpu
from nanoserve.sim.metrics import summarize
from nanoserve.sim.models import ModelCost, model
from nanoserve.sim.roofline import Roofline
from nanoserve.sim.simulation import ACTIVATION_RESERVE, SimConfig, simulate
from nanoserve.sim.workloads import LENGTHS, TraceRequest, make_trace, poisson_arrivals

GPU, MODEL = "A100-80G", "Qwen2.5-14B"
COST = ModelCost(model(MODEL))
HALF = COST.config.num_layers // 2


def cluster_config(policy: str = "kunserve", instances: int = 2, **options) -> ClusterConfig:
    return ClusterConfig(SimConfig(policy=policy, gpu=GPU, model=MODEL), instances, **options)


def trace(n: int, rate: float = 4.0, seed: int = 0):
    return make_trace(poisson_arrivals(rate, n=n, seed=seed), LENGTHS["burstgpt"], seed=seed)


def pair_pool_blocks() -> int:
    """Logical blocks of a two-instance pipeline: what a GPU holding half the layers (and the
    embeddings and head, never dropped) leaves for K/V of half the layers."""
    device = gpu(GPU).memory_bytes * 0.9
    kept = COST.weight_bytes - HALF * COST.layer_bytes
    return int((device - kept - ACTIVATION_RESERVE) // (COST.kv_bytes_per_token_per_layer * HALF * 16))


def test_one_instance_serves_exactly_as_simulate_does():
    requests = trace(60)
    alone = simulate(SimConfig(policy="fcfs", gpu=GPU, model=MODEL), requests)
    cluster = simulate_cluster(cluster_config("fcfs", 1), requests)
    for a, b in zip(alone.records, cluster.records):
        assert b.ttft == pytest.approx(a.ttft, abs=1e-9) and b.e2e == pytest.approx(a.e2e, abs=1e-9)


def test_one_swapping_instance_serves_exactly_as_simulate_does():
    # InferCept-like's instance: victims swapped out and back, copies layer by layer; a small
    # pool so that the swaps happen, and the cluster's loop must wait for them to land.
    config = SimConfig(policy="fcfs", gpu=GPU, model=MODEL, kv_manager="swap", layerwise_copies=True, kv_blocks=240)
    requests = trace(60, rate=8.0)
    alone = simulate(config, requests)
    cluster = simulate_cluster(ClusterConfig(config, 1), requests)
    assert alone.events["swap_outs"] > 0 and cluster.events["preemptions"] == sum(r.preemptions for r in alone.records)
    assert cluster.link_busy_seconds == pytest.approx(alone.link_busy_seconds)
    for a, b in zip(alone.records, cluster.records):
        assert b.ttft == pytest.approx(a.ttft, abs=1e-9) and b.e2e == pytest.approx(a.e2e, abs=1e-9)


def test_the_dispatcher_counts_every_queued_request_as_of_each_instance_s_report():
    # Eight 160-token requests queue on instance 0 (10 blocks each), one 480-token request on
    # instance 1 (30 blocks); nothing has started. Counting the head only, 0 looks emptier
    # (10 blocks against 30); counting the queue (Llumnix's virtual usage), 1 does (80 against 30).
    requests = [TraceRequest(0.0, 160, 8)] * 8 + [TraceRequest(0.0, 480, 8), TraceRequest(0.0, 64, 8)]
    cluster = SimCluster(cluster_config("fcfs", 2), requests)
    for request_id, instance in zip(cluster.ids[:9], [0] * 8 + [1]):
        spec = cluster.trace[request_id]
        cluster.members[instance].engine.add_request([1] * spec.prompt_len, SamplingParams(max_tokens=8), request_id)
    assert cluster.dispatch(cluster.ids[9], 0.0) == 0  # the loads reported at the start: both empty
    cluster._report_all()
    assert [(load.head_blocks, load.queued_blocks, load.num_waiting) for load in cluster.reported.values()] == [
        (10, 80 + 4, 9), (30, 30, 1)]
    assert ThrottleMonitor().short_blocks(list(cluster.reported.values())) == {}
    cluster.trace["extra"] = TraceRequest(0.0, 64, 8)
    assert cluster.dispatch("extra", 0.0) == 1


def test_drop_grows_a_pair_by_the_dropped_layers_and_restore_gives_it_back():
    cluster = SimCluster(cluster_config(drop=True), [])
    replica = cluster.members[0].engine.kv.num_blocks
    change = cluster.regrouper.drop({0: 1}, cluster._loads(), cluster._call)
    assert cluster._apply(change, 0.0) == {0, 1}
    halves = (range(HALF), range(HALF, 2 * HALF))
    assert [(g.instances, g.stages) for g in cluster.regrouper.groups] == [((0, 1), halves)]
    pools = [m.engine.kv.num_blocks for m in cluster.members.values()]
    assert sum(pools) == pair_pool_blocks() and abs(pools[0] - pools[1]) <= 1
    # One copy of the layers became K/V: about layer_bytes per replica block's layer slice.
    gained = sum(pools) - 2 * replica
    assert gained == pytest.approx(HALF * COST.layer_bytes / (COST.kv_bytes_per_token_per_layer * HALF * 16), abs=2)
    loads = cluster._loads()
    groups = cluster.regrouper.restorable(loads)
    cluster._apply(cluster.regrouper.restore(groups, loads, cluster._call), 0.0)
    assert [m.engine.kv.num_blocks for m in cluster.members.values()] == [replica, replica]
    # Each member pulled back the half it had dropped, over the network, before serving again.
    pull = gpu(GPU).link_seconds(HALF * COST.layer_bytes, "network")
    assert [m.clock.now for m in cluster.members.values()] == pytest.approx([pull, pull])


def test_a_member_s_max_num_seqs_follows_its_pool_through_a_drop_and_a_restore():
    """Issue 46: the replica's 256 fill ~96% of its KV at BurstGPT's lengths, so a drop's
    added KV would go unused under a fixed cap: the cap scales with the pool, and comes back."""
    cluster = SimCluster(cluster_config(drop=True), [])
    replica = cluster.members[0].engine.kv.num_blocks
    cluster._apply(cluster.regrouper.drop({0: 1}, cluster._loads(), cluster._call), 0.0)
    for member in cluster.members.values():
        pool = member.engine.kv.num_blocks
        assert member.engine.scheduler.config.max_num_seqs == round(256 * pool / replica) > 256
    loads = cluster._loads()
    cluster._apply(cluster.regrouper.restore(cluster.regrouper.restorable(loads), loads, cluster._call), 0.0)
    assert [m.engine.scheduler.config.max_num_seqs for m in cluster.members.values()] == [256, 256]
    fixed = SimCluster(cluster_config(drop=True, seqs_follow_pool=False), [])
    fixed._apply(fixed.regrouper.drop({0: 1}, fixed._loads(), fixed._call), 0.0)
    assert [m.engine.scheduler.config.max_num_seqs for m in fixed.members.values()] == [256, 256]


def test_the_drop_frees_what_every_queued_request_lacks_and_merges_the_throttled_first():
    """§4.1: "we first compute the memory demand of all queuing requests (R)"; among groups of
    one size, the throttled instance's merges first (ties were to the lowest id)."""
    requests = [TraceRequest(0.0, 160, 8)] * 6
    cluster = SimCluster(cluster_config(instances=4, drop=True), requests)
    for request_id in cluster.ids:
        spec = cluster.trace[request_id]
        cluster.members[2].engine.add_request([1] * spec.prompt_len, SamplingParams(max_tokens=8), request_id)
    loads = cluster._loads()
    assert loads[2].queued_blocks == 6 * 10 and loads[2].head_blocks == 10  # 160 tokens: 10 blocks each
    short = {2: 5}  # as if 5 blocks short at the head
    queue_shortfall = loads[2].virtual_blocks - loads[2].total_blocks  # negative: the instance is empty
    assert cluster.regrouper.blocks_to_free(short, loads) == max(5, queue_shortfall) == 5
    tight = {2: replace(loads[2], used_blocks=loads[2].total_blocks - 20)}
    assert cluster.regrouper.blocks_to_free(short, tight) == tight[2].virtual_blocks - tight[2].total_blocks > 5
    head = SimCluster(cluster_config(instances=4, drop=True, drop_demand="head"), [])
    assert head.regrouper.blocks_to_free(short, tight) == 5
    cluster._apply(cluster.regrouper.drop(short, loads, cluster._call), 0.0)
    assert [sorted(g.instances) for g in cluster.regrouper.groups if g.size > 1] == [[0, 2]]  # not [0, 1]


def test_round_robin_dispatch_reads_no_load():
    from nanoserve.cluster.round_robin_dispatch import RoundRobinDispatcher

    cluster = SimCluster(cluster_config("fcfs", 3, dispatch="round-robin"), [TraceRequest(0.0, 64, 8)] * 7)
    assert isinstance(cluster.dispatcher, RoundRobinDispatcher)
    assert [cluster.dispatch(i, 0.0) for i in cluster.ids] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="dispatch"):
        cluster_config("fcfs", 2, dispatch="random")


@pytest.mark.parametrize("background", [True, False])
def test_a_restore_pulls_its_weights_while_the_pipeline_serves(background):
    """§4.4: "we overlap restoring with the normal request processing". In the background the
    pair keeps serving while the dropped halves are pulled and switches once they are in;
    without, each member waits for its pull at the switch."""
    cluster = SimCluster(cluster_config(drop=True, background_restore=background), [])
    cluster._apply(cluster.regrouper.drop({0: 1}, cluster._loads(), cluster._call), 0.0)
    pull = gpu(GPU).link_seconds(HALF * COST.layer_bytes, "network")
    cluster._monitor(0.0)  # demand is low: restorable
    if background:
        assert cluster.regrouper.groups[0].size == 2 and cluster._pending_restore is not None
        assert [m.clock.now for m in cluster.members.values()] == [0.0, 0.0]  # nobody waits
        cluster._monitor(pull / 2)  # still pulling: the pair serves on
        assert cluster.regrouper.groups[0].size == 2
        for m in cluster.members.values():
            m.clock.advance_to(pull)
        cluster._monitor(pull)
    assert all(g.size == 1 for g in cluster.regrouper.groups) and cluster.events["restores"] == 1
    # Background: the switch happened at `pull` with no wait; otherwise the members waited for it.
    assert [m.clock.now for m in cluster.members.values()] == pytest.approx([pull, pull])
    assert [m.pulled_bytes for m in cluster.members.values()] == [HALF * COST.layer_bytes] * 2


def test_throttling_during_the_pull_cancels_the_restore():
    cluster = SimCluster(cluster_config(drop=True), [])
    cluster._apply(cluster.regrouper.drop({0: 1}, cluster._loads(), cluster._call), 0.0)
    cluster._monitor(0.0)
    assert cluster._pending_restore is not None and all(m.prefetched for m in cluster.members.values())
    cluster.monitor.short_blocks = lambda loads: {0: 1}  # demand is back
    cluster._monitor(1e-3)
    assert cluster._pending_restore is None and cluster.events["restores_cancelled"] == 1
    assert not any(m.prefetched for m in cluster.members.values())


def serving_pair(**options) -> SimCluster:
    """Two fcfs replicas (no monitor: a test drops by hand) 30 steps into a burst of 40 requests."""
    requests = trace(40, rate=40.0)
    cluster = SimCluster(cluster_config("fcfs", **options), requests)
    for request_id in cluster.ids:
        cluster.dispatch(request_id, requests[-1].arrival)
    for _ in range(30):
        member = min(cluster.members.values(), key=lambda m: m.next_time())
        cluster._step(member, math.inf)
    return cluster


def test_drop_keeps_every_running_request_and_stalls_it_for_its_kv():
    cluster = serving_pair()
    held = {i: m.engine.kv.num_used_blocks for i, m in cluster.members.items()}
    tables = {i: {r.request_id: len(m.engine.kv.block_table(r)) for r in m.engine.scheduler.running}
              for i, m in cluster.members.items()}
    start = max(m.clock.now for m in cluster.members.values())
    change = cluster.regrouper.drop({0: 1}, cluster._loads(), cluster._call)
    cluster._apply(change, start)
    block_layer = COST.kv_bytes_per_token_per_layer * 16
    for i, m in cluster.members.items():
        assert m.engine.kv.num_used_blocks == held[i]  # nothing lost, nothing recomputed
        assert set(m.stalled) == set(tables[i])  # every running request waits for its other half
        # Member i sends its own requests' K/V of the half it dropped, all of it over one link.
        assert m.sent_bytes == held[i] * HALF * block_layer
        last = max(ready for _, ready in m.stalled.values())
        assert last == pytest.approx(start + gpu(GPU).link_seconds(held[i] * HALF * block_layer, "network"))
    assert change.kv_bytes_sent == sum(held.values()) * HALF * block_layer
    cluster.run()
    result = cluster.result()  # raises unless every request finished exactly once
    assert sorted(r.request_id for r in result.records) == sorted(cluster.ids)
    assert all(r.finish_reason == "stop" for r in result.records)
    for m in cluster.members.values():
        m.engine.kv.check_invariants()
        assert not m.stalled and m.engine.kv.num_used_blocks == 0


def test_the_real_cluster_s_host_staging_stops_each_member_for_its_copies():
    """remap="host_staged" (nanoserve's real cluster): every held block, all layers, to host memory
    over PCIe, then the half that stays back; the exchange starts after the slowest member's copy
    out. In place (the paper's remap) nothing is staged."""
    runs = {}
    for remap in ("in_place", "host_staged"):
        cluster = serving_pair(remap=remap)
        held = {i: m.engine.kv.num_used_blocks for i, m in cluster.members.items()}
        start = max(m.clock.now for m in cluster.members.values())
        cluster._apply(cluster.regrouper.drop({0: 1}, cluster._loads(), cluster._call), start)
        runs[remap] = cluster, held, start
    block_layer = COST.kv_bytes_per_token_per_layer * 16
    in_place, held, start = runs["in_place"]
    assert all(m.staged_bytes == 0 and m.staging_seconds == 0 for m in in_place.members.values())
    staged, held_staged, start_staged = runs["host_staged"]
    assert held_staged == held and start_staged == start  # the same state before the change
    out = {i: gpu(GPU).link_seconds(held[i] * 2 * HALF * block_layer, "pcie") for i in held}
    back = {i: gpu(GPU).link_seconds(held[i] * HALF * block_layer, "pcie") for i in held}
    for i, m in staged.members.items():
        assert m.staged_bytes == held[i] * 3 * HALF * block_layer
        assert m.staging_seconds == pytest.approx(out[i] + back[i])
        # The exchange leaves after every member's copy out; its own copy back stops it meanwhile.
        assert m.clock.now == pytest.approx(start + max(out.values()) + back[i])
        ready = max(r for _, r in m.stalled.values())
        assert ready == pytest.approx(start + max(out.values())
                                      + gpu(GPU).link_seconds(held[i] * HALF * block_layer, "network"))
    staged.run()
    assert sorted(r.request_id for r in staged.result().records) == sorted(staged.ids)


def test_lockstep_starts_every_step_at_one_instant_and_leaves_the_stages_idle_between_steps():
    """stepping="lockstep" (nanoserve's real cluster): every cluster step starts its instances at
    one instant and ends when the slowest is done, so a static pair's stages idle between steps
    where independent members (vLLM's virtual engines) overlap them; both serve every request."""
    requests = trace(60, rate=30.0, seed=1)
    results = {}
    for stepping in ("independent", "lockstep"):
        cluster = SimCluster(cluster_config("fcfs", static_pipeline_stages=2, stepping=stepping), requests)
        starts = []
        serve = cluster._serve

        def spy(member, serve=serve, starts=starts):
            starts.append((len(starts), member.id, member.clock.now))
            return serve(member)

        cluster._serve = spy  # type: ignore[method-assign]
        cluster.run()
        result = cluster.result()
        assert sorted(r.request_id for r in result.records) == sorted(cluster.ids)
        results[stepping] = result, starts, cluster
    _, starts, cluster = results["lockstep"]
    clocks = {m.clock.now for m in cluster.members.values()}
    assert len(clocks) == 1  # every instance ends each step at the slowest one's end
    # Member 1's steps start where member 0's of the same cluster step did, never before its end.
    by_time: dict[float, set[int]] = {}
    for _, member, at in starts:
        by_time.setdefault(at, set()).add(member)
    assert sum(len(ids) == 2 for ids in by_time.values()) > len(by_time) / 2
    bubbles = {k: r.extra["pipeline_bubble_ratio"] for k, (r, _, _) in results.items()}
    assert bubbles["lockstep"] > bubbles["independent"]
    makespan = {k: max(rec.arrival + rec.e2e for rec in r.records) for k, (r, _, _) in results.items()}
    assert makespan["lockstep"] >= makespan["independent"]
    with pytest.raises(ValueError, match="stepping"):
        cluster_config(stepping="sometimes")


def test_group_lockstep_steps_each_pair_together_and_the_pairs_apart():
    """stepping="group_lockstep": a group's members share every step (GroupExecutor's lockstep);
    two groups step on their own clocks, as an asynchronous front would leave them."""
    requests = trace(80, rate=40.0, seed=2)
    cluster = SimCluster(cluster_config("fcfs", instances=4, static_pipeline_stages=2, stepping="group_lockstep"),
                         requests)
    cluster.run()
    assert sorted(r.request_id for r in cluster.result().records) == sorted(cluster.ids)
    pairs = sorted({tuple(sorted(m.layout.members)) for m in cluster.members.values()})
    assert len(pairs) == 2
    ends = [{cluster.members[i].clock.now for i in pair} for pair in pairs]
    assert all(len(end) == 1 for end in ends) and ends[0] != ends[1]


def test_static_pipelines_pair_the_instances_with_half_a_pool_each():
    cluster = SimCluster(cluster_config("fcfs", 4, static_pipeline_stages=2), [])
    assert [g.instances for g in cluster.regrouper.groups] == [(0, 1), (2, 3)]
    assert all(m.engine.kv.num_blocks in (pair_pool_blocks() // 2, -(-pair_pool_blocks() // 2))
               for m in cluster.members.values())
    with pytest.raises(ValueError):
        cluster_config("fcfs", 6, static_pipeline_stages=3)
    with pytest.raises(ValueError):
        cluster_config("kunserve", 4, static_pipeline_stages=2, drop=True)
    with pytest.raises(ValueError):  # a layout change rebuilds a paged pool
        ClusterConfig(SimConfig(policy="fcfs", gpu=GPU, model=MODEL, kv_manager="swap"), 2, drop=True)


def test_stages_price_their_own_layers_and_overlap_the_members_batches():
    roofline = Roofline(gpu(GPU), model(MODEL))
    batch = [(0, 1024)]
    overhead = gpu(GPU).efficiency.iteration_overhead_s
    one = StagePipeline(roofline, [range(2 * HALF)], "network", [0.0])
    assert one.run([(batch, 1)], 0.0) == pytest.approx(roofline.iteration_seconds(batch) - overhead)
    two = StagePipeline(roofline, [range(HALF), range(HALF, 2 * HALF)], "network", [0.0, 0.0])
    first, last = (Roofline(roofline.gpu, roofline.model, layers=HALF, last_stage=k == 1) for k in range(2))
    a = first.num_layers * first.layer_seconds(batch)
    b = last.num_layers * last.layer_seconds(batch) + last.head_seconds(1)
    hop = gpu(GPU).link_seconds(1024 * COST.config.hidden_size * 2, "network")
    assert two.run([(batch, 1)], 0.0) == pytest.approx(a + hop + b)
    # A second member's batch enters stage 0 as the first leaves it, and waits for stage 1.
    assert two.run([(batch, 1)], 0.0) == pytest.approx(max(2 * a + hop, a + hop + b) + b)


def test_a_pipeline_s_bubble_ratio_is_its_stages_idle_share_while_it_has_work():
    """§5.3's bubble time: two equal micro-batches through two equal stages keep the pipe busy
    for three stage-times and each stage for two (one idle at fill, one at drain): 1/3. An
    idle gap between runs is no bubble."""
    roofline = Roofline(gpu(GPU), model(MODEL))
    pipe = StagePipeline(roofline, [range(HALF), range(HALF, 2 * HALF)], "nvlink", [0.0, 0.0])
    batch = [(0, 256)]
    first, last = (Roofline(roofline.gpu, roofline.model, layers=HALF, last_stage=k == 1) for k in range(2))
    a = first.num_layers * first.layer_seconds(batch)
    b = last.num_layers * last.layer_seconds(batch) + last.head_seconds(1)
    done = pipe.run([(batch, 1), (batch, 1)], 0.0)
    assert pipe.occupied_seconds() == pytest.approx(done)
    assert bubble_ratio([pipe]) == pytest.approx(1 - 2 * (a + b) / (2 * done))
    pipe.run([(batch, 1)], done + 100.0)  # much later: the gap is not counted
    assert pipe.occupied_seconds() == pytest.approx(done + (pipe.free[1] - done - 100.0))


def test_ci_experiment_kunserve(monkeypatch, tmp_path):
    from experiments.kunserve import PAPER_ERA, STRONGER, VLLM, VLLM_PP

    monkeypatch.setenv("NANOSERVE_CHECK_INVARIANTS", "0")  # per step is too slow here; layout changes still check
    result = run_experiment("kunserve", scale="ci", seed=0)
    assert set(result.runs) == {f"BurstGPT: {label}" for label in ("KunServe", *PAPER_ERA, *STRONGER)}
    result.runs = {label.removeprefix("BurstGPT: "): run for label, run in result.runs.items()}
    count = len(result.runs["KunServe"].records)
    assert count > 300
    for run in result.runs.values():
        ids = [r.request_id for r in run.records]
        assert len(ids) == count == len(set(ids))  # every request of the trace, once
        assert all(r.finish_reason == "stop" and r.ttft is not None for r in run.records)
    kun = result.runs["KunServe"]
    assert kun.events["drops"] >= 1 and kun.events["restores"] >= 1
    assert result.runs[VLLM].events["throttled_steps"] > 0  # the bursts throttle vLLM's KV
    # max_num_seqs follows a dropped member's pool: it ran more at once than a replica may.
    assert kun.extra["peak_running"] > 256 == result.runs[VLLM].extra["peak_running"]
    stats = {label: summarize(run)["all"] for label, run in result.runs.items()}
    # Robust across seeds 0-6 (the burst rule): the static pipelines lose to KunServe's
    # dropped-on-demand ones at the median (1.18x at least) and in TPOT (1.42x at least); their
    # P99 does not always (0.90x at seed 2).
    assert stats[VLLM_PP].ttft_p50 >= 1.1 * stats["KunServe"].ttft_p50
    assert stats[VLLM_PP].tpot_p50 >= 1.3 * stats["KunServe"].tpot_p50
    # Until a drop, KunServe's instances serve as vLLM's do: the medians stay close. (The P99
    # against vLLM is not asserted: it swings either way with the seed, see the notes.)
    assert stats["KunServe"].ttft_p50 == pytest.approx(stats[VLLM].ttft_p50, rel=0.25)
    claims = [c for c in result.comparisons if c.metric.startswith("BurstGPT P99 TTFT")]
    assert len(claims) == len(PAPER_ERA) + len(STRONGER) + 1 and all(math.isfinite(c.ours) for c in claims)
    # Only the paper-era rows (and memory's part) are held to 12.7x; ours have no paper number.
    assert {c.metric.split(": ")[1].split(" / ")[0] for c in claims if c.paper_low == 12.7} == {*PAPER_ERA, VLLM}
    assert all(c.paper_low is None for c in claims if any(label in c.metric for label in STRONGER))
    # Beside every ratio, each run's KV held and GPU busy share.
    rows = {row["system"]: row for row in result.extra["policies"]}
    assert set(rows) == set(result.runs) | {"vLLM, 10x KV"}
    assert all(0 < row["held_kv"] <= 1 and 0 < row["compute_use"] <= 1 for row in rows.values())
    assert result.extra["datasets"]["BurstGPT"]["rate_rule"] == "burst"
    # InferCept swaps its victims out and back over the link, copies under the forwards.
    for label in ("InferCept", "InferCept-like, least-loaded, no swap budget (ours)"):
        infercept = result.runs[label]
        assert infercept.events["preemptions"] > 0 and infercept.link_busy_seconds > 0
        assert infercept.forward_stall_seconds <= infercept.link_busy_seconds
    llumnix = result.runs["Llumnix-like"]
    assert llumnix.events["migrations"] > 0 and llumnix.events["migrated_blocks"] > 0
    assert result.notes and "synthetic" in result.workload
    # Fig. 12's series: every run's KV demand from the first arrival, mean TTFT per window.
    timeline = result.extra["timeline"]["BurstGPT"]
    assert set(timeline["kv_demand"]) == set(timeline["ttft_mean"]) == set(result.runs) | {"vLLM, 10x KV"}
    vllm_demand = timeline["kv_demand"][VLLM]
    assert vllm_demand[0][0] >= 0 and max(d for _, d in vllm_demand) > 1  # the bursts throttle: over capacity
    assert 0.5 < max(d for _, d in timeline["kv_demand"]["vLLM, 10x KV"]) < 10  # over one replica's KV
    windows = timeline["ttft_mean"][VLLM]
    assert len(windows) > 5 and all(v > 0 for _, v in windows)
    pytest.importorskip("matplotlib")
    paths = save_plots(result, tmp_path)
    assert any(p.name == "kunserve-timeline.png" and p.stat().st_size > 0 for p in paths)
    # The same figure again from the file --json writes, without running anything.
    save_json(result, tmp_path / "kunserve.json")
    (again,) = replot(tmp_path / "kunserve.json", tmp_path / "again")
    assert again.name == "kunserve-timeline.png" and again.stat().st_size > 0


def test_the_long_scale_is_fig_15s_run_with_the_restore_ablation():
    from experiments import check_scale
    from experiments.kunserve import NO_RESTORE, SCALES, configs

    long = SCALES["long"]
    assert long.duration == 640.0 and long.restore_ablation and not SCALES["paper"].restore_ablation
    check_scale("long", "kunserve")
    with pytest.raises(ValueError, match="scale"):
        check_scale("long", "bros")  # only KunServe's experiment has a 640 s run
    ablation = configs(2, restore_ablation=True)[NO_RESTORE]
    assert ablation.drop and ablation.restore_fraction < 0 and NO_RESTORE not in configs(2)


def test_a_negative_restore_fraction_never_restores():
    """Fig. 15's "w/o restoration": the pair stays a pipeline even with nothing to serve."""
    cluster = SimCluster(cluster_config(drop=True, restore_fraction=-1.0), [])
    cluster._apply(cluster.regrouper.drop({0: 1}, cluster._loads(), cluster._call), 0.0)
    assert cluster.regrouper.restorable(cluster._loads()) == []
    cluster._monitor(1000.0)
    assert cluster.regrouper.groups[0].size == 2 and cluster.events["restores"] == 0


def test_the_burst_rule_bisects_to_the_rate_whose_typical_burst_fills_the_kv(monkeypatch):
    """Issue 46's rule, from §2.2: the base rate at which a typical x2 burst accumulates one
    replica's KV (`burst_peak`); the highest probe at or under `burst_fill` is kept."""
    from experiments import kunserve

    scale = replace(kunserve.SCALES["ci"], burst_fill=0.5)
    assert kunserve.bursts(scale, 0) and {w.factor for w in kunserve.bursts(scale, 0)} == {2.0}  # §2.2: 2x
    monkeypatch.setattr(kunserve, "burst_peak", lambda rate, scale, seed, lengths: rate / 8)
    rate, probes = kunserve.rate_for_burst.__wrapped__(scale, 0)
    assert rate / 8 <= 0.5 and rate == max(r for r, peak in probes if peak <= 0.5)
    assert any(peak > 0.5 for _, peak in probes) and 4.0 - rate < 4.0 / 2 ** (kunserve.BISECTION_STEPS - 3)
    with pytest.raises(ValueError, match="rate_rule"):
        replace(scale, rate_rule="tuned")


def test_fig14_runs_each_technique_on_the_same_trace(monkeypatch):
    """Fig. 14's rows in the paper's order, on one trace: percentiles ordered, vLLM (DP) with no
    pipeline (no bubble), the variants with drops measuring their pipelines' bubbles."""
    from experiments import kunserve

    monkeypatch.setenv("NANOSERVE_CHECK_INVARIANTS", "0")
    monkeypatch.setitem(kunserve.SCALES, "ci", replace(kunserve.SCALES["ci"], bursts=1))
    rows = kunserve.fig14("ci", 0, "BurstGPT")
    assert [r["variant"] for r in rows] == list(kunserve.FIG14_VARIANTS)
    assert len({r["rate_per_instance"] for r in rows}) == 1
    for r in rows:
        assert r["ttft_p50"] <= r["ttft_p90"] <= r["ttft_p99"] <= r["ttft_p99.9"]
        assert (r["bubble_ratio"] is None) == (r["drops"] == 0)
    assert rows[0]["drops"] == rows[1]["drops"] == 0 and rows[0]["bubble_ratio"] is None
    # Only the real cluster's remap stages KV through host memory, and only when it drops.
    assert all(r["kv_staged_bytes"] == 0 for r in rows[:-3])
    assert all((r["kv_staged_bytes"] > 0) == (r["drops"] > 0) for r in rows[-3:])
