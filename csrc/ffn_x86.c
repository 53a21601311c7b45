/*
 * ffn_x86.c: the AVX2 (with FMA and F16C) and AVX-512 (F, BW, VL) paths.
 *
 * Every function carries its own target attribute, so the file builds with
 * the package's ordinary flags and nothing here runs unless ffn.c's CPUID
 * check chose the path. The float32 kernels are written once
 * (ffn_x86_f32.h) over each path's vector; the AVX-512 path adds kernels
 * for bfloat16 calls where the CPU has AVX512_BF16 and AVX512_VNNI, with
 * 16-bit integer products (ffn_x86_i16.h): int4 (ffn_x86_int4.h), GPTQ and
 * AWQ (ffn_x86_gx.h), MXFP4 (ffn_x86_mxfp4.h).
 */
#define _GNU_SOURCE  /* syscall: AMX's tile state (ffn_x86_amx.h) */
#if defined(__x86_64__) || defined(__i386__)

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

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

/* 0..15. */
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

/* Nibble j of each lane as the float 2^23 + q, without a lookup (a shift
 * and a vpternlog on the integer pipes): minus 2^23 (or minus 2^23 + z)
 * it is q (q - z) exactly. */
AVX512 INLINE __m512 nib_biased_512(__m512i words, int j) {
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_srli_epi32(words, (unsigned)(4 * j)),
                                                         _mm512_set1_epi32(0xf),
                                                         _mm512_set1_epi32(0x4b000000), 0xea));
}

/* int4's (q - zero) * scale or MXFP4's e2m1 * 2^(e - 127) (exact: scalef
 * gives ldexp's answers) for q = 0..15. */
AVX512 INLINE __m512 nibble_table_512(const ColiFfnMat *m, int64_t o, int64_t g) {
    if (m->format == COLI_TENSOR_FP4_NATIVE_BLOCK)
        return _mm512_scalef_ps(_mm512_loadu_ps(coli_ffn_e2m1),
                                _mm512_set1_ps((float)m->scales[o * m->groups + g] - 127.0f));
    return _mm512_mul_ps(_mm512_sub_ps(iota16_512(), _mm512_set1_ps((float)coli_ffn_zero_at(m, o, g))),
                         _mm512_set1_ps(coli_ffn_scale_at(m, o * m->groups + g)));
}

/* The nibbles of the words at p, eight per word in order, as floats (16:
 * two words). */
AVX512 INLINE __m512 zeros8_512(const uint8_t *p) {
    const __m512i word = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i shift = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    __m512i w = _mm512_permutexvar_epi32(word, _mm512_maskz_loadu_epi32(3, p));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, shift), _mm512_set1_epi32(0xf)));
}

/* 16 scales from index i on (F32, F16 or BF16) as floats. */
AVX512 INLINE __m512 scales_512(ColiScaleFormat f, const uint8_t *scales, int64_t i) {
    if (f == COLI_SCALE_F32) return _mm512_loadu_ps(scales + 4 * i);
    __m256i h = _mm256_loadu_si256((const __m256i *)(scales + 2 * i));
    if (f == COLI_SCALE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#define SFX 512
#define L 16
#define vzeros8 zeros8_512
#define vload_scales scales_512
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
#define nib_biased nib_biased_512
#define vload_words words_512
#define plain_vec plain_512
#include "ffn_x86_f32.h"

#include "ffn_x86_i16.h"
#include "ffn_x86_int4.h"
#include "ffn_x86_gx.h"
#include "ffn_x86_gptq_act.h"
#include "ffn_x86_mxfp4.h"
#include "ffn_x86_amx.h"

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

/* As nib_biased_512. */
AVX2 INLINE __m256 nib_biased_256(__m256i words, int j) {
    return _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi32(words, 4 * j), _mm256_set1_epi32(0xf)),
        _mm256_set1_epi32(0x4b000000)));
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
            for (int i = 0; i < 16; i++) v[i] = ldexpf(coli_ffn_e2m1[i], 128);
            t.lo = _mm256_loadu_ps(v);
            t.hi = _mm256_loadu_ps(v + 8);
            return t;
        }
        __m256 p = _mm256_set1_ps(coli_ffn_ue8m0(e));
        t.lo = _mm256_mul_ps(_mm256_loadu_ps(coli_ffn_e2m1), p);
        t.hi = _mm256_mul_ps(_mm256_loadu_ps(coli_ffn_e2m1 + 8), p);
        return t;
    }
    __m256 z = _mm256_set1_ps((float)coli_ffn_zero_at(m, o, g));
    __m256 sc = _mm256_set1_ps(coli_ffn_scale_at(m, o * m->groups + g));
    t.lo = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(IOTA), z), sc);
    t.hi = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(IOTA + 8), z), sc);
    return t;
}

