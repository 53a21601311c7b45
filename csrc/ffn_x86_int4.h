/*
 * ffn_x86_int4.h (private, included once by ffn_x86.c after
 * ffn_x86_i16.h): the AVX-512 kernel for compressed-tensors int4 (groups of
 * a multiple of 32) in a bfloat16 call, with 16-bit integer products (see
 * ffn_x86_i16.h); for more than one token with AMX tiles where the CPU and
 * the OS offer them (ffn_x86_amx.h).
 *
 * Inputs in Q128 order (inside each 128 inputs, input 4i + s at 32s + i),
 * quantised per token and chunk of 128 inputs.
 *
 * Weights: 64 bytes read as 32 16-bit words hold a chunk's 128 nibbles;
 * vector n_s = every word's nibble s (a shift and a mask, no table), which
 * pairs with the inputs' vector s. One token's stream instead splits each
 * input into two bytes and multiplies bytes (qi_bytes, QI_SUM1): the same
 * integer sums. Lane l of a chunk's integer products covers inputs
 * 8l .. 8l + 7 (a quarter of 32 inputs is lanes 4j .. 4j + 3).
 *
 * Sum, per (token, output): per scale unit (a chunk, or for groups that are
 * not a multiple of 128 a quarter of one), P = the exact integer sum of its
 * products q a (q the stored nibble, a the quantised input), A = the exact
 * sum of its a, D = P - z A (z the unit's group's zero point, 8 without
 * zero points; |D| < 2^26, exact), and a = fma(float(D), S * 2^-k, a)
 * chunk after chunk, S the unit's weight scale and 2^-k the chunk's input
 * scale. With quarters each of a chunk's four quarter positions j has its
 * own a_j, and the result is (a_0 + a_1) + (a_2 + a_3); else it is a.
 *
 * D is the same integer however it is summed, so every loop below (one
 * token streaming four rows, tiles of up to four tokens, AMX tiles of
 * sixteen) gives a token the same bits, whatever its batch.
 */

typedef struct {
    const ColiFfnMat *m;
    int64_t row_bytes, chunks;  /* chunks of 128 inputs */
    int64_t whole;              /* chunks holding 128 inputs (the last may hold fewer) */
    __mmask64 tail;             /* the bytes of a last partial chunk */
    int quarters;               /* scales per quarter (groups not a multiple of 128) */
    int64_t aw;                 /* units of a chunk: 1, or 4 with quarters */
    int64_t st;                 /* S (and z) of a group of rows: per chunk, I16_ROWS * aw */
    int64_t kl;                 /* input scales of a token: chunks rounded up to 16 */
    int64_t al;                 /* input sums A of a token: aw per chunk, rounded up to 16 */
} QsInfo;

static QsInfo qs_info(const ColiFfnMat *m) {
    QsInfo q;
    memset(&q, 0, sizeof q);
    q.m = m;
    q.row_bytes = m->n_in / 2;
    q.chunks = (m->n_in + 127) / 128;
    q.whole = m->n_in / 128;
    int64_t tail = (m->n_in % 128) / 2;
    q.tail = tail ? (((__mmask64)1 << tail) - 1) : 0;
    q.quarters = m->group % 128 != 0;
    q.aw = q.quarters ? 4 : 1;
    q.st = I16_ROWS * q.aw * coli_ffn_round_up(q.chunks, 16);
    q.kl = coli_ffn_round_up(q.chunks, 16);
    q.al = q.aw * q.kl;
    return q;
}

/* 16 chunks' values of four rows (v[r]: row r's) in S's order: chunk c's
 * at 4c + r. */
VNNI INLINE void qs_interleave_rows(const __m512 v[I16_ROWS], float *out) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512i first = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
    const __m512i second = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
    __m512d ab[2] = {_mm512_castps_pd(_mm512_permutex2var_ps(v[0], lo, v[1])),
                     _mm512_castps_pd(_mm512_permutex2var_ps(v[0], hi, v[1]))};
    __m512d cd[2] = {_mm512_castps_pd(_mm512_permutex2var_ps(v[2], lo, v[3])),
                     _mm512_castps_pd(_mm512_permutex2var_ps(v[2], hi, v[3]))};
    for (int h = 0; h < 2; h++) {
        _mm512_storeu_pd((double *)(out + 32 * h), _mm512_permutex2var_pd(ab[h], first, cd[h]));
        _mm512_storeu_pd((double *)(out + 32 * h + 16), _mm512_permutex2var_pd(ab[h], second, cd[h]));
    }
}

/* 16 quarters' (four chunks') values of four rows in S's order: quarter j
 * of chunk c at 16c + 4j + r. */
