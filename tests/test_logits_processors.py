"""Every sampling parameter against its oracle: transformers' logits processors and warpers
(`transformers.generation.logits_process`) and OpenAI's formula for the penalties; and the
properties that make them safe to batch (a request alone or in a batch draws the same tokens;
a batch without the new parameters draws what it drew before they existed)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation import logits_process as hf

from nanoserve.model import logits_processors as lp
from nanoserve.model.logits_processors import RowHistory, apply_top_k_top_p, process_rows
from nanoserve.model.sampler import sample
from nanoserve.sampling import SamplingParams

VOCAB = 97


def logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def histories(rows: int, seed: int = 0, length: int = 12) -> list[RowHistory]:
    g = torch.Generator().manual_seed(seed + 1000)
    return [RowHistory(torch.randint(0, VOCAB, (length,), generator=g).tolist(),
                       torch.randint(0, VOCAB, (length,), generator=g).tolist()) for _ in range(rows)]


def processed(x: torch.Tensor, params: list[SamplingParams], hist: list[RowHistory]) -> torch.Tensor:
    out = x.clone()
    process_rows(out, params, hist)
    return out


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_hfs(penalty):
    x, hist = logits(4), histories(4)
    ours = processed(x, [SamplingParams(repetition_penalty=penalty)] * 4, hist)
    # HF penalizes every token of input_ids: the prompt followed by the output.
    input_ids = torch.tensor([list(h.prompt_token_ids) + list(h.output_token_ids) for h in hist])
    theirs = hf.RepetitionPenaltyLogitsProcessor(penalty)(input_ids, x.clone())
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("frequency,presence", [(0.5, 0.0), (0.0, 1.2), (-0.7, 0.3), (2.0, -2.0)])
def test_frequency_and_presence_penalties_are_openais_formula(frequency, presence):
    """OpenAI: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, c[j]
    counting j in the generated tokens only (the prompt is not penalized)."""
    x, hist = logits(3, 1), histories(3, 1, length=30)
    ours = processed(x, [SamplingParams(frequency_penalty=frequency, presence_penalty=presence)] * 3, hist)
    expected = x.clone()
    for row, h in enumerate(hist):
        for j in range(VOCAB):
            c = list(h.output_token_ids).count(j)
            expected[row, j] = x[row, j] - c * frequency - float(c > 0) * presence
    torch.testing.assert_close(ours, expected)


def test_only_the_penalized_rows_change_and_pending_tokens_count():
    x, hist = logits(4, 2), histories(4, 2)
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams(),
              SamplingParams(presence_penalty=1.0)]
    ours = processed(x, params, hist)
    torch.testing.assert_close(ours[[0, 2]], x[[0, 2]])
    assert not torch.equal(ours[1], x[1])
    # A token still on the device (asynchronous scheduling) counts as if it had been appended.
    drawn = torch.tensor([5, 41])
    pending = RowHistory(hist[1].output_token_ids, hist[1].prompt_token_ids, pending=(drawn, 1))
    appended = RowHistory([*hist[1].output_token_ids, 41], hist[1].prompt_token_ids)
    one = SamplingParams(frequency_penalty=0.8, repetition_penalty=1.4)
    torch.testing.assert_close(processed(x[1:2], [one], [pending]), processed(x[1:2], [one], [appended]))


def test_the_dense_penalties_equal_the_sparse_ones():
    """A GPU builds [rows, vocab] counts, a CPU touches only the tokens that occur: the same."""
    x, hist = logits(5, 11), histories(5, 11, length=40)
    hist[2] = RowHistory(hist[2].output_token_ids, hist[2].prompt_token_ids, pending=(torch.tensor([7, 3]), 0))
    hist[3] = RowHistory(hist[3].output_token_ids, [*hist[3].prompt_token_ids, VOCAB + 3])  # past the vocabulary
    params = [SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=pp)
              for r, f, pp in ((1.3, 0.5, 0.2), (1.0, 1.5, 0.0), (0.7, 0.0, -1.0), (2.0, -0.4, 0.6), (1.0, 0.0, 0.0))]
    pending = (torch.tensor([2]), torch.tensor([7]))
    args = (torch.tensor([p.repetition_penalty for p in params]), torch.tensor([p.frequency_penalty for p in params]),
            torch.tensor([p.presence_penalty for p in params]))
    sparse = x.clone()
    lp._sparse_penalties(sparse, hist, pending, *args)
    torch.testing.assert_close(lp._dense_penalties(x.clone(), hist, pending, *args), sparse)


def test_min_p_is_hfs():
    x = logits(5, 3)
    for min_p in (0.05, 0.2, 0.9):
        theirs = hf.MinPLogitsWarper(min_p)(None, x.clone())
        ours = lp.apply_min_p(x.clone(), torch.full((5,), min_p))
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_bad_words_are_hfs():
    """HF bans a word's last token where the output ends in the rest of it."""
    x = logits(3, 4)
    words = [[7], [3, 9], [11, 12, 13]]
    outputs = [[1, 2, 3], [4, 11, 12], [3, 9, 11]]
    ours = x.clone()
    process_rows(ours, [SamplingParams(bad_words=["w"])] * 3, [RowHistory(o, [0], bad_words_token_ids=words)
                                                               for o in outputs])
    theirs = hf.NoBadWordsLogitsProcessor(words, eos_token_id=0)(torch.tensor(outputs), x.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_min_tokens_is_hfs():
    x = logits(2, 5)
    eos = [2, 50]
    for generated in (0, 2, 3, 5):
        params = [SamplingParams(min_tokens=3, max_tokens=8)] * 2
        ours = x.clone()
        process_rows(ours, params, [RowHistory([1] * generated, [4, 4], min_tokens_stop_ids=frozenset(eos))] * 2)
        prompt = torch.tensor([[4, 4] + [1] * generated] * 2)
        theirs = hf.MinNewTokensLengthLogitsProcessor(2, 3, eos)(prompt, x.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), generated


def test_logit_bias_and_allowed_token_ids():
    x = logits(2, 6)
    ours = processed(x, [SamplingParams(logit_bias={3: 5.0, 90: -100.0}), SamplingParams(allowed_token_ids=[4, 8])],
                     [RowHistory((), ())] * 2)
    expected = x.clone()
    expected[0, 3] += 5
    expected[0, 90] -= 100
    torch.testing.assert_close(ours[0], expected[0])
    assert torch.isfinite(ours[1]).nonzero().flatten().tolist() == [4, 8]
    # HF's SequenceBiasLogitsProcessor, for one-token sequences, is the same addition.
    theirs = hf.SequenceBiasLogitsProcessor([[[3], 5.0], [[90], -100.0]])(torch.zeros(1, 1, dtype=torch.long),
                                                                          x[:1].clone())
    torch.testing.assert_close(ours[:1], theirs)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), top_k=st.sampled_from([0, 1, 5, 40, VOCAB]),
       top_p=st.sampled_from([1.0, 0.95, 0.6, 0.1, 1e-6]), scale=st.sampled_from([0.1, 1.0, 8.0]))
