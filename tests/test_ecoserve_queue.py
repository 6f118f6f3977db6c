"""EcoServe's indexed waiting queues, Q_P and Q_G (sched/ecoserve_queue.py), against the re-sort they replace.

- The queue alone, under hypothesis-drawn adds (at either end), removals and clock moves (mostly
  forward, sometimes back): its groups, their members' order and the admission bisect are what
  sorting the whole waiting deque by the §3.3 key at that moment gives.
- The scheduler over it, through the real Engine with random workloads, SLOs that move requests
  across deadline buckets while they wait, tight pools (preemptions, refused admissions) and
  aborts: step for step the same batches and queues as a scheduler that re-sorts every waiting
  request each step (the policy before the index).
"""
from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import deque
from itertools import groupby

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_harness import MockClock

from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.executor import Executor, ExecutorOutput
from nanoserve.memory import KVBuildContext, make_kv_manager
from nanoserve.memory.host import HostKVStore
from nanoserve.request import Request
from nanoserve.sampling import SamplingParams
from nanoserve.sched.ecoserve import EcoServeScheduler, _is_generation, _lacking
from nanoserve.sched.ecoserve_queue import TaskQueue, deadline_bucket
from nanoserve.sched.output import SchedulerOutput
from nanoserve.slo import SLO

BOUNDS = (0.5, 2.0)


# -- the queue alone ---------------------------------------------------------------------------
def _reference(waiting: deque, facts: dict, now: float) -> list[tuple[tuple[int, int], list[Request]]]:
    """The waiting deque stably sorted by the §3.3 key at `now`, cut into groups."""
    def key(request):
        deadline, occupied, rl = facts[request.request_id]
        return (deadline_bucket(deadline - now, BOUNDS), -occupied, -rl, request.arrival_time)
    ordered = sorted(waiting, key=key)
    return [(group, list(members)) for group, members in groupby(ordered, key=lambda r: key(r)[:2])]


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from([math.inf, 0.0, 0.4, 1.0, 1.9, 2.5, 4.0]),  # deadline offset
              st.integers(0, 2), st.integers(1, 6), st.integers(0, 3), st.booleans()),  # occupied, RL, arrival, front
    st.tuples(st.just("remove"), st.integers(0, 100)),
    st.tuples(st.just("advance"), st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0, -1.0])),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, room=st.integers(0, 7), skips=st.integers(0, 3))
def test_queue_matches_a_full_sort_of_the_waiting_deque(ops, room, skips):
    queue, waiting, facts, now = TaskQueue(BOUNDS), deque(), {}, 10.0
    queue.advance(now)
    for n, op in enumerate(ops):
        if op[0] == "add":
            _, offset, occupied, rl, arrival, front = op
            request = Request(f"r{n}", [1], SamplingParams(max_tokens=8), arrival_time=float(arrival))
            facts[request.request_id] = (now + offset, occupied, rl)
            (waiting.appendleft if front else waiting.append)(request)
            queue.add(request, deadline=now + offset, occupied_bucket=occupied, length=rl, at_front=front)
        elif op[0] == "remove" and waiting:
            request = waiting[op[1] % len(waiting)]
            waiting.remove(request)
            queue.remove(request)
        elif op[0] == "advance":
            now += op[1]
            queue.advance(now)
        assert len(queue) == len(waiting)
        expected = _reference(waiting, facts, now)
        assert queue.groups() == [group for group, _ in expected]
        for group, members in expected:
            assert queue.members(group) == members
            # The admission bisect, with some requests already refused this step.
            skip = set(members[:skips])
            left = [r for r in members if r not in skip]
            i = bisect_left(left, -room, key=lambda r: -facts[r.request_id][2])
            assert queue.closest_below(group, room, skip) is (left[min(i, len(left) - 1)] if left else None)


def test_a_waiting_request_moves_to_more_urgent_buckets_only_as_its_slack_shrinks():
    queue = TaskQueue(BOUNDS)
    request = Request("a", [1], SamplingParams(max_tokens=8), arrival_time=100.0)
    queue.add(request, deadline=103.0, occupied_bucket=1, length=4)  # before any clock reading
    queue.advance(100.0)
    assert queue.groups() == [(2, -1)]  # 3 s of slack
    queue.advance(101.5)
    assert queue.groups() == [(1, -1)]  # 1.5 s
    queue.advance(102.6)
    assert queue.groups() == [(0, -1)]  # 0.4 s
    queue.advance(200.0)
    assert queue.groups() == [(0, -1)]  # overdue: still the most urgent
    queue.remove(request)
    assert queue.groups() == [] and len(queue) == 0 and request not in queue


# -- the scheduler over it, against a full re-sort every step ---------------------------------
def _buckets(requests: list[Request], key) -> list[list[Request]]:
    """`requests` (in deque order) stably sorted by `key`, cut into (deadline, occupied) buckets."""
    keyed = sorted(((key(r), r) for r in requests), key=lambda kr: kr[0])
    return [[r for _, r in group] for _, group in groupby(keyed, key=lambda kr: kr[0][:2])]


