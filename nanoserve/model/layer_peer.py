"""The pipeline peer that kept the layers this device dropped (KunServe §3, §4.2, §4.4), in one
process.

After a drop, a request's forward pass is a pipeline: this device runs its resident layers and
the peer instance, which still holds the dropped ones, runs those. The peer needs two things
per dropped layer: the weights (its replica; here a device copy of the host copy taken when
the engine started) and the K/V that every live request has computed for that layer so far,
which the KV exchange of §4.2 ships to it before the drop frees it. In this single-process
form the peer lives on the same device: the exchange is a real tensor copy, the activation
transfer between stages is handing over the hidden state, and the coordinated, chunked
transfer of §4.2 is moot because there is no network to share. The peer's weights and KV sit
outside the arena, as they would on the peer's GPU, so they are not this device's capacity.
(Separate processes with a real pipeline come later.)

How the model runs a dropped layer. The model's layer module is replaced by a `PeerStage`
stub that owns no parameters (this device's model really has no weights for that layer) and
forwards to the peer's replica with a `ForwardContext` rewritten for the peer's KV cache. The
original module, whose parameters the arena emptied, goes back in on restore.

Peer KV addressing. Arena block ids are page numbers, and blocks owned at the same time never
overlap, so any two differ by at least `block_pages` (the pages of one block): b // block_pages
is a collision-free peer block id. The peer's cache thus needs num_pages // block_pages blocks
per layer, what the arena would hold if all its bytes were KV, and the runner's block tables
and slots translate with one integer division per step. A later drop changes block_pages, so
the peer re-keys the live blocks it holds (a copy), before the arena's geometry changes.
"""
from __future__ import annotations

import copy
import re
from dataclasses import replace
from typing import Iterable, Mapping

import torch
from torch import nn

from nanoserve.memory.arena import MemoryArena
from nanoserve.model.attention import ForwardContext


def move_weights_to_host(model: nn.Module) -> dict[str, torch.Tensor]:
    """Put every parameter of `model` on the host and return them by name.

    The arena then copies them into its own device buffer, so the device never holds two
    copies; what stays on the host is the replica a drop's peer loads from and a restore
    reads back (§4.4). On a CPU device this moves nothing and costs nothing.
    """
    host = {name: param.detach().to("cpu") for name, param in model.named_parameters()}
    for name, param in model.named_parameters():
        param.data = host[name]
    return host


class PeerStage(nn.Module):
    """Stands in for a dropped layer inside the model: no parameters, the peer runs the layer."""

    def __init__(self, peer: LayerPeer, layer: int):
        super().__init__()
        self.peer, self.layer = peer, layer  # LayerPeer is no nn.Module: its weights stay out of the model

    def forward(self, *args: object) -> torch.Tensor:
        return self.peer.run(self.layer, *args)


