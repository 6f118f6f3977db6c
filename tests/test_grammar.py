"""Structured outputs: the request-side constraint, llguidance's grammars, the bitmask, the compiler.

The central check drives a matcher the way the engine will -- fill the bitmask, mask the logits,
sample, accept -- with random logits standing in for the model, and checks that whatever came out
is valid: JSON that `jsonschema` accepts, a full regex match, one of the choices, a sentence of
the grammar. Random logits are the adversary a real model is not: they try every token the mask
lets through. SmolLM2's tokenizer is the real one, and the "model" is 37 tokens wider than it,
so the masks must also keep out tokens the tokenizer does not have.
"""
from __future__ import annotations

import dataclasses
import json
import pickle
import re
import threading
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from nanoserve.grammar import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCompiler,
    GrammarMatcher,
    allocate_bitmask,
    apply_bitmask,
    bitmask_words,
    fill_bitmasks,
    make_backend,
)
from nanoserve.structured_outputs import StructuredOutputsParams
from nanoserve.tokenizer import Tokenizer

MAX_TOKENS = 300
PADDING = 37  # the model's logits are this much wider than the tokenizer's vocabulary


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The walks' tensors are single rows of 49k logits, too small for torch's thread pool to help;
    on a busy 2-core machine its waiting workers made this file over 10x slower (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def backend(tok) -> GrammarBackend:
    return make_backend("llguidance", tok, tok.vocab_size + PADDING)


@pytest.fixture(scope="module")
def closing_tokens(tok, backend) -> torch.Tensor:
    """1.0 for the tokens that close something (a quote, bracket, brace, parenthesis) and EOS."""
    marks = torch.zeros(backend.vocab_size)
    for token in range(tok.vocab_size):
        if any(c in tok.token_to_str(token) for c in "\"}])"):
            marks[token] = 1.0
    marks[sorted(tok.eos_token_ids)] = 1.0
    return marks


def walk(backend: GrammarBackend, tok: Tokenizer, spec: StructuredOutputsParams, seed: int, greedy: bool,
         closing_bias: torch.Tensor | None = None) -> tuple[str, list[int]]:
    """Generate under the grammar with random logits until it terminates (asserted) -> (text, ids).

    `closing_bias` is added to the logits: a nudge toward closing strings and brackets, for
    grammars (any JSON object, recursive ones) under which a uniform random walk rarely ends."""
    matcher = backend.compile(spec).matcher()
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, backend.vocab_size)
    tokens: list[int] = []
    while not matcher.is_terminated():
        assert len(tokens) < MAX_TOKENS, f"no end after {MAX_TOKENS} tokens: {tok.decode(tokens)!r}"
        fill_bitmasks([(matcher, 0)], bitmask)
        logits = torch.randn(1, backend.vocab_size, generator=generator)
        if closing_bias is not None:
            logits += closing_bias
        apply_bitmask(logits, bitmask)
        if not greedy:  # argmax of logits + Gumbel noise draws from softmax(logits)
            logits -= torch.log(-torch.log(torch.rand(logits.shape, generator=generator)))
        token = int(logits.argmax())
        assert token < tok.vocab_size, "the mask let through a token past the tokenizer"
        assert matcher.accept(token), f"the matcher refused {token}, which its own mask allowed"
        tokens.append(token)
    assert tokens[-1] in tok.eos_token_ids
    assert not any(t in tok.eos_token_ids for t in tokens[:-1])
    assert matcher.num_accepted == len(tokens)
    return tok.decode(tokens[:-1]), tokens


def mask_of(matcher: GrammarMatcher, vocab_size: int) -> torch.Tensor:
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def allowed_tokens(mask_row: torch.Tensor) -> set[int]:
    return {word * 32 + bit for word, value in enumerate(mask_row.tolist()) for bit in range(32) if value >> bit & 1}


