"""No silent drops: every field of OpenAI's and vLLM's request schemas, sent to the server.

Each field is either honoured (200), accepted because it changes nothing here (200), or refused
with a 400 that names it; a field in neither schema is accepted and logged once. The field lists
are written out from OpenAI's API reference (chat completions, completions) and vLLM's
`ChatCompletionRequest` / `CompletionRequest` (v0.32), so a field added to either schema shows
up here as a decision to make, not a silent drop."""
from __future__ import annotations

import logging

import httpx
import pytest
from server_fixtures import LiveServer, server  # noqa: F401  (the module-scoped fixture)

from nanoserve.server import request_fields

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

OK, REFUSED = 200, 400

# (field, a value a client would send, what the server must answer); chat completions.
CHAT_FIELDS = [
    # OpenAI
    ("audio", {"voice": "alloy", "format": "wav"}, REFUSED), ("frequency_penalty", 0.5, OK),
    ("function_call", "auto", REFUSED), ("functions", [TOOL["function"]], REFUSED), ("logit_bias", {"5": 1}, OK),
    ("logprobs", True, OK), ("max_completion_tokens", 2, OK), ("max_tokens", 2, OK),
    ("metadata", {"k": "v"}, OK), ("modalities", ["text"], OK), ("modalities", ["text", "audio"], REFUSED),
    ("n", 2, OK), ("parallel_tool_calls", False, OK), ("prediction", {"type": "content", "content": "x"}, REFUSED),
    ("presence_penalty", 0.5, OK), ("prompt_cache_key", "k", OK), ("reasoning_effort", "low", OK),
    ("response_format", {"type": "json_object"}, OK), ("safety_identifier", "u1", OK), ("seed", 1, OK),
    ("service_tier", "auto", OK), ("stop", ["\n"], OK), ("store", False, OK), ("stream", False, OK),
    ("stream_options", None, OK), ("temperature", 0.5, OK), ("tool_choice", "auto", OK), ("tools", [TOOL], OK),
    ("top_logprobs", None, OK), ("top_p", 0.9, OK), ("user", "u1", OK), ("verbosity", "low", REFUSED),
    ("web_search_options", {}, REFUSED),
    # vLLM's extras
    ("best_of", 1, OK), ("best_of", 3, REFUSED), ("use_beam_search", False, OK), ("use_beam_search", True, REFUSED),
    ("top_k", 5, OK), ("min_p", 0.1, OK), ("repetition_penalty", 1.2, OK), ("length_penalty", 1.5, REFUSED),
    ("stop_token_ids", [5], OK), ("include_stop_str_in_output", True, OK), ("ignore_eos", True, OK),
    ("min_tokens", 1, OK), ("skip_special_tokens", False, OK), ("spaces_between_special_tokens", True, OK),
    ("spaces_between_special_tokens", False, REFUSED), ("truncate_prompt_tokens", 10, REFUSED),
    ("prompt_logprobs", 1, OK), ("allowed_token_ids", [5, 6], OK), ("bad_words", ["the"], OK),
    ("echo", False, OK), ("echo", True, REFUSED), ("add_generation_prompt", True, OK),
    ("continue_final_message", True, REFUSED), ("add_special_tokens", False, OK), ("documents", [{"text": "d"}], OK),
    ("chat_template", "{{ messages }}", REFUSED), ("chat_template_kwargs", {"enable_thinking": False}, OK),
    ("mm_processor_kwargs", {"x": 1}, REFUSED), ("structured_outputs", {"choice": ["a", "b"]}, OK),
    ("guided_json", {"type": "object"}, OK), ("guided_regex", "[a-z]+", OK), ("guided_choice", ["a"], OK),
    ("guided_grammar", 'start: "a"', OK), ("guided_decoding_backend", "llguidance", OK),
    ("guided_decoding_backend", "xgrammar", REFUSED), ("priority", 0, REFUSED), ("request_id", "r1", OK),
    ("logits_processors", ["m.P"], REFUSED), ("return_tokens_as_token_ids", False, OK),
    ("return_tokens_as_token_ids", True, REFUSED), ("return_token_ids", True, REFUSED), ("cache_salt", "s", OK),
    ("kv_transfer_params", {"a": 1}, REFUSED), ("vllm_xargs", {"a": 1}, REFUSED), ("include_reasoning", True, OK),
    ("include_reasoning", False, REFUSED), ("thinking_token_budget", 10, REFUSED),
    ("media_io_kwargs", {"a": 1}, REFUSED),
    # nanoserve's own
    ("priority", "offline", OK), ("slo", {"ttft": 5.0}, OK), ("timeout", 60.0, OK),
]

COMPLETION_FIELDS = [
    ("best_of", 1, OK), ("echo", True, OK), ("frequency_penalty", 0.3, OK), ("logit_bias", {"5": -1}, OK),
    ("logprobs", 2, OK), ("max_tokens", 2, OK), ("n", 2, OK), ("presence_penalty", 0.3, OK), ("seed", 2, OK),
    ("stop", "x", OK), ("stream", False, OK), ("suffix", "end", REFUSED), ("temperature", 0.0, OK), ("top_p", 0.5, OK),
    ("user", "u", OK), ("add_special_tokens", False, OK), ("response_format", {"type": "json_object"}, OK),
    ("prompt_embeds", "AAAA", REFUSED), ("prompt_logprobs", 0, OK), ("structured_outputs", {"regex": "[0-9]"}, OK),
]


def post(live: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.base_url + path, json=body, timeout=120)


@pytest.mark.parametrize("field,value,status", CHAT_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v, _ in CHAT_FIELDS])
def test_chat_field(server: LiveServer, field, value, status):
    body = {"messages": USER, "max_tokens": 2, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    response = post(server, "/chat/completions", body)
    assert response.status_code == status, response.text
    if status == REFUSED:
        assert response.json()["error"]["param"] == field


@pytest.mark.parametrize("field,value,status", COMPLETION_FIELDS,
                         ids=[f"{f}={v!r}"[:40] for f, v, _ in COMPLETION_FIELDS])
def test_completion_field(server: LiveServer, field, value, status):
    response = post(server, "/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert response.status_code == status, response.text
    if status == REFUSED:
        assert response.json()["error"]["param"] == field


def test_every_undeclared_field_is_sorted():
    """The declared fields of the request models and the two tables cover every field above."""
    from nanoserve.server.protocol import ChatCompletionRequest, CompletionRequest

    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields) | {"json"}
    tables = request_fields.NO_EFFECT | set(request_fields.REFUSED)
    missing = {f for f, _, _ in CHAT_FIELDS + COMPLETION_FIELDS} - declared - tables
    assert not missing


def test_an_unknown_field_is_accepted_and_logged_once(server: LiveServer, caplog):
    with caplog.at_level(logging.WARNING, logger="nanoserve.server"):
        for _ in range(2):
            assert post(server, "/completions", {"prompt": "hi", "max_tokens": 1, "frobnicate": 1}).status_code == OK
    assert sum("frobnicate" in r.getMessage() for r in caplog.records) == 1
