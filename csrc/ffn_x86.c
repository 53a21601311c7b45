/*
 * ffn_x86.c: the AVX2 (with FMA and F16C) and AVX-512 (F, BW, VL) paths.
 *
 * Every function carries its own target attribute, so the file builds with
 * the package's ordinary flags and nothing here runs unless ffn.c's CPUID
 * check chose the path.
 */
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "ffn_internal.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

enum { ROWS = COLI_FFN_DOT_ROWS, LANES = COLI_FFN_DOT_LANES };

/* ------------------------------------------------------------ AVX-512 micro-kernels */

/* DOT: TB tokens at a time, four rows: 4 x TB accumulators of 16 lanes. */
#define DOT512_BLOCK(TB)                                                                  \
    AVX512 static void dot512_##TB(const float *tile, int ld, int kcp, const float *x,      \
                                   int64_t ldx, float *acc) {                             \
        __m512 a[TB][ROWS];                                                               \
        for (int t = 0; t < TB; t++)                                                      \
            for (int r = 0; r < ROWS; r++) a[t][r] = _mm512_loadu_ps(acc + (t * ROWS + r) * LANES); \
        for (int p = 0; p < kcp; p += 16) {                                               \
            __m512 w0 = _mm512_loadu_ps(tile + p), w1 = _mm512_loadu_ps(tile + ld + p);   \
            __m512 w2 = _mm512_loadu_ps(tile + 2 * ld + p);                               \
            __m512 w3 = _mm512_loadu_ps(tile + 3 * ld + p);                               \
            for (int t = 0; t < TB; t++) {                                                \
                __m512 xv = _mm512_loadu_ps(x + t * ldx + p);                             \
                a[t][0] = _mm512_fmadd_ps(w0, xv, a[t][0]);                               \
                a[t][1] = _mm512_fmadd_ps(w1, xv, a[t][1]);                               \
                a[t][2] = _mm512_fmadd_ps(w2, xv, a[t][2]);                               \
                a[t][3] = _mm512_fmadd_ps(w3, xv, a[t][3]);                               \
            }                                                                             \
        }                                                                                 \
        for (int t = 0; t < TB; t++)                                                      \
            for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(acc + (t * ROWS + r) * LANES, a[t][r]); \
    }
DOT512_BLOCK(1)
DOT512_BLOCK(2)
DOT512_BLOCK(3)
DOT512_BLOCK(4)

AVX512 static void dot512(const float *tile, int ld, int kcp, const float *x, int64_t ldx,
                          int tokens, float *acc) {
    int t = 0;
    for (; t + 4 <= tokens; t += 4) dot512_4(tile, ld, kcp, x + t * ldx, ldx, acc + t * ROWS * LANES);
    switch (tokens - t) {
    case 3: dot512_3(tile, ld, kcp, x + t * ldx, ldx, acc + t * ROWS * LANES); break;
    case 2: dot512_2(tile, ld, kcp, x + t * ldx, ldx, acc + t * ROWS * LANES); break;
    case 1: dot512_1(tile, ld, kcp, x + t * ldx, ldx, acc + t * ROWS * LANES); break;
    default: break;
    }
}

/* AXPY: 64 outputs (four vectors) x TB tokens per pass. */
#define AXPY512_BLOCK(TB)                                                                 \
    AVX512 static void axpy512_##TB(const float *tile, int ld, int kc, const float *x,      \
                                    int64_t ldx, float *acc, int panel) {                 \
        __m512 a[TB][4];                                                                  \
        for (int t = 0; t < TB; t++)                                                      \
            for (int v = 0; v < 4; v++) a[t][v] = _mm512_loadu_ps(acc + t * panel + 16 * v); \
        for (int j = 0; j < kc; j++) {                                                    \
            const float *w = tile + (int64_t)j * ld;                                      \
            __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);                 \
            __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);            \
            for (int t = 0; t < TB; t++) {                                                \
                __m512 xv = _mm512_set1_ps(x[t * ldx + j]);                               \
                a[t][0] = _mm512_fmadd_ps(w0, xv, a[t][0]);                               \
                a[t][1] = _mm512_fmadd_ps(w1, xv, a[t][1]);                               \
                a[t][2] = _mm512_fmadd_ps(w2, xv, a[t][2]);                               \
                a[t][3] = _mm512_fmadd_ps(w3, xv, a[t][3]);                               \
            }                                                                             \
        }                                                                                 \
        for (int t = 0; t < TB; t++)                                                      \
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc + t * panel + 16 * v, a[t][v]); \
    }
