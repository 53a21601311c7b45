/*
 * ffn_x86_int4.h (private, included once by ffn_x86.c after
 * ffn_x86_i16.h): the AVX-512 kernel for compressed-tensors int4 (groups of
 * a multiple of 32) in a bfloat16 call, with 16-bit integer products (see
 * ffn_x86_i16.h).
 *
 * Inputs in Q128 order (inside each 128 inputs, input 4i + s at 32s + i),
 * quantised per token and chunk of 128 inputs.
 *
 * Weights: 64 bytes read as 32 16-bit words hold a chunk's 128 nibbles;
 * vector n_s = every word's nibble s (a shift and a mask, no table), which
 * pairs with the inputs' vector s. Lane l of a chunk's integer sum covers
 * inputs 8l .. 8l + 7 (a quarter of 32 inputs is lanes 4j .. 4j + 3).
 *
 * Sum, per (token, output): per chunk, P = the exact integer sum of
 * n_0 a_0 + ... + n_3 a_3 per lane (at most 8 * 15 * 2^15 < 2^24: exact as
 * float), then c = fma(float(P), S * 2^-k, c), S the chunk's weight scales
 * (one, or one per quarter: lanes 4j .. 4j + 3) times the chunk's input
 * scale, rounded. Per correction unit u (a group that is a multiple of
 * 128 inputs, else a quarter) W_u = s_u z_u (z = 8 without zero points)
 * and X_u = the token's sum of its quantised inputs of the unit (a
 * quarter: exact; a group: chunk after chunk, each chunk's exact sum times
 * its scale, added in order); cv = fma(W, X, cv) over the units 16 at a
 * time; the result is the lane tree of c - cv.
 *
 * One token streams four rows side by side; more stream row after row in
 * blocks of up to four tokens (the rows' bytes from L1 after the first
 * block).
 */

typedef struct {
    const ColiFfnMat *m;
    int64_t row_bytes, chunks;  /* chunks of 128 inputs */
    int64_t whole;              /* chunks holding 128 inputs (the last may hold fewer) */
    __mmask64 tail;             /* the bytes of a last partial chunk */
    int quarters;               /* scales per quarter (groups not a multiple of 128) */
    int64_t units;              /* correction units of a row: groups, or quarters */
    int64_t ul;                 /* units rounded up to 16 */
    int64_t sn;                 /* scales of a row: one per chunk, or per quarter */
    int64_t pl;                 /* params of a row: sn scales (rounded up), then ul weights */
    int64_t kl;                 /* input scales of a token: chunks rounded up to 16 */
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
    q.units = q.quarters ? (m->n_in + 31) / 32 : m->groups;
    q.ul = coli_ffn_round_up(q.units, 16);
    q.sn = q.quarters ? 4 * q.chunks : q.chunks;
    q.pl = coli_ffn_round_up(q.sn, 16) + q.ul;
    q.kl = coli_ffn_round_up(q.chunks, 16);
    return q;
}

/* Groups of 128 or 32 inputs (one S and one W per group): the rows' params
 * 16 groups at a time, whole vectors (zero past the groups) covering the
 * padding. F: the scale format, a constant where called. */
VNNI INLINE void qs_group_rows(const QsInfo *q, int64_t o0, int nr, float *ps, ColiScaleFormat f) {
    const ColiFfnMat *m = q->m;
    const int64_t sl = q->pl - q->ul;  /* S's floats */
    for (int r = 0; r < I16_ROWS; r++) {
        int64_t o = o0 + (r < nr ? r : 0);
        float *S = ps + r * q->pl, *W = S + sl;
        const uint8_t *zw = m->zeros ? m->zeros + 4 * ((o / 8) * m->groups) : NULL;
        unsigned shift = (unsigned)(4 * (o % 8));
        for (int64_t g = 0; g < q->ul; g += 16) {
            int64_t n = m->groups - g;
            __mmask16 k = n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0;
            __m512 sc = qs_scales(f, m->scales, o * m->groups + g, k), z = _mm512_set1_ps(8.0f);
            if (zw) {
                __m512i w = _mm512_srli_epi32(_mm512_maskz_loadu_epi32(k, zw + 4 * g), shift);
                z = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xf)));
            }
            _mm512_storeu_ps(W + g, _mm512_mul_ps(sc, z));
            if (g < sl) _mm512_storeu_ps(S + g, sc);
        }
    }
}

