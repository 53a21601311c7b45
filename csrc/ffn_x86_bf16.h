/*
 * ffn_x86_bf16.h (private, included once by ffn_x86.c): the AVX-512
 * kernel for MXFP4 that multiplies bfloat16 inputs with vdpbf16ps
 * (AVX512_BF16), two products per lane and instruction, and what the
 * integer kernels of int4, GPTQ and AWQ share with it (ffn_x86_int4.h,
 * ffn_x86_gx.h).
 *
 * Inputs are the call's bfloat16 tokens (gate and up), or a float32
 * activation split into a bfloat16 high part and the bfloat16 rounding of
 * the rest (down: 16 significant bits). Weights are decoded exactly into
 * bfloat16, so every product is exact; sums are float32. vdpbf16ps treats
 * subnormal bfloat16 values as zero.
 *
 * A "term" below is one vdpbf16ps of a weight vector with the matching
 * input vector; with two input parts (down), a weight vector makes two
 * terms, the high part's first.
 *
 * MXFP4 (inputs in EO64 order). A block of 64 inputs is 32 bytes, two
 * vectors: A the 32 low nibbles (even inputs), B the high ones, each
 * looked up (vpermw) in the table of e2m1 * 2^(e - 127) of its half
 * block's scale byte (two significant bits: exact; below 2^-126, scale
 * exponents 0 and 1, it counts as zero). Sum: two chains, the terms of
 * each block's A vector into chain 0, its B vector's into chain 1, block
 * after block; the result is the lane tree of c0 + c1.
 *
 * A few tokens stream the weights, several rows side by side; MXFP4 with
 * more tokens decodes rows once into a tile, a slice of inputs at a time,
 * the chains waiting in scratch between slices (its decode competes with the
 * products). Every loop performs the sums above, so a token's bits do not
 * depend on its batch.
 */

#define BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))

enum { BF_ROWS = 4, BF_STREAM_TOKENS = 2, BT_TOKENS = 4 };

/* How far ahead streaming kernels prefetch: cold weights need about 8 KiB
 * in flight for one thread to read at the memory's streaming rate
 * (measured: 2 KiB reads 25-35% slower). */
enum { BF_AHEAD = COLI_FFN_PREFETCH };

/* The distance of whole groups of rows (group_bytes each) of at least
 * BF_AHEAD bytes. */
static int64_t rows_ahead(int64_t group_bytes) {
    int64_t k = (BF_AHEAD + group_bytes - 1) / group_bytes;
    return (k < 1 ? 1 : k) * group_bytes;
}

/* ================================================================ MXFP4 */

typedef struct {
    const ColiFfnMat *m;
    int64_t row_bytes, blocks;
    int64_t whole;              /* blocks holding 64 inputs (the last may hold 32) */
    const uint16_t *mx;         /* the 16 bfloat16 values of each scale byte */
} BfInfo;

/* The MXFP4 tables (256 x 16 bfloat16), built once. */
static uint16_t MX_TABLES[256][16];
static pthread_once_t mx_once = PTHREAD_ONCE_INIT;

static void mx_tables(void) {
    for (int e = 0; e < 256; e++)
        for (int q = 0; q < 16; q++) MX_TABLES[e][q] = coli_f32_to_bf16(ldexpf(coli_ffn_e2m1[q], e - 127));
}

static BfInfo bf_info(const ColiFfnMat *m) {
    pthread_once(&mx_once, mx_tables);
    BfInfo d = {m, m->n_in / 2, (m->n_in + COLI_FFN_BLOCK - 1) / COLI_FFN_BLOCK, 0, &MX_TABLES[0][0]};
    d.whole = m->n_in / COLI_FFN_BLOCK;
    return d;
}

/* A block's two vectors of weights from its 32 bytes; bit 4 of each index
 * picks the table's half (bytes 16..31: the second half block). */
BF16 INLINE void bf_decode(__m256i bytes, __m512i tab, __m512i *a, __m512i *b) {
    const __m512i half = _mm512_set_epi64(0x0010001000100010LL, 0x0010001000100010LL,
                                          0x0010001000100010LL, 0x0010001000100010LL, 0, 0, 0, 0);
    __m512i v = _mm512_cvtepu8_epi16(bytes);
    __m512i hi = _mm512_or_si512(_mm512_srli_epi16(v, 4), half);
    v = _mm512_ternarylogic_epi64(v, _mm512_set1_epi16(0xf), half, 0xea);  /* (v & 15) | half */
    *a = _mm512_permutexvar_epi16(v, tab);
    *b = _mm512_permutexvar_epi16(hi, tab);
}

