/* Paged decode attention for the CPU: one new token per sequence, K/V read where they lie in
 * the paged cache (ours; issue 23). Built and loaded by kernels/cpu_decode_attention.py, which
 * documents the layout and why; kernels/reference.py is the semantics it must equal.
 *
 *   for each (decode row r, KV head h), in parallel (OpenMP, the same libgomp as PyTorch's):
 *       s[g, p] = scale * q[row_r, h*G + g] . K[p, h]        p < seq_len, g < G = H / Hkv
 *       out[row_r, h*G + g] = sum_p softmax_p(s[g, :]) V[p, h]
 *   K[p] lives in block table[p / B] at slot p % B (B - 1 - p % B for a right-to-left sequence).
 *
 * Scores, softmax and sums are fp32 whatever the cache holds (fp32 or bf16); a bf16 output is
 * rounded to nearest even, as PyTorch rounds. Two passes over the context: scores (K read once),
 * then the weighted sum of V (V read once).
 *
 * With `start` > 0 only positions [start, seq_len) are attended (the rest, a prefix several rows
 * share, is attended once for all of them elsewhere: cascade attention), and with `lse` set each
 * (row, query head)'s log-sum-exp of its scores is written there, so the two parts can be merged.
 */
#include "cpu_common.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline void prefetch(const void *start, size_t bytes) {
    for (size_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch((const char *)start + offset);
}

/* The element offset of position p's cache row (every KV head's K, or V: `row` elements of
 * `elem` bytes) in `cache`: block table[p / B], slot p % B, or B - 1 - p % B for a right-to-left
 * sequence. At a block's first position the next block is prefetched: a jump the hardware
 * prefetcher misses. */
static inline int64_t token_row(const void *cache, const int32_t *table, int64_t p, int64_t len, int64_t B,
                                int flip, int64_t row, size_t elem) {
    if (p % B == 0 && p + B < len)
        prefetch((const char *)cache + (size_t)table[p / B + 1] * B * row * elem, B * row * elem);
    const int64_t slot = flip ? B - 1 - p % B : p % B;
    return ((int64_t)table[p / B] * B + slot) * row;
}

typedef struct {
    int64_t num_rows;        /* decode rows to compute */
    const int32_t *rows;     /* [num_rows] each one's row in q and out */
    const int32_t *seqs;     /* [num_rows] each one's sequence (block table row, seq_lens entry) */
    const int32_t *seq_lens; /* [num_seqs] context length, this token included */
    const int32_t *tables;   /* [num_seqs, table_stride] block ids */
    int64_t table_stride;
    const uint8_t *right_to_left; /* [num_seqs] or NULL */
    int64_t q_stride_tok, q_stride_head, out_stride_tok, out_stride_head; /* in elements */
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int64_t start; /* the first position attended (0: all of them) */
    float *lse;    /* [num_rows, num_heads] log-sum-exp of each row's scores, or NULL */
} decode_args;