/* As zeros8_512: one word. */
AVX2 INLINE __m256 zeros8_256(const uint8_t *p) {
    int32_t w;
    memcpy(&w, p, sizeof w);
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xf)));
}

/* 8 scales from index i on, as scales_512. */
AVX2 INLINE __m256 scales_256(ColiScaleFormat f, const uint8_t *scales, int64_t i) {
    if (f == COLI_SCALE_F32) return _mm256_loadu_ps((const float *)(scales + 4 * i));
    __m128i h = _mm_loadu_si128((const __m128i *)(scales + 2 * i));
    if (f == COLI_SCALE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#define SFX 256
#define L 8
#define vzeros8 zeros8_256
#define vload_scales scales_256
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
#define nib_biased nib_biased_256
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

/* ------------------------------------------------------------ conversions */

/* Word indices: EO64's (evens of 64, then odds) and Q128's (input 4i + s
 * of the first 64 (i < 16) or of the second 64 (i >= 16), both from two
 * vectors of 32). */
static const uint16_t EO_EVEN[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                     32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};

/* coli_f32_to_bf16 of 16 floats, as 32-bit lanes (the value in the high
 * half, the low half zero). */
AVX512 INLINE __m512i bf16_bits_512(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));  /* NaN: quiet */
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

/* 32 floats at v as 32 bfloat16 words, in order; lo (when not NULL): the
 * words of the rounding of what is left of each (the split's low part). */
AVX512 INLINE __m512i bf16_words_512(const float *v, __m512i *lo) {
    __m512i a = bf16_bits_512(_mm512_loadu_ps(v)), b = bf16_bits_512(_mm512_loadu_ps(v + 16));
    const __m512i pack = _mm512_add_epi16(_mm512_loadu_si512(EO_EVEN), _mm512_set1_epi16(1));
    if (lo) {
        __m512i la = bf16_bits_512(_mm512_sub_ps(_mm512_loadu_ps(v), _mm512_castsi512_ps(a)));
        __m512i lb = bf16_bits_512(_mm512_sub_ps(_mm512_loadu_ps(v + 16), _mm512_castsi512_ps(b)));
        *lo = _mm512_permutex2var_epi16(la, pack, lb);
    }
    return _mm512_permutex2var_epi16(a, pack, b);
}

/* One block of 128 bfloat16 words (natural order, w[0..3]) into the order. */
AVX512 INLINE void order_words_512(int order, const __m512i w[4], uint16_t *dst) {
    if (order == COLI_FFN_ORDER_PLAIN) {
        for (int j = 0; j < 4; j++) _mm512_storeu_si512(dst + 32 * j, w[j]);
        return;
    }
    const __m512i even = _mm512_loadu_si512(EO_EVEN), one = _mm512_set1_epi16(1);
    if (order == COLI_FFN_ORDER_G8) {  /* word 8a + 2j + b is input 8a + j + 4b */
        __m512i i = _mm512_srli_epi16(even, 1), b = _mm512_and_si512(i, one);
        __m512i idx = _mm512_add_epi16(_mm512_and_si512(i, _mm512_set1_epi16(~7)),
                                       _mm512_add_epi16(_mm512_srli_epi16(_mm512_and_si512(i, _mm512_set1_epi16(7)), 1),
                                                        _mm512_slli_epi16(b, 2)));
        for (int j = 0; j < 4; j++) _mm512_storeu_si512(dst + 32 * j, _mm512_permutexvar_epi16(idx, w[j]));
        return;
    }
    if (order == COLI_FFN_ORDER_EO64) {
        for (int h = 0; h < 2; h++) {
            _mm512_storeu_si512(dst + 64 * h, _mm512_permutex2var_epi16(w[2 * h], even, w[2 * h + 1]));
            _mm512_storeu_si512(dst + 64 * h + 32, _mm512_permutex2var_epi16(
                                                       w[2 * h], _mm512_add_epi16(even, one), w[2 * h + 1]));
        }
        return;
    }
    /* Q128: word i of vector s is input 4i + s: i < 16 from w0, w1 (index
     * 4i + s), i >= 16 from w2, w3 (index 4(i - 16) + s). */
    __m512i quad = _mm512_slli_epi16(_mm512_and_si512(_mm512_loadu_si512(EO_EVEN), _mm512_set1_epi16(31)), 1);
    for (int s = 0; s < 4; s++) {
        __m512i idx = _mm512_add_epi16(quad, _mm512_set1_epi16((short)s));
        __m512i a = _mm512_permutex2var_epi16(w[0], idx, w[1]);
        __m512i b = _mm512_permutex2var_epi16(w[2], idx, w[3]);
        _mm512_storeu_si512(dst + 32 * s, _mm512_mask_blend_epi16(0xffff0000u, a, b));
    }
}

AVX512 static void put512(int x_type, int x_order, const float *v, int64_t i0, int64_t blocks,
                          void *row, int64_t half) {
    for (int64_t b = 0; b < blocks; b++, v += COLI_FFN_PAD) {
        int64_t at = i0 + b * COLI_FFN_PAD;
        if (x_type == COLI_FFN_X_F32) {  /* EO64 floats */
            float *dst = (float *)row + at;
            const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
            for (int h = 0; h < 2; h++) {
                const float *s = v + 64 * h;
                for (int q = 0; q < 2; q++) {
                    __m512 a = _mm512_loadu_ps(s + 32 * q), c = _mm512_loadu_ps(s + 32 * q + 16);
                    _mm512_storeu_ps(dst + 64 * h + 16 * q, _mm512_permutex2var_ps(a, ev, c));
                    _mm512_storeu_ps(dst + 64 * h + 32 + 16 * q, _mm512_permutex2var_ps(a, od, c));
                }
            }
            continue;
        }
        __m512i w[4], lo[4];
        int split = x_type == COLI_FFN_X_BF16_SPLIT;
        for (int j = 0; j < 4; j++) w[j] = bf16_words_512(v + 32 * j, split ? &lo[j] : NULL);
        order_words_512(x_order, w, (uint16_t *)row + at);
        if (split) order_words_512(x_order, lo, (uint16_t *)row + half + at);
    }
}

AVX512 static void to_bf16_512(const float *v, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits_512(_mm512_loadu_ps(v + i)), 16)));
    for (; i < n; i++) dst[i] = coli_f32_to_bf16(v[i]);
}

