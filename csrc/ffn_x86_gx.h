/*
 * ffn_x86_gx.h (private, included once by ffn_x86.c after ffn_x86_i16.h):
 * the AVX-512 kernels for GPTQ (without act order) and AWQ in a bfloat16
 * call, with 16-bit integer products (see ffn_x86_i16.h): the nibbles as
 * stored, the inputs quantised by the kernel.
 *
 * Inputs, as the driver writes them for a bfloat16 kernel (the call's
 * tokens for gate and up, down's activations in two bfloat16 parts), are
 * quantised per token and segment: a segment is a group, or for groups of
 * more than 128 inputs the largest part of one that divides it, holds at
 * most 128 inputs and whole word rows (GPTQ) or row pairs (AWQ). Each
 * segment's a = rint(v 2^k), k putting its largest magnitude in [2^14,
 * 2^15), scale 2^-k (0 for zeros, NaN when it holds a NaN or an
 * infinity), A = the exact sum of its a.
 *
 * Sum, per (token, output) and segment: P = the exact integer sum of the
 * segment's q a (q the stored nibble), D = P - z A, exact (|D| < 2^27);
 * acc = fma(float(D), s * 2^-k, acc), segment after segment, z and s the
 * segment's group's zero point (GPTQ's stored one plus one in its original
 * format) and scale. Result: acc. Integer sums do not depend on the order
 * of their products, so the loops below may walk rows and tokens in any
 * order and a token's bits do not depend on its batch.
 *
 * GPTQ. Stored (in, out): a word row holds eight inputs of each output.
 * Lanes are outputs; inputs in G8 order (inside each 8, input j at 2j and
 * input j + 4 at 2j + 1, j < 4), so that vector j of a word row, the words
 * shifted right by 4j and masked to nibbles j and j + 4, pairs with the
 * token's 32-bit pair (2j, 2j + 1) of 16-bit inputs. */

/* A range of outputs of a GPTQ or AWQ matrix (AWQ's below). */
typedef struct {
    const ColiFfnMat *m;
    int awq;
    int64_t c0, n;              /* outputs [c0, c0 + n) */
    int64_t nv;                 /* GPTQ: vectors of 16 outputs; AWQ: segments of 128 */
    int64_t words;              /* AWQ: words of a row in the range */
    int64_t ahead;              /* GPTQ: prefetch this many stored rows ahead */
    int64_t ahead1;             /* the same for one token: twice as far (cold: faster; in L3: slower) */
    int64_t seg;                /* inputs per segment */
} GxInfo;

/* A segment's inputs: the group, or the largest divisor of it of at most
 * 128 inputs and a multiple of step (a word row's 8, a row pair's 2). */
static int64_t gx_segment(const ColiFfnMat *m, int64_t step) {
    if (m->group <= 128) return m->group;
    for (int64_t s = 128 / step * step; s > step; s -= step)
        if (m->group % s == 0) return s;
    return step;
}

static GxInfo gx_info(const ColiFfnMat *m, int64_t n0, int64_t n1) {
    GxInfo g = {m, m->format == COLI_TENSOR_INT4_AWQ, n0, n1 - n0, 0, (n1 - n0 + 7) / 8, 1, 1, 0};
    g.seg = gx_segment(m, g.awq ? 2 : 8);
    g.nv = g.awq ? (g.words + 15) / 16 : (g.n + 15) / 16;
    int64_t bytes = g.awq ? 4 * g.words : 4 * g.n;  /* of a stored row in the range */
    g.ahead = (I16_AHEAD + bytes - 1) / bytes;
    g.ahead1 = (2 * I16_AHEAD + bytes - 1) / bytes;
    return g;
}

VNNI INLINE __mmask16 gq_lanes(const GxInfo *q, int64_t v) {
    int64_t left = q->n - 16 * v;
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* Nibble j (< 4) of each 16-bit half of w's lanes as a 16-bit integer (of
 * a GPTQ word: nibbles j and j + 4): the top one needs no mask after a
 * 16-bit shift. */
VNNI INLINE __m512i gx_nibbles(__m512i w, int j) {
    if (j == 3) return _mm512_srli_epi16(w, 12);
    const __m512i lo = _mm512_set1_epi32(0x000f000f);
    return _mm512_and_si512(j ? _mm512_srli_epi16(w, (unsigned)(4 * j)) : w, lo);
}

