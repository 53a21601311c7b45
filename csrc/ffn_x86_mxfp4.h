/*
 * ffn_x86_mxfp4.h (private, included once by ffn_x86.c after
 * ffn_x86_i16.h): the AVX-512 kernel for MXFP4 in a bfloat16 call, with
 * 16-bit integer products (see ffn_x86_i16.h); for more than one token
 * with AMX tiles where the CPU and the OS offer them (ffn_x86_amx.h).
 *
 * Weights: twice an e2m1 value is an integer (0, 1, 2, 3, 4, 6, 8, 12 and
 * their negatives), looked up (vpermw) from its nibble; a scale byte e
 * then weighs 2^(e - 128) (exact, subnormal for e < 2). Inputs in EO64
 * order (inside each block of 64, the 32 even inputs, then the 32 odd
 * ones: what a byte's low and high nibbles hold), quantised per token and
 * block of 64. The low nibbles' vector A pairs with the block's first 32
 * inputs, the high ones' B with the rest; lane l covers inputs 4l .. 4l + 3,
 * so lanes 0-7 are the first half block (its scale byte), lanes 8-15 the
 * second.
 *
 * Sum, per (token, output): per half block h of block u, P = the exact
 * integer sum of its products (at most 32 * 12 * 2^15 < 2^24), then
 * c = fma(float(P), S_h * 2^-k, c), half after half, block after block,
 * S_h the half's 2^(e - 128) and 2^-k the block's input scale; the result
 * is c. P is the same integer however it is summed, so one token streaming
 * four rows side by side, four rows of up to four tokens, and AMX tiles
 * give a token the same bits, whatever its batch.
 */

typedef struct {
    const ColiFfnMat *m;
    int64_t row_bytes, blocks;
    int64_t whole;              /* blocks holding 64 inputs (the last may hold 32) */
    int64_t ldq, lds;           /* a token's quantised inputs and block scales */
    int64_t st;                 /* S of a group of rows: per half block, I16_ROWS floats */
} MiInfo;

/* Twice the e2m1 value of each nibble, as 16-bit integers (a vpermw table
 * of 32: the upper half unused). */
static const int16_t MI_E2M1_X2[32] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static MiInfo mi_info(const ColiFfnMat *m) {
    MiInfo d = {m, m->n_in / 2, (m->n_in + COLI_FFN_BLOCK - 1) / COLI_FFN_BLOCK, 0, 0, 0, 0};
    d.whole = m->n_in / COLI_FFN_BLOCK;
    d.ldq = COLI_FFN_BLOCK * d.blocks;  /* a last half block's odd inputs lie past n_in */
    d.lds = d.blocks;
    d.st = 2 * I16_ROWS * coli_ffn_round_up(d.blocks, 8);
    return d;
}

/* 2^(e - 128) of 16 scale bytes (as int32), built from the bits: exact,
 * subnormal for e < 2. */
VNNI INLINE __m512 mi_weights(__m512i e) {
    __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(1), _mm512_add_epi32(e, _mm512_set1_epi32(21)));
    __mmask16 big = _mm512_cmpge_epi32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(big, tiny, normal));
}

/* The scales of rows o0 .. o0 + I16_ROWS - 1 (those past nr repeat the
 * first), st floats: half block h's (0, 1, ... over the row) at 4h + r.
 * Halves past the row weigh 2^-128 (their weights and inputs are zero). */
VNNI static void mi_params(const MiInfo *d, int64_t o0, int nr, float *S) {
    const ColiFfnMat *m = d->m;
    for (int64_t g = 0; g < d->st / I16_ROWS; g += 16) {
        int64_t n = m->groups - g;
        __mmask16 k = n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0;
        __m128i e[I16_ROWS];
        for (int r = 0; r < I16_ROWS; r++) e[r] = _mm_maskz_loadu_epi8(k, m->scales + (o0 + (r < nr ? r : 0)) * m->groups + g);
        __m128i ab_lo = _mm_unpacklo_epi8(e[0], e[1]), ab_hi = _mm_unpackhi_epi8(e[0], e[1]);
        __m128i cd_lo = _mm_unpacklo_epi8(e[2], e[3]), cd_hi = _mm_unpackhi_epi8(e[2], e[3]);
        __m128i q[4] = {_mm_unpacklo_epi16(ab_lo, cd_lo), _mm_unpackhi_epi16(ab_lo, cd_lo),
                        _mm_unpacklo_epi16(ab_hi, cd_hi), _mm_unpackhi_epi16(ab_hi, cd_hi)};
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(S + 4 * g + 16 * i, mi_weights(_mm512_cvtepu8_epi32(q[i])));
    }
}

