"""Reasoning ("thinking") output: `<think>…</think>` models such as Qwen3 and DeepSeek-R1.

These models think before they answer, and write the thinking between tags::

    <think>
    The user wants the capital of France. That is Paris.
    </think>

    The capital of France is Paris.

An OpenAI-style server returns the two parts apart, as vLLM's `--reasoning-parser` does: the
thinking as the message's `reasoning_content`, the answer as its `content`. Two things vary:

* **Who opens the reasoning.** Some chat templates end the prompt with `<think>\\n` (DeepSeek-R1's,
  Qwen3's thinking models): the output *starts inside* the reasoning and only `</think>` appears in
  it (`starts_in_reasoning=True`). Others let the model write `<think>` itself, as the first thing
  in its output (leading whitespace aside). A `<think>` anywhere else is ordinary text: an output
  that neither starts in reasoning nor opens it is all content, `</think>`s included.
* **Whether it closes.** With no `</think>`, an output that is in reasoning is all reasoning (it
  was cut short, by max_tokens say); the content is empty.

The tags are dropped, and so are the newlines the template puts around them: the newlines at both
ends of the reasoning and those that begin the content, as Qwen3's chat template does when it
renders an earlier answer back into the prompt. (vLLM's parsers drop only the tags, which leaves
`content` starting with "\\n\\n".) Other whitespace is the model's and is kept.

`split_reasoning` splits a whole output; `ReasoningStream` splits a stream of text deltas into
OpenAI deltas with the same result. Structured outputs (a grammar, a JSON schema) apply to the
content only, so the engine must know when the reasoning is over: `reasoning_ended` answers from
the text, `reasoning_end_index` cheaply from token ids when `</think>` is a single token (it is in
Qwen3's and DeepSeek-R1's vocabularies).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from nanoserve.server.partial_tags import partial_tag_length

THINK_START = "<think>"
THINK_END = "</think>"

Delta = dict[str, Any]


def _after_opening_tag(text: str) -> str | None:
    """The text after the `<think>` that opens the output (after leading whitespace), or None if
    the output does not open with one."""
    stripped = text.lstrip()
    return stripped[len(THINK_START):] if stripped.startswith(THINK_START) else None


def split_reasoning(text: str, starts_in_reasoning: bool) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; None for a part that is empty.

    `starts_in_reasoning`: the prompt ended inside the reasoning (its template wrote `<think>`).
    """
    rest = _after_opening_tag(text)
    if rest is None:
        if not starts_in_reasoning:  # no reasoning at all: the text is the content, untouched
            return None, text or None
        rest = text
    reasoning, _, content = rest.partition(THINK_END)
    reasoning = reasoning.strip("\n")
    content = content.lstrip("\n")
    return reasoning or None, content or None


def reasoning_ended(text: str, starts_in_reasoning: bool) -> bool:
    """Whether the output `text` has reached its content: `</think>` closed the reasoning, or the
    output shows it will not open any (it is neither in reasoning nor starting with `<think>`)."""
    rest = _after_opening_tag(text)
    if rest is not None:
        return THINK_END in rest
    if starts_in_reasoning:
        return THINK_END in text
    stripped = text.lstrip()
    return bool(stripped) and not THINK_START.startswith(stripped)


def reasoning_end_index(token_ids: Sequence[int], end_token_id: int) -> int | None:
    """The index in `token_ids` (an output that is in reasoning) where the content begins: just
    after the first `</think>` token, whose id is `end_token_id`; None while the reasoning goes on.
    """
    try:
        return token_ids.index(end_token_id) + 1
    except ValueError:
        return None


class ReasoningStream:
    """One choice's stream of text deltas turned into OpenAI deltas, `{"reasoning_content": ...}`
    and `{"content": ...}`, that join into what `split_reasoning` gives for the whole text.

    Text is held back only while its part is undecided: at the start, whitespace or a partial
    `<think>` (does the model open reasoning?); in the reasoning, a partial `</think>` and trailing
    newlines (they are dropped if the reasoning ends there); after `</think>`, leading newlines.
    """

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._phase: Literal["start", "reasoning", "content"] = "start"
        self._pending = ""  # text received and not yet sent
        self._reasoning_sent = False  # before any is sent, leading newlines are dropped
        self._strip_content = False  # the content follows `</think>`: drop its leading newlines
        self._content_sent = False

    def feed(self, delta_text: str) -> list[Delta]:
        """The deltas that `delta_text`, the next piece of the output, lets us send."""
        self._pending += delta_text
        out: list[Delta] = []
        if self._phase == "start":
            rest = _after_opening_tag(self._pending)
            stripped = self._pending.lstrip()
            if rest is not None:
                self._pending = rest
                self._phase = "reasoning"
            elif not stripped or THINK_START.startswith(stripped):
                return out  # it may still open with `<think>`
            else:
                self._phase = "reasoning" if self._starts_in_reasoning else "content"
        if self._phase == "reasoning":
            end = self._pending.find(THINK_END)
            if end < 0:
                undecided = partial_tag_length(self._pending, THINK_END)
                sendable = self._pending[:len(self._pending) - undecided].rstrip("\n")
                self._send_reasoning(sendable, out)
                self._pending = self._pending[len(sendable):]
                return out
            self._send_reasoning(self._pending[:end].rstrip("\n"), out)
            self._pending = self._pending[end + len(THINK_END):]
            self._phase = "content"
            self._strip_content = True
        self._send_content(out)
        return out

    def finish(self) -> list[Delta]:
        """The deltas still held back, once the output is complete."""
        out: list[Delta] = []
        if self._phase == "start":  # whitespace or a partial `<think>`: not an opening after all
            self._phase = "reasoning" if self._starts_in_reasoning else "content"
        if self._phase == "reasoning":  # no `</think>`: the reasoning was cut short
            self._send_reasoning(self._pending.rstrip("\n"), out)
            self._pending = ""
        else:
            self._send_content(out)
        return out

    def _send_reasoning(self, text: str, out: list[Delta]) -> None:
        if not self._reasoning_sent:
            text = text.lstrip("\n")
        if text:
            out.append({"reasoning_content": text})
            self._reasoning_sent = True

    def _send_content(self, out: list[Delta]) -> None:
        text, self._pending = self._pending, ""
        if self._strip_content and not self._content_sent:
            text = text.lstrip("\n")
        if text:
            out.append({"content": text})
            self._content_sent = True
