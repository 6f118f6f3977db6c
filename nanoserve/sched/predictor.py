"""Response-length (RL) predictors for EcoServe's exact allocation (ecoserve.txt §2.3, §3.2).

EcoServe reserves KV for a request's prompt plus its *predicted* RL, padded by a ratio (§2.3:
10-20% was the sweet spot), and handles what padding misses with a reserved pool and
offload-free preemption (§3.2.2). The paper predicts with a fine-tuned OPT-13B on a separate
server, retrained continually as requests finish (§3.2.1, [23]). This module gives the
interface and two predictors that need no model:

    OraclePredictor          the true lengths, from a trace: an upper bound for simulations
    BucketQuantilePredictor  online: a quantile of recent output lengths of requests with a
                             similar prompt length (log2 buckets), learned from finished ones

Plugging in: a predictor is a function of the request, which is what `exact_kv`'s
`predicted_len` option takes:

    predictor = BucketQuantilePredictor(BucketQuantileConfig(quantile=0.75))
    kv = make_kv_manager("exact", KVBuildContext(..., options={"predicted_len": predictor}))
    ...
    predictor.observe(request)  # when a request finishes: the online predictors learn here

`ExactKV` asks once per request, at its first admission check, and caches the answer; after a
preemption it uses L_new = predicted - generated (§3.2.2) instead of asking again. Padding is
the allocator's job (`padding_ratio`), not the predictor's: predictors return the raw RL.

A model-based predictor (e.g. a small classifier over the prompt's tokens into RL bins, as in
[23]) implements the same protocol:

    class BinClassifierPredictor(LengthPredictor):
        def __init__(self, model, bin_lengths): self.model, self.bins = model, bin_lengths
        def predict(self, request):
            logits = self.model(torch.tensor(request.prompt_token_ids)[None])
            return clamp(self.bins[int(logits.argmax())], request)
        def observe(self, request, true_output_len=None):
            ...  # queue (prompt, length) for retraining, as EcoServe's predictor does

`predict` runs inside the scheduler's admission check, so a slow model should run ahead (the
paper overlaps it with queueing and prefill, §3.2.1) and answer from a cache keyed by
request_id; `OraclePredictor` over that cache is exactly such a lookup.

Accuracy (`PredictorAccuracy`) follows §2.3, which reports the share of requests predicted
"accurately" at each padding ratio without spelling the rule out; we count a prediction p as
accurate when the true length t lies within ±padding of it: |t - p| <= ceil(p * padding), the
padding rounded up to whole tokens as `ExactAllocator.reservation_tokens` reserves it.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Mapping

if TYPE_CHECKING:
    from nanoserve.request import Request


def clamp(length: float, request: Request) -> int:
    """A prediction the allocator can use: a whole number of tokens, at least 1 (a request
    being admitted will generate at least one token) and at most `max_tokens` (the engine
    stops it there, so reserving more is pure waste)."""
    return max(1, min(int(length), request.params.max_tokens))


class LengthPredictor(ABC):
    """Predicts a request's output length from what is known at admission.

    An instance is callable (`predictor(request) == predictor.predict(request)`), so it can be
    passed straight as exact_kv's `predicted_len` option. Subclasses should not define
    `__len__` or `__bool__`: ExactKV reads the option as `predicted_len or max_tokens`, and a
    falsy predictor would be silently skipped."""

    @abstractmethod
    def predict(self, request: Request) -> int:
        """The predicted number of output tokens: 1 <= n <= request.params.max_tokens."""

    def observe(self, request: Request, true_output_len: int | None = None) -> None:
        """Learn from a finished request (default: its `num_output_tokens`). Stateless
        predictors ignore it; online ones update here."""

    def __call__(self, request: Request) -> int:
        return self.predict(request)


class OraclePredictor(LengthPredictor):
    """The true output lengths, for trace replay and simulation: what a perfect predictor
    would give, i.e. the best case for exact allocation. Unknown ids get `max_tokens` (the
    allocator's own no-prediction default)."""

    def __init__(self, lengths: Mapping[Hashable, int]):
        self.lengths = lengths  # not copied: a trace loader may keep filling it

    def predict(self, request: Request) -> int:
        return clamp(self.lengths.get(request.request_id, request.params.max_tokens), request)


@dataclass(frozen=True)
class BucketQuantileConfig:
    quantile: float = 0.5     # p50 balances over/under; p75+ trades KV waste for fewer overruns
    window: int = 256         # recent lengths kept per prompt-length bucket
    global_window: int = 1024  # recent lengths over all buckets: the fallback
    min_samples: int = 8      # fewer than this and a quantile is mostly noise
    default: int | None = None  # with no usable history; None: the request's max_tokens

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if self.window < 1 or self.global_window < 1 or self.min_samples < 1:
            raise ValueError("window, global_window and min_samples must be >= 1")
        if self.default is not None and self.default < 1:
            raise ValueError(f"default must be >= 1 or None, got {self.default}")


def prompt_bucket(num_prompt_tokens: int) -> int:
    """log2 bucket: 1 -> 1, 2-3 -> 2, 4-7 -> 3, ... Prompt lengths spread over orders of
    magnitude, and RL tracks the prompt's kind (a chat turn, a document to summarize) more
    than its exact length, so doubling-sized buckets share history where it is sparse."""
    return max(1, num_prompt_tokens).bit_length()


def quantile(values: list[int] | deque[int], q: float) -> int:
    """Nearest-rank quantile: the smallest observed value with at least a share q of the
    values at or below it. An observed length, never an interpolated one."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class BucketQuantilePredictor(LengthPredictor):
    """Predicts the configured quantile of the recent output lengths of finished requests
    whose prompt fell in the same log2 bucket; with too little history there, the quantile of
    the global window; with too little of that, `config.default` (else max_tokens, which is
    what exact allocation reserves without a predictor: safe, if wasteful).

    Memory is bounded: at most `window` lengths per bucket (buckets are log2 of the prompt
    length, so a few dozen at most) plus `global_window`. Bounded windows also let the
    predictor follow a workload that drifts, as EcoServe's continual retraining does."""

    def __init__(self, config: BucketQuantileConfig = BucketQuantileConfig()):
        self.config = config
        self.buckets: dict[int, deque[int]] = {}
        self.recent: deque[int] = deque(maxlen=config.global_window)

    def predict(self, request: Request) -> int:
        cfg = self.config
        history = self.buckets.get(prompt_bucket(request.num_prompt_tokens), ())
        if len(history) < cfg.min_samples:
            history = self.recent
        if len(history) >= cfg.min_samples:
            return clamp(quantile(history, cfg.quantile), request)
        return clamp(cfg.default or request.params.max_tokens, request)

    def observe(self, request: Request, true_output_len: int | None = None) -> None:
        if true_output_len is None:
            # An aborted request's length says when the client left, not what it would need.
            if request.finish_reason == "abort":
                return
            true_output_len = request.num_output_tokens
        if true_output_len < 0:
            raise ValueError(f"output length must be >= 0, got {true_output_len}")
        # A request stopped by max_tokens only gives a lower bound on its length; it is kept,
        # since it is still the KV that request used.
        bucket = prompt_bucket(request.num_prompt_tokens)
        self.buckets.setdefault(bucket, deque(maxlen=self.config.window)).append(true_output_len)
        self.recent.append(true_output_len)

    @property
    def num_stored(self) -> int:
        """Lengths held in memory, all windows together (bounded; see the class docstring)."""
        return len(self.recent) + sum(len(window) for window in self.buckets.values())


@dataclass
class PredictorAccuracy:
    """EcoServe's predictor accuracy (§2.3) and two companions, from (predicted, true) pairs.

        accuracy         share with |true - predicted| <= ceil(predicted * padding): the true
                         length lies within ±padding of the prediction (see the module
                         docstring for why this reading of §2.3)
        under_predicted  share with true > predicted + ceil(predicted * padding): requests that
                         outgrow their padded reservation and need the reserved pool or a
                         preemption (§3.2.2; Fig. 4c's under-provisioned requests)
        mean_abs_error   mean |true - predicted|, in tokens, of the unpadded prediction
    """

    padding: float = 0.0
    count: int = 0
    _within: int = field(default=0, repr=False)
    _under: int = field(default=0, repr=False)
    _abs_error: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.padding < 0:
            raise ValueError(f"padding must be >= 0, got {self.padding}")

    def record(self, predicted: int, true: int) -> None:
        # The same rounding as ExactAllocator.reservation_tokens; the epsilon keeps float
        # noise (20 * 0.1 = 2.0000000000000004) from widening the band by a token.
        pad = math.ceil(predicted * self.padding - 1e-9)
        error = true - predicted
        self.count += 1
        self._within += abs(error) <= pad
        self._under += error > pad
        self._abs_error += abs(error)

    @property
    def accuracy(self) -> float:
        return self._within / self.count if self.count else 0.0

    @property
    def under_predicted(self) -> float:
        return self._under / self.count if self.count else 0.0

    @property
    def mean_abs_error(self) -> float:
        return self._abs_error / self.count if self.count else 0.0

    def summary(self) -> dict[str, float]:
        return {"count": self.count, "accuracy": self.accuracy,
                "under_predicted": self.under_predicted, "mean_abs_error": self.mean_abs_error}
