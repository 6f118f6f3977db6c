"""Hermes tool calls (see `tool_calls`) found in a stream of text deltas, as OpenAI streams them.

A streamed chat completion sends the message in pieces ("deltas"). Content goes out as
`{"content": "..."}` as it is generated; a tool call goes out as a first delta that opens it::

    {"tool_calls": [{"index": 0, "id": "call_…", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}]}

followed by deltas that each add a piece of its arguments' JSON string::

    {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": \\"Paris\\"}"}}]}

The stream must say what `parse_tool_calls` says of the whole text: the same content once the
pieces are joined, and the same calls. So the parser is careful in three places:

* **A tag split across deltas.** A delta may end in `<tool` : text that may be the start of
  `<tool_call>` is held back until the next delta shows whether it is.
* **A block is sent when it closes.** Whether a block is a call at all (valid JSON, a known
  function) is only known at `</tool_call>`, and the arguments are sent as `parse_tool_calls`
  re-serializes them (`json.dumps`), which is not the text the model wrote. So a block is buffered
  until it closes, then sent as its opening delta and one delta with the whole arguments; a block
  that is not a call is sent as content instead. Tool calls are short, so the client waits for at
  most one call's tokens, and the arguments it receives are exactly the non-streaming ones.
* **Stripped content.** `parse_tool_calls` strips the content, so leading whitespace is dropped and
  trailing whitespace is held back until more content follows it (the "\\n" between text and a
  call, say, is sent only if text comes after the call).

At `finish()` a block the output ended inside is sent as content: the model did not complete it.
"""
from __future__ import annotations

from typing import Any

from nanoserve.server.partial_tags import partial_tag_length
from nanoserve.server.tool_calls import TOOL_CALL_END, TOOL_CALL_START, tool_call_from_block, tool_names

Delta = dict[str, Any]


class ToolCallStream:
    """One choice's stream of text deltas turned into OpenAI chat-completion deltas."""

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self._names = tool_names(tools)
        self._pending = ""  # text received and not yet sent: a partial tag, or an open block's body
        self._in_block = False  # `_pending` is the body of an open `<tool_call>` block
        self._searched = 0  # how much of an open block's body holds no `</tool_call>`
        self._content_started = False  # content sent yet (leading whitespace is dropped before)
        self._held_space = ""  # trailing whitespace of the content, sent if more content follows
        self.tool_call_count = 0  # calls sent so far (the finish_reason is "tool_calls" if any)

    def feed(self, delta_text: str) -> list[Delta]:
        """The deltas that `delta_text`, the next piece of the output, lets us send."""
        self._pending += delta_text
        out: list[Delta] = []
        while True:
            if self._in_block:
                # Resume the search where the last one stopped, less a tag's length: the tag may
                # have been cut in two.
                end = self._pending.find(TOOL_CALL_END, max(0, self._searched - len(TOOL_CALL_END) + 1))
                if end < 0:
                    self._searched = len(self._pending)
                    return out
                body = self._pending[:end]
                self._pending = self._pending[end + len(TOOL_CALL_END):]
                self._in_block = False
                call = tool_call_from_block(body, self._names)
                if call is None:  # the model failed to make a call: its text is content
                    self._content(TOOL_CALL_START + body + TOOL_CALL_END, out)
                else:
                    self._call(call, out)
            else:
                start = self._pending.find(TOOL_CALL_START)
                if start < 0:
                    keep = partial_tag_length(self._pending, TOOL_CALL_START)
                    cut = len(self._pending) - keep
                    self._content(self._pending[:cut], out)
                    self._pending = self._pending[cut:]
                    return out
                self._content(self._pending[:start], out)
                self._pending = self._pending[start + len(TOOL_CALL_START):]
                self._in_block = True
                self._searched = 0

    def finish(self) -> list[Delta]:
        """The deltas still held back, once the output is complete."""
        out: list[Delta] = []
        # An unclosed block, or a partial tag, is text after all.
        self._content((TOOL_CALL_START if self._in_block else "") + self._pending, out)
        self._pending = ""
        self._in_block = False
        self._held_space = ""  # trailing whitespace: stripped
        return out

    def _content(self, text: str, out: list[Delta]) -> None:
        if not self._content_started:
            text = text.lstrip()
        text = self._held_space + text
        kept = text.rstrip()
        self._held_space = text[len(kept):]
        if not kept:
            return
        self._content_started = True
        if out and "content" in out[-1]:  # one delta rather than two in a row
            out[-1]["content"] += kept
        else:
            out.append({"content": kept})

    def _call(self, call: dict[str, Any], out: list[Delta]) -> None:
        index = self.tool_call_count
        self.tool_call_count += 1
        function = call["function"]
        out.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                    "function": {"name": function["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": index, "function": {"arguments": function["arguments"]}}]})
