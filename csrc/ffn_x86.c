/*
 * ffn_x86.c: the AVX2 (with FMA and F16C) and AVX-512 (F, BW, VL) paths.
 *
 * Every function carries its own target attribute, so the file builds with
 * the package's ordinary flags and nothing here runs unless ffn.c's CPUID
 * check chose the path. The float32 kernels are written once
 * (ffn_x86_f32.h) over each path's vector; the AVX-512 path adds kernels
 * that multiply bfloat16 inputs with vdpbf16ps where the CPU has
 * AVX512_BF16 (ffn_x86_bf16.h).
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

static int x86_elem_bytes(ColiTensorFormat f) {
    return f == COLI_TENSOR_F32 ? 4 : f == COLI_TENSOR_F16 || f == COLI_TENSOR_BF16 ? 2 : 1;
}

/* The FP8 block scale of stored (row, col), or 1 for unscaled formats. */
static float x86_fp8_scale(const ColiFfnMat *m, int64_t row, int64_t col) {
    if (m->format != COLI_TENSOR_FP8_E4M3_BLOCK) return 1.0f;
    int64_t per_row = (m->cols + m->block_columns - 1) / m->block_columns;
    return coli_ffn_scale(m, (row / m->block_rows) * per_row + col / m->block_columns);
}

/* The 16 e2m1 values, and 0..15. */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static const float IOTA[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* ------------------------------------------------------------ AVX-512 vectors */

AVX512 INLINE float tree_512(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

AVX512 INLINE __m512i words_512(const uint8_t *p, int lanes) {
    return _mm512_maskz_loadu_epi32((__mmask16)(lanes >= 16 ? 0xffff : (1u << lanes) - 1), p);
}

/* 16 plain elements (F32, F16, BF16, e4m3, e5m2) at src as floats. */
AVX512 INLINE __m512 plain_512(ColiTensorFormat f, const uint8_t *src) {
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

AVX512 INLINE __m512 iota16_512(void) { return _mm512_loadu_ps(IOTA); }

/* int4's (q - zero) * scale or MXFP4's e2m1 * 2^(e - 127) (exact: scalef
 * gives ldexp's answers) for q = 0..15. */
AVX512 INLINE __m512 nibble_table_512(const ColiFfnMat *m, int64_t o, int64_t g) {
    if (m->format == COLI_TENSOR_FP4_NATIVE_BLOCK)
        return _mm512_scalef_ps(_mm512_loadu_ps(E2M1),
                                _mm512_set1_ps((float)m->scales[o * m->groups + g] - 127.0f));
    return _mm512_mul_ps(_mm512_sub_ps(iota16_512(), _mm512_set1_ps((float)coli_ffn_zero_at(m, o, g))),
                         _mm512_set1_ps(coli_ffn_scale_at(m, o * m->groups + g)));
}

#define SFX 512
#define L 16
#define VF __m512
#define VI __m512i
#define TAB16 __m512
#define tab_zero _mm512_setzero_ps
#define TGT AVX512
#define DOT_ROWS 4
#define STREAM_TB 4
#define AX_NV 8
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vfma _mm512_fmadd_ps
#define vfnmadd _mm512_fnmadd_ps
#define vtree tree_512
#define vsrli(v, n) _mm512_srli_epi32(v, (unsigned)(n))
#define widen_bytes(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define lookup16(t, i) _mm512_permutexvar_ps(i, t)
#define vload_words words_512
#define plain_vec plain_512
#include "ffn_x86_f32.h"

#include "ffn_x86_bf16.h"

/* ------------------------------------------------------------ AVX2 vectors */

/* A 16-entry table in two vectors (entries 0-7, 8-15), looked up by the low
 * four bits of each lane: two permutes and a blend on bit 3. */
typedef struct {
    __m256 lo, hi;
} Table16;

AVX2 INLINE __m256 lookup16_256(Table16 t, __m256i index) {
    __m256 a = _mm256_permutevar8x32_ps(t.lo, index), b = _mm256_permutevar8x32_ps(t.hi, index);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
}

AVX2 INLINE float tree_256(__m256 v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

static const int32_t LANE_MASKS[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

AVX2 INLINE __m256i mask_256(int lanes) {
    return _mm256_loadu_si256((const __m256i *)(LANE_MASKS + 8 - (lanes > 8 ? 8 : lanes)));
}

AVX2 INLINE __m256i words_256(const uint8_t *p, int lanes) {
    if (lanes >= 8) return _mm256_loadu_si256((const __m256i *)p);
    return _mm256_maskload_epi32((const int *)p, mask_256(lanes));
}

/* 8 plain elements (F32, F16, BF16, e4m3, e5m2) at src as floats. */
AVX2 INLINE __m256 plain_256(ColiTensorFormat f, const uint8_t *src) {
    switch (f) {
    case COLI_TENSOR_F32: return _mm256_loadu_ps((const float *)src);
    case COLI_TENSOR_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
    case COLI_TENSOR_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
    case COLI_TENSOR_F8_E5M2:
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)src)), 8));
    default: {  /* e4m3, as plain_512 */
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

AVX2 INLINE Table16 table_zero_256(void) {
    Table16 t = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    return t;
}

AVX2 INLINE Table16 iota16_256(void) {
    Table16 t = {_mm256_loadu_ps(IOTA), _mm256_loadu_ps(IOTA + 8)};
    return t;
}

/* As nibble_table_512; 2^(e - 127) from the exponent bits (exact). */
AVX2 INLINE Table16 nibble_table_256(const ColiFfnMat *m, int64_t o, int64_t g) {
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
        __m256 p = _mm256_set1_ps(coli_ffn_ue8m0(e));
        t.lo = _mm256_mul_ps(_mm256_loadu_ps(E2M1), p);
        t.hi = _mm256_mul_ps(_mm256_loadu_ps(E2M1 + 8), p);
        return t;
    }
    __m256 z = _mm256_set1_ps((float)coli_ffn_zero_at(m, o, g));
    __m256 sc = _mm256_set1_ps(coli_ffn_scale_at(m, o * m->groups + g));
    t.lo = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(IOTA), z), sc);
    t.hi = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(IOTA + 8), z), sc);
    return t;
}

