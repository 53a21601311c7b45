/*
 * ffn_x86_bf16.h (private, included once by ffn_x86.c): AVX-512 kernels
 * for MXFP4, GPTQ and AWQ that multiply bfloat16 inputs with vdpbf16ps
 * (AVX512_BF16), two products per lane and instruction (int4's multiplies
 * 16-bit integers: ffn_x86_int4.h).
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

/* ================================================================ GPTQ
 *
 * Stored (in, out): a word row holds eight inputs of each output. Lanes
 * are outputs; inputs in G8 order (inside each 8, input j at 2j and input
 * j + 4 at 2j + 1, j < 4), so that vector j of a word row, the words
 * shifted right by 4j, masked to nibbles j and j + 4 and OR 0x43004300,
 * pairs with the tokens' 32-bit pair (2j, 2j + 1): bfloat16 128 + q again,
 * no table. Sum, per output and group g: p = 0, then per two word rows of
 * the group in order, a0 = p plus the first row's terms (vectors 0..3) in
 * turn, a1 = 0 plus the second's, p = a0 + a1 (a row past the group adds
 * exact zeros); acc = fma(p - (128 + z) * xs_g, s, acc), the first product
 * rounded in an FMA (xs_g: the group sum of the token's inputs the driver
 * gives). Result: acc. */

/* A range of outputs of a GPTQ or AWQ matrix (AWQ's below). */
typedef struct {
    const ColiFfnMat *m;
    int awq;
    int64_t c0, n;              /* outputs [c0, c0 + n) */
    int64_t nv;                 /* GPTQ: vectors of 16 outputs; AWQ: segments of 128 */
    int64_t words;              /* AWQ: words of a row in the range */
    int64_t wpg;                /* GPTQ: word rows per group */
    int64_t ahead;              /* GPTQ: prefetch this many stored rows ahead */
} GxInfo;

static GxInfo gx_info(const ColiFfnMat *m, int64_t n0, int64_t n1) {
    GxInfo g = {m, m->format == COLI_TENSOR_INT4_AWQ, n0, n1 - n0, 0, (n1 - n0 + 7) / 8, m->group / 8, 1};
    g.nv = g.awq ? (g.words + 15) / 16 : (g.n + 15) / 16;
    int64_t bytes = g.awq ? 4 * g.words : 4 * g.n;  /* of a stored row in the range */
    g.ahead = (BF_AHEAD + bytes - 1) / bytes;
    if (g.ahead < 1) g.ahead = 1;
    return g;
}

BF16 INLINE __mmask16 gq_lanes(const GxInfo *q, int64_t v) {
    int64_t left = q->n - 16 * v;
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* Group g's 128 + z and s for vector v's outputs. */
BF16 INLINE void gq_params(const GxInfo *q, int64_t g, int64_t v, __m512 *zv, __m512 *sv) {
    const ColiFfnMat *m = q->m;
    int64_t o = q->c0 + 16 * v;
    __mmask16 k = gq_lanes(q, v);
    const __m512i word = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i shift = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    __m512i w = _mm512_maskz_loadu_epi32(k > 0xff ? 3 : 1, m->zeros + 4 * (g * (m->n_out / 8) + o / 8));
    w = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(word, w), shift), _mm512_set1_epi32(0xf));
    *zv = _mm512_add_ps(_mm512_cvtepi32_ps(w), _mm512_set1_ps(128.0f + (float)m->zero_plus_one));
    *sv = qs_scales(m->scale_format, m->scales, g * m->n_out + o, k);
}

/* A group of a GPTQ or AWQ panel (info: its GxInfo; zsv: the group's 128 +
 * z and s of every sum vector of the panel, 32 floats each). */
typedef void (*GxGroupFn)(const void *info, int64_t g, const float *zsv, const uint16_t *x,
                          int64_t ldx, int64_t part, const float *xs, int64_t ldxs, float *p,
                          float *acc, int64_t ldp);
/* A group's zsv for a panel. */
typedef void (*GxParamsFn)(const void *info, int64_t g, float *zsv);
/* One token's results of a panel from its sums. */
typedef void (*GxStoreFn)(const void *info, const float *acc, float *dst);

