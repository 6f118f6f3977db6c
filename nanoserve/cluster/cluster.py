"""KunServe's cluster (kunserve.txt §3, §4): several instances, each a full model replica in
its own process, behind one dispatcher, with a monitor that detects memory throttling.

    requests ─► Dispatcher ─► instance 0 (engine, replica, KV)   python -m nanoserve.cluster.instance
                     │    └─► instance 1 ...
                     └── ThrottleMonitor reads every instance's InstanceLoad after each step

- `Dispatcher` (§3's global scheduler, "incorporates the load-balancing design from Llumnix"): a
  new request goes to the instance whose KV would be least full counting what it holds, what
  every request in its queue needs (Llumnix's virtual usage: its dispatch load is used blocks
  plus `num_blocks_all_waiting_requests`, over the total), and the new request itself; ties go
  to the lowest id. Counting only the queue's head would let an instance whose queue waits for
  compute, not KV, look free while its queue grows. Where the instances cache prefixes (not under
  drops: the arena does not), it prefers, among instances whose load is close to the least,
  the one it sent the longest prefix of the request to lately (ours; cluster/prefix_routing.py).
- `ThrottleMonitor` (§3, "memory throttling"): an instance is throttled when the KV its running
  requests hold plus what its head-of-line request needs exceeds its capacity: the head cannot
  run without a preemption. The monitor reports how many blocks each throttled instance is
  short; that is the R of the drop plan (`drop_plan.plan_drop`, Fig. 6).
- `Cluster` starts the instances in one gloo world (instance id = rank), routes requests,
  steps them (in lockstep, or each group on its own: `stepping`), gathers outputs and, with
  `drop=True`, answers throttling by dropping layers and regrouping instances into pipelines,
  and restores them when the burst has passed (cluster/regroup.py), pulling the weights back
  while the pipelines serve (cluster/restore.py). A dead instance's group recovers from the
  host copy and its requests are retried on the live instances (§4.4). After a drop,
  "KunServe re-schedules queued requests" (§3): the requests still queued, never started, on
  throttled instances the drop did not enlarge (Fig. 6 merges the smallest groups, not
  necessarily every throttled one) go back through the dispatcher, which now sees the enlarged
  pools (`redispatched`; sim/cluster.py does the same).
  `abort_request` stops a request on whichever instance holds it. cluster/cluster_engine.py
  serves the cluster behind the OpenAI server (`nanoserve serve --instances N --drop`).
- Where the instances run is the launcher's business (cluster/instance_launcher.py): by default
  `LocalInstances` starts them as processes of this machine; `TorchrunInstances`
  (cluster/torchrun_instances.py) makes them the ranks of a torchrun world across machines,
  rank 0 being this front. The control channel, the messages and the gloo world are the same.
"""
from __future__ import annotations

import itertools
import secrets
import subprocess
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from multiprocessing.connection import Listener
from typing import TYPE_CHECKING, Any

import torch

from nanoserve.cluster.instance_channels import InstanceChannels, InstanceGone
from nanoserve.cluster.instance_launcher import InstanceLauncher
from nanoserve.cluster.load import InstanceLoad, PeerLost
from nanoserve.cluster.local_instances import LocalInstances
from nanoserve.cluster.prefix_routing import RoutedPrefixes
from nanoserve.cluster.regroup import CallAll, Regrouper
from nanoserve.cluster.restore import BackgroundRestore
from nanoserve.cluster.submission import Submission
from nanoserve.cluster_stats import ClusterStats
from nanoserve.engine_stats import EngineStats
from nanoserve.memory import resolve_prefix_caching
from nanoserve.memory.prefix_cache import BlockHash, block_hashes
from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.sched import POLICY_MEMORY
from nanoserve.slo import SLO, RequestClass

if TYPE_CHECKING:
    from nanoserve.cluster.regroup import LayoutChange
    from nanoserve.config import EngineArgs


