"""Hermes tool calls: the whole-output parser, the streaming parser that must agree with it, request
validation, and the llguidance grammar that forces a call (driven token by token on SmolLM2's
vocabulary with seeded random logits, its outputs parsed back and checked against the schemas)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.server.tool_call_stream import ToolCallStream
from nanoserve.server.tool_calls import parse_tool_calls, tool_choice_grammar, validate_tools

llguidance = pytest.importorskip("llguidance")


def function(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, "description": f"the {name} function"}
    if parameters is not None:
        spec["parameters"] = parameters
    return {"type": "function", "function": spec}


# The corpus: an enum, a nested object, an array, number bounds, and a function without parameters.
# The first four are the grammar tests' corpus: their strings, arrays and numbers are bounded so that
# random logits finish a call within the test's token budget (any object, get_time's arguments, may
# go on forever).
TOOLS = [
    function("get_weather", {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}),
    function("book_flight", {
        "type": "object",
        "properties": {
            "passenger": {"type": "object",
                          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                          "required": ["name", "age"], "additionalProperties": False},
            "seats": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["passenger", "seats"], "additionalProperties": False}),
    function("add_tags", {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False}),
    function("set_temperature", {
        "type": "object",
        "properties": {"celsius": {"type": "number", "minimum": -40, "maximum": 60.5, "multipleOf": 0.25},
                       "room": {"type": "string", "enum": ["kitchen", "hall"]}},
        "required": ["celsius", "room"], "additionalProperties": False}),
    function("get_time"),
]
BOUNDED_TOOLS = TOOLS[:4]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object"}) for tool in TOOLS}
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def block(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def calls_of(text: str) -> list[tuple[str, str]]:
    parsed = parse_tool_calls(text, TOOLS)
    for call in parsed.tool_calls:
        assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
    return [(call["function"]["name"], call["function"]["arguments"]) for call in parsed.tool_calls]


# --- parse_tool_calls ---

def test_one_call() -> None:
    parsed = parse_tool_calls(block("get_weather", {"city": "Paris"}), TOOLS)
    assert parsed.content is None
    assert [call["function"] for call in parsed.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]


def test_text_then_parallel_calls() -> None:
    text = ("I'll check both.\n\n" + block("get_weather", {"city": "Paris"}) + "\n"
            + block("get_weather", {"city": "Zürich", "unit": "celsius"}))
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == "I'll check both."
    assert calls_of(text) == [("get_weather", '{"city": "Paris"}'),
                              ("get_weather", '{"city": "Zürich", "unit": "celsius"}')]  # not \u00fc
    assert len({call["id"] for call in parsed.tool_calls}) == 2


def test_plain_text_is_content() -> None:
    assert parse_tool_calls("  Just an answer.\n", TOOLS).content == "Just an answer."
    assert parse_tool_calls("", TOOLS).content is None


def test_arguments_as_a_json_string_are_kept_verbatim() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\":\\"Oslo\\"}"}</tool_call>'
    assert calls_of(text) == [("get_weather", '{"city":"Oslo"}')]


def test_missing_arguments_are_an_empty_object() -> None:
    assert calls_of('<tool_call>{"name": "get_time"}</tool_call>') == [("get_time", "{}")]


@pytest.mark.parametrize("body", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}',  # unbalanced
    '{"arguments": {}}',  # no name
    '{"name": "launch_rockets", "arguments": {}}',  # not one of the tools
    '{"name": "get_weather", "arguments": [1]}',  # arguments not an object
    '{"name": "get_weather", "arguments": "not json"}',
    '["get_weather"]',
])
def test_failed_calls_stay_in_the_content(body: str) -> None:
    text = f"Before <tool_call>{body}</tool_call>" + block("get_time", {})
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == f"Before <tool_call>{body}</tool_call>"
    assert calls_of(text) == [("get_time", "{}")]


def test_an_unclosed_block_is_content() -> None:
    text = block("get_time", {}) + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert parse_tool_calls(text, TOOLS).content == '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert calls_of(text) == [("get_time", "{}")]


# --- ToolCallStream ---

def run_stream(pieces: list[str], tools: list[dict[str, Any]]) -> tuple[str | None, list[tuple[str, str]]]:
    """Feed `pieces`; check the deltas' shapes; return the joined content and the calls."""
    parser = ToolCallStream(tools)
    deltas = [delta for piece in pieces for delta in parser.feed(piece)] + parser.finish()
    content = ""
    calls: list[dict[str, str]] = []
    for delta in deltas:
        assert len(delta) == 1
        if "content" in delta:
            assert delta["content"]
            content += delta["content"]
            continue
        (call,) = delta["tool_calls"]
        if "id" in call:  # the delta that opens a call
            assert call["index"] == len(calls) and CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
            assert call["function"]["arguments"] == ""
            calls.append({"name": call["function"]["name"], "arguments": ""})
        else:
            assert call["index"] == len(calls) - 1 and set(call) == {"index", "function"}
            assert set(call["function"]) == {"arguments"}
            calls[-1]["arguments"] += call["function"]["arguments"]
    assert parser.tool_call_count == len(calls)
    return content or None, [(call["name"], call["arguments"]) for call in calls]


