"""What a chat completion's text becomes in the message: reasoning, content and tool calls.

The model writes one stream of text. A reasoning model (Qwen3, DeepSeek-R1) first thinks inside
`<think>…</think>` (reasoning.py: split off as `reasoning_content`, vLLM's `--reasoning-parser`);
a model given tools may answer with Hermes `<tool_call>` blocks (tool_calls.py: parsed into
`message.tool_calls`). The two run in that order, whole (`message`) or streamed (`ChatDeltas`):

    text ─► split reasoning ─► reasoning_content
                             └► content ─► parse tool calls ─► content, tool_calls
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.server.reasoning import ReasoningStream, split_reasoning
from nanoserve.server.tool_call_stream import ToolCallStream
from nanoserve.server.tool_calls import parse_tool_calls

REASONING_PARSERS = ("qwen3", "deepseek_r1")  # both `<think>…</think>`; vLLM's names
TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ChatOutputFormat:
    """How one request's text is read. `tools`: parse tool calls naming these (None: the text is
    all content); `reasoning`: split off `<think>` reasoning, which `starts_in_reasoning` when
    the chat template already opened it in the prompt (Qwen3's)."""

    tools: list[dict[str, Any]] | None = None
    reasoning: bool = False
    starts_in_reasoning: bool = False

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for a finished choice, and whether it calls tools."""
        reasoning, content = split_reasoning(text, self.starts_in_reasoning) if self.reasoning else (None, text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            message["reasoning_content"] = reasoning
        calls = False
        if self.tools is not None:
            parsed = parse_tool_calls(content or "", self.tools)
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
                calls = True
        return message, calls

    def deltas(self) -> ChatDeltas:
        return ChatDeltas(self)


class ChatDeltas:
    """One streamed choice's text deltas turned into message deltas, as `message` would split
    the whole text: reasoning first, then content and tool calls."""

    def __init__(self, fmt: ChatOutputFormat) -> None:
        self._reasoning = ReasoningStream(fmt.starts_in_reasoning) if fmt.reasoning else None
        self._tools = ToolCallStream(fmt.tools) if fmt.tools is not None else None

    @property
    def called_tools(self) -> bool:
        return self._tools is not None and self._tools.tool_call_count > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._through_tools(self._reasoning.feed(text) if self._reasoning is not None
                                   else [{"content": text}] if text else [])

    def finish(self) -> list[dict[str, Any]]:
        out = self._through_tools(self._reasoning.finish() if self._reasoning is not None else [])
        if self._tools is not None:
            out.extend(self._tools.finish())
        return out

    def _through_tools(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self._tools is None:
            return deltas
        out: list[dict[str, Any]] = []
        for delta in deltas:
            if "content" in delta:
                out.extend(self._tools.feed(delta["content"]))
            else:
                out.append(delta)
        return out
