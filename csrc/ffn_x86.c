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
#include <pthread.h>
#include <string.h>

#include "ffn_internal.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
/* Helpers are inlined into their (same-target) callers: a call would pass
 * vectors through memory. */
#define INLINE static inline __attribute__((always_inline))
/* The small constant loops over rows, tokens and vectors must become
 * straight code, so that their vectors stay in registers. */
#define UNROLL _Pragma("GCC unroll 8")

enum { ROWS = COLI_FFN_DOT_ROWS, LANES = COLI_FFN_DOT_LANES };

/* ------------------------------------------------------------ AVX-512 micro-kernels */

/* DOT: TB tokens at a time, four rows: 4 x TB accumulators of 16 lanes. */
#define DOT512_BLOCK(TB)                                                                  \
    AVX512 static void dot512_##TB(const float *tile, int ld, int kcp, const float *x,      \
                                   int64_t ldx, float *acc) {                             \
        __m512 a[TB][ROWS];                                                               \
        UNROLL for (int t = 0; t < TB; t++)                                                      \
            UNROLL for (int r = 0; r < ROWS; r++) a[t][r] = _mm512_loadu_ps(acc + (t * ROWS + r) * LANES); \
        for (int p = 0; p < kcp; p += 16) {                                               \
            __m512 w0 = _mm512_loadu_ps(tile + p), w1 = _mm512_loadu_ps(tile + ld + p);   \
            __m512 w2 = _mm512_loadu_ps(tile + 2 * ld + p);                               \
            __m512 w3 = _mm512_loadu_ps(tile + 3 * ld + p);                               \
            UNROLL for (int t = 0; t < TB; t++) {                                                \
                __m512 xv = _mm512_loadu_ps(x + t * ldx + p);                             \
                a[t][0] = _mm512_fmadd_ps(w0, xv, a[t][0]);                               \
                a[t][1] = _mm512_fmadd_ps(w1, xv, a[t][1]);                               \
                a[t][2] = _mm512_fmadd_ps(w2, xv, a[t][2]);                               \
                a[t][3] = _mm512_fmadd_ps(w3, xv, a[t][3]);                               \
            }                                                                             \
        }                                                                                 \
        UNROLL for (int t = 0; t < TB; t++)                                                      \
            UNROLL for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(acc + (t * ROWS + r) * LANES, a[t][r]); \
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
        UNROLL for (int t = 0; t < TB; t++)                                                      \
            UNROLL for (int v = 0; v < 4; v++) a[t][v] = _mm512_loadu_ps(acc + t * panel + 16 * v); \
        for (int j = 0; j < kc; j++) {                                                    \
            const float *w = tile + (int64_t)j * ld;                                      \
            __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);                 \
            __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);            \
            UNROLL for (int t = 0; t < TB; t++) {                                                \
                __m512 xv = _mm512_set1_ps(x[t * ldx + j]);                               \
                a[t][0] = _mm512_fmadd_ps(w0, xv, a[t][0]);                               \
                a[t][1] = _mm512_fmadd_ps(w1, xv, a[t][1]);                               \
                a[t][2] = _mm512_fmadd_ps(w2, xv, a[t][2]);                               \
                a[t][3] = _mm512_fmadd_ps(w3, xv, a[t][3]);                               \
            }                                                                             \
        }                                                                                 \
        UNROLL for (int t = 0; t < TB; t++)                                                      \
            UNROLL for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc + t * panel + 16 * v, a[t][v]); \
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
AVX512 INLINE __m512 exp512(__m512 v) {
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
        UNROLL for (int t = 0; t < TB; t++)                                                      \
            UNROLL for (int r = 0; r < ROWS; r++) a[t][r] = _mm256_loadu_ps(acc + (t * ROWS + r) * LANES); \
        for (int p = 0; p < kcp; p += 8) {                                                \
            __m256 w0 = _mm256_loadu_ps(tile + p), w1 = _mm256_loadu_ps(tile + ld + p);   \
            __m256 w2 = _mm256_loadu_ps(tile + 2 * ld + p);                               \
            __m256 w3 = _mm256_loadu_ps(tile + 3 * ld + p);                               \
            UNROLL for (int t = 0; t < TB; t++) {                                                \
                __m256 xv = _mm256_loadu_ps(x + t * ldx + p);                             \
                a[t][0] = _mm256_fmadd_ps(w0, xv, a[t][0]);                               \
                a[t][1] = _mm256_fmadd_ps(w1, xv, a[t][1]);                               \
                a[t][2] = _mm256_fmadd_ps(w2, xv, a[t][2]);                               \
                a[t][3] = _mm256_fmadd_ps(w3, xv, a[t][3]);                               \
            }                                                                             \
        }                                                                                 \
        UNROLL for (int t = 0; t < TB; t++)                                                      \
            UNROLL for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(acc + (t * ROWS + r) * LANES, a[t][r]); \
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
        UNROLL for (int t = 0; t < TB; t++)                                                      \
            UNROLL for (int v = 0; v < 4; v++) a[t][v] = _mm256_loadu_ps(acc + t * panel + 8 * v); \
        for (int j = 0; j < kc; j++) {                                                    \
            const float *w = tile + (int64_t)j * ld;                                      \
            __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);                  \
            __m256 w2 = _mm256_loadu_ps(w + 16), w3 = _mm256_loadu_ps(w + 24);            \
            UNROLL for (int t = 0; t < TB; t++) {                                                \
                __m256 xv = _mm256_broadcast_ss(x + t * ldx + j);                         \
                a[t][0] = _mm256_fmadd_ps(w0, xv, a[t][0]);                               \
                a[t][1] = _mm256_fmadd_ps(w1, xv, a[t][1]);                               \
                a[t][2] = _mm256_fmadd_ps(w2, xv, a[t][2]);                               \
                a[t][3] = _mm256_fmadd_ps(w3, xv, a[t][3]);                               \
            }                                                                             \
        }                                                                                 \
        UNROLL for (int t = 0; t < TB; t++)                                                      \
            UNROLL for (int v = 0; v < 4; v++) _mm256_storeu_ps(acc + t * panel + 8 * v, a[t][v]); \
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
AVX2 INLINE __m256 exp256(__m256 v) {
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

/* ------------------------------------------------------------ decoders, shared */

/* Element order inside each block of 32 inputs for kernels that decode a
 * byte's two nibbles into two vectors: the low nibbles (even inputs)
 * first, then the high ones. EVEN_ODD16 does the same per 16 (AVX2). */
static const uint8_t EVEN_ODD32[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
static const uint8_t EVEN_ODD16[32] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                       16, 24, 17, 25, 18, 26, 19, 27, 20, 28, 21, 29, 22, 30, 23, 31};

/* AWQ's packing: output c of a panel of 8 * L words (L lanes) sits at
 * L * nibble + word, nibble holding column AWQ_ORDER[nibble] of its eight. */
static const int AWQ_NIBBLE[8] = {0, 4, 1, 5, 2, 6, 3, 7};
static uint8_t AWQ_POS128[128], AWQ_POS64[64];
static void awq_positions(void) {
    for (int c = 0; c < 128; c++) AWQ_POS128[c] = (uint8_t)(16 * AWQ_NIBBLE[c % 8] + c / 8);
    for (int c = 0; c < 64; c++) AWQ_POS64[c] = (uint8_t)(8 * AWQ_NIBBLE[c % 8] + c / 8);
}

/* DOT kernels work on whole blocks of 32 inputs inside one scale group;
 * what is left at the end of a row goes through the scalar decoder. */
static void dot_tail(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t o, int64_t k0, int done,
                     int kc, float *row) {
    if (done < kc) coli_ffn_decode_scalar(m, k, o, 1, k0 + done, kc - done, row + done, NULL);
}

/* ------------------------------------------------------------ AVX-512 decoders */

/* int4 (compressed-tensors) and MXFP4: a row's 16 bytes hold 32 inputs;
 * each nibble indexes a 16-entry table of its group's values, built once
 * per group: (q - zero) * scale, or e2m1 * 2^(e - 127). */
AVX512 INLINE __m512 nibble_table512(const ColiFfnMat *m, int64_t o, int64_t g) {
    static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    if (m->format == COLI_TENSOR_FP4_NATIVE_BLOCK)
        return _mm512_scalef_ps(_mm512_loadu_ps(E2M1),
                                _mm512_set1_ps((float)m->scales[o * m->groups + g] - 127.0f));
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps((float)coli_ffn_zero_at(m, o, g))),
                         _mm512_set1_ps(coli_ffn_scale_at(m, o * m->groups + g)));
}

