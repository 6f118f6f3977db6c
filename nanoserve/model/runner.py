"""The real executor: turns a scheduled batch into one model forward and one sampling pass.

For a batch of chunks the runner builds flat tensors:

    input_ids, positions   [num_tokens]      every chunk's new tokens, back to back
    slot_mapping           [num_tokens]      where each new token's K/V is written
    block_tables           [num_seqs, max_blocks]  (padded; padding is never read unmasked)
    seq_lens               [num_seqs]        context length after the step
    query_start_loc        [num_seqs + 1]    where each chunk's tokens start in the flat batch
    directions             [num_seqs] or None  BROS: which sequences fill blocks right to left

All but the block table and the directions share one buffer and one host-to-device copy
(step_inputs.py); when a CUDA graph runs the step, that copy lands in the graph's own static
buffer, padded to its shape, and the table in the graphs' static table.

Before the forward pass it issues the batch's KV copies (checkpoints, swaps, restores) on the
host store's copy stream and makes the forward wait only for the ones it reads: this step's
blocking copies and the loads of its own requests (memory/copies.py). Saves and prefetches for
other requests run on beside the forward. It then runs the model, takes the hidden state of
the last token of every chunk that samples, and samples. The simulator's executor has the same
`execute` signature and returns the same `ExecutorOutput`, so the engine cannot tell them apart.

Layer-wise preemption (ConServe, conserve.txt §4.3 and §5) is the one extra: while the runner
runs a pure-offline batch it arms the model's safe points (one after every layer, checked every
`preempt_every_layers`); if someone has called `request_preemption()` by then, the forward stops
there and `execute` returns `ExecutorOutput(preempted=True)`, which the engine discards. See
`PreemptionFlag` (nanoserve/preemption.py).

Under asynchronous scheduling (engine.py) the runner is the engine's two-deep pipeline:
`submit` launches a step and returns before its tokens are known, `collect` waits for the
oldest. A request in both steps has, as the last input of the second, the token the first is
still drawing: `prepare` leaves a placeholder there and fills it on the device from the first
step's draws, so nothing waits for the host to learn the token:

    step n    ... forward ─► logits ─► draws.tokens [t_a, t_b, t_c]  ─► copy to host ─► collect n
                                                         │  index_copy (device)
    step n+1  input_ids [.., 0, .., 0] ◄─────────────────┘  rows of a, c (their pending inputs)
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from nanoserve.config import EngineArgs, ModelConfig
from nanoserve.device import to_device
from nanoserve.executor import Executor, ExecutorOutput, PromptLogprobs
from nanoserve.grammar import allocate_bitmask, fill_bitmasks
from nanoserve.memory.arena import CapacityChange, MemoryArena
from nanoserve.memory.host import HostKVStore
from nanoserve.model.attention import AttentionBackend, ForwardContext
from nanoserve.model.block_table import BlockTableRows
from nanoserve.model.causal_lm import CausalLM
from nanoserve.model.cuda_graphs import StepGraphs
from nanoserve.model.layer_peer import LayerPeer
from nanoserve.model.logits_processors import NO_HISTORY, RowHistory
from nanoserve.model.parallel import SINGLE, TPGroup, local_kv_heads
from nanoserve.model.sampler import DrawsOnDevice, sample_on_device
from nanoserve.model.step_inputs import StepInputLayout
from nanoserve.preemption import ForwardPreempted, PreemptionFlag
from nanoserve.request import Request
from nanoserve.sched.output import SchedulerOutput
from nanoserve.slo import RequestClass


def grammar_bitmask(sampling: list[Request]) -> torch.Tensor | None:
    """The tokens each sampling request's grammar allows next (int32 bits, all set for requests
    without one), filled for the batch at once; None if no grammar constrains this draw."""
    constrained = [(r.grammar, j) for j, r in enumerate(sampling) if r.grammar is not None and r.grammar_active]
    if not constrained:
        return None
    bitmask = allocate_bitmask(len(sampling), constrained[0][0].vocab_size)
    fill_bitmasks(constrained, bitmask)
    return bitmask


@dataclass
class LaunchedStep:
    """A step `ModelRunner.launch` queued on the device; `ModelRunner.land` reads its result."""

    sampling: list[Request] = field(default_factory=list)  # the requests it draws a token for
    draws: DrawsOnDevice | None = None  # None: nothing drawn (no sampling chunk, or not rank 0)
    preempted: bool = False
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # by request id


@dataclass(frozen=True)
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: ForwardContext
    sample_rows: list[int]  # flat-batch rows whose logits are sampled, one per sampling chunk
    sample_index: torch.Tensor  # the same rows on the device (gather without a sync)

    def sampled(self, hidden: torch.Tensor) -> torch.Tensor:
        """The sampling rows of `hidden`. Indexing a CUDA tensor with a Python list copies the
        list from pageable memory, which can stall the CPU until the GPU catches up; the
        index travelled with the step's other inputs instead."""
        return hidden.index_select(0, self.sample_index)


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                       dtype: torch.dtype, tp_size: int = 1,
                       layers: range | None = None) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """One (K, V) pair per layer; under tensor parallelism, for this rank's KV heads only; in a
    pipeline stage, for its own `layers` only (None for the others')."""
    shape = (num_blocks, block_size, local_kv_heads(cfg.num_kv_heads, tp_size), cfg.head_dim)
    held = range(cfg.num_layers) if layers is None else layers
    return [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            if layer in held else None for layer in range(cfg.num_layers)]


