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
 * four rows side by side (with byte products: mi_stream), four rows of up
 * to 16 tokens (16-bit products), and AMX tiles give a token the same
 * bits, whatever its batch.
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

/* 2^(e - 128) of 16 scale bytes, given e - 128 (the byte xor 0x80, read
 * signed) as int32: exact (a power of two from 2^-128 to 2^127, subnormal
 * below 2^-126). */
VNNI INLINE __m512 mi_weights(__m512i e128) {
    return _mm512_scalef_ps(_mm512_set1_ps(1.0f), _mm512_cvtepi32_ps(e128));
}

/* The scales of rows o0 .. o0 + I16_ROWS - 1 (those past nr repeat the
 * first), st floats: half block h's (0, 1, ... over the row) at 4h + r.
 * Halves past the row weigh 2^-128 (their weights and inputs are zero). */
VNNI static void mi_params(const MiInfo *d, int64_t o0, int nr, float *S) {
    const ColiFfnMat *m = d->m;
    const uint8_t *row[I16_ROWS];
    UNROLL for (int r = 0; r < I16_ROWS; r++) row[r] = m->scales + (o0 + (r < nr ? r : 0)) * m->groups;
    for (int64_t g = 0; g < d->st / I16_ROWS; g += 16) {
        int64_t n = m->groups - g;
        __mmask16 k = n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0;
        __m128i e[I16_ROWS];
        UNROLL for (int r = 0; r < I16_ROWS; r++)  /* e - 128 as a signed byte (0 past the row: 2^-128) */
            e[r] = _mm_xor_si128(_mm_maskz_loadu_epi8(k, row[r] + g), _mm_set1_epi8(-128));
        __m128i ab_lo = _mm_unpacklo_epi8(e[0], e[1]), ab_hi = _mm_unpackhi_epi8(e[0], e[1]);
        __m128i cd_lo = _mm_unpacklo_epi8(e[2], e[3]), cd_hi = _mm_unpackhi_epi8(e[2], e[3]);
        __m128i q[4] = {_mm_unpacklo_epi16(ab_lo, cd_lo), _mm_unpackhi_epi16(ab_lo, cd_lo),
                        _mm_unpacklo_epi16(ab_hi, cd_hi), _mm_unpackhi_epi16(ab_hi, cd_hi)};
        UNROLL for (int i = 0; i < 4; i++) _mm512_storeu_ps(S + 4 * g + 16 * i, mi_weights(_mm512_cvtepi8_epi32(q[i])));
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

/* One token's inputs as bytes, per pair of blocks (128 inputs), for the
 * byte-product stream: x = 256 h + l, h = x >> 8 signed, l = x & 255
 * unsigned, each plane in the order of a row's 64 bytes of the pair (its
 * low nibbles: the two blocks' even inputs; its high ones: their odd
 * ones); lane 4j + r of hs holds 12 times the sum of x over the pair's
 * half block j, of sx the scale of its block (0 past the blocks). 384
 * bytes: a 64-byte aligned array of them stays aligned. */
typedef struct {
    int8_t h_even[64], h_odd[64];
    uint8_t l_even[64], l_odd[64];
    int32_t hs[16];
    float sx[16];
} MiPair;

static int64_t mi_pairs(const MiInfo *d) { return (d->blocks + 1) / 2; }

/* The token's pairs from its quantised inputs xq and block scales sx. */
VNNI static void mi_pair_inputs(const MiInfo *d, const int16_t *xq, const float *sx, MiPair *pairs) {
    for (int64_t p = 0; p < mi_pairs(d); p++) {
        MiPair *q = pairs + p;
        memset(q, 0, sizeof *q);
        for (int b = 0; b < 2 && 2 * p + b < d->blocks; b++) {
            const int16_t *x = xq + 64 * (2 * p + b);
            __m512i even = _mm512_loadu_si512(x), odd = _mm512_loadu_si512(x + 32);
            __m512i he = _mm512_srai_epi16(even, 8), ho = _mm512_srai_epi16(odd, 8);
            _mm256_storeu_si256((__m256i *)(q->h_even + 32 * b), _mm512_cvtepi16_epi8(he));
            _mm256_storeu_si256((__m256i *)(q->h_odd + 32 * b), _mm512_cvtepi16_epi8(ho));
            _mm256_storeu_si256((__m256i *)(q->l_even + 32 * b), _mm512_cvtepi16_epi8(even));
            _mm256_storeu_si256((__m256i *)(q->l_odd + 32 * b), _mm512_cvtepi16_epi8(odd));
            /* half j of the pair: 16 even and 16 odd inputs from 16 (j % 2) on */
            for (int k = 0; k < 2; k++) {
                __m512i w = _mm512_add_epi32(
                    _mm512_cvtepi16_epi32(k ? _mm512_extracti64x4_epi64(even, 1) : _mm512_castsi512_si256(even)),
                    _mm512_cvtepi16_epi32(k ? _mm512_extracti64x4_epi64(odd, 1) : _mm512_castsi512_si256(odd)));
                int32_t sum = 12 * _mm512_reduce_add_epi32(w);
                for (int r = 0; r < I16_ROWS; r++) q->hs[4 * (2 * b + k) + r] = sum;
            }
            for (int i = 0; i < 8; i++) q->sx[8 * b + i] = sx[2 * p + b];
        }
    }
}

/* Twice the e2m1 value of each nibble as signed bytes (a vpshufb table). */
static const int8_t MI_E2M1_X2_I8[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* The same plus 12: 0 .. 24, a byte as unsigned as signed. */
static const int8_t MI_E2M1_X2_P12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* One token, four rows side by side, a pair of blocks (a row's 64 bytes)
 * a step, with byte products (vpdpbusd, 64 a instruction): with w a
 * weight's twice-e2m1 value, one lookup gives w + 12 (0 .. 24, a byte
 * both unsigned and signed) for sum (w + 12) h (unsigned times signed)
 * and sum l (w + 12) (the reverse), so P = 256 sum (w + 12) h +
 * sum (w + 12) l - 12 sum x is the exact integer the 16-bit products
 * give, and c takes the pair's four halves in order: the same bits as
 * mi_stream_1. This is pair p (k: its bytes in a row) of rows `rows`,
 * with their scales S, added to c. */
VNNI INLINE __m128 mi_stream_pair(const uint8_t *const *rows, int64_t p, __mmask64 k, int64_t ahead,
                                  const MiPair *q, const float *S, __m128 c) {
    const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MI_E2M1_X2_P12));
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512i sums[I16_ROWS];
    UNROLL for (int r = 0; r < I16_ROWS; r++) {
        /* the group of rows' bytes in order, not four streams */
        ffn_prefetch2((const char *)rows[0] + 256 * p + 64 * r, ahead);
        __m512i v = _mm512_maskz_loadu_epi8(k, rows[r] + 64 * p);
        __m512i lo = _mm512_shuffle_epi8(tab, _mm512_and_si512(v, nibble)); /* w + 12 */
        __m512i hi = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
        __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(q->h_even));
        h = _mm512_dpbusd_epi32(h, hi, _mm512_load_si512(q->h_odd));
        __m512i l = _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 8), _mm512_load_si512(q->l_even), lo);
        sums[r] = _mm512_dpbusd_epi32(l, _mm512_load_si512(q->l_odd), hi);
    }
    __m512i P = _mm512_sub_epi32(i16_quarters4(sums[0], sums[1], sums[2], sums[3]), _mm512_load_si512(q->hs));
    __m512 f = _mm512_cvtepi32_ps(P), s = _mm512_mul_ps(_mm512_loadu_ps(S + 16 * p), _mm512_load_ps(q->sx));
    c = _mm_fmadd_ps(_mm512_castps512_ps128(f), _mm512_castps512_ps128(s), c);
    c = _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 1), _mm512_extractf32x4_ps(s, 1), c);
    c = _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 2), _mm512_extractf32x4_ps(s, 2), c);
    return _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 3), _mm512_extractf32x4_ps(s, 3), c);
}