AVX512 static void from_bf16_512(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_si512(dst + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                         _mm256_loadu_si256((const __m256i *)(src + i))), 16));
    for (; i < n; i++) dst[i] = coli_bf16_to_f32(src[i]);
}

const ColiFfnConv coli_ffn_conv_avx512 = {put512, to_bf16_512, from_bf16_512};

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

static const ColiFfnKernel K512_INT4_BF16 = {"int4-i16/avx512", COLI_FFN_X_BF16,
                                              COLI_FFN_ORDER_Q128, 0, 1, qs_scratch, qs_run_x};
static const ColiFfnKernel K512_INT4_SPLIT = {"int4-i16/avx512", COLI_FFN_X_BF16_SPLIT,
                                               COLI_FFN_ORDER_Q128, 0, 1, qs_scratch, qs_run_split};
static const ColiFfnKernel K512_GPTQ_BF16 = {"gptq-i16/avx512", COLI_FFN_X_BF16, COLI_FFN_ORDER_G8,
                                              0, 16, gx_scratch, gx_run_x};
static const ColiFfnKernel K512_GPTQ_SPLIT = {"gptq-i16/avx512", COLI_FFN_X_BF16_SPLIT,
                                               COLI_FFN_ORDER_G8, 0, 16, gx_scratch, gx_run_split};
