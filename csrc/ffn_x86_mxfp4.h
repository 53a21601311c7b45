/*
 * ffn_x86_mxfp4.h (private, included once by ffn_x86.c after
 * ffn_x86_i16.h): the AVX-512 kernel for MXFP4 in a bfloat16 call, with
 * 16-bit integer products (see ffn_x86_i16.h).
 *
 * Weights: twice an e2m1 value is an integer (0, 1, 2, 3, 4, 6, 8, 12 and
 * their negatives), looked up (vpermw) from its nibble; a scale byte e
 * then weighs 2^(e - 128) (exact, subnormal for e < 2). Inputs in EO64
 * order (inside each block of 64, the 32 even inputs, then the 32 odd
 * ones: what a byte's low and high nibbles hold), quantised per token and
 * block of 64. The low nibbles' vector A pairs with the block's first 32 inputs,
 * the high ones' B with the rest; lane l covers inputs 4l .. 4l + 3, so
 * lanes 0-7 are the first half block (its scale byte), lanes 8-15 the
 * second.
 *
 * Sum, per (token, output): per block, P = the exact integer sum of A a_A +
 * B a_B per lane (at most 4 * 12 * 2^15: exact as a float), then c =
 * fma(float(P), S * 2^-k, c), S the half blocks' 2^(e - 128) per lane;
 * the result is the lane tree of c. One token streams four rows side by
 * side; more stream the rows one after another in blocks of four tokens
 * (the rows' bytes from L1 after the first block), with the same bits.
 */

typedef struct {
    const ColiFfnMat *m;
    int64_t row_bytes, blocks;
    int64_t whole;              /* blocks holding 64 inputs (the last may hold 32) */
    int64_t ldq, lds;           /* a token's quantised inputs and block scales */
} MiInfo;

/* 2^(e - 128) for each scale byte, built once (exact). */
static float MI_WEIGHTS[256];
static pthread_once_t mi_once = PTHREAD_ONCE_INIT;

static void mi_weights(void) {
    for (int e = 0; e < 256; e++) MI_WEIGHTS[e] = ldexpf(1.0f, e - 128);
}

/* Twice the e2m1 value of each nibble, as 16-bit integers (a vpermw table
 * of 32: the upper half unused). */
static const int16_t MI_E2M1_X2[32] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static MiInfo mi_info(const ColiFfnMat *m) {
    pthread_once(&mi_once, mi_weights);
    MiInfo d = {m, m->n_in / 2, (m->n_in + COLI_FFN_BLOCK - 1) / COLI_FFN_BLOCK, 0, 0, 0};
    d.whole = m->n_in / COLI_FFN_BLOCK;
    d.ldq = COLI_FFN_BLOCK * d.blocks;  /* a last half block's odd inputs lie past n_in */
    d.lds = d.blocks;
    return d;
}

/* Block blk's bytes of a row: whole, or its first 16 (the rest zero). */
VNNI INLINE __m256i mi_bytes(const uint8_t *row, int64_t blk, int whole) {
    if (whole) return _mm256_loadu_si256((const __m256i *)(row + 32 * blk));
    return _mm256_maskz_loadu_epi8(0xffff, row + 32 * blk);
}

/* Row o's scales of block blk per lane (a last half block repeats its only
 * scale: its weights are zero). */
VNNI INLINE __m512 mi_scale(const MiInfo *d, int64_t o, int64_t blk) {
    const ColiFfnMat *m = d->m;
    const uint8_t *e = m->scales + o * m->groups + 2 * blk;
    int e1 = 2 * blk + 1 < m->groups ? e[1] : e[0];
    return _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(MI_WEIGHTS[e[0]]), _mm512_set1_ps(MI_WEIGHTS[e1]));
}

/* Block U of row r decoded into A_, B_. */
#define MI_DECODE(A_, B_, r, U, WHOLE)                                                       \
    do {                                                                                     \
        /* the group of rows' bytes in order, not four streams */                           \
        if ((r) < 2) ffn_prefetch2((const char *)rows[0] + 64 * (2 * (U) + (r)), ahead);     \
        __m512i v_ = _mm512_cvtepu8_epi16(mi_bytes(rows[r], U, WHOLE));                      \
        A_ = _mm512_permutexvar_epi16(_mm512_and_si512(v_, _mm512_set1_epi16(0xf)), tab);    \
        B_ = _mm512_permutexvar_epi16(_mm512_srli_epi16(v_, 4), tab);                        \
    } while (0)

/* Token t's exact integer sum of block U. */
#define MI_SUM(A_, B_, t, U)                                                                 \
    _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), A_,                      \
                                            _mm512_loadu_si512(xq + (t) * d->ldq + 64 * (U))), \
                        B_, _mm512_loadu_si512(xq + (t) * d->ldq + 64 * (U) + 32))

/* c = fma(float(P), S * token t's block scale, c). */
#define MI_ADD(C, P, SV, t, U)                                                               \
    C = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), _mm512_mul_ps(SV, _mm512_set1_ps(sx[(t) * d->lds + (U)])), C)

