/*
 * ffn_x86_gptq_act.h (private, included once by ffn_x86.c after
 * ffn_x86_gx.h): the AVX-512 kernel for GPTQ with act order (a g_idx that
 * is not input / group) in a bfloat16 call, with 16-bit integer products
 * (see ffn_x86_i16.h).
 *
 * A group's inputs lie scattered over the word rows, so a word's nibbles
 * rarely share a group. Per call the kernel sorts the inputs by group (by
 * index within one) and cuts each group's members into segments of at
 * most GA_SEG; each token's inputs are quantised per segment (a =
 * rint(v 2^k), as ffn_x86_gx.h does per run of inputs; A their sum).
 *
 * Sum, per (token, output) and segment: P the exact integer sum of the
 * segment's products, D = P - z A (|D| < 2^27), acc = fma(float(D),
 * s 2^-k, acc), segment after segment (groups in order, a group's
 * segments in order); z and s the group's zero point and scale. P is the
 * same integer however it is summed, so the two ways below give a token
 * the same bits:
 *
 * - One token streams the word rows in order, as the kernel without act
 *   order does, and adds each nibble's products into its input's
 *   segment's sums: GPTQ's G8 vector j (nibbles j and j + 4 of each word)
 *   takes input 8r + j's value paired with a zero into one segment's
 *   sums, and input 8r + j + 4's paired the other way into another's
 *   (vpdpwssd, two a vector). The sums of every segment of a panel of
 *   outputs stay in L1 or L2 (GA_SUMS).
 * - More tokens first repack a panel of outputs into scratch: word rows
 *   of the inputs in segment order, each segment padded to whole words
 *   (each nibble rotated into its place and OR-ed in, vpternlogd), then
 *   run GPTQ's pairs over it as over rows without act order, every block
 *   of four tokens sharing each decoded vector.
 */

enum {
    GA_SEG = 128,                /* members of a segment at most */
    GA_SUMS = 96 * 1024,         /* one token: a panel's sums of every segment */
    GA_PACKED = 512 * 1024,      /* more tokens: a repacked panel, in L2 */
    GA_VMAX = 16                 /* vectors of 16 outputs a panel, at most */
};

/* Segment: its members' first position in the order (a multiple of 8),
 * their count, their group. */
typedef struct {
    int32_t start, count, group;
} GaSegment;

typedef struct {
    const ColiFfnMat *m;
    int64_t segs;               /* at most (the scratch's room) */
    int64_t ldq;                /* positions of the order: each segment padded to a multiple of 8 */
    int64_t rs;                 /* bytes of a stored word row */
} GaInfo;

static GaInfo ga_info(const ColiFfnMat *m) {
    GaInfo a = {m, m->groups + m->n_in / GA_SEG + 1, 0, m->n_out * 4};
    a.ldq = coli_ffn_round_up(m->n_in + 7 * a.segs, 32);
    return a;
}

/* Vectors of a panel: one token's sums of segs segments within GA_SUMS;
 * more tokens' repacked rows (pos positions) within GA_PACKED. */
static int64_t ga_vectors(int64_t segs, int64_t pos, int tokens) {
    int64_t v = tokens == 1 ? GA_SUMS / (64 * (segs > 0 ? segs : 1)) : GA_PACKED / (64 * (pos / 8 > 0 ? pos / 8 : 1));
    return v < 1 ? 1 : v > GA_VMAX ? GA_VMAX : v;
}

/* The scratch of a call, in bytes from the first (each part 64-byte
 * aligned): per group a count, the order (position -> input, -1 for
 * pads), the segments, each input's segment and position, one segment's
 * gathered inputs, a token's quantised inputs in the order, the sums (one
 * token) or the repacked panel (more), then per token its G8 pairs (one
 * token: of the stored rows; more: of the repacked ones), scales and sums
 * per segment. */
typedef struct {
    size_t order, segs, seg_of, pos_of, gather, xq, work, pairs, sx, A, total;
} GaScratch;

static size_t ga_align(size_t n) { return (n + 63) / 64 * 64; }

