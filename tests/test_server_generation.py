"""The generation surface over HTTP, with the official `openai` client against the embedded
SmolLM2: every sampling parameter reaches the engine, structured outputs (response_format, vLLM's
structured_outputs and guided_* fields), tool calls (non-streaming, streaming, and the round
trip with a `tool` message), prompt logprobs and echo, and the reasoning parser."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from openai import OpenAI
from server_fixtures import LiveServer, live_server, server  # noqa: F401  (the module-scoped fixture)

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_sampling_parameters_change_the_output_and_neutral_ones_do_not(server: LiveServer, client: OpenAI):
    base = {"model": server.model, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    plain = client.completions.create(**base).choices[0].text
    neutral = client.completions.create(**base, frequency_penalty=0, presence_penalty=0,
                                        extra_body={"repetition_penalty": 1.0, "min_p": 0.0}).choices[0].text
    assert neutral == plain
    first = server.tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = client.completions.create(**base, logit_bias={str(first): -100}).choices[0].text
    assert server.tokenizer.encode(banned, add_special_tokens=False)[0] != first
    shifted = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=1.0,
                                        extra_body={"repetition_penalty": 1.5, "min_tokens": 4}).choices[0]
    assert shifted.text != plain
    stop = plain[3:6]
    kept = client.completions.create(**base, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop)


@pytest.mark.parametrize("how", ["response_format", "structured_outputs", "guided_json"])
def test_json_schema_outputs_validate(server: LiveServer, client: OpenAI, how):
    kwargs: dict = {}
    if how == "response_format":
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                            "strict": True}}
    elif how == "structured_outputs":
        kwargs["extra_body"] = {"structured_outputs": {"json": PERSON}}
    else:
        kwargs["extra_body"] = {"guided_json": PERSON}
    response = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "A person"}],
                                              max_tokens=60, n=3, temperature=1.0, seed=3, **kwargs)
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_regex_choice_and_json_object_streamed(server: LiveServer, client: OpenAI):
    stream = client.chat.completions.create(
        model=server.model, messages=USER, max_tokens=30, stream=True,
        extra_body={"structured_outputs": {"regex": "(sunny|rainy), [0-9]{1,2} degrees"}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert re.fullmatch("(sunny|rainy), [0-9]{1,2} degrees", text), text
    choice = client.completions.create(model=server.model, prompt="Capital of France:", max_tokens=8,
                                       extra_body={"guided_choice": ["Paris", "Rome"]}).choices[0].text
    assert choice in ("Paris", "Rome")
    obj = client.chat.completions.create(model=server.model, messages=USER, max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     None, ["structured_outputs.json"]),
    ({"structured_outputs": {"regex": "(unclosed"}}, None, ["regex"]),
    ({"structured_outputs": {"json": PERSON, "regex": "a"}}, "structured_outputs", ["one"]),
    ({"guided_json": PERSON, "response_format": {"type": "json_object"}}, "response_format", ["Only one"]),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", ["name"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     ["nope"]),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", []),
])
def test_bad_constraints_are_400s_naming_the_field(server: LiveServer, body, param, words):
    before = server.engine.stats().prompt_tokens_total
    response = httpx.post(server.base_url + "/chat/completions",
                          json={"messages": USER, "max_tokens": 5, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert all(w in error["message"] for w in words), error
    if param is not None:
        assert error["param"] == param
    assert server.engine.stats().prompt_tokens_total == before  # refused before the engine


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_validate_against_the_schema(server: LiveServer, client: OpenAI, tool_choice):
    # One call each (parallel_tool_calls=False): a sampled 135M model may otherwise go on adding
    # calls until max_tokens.
    response = client.chat.completions.create(model=server.model, messages=USER, tools=[WEATHER, TIME],
                                              tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=120,
                                              temperature=0.8, seed=1, n=2)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            if isinstance(tool_choice, dict):
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_tool_calls_equal_the_whole_ones(server: LiveServer, client: OpenAI):
    kwargs = dict(model=server.model, messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=80,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_round_trip(server: LiveServer, client: OpenAI):
    first = client.chat.completions.create(model=server.model, messages=USER, tools=[WEATHER], tool_choice="required",
                                           max_tokens=80, temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    answer = client.chat.completions.create(model=server.model, messages=messages, tools=[WEATHER], max_tokens=20,
                                            temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    none = client.chat.completions.create(model=server.model, messages=USER, tools=[WEATHER], tool_choice="none",
                                          max_tokens=10, temperature=0).choices[0]
    assert none.message.tool_calls is None and none.finish_reason != "tool_calls"


def test_prompt_logprobs_and_echo(server: LiveServer, client: OpenAI):
    prompt = "The capital of France is"
    ids = server.tokenizer.encode(prompt)
    response = client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                         logprobs=2)
    choice = response.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert lp.text_offset[len(ids)] == len(prompt)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt=prompt, max_tokens=3, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == choice.text
    raw = httpx.post(server.base_url + "/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1},
                     timeout=60).json()
    rows = raw["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids) and str(ids[1]) in rows[1]


@pytest.fixture(scope="module")
def reasoning_server() -> Iterator[LiveServer]:
    with live_server(reasoning_parser="qwen3") as live:
        yield live


def test_reasoning_content_whole_and_streamed(reasoning_server: LiveServer):
    """SmolLM2 does not think, so a grammar makes it write a <think> block; the parser splits it."""
    live = reasoning_server
    client = OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=live.model, messages=USER, max_tokens=40, temperature=0,
                  extra_body={"structured_outputs": {"regex": "<think>\\n(hmm|well)\\n</think>\\n\\n(yes|no)"}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.model_extra["reasoning_content"] in ("hmm", "well") and message.content in ("yes", "no")
    reasoning = content = ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == (message.model_extra["reasoning_content"], message.content)