# -- JSON schemas ------------------------------------------------------------------------------
# Objects are closed (additionalProperties: false) and strings bounded, so that a random walk
# ends: an open object admits any number of extra keys, each an unbounded random string.
SCHEMAS = {
    "nested-object": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                    "id": {"type": "integer", "minimum": 1, "maximum": 9999}},
                     "required": ["name", "id"], "additionalProperties": False},
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"], "additionalProperties": False},
    "array-min-max-items": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                            "minItems": 2, "maxItems": 4},
    "enum-bool-null": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                       "nothing": {"type": "null"}},
        "required": ["color", "ok", "nothing"], "additionalProperties": False},
    "string-pattern": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    "number-range": {"type": "number", "minimum": -5, "maximum": 5},
    "array-of-objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object",
                  "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                 "tag": {"enum": ["a", "b"]}},
                  "required": ["x", "tag"], "additionalProperties": False}},
    "optional-properties": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 100},
                       "b": {"type": "string", "maxLength": 4},
                       "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
        "additionalProperties": False},
    "any-of-const": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"const": "none"}]},
}


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(backend, tok, name, greedy):
    schema = SCHEMAS[name]
    spec = StructuredOutputsParams(json=schema)
    for seed in range(3):
        text, _ = walk(backend, tok, spec, seed, greedy)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_outputs_are_objects(backend, tok, closing_tokens):
    spec = StructuredOutputsParams(json_object=True)
    texts = [walk(backend, tok, spec, seed, greedy, 3.0 * closing_tokens)[0]
             for seed in range(4) for greedy in (False, True)]
    assert all(isinstance(json.loads(text), dict) for text in texts)
    assert any(json.loads(text) for text in texts), "only empty objects: the walk tried nothing"


def test_json_whitespace_is_bounded(backend, tok):
    """At most one line break and 20 spaces at each place; compact and pretty JSON both pass."""
    matcher = backend.compile(StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})).matcher()

    def fits(text: str) -> bool:
        ids = tok.encode(text)
        accepted = 0
        while accepted < len(ids) and matcher.accept(ids[accepted]):
            accepted += 1
        matcher.rollback(accepted)
        return accepted == len(ids)

    assert fits("[1,2]") and fits("[\n  1,\n  2\n]") and fits("[ 1 , 2 ]")
    assert not fits("[\n\n1]") and not fits("[" + " " * 21 + "1]")


# -- regex, choice, grammars ------------------------------------------------------------------
REGEXES = [r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no|maybe)",
           r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}", r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?"]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_match(backend, tok, pattern):
    spec = StructuredOutputsParams(regex=pattern)
    for seed in range(3):
        for greedy in (False, True):
            text, _ = walk(backend, tok, spec, seed, greedy)
            assert re.fullmatch(pattern, text), text


CHOICES = ["yes", "no", "maybe so", 'a "quoted" \\ one', "ünïcödé 😀", "x|y", "line\nbreak", "no way"]


def test_choice_outputs_are_choices(backend, tok):
    spec = StructuredOutputsParams(choice=CHOICES)
    outputs = {walk(backend, tok, spec, seed, greedy)[0] for seed in range(6) for greedy in (False, True)}
    assert outputs <= set(CHOICES)


@pytest.mark.parametrize("choice", CHOICES)
def test_every_choice_can_be_generated(backend, tok, choice):
    """Quotes, backslashes, unicode and newlines are escaped right: each choice's own tokens are
    accepted and then the grammar is complete (EOS accepted, terminated)."""
    matcher = backend.compile(StructuredOutputsParams(choice=CHOICES)).matcher()
    assert all(matcher.accept(t) for t in tok.encode(choice))
    assert matcher.accept(min(tok.eos_token_ids)) and matcher.is_terminated()


GREETING = r'''
start: greeting " " NAME "!"
greeting: "hello" | "hi" | "good morning"
NAME: /[A-Z][a-z]{1,8}/
'''
EXPRESSION = r'''
start: expr
expr: NUM | "sum(" expr ", " expr ")"
NUM: /[0-9]{1,3}/
'''


def is_expression(text: str) -> bool:
    while (reduced := re.sub(r"sum\([0-9]{1,3}, [0-9]{1,3}\)", "0", text)) != text:
        text = reduced
    return re.fullmatch(r"[0-9]{1,3}", text) is not None


def test_lark_grammar_outputs_parse(backend, tok):
    for seed in range(3):
        for greedy in (False, True):
            text, _ = walk(backend, tok, StructuredOutputsParams(grammar=GREETING), seed, greedy)
            assert re.fullmatch(r"(hello|hi|good morning) [A-Z][a-z]{1,8}!", text), text
    # The expression grammar is recursive, and nests less often than not (few tokens start
    # "sum(", ten are digits), so the walk ends.
    texts = [walk(backend, tok, StructuredOutputsParams(grammar=EXPRESSION), seed, greedy)[0]
             for seed in range(6) for greedy in (False, True)]
    assert all(is_expression(text) for text in texts), texts
    assert any(text.startswith("sum(sum(") for text in texts), texts  # it did recurse, twice


