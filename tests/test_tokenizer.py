"""nanoserve.tokenizer against transformers' AutoTokenizer (the oracle) on the SmolLM2 directory:
ids, text, chat templates, message validation, and the streaming detokenizer's invariant."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    " leading and trailing spaces  ",
    "",
    "   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "naïve café — “curly quotes” and ‘apostrophes’",
    "emoji 😀🎉👨‍👩‍👧 and flags 🇫🇷",
    "中文，日本語、한국어",
    "numbers 12345 3.14159 -7e10",
    "code: def f(x):\n    return x**2  # comment",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|> <repo_name>",
    "I can't, you're, we'll . , ! ?",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi, how can I help?"}, {"role": "user", "content": "Tell me a joke 😀"}],
    [{"role": "user", "content": "  spaces \n and newlines \n"}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf, text):
    for add_special in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special)
        assert ids == hf(text, add_special_tokens=add_special)["input_ids"]
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_smollm2_special_tokens(tok, hf):
    # No BOS is added by encode (the GGUF says add_bos_token=False; the template writes its own
    # <|im_start|>). <|im_start|> is nonetheless the named bos_token, id 1.
    assert tok.encode("Hi")[0] != tok.bos_token_id == 1 == hf.bos_token_id
    assert tok.eos_token_ids == {0, 2}  # <|im_end|> and <|endoftext|>
    assert tok.vocab_size == len(hf) == 49152
    assert tok.encode("<|im_end|>") == [2]
    assert tok.token_to_str(2) == "<|im_end|>" and tok.token_to_str(tok.encode(" world")[0]) == " world"
    emoji = tok.encode("😀")
    assert len(emoji) > 1 and "".join(tok.token_to_str(i) for i in emoji).startswith("\\xf0")
    assert b"".join(tok.token_bytes(i) for i in emoji) == "😀".encode()


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf, conversation, add_generation_prompt):
    ours = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_chat_template_text_parts_and_extra_kwargs(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "a\nb"}])
    assert tok.apply_chat_template([{"role": "user", "content": "x", "name": None}], unused_kwarg=1)


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    ["not a dict"],
    [{"content": "no role"}],
    [{"role": 3, "content": "role not a string"}],
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": 42}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": ["bare string part"]}],
])
def test_bad_messages_raise_value_error(tok, messages):
    with pytest.raises(ValueError):
        tok.apply_chat_template(messages)


def _copy_tokenizer(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_no_chat_template(smollm2_dir, tmp_path):
    tok = Tokenizer.from_dir(_copy_tokenizer(smollm2_dir, tmp_path, chat_template=None))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="this model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_config_variants_match_transformers(smollm2_dir, tmp_path):
    # transformers v5 ignores add_bos/add_eos_token when tokenizer.json exists (its post-processor
    # decides), ignores clean-up for BPE, and reads an AddedToken-dict bos_token by its content.
    from transformers import AutoTokenizer

    directory = _copy_tokenizer(
        smollm2_dir, tmp_path, add_bos_token=True, add_eos_token=True, clean_up_tokenization_spaces=True,
        bos_token={"__type": "AddedToken", "content": "<|endoftext|>", "special": True,
                   "lstrip": False, "rstrip": False, "normalized": False, "single_word": False})
    for post_processor in (None, {"type": "TemplateProcessing", "pair": [],
                                  "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                             {"Sequence": {"id": "A", "type_id": 0}}],
                                  "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                       "tokens": ["<|endoftext|>"]}}}):
        spec = json.loads((smollm2_dir / "tokenizer.json").read_text())
        spec["post_processor"] = post_processor
        (directory / "tokenizer.json").write_text(json.dumps(spec))
        ours, theirs = Tokenizer.from_dir(directory), AutoTokenizer.from_pretrained(str(directory))
        assert ours.bos_token_id == 0
        for text in TEXTS:
            ids = ours.encode(text)
            assert ids == theirs(text)["input_ids"]
            assert (ids[:1] == [0]) == (post_processor is not None or text.startswith("<|endoftext|>"))
            for skip in (True, False):
                assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)


def _stream(tok: Tokenizer, prompt: list[int], outputs: list[int], skip: bool,
            stream: bool = True) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, stream=stream)
    deltas = [detok.append(t) for t in outputs]
    assert detok.text == "".join(deltas)
    return detok.text, deltas


def _check_stream(tok, prompt, outputs, skip, stream=True):
    streamed, _ = _stream(tok, prompt, outputs, skip, stream)
    full = tok.decode(outputs, skip_special_tokens=skip)
    held_back = full[len(streamed):]
    assert full.startswith(streamed)
    # Only an unfinished character at the very end may be held back.
    assert held_back == "" or held_back.endswith("\ufffd"), (streamed, full)


@pytest.mark.parametrize("stream", [True, False], ids=["DecodeStream", "python"])
def test_stream_multibyte_text(tok, stream):
    text = "Hé 😀 漢字 and 👨‍👩‍👧!"
    ids = tok.encode(text)
    streamed, deltas = _stream(tok, tok.encode("Say: "), ids, True, stream)
    assert streamed == text and "" in deltas  # some tokens end mid-character
    assert not any("\ufffd" in d for d in deltas)


def test_stream_decodes_small_windows(tok, monkeypatch):
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 20)
    sizes: list[int] = []
    original = tok.decode_raw

    def spy(window, skip=True):
        sizes.append(len(window))
        return original(window, skip)

    monkeypatch.setattr(tok, "decode_raw", spy)
    detok = IncrementalDetokenizer(tok, ids[:30], stream=False)  # the Python path
    for t in ids[30:]:
        detok.append(t)
    assert max(sizes) <= 7  # O(1) per token, not O(length)


@pytest.fixture(scope="module")
def partial_utf8_ids(tok) -> list[int]:
    """Token ids whose bytes are not valid UTF-8 on their own (pieces of multi-byte characters)."""
    found = []
    for i in range(tok.vocab_size):
        try:
            tok.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            found.append(i)
    assert len(found) > 50
    return found


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_concatenates_to_full_decode(tok, partial_utf8_ids, data):
    token = st.one_of(
        st.integers(0, tok.vocab_size - 1),  # anything, including special tokens
        st.sampled_from(partial_utf8_ids),  # pieces of multi-byte characters
        st.sampled_from(tok.encode("é 😀 漢字 👨‍👩‍👧 ∑ Ω")),  # characters split across tokens
    )
    prompt = tok.encode(data.draw(st.text(max_size=20), label="prompt"))
    outputs = data.draw(st.lists(token, max_size=40), label="outputs")
    _check_stream(tok, prompt, outputs, data.draw(st.booleans(), label="skip_special_tokens"),
                  data.draw(st.booleans(), label="DecodeStream"))
