# Triton kernel bodies (@triton.jit) take untyped pointer and tl.constexpr parameters; the launchers are typed.
# mypy: disable-error-code="no-untyped-def"
"""Paged attention in Triton: one kernel for prefill chunks, decodes and mixed batches.

Semantics are exactly `nanoserve/kernels/reference.paged_attention` (same signature): q holds every
sequence's new tokens back to back, `query_start_loc` marks where each sequence's rows start,
`seq_lens` is each context length after this step, and the new token at position p attends
causally to positions <= p. K/V live in pages of B slots; position p of sequence s is in page
`block_tables[s, p // B]` at slot `p % B`, or at slot `B - 1 - p % B` when `directions[s]` is
set: BROS's bidirectional blocks (bros.txt §5.1, §6), where a real-time sequence fills a page
from the left while a best-effort sequence fills the same page from the right.

Tiling
------
One program computes one *query tile* of one sequence for one KV head:

    rows of the tile   BLOCK_M = BLOCK_Q new tokens x GROUP query heads that share the KV head
    columns            the sequence's context, TILE_N positions at a time (flash attention's
                       online softmax keeps a running max and sum per row, so the whole context
                       is never materialised)

Packing the GQA group into the rows means each K/V tile is loaded once and used by all the
query heads that read it: that is what decode (memory bound) needs. A decode step has one new
token per sequence, so its tile holds one real token and a small BLOCK_M (16); a prefill chunk
is cut into tiles of BLOCK_Q = BLOCK_M // GROUP tokens with BLOCK_M = 64. `tl.dot` wants at
least 16 rows, and GROUP need not divide BLOCK_M (SmolLM2 has 9 heads over 3 KV heads), so
rows past BLOCK_Q x GROUP or past the chunk's end are masked out.

Columns are *logical* positions. Each column looks up its page in the block table and its slot
from the direction, so a K/V tile may span several pages of any size (B = 8..64 and beyond) and
the bidirectional layout costs one `where` on the slot index, not a different kernel.

A tile only loops over the columns its last query can see: a chunk's early tiles skip the
chunk's later keys. The causal mask is `column <= position of the row's query`; the same rule
hides the padding past a decode's context, because `seq_len` bounds the loop.

The grid is (number of query tiles, number of KV heads). Sequence s's tiles are numbered from
`query_start_loc[s] // BLOCK_Q + s`, an upper bound on the tiles of all earlier sequences that
needs no host synchronisation; each program binary-searches `query_start_loc` for its
sequence, and programs past the end of their sequence's tiles exit at once (vLLM's unified
Triton attention uses the same numbering).

Split-K for small decode batches (flash-decoding)
-------------------------------------------------
A decode batch gives the grid above one program per (sequence, KV head): 8 programs for one
Llama-3-8B sequence, on a GPU with 132 SMs. Measured on an H200 (benchmarks/RESULTS.md), batch 1
reached 2% of HBM bandwidth, 4-20x slower than SDPA. When every sequence decodes and those
programs would not fill the GPU, the context is cut into `num_splits` parts instead:

    grid (sequence, KV head, split)        each split: its ceil(seq_len / splits) columns (rounded
                                           to TILE_N), the same online softmax, then stores its
                                           normalised output and log-sum-exp (base 2)
    grid (sequence, query head)            combine: out = sum_i w_i o_i / sum_i w_i,
                                           w_i = 2^(lse_i - max lse)

The split count depends only on the batch's shape, never on context lengths (which live on the
device), so a CUDA graph records it like any other launch; a split past a sequence's end is empty
(lse = -inf, weight 0). A split takes at least `MIN_SPLIT_TOKENS` positions, decided on the
device from the sequence's own length: a 1k context is cut into 4 parts, not 32 of 32 tokens
each, whose fixed costs (a program, a partial output, a combine term) outweigh what they read
(issue 47: split-K at batch 1 x 1k measured 0.079 ms against 0.037 unsplit on an H200).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_start_loc, num_seqs, tile_idx, BLOCK_Q: tl.constexpr):
    """The last sequence whose first tile is at or before `tile_idx` (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_columns(queries, query_pos, k_cache, v_cache, block_tables, directions, seq, kv_head, start, end,
                    scale_log2, stride_table,
                    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
                    CAUSAL: tl.constexpr, HAS_DIRECTIONS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """Flash attention's online softmax over the logical columns [start, end) of sequence `seq`'s
    context for one KV head, TILE_N at a time: returns each row's max and sum (base 2) and its
    unnormalised output. Each column finds its page in the block table and its slot from the
    sequence's direction. CAUSAL: a row sees the columns up to its query's position
    (`query_pos`); otherwise every column in range."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if HAS_DIRECTIONS:
        right_to_left = tl.load(directions + seq) != 0
    table = block_tables + seq.to(tl.int64) * stride_table
    for col_start in range(start, end, TILE_N):
        cols = col_start + tl.arange(0, TILE_N)
        col_valid = cols < end
        page = tl.load(table + cols // BLOCK_SIZE, mask=col_valid, other=0).to(tl.int64)
        slot = cols % BLOCK_SIZE
        if HAS_DIRECTIONS:
            slot = tl.where(right_to_left, BLOCK_SIZE - 1 - slot, slot)

        k_offsets = page[None, :] * stride_k_block + slot[None, :] * stride_k_slot + kv_head * stride_k_head
        keys = tl.load(k_cache + k_offsets + dims[:, None], mask=dim_valid[:, None] & col_valid[None, :],
                       other=0.0)  # [HEAD_DIM_PAD, TILE_N]
        if DOT_IN_FP32:
            keys = keys.to(tl.float32)
        scores = tl.dot(queries, keys, input_precision=DOT_PRECISION) * scale_log2
        if CAUSAL:
            visible = (cols[None, :] <= query_pos[:, None]) & col_valid[None, :]
        else:
            visible = col_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        # Online softmax in base 2. The range's first column is visible to every row, so after the
        # first tile each row's max is finite and exp2(-inf - max) cleanly gives 0 for masked columns.
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v_offsets = page[:, None] * stride_v_block + slot[:, None] * stride_v_slot + kv_head * stride_v_head
        values = tl.load(v_cache + v_offsets + dims[None, :], mask=col_valid[:, None] & dim_valid[None, :],
                         other=0.0)  # [TILE_N, HEAD_DIM_PAD]
        if DOT_IN_FP32:
            values = values.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=DOT_PRECISION)
        row_max = new_max
    return row_max, row_sum, acc


# Integer arguments are specialised by value class (== 1, multiple of 16) unless told otherwise,
# which would compile new variants mid-serving as the batch changes: the batch-dependent ones
# are not (issue 22, defect 7).
@triton.jit(do_not_specialize=["num_seqs", "stride_table"])
def _paged_attention_kernel(
    out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, directions,
    scale_log2, num_seqs,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_table,
    HAS_DIRECTIONS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc, num_seqs, tile_idx, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    q_tile = tile_idx - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    prefix_len = seq_len - q_len

    # Row r of the tile is new token q_tile * BLOCK_Q + r // GROUP, query head r % GROUP of the group.
    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < q_len)
    query_pos = prefix_len + token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    q_rows = (q_start + token).to(tl.int64)
    queries = tl.load(q + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                      mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_IN_FP32:
        queries = queries.to(tl.float32)

    # Keys after the tile's last query are masked for every row, so the loop stops there.
    kv_end = tl.minimum(seq_len, prefix_len + (q_tile + 1) * BLOCK_Q)
    row_max, row_sum, acc = _attend_columns(
        queries, query_pos, k_cache, v_cache, block_tables, directions, seq, kv_head, 0, kv_end, scale_log2,
        stride_table, stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
        CAUSAL=True, HAS_DIRECTIONS=HAS_DIRECTIONS, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_M=BLOCK_M, TILE_N=TILE_N, DOT_PRECISION=DOT_PRECISION, DOT_IN_FP32=DOT_IN_FP32)

    acc = acc / tl.where(row_valid, row_sum, 1.0)[:, None]
    tl.store(out + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
             acc.to(out.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit(do_not_specialize=["stride_table"])
def _paged_decode_split_kernel(
    partial_out, partial_lse, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, directions,
    scale_log2,
    stride_q_tok, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_table, stride_po_seq, stride_po_head, stride_po_split, stride_pl_seq, stride_pl_head,
    NUM_SPLITS: tl.constexpr, HAS_DIRECTIONS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, MIN_SPLIT: tl.constexpr,
):
    """One split of one decoding sequence's context for one KV head: rows are the GROUP query
    heads of that KV head (one new token), columns the split's positions (at least MIN_SPLIT, a
    multiple of TILE_N; the splits past the context are empty)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N, MIN_SPLIT)
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token = tl.load(query_start_loc + seq).to(tl.int64)
    queries = tl.load(q + token * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                      mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_IN_FP32:
        queries = queries.to(tl.float32)

    # The new token sees its whole context: only the split's end masks.
    row_max, row_sum, acc = _attend_columns(
        queries, 0, k_cache, v_cache, block_tables, directions, seq, kv_head, start, end, scale_log2,
        stride_table, stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
        CAUSAL=False, HAS_DIRECTIONS=HAS_DIRECTIONS, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_M=BLOCK_M, TILE_N=TILE_N, DOT_PRECISION=DOT_PRECISION, DOT_IN_FP32=DOT_IN_FP32)

    nonempty = row_sum > 0
    acc = acc / tl.where(nonempty, row_sum, 1.0)[:, None]
    lse = tl.where(nonempty, row_max + tl.log2(tl.where(nonempty, row_sum, 1.0)), float("-inf"))
    base = seq.to(tl.int64) * stride_po_seq + split * stride_po_split
    tl.store(partial_out + base + head[:, None] * stride_po_head + dims[None, :], acc, mask=row_valid[:, None])
    tl.store(partial_lse + seq.to(tl.int64) * stride_pl_seq + head * stride_pl_head + split, lse, mask=row_valid)


@triton.jit
def _combine_splits_kernel(
    out, partial_out, partial_lse, query_start_loc,
    stride_o_tok, stride_o_head, stride_po_seq, stride_po_head, stride_po_split, stride_pl_seq, stride_pl_head,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """out = sum_i 2^(lse_i - m) o_i / sum_i 2^(lse_i - m), m the largest lse (split 0 is never
    empty: every sequence has a context)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(partial_lse + seq.to(tl.int64) * stride_pl_seq + head * stride_pl_head + splits,
                  mask=splits < NUM_SPLITS, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(partial_out + seq.to(tl.int64) * stride_po_seq + head * stride_po_head
                    + splits[:, None] * stride_po_split + dims[None, :],
                    mask=(splits < NUM_SPLITS)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    result = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    token = tl.load(query_start_loc + seq).to(tl.int64)
    tl.store(out + token * stride_o_tok + head * stride_o_head + dims, result.to(out.dtype.element_ty),
             mask=dims < HEAD_DIM)


MAX_SPLITS = 32
# assumption: 256 positions, 8 column tiles of 32; `benchmarks/attention.py --sweep` times 0 (no
# minimum), 128, 256 and 512 at batch 1 and 16 with 1k contexts, to set it from a GPU.
MIN_SPLIT_TOKENS = 256
_SM_COUNT: dict[int, int] = {}


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many parts to cut each decoding context into: enough programs for about two waves
    over the GPU's SMs, at most MAX_SPLITS; 1 (no split) once the batch fills the GPU alone, and
    on a CPU (the interpreter has no SMs to fill; tests ask for splits explicitly)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    programs = num_seqs * num_kv_heads
    return max(1, min(MAX_SPLITS, -(-2 * _SM_COUNT[index] // programs))) if programs < _SM_COUNT[index] else 1


def _tile_shape(num_tokens: int, num_seqs: int, group: int, head_dim_pad: int) -> tuple[int, int, dict]:
    """(BLOCK_M, TILE_N, launch options): a small row tile when every sequence decodes, a large
    one otherwise. For head_dim 128 the settings are the fastest of benchmarks/attention.py
    --sweep on an H200 (2026-11-26: decode 64 x 1k 0.091 -> 0.082 ms, prefill 2048 after 2048
    0.494 -> 0.452 ms); other head sizes keep K and V tiles at 8 KiB of fp16 each."""
    decode_only = num_tokens == num_seqs
    if head_dim_pad == 128:
        block_m = max(16 if decode_only else 128, triton.next_power_of_2(group))
        return block_m, 64, dict(num_warps=4, num_stages=3)
    block_m = max(16 if decode_only else 64, triton.next_power_of_2(group))
    return block_m, 64 if head_dim_pad <= 64 else 32, {}


SPLIT_TILE_N = {64: 64, 128: 32}  # the split-K kernel's column tile (as measured; other sizes: 32)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    directions: torch.Tensor | None,  # bool/int8 [num_seqs] or None
    scale: float,
    num_splits: int | None = None,  # decode only: None picks `decode_splits`; 1 never splits
    tuning: dict | None = None,  # benchmarks only: BLOCK_M, TILE_N, num_warps, num_stages overrides
    min_split_tokens: int = MIN_SPLIT_TOKENS,  # split decode: the fewest positions a split takes
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_seqs = block_tables.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    if directions is not None and directions.dtype == torch.bool:
        directions = directions.view(torch.int8)

    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, tile_n, launch = _tile_shape(num_tokens, num_seqs, group, head_dim_pad)
    tuning = launch | dict(tuning or {})
    block_m, tile_n = tuning.pop("BLOCK_M", block_m), tuning.pop("TILE_N", tile_n)
    block_q = block_m // group
    # Triton 3.9's interpreter multiplies bf16 tiles as their raw uint16 bits in tl.dot; on the
    # CPU those dots run in fp32 instead (compiled kernels use the tensor cores' bf16 path).
    dot_in_fp32 = q.dtype == torch.bfloat16 and triton.knobs.runtime.interpret
    precision = "ieee" if q.dtype == torch.float32 or dot_in_fp32 else "tf32"
    if num_tokens == num_seqs:
        splits = decode_splits(num_seqs, num_kv_heads, q.device) if num_splits is None else num_splits
        if splits > 1:
            return _split_decode(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, directions,
                                 scale, splits, group, head_dim_pad, block_m, SPLIT_TILE_N.get(head_dim_pad, 32),
                                 precision, dot_in_fp32, min_split_tokens)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        directions if directions is not None else seq_lens,  # any pointer; never read without directions
        scale * 1.4426950408889634, num_seqs,  # scale * log2(e): the softmax runs in base 2
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HAS_DIRECTIONS=directions is not None, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        DOT_PRECISION=precision, DOT_IN_FP32=dot_in_fp32, **tuning,
    )
    return out


def _split_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                  directions: torch.Tensor | None, scale: float, splits: int, group: int, head_dim_pad: int,
                  block_m: int, tile_n: int, precision: str, dot_in_fp32: bool, min_split_tokens: int) -> torch.Tensor:
    num_seqs = block_tables.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    partial_out = torch.empty((num_seqs, num_heads, splits, head_dim_pad), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
    _paged_decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        partial_out, partial_lse, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        directions if directions is not None else seq_lens, scale * 1.4426950408889634,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        NUM_SPLITS=splits, HAS_DIRECTIONS=directions is not None, GROUP=group, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m, TILE_N=tile_n,
        DOT_PRECISION=precision, DOT_IN_FP32=dot_in_fp32,
        MIN_SPLIT=-(-min_split_tokens // tile_n) * tile_n,  # whole column tiles
    )
    _combine_splits_kernel[(num_seqs, num_heads)](
        out, partial_out, partial_lse, query_start_loc,
        out.stride(0), out.stride(1), partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
    )
    return out
