"""Layout bookkeeping for `MemoryArena` (arena.py): its config, where each weight goes, free
page runs, restore-source and tiling checks, and the weights' fingerprint.

Pages are planned and counted here, never touched: no byte of the arena is written in this
module (`fingerprint` only reads), so the page arithmetic can be read and tested on its own.
"""
from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nanoserve.config import ModelConfig

SHARED = -1  # group of weights outside every decoder layer (embeddings, norm, head); never dropped


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ArenaConfig:
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    kv_blocks: int  # full-model KV blocks the arena holds besides the weights, before any drop
    weight_align: int = 256  # byte alignment of each parameter (kernels like aligned loads)
    layer_pattern: str = r"(?:^|\.)layers\.(\d+)\."  # the decoder-layer index in a parameter name

    def __post_init__(self) -> None:
        if min(self.block_size, self.num_kv_heads, self.head_dim, self.weight_align) < 1 or self.kv_blocks < 0:
            raise ValueError("block_size, num_kv_heads, head_dim, weight_align must be positive")

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype, kv_blocks: int,
                          **kwargs: Any) -> ArenaConfig:
        return cls(block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype, kv_blocks, **kwargs)

    @property
    def page_bytes(self) -> int:
        """K (or V) of one layer for one block of tokens."""
        return self.block_size * self.num_kv_heads * self.head_dim * _element_size(self.kv_dtype)


@dataclass(frozen=True)
class WeightSlot:
    """Where one parameter lives in the arena."""

    name: str
    offset: int  # bytes from the arena's start
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _element_size(self.dtype) * int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class WeightLayout:
    layer_ids: tuple[int, ...]
    home: dict[int, tuple[int, int]]  # group (SHARED or layer) -> (first page, pages)
    slots: dict[int, list[WeightSlot]]
    num_pages: int  # pages all weights take; KV pages follow


