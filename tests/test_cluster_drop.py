"""KunServe's drop -> exchange -> serve -> restore cycle in a real cluster of instance processes
(nanoserve/cluster/cluster.py, regroup.py, member.py, group.py), and recovery when a member dies.

Every test compares greedy outputs with an unthrottled single engine: a regrouped pipeline, a
KV exchange or a restore that put one block in the wrong place would change them."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from conftest import build_tiny_model
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.cluster.cluster import Cluster
from nanoserve.cluster.group import GroupExecutor, GroupLayout
from nanoserve.cluster.regroup import split_pool
from nanoserve.config import EngineArgs

BLOCK = 16
SHORT = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
# A burst: six 40-token prompts that finish fast and two short prompts that decode long. Into two
# pools of 6 blocks the burst needs 6 x 3 + 2 x 1 = 20 blocks: throttled. Once the short ones are
# done the long ones hold about 3 blocks each, under half the replicas' 12: the cluster restores.
BURST = [([i + 2] * 40, SHORT) for i in range(6)] + [([300 + i] * 5, LONG) for i in range(2)]
DEADLINE_S = 180  # a hang guard, not a speed assertion


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cluster-drop-llama")
    build_tiny_model("llama", directory)
    return directory


@pytest.fixture(scope="module")
def expected(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", dtype="float32", kv_cache_tokens=4096)
    return [llm.generate([prompt], params, use_tqdm=False)[0] for prompt, params in BURST]


@pytest.fixture(autouse=True)
def checked_instances(monkeypatch):
    monkeypatch.setenv("NANOSERVE_CHECK_INVARIANTS", "1")  # every instance checks its KV every step


def LLM_PARAMS(llama_dir):
    from safetensors.torch import load_file
    return [(n, t) for f in sorted(llama_dir.glob("*.safetensors")) for n, t in load_file(f).items()]


def small_pools(llama_dir) -> EngineArgs:
    return EngineArgs(model=str(llama_dir), device="cpu", dtype="float32", kv_cache_tokens=6 * BLOCK,
                      block_size=BLOCK)


def run_burst(cluster: Cluster, copies: int = 1, on_step=None) -> dict[str, object]:
    ids = []
    for c in range(copies):
        for i, (prompt, params) in enumerate(BURST):
            ids.append(f"burst{c}-{i}")
            cluster.add_request(ids[-1], prompt, params)
    finished, started = {}, time.monotonic()
    while len(finished) < len(ids):
        assert time.monotonic() - started < DEADLINE_S, f"cluster hung with {len(ids) - len(finished)} unfinished"
        outputs = cluster.step()
        for out in outputs:
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} finished twice"
                finished[out.request_id] = out
        if on_step is not None:
            on_step(cluster, outputs)
    return finished


def assert_matches(expected, finished, copies: int = 1) -> None:
    for c in range(copies):
        for i, ref in enumerate(expected):
            out = finished[f"burst{c}-{i}"]
            assert_close_greedy(ref, out, out.request_id, max_tokens=BURST[i][1].max_tokens)


def page_bytes() -> int:
    """One layer's K (or V) of one block: block_size x kv_heads x head_dim x fp32."""
    return BLOCK * 2 * (64 // 4) * 4  # the tiny llama of conftest: 2 KV heads of 16 dims


def test_a_group_step_after_a_solo_step_widened_the_block_tables(llama_dir):
    """The runner's block-table rows are re-allocated, wider, in a solo step, which runs under
    inference mode; a group step then writes them, so it runs under inference mode too (found by
    benchmarks/cluster.py's long prompts: the error came back as a lost peer, and the recovery it
    set off left the regrouper with a group its members had left)."""
    llm = LLM(str(llama_dir), device="cpu", dtype="float32", kv_cache_tokens=2048, block_size=BLOCK)
    long_prompt = [5 + i % 200 for i in range(300)]  # 19 blocks: wider than the rows' first 16
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = llm.generate([long_prompt], params, use_tqdm=False)[0]
    engine = llm.engine
    runner = engine.executor
    layout = GroupLayout((0,), (range(runner.model_config.num_layers),))  # a group of one: no peer to talk to
    engine.use_executor(GroupExecutor(runner, layout, 0, {0: list(range(engine.kv.num_blocks))}))
    assert llm.generate([long_prompt], params, use_tqdm=False)[0].token_ids == alone.token_ids


def test_drop_exchange_serve_restore_on_two_instances(llama_dir, expected):
    first_tokens_while_exchanging = []

    def watch(cluster: Cluster, outputs) -> None:
        if any(load.exchanging for load in cluster.loads.values()):
            first_tokens_while_exchanging.extend(o.request_id for o in outputs if len(o.token_ids) == 1)

    # Two blocks' K/V per chunk: the exchange takes several steps.
    chunk = 2 * 2 * page_bytes()
    with Cluster(small_pools(llama_dir), 2, drop=True, chunk_bytes=chunk) as cluster:
        finished = run_burst(cluster, on_step=watch)
        changes = cluster.layout_changes
        groups = cluster.regrouper.groups
        pulls = cluster.restore_pulls
        assert not cluster.has_unfinished_requests()
    assert_matches(expected, finished)
    kinds = [c.kind for c in changes]
    assert kinds[:2] == ["drop", "restore"], kinds
    drop, restore = changes[0], changes[1]
    assert [g.instances for g in drop.after] == [(0, 1)]
    assert [g.stages for g in drop.after] == [(range(0, 1), range(1, 2))]
    # Each member keeps its own layer's K/V of its requests and sends the other layer's: with
    # one layer of two on each side, as many bytes move as stay.
    assert drop.blocks_in_use > 0
    assert drop.kv_bytes_sent == drop.kv_bytes_kept == drop.blocks_in_use * 2 * page_bytes()
    assert drop.exchange_steps >= -(-drop.blocks_in_use // 2 // 2)  # the larger half, 2 blocks a chunk
    assert drop.exchange_steps > 1
    # §4.2: queued requests ran while the running ones waited for their K/V.
    assert first_tokens_while_exchanging
    # Pools: each block now holds one layer, and a layer's weights became KV: more than double.
    assert drop.capacity_before == 12 and drop.capacity_after > 2 * drop.capacity_before
    # The restore happened with the long requests still decoding: their peer's KV came home.
    assert restore.blocks_in_use > 0
    assert restore.kv_bytes_sent == restore.kv_bytes_kept == restore.blocks_in_use * 2 * page_bytes()
    assert restore.capacity_after == 12
    assert all(g.size == 1 for g in groups), "restore must leave independent instances"
    # §4.4: the weights were pulled while the pipeline served; the switch copied only the pages
    # that live KV blocks still held.
    assert pulls[-1]["outcome"] == "switched" and pulls[-1]["steps"] > 1
    assert 0 <= restore.weights_copied < pulls[-1]["pulled_bytes"]


def test_kunserve_s_lookahead_micro_batches_run_through_the_group_and_keep_the_answers(llama_dir, expected):
    """§4.3 in the real cluster (issue 46): under the kunserve policy a member in a group looks
    ahead over its queue and cuts its step into cost-balanced micro-batches, which the group
    executor runs through both stages in order; greedy answers are a single engine's."""
    args = dataclasses.replace(small_pools(llama_dir), policy="kunserve", max_num_batched_tokens=32)  # MIN = 8
    with Cluster(args, 2, drop=True) as cluster:
        finished = run_burst(cluster)
        kinds = [c.kind for c in cluster.layout_changes]
        counters = [stats.policy_counters for stats in cluster.engine_stats()]
    assert_matches(expected, finished)
    assert "drop" in kinds
    assert sum(c["pipelined_steps"] for c in counters) > 0
    assert sum(c["pipelined_microbatches"] for c in counters) > sum(c["pipelined_steps"] for c in counters)


def test_a_restore_without_the_background_pull_copies_every_weight(llama_dir, expected):
    with Cluster(small_pools(llama_dir), 2, drop=True, background_restore=False) as cluster:
        finished = run_burst(cluster)
        changes, pulls = cluster.layout_changes, cluster.restore_pulls
    assert_matches(expected, finished)
    restore = next(c for c in changes if c.kind == "restore")
    layers = sum(p.numel() * 4 for n, p in LLM_PARAMS(llama_dir) if ".layers." in n)
    assert not pulls and restore.weights_copied == layers  # each instance's dropped layer, whole


def test_throttling_during_the_pull_cancels_it_and_the_answers_hold(llama_dir, expected):
    """A second burst while the weights come back: the pull is given back (its pages and
    blocks return to the KV) and the group serves the burst as a pipeline again."""
    second: list[str] = []

    def burst_again(cluster: Cluster, outputs) -> None:
        if not second and cluster.pending_restore is not None:
            for i, (prompt, params) in enumerate(BURST):
                second.append(f"burst1-{i}")
                cluster.add_request(second[-1], prompt, params)

    with Cluster(small_pools(llama_dir), 2, drop=True, chunk_bytes=2 * 2 * page_bytes()) as cluster:
        finished = run_burst(cluster, on_step=burst_again)
        while cluster.has_unfinished_requests():
            finished.update({o.request_id: o for o in cluster.step() if o.finished})
        pulls = cluster.restore_pulls
    assert second and "cancelled" in [p["outcome"] for p in pulls], pulls
    assert_matches(expected, finished, copies=2)


def test_queued_requests_move_to_the_group_a_drop_enlarged(llama_dir):
    """§3: after a drop "KunServe re-schedules queued requests". Three instances of 6 blocks,
    three 3-block prompts each: after the first step each runs two and queues one, all three
    throttled. Fig. 6 frees enough by merging instances 0 and 1 alone, so instance 2 keeps its
    6 blocks; its never-started request goes back through the dispatcher, which sends it to the
    enlarged pair, and its answer is still the unthrottled engine's."""
    prompts = [[i + 2] * 40 for i in range(9)]
    reference = LLM(str(llama_dir), device="cpu", dtype="float32", kv_cache_tokens=4096).generate(
        prompts, SHORT, use_tqdm=False)
    moved_while_queued = []

    def watch(cluster: Cluster, outputs) -> None:
        for request_id, _, to in cluster.redispatched:
            if request_id in cluster.placement and cluster.placement[request_id] == to:
                moved_while_queued.append(request_id)

    with Cluster(small_pools(llama_dir), 3, drop=True) as cluster:
        ids = [f"q-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            cluster.add_request(request_id, prompt, SHORT)
        assert [cluster.placement[i] for i in ids] == [0, 1, 2] * 3  # spread before any step
        finished, started = {}, time.monotonic()
        while len(finished) < len(ids):
            assert time.monotonic() - started < DEADLINE_S, "cluster hung"
            outputs = cluster.step()
            finished.update({o.request_id: o for o in outputs if o.finished})
            watch(cluster, outputs)
        drop = cluster.layout_changes[0]
        redispatched = list(cluster.redispatched)
    assert drop.kind == "drop" and [g.instances for g in drop.after] == [(0, 1), (2,)]
    assert redispatched == [("q-8", 2, 0)], redispatched  # instance 2's queued request, to the pair
    assert moved_while_queued  # it was placed there before it finished
    for request_id, ref in zip(ids, reference):
        out = finished[request_id]
        assert_close_greedy(ref, out, request_id, max_tokens=SHORT.max_tokens)
    assert finished["q-8"].metrics.queue_time > 0  # its arrival travelled with it


def test_four_instances_regroup_in_pairs_and_come_back(llama_dir, expected):
    # Queued requests stay where they are: re-dispatched (§3), instances 2 and 3's would move
    # to the first pair and leave them unthrottled (the test above).
    with Cluster(small_pools(llama_dir), 4, drop=True, redispatch_queued=False) as cluster:
        finished = run_burst(cluster, copies=2)
        changes = cluster.layout_changes
        groups = cluster.regrouper.groups
    assert_matches(expected, finished, copies=2)
    drops = [c for c in changes if c.kind == "drop"]
    # Fig. 6 merges the two smallest groups first, ties to the lowest ids; as long as instances
    # stay throttled, later drops merge the next pair.
    assert [g.instances for g in drops[0].after if g.size > 1] == [(0, 1)]
    formed = {g.instances for c in drops for g in c.after if g.size > 1}
    assert formed >= {(0, 1), (2, 3)}, [[g.instances for g in c.after] for c in changes]
    assert any(c.kind == "restore" for c in changes)
    assert all(g.size == 1 for g in groups)


def test_groups_step_on_their_own_through_drops_and_restores(llama_dir, expected):
    """`stepping="group_lockstep"` (an asynchronous front): four instances, two bursts. Each group
    gets its next step when its own members have answered, so after a drop the pair and the
    other replicas step at their own pace, and a layout change pauses only the instances it
    involves. The answers are still the unthrottled engine's."""
    overlapped = []

    def watch(cluster: Cluster, outputs) -> None:
        in_flight = cluster.channels.in_flight
        # A group answered while another was still stepping: the front did not wait for it.
        if outputs and in_flight:
            overlapped.append(in_flight)

    with Cluster(small_pools(llama_dir), 4, drop=True, redispatch_queued=False,
                 stepping="group_lockstep") as cluster:
        finished = run_burst(cluster, copies=2, on_step=watch)
        changes = cluster.layout_changes
        groups = cluster.regrouper.groups
        beside = cluster.changes_beside_steps
        assert not cluster.has_unfinished_requests()
    assert_matches(expected, finished, copies=2)
    assert any(c.kind == "drop" for c in changes) and any(c.kind == "restore" for c in changes)
    assert all(g.size == 1 for g in groups)
    assert overlapped, "no group ever answered while another was in flight"
    assert beside >= 1, "every layout change waited for every group"  # it pauses only whom it involves


@pytest.mark.parametrize("instances", [2, 4])
def test_groups_keep_steps_in_flight_through_drops_and_restores(llama_dir, expected, instances):
    """`async_pipeline` in a cluster: a drop's group keeps steps in flight, each stage working on
    a different one (cluster/group.py `GroupExecutor`, `in_flight`). Every layout change and
    background pull first lands them (`drains`). The answers are still the unthrottled engine's."""
    in_flight = []

    def watch(cluster: Cluster, outputs) -> None:
        in_flight.append(max(load.steps_in_flight for load in cluster.loads.values()))

    args = dataclasses.replace(small_pools(llama_dir), async_pipeline=True)
    with Cluster(args, instances, drop=True, chunk_bytes=2 * 2 * page_bytes()) as cluster:
        finished = run_burst(cluster, copies=instances // 2, on_step=watch)
        changes, groups, drains = cluster.layout_changes, cluster.regrouper.groups, cluster.drains
        while cluster.has_unfinished_requests():  # nothing left but empty steps in flight
            cluster.step()
    assert_matches(expected, finished, copies=instances // 2)
    assert any(c.kind == "drop" for c in changes) and any(c.kind == "restore" for c in changes)
    assert all(g.size == 1 for g in groups)
    assert max(in_flight) >= 1, "no group ever kept a step in flight between the cluster's steps"
    assert drains >= 2  # a group landed its steps before the background pull began and before the restore


def test_async_pipeline_in_a_cluster_needs_the_drop(llama_dir):
    with pytest.raises(ValueError, match="needs drop=True"):
        Cluster(dataclasses.replace(small_pools(llama_dir), async_pipeline=True), 2)


def _serving_in_a_group(cluster: Cluster) -> bool:
    return any(g.size > 1 for g in cluster.regrouper.groups) and not cluster.loads[0].exchanging


def _exchanging_after(kind: str):
    def moment(cluster: Cluster) -> bool:
        changes = cluster.layout_changes
        return bool(changes) and changes[-1].kind == kind and cluster.loads[0].exchanging
    return moment


def _in_flight_in_a_group(cluster: Cluster) -> bool:
    return bool(cluster.loads[0].steps_in_flight) and _serving_in_a_group(cluster)


@pytest.mark.parametrize("moment, chunk, async_pipeline", [
    (_serving_in_a_group, 32 << 20, False),  # the pipeline's peer dies
    (_exchanging_after("drop"), 2 * 2 * page_bytes(), False),  # ...in the middle of the KV exchange
    (_exchanging_after("restore"), 2 * 2 * page_bytes(), False),  # the ex-peer dies while the KV comes home
    (lambda cluster: cluster.pending_restore is not None, 2 * 2 * page_bytes(), False),  # ...while weights come
    # With steps in flight through the peer: the survivor forgets them (`Engine.discard_in_flight`).
    (_in_flight_in_a_group, 32 << 20, True),
], ids=["serving", "drop-exchange", "restore-exchange", "restore-pull", "serving-in-flight"])
def test_a_member_killed_mid_run_leaves_every_request_answered(llama_dir, expected, moment, chunk, async_pipeline):
    killed = []

    def kill(cluster: Cluster, outputs) -> None:
        if not killed and 1 in cluster.loads and cluster.loads[1].num_running and moment(cluster):
            cluster.processes[1].kill()
            cluster.processes[1].wait()
            killed.append(1)

    args = dataclasses.replace(small_pools(llama_dir), async_pipeline=async_pipeline)
    with Cluster(args, 2, drop=True, chunk_bytes=chunk, peer_timeout_s=30) as cluster:
        finished = run_burst(cluster, on_step=kill)
        assert killed, "the moment to kill never came"
        assert cluster.dead == {1}
        assert [c.kind for c in cluster.layout_changes][-1] == "recover"
        assert cluster.retried, "instance 1's requests must be retried on instance 0"
        assert all(instance == 0 for _, instance in cluster.retried)
        assert [g.instances for g in cluster.regrouper.groups] == [(0,)]
    assert_matches(expected, finished)  # survivors recomputed, retries restarted: same answers


def test_a_member_lost_without_a_death_splits_its_group():
    """A member whose group step failed (`PeerLost`) while every instance lives recovers as a
    whole replica (`ClusterMember.recover`), so its group splits and its peer reloads too; before,
    the regrouper kept the pair and the next restore asked a whole replica to pull layers."""
    from nanoserve.cluster.load import InstanceLoad
    from nanoserve.cluster.regroup import Regrouper

    sent: list[dict] = []
    replies = {"manifest": (), "reweigh": 10, "allocate": (), "recover": 0,
               "exchange": {"sent": 0, "rounds": 0, "kept": 0, "weights_copied": 0}}

    def call(messages):
        sent.append(dict(messages))
        return {i: replies[message[0]] for i, message in messages.items()}

    loads = {i: InstanceLoad(i, 10, 10, 1, 1, 1, 1, replica_blocks=10) for i in (0, 1, 2)}
    regrouper = Regrouper(3, [100] * 4, 40)
    assert regrouper.drop({0: 1}, loads, call) is not None
    pair = next(g for g in regrouper.groups if g.size == 2)
    sent.clear()
    regrouper.recover(set(), {pair.instances[0]}, loads, call)
    assert sent == [{i: ("recover",) for i in pair.instances}]
    assert all(g.size == 1 for g in regrouper.groups) and len(regrouper.groups) == 3


def test_the_pool_is_shared_out_after_what_is_in_use():
    assert split_pool(10, {0: 3, 1: 1}, [0, 1]) == {0: 6, 1: 4}
    assert split_pool(7, {0: 0, 1: 0}, [0, 1]) == {0: 4, 1: 3}
    with pytest.raises(RuntimeError, match="cannot hold"):
        split_pool(3, {0: 2, 1: 2}, [0, 1])


@pytest.mark.parametrize("arch", ["qwen2", "opt", "opt-prenorm"])
def test_regrouped_pipelines_serve_every_architecture(arch, tmp_path):
    """The stage split skips each architecture's last-stage-only modules (final norms, OPT's
    projections) on the first member: a miss would normalise twice and change the tokens."""
    build_tiny_model(arch, tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_tokens=4096)
    expected = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt, params in BURST]
    with Cluster(small_pools(tmp_path), 2, drop=True) as cluster:
        finished = run_burst(cluster)
        kinds = [c.kind for c in cluster.layout_changes]
    assert kinds[:2] == ["drop", "restore"], kinds
    assert_matches(expected, finished)


def test_instances_get_their_own_gpu_or_a_share_of_one():
    from nanoserve.cluster.cluster import instance_devices

    assert instance_devices("cpu", 2, 0) == [("cpu", 1), ("cpu", 1)]
    assert instance_devices(None, 2, 4) == [(None, 1), (None, 1)]
    assert instance_devices("cuda", 2, 4) == [("cuda:0", 1), ("cuda:1", 1)]
    assert instance_devices("cuda:3", 2, 4) == [("cuda:3", 1), ("cuda:0", 1)]
    # more instances than GPUs: they share, and each knows by how many
    assert instance_devices("cuda", 3, 2) == [("cuda:0", 2), ("cuda:1", 1), ("cuda:0", 2)]


def test_cuda_tensors_travel_over_gloo_through_the_host(monkeypatch):
    from nanoserve.parallel import p2p

    class Fake:
        device = type("D", (), {"type": "cuda"})()

    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "gloo")
    assert p2p.staged(Fake()) and not p2p.staged(torch.zeros(1))
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "nccl")
    assert not p2p.staged(Fake())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_drop_and_restore_on_gpus(llama_dir, expected):
    """Two instances on the GPU(s) (sharing one when there is one, each with its part of the
    memory): the exchange and the pipeline's activations go through the host over gloo."""
    args = EngineArgs(model=str(llama_dir), device="cuda", dtype="float32", kv_cache_tokens=6 * BLOCK,
                      block_size=BLOCK)
    with Cluster(args, 2, drop=True, chunk_bytes=2 * 2 * page_bytes()) as cluster:
        finished = run_burst(cluster)
        kinds = [c.kind for c in cluster.layout_changes]
    assert_matches(expected, finished)
    assert kinds[:2] == ["drop", "restore"], kinds
