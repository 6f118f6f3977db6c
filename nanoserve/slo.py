"""Request classes, their latency targets, and per-class service metrics.

Every request is "online" (latency-critical: BROS's real-time, ConServe's online) or "offline"
(throughput work: BROS's best-effort, ConServe's offline, batch jobs): a `RequestClass`. Each
has a TTFT target (arrival to first token) and a TPOT target (mean gap between later tokens),
defaulted per class by `SchedulerConfig` and overridable per request. A request *attains* its SLO when
every target it has is met; an offline request has no targets by default, so it always does.

Defaults follow the papers: BROS evaluates RT requests at TTFT 0.4 s / TPOT 0.2 s (bros.txt
§7.1); ConServe holds online requests to a TPOT of 100 ms (conserve.txt §2). nanoserve's online
default is TTFT 1 s, TPOT 0.1 s: interactive, and reachable on a CPU with a small model.

`ClassMetrics` accumulates what finished requests of one class achieved: TTFT and TPOT samples
(a bounded window, for percentiles), SLO attainment, and output tokens for throughput (over the
span from the class's first arrival to its last finish).
"""
from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field


class RequestClass(enum.StrEnum):
    """A request's class, which policies and memory managers schedule by.

    ONLINE: latency-critical (BROS's real-time, ConServe's online); held to a TTFT and TPOT target.
    OFFLINE: throughput work (BROS's best-effort, ConServe's offline, batch jobs); no targets by default.

    A StrEnum: members equal and hash as their values ("online", "offline"), so lookups with
    strings, JSON, CSV and f-strings see the plain words. Code compares members by identity
    (`request.priority is RequestClass.OFFLINE`), which holds once a value is coerced with
    `RequestClass(value)`, as the dataclasses that store a class do.
    """

    ONLINE = "online"
    OFFLINE = "offline"

    @classmethod
    def _missing_(cls, value: object) -> RequestClass:
        # `RequestClass(value)` for a value that is no class: the message every boundary gives.
        raise ValueError(f"priority must be one of {', '.join(cls)}, got {value!r}")


PRIORITIES = tuple(RequestClass)  # every class, online first


@dataclass(frozen=True)
class SLO:
    """Latency targets. TTFT and TPOT are per token; the JCT target is per request and grows with
    its output, as EcoServe states it (ecoserve.txt §4, after its ref. [34]): "We then set the JCT
    SLO of a request to SLO-scale x (t_p + t_g x l_g), where l_g denotes its RL": here
    `jct_fixed` = SLO-scale x t_p and `jct_per_token` = SLO-scale x t_g (`jct_target`)."""

    ttft: float | None = None  # seconds; None: no target
    tpot: float | None = None
    jct_fixed: float | None = None  # seconds of end-to-end latency allowed whatever the output
    jct_per_token: float | None = None  # ...and per output token (both set, or neither)

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot", "jct_fixed", "jct_per_token"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"the {name} target must be a positive number of seconds, got {value!r}")
        if (self.jct_fixed is None) != (self.jct_per_token is None):
            raise ValueError("a JCT target needs both jct_fixed and jct_per_token")

    def jct_target(self, output_len: int) -> float | None:
        """Seconds from arrival to the last token allowed for `output_len` tokens (None: no target)."""
        if self.jct_fixed is None or self.jct_per_token is None:
            return None
        return self.jct_fixed + self.jct_per_token * output_len

    def attained(self, ttft: float | None, tpot: float | None, e2e: float | None = None,
                 output_len: int | None = None) -> bool:
        """Whether measured latencies meet every target this SLO sets (a missing measurement,
        e.g. the TPOT of a one-token answer, cannot miss)."""
        jct = None if output_len is None else self.jct_target(output_len)
        return ((self.ttft is None or ttft is None or ttft <= self.ttft)
                and (self.tpot is None or tpot is None or tpot <= self.tpot)
                and (jct is None or e2e is None or e2e <= jct))


DEFAULT_SLOS = {RequestClass.ONLINE: SLO(ttft=1.0, tpot=0.1), RequestClass.OFFLINE: SLO()}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class ClassMetrics:
    """What the finished requests of one class achieved. Windows keep the latest samples."""

    window: int = 10_000
    finished: int = 0
    attained: int = 0
    output_tokens: int = 0
    first_arrival: float | None = None
    last_finish: float | None = None
    ttfts: deque[float] = field(default_factory=deque)
    tpots: deque[float] = field(default_factory=deque)

    def observe(self, ttft: float | None, tpot: float | None, output_tokens: int, slo: SLO, arrival: float,
                now: float) -> None:
        self.finished += 1
        self.attained += slo.attained(ttft, tpot, now - arrival, output_tokens)
        self.output_tokens += output_tokens
        self.first_arrival = arrival if self.first_arrival is None else min(self.first_arrival, arrival)
        self.last_finish = now
        for samples, value in ((self.ttfts, ttft), (self.tpots, tpot)):
            if value is not None:
                samples.append(value)
                if len(samples) > self.window:
                    samples.popleft()

    def summary(self) -> dict[str, float | int | None]:
        span: float | None = None
        if self.finished:
            # Both are set by the first observe().
            assert self.last_finish is not None and self.first_arrival is not None
            span = self.last_finish - self.first_arrival
        ttfts, tpots = list(self.ttfts), list(self.tpots)
        return {
            "finished": self.finished,
            "slo_attainment": self.attained / self.finished if self.finished else None,
            "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "tpot_p50": percentile(tpots, 50), "tpot_p99": percentile(tpots, 99),
            "output_tokens": self.output_tokens,
            # Output tokens per second from the class's first arrival to its last finish.
            "throughput_tok_s": self.output_tokens / span if span else None,
        }
