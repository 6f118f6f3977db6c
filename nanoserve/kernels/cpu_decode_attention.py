"""Paged decode attention for the CPU in C, reading K/V in place (ours; issue 23).

The torch backend's decode path (nanoserve/kernels/cpu_attention.py) gathers each decode row's K/V out of
the paged cache into a padded batch and runs SDPA on the copy: every cached token is copied
once and read twice, and each length group is two `index_select`s, a mask and an SDPA call per
layer. `cpu_decode_attention.c` does the decode rows of a step in one call per layer, reading
each token's K and V where the block table says they lie:

    q [T, H, D] ──rows──►  (row r, KV head h): G = H / Hkv query heads
    block table [S, M] ──► K/V at cache[block, slot, h, :], slot = p % B (B-1-p % B: BROS)
                           scores fp32 -> softmax -> sum of V, fp32 -> out[row r, h*G:(h+1)*G]

(row, KV head) pairs run in parallel on PyTorch's own OpenMP runtime. The library is built on
first use (nanoserve/kernels/cpu_build.py); where it cannot be, `available()` is False and the torch
backend keeps its SDPA path. The results equal the reference's to fp32 rounding
(tests/test_cpu_attention.py).
"""
from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from nanoserve.kernels import cpu_build

SOURCE = Path(__file__).with_suffix(".c")


class _DecodeArgs(ctypes.Structure):
    """`decode_args` of cpu_decode_attention.c, field for field."""

    _fields_ = [
        ("num_rows", ctypes.c_int64), ("rows", ctypes.c_void_p), ("seqs", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p), ("tables", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
        ("right_to_left", ctypes.c_void_p),
        ("q_stride_tok", ctypes.c_int64), ("q_stride_head", ctypes.c_int64),
        ("out_stride_tok", ctypes.c_int64), ("out_stride_head", ctypes.c_int64),
        ("num_heads", ctypes.c_int64), ("num_kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
        ("block_size", ctypes.c_int64), ("scale", ctypes.c_float),
        ("start", ctypes.c_int64), ("lse", ctypes.c_void_p),
    ]


@cache
def _library() -> ctypes.CDLL | None:
    signature = [ctypes.POINTER(_DecodeArgs)] + [ctypes.c_void_p] * 4
    return cpu_build.load(SOURCE, {"decode_attention_f32": signature, "decode_attention_bf16": signature})


def available() -> bool:
    """Whether the C kernels are built and loaded here."""
    return _library() is not None


def decode_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    rows: list[int],  # the decode rows of q to compute
    seqs: list[int],  # each row's sequence
    directions: torch.Tensor | None,  # bool [num_seqs] or None
    scale: float,
    out: torch.Tensor,  # like q: the rows are written
    start: int = 0,
    lse: torch.Tensor | None = None,  # float32 [len(rows), num_heads], contiguous
) -> bool:
    """Write `out[rows]`: each row's attention over its sequence's cached context, from position
    `start` on (cascade attention computes the shared positions before it apart), and, given
    `lse`, each row's and query head's log-sum-exp of scores. Returns False, writing nothing,
    where the kernels are unavailable or the tensors are not what they read (another dtype or
    device, a non-contiguous cache); the caller then computes the rows itself."""
    library = _library()
    if (library is None or not rows or q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16)
            or not all(t.dtype == q.dtype for t in (k_cache, v_cache, out))
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or q.stride(2) != 1 or out.stride(2) != 1
            or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1
            or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous()):
        return False
    row_index = torch.tensor(rows, dtype=torch.int32)
    seq_index = torch.tensor(seqs, dtype=torch.int32)
    flags = None
    if directions is not None:
        flags = directions.to(torch.uint8).contiguous()
    args = _DecodeArgs(
        len(rows), row_index.data_ptr(), seq_index.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), None if flags is None else flags.data_ptr(),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], scale,
        start, None if lse is None else lse.data_ptr(),
    )
    fn = library.decode_attention_f32 if q.dtype == torch.float32 else library.decode_attention_bf16
    if fn(ctypes.byref(args), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()):
        raise MemoryError("cpu_decode_attention: out of memory for a row's scores")
    return True