static const ColiFfnKernel K512_GPTQ_ACT_BF16 = {"gptq-act-i16/avx512", COLI_FFN_X_BF16,
                                                  COLI_FFN_ORDER_PLAIN, 0, 16, ga_scratch, ga_run_x};
static const ColiFfnKernel K512_GPTQ_ACT_SPLIT = {"gptq-act-i16/avx512", COLI_FFN_X_BF16_SPLIT,
                                                   COLI_FFN_ORDER_PLAIN, 0, 16, ga_scratch, ga_run_split};
static const ColiFfnKernel K512_AWQ_BF16 = {"awq-i16/avx512", COLI_FFN_X_BF16, COLI_FFN_ORDER_PLAIN,
                                             0, 128, gx_scratch, gx_run_x};
static const ColiFfnKernel K512_AWQ_SPLIT = {"awq-i16/avx512", COLI_FFN_X_BF16_SPLIT,
                                              COLI_FFN_ORDER_PLAIN, 0, 128, gx_scratch, gx_run_split};
static const ColiFfnKernel K512_MXFP4_BF16 = {"mxfp4-i16/avx512", COLI_FFN_X_BF16,
                                               COLI_FFN_ORDER_EO64, 0, 1, mi_scratch, mi_run_x};
static const ColiFfnKernel K512_MXFP4_SPLIT = {"mxfp4-i16/avx512", COLI_FFN_X_BF16_SPLIT,
                                                COLI_FFN_ORDER_EO64, 0, 1, mi_scratch, mi_run_split};

const ColiFfnKernel *coli_ffn_kernel_avx512(const ColiFfnMat *m, int input) {
    if (!coli_ffn_format_computed(m->format, m->in_out)) return NULL;
    int bf16 = input != COLI_FFN_INPUT_F32 && coli_ffn_cpu_runs_i16();
    int split = input == COLI_FFN_INPUT_ACT;
    switch (m->format) {
    case COLI_TENSOR_FP4_NATIVE_BLOCK:
        if (bf16) return split ? &K512_MXFP4_SPLIT : &K512_MXFP4_BF16;
        return &K512_MXFP4;
    case COLI_TENSOR_INT4_BLOCK:
        if (bf16 && qs_takes(m)) return split ? &K512_INT4_SPLIT : &K512_INT4_BF16;
        return &K512_INT4;
    case COLI_TENSOR_INT4_GPTQ:
        if (bf16 && gq_takes(m)) return split ? &K512_GPTQ_SPLIT : &K512_GPTQ_BF16;
        if (bf16 && ga_takes(m)) return split ? &K512_GPTQ_ACT_SPLIT : &K512_GPTQ_ACT_BF16;
        return m->g_idx ? &K512_GPTQ_ACT : &K512_GPTQ;
    case COLI_TENSOR_INT4_AWQ:
        if (bf16 && aq_takes(m)) return split ? &K512_AWQ_SPLIT : &K512_AWQ_BF16;
        return &K512_AWQ;
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

int coli_ffn_cpu_runs_i16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
}

#endif /* x86 */