/* Block blk's bytes of a row: whole, or its first 16 (the rest zero). */
VNNI INLINE __m256i mi_bytes(const uint8_t *row, int64_t blk, int whole) {
    if (whole) return _mm256_loadu_si256((const __m256i *)(row + 32 * blk));
    return _mm256_maskz_loadu_epi8(0xffff, row + 32 * blk);
}

/* Block U of row r decoded into A_, B_. */
#define MI_DECODE(A_, B_, r, U, WHOLE)                                                       \
    do {                                                                                     \
        /* the group of rows' bytes in order, not four streams */                           \
        if (ahead && (r) < 2) ffn_prefetch2((const char *)rows[0] + 64 * (2 * (U) + (r)), ahead); \
        __m512i v_ = _mm512_cvtepu8_epi16(mi_bytes(rows[r], U, WHOLE));                      \
        A_ = _mm512_permutexvar_epi16(_mm512_and_si512(v_, _mm512_set1_epi16(0xf)), tab);    \
        B_ = _mm512_permutexvar_epi16(_mm512_srli_epi16(v_, 4), tab);                        \
    } while (0)

/* Token t's integer sums of block U, per lane. */
#define MI_SUM(A_, B_, t, U)                                                                 \
    _mm512_dpwssd_epi32(_mm512_madd_epi16(A_, _mm512_loadu_si512(xq + (t) * d->ldq + 64 * (U))), \
                        B_, _mm512_loadu_si512(xq + (t) * d->ldq + 64 * (U) + 32))

/* Four rows' units (i16_quarters4's) to half blocks: 128-bit block 0 holds
 * the four rows' first halves, block 1 their second. */
VNNI INLINE __m512i mi_halves(__m512i u) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(u, u, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(u, u, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* One token, four rows side by side: block U. */
#define MI_BLOCK1(U, WHOLE)                                                                  \
    do {                                                                                     \
        __m512i p_[I16_ROWS];                                                                 \
        UNROLL for (int r = 0; r < I16_ROWS; r++) {                                           \
            __m512i a_, b_;                                                                  \
            MI_DECODE(a_, b_, r, U, WHOLE);                                                  \
            p_[r] = MI_SUM(a_, b_, 0, U);                                                    \
        }                                                                                    \
        __m512i h_ = mi_halves(i16_quarters4(p_[0], p_[1], p_[2], p_[3]));                    \
        __m128 x_ = _mm_set1_ps(sx[U]);                                                      \
        c = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm512_castsi512_si128(h_)),                        \
                         _mm_mul_ps(_mm_loadu_ps(S + 8 * (U)), x_), c);                      \
        c = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm512_extracti32x4_epi32(h_, 1)),                 \
                         _mm_mul_ps(_mm_loadu_ps(S + 8 * (U) + 4), x_), c);                  \
    } while (0)

/* One token: rows o0 .. o0 + nr - 1 (the missing ones repeat the first and
 * are not stored) over every block (xq, sx: the token's; S: the rows'
 * scales). */
VNNI static void mi_stream(const MiInfo *d, int64_t o0, int nr, const int16_t *xq, const float *sx,
                           const float *S, float *dst) {
    const __m512i tab = _mm512_loadu_si512(MI_E2M1_X2);
    const int64_t ahead = rows_ahead(I16_ROWS * d->row_bytes);
    const uint8_t *rows[I16_ROWS];
    UNROLL for (int r = 0; r < I16_ROWS; r++) rows[r] = d->m->data + (o0 + (r < nr ? r : 0)) * d->row_bytes;
    __m128 c = _mm_setzero_ps();
    for (int64_t u = 0; u < d->whole; u++) MI_BLOCK1(u, 1);
    if (d->whole < d->blocks) MI_BLOCK1(d->whole, 0);
    float v[4];
    _mm_storeu_ps(v, c);
    for (int r = 0; r < nr; r++) dst[o0 + r] = v[r];
}

