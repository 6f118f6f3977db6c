"""Structured outputs by constrained decoding: the model may only draw tokens the grammar allows.

A request that asks for JSON matching a schema, text matching a regex, one of a few strings or a
sentence of a grammar (`nanoserve.structured_outputs.StructuredOutputsParams`) cannot rely on the
model to comply, least of all a 135M one. Constrained decoding makes it comply by construction:
at every step, before sampling, the logits of every token that the grammar cannot take next are
set to -inf. Whatever the sampler then draws -- greedy, top-p, any temperature -- keeps the output
a prefix of some valid output, and the grammar allows EOS only where the output is complete.

The life of a constraint, in four parts (each abstract class is in its own module):

1. `GrammarBackend` (backend.py): the library that understands constraints, for one tokenizer.
   The server calls `backend.check(spec)` when a request arrives (fast, no tokenizer) so that an
   invalid schema is a 400 for the client, not an error inside the engine.
2. `CompiledGrammar` (compiled.py): `backend.compile(spec)` turns the constraint into something
   that maps text to tokens -- slow-ish, so `GrammarCompiler` (compiler.py) runs it on a worker
   thread and caches it by the constraint: compile once per distinct grammar.
3. `GrammarMatcher` (matcher.py): `compiled.matcher()`, one per request, its position in the
   grammar. Each step: `fill_bitmasks` (bitmask.py) writes the allowed tokens of every
   constrained request into an int32 bitmask, one bit per token, in one batched call;
   `apply_bitmask` turns the disallowed tokens' logits to -inf; the sampler draws; the engine
   calls `matcher.accept(token)`. Tokens taken back (speculative drafts, a discarded step) are
   undone with `matcher.rollback(n)`.
4. The end: when the grammar is complete and can take nothing more, the mask allows only EOS;
   after the matcher accepts it, `matcher.is_terminated()` and the request finishes.

The backend is llguidance (llguidance_backend.py says why: it builds its tokenizer from the
`tokenizers` JSON without transformers, masks in about 50 us, covers JSON schema, regex and
Lark grammars in one library, and fills a batch's masks in parallel). Other libraries plug in by
implementing the three classes and an entry in `BACKENDS`; `make_backend` picks one by name.
"""
from __future__ import annotations

import importlib

from nanoserve.grammar.backend import GrammarBackend
from nanoserve.grammar.bitmask import allocate_bitmask, apply_bitmask, bitmask_words, fill_bitmasks
from nanoserve.grammar.compiled import CompiledGrammar
from nanoserve.grammar.compiler import GrammarCompiler
from nanoserve.grammar.matcher import GrammarMatcher
from nanoserve.tokenizer import Tokenizer

# name -> "module:class", imported on first use (a backend's library is needed only if chosen).
# Each class is constructed as cls(tokenizer, vocab_size).
BACKENDS: dict[str, str] = {
    "llguidance": "nanoserve.grammar.llguidance_backend:LLGuidanceBackend",
}
# Known libraries that have no backend here yet, and what to say when one is asked for.
_NOT_IMPLEMENTED: dict[str, str] = {
    "xgrammar": "the xgrammar backend is not installed/implemented in nanoserve; use 'llguidance' (the "
                "default), or implement GrammarBackend, CompiledGrammar and GrammarMatcher over xgrammar "
                "and register it in nanoserve.grammar.BACKENDS",
}
DEFAULT_BACKEND = "llguidance"


def make_backend(name: str, tokenizer: Tokenizer, vocab_size: int) -> GrammarBackend:
    """The grammar backend `name` for this tokenizer and the model's logits width `vocab_size`."""
    if name in _NOT_IMPLEMENTED:
        raise ValueError(_NOT_IMPLEMENTED[name])
    if name not in BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {', '.join(sorted(BACKENDS))}")
    module_name, _, class_name = BACKENDS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    backend = cls(tokenizer, vocab_size)
    assert isinstance(backend, GrammarBackend)
    return backend


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "CompiledGrammar", "GrammarBackend", "GrammarCompiler", "GrammarMatcher",
           "allocate_bitmask", "apply_bitmask", "bitmask_words", "fill_bitmasks", "make_backend"]