static GaScratch ga_layout(const GaInfo *a, int tokens) {
    GaScratch s;
    const ColiFfnMat *m = a->m;
    size_t sums = 64 * (size_t)a->segs > (size_t)GA_SUMS ? 64 * (size_t)a->segs : (size_t)GA_SUMS;
    size_t packed = 64 * (size_t)(a->ldq / 8) > (size_t)GA_PACKED ? 64 * (size_t)(a->ldq / 8) : (size_t)GA_PACKED;
    s.order = ga_align(sizeof(int32_t) * (size_t)(m->groups + 1));
    s.segs = s.order + ga_align(sizeof(int32_t) * (size_t)a->ldq);
    s.seg_of = s.segs + ga_align(sizeof(GaSegment) * (size_t)a->segs);
    s.pos_of = s.seg_of + ga_align(sizeof(int32_t) * (size_t)m->n_in);
    s.gather = s.pos_of + ga_align(sizeof(int32_t) * (size_t)m->n_in);
    s.xq = s.gather + ga_align(sizeof(uint16_t) * 2 * GA_SEG);
    s.work = s.xq + ga_align(sizeof(int16_t) * (size_t)a->ldq);
    s.pairs = s.work + ga_align(tokens == 1 ? sums : packed);
    s.sx = s.pairs + ga_align(sizeof(int32_t) * (size_t)(tokens * a->ldq));
    s.A = s.sx + ga_align(sizeof(float) * (size_t)(tokens * a->segs));
    s.total = s.A + ga_align(sizeof(int32_t) * (size_t)(tokens * a->segs));
    return s;
}

/* The order of the inputs (segments of each group's members by index,
 * groups in order, each segment padded to a multiple of 8 positions with
 * -1), the segments, each input's segment and position; returns how many
 * segments, and the positions used at *used (first: one count per group,
 * then clobbered). */
static int64_t ga_segments(const GaInfo *a, int32_t *first, int32_t *order, GaSegment *seg,
                           int32_t *seg_of, int32_t *pos_of, int64_t *used) {
    const ColiFfnMat *m = a->m;
    memset(first, 0, sizeof(int32_t) * (size_t)m->groups);
    for (int64_t k = 0; k < m->n_in; k++) first[coli_ffn_group_of(m, k)]++;
    int64_t n = 0;
    int32_t pos = 0;
    for (int64_t g = 0; g < m->groups; g++) {
        int32_t members = first[g];
        first[g] = (int32_t)n;  /* the group's first segment */
        for (int32_t s0 = 0; s0 < members; s0 += GA_SEG) {
            int32_t len = members - s0 < GA_SEG ? members - s0 : GA_SEG;
            seg[n++] = (GaSegment){pos, 0, (int32_t)g};
            pos += (len + 7) / 8 * 8;
        }
    }
    for (int64_t i = 0; i < pos; i++) order[i] = -1;
    for (int64_t k = 0; k < m->n_in; k++) {
        int32_t *s = &first[coli_ffn_group_of(m, k)];
        if (seg[*s].count == GA_SEG) (*s)++;
        GaSegment *sg = seg + *s;
        seg_of[k] = *s;
        pos_of[k] = sg->start + sg->count;
        order[sg->start + sg->count++] = (int32_t)k;
    }
    *used = pos;
    return n;
}

/* A token's inputs (bfloat16 at x, low parts `part` on when ns is 2)
 * quantised per segment (xq: in the order, zero at pads; sx, A: per
 * segment), then as G8 pairs: with stored (one token), word row r's pairs
 * j < 4 at 8r + 2j (input 8r + j's value in the low half, zero above) and
 * 8r + 2j + 1 (input 8r + j + 4's in the high half, zero below); else of
 * the repacked rows, positions 8R + j and 8R + j + 4 in one pair. */