/* The group's flush of n sum vectors for tb tokens: acc = fma(p - (128 + z)
 * xs, s, acc) (xs: token t's group sum at xs[t * ldxs]). */
BF16 INLINE void gx_flush(const float *zsv, int64_t n, int tb, const float *xs, int64_t ldxs,
                          const float *p, float *acc, int64_t ldp) {
    for (int64_t i = 0; i < n; i++) {
        __m512 zv = _mm512_loadu_ps(zsv + 32 * i), sv = _mm512_loadu_ps(zsv + 32 * i + 16);
        for (int t = 0; t < tb; t++) {
            __m512 d = _mm512_fnmadd_ps(zv, _mm512_set1_ps(xs[t * ldxs]), _mm512_loadu_ps(p + t * ldp + 16 * i));
            _mm512_storeu_ps(acc + t * ldp + 16 * i,
                             _mm512_fmadd_ps(d, sv, _mm512_loadu_ps(acc + t * ldp + 16 * i)));
        }
    }
}

/* Group g's scales and zero points of outputs [o, o + n) into L1, a cache
 * line at a time (ss: a scale's bytes): called for the next group during a
 * group's first pass over its rows, so that the params' first touch at the
 * group's start does not miss (spread along the rows' stream: a burst
 * stalls it). */
BF16 INLINE void gx_prefetch_params(const ColiFfnMat *m, int64_t g, int64_t o, int64_t n, int64_t ss) {
    if (g >= m->groups) return;
    const char *s = (const char *)m->scales + ss * (g * m->n_out + o);
    for (int64_t b = 0; b < ss * n; b += 64) _mm_prefetch(s + b, _MM_HINT_T0);
    if (o % 128 == 0 || (o + n) / 128 > o / 128)  /* a zero point line holds 128 outputs */
        _mm_prefetch((const char *)m->zeros + 4 * (g * (m->n_out / 8) + o / 8), _MM_HINT_T0);
}

BF16 static void gq_group_params(const void *info, int64_t g, float *zsv) {
    const GxInfo *q = info;
    for (int64_t v = 0; v < q->nv; v++) {
        __m512 zv, sv;
        gq_params(q, g, v, &zv, &sv);
        _mm512_storeu_ps(zsv + 32 * v, zv);
        _mm512_storeu_ps(zsv + 32 * v + 16, sv);
    }
}

/* Group g of the range's vectors for TB tokens, NS parts: p (TB rows of ldp
 * floats) gets the terms, acc the group's flush. */