/* Group g's z (integers) and s for vector v's outputs. */
VNNI INLINE void gq_params(const GxInfo *q, int64_t g, int64_t v, __m512i *zv, __m512 *sv) {
    const ColiFfnMat *m = q->m;
    int64_t o = q->c0 + 16 * v;
    __mmask16 k = gq_lanes(q, v);
    const __m512i word = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i shift = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    __m512i w = _mm512_maskz_loadu_epi32(k > 0xff ? 3 : 1, m->zeros + 4 * (g * (m->n_out / 8) + o / 8));
    w = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(word, w), shift), _mm512_set1_epi32(0xf));
    *zv = _mm512_add_epi32(w, _mm512_set1_epi32(m->zero_plus_one));
    *sv = qs_scales(m->scale_format, m->scales, g * m->n_out + o, k);
}

/* A segment of a GPTQ or AWQ panel (info: its GxInfo; zsv: its group's z
 * (integers) and s of every sum vector of the panel, 32 values each; xq:
 * the tokens' quantised inputs, ldq apart; sx, A: token t's scale and sum
 * of the segment at [t * lds]; p: TB rows of ldp integer sums). */
#define GX_SEGMENT_PARAMS                                                                   \
    const void *info, int64_t sg, const float *zsv, const int16_t *xq, int64_t ldq,         \
        const float *sx, const int32_t *A, int64_t lds, int32_t *p, float *acc, int64_t ldp
typedef void (*GxSegmentFn)(GX_SEGMENT_PARAMS);
/* A group's zsv for a panel. */
typedef void (*GxParamsFn)(const void *info, int64_t g, float *zsv);
/* One token's results of a panel from its sums. */
typedef void (*GxStoreFn)(const void *info, const float *acc, float *dst);

/* The segment's flush of n sum vectors for tb tokens: D = P - z A, acc =
 * fma(float(D), s * 2^-k, acc). */
VNNI INLINE void gx_flush(const float *zsv, int64_t n, int tb, const float *sx, const int32_t *A,
                        int64_t lds, const int32_t *p, float *acc, int64_t ldp) {
    for (int64_t i = 0; i < n; i++) {
        __m512i zv = _mm512_loadu_si512(zsv + 32 * i);
        __m512 sv = _mm512_loadu_ps(zsv + 32 * i + 16);
        for (int t = 0; t < tb; t++) {
            __m512i d = _mm512_sub_epi32(_mm512_loadu_si512(p + t * ldp + 16 * i),
                                         _mm512_mullo_epi32(zv, _mm512_set1_epi32(A[t * lds])));
            __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(sx[t * lds]));
            _mm512_storeu_ps(acc + t * ldp + 16 * i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale,
                                                                     _mm512_loadu_ps(acc + t * ldp + 16 * i)));
        }
    }
}

/* Group g's scales and zero points of outputs [o, o + n) into L1, a cache
 * line at a time (ss: a scale's bytes): called for the next group during a
 * group's first pass over its rows, so that the params' first touch at the
 * group's start does not miss (spread along the rows' stream: a burst
 * stalls it). */
VNNI INLINE void gx_prefetch_params(const ColiFfnMat *m, int64_t g, int64_t o, int64_t n, int64_t ss) {
    if (g >= m->groups) return;
    const char *s = (const char *)m->scales + ss * (g * m->n_out + o);
    for (int64_t b = 0; b < ss * n; b += 64) _mm_prefetch(s + b, _MM_HINT_T0);
    if (o % 128 == 0 || (o + n) / 128 > o / 128)  /* a zero point line holds 128 outputs */
        _mm_prefetch((const char *)m->zeros + 4 * (g * (m->n_out / 8) + o / 8), _MM_HINT_T0);
}

VNNI static void gq_group_params(const void *info, int64_t g, float *zsv) {
    const GxInfo *q = info;
    for (int64_t v = 0; v < q->nv; v++) {
        __m512i zv;
        __m512 sv;
        gq_params(q, g, v, &zv, &sv);
        _mm512_storeu_si512(zsv + 32 * v, zv);
        _mm512_storeu_ps(zsv + 32 * v + 16, sv);
    }
}

/* Segment sg of the range's vectors for TB tokens: p (TB rows of ldp
 * integers) gets the products, acc the segment's flush. */