/* The table of block blk of row o (a last half block repeats its only
 * scale). */
BF16 INLINE __m512i bf_mx_table(const BfInfo *d, int64_t o, int64_t blk) {
    const ColiFfnMat *m = d->m;
    const uint8_t *e = m->scales + o * m->groups + 2 * blk;
    int eb = 2 * blk + 1 < m->groups ? e[1] : e[0];
    __m256i lo = _mm256_loadu_si256((const __m256i *)(d->mx + 16 * e[0]));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo),
                              _mm256_loadu_si256((const __m256i *)(d->mx + 16 * eb)), 1);
}

/* The bytes of block blk of a row: whole, or its first 16 (the rest zero). */
BF16 INLINE __m256i bf_bytes(const uint8_t *row, int64_t blk, int whole) {
    if (whole) return _mm256_loadu_si256((const __m256i *)(row + 32 * blk));
    return _mm256_maskz_loadu_epi8(0xffff, row + 32 * blk);
}

/* The terms of weight vector W (A: H = 0, B: H = 1) of block BLK for TB_
 * tokens into ACC[t] (x: tokens ldx apart, parts part apart). */
#define BF_TERMS(ACC, W, BLK, H)                                                             \
    UNROLL for (int t = 0; t < TB_; t++)                                                     \
        UNROLL for (int s = 0; s < NS_; s++)                                                 \
            ACC[t] = _mm512_dpbf16_ps(ACC[t], (__m512bh)(W), (__m512bh)_mm512_loadu_si512(   \
                                          x + t * ldx + s * part + COLI_FFN_BLOCK * (BLK) + 32 * (H)))

/* Block U of every row. WHOLE: it holds 64 inputs. */
#define BF_STREAM_BLOCK(U, WHOLE)                                                            \
    UNROLL for (int r = 0; r < BF_ROWS; r++) {                                               \
        __m512i a, b;                                                                        \
        if (r < 2) /* the group's bytes in order, not four streams (measured faster) */      \
            _mm_prefetch((const char *)rows[0] + ahead + 64 * (2 * (U) + r), _MM_HINT_T0);   \
        bf_decode(bf_bytes(rows[r], U, WHOLE), bf_mx_table(d, orow[r], U), &a, &b);          \
        BF_TERMS(c[r], a, U, 0);                                                             \
        BF_TERMS(c2[r], b, U, 1);                                                            \
    }

/* Rows o0 .. o0 + nr - 1 (nr <= BF_ROWS; the missing ones repeat the
 * first and are not stored) for TB tokens and NS parts. */
#define BF_STREAM(TB, NS)                                                                    \
    BF16 static void bf_stream_##TB##_##NS(const BfInfo *d, int64_t o0, int nr,             \
                                           const uint16_t *x, int64_t ldx, int64_t part,     \
                                           float *dst, int64_t ld_dst) {                     \
        enum { TB_ = TB, NS_ = NS };                                                         \
        const uint8_t *rows[BF_ROWS];                                                        \
        int64_t orow[BF_ROWS];                                                               \
        /* Each row prefetches its place in the rows after this group. */                    \
        const int64_t ahead = rows_ahead(BF_ROWS * d->row_bytes);                            \
        __m512 c[BF_ROWS][TB], c2[BF_ROWS][TB];                                              \
        UNROLL for (int r = 0; r < BF_ROWS; r++) {                                           \
            orow[r] = o0 + (r < nr ? r : 0);                                                 \
            rows[r] = d->m->data + orow[r] * d->row_bytes;                                   \
            UNROLL for (int t = 0; t < TB; t++) c[r][t] = c2[r][t] = _mm512_setzero_ps();   \
        }                                                                                    \
        for (int64_t u = 0; u < d->whole; u++) BF_STREAM_BLOCK(u, 1);                        \
        if (d->whole < d->blocks) BF_STREAM_BLOCK(d->whole, 0);                              \
        UNROLL for (int r = 0; r < BF_ROWS; r++)                                             \
            if (r < nr)                                                                      \
                UNROLL for (int t = 0; t < TB; t++)                                          \
                    dst[t * ld_dst + o0 + r] = tree_512(_mm512_add_ps(c[r][t], c2[r][t]));   \
    }
BF_STREAM(1, 1)
BF_STREAM(2, 1)
BF_STREAM(1, 2)
BF_STREAM(2, 2)
#undef BF_STREAM
#undef BF_STREAM_BLOCK
#undef BF_TERMS

