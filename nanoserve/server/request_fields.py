"""What happens to each field a client may send that the request models do not declare.

The promise (docs/reference/server.md): a field that would change the output is honoured or refused, never
dropped. The request models (`protocol.py`) declare every field nanoserve honours, and every
field it refuses at values other than a neutral one (`best_of`, `use_beam_search`, ...). A body
may also carry fields of OpenAI's or vLLM's schemas that the models do not declare; they land
here, sorted three ways:

* `NO_EFFECT`: fields those servers accept that change nothing here either (`user`, `store`,
  `service_tier`, ...): accepted, as OpenAI and vLLM accept them;
* `REFUSED`: fields that would change the output and that nanoserve does not implement: a 400
  that names the field and says why;
* anything else: not a field of either schema (a typo, a newer API): accepted and logged once per
  name, as vLLM does, so an operator sees what clients send and nobody's request breaks.

The lists follow OpenAI's API reference (chat completions and completions, 2026) and vLLM's
`ChatCompletionRequest`/`CompletionRequest` (v0.32); tests/test_request_fields.py sends every field
of both schemas.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from nanoserve.server.errors import APIError

log = logging.getLogger("nanoserve.server")

NO_EFFECT = frozenset({
    "user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",  # OpenAI
    "prompt_cache_retention", "request_id", "cache_salt",  # vLLM's: ids and cache isolation
    "spaces_between_special_tokens",  # our tokenizers never insert spaces between special tokens
    "return_tokens_as_token_ids", "return_token_ids",  # refused below when true
    "guided_decoding_backend", "structured_outputs_backend",  # one backend here (refused below if another)
    "modalities",  # ["text"] is what we make; anything else is refused below
    "include_reasoning",  # vLLM: true (the default) returns reasoning_content, as we do; false refused
})

REFUSED: dict[str, str] = {
    "audio": "audio output is not supported (text models only)",
    "prediction": "predicted outputs (speculative decoding) are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated `functions` field is not supported; send `tools`",
    "function_call": "the deprecated `function_call` field is not supported; send `tool_choice`",
    "verbosity": "verbosity is an OpenAI-model setting that this model does not have",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported; shorten the prompt",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "multi_modal_data": "multimodal inputs are not supported",
    "logits_processors": "custom logits processors are not supported",
    "kv_transfer_params": "KV transfer between servers is not supported",
    "vllm_xargs": "vllm_xargs is not supported",
    "chat_template": "a per-request chat template is not supported; start the server with --chat-template",
    "continue_final_message": "continue_final_message is not supported",
    "thinking_token_budget": "a thinking-token budget is not supported",
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
    "media_io_kwargs": "multimodal inputs are not supported",
    "priority_level": "priority_level is not supported (see nanoserve's `priority`: online or offline)",
}

# A field in NO_EFFECT that *does* change the output at some values is refused at those.
_NEUTRAL: dict[str, Any] = {"return_tokens_as_token_ids": False, "return_token_ids": False,
                            "spaces_between_special_tokens": True, "modalities": ["text"],
                            "include_reasoning": True}
_BACKENDS = (None, "auto", "guidance", "llguidance")

_logged: set[str] = set()


def check_extra_fields(extra: Mapping[str, Any] | None) -> None:
    """Refuse (400) or accept each undeclared field of a request body; log unknown ones once."""
    for name, value in (extra or {}).items():
        if name in REFUSED:
            if value is None:
                continue  # null means "the default", as for every declared field
            raise APIError(f"{name} is not supported by this server: {REFUSED[name]}.", param=name)
        if name in NO_EFFECT:
            neutral = _NEUTRAL.get(name, value)
            if value is not None and value != neutral:
                raise APIError(f"{name}={value!r} is not supported by this server.", param=name)
            if name.endswith("_backend") and value not in _BACKENDS:
                raise APIError(f"{name}={value!r} is not available: this server's structured outputs use "
                               "llguidance.", param=name)
            continue
        if name not in _logged:
            _logged.add(name)
            log.warning("ignoring the unknown request field %r (logged once per name)", name)