AVX512 static void dot_nibbles512(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                                  int64_t k0, int kc, float *tile, const float *aux) {
    (void)aux;
    int full = m->group % COLI_FFN_KBLOCK == 0 ? kc & ~(COLI_FFN_KBLOCK - 1) : 0;
    int64_t g0 = k0 / m->group;
    int first_end = (int)((g0 + 1) * m->group - k0);
    for (int r = 0; r < nr; r++) {
        int64_t o = n0 + r;
        const uint8_t *src = m->data + o * (m->n_in / 2) + k0 / 2;
        float *row = tile + (int64_t)r * k->kc;
        int64_t g = g0;
        for (int j = 0, end = first_end; j < full; g++, end += (int)m->group) {
            __m512 table = nibble_table512(m, o, g);
            for (int stop = end < full ? end : full; j < stop; j += 32) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + j / 2)));
                _mm512_storeu_ps(row + j, _mm512_permutexvar_ps(v, table));
                _mm512_storeu_ps(row + j + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table));
            }
        }
        dot_tail(m, k, o, k0, full, kc, row);
    }
}

/* The same applied in registers to TB tokens, four rows at once. */
#define FUSED_NIBBLES512(TB)                                                                \
    AVX512 static void fused_nibbles512_##TB(const ColiFfnMat *m, int64_t n0, int64_t k0, int kc, \
                                             const float *x, int64_t ldx, float *acc) {     \
        __m512 a[TB][ROWS];                                                                 \
        const uint8_t *src[ROWS];                                                           \
        UNROLL for (int r = 0; r < ROWS; r++) src[r] = m->data + (n0 + r) * (m->n_in / 2) + k0 / 2; \
        UNROLL for (int t = 0; t < TB; t++)                                                        \
            UNROLL for (int r = 0; r < ROWS; r++) a[t][r] = _mm512_loadu_ps(acc + (t * ROWS + r) * LANES); \
        int64_t g = k0 / m->group;                                                          \
        for (int j = 0, end = (int)((g + 1) * m->group - k0); j < kc; g++, end += (int)m->group) { \
            __m512 tab[ROWS];                                                               \
            UNROLL for (int r = 0; r < ROWS; r++) tab[r] = nibble_table512(m, n0 + r, g);          \
            for (int stop = end < kc ? end : kc; j < stop; j += 32) {                       \
                UNROLL for (int r = 0; r < ROWS; r++) {                                            \
                    if (j % 128 == 0)                                                       \
                        _mm_prefetch((const char *)src[r] + j / 2 + COLI_FFN_PREFETCH, _MM_HINT_T0); \
                    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src[r] + j / 2))); \
                    __m512 lo = _mm512_permutexvar_ps(v, tab[r]);                           \
                    __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tab[r]);     \
                    UNROLL for (int t = 0; t < TB; t++) {                                          \
                        a[t][r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + t * ldx + j), a[t][r]); \
                        a[t][r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + t * ldx + j + 16), a[t][r]); \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        UNROLL for (int t = 0; t < TB; t++)                                                        \
            UNROLL for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(acc + (t * ROWS + r) * LANES, a[t][r]); \
    }
FUSED_NIBBLES512(1)
FUSED_NIBBLES512(2)
FUSED_NIBBLES512(3)
FUSED_NIBBLES512(4)

AVX512 static int fused_nibbles512(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                                   int64_t k0, int kc, const float *x, int64_t ldx, int tokens,
                                   float *acc, const float *aux) {
    (void)k;
    (void)aux;
    if (nr != ROWS || kc % COLI_FFN_KBLOCK || m->group % COLI_FFN_KBLOCK) return 0;
    switch (tokens) {
    case 1: fused_nibbles512_1(m, n0, k0, kc, x, ldx, acc); break;
    case 2: fused_nibbles512_2(m, n0, k0, kc, x, ldx, acc); break;
    case 3: fused_nibbles512_3(m, n0, k0, kc, x, ldx, acc); break;
    default: fused_nibbles512_4(m, n0, k0, kc, x, ldx, acc); break;
    }
    return 1;
}

