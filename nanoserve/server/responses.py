"""The JSON bodies and SSE chunks nanoserve sends back, in OpenAI's shapes: whole responses,
streamed chunks, usage and logprobs. What clients send is in protocol.py.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from nanoserve.outputs import RequestOutput
from nanoserve.server.chat_output import ChatOutputFormat

PLAIN = ChatOutputFormat()  # the text is all content

# -- responses ------------------------------------------------------------------------------
# Outputs arrive as (choice index, RequestOutput). A RequestOutput's `logprobs` list may be the
# engine's live list, so it is always cut to the length of the `token_ids` snapshot beside it.

Outputs = AsyncIterator[tuple[int, RequestOutput]]


def _logprob_rows(out: RequestOutput, start: int) -> list[dict[int, float]]:
    """`out`'s logprob rows for its tokens from `start` on (set whenever logprobs were asked for)."""
    assert out.logprobs is not None
    return out.logprobs[start:len(out.token_ids)]


def now() -> int:
    return int(time.time())


def sse(payload: Any) -> str:
    """One server-sent event, framed as OpenAI sends them."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens the prefix cache supplied."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_tokens(finals: list[RequestOutput], per_prompt: int) -> int:
    """The prompt tokens found cached, counted once per prompt as its tokens are (its first choice's)."""
    return sum(out.num_cached_tokens for out in finals[::per_prompt])


class IdTokenizer:
    """Stand-in for models served without a tokenizer: logprobs name tokens by id (as vLLM)."""

    def token_to_str(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_to_str(token_id).encode()


def completion_logprobs(tokenizer: Any, token_ids: list[int], rows: list[dict[int, float]],
                        text_offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, one entry per generated token.
    `text_offset` is where the first token's text starts in the choice's text (for streaming)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, row in zip(token_ids, rows):
        text = tokenizer.token_to_str(token_id)
        tokens.append(text)
        token_logprobs.append(row[token_id])
        alternatives: dict[str, float] = {}
        for alt_id, lp in sorted(row.items(), key=lambda kv: -kv[1]):
            alternatives.setdefault(tokenizer.token_to_str(alt_id), lp)  # keep the best of same-text ids
        top.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, token_ids: list[int], rows: list[dict[int, float]],
                  top_n: int) -> list[dict[str, Any]]:
    """The chat shape: `content` entries with the sampled token and exactly `top_n` alternatives.
    The engine's row holds the top-n plus the sampled token, which may rank below them."""
    def entry(token_id: int, lp: float) -> dict[str, Any]:
        return {"token": tokenizer.token_to_str(token_id), "logprob": lp,
                "bytes": list(tokenizer.token_bytes(token_id))}

    content = []
    for token_id, row in zip(token_ids, rows):
        best = sorted(row.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**entry(token_id, row[token_id]), "top_logprobs": [entry(t, lp) for t, lp in best]})
    return content


def prompt_logprobs(tokenizer: Any, out: RequestOutput) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id: {logprob,
    decoded_token}} for the token itself and the top alternatives."""
    if out.prompt_logprobs is None:
        return None
    return [None if row is None else {str(t): {"logprob": lp, "decoded_token": tokenizer.token_to_str(t)}
                                      for t, lp in sorted(row.items(), key=lambda kv: -kv[1])}
            for row in out.prompt_logprobs]


def echo_logprobs(tokenizer: Any, out: RequestOutput) -> dict[str, Any]:
    """The legacy completions shape for an echoed prompt: its first token has no logprob (null),
    as OpenAI returns it."""
    ids, rows = out.prompt_token_ids, out.prompt_logprobs or [None]
    rest = completion_logprobs(tokenizer, ids[1:], [r or {} for r in rows[1:]], len(tokenizer.token_to_str(ids[0])))
    return {"tokens": [tokenizer.token_to_str(ids[0]), *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]], "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]]}


def joined_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


def completion_response(head: dict, finals: list[RequestOutput], tokenizer: Any, logprobs: int | None,
                        prompt_tokens: int, per_prompt: int, echoed: list[str] | None = None) -> dict[str, Any]:
    """`echoed`: per prompt, its text, which starts each of its choices' texts (echo)."""
    choices = []
    for i, out in enumerate(finals):
        text, lp = out.text, None
        prefix = echoed[i // per_prompt] if echoed is not None else None
        if logprobs is not None:
            offset = len(prefix) if prefix is not None else 0
            lp = completion_logprobs(tokenizer, out.token_ids, _logprob_rows(out, 0), offset)
            if prefix is not None:
                lp = joined_logprobs(echo_logprobs(tokenizer, out), lp)
        if prefix is not None:
            text = prefix + text
        choices.append({"index": i, "text": text, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                        "logprobs": lp, "prompt_logprobs": prompt_logprobs(tokenizer, out)})
    return {**head, "choices": choices, "usage": usage(prompt_tokens, sum(len(o.token_ids) for o in finals),
                                                       cached_tokens(finals, per_prompt))}


def chat_finish_reason(out: RequestOutput, called_tools: bool) -> str | None:
    """OpenAI's: "tool_calls" when a choice that stopped by itself called tools."""
    return "tool_calls" if called_tools and out.finish_reason == "stop" else out.finish_reason


def chat_response(head: dict, finals: list[RequestOutput], tokenizer: Any, top_n: int | None,
                  prompt_tokens: int, fmt: ChatOutputFormat = PLAIN) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(finals):
        message, called = fmt.message(out.text)
        choices.append({"index": i, "message": message, "finish_reason": chat_finish_reason(out, called),
                        "stop_reason": out.stop_reason,
                        "logprobs": None if top_n is None else {"content": chat_logprobs(
                            tokenizer, out.token_ids, _logprob_rows(out, 0), top_n)}})
    return {**head, "prompt_logprobs": prompt_logprobs(tokenizer, finals[0]), "choices": choices,
            "usage": usage(prompt_tokens, sum(len(o.token_ids) for o in finals), cached_tokens(finals, len(finals)))}


async def completion_events(outputs: Outputs, *, head: dict, n: int, tokenizer: Any, logprobs: int | None,
                            include_usage: bool, prompt_tokens: int, per_prompt: int,
                            echoed: list[str] | None = None) -> AsyncGenerator[str, None]:
    """Stream chunks for /v1/completions: text deltas, the finish reason on a choice's last one.
    With `echoed` (echo), a choice's first chunk starts with its prompt's text (and logprobs)."""
    extra = {"usage": None} if include_usage else {}
    sent = [0] * n  # tokens already reported, per choice
    offset = [0] * n  # text_offset of the next token, per choice
    started = [False] * n
    completion_tokens = cached = 0
    async for i, out in outputs:
        new_ids = out.token_ids[sent[i]:]
        prefix = echoed[i // per_prompt] if echoed is not None and not started[i] else ""
        if not prefix and not out.new_text and not out.finished and (logprobs is None or not new_ids):
            continue  # text held back (half a character, a possible stop string): nothing to say
        lp = None
        if logprobs is not None:
            if prefix:
                offset[i] = len(prefix)
            lp = completion_logprobs(tokenizer, new_ids, _logprob_rows(out, sent[i]), offset[i])
            offset[i] += sum(len(t) for t in lp["tokens"])
            if prefix:
                lp = joined_logprobs(echo_logprobs(tokenizer, out), lp)
        started[i] = True
        sent[i] = len(out.token_ids)
        if out.finished:
            completion_tokens += len(out.token_ids)
            cached += out.num_cached_tokens if i % per_prompt == 0 else 0
        yield sse({**head, "choices": [{"index": i, "text": prefix + out.new_text, "logprobs": lp,
                                        "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}],
                   **extra})
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)})


async def chat_events(outputs: Outputs, *, head: dict, n: int, tokenizer: Any, top_n: int | None,
                      include_usage: bool, prompt_tokens: int,
                      fmt: ChatOutputFormat = PLAIN) -> AsyncGenerator[str, None]:
    """Stream chunks for /v1/chat/completions, as OpenAI orders them: a `role` delta per choice,
    content (or reasoning, or tool-call) deltas, then a chunk with an empty delta and the
    finish reason."""
    extra = {"usage": None} if include_usage else {}

    def chunk(i: int, delta: dict, finish: str | None = None, logprobs: Any = None, **more: Any) -> str:
        return sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish, **more}], **extra})

    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    sent = [0] * n
    streams = [fmt.deltas() for _ in range(n)]
    completion_tokens = cached = 0
    async for i, out in outputs:
        new_ids = out.token_ids[sent[i]:]
        lp = None
        if top_n is not None and new_ids:
            lp = {"content": chat_logprobs(tokenizer, new_ids, _logprob_rows(out, sent[i]), top_n)}
        sent[i] = len(out.token_ids)
        deltas = streams[i].feed(out.new_text) if out.new_text else []
        if out.finished:
            deltas += streams[i].finish()
        if lp is not None and not deltas:
            deltas = [{"content": ""}]  # the logprobs of tokens whose text is held back
        for k, delta in enumerate(deltas):
            yield chunk(i, delta, logprobs=lp if k == 0 else None)
        if out.finished:
            completion_tokens += len(out.token_ids)
            cached += out.num_cached_tokens if i == 0 else 0
            yield chunk(i, {}, chat_finish_reason(out, streams[i].called_tools), stop_reason=out.stop_reason)
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)})
