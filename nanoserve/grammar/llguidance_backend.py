"""The default grammar backend, on llguidance (github.com/guidance-ai/llguidance).

Why llguidance:

* **No transformers, no torch at its core.** Its tokenizer (`LLTokenizer`) is built straight from
  the `tokenizers` JSON that nanoserve already loads (`Tokenizer.backend.to_str()`), so the
  engine keeps its one tokenizer and no `transformers` dependency.
* **Fast masks, no precompilation.** It walks a trie of the vocabulary with a lazily built lexer
  and an Earley parser: tens of microseconds per mask (5-20 us measured for JSON schemas over
  SmolLM2's 49k tokens), and compiling a grammar is typically under a millisecond, so even a new
  schema per request does not stall the step.
* **One library for every constraint**: JSON schema, regex and (Lark) context-free grammars.
* **Batched masks**: `LLExecutor` fills the bitmask rows of a whole batch in parallel on its own
  Rust threads, without the GIL.

xgrammar would plug in by implementing the same three classes (`GrammarBackend`,
`CompiledGrammar`, `GrammarMatcher`) and registering itself in `nanoserve.grammar.BACKENDS`.

How a constraint becomes a grammar (`_grammar_text`):

    json         LLMatcher.grammar_from_json_schema(schema, defaults={whitespace options})
    json_object  the same, for the schema {"type": "object"} (llguidance's own advice)
    regex        LLMatcher.grammar_from_regex (Rust regex syntax; the whole output must match)
    choice       the Lark grammar  start: "a" | "b" | ...  (JSON string escapes are Lark's too)
    grammar      Lark as given; GBNF (a "::=" and no Lark `start:`) converted with gbnf_to_lark

JSON whitespace. llguidance allows any run of whitespace wherever JSON does, and so does vLLM
by default (`whitespace_flexible`, unless `disable_any_whitespace`). A small model under a mask
that allows whitespace will happily emit newline after newline, each one another token. The
default here, `JSON_WHITESPACE`, is llguidance's bounded `whitespace_pattern`: at most one line
break and 20 spaces or tabs at each place, enough for any pretty-printing and no more. Pass
`json_whitespace=None` for llguidance's unbounded default, or "" for compact JSON.

What llguidance does that the wrapper below evens out (`LLGuidanceMatcher`):

* Consuming a token the grammar does not allow puts an `LLMatcher` into an error state it never
  leaves. `accept` first asks `validate_tokens`, so a refused token leaves the matcher usable.
* When the grammar is complete and cannot go on, the `LLMatcher` is "stopped" and its mask allows
  only EOS; consuming that EOS then succeeds but does not count as a token (a later rollback
  would undo one token too many). When the grammar is complete but could go on, EOS is an
  ordinary token. The wrapper counts both the same and remembers which it was.
"""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence

import llguidance
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark, is_lark_syntax

from nanoserve.grammar.backend import GrammarBackend
from nanoserve.grammar.bitmask import check_bitmask
from nanoserve.grammar.compiled import CompiledGrammar
from nanoserve.grammar.matcher import GrammarMatcher
from nanoserve.structured_outputs import StructuredOutputsParams
from nanoserve.tokenizer import Tokenizer

# At each place JSON allows whitespace: spaces/tabs, or one line break and indentation.
# llguidance matches the pattern at most once per place, so the bounds hold.
JSON_WHITESPACE = r"[\x20\x09]{1,20}|\x0D?\x0A[\x20\x09]{0,20}"

# What each constraint is called in a client-facing error message.
_WHAT = {"json": "invalid JSON schema", "json_object": "invalid JSON object constraint",
         "regex": "invalid regex", "choice": "invalid choice", "grammar": "invalid grammar"}
# llguidance places an error in the Lark source ("at 1(8): ...", then the failing line and a caret
# under it); for a regex or choice the client wrote no Lark, so that position only confuses.
_LARK_POSITION = re.compile(r"^at \d+\(\d+\): |\n\s*\d+ \|.*", re.DOTALL)