/* 16 plain elements (F32, F16, BF16, e4m3, e5m2) at src as floats. */
AVX512 INLINE __m512 plain16_512(ColiTensorFormat f, const uint8_t *src) {
    switch (f) {
    case COLI_TENSOR_F32: return _mm512_loadu_ps(src);
    case COLI_TENSOR_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
    case COLI_TENSOR_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
    case COLI_TENSOR_F8_E5M2:
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src)), 8));
    default: {  /* e4m3: its bits moved into an f16 (exponent bias 15, not 7: times 2^8) */
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
        __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(mag, 7));
        __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
        __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
        return _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(NAN));
    }
    }
}

static int elem_bytes(ColiTensorFormat f) {
    return f == COLI_TENSOR_F32 ? 4 : f == COLI_TENSOR_F16 || f == COLI_TENSOR_BF16 ? 2 : 1;
}

/* The FP8 block scale of stored (row, col), or 1 for unscaled formats. */
static float plain_scale(const ColiFfnMat *m, int64_t row, int64_t col) {
    if (m->format != COLI_TENSOR_FP8_E4M3_BLOCK) return 1.0f;
    int64_t per_row = (m->cols + m->block_columns - 1) / m->block_columns;
    return coli_ffn_scale(m, (row / m->block_rows) * per_row + col / m->block_columns);
}

/* Whole vectors of 16 columns lie in one FP8 scale block only when blocks
 * are a multiple of 16 wide. */
static int plain_vectors_ok(const ColiFfnMat *m, int lanes) {
    return m->format != COLI_TENSOR_FP8_E4M3_BLOCK || m->block_columns % (uint32_t)lanes == 0;
}

AVX512 static void dot_plain512(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                                int64_t k0, int kc, float *tile, const float *aux) {
    (void)aux;
    int eb = elem_bytes(m->format), full = plain_vectors_ok(m, 16) ? kc & ~15 : 0;
    ColiTensorFormat f = m->format == COLI_TENSOR_FP8_E4M3_BLOCK ? COLI_TENSOR_F8_E4M3 : m->format;
    for (int r = 0; r < nr; r++) {
        int64_t o = n0 + r;
        const uint8_t *src = m->data + (o * m->cols + k0) * eb;
        float *row = tile + (int64_t)r * k->kc;
        for (int j = 0; j < full; j += 16)
            _mm512_storeu_ps(row + j, _mm512_mul_ps(plain16_512(f, src + j * eb),
                                                    _mm512_set1_ps(plain_scale(m, o, k0 + j))));
        dot_tail(m, k, o, k0, full, kc, row);
    }
}

AVX512 static void axpy_plain512(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                                 int64_t k0, int kc, float *tile, const float *aux) {
    int panel = k->panel;
    if (nr < panel || !plain_vectors_ok(m, 16)) {
        coli_ffn_decode_scalar(m, k, n0, nr, k0, kc, tile, aux);
        return;
    }
    int eb = elem_bytes(m->format);
    ColiTensorFormat f = m->format == COLI_TENSOR_FP8_E4M3_BLOCK ? COLI_TENSOR_F8_E4M3 : m->format;
    for (int j = 0; j < kc; j++) {
        const uint8_t *src = m->data + ((k0 + j) * m->cols + n0) * eb;
        for (int c = 0; c < panel; c += 16)
            _mm512_storeu_ps(tile + (int64_t)j * panel + c,
                             _mm512_mul_ps(plain16_512(f, src + c * eb),
                                           _mm512_set1_ps(plain_scale(m, k0 + j, n0 + c))));
    }
}

/* Plain and FP8 rows applied in registers to TB tokens, four rows at once,
 * over segments of one FP8 scale block (the whole chunk when unscaled). */
#define FUSED_PLAIN512(TB)                                                                  \
    AVX512 static void fused_plain512_##TB(const ColiFfnMat *m, int64_t n0, int64_t k0, int kc, \
                                           const float *x, int64_t ldx, float *acc) {       \
        int eb = elem_bytes(m->format);                                                     \
        ColiTensorFormat f = m->format == COLI_TENSOR_FP8_E4M3_BLOCK ? COLI_TENSOR_F8_E4M3 : m->format; \
        int64_t seg = m->format == COLI_TENSOR_FP8_E4M3_BLOCK ? (int64_t)m->block_columns     \
                                                               : COLI_FFN_DOT_KC;          \
        __m512 a[TB][ROWS];                                                                 \
        const uint8_t *src[ROWS];                                                           \
        UNROLL for (int r = 0; r < ROWS; r++) src[r] = m->data + ((n0 + r) * m->cols + k0) * eb; \
        UNROLL for (int t = 0; t < TB; t++)                                                 \
            UNROLL for (int r = 0; r < ROWS; r++) a[t][r] = _mm512_loadu_ps(acc + (t * ROWS + r) * LANES); \
        for (int j = 0, end = (int)(seg - k0 % seg); j < kc; end += (int)seg) {             \
            __m512 sc[ROWS];                                                                \
            UNROLL for (int r = 0; r < ROWS; r++) sc[r] = _mm512_set1_ps(plain_scale(m, n0 + r, k0 + j)); \
            for (int stop = end < kc ? end : kc; j < stop; j += 16) {                       \
                UNROLL for (int r = 0; r < ROWS; r++) {                                     \
                    if (j * eb % 64 == 0)                                                   \
                        _mm_prefetch((const char *)src[r] + j * eb + COLI_FFN_PREFETCH, _MM_HINT_T0); \
                    __m512 w = _mm512_mul_ps(plain16_512(f, src[r] + j * eb), sc[r]);       \
                    UNROLL for (int t = 0; t < TB; t++)                                     \
                        a[t][r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + t * ldx + j), a[t][r]); \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        UNROLL for (int t = 0; t < TB; t++)                                                 \
            UNROLL for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(acc + (t * ROWS + r) * LANES, a[t][r]); \
    }
FUSED_PLAIN512(1)
FUSED_PLAIN512(2)
FUSED_PLAIN512(3)
FUSED_PLAIN512(4)

AVX512 static int fused_plain512(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                                 int64_t k0, int kc, const float *x, int64_t ldx, int tokens,
                                 float *acc, const float *aux) {
    (void)k;
    (void)aux;
    if (nr != ROWS || kc % 16 || !plain_vectors_ok(m, 16)) return 0;
    switch (tokens) {
    case 1: fused_plain512_1(m, n0, k0, kc, x, ldx, acc); break;
    case 2: fused_plain512_2(m, n0, k0, kc, x, ldx, acc); break;
    case 3: fused_plain512_3(m, n0, k0, kc, x, ldx, acc); break;
    default: fused_plain512_4(m, n0, k0, kc, x, ldx, acc); break;
    }
    return 1;
}

/* GPTQ in registers: per word row, each of the panel's four vectors of
 * words gives eight inputs' weights, applied to TB tokens at once. */
#define FUSED_GPTQ512(TB)                                                                   \
    AVX512 static void fused_gptq512_##TB(const ColiFfnMat *m, int64_t n0, int64_t k0, int kc, \
                                          const float *x, int64_t ldx, float *acc,          \
                                          const float *aux, const int64_t *groups) {        \
        const __m512i low = _mm512_set1_epi32(0xf);                                         \
        __m512 a[TB][4];                                                                    \
        UNROLL for (int t = 0; t < TB; t++)                                                 \
            UNROLL for (int c = 0; c < 4; c++) a[t][c] = _mm512_loadu_ps(acc + t * 64 + 16 * c); \
        for (int j8 = 0; j8 < kc; j8 += 8) {                                                \
            const uint8_t *src = m->data + (((k0 + j8) / 8) * m->n_out + n0) * 4;           \
            __m512i w[4];                                                                   \
            UNROLL for (int c = 0; c < 4; c++) w[c] = _mm512_loadu_si512(src + 64 * c);     \
            UNROLL for (int j = 0; j < 8; j++) {                                            \
                const float *s = aux + 128 * groups[j8 + j];                                \
                __m512 xv[TB];                                                              \
                UNROLL for (int t = 0; t < TB; t++) xv[t] = _mm512_set1_ps(x[t * ldx + j8 + j]); \
                UNROLL for (int c = 0; c < 4; c++) {                                        \
                    __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w[c], 4 * j), low)); \
                    q = _mm512_mul_ps(_mm512_sub_ps(q, _mm512_loadu_ps(s + 64 + 16 * c)),   \
                                      _mm512_loadu_ps(s + 16 * c));                         \
                    UNROLL for (int t = 0; t < TB; t++) a[t][c] = _mm512_fmadd_ps(q, xv[t], a[t][c]); \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        UNROLL for (int t = 0; t < TB; t++)                                                 \
            UNROLL for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + t * 64 + 16 * c, a[t][c]); \
    }
