"""The growth BROS's bidirectional block manager does most, without planning (bros.txt §5.2):
a sequence growing inside its last page, or onto fresh pages taken from free blocks. Every
decode step grows each running sequence by one position and a scheduler asks before it reserves,
so these run twice per request per step; the general planner (`_plan_growth`, `_commit` in
`bidirectional.py`) would reach the same placement through far more work.

Both paths apply only where nothing else can happen: the sequence has nothing on the host, and
its last page grows (if at all) clear of the page on the other side of its block, so there is
nothing to save, move or restore. Then FindBlock and FindPreemptBlock both take free blocks
first, lowest id first, which is what `grow_onto_free` takes. Blocks whose fill grows are only
marked `stale` (see `bidirectional_blocks.py`); blocks leaving FREE are refiled at once.

`FastGrowth` is a helper of `BidirectionalBlockManager` over its `BidirectionalBlocks`: `in_place`
and `fresh_pages` only read (they say whether a shortcut applies); `grow_in_place` and
`grow_onto_free` apply the shortcut they allowed, changing the pool as `_commit` would.
"""
from __future__ import annotations

from nanoserve.memory.bidirectional_blocks import BidirectionalBlocks
from nanoserve.memory.bidirectional_index import FREE, SeqId, SeqState


def _any_block(block: int) -> bool:
    return True


class FastGrowth:
    """Growth that needs no plan: in place, or onto free blocks."""

    def __init__(self, pool: BidirectionalBlocks) -> None:
        self.pool = pool

    def in_place(self, seq_id: SeqId, num_tokens: int, best_effort: bool) -> SeqState | None:
        """The sequence, if its growth adds no page and stays clear of the page on the other side
        of its last block (if any): nothing to save, move or restore, so nothing to plan."""
        pool = self.pool
        state, B = pool.seqs.get(seq_id), pool.block_size
        if (state is None or state.best_effort != best_effort or state.host_pages
                or num_tokens > len(state.pages) * B):
            return None
        if num_tokens <= state.num_tokens:
            return state
        last = state.pages[-1]
        assert last is not None  # none of its pages is in the preemption table: all are on the device
        other = (pool.rt if best_effort else pool.be)[last]
        # RT fills [0, f) and BE [B - f, B): they meet only if the two fills exceed the block.
        return state if other is None or num_tokens - (len(state.pages) - 1) * B + pool.fill(*other) <= B else None

    def fresh_pages(self, seq_id: SeqId, num_tokens: int, best_effort: bool) -> int | None:
        """How many new pages growth to `num_tokens` adds, when that is all there is to plan: the
        sequence (if known) is resident and of this class, its last page grows (if at all) clear
        of the other side's page, and there are free blocks for the new pages (FindBlock and
        FindPreemptBlock both take free blocks first, lowest id first). None: plan it."""
        pool = self.pool
        state, B, have = pool.seqs.get(seq_id), pool.block_size, 0
        if state is not None:
            if state.best_effort != best_effort or state.host_pages:
                return None
            have, old = len(state.pages), state.num_tokens
            if old % B and num_tokens > old:
                last = state.pages[-1]
                assert last is not None  # none of its pages is in the preemption table: all are on the device
                other = (pool.rt if best_effort else pool.be)[last]
                if other is not None and min(B, num_tokens - (have - 1) * B) + pool.fill(*other) > B:
                    return None
        count = max(0, -(-num_tokens // B) - have)
        return count if count <= pool.index.sizes[FREE] else None

    def grow_in_place(self, state: SeqState, num_tokens: int) -> None:
        """Growth `in_place` allowed: more of the last page, so only its block's key goes stale."""
        self.pool.changed()
        if num_tokens > state.num_tokens:
            state.num_tokens = num_tokens
            self.pool.stale.add(state.pages[-1])  # type: ignore[arg-type]

    def grow_onto_free(self, seq_id: SeqId, num_tokens: int, best_effort: bool, count: int) -> None:
        """`_commit` of the plan `fresh_pages` stands for: `count` new pages on the lowest free
        blocks. The new blocks are filed at once (they leave FREE); the last page, if its fill grows,
        is only marked stale, as for growth in place."""
        pool = self.pool
        pool.changed()
        state = pool.seqs.get(seq_id)
        if state is None:
            state = pool.seqs[seq_id] = SeqState(best_effort)
        B, sides, pages, index = pool.block_size, pool.sides(best_effort), state.pages, pool.index
        if pages and num_tokens > state.num_tokens:
            pool.stale.add(pages[-1])  # type: ignore[arg-type]
        state.num_tokens = num_tokens = max(num_tokens, state.num_tokens)
        for block in index.first(FREE, count, _any_block):
            page = len(pages)
            sides[block] = (seq_id, page)
            pages.append(block)
            fill = min(B, num_tokens - page * B)  # `key` of a block with one page, all on the device
            index.put(block, ("be", fill) if best_effort else ("rt", fill) if fill < B else None)