AXPY512_BLOCK(1)
AXPY512_BLOCK(2)
AXPY512_BLOCK(3)
AXPY512_BLOCK(4)

AVX512 static void axpy512(const float *tile, int ld, int kc, int panel, const float *x,
                           int64_t ldx, int tokens, float *acc) {
    for (int c = 0; c < panel; c += 64) {
        int t = 0;
        for (; t + 4 <= tokens; t += 4)
            axpy512_4(tile + c, ld, kc, x + t * ldx, ldx, acc + t * panel + c, panel);
        switch (tokens - t) {
        case 3: axpy512_3(tile + c, ld, kc, x + t * ldx, ldx, acc + t * panel + c, panel); break;
        case 2: axpy512_2(tile + c, ld, kc, x + t * ldx, ldx, acc + t * panel + c, panel); break;
        case 1: axpy512_1(tile + c, ld, kc, x + t * ldx, ldx, acc + t * panel + c, panel); break;
        default: break;
        }
    }
}

/* exp(v) for the activations: 2^n * p(r), r = v - n ln 2 in two parts,
 * p of degree 6 (relative error about 2e-7); scalef rounds to 0 and inf
 * outside float's range. */
AVX512 static __m512 exp512(__m512 v) {
    /* Clamped (NaN kept: the second operand wins) so that n stays where
     * scalef still gives 0 and inf, and r stays small. */
    v = _mm512_min_ps(_mm512_set1_ps(100.0f), _mm512_max_ps(_mm512_set1_ps(-110.0f), v));
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

AVX512 static void act512(int activation, float alpha, float limit, const float *g, const float *u,
                          float *h, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 lim = _mm512_set1_ps(limit), nlim = _mm512_set1_ps(-limit);
    const __m512 nalpha = _mm512_set1_ps(-alpha);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i), hv;
        if (activation == COLI_FFN_ACT_SILU) {
            __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            hv = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv);
        } else {
            /* min/max with the operand order that keeps NaN (the second operand wins). */
            gv = _mm512_min_ps(lim, gv);
            uv = _mm512_max_ps(nlim, _mm512_min_ps(lim, uv));
            __m512 e = exp512(_mm512_mul_ps(nalpha, gv));
            hv = _mm512_mul_ps(_mm512_add_ps(uv, one), _mm512_div_ps(gv, _mm512_add_ps(one, e)));
        }
        _mm512_mask_storeu_ps(h + i, m, hv);
    }
}

const ColiFfnIsaOps coli_ffn_ops_avx512 = {dot512, axpy512, act512};

/* ------------------------------------------------------------ AVX2 micro-kernels */

/* DOT: four rows x TB tokens of 8-lane accumulators (lanes 8..15 of each
 * (token, row) stay as they were). */
#define DOT256_BLOCK(TB)                                                                  \
    AVX2 static void dot256_##TB(const float *tile, int ld, int kcp, const float *x,        \
                                 int64_t ldx, float *acc) {                               \
        __m256 a[TB][ROWS];                                                               \
        for (int t = 0; t < TB; t++)                                                      \
            for (int r = 0; r < ROWS; r++) a[t][r] = _mm256_loadu_ps(acc + (t * ROWS + r) * LANES); \
        for (int p = 0; p < kcp; p += 8) {                                                \
            __m256 w0 = _mm256_loadu_ps(tile + p), w1 = _mm256_loadu_ps(tile + ld + p);   \
            __m256 w2 = _mm256_loadu_ps(tile + 2 * ld + p);                               \
            __m256 w3 = _mm256_loadu_ps(tile + 3 * ld + p);                               \
            for (int t = 0; t < TB; t++) {                                                \
                __m256 xv = _mm256_loadu_ps(x + t * ldx + p);                             \
                a[t][0] = _mm256_fmadd_ps(w0, xv, a[t][0]);                               \
                a[t][1] = _mm256_fmadd_ps(w1, xv, a[t][1]);                               \
                a[t][2] = _mm256_fmadd_ps(w2, xv, a[t][2]);                               \
                a[t][3] = _mm256_fmadd_ps(w3, xv, a[t][3]);                               \
            }                                                                             \
        }                                                                                 \
        for (int t = 0; t < TB; t++)                                                      \
            for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(acc + (t * ROWS + r) * LANES, a[t][r]); \
    }
DOT256_BLOCK(1)
DOT256_BLOCK(2)

AVX2 static void dot256(const float *tile, int ld, int kcp, const float *x, int64_t ldx,
                        int tokens, float *acc) {
    int t = 0;
    for (; t + 2 <= tokens; t += 2) dot256_2(tile, ld, kcp, x + t * ldx, ldx, acc + t * ROWS * LANES);
    if (t < tokens) dot256_1(tile, ld, kcp, x + t * ldx, ldx, acc + t * ROWS * LANES);
}

