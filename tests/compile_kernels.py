"""Compile every Triton kernel variant the engine launches for a Hopper GPU (sm_90), without a
GPU: Triton's front end, its LLVM back end and the ptxas it ships run on any machine. Run in a
process of its own, without TRITON_INTERPRET (under the interpreter a kernel is not compiled).

    python tests/compile_kernels.py      # prints one line per variant; exits 1 on a failure
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import nanoserve.kernels.fused as fused  # noqa: E402
import nanoserve.kernels.paged_attention as attention  # noqa: E402
import nanoserve.kernels.store_kv as store  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
FLOATS = {"scale_log2", "eps"}


def compile_variant(kernel, pointers: dict[str, str], constexprs: dict, **options) -> None:
    """`pointers`: pointer argument -> element type ("bf16", "i32", ...); every other
    non-constexpr argument is an i32 (fp32 for FLOATS)."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=HOPPER, options=options)


def variants():
    # bf16, the serving dtype, in every variant; fp32 (the GPU tests' dtype: IEEE dots) for the
    # attention kernel's two tile shapes. The code is dtype-generic past the loads.
    yield from _fp32_attention()
    for dtype in ("bf16",):
        ptrs = dict(out=dtype, q=dtype, k_cache=dtype, v_cache=dtype, block_tables="i32", seq_lens="i32",
                    query_start_loc="i32", directions="i8")
        for directions in (False, True):
            for head_dim, group in ((128, 4), (64, 3)):
                for decode in (True, False):
                    block_m, tile_n, launch = attention._tile_shape(1 if decode else 2, 1, group, head_dim)
                    consts = dict(HAS_DIRECTIONS=directions, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim,
                                  BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n,
                                  DOT_PRECISION="tf32", DOT_IN_FP32=False)
                    yield (f"paged_attention {dtype} hd{head_dim} {'decode' if decode else 'prefill'}"
                           f"{' directions' if directions else ''}",
                           attention._paged_attention_kernel, ptrs, consts, launch)
                split_ptrs = dict(ptrs, partial_out="fp32", partial_lse="fp32")
                split_consts = dict(NUM_SPLITS=9, HAS_DIRECTIONS=directions, GROUP=group, HEAD_DIM=head_dim,
                                    HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16, BLOCK_M=16,
                                    TILE_N=attention.SPLIT_TILE_N.get(head_dim, 32), DOT_PRECISION="tf32",
                                    DOT_IN_FP32=False)
                yield (f"split decode {dtype} hd{head_dim}{' directions' if directions else ''}",
                       attention._paged_decode_split_kernel, split_ptrs, split_consts, {})
        yield (f"combine splits {dtype}", attention._combine_splits_kernel,
               dict(out=dtype, partial_out="fp32", partial_lse="fp32", query_start_loc="i32"),
               dict(NUM_SPLITS=9, SPLITS_PAD=16, HEAD_DIM=128, HEAD_DIM_PAD=128), {})
        yield (f"store_kv {dtype}", store._store_kv_kernel,
               dict(key=dtype, value=dtype, k_cache=dtype, v_cache=dtype, slot_mapping="i64"),
               dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, HEADS_PAD=8, HEAD_DIM_PAD=128), {})
        for residual in (False, True):
            yield (f"rms_norm {dtype}{' + residual' if residual else ''}", fused._rms_norm_kernel,
                   dict(out=dtype, resid_out=dtype, x=dtype, residual=dtype, weight=dtype),
                   dict(HAS_RESIDUAL=residual, BLOCK=1024), {})
        for store_kv in (False, True):
            yield (f"rope {dtype}{' + store' if store_kv else ''}", fused._rope_kernel,
                   dict(q_out=dtype, k_out=dtype, q=dtype, k=dtype, cos="fp32", sin="fp32", v=dtype, v_cache=dtype,
                        slot_mapping="i64" if store_kv else "fp32"),
                   dict(HALF=64, HALF_PAD=64, STORE=store_kv, BLOCK_SIZE=16 if store_kv else 1), {})
        yield (f"silu_and_mul {dtype}", fused._silu_and_mul_kernel, dict(out=dtype, gate_up=dtype),
               dict(BLOCK=4096), {})


def _fp32_attention():
    ptrs = dict(out="fp32", q="fp32", k_cache="fp32", v_cache="fp32", block_tables="i32", seq_lens="i32",
                query_start_loc="i32", directions="i8")
    for decode in (True, False):
        block_m, tile_n, launch = attention._tile_shape(1 if decode else 2, 1, 2, 64)
        consts = dict(HAS_DIRECTIONS=False, GROUP=2, HEAD_DIM=64, HEAD_DIM_PAD=64, BLOCK_SIZE=16, BLOCK_M=block_m,
                      BLOCK_Q=block_m // 2, TILE_N=tile_n, DOT_PRECISION="ieee", DOT_IN_FP32=False)
        yield (f"paged_attention fp32 hd64 {'decode' if decode else 'prefill'}", attention._paged_attention_kernel,
               ptrs, consts, launch)


def main() -> int:
    failed = 0
    for label, kernel, pointers, constexprs, options in variants():
        try:
            compile_variant(kernel, pointers, constexprs, **options)
            print(f"ok   {label}", flush=True)
        except Exception as e:  # noqa: BLE001 - every variant is tried, each failure printed
            failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
