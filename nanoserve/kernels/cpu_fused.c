/* The decoder layer's elementwise ops for the CPU, one call each (ours; issue 23). Built and
 * loaded by kernels/cpu_fused.py; the semantics are kernels/fused.py's PyTorch references, and
 * the numbers round where PyTorch's ops round (to the model's dtype: a no-op in fp32):
 *
 *   rms_norm      h = residual + x (rounded; or x alone)     y = w * round(h / rms(h))   rounded
 *   rope          rotate-half RoPE of q and k in fp32, rounded, into contiguous outputs (or, as
 *                 rope_store, k and v into their KV cache slots)
 *   silu_mul      round(silu(gate)) * up, rounded; gate and up the two halves of a row
 *
 * Sums and products are fp32. Rows run in parallel on PyTorch's OpenMP runtime only when the
 * input is large (a prefill chunk); at a decode step's few rows one thread is faster than
 * waking the pool. */
#include "cpu_common.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_ELEMENTS 65536 /* below this many elements, one thread */

/* `residual` may be NULL (then `summed` is unused). Strides are in elements, per row. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                                \
    int NAME(T *out, T *summed, const T *x, const T *residual, const T *weight, int64_t rows,      \
             int64_t cols, int64_t sx, int64_t sr, int64_t so, int64_t ss, float eps) {            \
        _Pragma("omp parallel for if (rows * cols >= PARALLEL_ELEMENTS)")                           \
        for (int64_t i = 0; i < rows; i++) {                                                       \
            const T *xi = x + i * sx;                                                              \
            T *oi = out + i * so;                                                                  \
            float squares = 0.0f;                                                                  \
            if (residual != NULL) {                                                                \
                const T *ri = residual + i * sr;                                                   \
                T *hi = summed + i * ss;                                                           \
                for (int64_t j = 0; j < cols; j++) hi[j] = STORE(LOAD(ri[j]) + LOAD(xi[j]));       \
                xi = hi;                                                                           \
            }                                                                                      \
            _Pragma("omp simd reduction(+:squares)")                                               \
            for (int64_t j = 0; j < cols; j++) squares += LOAD(xi[j]) * LOAD(xi[j]);               \
            const float inv = 1.0f / sqrtf(squares / (float)cols + eps);                           \
            for (int64_t j = 0; j < cols; j++)                                                     \
                oi[j] = STORE(LOAD(weight[j]) * ROUND(LOAD(xi[j]) * inv));                         \
        }                                                                                          \
        return 0;                                                                                  \
    }

/* q [tokens, q_heads, 2*half] and k [tokens, k_heads, 2*half] (any token and head strides);
 * cos, sin fp32 [tokens, half] (row stride s_cs); outputs contiguous. With `slots` (rope_store),
 * k_out and v_cache are the K and V caches (strides sc_*, `block_size` slots a block): token t's
 * rotated k heads go to slot slots[t], its v heads (strides sv_*) beside them, none for a
 * negative slot. */
#define DEFINE_ROPE(NAME, T, LOAD, STORE)                                                           \
    int NAME(T *q_out, T *k_out, const T *q, const T *k, const float *cos_, const float *sin_,     \
             int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t half, int64_t sq_tok,        \
             int64_t sq_head, int64_t sk_tok, int64_t sk_head, int64_t s_cs, const int64_t *slots,  \
             const T *v, T *v_cache, int64_t sv_tok, int64_t sv_head, int64_t block_size,           \
             int64_t sc_block, int64_t sc_slot, int64_t sc_head) {                                  \
        const int64_t heads = q_heads + k_heads;                                                   \
        _Pragma("omp parallel for if (tokens * heads * half >= PARALLEL_ELEMENTS)")                 \
        for (int64_t t = 0; t < tokens; t++) {                                                     \
            const float *c = cos_ + t * s_cs, *s = sin_ + t * s_cs;                                \
            const int64_t slot = slots != NULL ? slots[t] : 0;                                     \
            const int64_t at = slots != NULL ? (slot / block_size) * sc_block + (slot % block_size) * sc_slot : 0; \
            for (int64_t h = 0; h < heads; h++) {                                                  \
                const T *src = h < q_heads ? q + t * sq_tok + h * sq_head                          \
                                           : k + t * sk_tok + (h - q_heads) * sk_head;             \
                T *dst;                                                                            \
                if (h < q_heads) {                                                                 \
                    dst = q_out + (t * q_heads + h) * 2 * half;                                    \
                } else if (slots == NULL) {                                                        \
                    dst = k_out + (t * k_heads + h - q_heads) * 2 * half;                          \
                } else if (slot < 0) {                                                             \
                    continue;                                                                      \
                } else {                                                                           \
                    dst = k_out + at + (h - q_heads) * sc_head;                                    \
                    memcpy(v_cache + at + (h - q_heads) * sc_head,                                 \
                           v + t * sv_tok + (h - q_heads) * sv_head, 2 * half * sizeof(T));        \
                }                                                                                  \
                for (int64_t j = 0; j < half; j++) {                                               \
                    const float a = LOAD(src[j]), b = LOAD(src[half + j]);                         \
                    dst[j] = STORE(a * c[j] - b * s[j]);                                           \
                    dst[half + j] = STORE(b * c[j] + a * s[j]);                                    \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        return 0;                                                                                  \
    }

#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                                \
    int NAME(T *out, const T *gate_up, int64_t rows, int64_t cols, int64_t s_in, int64_t s_out) {  \
        _Pragma("omp parallel for if (rows * cols >= PARALLEL_ELEMENTS)")                           \
        for (int64_t i = 0; i < rows; i++) {                                                       \
            const T *g = gate_up + i * s_in, *u = g + cols;                                        \
            T *o = out + i * s_out;                                                                \
            for (int64_t j = 0; j < cols; j++) {                                                   \
                const float x = LOAD(g[j]);                                                        \
                o[j] = STORE(ROUND(x / (1.0f + fast_expf(-x))) * LOAD(u[j]));                           \
            }                                                                                      \
        }                                                                                          \
        return 0;                                                                                  \
    }

DEFINE_RMS_NORM(rms_norm_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)
DEFINE_ROPE(rope_f32, float, LOAD_F32, STORE_F32)
DEFINE_ROPE(rope_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)