VNNI INLINE void qs_interleave_quarters(const __m512 v[I16_ROWS], float *out) {
    __m512 t0 = _mm512_unpacklo_ps(v[0], v[1]), t1 = _mm512_unpackhi_ps(v[0], v[1]);
    __m512 t2 = _mm512_unpacklo_ps(v[2], v[3]), t3 = _mm512_unpackhi_ps(v[2], v[3]);
    __m512 u0 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
    __m512 u1 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
    __m512 u2 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
    __m512 u3 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
    __m512 e0 = _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(1, 0, 1, 0));
    __m512 e1 = _mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(1, 0, 1, 0));
    __m512 e2 = _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 2, 3, 2));
    __m512 e3 = _mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(3, 2, 3, 2));
    _mm512_storeu_ps(out, _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(out + 16, _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_ps(out + 32, _mm512_shuffle_f32x4(e2, e3, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(out + 48, _mm512_shuffle_f32x4(e2, e3, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 16 units' values of four rows into S's (or z's) order at out. */
VNNI INLINE void qs_interleave(const QsInfo *q, const __m512 v[I16_ROWS], float *out) {
    if (q->quarters) qs_interleave_quarters(v, out);
    else qs_interleave_rows(v, out);
}

/* Groups of 128 or 32 inputs (one unit a group): the rows' params 16
 * groups at a time up to end (a multiple of 16), whole vectors (zero past
 * the groups). F: the scale format, a constant where called. */
VNNI INLINE void qs_group_rows(const QsInfo *q, int64_t o0, int nr, float *ps, ColiScaleFormat f, int64_t end,
                               int with_z) {
    const ColiFfnMat *m = q->m;
    int32_t *z = (int32_t *)(ps + q->st);
    for (int64_t g = 0; g < end; g += 16) {
        int64_t n = m->groups - g;
        __mmask16 k = n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0;
        __m512 sc[I16_ROWS], zv[I16_ROWS];
        for (int r = 0; r < I16_ROWS; r++) {
            int64_t o = o0 + (r < nr ? r : 0);
            __m512i zi = _mm512_set1_epi32(8);
            sc[r] = qs_scales(f, m->scales, o * m->groups + g, k);
            if (m->zeros) {
                const uint8_t *zw = m->zeros + 4 * ((o / 8) * m->groups);
                __m512i w = _mm512_srli_epi32(_mm512_maskz_loadu_epi32(k, zw + 4 * g), (unsigned)(4 * (o % 8)));
                zi = _mm512_and_si512(w, _mm512_set1_epi32(0xf));
            }
            zv[r] = _mm512_castsi512_ps(zi);
        }
        /* 16 chunks (or four chunks' quarters): 64 values at 4g */
        qs_interleave(q, sc, ps + 4 * g);
        if (with_z) qs_interleave(q, zv, (float *)z + 4 * g);
    }
}

/* Params of rows o0 .. o0 + I16_ROWS - 1 (those past nr repeat the first),
 * 2 st values: the rows' scales S per unit (chunk c's at 4c + r; with
 * quarters, quarter j of chunk c's at 16c + 4j + r), then their zero
 * points z as int32 in the same order (zero past the units). Unless
 * whole, the values past the units' last block of 16 may be left as they
 * are (one token's stream reads no further; a small model's padding to
 * 16 chunks was half of the work), and without zero points z is not
 * written (one token's stream uses the stored 8 as a constant: the same
 * integers, without a transpose of 8s per block of rows). */
VNNI static void qs_params(const QsInfo *q, int64_t o0, int nr, float *ps, int whole) {
    const ColiFfnMat *m = q->m;
    if (m->group == 128 || m->group == 32) {
        int64_t end = whole ? q->st / I16_ROWS : coli_ffn_round_up(q->aw * q->chunks, 16);
        int with_z = whole || m->zeros;
        switch (m->scale_format) {
        case COLI_SCALE_F32: qs_group_rows(q, o0, nr, ps, COLI_SCALE_F32, end, with_z); return;
        case COLI_SCALE_F16: qs_group_rows(q, o0, nr, ps, COLI_SCALE_F16, end, with_z); return;
        default: qs_group_rows(q, o0, nr, ps, COLI_SCALE_BF16, end, with_z); return;
        }
    }
    int32_t *z = (int32_t *)(ps + q->st);
    memset(ps, 0, sizeof(float) * (size_t)(2 * q->st));
    for (int r = 0; r < I16_ROWS; r++) {
        int64_t o = o0 + (r < nr ? r : 0);
        for (int64_t u = 0; u < (q->quarters ? (m->n_in + 31) / 32 : q->chunks); u++) {
            int64_t g = (q->quarters ? 32 : 128) * u / m->group;  /* its group */
            int64_t at = q->quarters ? 16 * (u / 4) + 4 * (u % 4) + r : 4 * u + r;
            ps[at] = coli_ffn_scale_at(m, o * m->groups + g);
            z[at] = coli_ffn_zero_at(m, o, g);
        }
    }
}

/* Every token's inputs quantised per chunk (i16_quantise): per token,
 * chunks * 128 int16 at xq, the chunks' scales at sx (kl each), and the
 * units' exact sums at A (al each: per chunk, or per quarter from its
 * lanes: lane l of a chunk's vectors holds inputs 8l .. 8l + 7). */
VNNI static void qi_prepare(const QsInfo *q, const uint16_t *x, int64_t ldx, int64_t part, int ns,
                            int tokens, int16_t *xq, float *sx, int32_t *A) {
    const int64_t ldq = 128 * q->chunks;
    const __m512i ones = _mm512_set1_epi16(1);
    for (int t = 0; t < tokens; t++) {
        int16_t *dq = xq + t * ldq;
        int32_t *at = A + t * q->al;
        i16_quantise(x + t * ldx, part, ns, ldq, 128, ldq, dq, sx + t * q->kl, at);
        if (!q->quarters) continue;
        for (int64_t c = 0; c < q->chunks; c++) {
            __m512i lanes = _mm512_setzero_si512();
            for (int v = 0; v < 4; v++)
                lanes = _mm512_dpwssd_epi32(lanes, _mm512_loadu_si512(dq + 128 * c + 32 * v), ones);
            int32_t l[16];
            _mm512_storeu_si512(l, lanes);
            for (int j = 0; j < 4; j++) at[4 * c + j] = l[4 * j] + l[4 * j + 1] + l[4 * j + 2] + l[4 * j + 3];
        }
    }
}

/* One token's stream of int4 in groups of 32 without zero points reads
 * its scales where stored, a chunk at a time, instead of qs_params's
 * table: that table's conversion, transposes, stores and loads (four
 * scales a chunk) cost a third of the stream's time. sr[r]: row r's first
 * scale. */
static const int32_t QI_TRANSPOSE4[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

/* Quarters: the scales of groups g .. g + 3 (k: those that exist) of the
 * four rows, quarter j of row r at 4j + r (zero where k is off). */
VNNI INLINE __m512 qi_scales16(ColiScaleFormat f, const uint8_t *const sr[I16_ROWS], int64_t g, __mmask8 k) {
    __m512 v;
    if (f == COLI_SCALE_F32) {
        /* the lane immediates spelled out: unoptimised (sanitizer) builds do not unroll */
        v = _mm512_castps128_ps512(_mm_maskz_loadu_ps(k, sr[0] + 4 * g));
        v = _mm512_insertf32x4(v, _mm_maskz_loadu_ps(k, sr[1] + 4 * g), 1);
        v = _mm512_insertf32x4(v, _mm_maskz_loadu_ps(k, sr[2] + 4 * g), 2);
        v = _mm512_insertf32x4(v, _mm_maskz_loadu_ps(k, sr[3] + 4 * g), 3);
    } else {
        __m128i a = _mm_unpacklo_epi64(_mm_maskz_loadu_epi16(k, sr[0] + 2 * g), _mm_maskz_loadu_epi16(k, sr[1] + 2 * g));
        __m128i b = _mm_unpacklo_epi64(_mm_maskz_loadu_epi16(k, sr[2] + 2 * g), _mm_maskz_loadu_epi16(k, sr[3] + 2 * g));
        __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
        v = f == COLI_SCALE_F16 ? _mm512_cvtph_ps(h)
                                : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_permutexvar_ps(_mm512_loadu_si512(QI_TRANSPOSE4), v);
}

/* Chunk CI of row r decoded into n[4]. WHOLE: it holds 128 inputs. */
#define QI_DECODE(n, r, CI, WHOLE)                                                           \
    do {                                                                                     \
        const uint8_t *src_ = rows[r] + 64 * (CI);                                           \
        __m512i w_ = WHOLE ? _mm512_loadu_si512(src_) : _mm512_maskz_loadu_epi8(q->tail, src_); \
        /* the group of rows' bytes in order, not four streams (measured faster) */          \
        if (ahead) ffn_prefetch2((const char *)rows[0] + 64 * (I16_ROWS * (CI) + (r)), ahead); \
        n[0] = _mm512_and_si512(w_, lo);                                                     \
        n[1] = _mm512_and_si512(_mm512_srli_epi16(w_, 4), lo);                               \
        n[2] = _mm512_and_si512(_mm512_srli_epi16(w_, 8), lo);                               \
        n[3] = _mm512_srli_epi16(w_, 12);                                                    \
    } while (0)

/* Token t's integer sums of chunk CI with the decoded n, per lane. */
#define QI_SUM(N, t, CI)                                                                     \
    _mm512_dpwssd_epi32(                                                                     \
        _mm512_dpwssd_epi32(                                                                 \
            _mm512_dpwssd_epi32(                                                             \
                _mm512_madd_epi16((N)[0], _mm512_loadu_si512(xq + (t) * ldq + 128 * (CI))),    \
                (N)[1], _mm512_loadu_si512(xq + (t) * ldq + 128 * (CI) + 32)),                 \
            (N)[2], _mm512_loadu_si512(xq + (t) * ldq + 128 * (CI) + 64)),                     \
        (N)[3], _mm512_loadu_si512(xq + (t) * ldq + 128 * (CI) + 96))

/* Four tokens' quarters (i16_quarters4's) to chunks: lane 4t + r holds
 * token t's sum of row r. */
VNNI INLINE __m512i qi_chunks4(__m512i t0, __m512i t1, __m512i t2, __m512i t3) {
    __m512i first, second;
    i16_block_pairs4(t0, t1, t2, t3, &first, &second);
    return _mm512_add_epi32(first, second);
}

/* A (row, token)'s result from its sums as the loops leave them (v: the
 * token's, I16_ROWS * aw floats: row r's at r, or quarter j's at 4j + r). */
static inline float qi_result(const QsInfo *q, const float *v, int r) {
    return q->quarters ? (v[r] + v[4 + r]) + (v[8 + r] + v[12 + r]) : v[r];
}

/* One token's inputs of a chunk as bytes, in place of its Q128 int16
 * (qi_bytes): each a = 256 h + l, h = a >> 8 signed and l = a & 255
 * unsigned, of the even inputs (2b at byte b) then the odd ones, which is
 * how a chunk's 64 weight bytes hold them (low nibble of byte b: input 2b,
 * high nibble: 2b + 1). Four vectors of 64 bytes: l even, h even, l odd,
 * h odd. */
enum { QI_L_EVEN = 0, QI_H_EVEN = 64, QI_L_ODD = 128, QI_H_ODD = 192 };

/* vpermt2w indices: the even inputs of a Q128 chunk from its vectors 0
 * and 2 (inputs 4i and 4i + 2), or the odd ones from 1 and 3, in two
 * halves of 32. */
static const int16_t QI_EVEN_FIRST[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                          8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const int16_t QI_EVEN_SECOND[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                           24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

VNNI static void qi_bytes(const QsInfo *q, int16_t *xq) {
    const __m512i first = _mm512_loadu_si512(QI_EVEN_FIRST), second = _mm512_loadu_si512(QI_EVEN_SECOND);
    for (int64_t c = 0; c < q->chunks; c++) {
        int16_t *x = xq + 128 * c;
        __m512i v[4];
        for (int s = 0; s < 4; s++) v[s] = _mm512_loadu_si512(x + 32 * s);
        for (int odd = 0; odd < 2; odd++) {
            __m512i a0 = _mm512_permutex2var_epi16(v[odd], first, v[odd + 2]);
            __m512i a1 = _mm512_permutex2var_epi16(v[odd], second, v[odd + 2]);
            __m512i l = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a0)),
                                           _mm512_cvtepi16_epi8(a1), 1);
            __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(a0, 8))),
                                           _mm512_cvtepi16_epi8(_mm512_srai_epi16(a1, 8)), 1);
            _mm512_storeu_si512((uint8_t *)x + 128 * odd, l);
            _mm512_storeu_si512((uint8_t *)x + 128 * odd + 64, h);
        }
    }
}

/* One token's integer sums of chunk CI of row r, per lane, from the bytes
 * of qi_bytes: sum q (256 h + l) = 256 (sum q h) + sum l q, each a
 * vpdpbusd of 64 products (nibbles unsigned times h signed; l unsigned
 * times nibbles, 0 .. 15, as signed bytes): the exact sums of the int16
 * products in fewer instructions. */
#define QI_SUM1(P, r, CI, WHOLE)                                                             \
    do {                                                                                     \
        const uint8_t *src_ = rows[r] + 64 * (CI);                                           \
        const uint8_t *xb_ = (const uint8_t *)xq + 256 * (CI);                               \
        __m512i w_ = WHOLE ? _mm512_loadu_si512(src_) : _mm512_maskz_loadu_epi8(q->tail, src_); \
        if (ahead) ffn_prefetch2((const char *)rows[0] + 64 * (I16_ROWS * (CI) + (r)), ahead); \
        __m512i e_ = _mm512_and_si512(w_, lo8), o_ = _mm512_and_si512(_mm512_srli_epi16(w_, 4), lo8); \
        __m512i h_ = _mm512_dpbusd_epi32(_mm512_setzero_si512(), e_, _mm512_loadu_si512(xb_ + QI_H_EVEN)); \
        h_ = _mm512_dpbusd_epi32(h_, o_, _mm512_loadu_si512(xb_ + QI_H_ODD));                  \
        h_ = _mm512_dpbusd_epi32(_mm512_slli_epi32(h_, 8), _mm512_loadu_si512(xb_ + QI_L_EVEN), e_); \
        (P) = _mm512_dpbusd_epi32(h_, _mm512_loadu_si512(xb_ + QI_L_ODD), o_);                 \
    } while (0)

/* One token, four rows side by side: chunk CI. */
#define QI_CHUNK1(CI, WHOLE)                                                                 \
    do {                                                                                     \
        __m512i p[I16_ROWS];                                                                  \
        UNROLL for (int r = 0; r < I16_ROWS; r++) QI_SUM1(p[r], r, CI, WHOLE);                \
        __m512i u_ = i16_quarters4(p[0], p[1], p[2], p[3]);                                   \
        __m512 x_ = _mm512_set1_ps(sx[CI]);                                                  \
        if (QUARTERS_) {                                                                     \
            __m512i a_ = _mm512_permutexvar_epi32(fours, _mm512_castsi128_si512(             \
                                                             _mm_loadu_si128((const __m128i *)(A + 4 * (CI))))); \
            __m512i d_ = _mm512_sub_epi32(u_, Z_ ? _mm512_mullo_epi32(_mm512_loadu_si512(z + 16 * (CI)), a_) \
                                                 : _mm512_slli_epi32(a_, 3));                 \
            __m512 s_ = Z_ ? _mm512_loadu_ps(ps + 16 * (CI))                                 \
                           : qi_scales16(f, sr, 4 * (CI), WHOLE ? (__mmask8)0xf : tail4);    \
            cq = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_), _mm512_mul_ps(s_, x_), cq);         \
        } else {                                                                             \
            __m256i h_ = _mm256_add_epi32(_mm512_castsi512_si256(u_), _mm512_extracti64x4_epi64(u_, 1)); \
            __m128i s_ = _mm_add_epi32(_mm256_castsi256_si128(h_), _mm256_extracti128_si256(h_, 1)); \
            s_ = _mm_sub_epi32(s_, Z_ ? _mm_mullo_epi32(_mm_loadu_si128((const __m128i *)(z + 4 * (CI))), \
                                                        _mm_set1_epi32(A[CI]))               \
                                      : _mm_set1_epi32(8 * A[CI]));                          \
            cn = _mm_fmadd_ps(_mm_cvtepi32_ps(s_),                                           \
                              _mm_mul_ps(_mm_loadu_ps(ps + 4 * (CI)), _mm512_castps512_ps128(x_)), cn); \
        }                                                                                    \
    } while (0)

/* One token: rows o0 .. o0 + nr - 1 over every chunk (xq: the token's
 * inputs as qi_bytes leaves them; sx, A: its). ZEROS: the rows' zero
 * points z are read from qs_params's table ps (else every one is the
 * stored 8, a shift of A, and qs_params left z unwritten). Scales S: from
 * ps too, but with QUARTERS and without ZEROS (groups of 32) where stored
 * (qi_scales16), in format FMT (a constant: no branch a chunk). */
#define QI_STREAM(QUARTERS, ZEROS, FMT, NAME)                                                \
    VNNI static void qi_stream_##QUARTERS##ZEROS##NAME(const QsInfo *q, int64_t o0, int nr,  \
                                                       const int16_t *xq, const float *sx,   \
                                                       const int32_t *A, const float *ps, float *dst) { \
        enum { QUARTERS_ = QUARTERS, Z_ = ZEROS };                                           \
        const __m512i lo8 = _mm512_set1_epi8(0xf), fours = _mm512_loadu_si512(I16_FOURS);     \
        const int64_t ahead = rows_ahead(I16_ROWS * q->row_bytes);                           \
        const int32_t *z = (const int32_t *)(ps + q->st);                                    \
        const ColiScaleFormat f = FMT;                                                       \
        const int64_t ss = f == COLI_SCALE_F32 ? 4 : 2, left = q->m->groups - 4 * q->whole;  \
        const __mmask8 tail4 = (__mmask8)(left >= 4 ? 0xf : left > 0 ? (1u << left) - 1 : 0); \
        const uint8_t *rows[I16_ROWS], *sr[I16_ROWS];                                         \
        (void)fours, (void)z, (void)tail4;                                                   \
        UNROLL for (int r = 0; r < I16_ROWS; r++) {                                           \
            int64_t o_ = o0 + (r < nr ? r : 0);                                              \
            rows[r] = q->m->data + o_ * q->row_bytes;                                        \
            sr[r] = (const uint8_t *)q->m->scales + ss * o_ * q->m->groups;                  \
        }                                                                                    \
        __m512 cq = _mm512_setzero_ps();                                                     \
        __m128 cn = _mm_setzero_ps();                                                        \
        for (int64_t ci = 0; ci < q->whole; ci++) QI_CHUNK1(ci, 1);                          \
        if (q->whole < q->chunks) QI_CHUNK1(q->whole, 0);                                    \
        float v[16];                                                                         \
        if (QUARTERS_) _mm512_storeu_ps(v, cq);                                              \
        else _mm_storeu_ps(v, cn);                                                           \
        for (int r = 0; r < nr; r++) dst[o0 + r] = qi_result(q, v, r);                       \
    }
QI_STREAM(0, 0, q->m->scale_format, )
QI_STREAM(0, 1, q->m->scale_format, )
QI_STREAM(1, 0, COLI_SCALE_BF16, _bf16)
QI_STREAM(1, 0, COLI_SCALE_F16, _f16)
QI_STREAM(1, 0, COLI_SCALE_F32, _f32)
QI_STREAM(1, 1, q->m->scale_format, )
#undef QI_STREAM
#undef QI_CHUNK1
#undef QI_SUM1

/* TB tokens, four rows: chunk CI (the rows decoded once for the block). */
#define QI_CHUNKT(CI, WHOLE)                                                                 \
    do {                                                                                     \
        __m512i n[I16_ROWS][4];                                                               \
        UNROLL for (int r = 0; r < I16_ROWS; r++) QI_DECODE(n[r], r, CI, WHOLE);              \
        if (QUARTERS_) {                                                                     \
            __m512 s_ = _mm512_loadu_ps(ps + 16 * (CI));                                     \
            __m512i z_ = _mm512_loadu_si512(z + 16 * (CI));                                  \
            UNROLL for (int t = 0; t < TB_; t++) {                                           \
                __m512i u_ = i16_quarters4(QI_SUM(n[0], t, CI), QI_SUM(n[1], t, CI),           \
                                          QI_SUM(n[2], t, CI), QI_SUM(n[3], t, CI));          \
                __m512i a_ = _mm512_permutexvar_epi32(fours, _mm512_castsi128_si512(_mm_loadu_si128( \
                                                                 (const __m128i *)(A + t * q->al + 4 * (CI))))); \
                u_ = _mm512_sub_epi32(u_, _mm512_mullo_epi32(z_, a_));                       \
                cq[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u_),                              \
                                        _mm512_mul_ps(s_, _mm512_set1_ps(sx[t * q->kl + (CI)])), cq[t]); \
            }                                                                                \
        } else {                                                                             \
            __m512i u_[4];                                                                   \
            UNROLL for (int t = 0; t < 4; t++)                                               \
                u_[t] = t < TB_ ? i16_quarters4(QI_SUM(n[0], t, CI), QI_SUM(n[1], t, CI),      \
                                               QI_SUM(n[2], t, CI), QI_SUM(n[3], t, CI))      \
                                : _mm512_setzero_si512();                                    \
            __m512i a_ = _mm512_permutexvar_epi32(fours, _mm512_castsi128_si512(             \
                                                             _mm_loadu_si128((const __m128i *)(at + (CI) * tp)))); \
            __m512i d_ = _mm512_sub_epi32(qi_chunks4(u_[0], u_[1], u_[2], u_[3]),            \
                                          _mm512_mullo_epi32(_mm512_broadcast_i32x4(         \
                                                                 _mm_loadu_si128((const __m128i *)(z + 4 * (CI)))), a_)); \
            __m512 s_ = _mm512_broadcast_f32x4(_mm_loadu_ps(ps + 4 * (CI)));                 \
            __m512 x_ = _mm512_permutexvar_ps(fours, _mm512_castps128_ps512(_mm_loadu_ps(sxt + (CI) * tp))); \
            cn = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_), _mm512_mul_ps(s_, x_), cn);          \
        }                                                                                    \
    } while (0)

