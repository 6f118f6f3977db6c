"""`CompiledGrammar`: a constraint compiled once, shared by every request that asks for it."""
from __future__ import annotations

from abc import ABC, abstractmethod

from nanoserve.grammar.matcher import GrammarMatcher


class CompiledGrammar(ABC):
    """A constraint compiled against the tokenizer: the expensive, shareable part of a grammar.

    `GrammarCompiler` caches these by the constraint's key, so requests with the same JSON schema
    compile it once. Each request steps its own `matcher()`; the compiled grammar itself is never
    advanced, and `matcher()` may be called from any thread.
    """

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (nothing accepted yet), for one request."""
