"""KunServe's lookahead batch formulation (kunserve.txt §4.3, Fig. 10–11, Eq. 1–3, App. A.1).

After KunServe drops parameters, an instance runs its model as a pipeline, and a pipeline idles
(a "bubble") whenever one micro-batch takes longer than the one before it on the next stage
(Fig. 8). Token-count chunking (Sarathi-Serve) gives every micro-batch the same number of
tokens, but a micro-batch's time is not linear in its tokens: attention is quadratic in a
chunk's length and grows with its prefix, so a late chunk of a long prompt costs more than an
early one of the same size (Fig. 17). Under a burst many requests are queued, so KunServe looks
ahead over all of them and cuts the queued work into micro-batches of equal *cost*.

Paper → code:

- Eq. (1), the cost of one chunk of c new tokens over a prefix of p: `CostModel.chunk_cost`
  (`nanoserve/sched/cost_model.py`). A request cut into chunks has p_ij = Σ_{k<j} c_ik: here a
  piece's `start` *is* its prefix, so the same request's later pieces cost more.
- Eq. (2)–(3), a micro-batch's cost is the sum of its chunks' costs: `microbatch_cost` (plus the
  per-iteration constant, the same for every micro-batch, since each runs as its own pass).
- Fig. 10–11, the divide-and-conquer formulation: `lookahead_microbatches`. One micro-batch
  holds all queued work; `_split` cuts it where the cost of the two sides balances (Fig. 11
  line 8, `b.split(0.5·cost(b))`), cutting a request in two when the balance point falls inside
  it, and `_balance` splits each side again (Fig. 11's `balance_micro_batch`).
- When to stop (Fig. 11 lines 4–5, "don't chunk if with few tokens", and App. A.1: m micro-
  batches from MIN, each under cost_upper = cost/m). We fix the number m of micro-batches up
  front and let a micro-batch due k of them split at cost fraction ⌊k/2⌋/k: for m a power of two
  this is exactly Fig. 11's halving, and every leaf gets ≈ cost/m. m starts at ⌊tokens/MIN⌋ and
  shrinks until every micro-batch has ≥ MIN tokens (cost-dense work, a long prefix, gets fewer
  tokens per micro-batch, so equal cost may need fewer micro-batches than equal tokens). So no
  micro-batch is under MIN unless all the queued work is (then it is the only one). Stopping
  per branch instead, as the pseudocode reads literally, would leave leaves of different depth
  whose costs differ by 2×.
- `token_count_microbatches`: the baseline it replaces (Fig. 17 (a)): fixed token counts.
- Eq. (4), the pipeline's time, and the bubble ratio ("the ratio of idle GPU cycles" of the
  evaluation's ablation):
  `pipeline_time`, `bubble_ratio`. Eq. (4) is the two-stage, lockstep case.

The scheduler (`KunServeScheduler`): on one device there is no pipeline yet (KunServe's cluster
half, parameter drop and KV exchange, comes with the distributed work), so it is FCFS (chunked
prefill under the token budget, stall-free decodes, preemption by recompute from the end of the
running list) whose step is the *first lookahead micro-batch*: the work of the running requests
and then of the waiting ones that `max_num_seqs` leaves room for, in that order, cut into
cost-balanced micro-batches; this step runs the first (cut to the token budget if it is
larger: MIN defaults to half the budget, so it rarely is). It also records the estimated bubble
ratio that `num_stages` pipeline stages would see for the whole lookahead, and for token-count
chunking into as many micro-batches, so the gain can be reported (`last_bubble_ratio`, `stats`).

Under pipeline parallelism (`SchedulerConfig.pipeline_microbatches` = m > 1,
nanoserve/parallel/pipeline.py) the step looks ahead over the running and then the waiting
requests (§4.3: "we can re-form the microbatches across them by looking ahead all requests
queued"), FCFS's pass with up to m token budgets in flight (a KunServe cluster member's
group gives m x the budget, so each of the m micro-batches can be as large as a step alone;
the engine's own PP keeps one budget, the activations it profiled), and the
lookahead's balancing cuts it into up to m micro-batches of equal cost, each of at least
MIN tokens (Fig. 11 lines 4-5, "Don't chunk if with few tokens": a decode step of 87 requests
is not cut into four micro-batches of 22, each re-reading every weight);
`SchedulerOutput.microbatches` hands that cut to the executor, which would otherwise cut by
token count (`_plan_pipelined`). Assumption: the paper looks ahead over "all requests
queued" and stops splitting at MIN; a step here keeps at most m micro-batches in flight, so the
lookahead reaches `pipeline_step_tokens` tokens into the queue (issue 46; before, the step was
FCFS's one budget re-cut, `pipeline_step_tokens` = the budget, an ablation).
Assumption: the paper profiles MIN offline and says only that
it "ensures that each microbatch has sufficient tokens to fully utilize the GPU"; our default is
the share of one of the m micro-batches of a full step, budget / m, and `pipeline_min_tokens`
(a policy option) sets it (benchmarks/pipeline.py --sim sweeps it). Under an asynchronous
pipeline (`microbatches_in_flight` > 1) each step is one micro-batch: the first of the
lookahead over the queue, as on one device.

Option `pipeline_cut="tokens"` cuts the same pipelined step by token count instead (Fig. 17 (a)'s
baseline, `token_count_microbatches`: micro-batches filled in queue order to step / m tokens), so
an ablation compares the two cuts on the same work.

Left out: the paper's discussion notes lookahead needs a queue to look ahead into; we never wait
for one (normal serving just gets one micro-batch, the FCFS step, when the queue is short).
"""
from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections.abc import Callable, Hashable, Sequence
from itertools import islice