/* A tile: rows o0 .. o0 + nr - 1, chunks [c0, c1), TB tokens (xq, sx, A:
 * theirs; sxt, at: their chunk scales and sums, chunk after chunk, tp
 * apart), their sums carried in acc (token t's I16_ROWS * aw floats at
 * acc + t * I16_ROWS * aw) from the tile before. The rows' bytes come from
 * L2 (see qs_tiles): no prefetch of them here. */
#define QI_TILE(TB, QUARTERS)                                                                \
    VNNI static void qi_tile_##TB##_##QUARTERS(                                              \
        const QsInfo *q, int64_t o0, int nr, int64_t c0, int64_t c1, const int16_t *xq,     \
        int64_t ldq, const float *sx, const int32_t *A, const float *sxt, const int32_t *at, \
        int64_t tp, const float *ps, float *acc) {                                           \
        enum { TB_ = TB, QUARTERS_ = QUARTERS, ahead = 0 };                                  \
        const __m512i lo = _mm512_set1_epi16(0xf), fours = _mm512_loadu_si512(I16_FOURS);     \
        const int32_t *z = (const int32_t *)(ps + q->st);                                    \
        const uint8_t *rows[I16_ROWS];                                                        \
        (void)sxt, (void)at, (void)tp, (void)A, (void)sx;                                    \
        UNROLL for (int r = 0; r < I16_ROWS; r++)                                             \
            rows[r] = q->m->data + (o0 + (r < nr ? r : 0)) * q->row_bytes;                   \
        const __mmask16 mine = (__mmask16)((1u << (4 * TB)) - 1);                           \
        __m512 cq[TB], cn = _mm512_maskz_loadu_ps(mine, acc);                                \
        UNROLL for (int t = 0; t < TB; t++) cq[t] = QUARTERS ? _mm512_loadu_ps(acc + 16 * t) : cn; \
        int64_t w1 = c1 < q->whole ? c1 : q->whole;                                          \
        for (int64_t ci = c0; ci < w1; ci++) QI_CHUNKT(ci, 1);                               \
        if (c1 > q->whole) QI_CHUNKT(q->whole, 0);                                           \
        if (QUARTERS) {                                                                      \
            UNROLL for (int t = 0; t < TB; t++) _mm512_storeu_ps(acc + 16 * t, cq[t]);       \
        } else {                                                                             \
            _mm512_mask_storeu_ps(acc, mine, cn);                                            \
        }                                                                                    \
    }
