"""`GrammarMatcher`: one request's position in its grammar, stepped token by token."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class GrammarMatcher(ABC):
    """Where one request stands in its grammar: which tokens may come next, and what came so far.

    A matcher is made per request by `CompiledGrammar.matcher()` and lives as long as the request.
    Each decode step the engine asks it for the allowed next tokens (`fill_bitmask`, or a whole
    batch at once with `nanoserve.grammar.bitmask.fill_bitmasks`), samples from the masked logits,
    then tells it the token drawn (`accept`). A token that was rejected by the grammar after all
    (speculative decoding's drafts, a preempted step) is undone with `rollback`.

    Stopping: when the grammar is complete and admits nothing more, the mask allows only the EOS
    token(s); the matcher *terminates* once it accepts one (`is_terminated`), and from then on
    accepts nothing. A grammar that is complete but could go on (`[0-9]+` after "12") allows EOS
    next to its other tokens, and the model chooses.

    A matcher is not thread-safe: one thread steps it at a time (the engine's).
    """

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`. False if the grammar does not allow it here: the matcher is then
        left as it was (not advanced, still usable)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (0 <= num_tokens <= num_accepted)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 on the CPU, 32 tokens per word,
        bit set = allowed; `nanoserve.grammar.bitmask` explains the layout)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and the matcher has accepted the EOS token that ends it:
        generation must stop."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Tokens its bitmask rows cover (`allocate_bitmask(rows, matcher.vocab_size)` fits it)."""

    @property
    @abstractmethod
    def num_accepted(self) -> int:
        """How many tokens were accepted (and not rolled back) so far, the final EOS included."""

    @classmethod
    def fill_bitmasks(cls, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Fill many rows at once: `bitmask[row]` for each (matcher, row), all matchers of this class.

        The default fills one row after another. A backend whose library computes masks for a batch
        in parallel (llguidance's `LLExecutor`) overrides it; `nanoserve.grammar.bitmask.fill_bitmasks`
        groups a batch's matchers by class and calls this once per class.
        """
        for matcher, row in rows:
            matcher.fill_bitmask(bitmask, row)
