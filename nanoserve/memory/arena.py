"""One memory arena per device for weights and KV cache (KunServe §3, §4.1, §4.4).

KunServe answers memory throttling by dropping replicated parameters: the layers a pipeline
peer also holds are dropped and their bytes become KV cache (§3); the paper remaps freed
physical memory onto the tail of the KV range with CUDA VMM (§4.1). PyTorch has no VMM, so
the arena gets the same effect from one flat uint8 tensor that holds both: each parameter is a
view into it, and KV blocks are carved from whatever bytes no live weight holds.

Layout. The arena is cut into pages of `block_size x num_kv_heads x head_dim` KV elements, so
a page is the K (or the V) of one layer for one block of tokens. Each weight group (shared
weights: embeddings, final norm, head; then each decoder layer) fills whole pages starting at
its home page and never moves. A KV block is a run of 2 x R contiguous pages (R = resident
layers), anywhere in the free pages; its id is its first page:

    page 0                                                               num_pages
         | shared | layer0 | layer1 | layer2 | layer3 | KV blocks, free pages |
    after drop_layers([1, 2])  (R: 4 -> 2, so a block shrinks from 8 pages to 4):
         | shared | layer0 | KV blocks, free   | layer3 | KV blocks, free pages |
    one block, id b:   page b     b+1      b+2      b+3
                       K(r=0)     V(r=0)   K(r=1)   V(r=1)    r = rank among resident layers

`kv_caches()` gives resident layer r the views pages[2r : 2r + span] (K) and pages[2r + 1 :
2r + 1 + span] (V), each [span, block_size, kv_heads, head_dim], so `k_cache[b]` is page
b + 2r: the runner's slot formula and kernels work unchanged. The views span the whole arena
(like a VMM reservation); only owned blocks are addressed, and none overlaps a live weight.

Drop: the surviving layers' KV inside every live block moves down to its new rank (KV moves,
weights never do), each block's tail pages are freed, then the dropped layers' pages. The
dropped layers' KV is discarded: §4.2 ships it to the peer first (`owned_blocks()` and
`kv_caches()` say what to ship). Restore: a live block would have to grow by KV this device
never computed (the peer did), so `restore_layers` refuses with `BlocksInUseError` while any
KV block is owned; with none owned, the home pages are free and the weights are copied back.

Restore in the background (§4.4, "we overlap restoring with the normal request processing"):
`begin_restore` reserves the dropped layers' home pages: the free ones at once, the rest as the
blocks on them are freed; no block is carved there again. `fill_restore` copies the weights into
reserved pages a chunk at a time between steps (on a GPU on a copy stream of its own, from
page-locked host weights, so the copies run beside the forwards), and `restore_layers` then
copies only the pages still unfilled (none if the pull is done) and makes the forwards wait for
the copies. `cancel_restore` hands the reserved pages back, after the copies.

    home of a dropped layer:  | filled | filled | to fill | KV block (still owned) |
                                 `-- reserved: neither free nor owned --'   `-- reserved when freed

Allocation: the arena is its own `BlockPool`-like allocator (drop compacts exactly the blocks
it hands out); block ids are page numbers, not [0, num_blocks). `capacity_tokens` counts
non-weight bytes as if unfragmented (the paper's accounting); `num_free_blocks` is exact.

Invariants (checked by `check_invariants`):
  1. Conservation: resident weight pages, owned KV blocks and free runs tile the arena exactly,
     so free + owned + weight bytes == total and no KV block overlaps a live weight or another.
  2. Every block is in exactly one block table, and each table holds ceil(reserved / B) blocks.
  3. Each resident parameter is a view at its home bytes, and those bytes still hold what was
     loaded (fingerprint); dropped parameters are empty tensors, so nothing reads freed bytes.
  4. Capacity: capacity_tokens == (total - weight bytes) // block bytes * B, and
     block bytes == kv_bytes_per_token(resident layers) * B.
  5. Nothing leaked: free runs are maximal, and with no blocks owned every non-weight page is
     free or reserved for a restore.
  6. A restore's reserved pages lie inside the home pages of the layers it restores; filled
     and unfilled ones are disjoint.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.memory.arena_layout import (
    SHARED,
    ArenaConfig,
    PageRuns,
    as_pair,
    assert_tiles,
    check_restore_source,
    fingerprint,
    fingerprint_on_device,
    plan_weights,
)
from nanoserve.memory.blocks import NoFreeBlocksError

__all__ = ["ArenaConfig", "BlocksInUseError", "CapacityChange", "MemoryArena", "NoFreeBlocksError"]


class BlocksInUseError(RuntimeError):
    """`restore_layers` refused: KV blocks are still owned by sequences."""


@dataclass(frozen=True)
class CapacityChange:
    """What a drop or a restore did to KV capacity (token counts are whole blocks)."""

    kind: str  # "drop" or "restore"
    layers: tuple[int, ...]
    weight_bytes: int  # page bytes handed to KV (drop) or taken back from it (restore)
    kv_bytes_per_token: int  # for the resident layers after the change
    tokens: int  # KV tokens `weight_bytes` hold at the new geometry
    capacity_before: int
    capacity_after: int
    copied_bytes: int = 0  # restore: bytes copied by the call itself (less if pulled in the background)


class MemoryArena:
    """Weights and KV blocks of one device in one buffer; see the module docstring."""

    def __init__(self, model: nn.Module, config: ArenaConfig, device: torch.device | str | None = None):
        self.config = config
        self._params = dict(model.named_parameters())  # tied weights appear once
        if not self._params:
            raise ValueError("model has no parameters")
        device = torch.device(device) if device is not None else next(iter(self._params.values())).device
        layout = plan_weights(self._params, config)
        self.layer_ids: tuple[int, ...] = layout.layer_ids
        self._home, self._slots = layout.home, layout.slots
        self._resident: tuple[int, ...] = self.layer_ids
        self.num_pages = layout.num_pages + config.kv_blocks * self.block_pages
        self._arena = torch.zeros(self.num_pages * config.page_bytes, dtype=torch.uint8, device=device)
        self._pages = self._arena.view(config.kv_dtype).view(
            self.num_pages, config.block_size, config.num_kv_heads, config.head_dim)
        self._fingerprints: dict[int, tuple[int, int]] = {}
        for group in self._home:
            self._load(group, {s.name: self._params[s.name].detach() for s in self._slots[group]})
        self._free = PageRuns()
        self._free.release(layout.num_pages, self.num_pages - layout.num_pages)
        self._tables: dict[Hashable, list[int]] = {}
        self._reserved: dict[Hashable, int] = {}
        self.history: list[CapacityChange] = []  # every drop and restore, in order
        # A restore in the background (`begin_restore`): its layers, their weights' source, and
        # the reserved pages of their homes, unfilled and filled.
        self._pull_layers: tuple[int, ...] = ()
        self._pull_source: Mapping[str, torch.Tensor] = {}
        self._pull_todo, self._pull_done = PageRuns(), PageRuns()
        # layer -> fingerprint of its filled pages, on the device (`fingerprint_on_device`)
        self._pull_prints: dict[int, torch.Tensor] = {}
        self.pulled_bytes = 0  # weight bytes `fill_restore` has copied, over the arena's life
        # On a GPU the background restore copies on a stream of its own, from page-locked host
        # weights, beside the forwards (§4.4 puts pulls behind the pipeline's activations).
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # -- geometry and accounting ---------------------------------------------------------
    @property
    def resident_layers(self) -> tuple[int, ...]:
        return self._resident

    @property
    def block_pages(self) -> int:
        """Pages of one KV block: K and V of every resident layer."""
        return 2 * len(self._resident)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def total_bytes(self) -> int:
        return self._arena.numel()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the pages holding live weights (shared + resident layers)."""
        return sum(self._home[g][1] for g in (SHARED, *self._resident) if g in self._home) * self.config.page_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token for the resident layers only: dropped layers run on a peer."""
        return self.block_pages * self.config.page_bytes // self.config.block_size

    @property
    def capacity_blocks(self) -> int:
        """Blocks the non-weight bytes would hold if unfragmented."""
        return (self.total_bytes - self.weight_bytes) // (self.block_pages * self.config.page_bytes)

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.config.block_size

    def kv_caches(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Resident layer -> (k_cache, v_cache), each [span, B, kv_heads, head_dim], indexed
        by block id. Views change with the geometry: fetch them again after a drop or restore."""
        span = self.num_pages - self.block_pages + 1
        return {layer: (self._pages[2 * r : 2 * r + span], self._pages[2 * r + 1 : 2 * r + 1 + span])
                for r, layer in enumerate(self._resident)}

    # -- drop and restore (§4.1, §4.4) ---------------------------------------------------
    def drop_layers(self, layer_ids: Iterable[int]) -> CapacityChange:
        """Give the pages of `layer_ids`' weights to the KV cache; no surviving weight moves."""
        layers = tuple(sorted(set(layer_ids)))
        if not set(layers) <= set(self._resident):
            raise ValueError(f"layers {sorted(set(layers) - set(self._resident))} are not resident")
        if len(layers) == len(self._resident):
            raise ValueError("cannot drop every resident layer")
        if self._pull_layers:
            raise ValueError(f"layers {list(self._pull_layers)} are being restored: cancel_restore first")
        before, old_block_pages = self.capacity_tokens, self.block_pages
        old_ranks = {layer: r for r, layer in enumerate(self._resident)}
        self._resident = tuple(layer for layer in self._resident if layer not in layers)
        for block in self.owned_blocks():
            # Ranks only move down, in order, so no pair is overwritten before it is moved.
            for new_rank, layer in enumerate(self._resident):
                src, dst = block + 2 * old_ranks[layer], block + 2 * new_rank
                if src != dst:
                    self._pages[dst : dst + 2].copy_(self._pages[src : src + 2])
            self._free.release(block + self.block_pages, old_block_pages - self.block_pages)
        for layer in layers:
            for slot in self._slots[layer]:
                # A view left here would read whatever KV is later written over these bytes.
                self._params[slot.name].data = torch.empty(0, dtype=slot.dtype, device=self._arena.device)
            self._free.release(*self._home[layer])
            del self._fingerprints[layer]
        return self._change("drop", layers, before)

    def restore_layers(self, layer_ids: Iterable[int], source: Mapping[str, torch.Tensor]) -> CapacityChange:
        """Load `layer_ids`' weights back to their home pages from `source` (parameter name ->
        tensor: a host copy or a peer's weights). Refused while any KV block is owned."""
        layers = tuple(sorted(set(layer_ids)))
        dropped = set(self.layer_ids) - set(self._resident)
        if not set(layers) <= dropped:
            raise ValueError(f"layers {sorted(set(layers) - dropped)} are not dropped")
        check_restore_source([s for layer in layers for s in self._slots[layer]], source)
        owners = [seq for seq, table in self._tables.items() if table]
        if owners:
            raise BlocksInUseError(f"cannot restore layers {list(layers)}: sequences {owners[:8]} own "
                                   f"{self.num_used_blocks} KV blocks whose KV for those layers only the peer has")
        if self._pull_layers and layers != self._pull_layers:
            self.cancel_restore()
        before = self.capacity_tokens
        if self._pull_layers:  # the pull reserved every home page once its block was freed
            assert self._pull_todo.num_pages + self._pull_done.num_pages == sum(b - a for a, b in self._pull_homes())
            copied = self._fill(self._pull_todo.num_pages)  # what the background did not reach
            self._wait_for_copies()  # the forwards read these layers from the next step on
            prints = {layer: as_pair(pair) for layer, pair in self._pull_prints.items()}
            self._pull_layers, self._pull_source, self._pull_done, self._pull_prints = (), {}, PageRuns(), {}
            for layer in layers:
                self._load(layer, source, copy=False, fingerprinted=prints.get(layer))
        else:
            copied = sum(slot.nbytes for layer in layers for slot in self._slots[layer])
            for layer in layers:
                self._free.take(*self._home[layer])  # free: no block is owned, no weight is there
                self._load(layer, source)
        self._resident = tuple(sorted((*self._resident, *layers)))
        return self._change("restore", layers, before, copied)

    # -- restore in the background (§4.4) ------------------------------------------------
    @property
    def restoring(self) -> tuple[int, ...]:
        """The layers a background restore is pulling (empty: none)."""
        return self._pull_layers

    @property
    def pull_pages_left(self) -> int:
        """Reserved pages not yet filled: what `fill_restore` can still do now."""
        return self._pull_todo.num_pages

    def begin_restore(self, layer_ids: Iterable[int], source: Mapping[str, torch.Tensor]) -> None:
        """§4.4: "we overlap restoring with the normal request processing". Reserve the home pages
        of `layer_ids` (dropped layers): the free ones now, each page under a KV block when that
        block is freed. Serving goes on; `fill_restore` pulls the weights in between steps."""
        layers = tuple(sorted(set(layer_ids)))
        dropped = set(self.layer_ids) - set(self._resident)
        if not layers or not set(layers) <= dropped:
            raise ValueError(f"layers {sorted(set(layers) - dropped) or '[]'} are not dropped")
        if self._pull_layers:
            raise ValueError(f"layers {list(self._pull_layers)} are already being restored")
        check_restore_source([s for layer in layers for s in self._slots[layer]], source)
        self._pull_layers, self._pull_source = layers, source
        for start, end in self._pull_homes():
            for run_start, length in list(self._free):
                lo, hi = max(start, run_start), min(end, run_start + length)
                if lo < hi:
                    self._free.take(lo, hi - lo)
                    self._pull_todo.release(lo, hi - lo)

    def fill_restore(self, max_bytes: int | None) -> int:
        """Copy the weights into up to `max_bytes` of reserved, unfilled pages (None: all of
        them), lowest first; returns the bytes copied. Our choice: issued between steps from
        the host copy, one chunk a step; on a GPU on the arena's copy stream, so the copy runs
        beside the next forwards and the host does not wait for it (§4.4 puts pulls behind the
        pipeline's activations)."""
        page = self.config.page_bytes
        copied = self._fill(self._pull_todo.num_pages if max_bytes is None else max(1, max_bytes // page))
        self.pulled_bytes += copied
        return copied

    def _fill(self, pages: int) -> int:
        """Fill up to `pages` reserved pages, lowest first, and fingerprint each as it is filled
        (nothing writes a reserved page again, so the switch need not read the layer back)."""
        copied, page = 0, self.config.page_bytes
        with self._on_copy_stream():
            while pages and self._pull_todo.num_pages:
                start, length = next(iter(self._pull_todo))
                length = min(length, pages)
                self._pull_todo.take(start, length)
                copied += self._copy_weight_bytes(start * page, (start + length) * page)
                if page % 8 == 0:  # whole words: a page's fingerprint adds to its home's
                    for layer in self._pull_layers:
                        home, n = self._home[layer]
                        lo, hi = max(start, home), min(start + length, home + n)
                        if lo < hi:
                            piece = fingerprint_on_device(self._arena[lo * page : hi * page],
                                                          first=(lo - home) * page // 8)
                            held = self._pull_prints.get(layer)
                            self._pull_prints[layer] = piece if held is None else held + piece
                self._pull_done.release(start, length)
                pages -= length
        return copied

    def _on_copy_stream(self) -> AbstractContextManager[object]:
        """Where a restore's copies run: on a GPU the arena's copy stream, which first waits for
        the work queued so far (a reserved page may have been under a KV block that a queued
        forward still reads); on a CPU, in order."""
        if self._copy_stream is None:
            return nullcontext()
        self._copy_stream.wait_stream(torch.cuda.current_stream(self._arena.device))
        return torch.cuda.stream(self._copy_stream)

    def _wait_for_copies(self) -> None:
        """Work queued from now on runs after the restore's copies: before a forward reads a
        restored layer, or a KV block is carved from a page a cancelled restore was filling."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self._arena.device).wait_stream(self._copy_stream)

    def cancel_restore(self) -> None:
        """Throttling came back: the reserved pages, filled or not, are free KV pages again."""
        self._wait_for_copies()
        for runs in (self._pull_todo, self._pull_done):
            for start, length in list(runs):
                runs.take(start, length)
                self._free.release(start, length)
        self._pull_layers, self._pull_source, self._pull_prints = (), {}, {}

    def overlaps_restore(self, block: int, layers: Iterable[int] | None = None) -> bool:
        """Whether KV block `block` lies (partly) on a page a background restore wants (or on
        the home of one of `layers`)."""
        end = block + self.block_pages
        return any(start < end and block < stop for start, stop in self._pull_homes(layers))

    def _pull_homes(self, layers: Iterable[int] | None = None) -> list[tuple[int, int]]:
        """[first page, end) of each home a background restore fills (or of `layers`)."""
        return [(self._home[layer][0], self._home[layer][0] + self._home[layer][1])
                for layer in (self._pull_layers if layers is None else layers)]

    def _copy_weight_bytes(self, lo: int, hi: int) -> int:
        """Copy every restored parameter's bytes that fall in arena bytes [lo, hi) from the
        source; returns how many (alignment gaps between parameters hold no weight)."""
        copied = 0
        for layer in self._pull_layers:
            for slot in self._slots[layer]:
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.nbytes)
                if a < b:
                    flat = self._pull_source[slot.name].detach().contiguous().view(-1).view(torch.uint8)
                    # Non-blocking: from page-locked memory (move_weights_to_host) the host goes on.
                    self._arena[a:b].copy_(flat[a - slot.offset : b - slot.offset], non_blocking=True)
                    copied += b - a
        return copied

    def _release_pages(self, start: int, length: int) -> None:
        """Free [start, start + length), except the pages a background restore wants: those
        become reserved for it."""
        homes = self._pull_homes()
        cuts = sorted({start, start + length, *(x for home in homes for x in home if start < x < start + length)})
        for lo, hi in zip(cuts, cuts[1:]):
            wanted = any(a <= lo and hi <= b for a, b in homes)
            (self._pull_todo if wanted else self._free).release(lo, hi - lo)

    def _load(self, group: int, source: Mapping[str, torch.Tensor], copy: bool = True,
              fingerprinted: tuple[int, int] | None = None) -> None:
        """Point `group`'s parameters at their home bytes, copying `source` there first unless
        a background restore already did (and fingerprinted them, page by page)."""
        for slot in self._slots[group]:
            view = self._arena[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
            self._params[slot.name].data = view.copy_(source[slot.name]) if copy else view
        self._fingerprints[group] = fingerprinted or fingerprint(self._home_bytes(group))

    def _home_bytes(self, group: int) -> torch.Tensor:
        start, pages = self._home[group]
        return self._arena[start * self.config.page_bytes : (start + pages) * self.config.page_bytes]

    def _change(self, kind: str, layers: tuple[int, ...], before: int, copied: int = 0) -> CapacityChange:
        weight_bytes = sum(self._home[g][1] for g in layers) * self.config.page_bytes
        block_bytes = self.block_pages * self.config.page_bytes
        change = CapacityChange(kind, layers, weight_bytes, self.kv_bytes_per_token,
                                weight_bytes // block_bytes * self.config.block_size, before, self.capacity_tokens,
                                copied)
        self.history.append(change)
        return change

    # -- KV blocks (BlockPool's interface; ids are first pages) --------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be placed now: exact, fragmentation included."""
        return self._free.fits(self.block_pages)

    @property
    def num_used_blocks(self) -> int:
        return sum(len(table) for table in self._tables.values())

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    @property
    def caching(self) -> bool:
        """The arena keeps no prefix cache (`ArenaKV` says why): no block is ever shared."""
        return False

    def can_allocate(self, seq_id: Hashable, num_tokens: int, shared: Sequence[int] = ()) -> bool:
        if shared:
            raise ValueError("the arena shares no blocks")
        return self.blocks_needed(seq_id, num_tokens) <= self.num_free_blocks

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The live table (not a copy): callers must not modify it."""
        return self._tables.get(seq_id, [])

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        table, size = self._tables[seq_id], self.config.block_size
        if end > self._reserved[seq_id]:
            raise IndexError(f"positions up to {end} exceed the {self._reserved[seq_id]} reserved slots")
        return [table[p // size] * size + p % size for p in range(start, end)]

    def allocate(self, seq_id: Hashable, num_tokens: int, shared: Sequence[int] = ()) -> list[int]:
        """Grow `seq_id`'s reservation to `num_tokens` slots; all or nothing."""
        if shared:
            raise ValueError("the arena shares no blocks")
        table, new = self._tables.get(seq_id), []
        need = self.blocks_for(num_tokens) - len(table or ())
        if need > 0 or table is None:  # else (most decode steps) no block is needed: skip the free runs
            if need > self._free.fits(self.block_pages):  # O(1): the free runs keep their count
                raise NoFreeBlocksError(f"need {need} blocks, {self.num_free_blocks} free")
            new = [self._free.carve(self.block_pages) for _ in range(need)]
            self._tables.setdefault(seq_id, []).extend(new)
        self._reserved[seq_id] = max(self._reserved.get(seq_id, 0), num_tokens)
        return new

    def free(self, seq_id: Hashable) -> int:
        table = self._tables.pop(seq_id, [])
        self._reserved.pop(seq_id, None)
        for block in table:
            self._release_pages(block, self.block_pages)
        return len(table)

    def release_blocks(self, seq_id: Hashable, blocks: Iterable[int]) -> None:
        """Free some of `seq_id`'s blocks, shrinking its reservation by a block each (a group
        member gives back the blocks of a lookup table whose logical ids its owner retired)."""
        blocks, table = set(blocks), self._tables[seq_id]
        if not blocks <= set(table):
            raise ValueError(f"blocks {sorted(blocks - set(table))} are not {seq_id!r}'s")
        table[:] = [b for b in table if b not in blocks]
        self._reserved[seq_id] = len(table) * self.config.block_size
        for block in blocks:
            self._release_pages(block, self.block_pages)

    def adopt(self, seq_id: Hashable, block: int) -> None:
        """Give `seq_id` block `block` again; its pages must all be free (the inverse of
        `release_blocks` after a cancelled restore)."""
        self._free.take(block, self.block_pages)
        self._tables.setdefault(seq_id, []).append(block)
        self._reserved[seq_id] = len(self._tables[seq_id]) * self.config.block_size

    def free_all(self) -> int:
        """Free every sequence's blocks (a regroup re-carves them all, cluster/member.py)."""
        return sum(self.free(seq_id) for seq_id in list(self._tables))

    def layer_bytes(self, layer: int) -> int:
        """Bytes of the pages `layer`'s weights fill: what dropping it gives the KV cache."""
        return self._home[layer][1] * self.config.page_bytes

    def owned_blocks(self) -> list[int]:
        """Every block some sequence owns: the KV a drop must ship to the peer first (§4.2)."""
        return [block for table in self._tables.values() for block in table]

    # -- invariants ----------------------------------------------------------------------
    def check_invariants(self, check_weight_bytes: bool = True) -> None:
        """`check_weight_bytes` re-reads every live weight byte: off for cheap per-step checks."""
        owned = self.owned_blocks()
        assert len(set(owned)) == len(owned), "a block appears in two tables (or twice in one)"
        live = (SHARED, *self._resident) if SHARED in self._home else self._resident
        self._free.check()
        assert_tiles([(*self._home[g], f"weights of group {g}") for g in live]
                     + [(b, self.block_pages, f"KV block {b}") for b in owned]
                     + [(start, n, "free run") for start, n in self._free]
                     + [(start, n, "page reserved for a restore") for runs in (self._pull_todo, self._pull_done)
                        for start, n in runs], self.num_pages)
        wanted: list[list[int]] = []  # the homes being restored, adjacent ones merged
        for a, b in sorted(self._pull_homes()):
            if wanted and wanted[-1][1] == a:
                wanted[-1][1] = b
            else:
                wanted.append([a, b])
        for runs in (self._pull_todo, self._pull_done):
            runs.check()
            assert all(any(a <= start and start + n <= b for a, b in wanted) for start, n in runs), \
                "a reserved page lies outside the homes being restored"
        assert bool(self._pull_layers) or not (self._pull_todo.num_pages or self._pull_done.num_pages)
        assert self._tables.keys() == self._reserved.keys()
        for seq_id, table in self._tables.items():
            assert len(table) == self.blocks_for(self._reserved[seq_id]), f"{seq_id}: table size != reservation"
        base = self._arena.data_ptr()
        for group in live:
            for slot in self._slots[group]:
                param = self._params[slot.name]
                assert param.data_ptr() == base + slot.offset, f"{slot.name} no longer views its home bytes"
                assert tuple(param.shape) == slot.shape and param.dtype == slot.dtype, f"{slot.name} changed shape"
            assert not check_weight_bytes or fingerprint(self._home_bytes(group)) == self._fingerprints[group], \
                f"weights of group {group} were overwritten"
        for layer in set(self.layer_ids) - set(self._resident):
            assert all(self._params[s.name].numel() == 0 for s in self._slots[layer]), f"layer {layer} still viewed"
        assert self._fingerprints.keys() == set(live)
        block_bytes = self.block_pages * self.config.page_bytes
        assert block_bytes == self.kv_bytes_per_token * self.config.block_size
        assert self.capacity_tokens == (self.total_bytes - self.weight_bytes) // block_bytes * self.config.block_size
        assert self.num_free_blocks == sum(n // self.block_pages for _, n in self._free), "free-block count is stale"
        assert len(owned) + self.num_free_blocks <= self.capacity_blocks, "more blocks than bytes"
        if not owned:
            reserved = self._pull_todo.num_pages + self._pull_done.num_pages
            assert (self._free.num_pages + reserved) * self.config.page_bytes == self.total_bytes - self.weight_bytes