#define QI_TILES(Q) QI_TILE(1, Q) QI_TILE(2, Q) QI_TILE(4, Q)
QI_TILES(0)
QI_TILES(1)
#undef QI_TILES
#undef QI_TILE
#undef QI_CHUNKT
#undef QI_SUM
#undef QI_DECODE

typedef void (*QiTileFn)(const QsInfo *q, int64_t o0, int nr, int64_t c0, int64_t c1,
                         const int16_t *xq, int64_t ldq, const float *sx, const int32_t *A,
                         const float *sxt, const int32_t *at, int64_t tp, const float *ps, float *acc);
/* By quarters, then by block: 1, 2 and 4 tokens. */
static const QiTileFn QI_TILE_FNS[2][3] = {
    {qi_tile_1_0, qi_tile_2_0, qi_tile_4_0}, {qi_tile_1_1, qi_tile_2_1, qi_tile_4_1}};

/* Tiles of more than one token: rows in panels of about QI_PANEL bytes
 * (they stay in L2 while every block of tokens runs over them), inputs in
 * slices of QI_SLICE chunks (a block of four tokens' slice, 16 KiB, stays
 * in L1 while the panel's rows run over it), at most QI_TOKENS tokens'
 * sums at a time. */
enum { QI_PANEL = 256 * 1024, QI_SLICE = 16, QI_TOKENS = 16 };