class LLGuidanceBackend(GrammarBackend):
    """Compiles constraints with llguidance for one tokenizer and model vocabulary size.

    The `LLTokenizer` (about 0.2 s for a 49k vocabulary: a token trie and lexer tables) is built on
    first `compile`, on the compiler's thread, so making the backend and `check` cost nothing.
    """

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, json_whitespace: str | None = JSON_WHITESPACE,
                 mask_threads: int | None = None) -> None:
        """`json_whitespace`: see the module docstring. `mask_threads`: the threads of the pool that
        fills a batch's bitmask rows (llguidance's default, None, is 80% of the CPUs up to 32)."""
        self._tokenizer = tokenizer
        self._mask_threads = mask_threads
        self._executor: llguidance.LLExecutor | None = None
        # Bitmask rows must cover every token llguidance knows; a model padded past its tokenizer
        # (vocab_size > the tokenizer's) gets those extra tokens, which have no text and are never
        # allowed.
        self._vocab_size = max(vocab_size, tokenizer.vocab_size)
        if json_whitespace is None:
            self._json_options: llguidance._lib.JsonCompileOptions = {"whitespace_flexible": True}
        elif json_whitespace == "":
            self._json_options = {"whitespace_flexible": False}
        else:
            self._json_options = {"whitespace_pattern": json_whitespace}
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()  # compiles on several threads build it once
        self._executor_lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def mask_executor(self) -> llguidance.LLExecutor:
        """The thread pool that fills a batch's bitmask rows (made on first use; thread-safe)."""
        with self._executor_lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=self._mask_threads)
            return self._executor

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (built on first use; thread-safe)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                eos = sorted(self._tokenizer.eos_token_ids)
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self._vocab_size, eos_token=eos or None)
            return self._ll_tokenizer

    def check(self, spec: StructuredOutputsParams) -> None:
        grammar = self._grammar_text(spec)
        # Without a tokenizer llguidance checks the grammar itself (its syntax, the schema's
        # keywords, the regexes) in well under a millisecond for ordinary schemas.
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ValueError(self._message(spec, messages[0] if messages else "rejected by llguidance"))

    def compile(self, spec: StructuredOutputsParams) -> LLGuidanceCompiledGrammar:
        grammar = self._grammar_text(spec)
        # The constructor never raises for a bad grammar: the matcher is born in an error state.
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(self._message(spec, matcher.get_error()))
        return LLGuidanceCompiledGrammar(matcher, frozenset(self.ll_tokenizer.eos_tokens), self._vocab_size,
                                         self.mask_executor)

    def _grammar_text(self, spec: StructuredOutputsParams) -> str:
        """llguidance's serialized grammar for the constraint; ValueError if it cannot be made."""
        kind = spec.kind
        try:
            if kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(spec.schema, defaults=self._json_options)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=self._json_options)
            if kind == "regex":
                assert spec.regex is not None
                return llguidance.LLMatcher.grammar_from_regex(spec.regex)
            if kind == "choice":
                assert spec.choice is not None
                # A JSON string literal is a valid Lark literal with the same escapes (\", \\, \n,
                # \uXXXX), so json.dumps quotes any string safely.
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in spec.choice))
            assert kind == "grammar" and spec.grammar is not None
            text = spec.grammar
            if "::=" in text and not is_lark_syntax(text):
                text = gbnf_to_lark(text)
            return llguidance.LLMatcher.grammar_from_lark(text)
        except (ValueError, GbnfToLarkError) as exc:
            raise ValueError(self._message(spec, str(exc))) from exc

    @staticmethod
    def _message(spec: StructuredOutputsParams, detail: str) -> str:
        if spec.kind in ("regex", "choice"):
            detail = _LARK_POSITION.sub("", detail)
        return f"structured_outputs.{spec.kind}: {_WHAT[spec.kind]}: {detail.strip()}"