VNNI static void ga_quantise(const GaSegment *seg, int64_t n, int64_t used, const int32_t *order,
                             const int32_t *pos_of, int64_t n_in, const uint16_t *x, int64_t part, int ns,
                             int stored, uint16_t *gather, int16_t *xq, int32_t *pairs, float *sx,
                             int32_t *A) {
    for (int64_t i = 0; i < n; i++) {
        const int32_t *members = order + seg[i].start;
        for (int32_t j = 0; j < seg[i].count; j++) {
            gather[j] = x[members[j]];
            if (ns == 2) gather[GA_SEG + j] = x[part + members[j]];
        }
        i16_quantise(gather, GA_SEG, ns, seg[i].count, seg[i].count, (seg[i].count + 7) / 8 * 8,
                     xq + seg[i].start, sx + i, A + i);
    }
    if (stored) {
        for (int64_t k = 0; k < n_in; k++) {
            uint32_t v = (uint16_t)xq[pos_of[k]];
            int64_t c = k % 8;
            pairs[k - c + 2 * (c % 4) + c / 4] = (int32_t)(c < 4 ? v : v << 16);
        }
        return;
    }
    for (int64_t p = 0; p < used; p += 8)
        for (int j = 0; j < 4; j++) {
            pairs[p + 2 * j] = (int32_t)((uint32_t)(uint16_t)xq[p + j] | (uint32_t)(uint16_t)xq[p + j + 4] << 16);
            pairs[p + 2 * j + 1] = 0;
        }
}

/* One token: the stored word rows of the panel q (nv vectors; prefetching
 * q->ahead rows on) into sums (per segment, nv vectors of 16 integers;
 * pairs: the token's G8 pairs of the stored rows). */
VNNI static void ga_scatter(const GaInfo *a, const GxInfo *q, const int32_t *seg_of, const int32_t *pairs,
                            int32_t *sums) {
    const ColiFfnMat *m = q->m;
    const int64_t nv = q->nv, rows = m->n_in / 8, ahead = q->ahead * a->rs;
    const uint8_t *row = m->data + 4 * q->c0;
    for (int64_t r = 0; r < rows; r++, row += a->rs) {
        int32_t *dst[8];
        __m512i x[8];
        UNROLL for (int i = 0; i < 8; i++) {
            /* pair i: input 8r + i / 2 (i even) or 8r + i / 2 + 4 (odd) */
            dst[i] = sums + 16 * nv * seg_of[8 * r + i / 2 + 4 * (i % 2)];
            x[i] = _mm512_set1_epi32(pairs[8 * r + i]);
        }
        for (int64_t v = 0; v < nv; v++) {
            ffn_prefetch2((const char *)row + 64 * v, ahead);
            __m512i w = _mm512_maskz_loadu_epi32(gq_lanes(q, v), row + 64 * v);
            UNROLL for (int j = 0; j < 4; j++) {
                __m512i nb = gx_nibbles(w, j);
                UNROLL for (int h = 0; h < 2; h++) {
                    int32_t *p = dst[2 * j + h] + 16 * v;
                    _mm512_storeu_si512(p, _mm512_dpwssd_epi32(_mm512_loadu_si512(p), nb, x[2 * j + h]));
                }
            }
        }
    }
}

/* More tokens: the stored word rows of the panel q into packed (word row
 * R of the positions 8R .. 8R + 7, nv vectors of 64 bytes a row; used
 * positions), each nibble rotated to its position's place. */
VNNI static void ga_repack(const GaInfo *a, const GxInfo *q, const int32_t *pos_of, int64_t used,
                           uint8_t *packed) {
    const ColiFfnMat *m = q->m;
    const int64_t nv = q->nv, ld = 64 * nv, rows = m->n_in / 8, ahead = q->ahead * a->rs;
    const uint8_t *row = m->data + 4 * q->c0;
    memset(packed, 0, (size_t)(used / 8 * ld));
    for (int64_t r = 0; r < rows; r++, row += a->rs) {
        uint8_t *dst[8];
        __m512i turn[8], keep[8];
        UNROLL for (int j = 0; j < 8; j++) {
            int32_t p = pos_of[8 * r + j];
            dst[j] = packed + (p / 8) * ld;
            turn[j] = _mm512_set1_epi32((4 * (p % 8 - j)) & 31);
            keep[j] = _mm512_set1_epi32((int)(0xfu << (4 * (p % 8))));
        }
        for (int64_t v = 0; v < nv; v++) {
            ffn_prefetch2((const char *)row + 64 * v, ahead);
            __m512i w = _mm512_maskz_loadu_epi32(gq_lanes(q, v), row + 64 * v);
            UNROLL for (int j = 0; j < 8; j++) {
                uint8_t *p = dst[j] + 64 * v;
                /* p | (rotated & keep) */
                _mm512_store_si512(p, _mm512_ternarylogic_epi32(_mm512_load_si512(p), _mm512_rolv_epi32(w, turn[j]),
                                                                keep[j], 0xf8));
            }
        }
    }
}