static int64_t qi_panel_rows(const QsInfo *q, int64_t n) {
    int64_t rp = QI_PANEL / q->row_bytes / I16_ROWS * I16_ROWS;
    if (rp < I16_ROWS) rp = I16_ROWS;
    n = coli_ffn_round_up(n, I16_ROWS);
    return rp < n ? rp : n;
}

/* The tables of the tokens' chunk scales sx (kl per token) and, without
 * quarters, chunk sums A (al per token): chunk after chunk, tp apart. */
static void qi_fill_tables(const QsInfo *q, const float *sx, const int32_t *A, int tokens, float *sxt,
                           int32_t *at, int64_t tp) {
    i16_table32(sx, q->kl, q->chunks, tokens, sxt, tp);
    if (q->quarters) memset(at, 0, sizeof(int32_t) * (size_t)(q->chunks * tp));
    else i16_table32(A, q->al, q->chunks, tokens, at, tp);
}

/* Lines [l0, l1) of bytes at p into L2. */
INLINE void qi_prefetch_l2(const char *p, int64_t l0, int64_t l1) {
    for (int64_t l = l0; l < l1; l++) _mm_prefetch(p + 64 * l, _MM_HINT_T1);
}

/* Calls qs_tiles makes over a panel of rows (nr rows) for tokens tokens. */
static int64_t qi_tile_calls(const QsInfo *q, int64_t nr, int tokens) {
    int64_t blocks = 0;
    for (int t0 = 0, fn; t0 < tokens;) t0 += i16_block(tokens - t0, &fn), blocks++;
    return ((nr + I16_ROWS - 1) / I16_ROWS) * ((q->chunks + QI_SLICE - 1) / QI_SLICE) * blocks;
}