#define SFX 256
#define L 8
#define VF __m256
#define VI __m256i
#define TAB16 Table16
#define tab_zero table_zero_256
#define TGT AVX2
#define DOT_ROWS 2
#define STREAM_TB 2
#define AX_NV 4
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vfma _mm256_fmadd_ps
#define vfnmadd _mm256_fnmadd_ps
#define vtree tree_256
#define vsrli(v, n) _mm256_srli_epi32(v, (int)(n))
#define widen_bytes(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define lookup16(t, i) lookup16_256(t, i)
#define vload_words words_256
#define plain_vec plain_256
#include "ffn_x86_f32.h"

/* ------------------------------------------------------------ activations */

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

/* Masked at the end, so that every value goes through the same vector
 * code wherever the split between threads falls. */
AVX2 static void act256(int activation, float alpha, float limit, const float *g, const float *u,
                        float *h, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit);
    const __m256 nalpha = _mm256_set1_ps(-alpha);
    for (int64_t i = 0; i < n; i += 8) {
        __m256i m = mask_256(n - i >= 8 ? 8 : (int)(n - i));
        __m256 gv = _mm256_maskload_ps(g + i, m), uv = _mm256_maskload_ps(u + i, m), hv;
        if (activation == COLI_FFN_ACT_SILU) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            hv = _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv);
        } else {
            gv = _mm256_min_ps(lim, gv);
            uv = _mm256_max_ps(nlim, _mm256_min_ps(lim, uv));
            __m256 e = exp256(_mm256_mul_ps(nalpha, gv));
            hv = _mm256_mul_ps(_mm256_add_ps(uv, one), _mm256_div_ps(gv, _mm256_add_ps(one, e)));
        }
        _mm256_maskstore_ps(h + i, m, hv);
    }
}

const ColiFfnActFn coli_ffn_act_avx512 = act512;
const ColiFfnActFn coli_ffn_act_avx2 = act256;

/* ------------------------------------------------------------ kernel tables */

#define KERNEL(NAME, ORDER, SUMS, UNIT, SCRATCH, RUN) \
    {NAME, COLI_FFN_X_F32, ORDER, SUMS, UNIT, SCRATCH, RUN}

static const ColiFfnKernel K512_INT4 = KERNEL("int4/avx512", COLI_FFN_ORDER_EO64, 0, 1,
                                              dot_scratch_512, dot_run_512);
static const ColiFfnKernel K512_MXFP4 = KERNEL("mxfp4/avx512", COLI_FFN_ORDER_EO64, 0, 1,
                                               dot_scratch_512, dot_run_512);
static const ColiFfnKernel K512_PLAIN = KERNEL("plain/avx512", COLI_FFN_ORDER_PLAIN, 0, 1,
                                               dot_scratch_512, dot_run_512);
static const ColiFfnKernel K512_PLAIN_T = KERNEL("plain-in-out/avx512", COLI_FFN_ORDER_PLAIN, 0,
                                                 16, ax_scratch_512, ax_run_512);
static const ColiFfnKernel K512_GPTQ = KERNEL("gptq/avx512", COLI_FFN_ORDER_PLAIN, 1, 16,
                                              ax_scratch_512, ax_run_512);
