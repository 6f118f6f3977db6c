"""A second tier for the prefix cache, in host memory (ours, beyond vLLM's default; SGLang's
HiCache and vLLM's CPU offloading connector do the same): a cached block the device pool evicts
is copied to a host block first, under the same chain hash, and a later request whose prefix
runs on past the device's cached blocks into the host's loads those blocks back instead of
recomputing them, when the load is the cheaper of the two.

    device pool: a cached block's last owner frees it ──save (background)──► host tier, by hash, LRU
                 evicted before that save landed ──save again (blocking)──► the same host block
    admission:   device hit, then host hit ──load (its reader waits)──► fresh device blocks

A block is saved when it becomes evictable (the pool's `take_parked`, at the start of the next
step: `save_parked`), on the copy stream under later forwards, as ConServe's checkpoints run;
nobody waits for it. If an allocation evicts the block before that save is known to have landed
(or before it was issued), the block is saved again by a blocking copy: the step's forward
overwrites it, so it waits for that copy, which the copy stream runs after the background one
(memory/copies.py's rule for a save whose source the step overwrites). A host block is read
only once its save has landed. A load names its request as reader: the forward that runs
the request's chunk waits for it; the loaded device blocks are committed under their hashes at
once, so later requests share them on the device again.

The tier owns a fixed share of the host store (`num_blocks`, allocated up front under one
owner) and evicts its least recently used entry when full. Whether to load or recompute is
`load_cheaper(blocks, prefix_tokens)`: the link time of `blocks` against recomputing their
tokens after a prefix of `prefix_tokens`, where both are known (the builder's cost model and
link); assumption: where the link time is unknown (a real engine: no measured link), loading
is taken to be cheaper, as a host-to-device copy of a block moves its K/V once while
recomputing it runs every layer over its tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from nanoserve.memory.copies import KVCopy, device_slots
from nanoserve.memory.host import HostKVStore
from nanoserve.memory.prefix_cache import BlockHash

OWNER = "prefix-cache-host-tier"


def always_load(blocks: int, prefix_tokens: int) -> bool:
    return True


class PrefixHostTier:
    def __init__(self, store: HostKVStore, num_blocks: int,
                 load_cheaper: Callable[[int, int], bool] = always_load):
        if num_blocks < 1 or num_blocks > store.num_free_blocks:
            raise ValueError(f"the host tier needs 1 to {store.num_free_blocks} host blocks, got {num_blocks}")
        self.store, self.block_size = store, store.block_size
        self.load_cheaper = load_cheaper
        self._free = store.allocate(OWNER, num_blocks)
        self._host_of: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._readable: set[BlockHash] = set()  # entries whose save has landed
        self.saves = self.loads = self.evictions = 0  # blocks

    @property
    def num_blocks(self) -> int:
        return len(self._free) + len(self._host_of)

    def __len__(self) -> int:
        return len(self._host_of)

    def offload(self, evicted: Sequence[tuple[int, BlockHash]]) -> list[KVCopy]:
        """The device blocks the pool just evicted (block, hash): an entry whose save has landed
        is kept (marked recently used), one whose save is in flight is dropped, and a block never
        saved is saved now, in one blocking copy."""
        unsaved = []
        for block, block_hash in evicted:
            if block_hash in self._readable:
                self._host_of.move_to_end(block_hash)
            else:  # never saved, or its save may not have read the block before the new owner writes it
                unsaved.append((block, block_hash))
        return self._save(unsaved, blocking=True)

    def save_parked(self, parked: Sequence[tuple[int, BlockHash]]) -> list[KVCopy]:
        """Save cached blocks that just became evictable (block, hash), in one background copy;
        content the tier holds already is only marked recently used."""
        return self._save(parked, blocking=False)

    def _save(self, blocks: Sequence[tuple[int, BlockHash]], blocking: bool) -> list[KVCopy]:
        sources: list[int] = []
        saved: list[tuple[BlockHash, int]] = []
        for block, block_hash in blocks:
            host = self._host_of.get(block_hash)
            if host is not None and (not blocking or block_hash in self._readable):
                self._host_of.move_to_end(block_hash)  # saved already, or being saved in the background
                continue
            if host is None:
                host = self._take_host_block()
            self._host_of[block_hash] = host
            self._host_of.move_to_end(block_hash)
            sources.append(block)
            saved.append((block_hash, host))
        if not saved:
            return []
        save = KVCopy("save", device_slots(sources, self.block_size), self.store.slots_of(h for _, h in saved),
                      blocking=blocking)
        self.store.inflight.when_landed(save, lambda: self._landed(saved))
        self.saves += len(saved)
        return [save]

    def _landed(self, saved: list[tuple[BlockHash, int]]) -> None:
        """A save landed: its entries may be read, those still in the host blocks it wrote."""
        self._readable.update(h for h, host in saved if self._host_of.get(h) == host)

    def _take_host_block(self) -> int:
        if self._free:
            return self._free.pop()
        block_hash, host = self._host_of.popitem(last=False)
        self._readable.discard(block_hash)
        self.evictions += 1
        return host

    def run(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, the tier holds readable."""
        n = 0
        for h in hashes:
            if h not in self._readable:
                break
            n += 1
        return n

    def worth_loading(self, blocks: int, prefix_tokens: int) -> bool:
        return blocks > 0 and self.load_cheaper(blocks, prefix_tokens)

    def load(self, reader: str, hashes: Sequence[BlockHash], device_blocks: Sequence[int]) -> KVCopy:
        """Load the entries of `hashes` (all readable: `run`) into `device_blocks`, for `reader`."""
        if len(hashes) != len(device_blocks):
            raise ValueError("one device block per entry loaded")
        for block_hash in hashes:
            self._host_of.move_to_end(block_hash)
        self.loads += len(hashes)
        return KVCopy("load", self.store.slots_of(self._host_of[h] for h in hashes),
                      device_slots(device_blocks, self.block_size), reader=reader)

    def reset(self) -> None:
        """Forget every entry (the prefix cache was reset)."""
        self._free += self._host_of.values()
        self._host_of.clear()
        self._readable.clear()

    def check_invariants(self) -> None:
        held = list(self._host_of.values()) + self._free
        assert len(set(held)) == len(held), "a host block of the tier is used twice"
        assert sorted(held) == sorted(self.store.blocks_of(OWNER)), "the tier's host blocks disagree with the store"
        assert self._readable <= self._host_of.keys(), "a readable entry is not in the tier"