FUSED_GPTQ512(1)
FUSED_GPTQ512(2)
FUSED_GPTQ512(3)
FUSED_GPTQ512(4)

/* GPTQ without act order, in registers: a run of inputs sharing a group
 * adds q * x into partial sums, which take the group's scale and zero point
 * once at the end of the run: sum (q - z) s x = s (sum q x - z sum x). */
#define GROUPED_GPTQ512(TB)                                                                 \
    AVX512 static void grouped_gptq512_##TB(const ColiFfnMat *m, int64_t n0, int64_t k0, int kc, \
                                            const float *x, int64_t ldx, float *acc,        \
                                            const float *aux) {                             \
        const __m512i low = _mm512_set1_epi32(0xf);                                         \
        int64_t g = k0 / m->group;                                                          \
        for (int j = 0, end = (int)((g + 1) * m->group - k0); j < kc; g++, end += (int)m->group) { \
            __m512 p[TB][4];                                                                \
            float xs[TB];                                                                   \
            UNROLL for (int t = 0; t < TB; t++) {                                           \
                xs[t] = 0.0f;                                                               \
                UNROLL for (int c = 0; c < 4; c++) p[t][c] = _mm512_setzero_ps();           \
            }                                                                               \
            for (int stop = end < kc ? end : kc; j < stop; j += 8) {                        \
                const uint8_t *src = m->data + (((k0 + j) / 8) * m->n_out + n0) * 4;        \
                _mm_prefetch((const char *)src + 4 * m->n_out * 4, _MM_HINT_T0);            \
                _mm_prefetch((const char *)src + 4 * m->n_out * 4 + 128, _MM_HINT_T0);      \
                __m512i w[4];                                                               \
                UNROLL for (int c = 0; c < 4; c++) w[c] = _mm512_loadu_si512(src + 64 * c); \
                UNROLL for (int i = 0; i < 8; i++) {                                        \
                    __m512 xv[TB];                                                          \
                    UNROLL for (int t = 0; t < TB; t++) {                                   \
                        xs[t] += x[t * ldx + j + i];                                        \
                        xv[t] = _mm512_set1_ps(x[t * ldx + j + i]);                         \
                    }                                                                       \
                    UNROLL for (int c = 0; c < 4; c++) {                                    \
                        __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w[c], 4 * i), low)); \
                        UNROLL for (int t = 0; t < TB; t++) p[t][c] = _mm512_fmadd_ps(q, xv[t], p[t][c]); \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            const float *s = aux + 128 * g;                                                 \
            UNROLL for (int c = 0; c < 4; c++) {                                            \
                __m512 sc = _mm512_loadu_ps(s + 16 * c);                                    \
                __m512 zs = _mm512_mul_ps(_mm512_loadu_ps(s + 64 + 16 * c), sc);            \
                UNROLL for (int t = 0; t < TB; t++) {                                       \
                    float *a = acc + t * 64 + 16 * c;                                       \
                    __m512 v = _mm512_fmadd_ps(p[t][c], sc, _mm512_loadu_ps(a));            \
                    _mm512_storeu_ps(a, _mm512_fnmadd_ps(zs, _mm512_set1_ps(xs[t]), v));    \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }
GROUPED_GPTQ512(1)
GROUPED_GPTQ512(2)
GROUPED_GPTQ512(3)
GROUPED_GPTQ512(4)

/* AWQ the same way, an input row (16 words, 128 outputs) at a time, for
 * one or two tokens. */
#define GROUPED_AWQ512(TB)                                                                  \
    AVX512 static void grouped_awq512_##TB(const ColiFfnMat *m, int64_t n0, int64_t k0, int kc, \
                                           const float *x, int64_t ldx, float *acc,         \
                                           const float *aux) {                              \
        const __m512i low = _mm512_set1_epi32(0xf);                                         \
        int64_t g = k0 / m->group, row = m->n_out / 2;                                      \
        for (int j = 0, end = (int)((g + 1) * m->group - k0); j < kc; g++, end += (int)m->group) { \
            __m512 p[TB][8];                                                                \
            float xs[TB];                                                                   \
            UNROLL for (int t = 0; t < TB; t++) {                                           \
                xs[t] = 0.0f;                                                               \
                UNROLL for (int n = 0; n < 8; n++) p[t][n] = _mm512_setzero_ps();           \
            }                                                                               \
            for (int stop = end < kc ? end : kc; j < stop; j++) {                           \
                const uint8_t *src = m->data + (k0 + j) * row + n0 / 2;                     \
                _mm_prefetch((const char *)src + 8 * row, _MM_HINT_T0);                     \
                __m512i w = _mm512_loadu_si512(src);                                        \
                __m512 xv[TB];                                                              \
                UNROLL for (int t = 0; t < TB; t++) {                                       \
                    xs[t] += x[t * ldx + j];                                                \
                    xv[t] = _mm512_set1_ps(x[t * ldx + j]);                                 \
                }                                                                           \
                UNROLL for (int n = 0; n < 8; n++) {                                        \
                    __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 4 * n), low)); \
                    UNROLL for (int t = 0; t < TB; t++) p[t][n] = _mm512_fmadd_ps(q, xv[t], p[t][n]); \
                }                                                                           \
            }                                                                               \
            const float *s = aux + 256 * g;                                                 \
            UNROLL for (int n = 0; n < 8; n++) {                                            \
                __m512 sc = _mm512_loadu_ps(s + 16 * n);                                    \
                __m512 zs = _mm512_mul_ps(_mm512_loadu_ps(s + 128 + 16 * n), sc);           \
                UNROLL for (int t = 0; t < TB; t++) {                                       \
                    float *a = acc + t * 128 + 16 * n;                                      \
                    __m512 v = _mm512_fmadd_ps(p[t][n], sc, _mm512_loadu_ps(a));            \
                    _mm512_storeu_ps(a, _mm512_fnmadd_ps(zs, _mm512_set1_ps(xs[t]), v));    \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }
GROUPED_AWQ512(1)
GROUPED_AWQ512(2)

AVX512 static int fused_gptq512(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                                int64_t k0, int kc, const float *x, int64_t ldx, int tokens,
                                float *acc, const float *aux) {
    if (nr != k->panel || k->panel != 64) return 0;
    if (!m->g_idx && m->group % 8 == 0) {
        switch (tokens) {
        case 1: grouped_gptq512_1(m, n0, k0, kc, x, ldx, acc, aux); break;
        case 2: grouped_gptq512_2(m, n0, k0, kc, x, ldx, acc, aux); break;
        case 3: grouped_gptq512_3(m, n0, k0, kc, x, ldx, acc, aux); break;
        default: grouped_gptq512_4(m, n0, k0, kc, x, ldx, acc, aux); break;
        }
        return 1;
    }
    int64_t groups[COLI_FFN_AXPY_KC];
    for (int j = 0; j < kc; j += COLI_FFN_AXPY_KC) {  /* the groups of a chunk at a time */
        int n = kc - j < COLI_FFN_AXPY_KC ? kc - j : COLI_FFN_AXPY_KC;
        coli_ffn_chunk_groups(m, k0 + j, n, groups);
        switch (tokens) {
        case 1: fused_gptq512_1(m, n0, k0 + j, n, x + j, ldx, acc, aux, groups); break;
        case 2: fused_gptq512_2(m, n0, k0 + j, n, x + j, ldx, acc, aux, groups); break;
        case 3: fused_gptq512_3(m, n0, k0 + j, n, x + j, ldx, acc, aux, groups); break;
        default: fused_gptq512_4(m, n0, k0 + j, n, x + j, ldx, acc, aux, groups); break;
        }
    }
    return 1;
}

/* AWQ in registers: an input row's 16 words are eight vectors of
 * outputs, applied to TB (at most two) tokens. */
#define FUSED_AWQ512(TB)                                                                    \
    AVX512 static void fused_awq512_##TB(const ColiFfnMat *m, int64_t n0, int64_t k0, int kc, \
                                         const float *x, int64_t ldx, float *acc,           \
                                         const float *aux, const int64_t *groups) {         \
        const __m512i low = _mm512_set1_epi32(0xf);                                         \
        __m512 a[TB][8];                                                                    \
        UNROLL for (int t = 0; t < TB; t++)                                                 \
            UNROLL for (int n = 0; n < 8; n++) a[t][n] = _mm512_loadu_ps(acc + t * 128 + 16 * n); \
        for (int j = 0; j < kc; j++) {                                                      \
            const float *s = aux + 256 * groups[j];                                         \
            __m512i w = _mm512_loadu_si512(m->data + ((k0 + j) * (m->n_out / 8) + n0 / 8) * 4); \
            __m512 xv[TB];                                                                  \
            UNROLL for (int t = 0; t < TB; t++) xv[t] = _mm512_set1_ps(x[t * ldx + j]);     \
            UNROLL for (int n = 0; n < 8; n++) {                                            \
                __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 4 * n), low)); \
                q = _mm512_mul_ps(_mm512_sub_ps(q, _mm512_loadu_ps(s + 128 + 16 * n)),      \
                                  _mm512_loadu_ps(s + 16 * n));                             \
                UNROLL for (int t = 0; t < TB; t++) a[t][n] = _mm512_fmadd_ps(q, xv[t], a[t][n]); \
            }                                                                               \
        }                                                                                   \
        UNROLL for (int t = 0; t < TB; t++)                                                 \
            UNROLL for (int n = 0; n < 8; n++) _mm512_storeu_ps(acc + t * 128 + 16 * n, a[t][n]); \
    }
