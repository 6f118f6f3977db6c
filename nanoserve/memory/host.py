"""Host-memory KV storage, and the copy stream that moves K/V between it and the device cache.

Every paper here moves KV off the accelerator and back: ConServe checkpoints finished blocks
(conserve.txt §4.4), BROS saves only the best-effort slots a real-time sequence is about to
overwrite (bros.txt §5.2), EcoServe evicts a hosted request whose host needs its region back
(ecoserve.txt §3.4), and vLLM's swap preemption copies a whole sequence out and back. They all
use this one store.

A memory manager never touches tensors. It decides *what* moves and describes it as `KVCopy`
ops over flat slots (memory/copies.py says who waits for which). The runner hands each step's
copy groups to `execute`, which issues them on one copy stream in order (within a group: saves,
then device-to-device moves, then loads, so a slot can be saved and refilled in the same step)
and files each in `inflight`, the ledger the manager polls. Before its forward the runner calls
`wait_for`, which makes the compute stream wait only for the copies that forward needs:

    compute stream:  ─ forward n-1 ─┐               ┌─ wait(needed) ─ forward n ─
    copy stream:                    └─ saves, moves, loads of step n ─┘ (the rest runs on)

On CUDA the host tensors are pinned, copies run `non_blocking` on a dedicated stream, and one
event per group tells when they landed.

Layer by layer (`layerwise=True`; ours, for BROS's "the memory swapping time overlaps with the
model execution time, and the iteration time can be computed as max(T_exec, T_swap)", bros.txt
§4.1). `execute_step` issues a whole step's groups layer-major, every group's layer-0 part, then
every group's layer-1 part, and so on, with an event after each layer; `wait_for` makes the
compute stream wait for layer 0's part only, and the runner calls `wait_layer(l)` as the forward
reaches layer l. A forward that reads a restore then runs while the rest of the restore is on
the link:

    copy stream:     [L0 ][L1 ][L2 ][L3 ]
    compute stream:       ├L0─┤├L1─┤├L2─┤├L3─┤head┤      (whole copies: ....wait....├L0─┤├L1─ ...)

Per layer, the order is still saves, moves, loads, group after group, and a layer's copies touch
only that layer's tensors, so the caches end exactly as with whole copies. On a CPU there is no
second engine: the same code runs the copies in order, at once, and they land immediately, with
exactly the same bookkeeping.

Host space is handed out in whole host blocks of B slots, owned by an owner id (a request id,
usually); a save of fewer than B slots still takes a block. A slot copy carries every layer's
K and V.

Invariants (checked by `check_invariants`):
  1. Every host block is free or owned by exactly one owner: free + owned == total.
  2. No owner holds a block twice; no owner holds an empty list.
  3. With no owners, every host block is free.
  4. The in-flight ledger keeps its own (memory/copies.py).
"""
from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoserve.device import to_device
from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.copies import ISSUE_ORDER, LANDED_NOW, InflightCopies, KVCopy

__all__ = ["HostKVStore", "KVCopy", "LayerEvents"]


@dataclass
class LayerEvents:
    """The wait handle of a step's copies issued layer by layer: one CUDA event per layer this
    rank holds, recorded after that layer's part. The last one marks the whole step's copies."""

    per_layer: dict[int, Any] = field(default_factory=dict)  # layer -> event, in layer order

    @property
    def last(self) -> Any:
        return self.per_layer[max(self.per_layer)]


def _pin_in_place(owner: object, tensors: Sequence[torch.Tensor]) -> weakref.finalize:
    """Page-lock `tensors` where they lie (cudaHostRegister), so copies to and from the device run
    asynchronously. Not `pin_memory=True`: PyTorch's pinned allocator rounds every allocation up
    to a power of two, which turns a 40 GiB store into 64 GiB of locked host memory. Unlocked
    when `owner` is collected (the finalizer holds the tensors, so they outlive it), or earlier by
    calling the finalizer this returns (it runs once)."""
    registered: list[torch.Tensor] = []
    if all(t.numel() == 0 for t in tensors):
        return weakref.finalize(owner, _unpin, registered)  # nothing to lock: no CUDA context either
    cudart = torch.cuda.cudart()
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        err = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        if int(err) != 0:
            for done in registered:
                cudart.cudaHostUnregister(done.data_ptr())
            raise RuntimeError(f"could not page-lock {tensor.numel() * tensor.element_size() / 2**30:.1f} GiB "
                               f"of host KV store (CUDA error {int(err)}); lower --host-kv-gb")
        registered.append(tensor)
    return weakref.finalize(owner, _unpin, registered)