class LayerPeer:
    """Weights and KV of the layers this device dropped; see the module docstring."""

    def __init__(self, model: nn.Module, host_weights: Mapping[str, torch.Tensor], device: torch.device,
                 layer_pattern: str):
        self.host_weights = host_weights
        self.device = device
        self._slots: dict[int, tuple[nn.Module, str, str]] = {}  # layer -> (parent, key, module name)
        self._originals: dict[int, nn.Module] = {}  # the model's own modules, while the peer serves them
        self._replicas: dict[int, nn.Module] = {}
        self._caches: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._block_pages = 1
        self._ctx_in: ForwardContext | None = None  # last context translated, and its translation
        self._ctx_out: ForwardContext | None = None
        pattern = re.compile(layer_pattern)  # matches parameter names: "...layers.3." + tail
        for name, _ in model.named_modules():
            match = pattern.search(name + ".")
            if match and match.end() == len(name) + 1:  # the decoder layer itself, not a child
                parent, _, key = name.rpartition(".")
                self._slots[int(match.group(1))] = (model.get_submodule(parent), key, name)
        self._caches = [None] * (max(self._slots) + 1 if self._slots else 0)

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers the peer serves now."""
        return tuple(sorted(self._replicas))

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) the peer holds for `layer`, indexed by peer block id (arena id // block_pages)."""
        cache = self._caches[layer]
        if cache is None:
            raise KeyError(f"the peer does not serve layer {layer}")
        return cache

    def peer_block(self, arena_block: int) -> int:
        return arena_block // self._block_pages

    # -- drop: KV exchange, then serving (§4.2) ----------------------------------------------
    @torch.no_grad()
    def receive_kv(self, layers: Iterable[int], arena: MemoryArena, block_pages_after: int) -> None:
        """Copy every owned block's K/V of `layers` out of the arena, and re-key the layers the
        peer already holds for the geometry after the drop. Call before the arena drops."""
        blocks = arena.owned_blocks()
        self._rekey(arena.num_pages, block_pages_after, blocks)
        src = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        dst = torch.div(src, block_pages_after, rounding_mode="floor")
        caches = arena.kv_caches()
        for layer in layers:
            if self._caches[layer] is not None:
                raise ValueError(f"the peer already serves layer {layer}")
            pair = []
            for cache in caches[layer]:
                own = cache.new_zeros((arena.num_pages // block_pages_after, *cache.shape[1:]))
                own[dst] = cache[src]  # the exchange itself: a real copy of live requests' K/V
                pair.append(own)
            self._caches[layer] = (pair[0], pair[1])

    @torch.no_grad()
    def serve(self, layers: Iterable[int]) -> None:
        """Load the replica weights of `layers` and put a `PeerStage` in the model in their place.
        Call after the arena dropped them (the modules' parameters are empty, so copying the
        module structure copies no weight)."""
        for layer in layers:
            parent, key, name = self._slots[layer]
            original = parent.get_submodule(key)
            replica = copy.deepcopy(original)
            for rel, param in replica.named_parameters():
                param.data = self.host_weights[f"{name}.{rel}"].to(self.device, copy=True)
            self._originals[layer], self._replicas[layer] = original, replica
            setattr(parent, key, PeerStage(self, layer))

    # -- restore: the device serves the layers again (§4.4) ----------------------------------
    def release(self, layers: Iterable[int], num_pages: int, block_pages: int) -> None:
        """Give `layers` back to the model (the arena has restored their weights): the stubs
        go, the replicas and their KV are dropped, the rest is re-keyed (no block is owned)."""
        for layer in layers:
            parent, key, _ = self._slots[layer]
            setattr(parent, key, self._originals.pop(layer))
            del self._replicas[layer]
            self._caches[layer] = None
        self._rekey(num_pages, block_pages, [])
        self._ctx_in = self._ctx_out = None

    # -- the forward pass of a dropped layer ---------------------------------------------------
    def run(self, layer: int, *args: object) -> torch.Tensor:
        args = tuple(self._context(a) if isinstance(a, ForwardContext) else a for a in args)
        return self._replicas[layer](*args)

    def _context(self, ctx: ForwardContext) -> ForwardContext:
        """`ctx` with blocks and slots in the peer's ids and the peer's caches. Built once per
        forward pass (every peer layer sees the same `ctx` object) and reused."""
        if ctx is not self._ctx_in:
            size = self._block_size()
            slots = ctx.slot_mapping
            peer_slots = torch.div(slots, size * self._block_pages, rounding_mode="floor") * size + slots % size
            self._ctx_out = replace(
                ctx, slot_mapping=torch.where(slots >= 0, peer_slots, slots),  # < 0: "skip", kept
                block_tables=torch.div(ctx.block_tables, self._block_pages, rounding_mode="floor"),
                kv_caches=self._caches)
            self._ctx_in = ctx
        return self._ctx_out

    def _block_size(self) -> int:
        return next(c[0].shape[1] for c in self._caches if c is not None)

    def _rekey(self, num_pages: int, block_pages: int, blocks: list[int]) -> None:
        """Re-address the held KV for blocks of `block_pages` pages, copying the live `blocks`."""
        old = torch.tensor([self.peer_block(b) for b in blocks], dtype=torch.int64, device=self.device)
        self._block_pages = block_pages
        new = torch.tensor([self.peer_block(b) for b in blocks], dtype=torch.int64, device=self.device)
        for layer, cache in enumerate(self._caches):
            if cache is not None:
                moved = []
                for tensor in cache:
                    fresh = tensor.new_zeros((num_pages // block_pages, *tensor.shape[1:]))
                    fresh[new] = tensor[old]
                    moved.append(fresh)
                self._caches[layer] = (moved[0], moved[1])
        self._ctx_in = self._ctx_out = None