/* TB tokens, four rows: block U (the rows decoded once for the block). */
#define MI_BLOCKT(U, WHOLE)                                                                  \
    do {                                                                                     \
        __m512i a_[I16_ROWS], b_[I16_ROWS], u_[4];                                            \
        UNROLL for (int r = 0; r < I16_ROWS; r++) MI_DECODE(a_[r], b_[r], r, U, WHOLE);       \
        UNROLL for (int t = 0; t < 4; t++)                                                   \
            u_[t] = t < TB_ ? i16_quarters4(MI_SUM(a_[0], b_[0], t, U), MI_SUM(a_[1], b_[1], t, U), \
                                           MI_SUM(a_[2], b_[2], t, U), MI_SUM(a_[3], b_[3], t, U)) \
                            : _mm512_setzero_si512();                                        \
        __m512i h0_, h1_; /* the four tokens' first halves, then their second */                 \
        i16_block_pairs4(u_[0], u_[1], u_[2], u_[3], &h0_, &h1_);                                 \
        __m512 x_ = _mm512_permutexvar_ps(fours, _mm512_castps128_ps512(_mm_loadu_ps(sxt + (U) * tp))); \
        c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h0_),                                              \
                            _mm512_mul_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(S + 8 * (U))), x_), c); \
        c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h1_),                                              \
                            _mm512_mul_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(S + 8 * (U) + 4)), x_), c); \
    } while (0)

/* TB tokens (xq: theirs; sxt: their block scales, block after block, tp
 * apart), rows o0 .. o0 + nr - 1 over every block: lane 4t + r of the sum
 * vector is token t's row r. */
#define MI_STREAMT(TB)                                                                       \
    VNNI static void mi_stream_##TB(const MiInfo *d, int64_t o0, int nr, const int16_t *xq,  \
                                    const float *sxt, int64_t tp, const float *S, float *dst, \
                                    int64_t ld_dst) {                                        \
        enum { TB_ = TB, ahead = 0 };                                                        \
        const __m512i tab = _mm512_loadu_si512(MI_E2M1_X2), fours = _mm512_loadu_si512(I16_FOURS); \
        const uint8_t *rows[I16_ROWS];                                                        \
        UNROLL for (int r = 0; r < I16_ROWS; r++)                                             \
            rows[r] = d->m->data + (o0 + (r < nr ? r : 0)) * d->row_bytes;                   \
        __m512 c = _mm512_setzero_ps();                                                      \
        for (int64_t u = 0; u < d->whole; u++) MI_BLOCKT(u, 1);                              \
        if (d->whole < d->blocks) MI_BLOCKT(d->whole, 0);                                    \
        float v[16];                                                                         \
        _mm512_storeu_ps(v, c);                                                              \
        for (int t = 0; t < TB; t++)                                                         \
            for (int r = 0; r < nr; r++) dst[t * ld_dst + o0 + r] = v[4 * t + r];            \
    }
MI_STREAMT(1)
MI_STREAMT(2)
MI_STREAMT(4)
#undef MI_STREAMT
#undef MI_BLOCKT
#undef MI_BLOCK1
#undef MI_SUM
#undef MI_DECODE

typedef void (*MiStreamFn)(const MiInfo *d, int64_t o0, int nr, const int16_t *xq, const float *sxt,
                           int64_t tp, const float *S, float *dst, int64_t ld_dst);
static const MiStreamFn MI_STREAM_FNS[3] = {mi_stream_1, mi_stream_2, mi_stream_4};

/* More than one token with AMX (ffn_x86_amx.h): 16 rows, a half block and
 * up to 16 tokens a tile. */