class ModelRunner(Executor):
    def __init__(self, model: CausalLM, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, backend: AttentionBackend, seed: int = 0,
                 host_store: HostKVStore | None = None, arena: MemoryArena | None = None,
                 host_weights: Mapping[str, torch.Tensor] | None = None,
                 preempt_every_layers: int = EngineArgs.preempt_every_layers,
                 tp: TPGroup = SINGLE, stage_layers: range | None = None,
                 cuda_graph_sizes: Iterable[int] = (), max_blocks_per_seq: int = 0,
                 mixed_graph_sizes: Iterable[int] = (), max_num_seqs: int = 0, layerwise_preemption: bool = True):
        """With `arena` (KunServe), the KV caches are the arena's views and `host_weights` (every
        parameter by name, on the host) feeds the peer on a drop and the arena on a restore.
        `preempt_every_layers`: how often a pure-offline forward checks the preemption flag;
        `layerwise_preemption`: whether anything may ask a forward to stop (the policy's
        `Scheduler.PREEMPTS_RUNNING_BATCH`): without it no forward arms a safe point, so a
        pure-offline batch keeps its CUDA graph and never waits for the device mid-forward.
        `tp`: this rank's tensor-parallel group; only rank 0 samples (every rank computes the
        gathered logits, as the gather is collective). `stage_layers`: a pipeline stage's layers
        (model/stages.py), the only ones it keeps KV for. `cuda_graph_sizes`: the decode batch
        sizes to record CUDA graphs for (cuda_graphs.py; none: every step runs eagerly), over
        block tables `max_blocks_per_seq` wide; only a single-rank runner without an arena.
        `mixed_graph_sizes`: the token counts of mixed-batch graphs over up to `max_num_seqs`
        sequences (none: mixed batches run eagerly)."""
        self.model = model
        self.tp = tp
        self.stage_layers = stage_layers
        # ConServe's layer-wise preemption: the modules whose layer loop has a safe point.
        self.preemption = PreemptionFlag(preempt_every_layers, model_config.num_layers)
        self.layerwise_preemption = layerwise_preemption
        if tp.size > 1:
            self.preemption.agree = tp.any
        if device.type == "cuda":
            self.preemption.wait_for_device = lambda: torch.cuda.current_stream(device).synchronize()
        self._safe_point_hosts = [model.body()]  # whose layer loop has ConServe's safe points
        self.host_store = host_store  # where the memory manager's KV copies go to and come from
        self._preemptible = False  # whether the forward in flight has ConServe's safe points armed
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.arena, self.host_weights, self.peer = arena, host_weights, None
        if arena is None:
            self.kv_caches = allocate_kv_caches(model_config, num_blocks, block_size, device, dtype, tp.size,
                                                stage_layers)
        else:
            if host_weights is None:
                raise ValueError("a runner over an arena needs host_weights to drop and restore layers")
            self.peer = LayerPeer(model, host_weights, device, arena.config.layer_pattern)
            self.kv_caches = self._arena_kv_caches()
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # Asynchronous scheduling: the steps launched and not yet landed, and for each request
        # whose latest token is still being drawn, where on the device it will be.
        self.depth = 2
        self.clocked = False  # MicrobatchPipeline: a launched step finishes on its own
        self._launched: deque[LaunchedStep] = deque()
        self._drawing: dict[str, tuple[torch.Tensor, int]] = {}
        self.block_tables = BlockTableRows(pin_memory=device.type == "cuda")  # kept between steps
        self._grammar_masks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoserve-masks")
        sizes, mixed = sorted(set(cuda_graph_sizes)), sorted(set(mixed_graph_sizes))
        if (sizes or mixed) and (arena is not None or tp.size > 1 or stage_layers is not None):
            raise ValueError("CUDA graphs need a single-rank runner whose layers never change (no arena)")
        self.graphs = (StepGraphs(model, self.kv_caches, backend, sizes, max_blocks_per_seq, device,
                                  mixed_sizes=mixed, max_num_seqs=max_num_seqs)
                       if sizes or mixed else None)

    # -- KunServe: drop and restore layers between steps (§4.1, §4.2, §4.4) --------------------
    def _arena_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        # A dropped layer's entry is None: its PeerStage reads the peer's cache, never this list.
        assert self.arena is not None, "only a runner over an arena reads its KV views"
        views = self.arena.kv_caches()
        return [views.get(layer) for layer in range(self.model_config.num_layers)]

    def refresh_kv_caches(self) -> None:
        """Read the arena's KV views again: a cluster member changed the arena's layers itself
        (cluster/member.py re-lays it out between steps)."""
        self.kv_caches = self._arena_kv_caches()

    def drop_layers(self, layer_ids: Iterable[int]) -> CapacityChange:
        """Hand `layer_ids` to the pipeline peer and their weight bytes to the KV cache: the live
        requests' K/V of those layers is copied to the peer first (§4.2), then the arena drops
        them (§4.1), then the peer runs them with its replica weights."""
        if self.arena is None or self.peer is None:
            raise RuntimeError("drop_layers needs a runner built over a MemoryArena")
        layers, resident = sorted(set(layer_ids)), self.arena.resident_layers
        if not set(layers) <= set(resident) or len(layers) == len(resident):
            # Checked here too: the peer must not take KV for a drop the arena would refuse.
            raise ValueError(f"cannot drop layers {layers}: resident are {list(resident)}, one must stay")
        block_pages_after = 2 * (len(resident) - len(layers))
        self.peer.check_room(layers, self.arena, block_pages_after)  # before anything changes
        self.peer.receive_kv(layers, self.arena, block_pages_after)
        change = self.arena.drop_layers(layers)
        self.peer.serve(layers)
        self.kv_caches = self._arena_kv_caches()
        return change

    def restore_layers(self, layer_ids: Iterable[int]) -> CapacityChange:
        """Load `layer_ids` back from the host copy and stop the peer serving them (§4.4). The
        arena refuses (BlocksInUseError, nothing changed) while any request holds KV blocks."""
        if self.arena is None or self.peer is None:
            raise RuntimeError("restore_layers needs a runner built over a MemoryArena")
        layers = sorted(set(layer_ids))
        assert self.host_weights is not None  # required with the arena (__init__)
        change = self.arena.restore_layers(layers, self.host_weights)
        self.peer.release(layers, self.arena.num_pages, self.arena.block_pages)
        self.kv_caches = self._arena_kv_caches()
        return change

    def prepare(self, batch: SchedulerOutput, graph: str | None = None) -> PreparedBatch:
        """The step's inputs on the device. `graph`: "decode" or "mixed" if a CUDA graph will
        run the step (`_replayable`): they go straight into its static buffers."""
        size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        fed_rows: list[int] = []  # flat rows whose input is a token still being drawn
        fed_from: list[tuple[torch.Tensor, int]] = []  # ...and where on the device it will be
        for chunk in batch.chunks:
            table = chunk.block_table
            request = chunk.request
            if chunk.end > request.num_tokens:
                # Asynchronous scheduling: the last input is the token the latest step in flight
                # draws for this request; every earlier one is known.
                known = request.token_ids[chunk.start : chunk.end - 1]
                assert len(known) == chunk.num_tokens - 1, "only a chunk's last input may be in flight"
                input_ids.extend(known)
                fed_rows.append(len(input_ids))
                fed_from.append(self._drawing[request.request_id])
                input_ids.append(0)
            else:
                input_ids.extend(request.token_ids[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            if chunk.right_to_left:
                slots.extend(table[p // size] * size + size - 1 - p % size for p in range(chunk.start, chunk.end))
            else:
                slots.extend(table[p // size] * size + p % size for p in range(chunk.start, chunk.end))
            query_start_loc.append(query_start_loc[-1] + chunk.num_tokens)
            seq_lens.append(chunk.end)
            if chunk.samples:
                sample_rows.append(query_start_loc[-1] - 1)
        tables = self.block_tables.table([(c.request.request_id, c.block_table) for c in batch.chunks])
        n, s, pinned = len(input_ids), len(seq_lens), self.device.type == "cuda"
        # One copy for the six small inputs (step_inputs.py): into a graph's static buffer when a
        # graph runs the step, else into a fresh one (on a CPU the host buffer is the input).
        if graph is None:
            layout, buffer = StepInputLayout(n, s), None
            block_tables = tables.to(self.device, non_blocking=pinned)
        else:
            assert self.graphs is not None  # _replayable found a graph
            layout, buffer = self.graphs.inputs_for(graph, n)
            block_tables = self.graphs.write_block_table(tables)
        host = layout.pack(input_ids, positions, slots, sample_rows, seq_lens, query_start_loc, pin_memory=pinned)
        if buffer is None:
            buffer = host.to(self.device, non_blocking=pinned)
        else:
            buffer.copy_(host, non_blocking=pinned)
        inputs = layout.views(buffer, n, s, len(sample_rows))
        ctx = ForwardContext(
            slot_mapping=inputs.slot_mapping,
            block_tables=block_tables,
            seq_lens=inputs.seq_lens,
            query_start_loc=inputs.query_start_loc,
            kv_caches=self.kv_caches,
            backend=self.backend,
            # Only a batch with a right-to-left sequence pays for the direction flags.
            directions=(self._to_device([c.right_to_left for c in batch.chunks], torch.bool)
                        if any(c.right_to_left for c in batch.chunks) else None),
        )
        if fed_rows:
            self._feed(inputs.input_ids, fed_rows, fed_from)
        return PreparedBatch(inputs.input_ids, inputs.positions, ctx, sample_rows, inputs.sample_index)

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A step input on the device. On CUDA from page-locked memory, so the non-blocking
        copy is truly asynchronous: the CPU goes on preparing and launching while the inputs
        travel (PyTorch's pinned allocator keeps the buffer until the copy is done)."""
        return to_device(values, dtype, device=self.device)

    def _feed(self, input_ids: torch.Tensor, rows: list[int], sources: list[tuple[torch.Tensor, int]]) -> None:
        """Write each of `rows` of `input_ids` from its (draws, index) source on the device: one
        gather and one scatter per step drawn from (almost always one: the previous step)."""
        by_step: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for row, (draws, index) in zip(rows, sources):
            _, dst, src = by_step.setdefault(id(draws), (draws, [], []))
            dst.append(row)
            src.append(index)
        for draws, dst, src in by_step.values():
            gathered = draws.index_select(0, self._to_device(src, torch.int64))
            input_ids.index_copy_(0, self._to_device(dst, torch.int64), gathered)

    def apply_kv_copies(self, groups: list, landed: Iterable[int] = (), readers: Iterable[str] = ()) -> None:
        """Issue the step's copy groups (checkpoints, swaps, restores) and make the forward over
        `readers` wait for those it needs. `landed`: copies the manager saw land, which it may now
        reuse the blocks of: retired first, so this rank's streams are past them too."""
        store = self.host_store
        if store is None:
            if groups:
                raise RuntimeError("the batch carries KV copies but the runner has no host store")
            return
        store.retire(landed)
        # In order (a later group may save what an earlier one filled); layer-major if the store
        # streams copies layer by layer, in which case the forward waits per layer (run_model).
        store.execute_step(groups, self.kv_caches)
        store.wait_for(readers)

    def request_preemption(self) -> None:
        """Stop the pure-offline forward in flight at its next safe point (ConServe Alg. 2's
        PREEMPTRUNNING); the engine forwards its scheduler's request here."""
        self.preemption.request()

    def on_safe_point(self, callback: Callable[[], None] | None) -> None:
        self.preemption.on_safe_point = callback

    @torch.inference_mode()
    def run_model(self, prepared: PreparedBatch, preemptible: bool = False,
                  hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states for every token of the batch (and K/V written to the cache). With
        `preemptible` the safe points are armed and the forward may raise `ForwardPreempted`.
        A later pipeline stage passes the previous stage's `hidden` instead of token ids."""
        store = self.host_store
        layer_waits = store is not None and store.has_layer_waits
        hosts = self._safe_point_hosts if preemptible or layer_waits else []
        for host in hosts:
            host.safe_point = self._after_layer if layer_waits else self.preemption.safe_point
        self._preemptible = preemptible
        try:
            return self.model(None if hidden is not None else prepared.input_ids, prepared.positions, prepared.ctx,
                              hidden)
        finally:
            for host in hosts:
                host.safe_point = None
            self.preemption.requested = False  # not consumed by this forward: the next schedule serves it

    def _after_layer(self, layers_done: int) -> None:
        """Between layers when copies stream layer by layer: the next layer waits for its part of
        the copies it reads (HostKVStore.wait_layer), then ConServe's safe point, if armed."""
        assert self.host_store is not None  # installed only for a store's layer waits (run_model)
        self.host_store.wait_layer(layers_done)
        if self._preemptible:
            self.preemption.safe_point(layers_done)

    def supports_prompt_logprobs(self) -> bool:
        return True

    def shutdown(self) -> None:
        self._grammar_masks.shutdown(wait=False)

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        return self.land(self.launch(batch))

    # -- asynchronous scheduling: the engine's two-deep pipeline (MicrobatchPipeline) -----------
    def submit(self, batch: SchedulerOutput) -> None:
        """Launch `batch` and return before its tokens are known (asynchronous scheduling)."""
        self._launched.append(self.launch(batch))

    def collect(self) -> ExecutorOutput:
        """The oldest launched step's result; waits for its tokens only."""
        return self.land(self._launched.popleft())

    def discard_in_flight(self) -> None:
        self._launched.clear()
        self._drawing.clear()

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput) -> LaunchedStep:
        """Queue the step's copies, forward and sampling on the device. On a GPU this returns
        while the device works; on a CPU the work is done by then."""
        self.apply_kv_copies(batch.kv_copies, batch.landed_copies, (c.request.request_id for c in batch.chunks))
        if not batch.chunks:
            return LaunchedStep()
        # Only a pure-offline batch is preemptible (ConServe's offline batching mode, §4.3), and
        # not as a pipeline stage: the stages run different layers, so no barrier aligns them.
        preemptible = (self.layerwise_preemption and self.stage_layers is None
                       and all(c.request.priority is RequestClass.OFFLINE for c in batch.chunks))
        sampling = [c.request for c in batch.chunks if c.samples]
        # Structured outputs: the grammars' masks are filled on a thread while the forward runs
        # (llguidance releases the GIL), as vLLM fills them while the GPU computes the logits.
        masks = None
        if self.tp.rank == 0 and self._needs_masks(sampling):  # only rank 0 samples
            masks = self._grammar_masks.submit(grammar_bitmask, sampling)
        prompt_logprobs: dict[str, PromptLogprobs] = {}  # a graph never runs a step that wants them
        graph = self._replayable(batch, preemptible)
        prepared = self.prepare(batch, graph)
        if graph == "decode":
            assert self.graphs is not None  # _replayable found a graph
            logits = self.graphs.replay(prepared.input_ids.shape[0])
        elif graph == "mixed":
            assert self.graphs is not None
            logits = self.graphs.replay_mixed(prepared.input_ids.shape[0], len(prepared.sample_rows))
            if not sampling:
                return LaunchedStep()
        else:
            try:
                hidden = self.run_model(prepared, preemptible=preemptible)
            except ForwardPreempted:
                return LaunchedStep(preempted=True)
            prompt_logprobs = self.prompt_logprobs(batch, hidden)
            if not sampling:
                return LaunchedStep(prompt_logprobs=prompt_logprobs)
            logits = self.model.compute_logits(prepared.sampled(hidden))
        if self.tp.rank != 0:
            return LaunchedStep()
        draws = self.draw(sampling, logits, masks)
        for index, request in enumerate(sampling):
            self._drawing[request.request_id] = (draws.tokens, index)
        return LaunchedStep(sampling, draws, prompt_logprobs=prompt_logprobs)

    def prompt_logprobs(self, batch: SchedulerOutput, hidden: torch.Tensor) -> dict[str, PromptLogprobs]:
        """The logprobs of the prompt tokens this step's chunks predict, for requests that ask
        (`SamplingParams.prompt_logprobs`): row i of a chunk predicts token i + 1, so a chunk
        over positions [s, e) gives the prompt tokens s + 1 .. e (those inside the prompt), each
        with its logprob and the top-n alternatives, from the model's own distribution. Every
        rank computes the logits (their gather is collective under tensor parallelism)."""
        found: dict[str, PromptLogprobs] = {}
        offset = 0
        for chunk in batch.chunks:
            request, rows = chunk.request, chunk.num_tokens
            top = request.params.prompt_logprobs
            first, last = chunk.start + 1, min(chunk.end, request.num_prompt_tokens - 1)  # tokens predicted
            if top is not None and first <= last:
                logits = self.model.compute_logits(hidden[offset:offset + last - first + 1])
                if self.tp.rank != 0:  # only rank 0 reports them
                    offset += rows
                    continue
                logprobs = logits.float().log_softmax(-1)
                targets = torch.tensor(request.prompt_token_ids[first:last + 1], device=logprobs.device)
                chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
                values, ids = (t.tolist() for t in logprobs.topk(top, dim=-1)) if top else ([[]] * len(chosen),) * 2
                found[request.request_id] = PromptLogprobs(first, [
                    {**dict(zip(i, v)), token: c} for i, v, token, c in zip(ids, values, targets.tolist(), chosen)])
            offset += rows
        return found

    def land(self, step: LaunchedStep) -> ExecutorOutput:
        """Wait for a launched step's tokens and hand them out; a request whose latest token this
        was is no longer fed from the device (the engine appends it next)."""
        if step.draws is None:
            return ExecutorOutput(preempted=step.preempted, prompt_logprobs=step.prompt_logprobs)
        for request in step.sampling:
            drawing = self._drawing.get(request.request_id)
            if drawing is not None and drawing[0] is step.draws.tokens:
                del self._drawing[request.request_id]
        out = self._output(step.sampling, step.draws)
        out.prompt_logprobs = step.prompt_logprobs
        return out

    def _replayable(self, batch: SchedulerOutput, preemptible: bool) -> str | None:
        """Which CUDA graph can run this step (cuda_graphs.py): "decode" when every sequence
        decodes one token it samples, "mixed" for any other batch a mixed graph holds, None to
        run eagerly. Only left to right, with no Python to run between layers. Decided before
        the inputs are built: they are built in the layout of the graph that runs them."""
        graphs, chunks = self.graphs, batch.chunks
        if graphs is None or preemptible or any(c.right_to_left for c in chunks):
            return None
        if any(c.request.params.prompt_logprobs is not None for c in chunks):
            return None  # the graphs keep only the sampled rows' hidden states
        if self.host_store is not None and self.host_store.has_layer_waits:
            return None
        num_seqs, num_tokens = len(chunks), sum(c.num_tokens for c in chunks)
        width = max(len(c.block_table) for c in chunks)
        if graphs.can_replay(num_seqs, num_tokens == num_seqs == sum(c.samples for c in chunks), width):
            return "decode"
        return "mixed" if graphs.can_replay_mixed(num_tokens, num_seqs, width) else None

    def draw(self, sampling: list[Request], logits: torch.Tensor,
             masks: Future[torch.Tensor | None] | None = None) -> DrawsOnDevice:
        """Queue the draw of each request's next token from its row of `logits`. `masks`: the
        grammars' bitmask being filled since the step was launched (None: filled here)."""
        for request in sampling:
            if request.params.seed is not None and request.generator is None:
                request.generator = torch.Generator(device=self.device).manual_seed(request.params.seed)
        histories = bitmask = None
        if any(r.params.needs_logits_processing for r in sampling):
            histories = [self.history(r) if r.params.needs_logits_processing else NO_HISTORY for r in sampling]
            bitmask = masks.result() if masks is not None else grammar_bitmask(sampling)
        return sample_on_device(logits, [r.params for r in sampling], [r.generator for r in sampling],
                                self.generator, histories, bitmask)

    @staticmethod
    def _needs_masks(sampling: list[Request]) -> bool:
        return any(r.grammar_active for r in sampling)

    def history(self, request: Request) -> RowHistory:
        """What the logits processors read of `request`; under asynchronous scheduling its
        latest token may still be on the device, drawn by the step in flight."""
        return RowHistory(request.output_token_ids, request.prompt_token_ids, self._drawing.get(request.request_id),
                          request.min_tokens_stop_ids, request.bad_words_token_ids)

    def sample(self, sampling: list[Request], logits: torch.Tensor) -> ExecutorOutput:
        """Draw each request's next token from its row of `logits` (and wait for them)."""
        return self._output(sampling, self.draw(sampling, logits))

    @staticmethod
    def _output(sampling: list[Request], draws: DrawsOnDevice) -> ExecutorOutput:
        result = draws.result()
        out = ExecutorOutput()
        for request, token, logprobs in zip(sampling, result.token_ids, result.logprobs):
            out.sampled[request.request_id] = token
            if logprobs is not None:
                out.logprobs[request.request_id] = logprobs
        return out