static const ColiFfnKernel K512_GPTQ_ACT = KERNEL("gptq/avx512", COLI_FFN_ORDER_PLAIN, 0, 16,
                                                  ax_scratch_512, ax_run_512);
static const ColiFfnKernel K512_AWQ = KERNEL("awq/avx512", COLI_FFN_ORDER_PLAIN, 1, 128,
                                             ax_scratch_512, ax_run_512);

static const ColiFfnKernel K256_INT4 = KERNEL("int4/avx2", COLI_FFN_ORDER_EO64, 0, 1,
                                              dot_scratch_256, dot_run_256);
static const ColiFfnKernel K256_MXFP4 = KERNEL("mxfp4/avx2", COLI_FFN_ORDER_EO64, 0, 1,
                                               dot_scratch_256, dot_run_256);
static const ColiFfnKernel K256_PLAIN = KERNEL("plain/avx2", COLI_FFN_ORDER_PLAIN, 0, 1,
                                               dot_scratch_256, dot_run_256);
static const ColiFfnKernel K256_PLAIN_T = KERNEL("plain-in-out/avx2", COLI_FFN_ORDER_PLAIN, 0, 8,
                                                 ax_scratch_256, ax_run_256);
static const ColiFfnKernel K256_GPTQ = KERNEL("gptq/avx2", COLI_FFN_ORDER_PLAIN, 1, 8,
                                              ax_scratch_256, ax_run_256);
static const ColiFfnKernel K256_GPTQ_ACT = KERNEL("gptq/avx2", COLI_FFN_ORDER_PLAIN, 0, 8,
                                                  ax_scratch_256, ax_run_256);
static const ColiFfnKernel K256_AWQ = KERNEL("awq/avx2", COLI_FFN_ORDER_PLAIN, 1, 64,
                                             ax_scratch_256, ax_run_256);

static const ColiFfnKernel K512_INT4_BF16 = {"int4-bf16/avx512", COLI_FFN_X_BF16,
                                              COLI_FFN_ORDER_EO64, 0, 1, bf_scratch, bf_run_x};
static const ColiFfnKernel K512_INT4_SPLIT = {"int4-bf16/avx512", COLI_FFN_X_BF16_SPLIT,
                                               COLI_FFN_ORDER_EO64, 0, 1, bf_scratch, bf_run_split};
static const ColiFfnKernel K512_MXFP4_BF16 = {"mxfp4-bf16/avx512", COLI_FFN_X_BF16,
                                               COLI_FFN_ORDER_EO64, 0, 1, bf_scratch, bf_run_x};
static const ColiFfnKernel K512_MXFP4_SPLIT = {"mxfp4-bf16/avx512", COLI_FFN_X_BF16_SPLIT,
                                                COLI_FFN_ORDER_EO64, 0, 1, bf_scratch, bf_run_split};

const ColiFfnKernel *coli_ffn_kernel_avx512(const ColiFfnMat *m, int input) {
    if (!coli_ffn_format_computed(m->format, m->in_out)) return NULL;
    int bf16 = input != COLI_FFN_INPUT_F32 && coli_ffn_cpu_has_avx512_bf16();
    int split = input == COLI_FFN_INPUT_ACT;
    switch (m->format) {
    case COLI_TENSOR_FP4_NATIVE_BLOCK:
        if (bf16) return split ? &K512_MXFP4_SPLIT : &K512_MXFP4_BF16;
        return &K512_MXFP4;
    case COLI_TENSOR_INT4_BLOCK:
        if (bf16 && bf_takes(m)) return split ? &K512_INT4_SPLIT : &K512_INT4_BF16;
        return &K512_INT4;
    case COLI_TENSOR_INT4_GPTQ: return m->g_idx ? &K512_GPTQ_ACT : &K512_GPTQ;
    case COLI_TENSOR_INT4_AWQ: return &K512_AWQ;
    default: return m->in_out ? &K512_PLAIN_T : &K512_PLAIN;
    }
}

const ColiFfnKernel *coli_ffn_kernel_avx2(const ColiFfnMat *m) {
    if (!coli_ffn_format_computed(m->format, m->in_out)) return NULL;
    switch (m->format) {
    case COLI_TENSOR_FP4_NATIVE_BLOCK: return &K256_MXFP4;
    case COLI_TENSOR_INT4_BLOCK: return &K256_INT4;
    case COLI_TENSOR_INT4_GPTQ: return m->g_idx ? &K256_GPTQ_ACT : &K256_GPTQ;
    case COLI_TENSOR_INT4_AWQ: return &K256_AWQ;
    default: return m->in_out ? &K256_PLAIN_T : &K256_PLAIN;
    }
}

int coli_ffn_cpu_has_avx512_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}

#endif /* x86 */