FUSED_AWQ512(1)
FUSED_AWQ512(2)

AVX512 static int fused_awq512(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                               int64_t k0, int kc, const float *x, int64_t ldx, int tokens,
                               float *acc, const float *aux) {
    if (nr != k->panel || k->panel != 128 || tokens > 2) return 0;
    if (tokens == 1) grouped_awq512_1(m, n0, k0, kc, x, ldx, acc, aux);
    else grouped_awq512_2(m, n0, k0, kc, x, ldx, acc, aux);
    return 1;
    int64_t groups[COLI_FFN_AXPY_KC];
    for (int j = 0; j < kc; j += COLI_FFN_AXPY_KC) {
        int n = kc - j < COLI_FFN_AXPY_KC ? kc - j : COLI_FFN_AXPY_KC;
        coli_ffn_chunk_groups(m, k0 + j, n, groups);
        if (tokens == 1) fused_awq512_1(m, n0, k0 + j, n, x + j, ldx, acc, aux, groups);
        else fused_awq512_2(m, n0, k0 + j, n, x + j, ldx, acc, aux, groups);
    }
    return 1;
}

/* GPTQ: 16 output columns' words per vector, each word eight inputs;
 * nibble j of word row w is input 8w + j, dequantized with its group's
 * scales and zero points from aux. */
