/*
 * decode_attention.c: coli_decode_attention (decode_attention.h).
 *
 * Each thread takes a run of query heads. For one head: the query in
 * float32 times the scale, its scores against the n keys into a per-thread
 * row, the softmax's maximum and sum, then the values weighted by
 * exp(score - max) and divided by the sum. The AVX-512 path does the same
 * sums 16 lanes at a time (so its float32 results differ from the scalar
 * path's in rounding only) with a polynomial exp accurate to about 2 ulp.
 */
#include "decode_attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "coli_errors.h"
#include "compute_pool.h"
#include "ffn_internal.h"   /* coli_bf16_to_f32, coli_f32_to_bf16 */
#include "tensor.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ATTN_X86 1
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
#endif

typedef struct {
    const ColiDecodeAttention *a;
    int isa;
    float *scratch;             /* per thread: for up to four heads, n scores, d and dv floats */
    int64_t scratch_floats;
} Job;

static float load(const void *p, int64_t i, int bf16) {
    return bf16 ? coli_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void store(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = coli_f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* ---- scalar ---------------------------------------------------------- */

static void head_scalar(const ColiDecodeAttention *a, int64_t b, int64_t h, float *s, float *qf,
                        float *acc) {
    const int bf16 = a->format == COLI_TENSOR_BF16;
    const int64_t g = h / (a->heads / a->kv_heads), row = b * a->heads + h;
    for (int64_t i = 0; i < a->d; i++) qf[i] = load(a->q, row * a->d + i, bf16) * a->scale;
    float max = -INFINITY;
    for (int64_t j = 0; j < a->n; j++) {
        const int64_t at = b * a->k_batch + g * a->k_head + j * a->k_token;
        float dot = 0.0f;
        for (int64_t i = 0; i < a->d; i++) dot += qf[i] * load(a->k, at + i, bf16);
        s[j] = dot;
        if (dot > max) max = dot;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < a->n; j++) {
        s[j] = expf(s[j] - max);
        sum += s[j];
    }
    for (int64_t i = 0; i < a->dv; i++) acc[i] = 0.0f;
    for (int64_t j = 0; j < a->n; j++) {
        const int64_t at = b * a->v_batch + g * a->v_head + j * a->v_token;
        for (int64_t i = 0; i < a->dv; i++) acc[i] += s[j] * load(a->v, at + i, bf16);
    }
    for (int64_t i = 0; i < a->dv; i++) store(a->out, row * a->dv + i, acc[i] / sum, bf16);
}

/* ---- AVX-512 --------------------------------------------------------- */

#ifdef ATTN_X86
static AVX512 __m512 load16(const void *p, int64_t i, __mmask16 m, int bf16) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Key and value rows are read once per call, in order, and usually cold
 * (a decode step streams a layer's expert weights between two calls).
 * Without a hint each row waited for memory: 68-77 us cold against 14 us
 * warm over 302 positions. So each loop asks for the row ROWS_AHEAD rows
 * on, every cache line of it, while it computes this one, and never for a
 * row past the last. */
#define ROWS_AHEAD 16

/* always inlined: GCC may find a function that only prefetches pure and
 * drop its calls */
static inline __attribute__((always_inline)) AVX512 void prefetch_row(const void *p, int64_t at, int64_t count, int bf16) {
    const char *row = (const char *)p + at * (bf16 ? 2 : 4);
    const int64_t bytes = count * (bf16 ? 2 : 4);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
}

static AVX512 __mmask16 lanes(int64_t left) {
    if (left <= 0) return 0;
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* exp(x) for x <= 0: 2^k e^r with k = round(x / ln 2), |r| <= ln 2 / 2, and
 * e^r by its Taylor polynomial to r^7 (error below 2^-24 relative). */
static AVX512 __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860682030941723e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}

/* row[j] = exp(row[j] - max) for j < n; returns their sum. */
static AVX512 float exp_row(float *row, int64_t n, float max) {
    const __m512 top = _mm512_set1_ps(max);
    __m512 sums = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = lanes(n - j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), top));
        _mm512_mask_storeu_ps(row + j, m, e);
        sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(sums);
}

/* q . k for one key row, the scaled query in qf (d floats, 16-padded). */
static AVX512 float dot_row(const float *qf, const void *k, int64_t at, int64_t d, int bf16) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i), load16(k, at + i, 0xFFFF, bf16), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i + 16), load16(k, at + i + 16, 0xFFFF, bf16), s1);
    }
    for (; i < d; i += 16) {
        const __mmask16 m = lanes(d - i);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qf + i), load16(k, at + i, m, bf16), s0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