def test_stream_holds_back_a_partial_tag() -> None:
    parser = ToolCallStream(TOOLS)
    assert parser.feed("Let me see.\n<tool") == [{"content": "Let me see."}]
    assert parser.feed('_call>\n{"name": "get_weather", "arguments": {"city": "Ro') == []
    deltas = parser.feed('me"}}\n</tool_call>')
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Rome"}'}}]}
    assert parser.feed("\n") == []  # whitespace waits for more content
    assert parser.feed("<toolb") == [{"content": "\n\n<toolb"}]  # not a tag: "b" is not "_"
    assert parser.feed(" \n") == []
    assert parser.finish() == []  # trailing whitespace is stripped


def test_stream_flushes_an_unclosed_block_as_content() -> None:
    parser = ToolCallStream(TOOLS)
    assert parser.feed('<tool_call>{"name": "get_time"') == []
    assert parser.finish() == [{"content": '<tool_call>{"name": "get_time"'}]


# Outputs built from content, tag fragments and blocks, valid and not.
VALID_BLOCKS = [
    block("get_weather", {"city": "Paris"}),
    block("get_weather", {"city": "Zürich", "unit": "celsius"}),
    block("book_flight", {"passenger": {"name": "Ada", "age": 36}, "seats": 2}),
    block("add_tags", {"tags": ["a", "b"]}),
    '<tool_call>{"name":"set_temperature","arguments":{"celsius":21.5,"room":"hall"}}</tool_call>',
    '<tool_call>\n  {"name": "get_time"}  \n</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
]
INVALID_BLOCKS = [
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {</tool_call>',
    "<tool_call></tool_call>",
]
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "<", "</tool_", "_call>", "\n", " ", "  \n", "Hi", "é😀",
             '{"name": "get_time"}', "text <b>"]
segments = st.one_of(st.sampled_from(VALID_BLOCKS), st.sampled_from(INVALID_BLOCKS), st.sampled_from(FRAGMENTS))


@st.composite
def split_output(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(segments, max_size=10)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=400, deadline=None)
@given(split_output())
def test_stream_agrees_with_whole_text(case: tuple[str, list[str]]) -> None:
    text, pieces = case
    content, calls = run_stream(pieces, TOOLS)
    assert content == parse_tool_calls(text, TOOLS).content
    assert calls == calls_of(text)


# --- validate_tools ---

def test_valid_requests_pass() -> None:
    validate_tools(TOOLS, "auto", True)
    validate_tools(TOOLS, "required", False)
    validate_tools(TOOLS, {"type": "function", "function": {"name": "add_tags"}}, None)
    validate_tools(None, None, None)
    validate_tools(None, "none", None)