def test_gbnf_grammar_is_converted(backend, tok):
    gbnf = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | [0-9]{1,2}\n'
    for seed in range(4):
        text, _ = walk(backend, tok, StructuredOutputsParams(grammar=gbnf), seed, greedy=False)
        assert re.fullmatch(r"The answer is (yes|no|[0-9]{1,2})\.", text), text


# -- check() ----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, field", [
    (dict(json={"type": "nonsense"}), "structured_outputs.json"),
    (dict(json={"type": "string", "format": "no-such-format"}), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (dict(grammar='root ::= ("unclosed"'), "structured_outputs.grammar"),
])
def test_check_names_the_invalid_field(backend, spec, field):
    params = StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match=re.escape(field)) as raised:
        backend.check(params)
    if "grammar" not in field:  # no Lark the client did not write
        assert "start:" not in str(raised.value) and "at 1(" not in str(raised.value)
    with pytest.raises(ValueError, match=re.escape(field)):  # compile says the same
        backend.compile(params)


def test_check_accepts_valid_constraints(backend):
    specs = [StructuredOutputsParams(json=s) for s in SCHEMAS.values()]
    specs += [StructuredOutputsParams(regex=r) for r in REGEXES]
    specs += [StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=GREETING),
              StructuredOutputsParams(json_object=True), StructuredOutputsParams(grammar='root ::= "a" | "b"')]
    for spec in specs:
        backend.check(spec)


def test_check_needs_no_tokenizer(tok):
    """A fresh backend checks without building llguidance's tokenizer (the server's fast path)."""
    fresh = make_backend("llguidance", tok, tok.vocab_size)
    fresh.check(StructuredOutputsParams(json=SCHEMAS["nested-object"]))
    with pytest.raises(ValueError):
        fresh.check(StructuredOutputsParams(regex="(unclosed"))
    assert fresh._ll_tokenizer is None