/* acc[0, w) = sum over j of s[j] v[row j][c, c + w), w <= 64, the four
 * 16-float sums held in registers across the keys. */
static AVX512 void weigh_values(const ColiDecodeAttention *a, int64_t base, const float *s, int64_t c,
                                int64_t w, float *acc) {
    const int bf16 = a->format == COLI_TENSOR_BF16;
    const __mmask16 m0 = lanes(w), m1 = lanes(w - 16), m2 = lanes(w - 32), m3 = lanes(w - 48);
    __m512 y0 = _mm512_setzero_ps(), y1 = _mm512_setzero_ps(), y2 = _mm512_setzero_ps(),
           y3 = _mm512_setzero_ps();
    for (int64_t j = 0; j < a->n; j++) {
        const int64_t at = base + j * a->v_token + c;
        if (j + ROWS_AHEAD < a->n) prefetch_row(a->v, at + ROWS_AHEAD * a->v_token, w, bf16);
        const __m512 p = _mm512_set1_ps(s[j]);
        y0 = _mm512_fmadd_ps(p, load16(a->v, at, m0, bf16), y0);
        if (w > 16) y1 = _mm512_fmadd_ps(p, load16(a->v, at + 16, m1, bf16), y1);
        if (w > 32) y2 = _mm512_fmadd_ps(p, load16(a->v, at + 32, m2, bf16), y2);
        if (w > 48) y3 = _mm512_fmadd_ps(p, load16(a->v, at + 48, m3, bf16), y3);
    }
    _mm512_mask_storeu_ps(acc, m0, y0);
    if (w > 16) _mm512_mask_storeu_ps(acc + 16, m1, y1);
    if (w > 32) _mm512_mask_storeu_ps(acc + 32, m2, y2);
    if (w > 48) _mm512_mask_storeu_ps(acc + 48, m3, y3);
}

static AVX512 void head_avx512(const ColiDecodeAttention *a, int64_t b, int64_t h, float *s, float *qf,
                               float *acc) {
    const int bf16 = a->format == COLI_TENSOR_BF16;
    const int64_t g = h / (a->heads / a->kv_heads), row = b * a->heads + h;
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int64_t i = 0; i < a->d; i += 16) {
        const __mmask16 m = lanes(a->d - i);
        _mm512_storeu_ps(qf + i, _mm512_maskz_mov_ps(m, _mm512_mul_ps(load16(a->q, row * a->d + i, m, bf16),
                                                                       scale)));
    }
    float max = -INFINITY;
    const int64_t kbase = b * a->k_batch + g * a->k_head;
    for (int64_t j = 0; j < a->n; j++) {
        if (j + ROWS_AHEAD < a->n) prefetch_row(a->k, kbase + (j + ROWS_AHEAD) * a->k_token, a->d, bf16);
        s[j] = dot_row(qf, a->k, kbase + j * a->k_token, a->d, bf16);
        max = s[j] > max ? s[j] : max;
    }
    const float sum = exp_row(s, a->n, max);
    const int64_t vbase = b * a->v_batch + g * a->v_head;
    for (int64_t c = 0; c < a->dv; c += 64)
        weigh_values(a, vbase, s, c, a->dv - c < 64 ? a->dv - c : 64, acc + c);
    for (int64_t i = 0; i < a->dv; i++) store(a->out, row * a->dv + i, acc[i] / sum, bf16);
}

/* Four query heads h0 .. h0 + 3 of one key/value head g, each key and value
 * row read once for the four. s holds 4 x n scores, qf 4 scaled queries
 * (each 16-padded, dq floats apart), acc 4 x 16-padded dv sums. */