@pytest.mark.parametrize(("tools", "tool_choice", "message"), [
    ([function("a"), {"type": "function", "function": {"description": "x"}}], None,
     "tools[1].function.name is required"),
    ([{"type": "retrieval"}], None, "tools[0].type must be 'function'"),
    ([{"type": "function"}], None, "tools[0].function is required"),
    ([function("a b")], None, "tools[0].function.name must be"),
    ([function("a"), function("a")], None, "tools[1].function.name 'a' is used by an earlier tool"),
    ([{"type": "function", "function": {"name": "a", "parameter": {}}}], None,
     "tools[0].function has unknown field 'parameter'"),
    ([function("a", {"type": "object", "properties": {"x": {"type": "strin"}}})], None,
     "tools[0].function.parameters.properties.x.type is not a valid JSON schema"),
    ([function("a", {"type": "array"})], None, "tools[0].function.parameters must be the schema of an object"),
    ([{"type": "function", "function": {"name": "a", "parameters": []}}], None,
     "tools[0].function.parameters must be a JSON schema object"),
    ("a", None, "tools must be a list"),
    ([function("a")], {"type": "function", "function": {"name": "x"}},
     "tool_choice names function 'x', which is not in tools"),
    (None, "required", "tool_choice 'required' needs tools"),
    ([function("a")], "always", "tool_choice must be one of"),
    ([function("a")], {"type": "function"}, "tool_choice.function.name is required"),
])
def test_invalid_requests_name_the_field(tools: Any, tool_choice: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_tools(tools, tool_choice, None)


def test_parallel_tool_calls_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match="parallel_tool_calls"):
        validate_tools(TOOLS, "auto", "yes")


# --- tool_choice_grammar, driven through llguidance ---

def test_no_grammar_unless_a_call_is_forced() -> None:
    assert tool_choice_grammar(TOOLS, "auto", True) is None
    assert tool_choice_grammar(TOOLS, "none", True) is None
    assert tool_choice_grammar(TOOLS, None, True) is None


def test_grammar_shape() -> None:
    grammar = tool_choice_grammar(TOOLS[:1], {"type": "function", "function": {"name": "get_weather"}}, True)
    assert grammar is not None
    lines = grammar.splitlines()
    assert lines[:4] == [
        "%llguidance {}",
        "start: tool_call",
        "tool_call: call_0",
        r'call_0: "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " args_0 "}\n</tool_call>"',
    ]
    assert lines[4].startswith("args_0: %json {")
    assert json.loads(lines[4].removeprefix("args_0: %json ")) == {
        **SCHEMAS["get_weather"],
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}}
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


def test_only_a_strict_function_fails_on_keywords_llguidance_lacks() -> None:
    parameters = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
    for strict in (False, True):
        tools = [{"type": "function", "function": {"name": "f", "parameters": parameters, "strict": strict}}]
        validate_tools(tools, "required", True)
        grammar = tool_choice_grammar(tools, "required", True)
        assert grammar is not None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        assert ("uniqueItems" in error) if strict else error == ""


@pytest.fixture(scope="module")
def lltokenizer(smollm2_dir: Path) -> Any:
    from nanoserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    return llguidance.LLTokenizer(tok.backend.to_str(), eos_token=min(tok.eos_token_ids))


def generate(lltokenizer: Any, grammar: str, seed: int, fresh_logits: bool) -> str:
    """Sample under the grammar: argmax of seeded random logits masked by the grammar, until the
    matcher stops. With `fresh_logits` new logits each step; else one vector for every step (a
    greedy "model") and EOS whenever the grammar allows it (that model would repeat a parallel call
    forever)."""
    matcher = llguidance.LLMatcher(lltokenizer, grammar)
    assert not matcher.is_error(), matcher.get_error()
    rng = np.random.default_rng(seed)
    vocab = lltokenizer.vocab_size
    logits = rng.standard_normal(vocab)
    tokens: list[int] = []
    for _ in range(400):
        if matcher.is_stopped():
            break
        if fresh_logits:
            logits = rng.standard_normal(vocab)
        words = np.frombuffer(matcher.compute_bitmask(), dtype="<i4")
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        if not fresh_logits and allowed[lltokenizer.eos_token]:
            token = lltokenizer.eos_token
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    assert matcher.is_stopped(), f"no end in 400 tokens: {lltokenizer.decode_str(tokens)!r}"
    # The matcher stops on EOS, or by itself once nothing can extend the output.
    if tokens[-1] == lltokenizer.eos_token:
        tokens.pop()
    return str(lltokenizer.decode_str(tokens))