PREFIX_SLACK = 0.1  # assumption: "loads are close" is within 10 points of KV usage of the least loaded
THROTTLE_HISTORY = 10_000  # the monitor's latest reports kept (`throttle_events`): a server runs for long
# How the front steps its instances (`Cluster(stepping=...)`; sim/cluster.py's ClusterConfig.stepping
# prices each): every instance from one instant, the next step waiting for the slowest; or each
# group on its own (its members still together: they pass activations every step).
STEPPINGS = ("lockstep", "group_lockstep")


class Dispatcher:
    """Least-loaded routing by KV demand; `pick` also books the request against the chosen
    instance until its next load report, so a burst does not all land on one instance.

    Prefix-aware (ours; SGLang's router and llm-d do the same): given the request's prompt block
    hashes, among the instances whose usage with the request is within `prefix_slack` of the
    least loaded one's, `pick` takes the one most likely to hold the longest prefix of it cached
    (`RoutedPrefixes`), ties to the least loaded. A request no instance holds any of, or one
    sent without hashes (instances that do not cache), is routed by load alone, as before."""

    def __init__(self, prefix_slack: float = PREFIX_SLACK) -> None:
        self._booked: dict[int, int] = {}
        self.prefix_slack = prefix_slack
        self.prefixes = RoutedPrefixes()
        self.prefix_routed = 0  # requests sent to a less loaded instance's rival for its cached prefix

    def pick(self, loads: Sequence[InstanceLoad], request_blocks: int, hashes: Sequence[BlockHash] = ()) -> int:
        if not loads:
            raise ValueError("no instance to dispatch to")

        def usage(load: InstanceLoad) -> float:
            return load.usage_with(request_blocks + self._booked.get(load.instance, 0))

        best = min(loads, key=lambda load: (usage(load), load.instance))
        if hashes:
            close = [load for load in loads if usage(load) <= usage(best) + self.prefix_slack]
            cached = max(close, key=lambda load: (self.prefixes.match(load.instance, hashes), -usage(load),
                                                  -load.instance))
            if self.prefixes.match(cached.instance, hashes) > self.prefixes.match(best.instance, hashes):
                best = cached
                self.prefix_routed += 1
            self.prefixes.record(best.instance, hashes, best.total_blocks)
        self._booked[best.instance] = self._booked.get(best.instance, 0) + request_blocks
        return best.instance

    def reported(self, instance: int) -> None:
        """The instance's load now includes what was booked for it."""
        self._booked.pop(instance, None)


class ThrottleMonitor:
    def short_blocks(self, loads: Sequence[InstanceLoad]) -> dict[int, int]:
        """Blocks each throttled instance lacks (demand over capacity); empty when none is."""
        return {load.instance: load.demand_blocks - load.total_blocks
                for load in loads if load.demand_blocks > load.total_blocks}


def instance_devices(device: str | None, num_instances: int, device_count: int) -> list[tuple[str | None, int]]:
    """(device, how many instances share it) per instance. On CUDA each instance gets its own
    GPU, `cuda:(first + i) % device_count`; with fewer GPUs than instances they share, and each
    then takes a share of the memory (for tests on one GPU). Elsewhere every instance runs on
    `device` as given."""
    if device is None or not device.startswith("cuda") or device_count < 1:
        return [(device, 1)] * num_instances
    first = int(device.split(":")[1]) if ":" in device else 0
    devices = [f"cuda:{(first + i) % device_count}" for i in range(num_instances)]
    return [(d, devices.count(d)) for d in devices]