class LLGuidanceCompiledGrammar(CompiledGrammar):
    """A compiled llguidance grammar: a pristine `LLMatcher` that each request deep-copies.

    `LLMatcher.deep_copy` shares the compiled grammar and lexer and copies only the parser state
    (under a microsecond), so a matcher per request is nearly free once the grammar is compiled.
    """

    def __init__(self, pristine: llguidance.LLMatcher, eos_token_ids: frozenset[int], vocab_size: int,
                 mask_executor: Callable[[], llguidance.LLExecutor]) -> None:
        self._pristine = pristine
        self._eos_token_ids = eos_token_ids
        self._vocab_size = vocab_size
        self._mask_executor = mask_executor
        # llguidance does not document deep_copy as safe from several threads at once on one
        # matcher; requests arrive on one thread in practice, so taking turns costs nothing.
        self._lock = threading.Lock()

    def matcher(self) -> LLGuidanceMatcher:
        with self._lock:
            copy = self._pristine.deep_copy()
        return LLGuidanceMatcher(copy, self._eos_token_ids, self._vocab_size, self._mask_executor)


class LLGuidanceMatcher(GrammarMatcher):
    """One request's `LLMatcher`, with nanoserve's accept/rollback/termination rules (module
    docstring: refused tokens leave it usable; EOS counts as a token however llguidance took it)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int], vocab_size: int,
                 mask_executor: Callable[[], llguidance.LLExecutor]) -> None:
        self._matcher = matcher
        self._mask_executor = mask_executor  # the backend's pool, for fill_bitmasks
        self._eos_token_ids = eos_token_ids
        self._vocab_size = vocab_size
        self._num_accepted = 0
        self._terminated = False
        # Whether the LLMatcher counted the EOS that terminated us (it does not when it was stopped).
        self._eos_counted = False

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher underneath (for the batched mask fill)."""
        return self._matcher

    @property
    def num_accepted(self) -> int:
        return self._num_accepted

    def is_terminated(self) -> bool:
        return self._terminated

    def accept(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self._vocab_size:
            return False
        is_eos = token_id in self._eos_token_ids
        if is_eos and self._matcher.is_stopped() and not self._matcher.is_error():
            # Complete and unable to go on: EOS is the only way forward, and llguidance takes it
            # without counting it.
            self._terminated, self._eos_counted = True, False
            self._num_accepted += 1
            return True
        if self._matcher.validate_tokens([token_id]) != 1:
            return False
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"llguidance refused a token it had validated: {self._matcher.get_error()}")
        self._num_accepted += 1
        if is_eos:
            self._terminated, self._eos_counted = True, True
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens of {self._num_accepted} accepted")
        if num_tokens == 0:
            return
        counted = num_tokens - (1 if self._terminated and not self._eos_counted else 0)
        if counted and not self._matcher.rollback(counted):
            raise RuntimeError(f"llguidance could not roll back {counted} tokens: {self._matcher.get_error()}")
        self._num_accepted -= num_tokens
        self._terminated = self._eos_counted = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        check_bitmask(bitmask, self._vocab_size)
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"row {row} is outside a bitmask of {bitmask.shape[0]} rows")
        target = bitmask[row]
        # Writes the row in place, through its address (the GIL is released meanwhile).
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    @classmethod
    def fill_bitmasks(cls, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """All rows in one call to llguidance's `LLExecutor`, which computes them in parallel (on
        the pool of the first matcher's backend: any pool can fill any llguidance matcher)."""
        if not rows:
            return
        matchers: list[tuple[llguidance.LLMatcher, int]] = []
        vocab_sizes = set()
        for matcher, row in rows:
            if not isinstance(matcher, LLGuidanceMatcher):
                raise TypeError(f"LLGuidanceMatcher.fill_bitmasks got a {type(matcher).__name__}")
            if not 0 <= row < bitmask.shape[0]:
                raise IndexError(f"row {row} is outside a bitmask of {bitmask.shape[0]} rows")
            matchers.append((matcher.ll_matcher, row))
            vocab_sizes.add(matcher.vocab_size)
        if len(vocab_sizes) != 1:
            raise ValueError(f"one bitmask cannot hold matchers of vocabularies {sorted(vocab_sizes)}")
        (vocab_size,) = vocab_sizes
        check_bitmask(bitmask, vocab_size)
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        first = rows[0][0]
        assert isinstance(first, LLGuidanceMatcher)
        first._mask_executor().unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
