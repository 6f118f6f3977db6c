"""A model-free executor for driving the real Engine and scheduler over a KV manager: it runs
each step's copy groups on small real caches, as the runner does, checks that every chunk's
earlier positions read back the K/V written for them, and writes tags unique per (request,
position, layer, K or V) for the chunk's new positions. Any lost, misplaced or clobbered slot
fails an assertion. Also the mock clock the policy tests share."""
from __future__ import annotations

import torch

from nanoserve.executor import Executor, ExecutorOutput
from nanoserve.memory.host import HostKVStore
from nanoserve.sched import SchedulerOutput

LAYERS, HEADS, HEAD_DIM = 2, 1, 2


class MockClock:
    """A scheduler's clock that only moves when a test (or its executor) sets `now`."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class TaggingExecutor(Executor):
    def __init__(self, store: HostKVStore, num_blocks: int, block_size: int):
        self.store, self.block_size = store, block_size
        self.caches = [(torch.zeros(num_blocks, block_size, HEADS, HEAD_DIM),
                        torch.zeros(num_blocks, block_size, HEADS, HEAD_DIM)) for _ in range(LAYERS)]
        self.index: dict[str, int] = {}
        self.positions_checked = 0

    def tag(self, rid: str, pos: int, layer: int, is_v: bool) -> torch.Tensor:
        base = 1 + self.index.setdefault(rid, len(self.index)) * 1000 + pos + layer * 100_000
        base = -base if is_v else base
        return torch.tensor([[base, base + 0.5]], dtype=torch.float32)

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        for group in batch.kv_copies:  # as ModelRunner.execute does
            self.store.execute(group, self.caches)
        size = self.block_size
        for chunk in batch.chunks:
            rid, table = chunk.request.request_id, chunk.block_table
            for pos in range(chunk.end):
                offset = size - 1 - pos % size if chunk.right_to_left else pos % size
                slot = table[pos // size] * size + offset
                for layer, (k, v) in enumerate(self.caches):
                    kf, vf = k.view(-1, HEADS, HEAD_DIM), v.view(-1, HEADS, HEAD_DIM)
                    if pos < chunk.start:
                        assert torch.equal(kf[slot], self.tag(rid, pos, layer, False)), (rid, pos)
                        assert torch.equal(vf[slot], self.tag(rid, pos, layer, True)), (rid, pos)
                        self.positions_checked += 1
                    else:
                        kf[slot], vf[slot] = self.tag(rid, pos, layer, False), self.tag(rid, pos, layer, True)
        return ExecutorOutput(sampled={c.request.request_id: c.end % 100 for c in batch.chunks if c.samples})


def serve_random_requests(engine, rng, max_tokens: tuple[int, int], count: int = 8, max_steps: int = 3000) -> int:
    """Add `count` requests (prompts of 1-14 tokens, outputs drawn from `max_tokens`, either class)
    and step the engine until all finish or `max_steps` pass; returns how many finished. The
    engine checks its KV manager's invariants every step (NANOSERVE_CHECK_INVARIANTS)."""
    from nanoserve.sampling import SamplingParams

    for i in range(count):
        engine.add_request([1 + i] * rng.randint(1, 14), SamplingParams(max_tokens=rng.randint(*max_tokens),
                                                                         ignore_eos=True),
                           f"r{i}", priority=rng.choice(["online", "offline"]))
    finished = 0
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        finished += sum(o.finished for o in engine.step())
    return finished