AVX512 static void axpy_gptq512(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                                int64_t k0, int kc, float *tile, const float *aux) {
    int panel = k->panel;
    if (nr < panel) {
        coli_ffn_decode_scalar(m, k, n0, nr, k0, kc, tile, aux);
        return;
    }
    const __m512i low = _mm512_set1_epi32(0xf);
    int64_t groups[COLI_FFN_AXPY_KC];
    coli_ffn_chunk_groups(m, k0, kc, groups);
    for (int j8 = 0; j8 < kc; j8 += 8) {
        const uint8_t *src = m->data + (((k0 + j8) / 8) * m->n_out + n0) * 4;
        for (int c = 0; c < panel; c += 16) {
            __m512i w = _mm512_loadu_si512(src + 4 * c);
            UNROLL for (int j = 0; j < 8; j++) {
                const float *s = aux + 2 * panel * groups[j8 + j];
                __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 4 * j), low));
                q = _mm512_mul_ps(_mm512_sub_ps(q, _mm512_loadu_ps(s + panel + c)),
                                  _mm512_loadu_ps(s + c));
                _mm512_storeu_ps(tile + (int64_t)(j8 + j) * panel + c, q);
            }
        }
    }
}

/* AWQ: one input row's 16 words are 128 outputs; nibble j of the words is
 * one vector (positions 16j..16j+15, see awq_positions). */
AVX512 static void axpy_awq512(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                               int64_t k0, int kc, float *tile, const float *aux) {
    int panel = k->panel;
    if (nr < panel) {
        coli_ffn_decode_scalar(m, k, n0, nr, k0, kc, tile, aux);
        return;
    }
    const __m512i low = _mm512_set1_epi32(0xf);
    int64_t groups[COLI_FFN_AXPY_KC];
    coli_ffn_chunk_groups(m, k0, kc, groups);
    for (int j = 0; j < kc; j++) {
        int64_t kk = k0 + j;
        const float *s = aux + 2 * panel * groups[j];
        __m512i w = _mm512_loadu_si512(m->data + (kk * (m->n_out / 8) + n0 / 8) * 4);
        UNROLL for (int n = 0; n < 8; n++) {
            __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 4 * n), low));
            q = _mm512_mul_ps(_mm512_sub_ps(q, _mm512_loadu_ps(s + panel + 16 * n)),
                              _mm512_loadu_ps(s + 16 * n));
            _mm512_storeu_ps(tile + (int64_t)j * panel + 16 * n, q);
        }
    }
}

/* ------------------------------------------------------------ AVX2 decoders */

/* A 16-entry table in two vectors (entries 0-7, 8-15), looked up by the low
 * four bits of each lane: two permutes and a blend on bit 3 (moved to the
 * sign by shift_to_sign). */
typedef struct {
    __m256 lo, hi;
} Table16;

AVX2 INLINE __m256 lookup16(Table16 t, __m256i index, int shift_to_sign) {
    __m256 a = _mm256_permutevar8x32_ps(t.lo, index), b = _mm256_permutevar8x32_ps(t.hi, index);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_sll_epi32(index, _mm_cvtsi32_si128(shift_to_sign))));
}

/* int4's (q - zero) * scale or MXFP4's e2m1 * 2^(e - 127) for q = 0..15. */
AVX2 INLINE Table16 nibble_table256(const ColiFfnMat *m, int64_t o, int64_t g) {
    static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    Table16 t;
    if (m->format == COLI_TENSOR_FP4_NATIVE_BLOCK) {
        int e = m->scales[o * m->groups + g];
        if (e == 255) {  /* ldexp's answers: inf, and 0 for 0 */
            float v[16];
            for (int i = 0; i < 16; i++) v[i] = ldexpf(E2M1[i], 128);
            t.lo = _mm256_loadu_ps(v);
            t.hi = _mm256_loadu_ps(v + 8);
            return t;
        }
        /* 2^(e - 127) exactly: a normal float's exponent bits, or 2^-127's. */
        __m256 p = _mm256_castsi256_ps(_mm256_set1_epi32(e ? e << 23 : 0x00400000));
        t.lo = _mm256_mul_ps(_mm256_loadu_ps(E2M1), p);
        t.hi = _mm256_mul_ps(_mm256_loadu_ps(E2M1 + 8), p);
        return t;
    }
    __m256 z = _mm256_set1_ps((float)coli_ffn_zero_at(m, o, g));
    __m256 sc = _mm256_set1_ps(coli_ffn_scale_at(m, o * m->groups + g));
    t.lo = _mm256_mul_ps(_mm256_sub_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), z), sc);
    t.hi = _mm256_mul_ps(_mm256_sub_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), z), sc);
    return t;
}

/* Eight bytes' low nibbles (even inputs) and high nibbles (odd inputs). */
AVX2 INLINE void nibbles256(const uint8_t *p, Table16 t, __m256 *even, __m256 *odd) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *even = lookup16(t, v, 28);
    *odd = lookup16(t, _mm256_srli_epi32(v, 4), 28);
}

AVX2 static void dot_nibbles256(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                                int64_t k0, int kc, float *tile, const float *aux) {
    (void)aux;
    int full = m->group % COLI_FFN_KBLOCK == 0 ? kc & ~(COLI_FFN_KBLOCK - 1) : 0;
    int64_t g0 = k0 / m->group;
    int first_end = (int)((g0 + 1) * m->group - k0);
    for (int r = 0; r < nr; r++) {
        int64_t o = n0 + r;
        const uint8_t *src = m->data + o * (m->n_in / 2) + k0 / 2;
        float *row = tile + (int64_t)r * k->kc;
        int64_t g = g0;
        for (int j = 0, end = first_end; j < full; g++, end += (int)m->group) {
            Table16 t = nibble_table256(m, o, g);
            for (int stop = end < full ? end : full; j < stop; j += 16) {
                __m256 even, odd;
                nibbles256(src + j / 2, t, &even, &odd);
                _mm256_storeu_ps(row + j, even);
                _mm256_storeu_ps(row + j + 8, odd);
            }
        }
        dot_tail(m, k, o, k0, full, kc, row);
    }
}