typedef void (*BfStreamFn)(const BfInfo *d, int64_t o0, int nr, const uint16_t *x, int64_t ldx,
                           int64_t part, float *dst, int64_t ld_dst);
static const BfStreamFn BF_STREAM_FNS[2][BF_STREAM_TOKENS] = {{bf_stream_1_1, bf_stream_2_1},
                                                               {bf_stream_1_2, bf_stream_2_2}};

/* Many tokens: BF_ROWS rows, a slice of BT_SLICE blocks of inputs at a
 * time, decoded into a tile (row r's vector n of the slice at word
 * r * 64 BT_SLICE + 32 n), then every block of tokens over it, a chain at
 * a time; the chains of every (token, row) wait in scratch between slices
 * (a chain still takes its terms block after block). A tile of the rows'
 * whole width (114 KiB for Mixtral's down) was read back from L2 by every
 * block of tokens; the slice's tile stays in L1 (measured: slices of 16
 * blocks 0.82x the time of whole rows at 16 tokens; 4, 8 and 32 blocks, or
 * panels of 8 or 16 rows, slower). */
enum { BT_SLICE = 16 };

/* Blocks b0 .. b1 - 1 of rows o0 .. o0 + BF_ROWS - 1 into the tile (rows
 * past nr repeat the first: their sums are not stored). The whole blocks
 * from locals (the tile's stores would otherwise reload every field from
 * the descriptions: measured 7 cycles a block), a last half block as the
 * streaming kernels decode it. */
BF16 static void bf_decode_slice(const BfInfo *d, int64_t o0, int nr, int64_t b0, int64_t b1,
                                 uint16_t *tile) {
    const uint8_t *const data = d->m->data, *const scales = d->m->scales;
    const uint16_t *const mx = d->mx;
    const int64_t groups = d->m->groups, row_bytes = d->row_bytes;
    const int64_t bw = b1 < d->whole ? b1 : d->whole;
    for (int r = 0; r < BF_ROWS; r++) {
        int64_t o = o0 + (r < nr ? r : 0);
        uint16_t *w = tile + r * 64 * BT_SLICE - 64 * b0;
        const uint8_t *row = data + o * row_bytes, *e = scales + o * groups;
        for (int64_t b = b0; b < bw; b++) {
            __m512i a, bb;
            if (b % 2 == 0) _mm_prefetch((const char *)row + 32 * b + BF_AHEAD, _MM_HINT_T0);
            __m512i tab = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(mx + 16 * e[2 * b]))),
                _mm256_loadu_si256((const __m256i *)(mx + 16 * e[2 * b + 1])), 1);
            bf_decode(_mm256_loadu_si256((const __m256i *)(row + 32 * b)), tab, &a, &bb);
            _mm512_storeu_si512(w + 64 * b, a);
            _mm512_storeu_si512(w + 64 * b + 32, bb);
        }
        for (int64_t b = bw; b < b1; b++) {
            __m512i a, bb;
            bf_decode(bf_bytes(row, b, 0), bf_mx_table(d, o, b), &a, &bb);
            _mm512_storeu_si512(w + 64 * b, a);
            _mm512_storeu_si512(w + 64 * b + 32, bb);
        }
    }
}

/* TB tokens by the tile's rows over nb blocks, NS parts: chain h of (t, r)
 * from and back to acc[((t * BF_ROWS + r) * 2 + h) * 16]. */
#define BT_KERNEL(TB, NS)                                                                    \
    BF16 static void bt_##TB##_##NS(const uint16_t *tile, int64_t nb, const uint16_t *x,    \
                                    int64_t ldx, int64_t part, float *acc) {                 \
        UNROLL for (int h = 0; h < 2; h++) {                                                 \
            __m512 a[TB][BF_ROWS];                                                           \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                UNROLL for (int r = 0; r < BF_ROWS; r++)                                     \
                    a[t][r] = _mm512_loadu_ps(acc + ((t * BF_ROWS + r) * 2 + h) * 16);      \
            for (int64_t b = 0; b < nb; b++) {                                               \
                __m512bh w[BF_ROWS];                                                         \
                UNROLL for (int r = 0; r < BF_ROWS; r++)                                     \
                    w[r] = (__m512bh)_mm512_loadu_si512(tile + r * 64 * BT_SLICE + 64 * b + 32 * h); \
                UNROLL for (int t = 0; t < TB; t++)                                          \
                    UNROLL for (int s = 0; s < NS; s++) {                                    \
                        __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * ldx + s * part +  \
                                                                   64 * b + 32 * h);         \
                        UNROLL for (int r = 0; r < BF_ROWS; r++)                             \
                            a[t][r] = _mm512_dpbf16_ps(a[t][r], w[r], xv);                   \
                    }                                                                        \
            }                                                                                \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                UNROLL for (int r = 0; r < BF_ROWS; r++)                                     \
                    _mm512_storeu_ps(acc + ((t * BF_ROWS + r) * 2 + h) * 16, a[t][r]);      \
        }                                                                                    \
    }
