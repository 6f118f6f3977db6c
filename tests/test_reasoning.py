"""The `<think>…</think>` reasoning parser: whole outputs, and streams that must agree with them."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.server.reasoning import ReasoningStream, reasoning_end_index, reasoning_ended, split_reasoning


def stream(pieces: list[str], starts_in_reasoning: bool) -> tuple[str | None, str | None, list[dict[str, str]]]:
    """Feed `pieces` to a ReasoningStream; return the joined (reasoning, content) and the deltas."""
    parser = ReasoningStream(starts_in_reasoning)
    deltas = [delta for piece in pieces for delta in parser.feed(piece)] + parser.finish()
    reasoning = "".join(d["reasoning_content"] for d in deltas if "reasoning_content" in d)
    content = "".join(d["content"] for d in deltas if "content" in d)
    return reasoning or None, content or None, deltas


def test_qwen3_writes_its_own_think_block() -> None:
    text = "<think>\nThe user wants Paris.\n</think>\n\nThe capital is Paris."
    assert split_reasoning(text, starts_in_reasoning=False) == ("The user wants Paris.", "The capital is Paris.")


def test_prompt_opened_the_reasoning() -> None:
    text = "Let me think.\nOK.\n</think>\n\nAnswer: 4"
    assert split_reasoning(text, starts_in_reasoning=True) == ("Let me think.\nOK.", "Answer: 4")
    # The model writing `<think>` anyway (an older template) changes nothing.
    assert split_reasoning("<think>\n" + text, starts_in_reasoning=True) == ("Let me think.\nOK.", "Answer: 4")


def test_unclosed_reasoning_is_all_reasoning() -> None:
    assert split_reasoning("<think>\nstill thinking\n", starts_in_reasoning=False) == ("still thinking", None)
    assert split_reasoning("still thinking", starts_in_reasoning=True) == ("still thinking", None)


def test_no_reasoning_is_all_content() -> None:
    assert split_reasoning("Hello </think> there\n", starts_in_reasoning=False) == (None, "Hello </think> there\n")
    assert split_reasoning("Hi <think>x</think>", starts_in_reasoning=False) == (None, "Hi <think>x</think>")
    assert split_reasoning("", starts_in_reasoning=False) == (None, None)
    assert split_reasoning("", starts_in_reasoning=True) == (None, None)


def test_empty_parts_are_none() -> None:
    assert split_reasoning("<think>\n\n</think>\n\nHi", starts_in_reasoning=False) == (None, "Hi")
    assert split_reasoning("\n</think>\n\n", starts_in_reasoning=True) == (None, None)


def test_only_newlines_are_stripped() -> None:
    text = "<think>\n  indented\n\n</think>\n\n  - item\n"
    assert split_reasoning(text, starts_in_reasoning=False) == ("  indented", "  - item\n")


def test_partial_tags_are_held_back() -> None:
    parser = ReasoningStream(starts_in_reasoning=False)
    assert parser.feed("  <thi") == []  # may still open the reasoning
    assert parser.feed("nk>\nStep 1\n</th") == [{"reasoning_content": "Step 1"}]
    assert parser.feed("ink>\n\n") == []
    assert parser.feed("Done") == [{"content": "Done"}]
    assert parser.finish() == []


def test_held_newlines_are_sent_when_reasoning_goes_on() -> None:
    parser = ReasoningStream(starts_in_reasoning=True)
    assert parser.feed("\nA\n\n") == [{"reasoning_content": "A"}]
    assert parser.feed("B</") == [{"reasoning_content": "\n\nB"}]
    assert parser.feed("x") == [{"reasoning_content": "</x"}]
    assert parser.finish() == []


def test_text_that_does_not_open_reasoning_streams_as_content() -> None:
    parser = ReasoningStream(starts_in_reasoning=False)
    assert parser.feed("<b") == [{"content": "<b"}]
    assert parser.feed("</think>\n") == [{"content": "</think>\n"}]
    assert parser.finish() == []


def test_reasoning_ended() -> None:
    assert not reasoning_ended("", starts_in_reasoning=False)
    assert not reasoning_ended(" <thi", starts_in_reasoning=False)
    assert reasoning_ended("Hello", starts_in_reasoning=False)
    assert not reasoning_ended("<think>a</thin", starts_in_reasoning=False)
    assert reasoning_ended("<think>a</think>", starts_in_reasoning=False)
    assert not reasoning_ended("Hello", starts_in_reasoning=True)
    assert reasoning_ended("a</think>", starts_in_reasoning=True)


def test_reasoning_end_index() -> None:
    end = 151668  # Qwen3's `</think>`
    assert reasoning_end_index([5, 6, 7], end) is None
    assert reasoning_end_index([5, end, 7, 8], end) == 2
    assert reasoning_end_index((end, end), end) == 1
    assert reasoning_end_index([], end) is None


# Outputs built from the pieces that matter: tags, their fragments, newlines, other whitespace.
PIECES = ["<think>", "</think>", "<think>\n", "\n</think>\n\n", "<", "</", "<thi", "</th", "think>", "\n", "\n\n",
          " ", "\t", "a", "Bé", "x y", "😀"]
outputs = st.lists(st.sampled_from(PIECES), max_size=14).map("".join)


@st.composite
def split_text(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = draw(outputs)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=400, deadline=None)
@given(split_text(), st.booleans())
def test_stream_agrees_with_whole_text(case: tuple[str, list[str]], starts_in_reasoning: bool) -> None:
    text, pieces = case
    reasoning, content, deltas = stream(pieces, starts_in_reasoning)
    assert (reasoning, content) == split_reasoning(text, starts_in_reasoning)
    for delta in deltas:  # one non-empty field per delta
        assert len(delta) == 1 and next(iter(delta.values()))


@settings(max_examples=200, deadline=None)
@given(outputs, st.booleans())
def test_reasoning_is_final_once_ended(text: str, starts_in_reasoning: bool) -> None:
    """Once `reasoning_ended` says so for a prefix, no later text changes the reasoning."""
    ended_at = next((i for i in range(len(text) + 1) if reasoning_ended(text[:i], starts_in_reasoning)), None)
    if ended_at is None:
        return
    assert all(reasoning_ended(text[:i], starts_in_reasoning) for i in range(ended_at, len(text) + 1))
    assert split_reasoning(text[:ended_at], starts_in_reasoning)[0] == split_reasoning(text, starts_in_reasoning)[0]