#define GQ_SEGMENT(TB)                                                                      \
    VNNI static void gq_segment_##TB(GX_SEGMENT_PARAMS) {                                     \
        const GxInfo *q = info;                                                             \
        const ColiFfnMat *m = q->m;                                                         \
        const int64_t v1 = q->nv;                                                           \
        const int64_t rs = m->n_out * 4;                                                    \
        const int64_t g = sg * q->seg / m->group, r0 = sg * q->seg / 8;                     \
        const int64_t r1 = r0 + q->seg / 8 < m->n_in / 8 ? r0 + q->seg / 8 : m->n_in / 8;   \
        const int64_t ss = m->scale_format == COLI_SCALE_F32 ? 4 : 2;                       \
        for (int t = 0; t < TB; t++) memset(p + t * ldp, 0, sizeof(int32_t) * (size_t)(16 * v1)); \
        /* Two word rows per pass over p; a row past the segment is zeros. */               \
        for (int64_t r = r0; r < r1; r += 2) {                                              \
            const uint8_t *row[2];                                                          \
            __mmask16 use[2];                                                               \
            __m512i xp[2][TB][4];                                                           \
            UNROLL for (int i = 0; i < 2; i++) {                                            \
                int64_t ri = r + i < r1 ? r + i : r;                                        \
                row[i] = m->data + ri * rs + q->c0 * 4;                                     \
                use[i] = r + i < r1 ? 0xffff : 0;                                           \
                UNROLL for (int t = 0; t < TB; t++)                                         \
                    UNROLL for (int j = 0; j < 4; j++) {                                    \
                        int32_t pair = 0;                                                   \
                        if (use[i]) memcpy(&pair, xq + t * ldq + 8 * ri + 2 * j, sizeof pair); \
                        xp[i][t][j] = _mm512_set1_epi32(pair);                              \
                    }                                                                       \
            }                                                                               \
            for (int64_t v = 0; v < v1; v++) {                                              \
                __mmask16 k = gq_lanes(q, v);                                               \
                if (r == r0) gx_prefetch_params(m, g + 1, q->c0 + 16 * v, q->n - 16 * v < 16 ? q->n - 16 * v : 16, ss); \
                __m512i a[2][TB]; /* two chains (exact integers: for the pipes) */          \
                UNROLL for (int t = 0; t < TB; t++) {                                       \
                    a[0][t] = _mm512_loadu_si512(p + t * ldp + 16 * v);                     \
                    a[1][t] = _mm512_setzero_si512();                                       \
                }                                                                           \
                UNROLL for (int i = 0; i < 2; i++) {                                        \
                    ffn_prefetch2((const char *)row[i] + 64 * v, (TB == 1 ? q->ahead1 : q->ahead) * rs); \
                    __m512i w = _mm512_maskz_loadu_epi32(k & use[i], row[i] + 64 * v), n[4]; \
                    UNROLL for (int j = 0; j < 4; j++) n[j] = gx_nibbles(w, j);            \
                    UNROLL for (int t = 0; t < TB; t++)                                     \
                        UNROLL for (int j = 0; j < 4; j++)                                  \
                            a[i][t] = _mm512_dpwssd_epi32(a[i][t], n[j], xp[i][t][j]);      \
                }                                                                           \
                UNROLL for (int t = 0; t < TB; t++)                                         \
                    _mm512_storeu_si512(p + t * ldp + 16 * v, _mm512_add_epi32(a[0][t], a[1][t])); \
            }                                                                               \
        }                                                                                   \
        gx_flush(zsv, q->nv, TB, sx, A, lds, p, acc, ldp);                                  \
    }
GQ_SEGMENT(1)
GQ_SEGMENT(2)
GQ_SEGMENT(4)
#undef GQ_SEGMENT

static const GxSegmentFn GQ_SEGMENTS[3] = {gq_segment_1, gq_segment_2, gq_segment_4};

/* Tokens of a panel at a time beyond two tokens (their sums in scratch). */
enum { GX_TOKENS = 32, GX_TB = 4 };  /* GX_TB: the largest block of tokens of a segment */

/* The tokens' quantised inputs (GxInputs: per token, ldq int16 inputs,
 * then lds scales and lds sums, one per segment). */
typedef struct {
    const int16_t *xq;
    int64_t ldq;
    const float *sx;
    const int32_t *A;
    int64_t lds;
} GxInputs;

