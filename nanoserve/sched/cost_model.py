"""An iteration latency model: "what would this batch cost?", asked before the batch is built.

Prefill chunks follow KunServe §4.3, Eq. (1): a chunk of c new tokens over a prefix of p cached
tokens costs

    cost(p, c) = α·(p·c + (c² + c)/2) + β·c + γ
                    prefix-attn  self-attn   mlp  other

and a batch costs the sum of its chunks (Eq. 2–3). Token-count budgets miss the quadratic
self-attention and the prefix attention, which is why a later chunk of a prompt is slower than
an earlier one of the same size.

Decodes (one new token each) are memory-bound, not compute-bound, so, like BROS §4.1
("Inference cost modeling": fit prefill and decode separately), they get their own terms: δ per
token of context read and ε per decoding sequence. One constant per iteration (kernel launches,
sampling set-up, Python) closes the model:

    cost(batch) = Σ_prefill cost(p, c) + Σ_decode (δ·(p + 1) + ε) + ι

Every term is linear in the coefficients, so the model is `coefficients · features(batch)` and
is fitted by least squares on profiled batches (`nanoserve profile`, tools/profile.py). Coefficients are
kept non-negative, so that a prediction never drops when a chunk grows or gains prefix.

A profile is the forward pass alone, on a quiet machine, at its fastest (see profile.py). A
served step also schedules, samples and streams, and shares the machine, so it takes longer by
a factor that drifts. `Calibration` follows that factor from the steps the engine measures,
and the policies budget with the fitted model scaled by it.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from nanoserve.sched.output import SchedulerOutput

# A batch described abstractly: one (prefix_len, num_new_tokens) pair per chunk; a decode is a
# chunk of one new token. Schedulers can price a plan without reserving any KV for it.
Batch = Sequence[tuple[int, int]]

FEATURES = ("prefill_attn", "prefill_tokens", "prefill_chunks", "decode_context", "decode_seqs", "iteration")


def is_decode(prefix_len: int, num_new: int) -> bool:
    return num_new == 1


def chunk_features(prefix_len: int, num_new: int) -> list[float]:
    """One chunk's features, without the per-iteration constant."""
    p, c = prefix_len, num_new
    if c < 1 or p < 0:
        raise ValueError(f"a chunk needs num_new >= 1 and prefix_len >= 0, got ({p}, {c})")
    if is_decode(p, c):
        return [0.0, 0.0, 0.0, float(p + 1), 1.0, 0.0]  # context read = prefix + the new token
    return [p * c + (c * c + c) / 2, float(c), 1.0, 0.0, 0.0, 0.0]


def features(batch: Batch) -> list[float]:
    """The batch's feature vector, in `FEATURES` order: Σ of its chunks' features plus 1 for the
    iteration constant (an empty batch costs nothing: no forward pass runs)."""
    total = [0.0] * len(FEATURES)
    for prefix_len, num_new in batch:
        total = [a + b for a, b in zip(total, chunk_features(prefix_len, num_new))]
    total[-1] = 1.0 if batch else 0.0
    return total