#define GQ_GROUP(TB, NS)                                                                     \
    BF16 static void gq_group_##TB##_##NS(const void *info, int64_t g, const float *zsv,    \
                                          const uint16_t *x, int64_t ldx, int64_t part,      \
                                          const float *xs, int64_t ldxs, float *p,           \
                                          float *acc, int64_t ldp) {                         \
        const GxInfo *q = info;                                                              \
        const ColiFfnMat *m = q->m;                                                          \
        const int64_t v1 = q->nv;                                                            \
        const int64_t rs = m->n_out * 4;                                                     \
        const __m512i lo = _mm512_set1_epi32(0x000f000f), bias = _mm512_set1_epi32(0x43004300); \
        int64_t r1 = (g + 1) * q->wpg;                                                       \
        const int64_t ss = m->scale_format == COLI_SCALE_F32 ? 4 : 2;                        \
        for (int t = 0; t < TB; t++) memset(p + t * ldp, 0, sizeof(float) * (size_t)(16 * v1)); \
        /* Two word rows per pass over p; a row past the group is zeros (its
         * terms add exact zeros). */                                                      \
        for (int64_t r = g * q->wpg; r < r1; r += 2) {                                       \
            const uint8_t *row[2];                                                           \
            __mmask16 use[2];                                                                \
            __m512bh xp[2][TB][4][NS];                                                       \
            UNROLL for (int i = 0; i < 2; i++) {                                             \
                int64_t ri = r + i < r1 ? r + i : r;                                         \
                row[i] = m->data + ri * rs + q->c0 * 4;                                      \
                use[i] = r + i < r1 ? 0xffff : 0;                                            \
                UNROLL for (int t = 0; t < TB; t++)                                          \
                    UNROLL for (int j = 0; j < 4; j++)                                       \
                        UNROLL for (int h = 0; h < NS; h++) {                                \
                            int32_t pair = 0;                                                \
                            if (use[i]) memcpy(&pair, x + t * ldx + h * part + 8 * ri + 2 * j, sizeof pair); \
                            xp[i][t][j][h] = (__m512bh)_mm512_set1_epi32(pair);              \
                        }                                                                    \
            }                                                                                \
            for (int64_t v = 0; v < v1; v++) {                                               \
                __mmask16 k = gq_lanes(q, v);                                                \
                if (r == g * q->wpg) gx_prefetch_params(m, g + 1, q->c0 + 16 * v, q->n - 16 * v < 16 ? q->n - 16 * v : 16, ss); \
                __m512 a[2][TB]; /* two chains: the first row's terms after p, the second's */ \
                UNROLL for (int t = 0; t < TB; t++) {                                        \
                    a[0][t] = _mm512_loadu_ps(p + t * ldp + 16 * v);                         \
                    a[1][t] = _mm512_setzero_ps();                                           \
                }                                                                            \
                UNROLL for (int i = 0; i < 2; i++) {                                         \
                    ffn_prefetch2((const char *)row[i] + 64 * v, q->ahead * rs);               \
                    __m512i w = _mm512_maskz_loadu_epi32(k & use[i], row[i] + 64 * v), n[4];  \
                    n[0] = _mm512_ternarylogic_epi32(w, lo, bias, 0xea);                     \
                    UNROLL for (int j = 1; j < 4; j++)                                       \
                        n[j] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(w, 4 * j), lo, bias, 0xea); \
                    UNROLL for (int t = 0; t < TB; t++)                                      \
                        UNROLL for (int j = 0; j < 4; j++)                                   \
                            UNROLL for (int h = 0; h < NS; h++)                              \
                                a[i][t] = _mm512_dpbf16_ps(a[i][t], (__m512bh)n[j], xp[i][t][j][h]); \
                }                                                                            \
                UNROLL for (int t = 0; t < TB; t++)                                          \
                    _mm512_storeu_ps(p + t * ldp + 16 * v, _mm512_add_ps(a[0][t], a[1][t]));  \
            }                                                                                \
        }                                                                                    \
        gx_flush(zsv, q->nv, TB, xs, ldxs, p, acc, ldp);                                     \
    }
GQ_GROUP(1, 1)
GQ_GROUP(2, 1)
GQ_GROUP(1, 2)
GQ_GROUP(2, 2)
GQ_GROUP(4, 1)
GQ_GROUP(4, 2)
#undef GQ_GROUP

static const GxGroupFn GQ_GROUPS[2][3] = {{gq_group_1_1, gq_group_2_1, gq_group_4_1},
                                          {gq_group_1_2, gq_group_2_2, gq_group_4_2}};

/* Tokens of a panel at a time beyond two tokens (their sums in scratch). */
enum { GX_TOKENS = 32, GX_TB = 4 };  /* GX_TB: the largest block of tokens of a group */

/* Every token of a panel: blocks of up to GX_TOKENS tokens, each group
 * for every four of them, then two, then one (the group's rows of the panel
 * stay in cache; four share each decoded vector: measured faster than two,
 * and eight spill registers), then the results. */