class StandInStream:
    """A copy stream a state machine drives, for testing copies in flight on a CPU: `issue` files
    the planned copies in the store's ledger without moving any data; `land(n)` moves the data of
    the next n, in issue order, as one copy stream would, and marks them landed, so the ledger
    reports them at the manager's next poll."""

    def __init__(self, store: HostKVStore, caches) -> None:
        self.store, self.caches = store, caches
        self.planned: list = []  # this step's copies, not issued yet
        self.issued: list = []  # on the stream, in order, not landed
        self.landed: set[int] = set()

    def issue(self) -> None:
        for copy in self.planned:
            self.store.inflight.issue(copy, lambda t=copy.ticket: t in self.landed)
        self.issued += self.planned
        self.planned = []

    def land(self, count: int) -> None:
        for copy in self.issued[:count]:
            self.store.copy_now([copy], self.caches)
            self.landed.add(copy.ticket)
        self.issued = self.issued[count:]

    def land_what(self, readers: set) -> None:
        """What a forward over `readers` waits for (`KVCopy.needed_by`), and all issued before it."""
        needed = [i for i, c in enumerate(self.issued) if c.needed_by(readers)]
        self.land(needed[-1] + 1 if needed else 0)

    def unlanded(self) -> list:
        return self.issued + self.planned

    def drain(self) -> None:
        self.issue()
        self.land(len(self.issued))

    def scrub(self, free_blocks) -> None:
        """A free block holds nothing anyone may read: fill it with garbage, so a forward that
        read it before its load landed would see it."""
        for k, v in self.caches:
            for block in free_blocks:
                k[block].fill_(-7.0), v[block].fill_(-7.0)

    def replay(self, caches, store: HostKVStore) -> None:
        """Land every unlanded copy, one by one in order, on scratch `caches` and `store`."""
        for copy in self.unlanded():
            store.copy_now([copy], caches)


def prefix_digest(token_ids, upto: int, salt: int = 0) -> int:
    """A 20-bit digest of token_ids[:upto + 1] (exact in float32), the stand-in for what a real
    model's K/V at position `upto` depends on: every token up to it."""
    h = salt
    for t in token_ids[:upto + 1]:
        h = (h * 1_000_003 + t + 1) % (1 << 20)
    return h


class ContentTaggingExecutor(TaggingExecutor):
    """Like `TaggingExecutor`, but each position's K/V is a function of the tokens up to it, as a
    real model's is: [token id, digest of the prefix] per layer and K or V. So two requests with
    the same first tokens write the same K/V there, and one may read what the other wrote (a
    shared prefix block); a block read back that holds other tokens fails the check. The sampled
    token is a function of the request's tokens only, so outputs do not depend on who computed
    which block."""

    def __init__(self, store, num_blocks: int, block_size: int):
        super().__init__(store, num_blocks, block_size)
        self.positions_shared = 0  # positions read that this request did not write itself
        self.written_by: dict[int, str] = {}

    @staticmethod
    def content_tag(token: int, digest: int, layer: int, is_v: bool) -> torch.Tensor:
        sign = -1.0 if is_v else 1.0
        return torch.tensor([[sign * (token + 1 + layer * 100_000), float(digest)]], dtype=torch.float32)

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        for group in batch.kv_copies:
            self.store.execute(group, self.caches)
        size = self.block_size
        sampled = {}
        for chunk in batch.chunks:
            request, table = chunk.request, chunk.block_table
            rid, ids = request.request_id, request.token_ids
            digest = 0
            for pos in range(chunk.end):
                token = ids[pos] if pos < len(ids) else -1
                digest = (digest * 1_000_003 + token + 1) % (1 << 20)
                offset = size - 1 - pos % size if chunk.right_to_left else pos % size
                slot = table[pos // size] * size + offset
                for layer, (k, v) in enumerate(self.caches):
                    kf, vf = k.view(-1, HEADS, HEAD_DIM), v.view(-1, HEADS, HEAD_DIM)
                    want_k, want_v = self.content_tag(token, digest, layer, False), self.content_tag(token, digest,
                                                                                                    layer, True)
                    if pos < chunk.start:
                        assert torch.equal(kf[slot], want_k), (rid, pos, "K")
                        assert torch.equal(vf[slot], want_v), (rid, pos, "V")
                        self.positions_checked += 1
                    else:
                        kf[slot], vf[slot] = want_k, want_v
                if pos < chunk.start:
                    self.positions_shared += self.written_by.get(slot) != rid
                else:
                    self.written_by[slot] = rid
            if chunk.samples:
                sampled[rid] = 1 + digest % 97
        return ExecutorOutput(sampled=sampled)
