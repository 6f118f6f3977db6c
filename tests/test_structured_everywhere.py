"""Structured outputs under every scheduling policy and KV manager, tensor and pipeline
parallelism, asynchronous scheduling, and a reasoning model's gate, on a tiny random Llama with a
byte-level tokenizer (conftest.write_byte_tokenizer).

Each run's outputs must match their constraint, and its greedy ones must equal the plain fcfs
engine's token for token: a policy's tricks (preemption by recompute or swap, checkpoints and
discarded steps, right-to-left blocks, exact allocation, dropped layers) never touch a
request's tokens, so its grammar state needs no rollback."""
from __future__ import annotations

import re

import pytest
from conftest import build_tiny_model, write_byte_tokenizer

from nanoserve import LLM, SamplingParams
from nanoserve.sched import SCHEDULERS
from nanoserve.structured_outputs import StructuredOutputsParams

PATTERN = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-bytes")
    build_tiny_model("llama", directory)
    write_byte_tokenizer(directory)
    return directory


def requests():
    specs = [StructuredOutputsParams(regex=PATTERN), StructuredOutputsParams(choice=CHOICES),
             StructuredOutputsParams(json=SCHEMA)]
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 1.0, seed=i, max_tokens=60,
                             structured_outputs=specs[i % 3]) for i in range(9)]
    params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))  # unconstrained beside them
    prompts = [f"request {i}: " + "words " * (i % 4) for i in range(len(params))]
    return prompts, params


def check(outputs, params):
    import json

    for out, p in zip(outputs, params):
        spec = p.structured_outputs
        if spec is None:
            continue
        if spec.kind == "regex":
            assert re.fullmatch(PATTERN, out.text), out.text
        elif spec.kind == "choice":
            assert out.text in CHOICES
        elif out.finish_reason == "stop":  # a random model may pad JSON with whitespace past max_tokens
            value = json.loads(out.text)
            assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 50


@pytest.fixture(scope="module")
def reference(tiny_dir):
    prompts, params = requests()
    outputs = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=4096).generate(
        prompts, params, use_tqdm=False)
    check(outputs, params)
    return outputs


def run_and_compare(reference, tiny_dir, **engine_kwargs):
    prompts, params = requests()
    with LLM(str(tiny_dir), device="cpu", dtype="float32", **engine_kwargs) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        check(outputs, params)
        assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
        return llm.engine.stats()


@pytest.mark.parametrize("policy", sorted(SCHEDULERS))
def test_every_policy(reference, tiny_dir, policy):
    """A KV cache of 192 tokens for 10 requests of up to ~60: each policy preempts, swaps,
    checkpoints or drops in its own way."""
    stats = run_and_compare(reference, tiny_dir, policy=policy, kv_cache_tokens=192, block_size=4,
                            max_num_batched_tokens=16)
    assert stats.kv_blocks_used == 0


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                      dict(pipeline_parallel_size=2, async_pipeline=True),
                                      dict(async_scheduling=True)])
def test_parallel_and_asynchronous(reference, tiny_dir, parallel):
    run_and_compare(reference, tiny_dir, kv_cache_tokens=4096, **parallel)


def test_the_grammar_starts_after_the_reasoning(tiny_dir):
    """With a reasoning parser and a prompt that opens <think>, the model thinks freely until it
    writes </think> (here forced by a logit bias); only then does the grammar hold."""
    with LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=4096, reasoning_parser="qwen3") as llm:
        tok = llm.tokenizer
        think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
        prompt = tok.encode("question ") + [think]
        spec = StructuredOutputsParams(regex="[0-9]{2}")
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec,
                                                    logit_bias={end: 100.0}), use_tqdm=False)[0]
        assert out.token_ids[0] == end  # free before </think>: the bias wins
        assert re.fullmatch("[0-9]{2}", tok.decode(out.token_ids[1:])), out.token_ids
        # Without an open <think> in the prompt, the grammar holds from the first token.
        plain = llm.generate([tok.encode("question ")], SamplingParams(temperature=0, max_tokens=20,
                             structured_outputs=spec, logit_bias={end: 100.0}), use_tqdm=False)[0]
        assert re.fullmatch("[0-9]{2}", plain.text)


def test_prompt_logprobs_and_bad_words_under_tensor_parallelism_and_async_scheduling(tiny_dir):
    """Prompt logprobs need every tensor-parallel rank's logits; a bad word of several tokens
    needs the latest token on the host (asynchronous scheduling then waits for it)."""
    prompts = ["abcabc hello", "hello world hello"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=2, bad_words=["lo w", "ab"])
    with LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=4096) as llm:
        ref = llm.generate(prompts, params, use_tqdm=False)
        spellings = llm.engine.bad_words_token_ids(["lo w", "ab"])
    for extra in (dict(tensor_parallel_size=2), dict(async_scheduling=True)):
        with LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=4096, **extra) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        for out, r in zip(outs, ref):
            assert out.token_ids == r.token_ids
            for word in spellings:
                assert all(out.token_ids[i:i + len(word)] != word for i in range(len(out.token_ids)))
            assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
            for a, b in zip(out.prompt_logprobs[1:], r.prompt_logprobs[1:]):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.cuda
def test_cuda_graphs_keep_the_mask_outside(reference, tiny_dir):
    """On a GPU decode steps replay CUDA graphs; the grammar's mask is applied to the logits the
    graph returns, before the draw: outputs valid, greedy ones equal the CPU's fp32 ones (or a
    near-tie), mixed graphs too."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    prompts, params = requests()
    with LLM(str(tiny_dir), device="cuda", dtype="float32", kv_cache_tokens=4096, mixed_graphs=True) as llm:
        assert llm.engine.executor.graphs is not None
        outputs = llm.generate(prompts, params, use_tqdm=False)
    check(outputs, params)


def test_chat_template_variables_reach_the_template(tiny_dir, tmp_path):
    """`tools` and `chat_template_kwargs` (Qwen3's enable_thinking) are template variables, as in
    transformers: a template that reads them renders them."""
    import json
    import shutil

    directory = tmp_path / "templated"
    shutil.copytree(tiny_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if tools %}TOOLS {{ tools | map(attribute='function') | map(attribute='name') "
                               "| join(',') }}\n{% endif %}{% if enable_thinking is false %}<think></think>{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with LLM(str(directory), device="cpu", dtype="float32", kv_cache_tokens=1024) as llm:
        tools = [{"type": "function", "function": {"name": "get_time"}}]
        out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                       tools=tools, chat_template_kwargs={"enable_thinking": False})[0]
        prompt = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert prompt == "user: hi\nTOOLS get_time\n<think></think>"
