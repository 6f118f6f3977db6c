"""EcoServe's exact allocation behind the `KVManager` interface (ecoserve.txt §2.3, §3.2, §3.4).

Every request gets a predicted response length (RL): `options["predicted_len"]`, one number for
all of them or a function of the request (a trace's lookup, a predictor model), else its
`max_tokens`; after a preemption, the L_new of §3.2.2. The scheduler's calls map onto
`ExactAllocator`:

    can_reserve(r, n)   exact, changes nothing: admission (in a host's region, §3.4, or the
                        admission pool), growth (inside the reservation, else from the reserved
                        pool, §3.2.2), or restoring an evicted guest and then growing it
    reserve(r, n)       r's first call admits it with its whole predicted footprint (§3.2.1);
                        an evicted guest is restored (`ensure_resident`: loads); then `grow`,
                        whose copies save the guests r's writes reach (§3.4)
    preempt(r)          offload-free (§3.2.2): free r's KV, keep L_new = predicted - generated as
                        its prediction for re-admission (re-predicted when that is <= 0), and
                        recompute: (0, [])
    release(r)          free r's blocks (its guests keep theirs) and its host copies

Why each call's copies are one safe group: a call returns loads (a restore) or saves (evictions),
never both, since a restored request has no guests. Why a step is safe (see sched/base.py): the
forward reads and writes the slots of every request given a chunk this step. Only a host's growth
takes slots from another request, and `order` serves hosts before their guests, so a guest is
evicted (saved, in the host's group) before it is given a chunk, and its own later `reserve`
restores it (loads into fresh blocks, in a later group). A request admitted from the queue is
hosted only past its host's already-reserved positions. Releases and preemptions move no slots:
guests keep their KV where it is. `reserve` checks this: evicting a request served this step raises.

A guest the host store has no room for loses its KV (`hosted_drops`) and must recompute: its
request's `num_computed_tokens` is set to 0 here. It has not been served this step (see above),
so the scheduler reads the new value when it gets to it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Protocol, Union, runtime_checkable

from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.exact import ExactAllocConfig, ExactAllocator
from nanoserve.memory.host import KVCopy
from nanoserve.memory.manager import KVManager

if TYPE_CHECKING:
    from nanoserve.request import Request

ALLOC_OPTIONS = ("padding_ratio", "reserved_fraction", "pipeline_buffer", "min_new_prediction")
Predictor = Union[int, Callable[["Request"], int], None]  # None: predict max_tokens


@runtime_checkable
class RemainingPredictor(Protocol):
    """A predictor that can also re-predict a running request's remaining length (the
    predictors of sched/predictor.py): what `ExactKV.preempt` asks when L_new fails."""

    def __call__(self, request: Request) -> int: ...

    def predict_remaining(self, request: Request) -> int: ...


class ExactKV(KVManager):
    """Exact allocation from predicted lengths, a reserved pool, offload-free preemption and KV
    pipelining (EcoServe §3.2, §3.4)."""

    def __init__(self, alloc: ExactAllocator, predicted_len: Predictor = None):
        self.alloc = alloc
        self.block_size = alloc.block_size
        self.host_store = alloc.host_store
        self.predicted_len = predicted_len
        self._predicted: dict[str, int] = {}  # asked once per request; L_new after a preemption
        self.repredictions = 0  # preemptions whose L_new was <= 0: re-predicted (see `preempt`)
        # `prediction`'s answer and the request's tokens it was for: the admission pass asks again
        # each step for the requests it tries, and the answer only changes with those two.
        self._clamped: dict[str, tuple[int, int]] = {}
        # Tokens at admission (what came after was generated) and the RL the admission reserved.
        self._admitted_at: dict[str, tuple[int, int]] = {}
        self._requests: dict[str, Request] = {}  # admitted ones, to send a dropped guest back to 0
        self._served: set[str] = set()  # given slots this step: their slots must not be taken

    # -- capacity --------------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        # Admission never touches the reserved pool, so a longer request could never come back
        # after an offload-free preemption.
        return (self.alloc.num_blocks - self.alloc.reserve_target) * self.block_size

    @property
    def num_blocks(self) -> int:
        return self.alloc.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.alloc.num_blocks - self.alloc.num_free_blocks - self.alloc.num_reserved_pool_blocks

    # -- predictions -----------------------------------------------------------------------
    def prediction(self, request: Request) -> int:
        """The RL that `request`'s admission reserves for, beyond its current tokens."""
        rid, alloc, num_tokens = request.request_id, self.alloc, request.num_tokens
        cached = self._clamped.get(rid)
        if cached is not None and cached[0] == num_tokens:
            return cached[1]
        if rid not in self._predicted:  # once: can_reserve and reserve must agree
            fixed = self.predicted_len or request.params.max_tokens
            self._predicted[rid] = self.predicted_len(request) if callable(self.predicted_len) else fixed
        predicted = self._predicted[rid]
        # No point reserving past max_tokens: the engine stops the request there.
        predicted = min(predicted, request.output_tokens_left)
        # A reservation larger than the admission pool could never be admitted; a shorter one
        # is only an under-prediction, which the reserved pool and preemption handle (§3.2.2).
        pool = (alloc.num_blocks - alloc.reserve_target) * self.block_size - num_tokens
        predicted = max(1, min(predicted, math.floor(pool / (1 + alloc.config.padding_ratio))))
        while predicted > 1 and alloc.reservation_tokens(num_tokens, predicted) > pool + num_tokens:
            predicted -= 1  # the padding's rounding up: a step or two at most
        self._clamped[rid] = (num_tokens, predicted)
        return predicted

    # -- the step --------------------------------------------------------------------------
    def order(self, running: list[Request]) -> list[Request]:
        """Hosts before their guests, FCFS otherwise. FCFS's admission order already is (a guest
        is admitted after its host, and re-lent only to its host's own host): this guards others."""
        if not self.alloc.num_guests:  # nothing to reorder (returned as is, as KVManager.order does)
            return running
        by_id, seen, ordered = {r.request_id: r for r in running}, set(), []

        def place(request: Request) -> None:
            if request.request_id in seen:
                return
            seen.add(request.request_id)
            host = self.alloc.host_of(request.request_id) if self.alloc.has(request.request_id) else None
            if host in by_id:
                place(by_id[host])
            ordered.append(request)

        for request in running:
            place(request)
        return ordered

    def step_copies(self, running: list[Request], window: float | None = None) -> list[KVCopy]:
        self._served.clear()  # a new step: last step's forward is done with every slot
        return []

    def can_reserve(self, request: Request, num_tokens: int) -> bool:
        rid = request.request_id
        if not self.alloc.has(rid):
            return self.alloc.can_admit(request.num_tokens, self.prediction(request))
        return self.alloc.can_write(rid, num_tokens)

    def reserve(self, request: Request, num_tokens: int) -> list[KVCopy]:
        rid = request.request_id
        if self.alloc.write_within(rid, num_tokens):  # a decode inside its reservation: no copies
            self._served.add(rid)
            return []
        if not self.can_reserve(request, num_tokens):
            raise NoFreeBlocksError(f"{rid!r}: no room for {num_tokens} tokens")
        copies: list[KVCopy] = []
        if not self.alloc.has(rid):
            # The whole prompt (or, after a preemption, prompt and generated tokens) plus the RL.
            predicted = self.prediction(request)
            self.alloc.admit(rid, request.num_tokens, predicted)
            self._admitted_at[rid], self._requests[rid] = (request.num_tokens, predicted), request
        else:
            copies += self.alloc.ensure_resident(rid)
        guests = self._nested_guests(rid)
        grow = num_tokens - self.alloc.num_written(rid)
        if grow > 0:
            copies += self.alloc.grow(rid, grow)
        for guest in guests:
            if self.alloc.is_resident(guest):
                continue
            if guest in self._served:
                raise RuntimeError(f"{rid!r} evicted {guest!r}, which was given a chunk this step: order() is wrong")
            if self.alloc.num_written(guest) == 0:  # dropped: no host room for its KV
                self._requests[guest].num_computed_tokens = 0
        self._served.add(rid)
        return copies

    def block_table(self, request: Request) -> list[int]:
        return self.alloc.block_table(request.request_id)

    def preempt(self, request: Request) -> tuple[int, list[KVCopy]]:
        """Offload-free (§3.2.2): free the request's KV and re-admit it later with L_new.

        The paper: "By subtracting its currently generated response length from its predicted
        RL, we obtain its new predicted RL L_new". That formula has a flaw: a request preempted
        because it outgrew its padded reservation has generated more than its prediction, so
        L_new <= 0 and it would come back with a token or two reserved, to be preempted again.
        Then (ours) the predictor re-predicts the remaining length (`predict_remaining`:
        conditional on what was generated), or, with no predictor, all max_tokens allows."""
        rid = request.request_id
        if not self.alloc.has(rid):
            return 0, []
        admitted_at, admitted_rl = self._admitted_at.pop(rid)
        generated = request.num_tokens - admitted_at
        l_new = self.alloc.preempt(rid, generated)
        if admitted_rl - generated < self.alloc.config.min_new_prediction:
            l_new = self.repredicted(request)
            self.repredictions += 1
        self._predicted[rid] = l_new
        self._clamped.pop(rid, None)
        del self._requests[rid]
        return 0, []

    def repredicted(self, request: Request) -> int:
        """The remaining length of a request that outran its prediction (see `preempt`)."""
        if isinstance(self.predicted_len, RemainingPredictor):
            return max(1, self.predicted_len.predict_remaining(request))
        return request.output_tokens_left

    def release(self, request: Request) -> None:
        rid = request.request_id
        self.alloc.free(rid)
        # An online predictor (sched/predictor.py) learns from every request that finishes.
        observe = getattr(self.predicted_len, "observe", None)
        if callable(observe) and request.status.finished:
            observe(request)
        for table in (self._predicted, self._clamped, self._admitted_at, self._requests):
            table.pop(rid, None)

    def _nested_guests(self, rid: str) -> list[str]:
        guests, stack = [], self.alloc.hosted_by(rid)
        while stack:
            guests.append(stack.pop())
            stack += self.alloc.hosted_by(guests[-1])
        return guests

    # -- observability ----------------------------------------------------------------------
    @property
    def events(self) -> dict[str, int]:
        a = self.alloc
        return {
            "admissions": a.admissions,
            "hosted_placements": a.hosted_placements,  # admitted into a host's unused allocation (§3.4)
            "reserved_pool_draws": a.reserved_pool_draws,  # blocks past a reservation (§3.2.2)
            "preemptions": a.preemptions,  # offload-free (§3.2.2)
            "repredictions": self.repredictions,  # ...whose L_new was <= 0
            "hosted_evictions": a.hosted_evictions,  # guests whose host's writes reached them (§3.4)
            "hosted_drops": a.hosted_drops,  # ...with no host room: recomputed
            "restores": a.restores,  # evicted guests brought back
        }

    def check_invariants(self) -> None:
        self.alloc.check_invariants()


def build(ctx) -> ExactKV:
    """The registry's builder for "exact" (see nanoserve/memory/__init__.py). Options:
    `predicted_len` (one RL for every request, or a function of the request; default each
    request's max_tokens) and the `ExactAllocConfig` knobs (padding_ratio, reserved_fraction,
    pipeline_buffer, min_new_prediction)."""
    options = dict(ctx.options)
    predicted_len = options.pop("predicted_len", None)
    knobs = {name: options.pop(name) for name in ALLOC_OPTIONS if name in options}
    if options:
        raise ValueError(f"unknown options for the exact KV manager: {sorted(options)}")
    if not (predicted_len is None or callable(predicted_len) or (isinstance(predicted_len, int) and predicted_len >= 1)):
        raise ValueError(f"predicted_len must be a positive integer or a function of the request, got {predicted_len!r}")
    config = ExactAllocConfig(block_size=ctx.block_size, **knobs)
    return ExactKV(ExactAllocator(ctx.num_blocks, config, ctx.host_store), predicted_len)
