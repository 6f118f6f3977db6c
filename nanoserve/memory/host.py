"""Host-memory KV storage and the copies between it and the device cache.

Every paper here moves KV off the accelerator and back: ConServe checkpoints finished blocks
(conserve.txt §4.4), BROS saves only the best-effort slots a real-time sequence is about to
overwrite (bros.txt §5.2), EcoServe evicts a hosted request whose host needs its region back
(ecoserve.txt §3.4). They all use this one store.

A memory manager never touches tensors. It decides *what* moves and describes it as `KVCopy`
ops over flat slots: device slots are `block * B + slot` (the runner's slot-mapping numbering),
host slots `host_block * B + i`. The runner executes the ops on the real caches
(`HostKVStore.execute`) before the step's forward pass: saves, then device-to-device moves,
then loads, so a slot can be saved and refilled in the same step. A slot copy carries every
layer's K and V.

Host space is handed out in whole host blocks of B slots, owned by an owner id (a request id,
usually); a save of fewer than B slots still takes a block. On CUDA the host tensors are
pinned and copies run on a side stream; `fence()` makes the compute stream wait for them.

Invariants (checked by `check_invariants`):
  1. Every host block is free or owned by exactly one owner: free + owned == total.
  2. No owner holds a block twice; no owner holds an empty list.
  3. With no owners, every host block is free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Literal, Sequence

import torch

from nanoserve.memory.blocks import NoFreeBlocksError


@dataclass(frozen=True)
class KVCopy:
    """Copy every layer's K/V from slots `src` to slots `dst`, pairwise in order.

    save: device slots -> host slots; load: host slots -> device slots; move: device slots ->
    other device slots (BROS moves a best-effort page's surviving slots to a fresh block).
    """

    kind: Literal["save", "move", "load"]
    src: tuple[int, ...]
    dst: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("save", "move", "load"):
            raise ValueError(f"unknown copy kind {self.kind!r}")
        if len(self.src) != len(self.dst):
            raise ValueError("a KV copy pairs source and destination slots one to one")


class HostKVStore:
    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pin_memory: bool | None = None):
        if num_blocks < 0 or block_size < 1:
            raise ValueError("num_blocks must be >= 0 and block_size >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[Hashable, list[int]] = {}
        self._stream: torch.cuda.Stream | None = None
        self._last_copy: torch.cuda.Event | None = None

    # -- host block allocation ------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_of(self, owner: Hashable) -> list[int]:
        return list(self._owned.get(owner, ()))

    def slots(self, host_block: int, count: int | None = None) -> list[int]:
        """The first `count` (default all) flat host slots of `host_block`."""
        start = host_block * self.block_size
        return list(range(start, start + (self.block_size if count is None else count)))

    def allocate(self, owner: Hashable, num_blocks: int) -> list[int]:
        """All or nothing: `num_blocks` more host blocks for `owner`, or NoFreeBlocksError."""
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"host store: need {num_blocks} blocks, {len(self._free)} free")
        new = [self._free.pop() for _ in range(num_blocks)]
        if new:
            self._owned.setdefault(owner, []).extend(new)
        return new

    def free(self, owner: Hashable, blocks: Sequence[int] | None = None) -> int:
        """Release `blocks` of `owner` (all of them when None); returns how many were freed."""
        held = self._owned.get(owner, [])
        drop = list(held) if blocks is None else list(blocks)
        if not set(drop) <= set(held):
            raise ValueError(f"{owner!r} does not own host blocks {sorted(set(drop) - set(held))}")
        keep = [b for b in held if b not in set(drop)]
        if keep:
            self._owned[owner] = keep
        else:
            self._owned.pop(owner, None)
        self._free.extend(reversed(drop))
        return len(drop)

    # -- copies (run by the executor) -----------------------------------------------------
    def execute(self, copies: Sequence[KVCopy], kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run `copies` against the device caches: every save, then every move, then every load.

        That order lets one step checkpoint a slot, then refill it, without losing the old K/V.
        """
        if not copies:
            return
        # A pipeline stage holds only its layers' caches (None for the others'): it copies those.
        device = next(c for c in kv_caches if c is not None)[0].device
        if device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(device)
        if self._stream is None:
            self._copy(copies, kv_caches)
            return
        self._stream.wait_stream(torch.cuda.current_stream(device))  # the K/V to save are written
        with torch.cuda.stream(self._stream):
            self._copy(copies, kv_caches)
        self._last_copy = torch.cuda.Event()
        self._last_copy.record(self._stream)

    def fence(self) -> None:
        """Make the compute stream wait for every issued copy (no-op on the CPU)."""
        if self._last_copy is not None:
            torch.cuda.current_stream().wait_event(self._last_copy)
            self._last_copy = None

    def _copy(self, copies: Sequence[KVCopy], kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        device = next(c for c in kv_caches if c is not None)[0].device
        for kind in ("save", "move", "load"):
            group = [c for c in copies if c.kind == kind]
            if not group:
                continue
            src_slots = [s for c in group for s in c.src]
            dst_slots = [s for c in group for s in c.dst]
            src = torch.tensor(src_slots, dtype=torch.int64)
            dst = torch.tensor(dst_slots, dtype=torch.int64)
            if kind != "move" and len(src_slots) > 1:
                # Runs where both sides are consecutive (whole blocks, a checkpoint's block
                # ranges) are copied in one slice each: index_select + index_copy_ would move
                # every byte twice. Saves and loads cross tensors, so runs cannot overlap; a move
                # keeps the gather-then-scatter below. Short runs stay on the index path, where
                # one call per run would cost more than the second copy.
                breaks = ((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)
                starts = [0, *(breaks.nonzero().flatten() + 1).tolist()]
                if len(starts) * 64 <= len(src_slots):  # runs average at least 64 slots
                    runs = [(src_slots[a], dst_slots[a], b - a) for a, b in zip(starts, [*starts[1:], len(src_slots)])]
                    for layer, caches in enumerate(kv_caches):
                        for host, cache in zip((self.k[layer], self.v[layer]), caches or ()):
                            flat = cache.view(-1, *cache.shape[2:])
                            source, target = (flat, host) if kind == "save" else (host, flat)
                            for s, d, n in runs:
                                target.narrow(0, d, n).copy_(source.narrow(0, s, n))
                    continue
            if kind != "load":
                src = src.to(device)
            if kind != "save":
                dst = dst.to(device)
            for layer, caches in enumerate(kv_caches):
                for host, cache in zip((self.k[layer], self.v[layer]), caches or ()):
                    flat = cache.view(-1, *cache.shape[2:])
                    source, target = {"save": (flat, host), "move": (flat, flat), "load": (host, flat)}[kind]
                    # Gather first, then scatter: a move's sources are read before any is overwritten.
                    target.index_copy_(0, dst, source.index_select(0, src).to(target.device))

    # -- invariants -----------------------------------------------------------------------
    def check_invariants(self) -> None:
        owned = [b for blocks in self._owned.values() for b in blocks]
        assert len(set(owned)) == len(owned), "a host block is owned twice"
        assert len(set(self._free)) == len(self._free), "a host block is free twice"
        assert not set(owned) & set(self._free), "a host block is both owned and free"
        assert len(owned) + len(self._free) == self.num_blocks, "host blocks were lost or invented"
        assert all(blocks for blocks in self._owned.values()), "an owner holds an empty list"
        if not self._owned:
            assert len(self._free) == self.num_blocks
