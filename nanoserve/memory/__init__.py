"""KV memory: the allocators of the four papers, the host store they copy through, and the
`KVManager` adapters a scheduler drives them with. `make_kv_manager` picks one by name.

    paged          vLLM's block pool, recompute on preemption (memory/blocks.py)
    swap           vLLM's block pool, preemption swaps a request's blocks to host (memory/swap.py)
    exact          EcoServe's exact allocation from predicted lengths (memory/exact.py)
    bidirectional  BROS's shared RT/BE blocks with lazy checkpointing (memory/bidirectional.py)
    checkpoint     ConServe's incremental checkpointing (memory/checkpoint.py)
    arena          KunServe's weights-and-KV arena (memory/arena.py); built with the model

Automatic prefix caching (memory/prefix_cache.py) runs in paged, swap and checkpoint
(`PREFIX_CACHING_MANAGERS`, each saying in its docstring what sharing means beside its
mechanism); the others refuse it in their builders, saying why.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nanoserve.config import ModelConfig
from nanoserve.memory.host import HostKVStore
from nanoserve.memory.manager import KVManager

# name -> "module:function"; each function takes a KVBuildContext and returns a KVManager.
KV_MANAGERS: dict[str, str] = {
    "paged": "nanoserve.memory.manager:build_paged",
    "swap": "nanoserve.memory.swap:build",
    "exact": "nanoserve.memory.exact_kv:build",
    "bidirectional": "nanoserve.memory.bidirectional_kv:build",
    "checkpoint": "nanoserve.memory.checkpoint_kv:build",
}
NEEDS_HOST_STORE = frozenset({"swap", "exact", "bidirectional", "checkpoint"})
# The managers that share cached prefix blocks (memory/prefix_cache.py); each of the others
# refuses `prefix_caching=True` in its builder, saying why.
PREFIX_CACHING_MANAGERS = frozenset({"paged", "swap", "checkpoint"})
# Every name `EngineArgs.kv_manager` takes: the registry's, and "arena", which the builder makes
# from the loaded model (its weights move into the arena).
KV_MANAGER_NAMES = (*KV_MANAGERS, "arena")


@dataclass(frozen=True)
class KVBuildContext:
    num_blocks: int  # device KV blocks
    block_size: int
    model_config: ModelConfig
    host_store: HostKVStore | None = None
    options: Mapping[str, Any] = field(default_factory=dict)  # manager-specific knobs
    # Link time of one block's device-host copy, where it was measured (the simulator's link);
    # None: unknown. A manager that budgets its background copies by time needs it.
    link_block_seconds: float | None = None
    prefix_caching: bool = False  # share cached prefix blocks (`resolve_prefix_caching`)
    # The prefix cache's second tier: host blocks of `host_store` that keep evicted cached
    # blocks (paged only; memory/prefix_host_tier.py); 0: none.
    prefix_host_blocks: int = 0
    # Seconds to recompute n tokens after a prefix of p (the policy's cost model's `chunk_cost(p,
    # n)`), where known: the host tier loads a block only where that is dearer than its link time.
    recompute_seconds: Callable[[int, int], float] | None = None


def resolve_prefix_caching(name: str, requested: bool | None) -> bool:
    """`EngineArgs.enable_prefix_caching` for manager `name`: None means on wherever the manager
    supports it (vLLM v1's default is on); True where it does not fails in the manager's builder."""
    return name in PREFIX_CACHING_MANAGERS if requested is None else requested


def refuse_prefix_caching(ctx: KVBuildContext, name: str, why: str) -> None:
    """For a builder whose manager shares no blocks: fail if `ctx` asks for prefix caching."""
    if ctx.prefix_caching:
        raise ValueError(f"the {name} KV manager does not support prefix caching: {why} "
                         f"(enable_prefix_caching=False; the managers that do: "
                         f"{', '.join(sorted(PREFIX_CACHING_MANAGERS))})")


def make_kv_manager(name: str, ctx: KVBuildContext) -> KVManager:
    try:
        module_name, function = KV_MANAGERS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown KV manager {name!r}; available: {', '.join(sorted(KV_MANAGER_NAMES))}") from None
    return getattr(importlib.import_module(module_name), function)(ctx)