/* More tokens: segment sg over the repacked panel's vectors [v0, v0 + VB)
 * for TB tokens (pairs: theirs, ldp apart; sx, A: their scale and sum of
 * the segment, lds apart), then acc (TB rows of ldc floats). */
#define GA_PASS(TB, VB)                                                                      \
    VNNI static void ga_pass_##TB(const GxInfo *q, const uint8_t *packed, const GaSegment *sg,  \
                                  const int32_t *pairs, int64_t ldp, const float *sx,        \
                                  const int32_t *A, int64_t lds, int64_t v0, float *acc,     \
                                  int64_t ldc) {                                             \
        const int64_t ld = 64 * q->nv, r1 = (sg->start + sg->count + 7) / 8;                  \
        __m512i p[TB][VB];                                                                   \
        UNROLL for (int v = 0; v < VB; v++) UNROLL for (int t = 0; t < TB; t++) p[t][v] = _mm512_setzero_si512(); \
        for (int64_t R = sg->start / 8; R < r1; R++) {                                       \
            __m512i x[TB][4];                                                                \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                UNROLL for (int j = 0; j < 4; j++) x[t][j] = _mm512_set1_epi32(pairs[t * ldp + 8 * R + 2 * j]); \
            UNROLL for (int v = 0; v < VB; v++) {                                            \
                if (v0 + v >= q->nv) break;                                                  \
                __m512i w = _mm512_load_si512(packed + R * ld + 64 * (v0 + v));               \
                UNROLL for (int j = 0; j < 4; j++) {                                         \
                    __m512i nb = gx_nibbles(w, j);                                           \
                    UNROLL for (int t = 0; t < TB; t++) p[t][v] = _mm512_dpwssd_epi32(p[t][v], nb, x[t][j]); \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        UNROLL for (int v = 0; v < VB; v++) {                                                \
            if (v0 + v >= q->nv) break;                                                      \
            __m512i zv;                                                                      \
            __m512 sv;                                                                       \
            gq_params(q, sg->group, v0 + v, &zv, &sv);                                       \
            UNROLL for (int t = 0; t < TB; t++) {                                            \
                __m512i d = _mm512_sub_epi32(p[t][v], _mm512_mullo_epi32(zv, _mm512_set1_epi32(A[t * lds]))); \
                float *c = acc + t * ldc + 16 * (v0 + v);                                    \
                _mm512_storeu_ps(c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, _mm512_set1_ps(sx[t * lds])), \
                                                    _mm512_loadu_ps(c)));                    \
            }                                                                                \
        }                                                                                    \
    }
GA_PASS(1, 8)
GA_PASS(2, 8)
GA_PASS(4, 4)
#undef GA_PASS

typedef void (*GaPassFn)(const GxInfo *q, const uint8_t *packed, const GaSegment *sg, const int32_t *pairs,
                         int64_t ldp, const float *sx, const int32_t *A, int64_t lds, int64_t v0, float *acc,
                         int64_t ldc);
static const GaPassFn GA_PASSES[3] = {ga_pass_1, ga_pass_2, ga_pass_4};

/* One token's outputs of the panel from its segments' sums (ga_scatter):
 * acc = fma(float(P - z A), s 2^-k, acc), segment after segment. */
VNNI static void ga_flush(const GxInfo *q, const GaSegment *seg, int64_t n, const int32_t *sums,
                          const float *sx, const int32_t *A, float *dst) {
    for (int64_t v = 0; v < q->nv; v++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            __m512i zv;
            __m512 sv;
            gq_params(q, seg[i].group, v, &zv, &sv);
            __m512i d = _mm512_sub_epi32(_mm512_loadu_si512(sums + 16 * (i * q->nv + v)),
                                         _mm512_mullo_epi32(zv, _mm512_set1_epi32(A[i])));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, _mm512_set1_ps(sx[i])), acc);
        }
        _mm512_mask_storeu_ps(dst + q->c0 + 16 * v, gq_lanes(q, v), acc);
    }
}

