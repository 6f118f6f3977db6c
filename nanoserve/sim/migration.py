"""Llumnix's request migration between instances (Sun et al., OSDI'24), the baseline KunServe
compares with: "Llumnix adopts load balancing to cope with memory throttling of an instance,
and migrates KVCache between instances to free sufficient memory in case of insufficient memory
even with load balancing. We compared with the latest version of Llumnix (release v0.1.0)"
(kunserve.txt §5.1). As Llumnix v0.1.0's code does it, with its `configs/base.yml` (migration
and defragmentation on, `SR` request choice); every constant is a `MigrationConfig` field:

    every 50 ms       read every instance's freeness F = (free blocks - the head-of-line waiting
                      request's blocks) / (running requests + 1 if any waits)
    sources           F < 3 blocks per request, or it has preempted requests waiting
    destinations      F > 3 and no preempted request
    pairs             sources by F ascending zipped with destinations by F descending
                      ("defrag_constrained": no further check); one request per pair per round,
                      the shortest running one past its prefill ("SR")
    live migration    stage k copies the request's blocks written since stage k-1 (but the last,
                      still being written) while it keeps decoding on the source; once what is
                      left is at most 16 blocks, the last stage takes it off the source, copies
                      the rest, and the destination runs it. At most 3 stages, else give up
    destination room  each stage reserves its blocks on the destination first; short of them
                      (a 1% watermark kept free, vLLM's), the migration is abandoned and the
                      request stays on the source

Copies cross the cluster's network link at its rate (`GPU.link_seconds`), one migration's
stages back to back; concurrent migrations do not share bandwidth (assumption: KunServe's
cluster A has one GPU per server and 200 Gbps RDMA, and a pair migrates one request at a time).
Each request migrates at most once at a time; an instance may be in several migrations.

Timing (ours, a discrete-event simplification): a stage starts and ends at cluster events,
taking the request's state as of its instance's latest step; the last stage's downtime is its
copy of at most 16 blocks.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.cluster.instance import load_of

if TYPE_CHECKING:
    from nanoserve.request import Request
    from nanoserve.sim.cluster_layout import SimMember


@dataclass(frozen=True)
class MigrationConfig:
    polling_interval_s: float = 0.05  # POLLING_INTERVAL, PAIR_MIGRATION_FREQUENCY = 1
    migrate_out_threshold: float = 3.0  # MIGRATE_OUT_THRESHOLD: free blocks per request
    max_stages: int = 3  # MAX_STAGES
    last_stage_max_blocks: int = 16  # LAST_STAGE_MAX_BLOCKS
    watermark: float = 0.01  # vLLM's block watermark, kept free on a destination
    defrag: bool = True  # base.yml's ENABLE_DEFRAG: the head-of-line request counts in F


@dataclass
class Migration:
    request: Request
    src: int
    dst: int
    stage: int = 0
    sent_blocks: int = 0  # blocks copied by the stages that ended
    stage_blocks: int = 0  # blocks the stage in flight copies
    last: bool = False  # the stage in flight is the last: the request is off the source
    stage_end: float = math.inf


class LlumnixMigrator:
    """Starts and advances migrations between `members` (SimMembers by id)."""

    def __init__(self, config: MigrationConfig, members: Mapping[int, SimMember], link: str, block_bytes: float,
                 start: float, on_moved: Callable[[str, int], None] = lambda request_id, instance: None):
        """`block_bytes`: one block's K/V over every layer; `on_moved(request id, instance)` is
        told of every migration that completes."""
        self.config, self.members, self.link, self.block_bytes = config, members, link, block_bytes
        self.on_moved = on_moved
        self.in_flight: dict[str, Migration] = {}
        self.next_poll = start
        self.events = {"migrations": 0, "migrated_blocks": 0, "aborted_src": 0, "aborted_dst": 0}

    # -- when ------------------------------------------------------------------------------
    def next_time(self, has_work: bool) -> float:
        """The next stage end, or the next poll while any instance has work."""
        ends = min((m.stage_end for m in self.in_flight.values()), default=math.inf)
        return min(ends, self.next_poll if has_work else math.inf)

    def advance(self, now: float) -> None:
        """Everything due at `now`: stages that end, then a poll if one is due."""
        for migration in [m for m in self.in_flight.values() if m.stage_end <= now]:
            self._stage_ended(migration, now)
        if self.next_poll <= now:
            self._poll(now)
            self.next_poll = now + self.config.polling_interval_s

    # -- the poll --------------------------------------------------------------------------
    def freeness(self, member: SimMember) -> float:
        """Llumnix's migration load, negated: free blocks per request (inf when none runs), from
        the load the dispatcher and the monitor read (`dist.instance.load_of`)."""
        load = load_of(member)
        free = load.total_blocks - load.used_blocks - self._watermark(member)
        requests = load.num_running
        if self.config.defrag and load.num_waiting:
            free -= load.head_blocks
            requests += 1
        return math.inf if requests == 0 else free / requests

    def _watermark(self, member: SimMember) -> int:
        return int(self.config.watermark * member.engine.kv.num_blocks)

    @staticmethod
    def _preempted_waiting(member: SimMember) -> bool:
        return any(r.num_preemptions > 0 for r in member.engine.scheduler.waiting)

    def _poll(self, now: float) -> None:
        threshold = self.config.migrate_out_threshold
        free = {i: self.freeness(m) for i, m in self.members.items()}
        killed = {i: self._preempted_waiting(m) for i, m in self.members.items()}
        sources = sorted((i for i in free if killed[i] or free[i] < threshold), key=lambda i: (free[i], i))
        destinations = sorted((i for i in free if not killed[i] and free[i] > threshold), key=lambda i: (-free[i], i))
        for src, dst in zip(sources, destinations):
            request = self._shortest_decoding(self.members[src])
            if request is not None:
                migration = Migration(request, src, dst)
                self.in_flight[request.request_id] = migration
                self._start_stage(migration, now)

    def _shortest_decoding(self, member: SimMember) -> Request | None:
        """"SR": the shortest running request past its prefill, not already migrating."""
        candidates = [r for r in member.engine.scheduler.running
                      if r.num_computed_tokens >= r.num_prompt_tokens and r.request_id not in self.in_flight]
        return min(candidates, key=lambda r: (r.num_tokens, r.request_id), default=None)

    # -- the stages ------------------------------------------------------------------------
    def _start_stage(self, migration: Migration, now: float) -> None:
        src, dst = self.members[migration.src], self.members[migration.dst]
        request = migration.request
        held = len(src.engine.kv.block_table(request))
        incremental = held - migration.sent_blocks
        last = incremental <= self.config.last_stage_max_blocks
        send = incremental if last else incremental - 1  # the last block is still being written
        dst_kv = dst.engine.kv
        if dst_kv.num_blocks - dst_kv.num_used_blocks - send < self._watermark(dst):
            self._abort(migration, "aborted_dst")
            return
        dst_kv.reserve(request, (migration.sent_blocks + send) * dst_kv.block_size)
        migration.last = last
        if last:
            src.engine.scheduler.stall(request)  # it stops decoding on the source
        migration.stage += 1
        migration.stage_blocks = send
        migration.stage_end = now + src.roofline.gpu.link_seconds(send * self.block_bytes, self.link)

    def _stage_ended(self, migration: Migration, now: float) -> None:
        src, dst = self.members[migration.src], self.members[migration.dst]
        request = migration.request
        migration.sent_blocks += migration.stage_blocks
        self.events["migrated_blocks"] += migration.stage_blocks
        if migration.last:
            handover = src.engine.detach_request(request.request_id)  # frees the source's blocks
            dst.engine.attach_request(handover)
            dst.clock.advance_to(now)  # an idle destination starts it now
            del self.in_flight[request.request_id]
            self.events["migrations"] += 1
            self.on_moved(request.request_id, migration.dst)
        elif request.status.finished or request not in src.engine.scheduler.running:
            self._abort(migration, "aborted_src")  # it finished or was preempted meanwhile
        elif migration.stage >= self.config.max_stages:
            self._abort(migration, "aborted_src")
        else:
            self._start_stage(migration, now)

    def _abort(self, migration: Migration, why: str) -> None:
        """Give the migration up: the destination frees what it reserved. The request is still
        on the source: only a last stage takes it off, and that stage never aborts."""
        self.members[migration.dst].engine.kv.release(migration.request)
        del self.in_flight[migration.request.request_id]
        self.events[why] += 1
