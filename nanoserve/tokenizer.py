"""The engine's tokenizer: `tokenizer.json` through the `tokenizers` library, plus chat templates.

nanoserve does not depend on `transformers` at run time, yet it must produce the very ids and text
`transformers` would, or its outputs could not be compared with HF's. So this module reimplements
the few behaviours of `transformers`' tokenizer that change results:

* **Special tokens.** The named tokens in `tokenizer_config.json` (`bos_token`, ...) are registered
  as special. What encode() adds (BOS...) is decided by `tokenizer.json`'s post-processor alone:
  transformers v5 drops `add_bos_token`/`add_eos_token` from the config when that file exists.
  SmolLM2 adds nothing: its chat template writes `<|im_start|>` itself.
* **Decoding.** `clean_up_tokenization_spaces` is honoured as transformers v5 does: never for a
  BPE model (it would delete real spaces before punctuation) unless the config insists.
* **Chat templates.** Rendered with the same sandboxed Jinja environment, globals, `tojson`
  filter and variables as `transformers.apply_chat_template(tokenize=False)`.

`IncrementalDetokenizer` turns a stream of token ids into text deltas without re-decoding the whole
output each step, using the prefix/read-offset scheme of vLLM and TGI: decode a small window of
recent tokens, and emit only text that no later token can change.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

_DecodeStream: type[DecodeStream] | None
try:
    from tokenizers.decoders import DecodeStream
    _DecodeStream = DecodeStream
except ImportError:  # tokenizers < 0.21
    _DecodeStream = None

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


class Tokenizer:
    """A model's tokenizer and chat template, as `transformers.AutoTokenizer` would load them."""

    def __init__(self, backend: _Backend, tokenizer_config: dict[str, Any],
                 eos_token_ids: frozenset[int], chat_template: str | None) -> None:
        self._tok = backend
        self._config = tokenizer_config
        self.special_tokens: dict[str, str] = {
            name: value for name in _SPECIAL_TOKEN_NAMES
            if (value := _token_content(tokenizer_config.get(name))) is not None}
        self._register_special_tokens()
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos is not None else None
        eos = self.special_tokens.get("eos_token")
        eos_id = backend.token_to_id(eos) if eos is not None else None
        self.eos_token_ids: frozenset[int] = eos_token_ids | ({eos_id} if eos_id is not None else set())
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = chat_template
        # Byte-level decoders (GPT-2 style, possibly inside a Sequence) spell bytes as characters.
        self._byte_level = backend.decoder is not None and b'"ByteLevel"' in backend.decoder.__getstate__()
        self._clean_up = bool(tokenizer_config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE" or bool(tokenizer_config.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))
        self._template: jinja2.Template | None = None
        self._token_strs: dict[int, str] = {}

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer in `path`; `chat_template` (a file, or the template's text: vLLM's
        --chat-template) replaces the model's own."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (nanoserve needs a fast tokenizer)")
        backend = _Backend.from_file(str(path / "tokenizer.json"))
        config = {**_read_json(path / "special_tokens_map.json"), **_read_json(path / "tokenizer_config.json")}
        eos: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            value = _read_json(path / name).get("eos_token_id")
            eos.update([value] if isinstance(value, int) else value or [])
        template = read_chat_template(chat_template) if chat_template is not None else _chat_template(path, config)
        return cls(backend, config, frozenset(eos), template)

    def _register_special_tokens(self) -> None:
        # transformers makes every named special token, and any extra listed ones, special in the
        # backend. (It ignores add_bos_token/add_eos_token when there is a tokenizer.json: that
        # file's post-processor alone decides what encode() adds, so nothing to do for those.)
        extra = self._config.get("additional_special_tokens") or self._config.get("extra_special_tokens")
        if isinstance(extra, dict):  # {"image_token": "<image>", ...}
            extra = list(extra.values())
        names = [*self.special_tokens.values(), *(_token_content(t) for t in (extra or []))]
        known = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        self._tok.add_special_tokens([AddedToken(n, special=True, normalized=False)
                                      for n in dict.fromkeys(names) if n and n not in known])

    # -- ids <-> text ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.decode_raw(ids, skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    @property
    def backend(self) -> _Backend:
        """The `tokenizers` tokenizer underneath (what a `DecodeStream` steps with)."""
        return self._tok

    def decode_raw(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """decode() without the clean-up pass, which is not local enough to stream."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_to_str(self, token_id: int) -> str:
        """The text of one token, e.g. for logprobs. A byte-level token that is only part of a
        UTF-8 character shows its bytes escaped (`\\xe2\\x80`), as OpenAI's API does."""
        if (cached := self._token_strs.get(token_id)) is None:
            if self._byte_level:
                cached = self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")
            else:
                cached = self._tok.decode([token_id], skip_special_tokens=False)
            self._token_strs[token_id] = cached
        return cached

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token's piece is spelled in GPT-2's
        printable byte alphabet; anything else is its decoded text in UTF-8)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self._tok.decode([token_id], skip_special_tokens=False).encode()

    # -- chat --------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render a conversation to the prompt text, as `transformers` does with tokenize=False.

        Message content may be a string or a list of OpenAI-style `{"type": "text", "text": ...}`
        parts, which are joined with newlines (as vLLM does). Raises ValueError for bad messages.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        chat = _validate_messages(messages)
        if self._template is None:
            try:
                self._template = _jinja_env().from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise ValueError(f"the model's chat template does not compile: {exc}") from exc
        variables = {"tools": None, "documents": None, **self.special_tokens, **extra}
        try:
            return self._template.render(messages=chat, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as exc:  # e.g. raise_exception("roles must alternate")
            raise ValueError(f"chat template error: {exc}") from exc


class IncrementalDetokenizer:
    """Streams the text of generated tokens, one delta per appended token.

    Two offsets into the token list: text up to `read_offset` has been emitted; decoding starts a
    few tokens earlier at `prefix_offset`, because a token's text can depend on its neighbour (a
    sentencepiece word-start space, bytes of one character split over tokens). Each step decodes
    only `ids[prefix_offset:]` and emits what goes past the text of `ids[prefix_offset:read_offset]`
    -- unless it ends in U+FFFD, the mark of a character whose remaining bytes have not arrived.
    The deltas concatenate to `tokenizer.decode(outputs)` (less any unfinished last character).

    Where the `tokenizers` library has `DecodeStream` (0.22 and later), that does the same in
    Rust, one call per token (about 2 us against 4-30 us here; a step of 64 requests spent most
    of its CPU time detokenizing, benchmarks/RESULTS.md). `stream=False` keeps the Python path.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stream: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # A few prompt tokens of context, so the first output token decodes as it would mid-text;
        # the rest of the prompt is never looked at again.
        self._ids = [int(t) for t in prompt_token_ids[-5:]]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._text = ""
        self._stream = None
        # A context that ends mid-character makes DecodeStream emit that context's pending
        # bytes with the first output token; the Python path handles it (rare: a prompt
        # that ends inside a character).
        if (stream and _DecodeStream is not None
                and not tokenizer.decode_raw(self._ids, skip_special_tokens).endswith("\ufffd")):
            try:
                self._stream = _DecodeStream(ids=list(self._ids), skip_special_tokens=skip_special_tokens)
            except TypeError:  # a DecodeStream that takes no context (tokenizers 0.21)
                self._stream = None

    @property
    def text(self) -> str:
        return self._text

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (may be empty)."""
        if self._stream is not None:
            delta = self._stream.step(self._tokenizer.backend, int(token_id)) or ""
            self._text += delta
            return delta
        self._ids.append(token_id)
        decode = self._tokenizer.decode_raw
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = decode(self._ids[self._prefix_offset:], self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text += delta
        return delta


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the OpenAI message shape, and return plain copies with text content joined."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, not {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise ValueError(f"messages[{i}].content[{j}] must be "
                                     "{'type': 'text', 'text': <string>} (only text is supported)")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is None and message.get("role") == "assistant" and message.get("tool_calls"):
            content = ""  # OpenAI's assistant turn that only called tools (templates render the calls)
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}] needs a 'content' that is a string or a list of text parts")
        # transformers drops None-valued keys (e.g. "name": None), which templates handle better.
        chat.append({**{k: v for k, v in message.items() if v is not None}, "content": content})
    return chat


class _GenerationTag(jinja2.ext.Extension):
    # transformers' `{% generation %}` marks assistant text for training masks; rendering ignores it.
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in: sandboxed, same options/globals."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def read_chat_template(value: str) -> str:
    """A chat template given by the user: the text of a file, or the template itself (it has
    Jinja's `{{` or `{%`); anything else is a file that does not exist."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"chat template {value!r}: no such file (give a file, or the template's text)")
    return path.read_text()


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (path / "chat_template.jinja").is_file():  # transformers v5 saves here
        template = (path / "chat_template.jinja").read_text()
    if template is None:
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def _token_content(value: Any) -> str | None:
    # tokenizer_config may hold a token as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):
        text = text.replace(before, after)
    return text


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte spelled as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


_UNICODE_TO_BYTE = {char: byte for byte, char in bytes_to_unicode().items()}