def _unpin(tensors: list[torch.Tensor]) -> None:
    if not tensors:
        return
    cudart = torch.cuda.cudart()
    for tensor in tensors:
        cudart.cudaHostUnregister(tensor.data_ptr())


class HostKVStore:
    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pin_memory: bool | None = None, layerwise: bool = False,
                 layers: Iterable[int] | None = None):
        """`layerwise`: issue a step's copies layer by layer, so a forward waits per layer (above).
        `layers`: the model's layers this rank holds KV for (a pipeline stage's; default all of
        `num_layers`): the store keeps one row of `k` and `v` per held layer, in layer order, so a
        stage pins only its own layers' share of the host budget (which is sized per stage)."""
        if num_blocks < 0 or block_size < 1:
            raise ValueError("num_blocks must be >= 0 and block_size >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        held = range(num_layers) if layers is None else sorted(layers)
        self._row = {layer: row for row, layer in enumerate(held)}  # model layer -> row of k and v
        shape = (len(held), num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self._unpin = _pin_in_place(self, (self.k, self.v)) if pin else None
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[Hashable, list[int]] = {}
        self.inflight = InflightCopies()  # issued copies the manager has not yet seen land
        self._stream: torch.cuda.Stream | None = None
        self._device: torch.device | None = None  # the device cache's, set with the stream
        self.layerwise = layerwise
        self._layer_waits: dict[int, list[Any]] = {}  # layer -> events the forward still waits for there

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

    def slots_of(self, host_blocks: Iterable[int]) -> tuple[int, ...]:
        """Every flat host slot of `host_blocks`, block by block: the host side of a whole-block copy."""
        return tuple(s for b in host_blocks for s in self.slots(b))

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
    def execute(self, copies: Sequence[KVCopy], kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Issue one group of copies against the device caches: every save, then every move, then
        every load. That order lets one step checkpoint a slot, then refill it, without losing the
        old K/V. The copies are filed in `inflight`; on a CPU they have landed when this returns."""
        if not copies:
            return
        # A pipeline stage holds only its layers' caches (None for the others'): it copies those.
        device = next(c for c in kv_caches if c is not None)[0].device
        if device.type != "cuda":
            self.copy_now(copies, kv_caches)
            for copy in copies:
                self.inflight.issue(copy, LANDED_NOW)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
            self._device = device
        # The copies read K/V earlier forwards wrote, and overwrite blocks earlier forwards read.
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            self._copy(copies, kv_caches, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        for copy in copies:
            self.inflight.issue(copy, event.query, event)

    def execute_step(self, groups: Sequence[Sequence[KVCopy]],
                     kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Issue one step's copy groups in order: group after group (`execute`), or layer-major
        when `layerwise` (one event per layer; every copy of the step lands with the last)."""
        groups = [list(g) for g in groups if g]
        if not self.layerwise:
            for group in groups:
                self.execute(group, kv_caches)
            return
        if not groups:
            return
        held = [layer for layer, c in enumerate(kv_caches) if c is not None]
        first = kv_caches[held[0]]
        assert first is not None  # held lists only layers with caches
        device = first[0].device
        if device.type != "cuda":
            for layer in held:
                for group in groups:
                    self._copy(group, kv_caches, non_blocking=False, layers=(layer,))
            for group in groups:
                for copy in group:
                    self.inflight.issue(copy, LANDED_NOW)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
            self._device = device
        self._stream.wait_stream(torch.cuda.current_stream(device))
        events = LayerEvents()
        with torch.cuda.stream(self._stream):
            for layer in held:
                for group in groups:
                    self._copy(group, kv_caches, non_blocking=True, layers=(layer,))
                events.per_layer[layer] = torch.cuda.Event()
                events.per_layer[layer].record(self._stream)
        for group in groups:
            for copy in group:
                self.inflight.issue(copy, events.last.query, events)

    def copy_now(self, copies: Sequence[KVCopy], kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Move the data of one group synchronously, in `execute`'s order, without filing it in
        the ledger: what `execute` does on a CPU, and what a test's stand-in copy stream runs
        when it decides a copy lands."""
        if copies:
            self._copy(copies, kv_caches, non_blocking=False)

    def synchronize(self) -> None:
        """Block the host until every issued copy has run (no-op on a CPU, where they all have)."""
        if self._stream is not None:
            self._stream.synchronize()

    def release(self) -> None:
        """Free the store's memory (the engine's shutdown): wait for the copies in flight, unlock
        the pages, drop the tensors. The store holds no KV afterwards and serves no more copies."""
        self.synchronize()
        if self._unpin is not None:
            self._unpin()  # a weakref.finalize: runs once, and not again at collection
        self.k = self.v = torch.empty(0, dtype=self.k.dtype)
        self.num_blocks, self._free, self._owned = 0, [], {}

    def wait_for(self, readers: Iterable[Hashable]) -> None:
        """Make the compute stream wait for the in-flight copies a forward over `readers` needs
        (`KVCopy.needed_by`): this step's blocking copies and the loads its requests read. Saves
        and prefetches for other requests keep running under the forward. No-op on a CPU."""
        readers = set(readers)
        handles = self.inflight.handles(lambda copy: copy.needed_by(readers))
        if not self.layerwise:
            self._wait(handles)
            return
        self._layer_waits = {}
        for handle in handles:
            for layer, event in handle.per_layer.items():
                self._layer_waits.setdefault(layer, []).append(event)
        if self._layer_waits:  # the first layer this rank holds waits now; the rest, as reached
            self.wait_layer(min(self._layer_waits))

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait for the part of the needed copies that touches `layer`
        (layer-by-layer mode; the runner calls it as the forward reaches each layer)."""
        self._wait(self._layer_waits.pop(layer, []))

    @property
    def has_layer_waits(self) -> bool:
        """Does the coming forward still wait for copies at some layer (see `wait_layer`)?"""
        return bool(self._layer_waits)

    def retire(self, tickets: Iterable[int]) -> None:
        """The manager (in the scheduling process) saw `tickets` land and may now reuse what they
        touched. Where this store's own copies of them may still run (another tensor- or
        pipeline-parallel rank's stream), the compute and copy streams wait for them first."""
        handles = self.inflight.forget(tickets)
        self._wait(handles)
        if handles and self._stream is not None:
            for event in handles:
                self._stream.wait_event(event.last if isinstance(event, LayerEvents) else event)

    def _wait(self, events: list[Any]) -> None:
        if events:
            # Events exist only once the copy stream does, and with it the cache's device.
            stream = torch.cuda.current_stream(self._device)
            for event in events:
                stream.wait_event(event.last if isinstance(event, LayerEvents) else event)

    def _copy(self, copies: Sequence[KVCopy], kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
              non_blocking: bool, layers: Sequence[int] | None = None) -> None:
        """`layers`: copy only those layers' K/V (default: every layer this rank holds)."""
        if layers is not None:
            kv_caches = [c if i in layers else None for i, c in enumerate(kv_caches)]
        device = next(c for c in kv_caches if c is not None)[0].device
        for kind in ISSUE_ORDER:
            group = [c for c in copies if c.kind == kind]
            if not group:
                continue
            src_slots = [s for c in group for s in c.src]
            dst_slots = [s for c in group for s in c.dst]
            if kind == "move":
                self._move(src_slots, dst_slots, kv_caches, device)
            elif non_blocking:
                self._transfer_async(kind, src_slots, dst_slots, kv_caches, device)
            else:
                self._transfer(kind, src_slots, dst_slots, kv_caches, device)

    def _move(self, src_slots: list[int], dst_slots: list[int],
              kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None], device: torch.device) -> None:
        src, dst = (to_device(slots, torch.int64, device=device) for slots in (src_slots, dst_slots))
        for caches in kv_caches:
            for cache in caches or ():
                flat = cache.view(-1, *cache.shape[2:])
                # Gather first, then scatter: a move's sources are read before any is overwritten.
                flat.index_copy_(0, dst, flat.index_select(0, src))

    def _layers(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None]
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(host tensor, flat device cache) for every layer's K and V this rank holds."""
        for layer, caches in enumerate(kv_caches):
            if caches is None:
                continue
            row = self._row[layer]
            for host, cache in zip((self.k[row], self.v[row]), caches):
                yield host, cache.view(-1, *cache.shape[2:])

    def _transfer(self, kind: str, src_slots: list[int], dst_slots: list[int],
                  kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None], device: torch.device) -> None:
        """A save or load on the CPU (or any synchronous device)."""
        src = torch.tensor(src_slots, dtype=torch.int64)
        dst = torch.tensor(dst_slots, dtype=torch.int64)
        runs = _runs(src, dst) if len(src_slots) > 1 else []
        if runs and len(runs) * 64 <= len(src_slots):
            # Runs where both sides are consecutive (whole blocks, a checkpoint's block ranges)
            # are copied in one slice each: index_select + index_copy_ would move every byte
            # twice. Saves and loads cross tensors, so runs cannot overlap. Short runs stay on the
            # index path, where one call per run would cost more than the second copy.
            for host, flat in self._layers(kv_caches):
                source, target = (flat, host) if kind == "save" else (host, flat)
                for s, d, n in runs:
                    target.narrow(0, d, n).copy_(source.narrow(0, s, n))
            return
        src, dst = (src.to(device), dst) if kind == "save" else (src, dst.to(device))
        for host, flat in self._layers(kv_caches):
            source, target = (flat, host) if kind == "save" else (host, flat)
            target.index_copy_(0, dst, source.index_select(0, src).to(target.device))

    def _transfer_async(self, kind: str, src_slots: list[int], dst_slots: list[int],
                        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
                        device: torch.device) -> None:
        """A save or load on the copy stream, never blocking the host thread.

        The device side may be scattered (a sequence's blocks lie anywhere in the pool), the host
        side comes in runs (host blocks of B slots). So a save gathers its device slots into one
        contiguous staging tensor with one kernel per layer and K/V, then copies each host run
        out of it into pinned memory; a load copies each host run into a staging tensor, then
        scatters it with one kernel. Staging tensors are allocated on the copy stream, so the
        caching allocator reuses their memory only after the stream has finished with them."""
        host_slots = dst_slots if kind == "save" else src_slots
        device_slots = to_device(src_slots if kind == "save" else dst_slots, torch.int64, device=device)
        host = torch.tensor(host_slots, dtype=torch.int64)
        runs = _runs(host, torch.arange(len(host_slots)))  # (host start, staging start, length)
        for layer_host, flat in self._layers(kv_caches):
            if kind == "save":
                staged = flat.index_select(0, device_slots)
                for h, s, n in runs:
                    layer_host.narrow(0, h, n).copy_(staged.narrow(0, s, n), non_blocking=True)
            else:
                staged = torch.empty((len(host_slots), *flat.shape[1:]), dtype=flat.dtype, device=device)
                for h, s, n in runs:
                    staged.narrow(0, s, n).copy_(layer_host.narrow(0, h, n), non_blocking=True)
                flat.index_copy_(0, device_slots, staged)

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
        self.inflight.check_invariants()


def _runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs where both sides count up by one."""
    if len(src) < 2:
        return [(int(src[0]), int(dst[0]), 1)] if len(src) else []
    breaks = ((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)
    starts = [0, *(breaks.nonzero().flatten() + 1).tolist()]
    firsts_src, firsts_dst = src[starts].tolist(), dst[starts].tolist()
    return [(s, d, b - a) for s, d, a, b in zip(firsts_src, firsts_dst, starts, [*starts[1:], len(src)])]
