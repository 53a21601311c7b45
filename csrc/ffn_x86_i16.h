/*
 * ffn_x86_i16.h (private, included once by ffn_x86.c): what the AVX-512
 * kernels of bfloat16 calls share (int4: ffn_x86_int4.h; GPTQ and AWQ:
 * ffn_x86_gx.h; MXFP4: ffn_x86_mxfp4.h), on CPUs with AVX512_BF16 and
 * AVX512_VNNI (every CPU with the first has the second).
 *
 * They multiply 16-bit integers with vpdpwssd (two products per 32-bit
 * lane and instruction, exact), not bfloat16 pairs with vdpbf16ps: on the
 * Intel Xeon they were measured on, vdpbf16ps issues one per two cycles
 * and vpdpwssd two per cycle (0.57 against 0.15 ns per instruction), so
 * the same 32 products cost a quarter as much, and down needs no split of
 * its activations into two bfloat16 parts.
 *
 * Inputs come as the driver writes them for a bfloat16 kernel, in the
 * kernel's order: the call's bfloat16 tokens (gate and up), or down's
 * float activations as a high and a low bfloat16 part (16 significant
 * bits). Each kernel quantises them per token and block of inputs to
 * 16-bit integers a = rint(v 2^k), k the power of two that puts the
 * block's largest magnitude m in [2^14, 2^15): every input within 2^-15 m
 * of its value. The block's scale 2^-k is exact; a block of zeros has
 * scale 0, one holding a NaN or an infinity scale NaN (its outputs are
 * NaN). Integer sums do not depend on the order of their products, so a
 * kernel may walk rows and tokens as it likes and a token's bits still do
 * not depend on its batch.
 */

#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))

/* The int4 kernel's AMX part (ffn_x86_amx.h), with compilers that know
 * AMX (GCC 11, Clang 12). */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define COLI_AMX 1
#define AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,amx-tile,amx-int8")))
#else
#define COLI_AMX 0
#endif

/* Rows a streaming kernel walks side by side. */
enum { I16_ROWS = 4 };

/* How far ahead streaming kernels prefetch: cold weights need about 8 KiB
 * in flight for one thread to read at the memory's streaming rate
 * (measured: 2 KiB reads 25-35% slower). */
enum { I16_AHEAD = COLI_FFN_PREFETCH };

/* The distance of whole groups of rows (group_bytes each) of at least
 * I16_AHEAD bytes. */
static int64_t rows_ahead(int64_t group_bytes) {
    int64_t k = (I16_AHEAD + group_bytes - 1) / group_bytes;
    return (k < 1 ? 1 : k) * group_bytes;
}

/* The same distance in rows (of row_bytes), whole groups of I16_ROWS:
 * how far ahead a streaming kernel prefetches its rows' params. */
static int64_t i16_params_ahead(int64_t row_bytes) {
    return I16_ROWS * (rows_ahead(I16_ROWS * row_bytes) / (I16_ROWS * row_bytes));
}

/* Bytes [b0, b1) of p into L1, a line at a time.
 *
 * A function that only prefetches looks free of effects to GCC: a plain
 * static one is found pure and its calls dropped (GCC 12 -O2 removed
 * every scale prefetch of the MXFP4 kernel). Such helpers are INLINE, so
 * they are part of their caller before that analysis. */
INLINE void i16_prefetch_bytes(const void *p, int64_t b0, int64_t b1) {
    for (int64_t b = b0 & ~(int64_t)63; b < b1; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* Rows o .. o + I16_ROWS - 1 (those before n1) of a table of row_bytes a
 * row into L1: a group of rows' params, a stream of their own that the
 * rows' prefetch does not cover. */
INLINE void i16_prefetch_rows(const void *p, int64_t row_bytes, int64_t o, int64_t n1) {
    if (o >= n1) return;
    int64_t end = o + I16_ROWS < n1 ? o + I16_ROWS : n1;
    i16_prefetch_bytes(p, o * row_bytes, end * row_bytes);
}

/* Scales of format f from element i on (k: the lanes to load) as floats. */
VNNI INLINE __m512 qs_scales(ColiScaleFormat f, const uint8_t *scales, int64_t i, __mmask16 k) {
    if (f == COLI_SCALE_F32) return _mm512_maskz_loadu_ps(k, scales + 4 * i);
    __m256i h = _mm256_maskz_loadu_epi16(k, scales + 2 * i);
    if (f == COLI_SCALE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 (k: those to load) bfloat16 inputs at p, with their low parts `part`
 * on when ns is 2, as floats. */
VNNI INLINE __m512 i16_widen(const uint16_t *p, int64_t part, int ns, __mmask16 k) {
    __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
    if (ns == 2)
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p + part)), 16)));
    return v;
}

/* A token's n inputs quantised in segments of seg (see the top): xq the
 * same positions, zero on to ldq; per segment its scale sx and sum A. */
