"""Which regime KunServe's numbers put a GPU in, on our roofline: arithmetic, no simulation.

KunServe's gain needs bursts that throttle KV while compute keeps up (kunserve.txt §2.2, Fig. 12:
TTFT rises with KV demand). Whether a workload can do that on a simulated GPU follows from a few
means, before any policy runs. Two calculations, both ours:

- `steady_state`: the rate at which one GPU holds a given share of its KV on average, and what
  that rate costs in compute. N = share x KV / (p + o/2) requests are resident (a request holds
  its prompt and, averaged over its decode, half its output). The GPU decodes all N together,
  one roofline step of N at context p + o/2, in the time prefills leave it, so

        TPOT = step / (1 - rate x prefill)      stay = o x TPOT      N = rate x stay (Little)
        =>  rate = N / (o x step + N x prefill)

  A GPU holding N requests is never idle, so the question is not utilization but what is left:
  `prefill_share` = rate x prefill is the compute the arrivals' prefills take. A burst of factor
  f needs f x prefill_share for prefills alone: over 1, compute falls behind, whatever the KV.
  Assumptions (ours): mean lengths stand for the distribution, the prefill runs whole at the
  mean prompt, a request waits for nothing but compute.

- `paper_point`: the rate §2.2's own numbers imply for BurstGPT: the KV "provisioned ... 2.1x
  higher than the average requirement" holds (KV / 2.1) tokens on average, and "the average stay
  time for a request is 11 seconds", so by Little's law rate = (KV / 2.1) / (11 s x (p + o/2)).
  Its prefill share says whether our GPU could serve that rate at all.

`python -m experiments.kunserve` prints both for the paper's three datasets (`regime_report`).
"""
from __future__ import annotations

from typing import NamedTuple

from nanoserve.sim.roofline import Roofline
from nanoserve.sim.workloads import LengthDist

# kunserve.txt §2.2, Qwen-2.5-14B on BurstGPT (cluster A, one A800 80 GB per instance).
PAPER_KIB_PER_TOKEN = 192  # "each token consumes 192 KB memory"
PAPER_BURST_TOKENS = 243_000  # "a typical burst introduces an accumulation of 243 K tokens per GPU"
PAPER_BURST_GB = 45  # "... consuming 45 GB KVCache memory per GPU"
PAPER_PROVISIONING = 2.1  # "HBM provisioned for KVCache is 2.1x higher than the average requirement"
PAPER_STAY_S = 11.0  # "For BurstGPT dataset, the average stay time for a request is 11 seconds"
PAPER_BURST_FACTOR = 2.0  # Fig. 2(a): "the incoming request rate increases by 2x at time 45s"


class SteadyState(NamedTuple):
    kv_share: float  # of one GPU's KV held on average
    resident: float  # requests holding it
    decode_step_s: float  # one decode step of all of them
    rate: float  # req/s per GPU
    prefill_share: float  # of the GPU's time, the arrivals' prefills
    tpot_s: float
    stay_s: float


class PaperPoint(NamedTuple):
    kv_tokens: int  # one GPU's KV on our roofline
    burst_share: float  # §2.2's burst accumulation over that KV
    burst_gb: float  # the accumulation at our bytes per token (the paper: 45 GB)
    held_tokens: float  # KV / 2.1, held on average
    rate: float  # req/s per GPU, by Little's law with §2.2's stay
    prefill_share: float  # its prefills' share of our GPU


def _request_tokens(lengths: LengthDist) -> float:
    return lengths.mean_prompt + lengths.mean_output / 2


def prefill_seconds(roofline: Roofline, lengths: LengthDist) -> float:
    return roofline.iteration_seconds([(0, round(lengths.mean_prompt))])


def steady_state(roofline: Roofline, kv_tokens: int, lengths: LengthDist, kv_share: float) -> SteadyState:
    """The rate at which one GPU holds `kv_share` of its `kv_tokens` on average (module docstring)."""
    if not 0 < kv_share <= 1:
        raise ValueError(f"kv_share must be in (0, 1], got {kv_share}")
    resident = kv_share * kv_tokens / _request_tokens(lengths)
    step = roofline.iteration_seconds([(round(_request_tokens(lengths)), 1)] * max(1, round(resident)))
    prefill = prefill_seconds(roofline, lengths)
    rate = resident / (lengths.mean_output * step + resident * prefill)
    tpot = step / (1 - rate * prefill)
    return SteadyState(kv_share, resident, step, rate, rate * prefill, tpot, lengths.mean_output * tpot)


def paper_point(roofline: Roofline, kv_tokens: int, lengths: LengthDist) -> PaperPoint:
    """§2.2's numbers on our GPU (module docstring); `lengths` should be BurstGPT's, the trace
    §2.2 measured."""
    held = kv_tokens / PAPER_PROVISIONING
    rate = held / (PAPER_STAY_S * _request_tokens(lengths))
    return PaperPoint(kv_tokens, PAPER_BURST_TOKENS / kv_tokens,
                      PAPER_BURST_TOKENS * roofline.cost.kv_bytes_per_token / 1e9, held, rate,
                      rate * prefill_seconds(roofline, lengths))


def lines(roofline: Roofline, where: str, kv_tokens: int, datasets: dict[str, LengthDist],
          burstgpt: LengthDist) -> list[str]:
    """Both calculations in words, for an experiment's notes and for `python -m`; `where` names
    the model and GPU."""
    point = paper_point(roofline, kv_tokens, burstgpt)
    out = [f"§2.2 on our roofline ({where}, {kv_tokens / 1e3:.0f}K tokens of "
           f"KV): the 243K-token burst is {point.burst_share:.2f}x the KV ({point.burst_gb:.0f} GB at "
           f"{roofline.cost.kv_bytes_per_token / 1024:.0f} KiB/token; the paper: {PAPER_BURST_GB} GB). KV 2.1x the "
           f"average holds {point.held_tokens / 1e3:.0f}K tokens; with an 11 s stay that is {point.rate:.1f} req/s "
           f"per GPU, whose prefills alone take {point.prefill_share:.0%} of it."]
    for label, lengths in datasets.items():
        alone = roofline.iteration_seconds([(round(_request_tokens(lengths)), 1)])
        for share in (1 / PAPER_PROVISIONING, 0.6):
            s = steady_state(roofline, kv_tokens, lengths, share)
            out.append(f"{label} ({lengths.mean_prompt:g} in / {lengths.mean_output:g} out) holding {share:.0%} of "
                       f"the KV: {s.resident:.0f} requests resident, {s.rate:.2f} req/s per GPU, prefills "
                       f"{s.prefill_share:.0%} of the GPU (a x{PAPER_BURST_FACTOR:g} burst: "
                       f"{PAPER_BURST_FACTOR * s.prefill_share:.0%}), TPOT {s.tpot_s * 1e3:.0f} ms "
                       f"({alone * 1e3:.0f} ms alone), stay {s.stay_s:.0f} s.")
    return out

