"""`GrammarBackend`: the library that checks and compiles constraints for one tokenizer."""
from __future__ import annotations

from abc import ABC, abstractmethod

from nanoserve.grammar.compiled import CompiledGrammar
from nanoserve.structured_outputs import StructuredOutputsParams


class GrammarBackend(ABC):
    """Turns `StructuredOutputsParams` into grammars over one tokenizer's tokens.

    Made once per engine (`nanoserve.grammar.make_backend`) for its tokenizer and its model's
    vocabulary size. Three calls, from three places:

    * `check(spec)`: the server, on each request, before it reaches the engine. Fast, needs no
      tokenizer; raises ValueError with a message for the client.
    * `compile(spec)`: a worker thread of `GrammarCompiler`, once per distinct constraint. May take
      milliseconds to seconds (a large schema); raises ValueError if the constraint is invalid.
    * `vocab_size`: the width, in tokens, of the bitmask rows its matchers fill
      (`nanoserve.grammar.bitmask.allocate_bitmask(rows, backend.vocab_size)`).
    """

    name: str = ""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Tokens per bitmask row: the model's logits width, or the tokenizer's if that is larger
        (tokens past the tokenizer's vocabulary are never allowed)."""

    @abstractmethod
    def check(self, spec: StructuredOutputsParams) -> None:
        """Raise ValueError, naming the field ("structured_outputs.json: invalid JSON schema: ..."),
        if the constraint cannot be compiled. Must be fast and must not need the tokenizer."""

    @abstractmethod
    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Compile the constraint against the tokenizer (slow; thread-safe; called off the engine's
        step). Raises ValueError for an invalid constraint, with the same message as `check`."""
