"""BROS's request-pulling queues (`nanoserve/sched/bros_queue.py`), against a plain sorted list.

A `PolledQueue` must yield exactly the requests in it, in (rank, queue position) order, however
pushes (to the back or the front of the queue), discards and partial pulls interleave, and a
pull must put back what it did not hand over for good; `QueuePositions` must order requests as a
deque taking arrivals at the back and preemptions at the front does.
"""
from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.request import Request
from nanoserve.sampling import SamplingParams
from nanoserve.sched.bros_queue import PolledQueue, QueuePositions

REQUESTS = [Request(f"r{i}", [1], SamplingParams()) for i in range(12)]

OPS = st.lists(st.one_of(
    st.tuples(st.just("push"), st.integers(0, 11), st.integers(0, 3), st.booleans()),  # request, rank, front
    st.tuples(st.just("discard"), st.integers(0, 11)),
    # pull: read `take` requests, "admit" (discard) those whose index is in `admit`, refile one meanwhile
    st.tuples(st.just("pull"), st.integers(0, 12), st.sets(st.integers(0, 11)), st.integers(-1, 11)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_polled_queue_matches_a_sorted_model(ops):
    queue, positions = PolledQueue(), QueuePositions()
    model: dict[Request, tuple[int, int]] = {}  # request -> (rank, position)
    waiting: deque[Request] = deque()  # the scheduler's deque the positions stand for

    def push(request, rank, front):
        if request in model:
            waiting.remove(request)
        position = positions.front() if front else positions.back()
        (waiting.appendleft if front else waiting.append)(request)
        queue.push(request, rank, position)
        model[request] = (rank, position)

    def in_order():
        return sorted(model, key=model.__getitem__)

    for op in ops:
        if op[0] == "push":
            push(REQUESTS[op[1]], op[2], op[3])
        elif op[0] == "discard":
            request = REQUESTS[op[1]]
            queue.discard(request)
            if model.pop(request, None) is not None:
                waiting.remove(request)
        else:
            _, take, admit, refile = op
            expected, pulled = in_order()[:take], []
            puller = queue.pull()
            while len(pulled) < take and (item := next(puller, None)) is not None:
                assert item[0] == model[item[1]][0]
                pulled.append(item[1])
            assert pulled == expected
            for request in pulled:  # admitted while the pull is open: they leave for good
                if REQUESTS.index(request) in admit:
                    queue.discard(request)
                    del model[request]
                    waiting.remove(request)
            if refile >= 0:  # a preemption while the pull is open files a request anew
                push(REQUESTS[refile], 0, True)
            puller.close()
        assert len(queue) == len(model)
        assert queue.requests() == in_order()
        assert [r for r in waiting if r in model] == sorted(model, key=lambda r: model[r][1])
        assert queue.first() == (in_order()[0] if model else None)
        assert all(queue.key(r) == model[r] for r in model)
    assert [request for _, request in queue.pull()] == in_order()


def test_pull_reads_only_as_far_as_asked():
    queue, positions = PolledQueue(), QueuePositions()
    for i, request in enumerate(REQUESTS):
        queue.push(request, rank=i % 3, position=positions.back())
    puller = queue.pull()
    first = [next(puller)[1] for _ in range(3)]
    assert first == [REQUESTS[0], REQUESTS[3], REQUESTS[6]]  # rank 0, in queue order
    assert len(queue._heap) == len(REQUESTS) - 3  # only those were popped
    puller.close()
    assert queue.requests() == sorted(REQUESTS, key=lambda r: (REQUESTS.index(r) % 3, REQUESTS.index(r)))