/* One token's rows o0 .. o0 + nr - 1 (the missing ones repeat the first
 * and are not stored); S: their scales. The whole pairs load without a
 * mask (measured 0.90x of a masked load every pair, cold), the last
 * half pair with one. */
VNNI static void mi_stream(const MiInfo *d, int64_t o0, int nr, const MiPair *pairs, const float *S, float *dst) {
    const int64_t ahead = rows_ahead(I16_ROWS * d->row_bytes), whole = d->row_bytes / 64;
    const uint8_t *rows[I16_ROWS];
    UNROLL for (int r = 0; r < I16_ROWS; r++) rows[r] = d->m->data + (o0 + (r < nr ? r : 0)) * d->row_bytes;
    __m128 c = _mm_setzero_ps();
    for (int64_t p = 0; p < whole; p++) c = mi_stream_pair(rows, p, ~(__mmask64)0, ahead, pairs + p, S, c);
    if (whole < mi_pairs(d))
        c = mi_stream_pair(rows, whole, ((__mmask64)1 << (d->row_bytes - 64 * whole)) - 1, ahead, pairs + whole, S, c);
    float v[4];
    _mm_storeu_ps(v, c);
    for (int r = 0; r < nr; r++) dst[o0 + r] = v[r];
}

/* Tokens T0 .. T0 + 3 (those below TB_) of block U from its decoded rows
 * a_, b_, into C: lane 4t + r is token T0 + t's row r. */