VNNI static void i16_quantise(const uint16_t *x, int64_t part, int ns, int64_t n, int64_t seg,
                           int64_t ldq, int16_t *xq, float *sx, int32_t *A) {
    for (int64_t s0 = 0, i = 0; s0 < n; s0 += seg, i++) {
        int64_t len = n - s0 < seg ? n - s0 : seg;
        __m512 mx = _mm512_setzero_ps();
        __mmask16 bad = 0;
        for (int64_t j = 0; j < len; j += 16) {
            __mmask16 k = len - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - j)) - 1);
            __m512 a = _mm512_abs_ps(i16_widen(x + s0 + j, part, ns, k));
            bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ);  /* NaN or infinite */
            mx = _mm512_max_ps(mx, a);
        }
        float top = _mm512_reduce_max_ps(mx);
        if (bad || top == 0.0f) {
            memset(xq + s0, 0, sizeof(int16_t) * (size_t)len);
            sx[i] = bad ? NAN : 0.0f;
            A[i] = 0;
            continue;
        }
        int e;
        (void)frexpf(top, &e);  /* top in [2^(e-1), 2^e) */
        const __m512 kf = _mm512_set1_ps((float)(15 - e));
        __m512i sum = _mm512_setzero_si512();
        for (int64_t j = 0; j < len; j += 16) {
            __mmask16 k = len - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - j)) - 1);
            __m512i a = _mm512_cvt_roundps_epi32(_mm512_scalef_ps(i16_widen(x + s0 + j, part, ns, k), kf),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            a = _mm512_min_epi32(_mm512_max_epi32(a, _mm512_set1_epi32(-32767)), _mm512_set1_epi32(32767));
            _mm512_mask_cvtepi32_storeu_epi16(xq + s0 + j, k, a);
            sum = _mm512_add_epi32(sum, a);
        }
        sx[i] = ldexpf(1.0f, e - 15);
        A[i] = _mm512_reduce_add_epi32(sum);
    }
    for (int64_t j = n; j < ldq; j++) xq[j] = 0;
}

/* A kernel's two entries, from its rows function (name##_rows: ns input
 * parts): the call's bfloat16 tokens, and down's split activations. */
#define I16_ENTRIES(name)                                                                    \
    static void name##_run_x(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) { \
        name##_rows(m, n0, n1, task, 1);                                                     \
    }                                                                                        \
    static void name##_run_split(const ColiFfnMat *m, int64_t n0, int64_t n1,                \
                                 const ColiFfnTask *task) {                                  \
        name##_rows(m, n0, n1, task, 2);                                                     \
    }

/* Four rows' lane sums p[r] to units: lane 4j + r holds lanes 4j .. 4j + 3
 * of p[r] (row r's quarter j). */
VNNI INLINE __m512i i16_quarters4(__m512i p0, __m512i p1, __m512i p2, __m512i p3) {
    __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
    __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p2, p3), _mm512_unpackhi_epi32(p2, p3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

/* Four tokens' units (i16_quarters4's) by pairs of 128-bit blocks: lane
 * 4t + r of *first holds token t's blocks 0 + 1 of row r, of *second its
 * blocks 2 + 3. */
VNNI INLINE void i16_block_pairs4(__m512i t0, __m512i t1, __m512i t2, __m512i t3, __m512i *first, __m512i *second) {
    __m512i s01 = _mm512_add_epi32(_mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
    __m512i s23 = _mm512_add_epi32(_mm512_shuffle_i32x4(t2, t3, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_i32x4(t2, t3, _MM_SHUFFLE(3, 1, 3, 1)));
    *first = _mm512_shuffle_i32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0));
    *second = _mm512_shuffle_i32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1));
}

/* Lanes 4i .. 4i + 3 take element i of four (vpermd indices: 4i + r lanes
 * of a token of four, or of a quarter). */
static const int32_t I16_FOURS[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};

/* The stride of a table of per-token values of each block of inputs,
 * block after block (tokens rounded up to 4, plus 4: a vector of four from
 * any token on, zero past them). */
static int64_t i16_table_stride(int tokens) { return coli_ffn_round_up(tokens, 4) + 4; }

/* A table of n 32-bit values per token (token t's at src + t ld), value
 * after value, tp apart, zero past the tokens. */
static void i16_table32(const void *src, int64_t ld, int64_t n, int tokens, void *table, int64_t tp) {
    memset(table, 0, 4 * (size_t)(n * tp));
    for (int t = 0; t < tokens; t++)
        for (int64_t i = 0; i < n; i++)
            memcpy((char *)table + 4 * (i * tp + t), (const char *)src + 4 * (t * ld + i), 4);
}

/* AMX tiles (ffn_x86_amx.h): 16 rows of 64 bytes, 16 tokens a tile;
 * QA_PANEL tiles of rows share each block's input tiles (a Mixtral expert
 * at 16 tokens: two as fast as four or one loading them for every tile,
 * eight 30% slower: more rows' streams from memory at once). */
enum { QA_ROWS = 16, QA_TOKENS = 16, QA_TILE = 1024, QA_PANEL = 2 };
/* The pipeline of the AMX loops: a tile is decoded QA_LAG steps before it
 * multiplies and its sums are added QA_LAG steps after, in QA_BUFS
 * buffers of each. */
enum { QA_LAG = 2, QA_BUFS = QA_LAG + 1 };

/* The next block of tokens of a streaming kernel (4, 2 or 1 of the left
 * ones), and the index of its function (0, 1, 2 for 1, 2, 4). */
static int i16_block(int left, int *index) {
    int tb = left >= 4 ? 4 : left >= 2 ? 2 : 1;
    *index = tb == 4 ? 2 : tb - 1;
    return tb;
}