#define MI_BLOCK1(U, WHOLE)                                                                  \
    UNROLL for (int r = 0; r < I16_ROWS; r++) {                                               \
        __m512i a_, b_;                                                                      \
        MI_DECODE(a_, b_, r, U, WHOLE);                                                      \
        __m512i p_ = MI_SUM(a_, b_, 0, U);                                                   \
        MI_ADD(c[r][0], p_, mi_scale(d, orow[r], U), 0, U);                                  \
    }

#define MI_BLOCKT(U, WHOLE)                                                                  \
    UNROLL for (int r = 0; r < I16_ROWS; r++) {                                               \
        __m512i a_, b_;                                                                      \
        MI_DECODE(a_, b_, r, U, WHOLE);                                                      \
        __m512 sv = mi_scale(d, orow[r], U);                                                 \
        UNROLL for (int t = 0; t < TB_; t++) {                                               \
            __m512i p_ = MI_SUM(a_, b_, t, U);                                               \
            MI_ADD(c[r][t], p_, sv, t, U);                                                   \
        }                                                                                    \
    }

/* Rows o0 .. o0 + nr - 1 (nr <= I16_ROWS; the missing ones repeat the
 * first and are not stored) for TB tokens (xq, sx: theirs). */
#define MI_STREAM(TB)                                                                        \
    VNNI static void mi_stream_##TB(const MiInfo *d, int64_t o0, int nr, const int16_t *xq,  \
                                    const float *sx, float *dst, int64_t ld_dst) {           \
        enum { TB_ = TB };                                                                   \
        const __m512i tab = _mm512_loadu_si512(MI_E2M1_X2);                                  \
        const int64_t ahead = rows_ahead(I16_ROWS * d->row_bytes);                            \
        const uint8_t *rows[I16_ROWS];                                                        \
        int64_t orow[I16_ROWS];                                                               \
        __m512 c[I16_ROWS][TB];                                                               \
        UNROLL for (int r = 0; r < I16_ROWS; r++) {                                           \
            orow[r] = o0 + (r < nr ? r : 0);                                                 \
            rows[r] = d->m->data + orow[r] * d->row_bytes;                                   \
            UNROLL for (int t = 0; t < TB; t++) c[r][t] = _mm512_setzero_ps();               \
        }                                                                                    \
        if (TB == 1) {                                                                       \
            for (int64_t u = 0; u < d->whole; u++) MI_BLOCK1(u, 1)                           \
            if (d->whole < d->blocks) MI_BLOCK1(d->whole, 0)                                 \
        } else {                                                                             \
            for (int64_t u = 0; u < d->whole; u++) MI_BLOCKT(u, 1)                           \
            if (d->whole < d->blocks) MI_BLOCKT(d->whole, 0)                                 \
        }                                                                                    \
        UNROLL for (int r = 0; r < I16_ROWS; r++)                                             \
            if (r < nr) UNROLL for (int t = 0; t < TB; t++)                                  \
                dst[t * ld_dst + o0 + r] = tree_512(c[r][t]);                                \
    }
MI_STREAM(1)
MI_STREAM(2)
MI_STREAM(4)
#undef MI_STREAM
#undef MI_BLOCKT
#undef MI_BLOCK1
#undef MI_ADD
#undef MI_SUM
#undef MI_DECODE

typedef void (*MiStreamFn)(const MiInfo *d, int64_t o0, int nr, const int16_t *xq, const float *sx,
                           float *dst, int64_t ld_dst);
static const MiStreamFn MI_STREAM_FNS[3] = {mi_stream_1, mi_stream_2, mi_stream_4};

/* Scratch: the tokens' quantised inputs, their block scales and sums. */
static size_t mi_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)n0, (void)n1;
    MiInfo d = mi_info(m);
    return (size_t)tokens * (sizeof(int16_t) * (size_t)d.ldq + (sizeof(float) + sizeof(int32_t)) * (size_t)d.lds);
}

static void mi_rows(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    MiInfo d = mi_info(m);
    int64_t part = ns == 2 ? task->ldx / 2 : 0;
    int16_t *xq = (int16_t *)task->scratch;
    float *sx = (float *)(xq + task->tokens * d.ldq);
    int32_t *sums = (int32_t *)(sx + task->tokens * d.lds);
    for (int t = 0; t < task->tokens; t++)
        i16_quantise((const uint16_t *)task->x + t * task->ldx, part, ns, d.ldq, COLI_FFN_BLOCK, d.ldq,
                    xq + t * d.ldq, sx + t * d.lds, sums + t * d.lds);
    for (int64_t o0 = n0; o0 < n1; o0 += I16_ROWS) {
        int nr = n1 - o0 < I16_ROWS ? (int)(n1 - o0) : I16_ROWS;
        for (int t0 = 0, fn; t0 < task->tokens;) {
            int tb = i16_block(task->tokens - t0, &fn);
            MI_STREAM_FNS[fn](&d, o0, nr, xq + t0 * d.ldq, sx + t0 * d.lds,
                              task->dst + t0 * task->ld_dst, task->ld_dst);
            t0 += tb;
        }
    }
}

I16_ENTRIES(mi)

#undef I16_ENTRIES
#undef VNNI