from nanoserve.config import SchedulerConfig
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.manager import KVManager
from nanoserve.request import Request
from nanoserve.sched.cost_model import CostModel
from nanoserve.sched.fcfs import FCFSScheduler
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput

# One piece of queued work: request `id` still lacks tokens [start, start + num_tokens); the
# first `start` tokens are its prefix (already cached, or in an earlier micro-batch).
Piece = tuple[Hashable, int, int]
MicroBatch = list[Piece]


def microbatch_cost(microbatch: Sequence[Piece], cost_model: CostModel) -> float:
    """Eq. (3): Σ Eq. (1) over the micro-batch's chunks, plus the per-pass constant."""
    return cost_model.predict([(start, n) for _, start, n in microbatch])


def _split(mb: MicroBatch, k0: int, k1: int, cost_model: CostModel) -> tuple[MicroBatch, MicroBatch]:
    """Fig. 11 line 8: cut `mb` after x tokens so that cost(head)/k0 ≈ cost(tail)/k1, with
    x ∈ [k0, tokens − k1] so that each side keeps a token per micro-batch it is due.
    head(x)'s cost grows with x and tail(x)'s shrinks (a token moved from tail to head stops
    paying attention to its prefix on one side and starts on the other), so a binary search
    finds the crossing. (The one exception: a 1-token piece is priced as a decode.)"""
    costs = [cost_model.chunk_cost(start, n) for _, start, n in mb]
    offsets, cum = [0], [0.0]  # token offset and cost of everything before chunk j
    for (_, _, n), c in zip(mb, costs):
        offsets.append(offsets[-1] + n)
        cum.append(cum[-1] + c)
    total_tokens, total_cost, iteration = offsets[-1], cum[-1], cost_model.iteration

    def sides(x: int) -> tuple[float, float, int, int]:
        j = bisect_right(offsets, x - 1) - 1  # the chunk holding token x - 1 (head's last)
        t = x - offsets[j]  # head keeps t of chunk j's tokens
        rid, start, n = mb[j]
        head = cum[j] + cost_model.chunk_cost(start, t) + iteration
        tail = total_cost - cum[j + 1] + (cost_model.chunk_cost(start + t, n - t) if t < n else 0.0) + iteration
        return head / k0, tail / k1, j, t

    lo, hi = k0, total_tokens - k1
    a, b = lo, hi
    while a < b:  # the smallest x whose head side is at least its tail side
        mid = (a + b) // 2
        h, t_, _, _ = sides(mid)
        if h >= t_:
            b = mid
        else:
            a = mid + 1
    best = min((x for x in (a - 1, a) if lo <= x <= hi), key=lambda x: max(sides(x)[:2]))
    _, _, j, t = sides(best)
    rid, start, n = mb[j]
    head = mb[:j] + [(rid, start, t)]
    tail = ([(rid, start + t, n - t)] if t < n else []) + mb[j + 1:]
    return head, tail


