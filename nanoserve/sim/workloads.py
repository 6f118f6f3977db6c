"""Workloads for the simulator: arrival processes and request-length distributions.

We do not have the papers' datasets (ShareGPT, BurstGPT, LongBench, ...). Every length
distribution here is a *synthetic* stand-in: a lognormal clipped to the dataset's range, whose
parameters are solved so that the clipped mean equals the mean the paper reports (or, where the
paper itself synthesized requests, the paper's uniform or fixed lengths). Every `LengthDist.label`
says "synthetic" so that no plot or table passes these off as the real traces.

The arrival processes are the ones the papers drive their systems with: Poisson (EcoServe, BROS),
a Gamma renewal process with a given coefficient of variation (ConServe §6.3.2), ON/OFF phases
(ConServe §6.3.1) and BurstGPT-like bursts of 2-3x the base rate (KunServe §2.2, ConServe §2).
`replay_csv` / `save_csv` read and write a trace as `timestamp,prompt_len,output_len,priority`.
"""
from __future__ import annotations

import csv
import math
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from itertools import count, takewhile
from typing import cast

from nanoserve.slo import PRIORITIES, RequestClass

_NAMES = tuple(c.value for c in PRIORITIES)  # ('online', 'offline'): how messages show the classes


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds from the trace start
    prompt_len: int
    output_len: int
    priority: RequestClass = RequestClass.ONLINE  # "online"/"offline" are coerced to the member
    # Shared prefixes, for automatic prefix caching: the first `prefix_len` prompt tokens are the
    # start of one token stream per `prefix_group` (a system prompt; a conversation's history,
    # which each turn extends); the rest are this request's own. None: all its own.
    prefix_group: int | None = None
    prefix_len: int = 0

    def __post_init__(self) -> None:
        # Checked before the coercion, so that the message shows the value as given.
        if self.prompt_len < 1 or self.output_len < 1 or self.priority not in PRIORITIES:
            raise ValueError(f"need positive lengths and a priority in {_NAMES}: {self}")
        if not 0 <= self.prefix_len <= self.prompt_len or (self.prefix_len and self.prefix_group is None):
            raise ValueError(f"a prefix needs a group and at most the prompt's length: {self}")
        object.__setattr__(self, "priority", RequestClass(self.priority))


_ID_BASE, _ID_SPAN = 100, 10_000  # the ids that name a stream: clear of the simulator's filler and EOS