#define MI_FOUR(C, T0, U)                                                                    \
    do {                                                                                     \
        __m512i u_[4];                                                                       \
        UNROLL for (int t = 0; t < 4; t++)                                                   \
            u_[t] = (T0) + t < TB_ ? i16_quarters4(MI_SUM(a_[0], b_[0], (T0) + t, U),           \
                                                  MI_SUM(a_[1], b_[1], (T0) + t, U),           \
                                                  MI_SUM(a_[2], b_[2], (T0) + t, U),           \
                                                  MI_SUM(a_[3], b_[3], (T0) + t, U))           \
                                  : _mm512_setzero_si512();                                  \
        __m512i h0_, h1_; /* the four tokens' first halves, then their second */                 \
        i16_block_pairs4(u_[0], u_[1], u_[2], u_[3], &h0_, &h1_);                                 \
        __m512 x_ = _mm512_permutexvar_ps(fours, _mm512_castps128_ps512(_mm_loadu_ps(sxt + (U) * tp + (T0)))); \
        C = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h0_),                                              \
                            _mm512_mul_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(S + 8 * (U))), x_), C); \
        C = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h1_),                                              \
                            _mm512_mul_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(S + 8 * (U) + 4)), x_), C); \
    } while (0)

/* How far ahead a stream of more than one token prefetches its group of
 * rows' bytes: less than a token's stream needs (COLI_FFN_PREFETCH), as
 * each byte now feeds up to 16 tokens' products. */
enum { MI_AHEAD = 2048 };
/* TB tokens, four rows: block U, the rows decoded once for all TB. */
#define MI_BLOCKT(U, WHOLE)                                                                  \
    do {                                                                                     \
        __m512i a_[I16_ROWS], b_[I16_ROWS];                                                   \
        UNROLL for (int r = 0; r < I16_ROWS; r++) MI_DECODE(a_[r], b_[r], r, U, WHOLE);       \
        UNROLL for (int q = 0; q < MI_FOURS; q++) MI_FOUR(c[q], 4 * q, U);                   \
    } while (0)

/* TB tokens (xq: theirs; sxt: their block scales, block after block, tp
 * apart), rows o0 .. o0 + nr - 1 over every block: lane 4t + r of sum
 * vector t / 4 is token t's row r. Up to 16 tokens share one decode of
 * each block (measured in cache: 16 tokens of a Qwen3-30B-A3B expert in
 * about 0.9x the time of four calls of four). */