/* Every token of a panel: blocks of up to GX_TOKENS tokens, each segment
 * for every four of them, then two, then one (the segment's rows of the
 * panel stay in cache; four share each decoded vector: measured faster
 * than two, and eight spill registers), then the results. */
static void gx_tokens(const void *info, const GxSegmentFn fns[3], GxParamsFn params, GxStoreFn store,
                      const GxInputs *in, const ColiFfnTask *task, int32_t *p, float *acc,
                      int64_t ldp, float *zsv) {
    const GxInfo *q = info;
    const ColiFfnMat *m = q->m;
    for (int b0 = 0; b0 < task->tokens; b0 += GX_TOKENS) {
        int nb = task->tokens - b0 < GX_TOKENS ? task->tokens - b0 : GX_TOKENS;
        memset(acc, 0, sizeof(float) * (size_t)(nb * ldp));
        for (int64_t sg = 0; sg < in->lds; sg++) {
            if (sg * q->seg % m->group == 0) params(info, sg * q->seg / m->group, zsv);
            for (int t0 = b0; t0 < b0 + nb;) {
                int left = b0 + nb - t0, tb = left >= 4 ? 4 : left >= 2 ? 2 : 1;
                fns[tb / 2](info, sg, zsv, in->xq + t0 * in->ldq, in->ldq, in->sx + t0 * in->lds + sg,
                            in->A + t0 * in->lds + sg, in->lds, p, acc + (t0 - b0) * ldp, ldp);
                t0 += tb;
            }
        }
        for (int t = 0; t < nb; t++) store(info, acc + t * ldp, task->dst + (b0 + t) * task->ld_dst);
    }
}

static void gq_store(const void *info, const float *acc, float *dst) {
    const GxInfo *q = info;
    memcpy(dst + q->c0, acc, sizeof(float) * (size_t)q->n);
}

/* GPTQ without act order, groups of whole word rows. */
static int gq_takes(const ColiFfnMat *m) {
    return m->format == COLI_TENSOR_INT4_GPTQ && !m->g_idx && m->group % 8 == 0;
}

/* ================================================================ AWQ
 *
 * Stored (in, out): an input row's words hold eight outputs each (word w,
 * nibble n: output 8w + (0, 2, 4, 6, 1, 3, 5, 7)[n]). Inputs in plain
 * order, paired (k, k + 1): the 16 words of a segment (128 outputs) of
 * rows k and k + 1, interleaved by 16-bit halves (vpunpck{l,h}wd: U_u,
 * u = 0, 1), hold in each dword a half word of row k and the same of row
 * k + 1; vector 4u + j (j < 4) is U_u's nibble j of each half: per lane the
 * pair (row k's nibble, row k + 1's), which pairs with the token's 16-bit
 * inputs (k, k + 1) (a last odd row pairs with a zero). Lane d of vector
 * 4u + j is word 4(d / 4) + 2u + (d % 4) / 2, nibble 4 (d % 2) + j: output
 * 32 (d / 4) + 16u + 2j + (d % 2) + 8 ((d % 4) / 2) of the segment. The
 * sum is the top's. */

VNNI INLINE __mmask16 aq_lanes(const GxInfo *a, int64_t seg) {
    int64_t left = a->words - 16 * seg;
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* Group g's z (integers) of vector 4u + j of segment seg. */
VNNI INLINE __m512i aq_zeros(const GxInfo *a, int64_t g, int64_t seg, int u, int j) {
    const ColiFfnMat *m = a->m;
    int64_t w0 = a->c0 / 8 + 16 * seg;
    __m512i z = _mm512_maskz_loadu_epi32(aq_lanes(a, seg), m->zeros + 4 * (g * (m->n_out / 8) + w0));
    z = u ? _mm512_unpackhi_epi16(z, z) : _mm512_unpacklo_epi16(z, z);
    return _mm512_and_si512(_mm512_srli_epi32(z, (unsigned)(4 * j)), _mm512_set1_epi32(0xf));
}

/* Group g's s of segment seg's 8 vectors: its 128 outputs' scales loaded
 * in order, then put in lane order (gathers: a fifth of a cold one-token
 * call). Lane 4q + r of vector 4u + j is output 32q + t of the segment,
 * t = 16u + 2j + (r & 1) + 8 (r >> 1) (the top's words and nibbles): one
 * index vector for the four quarters, each from its own pair of 16. */
VNNI static void aq_scales(const GxInfo *a, int64_t g, int64_t seg, __m512 sv[8]) {
    const ColiFfnMat *m = a->m;
    const int64_t left = a->n - 128 * seg, first = g * m->n_out + a->c0 + 128 * seg;
    __m512 S[8];
    for (int i = 0; i < 8; i++) {
        int64_t n = left - 16 * i;
        __mmask16 k = n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0;
        S[i] = qs_scales(m->scale_format, m->scales, first + 16 * i, k);
    }
    const __m512i base = _mm512_setr_epi32(0, 1, 8, 9, 0, 1, 8, 9, 0, 1, 8, 9, 0, 1, 8, 9);
    for (int v = 0; v < 8; v++) {
        __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(16 * (v / 4) + 2 * (v % 4)));
        __m512 r = _mm512_permutex2var_ps(S[0], idx, S[1]);
        r = _mm512_mask_blend_ps(0x00f0, r, _mm512_permutex2var_ps(S[2], idx, S[3]));
        r = _mm512_mask_blend_ps(0x0f00, r, _mm512_permutex2var_ps(S[4], idx, S[5]));
        sv[v] = _mm512_mask_blend_ps(0xf000, r, _mm512_permutex2var_ps(S[6], idx, S[7]));
    }
}