def test_top_k_top_p_without_a_sort_is_hfs(seed, top_k, top_p, scale):
    """The sort-free mask keeps HF's tokens (TopK then TopP warpers), whether the nucleus lies
    within the candidates or needs the bisection (a flat distribution: scale 0.1)."""
    x = logits(3, seed, scale)
    theirs = x.clone()
    if top_k:
        theirs = hf.TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1:
        theirs = hf.TopPLogitsWarper(top_p)(None, theirs)
    ours = apply_top_k_top_p(x.clone(), torch.full((3,), top_k), torch.full((3,), top_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_the_bisection_finds_the_sorted_nucleus(monkeypatch):
    monkeypatch.setattr(lp, "TOP_P_TIERS", (2, 3))  # force every row past the candidates
    for seed in range(20):
        x = logits(4, seed, 0.5)
        theirs = hf.TopPLogitsWarper(0.7)(None, x.clone())
        ours = apply_top_k_top_p(x.clone(), torch.zeros(4, dtype=torch.long), torch.full((4,), 0.7))
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def draw(x, params, hist=None, seed=0):
    generators = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    return sample(x, params, generators, torch.Generator().manual_seed(seed), hist).token_ids


def test_greedy_with_processors_is_the_argmax_of_the_processed_logits():
    x, hist = logits(4, 7), histories(4, 7)
    params = [SamplingParams(temperature=0, repetition_penalty=1.5), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={1: 100.0}), SamplingParams(temperature=0, frequency_penalty=2)]
    expected = processed(x, params, hist).argmax(-1).tolist()
    assert draw(x, params, hist) == expected
    assert expected[2] == 1


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000), position=st.integers(0, 5))
def test_a_seeded_request_draws_the_same_alone_and_in_a_batch(seed, position):
    x, hist = logits(6, seed), histories(6, seed)
    mine = SamplingParams(temperature=0.9, top_p=0.8, min_p=0.02, repetition_penalty=1.2, frequency_penalty=0.3,
                          seed=seed)
    others = [SamplingParams(temperature=t, top_k=k, presence_penalty=pp)
              for t, k, pp in ((0, 0, 0.0), (1.0, 5, 0.5), (0.7, 0, 0.0), (1.3, 0, 0.0), (0, 0, 1.0), (0.5, 3, 0.0))]
    params = others[:position] + [mine] + others[position + 1:]
    batch = draw(x, params, hist, seed=seed + 1)
    alone = draw(x[position:position + 1], [mine], [hist[position]], seed=seed + 2)
    assert batch[position] == alone[0]


def test_requests_without_the_new_parameters_draw_as_before():
    """The same generator, the same rows, the same draws: the processors leave no trace on a
    batch that asks for none of them (the reference is the old sampler's path, written out)."""
    x = logits(5, 9)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.1, top_k=7),
              SamplingParams(temperature=0.6, top_p=0.9), SamplingParams(temperature=0)]
    ours = draw(x, params, seed=4)
    g = torch.Generator().manual_seed(4)
    tokens = x.argmax(-1)
    rows = [1, 2, 3]
    y = x[rows] / torch.tensor([0.8, 1.1, 0.6]).unsqueeze(1)
    y = apply_top_k_top_p(y, torch.tensor([0, 7, 0]), torch.tensor([1.0, 1.0, 0.9]))
    probs = y.softmax(-1)
    noise = torch.empty(3, VOCAB).uniform_(generator=g).log_().neg_()  # Exp(1) noise, as the CPU draws it
    tokens[rows] = (probs / noise).argmax(-1)
    assert ours == tokens.tolist()


def test_processors_need_histories():
    with pytest.raises(ValueError, match="histories"):
        draw(logits(1), [SamplingParams(repetition_penalty=1.2)])


@pytest.mark.parametrize("kwargs,field", [
    ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"bad_words": [""]}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"n": 0}, "n"), ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_bad_parameters_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_logit_bias_is_read_only_and_params_stay_hashable():
    params = SamplingParams(logit_bias={3: 1.0})
    with pytest.raises(TypeError):
        params.logit_bias[4] = 2.0  # type: ignore[index]
    assert hash(params) == hash(SamplingParams(logit_bias={3: 1.0}))
