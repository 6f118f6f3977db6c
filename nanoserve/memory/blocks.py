"""The paged KV block pool (vLLM's PagedAttention memory manager, §4 of Kwon et al., 2023), with
automatic prefix caching (vLLM v1's `BlockPool` + `KVCacheManager`; memory/prefix_cache.py).

The KV cache is cut into `num_blocks` blocks of `block_size` token slots. A sequence owns a
block table, a list of block ids; its token at position p lives at slot
`table[p // block_size] * block_size + p % block_size` of the flattened cache. Blocks are
handed out one at a time as a sequence grows, so no sequence reserves memory it has not used
beyond its last, partly filled block.

With prefix caching (`enable_prefix_caching`), a full block whose K/V is written can be
*committed* under its chain hash (`commit`); a new sequence whose first blocks have the same
hashes starts its table with those blocks (`try_allocate(..., shared=...)`) instead of fresh
ones. A block is then in several tables: its reference count says how many, and it returns to
the pool when the last one frees it. Still cached, it waits on the cache's LRU list of
evictable blocks, where a later hit can take it back; the pool evicts it (forgetting its hash)
only when it has no never-cached free block left. A shared block is always full and never
written again: a sequence's writes go to positions past its shared prefix, in its own blocks.

A block a sequence gave up while an in-flight copy still reads or writes it (a checkpoint's
save, memory/copies.py) is *marked* by that copy until `unhold`, once the copy has landed. A
marked block that no table holds any more is *held*: off the free list, out of the cache (it
loses its hash: what the copy writes into it is not what the hash names). A block another table
still shares stays in use meanwhile (the copy only reads what nobody writes: a shared block is
full and final), and becomes held if its last owner frees it before the copy lands.

A *retired* block leaves circulation: `retire` takes the free ones off the free list at once
and each owned or held one when its last owner frees it; `unretire` puts them back. KunServe's
background restore retires the logical blocks whose pages the returning weights need
(cluster/member.py). A retiring block is not handed to a new sharer, and loses its hash.

Invariants (checked by `check_invariants`):
  1. Every block id in [0, num_blocks) is free (never-cached or evictable), held,
     retired-and-free, or owned (in at least one table), never two of these:
     free + evictable + held + retired + owned == total.
  2. An owned block's reference count is the number of tables it is in (never twice in one);
     every other block's count is zero.
  3. A sequence reserving n token slots owns exactly ceil(n / block_size) blocks.
  4. `slot_mapping` is consistent with the tables: position p maps into block table[p // B].
  5. Only owned or evictable blocks are cached.
  6. With no sequences and nothing held, every block is free (or retired).
"""
from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence

from nanoserve.memory.prefix_cache import BlockHash, PrefixCache


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 record_moves: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack of never-cached free blocks: the most recently freed block is reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks  # tables each block is in
        self._tables: dict[Hashable, list[int]] = {}
        self._reserved: dict[Hashable, int] = {}  # token slots each sequence has reserved
        self._held: set[int] = set()  # in no table, waiting for a copy to land
        self._holds: dict[int, int] = {}  # block -> in-flight copies that marked it (`free(..., hold=...)`)
        self._retiring: set[int] = set()  # out of circulation once free (`retire`)
        self._retired: set[int] = set()  # retiring and free: neither owned nor on the free list
        # Prefix caching: the hash index and the evictable blocks (None: off), and how many
        # leading blocks of each table are committed (cached or found cached).
        self.cache: PrefixCache | None = PrefixCache() if enable_prefix_caching else None
        self._committed: dict[Hashable, int] = {}
        # Blocks evicted from the cache, and cached blocks freed by their last owner, not yet
        # taken (`take_evicted`, `take_parked`): what a second tier copies. None: not recorded.
        recorded = record_moves and enable_prefix_caching
        self.evicted: list[tuple[int, BlockHash]] | None = [] if recorded else None
        self.parked: list[tuple[int, BlockHash]] | None = [] if recorded else None

    # -- queries -------------------------------------------------------------------------
    @property
    def caching(self) -> bool:
        return self.cache is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached free ones and evictable cached ones."""
        return len(self._free) + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def num_used_blocks(self) -> int:
        """Blocks in a table or held for an in-flight copy (retired and evictable ones are neither)."""
        return self.num_blocks - self.num_free_blocks - len(self._retired)

    @property
    def num_retiring_blocks(self) -> int:
        """Blocks retired, free or not yet: what the pool's capacity has lost."""
        return len(self._retiring)

    @property
    def retired_free(self) -> frozenset[int]:
        """Retired blocks no sequence holds any more."""
        return frozenset(self._retired)

    @property
    def num_held_blocks(self) -> int:
        return len(self._held)

    @property
    def num_hold_marks(self) -> int:
        """Marks of in-flight copies on blocks (`free(..., hold=...)`) not yet lifted by `unhold`."""
        return sum(self._holds.values())

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Blocks `seq_id` must still get to hold `num_tokens` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def can_allocate(self, seq_id: Hashable, num_tokens: int, shared: Sequence[int] = ()) -> bool:
        table = self._tables.get(seq_id)
        if table is not None and num_tokens <= len(table) * self.block_size:
            return True  # inside its last block (see `allocate`)
        return self._blocks_taken(seq_id, num_tokens, shared) <= self.num_free_blocks

    def _blocks_taken(self, seq_id: Hashable, num_tokens: int, shared: Sequence[int]) -> int:
        """Free blocks `try_allocate(seq_id, num_tokens, shared)` would take: new ones, and the
        shared ones that sit evictable (a hit on a free cached block takes it off the free list)."""
        need = max(0, self.blocks_needed(seq_id, num_tokens) - len(shared))
        if shared and self.cache is not None:
            need += sum(1 for b in shared if self._refs[b] == 0)
        return need

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The live table (not a copy): callers must not modify it."""
        return self._tables.get(seq_id, [])

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Flat cache slots of positions [start, end) of `seq_id`."""
        table, size = self._tables[seq_id], self.block_size
        if end > self._reserved[seq_id]:
            raise IndexError(f"positions up to {end} exceed the {self._reserved[seq_id]} reserved slots")
        return [table[p // size] * size + p % size for p in range(start, end)]

    def cached_blocks(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The blocks holding the longest cached run of `hashes` (a request's chain, from its
        first block), stopping at a retiring block; [] without caching. Changes nothing."""
        if self.cache is None:
            return []
        blocks = self.cache.longest_hit(hashes)
        if self._retiring:
            for i, b in enumerate(blocks):
                if b in self._retiring:
                    return blocks[:i]
        return blocks

    def num_committed(self, seq_id: Hashable) -> int:
        """Leading blocks of `seq_id`'s table that are committed (`commit`)."""
        return self._committed.get(seq_id, 0)

    # -- mutations -----------------------------------------------------------------------
    def try_allocate(self, seq_id: Hashable, num_tokens: int, shared: Sequence[int] = ()) -> list[int] | None:
        """`allocate` if the pool can cover it, else None (nothing changes): one call where a
        scheduler would ask `can_allocate` and then `allocate`. `shared`: cached blocks (from
        `cached_blocks`) that a new sequence starts its table with; they count as committed."""
        table = self._tables.get(seq_id)
        if table is not None and num_tokens <= len(table) * self.block_size:
            # Growth inside the last block (most decodes): the cheap path, no block moves.
            self._reserved[seq_id] = max(self._reserved[seq_id], num_tokens)
            return []
        if shared and (table is not None or len(shared) * self.block_size > num_tokens):
            raise ValueError("only a new sequence starts with shared blocks, and only within its reservation")
        if self._blocks_taken(seq_id, num_tokens, shared) > self.num_free_blocks:
            return None
        refs = self._refs
        if shared:
            cache = self.cache
            assert cache is not None, "shared blocks need prefix caching"
            for b in shared:
                if refs[b] == 0:
                    cache.unpark(b)
                refs[b] += 1
            self._committed[seq_id] = len(shared)
        new = [self._take_free() for _ in range(self.blocks_needed(seq_id, num_tokens) - len(shared))]
        for b in new:
            refs[b] = 1
        if table is None:
            table = self._tables[seq_id] = list(shared)
        table.extend(new)
        self._reserved[seq_id] = max(self._reserved.get(seq_id, 0), num_tokens)
        return new

    def _take_free(self) -> int:
        if self._free:
            return self._free.pop()
        assert self.cache is not None
        block, block_hash = self.cache.evict()  # the least recently freed cached block
        if self.evicted is not None:
            self.evicted.append((block, block_hash))
        return block

    def take_evicted(self) -> list[tuple[int, BlockHash]]:
        """The (block, hash) pairs evicted since the last call, where `record_moves` asked
        for them: the new owner writes each block in this step, so a second tier that keeps the
        content must copy it out first (PagedKV's host tier)."""
        evicted, self.evicted = self.evicted or [], [] if self.evicted is not None else None
        return evicted

    def take_parked(self) -> list[tuple[int, BlockHash]]:
        """The (block, hash) pairs of cached blocks freed by their last owner since the last call
        (where recorded) that are still free and cached under that hash: a second tier may copy
        them out in the background, before an allocation needs them."""
        parked, self.parked = self.parked or [], [] if self.parked is not None else None
        cache = self.cache
        if cache is None:
            return []
        return [(b, h) for b, h in parked if cache.is_evictable(b) and cache.hash_of(b) == h]

    def allocate(self, seq_id: Hashable, num_tokens: int, shared: Sequence[int] = ()) -> list[int]:
        """Grow `seq_id`'s reservation to `num_tokens` slots; returns the blocks added.

        All or nothing: if the pool cannot cover the growth, nothing changes.
        """
        new = self.try_allocate(seq_id, num_tokens, shared)
        if new is None:
            raise NoFreeBlocksError(f"need {self._blocks_taken(seq_id, num_tokens, shared)} blocks, "
                                    f"{self.num_free_blocks} free")
        return new

    def commit(self, seq_id: Hashable, hashes: Sequence[BlockHash]) -> None:
        """The K/V of `seq_id`'s first len(hashes) blocks is written and they are full: cache
        each under its chain hash (`hashes[i]` names `table[i]`), so later sequences may share
        them. A no-op without caching. Content already cached in another block leaves this
        copy uncached (it is freed as a plain block); vLLM keeps the first copy too."""
        cache = self.cache
        if cache is None:
            return
        done = self._committed.get(seq_id, 0)
        if len(hashes) <= done:
            return
        table = self._tables[seq_id]
        for i in range(done, len(hashes)):
            if table[i] not in self._retiring:
                cache.insert(table[i], hashes[i])
        self._committed[seq_id] = len(hashes)

    def free(self, seq_id: Hashable, hold: Collection[int] = ()) -> int:
        """Drop `seq_id`'s table. Each block its last owner drops returns to the pool, except
        those an in-flight copy still uses: `hold` (of this table's blocks) marks them for one
        copy each, and a marked block stays out of reach until `unhold`. A block other tables
        still share stays theirs. Freeing an unknown id is a no-op. Returns how many blocks left
        the table."""
        table = self._tables.pop(seq_id, [])
        self._reserved.pop(seq_id, None)
        self._committed.pop(seq_id, None)
        refs, cache, holds = self._refs, self.cache, self._holds
        if hold:
            for b in set(hold) & set(table):
                holds[b] = holds.get(b, 0) + 1
        # Tail first: the cache's LRU then evicts the ends of prefixes before their heads.
        for b in reversed(table):
            refs[b] -= 1
            if refs[b]:
                continue  # another table shares it
            if b in holds or b in self._retiring:
                if cache is not None:
                    cache.forget(b)
                (self._held if b in holds else self._retired).add(b)
            elif cache is not None and cache.is_cached(b):
                cache.park(b)
                if self.parked is not None:
                    block_hash = cache.hash_of(b)
                    assert block_hash is not None
                    self.parked.append((b, block_hash))
            else:
                self._free.append(b)
        return len(table)

    def unhold(self, blocks: Iterable[int]) -> None:
        """The copy that marked `blocks` landed: lift its mark; a held block no other copy marks
        is free again."""
        blocks = list(blocks)
        unmarked = [b for b in blocks if not self._holds.get(b)]
        if unmarked:
            raise ValueError(f"blocks {sorted(unmarked)} are not held")
        released = []
        for b in blocks:
            self._holds[b] -= 1
            if not self._holds[b]:
                del self._holds[b]
                if b in self._held:
                    self._held.discard(b)
                    released.append(b)
        self._retired.update(b for b in released if b in self._retiring)
        self._free.extend(reversed([b for b in released if b not in self._retiring]))

    def retire(self, blocks: Iterable[int]) -> None:
        """Take `blocks` out of circulation: the free ones now, the others when freed."""
        blocks = set(blocks)
        if not all(0 <= b < self.num_blocks for b in blocks):
            raise ValueError(f"block ids out of [0, {self.num_blocks})")
        self._retiring |= blocks
        now = blocks & set(self._free)
        self._free = [b for b in self._free if b not in now]
        if self.cache is not None:
            now.update(self.cache.take_evictable(blocks))
            for b in blocks:  # an owned retiring block is shared no further
                self.cache.forget(b)
        self._retired |= now

    def unretire(self) -> None:
        """Every retired block returns: the free ones to the free list."""
        self._free.extend(sorted(self._retired, reverse=True))
        self._retiring, self._retired = set(), set()

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (vLLM's `reset_prefix_cache`): evictable blocks become plain
        free blocks and blocks in use are shared no further. Returns the hashes forgotten."""
        if self.cache is None:
            return 0
        forgotten = len(self.cache)
        self._free.extend(self.cache.reset())
        return forgotten

    # -- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        owned_counts: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"{seq_id}: a block appears twice in one table"
            for b in table:
                owned_counts[b] = owned_counts.get(b, 0) + 1
        owned = set(owned_counts)
        free = set(self._free)
        evictable = {b for b in range(self.num_blocks) if self.cache is not None and self.cache.is_evictable(b)}
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not owned & free, "a block is both owned and free"
        assert not owned & evictable and not free & evictable, "an evictable block is owned or on the free list"
        assert not self._held & (owned | free | evictable), "a held block is also owned or free"
        assert self._held <= self._holds.keys(), "a held block is marked by no copy"
        assert self._holds.keys() <= owned | self._held, "a marked block is free"
        assert not self._retired & (owned | free | evictable | self._held), "a retired block is in use or free"
        assert self._retired <= self._retiring, "a block is retired without being retiring"
        assert not (self._retiring - self._retired) & (free | evictable), "a retiring block went back to the free list"
        assert len(owned) + len(free) + len(evictable) + len(self._held) + len(self._retired) == self.num_blocks, \
            "blocks were lost or invented"
        assert all(0 <= b < self.num_blocks for b in owned | free | self._held), "block id out of range"
        for b in range(self.num_blocks):
            assert self._refs[b] == owned_counts.get(b, 0), f"block {b}: reference count {self._refs[b]} " \
                                                            f"!= {owned_counts.get(b, 0)} tables"
        assert self._tables.keys() == self._reserved.keys()
        assert self._committed.keys() <= self._tables.keys()
        for seq_id, table in self._tables.items():
            assert len(table) == self.blocks_for(self._reserved[seq_id]), f"{seq_id}: table size != reservation"
            assert self._committed.get(seq_id, 0) <= len(table)
        if self.cache is not None:
            self.cache.check_invariants()
            for b in range(self.num_blocks):
                if self.cache.is_cached(b):
                    assert b in owned or b in evictable, f"block {b} is cached but neither owned nor evictable"
        if not self._tables and not self._held:
            assert len(free) + len(evictable) + len(self._retired) == self.num_blocks