VNNI static void aq_group_params(const void *info, int64_t g, float *zsv) {
    const GxInfo *a = info;
    for (int64_t seg = 0; seg < a->nv; seg++) {
        __m512 sv[8];
        aq_scales(a, g, seg, sv);
        for (int n = 0; n < 8; n++) {
            _mm512_storeu_si512(zsv + 32 * (8 * seg + n), aq_zeros(a, g, seg, n / 4, n % 4));
            _mm512_storeu_ps(zsv + 32 * (8 * seg + n) + 16, sv[n]);
        }
    }
}

/* Segment sg (of inputs) of the range's segments (of 128 outputs) for TB
 * tokens into p (TB rows of ldp integers: output segment seg's vector n at
 * 16 (8 seg + n)), then acc. */
#define AQ_SEGMENT(TB)                                                                      \
    VNNI static void aq_segment_##TB(GX_SEGMENT_PARAMS) {                                     \
        const GxInfo *a = info;                                                             \
        const ColiFfnMat *m = a->m;                                                         \
        const int64_t rs = m->n_out / 2;                                                    \
        const int64_t ss = m->scale_format == COLI_SCALE_F32 ? 4 : 2;                       \
        const int64_t g = sg * a->seg / m->group;                                           \
        int64_t k0 = sg * a->seg, k1 = k0 + a->seg < m->n_in ? k0 + a->seg : m->n_in;       \
        for (int t = 0; t < TB; t++) memset(p + t * ldp, 0, sizeof(int32_t) * (size_t)(128 * a->nv)); \
        if (a->nv <= 4) { /* a panel of many tokens: segment by segment, its 8 sums         \
                           * in registers over the group's rows (in cache after the         \
                           * first tokens): the same terms in the same order */             \
            /* the next group's rows of the panel into L2 while this one works,   \
             * a row's at a time (a burst of them stalls the loads) */                      \
            const int64_t next = (k1 - k0) * rs, kn = m->n_in - (k1 - k0);                  \
            /* VP vectors of a segment per pass over the rows: all 8 for two     \
             * tokens, U_0's 4 then U_1's for four (registers) */                           \
            enum { VP = TB > 2 ? 4 : 8 };                                                   \
            for (int64_t seg = 0; seg < a->nv; seg++) {                                     \
                __mmask16 lanes = aq_lanes(a, seg);                                         \
                UNROLL for (int n0 = 0; n0 < 8; n0 += VP) {                                 \
                    __m512i s8[VP][TB];                                                     \
                    UNROLL for (int n = 0; n < VP; n++)                                     \
                        UNROLL for (int t = 0; t < TB; t++) s8[n][t] = _mm512_setzero_si512(); \
                    for (int64_t k = k0; k < k1; k += 2) {                                  \
                        const uint8_t *ra = m->data + k * rs + a->c0 / 2 + 64 * seg;        \
                        if (n0 == 0 && k < kn) {                                            \
                            _mm_prefetch((const char *)ra + next, _MM_HINT_T1);             \
                            if (k + 1 < kn) _mm_prefetch((const char *)ra + rs + next, _MM_HINT_T1); \
                        }                                                                   \
                        __m512i A = _mm512_maskz_loadu_epi32(lanes, ra);                    \
                        __m512i B = _mm512_maskz_loadu_epi32(k + 1 < k1 ? lanes : 0, ra + rs); \
                        __m512i U[2] = {_mm512_unpacklo_epi16(A, B), _mm512_unpackhi_epi16(A, B)}; \
                        __m512i xk[TB];                                                     \
                        UNROLL for (int t = 0; t < TB; t++) {                               \
                            int32_t pair;                                                   \
                            memcpy(&pair, xq + t * ldq + k, sizeof pair);                   \
                            xk[t] = _mm512_set1_epi32(pair);                                \
                        }                                                                   \
                        UNROLL for (int n = 0; n < VP; n++) {                               \
                            int v = n0 + n;                                                 \
                            __m512i w = gx_nibbles(U[v / 4], v % 4);                        \
                            UNROLL for (int t = 0; t < TB; t++)                             \
                                s8[n][t] = _mm512_dpwssd_epi32(s8[n][t], w, xk[t]);         \
                        }                                                                   \
                    }                                                                       \
                    UNROLL for (int n = 0; n < VP; n++)                                     \
                        UNROLL for (int t = 0; t < TB; t++)                                 \
                            _mm512_storeu_si512(p + t * ldp + 16 * (8 * seg + n0 + n), s8[n][t]); \
                }                                                                           \
            }                                                                               \
            gx_flush(zsv, 8 * a->nv, TB, sx, A, lds, p, acc, ldp);                          \
            return;                                                                         \
        }                                                                                   \
        /* Rows streamed: NP pairs of rows per pass over p (four with one
         * token: half the traffic; two with two: registers); a pair past the
         * segment is zeros. */                                                             \
        enum { NP = TB == 1 ? 4 : 2 };                                                      \
        const int64_t block = 2 * NP * 4 * a->words; /* bytes of a block's rows in the range */ \
        const int64_t ahead = 2 * NP * ((I16_AHEAD + block - 1) / block);                   \
        /* rows prefetched by row past blocks of I16_AHEAD bytes, 2 I16_AHEAD   \
         * ahead in all (measured: I16_AHEAD 1.03x, 3 I16_AHEAD 1.04x) */       \
        const int by_row = block > I16_AHEAD;                                               \
        const int64_t dseg = (2 * I16_AHEAD + 2 * NP * 64 - 1) / (2 * NP * 64);             \
        for (int64_t k = k0; k < k1; k += 2 * NP) {                                         \
            const uint8_t *ra[NP], *rb[NP];                                                 \
            __mmask16 use[NP][2];                                                           \
            __m512i xp[NP][TB];                                                             \
            UNROLL for (int i = 0; i < NP; i++) {                                           \
                int64_t ki = k + 2 * i;                                                     \
                ra[i] = m->data + (ki < k1 ? ki : k0) * rs + a->c0 / 2;                     \
                rb[i] = ra[i] + rs;                                                         \
                use[i][0] = ki < k1 ? 0xffff : 0;                                           \
                use[i][1] = ki + 1 < k1 ? 0xffff : 0;                                       \
                UNROLL for (int t = 0; t < TB; t++) {                                       \
                    int32_t pair = 0;                                                       \
                    if (ki < k1) memcpy(&pair, xq + t * ldq + ki, sizeof pair);             \
                    xp[i][t] = _mm512_set1_epi32(pair);                                     \
                }                                                                           \
            }                                                                               \
            /* Short blocks: a later block of rows into L1 in memory order as     \
             * they go (one stream: each row's own prefetch made 2 NP streams),     \
             * whole blocks of at least I16_AHEAD bytes ahead (the next one alone,  \
             * a few KiB on short rows, measured slower cold). Longer ones: whole   \
             * blocks ahead would leave L1 before their use, so each row's own      \
             * stream, dseg segments on (a Mixtral expert: 0.85x cold). */          \
            int64_t pk = k + ahead, pseg = 0;                                               \
            for (int64_t seg = 0; seg < a->nv; seg++) {                                     \
                __mmask16 lanes = aq_lanes(a, seg);                                         \
                if (by_row) {                                                               \
                    int64_t ps = (seg + dseg) % a->nv, pr = k + 2 * NP * ((seg + dseg) / a->nv); \
                    UNROLL for (int i = 0; i < 2 * NP; i++)                                 \
                        if (pr + i < m->n_in)                                               \
                            _mm_prefetch((const char *)m->data + (pr + i) * rs + a->c0 / 2 + 64 * ps, _MM_HINT_T0); \
                } else {                                                                    \
                    UNROLL for (int i = 0; i < 2 * NP; i++) {                               \
                        if (pk < m->n_in)                                                   \
                            _mm_prefetch((const char *)m->data + pk * rs + a->c0 / 2 + 64 * pseg, _MM_HINT_T0); \
                        if (++pseg == a->nv) pseg = 0, pk++;                                \
                    }                                                                       \
                }                                                                           \
                if (k == k0) gx_prefetch_params(m, g + 1, a->c0 + 128 * seg, a->n - 128 * seg < 128 ? a->n - 128 * seg : 128, ss); \
                __m512i A[NP], B[NP];                                                       \
                UNROLL for (int i = 0; i < NP; i++) {                                       \
                    A[i] = _mm512_maskz_loadu_epi32(lanes & use[i][0], ra[i] + 64 * seg);   \
                    B[i] = _mm512_maskz_loadu_epi32(lanes & use[i][1], rb[i] + 64 * seg);   \
                }                                                                           \
                __m512i U[NP][2];                                                           \
                UNROLL for (int i = 0; i < NP; i++) {                                       \
                    U[i][0] = _mm512_unpacklo_epi16(A[i], B[i]);                            \
                    U[i][1] = _mm512_unpackhi_epi16(A[i], B[i]);                            \
                }                                                                           \
                UNROLL for (int n = 0; n < 8; n++) {                                        \
                    __m512i acc_[TB];                                                       \
                    UNROLL for (int t = 0; t < TB; t++)                                     \
                        acc_[t] = _mm512_loadu_si512(p + t * ldp + 16 * (8 * seg + n));     \
                    UNROLL for (int i = 0; i < NP; i++) {                                   \
                        __m512i w = gx_nibbles(U[i][n / 4], n % 4);                         \
                        UNROLL for (int t = 0; t < TB; t++)                                 \
                            acc_[t] = _mm512_dpwssd_epi32(acc_[t], w, xp[i][t]);            \
                    }                                                                       \
                    UNROLL for (int t = 0; t < TB; t++)                                     \
                        _mm512_storeu_si512(p + t * ldp + 16 * (8 * seg + n), acc_[t]);     \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        gx_flush(zsv, 8 * a->nv, TB, sx, A, lds, p, acc, ldp);                              \
    }
AQ_SEGMENT(1)
AQ_SEGMENT(2)
AQ_SEGMENT(4)
#undef AQ_SEGMENT

static const GxSegmentFn AQ_SEGMENTS[3] = {aq_segment_1, aq_segment_2, aq_segment_4};

/* A token's results in output order: outputs 16i .. 16i + 15 of a
 * segment (q = i / 2, u = i % 2) are lanes 4q + 2 (s / 8) + s % 2 of its
 * vectors 4u + (s % 8) / 2, s = 0 .. 15 (aq_scales's order, inverted):
 * two permutes of two vectors each. */
VNNI static void aq_store(const void *info, const float *acc, float *dst) {
    const GxInfo *a = info;
    const __m512i s = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i seven = _mm512_set1_epi32(7), one = _mm512_set1_epi32(1);
    /* lane s: 16 ((s % 8) / 2 % 2) + 2 (s / 8) + s % 2, and 4q to add */
    const __m512i lane = _mm512_add_epi32(
        _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(_mm512_and_si512(s, seven), 1), one), 4),
                         _mm512_slli_epi32(_mm512_srli_epi32(s, 3), 1)),
        _mm512_and_si512(s, one));
    const __mmask16 second = 0xf0f0;  /* s % 8 >= 4: vectors 4u + 2 and 4u + 3 */
    for (int64_t seg = 0; seg < a->nv; seg++) {
        const float *v = acc + 128 * seg;
        for (int i = 0; i < 8; i++) {
            int64_t o = 128 * seg + 16 * i, left = a->n - o;
            if (left <= 0) break;
            const int q = i / 2, u = i % 2;
            __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(4 * q));
            __m512 r0 = _mm512_permutex2var_ps(_mm512_loadu_ps(v + 16 * (4 * u)), idx, _mm512_loadu_ps(v + 16 * (4 * u + 1)));
            __m512 r1 = _mm512_permutex2var_ps(_mm512_loadu_ps(v + 16 * (4 * u + 2)), idx, _mm512_loadu_ps(v + 16 * (4 * u + 3)));
            __mmask16 k = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            _mm512_mask_storeu_ps(dst + a->c0 + o, k, _mm512_mask_blend_ps(second, r0, r1));
        }
    }
}