def prompt_token_ids(spec: TraceRequest, index: int, length: int, filler: int) -> list[int]:
    """The first `length` prompt tokens of `spec`, the `index`-th request of its trace: its group's
    stream for the first `spec.prefix_len`, then its own. A stream is two tokens that name it and
    filler after them, so two requests' tokens agree exactly as far as they share a stream (what a
    prefix cache hashes), at the cost of a list of filler."""
    def stream(name: int, offset: int, n: int) -> list[int]:
        head = [_ID_BASE + offset + name % _ID_SPAN, _ID_BASE + offset + name // _ID_SPAN % _ID_SPAN]
        return (head + [filler] * max(0, n - 2))[:n]

    shared = min(spec.prefix_len, length)
    group = stream(spec.prefix_group, 0, shared) if spec.prefix_group is not None and shared else []
    return group + stream(index, _ID_SPAN, length - shared)


def shared_system_prompt(arrivals: list[float], system_len: int, own: LengthDist, *, groups: int = 1,
                         seed: int = 0) -> list[TraceRequest]:
    """Chat traffic behind one system prompt (or `groups` of them, requests spread evenly): each
    request is a `system_len`-token system prompt followed by its own prompt and output drawn
    from `own`. Ours: a prefix-caching workload, not a paper's."""
    rng = random.Random(seed)
    pairs = own.sample(len(arrivals), seed)
    return [TraceRequest(t, system_len + p, o, prefix_group=rng.randrange(groups), prefix_len=system_len)
            for t, (p, o) in zip(arrivals, pairs)]


def multi_turn_chat(starts: list[float], turns: int, think_seconds: float, turn: LengthDist, *,
                    system_len: int = 0, seed: int = 0) -> list[TraceRequest]:
    """Conversations that resend their history: one per start time, `turns` turns each, turn k
    arriving `think_seconds` after turn k-1 (open loop: a fixed gap, not after the reply). A
    turn's prompt is the whole conversation so far (a `system_len` opening, the earlier messages
    and replies, lengths from `turn`) and its new message. The whole prompt is the
    conversation's stream (its group), and the simulator's replies are filler, as the stream is
    past its head: so each turn's prompt begins with the previous turn's prompt and reply, token
    for token, as a real client resends what the engine said. Ours: a prefix-caching workload."""
    trace = []
    for c, start in enumerate(starts):
        pairs = turn.sample(turns, seed * 1_000_003 + c)
        history = system_len
        for k, (message, reply) in enumerate(pairs):
            prompt = history + message
            trace.append(TraceRequest(start + k * think_seconds, prompt, reply, prefix_group=c, prefix_len=prompt))
            history = prompt + reply
    return sorted(trace, key=lambda r: r.arrival)


@dataclass(frozen=True)
class ClosedLoopBatches:
    """Requests submitted a batch at a time, each batch the moment the one before it has
    completed (BROS §7.1: BE requests "are periodically submitted in a batch manner when previous
    batched requests are completed"). The first batch arrives at `start`; none is submitted
    after `until`. The requests' own `arrival` fields are ignored: `simulate` stamps each with
    its batch's submission time."""

    batches: tuple[tuple[TraceRequest, ...], ...]
    start: float = 0.0
    until: float = math.inf

    def __post_init__(self) -> None:
        if not self.batches or any(not batch for batch in self.batches):
            raise ValueError("closed-loop batches need at least one request each")

    @property
    def num_requests(self) -> int:
        return sum(len(batch) for batch in self.batches)


# ----------------------------------------------------------------------------- arrivals
def _check(rate: float, n: int | None, duration: float | None) -> None:
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"rate must be positive and finite, got {rate}")
    if (n is None) == (duration is None):
        raise ValueError("give exactly one of n and duration")
    if (n is not None and n < 0) or (duration is not None and not 0 <= duration < math.inf):
        raise ValueError(f"need n >= 0 or a finite duration >= 0, got n={n}, duration={duration}")


def _renewal(gap: Callable[[], float], n: int | None, duration: float | None) -> list[float]:
    out: list[float] = []
    t = gap()
    while (len(out) < n) if n is not None else (t < duration):  # type: ignore[operator]
        out.append(t)
        t += gap()
    return out


def _modulated(rng: random.Random, segments: Iterator[tuple[float, float, float]],
               n: int | None, duration: float | None) -> list[float]:
    """A Poisson process whose rate is piecewise constant over `segments` (start, end, rate):
    unit-rate arrivals in cumulative-intensity space, mapped back through the intensity. Exact
    (no thinning), and zero-rate segments simply get no arrivals."""
    out: list[float] = []
    lam0, (start, end, rate) = 0.0, next(segments)  # lam0: cumulative intensity at `start`
    s = rng.expovariate(1.0)
    while n is None or len(out) < n:
        if rate > 0 and s <= lam0 + rate * (end - start):
            t = min(start + (s - lam0) / rate, end)  # min: rounding must not cross segments
            if duration is not None and t >= duration:
                break
            out.append(t)
            s += rng.expovariate(1.0)
        elif duration is not None and end >= duration:
            break
        else:
            lam0 += rate * (end - start)
            start, end, rate = next(segments)
    return out


def poisson_arrivals(rate: float, *, n: int | None = None, duration: float | None = None,
                     seed: int = 0) -> list[float]:
    _check(rate, n, duration)
    rng = random.Random(seed)
    return _renewal(lambda: rng.expovariate(rate), n, duration)