static void gx_tokens(const void *info, const GxGroupFn fns[3], GxParamsFn params, GxStoreFn store,
                      int64_t groups, const ColiFfnTask *task, int64_t part, float *p, float *acc,
                      int64_t ldp, float *zsv) {
    const uint16_t *x = (const uint16_t *)task->x;
    for (int b0 = 0; b0 < task->tokens; b0 += GX_TOKENS) {
        int nb = task->tokens - b0 < GX_TOKENS ? task->tokens - b0 : GX_TOKENS;
        memset(acc, 0, sizeof(float) * (size_t)(nb * ldp));
        for (int64_t g = 0; g < groups; g++) {
            params(info, g, zsv);
            for (int t0 = b0; t0 < b0 + nb;) {
                int left = b0 + nb - t0, tb = left >= 4 ? 4 : left >= 2 ? 2 : 1;
                fns[tb / 2](info, g, zsv, x + t0 * task->ldx, task->ldx, part,
                            task->xs + t0 * task->ldxs + g, task->ldxs, p, acc + (t0 - b0) * ldp, ldp);
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
 * nibble n: output 8w + AWQ's order[n]). Inputs in plain order, paired (k,
 * k + 1): the 16 words of a segment (128 outputs) of rows k and k + 1,
 * interleaved by 16-bit halves (vpunpck{l,h}wd: U_u, u = 0, 1), hold in
 * each dword a half word of row k and the same of row k + 1; vector 4u + j
 * (j < 4) is U_u shifted right by 4j, masked to nibbles and OR 0x43004300:
 * per lane the pair (row k's nibble, row k + 1's) as bfloat16 128 + q.
 * Lane d of vector 4u + j is word 4(d / 4) + 2u + (d % 4) / 2, nibble
 * 4 (d % 2) + j. Sum, per output and group: p = 0, then for each pair of
 * rows of the group in order, its term (both parts) into p (a last odd row
 * pairs with zeros); acc = fma(p - (128 + z) * xs_g, s, acc). */

static const uint8_t AWQ_ORDER[8] = {0, 2, 4, 6, 1, 3, 5, 7};  /* nibble n holds column order[n] */

BF16 INLINE __mmask16 aq_lanes(const GxInfo *a, int64_t seg) {
    int64_t left = a->words - 16 * seg;
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* Word of lane d of vector 4u + j (see above). */
BF16 INLINE __m512i aq_word(int u) {
    __m512i d = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(d, 2), 2),
                            _mm512_add_epi32(_mm512_set1_epi32(2 * u),
                                             _mm512_srli_epi32(_mm512_and_si512(d, _mm512_set1_epi32(3)), 1)));
}

/* Group g's 128 + z and s of vector 4u + j of segment seg. */
BF16 INLINE void aq_params(const GxInfo *a, int64_t g, int64_t seg, int u, int j, __m512 *zv, __m512 *sv) {
    const ColiFfnMat *m = a->m;
    __mmask16 k = aq_lanes(a, seg);
    int64_t w0 = a->c0 / 8 + 16 * seg;
    __m512i z = _mm512_maskz_loadu_epi32(k, m->zeros + 4 * (g * (m->n_out / 8) + w0));
    z = u ? _mm512_unpackhi_epi16(z, z) : _mm512_unpacklo_epi16(z, z);
    z = _mm512_and_si512(_mm512_srli_epi32(z, (unsigned)(4 * j)), _mm512_set1_epi32(0xf));
    *zv = _mm512_add_ps(_mm512_cvtepi32_ps(z), _mm512_set1_ps(128.0f));
    /* Lane d: output 8 word + order[nibble], a gather. */
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i d = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i nib = _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(d, _mm512_set1_epi32(1)), 2),
                                   _mm512_set1_epi32(j));
    __m512i idx = _mm512_add_epi32(_mm512_slli_epi32(aq_word(u), 3), _mm512_permutexvar_epi32(nib, order));
    __mmask16 kw = _mm512_cmplt_epi32_mask(aq_word(u), _mm512_set1_epi32((int)(a->words - 16 * seg)));
    int64_t base = g * m->n_out + 8 * w0;
    if (m->scale_format == COLI_SCALE_F32) {
        *sv = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), kw, idx, m->scales + 4 * base, 4);
    } else {
        /* 16-bit scales: gather 32 bits at each (2-byte aligned) scale, keep the low half. */
        __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), kw, idx, m->scales + 2 * base, 2);
        h = _mm512_and_si512(h, _mm512_set1_epi32(0xffff));
        *sv = m->scale_format == COLI_SCALE_F16 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h))
                                                : _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    }
}

BF16 static void aq_group_params(const void *info, int64_t g, float *zsv) {
    const GxInfo *a = info;
    for (int64_t seg = 0; seg < a->nv; seg++)
        for (int n = 0; n < 8; n++) {
            __m512 zv, sv;
            aq_params(a, g, seg, n / 4, n % 4, &zv, &sv);
            _mm512_storeu_ps(zsv + 32 * (8 * seg + n), zv);
            _mm512_storeu_ps(zsv + 32 * (8 * seg + n) + 16, sv);
        }
}

