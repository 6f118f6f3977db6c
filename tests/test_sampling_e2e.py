"""The sampling parameters end to end on the embedded SmolLM2: the offline API and the engine's
stop rules (min_tokens, include_stop_str_in_output, skip_special_tokens, bad_words, n), and
HF's `generate` as the oracle for greedy decoding under a repetition penalty."""
from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.generation_config import sampling_defaults

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_num_seqs=8, kv_cache_tokens=4096)


def test_greedy_with_repetition_penalty_matches_hf_generate(llm, hf_gguf_model):
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True)
    ours = llm.generate([ids], params, use_tqdm=False)[0].token_ids
    with torch.no_grad():
        theirs = hf_gguf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                        repetition_penalty=1.3)[0, len(ids):].tolist()
    assert ours == theirs


def test_penalties_change_greedy_output_and_a_neutral_value_does_not(llm):
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(PROMPT, base, use_tqdm=False)[0].token_ids
    assert llm.generate(PROMPT, base.replace(repetition_penalty=1.0, frequency_penalty=0.0),
                        use_tqdm=False)[0].token_ids == plain
    penalized = llm.generate(PROMPT, base.replace(frequency_penalty=2.0), use_tqdm=False)[0].token_ids
    assert penalized != plain
    # Under a strong frequency penalty no token repeats as often as it may without one.
    assert max(penalized.count(t) for t in set(penalized)) <= max(plain.count(t) for t in set(plain))


def test_logit_bias_forces_and_bans(llm):
    forced = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logit_bias={forced: 100.0}),
                       use_tqdm=False)[0]
    assert out.token_ids == [forced] * 4
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].token_ids[0]
    banned = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logit_bias={plain: -100.0}),
                          use_tqdm=False)[0].token_ids[0]
    assert banned != plain


def test_min_tokens_holds_back_eos_and_stop_strings(llm):
    eos = min(llm.engine.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=4, logit_bias={eos: 100.0})
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    assert out.finish_reason == "stop"


def test_stop_string_in_or_out_of_the_output(llm):
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    stop = plain.text[4:7]
    assert stop.strip()
    cut = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop=stop), use_tqdm=False)[0]
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop=stop,
                                               include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == cut.text + stop and plain.text.startswith(kept.text)
    assert cut.stop_reason == kept.stop_reason == stop


def test_bad_words_are_never_generated(llm):
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    word = plain.text.split()[0]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word]),
                       use_tqdm=False)[0]
    for spelling in llm.engine.bad_words_token_ids([word]):
        n = len(spelling)
        assert all(out.token_ids[i:i + n] != spelling for i in range(len(out.token_ids)))


def test_skip_special_tokens_false_shows_them(llm):
    eos = min(llm.engine.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={eos: 100.0})
    hidden = llm.generate(PROMPT, params, use_tqdm=False)[0]
    shown = llm.generate(PROMPT, params.replace(skip_special_tokens=False), use_tqdm=False)[0]
    assert hidden.text == "" and shown.text == llm.tokenizer.decode([eos, eos], skip_special_tokens=False) != ""


def test_n_completions_offline(llm):
    out = llm.generate([PROMPT, "Hello"], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8), use_tqdm=False)
    assert len(out) == 2 and all(len(o.outputs) == 3 for o in out)
    texts = [c.text for c in out[0].outputs]
    assert len(set(texts)) > 1  # different seeds, different samples
    again = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8), use_tqdm=False)[0]
    assert [c.text for c in again.outputs] == texts
    assert out[0].text == texts[0] and [c.index for c in out[0].outputs] == [0, 1, 2]


def test_a_request_without_new_parameters_decodes_as_before_beside_penalized_ones(llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm.generate(PROMPT, params, use_tqdm=False)[0].token_ids
    mixed = llm.generate([PROMPT, PROMPT, PROMPT],
                         [params, params.replace(repetition_penalty=1.5, min_p=0.1),
                          params.replace(temperature=0.8, frequency_penalty=1.0, bad_words=["fox"])],
                         use_tqdm=False)
    assert mixed[0].token_ids == alone


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95, "top_k": 20, '
                                                     '"do_sample": true, "max_new_tokens": 99}')
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 99}
    assert sampling_defaults(tmp_path, "vllm") == {}
    assert sampling_defaults(tmp_path, overrides={"temperature": 0.1})["temperature"] == 0.1
    with pytest.raises(ValueError, match="unknown sampling field"):
        sampling_defaults(tmp_path, overrides={"beam_width": 3})
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(tmp_path, str(tmp_path / "missing"))


def test_prompt_logprobs_match_hf_and_survive_chunking(hf_gguf_model):
    """Each prompt token's logprob is HF's log-softmax at the position before it, whether the
    prompt is computed in one step or chunked over several, and with the prefix cached."""
    small_chunks = LLM(device="cpu", dtype="float32", max_num_batched_tokens=8, kv_cache_tokens=2048)
    ids = small_chunks.tokenizer.encode(PROMPT)
    with torch.no_grad():
        reference = hf_gguf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    for _ in range(2):  # the second time, the prompt's blocks are cached: computed again anyway
        out = small_chunks.generate([ids], params, use_tqdm=False)[0]
        rows = out.prompt_logprobs
        assert rows is not None and len(rows) == len(ids) and rows[0] is None
        for i in range(1, len(ids)):
            assert rows[i][ids[i]] == pytest.approx(reference[i - 1, ids[i]].item(), abs=2e-3)
            top = reference[i - 1].topk(3).indices.tolist()
            assert set(top) <= set(rows[i]) and len(rows[i]) <= 4
