"""EcoServe's exact allocation behind the `KVManager` interface (ecoserve.txt §2.3, §3.2, §3.4).

Every request gets a predicted response length (RL): `options["predicted_len"]`, one number for
all of them or a function of the request (a trace's lookup, a predictor model), else its
`max_tokens`; after a preemption, the L_new of §3.2.2. A prediction is made for a request's tokens
at the time (its prompt, or prompt and generated tokens after a preemption) and reserves
`tokens + RL + padding` slots. The scheduler's calls map onto `ExactAllocator`:

    can_reserve(r, n)   exact, changes nothing: what `reserve` would do
    reserve(r, n)       decoupled (the default, §3.2.1): r's first call admits its prompt only
                        (`admit_prompt`: "The KVC size allocated to a PT equals its prompt
                        length"), its KV charged to the reserved pool ("A small amount KVC is
                        reserved for PTs") or, a prompt longer than the pool holds, from A_KVC
                        ("at the initial iteration, prompts are selected sequentially to form a
                        batch until the available KVC space is fully allocated or the TFS is
                        reached": PTs fill the *available* KVC; the pool keeps PTs coming when
                        GTs have taken it all). `long_prompts="coupled"` is the earlier reading
                        (assumption, kept as an option to sweep): past the pool a prompt spills,
                        admitted with its padded RL at once (`admit`) when A_KVC holds both. It
                        left 98% of BookCorpus's prompts (mean 1,952 tokens against a 732-token
                        pool) and up to 40% of ShareGPT's coupled. Its first call past its prompt
                        batches its GT (`batch`: its RL from A_KVC, or in a host's region). Coupled
                        (`decoupled=False`: ORCA, fcfs): the first call admits prompt + padded RL.
                        Then `grow`: past the allocation from the reserved pool; its copies save
                        the guests r's writes reach (§3.4). An evicted guest is restored first.
    pause(r)            resident preemption (§3.2.2): a decoding GT that cannot grow keeps its KV
                        and waits to be batched again with L_new; None (a guest is evicted instead)
    preempt(r)          drop r's KV (recompute) and keep L_new for its re-admission
    release(r)          free r's blocks (its guests keep theirs) and its host copies

Why each call's copies are one safe group: a call returns loads (a restore) or saves (evictions),
never both, since a restored request has no guests. Why a step is safe (see sched/base.py): the
forward reads and writes the slots of every request given a chunk this step. Only a host's growth
takes slots from another request, and `order` serves hosts before their guests, so a guest is
evicted (saved, in the host's group) before it is given a chunk, and its own later `reserve`
restores it (loads into fresh blocks, in a later group). A request batched from the queue is
hosted only past its host's already-reserved positions. Releases and preemptions move no slots:
guests keep their KV where it is. `reserve` checks this: evicting a request served this step raises.

A guest the host store has no room for loses its KV (`hosted_drops`) and must recompute: its
request's `num_computed_tokens` is set to 0 here. It has not been served this step (see above),
so the scheduler reads the new value when it gets to it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from nanoserve.memory import KVBuildContext, refuse_prefix_caching
from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.exact import ExactAllocator, ExactAllocConfig
from nanoserve.memory.host import KVCopy
from nanoserve.memory.manager import KVManager
from nanoserve.memory.predictor import LengthPredictor, as_length_predictor

if TYPE_CHECKING:
    from nanoserve.request import Request

ALLOC_OPTIONS = ("padding_ratio", "reserved_fraction", "pipeline_buffer_ratio", "min_new_prediction")
LONG_PROMPTS = ("decoupled", "coupled")  # what a prompt longer than the reserved pool gets (module docstring)
# exact_kv's `predicted_len` option: a predictor, one RL for every request, a function of the
# request, or None (each request's max_tokens); `as_length_predictor` makes each a predictor.
Predictor = LengthPredictor | Callable[["Request"], int] | int | None


class ExactKV(KVManager):
    """Exact allocation from predicted lengths, decoupled PT/GT allocation, a reserved pool,
    offload-free (resident) preemption and KV pipelining (EcoServe §3.2, §3.4)."""

    def __init__(self, alloc: ExactAllocator, predicted_len: Predictor = None, decoupled: bool = True,
                 long_prompts: str = "decoupled", pipelining: bool = True):
        if long_prompts not in LONG_PROMPTS:
            raise ValueError(f"long_prompts must be one of {LONG_PROMPTS}, got {long_prompts!r}")
        self.alloc = alloc
        self.block_size = alloc.block_size
        self.host_store = alloc.host_store
        self.predictor = as_length_predictor(predicted_len)
        self.decoupled = decoupled
        # Decoupled: a prompt the reserved pool cannot hold takes A_KVC ("decoupled") or spills
        # with its RL ("coupled"); see the module docstring.
        self.from_available = long_prompts == "decoupled"
        # KVCPipeline (§3.4) on: GTs may be hosted in a batched GT's unused allocation. Off: the
        # Fig. 11 ablation's EcoServe-SDO ("the performance difference between EcoServe and
        # EcoServe-SDO indicates the effectiveness of KVCPipeline").
        self.pipelining = pipelining
        # Per request: (its tokens when predicted, the RL its allocation is for), asked once per
        # request and again (L_new) at each preemption; the RL is clamped to what can be admitted.
        self._predicted: dict[str, tuple[int, int]] = {}
        self._requests: dict[str, Request] = {}  # admitted ones, to send a dropped guest back to 0
        self._served: set[str] = set()  # given slots this step: their slots must not be taken
        self.repredictions = 0  # preemptions whose L_new was <= 0: re-predicted (see `_l_new`)
        self.spills = 0  # prompts admitted coupled, past the reserved pool
        self.pauses = 0  # preemptions that kept the request's KV (on the device, or a guest's on the host)

    # -- capacity --------------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        # GTs are batched from A_KVC only, so a longer request could never be batched.
        return (self.alloc.num_blocks - self.alloc.reserve_target) * self.block_size

    @property
    def num_blocks(self) -> int:
        return self.alloc.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.alloc.num_blocks - self.alloc.num_free_blocks

    def admission_room_tokens(self) -> int:
        """A_KVC: the reserved pool is not for GTs."""
        return self.alloc.num_admission_blocks * self.block_size

    # -- predictions -----------------------------------------------------------------------
    def predicted_output_len(self, request: Request) -> int:
        """The RL that `request`'s next allocation is for, past the tokens it had when predicted."""
        return self._prediction(request)[1]

    def predicted_total_output_len(self, request: Request) -> int:
        """What was generated when the RL was predicted (0, or the tokens before a preemption)
        plus that RL: after a pause, the tokens so far and L_new."""
        base, predicted = self._prediction(request)
        return base - request.num_prompt_tokens + predicted

    def _prediction(self, request: Request) -> tuple[int, int]:
        cached = self._predicted.get(request.request_id)
        if cached is None:  # once: can_reserve and reserve must agree
            predicted = self.predictor.predict(request)
            cached = self._predicted[request.request_id] = self._clamped(request, predicted)
        return cached

    def _clamped(self, request: Request, predicted: int) -> tuple[int, int]:
        """(tokens now, `predicted` cut to what can be admitted with them)."""
        alloc, base = self.alloc, request.num_tokens
        # No point reserving past max_tokens: the engine stops the request there.
        predicted = min(predicted, request.output_tokens_left)
        # A reservation larger than A_KVC could never be batched; a shorter one is only an
        # under-prediction, which the reserved pool and preemption handle (§3.2.2).
        pool = (alloc.num_blocks - alloc.reserve_target) * self.block_size - base
        predicted = max(1, min(predicted, math.floor(pool / (1 + alloc.config.padding_ratio))))
        while predicted > 1 and alloc.reservation_tokens(base, predicted) > pool + base:
            predicted -= 1  # the padding's rounding up: a step or two at most
        return base, predicted

    def _l_new(self, request: Request) -> int:
        """§3.2.2: "By subtracting its currently generated response length from its predicted RL,
        we obtain its new predicted RL L_new". That formula has a flaw: a request preempted
        because it outgrew its padded reservation has generated more than its prediction, so
        L_new <= 0 and it would come back with a token or two reserved, to be preempted again.
        Then (ours) the predictor re-predicts the remaining length (`predict_remaining`:
        conditional on what was generated), or, with no predictor, all max_tokens allows."""
        base, predicted = self._prediction(request)
        l_new = predicted - (request.num_tokens - base)
        if l_new >= self.alloc.config.min_new_prediction:
            return l_new
        self.repredictions += 1
        return max(1, self.predictor.predict_remaining(request))

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
        rid, alloc = request.request_id, self.alloc
        if not alloc.has(rid):
            _, predicted = self._prediction(request)
            if self.decoupled and alloc.can_admit_prompt(request.num_tokens, from_available=self.from_available):
                return True
            if self.decoupled and self.from_available:
                return False  # a PT gets its prompt only, never prompt + RL
            return alloc.can_admit(request.num_tokens, predicted, allow_hosting=self._hosting_coupled)
        if not alloc.is_batched(rid) and num_tokens > alloc.reservation(rid):
            return alloc.can_batch(rid, *self._prediction(request), allow_hosting=self.pipelining)
        return alloc.can_write(rid, num_tokens)

    @property
    def _hosting_coupled(self) -> bool:
        # Decoupled, only GTs are hosted (§3.4: "Recursively select hosted GT groups"), so no
        # request waiting in Q_G is ever a guest; coupled (ORCA), a whole admission may be.
        return self.pipelining and not self.decoupled

    def reserve(self, request: Request, num_tokens: int) -> list[KVCopy]:
        rid, alloc = request.request_id, self.alloc
        if alloc.write_within(rid, num_tokens):  # a decode inside its allocation: no copies
            self._served.add(rid)
            return []
        if not self.can_reserve(request, num_tokens):
            raise NoFreeBlocksError(f"{rid!r}: no room for {num_tokens} tokens")
        copies: list[KVCopy] = []
        if not alloc.has(rid):
            _, predicted = self._prediction(request)
            if self.decoupled and alloc.can_admit_prompt(request.num_tokens, from_available=self.from_available):
                # A PT: its prompt, from the reserved pool or (a long one) from A_KVC.
                alloc.admit_prompt(rid, request.num_tokens, from_available=self.from_available)
            else:  # coupled: the prompt and its RL at once
                alloc.admit(rid, request.num_tokens, predicted, allow_hosting=self._hosting_coupled)
                self.spills += self.decoupled
            self._requests[rid] = request
        elif not alloc.is_batched(rid) and num_tokens > alloc.reservation(rid):
            # its GT: the predicted RL
            copies += alloc.batch(rid, *self._prediction(request), allow_hosting=self.pipelining)
        else:
            copies += alloc.ensure_resident(rid)
        guests = self._nested_guests(rid)
        grow = num_tokens - alloc.num_written(rid)
        if grow > 0:
            copies += alloc.grow(rid, grow)
        self._reset_dropped(guests)
        self._served.add(rid)
        return copies

    def block_table(self, request: Request) -> list[int]:
        return self.alloc.block_table(request.request_id)

    def pause(self, request: Request) -> tuple[int, list[KVCopy]] | None:
        """Resident preemption (§3.2.2): "If the reserved KVC is not enough, this request stops
        processing along with other completed requests in the batch ... It will be grouped with
        other GTs with the predicted RLs equalling to L_new". It keeps its KV: "A waiting GT
        occupies a certain KVC space for the tokens of its prompt and also for its previously
        generated tokens if it is preempted" (§2.4). Only a decoding GT pauses; anything else is
        dropped (`preempt`). A guest is evicted to host memory (§3.4): then its tokens survive
        there, not resident."""
        rid, alloc = request.request_id, self.alloc
        decoding = request.num_computed_tokens == request.num_tokens - 1
        if not (self.decoupled and alloc.has(rid) and decoding and alloc.is_batched(rid) and alloc.is_resident(rid)):
            return self.preempt(request)
        l_new, guests = self._l_new(request), self._nested_guests(rid)
        copies = alloc.pause(rid)
        self._reset_dropped(guests)
        if not alloc.is_resident(rid) and alloc.num_written(rid) == 0:  # an evicted guest with no host room
            return self.preempt(request)
        self._predicted[rid] = self._clamped(request, l_new)
        self.pauses += 1
        return None if alloc.is_resident(rid) else (request.num_computed_tokens, copies)

    def preempt(self, request: Request) -> tuple[int, list[KVCopy]]:
        """Offload-free, dropping the KV (§3.2.2's second option; what a coupled policy does): free
        the request's KV and re-admit it later with L_new (`_l_new`), recomputing."""
        rid = request.request_id
        if not self.alloc.has(rid):
            return 0, []
        l_new = self._l_new(request)
        self.alloc.preempt(rid, request.num_tokens - self._predicted[rid][0])
        self._predicted[rid] = self._clamped(request, l_new)
        del self._requests[rid]
        return 0, []

    def release(self, request: Request) -> None:
        rid = request.request_id
        self.alloc.free(rid)
        # An online predictor (memory/predictor.py) learns from every request that finishes.
        if request.status.finished:
            self.predictor.observe(request)
        self._predicted.pop(rid, None)
        self._requests.pop(rid, None)

    def _nested_guests(self, rid: str) -> list[str]:
        if not self.alloc.num_guests:
            return []
        guests, stack = [], self.alloc.hosted_by(rid)
        while stack:
            guests.append(stack.pop())
            stack += self.alloc.hosted_by(guests[-1])
        return cast("list[str]", guests)  # the allocator is keyed by this manager's request ids

    def _reset_dropped(self, guests: list[str]) -> None:
        """Guests just evicted with no host room recompute from 0 (see the module docstring)."""
        for guest in guests:
            if self.alloc.is_resident(guest):
                continue
            if guest in self._served:
                raise RuntimeError(f"{guest!r} was evicted after it was given a chunk this step: order() is wrong")
            if self.alloc.num_written(guest) == 0:  # dropped: no host room for its KV
                self._requests[guest].num_computed_tokens = 0

    # -- observability ----------------------------------------------------------------------
    @property
    def events(self) -> dict[str, int]:
        a = self.alloc
        return {
            "admissions": a.admissions,
            "prompt_admissions": a.prompt_admissions,  # PTs given their prompt's KV only (§3.2.1)
            "prompt_admissions_available": a.prompt_admissions_available,  # ...of them from A_KVC
            "spills": self.spills,  # ...or (long_prompts="coupled"), prompt and RL at once
            "batches": a.batches,  # GTs given their predicted RL (§3.2.1)
            "hosted_placements": a.hosted_placements,  # in a host's unused allocation (§3.4)
            "reserved_pool_draws": a.reserved_pool_draws,  # blocks past an allocation (§3.2.2)
            "pauses": self.pauses,  # preemptions that kept the KV (§3.2.2)
            "preemptions": a.preemptions,  # KV dropped, recomputed
            "repredictions": self.repredictions,  # ...whose L_new was <= 0
            "hosted_evictions": a.hosted_evictions,  # guests whose host's writes reached them (§3.4)
            "hosted_drops": a.hosted_drops,  # ...with no host room: recomputed
            "restores": a.restores,  # evicted guests brought back
        }

    def check_invariants(self) -> None:
        self.alloc.check_invariants()