/* GPTQ with act order. */
static int ga_takes(const ColiFfnMat *m) { return m->format == COLI_TENSOR_INT4_GPTQ && m->g_idx; }

static size_t ga_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)n0, (void)n1;
    GaInfo a = ga_info(m);
    return ga_layout(&a, tokens).total + sizeof(float) * (size_t)(GX_TOKENS * 16 * GA_VMAX);
}

/* Outputs [n0, n1), panel after panel: one token scatters the stored rows
 * into its sums; more repack the panel, then run blocks of up to
 * GX_TOKENS tokens, each segment for every four of them, then two, then
 * one. */
VNNI static void ga_rows(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    GaInfo a = ga_info(m);
    GaScratch at = ga_layout(&a, task->tokens);
    uint8_t *base = task->scratch, *work = base + at.work;
    int32_t *order = (int32_t *)(base + at.order), *seg_of = (int32_t *)(base + at.seg_of);
    int32_t *pos_of = (int32_t *)(base + at.pos_of), *pairs = (int32_t *)(base + at.pairs), *A = (int32_t *)(base + at.A);
    GaSegment *seg = (GaSegment *)(base + at.segs);
    float *sx = (float *)(base + at.sx), *acc = (float *)(base + at.total);
    const int one = task->tokens == 1;
    int64_t used, part = ns == 2 ? task->ldx / 2 : 0;
    int64_t segs = ga_segments(&a, (int32_t *)base, order, seg, seg_of, pos_of, &used);
    for (int t = 0; t < task->tokens; t++)
        ga_quantise(seg, segs, used, order, pos_of, m->n_in, (const uint16_t *)task->x + t * task->ldx, part, ns,
                    one, (uint16_t *)(base + at.gather), (int16_t *)(base + at.xq), pairs + t * a.ldq,
                    sx + t * a.segs, A + t * a.segs);
    GxInfo q = gx_info(m, n0, n1);
    const int64_t width = 16 * ga_vectors(segs, used, task->tokens);
    for (int64_t c0 = n0; c0 < n1; c0 += width) {
        GxInfo qp = q;
        qp.c0 = c0;
        qp.n = n1 - c0 < width ? n1 - c0 : width;
        qp.nv = (qp.n + 15) / 16;
        qp.ahead = (I16_AHEAD + 64 * qp.nv - 1) / (64 * qp.nv);  /* rows */
        if (one) {
            memset(work, 0, sizeof(int32_t) * (size_t)(16 * qp.nv * segs));
            ga_scatter(&a, &qp, seg_of, pairs, (int32_t *)work);
            ga_flush(&qp, seg, segs, (const int32_t *)work, sx, A, task->dst);
            continue;
        }
        ga_repack(&a, &qp, pos_of, used, work);
        const int64_t ldc = 16 * qp.nv;
        for (int b0 = 0; b0 < task->tokens; b0 += GX_TOKENS) {
            int nb = task->tokens - b0 < GX_TOKENS ? task->tokens - b0 : GX_TOKENS;
            memset(acc, 0, sizeof(float) * (size_t)(nb * ldc));
            for (int64_t s = 0; s < segs; s++)
                for (int t0 = b0, fn; t0 < b0 + nb;) {
                    int tb = i16_block(b0 + nb - t0, &fn), vb = tb == 4 ? 4 : 8;
                    for (int64_t v0 = 0; v0 < qp.nv; v0 += vb)
                        GA_PASSES[fn](&qp, work, seg + s, pairs + t0 * a.ldq, a.ldq, sx + t0 * a.segs + s,
                                      A + t0 * a.segs + s, a.segs, v0, acc + (t0 - b0) * ldc, ldc);
                    t0 += tb;
                }
            for (int t = 0; t < nb; t++)
                memcpy(task->dst + (b0 + t) * task->ld_dst + c0, acc + t * ldc, sizeof(float) * (size_t)qp.n);
        }
    }
}

I16_ENTRIES(ga)