class ResortingEcoServe(EcoServeScheduler):
    """Both admission passes as they would be without the index: every waiting request re-keyed
    by §3.3 and sorted each step (the bisect pops from a per-step copy of each bucket)."""

    def _key(self, request: Request, length: int) -> tuple:
        now = self.clock()
        return (self._deadline_bucket(request, now), -self._occupied_bucket(request), -length, request.arrival_time)

    def _batch_generations(self, out: SchedulerOutput, budget: int) -> int:
        failures, used = 0, 0
        gts = [r for r in self.waiting if _is_generation(r)]
        for bucket in _buckets(gts, lambda r: self._key(r, self.predicted_rl(r))):
            while bucket and used < budget and len(self.running) < self.config.max_num_seqs:
                if failures >= self.max_failed_admissions:
                    return used
                room = self.kv.admission_room_tokens()
                i = bisect_left(bucket, -room, key=lambda r: -self.predicted_rl(r))
                request = bucket.pop(min(i, len(bucket) - 1))
                chunk = self.try_chunk(request, 1)
                if chunk is None:
                    failures += 1
                    continue
                self._dequeue(self._generations, request)
                self._batched.add(request)
                out.chunks.append(chunk)
                used += 1
        return used

    def _admit_prompts(self, out: SchedulerOutput, budget: int) -> None:
        failures = 0
        pts = [r for r in self.waiting if not _is_generation(r)]
        for bucket in _buckets(pts, lambda r: self._key(r, _lacking(r))):
            while bucket and budget > 0 and len(self.running) < self.config.max_num_seqs:
                if failures >= self.max_failed_admissions:
                    return
                i = bisect_left(bucket, -budget, key=lambda r: -_lacking(r))
                request = bucket.pop(min(i, len(bucket) - 1))
                num_new = min(_lacking(request), budget)
                chunk = self.try_chunk(request, num_new)
                if chunk is None:
                    failures += 1
                    continue
                self._dequeue(self._prompts, request)
                out.chunks.append(chunk)
                budget -= num_new


class InstantExecutor(Executor):
    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        return ExecutorOutput(sampled={c.request.request_id: c.end % 100 for c in batch.chunks if c.samples})


def _trace(policy: type[EcoServeScheduler], seed: int) -> list[tuple]:
    rng = random.Random(seed)
    num_blocks, budget, max_seqs = rng.choice([16, 24, 40]), rng.choice([3, 8, 16, 64]), rng.choice([2, 4, 8, 32])
    predicted = {}
    store = HostKVStore(rng.choice([0, 64]), 4, 1, 1, 1, torch.float32, pin_memory=False)
    options = dict(padding_ratio=rng.choice([0.0, 0.15]), reserved_fraction=rng.choice([0.0, 0.1]),
                   predicted_len=lambda r: predicted[r.request_id])
    kv = make_kv_manager("exact", KVBuildContext(num_blocks, 4, None, store, options))  # type: ignore[arg-type]
    clock = MockClock()
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_model_len=kv.max_request_tokens, policy="ecoserve")
    scheduler = policy(config, kv, clock=clock, tfs_target=rng.choice([None, 0.05, "online_tpot"]))
    scheduler.kv_bucket_tokens = rng.choice([4, 8, 128])  # small: occupied-KV buckets that differ
    engine = Engine(scheduler, InstantExecutor(), tokenizer=None)
    same_arrival = rng.random() < 0.5  # ties on the whole key: deque order decides
    arrivals = []
    for i in range(rng.randint(5, 40)):
        prompt, max_tokens = rng.randint(1, 12), rng.choice([rng.randint(1, 30), 8, 16])
        if prompt + max_tokens <= engine.config.max_model_len:
            predicted[f"r{i}"] = max(1, max_tokens // rng.choice([1, 2, 4]))
            slo = rng.choice([None, SLO(ttft=0.05, tpot=0.01), SLO(ttft=1.0, tpot=0.3), SLO(ttft=3.0, tpot=0.7), SLO()])
            arrivals.append((rng.randint(0, 30), f"r{i}", prompt, max_tokens, rng.choice(["online", "offline"]), slo,
                             0.0 if same_arrival else rng.uniform(0, 3)))
    aborts = {rng.randrange(0, 100): rng.choice(arrivals)[1] for _ in range(rng.randint(0, 3))} if arrivals else {}
    trace = []
    for step in range(3000):
        for at, rid, prompt, max_tokens, priority, slo, age in arrivals:
            if at == step:
                engine.add_request([1] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid,
                                   priority=priority, slo=slo, arrival_time=clock.now - age)
        if step in aborts and aborts[step] in engine.requests:
            engine.abort_request(aborts[step])
        if step > 30 and not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        trace.append((sorted((o.request_id, o.finished) for o in outputs),
                      [r.request_id for r in scheduler.running], [r.request_id for r in scheduler.waiting]))
        clock.now += rng.choice([0.001, 0.05, 0.3, 0.7])
    assert not engine.has_unfinished_requests()
    return trace


@pytest.mark.parametrize("seed", range(40))
def test_the_indexed_queue_admits_exactly_as_a_full_re_sort(seed):
    assert _trace(EcoServeScheduler, seed) == _trace(ResortingEcoServe, seed)