/* A task is a decode row and a range of its KV heads: all of them when there are at least as
 * many rows as threads (a task then reads each cached token's K and V rows whole: every head's,
 * contiguous), else one head each (a batch of one still uses every thread). `k` and `v` point
 * at the cache's element 0; a token's K for head h is k[((block * B + slot) * Hkv + h) * D ...]. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                            \
    int NAME(const decode_args *a, const T *q, const T *k, const T *v, T *out) {                     \
        const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_dim, B = a->block_size;        \
        const int64_t Hkv = a->num_kv_heads;                                                         \
        const int64_t split = a->num_rows >= omp_get_max_threads() ? 1 : Hkv;                        \
        const int64_t tasks = a->num_rows * split, per_task = Hkv / split;                           \
        int failed = 0;                                                                              \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                             \
        for (int64_t task = 0; task < tasks; task++) {                                               \
            const int64_t r = task / split, h0 = (task % split) * per_task, h1 = h0 + per_task;      \
            const int64_t seq = a->seqs[r], first = a->start, heads = (h1 - h0) * G;                \
            const int64_t len = a->seq_lens[seq] - first; /* attended positions: first + [0, len) */ \
            const int32_t *table = a->tables + seq * a->table_stride;                                \
            const int flip = a->right_to_left != NULL && a->right_to_left[seq];                      \
            float *scores = malloc(sizeof(float) * (size_t)(heads * len + 2 * heads * D + D));       \
            if (scores == NULL) { failed = 1; continue; }                                            \
            float *qf = scores + heads * len, *acc = qf + heads * D, *row = acc + heads * D;         \
            for (int64_t j = 0; j < heads; j++) {                                                    \
                const T *qrow = q + a->rows[r] * a->q_stride_tok + (h0 * G + j) * a->q_stride_head;  \
                for (int64_t d = 0; d < D; d++) qf[j * D + d] = LOAD(qrow[d]) * a->scale;           \
                for (int64_t d = 0; d < D; d++) acc[j * D + d] = 0.0f;                               \
            }                                                                                        \
            for (int64_t p = 0; p < len; p++) {                                                      \
                const T *kp = k + token_row(k, table, first + p, first + len, B, flip, Hkv * D, sizeof(T)); \
                for (int64_t h = h0; h < h1; h++) { /* one K row, converted once, for G heads */     \
                    for (int64_t d = 0; d < D; d++) row[d] = LOAD(kp[h * D + d]);                    \
                    for (int64_t g = 0; g < G; g++) {                                                \
                        const int64_t j = (h - h0) * G + g;                                          \
                        const float *qj = qf + j * D;                                                \
                        float dot = 0.0f;                                                            \
                        _Pragma("omp simd reduction(+:dot)")                                         \
                        for (int64_t d = 0; d < D; d++) dot += qj[d] * row[d];                       \
                        scores[j * len + p] = dot;                                                   \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            for (int64_t j = 0; j < heads; j++) {                                                    \
                float *sj = scores + j * len, top = -INFINITY, total = 0.0f;                         \
                for (int64_t p = 0; p < len; p++) top = sj[p] > top ? sj[p] : top;                   \
                for (int64_t p = 0; p < len; p++) { sj[p] = fast_expf(sj[p] - top); total += sj[p]; }     \
                const float inv = 1.0f / total;                                                      \
                for (int64_t p = 0; p < len; p++) sj[p] *= inv;                                      \
                if (a->lse != NULL) a->lse[r * a->num_heads + h0 * G + j] = top + logf(total);       \
            }                                                                                        \
            for (int64_t p = 0; p < len; p++) {                                                      \
                const T *vp = v + token_row(v, table, first + p, first + len, B, flip, Hkv * D, sizeof(T)); \
                for (int64_t h = h0; h < h1; h++) { /* one V row, converted once, for G heads */     \
                    for (int64_t d = 0; d < D; d++) row[d] = LOAD(vp[h * D + d]);                    \
                    for (int64_t g = 0; g < G; g++) {                                                \
                        const int64_t j = (h - h0) * G + g;                                          \
                        const float w = scores[j * len + p];                                         \
                        float *aj = acc + j * D;                                                     \
                        _Pragma("omp simd")                                                          \
                        for (int64_t d = 0; d < D; d++) aj[d] += w * row[d];                         \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            for (int64_t j = 0; j < heads; j++) {                                                    \
                T *orow = out + a->rows[r] * a->out_stride_tok + (h0 * G + j) * a->out_stride_head;  \
                for (int64_t d = 0; d < D; d++) orow[d] = STORE(acc[j * D + d]);                     \
            }                                                                                        \
            free(scores);                                                                            \
        }                                                                                            \
        return failed;                                                                               \
    }

DEFINE_DECODE(decode_attention_f32, float, LOAD_F32, STORE_F32)
DEFINE_DECODE(decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