static AVX512 void four_heads_avx512(const ColiDecodeAttention *a, int64_t b, int64_t h0, float *s, float *qf,
                                     float *acc) {
    const int bf16 = a->format == COLI_TENSOR_BF16;
    const int64_t g = h0 / (a->heads / a->kv_heads), n = a->n, d = a->d;
    const int64_t dq = (d + 15) / 16 * 16, da = (a->dv + 15) / 16 * 16;
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int64_t r = 0; r < 4; r++)
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 m = lanes(d - i);
            const __m512 x = load16(a->q, (b * a->heads + h0 + r) * d + i, m, bf16);
            _mm512_storeu_ps(qf + r * dq + i, _mm512_maskz_mov_ps(m, _mm512_mul_ps(x, scale)));
        }
    float max[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    const int64_t kbase = b * a->k_batch + g * a->k_head;
    for (int64_t j = 0; j < n; j++) {
        const int64_t at = kbase + j * a->k_token;
        if (j + ROWS_AHEAD < n) prefetch_row(a->k, at + ROWS_AHEAD * a->k_token, d, bf16);
        __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps(), t2 = _mm512_setzero_ps(),
               t3 = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            const __m512 kv = load16(a->k, at + i, lanes(d - i), bf16);
            t0 = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i), kv, t0);
            t1 = _mm512_fmadd_ps(_mm512_loadu_ps(qf + dq + i), kv, t1);
            t2 = _mm512_fmadd_ps(_mm512_loadu_ps(qf + 2 * dq + i), kv, t2);
            t3 = _mm512_fmadd_ps(_mm512_loadu_ps(qf + 3 * dq + i), kv, t3);
        }
        const float v[4] = {_mm512_reduce_add_ps(t0), _mm512_reduce_add_ps(t1), _mm512_reduce_add_ps(t2),
                            _mm512_reduce_add_ps(t3)};
        for (int r = 0; r < 4; r++) {
            s[r * n + j] = v[r];
            max[r] = v[r] > max[r] ? v[r] : max[r];
        }
    }
    float sum[4];
    for (int r = 0; r < 4; r++) sum[r] = exp_row(s + r * n, n, max[r]);
    const int64_t vbase = b * a->v_batch + g * a->v_head;
    for (int64_t c = 0; c < a->dv; c += 32) {
        const __mmask16 m0 = lanes(a->dv - c), m1 = lanes(a->dv - c - 16);
        __m512 y00 = _mm512_setzero_ps(), y01 = _mm512_setzero_ps(), y10 = _mm512_setzero_ps(),
               y11 = _mm512_setzero_ps(), y20 = _mm512_setzero_ps(), y21 = _mm512_setzero_ps(),
               y30 = _mm512_setzero_ps(), y31 = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const int64_t at = vbase + j * a->v_token + c;
            if (j + ROWS_AHEAD < n)
                prefetch_row(a->v, at + ROWS_AHEAD * a->v_token, a->dv - c < 32 ? a->dv - c : 32, bf16);
            const __m512 v0 = load16(a->v, at, m0, bf16), v1 = load16(a->v, at + 16, m1, bf16);
            __m512 p = _mm512_set1_ps(s[j]);
            y00 = _mm512_fmadd_ps(p, v0, y00);
            y01 = _mm512_fmadd_ps(p, v1, y01);
            p = _mm512_set1_ps(s[n + j]);
            y10 = _mm512_fmadd_ps(p, v0, y10);
            y11 = _mm512_fmadd_ps(p, v1, y11);
            p = _mm512_set1_ps(s[2 * n + j]);
            y20 = _mm512_fmadd_ps(p, v0, y20);
            y21 = _mm512_fmadd_ps(p, v1, y21);
            p = _mm512_set1_ps(s[3 * n + j]);
            y30 = _mm512_fmadd_ps(p, v0, y30);
            y31 = _mm512_fmadd_ps(p, v1, y31);
        }
        _mm512_storeu_ps(acc + c, y00);
        _mm512_storeu_ps(acc + da + c, y10);
        _mm512_storeu_ps(acc + 2 * da + c, y20);
        _mm512_storeu_ps(acc + 3 * da + c, y30);
        if (a->dv - c > 16) {
            _mm512_storeu_ps(acc + c + 16, y01);
            _mm512_storeu_ps(acc + da + c + 16, y11);
            _mm512_storeu_ps(acc + 2 * da + c + 16, y21);
            _mm512_storeu_ps(acc + 3 * da + c + 16, y31);
        }
    }
    for (int r = 0; r < 4; r++) {
        const int64_t row = b * a->heads + h0 + r;
        for (int64_t i = 0; i < a->dv; i++) store(a->out, row * a->dv + i, acc[r * da + i] / sum[r], bf16);
    }
}
#endif

/* ---- the call -------------------------------------------------------- */

/* A unit is four query heads of one key/value head where the AVX-512 path
 * runs and each group is a multiple of four, else one head. */