/* Params of rows o0 .. o0 + I16_ROWS - 1 (those past nr repeat the first),
 * pl floats each: the scales S (per chunk or per quarter), then the
 * correction weights W = s z per unit, zero past the units. */
VNNI static void qs_params(const QsInfo *q, int64_t o0, int nr, float *ps) {
    const ColiFfnMat *m = q->m;
    if (m->group == 128 || m->group == 32) {
        switch (m->scale_format) {
        case COLI_SCALE_F32: qs_group_rows(q, o0, nr, ps, COLI_SCALE_F32); return;
        case COLI_SCALE_F16: qs_group_rows(q, o0, nr, ps, COLI_SCALE_F16); return;
        default: qs_group_rows(q, o0, nr, ps, COLI_SCALE_BF16); return;
        }
    }
    for (int r = 0; r < I16_ROWS; r++) {
        int64_t o = o0 + (r < nr ? r : 0);
        float *S = ps + r * q->pl, *W = S + q->pl - q->ul;
        memset(W, 0, sizeof(float) * (size_t)q->ul);
        memset(S, 0, sizeof(float) * (size_t)(q->pl - q->ul));
        if (q->quarters) {  /* groups of 64, 96, ...: a quarter's group */
            for (int64_t j = 0; j < q->units; j++) {
                int64_t g = 32 * j / m->group;
                S[j] = coli_ffn_scale_at(m, o * m->groups + g);
                W[j] = S[j] * (float)(m->zeros ? coli_ffn_zero_at(m, o, g) : 8);
            }
            continue;
        }
        for (int64_t g = 0; g < m->groups; g++)  /* groups of 256, 384, ...: per group, each chunk's */
            W[g] = coli_ffn_scale_at(m, o * m->groups + g) *
                   (float)(m->zeros ? coli_ffn_zero_at(m, o, g) : 8);
        for (int64_t c = 0; c < q->chunks; c++)
            S[c] = coli_ffn_scale_at(m, o * m->groups + 128 * c / m->group);
    }
}

/* Every token's inputs quantised per chunk (i16_quantise): per token,
 * chunks * 128 int16 at xq, the chunks' scales at sx and exact sums at A
 * (kl each), and the unit sums X (ul each, zero past the units): a
 * quarter's from its lanes (lane l of a chunk's vectors holds inputs
 * 8l .. 8l + 7), a group's its chunks' in order. */
VNNI static void qi_prepare(const QsInfo *q, const uint16_t *x, int64_t ldx, int64_t part, int ns,
                            int tokens, int16_t *xq, float *sx, int32_t *A, float *X) {
    const int64_t ldq = 128 * q->chunks, cpg = q->quarters ? 1 : q->m->group / 128;
    const __m512i ones = _mm512_set1_epi16(1);
    for (int t = 0; t < tokens; t++) {
        float *xt = X + t * q->ul, *st = sx + t * q->kl, acc = 0.0f;
        int16_t *dq = xq + t * ldq;
        i16_quantise(x + t * ldx, part, ns, ldq, 128, ldq, dq, st, A + t * q->kl);
        memset(xt, 0, sizeof(float) * (size_t)q->ul);
        for (int64_t c = 0; c < q->chunks; c++) {
            if (q->quarters) {
                __m512i lanes = _mm512_setzero_si512();
                for (int v = 0; v < 4; v++)
                    lanes = _mm512_dpwssd_epi32(lanes, _mm512_loadu_si512(dq + 128 * c + 32 * v), ones);
                int32_t l[16];
                _mm512_storeu_si512(l, lanes);
                for (int j = 0; j < 4 && 4 * c + j < q->units; j++)
                    xt[4 * c + j] = st[c] * (float)(l[4 * j] + l[4 * j + 1] + l[4 * j + 2] + l[4 * j + 3]);
                continue;
            }
            float part_sum = st[c] * (float)A[t * q->kl + c];
            acc = c % cpg ? acc + part_sum : part_sum;
            if (c % cpg == cpg - 1 || c == q->chunks - 1) xt[c / cpg] = acc;
        }
    }
}