/* The inputs of a call, quantised (qi_prepare's), and their chunk tables
 * (qi_fill_tables'). */
typedef struct {
    const int16_t *xq;
    int64_t ldq;
    const float *sx;
    const int32_t *A;
    const float *sxt;
    const int32_t *at;
    int64_t tp;
} QiInputs;

/* Rows [n0, n1) for more than one token, in tiles (see QI_PANEL): the
 * next panel's bytes go into L2 a share per tile, the first's at once. */
static void qs_tiles(const QsInfo *q, int64_t n0, int64_t n1, const ColiFfnTask *task,
                     const QiInputs *in, float *ps, float *acc) {
    const int64_t rp = qi_panel_rows(q, n1 - n0), ga = I16_ROWS * q->aw;
    const char *data = (const char *)q->m->data;
    qi_prefetch_l2(data + n0 * q->row_bytes, 0, ((n0 + rp < n1 ? rp : n1 - n0) * q->row_bytes + 63) / 64);
    for (int64_t p0 = n0; p0 < n1; p0 += rp) {
        int64_t p1 = p0 + rp < n1 ? p0 + rp : n1, p2 = p1 + rp < n1 ? p1 + rp : n1;
        int64_t lines = ((p2 - p1) * q->row_bytes + 63) / 64, done = 0;
        int64_t calls = qi_tile_calls(q, p1 - p0, task->tokens), share = (lines + calls - 1) / calls;
        const char *next = data + p1 * q->row_bytes;
        for (int64_t o0 = p0; o0 < p1; o0 += I16_ROWS)
            qs_params(q, o0, p1 - o0 < I16_ROWS ? (int)(p1 - o0) : I16_ROWS, ps + (o0 - p0) / I16_ROWS * 2 * q->st, 1);
        for (int tg = 0; tg < task->tokens; tg += QI_TOKENS) {
            int nt = task->tokens - tg < QI_TOKENS ? task->tokens - tg : QI_TOKENS;
            memset(acc, 0, sizeof(float) * (size_t)((p1 - p0 + I16_ROWS - 1) / I16_ROWS * nt * ga));
            for (int64_t c0 = 0; c0 < q->chunks; c0 += QI_SLICE) {
                int64_t c1 = c0 + QI_SLICE < q->chunks ? c0 + QI_SLICE : q->chunks;
                for (int t0 = tg, fn; t0 < tg + nt;) {
                    int tb = i16_block(tg + nt - t0, &fn);
                    for (int64_t o0 = p0; o0 < p1; o0 += I16_ROWS) {
                        int nr = p1 - o0 < I16_ROWS ? (int)(p1 - o0) : I16_ROWS;
                        int64_t g = (o0 - p0) / I16_ROWS, upto = done + share < lines ? done + share : lines;
                        qi_prefetch_l2(next, done, upto);
                        done = upto;
                        QI_TILE_FNS[q->quarters][fn](q, o0, nr, c0, c1, in->xq + t0 * in->ldq, in->ldq,
                                                     in->sx + t0 * q->kl, in->A + t0 * q->al, in->sxt + t0,
                                                     in->at + t0, in->tp, ps + g * 2 * q->st,
                                                     acc + (g * nt + t0 - tg) * ga);
                    }
                    t0 += tb;
                }
            }
            for (int64_t o0 = p0; o0 < p1; o0 += I16_ROWS) {
                int64_t g = (o0 - p0) / I16_ROWS;
                for (int r = 0; r < I16_ROWS && o0 + r < p1; r++)
                    for (int t = 0; t < nt; t++)
                        task->dst[(tg + t) * task->ld_dst + o0 + r] = qi_result(q, acc + (g * nt + t) * ga, r);
            }
        }
    }
}

