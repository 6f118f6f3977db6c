"""The growth BROS's bidirectional block manager does most, without planning (bros.txt §5.2):
a sequence growing inside its last page, or onto fresh pages taken from free blocks. Every
decode step grows each running sequence by one position and a scheduler asks before it reserves,
so these run twice per request per step; the general planner (`_plan_growth`, `_commit` in
`bidirectional.py`) would reach the same placement through far more work.

Both paths apply only where nothing else can happen: the sequence has nothing on the host, and
its last page grows (if at all) clear of the page on the other side of its block, so there is
nothing to save, move or restore. Then FindBlock and FindPreemptBlock both take free blocks
first, lowest id first, which is what `_grow_onto_free` takes. Blocks whose fill grows are only
marked `_stale` (see `bidirectional_blocks.py`); blocks leaving FREE are refiled at once.
"""
from __future__ import annotations

from nanoserve.memory.bidirectional_blocks import BidirectionalBlocks
from nanoserve.memory.bidirectional_index import FREE, SeqId, SeqState


def _any_block(block: int) -> bool:
    return True


class FastGrowth(BidirectionalBlocks):
    # (generation, pins, fewest positions) of a fresh RT sequence that could not grow; see `_known_rt_miss`.
    _rt_miss: tuple[int, frozenset, int] | None = None

    def _known_rt_miss(self, seq_id: SeqId, num_tokens: int) -> bool:
        """Whether an RT sequence growing to `num_tokens` is known not to fit: a new one of at most
        that many positions did not, and nothing changed since. In overload BROS asks this of
        hundreds of waiting RT requests a step; between two mutations only the first costs a search.

        Exact, because a new RT sequence of n positions needs the first ceil(n / B) blocks of
        FindPreemptBlock's ranking, which does not depend on who asks, and saves the BE slots
        under [0, fill) of each: a larger one needs a superset. An RT sequence that is wholly
        swapped out (RT pages leave the device whole) needs no less to come back and grow to n:
        the same blocks, the same saves, and less host room, since its host blocks are freed
        only after the restore."""
        miss = self._rt_miss
        if miss is None or miss[0] != self.generation or miss[1] != self.pinned:
            return False
        state = self._seqs.get(seq_id)
        if state is not None:
            if state.best_effort or any(block is not None for block in state.pages):
                return False
            num_tokens = max(num_tokens, state.num_tokens)
        return num_tokens >= miss[2]

    def _note_rt_miss(self, seq_id: SeqId, num_tokens: int) -> None:
        if seq_id in self._seqs:
            return
        miss = self._rt_miss
        if miss is not None and miss[0] == self.generation and miss[1] == self.pinned:
            num_tokens = min(num_tokens, miss[2])
        self._rt_miss = (self.generation, frozenset(self.pinned), num_tokens)
    def _in_place(self, seq_id: SeqId, num_tokens: int, best_effort: bool) -> SeqState | None:
        """The sequence, if its growth adds no page and stays clear of the page on the other side
        of its last block (if any): nothing to save, move or restore, so nothing to plan."""
        state, B = self._seqs.get(seq_id), self.block_size
        if (state is None or state.best_effort != best_effort or state.host_pages
                or num_tokens > len(state.pages) * B):
            return None
        if num_tokens <= state.num_tokens:
            return state
        other = (self._rt if best_effort else self._be)[state.pages[-1]]
        # RT fills [0, f) and BE [B - f, B): they meet only if the two fills exceed the block.
        return state if other is None or num_tokens - (len(state.pages) - 1) * B + self._fill(*other) <= B else None

    def _fresh_pages(self, seq_id: SeqId, num_tokens: int, best_effort: bool) -> int | None:
        """How many new pages growth to `num_tokens` adds, when that is all there is to plan: the
        sequence (if known) is resident and of this class, its last page grows (if at all) clear
        of the other side's page, and there are free blocks for the new pages (FindBlock and
        FindPreemptBlock both take free blocks first, lowest id first). None: plan it."""
        state, B, have = self._seqs.get(seq_id), self.block_size, 0
        if state is not None:
            if state.best_effort != best_effort or state.host_pages:
                return None
            have, old = len(state.pages), state.num_tokens
            if old % B and num_tokens > old:
                other = (self._rt if best_effort else self._be)[state.pages[-1]]
                if other is not None and min(B, num_tokens - (have - 1) * B) + self._fill(*other) > B:
                    return None
        count = max(0, -(-num_tokens // B) - have)
        return count if count <= self._index.sizes[FREE] else None

    def _no_block_for_rt_page(self, seq_id: SeqId, num_tokens: int) -> bool:
        """Whether an RT sequence growing to `num_tokens` needs a block for a page (a new page, or
        a swapped-out one to restore) while no block can take one: none free and none holding a
        BE page alone, FindPreemptBlock's only targets. Then its growth fails whatever else it
        would plan. In overload the scheduler asks this of every waiting RT request, each step."""
        return self.rt_page_room() == 0 and self.rt_pages_lacking(seq_id, num_tokens) > 0

    def rt_pages_lacking(self, seq_id: SeqId, num_tokens: int) -> int:
        """Pages an RT sequence growing to `num_tokens` still needs a block for (new pages, or
        swapped-out ones to restore)."""
        state = self._seqs.get(seq_id)
        on_device = 0 if state is None else sum(block is not None for block in state.pages)
        return -(-num_tokens // self.block_size) - on_device

    def rt_page_room(self) -> int:
        """Blocks that could take an RT page: free ones and those holding a BE page alone (a
        BE-only block stays BE-only while its key is stale)."""
        return sum(n for key, n in self._index.sizes.items() if key == FREE or (key is not None and key[0] == "be"))

    def _grow_in_place(self, state: SeqState, num_tokens: int) -> None:
        """Growth `_in_place` allowed: more of the last page, so only its block's key goes stale."""
        self.generation += 1
        if num_tokens > state.num_tokens:
            state.num_tokens = num_tokens
            self._stale.add(state.pages[-1])  # type: ignore[arg-type]

    def _grow_onto_free(self, seq_id: SeqId, num_tokens: int, best_effort: bool, count: int) -> None:
        """`_commit` of the plan `_fresh_pages` stands for: `count` new pages on the lowest free
        blocks. The new blocks are filed at once (they leave FREE); the last page, if its fill grows,
        is only marked stale, as for growth in place."""
        self.generation += 1
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = SeqState(best_effort)
        B, sides, pages, index = self.block_size, (self._be if best_effort else self._rt), state.pages, self._index
        if pages and num_tokens > state.num_tokens:
            self._stale.add(pages[-1])  # type: ignore[arg-type]
        state.num_tokens = num_tokens = max(num_tokens, state.num_tokens)
        for block in index.first(FREE, count, _any_block):
            page = len(pages)
            sides[block] = (seq_id, page)
            pages.append(block)
            fill = min(B, num_tokens - page * B)  # `_key` of a block with one page, all on the device
            index.put(block, ("be", fill) if best_effort else ("rt", fill) if fill < B else None)

    def try_grow(self, seq_id: SeqId, num_tokens: int, *, best_effort: bool):
        """`grow` if it can, else None (nothing changes): growth in place answers in one look,
        where a scheduler's `can_grow` and then `grow` would each look."""
        state = self._in_place(seq_id, num_tokens, best_effort)
        if state is not None:
            self._grow_in_place(state, num_tokens)
            return []
        if not self.can_grow(seq_id, num_tokens, best_effort=best_effort):  # type: ignore[attr-defined]
            return None
        return self.grow(seq_id, num_tokens, best_effort=best_effort)  # type: ignore[attr-defined]
