"""Automatic prefix caching: the index from block contents to the blocks that hold them (vLLM v1's
`BlockPool` cache, `vllm/v1/core/block_pool.py`; nano-vllm's `BlockManager`; SGLang's radix tree
does the same job with a tree).

A *full* block's K/V depends on its own tokens and on every token before it, so it is named by a
chain hash: `hash(parent block's hash, its tokens, extra key)`. Two requests whose first n blocks
hold the same tokens have the same first n hashes, and the second can point its block table at
the first one's blocks instead of recomputing them. `block_hashes` extends a request's chain
(kept on the request, `Request.block_hashes`, as vLLM keeps it) and `PrefixCache` maps each
hash to the one block that holds it.

A cached block's life (the pool, memory/blocks.py, keeps its reference count):

    written, full ──commit──► cached, owned (ref ≥ 1) ──last owner frees──► cached, free (LRU)
                                   ▲                                            │      │
                                   └──────────── a hit takes it back ───────────┘      │
                                                                   allocation evicts it: plain free

Free cached blocks are the *evictable* ones, kept here in least-recently-freed order. They count
as free (the pool hands one out when it has no never-cached block left, forgetting its hash),
so caching never costs capacity: it only delays reuse. A request frees its blocks tail first, so
the blocks evicted first are the ends of prefixes, and the heads, the blocks most requests
share, stay longest.

The hash is BLAKE2b over the parent's digest and the tokens (16 bytes; vLLM offers SHA-256 for
the same reason: Python's `hash` of a tuple of ints can be forced to collide by a client that
chooses its prompt). The extra key is for whatever else changes a block's K/V (a LoRA adapter,
a model revision; none yet): requests with different keys never share.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes


def block_hashes(token_ids: Sequence[int], block_size: int, known: list[BlockHash], num_blocks: int,
                 extra_key: bytes = b"") -> list[BlockHash]:
    """Extend `known` (the chain hashes of the first len(known) blocks of `token_ids`, in place)
    to the first `num_blocks` full blocks and return it. Each block is hashed once per request."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    parent = known[-1] if known else extra_key
    for i in range(len(known), num_blocks):
        tokens = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=16).digest()
        known.append(parent)
    return known


class PrefixCache:
    """Which block holds each cached hash, and the evictable (free, cached) blocks in LRU order.

    Invariants (checked by `check_invariants`, with the pool's own in `BlockPool`):
      1. `hash -> block` and `block -> hash` are inverse maps: a hash names exactly one block.
      2. Every evictable block is cached.
    Counters: `queries` and `hits` in tokens (admissions that looked up the cache, and the tokens
    they found), `evictions` in blocks.
    """

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    # -- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def longest_hit(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The blocks that hold the longest cached run of `hashes` from the first."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    # -- mutations -----------------------------------------------------------------------
    def insert(self, block: int, block_hash: BlockHash) -> bool:
        """Name `block` by `block_hash`. False (nothing changes) if that content is cached in
        another block already, or `block` is cached: the first copy stays the shared one."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def forget(self, block: int) -> None:
        """`block`'s content is no longer shareable (it is about to be overwritten, or the cache
        is reset). A no-op for an uncached block; an evictable one leaves the LRU too."""
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._block_of[block_hash]
        self._evictable.pop(block, None)

    def park(self, block: int) -> None:
        """The cached `block`'s last owner freed it: it becomes the most recently freed."""
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A hit takes the free cached `block` back into a table."""
        del self._evictable[block]

    def evict(self) -> tuple[int, BlockHash]:
        """The least recently freed evictable block, uncached, for a new owner, and the hash it
        had (a second tier may keep its content under that name)."""
        block, _ = self._evictable.popitem(last=False)
        block_hash = self._hash_of[block]
        self.forget(block)
        self.evictions += 1
        return block, block_hash

    def take_evictable(self, blocks: Iterable[int]) -> list[int]:
        """Uncache those of `blocks` that are evictable and return them (the pool retires them)."""
        taken = [b for b in blocks if b in self._evictable]
        for b in taken:
            self.forget(b)
        return taken

    def reset(self) -> list[int]:
        """Forget every hash; returns the blocks that were evictable (now plain free blocks)."""
        freed = list(self._evictable)
        self._block_of.clear()
        self._hash_of.clear()
        self._evictable.clear()
        return freed

    def check_invariants(self) -> None:
        assert len(self._block_of) == len(self._hash_of), "hash -> block and block -> hash differ in size"
        assert all(self._hash_of[b] == h for h, b in self._block_of.items()), "a hash names two blocks"
        assert all(b in self._hash_of for b in self._evictable), "an evictable block is not cached"