/* Chunk CI of row r decoded into n[4]. WHOLE: it holds 128 inputs. */
#define QI_DECODE(n, r, CI, WHOLE)                                                           \
    do {                                                                                     \
        const uint8_t *src_ = rows[r] + 64 * (CI);                                           \
        __m512i w_ = WHOLE ? _mm512_loadu_si512(src_) : _mm512_maskz_loadu_epi8(q->tail, src_); \
        /* the group of rows' bytes in order, not four streams (measured faster) */          \
        ffn_prefetch2((const char *)rows[0] + 64 * (I16_ROWS * (CI) + (r)), ahead);            \
        n[0] = _mm512_and_si512(w_, lo);                                                     \
        n[1] = _mm512_and_si512(_mm512_srli_epi16(w_, 4), lo);                               \
        n[2] = _mm512_and_si512(_mm512_srli_epi16(w_, 8), lo);                               \
        n[3] = _mm512_srli_epi16(w_, 12);                                                    \
    } while (0)

/* Chunk CI's weight scales of row r. */
#define QI_SCALE(r, CI)                                                                      \
    (QUARTERS_ ? _mm512_permutexvar_ps(expand, _mm512_castps128_ps512(                       \
                                                   _mm_loadu_ps(ps + (r) * q->pl + 4 * (CI)))) \
               : _mm512_set1_ps(ps[(r) * q->pl + (CI)]))

/* Token t's exact integer sum of chunk CI with the decoded n. */
#define QI_SUM(N, t, CI)                                                                     \
    _mm512_dpwssd_epi32(                                                                     \
        _mm512_dpwssd_epi32(                                                                 \
            _mm512_dpwssd_epi32(                                                             \
                _mm512_dpwssd_epi32(_mm512_setzero_si512(), (N)[0],                           \
                                    _mm512_loadu_si512(xq + (t) * ldq + 128 * (CI))),         \
                (N)[1], _mm512_loadu_si512(xq + (t) * ldq + 128 * (CI) + 32)),                 \
            (N)[2], _mm512_loadu_si512(xq + (t) * ldq + 128 * (CI) + 64)),                     \
        (N)[3], _mm512_loadu_si512(xq + (t) * ldq + 128 * (CI) + 96))

/* c = fma(float(P), S * token t's chunk scale, c). */
#define QI_ADD(C, P, SV, t, CI)                                                              \
    C = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P),                                               \
                        _mm512_mul_ps(SV, _mm512_set1_ps(sx[(t) * q->kl + (CI)])), C)

/* One token: the four rows side by side. */
#define QI_CHUNK1(CI, WHOLE)                                                                 \
    do {                                                                                     \
        __m512i n[I16_ROWS][4];                                                               \
        UNROLL for (int r = 0; r < I16_ROWS; r++) QI_DECODE(n[r], r, CI, WHOLE);              \
        UNROLL for (int r = 0; r < I16_ROWS; r++) {                                           \
            __m512i p_ = QI_SUM(n[r], 0, CI);                                                \
            QI_ADD(c[r][0], p_, QI_SCALE(r, CI), 0, CI);                                     \
        }                                                                                    \
    } while (0)

