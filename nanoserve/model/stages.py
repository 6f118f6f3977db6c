"""Which decoder layers a pipeline stage holds, and a model cut down to them (the model's side of
pipeline parallelism; parallel/pipeline.py runs the stages).

    stage 0: embeddings, layers [0, a)    stage 1: layers [a, b)    ...    last: ..., norm, LM head

`StageLayout` says which layers a rank holds; `keep_stage` removes the rest from a model built
on the meta device, before any memory is allocated, and lists the checkpoint tensors to skip.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from nanoserve.model.causal_lm import CausalLM


@dataclass(frozen=True)
class StageLayout:
    """Stage `stage` of `num_stages` holds decoder layers `layers`."""

    stage: int = 0
    num_stages: int = 1
    layers: range = range(0)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def holds(self, layer: int) -> bool:
        return layer in self.layers


def partition_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, as equal as possible; the earlier stages take the remainder (the last stage
    also runs the LM head)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + base + (stage < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def stage_layouts(num_layers: int, num_stages: int) -> list[StageLayout]:
    return [StageLayout(s, num_stages, r) for s, r in enumerate(partition_layers(num_layers, num_stages))]


class MissingLayer(nn.Module):
    """A layer another pipeline stage runs: it holds no weights and the forward skips it."""


def keep_stage(model: CausalLM, layout: StageLayout) -> list[str]:
    """Strip `model` (on the meta device) down to `layout`'s stage; returns the name prefixes of
    the checkpoint tensors that now have no home, for the loader to skip."""
    if layout.num_stages == 1:
        return []
    body = model.body()
    prefix = model.BODY_PREFIX
    skip = []
    for i in range(len(body.layers)):
        if not layout.holds(i):
            body.layers[i] = MissingLayer()
            skip.append(f"{prefix}.layers.{i}.")
    tied = model.lm_head is None
    if not layout.is_first:
        for name in body.FIRST_STAGE_ONLY:
            if getattr(body, name) is not None:
                setattr(body, name, None)
                skip.append(f"{prefix}.{name}.")
        if not (layout.is_last and tied):  # a tied LM head is the embedding matrix
            body.embed_tokens = None
            skip.append(f"{prefix}.embed_tokens.")
    if not layout.is_last:
        for name in body.LAST_STAGE_ONLY:
            if getattr(body, name) is not None:
                setattr(body, name, None)
                skip.append(f"{prefix}.{name}.")
        if not tied:
            model.lm_head = None
            skip.append("lm_head.")
    return skip