#define FUSED_NIBBLES256(TB)                                                                \
    AVX2 static void fused_nibbles256_##TB(const ColiFfnMat *m, int64_t n0, int64_t k0, int kc, \
                                           const float *x, int64_t ldx, float *acc) {       \
        __m256 a[TB][ROWS];                                                                 \
        const uint8_t *src[ROWS];                                                           \
        UNROLL for (int r = 0; r < ROWS; r++) src[r] = m->data + (n0 + r) * (m->n_in / 2) + k0 / 2; \
        UNROLL for (int t = 0; t < TB; t++)                                                 \
            UNROLL for (int r = 0; r < ROWS; r++) a[t][r] = _mm256_loadu_ps(acc + (t * ROWS + r) * LANES); \
        int64_t g = k0 / m->group;                                                          \
        for (int j = 0, end = (int)((g + 1) * m->group - k0); j < kc; g++, end += (int)m->group) { \
            Table16 tab[ROWS];                                                              \
            UNROLL for (int r = 0; r < ROWS; r++) tab[r] = nibble_table256(m, n0 + r, g);   \
            for (int stop = end < kc ? end : kc; j < stop; j += 16) {                       \
                UNROLL for (int r = 0; r < ROWS; r++) {                                     \
                    if (j % 128 == 0)                                                       \
                        _mm_prefetch((const char *)src[r] + j / 2 + COLI_FFN_PREFETCH, _MM_HINT_T0); \
                    __m256 even, odd;                                                       \
                    nibbles256(src[r] + j / 2, tab[r], &even, &odd);                        \
                    UNROLL for (int t = 0; t < TB; t++) {                                   \
                        a[t][r] = _mm256_fmadd_ps(even, _mm256_loadu_ps(x + t * ldx + j), a[t][r]); \
                        a[t][r] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(x + t * ldx + j + 8), a[t][r]); \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        UNROLL for (int t = 0; t < TB; t++)                                                 \
            UNROLL for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(acc + (t * ROWS + r) * LANES, a[t][r]); \
    }
FUSED_NIBBLES256(1)
FUSED_NIBBLES256(2)

AVX2 static int fused_nibbles256(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                                 int64_t k0, int kc, const float *x, int64_t ldx, int tokens,
                                 float *acc, const float *aux) {
    (void)k;
    (void)aux;
    if (nr != ROWS || kc % COLI_FFN_KBLOCK || m->group % COLI_FFN_KBLOCK || tokens > 2) return 0;
    if (tokens == 1) fused_nibbles256_1(m, n0, k0, kc, x, ldx, acc);
    else fused_nibbles256_2(m, n0, k0, kc, x, ldx, acc);
    return 1;
}

/* 8 plain elements (F32, F16, BF16, e4m3, e5m2) at src as floats. */
AVX2 INLINE __m256 plain8_256(ColiTensorFormat f, const uint8_t *src) {
    switch (f) {
    case COLI_TENSOR_F32: return _mm256_loadu_ps((const float *)src);
    case COLI_TENSOR_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
    case COLI_TENSOR_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
    case COLI_TENSOR_F8_E5M2:
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)src)), 8));
    default: {  /* e4m3, as plain16_512 */
        __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)src));
        __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(mag, 7));
        __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
        __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f))));
        return _mm256_blendv_ps(v, _mm256_set1_ps(NAN), nan);
    }
    }
}

AVX2 static void dot_plain256(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                              int64_t k0, int kc, float *tile, const float *aux) {
    (void)aux;
    int eb = elem_bytes(m->format), full = plain_vectors_ok(m, 8) ? kc & ~7 : 0;
    ColiTensorFormat f = m->format == COLI_TENSOR_FP8_E4M3_BLOCK ? COLI_TENSOR_F8_E4M3 : m->format;
    for (int r = 0; r < nr; r++) {
        int64_t o = n0 + r;
        const uint8_t *src = m->data + (o * m->cols + k0) * eb;
        float *row = tile + (int64_t)r * k->kc;
        float scale = plain_scale(m, o, k0);
        for (int j = 0; j < full; j += 8) {
            if (m->format == COLI_TENSOR_FP8_E4M3_BLOCK && (k0 + j) % m->block_columns == 0)
                scale = plain_scale(m, o, k0 + j);
            _mm256_storeu_ps(row + j, _mm256_mul_ps(plain8_256(f, src + j * eb), _mm256_set1_ps(scale)));
        }
        dot_tail(m, k, o, k0, full, kc, row);
    }
}

AVX2 static void axpy_plain256(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                               int64_t k0, int kc, float *tile, const float *aux) {
    int panel = k->panel;
    if (nr < panel || !plain_vectors_ok(m, 8)) {
        coli_ffn_decode_scalar(m, k, n0, nr, k0, kc, tile, aux);
        return;
    }
    int eb = elem_bytes(m->format);
    ColiTensorFormat f = m->format == COLI_TENSOR_FP8_E4M3_BLOCK ? COLI_TENSOR_F8_E4M3 : m->format;
    for (int j = 0; j < kc; j++) {
        const uint8_t *src = m->data + ((k0 + j) * m->cols + n0) * eb;
        for (int c = 0; c < panel; c += 8)
            _mm256_storeu_ps(tile + (int64_t)j * panel + c,
                             _mm256_mul_ps(plain8_256(f, src + c * eb),
                                           _mm256_set1_ps(plain_scale(m, k0 + j, n0 + c))));
    }
}

/* GPTQ and AWQ as their AVX-512 decoders, eight lanes. */
AVX2 static void axpy_gptq256(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                              int64_t k0, int kc, float *tile, const float *aux) {
    int panel = k->panel;
    if (nr < panel) {
        coli_ffn_decode_scalar(m, k, n0, nr, k0, kc, tile, aux);
        return;
    }
    const __m256i low = _mm256_set1_epi32(0xf);
    int64_t groups[COLI_FFN_AXPY_KC];
    coli_ffn_chunk_groups(m, k0, kc, groups);
    for (int j8 = 0; j8 < kc; j8 += 8) {
        const uint8_t *src = m->data + (((k0 + j8) / 8) * m->n_out + n0) * 4;
        for (int c = 0; c < panel; c += 8) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(src + 4 * c));
            UNROLL for (int j = 0; j < 8; j++) {
                const float *s = aux + 2 * panel * groups[j8 + j];
                __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 4 * j), low));
                q = _mm256_mul_ps(_mm256_sub_ps(q, _mm256_loadu_ps(s + panel + c)), _mm256_loadu_ps(s + c));
                _mm256_storeu_ps(tile + (int64_t)(j8 + j) * panel + c, q);
            }
        }
    }
}