#define MI_STREAMT(TB)                                                                       \
    VNNI static void mi_stream_##TB(const MiInfo *d, int64_t o0, int nr, const int16_t *xq,  \
                                    const float *sxt, int64_t tp, const float *S, float *dst, \
                                    int64_t ld_dst) {                                        \
        enum { TB_ = TB };                                                                   \
        const int64_t ahead = MI_AHEAD;                                                      \
        const __m512i tab = _mm512_loadu_si512(MI_E2M1_X2), fours = _mm512_loadu_si512(I16_FOURS); \
        const uint8_t *rows[I16_ROWS];                                                        \
        UNROLL for (int r = 0; r < I16_ROWS; r++)                                             \
            rows[r] = d->m->data + (o0 + (r < nr ? r : 0)) * d->row_bytes;                   \
        enum { MI_FOURS = (TB + 3) / 4 };                                                    \
        __m512 c[MI_FOURS];                                                                  \
        UNROLL for (int q = 0; q < MI_FOURS; q++) c[q] = _mm512_setzero_ps();                \
        for (int64_t u = 0; u < d->whole; u++) MI_BLOCKT(u, 1);                              \
        if (d->whole < d->blocks) MI_BLOCKT(d->whole, 0);                                    \
        float v[16 * MI_FOURS];                                                              \
        UNROLL for (int q = 0; q < MI_FOURS; q++) _mm512_storeu_ps(v + 16 * q, c[q]);        \
        for (int t = 0; t < TB; t++)                                                         \
            for (int r = 0; r < nr; r++) dst[t * ld_dst + o0 + r] = v[4 * t + r];            \
    }
MI_STREAMT(1)
MI_STREAMT(2)
MI_STREAMT(4)
MI_STREAMT(8)
MI_STREAMT(16)
#undef MI_STREAMT
#undef MI_BLOCKT
#undef MI_FOUR
#undef MI_SUM
#undef MI_DECODE

typedef void (*MiStreamFn)(const MiInfo *d, int64_t o0, int nr, const int16_t *xq, const float *sxt,
                           int64_t tp, const float *S, float *dst, int64_t ld_dst);
/* Stream i takes 2^i tokens. */
static const MiStreamFn MI_STREAM_FNS[5] = {mi_stream_1, mi_stream_2, mi_stream_4, mi_stream_8, mi_stream_16};

/* The stream for the next *tb of left (>= 1) tokens: the largest that fits. */
static MiStreamFn mi_stream_fn(int left, int *tb) {
    int i = 4;
    while ((1 << i) > left) i--;
    *tb = 1 << i;
    return MI_STREAM_FNS[i];
}

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
 * with AMX, the inputs' tiles and QA_BUFS blocks' weight and sum tiles;
 * one token's pairs (mi_stream). */
typedef struct {
    size_t sx, A, S, acc, sxt, tiles, amx, pairs, total;
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
    s.pairs = s.amx + QA_BUFS * 5 * QA_TILE;
    s.total = s.pairs + sizeof(MiPair) * (size_t)mi_pairs(d);
    return s;
}

static size_t mi_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)n0, (void)n1;
    MiInfo d = mi_info(m);
    return mi_layout(&d, tokens).total;
}

static void mi_rows(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    MiInfo d = mi_info(m);
    /* the scale bytes' stream as far ahead as the rows' (whole groups of
     * rows): left to mi_params's first touch, they waited on memory */
    const int64_t pa = i16_params_ahead(d.row_bytes);
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
        MiPair *pairs = (MiPair *)(base + at.pairs);
        mi_pair_inputs(&d, xq, sx, pairs);
        for (int64_t o0 = n0; o0 < n1; o0 += I16_ROWS) {
            int nr = n1 - o0 < I16_ROWS ? (int)(n1 - o0) : I16_ROWS;
            i16_prefetch_rows(m->scales, m->groups, o0 + pa, n1);
            mi_params(&d, o0, nr, S);
            mi_stream(&d, o0, nr, pairs, S, task->dst);
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
        i16_prefetch_rows(m->scales, m->groups, o0 + pa, n1);
        mi_params(&d, o0, nr, S);
        for (int t0 = 0, tb; t0 < task->tokens; t0 += tb)
            mi_stream_fn(task->tokens - t0, &tb)(&d, o0, nr, xq + t0 * d.ldq, sxt + t0, tp, S,
                                                 task->dst + t0 * task->ld_dst, task->ld_dst);
    }
}

I16_ENTRIES(mi)
