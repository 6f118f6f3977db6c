"""The paged KV block pool (vLLM's PagedAttention memory manager, §4 of Kwon et al., 2023).

The KV cache is cut into `num_blocks` blocks of `block_size` token slots. A sequence owns a
block table, a list of block ids; its token at position p lives at slot
`table[p // block_size] * block_size + p % block_size` of the flattened cache. Blocks are
handed out one at a time as a sequence grows, so no sequence reserves memory it has not used
beyond its last, partly filled block.

A block a sequence gave up while an in-flight copy still reads or writes it (a checkpoint's
save, memory/copies.py) is *held*: out of every table and off the free list, until `unhold`
returns it once the copy has landed.

A *retired* block leaves circulation: `retire` takes the free ones off the free list at once
and each owned or held one when it is freed; `unretire` puts them back. KunServe's background
restore retires the logical blocks whose pages the returning weights need (cluster/member.py).

Invariants (checked by `check_invariants`):
  1. Every block id in [0, num_blocks) is free, held, retired-and-free, or in exactly one table,
     never two of these: free + held + retired + owned == total, and no id appears twice.
  2. A sequence reserving n token slots owns exactly ceil(n / block_size) blocks.
  3. `slot_mapping` is consistent with the tables: position p maps into block table[p // B].
  4. With no sequences and nothing held, every block is free.
"""
from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed block is reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._reserved: dict[Hashable, int] = {}  # token slots each sequence has reserved
        self._held: set[int] = set()  # freed by their sequence, waiting for a copy to land
        self._retiring: set[int] = set()  # out of circulation once free (`retire`)
        self._retired: set[int] = set()  # retiring and free: neither owned nor on the free list

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks in a table or held for an in-flight copy (retired ones are neither)."""
        return self.num_blocks - len(self._free) - len(self._retired)

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

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Blocks `seq_id` must still get to hold `num_tokens` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def can_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        table = self._tables.get(seq_id)
        if table is not None and num_tokens <= len(table) * self.block_size:
            return True  # inside its last block (see `allocate`)
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

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

    # -- mutations -----------------------------------------------------------------------
    def try_allocate(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """`allocate` if the pool can cover it, else None (nothing changes): one call where a
        scheduler would ask `can_allocate` and then `allocate`."""
        table = self._tables.get(seq_id)
        if table is not None and num_tokens <= len(table) * self.block_size:
            # Growth inside the last block (most decodes): the cheap path, no block moves.
            self._reserved[seq_id] = max(self._reserved[seq_id], num_tokens)
            return []
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            return None
        new = [self._free.pop() for _ in range(need)]
        self._tables.setdefault(seq_id, []).extend(new)
        self._reserved[seq_id] = max(self._reserved.get(seq_id, 0), num_tokens)
        return new

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Grow `seq_id`'s reservation to `num_tokens` slots; returns the blocks added.

        All or nothing: if the pool cannot cover the growth, nothing changes.
        """
        new = self.try_allocate(seq_id, num_tokens)
        if new is None:
            raise NoFreeBlocksError(f"need {self.blocks_needed(seq_id, num_tokens)} blocks, {len(self._free)} free")
        return new

    def free(self, seq_id: Hashable, hold: Collection[int] = ()) -> int:
        """Return `seq_id`'s blocks to the pool, except those in `hold`, which an in-flight copy
        still uses: they stay out of reach until `unhold`. Freeing an unknown id is a no-op.
        Returns how many blocks left the table."""
        table = self._tables.pop(seq_id, [])
        self._reserved.pop(seq_id, None)
        count = len(table)
        if hold:
            held = set(hold) & set(table)
            self._held |= held
            table = [b for b in table if b not in held]
        if self._retiring:
            self._retired.update(b for b in table if b in self._retiring)
            table = [b for b in table if b not in self._retiring]
        self._free.extend(reversed(table))
        return count

    def unhold(self, blocks: Iterable[int]) -> None:
        """The copy that held `blocks` landed: they are free again."""
        blocks = list(blocks)
        if not set(blocks) <= self._held:
            raise ValueError(f"blocks {sorted(set(blocks) - self._held)} are not held")
        self._held -= set(blocks)
        self._retired.update(b for b in blocks if b in self._retiring)
        self._free.extend(reversed([b for b in blocks if b not in self._retiring]))

    def retire(self, blocks: Iterable[int]) -> None:
        """Take `blocks` out of circulation: the free ones now, the others when freed."""
        blocks = set(blocks)
        if not all(0 <= b < self.num_blocks for b in blocks):
            raise ValueError(f"block ids out of [0, {self.num_blocks})")
        self._retiring |= blocks
        now = blocks & set(self._free)
        self._retired |= now
        self._free = [b for b in self._free if b not in now]

    def unretire(self) -> None:
        """Every retired block returns: the free ones to the free list."""
        self._free.extend(sorted(self._retired, reverse=True))
        self._retiring, self._retired = set(), set()

    # -- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        owned = [b for table in self._tables.values() for b in table]
        assert len(set(owned)) == len(owned), "a block appears in two tables (or twice in one)"
        assert len(set(self._free)) == len(self._free), "a block is on the free list twice"
        assert not set(owned) & set(self._free), "a block is both owned and free"
        assert not self._held & (set(owned) | set(self._free)), "a held block is also owned or free"
        assert not self._retired & (set(owned) | set(self._free) | self._held), "a retired block is in use or free"
        assert self._retired <= self._retiring, "a block is retired without being retiring"
        assert not (self._retiring - self._retired) & set(self._free), "a retiring block went back to the free list"
        assert len(owned) + len(self._free) + len(self._held) + len(self._retired) == self.num_blocks, \
            "blocks were lost or invented"
        assert all(0 <= b < self.num_blocks for b in owned + self._free + list(self._held)), "block id out of range"
        assert self._tables.keys() == self._reserved.keys()
        for seq_id, table in self._tables.items():
            assert len(table) == self.blocks_for(self._reserved[seq_id]), f"{seq_id}: table size != reservation"
        if not self._tables and not self._held:
            assert len(self._free) + len(self._retired) == self.num_blocks
