"""Response-length (RL) predictors for EcoServe's exact allocation (ecoserve.txt §2.3, §3.2).

EcoServe reserves KV for a request's prompt plus its *predicted* RL, padded by a ratio (§2.3:
10-20% was the sweet spot), and handles what padding misses with a reserved pool and
offload-free preemption (§3.2.2). The paper predicts with a fine-tuned OPT-13B on a separate
server, retrained continually as requests finish (§3.2.1, [23]). This module gives the
interface and two predictors that need no model:

    OraclePredictor          the true lengths, from a trace: an upper bound for simulations
    NoisyOraclePredictor     the true lengths with the paper's predictor's error: within ±padding
                             for a set share of requests (§2.3: 73.2% on ShareGPT), under or over
                             it for the rest; the stand-in for the fine-tuned OPT-13B in simulations
    BucketQuantilePredictor  online: a quantile of recent output lengths of requests with a
                             similar prompt length (log2 buckets), learned from finished ones and,
                             optionally, warm-started from a held-out slice (`warm`), as the paper
                             fine-tunes on 10k held-out requests before serving

Plugging in: a predictor is a function of the request, which is what `exact_kv`'s
`predicted_len` option takes:

    predictor = BucketQuantilePredictor(BucketQuantileConfig(quantile=0.75))
    kv = make_kv_manager("exact", KVBuildContext(..., options={"predicted_len": predictor}))
    ...
    predictor.observe(request)  # when a request finishes: the online predictors learn here

`ExactKV` asks once per request, at its first admission check, and caches the answer; after a
preemption it uses L_new = predicted - generated (§3.2.2) instead of asking again, unless that is
<= 0 (the request outran its prediction): then it asks `predict_remaining`, the length still to
come given what was generated. Padding is
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
import random
import zlib
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
    passed straight as exact_kv's `predicted_len` option; a number or a plain function given
    there is wrapped into one (`as_length_predictor`), so `ExactKV` asks every predictor the
    same three things."""

    @abstractmethod
    def predict(self, request: Request) -> int:
        """The predicted number of output tokens: 1 <= n <= request.params.max_tokens."""

    def observe(self, request: Request, true_output_len: int | None = None) -> None:
        """Learn from a finished request (default: its `num_output_tokens`). Stateless
        predictors ignore it; online ones update here."""

    def predict_remaining(self, request: Request) -> int:
        """Tokens still to come for a request that already generated `num_output_tokens` and
        outran its prediction (§3.2.2's L_new = predicted - generated is then <= 0, see
        `ExactKV.preempt`). Default: the prediction's excess if any, else all `max_tokens` allows
        (what exact allocation reserves without a predictor)."""
        generated, left = request.num_output_tokens, request.output_tokens_left
        predicted = self.predict(request)
        return min(left, predicted - generated) if predicted > generated else left

    def __call__(self, request: Request) -> int:
        return self.predict(request)


class OraclePredictor(LengthPredictor):
    """The true output lengths, for trace replay and simulation: what a perfect predictor
    would give, i.e. the best case for exact allocation. Unknown ids get `max_tokens` (the
    allocator's own no-prediction default)."""

    def __init__(self, lengths: Mapping[Hashable, int]):
        self.lengths = lengths  # not copied: a trace loader may keep filling it

    def __repr__(self) -> str:  # what a run's saved config names (no object address: reproducible)
        return f"OraclePredictor({len(self.lengths)} lengths)"

    def predict(self, request: Request) -> int:
        return clamp(self.lengths.get(request.request_id, request.params.max_tokens), request)

    def predict_remaining(self, request: Request) -> int:
        return max(1, self.predict(request) - request.num_output_tokens)