/* More tokens: row after row, the block's tokens side by side. */
#define QI_CHUNKT(CI, WHOLE)                                                                 \
    UNROLL for (int r = 0; r < I16_ROWS; r++) {                                               \
        __m512i n[4];                                                                        \
        QI_DECODE(n, r, CI, WHOLE);                                                          \
        __m512 sv = QI_SCALE(r, CI);                                                         \
        UNROLL for (int t = 0; t < TB_; t++) {                                               \
            __m512i p_ = QI_SUM(n, t, CI);                                                   \
            QI_ADD(c[r][t], p_, sv, t, CI);                                                  \
        }                                                                                    \
    }

/* Row r's results for TB tokens (sums C[t]): the lane tree of c - cv. */
#define QI_RESULT(r, C)                                                                      \
    do {                                                                                     \
        const float *W = ps + (r) * q->pl + q->pl - q->ul;                                   \
        UNROLL for (int t = 0; t < TB_; t++) {                                               \
            __m512 cv = _mm512_setzero_ps();                                                 \
            for (int64_t j = 0; j < q->ul; j += 16)                                          \
                cv = _mm512_fmadd_ps(_mm512_loadu_ps(W + j), _mm512_loadu_ps(X + t * q->ul + j), cv); \
            dst[t * ld_dst + o0 + (r)] = tree_512(_mm512_sub_ps(C[t], cv));                  \
        }                                                                                    \
    } while (0)

/* Rows o0 .. o0 + nr - 1 for TB tokens (xq, sx, X: theirs). */
#define QI_STREAM(TB, QUARTERS)                                                              \
    VNNI static void qi_stream_##TB##_##QUARTERS(                                            \
        const QsInfo *q, int64_t o0, int nr, const int16_t *xq, int64_t ldq, const float *sx, \
        const float *ps, const float *X, float *dst, int64_t ld_dst) {                       \
        enum { TB_ = TB, QUARTERS_ = QUARTERS };                                             \
        const __m512i lo = _mm512_set1_epi16(0xf);                                           \
        const __m512i expand = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3); \
        const int64_t ahead = rows_ahead(I16_ROWS * q->row_bytes);  \
        const uint8_t *rows[I16_ROWS];                                                        \
        (void)expand;                                                                        \
        UNROLL for (int r = 0; r < I16_ROWS; r++)                                             \
            rows[r] = q->m->data + (o0 + (r < nr ? r : 0)) * q->row_bytes;                   \
        __m512 c[I16_ROWS][TB];                                                               \
        UNROLL for (int r = 0; r < I16_ROWS; r++)                                             \
            UNROLL for (int t = 0; t < TB; t++) c[r][t] = _mm512_setzero_ps();               \
        if (TB == 1) {                                                                       \
            for (int64_t ci = 0; ci < q->whole; ci++) QI_CHUNK1(ci, 1);                      \
            if (q->whole < q->chunks) QI_CHUNK1(q->whole, 0);                                \
        } else {                                                                             \
            for (int64_t ci = 0; ci < q->whole; ci++) QI_CHUNKT(ci, 1)                       \
            if (q->whole < q->chunks) QI_CHUNKT(q->whole, 0)                                 \
        }                                                                                    \
        UNROLL for (int r = 0; r < I16_ROWS; r++) if (r < nr) QI_RESULT(r, c[r]);            \
    }
#define QI_STREAMS(Q) QI_STREAM(1, Q) QI_STREAM(2, Q) QI_STREAM(4, Q)
QI_STREAMS(0)
QI_STREAMS(1)
#undef QI_STREAMS
#undef QI_STREAM
#undef QI_CHUNK1
#undef QI_CHUNKT
#undef QI_RESULT
#undef QI_ADD
#undef QI_SUM
#undef QI_SCALE
#undef QI_DECODE

typedef void (*QiStreamFn)(const QsInfo *q, int64_t o0, int nr, const int16_t *xq, int64_t ldq,
                           const float *sx, const float *ps, const float *X, float *dst,
                           int64_t ld_dst);
