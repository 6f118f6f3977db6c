"""One instance's side of KunServe's drop, KV exchange, restore and failure recovery
(kunserve.txt §4.1, §4.2, §4.4). The cluster (cluster/cluster.py) drives every change of layout
in four phases, each sent to all the members involved before any reply is read:

    1. manifest()          each member lists its requests that hold KV, with their block tables
    2. reweigh(...)        each stages out the KV it holds for those requests, frees every block,
                           drops (or loads back) layers and reports the blocks its arena now has
    3. allocate(pools)     each carves its blocks: per-request tables when alone, one
                           logical -> physical table per owner in a group (cluster/group.py)
    4. exchange(...)       each sends what it staged to the member that now holds those layers
                           (chunked, cluster/kv_exchange.py) and installs what it keeps or receives

A drop goes from one layout to a pipeline (layers leave, KV of the dropped layers goes to the
peer); a restore goes back (layers return from the host copy, the peer's KV comes home); a plan
that must fetch a layer (drop_plan's fallback) loads it from the host copy too. The same four
phases do all three: the KV of layer l of owner O's request moves from whoever held l for O to
whoever holds it now. Staging the KV first (a copy in host memory) is what lets a member free
and re-carve its arena in any order; the paper remaps pages in place instead (§4.1).

A restore can also run in the background first (§4.4, "we overlap restoring with the normal
request processing"; cluster/restore.py drives it): `begin_restore` reserves the home pages of the
layers this member lacks and names the logical blocks of each owner's pool that lie on them;
each owner `retire`s those (no request gets them again); once an owner's retired blocks are
free, every member `release`s their pages to the pull, and each step fills a chunk of them
(`step`, after the step's activations and KV chunk). The restore's reweigh then copies only
what is left. `cancel_restore` undoes it all when throttling comes back first.

A member whose group loses a peer (`recover`, §4.4) loads every layer it lacks from the host
copy and recomputes its requests: their KV for the peer's layers died with the peer.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from nanoserve.cluster.drop_plan import Group
from nanoserve.cluster.group import (
    GroupExecutor,
    GroupLayout,
    StageModules,
    lookahead_tokens,
    member_microbatches,
    pool_seq_limit,
)
from nanoserve.cluster.kv_exchange import KVMove, block_bytes, chunk_moves, recv_chunk, send_chunk
from nanoserve.cluster.submission import Submission
from nanoserve.engine import Engine
from nanoserve.memory.arena import MemoryArena
from nanoserve.memory.arena_kv import ArenaKV
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.manager import KVManager, PagedKV
from nanoserve.model.runner import ModelRunner
from nanoserve.request import Request
from nanoserve.sched.output import SchedulerOutput

Manifest = tuple[tuple[str, tuple[int, ...]], ...]  # an owner's (request id, block table) pairs
LUT = "group lookup tables"  # the arena sequence that owns every block of a group's pools


def reserve_manifest(kv: KVManager, manifest: Manifest, running: Iterable[Request], block_size: int) -> Manifest:
    """Phase 3 in a member's new KV manager: as many blocks for each of its requests in
    `manifest` as it held before; returns their new block tables, in the manifest's order."""
    requests = {r.request_id: r for r in running}
    tables = []
    for request_id, table in manifest:
        kv.reserve(requests[request_id], len(table) * block_size)
        tables.append((request_id, tuple(kv.block_table(requests[request_id]))))
    return tuple(tables)


@dataclass
class Transfer:
    """The chunks `src` sends `dst` after a layout change, and how many have gone."""

    src: int
    dst: int
    chunks: list[list[KVMove]]
    done: int = 0


@dataclass(frozen=True)
class Relayout:
    """Every involved member's layout before and after, and its requests' tables before."""

    old: Mapping[int, GroupLayout]
    new: Mapping[int, GroupLayout]
    manifests: Mapping[int, Manifest]

    def members(self) -> list[int]:
        return sorted(self.new)

    def staged(self, holder: int) -> Iterator[tuple[int, str, int, int]]:
        """(owner, request id, block index, block) for every block `holder` held before, in the
        order both ends of an exchange enumerate them."""
        for owner in self.old[holder].members:
            for request_id, table in self.manifests[owner]:
                for j, block in enumerate(table):
                    yield owner, request_id, j, block

    def moves(self, src: int, dst: int) -> Iterator[tuple[int, str, int, int]]:
        """(owner, request id, block index, layer) of every block-layer `src` held before and
        `dst` holds after (`src == dst`: what stays), in the order both ends use."""
        for owner, request_id, j, _ in self.staged(src):
            for layer in self.old[src].stage_of(src):
                if self.new[owner].holder(layer) == dst:
                    yield owner, request_id, j, layer