@dataclass(frozen=True)
class PredictionError:
    """How wrong a `NoisyOraclePredictor` is, against the band ±`padding` around its prediction
    that `PredictorAccuracy` counts as accurate.

    The paper (§2.3): "sweetspot padding ratios for Alpaca, ShareGPT and BookCorpus are 10%, 15%
    and 20%, which lead to 77.5%, 73.2%, and 69.8% prediction accuracy". It does not give how the
    misses split between under- and over-prediction, nor how far they miss.
    assumption: `under_share` of the misses are under-predictions (default half), and a miss
    lands uniformly up to `reach` (default 50%) of the true length beyond the band's edge."""

    accuracy: float = 0.732  # ShareGPT at 15% padding (§2.3)
    padding: float = 0.15
    under_share: float = 0.5
    reach: float = 0.5

    def __post_init__(self) -> None:
        for name in ("accuracy", "under_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 <= self.padding < 1 or self.reach <= 0:
            raise ValueError("padding must be in [0, 1) and reach > 0")


# The paper's accuracy at its sweet-spot padding per dataset (§2.3).
PAPER_PREDICTION_ERROR = {"alpaca": PredictionError(0.775, 0.10), "sharegpt": PredictionError(0.732, 0.15),
                          "bookcorpus": PredictionError(0.698, 0.20)}


class NoisyOraclePredictor(LengthPredictor):
    """The true lengths, wrong the way a real predictor is: for a share `error.accuracy` of
    requests the true length t lies within ±padding of the prediction p (|t - p| <=
    ceil(p * padding), `PredictorAccuracy`'s rule); of the rest, `under_share` are
    under-predicted (t beyond p's padded band: they outgrow their reservation) and the others
    over-predicted. Each request's draw depends only on (seed, request id), so a run replays
    exactly and every policy sees the same predictions."""

    def __init__(self, lengths: Mapping[Hashable, int], error: PredictionError = PredictionError(), seed: int = 0):
        self.lengths, self.error, self.seed = lengths, error, seed

    def __repr__(self) -> str:
        return f"NoisyOraclePredictor({len(self.lengths)} lengths, {self.error}, seed={self.seed})"

    def predict(self, request: Request) -> int:
        true = self.lengths.get(request.request_id)
        if true is None:
            return clamp(request.params.max_tokens, request)
        rng = random.Random(zlib.crc32(f"{self.seed}:{request.request_id}".encode()))
        return clamp(self.noisy(max(1, true), rng), request)

    def predict_remaining(self, request: Request) -> int:
        """The rest of the true length, with the same error (a fresh draw for each point)."""
        true, generated = self.lengths.get(request.request_id), request.num_output_tokens
        if true is None:
            return super().predict_remaining(request)
        rng = random.Random(zlib.crc32(f"{self.seed}:{request.request_id}:{generated}".encode()))
        return max(1, min(request.output_tokens_left, self.noisy(max(1, true - generated), rng)))

    def noisy(self, true: int, rng: random.Random) -> int:
        """A prediction for true length `true`, in the class (accurate, under, over) drawn.
        The band is `PredictorAccuracy`'s, padding rounded up to whole tokens; a length too
        short to be missed below (1 or 2 tokens) is predicted accurately instead."""
        err = self.error

        def pad(p: int) -> int:
            return math.ceil(p * err.padding - 1e-9)

        lo = hi = true  # the accurate predictions: [lo, hi]
        while lo > 1 and true - (lo - 1) <= pad(lo - 1):
            lo -= 1
        while (hi + 1) - true <= pad(hi + 1):
            hi += 1
        draw = rng.random()
        beyond = 1 + rng.uniform(0, err.reach)
        if draw >= err.accuracy and lo > 1:
            if (draw - err.accuracy) / (1 - err.accuracy) < err.under_share:
                return max(1, min(lo - 1, math.floor(true / ((1 + err.padding) * beyond))))
            return max(hi + 1, math.ceil(true * beyond / (1 - err.padding)))
        return rng.randint(lo, hi)


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


def quantile(values: Sequence[int], q: float) -> int:
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

    def __repr__(self) -> str:
        return f"BucketQuantilePredictor({self.config})"

    def predict(self, request: Request) -> int:
        cfg = self.config
        history = self.buckets.get(prompt_bucket(request.num_prompt_tokens), ())
        if len(history) < cfg.min_samples:
            history = self.recent
        if len(history) >= cfg.min_samples:
            return clamp(quantile(history, cfg.quantile), request)
        return clamp(cfg.default or request.params.max_tokens, request)

    def predict_remaining(self, request: Request) -> int:
        """The configured quantile of the recent lengths beyond what the request already
        generated (its bucket's, else the global window's), minus that: the conditional
        remaining length. With no such history, the default rule (max_tokens)."""
        cfg, generated = self.config, request.num_output_tokens
        for history in (self.buckets.get(prompt_bucket(request.num_prompt_tokens), ()), self.recent):
            longer = [n for n in history if n > generated]
            if len(longer) >= cfg.min_samples:
                return max(1, min(request.output_tokens_left, quantile(longer, cfg.quantile) - generated))
        return super().predict_remaining(request)

    def observe(self, request: Request, true_output_len: int | None = None) -> None:
        if true_output_len is None:
            # An aborted request's length says when the client left, not what it would need.
            if request.finish_reason == "abort":
                return
            true_output_len = request.num_output_tokens
        # A request stopped by max_tokens only gives a lower bound on its length; it is kept,
        # since it is still the KV that request used.
        self.observe_lengths(request.num_prompt_tokens, true_output_len)

    def observe_lengths(self, num_prompt_tokens: int, output_len: int) -> None:
        """Learn one (prompt length, output length) pair."""
        if output_len < 0:
            raise ValueError(f"output length must be >= 0, got {output_len}")
        bucket = prompt_bucket(num_prompt_tokens)
        self.buckets.setdefault(bucket, deque(maxlen=self.config.window)).append(output_len)
        self.recent.append(output_len)

    def warm(self, pairs: Iterable[tuple[int, int]]) -> BucketQuantilePredictor:
        """Learn (prompt length, output length) pairs from a held-out slice before serving, as
        EcoServe's predictor is fine-tuned on 10k requests of the trace it then serves (§2.3);
        returns self. Only the windows' most recent pairs are kept."""
        for prompt_len, output_len in pairs:
            self.observe_lengths(prompt_len, output_len)
        return self

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


class MaxTokensPredictor(LengthPredictor):
    """No prediction: every request may generate all its `max_tokens` (what exact allocation
    reserves without a predictor, as ORCA does)."""

    def predict(self, request: Request) -> int:
        return request.params.max_tokens

    def predict_remaining(self, request: Request) -> int:
        return request.output_tokens_left


class FixedLengthPredictor(LengthPredictor):
    """One RL for every request (exact_kv's `predicted_len` given as a number)."""

    def __init__(self, length: int):
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"predicted_len must be a positive integer or a function of the request, "
                             f"got {length!r}")
        self.length = length

    def predict(self, request: Request) -> int:
        return self.length

    def predict_remaining(self, request: Request) -> int:
        return request.output_tokens_left  # a fixed guess knows nothing of what was generated


class FunctionPredictor(LengthPredictor):
    """A plain function of the request (a trace's lookup): it predicts, it does not re-predict
    or learn."""

    def __init__(self, predict: Callable[[Request], int]):
        self.function = predict

    def predict(self, request: Request) -> int:
        return self.function(request)

    def predict_remaining(self, request: Request) -> int:
        return request.output_tokens_left


def as_length_predictor(predicted_len: LengthPredictor | Callable[[Request], int] | int | None) -> LengthPredictor:
    """exact_kv's `predicted_len` option as a `LengthPredictor`: a predictor as it is, a number
    for every request, a function of the request, or None (each request's `max_tokens`)."""
    if isinstance(predicted_len, LengthPredictor):
        return predicted_len
    if predicted_len is None:
        return MaxTokensPredictor()
    if callable(predicted_len):
        return FunctionPredictor(predicted_len)
    return FixedLengthPredictor(predicted_len)
