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

Room for the peer (issue 22, defect 3). On one device this stand-in cannot take its memory from
the bytes the drop frees, as the real peer does (cluster/member.py receives into blocks carved
from its own freed weight bytes): the freed bytes become this device's KV pages, and the peer's
replica of the dropped layers is exactly as large as what they freed, so a stand-in that
borrowed them would cancel the drop's gain. Its replica and KV therefore sit beside the arena,
and `check_room` refuses a drop, before anything changes, when the device has no room for
them (on a full GPU the first drop would otherwise run out of memory half-way). A CPU's host
RAM is not checked.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import torch
from torch import nn

from nanoserve.memory.arena import MemoryArena
from nanoserve.model.attention import ForwardContext


def move_weights_to_host(model: nn.Module) -> dict[str, torch.Tensor]:
    """Put every parameter of `model` on the host and return them by name.

    The arena then copies them into its own device buffer, so the device never holds two
    copies; what stays on the host is the replica a drop's peer loads from and a restore
    reads back (§4.4). From a GPU into page-locked memory, so that a background restore's
    copies (MemoryArena.fill_restore, on its copy stream) and the peer's loads do not hold the
    host up. On a CPU device this moves nothing and costs nothing.
    """
    host = {name: host_copy(param.detach()) for name, param in model.named_parameters()}
    for name, param in model.named_parameters():
        param.data = host[name]
    return host


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the host: page-locked if it comes from a GPU, itself if it is there already."""
    if tensor.device.type != "cuda":
        return tensor.to("cpu")
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return pinned.copy_(tensor)


class PeerRoomError(MemoryError):
    """A drop refused before it began: the device has no room for the stand-in peer's replica
    weights and KV of the layers (see the module docstring)."""


def cuda_free_bytes(device: torch.device) -> int:
    """What this process can still allocate on `device`: the driver's free bytes and the
    caching allocator's reserved but unused ones."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class PeerStage(nn.Module):
    """Stands in for a dropped layer inside the model: no parameters, the peer runs the layer."""

    def __init__(self, peer: LayerPeer, layer: int):
        super().__init__()
        self.peer, self.layer = peer, layer  # LayerPeer is no nn.Module: its weights stay out of the model

    def forward(self, *args: object) -> object:
        return self.peer.run(self.layer, *args)  # whatever the layer returns (Llama's: x, residual)


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
        # What the device can still allocate, or None where it is not checked (a CPU's RAM).
        self.free_bytes: Callable[[], int | None] = (
            (lambda: cuda_free_bytes(device)) if device.type == "cuda" else (lambda: None))
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
    def bytes_needed(self, layers: Iterable[int], arena: MemoryArena, block_pages_after: int) -> int:
        """At most what a drop of `layers` makes the peer allocate: K and V of the new layers
        (`receive_kv`), the re-keyed caches of the layers it already holds (counted whole: each
        new cache is filled before its old one goes) and the new layers' replica weights (`serve`)."""
        layers = list(layers)
        blocks = arena.num_pages // block_pages_after

        def kv_bytes(pair: tuple[torch.Tensor, torch.Tensor]) -> int:  # a (K, V) pair's bytes with `blocks` blocks
            return sum(blocks * cache[0].numel() * cache.element_size() for cache in pair)

        caches = arena.kv_caches()
        kv = sum(kv_bytes(caches[layer]) for layer in layers)
        rekeyed = sum(kv_bytes(pair) for pair in self._caches if pair is not None)
        prefixes = tuple(self._slots[layer][2] + "." for layer in layers)
        replicas = sum(t.numel() * t.element_size() for n, t in self.host_weights.items() if n.startswith(prefixes))
        return kv + rekeyed + replicas

    def check_room(self, layers: Iterable[int], arena: MemoryArena, block_pages_after: int) -> None:
        """Raise PeerRoomError if the device cannot hold what the drop gives the peer."""
        free = self.free_bytes()
        if free is None:
            return
        layers = list(layers)
        needed = self.bytes_needed(layers, arena, block_pages_after)
        if needed > free:
            raise PeerRoomError(
                f"dropping layers {layers} needs {needed / 2**30:.2f} GiB on {self.device} for the "
                f"single-process peer's replica weights and KV, and {free / 2**30:.2f} GiB is free: "
                "this stand-in keeps the peer beside the arena on the same device (a drop there cannot "
                "gain capacity). Serve with a KunServe cluster (nanoserve.cluster.cluster, one device per "
                "instance), whose peers receive the KV into their own freed weight bytes, or leave the "
                "device room for the stand-in (a lower gpu_memory_utilization).")

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
    def run(self, layer: int, *args: object) -> object:
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
        assert self._ctx_out is not None  # set with `_ctx_in`
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