class ClusterMember:
    """One instance of the cluster: its engine, the model runner under it (`runner`, its
    executor while it serves alone), and its part in each layout change. `pipelined`: in a
    group it keeps steps in flight (cluster/group.py `GroupExecutor`, `in_flight`)."""

    def __init__(self, instance_id: int, engine: Engine, runner: ModelRunner, pipelined: bool = False):
        self.id, self.engine, self.runner = instance_id, engine, runner
        self.pipelined = pipelined
        self.arena = runner.arena  # None: this member cannot drop layers
        self.group: GroupExecutor | None = None  # its executor while it serves in a group
        self.layout = GroupLayout.of(Group.replica(instance_id, self.runner.model_config.num_layers))
        self.luts: dict[int, list[int]] = {}
        self.stage = StageModules(self.runner.model)
        self.replica_blocks = engine.kv.num_blocks  # KV capacity with every layer held
        self.replica_max_num_seqs = engine.scheduler.config.max_num_seqs  # scaled with the pool in a group
        # One block of K and V for every layer: the unit of the cluster's "blocks short".
        self.replica_block_bytes = self.arena.block_pages * self.arena.config.page_bytes if self.arena else 0
        self._relayout: Relayout | None = None
        self._staging: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._index: dict[tuple[int, str, int], int] = {}
        self._transfers: list[Transfer] = []
        self._rounds = 0
        self.stalled: dict[str, tuple[Request, int]] = {}  # waiting for their K/V: (request, rounds)
        self.owner_pool: BlockPool | None = None  # this member's logical pool while in a group
        self._released: dict[int, set[int]] = {}  # owner -> logical blocks given to a restore's pull
        self._pull_chunk = 0  # weight bytes a background restore copies per step
        self.weights_copied = 0  # by the latest layout change itself (not in the background)
        self.step_tokens = 0  # tokens its engine's latest step scheduled (0: the engine did not step)

    def phase(self, kind: str) -> Callable[..., object] | None:
        """The method that runs the layout-change message `kind` the cluster sends
        (cluster/regroup.py, restore.py); None if `kind` is no such message."""
        phases: dict[str, Callable[..., object]] = {
            "manifest": self.manifest, "reweigh": self.reweigh, "allocate": self.allocate,
            "exchange": self.exchange, "recover": self.recover, "begin_restore": self.begin_restore,
            "retire": self.retire, "release": self.release, "cancel_restore": self.cancel_restore}
        return phases.get(kind)

    @property
    def _arena(self) -> MemoryArena:
        """The arena every layout change re-lays out."""
        if self.arena is None:
            raise RuntimeError(f"instance {self.id} has no memory arena: it cannot drop or restore layers")
        return self.arena

    @property
    def _host_weights(self) -> Mapping[str, torch.Tensor]:
        """The host copy that layers load back from."""
        weights = self.runner.host_weights
        assert weights is not None, "a runner over an arena has host weights"
        return weights

    # -- serving ---------------------------------------------------------------------------
    def step(self) -> list:
        """One engine step. In a group a member with nothing to run still runs its stage of
        its peers' batches (with steps in flight its engine submits an empty step for that)."""
        group = self.group
        taken = group.steps if group is not None else 0
        ran = self.engine.has_unfinished_requests() or (group is not None and group.clocked)
        outputs = self.engine.step() if ran else []
        self.step_tokens = self.engine.last_step_tokens if ran else 0
        if group is not None and group.steps == taken:
            group.execute(SchedulerOutput([]))
        self.advance()  # the step's activations went first
        if self.arena is not None and self.arena.restoring:
            self.arena.fill_restore(self._pull_chunk)  # §4.4: "prioritizing the pipeline network"
        return outputs

    def drain(self) -> list:
        """Land every step in flight (`Engine.drain`): before a layout change or a restore's
        pages change hands, nothing may still be on its way through the group. Every member of a
        group drains at once (the same number of shared steps each)."""
        outputs = self.engine.drain()
        self.step_tokens = 0
        return outputs

    def take_queued(self) -> list[Submission]:
        """§3, "KunServe re-schedules queued requests" after a drop: the requests queued here
        that never started (no step ran any of them: no KV, no output) leave this engine, in
        queue order, for the cluster to dispatch again. They leave as aborted (every policy
        forgets a request that way; detaching is not for all of them), an output no client sees;
        their arrival time and SLO travel with them."""
        taken = [Submission(r.request_id, list(r.prompt_token_ids), r.params, r.priority, r.slo, r.prompt,
                            r.arrival_time)
                 for r in self.engine.scheduler.waiting if r.first_scheduled_time is None]
        for submission in taken:
            self.engine.abort_request(submission.request_id)
        return taken

    # -- what the cluster reads (cluster/instance.py load_of) -------------------------------------
    @property
    def capacity_blocks(self) -> int:
        """KV blocks this member's requests can have: its pool, less the retired blocks."""
        return self.engine.kv.num_blocks - len(self.retired_free)

    @property
    def retired_free(self) -> frozenset[int]:
        """Its pool's retired blocks no request holds: a background restore may take them."""
        return self.owner_pool.retired_free if self.owner_pool is not None else frozenset()

    @property
    def pull_pages_left(self) -> int:
        return self.arena.pull_pages_left if self.arena is not None else 0

    @property
    def restore_pulled_bytes(self) -> int:
        return self.arena.pulled_bytes if self.arena is not None else 0

    def layer_bytes(self) -> list[int]:
        return [self.arena.layer_bytes(layer) for layer in self.arena.layer_ids] if self.arena else []

    # -- phase 1 ---------------------------------------------------------------------------
    def manifest(self) -> Manifest:
        kv = self.engine.kv
        return tuple((r.request_id, tuple(kv.block_table(r))) for r in self.engine.scheduler.running
                     if kv.block_table(r))

    # -- phase 2 ---------------------------------------------------------------------------
    def _physical(self, layout: GroupLayout, owner: int, block: int) -> int:
        return block if layout.solo else self.luts[owner][block]

    def reweigh(self, relayout: Relayout) -> int:
        if self._transfers:
            raise RuntimeError("the previous layout change is still exchanging KV")
        old, new = relayout.old[self.id], relayout.new[self.id]
        entries = list(relayout.staged(self.id))
        self._index = {(o, r, j): i for i, (o, r, j, _) in enumerate(entries)}
        rows = torch.tensor([self._physical(old, o, b) for o, _, _, b in entries], dtype=torch.long,
                            device=self.runner.device)
        self._staging = [None] * len(self.runner.kv_caches)
        for layer in old.stage_of(self.id):
            cache = self.runner.kv_caches[layer]
            assert cache is not None, f"layer {layer} of this member's stage is held here"
            k_cache, v_cache = cache
            # To the host, one layer at a time: a drop is due when the arena is full, so the
            # device has no room for a second copy of the live KV (a GPU would run out of
            # memory); one layer's rows pass through it at a time. On a CPU .cpu() is free.
            self._staging[layer] = (k_cache[rows].cpu(), v_cache[rows].cpu())  # indexing by a tensor copies
        self._hold(new)
        self._relayout = relayout
        return self._arena.num_free_blocks

    def _hold(self, layout: GroupLayout) -> None:
        """Free every block, then drop or load back layers (from the host copy) until the arena
        holds this member's stage of `layout`, and run the model and the caches as that stage."""
        self._arena.free_all()
        held, keep = set(self._arena.resident_layers), set(layout.stage_of(self.id))
        self.weights_copied = 0
        if held - keep:
            if self._arena.restoring:  # every block is free by now: nothing to adopt back
                self._arena.cancel_restore()
                self._released = {}
            self._arena.drop_layers(held - keep)
        if keep - held:
            self.weights_copied = self._arena.restore_layers(keep - held, self._host_weights).copied_bytes
        if layout.solo:
            self.stage.release()
        else:
            self.stage.set_stage(layout.stage_of(self.id), is_last=layout.members[-1] == self.id)
        self.runner.refresh_kv_caches()

    # -- phase 3 ---------------------------------------------------------------------------
    def allocate(self, pools: Mapping[int, int] | None) -> Manifest:
        """`pools`: each owner's logical pool in blocks when the new layout is a group."""
        assert self._relayout is not None
        new, size = self._relayout.new[self.id], self._arena.block_size
        self._released, self.owner_pool = {}, None
        if new.solo:
            self.luts = {}
            kv: PagedKV = ArenaKV(self._arena)
            self.group = None
            self.engine.scheduler.keep_in_flight(1)
            self.engine.use_executor(self.runner)
        else:
            assert pools is not None
            self.luts = self._deal_blocks(new.members, pools)
            self.owner_pool = BlockPool(pools[self.id], size)
            kv = PagedKV(self.owner_pool)
            self.group = GroupExecutor(self.runner, new, self.id, self.luts, in_flight=self.pipelined)
            self.engine.scheduler.keep_in_flight(self.group.depth)
            self.engine.use_executor(self.group, self.group if self.pipelined else None)
        tables = reserve_manifest(kv, self._relayout.manifests.get(self.id, ()), self.engine.scheduler.running, size)
        self.engine.scheduler.use_kv_manager(kv)
        # max_num_seqs follows the pool, as the simulator's members do (sim/cluster_layout.py
        # `SimMember.seq_limit`): a fixed cap would leave the drop's added KV unused.
        self.engine.scheduler.limit_sequences(pool_seq_limit(self.replica_max_num_seqs, kv.num_blocks,
                                                             self.replica_blocks))
        # A policy that cuts micro-batches (kunserve, §4.3) looks ahead m budgets into its queue
        # and cuts them for the group's stages; `GroupExecutor` runs them through the stages in
        # order, its sends asynchronous, so stage k works on one while stage k+1 runs the last.
        stages = len(new.members)
        budget = self.engine.scheduler.config.max_num_batched_tokens
        if self.group is not None and self.group.clocked:  # a step is one micro-batch, as on one device
            self.engine.scheduler.use_pipeline(stages, 1)
        else:
            self.engine.scheduler.use_pipeline(stages, member_microbatches(stages), lookahead_tokens(stages, budget))
        self.layout = new
        return tables

    def _deal_blocks(self, members: tuple[int, ...], pools: Mapping[int, int]) -> dict[int, list[int]]:
        """Carve the group's blocks from the arena (one table, `LUT`) and deal them out: owner ->
        logical -> physical block. Ours: the blocks on the dropped layers' homes are dealt last
        and evenly, so they are every owner's highest logical ids, which a fresh pool hands out
        last: a later background restore then finds them free more often, and retiring them
        leaves each owner about its share of the rest."""
        self._arena.allocate(LUT, sum(pools[o] for o in members) * self._arena.block_size)
        dropped = set(self._arena.layer_ids) - set(self._arena.resident_layers)
        blocks = sorted(self._arena.block_table(LUT), key=lambda b: self._arena.overlaps_restore(b, dropped))
        luts: dict[int, list[int]] = {o: [] for o in members}
        turn = 0
        for block in blocks:
            while len(luts[members[turn % len(members)]]) == pools[members[turn % len(members)]]:
                turn += 1
            luts[members[turn % len(members)]].append(block)
            turn += 1
        return luts

    # -- phase 4, then one chunk per step -----------------------------------------------------
    def exchange(self, new_manifests: Mapping[int, Manifest], chunk_bytes: int) -> dict[str, int]:
        """Install what stays here and plan the rest: each pair of members then moves one chunk
        per serving step (`advance`), after that step's activations. Every member derives every
        pair's chunks from the same lists, so an owner knows the step after which each of its
        requests has all its K/V in place; until then the request is stalled (§4.2: a request
        waits only for its own exchange, and the queued requests run meanwhile)."""
        relayout = self._relayout
        assert relayout is not None
        new_tables = {(o, r): table for o, manifest in new_manifests.items() for r, table in manifest}
        members = relayout.members()
        kv_block_bytes = block_bytes(self.runner.kv_caches)  # one layer's K and V of one block
        report = {"sent": 0, "kept": 0, "rounds": 0, "weights_copied": self.weights_copied}
        ready: dict[str, int] = {}  # this member's request -> exchange rounds before it may run
        self._transfers = []
        for src in members:
            for dst in members:
                moves, requests = [], []
                for owner, request_id, j, layer in relayout.moves(src, dst):
                    target = new_tables[owner, request_id][j]
                    dst_block = self._physical(relayout.new[dst], owner, target) if self.id == dst else 0
                    src_row = self._index[owner, request_id, j] if self.id == src else 0
                    moves.append(KVMove(layer, src_row, dst_block))
                    requests.append((owner, request_id))
                if not moves:
                    continue
                if src == dst:
                    if self.id == src:
                        report["kept"] += self._install(moves)
                    continue
                chunks = chunk_moves(moves, kv_block_bytes, chunk_bytes)
                report["sent"] += len(moves) * kv_block_bytes if self.id == src else 0
                report["rounds"] = max(report["rounds"], len(chunks))
                owners = iter(requests)  # moves and their requests, chunk by chunk
                for rounds, chunk in enumerate(chunks, 1):
                    for owner, request_id in (next(owners) for _ in chunk):
                        if owner == self.id:
                            ready[request_id] = max(ready.get(request_id, 0), rounds)
                if self.id in (src, dst):
                    self._transfers.append(Transfer(src, dst, chunks))
        scheduler = self.engine.scheduler
        for request in [r for r in scheduler.running if r.request_id in ready]:
            scheduler.stall(request)
            self.stalled[request.request_id] = (request, ready[request.request_id])
        self._rounds = 0
        self._relayout = None
        self._finish_exchange()
        return report

    def advance(self) -> None:
        """One chunk of every transfer this member is part of, in the same order everywhere."""
        if not self._transfers:
            return
        for transfer in self._transfers:
            if transfer.done < len(transfer.chunks):
                chunk = transfer.chunks[transfer.done]
                if self.id == transfer.src:
                    send_chunk(self._staging, chunk, transfer.dst)
                else:
                    recv_chunk(self.runner.kv_caches, chunk, transfer.src)
                transfer.done += 1
        self._rounds += 1
        for request_id, (request, rounds) in list(self.stalled.items()):
            if rounds <= self._rounds:
                del self.stalled[request_id]
                self.engine.scheduler.resume(request)
        self._finish_exchange()

    def _finish_exchange(self) -> None:
        if all(t.done == len(t.chunks) for t in self._transfers):
            self._transfers, self._staging, self._index = [], [], {}

    @property
    def exchanging(self) -> bool:
        return bool(self._transfers)

    def unstall(self, request_id: str) -> None:
        """Put a stalled request back among the running (before an abort)."""
        if request_id in self.stalled:
            self.engine.scheduler.resume(self.stalled.pop(request_id)[0])

    def _install(self, moves: list[KVMove]) -> int:
        copied = 0
        for m in moves:
            staged, cache = self._staging[m.layer], self.runner.kv_caches[m.layer]
            assert staged is not None and cache is not None, f"layer {m.layer} was staged and is held here"
            (k_stage, v_stage), (k_cache, v_cache) = staged, cache
            k_cache[m.dst_block].copy_(k_stage[m.src_block])
            v_cache[m.dst_block].copy_(v_stage[m.src_block])
            copied += 2 * k_stage[m.src_block].numel() * k_stage.element_size()
        return copied

    # -- §4.4 restore in the background ------------------------------------------------------
    def begin_restore(self, chunk_bytes: int) -> dict[int, tuple[int, ...]]:
        """Start pulling every layer this member lacks (from the host copy; the paper pulls
        from peers "whenever possible"): reserve their home pages, and return, per owner, the
        logical blocks of its pool whose pages here lie on them."""
        lacking = set(self._arena.layer_ids) - set(self._arena.resident_layers)
        self._arena.begin_restore(lacking, self._host_weights)
        self._pull_chunk = chunk_bytes
        return {owner: tuple(i for i, block in enumerate(lut) if self._arena.overlaps_restore(block))
                for owner, lut in self.luts.items()}

    def retire(self, logical: Iterable[int]) -> None:
        """No request of this member's gets these logical blocks again (the others' pulls want
        their pages); the ones in use leave as their requests free them."""
        assert self.owner_pool is not None, "only a group member has a logical pool"
        self.owner_pool.retire(logical)

    def release(self, freed: Iterable[tuple[int, Iterable[int]]]) -> None:
        """(owner, logical blocks) its owner no longer uses: their pages here go to the pull."""
        for owner, logical in freed:
            ids = set(logical) - self._released.setdefault(owner, set())
            self._arena.release_blocks(LUT, [self.luts[owner][i] for i in ids])
            self._released[owner] |= ids

    def cancel_restore(self) -> None:
        """Throttling is back before the switch: pages and logical blocks return to the KV."""
        self._arena.cancel_restore()
        for owner, ids in self._released.items():
            for i in ids:
                self._arena.adopt(LUT, self.luts[owner][i])
        self._released = {}
        if self.owner_pool is not None:
            self.owner_pool.unretire()

    # -- §4.4 faults -----------------------------------------------------------------------
    def recover(self) -> int:
        """A peer of this member's group died: become a full replica again from the host copy
        and recompute every running request. Returns how many were requeued."""
        scheduler = self.engine.scheduler
        for request_id in list(self.stalled):
            self.unstall(request_id)
        self._transfers, self._staging, self._index = [], [], {}
        self.luts, self.layout = {}, GroupLayout.of(Group.replica(self.id, len(self._arena.layer_ids)))
        self._released, self.owner_pool = {}, None
        self._hold(self.layout)  # a background restore's pulled pages count: the rest is copied
        scheduler.use_kv_manager(ArenaKV(self._arena))
        self.group = None
        self.engine.discard_in_flight()  # they went through the lost peer
        scheduler.keep_in_flight(1)
        self.engine.use_executor(self.runner)
        return scheduler.requeue_running()