def plan_weights(params: Mapping[str, torch.Tensor], config: ArenaConfig) -> WeightLayout:
    """Give each weight group whole pages: SHARED first, then the layers in order, so dropping
    a run of adjacent layers (KunServe drops a half) frees one contiguous stretch."""
    pattern = re.compile(config.layer_pattern)
    groups: dict[int, list[str]] = {}
    for name in params:
        match = pattern.search(name)
        groups.setdefault(int(match.group(1)) if match else SHARED, []).append(name)
    layer_ids = tuple(sorted(g for g in groups if g != SHARED))
    if not layer_ids:
        raise ValueError(f"no parameter name matches layer_pattern {config.layer_pattern!r}")
    page = config.page_bytes
    home: dict[int, tuple[int, int]] = {}
    slots: dict[int, list[WeightSlot]] = {}
    next_page = 0
    for group in sorted(groups):
        cursor, slots[group] = next_page * page, []
        for name in groups[group]:
            param = params[name]
            align = max(config.weight_align, param.element_size())
            cursor = -(-cursor // align) * align
            slots[group].append(WeightSlot(name, cursor, tuple(param.shape), param.dtype))
            cursor += param.numel() * param.element_size()
        pages = -(-cursor // page) - next_page
        home[group], next_page = (next_page, pages), next_page + pages
    return WeightLayout(layer_ids, home, slots, next_page)


def check_restore_source(slots: Iterable[WeightSlot], source: Mapping[str, torch.Tensor]) -> None:
    """Refuse a restore source that lacks a parameter or holds it with the wrong shape or dtype."""
    for slot in slots:
        if slot.name not in source:
            raise KeyError(f"restore source has no {slot.name!r}")
        tensor = source[slot.name]
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise ValueError(f"{slot.name}: source is {tuple(tensor.shape)} {tensor.dtype}, "
                             f"expected {slot.shape} {slot.dtype}")


FINGERPRINT_MOD = 1 << 64


def fingerprint(region: torch.Tensor, chunk: int = 1 << 22, first: int = 0) -> tuple[int, int]:
    """Sum and position-weighted sum of the region's 8-byte words (of its bytes where they do
    not align), modulo 2^64: changing any one byte changes the pair. Words, not bytes, because a
    restore fingerprints every layer it loads: summing bytes widened to int64 took 10x longer
    than the copy itself (wrapping int64 arithmetic keeps a one-word change visible).

    `first`: the region's first word (or byte) is word `first` of a larger region. The pairs of
    consecutive pieces then add up (modulo 2^64) to the larger region's pair, so a background
    restore fingerprints each page as it fills it (`fingerprint_on_device`)."""
    return as_pair(fingerprint_on_device(region, chunk, first))


def fingerprint_on_device(region: torch.Tensor, chunk: int = 1 << 22, first: int = 0) -> torch.Tensor:
    """`fingerprint`'s pair as a two-element int64 tensor on the region's device, computed
    without waiting for it: a background restore fingerprints the pages it fills on its copy
    stream, adds the pieces' tensors, and reads the sum once, when the layer comes back. int64
    sums wrap, which is arithmetic modulo 2^64, so the sum of the pieces' tensors is the whole
    region's."""
    words = region
    if region.numel() % 8 == 0 and region.storage_offset() % 8 == 0:
        words = region.view(torch.int64)
    pair = torch.zeros(2, dtype=torch.int64, device=region.device)
    for start in range(0, words.numel(), chunk):
        piece = words[start : start + chunk].to(torch.int64)
        position = torch.arange(first + start + 1, first + start + 1 + piece.numel(), device=piece.device)
        pair += torch.stack([piece.sum(), (piece * position).sum()])
    return pair


def as_pair(pair: torch.Tensor) -> tuple[int, int]:
    """A `fingerprint_on_device` tensor as `fingerprint`'s pair (this waits for it)."""
    total, weighted = pair.tolist()
    return total % FINGERPRINT_MOD, weighted % FINGERPRINT_MOD


class PageRuns:
    """A set of free pages kept as maximal runs [start, start + length), sorted by start.

    Runs are merged on release, so two runs never touch: a run's length is the longest
    contiguous stretch a KV block could be carved from there.

    Counts are kept up to date, not summed per call: the free pages, and for one piece length
    (`unit`, the last one `fits` or `first_fit` was asked about: the arena's block size) how
    many pieces fit and which runs hold one, so both answer in O(1) on an allocator's hot path.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._lengths: dict[int, int] = {}
        self._num_pages = 0
        self._unit = 0  # 0: no piece length indexed yet
        self._unit_fits = 0  # sum(run // unit)
        self._unit_starts: list[int] = []  # sorted starts of the runs of at least `unit` pages

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((start, self._lengths[start]) for start in self._starts)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    def fits(self, length: int) -> int:
        """How many `length`-page pieces can still be carved, each from a single run."""
        if length != self._unit:
            self._index(length)
        return self._unit_fits

    def first_fit(self, length: int) -> int | None:
        # Lowest address first keeps blocks packed at the bottom of each free stretch.
        if length != self._unit:
            self._index(length)
        return self._unit_starts[0] if self._unit_starts else None

    def carve(self, length: int) -> int:
        """Take the lowest `length`-page piece that fits in one run; returns its first page."""
        start = self.first_fit(length)
        if start is None:
            raise ValueError(f"no free run holds {length} pages")
        self.take(start, length)
        return start

    def take(self, start: int, length: int) -> None:
        """Mark [start, start + length) used; every page of it must be free, in one run."""
        if length == 0:
            return
        i = bisect.bisect_right(self._starts, start) - 1
        run = self._starts[i] if i >= 0 else None
        if run is None or start + length > run + self._lengths[run]:
            raise ValueError(f"pages [{start}, {start + length}) are not all free")
        run_end = run + self._remove(i)
        self._insert(run, start - run)
        self._insert(start + length, run_end - start - length)

    def release(self, start: int, length: int) -> None:
        """Mark [start, start + length) free; none of it may be free already."""
        if length == 0:
            return
        end = start + length
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] > start:
            raise ValueError(f"pages [{start}, {end}) overlap a free run (double free)")
        if i < len(self._starts) and self._starts[i] < end:
            raise ValueError(f"pages [{start}, {end}) overlap a free run (double free)")
        if i < len(self._starts) and self._starts[i] == end:
            end += self._remove(i)
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:
            start = self._starts[i - 1]
            self._remove(i - 1)
        self._insert(start, end - start)

    def _insert(self, start: int, length: int) -> None:
        if length > 0:
            bisect.insort(self._starts, start)
            self._lengths[start] = length
            self._num_pages += length
            if self._unit and length >= self._unit:
                self._unit_fits += length // self._unit
                bisect.insort(self._unit_starts, start)

    def _remove(self, i: int) -> int:
        """Drop the i-th run; returns its length."""
        start = self._starts.pop(i)
        length = self._lengths.pop(start)
        self._num_pages -= length
        if self._unit and length >= self._unit:
            self._unit_fits -= length // self._unit
            del self._unit_starts[bisect.bisect_left(self._unit_starts, start)]
        return length

    def _index(self, unit: int) -> None:
        """Count pieces of `unit` pages from scratch (once per change of piece length)."""
        if unit < 1:
            raise ValueError("piece length must be positive")
        self._unit = unit
        self._unit_fits = sum(run // unit for run in self._lengths.values())
        self._unit_starts = [start for start in self._starts if self._lengths[start] >= unit]

    def check(self) -> None:
        assert self._starts == sorted(self._lengths), "run index out of sync"
        for a, b in zip(self._starts, self._starts[1:]):
            assert a + self._lengths[a] < b, f"free runs at {a} and {b} touch or overlap (not merged)"
        assert all(length > 0 for length in self._lengths.values()), "empty free run"
        assert self._num_pages == sum(self._lengths.values()), "free page count is stale"
        if self._unit:
            assert self._unit_fits == sum(run // self._unit for run in self._lengths.values()), "fit count is stale"
            assert self._unit_starts == [s for s in self._starts if self._lengths[s] >= self._unit], \
                "index of runs that fit a piece is stale"


def assert_tiles(pieces: Iterable[tuple[int, int, str]], num_pages: int) -> None:
    """Assert the (start, length, what) pieces cover [0, num_pages) exactly once.

    This is conservation and disjointness at once: a gap is a leaked page, an overlap is a
    page two owners (say a KV block and a live weight) both believe is theirs.
    """
    end, last = 0, "start of arena"
    for start, length, what in sorted(p for p in pieces if p[1] > 0):
        assert start >= end, f"pages [{start}, {end}) held by both {last} and {what}"
        assert start == end, f"pages [{end}, {start}) leaked: neither free nor owned (after {last})"
        end, last = start + length, what
    assert end == num_pages, f"pages [{end}, {num_pages}) leaked, or pieces run past the arena"
