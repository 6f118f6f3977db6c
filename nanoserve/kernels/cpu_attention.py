"""Paged attention for the CPU's torch backend: nanoserve/kernels/reference.py's semantics, less memory traffic.

On a CPU, decode attention is bound by memory, not arithmetic: each decode row's K/V is
gathered out of the paged cache into a padded batch (a copy of every cached token it reads),
and SDPA then reads that copy again. The reference pads every decode row to the longest
context of the step; with mixed lengths most of what it copies is padding. Profiled on
benchmarks/throughput.py's 64 requests (benchmarks/profile_cpu.py, 2-core EPYC, fp32),
attention was 29% of the run, its gather and SDPA most of it. Three changes (ours), each
computing exactly what the reference computes:

1. Decode rows are grouped by context length before the gather: sorted by their number of
   blocks, a new group starts when a row's blocks exceed `GROUP_RATIO` x the group's first
   row's. Each group pads only to its own longest row, so the padding is below
   (GROUP_RATIO - 1) of what a group reads, for one more SDPA call per group.

       blocks per row   1 1 2 | 3 3 4 | 7 9 | 14 18 20      (GROUP_RATIO 1.5)
       one call each:   pad to 2 | pad to 4 | pad to 9 | pad to 20
       the reference:   every row padded to 20

2. A decode row's query heads are folded onto their KV head: [S, Hkv, H / Hkv, D] queries
   against [S, Hkv, L, D] keys is grouped-query attention with H / Hkv query rows per head,
   one SDPA matrix product per (row, KV head) instead of one per query head.

3. A prefill chunk that is the sequence's whole context (its first chunk) attends with
   `is_causal` over its own positions: no mask is built and SDPA skips the masked half.
   Later chunks keep the reference's mask (their queries are not at the keys' start).

4. Where the C kernel builds (nanoserve/kernels/cpu_decode_attention.py, the usual case on Linux), the
   decode rows skip 1 and 2 altogether: one call per layer reads their K/V in place, no gather.
   Measured inside the engine on a 2-core EPYC (SmolLM2, bf16, contexts 64-128): 37 against 80
   us a layer at batch 1, 103 against 163 at batch 8, 344 against 437 at batch 32.

5. Cascade attention for decode rows that share a prefix (FlashInfer's cascade, vLLM's
   `use_cascade_attention` on GPUs; ours on the CPU): with prefix caching, many decode rows'
   block tables begin with the same blocks (a system prompt). Their attention over those
   blocks is one flash-attention call for all rows at once (PyTorch's CPU kernel, which
   returns the log-sum-exp: the shared keys are read once, as a matrix product), the C kernel
   does each row's own rest with its log-sum-exp, and the two are merged exactly:

       out = (e^(lse1 - m) out1 + e^(lse2 - m) out2) / (e^(lse1 - m) + e^(lse2 - m)),  m = max(lse1, lse2)

   Used for the largest group of decode rows whose tables begin with the same block, where it
   has at least `CASCADE_MIN_ROWS` rows sharing at least `CASCADE_MIN_TOKENS` tokens
   (assumption: vLLM's GPU thresholds are of the same order); the other rows go the usual way.
   Prompt chunks that share a cached prefix (47 requests admitted together after a system
   prompt) do the same (`cascade_prefill`, at least `CASCADE_MIN_CHUNKS` chunks): the shared
   part is one call for all their rows, their own parts one causal call per shape of chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels import cpu_decode_attention
from nanoserve.kernels.reference import gather_kv

# ours: a decode group's longest row may hold this many times its shortest row's blocks.
GROUP_RATIO = 1.5
# ours (5. above): cascade attention where this many decode rows share this many leading tokens.
CASCADE_MIN_ROWS = 8
CASCADE_MIN_CHUNKS = 4  # prompt chunks: each is a handful of rows already
CASCADE_MIN_TOKENS = 256


def sharing_group(block_tables: torch.Tensor, seqs: list[int]) -> list[int]:
    """The largest set of `seqs` whose tables begin with the same block (those that may share a
    cached prefix; the others, say a request that computed the same prompt before it was
    cached, go the usual way)."""
    firsts = block_tables[seqs, 0].tolist()
    mode = max(set(firsts), key=firsts.count)
    return [seq for seq, first in zip(seqs, firsts) if first == mode]


def common_prefix_blocks(block_tables: torch.Tensor, seqs: list[int], lens: list[int], block_size: int) -> int:
    """Leading blocks that every one of `seqs` has in its table, the same block ids (a shared
    cached prefix), each sequence keeping at least its last position outside them."""
    limit = min((lens[i] - 1) // block_size for i in seqs)
    if limit <= 0:
        return 0
    tables = block_tables[seqs, :limit]
    same = (tables == tables[:1]).all(dim=0)
    differ = (~same).nonzero()
    return int(differ[0, 0]) if differ.numel() else limit


def cascade_group(block_tables: torch.Tensor, seqs: list[int], starts: list[int], lens: list[int], block_size: int,
                  min_seqs: int) -> tuple[list[int], int]:
    """5. above: the largest group of `seqs` whose tables begin with the same block, and the
    blocks they all share before any of their queries (a decode row's one query always comes
    after them; a prompt chunk's must start past them, so none of the shared keys is masked);
    0 where fewer than `min_seqs` share, or less than `CASCADE_MIN_TOKENS`."""
    if len(seqs) < min_seqs:
        return [], 0
    group = sharing_group(block_tables, seqs)
    if len(group) < min_seqs:
        return group, 0
    shared = min([common_prefix_blocks(block_tables, group, lens, block_size)]
                 + [(lens[i] - (starts[i + 1] - starts[i])) // block_size for i in group])
    return group, shared if shared * block_size >= CASCADE_MIN_TOKENS else 0


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, rows: list[int], seqs: list[int], shared: int, scale: float,
                   out: torch.Tensor) -> bool:
    """5. above: `out[rows]` for decode rows whose tables share their first `shared` blocks.
    False, writing nothing, where the C kernel cannot do the rest."""
    block_size, (num_heads, head_dim) = k_cache.shape[1], q.shape[1:]
    rest = torch.empty(len(rows), num_heads, head_dim, dtype=q.dtype)
    rest_lse = torch.empty(len(rows), num_heads, dtype=torch.float32)
    queries = q[rows]  # [N, H, D]
    if not cpu_decode_attention.decode_attention(queries, k_cache, v_cache, block_tables, seq_lens,
                                                 list(range(len(rows))), seqs, None, scale, rest,
                                                 start=shared * block_size, lse=rest_lse):
        return False
    blocks = block_tables[seqs[0], :shared]
    prefix, prefix_lse = _attend_shared(queries, _shared_keys(k_cache, blocks), _shared_keys(v_cache, blocks), scale)
    out[rows] = _merge(prefix, prefix_lse, rest, rest_lse).to(out.dtype)
    return True


def decode_groups(num_blocks: dict[int, int], ratio: float = GROUP_RATIO) -> list[list[int]]:
    """Rows (keys of `num_blocks`) sorted by block count and cut where a row's count passes
    `ratio` x the first count of its group."""
    groups: list[list[int]] = []
    for row in sorted(num_blocks, key=num_blocks.__getitem__):
        if not groups or num_blocks[row] > ratio * num_blocks[groups[-1][0]]:
            groups.append([])
        groups[-1].append(row)
    return groups


def _merge(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets, from each one's output [N, H, D] and log-sum-exp
    [N, H]: exact, in fp32."""
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top).unsqueeze(-1), torch.exp(lse2 - top).unsqueeze(-1)
    return (w1 * out1.float() + w2 * out2.float()) / (w1 + w2)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash attention, which also returns the log-sum-exp: [1, heads, rows, D] each."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                          scale=scale)[:2]
    return out, lse