AVX2 static void axpy_awq256(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                             int64_t k0, int kc, float *tile, const float *aux) {
    int panel = k->panel;
    if (nr < panel) {
        coli_ffn_decode_scalar(m, k, n0, nr, k0, kc, tile, aux);
        return;
    }
    const __m256i low = _mm256_set1_epi32(0xf);
    int64_t groups[COLI_FFN_AXPY_KC];
    coli_ffn_chunk_groups(m, k0, kc, groups);
    for (int j = 0; j < kc; j++) {
        const float *s = aux + 2 * panel * groups[j];
        __m256i w = _mm256_loadu_si256((const __m256i *)(m->data + ((k0 + j) * (m->n_out / 8) + n0 / 8) * 4));
        UNROLL for (int n = 0; n < 8; n++) {
            __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 4 * n), low));
            q = _mm256_mul_ps(_mm256_sub_ps(q, _mm256_loadu_ps(s + panel + 8 * n)), _mm256_loadu_ps(s + 8 * n));
            _mm256_storeu_ps(tile + (int64_t)j * panel + 8 * n, q);
        }
    }
}

/* ------------------------------------------------------------ kernel tables */

#define DOT_KERNEL(NAME, KPOS, DECODE, FUSED) \
    {NAME, COLI_FFN_DOT, COLI_FFN_DOT_ROWS, COLI_FFN_DOT_KC, KPOS, NULL, NULL, NULL, DECODE, FUSED}
#define AXPY_KERNEL(NAME, PANEL, COLPOS, PREPARE, AUX, DECODE, FUSED) \
    {NAME, COLI_FFN_AXPY, PANEL, COLI_FFN_AXPY_KC, NULL, COLPOS, PREPARE, AUX, DECODE, FUSED}

static const ColiFfnKernel K512_INT4 = DOT_KERNEL("int4/avx512", EVEN_ODD32, dot_nibbles512,
                                                  fused_nibbles512);
static const ColiFfnKernel K512_MXFP4 = DOT_KERNEL("mxfp4/avx512", EVEN_ODD32, dot_nibbles512,
                                                   fused_nibbles512);
static const ColiFfnKernel K512_PLAIN = DOT_KERNEL("plain/avx512", NULL, dot_plain512,
                                                   fused_plain512);
static const ColiFfnKernel K512_PLAIN_T = AXPY_KERNEL("plain-in-out/avx512", 64, NULL, NULL, NULL,
                                                      axpy_plain512, NULL);
static const ColiFfnKernel K512_GPTQ = AXPY_KERNEL("gptq/avx512", 64, NULL, coli_ffn_prepare_quant,
                                                   coli_ffn_quant_aux, axpy_gptq512, fused_gptq512);
static const ColiFfnKernel K512_AWQ = AXPY_KERNEL("awq/avx512", 128, AWQ_POS128,
                                                  coli_ffn_prepare_quant, coli_ffn_quant_aux,
                                                  axpy_awq512, fused_awq512);

static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

const ColiFfnKernel *coli_ffn_kernel_avx512(ColiTensorFormat format, int in_out) {
    pthread_once(&tables_once, awq_positions);
    switch (format) {
    case COLI_TENSOR_F32:
    case COLI_TENSOR_F16:
    case COLI_TENSOR_BF16:
    case COLI_TENSOR_F8_E4M3:
    case COLI_TENSOR_F8_E5M2:
    case COLI_TENSOR_FP8_E4M3_BLOCK: return in_out ? &K512_PLAIN_T : &K512_PLAIN;
    case COLI_TENSOR_FP4_NATIVE_BLOCK: return in_out ? NULL : &K512_MXFP4;
    case COLI_TENSOR_INT4_BLOCK: return in_out ? NULL : &K512_INT4;
    case COLI_TENSOR_INT4_GPTQ: return in_out ? &K512_GPTQ : NULL;
    case COLI_TENSOR_INT4_AWQ: return in_out ? &K512_AWQ : NULL;
    default: return NULL;
    }
}

static const ColiFfnKernel K256_INT4 = DOT_KERNEL("int4/avx2", EVEN_ODD16, dot_nibbles256,
                                                  fused_nibbles256);
static const ColiFfnKernel K256_MXFP4 = DOT_KERNEL("mxfp4/avx2", EVEN_ODD16, dot_nibbles256,
                                                   fused_nibbles256);
static const ColiFfnKernel K256_PLAIN = DOT_KERNEL("plain/avx2", NULL, dot_plain256, NULL);
static const ColiFfnKernel K256_PLAIN_T = AXPY_KERNEL("plain-in-out/avx2", 64, NULL, NULL, NULL,
                                                      axpy_plain256, NULL);
static const ColiFfnKernel K256_GPTQ = AXPY_KERNEL("gptq/avx2", 64, NULL, coli_ffn_prepare_quant,
                                                   coli_ffn_quant_aux, axpy_gptq256, NULL);
static const ColiFfnKernel K256_AWQ = AXPY_KERNEL("awq/avx2", 64, AWQ_POS64, coli_ffn_prepare_quant,
                                                  coli_ffn_quant_aux, axpy_awq256, NULL);

const ColiFfnKernel *coli_ffn_kernel_avx2(ColiTensorFormat format, int in_out) {
    pthread_once(&tables_once, awq_positions);
    switch (format) {
    case COLI_TENSOR_F32:
    case COLI_TENSOR_F16:
    case COLI_TENSOR_BF16:
    case COLI_TENSOR_F8_E4M3:
    case COLI_TENSOR_F8_E5M2:
    case COLI_TENSOR_FP8_E4M3_BLOCK: return in_out ? &K256_PLAIN_T : &K256_PLAIN;
    case COLI_TENSOR_FP4_NATIVE_BLOCK: return in_out ? NULL : &K256_MXFP4;
    case COLI_TENSOR_INT4_BLOCK: return in_out ? NULL : &K256_INT4;
    case COLI_TENSOR_INT4_GPTQ: return in_out ? &K256_GPTQ : NULL;
    case COLI_TENSOR_INT4_AWQ: return in_out ? &K256_AWQ : NULL;
    default: return NULL;
    }
}

#endif /* x86 */