/* The scales (and zero points) of rows o .. o + I16_ROWS - 1 into L1: a
 * stream of their own the rows' prefetch does not cover (with groups of
 * 32 and bfloat16 scales, an eighth of a row's bytes; left to demand
 * misses, measured a quarter of a cold expert's time). */
INLINE void qs_prefetch_params(const QsInfo *q, int64_t o, int64_t n1) {
    const ColiFfnMat *m = q->m;
    if (o >= n1) return;
    i16_prefetch_rows(m->scales, m->groups * (m->scale_format == COLI_SCALE_F32 ? 4 : 2), o, n1);
    if (m->zeros && o % 8 < I16_ROWS)  /* eight rows' zero points share a row of words */
        for (int64_t b = 0; b < 4 * m->groups; b += 64)
            _mm_prefetch((const char *)m->zeros + 4 * (o / 8) * m->groups + b, _MM_HINT_T0);
}

/* More than one token with AMX (ffn_x86_amx.h): 16 rows and up to 16
 * tokens a tile, a chunk at a time (qa_rows) or a quarter (qq_rows). */
#if COLI_AMX
AMX static void qa_inputs(const QsInfo *q, const int16_t *xq, int64_t ldq, int tokens, uint8_t *b);
AMX static void qa_rows(const QsInfo *q, int64_t n0, int64_t n1, const ColiFfnTask *task, const QiInputs *in,
                        const uint8_t *b, float *ps, float *acc, uint8_t *w);