def check_forced_calls(text: str, allowed_names: list[str], parallel: bool) -> None:
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content is None, text
    assert parsed.tool_calls and (parallel or len(parsed.tool_calls) == 1), text
    for call in parsed.tool_calls:
        name = call["function"]["name"]
        assert name in allowed_names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


@pytest.mark.parametrize("name", [tool["function"]["name"] for tool in BOUNDED_TOOLS])
@pytest.mark.parametrize("fresh_logits", [False, True], ids=["greedy", "random"])
def test_named_function_grammar(lltokenizer: Any, name: str, fresh_logits: bool) -> None:
    grammar = tool_choice_grammar(BOUNDED_TOOLS, {"type": "function", "function": {"name": name}}, True)
    assert grammar is not None
    for seed in range(3):
        check_forced_calls(generate(lltokenizer, grammar, seed, fresh_logits), [name], parallel=False)


@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
@pytest.mark.parametrize("fresh_logits", [False, True], ids=["greedy", "random"])
def test_required_grammar(lltokenizer: Any, parallel: bool, fresh_logits: bool) -> None:
    grammar = tool_choice_grammar(BOUNDED_TOOLS, "required", parallel)
    assert grammar is not None
    assert llguidance.LLMatcher.validate_grammar(grammar, lltokenizer) == ""
    names: set[str] = set()
    counts: set[int] = set()
    for seed in range(8):
        text = generate(lltokenizer, grammar, seed, fresh_logits)
        check_forced_calls(text, [tool["function"]["name"] for tool in BOUNDED_TOOLS], parallel)
        calls = parse_tool_calls(text, TOOLS).tool_calls
        names.update(call["function"]["name"] for call in calls)
        counts.add(len(calls))
        # the stream, fed token-sized pieces, agrees
        assert run_stream(list(text), TOOLS) == (None, calls_of(text))
    assert len(names) > 1  # the grammar offers every function, not only the first
    if parallel and fresh_logits:
        assert max(counts) > 1


def accepts(lltokenizer: Any, grammar: str, text: str) -> bool:
    """Whether the grammar allows exactly `text` (every token of it, and then the end)."""
    matcher = llguidance.LLMatcher(lltokenizer, grammar)
    tokens = lltokenizer.tokenize_str(text)
    return bool(matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens)
                and matcher.is_accepting())


def test_grammar_accepts_the_hermes_text_and_nothing_else(lltokenizer: Any) -> None:
    grammar = tool_choice_grammar(TOOLS, "required", True)
    assert grammar is not None
    time_call, weather_call = block("get_time", {}), block("get_weather", {"city": "Oslo"})
    assert accepts(lltokenizer, grammar, time_call)
    assert accepts(lltokenizer, grammar, block("get_time", {"any": [1, {"x": None}]}))  # no parameters: any object
    assert accepts(lltokenizer, grammar, time_call + "\n" + weather_call)
    assert not accepts(lltokenizer, grammar, "Sure. " + time_call)  # a call, nothing else
    assert not accepts(lltokenizer, grammar, block("launch_rockets", {}))
    assert not accepts(lltokenizer, grammar, block("get_weather", {"city": "Oslo", "country": "NO"}))
    assert not accepts(lltokenizer, grammar, block("get_weather", {"city": "Oslo"}).replace(": ", ":"))
    single = tool_choice_grammar(TOOLS, "required", False)
    assert single is not None
    assert accepts(lltokenizer, single, weather_call)
    assert not accepts(lltokenizer, single, time_call + "\n" + weather_call)
