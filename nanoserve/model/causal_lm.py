"""What the rest of the engine reads of a model: a `CausalLM` (the whole model: forward,
logits, weight loading) over a `DecoderBody` (embeddings, the decoder layers, the final norm).
Each architecture (llama.py and its Qwen variants, opt.py) implements both; the runner, the
pipeline stages (stages.py, cluster/group.py) and the loader call only what is declared here,
so nothing outside an architecture's file knows which one it is.
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
from torch import nn

from nanoserve.config import ModelConfig
from nanoserve.model.attention import ForwardContext
from nanoserve.model.layers import Weight
from nanoserve.model.parallel import ParallelLMHead, VocabParallelEmbedding


class DecoderBody(nn.Module):
    """The module that holds the decoder layers (`layers`) and runs them in order.

    A pipeline stage keeps only its own layers (the others become `MissingLayer`s) and only the
    modules its position needs: those named in `FIRST_STAGE_ONLY` run on the first stage only,
    those in `LAST_STAGE_ONLY` on the last only (stages.py sets them to None elsewhere; a name
    may also be None in a model that has no such module). `embed_tokens` is the first stage's
    too, and the last's when the LM head is tied to it."""

    FIRST_STAGE_ONLY: ClassVar[tuple[str, ...]] = ()
    LAST_STAGE_ONLY: ClassVar[tuple[str, ...]] = ()

    # ConServe's preemption safe point (conserve.txt §5): the runner installs a callable here
    # only while it runs a pure-offline batch; called after each layer, it may raise to stop.
    safe_point: Callable[[int], None] | None = None

    layers: nn.ModuleList
    embed_tokens: VocabParallelEmbedding | None

    @abstractmethod
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of every token. A later pipeline stage passes the previous stage's
        `hidden` instead of ids; a layer another stage holds is skipped."""


class CausalLM(nn.Module):
    """forward(input_ids [T], positions [T], ctx) -> hidden [T, H]; compute_logits picks rows."""

    # Where the body's tensors live in an HF checkpoint ("model.layers.0..." for Llama).
    BODY_PREFIX: ClassVar[str] = "model"

    config: ModelConfig
    lm_head: ParallelLMHead | None  # None: tied to the embedding, or held by another stage

    @abstractmethod
    def body(self) -> DecoderBody:
        """The decoder body: the module whose layers a stage keeps and a safe point follows."""

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        return self.body()(input_ids, positions, ctx, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_head().logits(hidden)

    def logits_head(self) -> VocabParallelEmbedding:
        """The module whose weight computes the logits: the LM head, or the embedding if tied."""
        if self.lm_head is not None:
            return self.lm_head
        embed = self.body().embed_tokens
        if embed is None:
            raise RuntimeError("this pipeline stage holds no LM head")
        return embed

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Copy HF-named checkpoint tensors into the model (each rank takes its own slices)."""