AMX static void qq_rows(const QsInfo *q, int64_t n0, int64_t n1, const ColiFfnTask *task, const QiInputs *in,
                        const uint8_t *b, float *ps, float *acc, uint8_t *w);
#endif

/* The scratch of a call (offsets in bytes from the first, 64-byte aligned):
 * the tokens' quantised inputs, their chunk scales and unit sums, the
 * params of a panel of rows (of QA_PANEL tiles of rows at least), the sums
 * of its tiles (for AMX, 16 floats a row at least), the chunk tables; with
 * AMX, the inputs' tiles and QA_BUFS chunks' weight and sum tiles. */
typedef struct {
    size_t sx, A, ps, acc, sxt, at, tiles, amx, total;
} QsScratch;

static QsScratch qs_layout(const QsInfo *q, int64_t n0, int64_t n1, int tokens) {
    QsScratch s;
    int64_t groups = qi_panel_rows(q, n1 - n0) / I16_ROWS, nt = tokens < QI_TOKENS ? tokens : QI_TOKENS;
    int64_t per_group = nt * I16_ROWS * q->aw > 256 ? nt * I16_ROWS * q->aw : 256;  /* AMX: 16 floats a row (64 with quarters) */
    if (groups < QA_PANEL * QA_ROWS / I16_ROWS) groups = QA_PANEL * QA_ROWS / I16_ROWS;
    s.sx = sizeof(int16_t) * (size_t)(tokens * 128 * q->chunks);
    s.A = s.sx + sizeof(float) * (size_t)(tokens * q->kl);
    s.ps = s.A + sizeof(int32_t) * (size_t)(tokens * q->al);
    s.acc = s.ps + sizeof(float) * (size_t)(groups * 2 * q->st);
    s.sxt = s.acc + sizeof(float) * (size_t)(groups * per_group);
    s.at = s.sxt + sizeof(float) * (size_t)(q->chunks * i16_table_stride(tokens));
    s.tiles = (s.at + sizeof(int32_t) * (size_t)(q->chunks * i16_table_stride(tokens)) + 63) / 64 * 64;
    s.amx = s.tiles + (size_t)((tokens + QA_TOKENS - 1) / QA_TOKENS * q->chunks) * 4 * QA_TILE;
    s.total = s.amx + QA_BUFS * 10 * QA_TILE;  /* with quarters: 2 KiB of A tiles, 8 KiB of sums */
    return s;
}

static size_t qs_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    QsInfo q = qs_info(m);
    return qs_layout(&q, n0, n1, tokens).total;
}

typedef void (*QiStreamFn)(const QsInfo *, int64_t, int, const int16_t *, const float *, const int32_t *,
                           const float *, float *);

static void qs_rows(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    QsInfo q = qs_info(m);
    /* the params' stream as far ahead as the rows' (whole blocks of rows) */
    const int64_t pa = i16_params_ahead(q.row_bytes);
    const int64_t ldq = 128 * q.chunks;
    QsScratch at = qs_layout(&q, n0, n1, task->tokens);
    uint8_t *base = task->scratch;
    int16_t *xq = (int16_t *)base;
    float *sx = (float *)(base + at.sx), *ps = (float *)(base + at.ps), *acc = (float *)(base + at.acc);
    int32_t *A = (int32_t *)(base + at.A);
    int64_t part = ns == 2 ? task->ldx / 2 : 0;
    qi_prepare(&q, (const uint16_t *)task->x, task->ldx, part, ns, task->tokens, xq, sx, A);
    if (task->tokens > 1) {
        QiInputs in = {xq, ldq, sx, A, (float *)(base + at.sxt), (int32_t *)(base + at.at),
                       i16_table_stride(task->tokens)};
        qi_fill_tables(&q, sx, A, task->tokens, (float *)(base + at.sxt), (int32_t *)(base + at.at), in.tp);
#if COLI_AMX
        if (coli_ffn_amx_usable()) {
            qa_inputs(&q, xq, ldq, task->tokens, base + at.tiles);
            (q.quarters ? qq_rows : qa_rows)(&q, n0, n1, task, &in, base + at.tiles, ps, acc, base + at.amx);
            return;
        }
#endif
        qs_tiles(&q, n0, n1, task, &in, ps, acc);
        return;
    }
    /* zero points read where stored, or where qs_params's generic path
     * wrote them; groups of 32 without them read their scales themselves */
    int zeros = m->zeros || (m->group != 128 && m->group != 32);
    qi_bytes(&q, xq);
    QiStreamFn own_scales = m->scale_format == COLI_SCALE_F32 ? qi_stream_10_f32
                            : m->scale_format == COLI_SCALE_F16 ? qi_stream_10_f16 : qi_stream_10_bf16;
    for (int64_t o0 = n0; o0 < n1; o0 += I16_ROWS) {
        int nr = n1 - o0 < I16_ROWS ? (int)(n1 - o0) : I16_ROWS;
        qs_prefetch_params(&q, o0 + pa, n1);
        if (zeros || !q.quarters) qs_params(&q, o0, nr, ps, 0);
        if (q.quarters) (zeros ? qi_stream_11 : own_scales)(&q, o0, nr, xq, sx, A, ps, task->dst);
        else (zeros ? qi_stream_01 : qi_stream_00)(&q, o0, nr, xq, sx, A, ps, task->dst);
    }
}

I16_ENTRIES(qs)

/* Whether an int4 matrix has this kernel: groups of a multiple of 32. */
static int qs_takes(const ColiFfnMat *m) { return m->group % 32 == 0; }
