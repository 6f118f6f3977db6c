/* Shared by the CPU's C kernels (kernels/cpu_build.py builds them): bf16 <-> fp32 as PyTorch
 * converts, and an exp the compiler can vectorize. */
#ifndef NANOSERVE_CPU_COMMON_H
#define NANOSERVE_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#else /* built without OpenMP (a torch without libgomp): the pragmas are ignored, one thread */
static inline int omp_get_max_threads(void) { return 1; }
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

/* How a kernel reads, writes and rounds its element type T as fp32: fp32 itself is used as is;
 * bf16 converts, and rounding an fp32 value to bf16 and back mimics PyTorch computing in bf16. */
#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
#define ROUND_F32(x) (x)
#define ROUND_BF16(x) bf16_to_f32(f32_to_bf16(x))

/* e^x to within 1 ulp (measured: 0.7), branch-free so that loops of it vectorize (libm's expf is a call per
 * element): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes' expf
 * coefficients), times 2^n built in the exponent bits. Below -87.34 the result is 0 (fp32's
 * smallest normal is e^-87.34); above 88.37 (127.5 ln2), +inf, where the true e^x overflows
 * only at 88.72: the kernels' uses (softmax of x <= 0, SiLU's e^-x) never need that band.
 * NaN gives NaN. */
static inline float fast_expf(float x) {
    const float hi = 88.3762626647949f, lo = -87.3365479f;
    float c = x > hi ? hi : x;
    c = c < lo ? lo : c;
    /* round to nearest: adding 1.5 * 2^23 leaves no fraction bits (the default rounding mode) */
    const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = c - n * 0.693359375f; /* ln2 in two parts (Cody-Waite): exact first product */
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = (int32_t)n + 127;
    uint32_t bits = (uint32_t)(e < 1 ? 1 : e) << 23; /* n >= -126 after the clamp but for the edge */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = p * scale;
    y = x > hi ? INFINITY : y;
    y = x < lo ? 0.0f : y;
    return x != x ? x : y;
}

#endif
