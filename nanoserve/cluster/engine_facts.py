"""`EngineFacts`: what a cluster's front (cluster/cluster_engine.py) needs to know of the engines
behind it to check and describe requests before any reaches an instance: the facts an `Engine`
fixes when it is built. Every instance is built from one `EngineArgs`; each reports its own
("facts", cluster/instance.py), and the front takes the strictest (the shortest context).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine


@dataclass(frozen=True)
class EngineFacts:
    model_name: str
    config: SchedulerConfig
    reasoning_parser: str | None
    sampling_defaults: Mapping[str, Any]
    vocab_size: int | None  # the logits' width (structured outputs' bitmasks cover it)
    structured_outputs_backend: str
    supports_prompt_logprobs: bool

    @classmethod
    def of(cls, engine: Engine) -> EngineFacts:
        return cls(engine.model_name, engine.config, engine.reasoning_parser, dict(engine.sampling_defaults),
                   engine.vocab_size, engine.structured_outputs_backend, engine.supports_prompt_logprobs())
