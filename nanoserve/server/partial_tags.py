"""Tags split across streamed deltas: how much of a text's end may still become a tag.

A streamed parser that looks for `<tool_call>` or `</think>` cannot send a delta ending in
`<tool` or `</thi` yet: the next delta may complete the tag. Both stream parsers
(tool_call_stream.py, reasoning.py) hold back exactly what this returns.
"""
from __future__ import annotations


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`: text that may
    become the tag when the next delta comes."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