def batch_of(output: SchedulerOutput) -> list[tuple[int, int]]:
    """A scheduled batch as (prefix_len, num_new) pairs: a chunk's start is its cached prefix."""
    return [(c.start, c.num_tokens) for c in output.chunks]


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of each feature (see the module docstring for the equation)."""

    prefill_attn: float = 0.0  # α: per query-key pair of prefill attention (prefix + causal self)
    prefill_tokens: float = 0.0  # β: per prefill token (linear layers, MLP, norms)
    prefill_chunks: float = 0.0  # γ: per prefill chunk (its per-sequence overheads)
    decode_context: float = 0.0  # δ: per context token a decode reads
    decode_seqs: float = 0.0  # ε: per decoding sequence (its token's linear layers, sampling)
    iteration: float = 0.0  # ι: per forward pass

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"coefficient {f.name} must be finite and >= 0, got {value}")

    @property
    def coefficients(self) -> list[float]:
        return [getattr(self, name) for name in FEATURES]

    # Schedulers price a chunk for every request they consider, thousands per step, so the two
    # predictions below are `coefficients · features` written out as scalar arithmetic.
    def chunk_cost(self, prefix_len: int, num_new: int) -> float:
        """Eq. (1) for a prefill chunk (or the decode terms for a decode); no iteration constant."""
        p, c = prefix_len, num_new
        if c < 1 or p < 0:
            chunk_features(p, c)  # raises the ValueError
        if c == 1:
            return self.decode_context * (p + 1) + self.decode_seqs
        return self.prefill_attn * (p * c + (c * c + c) / 2) + self.prefill_tokens * c + self.prefill_chunks

    def predict(self, batch: Batch) -> float:
        """Predicted seconds for one iteration running `batch` (Eq. 3 plus the constant)."""
        if not batch:
            return 0.0
        return sum(self.chunk_cost(p, c) for p, c in batch) + self.iteration

    def predict_output(self, output: SchedulerOutput) -> float:
        """Predicted seconds for a scheduled step (its KV copies are not modelled)."""
        return self.predict(batch_of(output))

    def scaled(self, factor: float) -> CostModel:
        """Every coefficient times `factor` (the model is linear: every prediction scales)."""
        return CostModel(**{name: getattr(self, name) * factor for name in FEATURES})

    # -- persistence ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> CostModel:
        return cls(**{name: float(data[name]) for name in FEATURES})

    def save(self, path: str | Path, **extra: Any) -> None:
        """JSON: {"coefficients": {...}, **extra} (the profiler adds the fit report and samples)."""
        Path(path).write_text(json.dumps({"coefficients": self.to_dict(), **extra}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text())["coefficients"])


@dataclass(frozen=True)
class Sample:
    """One timed iteration: the batch it ran and its wall-clock seconds."""

    batch: tuple[tuple[int, int], ...]
    seconds: float

    def to_dict(self) -> dict:
        return {"batch": [list(c) for c in self.batch], "seconds": self.seconds}

    @classmethod
    def from_dict(cls, data: dict) -> Sample:
        return cls(tuple((int(p), int(c)) for p, c in data["batch"]), float(data["seconds"]))


@dataclass(frozen=True)
class FitReport:
    num_samples: int
    mean_rel_error: float  # mean of |predicted - measured| / measured
    max_rel_error: float
    r2: float  # coefficient of determination on the samples (1 is a perfect fit)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (f"{self.num_samples} samples: mean relative error {self.mean_rel_error:.1%}, "
                f"max {self.max_rel_error:.1%}, R² {self.r2:.4f}")


def evaluate(model: CostModel, samples: Sequence[Sample]) -> FitReport:
    """How well `model` predicts `samples`."""
    if not samples:
        raise ValueError("no samples to evaluate")
    measured = [s.seconds for s in samples]
    predicted = [model.predict(s.batch) for s in samples]
    rel = [abs(p - m) / m for p, m in zip(predicted, measured)]
    mean = sum(measured) / len(measured)
    ss_res = sum((p - m) ** 2 for p, m in zip(predicted, measured))
    ss_tot = sum((m - mean) ** 2 for m in measured)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return FitReport(len(samples), sum(rel) / len(rel), max(rel), r2)


def fit(samples: Iterable[Sample], relative: bool = True) -> CostModel:
    """Least-squares coefficients for `samples`, all >= 0.

    With `relative` (the default) each row is weighted by 1 / measured seconds, so the fit
    minimises relative error: otherwise the few largest batches would dominate and the small
    ones, where the constants live, would be predicted badly. Non-negativity is an active-set
    loop (NNLS-lite): solve, fix the most negative coefficient at zero, solve the rest again.
    Features a sample set never exercises (all zero) get zero.
    """
    samples = list(samples)
    if not samples:
        raise ValueError("no samples to fit")
    if any(not s.seconds > 0 for s in samples):
        raise ValueError("every sample needs a positive duration")
    x = torch.tensor([features(s.batch) for s in samples], dtype=torch.float64)
    y = torch.tensor([s.seconds for s in samples], dtype=torch.float64)
    if relative:
        x, y = x / y[:, None], torch.ones_like(y)
    # Features span ~10 orders of magnitude (attention pairs vs. a constant 1): scale columns
    # to unit norm so the solve is well conditioned, and unscale the solution.
    scale = x.norm(dim=0)
    active = [j for j in range(len(FEATURES)) if scale[j] > 0]
    solution = torch.zeros(len(FEATURES), dtype=torch.float64)
    while active:
        cols = torch.tensor(active)
        a = x[:, cols] / scale[cols]
        w = torch.linalg.lstsq(a, y[:, None], driver="gelsd").solution[:, 0] / scale[cols]
        if (w >= 0).all():
            solution[cols] = w
            break
        active.pop(int(torch.argmin(w)))
    return CostModel(**{name: float(v) for name, v in zip(FEATURES, solution)})


# SmolLM2-135M in fp32 on a 2-core CPU (`nanoserve profile --quick`, 2026-11-22:
# mean relative error 2.2%). Policies use it until a profile of the served model is given
# (`EngineArgs.cost_model`); its shape, not its scale, is what the default gets right elsewhere.
DEFAULT_COST_MODEL = CostModel(prefill_attn=4.5e-7, prefill_tokens=1.3e-3, prefill_chunks=3.8e-3,
                               decode_context=5.0e-6, decode_seqs=1.8e-3, iteration=4.1e-2)


class Calibration:
    """The measured-over-predicted step time, as a moving average, and the model scaled by it.

    Each step's ratio enters an exponential moving average (`weight` per step), clamped to
    [`low`, `high`] so that one stalled step (a page fault, a neighbour's burst) or one empty
    one cannot swing the policies' budgets far."""

    def __init__(self, fitted: CostModel, weight: float = 0.1, low: float = 0.25, high: float = 4.0):
        self.fitted, self.weight, self.low, self.high = fitted, weight, low, high
        self.factor = 1.0
        self.model = fitted

    def observe(self, batch: Batch, measured: float) -> CostModel:
        """Fold in one step that ran `batch` in `measured` seconds; returns the model scaled by
        the new factor. The ratio is against the *fitted* model's prediction, so the factor
        converges to measured / fitted, whatever it was before."""
        return self.observe_scaled(self.model.predict(batch), measured)

    def observe_scaled(self, predicted: float, measured: float) -> CostModel:
        """`observe`, given the step's prediction by the current (scaled) model, as the engine
        already has it: the model is linear, so the fitted prediction is that over the factor."""
        predicted /= self.factor
        if predicted > 0 and measured > 0:
            ratio = min(self.high, max(self.low, measured / predicted))
            self.factor += self.weight * (ratio - self.factor)
            self.model = self.fitted.scaled(self.factor)
        return self.model