def build(ctx: KVBuildContext) -> ExactKV:
    """The registry's builder for "exact" (see nanoserve/memory/__init__.py). Options:
    `predicted_len` (one RL for every request, or a function of the request; default each
    request's max_tokens), `decoupled` (default True: PTs get their prompt's KV, GTs their RL
    when batched; False: prompt + RL at admission, for ORCA and policies that do not batch GTs),
    `long_prompts` ("decoupled", the default: a prompt past the reserved pool takes A_KVC;
    "coupled": it spills with its RL), `pipelining` (default True: §3.4's hosting; False: the
    Fig. 11 ablation), and the `ExactAllocConfig` knobs (padding_ratio, reserved_fraction, pipeline_buffer_ratio,
    min_new_prediction)."""
    refuse_prefix_caching(ctx, "exact", "EcoServe's allocator reserves each request's prompt plus its predicted "
                          "length as that request's own (§3.2.1) and counts A_KVC from those reservations; a block "
                          "shared by several requests belongs to no one reservation")
    options = dict(ctx.options)
    predicted_len = options.pop("predicted_len", None)
    decoupled = options.pop("decoupled", True)
    long_prompts = options.pop("long_prompts", "decoupled")
    pipelining = options.pop("pipelining", True)
    knobs = {name: options.pop(name) for name in ALLOC_OPTIONS if name in options}
    if options:
        raise ValueError(f"unknown options for the exact KV manager: {sorted(options)}")
    predictor = as_length_predictor(predicted_len)  # checks it, before anything is allocated
    if not isinstance(decoupled, bool) or not isinstance(pipelining, bool):
        raise ValueError(f"decoupled and pipelining must be bools, got {decoupled!r}, {pipelining!r}")
    config = ExactAllocConfig(block_size=ctx.block_size, **knobs)
    return ExactKV(ExactAllocator(ctx.num_blocks, config, ctx.host_store), predictor, decoupled, long_prompts,
                   pipelining)