static int64_t unit_heads(const Job *job) {
    const ColiDecodeAttention *a = job->a;
    return job->isa == COLI_FFN_ISA_AVX512 && (a->heads / a->kv_heads) % 4 == 0 ? 4 : 1;
}

static void run_heads(void *ctx, int thread, int threads) {
    const Job *job = ctx;
    const ColiDecodeAttention *a = job->a;
    const int64_t per = unit_heads(job), units = a->batch * a->heads / per;
    const int64_t lo = units * thread / threads, hi = units * (thread + 1) / threads;
    float *s = job->scratch + (size_t)thread * (size_t)job->scratch_floats;
    float *qf = s + 4 * ((a->n + 15) / 16 * 16), *acc = qf + 4 * ((a->d + 15) / 16 * 16);
    for (int64_t u = lo; u < hi; u++) {
        const int64_t b = u * per / a->heads, h = u * per % a->heads;
#ifdef ATTN_X86
        if (per == 4) {
            four_heads_avx512(a, b, h, s, qf, acc);
            continue;
        }
        if (job->isa == COLI_FFN_ISA_AVX512) {
            head_avx512(a, b, h, s, qf, acc);
            continue;
        }
#endif
        head_scalar(a, b, h, s, qf, acc);
    }
}

static int check(const ColiDecodeAttention *a, char *err, size_t err_len) {
    if (!a || !a->q || !a->k || !a->v || !a->out)
        return coli_fail(err, err_len, COLI_EINVAL, "decode attention: NULL operand");
    if (a->format != COLI_TENSOR_F32 && a->format != COLI_TENSOR_BF16)
        return coli_fail(err, err_len, COLI_EINVAL, "decode attention: float32 or bfloat16 values, not format %d",
                         a->format);
    if (a->batch < 1 || a->heads < 1 || a->kv_heads < 1 || a->heads % a->kv_heads || a->n < 1 || a->d < 1 ||
        a->dv < 1)
        return coli_fail(err, err_len, COLI_EINVAL, "decode attention: batch %lld, %lld heads over %lld key/value "
                         "heads (a multiple), %lld cached positions, head sizes %lld and %lld: each at least 1",
                         (long long)a->batch, (long long)a->heads, (long long)a->kv_heads, (long long)a->n,
                         (long long)a->d, (long long)a->dv);
    if (a->k_token < a->d || a->v_token < a->dv || a->k_head < 0 || a->v_head < 0 || a->k_batch < 0 ||
        a->v_batch < 0)
        return coli_fail(err, err_len, COLI_EINVAL, "decode attention: key and value rows must not overlap "
                         "(token strides %lld and %lld for head sizes %lld and %lld)", (long long)a->k_token,
                         (long long)a->v_token, (long long)a->d, (long long)a->dv);
    const size_t size = a->format == COLI_TENSOR_BF16 ? 2 : 4;
    const uintptr_t o0 = (uintptr_t)a->out, o1 = o0 + (uintptr_t)(a->batch * a->heads * a->dv) * size;
    const uintptr_t q0 = (uintptr_t)a->q, q1 = q0 + (uintptr_t)(a->batch * a->heads * a->d) * size;
    if (o0 < q1 && q0 < o1) return coli_fail(err, err_len, COLI_EINVAL, "decode attention: out overlaps q");
    return 0;
}

int coli_decode_attention(const ColiDecodeAttention *a, ColiComputePool *pool, char *err, size_t err_len) {
    int rc = check(a, err, err_len);
    if (rc) return rc;
    int isa = a->isa == COLI_FFN_ISA_AUTO ? coli_ffn_isa_default(err, err_len) : a->isa;
    if (isa < 0) return isa;
    if (!coli_ffn_isa_supported(isa))
        return coli_fail(err, err_len, COLI_EINVAL, "decode attention: kernel path %d is not one this CPU and "
                         "build can run", isa);
    /* for four heads: n scores, the scaled query and the sums, each padded to 16 floats */
    Job job = {a, isa, NULL, 4 * ((a->n + 15) / 16 + (a->d + 15) / 16 + (a->dv + 15) / 16) * 16};
    job.scratch = malloc(sizeof(float) * (size_t)job.scratch_floats * (size_t)coli_compute_pool_threads(pool));
    if (!job.scratch)
        return coli_fail(err, err_len, COLI_ENOMEM, "decode attention: out of memory for %lld scores",
                         (long long)a->n);
    coli_compute_pool_run(pool, run_heads, &job);   /* threads past the last head find none */
    free(job.scratch);
    return 0;
}