/* AWQ in groups of an even number of rows. */
static int aq_takes(const ColiFfnMat *m) {
    return m->format == COLI_TENSOR_INT4_AWQ && m->group % 2 == 0;
}

/* ---- GPTQ and AWQ: panels of a range, blocks of tokens. */

/* Units (vectors or segments) per panel: a few tokens, the whole range
 * (whole stored rows stream in order: narrower panels measured slower
 * cold); more, 512 outputs, so that a segment's rows of the panel stay in
 * cache while every block of four tokens runs over them. */
static int64_t gx_panel(const GxInfo *q, int tokens) {
    int64_t u = tokens <= 2 ? q->nv : 512 / (q->awq ? 128 : 16);
    return u > q->nv ? q->nv : u;
}

/* Rows of p: the largest block of tokens a call runs (two at least). */
static int64_t gx_p_rows(int tokens) { return tokens > 2 ? GX_TB : 2; }

static size_t gx_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    GxInfo q = gx_info(m, n0, n1);
    int64_t ldp = (q.awq ? 128 : 16) * gx_panel(&q, tokens);  /* the values of a panel's sum vectors */
    int nb = tokens < GX_TOKENS ? tokens : GX_TOKENS;  /* p, acc, the params */
    int64_t ldq = coli_ffn_round_up(m->n_in, 32), lds = (m->n_in + q.seg - 1) / q.seg;
    return sizeof(float) * (size_t)((gx_p_rows(tokens) + nb + 2) * ldp) +
           (size_t)tokens * (sizeof(int16_t) * (size_t)ldq + (sizeof(float) + sizeof(int32_t)) * (size_t)lds);
}