def _balance(mb: MicroBatch, k: int, cost_model: CostModel) -> list[MicroBatch]:
    """Fig. 11's `balance_micro_batch`: split in two, then each half again, until each piece is
    one of the k micro-batches this one is due."""
    if k <= 1:
        return [mb]
    k0 = k // 2
    head, tail = _split(mb, k0, k - k0, cost_model)
    return _balance(head, k0, cost_model) + _balance(tail, k - k0, cost_model)


def lookahead_microbatches(work: Sequence[Piece], cost_model: CostModel, min_tokens: int,
                           num_microbatches: int | None = None) -> list[MicroBatch]:
    """Cut the queued `work` (in queue order) into cost-balanced micro-batches (Fig. 10–11).

    Returns micro-batches in execution order, each a list of (id, start, num_tokens). Together
    they cover every queued token exactly once, each request's pieces in order (a request cut
    across micro-batches continues at the next), and each micro-batch has ≥ `min_tokens`
    tokens unless all the work has fewer. There are at most m = ⌊tokens / min_tokens⌋ of them
    (App. A.1), fewer where cost-dense work needs them larger; `num_microbatches` lowers m."""
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    pieces: list[Piece] = [(rid, start, n) for rid, start, n in work]
    if any(n < 1 or start < 0 for _, start, n in pieces):
        raise ValueError("every piece of work needs num_tokens >= 1 and start >= 0")
    if not pieces:
        return []
    tokens = sum(n for _, _, n in pieces)
    m = max(1, tokens // min_tokens)
    if num_microbatches is not None:
        m = max(1, min(m, num_microbatches))
    while True:
        mbs = _balance(pieces, m, cost_model)
        fewest = min(sum(n for _, _, n in b) for b in mbs)
        if m == 1 or fewest >= min_tokens:
            return mbs
        # Cost-dense work (long prefixes) got fewer than MIN tokens: fewer, larger micro-batches.
        m = max(1, min(m - 1, m * fewest // min_tokens))


def token_count_microbatches(work: Sequence[Piece], tokens_per_batch: int) -> list[MicroBatch]:
    """The baseline (Sarathi-Serve, Fig. 17 (a)): fill micro-batches with `tokens_per_batch`
    tokens each, in queue order, chunking a request where a micro-batch fills up."""
    if tokens_per_batch < 1:
        raise ValueError(f"tokens_per_batch must be >= 1, got {tokens_per_batch}")
    out: list[MicroBatch] = []
    current: MicroBatch = []
    room = tokens_per_batch
    for rid, start, n in work:
        while n > 0:
            take = min(n, room)
            current.append((rid, start, take))
            start, n, room = start + take, n - take, room - take
            if room == 0:
                out.append(current)
                current, room = [], tokens_per_batch
    if current:
        out.append(current)
    return out


def pipeline_time(costs: Sequence[float], num_stages: int, lockstep: bool = False) -> float:
    """Time for micro-batches of these (whole-model) costs to pass through `num_stages` stages
    that each take 1/num_stages of a micro-batch's cost, in order (a request cut across
    micro-batches needs its earlier piece's K/V only on the same stage, which ran it first).

    By default each stage starts a micro-batch as soon as it is free and the previous stage has
    handed it over. With `lockstep`, all stages advance together, each round as long as its
    slowest stage: for two stages this is Eq. (4), (cost_b1 + Σ max(cost_bk, cost_bk+1) +
    cost_bm) / 2; it is an upper bound on the default."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    per_stage = [c / num_stages for c in costs]
    if not per_stage:
        return 0.0
    if lockstep:
        m = len(per_stage)
        return sum(max(per_stage[max(0, r - num_stages + 1):min(m, r + 1)]) for r in range(m + num_stages - 1))
    finish = [0.0] * num_stages  # when each stage finished its latest micro-batch
    for c in per_stage:
        ready = 0.0
        for s in range(num_stages):
            finish[s] = max(finish[s], ready) + c
            ready = finish[s]
    return finish[-1]


def bubble_ratio(microbatch_costs: Sequence[float], num_stages: int, lockstep: bool = False) -> float:
    """The share of stage-time spent idle: 1 − Σ cost / (num_stages · pipeline time). Even equal
    micro-batches leave the fill-and-drain bubble (S − 1)/(m + S − 1); unequal ones leave more."""
    span = pipeline_time(microbatch_costs, num_stages, lockstep)
    return 0.0 if span <= 0 else max(0.0, 1.0 - sum(microbatch_costs) / (num_stages * span))


class KunServeScheduler(FCFSScheduler):
    """FCFS whose step is the first cost-balanced lookahead micro-batch (see the module docstring).

    `num_stages`: the pipeline depth the bubble estimate assumes. `min_tokens`: MIN of Fig. 11,
    default half the token budget, so that a micro-batch is usually no more than one step.
    `pipeline_min_tokens`: MIN when a pipelined step is cut (default: budget / m)."""

    OPTIONS = {"pipeline_min_tokens": "Fig. 11's MIN when a pipelined step is cut (default: budget / micro-batches)",
               "pipeline_step_tokens": "tokens a pipelined step looks ahead over (default: micro-batches x budget; "
                                       "the budget: FCFS's step re-cut, the rule before issue 46)",
               "pipeline_cut": "how a pipelined step is cut: 'cost' (the lookahead's balancing, default) or "
                               "'tokens' (Fig. 17 (a)'s baseline: micro-batches filled to step / m tokens, "
                               "in queue order)"}
    ASYNC_SCHEDULING = False  # its lookahead cuts known tokens only (and its arena runs layers in Python)

    def __init__(self, config: SchedulerConfig, kv: KVManager | BlockPool, cost_model: CostModel | None = None,
                 clock: Callable[[], float] = time.monotonic, num_stages: int = 2, min_tokens: int | None = None):
        super().__init__(config, kv, cost_model, clock)
        self.pipeline_min_tokens: int | None = config.policy_options.get("pipeline_min_tokens")
        if self.pipeline_min_tokens is not None and self.pipeline_min_tokens < 1:
            raise ValueError(f"pipeline_min_tokens must be >= 1, got {self.pipeline_min_tokens}")
        self.pipeline_step_tokens: int | None = config.policy_options.get("pipeline_step_tokens")
        self.pipeline_cut: str = config.policy_options.get("pipeline_cut", "cost")
        if self.pipeline_cut not in ("cost", "tokens"):
            raise ValueError(f"pipeline_cut must be 'cost' or 'tokens', got {self.pipeline_cut!r}")
        if self.pipeline_step_tokens is not None and self.pipeline_step_tokens < 1:
            raise ValueError(f"pipeline_step_tokens must be >= 1, got {self.pipeline_step_tokens}")
        self.use_pipeline(num_stages, config.pipeline_microbatches)  # > 1 micro-batches: a pipelined executor
        self.min_tokens = min_tokens if min_tokens is not None else max(1, config.max_num_batched_tokens // 2)
        self._allotted: dict[Hashable, int] | None = None  # this step's share per request
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")
        self.last_microbatches: list[MicroBatch] = []
        self.last_bubble_ratio: float | None = None  # lookahead's, for the latest step with work
        self.last_token_count_bubble_ratio: float | None = None  # token-count chunking's, same m
        self.stats = {"steps": 0, "microbatches": 0, "request_cuts": 0,
                      "bubble_ratio_sum": 0.0, "token_count_bubble_ratio_sum": 0.0}
        self._pipelined = {"pipelined_steps": 0, "pipelined_microbatches": 0, "pipelined_tokens": 0}

    def use_pipeline(self, num_stages: int, microbatches_per_step: int, step_tokens: int | None = None) -> None:
        """§4.4: a member that joined a pipeline group cuts its steps into micro-batches of
        balanced cost for that many stages, looking ahead `step_tokens` into the queue; alone
        again, it runs one forward a step."""
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        self.num_stages = num_stages
        self.microbatches_per_step = microbatches_per_step
        self.step_tokens = step_tokens

    def lookahead(self) -> list[MicroBatch]:
        """The queued work (running requests in serving order, then as many waiting ones as
        max_num_seqs leaves room for), cut into lookahead micro-batches; records the estimate."""
        room = max(0, self.config.max_num_seqs - len(self.running))
        queued = self.running + list(islice(self.waiting, room))
        work = [(r.request_id, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens)
                for r in queued
                if r.num_tokens > r.num_computed_tokens and not r.num_pending_tokens]
        mbs = lookahead_microbatches(work, self.cost_model, self.min_tokens)
        self.last_microbatches = mbs
        if mbs:
            tokens = sum(n for _, _, n in work)
            baseline = token_count_microbatches(work, math.ceil(tokens / len(mbs)))
            self.last_bubble_ratio = bubble_ratio([microbatch_cost(b, self.cost_model) for b in mbs], self.num_stages)
            self.last_token_count_bubble_ratio = bubble_ratio(
                [microbatch_cost(b, self.cost_model) for b in baseline], self.num_stages)
            self.stats["steps"] += 1
            self.stats["microbatches"] += len(mbs)
            self.stats["request_cuts"] += sum(len(b) for b in mbs) - len(work)
            self.stats["bubble_ratio_sum"] += self.last_bubble_ratio
            self.stats["token_count_bubble_ratio_sum"] += self.last_token_count_bubble_ratio
        return mbs

    def plan(self) -> SchedulerOutput:
        self.running = self.kv.order(self.running)
        if self.microbatches_per_step > 1:
            return self._plan_pipelined()
        # This step's micro-batch: a prefix of the queued work, so a request outside it has
        # nothing after it inside it either. FCFS's pass then serves exactly that share.
        mbs = self.lookahead()
        self._allotted = {rid: n for rid, _, n in mbs[0]} if mbs else {}
        return super().plan()

    def step_token_budget(self) -> int:
        """One device: the budget. A pipelined step: the option `pipeline_step_tokens`, else
        what `use_pipeline` gave (a cluster member's group: m budgets), else the budget."""
        budget = self.config.max_num_batched_tokens
        if self.microbatches_per_step <= 1:
            return budget
        return self.pipeline_step_tokens or self.step_tokens or budget

    def _plan_pipelined(self) -> SchedulerOutput:
        """Under pipeline parallelism: the lookahead over the running and waiting requests
        (FCFS's pass under `step_token_budget`), cut by the lookahead's balancing into up to m
        micro-batches of equal cost and at least MIN tokens, where token-count chunking would
        give them equal tokens."""
        self._allotted = None
        out = super().plan()
        work = [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]
        if work:
            min_tokens = (self.pipeline_min_tokens
                          or max(1, self.config.max_num_batched_tokens // self.microbatches_per_step))
            if self.pipeline_cut == "tokens":  # Fig. 17 (a): the same work, cut by token count
                mbs = token_count_microbatches(work, -(-self.step_token_budget() // self.microbatches_per_step))
            else:
                mbs = lookahead_microbatches(work, self.cost_model, min_tokens, self.microbatches_per_step)
            out.microbatches = self._cut(out, mbs)
            self.last_microbatches = mbs
            self._pipelined["pipelined_steps"] += 1
            self._pipelined["pipelined_microbatches"] += len(mbs)
            self._pipelined["pipelined_tokens"] += out.num_tokens
            self.last_bubble_ratio = bubble_ratio([microbatch_cost(b, self.cost_model) for b in mbs], self.num_stages)
        return out

    def counters(self) -> dict[str, int]:
        """Steps cut on one device and the micro-batches cut (`stats`' counts), and the pipelined
        steps (in a group, or under PP) with their micro-batches and tokens."""
        return {"steps": int(self.stats["steps"]), "microbatches": int(self.stats["microbatches"]),
                "request_cuts": int(self.stats["request_cuts"]), **self._pipelined}

    def tokens_wanted(self, request: Request) -> int:
        if self._allotted is None:
            return super().tokens_wanted(request)
        return self._allotted.get(request.request_id, 0)

    @staticmethod
    def _cut(out: SchedulerOutput, step: list[MicroBatch]) -> list[list[ScheduledChunk]]:
        """The step's chunks cut along `step`'s pieces (which cover them exactly)."""
        chunks: dict[Hashable, ScheduledChunk] = {c.request.request_id: c for c in out.chunks}
        return [[chunks[rid]._replace(start=start, num_tokens=n) for rid, start, n in mb] for mb in step]