class Cluster:
    """N instances of `args` (each a full engine in its own process) behind a dispatcher. With
    `drop=True` (KunServe) the instances use the arena KV manager, a throttled step triggers
    a drop and a quiet one a restore. `chunk_bytes` sizes the KV exchange's chunks, one per step
    (§4.2: about what the link moves in one stage's execution time; the default suits gloo over
    loopback, ~2 GiB/s measured here, so ~15 ms a chunk, and CPU steps of 50-300 ms), and the
    weights a background restore pulls per step (`background_restore`, §4.4; off: the restore
    loads them while every member waits). `redispatch_queued`: after a drop, move the queued
    requests of throttled instances it did not enlarge (§3; off: they wait where they are, an
    ablation, as sim/cluster.py's `SimConfig.redispatch_queued`). `launcher`: how the instances
    are started or reached (default `LocalInstances`: processes of this machine).

    `stepping` (ours; issue 46 item 5): "lockstep" (the default) sends every instance its step at
    once and reads every answer before the next, so the cluster steps at its slowest instance's
    pace. "group_lockstep" is an asynchronous front, as the paper's independent engines are
    (kunserve.txt §3: each instance "runs vLLM"): each group (a replica, or a drop's pipeline)
    gets its next step as soon as its own members have answered, and a group with no work gets
    none. A group's members still step together: they exchange step messages and activations
    every step (cluster/group.py). A layout change pauses only the instances it involves, at
    the step each has reached: its first phase takes their step answers first
    (cluster/instance_channels.py); the other groups serve on meanwhile.

    `args.async_pipeline` (ours; issue 46 item 5; needs `drop`): a drop's groups keep steps in
    flight, each stage working on a different step (cluster/group.py `GroupExecutor`,
    `in_flight`), as vLLM's pipeline parallelism keeps micro-batches in flight (virtual
    engines); kunserve.txt §4.3 builds on such "modern pipeline implementations" and does not
    say how its members step. Before a layout change or a background pull's phases the groups
    land them first (`drains`)."""

    def __init__(self, args: EngineArgs, num_instances: int, drop: bool = False, chunk_bytes: int = 32 << 20,
                 restore_fraction: float = 0.5, peer_timeout_s: float = 60.0, background_restore: bool = True,
                 redispatch_queued: bool = True, launcher: InstanceLauncher | None = None,
                 stepping: str = STEPPINGS[0]):
        if stepping not in STEPPINGS:
            raise ValueError(f"stepping must be one of {', '.join(STEPPINGS)}, not {stepping!r}")
        if num_instances < 1:
            raise ValueError("a cluster needs at least one instance")
        if args.tensor_parallel_size * args.pipeline_parallel_size != 1:
            raise ValueError("each instance is one process here; run tensor or pipeline parallelism inside "
                             "an instance in a later version")
        if args.async_pipeline and not drop:
            raise ValueError("async_pipeline in a cluster keeps a drop's pipeline groups' steps in flight; "
                             "it needs drop=True (--drop)")
        if drop and args.kv_manager not in (None, "arena"):
            raise ValueError("dropping layers needs the arena KV manager (kv_manager='arena')")
        self.args = replace(args, kv_manager="arena" if drop else args.kv_manager, kv_manager_options=None)
        # Whether the instances cache prefixes: then the dispatcher routes by prefix too.
        self.prefix_caching = not drop and resolve_prefix_caching(self.args.kv_manager or POLICY_MEMORY[args.policy],
                                                                  args.enable_prefix_caching)
        self.drop_enabled = drop
        self.redispatch_queued = redispatch_queued
        self.stepping = stepping
        # A drop's groups keep steps in flight (cluster/group.py `GroupExecutor`, `in_flight`).
        self.pipelined = args.async_pipeline
        self.drains = 0  # times the groups landed their steps in flight for a change or a pull
        self.launcher = launcher if launcher is not None else LocalInstances()
        # Built first, so that a failed start stops what connected through the same path.
        self.channels = InstanceChannels(self._take_step_answer)
        authkey = secrets.token_bytes(16)
        self._listener = Listener((self.launcher.listen_host(), 0), authkey=authkey)
        try:
            world = (self.launcher.start(self._listener.address, authkey, num_instances), num_instances)
            for _ in range(num_instances):
                connection = self._listener.accept()
                self.channels.add(connection.recv(), connection)  # each instance says its id first
            device = self.args.device or ("cuda" if torch.cuda.is_available() else None)
            placed = instance_devices(device, num_instances, torch.cuda.device_count()) \
                if self.launcher.assigns_devices() else [(device, 1)] * num_instances
            started = {i: _raise(reply) for i, reply in self.channels.call_all(
                {i: (replace(self.args, device=placed[i][0]), world, peer_timeout_s, placed[i][1])
                 for i in range(num_instances)}).items()}
        except BaseException:
            self.shutdown()
            raise
        self.loads: dict[int, InstanceLoad] = {i: reply[0] for i, reply in started.items()}
        _, layer_bytes, block_bytes = started[0]
        self.regrouper = Regrouper(num_instances, layer_bytes, block_bytes, chunk_bytes, restore_fraction)
        self.dispatcher = Dispatcher()
        self.monitor = ThrottleMonitor()
        self.placement: dict[str, int] = {}  # unfinished request id -> the instance that holds it
        self.dispatched: Counter[int] = Counter()  # instance -> requests sent to it, over the cluster's life
        self._submitted: dict[str, Submission] = {}  # unfinished, for retries
        self._ids = itertools.count()
        # The monitor's reports, one per throttled step (the latest THROTTLE_HISTORY of them).
        self.throttle_events: deque[dict[int, int]] = deque(maxlen=THROTTLE_HISTORY)
        self.throttled_steps = 0
        self.throttled: frozenset[int] = frozenset()  # instances throttled after the latest step
        self.retried: list[tuple[str, int]] = []  # (request, new instance): restarted after theirs died
        self.redispatched: list[tuple[str, int, int]] = []  # (request, from, to): moved after a drop (§3)
        self._engine_stats: dict[int, EngineStats] = {}  # each instance's after its latest step
        self.last_step_tokens = 0  # tokens the latest step scheduled, every instance's together
        self.dead: set[int] = set()
        self.background_restore = background_restore
        self.pending_restore: BackgroundRestore | None = None
        self.restore_pulls: list[dict[str, object]] = []  # per background restore: steps, bytes, outcome
        self.steps_sent: Counter[int] = Counter()  # instance -> steps the front sent it
        self.changes_beside_steps = 0  # drops and restores run while another group was stepping
        # Step answers read but not yet handed out by `step` (outputs), and what they reported.
        self._outputs: list[RequestOutput] = []
        self._tokens = 0
        self._gone: set[int] = set()
        self._lost: set[int] = set()
        self._fresh: set[int] = set()  # given a request since their latest load report

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The instance processes this front started, `processes[i]` instance i's (under torchrun
        only instance 0's: the others are torchrun's ranks)."""
        return self.launcher.processes

    @property
    def layout_changes(self) -> list[LayoutChange]:
        return self.regrouper.history

    def _call(self, instance: int, *message: object) -> Any:
        return _raise(self.call_all({instance: message})[instance])

    def call_all(self, messages: Mapping[int, tuple]) -> dict[int, object]:
        """Send every message, then read every reply: the instances work at once. An instance
        that is gone answers `InstanceGone`; one with a step in flight gives that first."""
        return self.channels.call_all(messages)

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    priority: RequestClass | str = RequestClass.ONLINE, *, slo: SLO | None = None,
                    prompt_text: str | None = None, arrival_time: float | None = None) -> int:
        """Route the request; returns the instance it went to. `slo` overrides its class's
        targets; `prompt_text` is the text behind the token ids; `arrival_time` (time.monotonic,
        the instances' clock) defaults to when the instance takes it."""
        if request_id in self._submitted:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self._dispatch(Submission(request_id, list(token_ids), params, RequestClass(priority), slo,
                                         prompt_text, arrival_time))

    def _dispatch(self, submission: Submission) -> int:
        token_ids = submission.token_ids
        blocks = -(-len(token_ids) // self.args.block_size)
        # The blocks an instance's cache could supply (the last token is always computed).
        hashes = block_hashes(token_ids, self.args.block_size, [], (len(token_ids) - 1) // self.args.block_size) \
            if self.prefix_caching else []
        instance = self.dispatcher.pick(list(self.loads.values()), blocks, hashes)
        self._call(instance, "add", submission)
        self._fresh.add(instance)
        self.placement[submission.request_id] = instance
        self.dispatched[instance] += 1
        self._submitted[submission.request_id] = submission
        return instance

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop the request on the instance that holds it, which frees its KV there (a request
        waiting for its K/V after a drop too); its final output, or None for an unknown or
        finished id, or one whose instance is gone (its requests are not retried then)."""
        if self._submitted.pop(request_id, None) is None:
            return None
        instance = self.placement.pop(request_id)
        reply = self.call_all({instance: ("abort", request_id)})[instance]
        return None if isinstance(reply, InstanceGone) else _raise(reply)

    def reset_prefix_cache(self) -> int:
        """Every live instance forgets its cached prefixes; the blocks forgotten, all together."""
        replies = self.call_all({i: ("reset_prefix_cache",) for i in self.loads})
        return sum(_raise(reply) for reply in replies.values() if not isinstance(reply, InstanceGone))

    def step(self) -> list[RequestOutput]:
        """One step: in lockstep, one of every instance; with `stepping="group_lockstep"`, until
        at least one group has answered its step (the others stay in flight). Then the monitor's
        look at the loads, and a drop, a restore or a recovery if one is due. Returns the
        outputs of every step answer read since the last call."""
        self._start_steps()
        channels = self.channels
        if self.stepping == "lockstep":
            channels.wait()
        else:  # until one of the groups in flight has answered whole
            in_flight = [group for group in self._live_groups() if set(group) & channels.in_flight]
            channels.wait(lambda: any(not set(group) & channels.in_flight for group in in_flight))
        outputs, self.last_step_tokens = self._take_outputs(), self._tokens
        self._tokens = 0
        self.throttled = frozenset()
        gone, lost, self._gone, self._lost = self._gone - self.dead, self._lost, set(), set()
        if gone or lost:
            self._recover(gone, lost)
            return outputs + self._take_outputs()
        short = self.monitor.short_blocks(list(self.loads.values()))
        self.throttled = frozenset(short)
        if short:
            self.throttle_events.append(short)
            self.throttled_steps += 1
        if any(load.exchanging for load in self.loads.values()):
            return outputs + self._take_outputs()  # one layout change at a time
        if self.drop_enabled and short:
            if self.pending_restore is not None:  # demand is back: the pulled weights are not used
                self._end_pull(list(self.pending_restore.groups), [], call=self._phases_call())
            change = self.regrouper.drop(short, self.loads, self._phases_call())
            if change is not None:
                self._changed(change)
                if self.redispatch_queued:
                    self._redispatch(set(short) - enlarged(change))
        elif self.drop_enabled:
            groups = self.regrouper.restorable(self.loads)
            if self.background_restore:
                groups = self._restore_when_pulled(groups)
            if groups:
                self._changed(self.regrouper.restore(groups, self.loads, self._phases_call()))
        return outputs + self._take_outputs()  # those a layout change's first phase took in

    def _changed(self, change: LayoutChange) -> None:
        """After a drop or restore: the loads of the instances it involved. The other groups
        serve on (their loads as reported); `changes_beside_steps` counts the changes during
        which one of them had a step in flight."""
        changed = involved(change)
        self.changes_beside_steps += bool(self.channels.in_flight - changed)
        self._refresh_loads(changed)

    def _phases_call(self) -> CallAll:
        """What a drop's, a restore's or a background pull's messages go through: `call_all`,
        and with groups that keep steps in flight (`async_pipeline`) a drain of every group
        before the first of them, so that no phase finds a step on its way through a group
        (a freed block could still be written, a relaid-out member still be a stage). Once per
        change: its later phases find the groups drained, and perhaps already relaid out."""
        if not self.pipelined:
            return self.call_all
        drained = False

        def call(messages: Mapping[int, tuple]) -> dict[int, object]:
            nonlocal drained
            if not drained:
                drained = True
                self._drain_groups()
            return self.call_all(messages)
        return call

    def _drain_groups(self) -> None:
        """Every group of two or more lands its steps in flight (the members answer as a step
        does, and the answers are booked as steps')."""
        members = [i for group in self._live_groups() if len(group) > 1 for i in group]
        if members:
            self.drains += 1
            for instance, reply in self.call_all({i: ("drain",) for i in members}).items():
                self._take_step_answer(instance, reply)

    def _live_groups(self) -> list[tuple[int, ...]]:
        return [live for group in self.regrouper.groups
                if (live := tuple(i for i in group.instances if i in self.loads))]

    def _start_steps(self) -> None:
        """Lockstep: every live instance. Otherwise every group that has no member in flight
        and has work: a request, a KV exchange or a background pull (cluster/restore.py)."""
        channels = self.channels
        if self.stepping == "lockstep":
            chosen = [i for i in self.loads if i not in channels.in_flight]
        else:
            chosen = [i for group in self._live_groups()
                      if not set(group) & channels.in_flight and any(self._has_work(i) for i in group)
                      for i in group]
        self.steps_sent.update(chosen)
        channels.start_steps(chosen)

    def _has_work(self, instance: int) -> bool:
        load = self.loads[instance]
        return bool(load.num_running or load.num_waiting or load.exchanging or load.pull_pages_left
                    or instance in self._fresh)

    def _take_step_answer(self, instance: int, reply: object) -> None:
        """Book one step's answer, wherever it was read (cluster/instance_channels.py)."""
        self._fresh.discard(instance)
        if isinstance(reply, InstanceGone):
            self._gone.add(instance)
            return
        if isinstance(reply, PeerLost):
            self._lost.add(instance)
            return
        if instance not in self.loads:
            return  # its answer came after the cluster gave it up
        produced, self.loads[instance], self._engine_stats[instance], tokens = _raise(reply)
        self._tokens += tokens
        self.dispatcher.reported(instance)
        self._outputs.extend(produced)
        for out in produced:
            if out.finished:
                self._submitted.pop(out.request_id, None)
                self.placement.pop(out.request_id, None)

    def _take_outputs(self) -> list[RequestOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    def _restore_when_pulled(self, restorable: list) -> list:
        """§4.4's overlapped restore (cluster/restore.py): the first time groups are restorable their
        members start pulling; the groups are returned once the pull has nothing left to fill,
        those still restorable then (the others give their pull back). Ours: an idle cluster
        switches at once, pulled or not (no step would come to pull in)."""
        pending, idle = self.pending_restore, not self.has_unfinished_requests()
        if pending is None:
            if restorable and not idle:
                self.pending_restore = BackgroundRestore(restorable, self.regrouper.chunk_bytes, self.loads,
                                                         self._phases_call())
                self._refresh_loads(i for group in restorable for i in group.instances)
                return []
            return restorable  # idle: nothing to overlap with, and the stop delays no one
        if not pending.ready(self.loads, self._phases_call()) and not idle:
            return []
        kept = [g for g in pending.groups if g in restorable]
        self._end_pull([g for g in pending.groups if g not in kept], kept, call=self._phases_call())
        return kept

    def _end_pull(self, cancelled: list, kept: list, skip: AbstractSet[int] = frozenset(),
                  call: CallAll | None = None) -> None:
        """The pending pull ends: `cancelled` groups give theirs back (`skip`: members that are
        gone), `kept` ones switch now; recorded in `restore_pulls`. `call`: default `call_all`
        (a recovery's: a group that lost a peer cannot drain)."""
        pending = self.pending_restore
        assert pending is not None
        if cancelled:
            pending.cancel(call or self.call_all, cancelled, skip)
        self.restore_pulls.append({"steps": pending.steps, "pulled_bytes": pending.pulled_bytes(self.loads),
                                   "groups": len(kept), "outcome": "switched" if kept else "cancelled"})
        self.pending_restore = None

    def _redispatch(self, throttled: AbstractSet[int]) -> None:
        """§3: the never-started requests queued on `throttled` instances (those the drop did
        not enlarge) go back through the dispatcher, which sees every instance's load after the
        drop; they keep their arrival time. Where the dispatcher sends one back to where it was,
        it waits there as before."""
        replies = self.call_all({i: ("take_queued",) for i in sorted(throttled) if i in self.loads})
        taken = [(i, submission) for i, reply in replies.items() if not isinstance(reply, InstanceGone)
                 for submission in _raise(reply)]
        if not taken:
            return
        self._refresh_loads({i for i, _ in taken})  # their queues without them
        for source, submission in taken:
            self.redispatched.append((submission.request_id, source, self._dispatch(submission)))

    def _refresh_loads(self, instances: Iterable[int] | None = None) -> None:
        """Read the loads of `instances` (default: every live one) now; with steps in flight
        (`stepping="group_lockstep"`) each named one first gives its step's answer."""
        chosen = self.loads if instances is None else [i for i in instances if i in self.loads]
        for instance, reply in self.call_all({i: ("load",) for i in chosen}).items():
            if isinstance(reply, InstanceGone):
                self._gone.add(instance)  # the next step recovers
                continue
            self.loads[instance] = _raise(reply)
            self.dispatcher.reported(instance)  # the fresh load holds what was booked for it

    def _recover(self, gone: set[int], lost: set[int]) -> None:
        """§4.4: the dead leave, their groups' survivors reload from the host copy, and the dead
        instances' unfinished requests start again on live ones."""
        self.dead |= gone
        if self.pending_restore is not None:  # a recovery reloads every layer anyway
            self._end_pull(list(self.pending_restore.groups), [], skip=gone)
        for instance in gone:
            self.loads.pop(instance, None)
            self.dispatcher.prefixes.forget(instance)
            self.launcher.kill(instance)
        if not self.loads:
            raise RuntimeError(f"every instance of the cluster is gone (last: {sorted(gone)})")
        self.regrouper.recover(self.dead, lost, self.loads, self.call_all)
        self._refresh_loads()
        for request_id, instance in list(self.placement.items()):
            if instance in gone and request_id in self._submitted:
                self.retried.append((request_id, self._dispatch(self._submitted[request_id])))

    def has_unfinished_requests(self) -> bool:
        return (bool(self._submitted) or bool(self._outputs) or bool(self.channels.in_flight)
                or any(load.num_running or load.num_waiting for load in self.loads.values()))

    def unfinished_request_ids(self) -> list[str]:
        return list(self._submitted)

    def settled(self) -> bool:
        """No layout work is left for steps to do: no KV exchange, no background pull, no
        group that a step could restore (an idle cluster restores at its next step)."""
        return (self.pending_restore is None and not any(load.exchanging for load in self.loads.values())
                and all(g.size == 1 for g in self.regrouper.groups))

    def engine_stats(self) -> list[EngineStats]:
        """Each instance's `EngineStats` after its latest step (a dead one's last: its counters
        still count)."""
        return list(self._engine_stats.values())

    def stats(self) -> ClusterStats:
        loads = self.loads
        return ClusterStats(
            {i: load.used_blocks for i, load in loads.items()}, {i: load.total_blocks for i, load in loads.items()},
            {i: load.num_running for i, load in loads.items()}, {i: load.num_waiting for i, load in loads.items()},
            self.throttled, frozenset(i for g in self.regrouper.groups if g.size > 1 for i in g.instances),
            dict(Counter(change.kind for change in self.layout_changes)), self.throttled_steps,
            len(self.redispatched), len(self.retried), len(self.dead))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        ids = [f"cluster-{next(self._ids)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts):
            self.add_request(request_id, prompt, params)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def shutdown(self) -> None:
        self.channels.stop()
        self.launcher.stop(30)
        self._listener.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def involved(change: LayoutChange) -> set[int]:
    """The instances whose group a layout change changed (the others kept theirs)."""
    before, after = set(change.before), set(change.after)
    return {i for group in before ^ after for i in group.instances}


def enlarged(change: LayoutChange) -> set[int]:
    """The instances of the groups a layout change made (their pools changed)."""
    before = set(change.before)
    return {i for group in change.after if group not in before for i in group.instances}


def _raise(reply: object) -> Any:
    """An instance's reply (whatever it pickled), or raised if it is an exception."""
    if isinstance(reply, BaseException):
        raise reply
    return reply