VNNI static void gx_rows(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    GxInfo q = gx_info(m, n0, n1);
    int64_t pu = gx_panel(&q, task->tokens), width = q.awq ? 128 : 16, ldp = width * pu;
    int64_t part = ns == 2 ? task->ldx / 2 : 0;
    int nb = task->tokens < GX_TOKENS ? task->tokens : GX_TOKENS;
    int32_t *p = (int32_t *)task->scratch;
    float *acc = (float *)(p + gx_p_rows(task->tokens) * ldp), *zsv = acc + nb * ldp;
    GxInputs in = {NULL, coli_ffn_round_up(m->n_in, 32), NULL, NULL, (m->n_in + q.seg - 1) / q.seg};
    float *sx = zsv + 2 * ldp;
    int32_t *A = (int32_t *)(sx + task->tokens * in.lds);
    int16_t *xq = (int16_t *)(A + task->tokens * in.lds);
    /* the first group's params on their way while the inputs are quantised
     * (the passes prefetch each next group's) */
    for (int64_t o = n0; o < n1; o += 128)
        gx_prefetch_params(m, 0, o, n1 - o < 128 ? n1 - o : 128, m->scale_format == COLI_SCALE_F32 ? 4 : 2);
    for (int t = 0; t < task->tokens; t++)
        i16_quantise((const uint16_t *)task->x + t * task->ldx, part, ns, m->n_in, q.seg, in.ldq,
                    xq + t * in.ldq, sx + t * in.lds, A + t * in.lds);
    in.xq = xq, in.sx = sx, in.A = A;
    for (int64_t u0 = 0; u0 < q.nv; u0 += pu) {
        GxInfo qp = q;  /* the panel */
        qp.c0 = n0 + width * u0;
        qp.n = q.n - width * u0 < ldp ? q.n - width * u0 : ldp;
        qp.words = (qp.n + 7) / 8;
        qp.nv = (qp.n + width - 1) / width;
        gx_tokens(&qp, q.awq ? AQ_SEGMENTS : GQ_SEGMENTS, q.awq ? aq_group_params : gq_group_params,
                  q.awq ? aq_store : gq_store, &in, task, p, acc, ldp, zsv);
    }
}

I16_ENTRIES(gx)

#undef GX_SEGMENT_PARAMS
