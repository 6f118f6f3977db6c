"""Structured outputs end to end on the embedded SmolLM2 (offline API): every output of a corpus
of JSON schemas parses and validates (`jsonschema`), regexes match in full and choices are one of
theirs, greedy and sampled; a grammar survives preemption, chunked prefill and asynchronous
scheduling; and a request waiting for its grammar does not hold others back."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.structured_outputs import StructuredOutputsParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False}, "ok": {"type": "boolean"}},
     "required": ["point", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "note": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["code", "note"], "additionalProperties": False},
]
PROMPT = "Describe a person as JSON:"


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_num_seqs=16, kv_cache_tokens=4096)


def generate(llm, spec, n_sampled=3, max_tokens=120, **kwargs):
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec, **kwargs)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=spec, **kwargs)
               for s in range(n_sampled)]
    return llm.generate([PROMPT] * len(params), params, use_tqdm=False)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "enum-array", "nested-bounds", "pattern-null"])
def test_every_output_validates_against_its_schema(llm, schema):
    for out in generate(llm, StructuredOutputsParams(json=schema)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_regex_and_choice(llm):
    # Any object at all: a sampled 135M model may nest on past max_tokens (a valid prefix, cut).
    stopped = [out for out in generate(llm, StructuredOutputsParams(json_object=True), max_tokens=200)
               if out.finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(out.text), dict) for out in stopped)
    for out in generate(llm, StructuredOutputsParams(regex=r"(yes|no), because [a-z ]{1,20}\."), max_tokens=40):
        assert re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", out.text), out.text
    choices = ["Paris", "London", "New York"]
    assert all(out.text in choices for out in generate(llm, StructuredOutputsParams(choice=choices)))


def test_a_lark_grammar(llm):
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    for out in generate(llm, StructuredOutputsParams(grammar=grammar), max_tokens=20):
        assert re.fullmatch(r"The answer is [0-9]{1,3}\.", out.text), out.text


def test_grammars_survive_preemption_chunking_and_async_scheduling():
    """Recompute preemption (a KV cache far too small for all), prompt chunks of 8 tokens, and
    asynchronous scheduling: every output is still valid, and the greedy ones equal the roomy
    engine's."""
    schema = SCHEMAS[0]
    spec = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 0.9, seed=i, max_tokens=60, structured_outputs=spec)
              for i in range(8)]
    prompts = [f"{PROMPT} number {i}" for i in range(8)]
    roomy = LLM(device="cpu", dtype="float32", max_num_seqs=8, kv_cache_tokens=4096).generate(
        prompts, params, use_tqdm=False)
    for extra in ({"kv_cache_tokens": 96, "max_num_batched_tokens": 8, "block_size": 16},
                  {"kv_cache_tokens": 4096, "async_scheduling": True}):
        llm = LLM(device="cpu", dtype="float32", max_num_seqs=8, **extra)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, ref in zip(outs, roomy):
            jsonschema.validate(json.loads(out.text), schema)
            assert out.token_ids == ref.token_ids  # seeded draws are per-request: the same too
        if "async_scheduling" not in extra:
            assert llm.engine.scheduler.num_preemptions > 0


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPT, plain, use_tqdm=False)[0].token_ids
    mixed = llm.generate([PROMPT, PROMPT], [plain, plain.replace(structured_outputs=StructuredOutputsParams(
        json=SCHEMAS[1]))], use_tqdm=False)
    assert mixed[0].token_ids == alone


def test_an_invalid_constraint_is_refused_before_any_work(llm):
    with pytest.raises(ValueError, match="structured_outputs.json"):
        llm.generate(PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "nonsense"})),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture
def stuck_compiles(llm, monkeypatch):
    """Every grammar compile waits until the test sets the returned event."""
    import threading

    gate = threading.Event()
    backend = llm.engine.grammar_backend()
    real = type(backend).compile
    monkeypatch.setattr(type(backend), "compile", lambda self, spec: (gate.wait(30), real(self, spec))[1])
    yield gate
    gate.set()


def test_a_request_waiting_for_its_grammar_holds_nobody_back(llm, stuck_compiles):
    """The compile runs on a worker thread: while it is stuck, the other requests finish."""
    gate = stuck_compiles
    engine = llm.engine
    spec = StructuredOutputsParams(regex="[a-z]{3,5}")  # not compiled before: a cache miss
    waiting = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec))
    other = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(20):
        engine.step()
    assert other.is_finished and not waiting.is_finished and waiting.num_computed_tokens == 0
    gate.set()
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    assert re.fullmatch("[a-z]{3,5}", finished[waiting.request_id].text)


def test_a_grammar_the_library_refuses_at_compile_ends_its_request_with_an_output(llm, monkeypatch):
    """A constraint that passed the handler's check but fails to compile ends its request: its
    final output names the reason, and nothing of it stays in the engine."""
    backend = llm.engine.grammar_backend()

    def refuse(self, spec):
        raise ValueError("simulated compile failure")

    monkeypatch.setattr(type(backend), "compile", refuse)
    engine = llm.engine
    spec = StructuredOutputsParams(regex="[q-z]{2,7}")  # not compiled before: a cache miss
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=8, structured_outputs=spec))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (final,) = [o for o in outputs if o.request_id == request.request_id]
    assert final.finish_reason == "abort" and "simulated compile failure" in final.stop_reason
    assert request.request_id not in engine.requests and len(engine.output_processor()) == 0


def test_abort_while_waiting_for_the_grammar(llm, stuck_compiles):
    engine = llm.engine
    request = engine.add_request(PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]{4}")))
    out = engine.abort_request(request.request_id)
    assert out is not None and out.finish_reason == "abort" and not engine.has_unfinished_requests()