#if COLI_AMX
AMX static void ma_inputs(const MiInfo *d, const int16_t *xq, int tokens, uint8_t *b);
AMX static void ma_rows(const MiInfo *d, int64_t n0, int64_t n1, const ColiFfnTask *task, const float *sxt,
                        int64_t tp, const uint8_t *b, float *S, float *acc, uint8_t *w);
#endif

/* The scratch of a call (offsets in bytes from the first, 64-byte
 * aligned): the tokens' quantised inputs, their block scales and sums, the
 * scales of a tile of 16 rows, their sums, the block scales' table;
 * with AMX, the inputs' tiles and QA_BUFS blocks' weight and sum tiles. */
typedef struct {
    size_t sx, A, S, acc, sxt, tiles, amx, total;
} MiScratch;

static MiScratch mi_layout(const MiInfo *d, int tokens) {
    MiScratch s;
    int64_t tp = i16_table_stride(tokens);
    s.sx = sizeof(int16_t) * (size_t)(tokens * d->ldq);
    s.A = s.sx + sizeof(float) * (size_t)(tokens * d->lds);
    s.S = s.A + sizeof(int32_t) * (size_t)(tokens * d->lds);
    s.acc = s.S + sizeof(float) * (size_t)(QA_ROWS / I16_ROWS * d->st);
    s.sxt = s.acc + sizeof(float) * (size_t)(QA_ROWS * QA_TOKENS);
    s.tiles = (s.sxt + sizeof(float) * (size_t)(d->blocks * tp) + 63) / 64 * 64;
    s.amx = s.tiles + (size_t)((tokens + QA_TOKENS - 1) / QA_TOKENS * d->blocks) * 2 * QA_TILE;
    s.total = s.amx + QA_BUFS * 5 * QA_TILE;
    return s;
}

static size_t mi_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)n0, (void)n1;
    MiInfo d = mi_info(m);
    return mi_layout(&d, tokens).total;
}

static void mi_rows(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    MiInfo d = mi_info(m);
    MiScratch at = mi_layout(&d, task->tokens);
    uint8_t *base = task->scratch;
    int64_t part = ns == 2 ? task->ldx / 2 : 0, tp = i16_table_stride(task->tokens);
    int16_t *xq = (int16_t *)base;
    float *sx = (float *)(base + at.sx), *S = (float *)(base + at.S), *sxt = (float *)(base + at.sxt);
    int32_t *sums = (int32_t *)(base + at.A);
    for (int t = 0; t < task->tokens; t++)
        i16_quantise((const uint16_t *)task->x + t * task->ldx, part, ns, d.ldq, COLI_FFN_BLOCK, d.ldq,
                    xq + t * d.ldq, sx + t * d.lds, sums + t * d.lds);
    if (task->tokens == 1) {
        for (int64_t o0 = n0; o0 < n1; o0 += I16_ROWS) {
            int nr = n1 - o0 < I16_ROWS ? (int)(n1 - o0) : I16_ROWS;
            mi_params(&d, o0, nr, S);
            mi_stream(&d, o0, nr, xq, sx, S, task->dst);
        }
        return;
    }
    i16_table32(sx, d.lds, d.blocks, task->tokens, sxt, tp);
#if COLI_AMX
    if (coli_ffn_amx_usable()) {
        ma_inputs(&d, xq, task->tokens, base + at.tiles);
        ma_rows(&d, n0, n1, task, sxt, tp, base + at.tiles, S, (float *)(base + at.acc), base + at.amx);
        return;
    }
#endif
    for (int64_t o0 = n0; o0 < n1; o0 += I16_ROWS) {
        int nr = n1 - o0 < I16_ROWS ? (int)(n1 - o0) : I16_ROWS;
        mi_params(&d, o0, nr, S);
        for (int t0 = 0, fn; t0 < task->tokens;) {
            int tb = i16_block(task->tokens - t0, &fn);
            MI_STREAM_FNS[fn](&d, o0, nr, xq + t0 * d.ldq, sxt + t0, tp, S, task->dst + t0 * task->ld_dst,
                              task->ld_dst);
            t0 += tb;
        }
    }
}

I16_ENTRIES(mi)