@pytest.mark.parametrize("kwargs, message", [
    ({}, "set exactly one of json, regex, choice, grammar, json_object; none is set"),
    (dict(regex="a", choice=["a"]), "regex, choice are set"),
    (dict(json={"type": "object"}, json_object=True), "json, json_object are set"),
    (dict(choice=[]), "structured_outputs.choice must not be empty"),
    (dict(choice="ab"), "structured_outputs.choice must be a list of strings"),
    (dict(choice=["a", 1]), "structured_outputs.choice must hold only strings"),
    (dict(json="{not json"), "structured_outputs.json: the schema is not valid JSON"),
    (dict(json="[1, 2]"), "structured_outputs.json: a JSON schema must be a JSON object"),
    (dict(grammar="  "), "structured_outputs.grammar must be a non-empty string"),
    (dict(json_object=1), "structured_outputs.json_object must be a boolean"),
])
def test_params_reject_bad_shapes(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_params_are_hashable_and_keyed_canonically():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    as_dict = StructuredOutputsParams(json=schema)
    as_text = StructuredOutputsParams(json=json.dumps(schema, indent=4))
    assert as_dict == as_text and hash(as_dict) == hash(as_text) and as_dict.key == as_text.key
    assert as_dict.kind == "json" and as_text.schema == schema and isinstance(as_text.json, str)
    # Property order is part of the grammar (llguidance generates properties in schema order).
    reordered = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    assert StructuredOutputsParams(json=reordered) != as_dict
    # The caller's dict is copied: changing it later changes neither the constraint nor its key.
    key = as_dict.key
    schema["properties"]["c"] = {"type": "null"}
    assert as_dict.key == key and "c" not in as_dict.schema
    choice = StructuredOutputsParams(choice=["a", "b"])
    assert choice.choice == ("a", "b") and choice == StructuredOutputsParams(choice=("a", "b"))
    assert choice != StructuredOutputsParams(regex="a|b") and choice.kind == "choice"
    assert {StructuredOutputsParams(json_object=True), StructuredOutputsParams(json_object=True)} == {
        StructuredOutputsParams(json_object=True)}
    assert StructuredOutputsParams(grammar="start: /a/").kind == "grammar"
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.regex = "x"
    assert pickle.loads(pickle.dumps(as_dict)) == as_dict  # it may cross to an engine process


def test_make_backend_names():
    with pytest.raises(ValueError, match="xgrammar backend is not installed/implemented"):
        make_backend("xgrammar", None, 10)
    with pytest.raises(ValueError, match="unknown grammar backend 'outlines'"):
        make_backend("outlines", None, 10)


# -- the compiler -----------------------------------------------------------------------------
class RecordingBackend(GrammarBackend):
    """Another backend's compiles, recording the thread each ran on; `gate` holds them back."""

    name = "recording"

    def __init__(self, inner: GrammarBackend) -> None:
        self.inner = inner
        self.threads: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def check(self, spec: StructuredOutputsParams) -> None:
        self.inner.check(spec)

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(10)
        return self.inner.compile(spec)


def test_compiler_caches_and_compiles_off_thread(backend, tok):
    recording = RecordingBackend(backend)
    compiler = GrammarCompiler(recording, max_workers=2, cache_size=2)
    try:
        recording.gate.clear()
        schema = SCHEMAS["enum-bool-null"]
        first = compiler.submit(StructuredOutputsParams(json=schema))
        in_flight = compiler.submit(StructuredOutputsParams(json=json.dumps(schema)))  # same key, still compiling
        assert in_flight is first and not first.done()
        recording.gate.set()
        compiled = first.result(timeout=10)
        assert compiler.submit(StructuredOutputsParams(json=schema)).result() is compiled
        assert len(recording.threads) == 1
        assert recording.threads[0] != threading.current_thread().name
        assert recording.threads[0].startswith("nanoserve-grammar")
        # A grammar compiled on the worker steps on this thread.
        text, _ = walk(backend, tok, StructuredOutputsParams(json=schema), 0, greedy=True)
        matcher = compiled.matcher()
        assert all(matcher.accept(t) for t in tok.encode(text))
        # An LRU of two: a third constraint evicts the least recently used.
        compiler.submit(StructuredOutputsParams(regex="a")).result()
        compiler.submit(StructuredOutputsParams(regex="b")).result()
        assert len(compiler) == 2
        assert compiler.submit(StructuredOutputsParams(json=schema)).result() is not compiled
        assert len(recording.threads) == 4
    finally:
        compiler.shutdown()


def test_compiler_reports_and_forgets_failures(backend):
    compiler = GrammarCompiler(backend)
    try:
        spec = StructuredOutputsParams(json={"type": "nonsense"})
        future: Future[CompiledGrammar] = compiler.submit(spec)
        with pytest.raises(ValueError, match="structured_outputs.json: invalid JSON schema"):
            future.result(timeout=10)
        assert compiler.submit(spec) is not future  # a failure is not cached
    finally:
        compiler.shutdown()


# -- the bitmask ------------------------------------------------------------------------------
def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Bit by bit, in Python: token t is allowed iff bit t % 32 of word t // 32 is set."""
    out = logits.clone()
    for row in range(out.shape[0]):
        words = bitmask[row].tolist()
        for token in range(out.shape[1]):
            word = token // 32
            if word >= len(words) or not (words[word] >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("vocab, width", [(1000, 1000), (1000, 1030), (1000, 990), (64, 64)],
                         ids=["same", "logits-wider", "logits-narrower", "exact-words"])
def test_apply_bitmask_matches_the_bitwise_reference(vocab, width):
    generator = torch.Generator().manual_seed(vocab + width)
    bitmask = torch.randint(-2**31, 2**31, (3, bitmask_words(vocab)), generator=generator, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[1] = -1  # all allowed
    bitmask[2, 0] = 0  # the first 32 tokens banned
    logits = torch.randn(3, width, generator=generator)
    expected = reference_apply(logits, bitmask)
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    if width <= vocab:
        assert torch.isfinite(logits[1]).all()
    assert (bitmask < 0).any()  # bit 31 (the sign) was exercised


def test_apply_bitmask_touches_only_the_given_rows():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=generator)
    before = logits.clone()
    bitmask = torch.zeros(2, bitmask_words(100), dtype=torch.int32)
    bitmask[:, 0] = 0b101  # tokens 0 and 2
    apply_bitmask(logits[1:3], bitmask)  # a view: the caller's rows 1 and 2
    assert torch.equal(logits[[0, 3]], before[[0, 3]])
    for row in (1, 2):
        assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == [0, 2]
    single = before[0].clone()
    apply_bitmask(single, bitmask[0])
    assert torch.isfinite(single).nonzero().flatten().tolist() == [0, 2]


def test_allocate_bitmask():
    bitmask = allocate_bitmask(3, 49189)
    assert bitmask.shape == (3, 1538) and bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
    assert (bitmask == -1).all()
    assert bitmask.is_pinned() == torch.cuda.is_available()


def test_batched_fill_equals_row_by_row(backend, tok):
    specs = [StructuredOutputsParams(json=SCHEMAS["nested-object"]),
             StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
             StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(json_object=True)]
    prefixes = ['{"user": {"na', "12", "may", ""]
    matchers = []
    for spec, prefix in zip(specs, prefixes):
        matcher = backend.compile(spec).matcher()
        assert all(matcher.accept(t) for t in tok.encode(prefix))
        matchers.append(matcher)
    rows = [4, 0, 2, 5]  # scattered, out of order; rows 1 and 3 are no one's
    batched = allocate_bitmask(6, backend.vocab_size)
    fill_bitmasks(list(zip(matchers, rows)), batched)
    assert (batched[[1, 3]] == -1).all()
    for matcher, row in zip(matchers, rows):
        one = mask_of(matcher, backend.vocab_size)
        assert torch.equal(batched[row], one)
        allowed = allowed_tokens(one)
        assert allowed and max(allowed) < tok.vocab_size  # nothing past the tokenizer
    assert all(tok.token_to_str(t)[0].isdigit() for t in allowed_tokens(batched[0]))  # "12" needs a digit
    with pytest.raises(ValueError, match="words per row"):
        fill_bitmasks([(matchers[0], 0)], allocate_bitmask(1, tok.vocab_size + 200))


# -- accept, rollback, termination ------------------------------------------------------------
def test_rollback_restores_the_masks(backend, tok):
    spec = StructuredOutputsParams(json=SCHEMAS["nested-object"])
    ids = tok.encode('{"user": {"name": "Ada", "id": 7}, "active": true}')
    assert len(ids) > 6
    matcher = backend.compile(spec).matcher()
    assert all(matcher.accept(t) for t in ids[:5])
    assert matcher.num_accepted == 5
    matcher.rollback(2)
    assert matcher.num_accepted == 3
    reference = backend.compile(spec).matcher()
    assert all(reference.accept(t) for t in ids[:3])
    assert torch.equal(mask_of(matcher, backend.vocab_size), mask_of(reference, backend.vocab_size))
    # ... and the matcher goes on from there.
    assert all(matcher.accept(t) for t in ids[3:])
    with pytest.raises(ValueError, match="cannot roll back"):
        matcher.rollback(len(ids) + 1)


@pytest.mark.parametrize("pattern, text", [("ab", "ab"), ("[0-9]+", "12")],
                         ids=["complete-and-stopped", "complete-could-go-on"])
def test_eos_terminates_and_rolls_back(backend, tok, pattern, text):
    """EOS counts as one accepted token whether llguidance took it as a stop ("ab": nothing can
    follow) or as a token ("[0-9]+": more digits could follow); rollback(1) undoes just it."""
    eos = min(tok.eos_token_ids)
    matcher = backend.compile(StructuredOutputsParams(regex=pattern)).matcher()
    ids = tok.encode(text)
    assert all(matcher.accept(t) for t in ids)
    before_eos = mask_of(matcher, backend.vocab_size)
    assert eos in allowed_tokens(before_eos)
    assert matcher.accept(eos) and matcher.is_terminated() and matcher.num_accepted == len(ids) + 1
    assert not matcher.accept(eos) and not matcher.accept(ids[0])  # nothing after the end
    matcher.rollback(1)
    assert not matcher.is_terminated() and matcher.num_accepted == len(ids)
    assert torch.equal(mask_of(matcher, backend.vocab_size), before_eos)
    matcher.rollback(len(ids))
    assert allowed_tokens(mask_of(matcher, backend.vocab_size)) >= {ids[0]}


def test_refused_token_leaves_the_matcher_usable(backend, tok):
    matcher = backend.compile(StructuredOutputsParams(regex=r"\d{3}-\d{4}")).matcher()
    assert matcher.accept(tok.encode("1")[0])
    before = mask_of(matcher, backend.vocab_size)
    for refused in [tok.encode("x")[0], min(tok.eos_token_ids), tok.vocab_size + 3, 10**9, -1]:
        assert not matcher.accept(refused)
        assert matcher.num_accepted == 1 and not matcher.is_terminated()
        assert torch.equal(mask_of(matcher, backend.vocab_size), before)
    assert all(matcher.accept(t) for t in tok.encode("23-4567"))
    assert matcher.accept(min(tok.eos_token_ids)) and matcher.is_terminated()