/* Group g of the range's segments for TB tokens, NS parts into p (TB rows
 * of ldp floats: segment seg's vector n at 16 (8 seg + n)), then acc. */
#define AQ_GROUP(TB, NS)                                                                     \
    BF16 static void aq_group_##TB##_##NS(const void *info, int64_t g, const float *zsv,    \
                                          const uint16_t *x, int64_t ldx, int64_t part,      \
                                          const float *xs, int64_t ldxs, float *p,           \
                                          float *acc, int64_t ldp) {                         \
        const GxInfo *a = info;                                                              \
        const ColiFfnMat *m = a->m;                                                          \
        const int64_t rs = m->n_out / 2;                                                     \
        const int64_t ss = m->scale_format == COLI_SCALE_F32 ? 4 : 2;                        \
        const __m512i lo = _mm512_set1_epi32(0x000f000f), bias = _mm512_set1_epi32(0x43004300); \
        int64_t k0 = g * m->group, k1 = k0 + m->group < m->n_in ? k0 + m->group : m->n_in;  \
        for (int t = 0; t < TB; t++) memset(p + t * ldp, 0, sizeof(float) * (size_t)(128 * a->nv)); \
        if (a->nv <= 4) { /* a panel of many tokens: segment by segment, its 8 sums    \
                           * in registers over the group's rows (in cache after the     \
                           * first tokens): the same terms in the same order */         \
            /* the next group's rows of the panel into L2 while this one works,   \
             * a row's at a time (a burst of them stalls the loads) */                   \
            const int64_t next = (k1 - k0) * rs, kn = m->n_in - (k1 - k0);                  \
            /* VP vectors of a segment per pass over the rows: all 8 for two     \
             * tokens, U_0's 4 then U_1's for four (registers) */                \
            enum { VP = TB > 2 ? 4 : 8 };                                                    \
            for (int64_t seg = 0; seg < a->nv; seg++) {                                      \
                __mmask16 lanes = aq_lanes(a, seg);                                          \
                UNROLL for (int n0 = 0; n0 < 8; n0 += VP) {                                  \
                    __m512 s8[VP][TB];                                                       \
                    UNROLL for (int n = 0; n < VP; n++)                                      \
                        UNROLL for (int t = 0; t < TB; t++) s8[n][t] = _mm512_setzero_ps();  \
                    for (int64_t k = k0; k < k1; k += 2) {                                   \
                        const uint8_t *ra = m->data + k * rs + a->c0 / 2 + 64 * seg;         \
                        if (n0 == 0 && k < kn) {                                             \
                            _mm_prefetch((const char *)ra + next, _MM_HINT_T1);              \
                            if (k + 1 < kn) _mm_prefetch((const char *)ra + rs + next, _MM_HINT_T1); \
                        }                                                                    \
                        __m512i A = _mm512_maskz_loadu_epi32(lanes, ra);                     \
                        __m512i B = _mm512_maskz_loadu_epi32(k + 1 < k1 ? lanes : 0, ra + rs); \
                        __m512i U[2] = {_mm512_unpacklo_epi16(A, B), _mm512_unpackhi_epi16(A, B)}; \
                        __m512bh xk[TB][NS];                                                 \
                        UNROLL for (int t = 0; t < TB; t++)                                  \
                            UNROLL for (int h = 0; h < NS; h++) {                            \
                                int32_t pair;                                                \
                                memcpy(&pair, x + t * ldx + h * part + k, sizeof pair);      \
                                xk[t][h] = (__m512bh)_mm512_set1_epi32(pair);                \
                            }                                                                \
                        UNROLL for (int n = 0; n < VP; n++) {                                \
                            int v = n0 + n;                                                  \
                            __m512i w = _mm512_ternarylogic_epi32(                           \
                                _mm512_srli_epi32(U[v / 4], (unsigned)(4 * (v % 4))), lo, bias, 0xea); \
                            UNROLL for (int t = 0; t < TB; t++)                              \
                                UNROLL for (int h = 0; h < NS; h++)                          \
                                    s8[n][t] = _mm512_dpbf16_ps(s8[n][t], (__m512bh)w, xk[t][h]); \
                        }                                                                    \
                    }                                                                        \
                    UNROLL for (int n = 0; n < VP; n++)                                      \
                        UNROLL for (int t = 0; t < TB; t++)                                  \
                            _mm512_storeu_ps(p + t * ldp + 16 * (8 * seg + n0 + n), s8[n][t]); \
                }                                                                            \
            }                                                                                \
            gx_flush(zsv, 8 * a->nv, TB, xs, ldxs, p, acc, ldp);                             \
            return;                                                                          \
        }                                                                                    \
        /* Rows streamed: NP pairs of rows per pass over p (four with one
         * token: half the traffic; two with two: registers); a pair past the
         * group is zeros (its terms add exact zeros). */                                  \
        enum { NP = TB == 1 ? 4 : 2 };                                                       \
        for (int64_t k = k0; k < k1; k += 2 * NP) {                                          \
            const uint8_t *ra[NP], *rb[NP];                                                  \
            __mmask16 use[NP][2];                                                            \
            __m512bh xp[NP][TB][NS];                                                         \
            UNROLL for (int i = 0; i < NP; i++) {                                            \
                int64_t ki = k + 2 * i;                                                      \
                ra[i] = m->data + (ki < k1 ? ki : k0) * rs + a->c0 / 2;                      \
                rb[i] = ra[i] + rs;                                                          \
                use[i][0] = ki < k1 ? 0xffff : 0;                                            \
                use[i][1] = ki + 1 < k1 ? 0xffff : 0;                                        \
                UNROLL for (int t = 0; t < TB; t++)                                          \
                    UNROLL for (int h = 0; h < NS; h++) {                                    \
                        int32_t pair = 0;                                                    \
                        if (ki < k1) memcpy(&pair, x + t * ldx + h * part + ki, sizeof pair); \
                        xp[i][t][h] = (__m512bh)_mm512_set1_epi32(pair);                     \
                    }                                                                        \
            }                                                                                \
            /* the next block of rows into L1 in memory order as they go (one       \
             * stream: each row's own prefetch made 2 NP streams) */                   \
            int64_t pk = k + 2 * NP, pseg = 0;                                               \
            for (int64_t seg = 0; seg < a->nv; seg++) {                                    \
                __mmask16 lanes = aq_lanes(a, seg);                                          \
                UNROLL for (int i = 0; i < 2 * NP; i++) {                                    \
                    if (pk < m->n_in)                                                        \
                        _mm_prefetch((const char *)m->data + pk * rs + a->c0 / 2 + 64 * pseg, _MM_HINT_T0); \
                    if (++pseg == a->nv) pseg = 0, pk++;                                     \
                }                                                                            \
                if (k == k0) gx_prefetch_params(m, g + 1, a->c0 + 128 * seg, a->n - 128 * seg < 128 ? a->n - 128 * seg : 128, ss); \
                __m512i A[NP], B[NP];                                                        \
                UNROLL for (int i = 0; i < NP; i++) {                                        \
                    A[i] = _mm512_maskz_loadu_epi32(lanes & use[i][0], ra[i] + 64 * seg);    \
                    B[i] = _mm512_maskz_loadu_epi32(lanes & use[i][1], rb[i] + 64 * seg);    \
                }                                                                            \
                __m512i U[NP][2];                                                            \
                UNROLL for (int i = 0; i < NP; i++) {                                        \
                    U[i][0] = _mm512_unpacklo_epi16(A[i], B[i]);                             \
                    U[i][1] = _mm512_unpackhi_epi16(A[i], B[i]);                             \
                }                                                                            \
                UNROLL for (int n = 0; n < 8; n++) {                                         \
                    __m512 acc_[TB];                                                         \
                    UNROLL for (int t = 0; t < TB; t++)                                      \
                        acc_[t] = _mm512_loadu_ps(p + t * ldp + 16 * (8 * seg + n));         \
                    UNROLL for (int i = 0; i < NP; i++) {                                    \
                        __m512i w = _mm512_ternarylogic_epi32(                               \
                            _mm512_srli_epi32(U[i][n / 4], (unsigned)(4 * (n % 4))), lo, bias, 0xea); \
                        UNROLL for (int t = 0; t < TB; t++)                                  \
                            UNROLL for (int h = 0; h < NS; h++)                              \
                                acc_[t] = _mm512_dpbf16_ps(acc_[t], (__m512bh)w, xp[i][t][h]); \
                    }                                                                        \
                    UNROLL for (int t = 0; t < TB; t++)                                      \
                        _mm512_storeu_ps(p + t * ldp + 16 * (8 * seg + n), acc_[t]);         \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        gx_flush(zsv, 8 * a->nv, TB, xs, ldxs, p, acc, ldp);                                 \
    }
AQ_GROUP(1, 1)
AQ_GROUP(2, 1)
AQ_GROUP(1, 2)
AQ_GROUP(2, 2)
AQ_GROUP(4, 1)
AQ_GROUP(4, 2)
#undef AQ_GROUP

static const GxGroupFn AQ_GROUPS[2][3] = {{aq_group_1_1, aq_group_2_1, aq_group_4_1},
                                          {aq_group_1_2, aq_group_2_2, aq_group_4_2}};

static void aq_store(const void *info, const float *acc, float *dst) {
    const GxInfo *a = info;
    for (int64_t seg = 0; seg < a->nv; seg++)
        for (int v = 0; v < 8; v++)
            for (int d = 0; d < 16; d++) {
                int64_t w = 16 * seg + 4 * (d / 4) + 2 * (v / 4) + (d % 4) / 2;
                int64_t c = 8 * w + AWQ_ORDER[4 * (d % 2) + v % 4];
                if (c < a->n) dst[a->c0 + c] = acc[16 * (8 * seg + v) + d];
            }
}

/* AWQ in groups of an even number of rows. */
static int aq_takes(const ColiFfnMat *m) {
    return m->format == COLI_TENSOR_INT4_AWQ && m->group % 2 == 0;
}

/* ---- GPTQ and AWQ: panels of a range, blocks of tokens. */

/* Units (vectors or segments) per panel: a few tokens, the whole range
 * (whole stored rows stream in order: narrower panels measured slower
 * cold); more, 512 outputs, so that a group's rows of the panel stay in
 * cache while every block of four tokens runs over them. */
static int64_t gx_panel(const GxInfo *q, int tokens) {
    int64_t u = tokens <= 2 ? q->nv : 512 / (q->awq ? 128 : 16);
    return u > q->nv ? q->nv : u;
}

/* Rows of p: the largest block of tokens a call runs (two at least). */
static int64_t gx_p_rows(int tokens) { return tokens > 2 ? GX_TB : 2; }

static size_t gx_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    GxInfo q = gx_info(m, n0, n1);
    int64_t ldp = (q.awq ? 128 : 16) * gx_panel(&q, tokens);  /* the floats of a panel's sum vectors */
    int nb = tokens < GX_TOKENS ? tokens : GX_TOKENS;  /* p, acc, the params */
    return sizeof(float) * (size_t)((gx_p_rows(tokens) + nb + 2) * ldp);
}

BF16 static void gx_rows(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    GxInfo q = gx_info(m, n0, n1);
    int64_t pu = gx_panel(&q, task->tokens), width = q.awq ? 128 : 16, ldp = width * pu;
    int64_t part = ns == 2 ? task->ldx / 2 : 0;
    float *p = (float *)task->scratch, *acc = p + gx_p_rows(task->tokens) * ldp;
    for (int64_t u0 = 0; u0 < q.nv; u0 += pu) {
        GxInfo qp = q;  /* the panel */
        qp.c0 = n0 + width * u0;
        qp.n = q.n - width * u0 < ldp ? q.n - width * u0 : ldp;
        qp.words = (qp.n + 7) / 8;
        qp.nv = (qp.n + width - 1) / width;
        gx_tokens(&qp, q.awq ? AQ_GROUPS[ns - 1] : GQ_GROUPS[ns - 1],
                  q.awq ? aq_group_params : gq_group_params, q.awq ? aq_store : gq_store, m->groups,
                  task, part, p, acc, ldp, acc + (task->tokens < GX_TOKENS ? task->tokens : GX_TOKENS) * ldp);
    }
}

static void gx_run_x(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    gx_rows(m, n0, n1, task, 1);
}

static void gx_run_split(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    gx_rows(m, n0, n1, task, 2);
}

#undef BF16