/* By quarters, then by block: 1, 2 and 4 tokens. */
static const QiStreamFn QI_STREAM_FNS[2][3] = {
    {qi_stream_1_0, qi_stream_2_0, qi_stream_4_0}, {qi_stream_1_1, qi_stream_2_1, qi_stream_4_1}};

/* Scratch: the tokens' quantised inputs (first: 64-byte aligned), their
 * chunk scales and unit sums, the params of a group of rows, the tokens'
 * chunk sums. */
static size_t qs_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)n0, (void)n1;
    QsInfo q = qs_info(m);
    return sizeof(int16_t) * (size_t)(tokens * 128 * q.chunks) + sizeof(int32_t) * (size_t)(tokens * q.kl) +
           sizeof(float) * (size_t)(tokens * (q.kl + q.ul) + I16_ROWS * q.pl);
}

/* The scales (and zero points) of rows o .. o + I16_ROWS - 1 into L1: a
 * stream of their own the rows' prefetch does not cover (with groups of
 * 32 and bfloat16 scales, an eighth of a row's bytes; left to demand
 * misses, measured a quarter of a cold expert's time). */
static void qs_prefetch_params(const QsInfo *q, int64_t o, int64_t n1) {
    const ColiFfnMat *m = q->m;
    if (o >= n1) return;
    int64_t end = o + I16_ROWS < n1 ? o + I16_ROWS : n1;
    int64_t ss = m->scale_format == COLI_SCALE_F32 ? 4 : 2;
    int64_t b0 = o * m->groups * ss, b1 = end * m->groups * ss;
    for (int64_t b = b0 & ~(int64_t)63; b < b1; b += 64)
        _mm_prefetch((const char *)m->scales + b, _MM_HINT_T0);
    if (m->zeros && o % 8 < I16_ROWS)  /* eight rows' zero points share a row of words */
        for (int64_t b = 0; b < 4 * m->groups; b += 64)
            _mm_prefetch((const char *)m->zeros + 4 * (o / 8) * m->groups + b, _MM_HINT_T0);
}

static void qs_rows(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    QsInfo q = qs_info(m);
    /* the params' stream as far ahead as the rows' (whole blocks of rows) */
    const int64_t pa = I16_ROWS * (rows_ahead(I16_ROWS * q.row_bytes) / (I16_ROWS * q.row_bytes));
    const int64_t ldq = 128 * q.chunks;
    int16_t *xq = (int16_t *)task->scratch;
    float *sx = (float *)(xq + task->tokens * ldq), *X = sx + task->tokens * q.kl;
    float *ps = X + task->tokens * q.ul;
    int32_t *A = (int32_t *)(ps + I16_ROWS * q.pl);
    int64_t part = ns == 2 ? task->ldx / 2 : 0;
    qi_prepare(&q, (const uint16_t *)task->x, task->ldx, part, ns, task->tokens, xq, sx, A, X);
    for (int64_t o0 = n0; o0 < n1; o0 += I16_ROWS) {
        int nr = n1 - o0 < I16_ROWS ? (int)(n1 - o0) : I16_ROWS;
        qs_prefetch_params(&q, o0 + pa, n1);
        qs_params(&q, o0, nr, ps);
        for (int t0 = 0, fn; t0 < task->tokens;) {
            int tb = i16_block(task->tokens - t0, &fn);
            QI_STREAM_FNS[q.quarters][fn](&q, o0, nr, xq + t0 * ldq, ldq, sx + t0 * q.kl, ps,
                                          X + t0 * q.ul, task->dst + t0 * task->ld_dst, task->ld_dst);
            t0 += tb;
        }
    }
}

I16_ENTRIES(qs)

/* Whether an int4 matrix has this kernel: groups of a multiple of 32. */
static int qs_takes(const ColiFfnMat *m) { return m->group % 32 == 0; }