def _shared_keys(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[1, Hkv, len(blocks) * B, D]: the keys (or values) of `blocks`, in position order."""
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    return cache.index_select(0, blocks).reshape(1, len(blocks) * block_size, num_kv_heads, head_dim).transpose(1, 2)


def _attend_shared(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [N, H, D] (any positions after the shared keys: no mask) against shared keys
    [1, Hkv, P, D]: each KV head's G query heads of every row attend as one batch of rows."""
    n, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    folded = queries.view(n, num_kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(1, num_kv_heads, n * group,
                                                                                        head_dim)
    out, lse = _flash(folded, keys, values, scale)
    out = out.view(num_kv_heads, n, group, head_dim).permute(1, 0, 2, 3).reshape(n, num_heads, head_dim)
    return out, lse.view(num_kv_heads, n, group).permute(1, 0, 2).reshape(n, num_heads)


def cascade_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    starts: list[int], lens: list[int], seqs: list[int], shared: int, scale: float,
                    out: torch.Tensor) -> None:
    """5. above, for prompt chunks whose tables share their first `shared` blocks and whose
    queries all lie past them: every chunk's rows attend to the shared keys in one call; each
    chunk attends to its own later keys causally, one call for all the chunks of one shape
    (rows, own keys), whose mask is then the same; the two parts merge exactly."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    blocks = block_tables[seqs[0], :shared]
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
    shared_out, shared_lse = _attend_shared(q[rows], _shared_keys(k_cache, blocks), _shared_keys(v_cache, blocks),
                                            scale)
    offsets: dict[int, int] = {}  # each chunk's first row in `rows`
    shapes: dict[tuple[int, int], list[int]] = {}  # chunks by (rows, own keys)
    offset, begin = 0, shared * block_size
    for i in seqs:
        q_len = starts[i + 1] - starts[i]
        offsets[i] = offset
        offset += q_len
        shapes.setdefault((q_len, lens[i] - begin), []).append(i)
    for (q_len, own), chunks in shapes.items():
        own_blocks = -(-own // block_size)
        tables = block_tables[chunks, shared:shared + own_blocks]
        keys = torch.cat([_shared_keys(k_cache, t)[:, :, :own] for t in tables]).repeat_interleave(group, dim=1)
        values = torch.cat([_shared_keys(v_cache, t)[:, :, :own] for t in tables]).repeat_interleave(group, dim=1)
        queries = torch.stack([q[starts[i]:starts[i + 1]] for i in chunks]).transpose(1, 2)  # [M, H, q_len, D]
        # Query j sits at own key index own - q_len + j and sees every own key up to it.
        visible = torch.arange(own) <= (own - q_len + torch.arange(q_len)).unsqueeze(1)
        mask = torch.zeros(q_len, own, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
        own_out, own_lse = _flash(queries, keys, values, scale, mask)
        for m, i in enumerate(chunks):
            at = offsets[i]
            out[starts[i]:starts[i + 1]] = _merge(shared_out[at:at + q_len], shared_lse[at:at + q_len],
                                                  own_out[m].transpose(0, 1), own_lse[m].transpose(0, 1)).to(out.dtype)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    directions: torch.Tensor | None,  # bool [num_seqs] or None
    scale: float,
) -> torch.Tensor:
    """The reference's paged attention (nanoserve/kernels/reference.py), by the module docstring's path."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()

    def gathered(seqs: torch.Tensor | slice, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, Hkv, n_blocks * block_size, D] keys and values of `seqs`, in position order."""
        dirs = directions[seqs] if directions is not None else None
        table = block_tables[seqs, :n_blocks]
        return (gather_kv(k_cache, table, dirs).transpose(1, 2), gather_kv(v_cache, table, dirs).transpose(1, 2))

    # 5. above: rows of one direction (no BROS right-to-left blocks) in a dtype the kernels take.
    cascade = directions is None and q.dtype in (torch.float32, torch.bfloat16)
    decode_seqs = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if cascade:
        group, shared = cascade_group(block_tables, decode_seqs, starts, lens, block_size, CASCADE_MIN_ROWS)
        if shared and cascade_decode(q, k_cache, v_cache, block_tables, seq_lens, [starts[i] for i in group], group,
                                     shared, scale, out):
            cascaded = set(group)
            decode_seqs = [i for i in decode_seqs if i not in cascaded]
    # Where the C kernel is built (nanoserve/kernels/cpu_decode_attention.py), it reads the decode rows' K/V
    # in place, all rows in one call; otherwise they are gathered by length group for SDPA.
    if cpu_decode_attention.decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                             [starts[i] for i in decode_seqs], decode_seqs, directions, scale, out):
        decode_seqs = []
    decode_blocks = {i: -(-lens[i] // block_size) for i in decode_seqs}
    for seqs in decode_groups(decode_blocks, GROUP_RATIO):  # read now: tests sweep it
        n_blocks = decode_blocks[seqs[-1]]
        index = torch.tensor(seqs, device=q.device)
        keys, values = gathered(index, n_blocks)
        rows = torch.tensor([starts[i] for i in seqs], device=q.device)
        queries = q[rows].view(len(seqs), num_kv_heads, num_heads // num_kv_heads, head_dim)
        mask = torch.arange(n_blocks * block_size, device=q.device) < seq_lens[index].unsqueeze(1)  # [S, keys]
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
        out[rows] = attn.reshape(len(seqs), num_heads, head_dim)

    prefill_seqs = [i for i in range(len(lens)) if starts[i + 1] - starts[i] > 1]
    done: set[int] = set()
    if cascade:
        group, shared = cascade_group(block_tables, prefill_seqs, starts, lens, block_size, CASCADE_MIN_CHUNKS)
        if shared:
            cascade_prefill(q, k_cache, v_cache, block_tables, starts, lens, group, shared, scale, out)
            done = set(group)
    for i in range(len(lens)):
        first, end = starts[i], starts[i + 1]
        q_len, context = end - first, lens[i]
        if q_len <= 1 or i in done:
            continue
        keys, values = gathered(slice(i, i + 1), -(-context // block_size))
        keys, values = keys[:, :, :context], values[:, :, :context]
        queries = q[first:end].unsqueeze(0).transpose(1, 2)  # [1, H, n, D]
        if q_len == context:  # the whole context is this chunk: plain causal attention
            attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:  # query j sits at position context - q_len + j and sees keys up to it
            positions = context - q_len + torch.arange(q_len, device=q.device)
            mask = torch.arange(context, device=q.device) <= positions.unsqueeze(1)
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[first:end] = attn.transpose(1, 2).reshape(q_len, num_heads, head_dim)
    return out
