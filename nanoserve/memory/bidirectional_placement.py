"""Where BROS's bidirectional block manager puts a page (bros.txt Alg. 1 FindBlock /
FindPreemptBlock, §4.2; §5.2 block management), and the counts that settle most "no room"
answers before a search. Read-only: a `Placement` searches the `BidirectionalBlocks` it was
built over (through its public attributes and queries) and changes nothing but the index's
stale keys, which it refreshes before reading.

    be_targets      FindBlock: a BE page takes the block with the most empty slots whose BE side
                    is unused and whose RT fill leaves it room: a free block, else the RT-only
                    block with the least fill.
    rt_targets      FindPreemptBlock: an RT page takes a free block, else shares the BE-only
                    block with the fewest BE slots on the device (a pinned sequence's last).
    rt_page_room, rt_pages_lacking, no_block_for_rt_page, be_restore_out_of_reach
                    counts over the index that rule growth out without a search.
"""
from __future__ import annotations

from itertools import product

from nanoserve.memory.bidirectional_blocks import BidirectionalBlocks
from nanoserve.memory.bidirectional_index import FREE, NOBODY, SeqId


class Placement:
    """FindBlock / FindPreemptBlock (Alg. 1): read-only searches over a pool's block index."""

    def __init__(self, pool: BidirectionalBlocks) -> None:
        self.pool = pool

    # -- FindBlock / FindPreemptBlock (Alg. 1): read-only searches over the index ------------
    def rt_targets(self, count: int, taken: set[int], gone: frozenset) -> list[int] | None:
        """FindPreemptBlock: free blocks, then BE-only ones by fewest BE slots on the device (a pinned
        sequence's last), ties to the lowest id. The blocks of `gone` sequences, which the index
        files under their present owners, are ranked one by one."""
        pool = self.pool
        mine = {b for seq in gone for b in pool.seqs[seq].pages if b is not None}
        skip, index = taken | mine, pool.index
        found = [((False, False, 0), b) for b in index.first(FREE, count, lambda b: b not in skip)]
        for pinned, n in product((False, True), range(pool.block_size + 1)) if len(found) < count else ():
            pool.refresh()

            def ok(b: int) -> bool:
                if b in skip:
                    return False
                rank = self.rt_rank(b, NOBODY)
                assert rank is not None  # filed under ("be", n): a BE page alone, its RT side free
                return rank[0] == pinned  # noqa: B023
            found += [((pinned, True, n), b) for b in index.first(("be", n), count - len(found), ok)]
        ranked = sorted(found + [(r, b) for b in mine - taken if (r := self.rt_rank(b, gone)) is not None])
        return [b for _, b in ranked[:count]] if len(ranked) >= count else None

    def rt_rank(self, block: int, gone: frozenset) -> tuple[bool, bool, int] | None:
        """FindPreemptBlock's rank: (a pinned sequence's BE slots here, any BE page here, its slots
        on the device); None if the RT side is taken."""
        pool = self.pool
        owner, rt = pool.live_be(block, gone), pool.rt[block]
        if rt is not None and rt[0] not in gone:
            return None
        resident = len(pool.resident(*owner)) if owner else 0
        return owner is not None and owner[0] in pool.pinned and resident > 0, owner is not None, resident

    def be_targets(self, rooms: list[int], taken: set[int]) -> list[int] | None:
        """FindBlock, page by page: the block with the most empty slots whose BE side is unused and
        that leaves the page's room: a free block, else the RT-only block with the least fill."""
        pool = self.pool
        ready, out = pool.index.first(FREE, len(rooms), lambda b: b not in taken), []
        for room in rooms:
            for fill in range(1, pool.block_size - room + 1) if not ready else ():
                pool.refresh()
                if ready := pool.index.first(("rt", fill), 1, lambda b: b not in taken and b not in out):
                    break
            if not ready:
                return None
            out.append(ready.pop(0))
        return out

    # -- counts that settle an answer without a search ---------------------------------------
    def no_block_for_rt_page(self, seq_id: SeqId, num_tokens: int) -> bool:
        """Whether an RT sequence growing to `num_tokens` needs a block for a page (a new page, or
        a swapped-out one to restore) while no block can take one: none free and none holding a
        BE page alone, FindPreemptBlock's only targets. Then its growth fails whatever else it
        would plan. In overload the scheduler asks this of every waiting RT request, each step."""
        return self.rt_page_room() == 0 and self.rt_pages_lacking(seq_id, num_tokens) > 0

    def rt_pages_lacking(self, seq_id: SeqId, num_tokens: int) -> int:
        """Pages an RT sequence growing to `num_tokens` still needs a block for (new pages, or
        swapped-out ones to restore)."""
        state = self.pool.seqs.get(seq_id)
        on_device = 0 if state is None else sum(block is not None for block in state.pages)
        return -(-num_tokens // self.pool.block_size) - on_device

    def rt_page_room(self) -> int:
        """Blocks that could take an RT page: free ones and those holding a BE page alone (a
        BE-only block stays BE-only while its key is stale)."""
        return sum(n for key, n in self.pool.index.sizes.items()
                   if key == FREE or (key is not None and key[0] == "be"))

    def be_restore_out_of_reach(self, seq_id: SeqId) -> bool:
        """A count that settles most refusals before `can_grow`'s what-if (BROS asks it for every
        swapped-out BE request it passes over, each step): a BE page swapped out whole needs a
        block of its own whose BE side is unused (`be_targets`: a free block or an RT-only one),
        so more such pages than such blocks cannot be restored. Necessary, not sufficient."""
        pool = self.pool
        state = pool.seqs[seq_id]
        whole = sum(1 for page in state.host_pages if state.pages[page] is None)
        if not whole:
            return False
        pool.refresh()  # the counts below must be current
        sizes = pool.index.sizes
        return whole > sizes[FREE] + sum(sizes[("rt", fill)] for fill in range(pool.block_size))
