"""The sampler in isolation: greedy, temperature, top-k, top-p, seeds and logprobs."""
from __future__ import annotations

import pytest
import torch

from nanoserve.model.logits_processors import apply_top_k_top_p
from nanoserve.model.sampler import sample
from nanoserve.sampling import SamplingParams


def draw(logits, params, generators=None, seed=0):
    generators = generators or [None] * len(params)
    return sample(logits, params, generators, torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    result = draw(logits, [SamplingParams(temperature=0)] * 6)
    assert result.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_draw_as_their_fp32_widening(dtype):
    """Greedy rows take the argmax in the logits' own dtype, ties included (coarse values make
    many); drawn rows and logprobs are widened first: every result equals that of the fp32
    copy of the same logits."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(8, 300, generator=g) * 4).round().to(dtype)  # integers: ties in every row
    params = ([SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=0, logprobs=3)]
              + [SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=1.2, top_k=5, seed=8),
                 SamplingParams(temperature=1.0, top_p=0.9, seed=9, logprobs=2), SamplingParams(temperature=0.5)])

    def run(x):
        generators = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
        return draw(x, params, generators, seed=11)

    half, wide = run(logits), run(logits.float())
    assert half.token_ids == wide.token_ids
    assert half.token_ids[:4] == logits.float().argmax(-1).tolist()[:4]
    assert half.logprobs == wide.logprobs


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    argmax = logits.argmax(-1).tolist()
    assert draw(logits, [SamplingParams(temperature=1.5, top_k=1)] * 4).token_ids == argmax
    assert draw(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 4).token_ids == argmax


def test_top_k_top_p_mask():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [0.0, 0.0, 0.0, 10.0]])
    probs = logits.softmax(-1)
    masked = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.5]))
    assert torch.isinf(masked[0, 2:]).all() and torch.isfinite(masked[0, :2]).all()
    assert torch.isfinite(masked[1, 3]) and torch.isinf(masked[1, :3]).all()
    # top_p keeps the smallest prefix whose mass reaches p
    p = float(probs[0, 0] + probs[0, 1]) - 1e-4
    masked = apply_top_k_top_p(logits[:1], torch.tensor([0]), torch.tensor([p]))
    assert torch.isfinite(masked[0, :2]).all() and torch.isinf(masked[0, 2:]).all()


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    params = [SamplingParams(temperature=0.7)] * 4000
    result = draw(logits.expand(4000, -1).clone(), params, seed=3)
    freq = torch.bincount(torch.tensor(result.token_ids), minlength=4).float() / 4000
    expected = (logits[0] / 0.7).softmax(-1)
    assert (freq - expected).abs().max() < 0.03


def test_seeded_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 100, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(rows):
        gens = [torch.Generator().manual_seed(42) if i == 0 else None for i in range(len(rows))]
        params = [seeded] + [SamplingParams(temperature=1.0)] * (len(rows) - 1)
        return draw(logits[rows], params, gens, seed=len(rows)).token_ids[0]

    alone = run([0])
    assert run([0, 1, 2, 3]) == alone and run([0, 5, 6, 7, 1, 2]) == alone


def test_logprobs_are_those_of_the_raw_distribution():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.5, logprobs=0),
              SamplingParams(temperature=0)]
    result = draw(logits, params)
    ref = logits.log_softmax(-1)
    row = result.logprobs[0]
    top = ref[0].topk(3)
    assert list(row) == top.indices.tolist()  # the greedy token is the top one: 3 entries
    assert torch.allclose(torch.tensor(list(row.values())), top.values)
    assert list(result.logprobs[1]) == [result.token_ids[1]]
    assert result.logprobs[1][result.token_ids[1]] == pytest.approx(float(ref[1, result.token_ids[1]]))
    assert result.logprobs[2] is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(seed=2**64), "seed"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_params_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