def gamma_arrivals(rate: float, cv: float, *, n: int | None = None,
                   duration: float | None = None, seed: int = 0) -> list[float]:
    """Gamma inter-arrivals with mean 1/rate and coefficient of variation `cv` (ConServe's load
    generator); cv = 1 is Poisson, larger cv is burstier."""
    _check(rate, n, duration)
    if not cv > 0:
        raise ValueError(f"cv must be positive, got {cv}")
    k = 1.0 / (cv * cv)
    rng = random.Random(seed)
    return _renewal(lambda: rng.gammavariate(k, 1.0 / (rate * k)), n, duration)


def on_off_arrivals(rate: float, on_seconds: float, off_seconds: float, *, n: int | None = None,
                    duration: float | None = None, seed: int = 0) -> list[float]:
    """Poisson at `rate` during ON phases, silence during OFF phases; the trace starts ON."""
    _check(rate, n, duration)
    if not on_seconds > 0 or not off_seconds >= 0:
        raise ValueError(f"need on_seconds > 0, off_seconds >= 0; got {on_seconds}, {off_seconds}")
    period = on_seconds + off_seconds
    # k * period, not a running sum, so that phase boundaries do not drift over long traces.
    segments = (seg for k in count() for seg in ((k * period, k * period + on_seconds, rate),
                                                  (k * period + on_seconds, (k + 1) * period, 0.0)))
    return _modulated(random.Random(seed), segments, n, duration)


@dataclass(frozen=True)
class BurstWindow:
    start: float
    end: float
    factor: float  # the rate multiplier inside [start, end)


def _burst_stream(seed: int, burst_every: float, burst_seconds: float,
                  factor: tuple[float, float]) -> Iterator[BurstWindow]:
    if not burst_every > 0 or not burst_seconds > 0 or not 0 < factor[0] <= factor[1]:
        raise ValueError(f"need burst_every > 0, burst_seconds > 0, 0 < factor[0] <= factor[1]; "
                         f"got {burst_every}, {burst_seconds}, {factor}")
    # Its own RNG, so the windows do not depend on how many arrivals were drawn (n vs duration).
    rng = random.Random(f"bursts:{seed}")
    t = 0.0
    while True:
        start = t + rng.expovariate(1.0 / burst_every)
        t = start + burst_seconds
        yield BurstWindow(start, t, rng.uniform(*factor))


def burst_windows(duration: float, *, seed: int = 0, burst_every: float = 60.0,
                  burst_seconds: float = 15.0,
                  factor: tuple[float, float] = (2.0, 3.0)) -> list[BurstWindow]:
    """The bursts that `bursty_arrivals` with the same seed and burst arguments uses, up to
    `duration` (the same windows whether that trace was cut by n or by duration)."""
    stream = _burst_stream(seed, burst_every, burst_seconds, factor)
    return list(takewhile(lambda w: w.start < duration, stream))


def bursty_arrivals(rate: float, *, n: int | None = None, duration: float | None = None,
                    seed: int = 0, burst_every: float = 60.0, burst_seconds: float = 15.0,
                    factor: tuple[float, float] = (2.0, 3.0)) -> list[float]:
    """BurstGPT-like: Poisson at `rate`, multiplied by U(factor) inside bursts of `burst_seconds`
    that start an Exp(mean `burst_every`) gap after the previous burst ends. KunServe sees the
    BurstGPT rate jump 2x with no clear pattern (§2.2); ConServe cites 3x within a minute (§2)."""
    _check(rate, n, duration)

    def segments() -> Iterator[tuple[float, float, float]]:
        prev = 0.0
        for w in _burst_stream(seed, burst_every, burst_seconds, factor):
            yield prev, w.start, rate
            yield w.start, w.end, rate * w.factor
            prev = w.end

    return _modulated(random.Random(seed), segments(), n, duration)


# ----------------------------------------------------------------------------- lengths
def _phi_interval(lo: float, hi: float) -> float:
    """P(lo < Z < hi) for a standard normal, via erfc on the side that keeps precision."""
    if lo > 0:  # both in the upper tail: difference of small upper-tail masses
        return 0.5 * (math.erfc(lo / math.sqrt(2)) - math.erfc(hi / math.sqrt(2)))
    return 0.5 * (math.erfc(-hi / math.sqrt(2)) - math.erfc(-lo / math.sqrt(2)))


def clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for X ~ LogNormal(mu, sigma), in closed form."""
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    below, above = _phi_interval(-math.inf, a), _phi_interval(b, math.inf)
    inside = math.exp(mu + sigma * sigma / 2) * _phi_interval(a - sigma, b - sigma)
    return lo * below + hi * above + inside


@cache
def solve_mu(target: float, sigma: float, lo: float, hi: float) -> float:
    """The mu whose lognormal, clipped to [lo, hi], has mean `target` (bisection: the clipped
    mean rises monotonically from lo to hi as mu grows). Cached: each distribution solves once."""
    if not lo < target < hi:
        raise ValueError(f"need lo < target < hi, got {lo}, {target}, {hi}")
    # 40 sigmas past either bound, the clipped mean is lo or hi to double precision.
    left, right = math.log(lo) - 40 * sigma, math.log(hi) + 40 * sigma
    for _ in range(200):
        mid = 0.5 * (left + right)
        below = clipped_lognormal_mean(mid, sigma, lo, hi) < target
        left, right = (mid, right) if below else (left, mid)
    return 0.5 * (left + right)


@dataclass(frozen=True)
class LengthDist:
    name: str  # e.g. "ShareGPT-like (EcoServe)"
    mean_prompt: float
    mean_output: float
    min_prompt: int = 1
    max_prompt: int = 32768
    min_output: int = 1
    max_output: int = 32768
    sigma: float = 1.0  # lognormal shape
    uniform: bool = False  # uniform integers in [min, max]; the means are then documentation

    def __post_init__(self) -> None:
        if not 0 < self.sigma <= 5:  # beyond 5 the closed form overflows and no dataset looks so
            raise ValueError(f"{self.name}: sigma must be in (0, 5], got {self.sigma}")
        for what, mean, lo, hi in (("prompt", self.mean_prompt, self.min_prompt, self.max_prompt),
                                   ("output", self.mean_output, self.min_output, self.max_output)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{self.name}: need 1 <= min_{what} <= max_{what}")
            if not self.uniform and not (lo < mean < hi or lo == mean == hi):
                raise ValueError(f"{self.name}: mean_{what} {mean} unreachable in [{lo}, {hi}]")

    @property
    def label(self) -> str:
        return f"{self.name} (synthetic)"

    def _sampler(self, rng: random.Random, mean: float, lo: int, hi: int) -> Callable[[], int]:
        if self.uniform:
            return lambda: rng.randint(lo, hi)
        if lo == hi:
            return lambda: lo
        mu = solve_mu(float(mean), self.sigma, float(lo), float(hi))
        # round() commutes with clipping to integer bounds and is mean-neutral for a smooth density.
        return lambda: min(max(round(rng.lognormvariate(mu, self.sigma)), lo), hi)

    def sample(self, n: int, seed: int = 0) -> list[tuple[int, int]]:
        """`n` (prompt_len, output_len) pairs, drawn independently: the papers give no joint law."""
        rng = random.Random(seed)
        prompt = self._sampler(rng, self.mean_prompt, self.min_prompt, self.max_prompt)
        output = self._sampler(rng, self.mean_output, self.min_output, self.max_output)
        return [(prompt(), output()) for _ in range(n)]


# EcoServe Table 2 (ecoserve.txt): ShareGPT averages 161.31 prompt (range 16-3.2K) / 337.99 output (19-991).
SHAREGPT_ECOSERVE = LengthDist("ShareGPT-like (EcoServe)", 161.31, 337.99,
                               min_prompt=16, max_prompt=3200, min_output=19, max_output=991)
# KunServe §5 (kunserve.txt): ShareGPT averages 1,660 in / 373 out, inputs capped at 4K.
SHAREGPT_KUNSERVE = LengthDist("ShareGPT-like (KunServe)", 1660, 373, max_prompt=4096)
# KunServe §5: BurstGPT's conversations average 642 in / 262 out.
BURSTGPT = LengthDist("BurstGPT-like (KunServe)", 642, 262)
# KunServe §5: LongBench summarization averages 5.9K in / 499 out; ConServe's offline workload.
LONGBENCH = LengthDist("LongBench-like (KunServe)", 5900, 499, max_prompt=32000)
# EcoServe Table 2: Alpaca 19.31 in (range 9-2.47K) / 58.41 out (range 13-292).
ALPACA = LengthDist("Alpaca-like (EcoServe)", 19.31, 58.41, min_prompt=9, max_prompt=2470,
                    min_output=13, max_output=292)
# EcoServe Table 2: BookCorpus 1952.11 in / 681.2 out (range 32-1041); EcoServe cuts prompts
# into 2048-token chunks, so 2048 is the prompt cap (most chunks are full ones).
BOOKCORPUS = LengthDist("BookCorpus-like (EcoServe)", 1952.11, 681.2, min_prompt=18,
                        max_prompt=2048, min_output=32, max_output=1041)
# BROS §7.1 (bros.txt): best-effort prompts U(512, 1024), outputs U(32, 128), following FlexGen.
BROS_BE = LengthDist("BROS best-effort", 768, 80, min_prompt=512, max_prompt=1024,
                     min_output=32, max_output=128, uniform=True)
# ConServe §6.3 (conserve.txt): its synthetic requests are all 1024 in / 128 out
# ("representative values for online loads"); nanoserve uses them for its offline load too.
CONSERVE = LengthDist("ConServe fixed 1024/128", 1024, 128, min_prompt=1024, max_prompt=1024,
                      min_output=128, max_output=128)

LENGTHS: dict[str, LengthDist] = {
    "sharegpt-ecoserve": SHAREGPT_ECOSERVE, "sharegpt-kunserve": SHAREGPT_KUNSERVE,
    "burstgpt": BURSTGPT, "longbench": LONGBENCH, "alpaca": ALPACA, "bookcorpus": BOOKCORPUS,
    "bros-be": BROS_BE, "conserve": CONSERVE,
}


# ----------------------------------------------------------------------------- traces
def make_trace(arrivals: list[float], lengths: LengthDist, *, seed: int = 0,
               priority: RequestClass | str = RequestClass.ONLINE) -> list[TraceRequest]:
    pairs = lengths.sample(len(arrivals), seed)
    # A class name is checked and coerced to the member by TraceRequest.__post_init__.
    return [TraceRequest(t, p, o, cast(RequestClass, priority)) for t, (p, o) in zip(arrivals, pairs)]


def merge_traces(*traces: list[TraceRequest]) -> list[TraceRequest]:
    """One trace, by arrival; ties keep argument order (sorted() is stable)."""
    return sorted((r for trace in traces for r in trace), key=lambda r: r.arrival)


_COLUMNS = ("timestamp", "prompt_len", "output_len", "priority")


def save_csv(trace: list[TraceRequest], path: str | os.PathLike[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_COLUMNS)
        # repr() is the shortest string that parses back to the same float: exact round trips.
        w.writerows((repr(r.arrival), r.prompt_len, r.output_len, r.priority) for r in trace)


def replay_csv(path: str | os.PathLike[str]) -> list[TraceRequest]:
    """A trace from a CSV with `timestamp,prompt_len,output_len[,priority]`, sorted by timestamp
    and shifted so that the first request arrives at 0."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _COLUMNS[:3] if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
        rows = []
        for line, row in enumerate(reader, start=2):
            try:
                t, p, o = float(row["timestamp"]), int(row["prompt_len"]), int(row["output_len"])
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{line}: bad value ({e})") from None
            prio = (row.get("priority") or RequestClass.ONLINE).strip()
            if p < 1 or o < 1 or not math.isfinite(t) or prio not in PRIORITIES:
                raise ValueError(f"{path}:{line}: need positive lengths, a finite timestamp and a "
                                 f"priority in {_NAMES}; got {t}, {p}, {o}, {prio!r}")
            rows.append((t, p, o, RequestClass(prio)))
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0] if rows else 0.0
    return [TraceRequest(t - t0, p, o, prio) for t, p, o, prio in rows]