/* AXPY: 32 outputs (four vectors) x TB tokens per pass. */
#define AXPY256_BLOCK(TB)                                                                 \
    AVX2 static void axpy256_##TB(const float *tile, int ld, int kc, const float *x,        \
                                  int64_t ldx, float *acc, int panel) {                   \
        __m256 a[TB][4];                                                                  \
        for (int t = 0; t < TB; t++)                                                      \
            for (int v = 0; v < 4; v++) a[t][v] = _mm256_loadu_ps(acc + t * panel + 8 * v); \
        for (int j = 0; j < kc; j++) {                                                    \
            const float *w = tile + (int64_t)j * ld;                                      \
            __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);                  \
            __m256 w2 = _mm256_loadu_ps(w + 16), w3 = _mm256_loadu_ps(w + 24);            \
            for (int t = 0; t < TB; t++) {                                                \
                __m256 xv = _mm256_broadcast_ss(x + t * ldx + j);                         \
                a[t][0] = _mm256_fmadd_ps(w0, xv, a[t][0]);                               \
                a[t][1] = _mm256_fmadd_ps(w1, xv, a[t][1]);                               \
                a[t][2] = _mm256_fmadd_ps(w2, xv, a[t][2]);                               \
                a[t][3] = _mm256_fmadd_ps(w3, xv, a[t][3]);                               \
            }                                                                             \
        }                                                                                 \
        for (int t = 0; t < TB; t++)                                                      \
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(acc + t * panel + 8 * v, a[t][v]); \
    }
AXPY256_BLOCK(1)
AXPY256_BLOCK(2)

AVX2 static void axpy256(const float *tile, int ld, int kc, int panel, const float *x,
                         int64_t ldx, int tokens, float *acc) {
    for (int c = 0; c < panel; c += 32) {
        int t = 0;
        for (; t + 2 <= tokens; t += 2)
            axpy256_2(tile + c, ld, kc, x + t * ldx, ldx, acc + t * panel + c, panel);
        if (t < tokens) axpy256_1(tile + c, ld, kc, x + t * ldx, ldx, acc + t * panel + c, panel);
    }
}

/* exp as exp512, with the power of two built from the exponent bits;
 * inputs are clamped to where that is exact, which gives 0 and inf (and
 * keeps NaN) at the ends. */
AVX2 static __m256 exp256(__m256 v) {
    const __m256 hi = _mm256_set1_ps(88.7228f), lo = _mm256_set1_ps(-87.3365f);
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    __m256 over = _mm256_cmp_ps(v, hi, _CMP_GT_OQ), under = _mm256_cmp_ps(v, lo, _CMP_LT_OQ);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n as two factors, so n = 128 (v near 88.7) stays finite. */
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i half = _mm256_srai_epi32(ni, 1);
    __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    __m256 f2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    p = _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
    p = _mm256_blendv_ps(p, _mm256_set1_ps(INFINITY), over);
    p = _mm256_blendv_ps(p, _mm256_setzero_ps(), under);
    return _mm256_blendv_ps(p, v, nan);
}

AVX2 static void act256(int activation, float alpha, float limit, const float *g, const float *u,
                        float *h, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit);
    const __m256 nalpha = _mm256_set1_ps(-alpha);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i), hv;
        if (activation == COLI_FFN_ACT_SILU) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            hv = _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv);
        } else {
            gv = _mm256_min_ps(lim, gv);
            uv = _mm256_max_ps(nlim, _mm256_min_ps(lim, uv));
            __m256 e = exp256(_mm256_mul_ps(nalpha, gv));
            hv = _mm256_mul_ps(_mm256_add_ps(uv, one), _mm256_div_ps(gv, _mm256_add_ps(one, e)));
        }
        _mm256_storeu_ps(h + i, hv);
    }
    if (i < n) coli_ffn_ops_scalar.act(activation, alpha, limit, g + i, u + i, h + i, n - i);
}

const ColiFfnIsaOps coli_ffn_ops_avx2 = {dot256, axpy256, act256};

/* ------------------------------------------------------------ kernel tables */

const ColiFfnKernel *coli_ffn_kernel_avx512(ColiTensorFormat format, int in_out) {
    (void)format;
    (void)in_out;
    return NULL;
}

const ColiFfnKernel *coli_ffn_kernel_avx2(ColiTensorFormat format, int in_out) {
    (void)format;
    (void)in_out;
    return NULL;
}

#endif /* x86 */