BT_KERNEL(1, 1)
BT_KERNEL(2, 1)
BT_KERNEL(3, 1)
BT_KERNEL(4, 1)
BT_KERNEL(1, 2)
BT_KERNEL(2, 2)
BT_KERNEL(3, 2)
BT_KERNEL(4, 2)
#undef BT_KERNEL

typedef void (*BtFn)(const uint16_t *tile, int64_t nb, const uint16_t *x, int64_t ldx,
                     int64_t part, float *acc);
static const BtFn BT_FNS[2][BT_TOKENS] = {{bt_1_1, bt_2_1, bt_3_1, bt_4_1},
                                          {bt_1_2, bt_2_2, bt_3_2, bt_4_2}};

/* Scratch of the tiled path: the tile, then the chains of every (token, row). */
static size_t bf_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)m, (void)n0, (void)n1;
    if (tokens <= BF_STREAM_TOKENS) return 0;
    return sizeof(uint16_t) * (size_t)(BF_ROWS * 64 * BT_SLICE) +
           sizeof(float) * (size_t)(tokens * BF_ROWS * 2 * 16);
}

BF16 static void bf_tiled(const BfInfo *d, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    int64_t part = ns == 2 ? task->ldx / 2 : 0;
    uint16_t *tile = (uint16_t *)task->scratch;
    float *acc = (float *)(tile + BF_ROWS * 64 * BT_SLICE);
    const uint16_t *x = (const uint16_t *)task->x;
    const int64_t lda = BF_ROWS * 2 * 16;  /* a token's chains */
    for (int64_t o0 = n0; o0 < n1; o0 += BF_ROWS) {
        int nr = n1 - o0 < BF_ROWS ? (int)(n1 - o0) : BF_ROWS;
        memset(acc, 0, sizeof(float) * (size_t)(task->tokens * lda));
        for (int64_t b0 = 0; b0 < d->blocks; b0 += BT_SLICE) {
            int64_t b1 = d->blocks - b0 < BT_SLICE ? d->blocks : b0 + BT_SLICE;
            bf_decode_slice(d, o0, nr, b0, b1, tile);
            for (int t0 = 0; t0 < task->tokens; t0 += BT_TOKENS) {
                int tb = task->tokens - t0 < BT_TOKENS ? task->tokens - t0 : BT_TOKENS;
                BT_FNS[ns - 1][tb - 1](tile, b1 - b0, x + t0 * task->ldx + 64 * b0, task->ldx,
                                       part, acc + t0 * lda);
            }
        }
        for (int t = 0; t < task->tokens; t++)
            for (int r = 0; r < nr; r++) {
                const float *a = acc + t * lda + r * 2 * 16;
                task->dst[t * task->ld_dst + o0 + r] =
                    tree_512(_mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16)));
            }
    }
}

/* ns: input parts (1: bfloat16 tokens; 2: high and low). */
static void bf_rows(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    BfInfo d = bf_info(m);
    if (task->tokens > BF_STREAM_TOKENS) {
        bf_tiled(&d, n0, n1, task, ns);
        return;
    }
    int64_t part = ns == 2 ? task->ldx / 2 : 0;
    BfStreamFn fn = BF_STREAM_FNS[ns - 1][task->tokens - 1];
    for (int64_t o0 = n0; o0 < n1; o0 += BF_ROWS)
        fn(&d, o0, n1 - o0 < BF_ROWS ? (int)(n1 - o0) : BF_ROWS, (const uint16_t *)task->x,
           task->ldx, part, task->dst, task->ld_dst);
}

static void bf_run_x(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    bf_rows(m, n0, n1, task, 1);
}

static void bf_run_split(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    bf_rows(m, n0, n1, task, 2);
}

/* Scales of format f from element i on (k: the lanes to load) as floats. */
BF16 INLINE __m512 qs_scales(ColiScaleFormat f, const uint8_t *scales, int64_t i, __mmask16 k) {
    if (f == COLI_SCALE_F32) return _mm512_maskz_loadu_ps(k, scales + 4 * i);
    __m256i h = _mm256_maskz_loadu_epi16(k, scales + 2 * i);
    if (f == COLI_SCALE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#undef BF16
