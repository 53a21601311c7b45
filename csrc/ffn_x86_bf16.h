/*
 * ffn_x86_bf16.h (private, included once by ffn_x86.c): AVX-512 DOT
 * kernels for int4 and MXFP4 that multiply bfloat16 inputs with
 * vdpbf16ps (AVX512_BF16), two products per lane and instruction.
 *
 * Weights are decoded exactly into bfloat16: an MXFP4 weight e2m1 * 2^(e -
 * 127) has two significant bits, an int4 weight q - z is an integer below
 * 16 in magnitude (its scale is applied per group, in float32, after the
 * products). Inputs are the call's bfloat16 tokens (gate and up), or a
 * float32 activation split into a bfloat16 high part and the bfloat16
 * rounding of the rest (down: 16 significant bits, the parts' products
 * summed separately). Products are exact and sums float32 as elsewhere;
 * vdpbf16ps treats subnormal bfloat16 values as zero (weights below 2^-126:
 * MXFP4 scale exponents 0 and 1).
 *
 * Layout: inputs in EO64 order as bfloat16, so a block of 64 inputs is two
 * vectors of 32: A holds the 32 low nibbles of the block's 32 bytes (even
 * inputs), B the high ones; lane l of A pairs inputs 4l and 4l + 2.
 *
 * Sums, per (token, output) and input part (high, low):
 *   DIRECT (MXFP4): vector n (A of block b is n = 2b, B is 2b + 1) adds
 *     into chain n mod 4 with vdpbf16ps.
 *   GROUP (int4, groups a multiple of 64): per group g, pa = 0 then pa =
 *     vdpbf16ps(pa, w, x) over its A vectors in order, pb the same over its
 *     B vectors; chain g mod 4 = fma(pa + pb, scale, chain).
 *   BLOCK (int4, groups 32 mod 64): the same per block b (one A, one B),
 *     lanes 0..7 scaled by the first half's group, 8..15 by the second's.
 * Result: the lane tree of the parts' ((c0 + c1) + (c2 + c3)) added (high
 * + low). Every batch runs the same row function, TB tokens at a time.
 */

#define BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))

enum { BF_DIRECT, BF_GROUP, BF_BLOCK };

typedef struct {
    const ColiFfnMat *m;
    int mode;
    int64_t row_bytes, blocks;
    const uint16_t *mx;         /* MXFP4: the 16 bfloat16 values of each scale byte */
} BfInfo;

/* The MXFP4 tables (256 x 16 bfloat16), built once. */
static uint16_t MX_TABLES[256][16];
static pthread_once_t mx_once = PTHREAD_ONCE_INIT;

static void mx_tables(void) {
    static const float e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    for (int e = 0; e < 256; e++)
        for (int q = 0; q < 16; q++) MX_TABLES[e][q] = coli_f32_to_bf16(ldexpf(e2m1[q], e - 127));
}

/* One block's two vectors of weights, from its 32 bytes: dup, the table's
 * halves are equal (the index's bit 4 may be anything); otherwise bit 4
 * picks the half of the block's inputs (bytes 16..31: the second). */
BF16 INLINE void bf_decode(__m256i bytes, __m512i tab, int dup, __m512i *a, __m512i *b) {
    __m512i v = _mm512_cvtepu8_epi16(bytes);
    __m512i hi = _mm512_srli_epi16(v, 4);
    if (!dup) {
        const __m512i half = _mm512_set_epi64(0x0010001000100010LL, 0x0010001000100010LL,
                                              0x0010001000100010LL, 0x0010001000100010LL, 0, 0, 0, 0);
        v = _mm512_ternarylogic_epi64(v, _mm512_set1_epi16(0xf), half, 0xea);  /* (v & 15) | half */
        hi = _mm512_or_si512(hi, half);
    }
    *a = _mm512_permutexvar_epi16(v, tab);
    *b = _mm512_permutexvar_epi16(hi, tab);
}

/* int4's table of q - z for zero points za (words 0..15) and zb (16..31). */
BF16 INLINE __m512i bf_int4_table(float za, float zb) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(iota, _mm512_set1_ps(zb)),
                                        _mm512_sub_ps(iota, _mm512_set1_ps(za)));
}

BF16 INLINE __m512i bf_mx_table(const BfInfo *d, int64_t o, int64_t blk) {
    const ColiFfnMat *m = d->m;
    const uint8_t *e = m->scales + o * m->groups + 2 * blk;
    int eb = 2 * blk + 1 < m->groups ? e[1] : e[0];
    __m256i lo = _mm256_loadu_si256((const __m256i *)(d->mx + 16 * e[0]));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo),
                              _mm256_loadu_si256((const __m256i *)(d->mx + 16 * eb)), 1);
}

/* The bytes of block blk of a row, zeros past the row's end (a masked load:
 * no call in the loop, which would send every accumulator to memory). */
BF16 INLINE __m256i bf_bytes(const BfInfo *d, const uint8_t *row, int64_t blk) {
    int64_t left = (d->m->n_in - COLI_FFN_BLOCK * blk) / 2;
    __mmask32 k = left >= 32 ? 0xffffffffu : (1u << left) - 1;
    return _mm256_maskz_loadu_epi8(k, row + 32 * blk);
}

/* One unit (see the sums above) of the row for TB tokens and NS parts:
 * chain J of every (part, token) accumulator c. s and z: the row's group
 * scales and zero points (int4; BLOCK: per half block). */
#define BF_UNIT(MODE, NS, TB, U, J)                                                          \
    do {                                                                                     \
        if (MODE == BF_DIRECT) {                                                             \
            __m512i a_, b_;                                                                  \
            _mm_prefetch((const char *)row + 32 * (U) + COLI_FFN_PREFETCH, _MM_HINT_T0);    \
            bf_decode(bf_bytes(d, row, U), bf_mx_table(d, o, U), 0, &a_, &b_);               \
            UNROLL for (int s_ = 0; s_ < NS; s_++)                                           \
                UNROLL for (int t = 0; t < TB; t++) {                                        \
                    const uint16_t *xt = x + t * ldx + s_ * part + COLI_FFN_BLOCK * (U);     \
                    c[s_][t][(J) % 2 * 2] = _mm512_dpbf16_ps(c[s_][t][(J) % 2 * 2], (__m512bh)a_, \
                                                         (__m512bh)_mm512_loadu_si512(xt));  \
                    c[s_][t][(J) % 2 * 2 + 1] = _mm512_dpbf16_ps(c[s_][t][(J) % 2 * 2 + 1],  \
                                                                 (__m512bh)b_,               \
                                                         (__m512bh)_mm512_loadu_si512(xt + 32)); \
                }                                                                            \
        } else {                                                                             \
            int64_t b0_ = MODE == BF_GROUP ? (U) * per_ : (U);                              \
            int64_t ga_ = MODE == BF_GROUP ? (U) : 2 * (U), gb_ = ga_ + (MODE != BF_GROUP); \
            __m512i tab_ = bf_int4_table(z[ga_], z[gb_]);                                    \
            __m512 sc_ = _mm512_set1_ps(s[ga_]);                                             \
            if (MODE == BF_BLOCK) sc_ = _mm512_mask_mov_ps(sc_, 0xff00, _mm512_set1_ps(s[gb_])); \
            __m512 p_[NS][TB], q_[NS][TB];                                                   \
            UNROLL for (int s_ = 0; s_ < NS; s_++)                                           \
                UNROLL for (int t = 0; t < TB; t++) p_[s_][t] = q_[s_][t] = _mm512_setzero_ps(); \
            UNROLL for (int i_ = 0; i_ < (MODE == BF_GROUP ? per_ : 1); i_++) {               \
                __m512i a_, b_;                                                              \
                int64_t blk_ = b0_ + i_;                                                     \
                _mm_prefetch((const char *)row + 32 * blk_ + COLI_FFN_PREFETCH, _MM_HINT_T0); \
                bf_decode(bf_bytes(d, row, blk_), tab_, MODE == BF_GROUP, &a_, &b_);         \
                UNROLL for (int s_ = 0; s_ < NS; s_++)                                       \
                    UNROLL for (int t = 0; t < TB; t++) {                                    \
                        const uint16_t *xt = x + t * ldx + s_ * part + COLI_FFN_BLOCK * blk_; \
                        p_[s_][t] = _mm512_dpbf16_ps(p_[s_][t], (__m512bh)a_,                \
                                                     (__m512bh)_mm512_loadu_si512(xt));      \
                        q_[s_][t] = _mm512_dpbf16_ps(q_[s_][t], (__m512bh)b_,                \
                                                     (__m512bh)_mm512_loadu_si512(xt + 32)); \
                    }                                                                        \
            }                                                                                \
            UNROLL for (int s_ = 0; s_ < NS; s_++)                                           \
                UNROLL for (int t = 0; t < TB; t++)                                          \
                    c[s_][t][J] = _mm512_fmadd_ps(_mm512_add_ps(p_[s_][t], q_[s_][t]), sc_,   \
                                                  c[s_][t][J]);                              \
        }                                                                                    \
    } while (0)

/* Row o for tokens x (TB rows of ldx bfloat16, parts part apart) into
 * dst[t * ld_dst]. Units are unrolled by four so that chains are
 * registers; DIRECT units are blocks whose two vectors take chains
 * 2(b mod 2) and 2(b mod 2) + 1, which is chain n mod 4. GROUP rows have
 * PER blocks a group. */
#define BF_ROW(MODE, PER, NS, TB)                                                            \
    BF16 static void bf_row_##MODE##_##PER##_##NS##_##TB(                                   \
        const BfInfo *d, int64_t o, const uint16_t *x, int64_t ldx, int64_t part, float *dst, \
        int64_t ld_dst, const float *s, const float *z) {                                    \
        const uint8_t *row = d->m->data + o * d->row_bytes;                                  \
        int64_t units = MODE == BF_GROUP ? d->m->groups : d->blocks, u = 0;                  \
        const int per_ = PER;                                                                \
        __m512 c[NS][TB][4];                                                                 \
        (void)s, (void)z, (void)per_;                                                                 \
        UNROLL for (int s_ = 0; s_ < NS; s_++)                                               \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                UNROLL for (int j = 0; j < 4; j++) c[s_][t][j] = _mm512_setzero_ps();        \
        for (; u + 4 <= units; u += 4) {                                                     \
            BF_UNIT(MODE, NS, TB, u, 0);                                                     \
            BF_UNIT(MODE, NS, TB, u + 1, 1);                                                 \
            BF_UNIT(MODE, NS, TB, u + 2, 2);                                                 \
            BF_UNIT(MODE, NS, TB, u + 3, 3);                                                 \
        }                                                                                    \
        if (u < units) BF_UNIT(MODE, NS, TB, u, 0);                                          \
        if (u + 1 < units) BF_UNIT(MODE, NS, TB, u + 1, 1);                                  \
        if (u + 2 < units) BF_UNIT(MODE, NS, TB, u + 2, 2);                                  \
        UNROLL for (int t = 0; t < TB; t++) {                                                \
            __m512 v = _mm512_add_ps(_mm512_add_ps(c[0][t][0], c[0][t][1]),                  \
                                     _mm512_add_ps(c[0][t][2], c[0][t][3]));                 \
            if (NS == 2)                                                                     \
                v = _mm512_add_ps(v, _mm512_add_ps(_mm512_add_ps(c[NS - 1][t][0], c[NS - 1][t][1]), \
                                                   _mm512_add_ps(c[NS - 1][t][2], c[NS - 1][t][3]))); \
            dst[t * ld_dst] = tree_512(v);                                                   \
        }                                                                                    \
    }
#define BF_ROWS(MODE, PER) \
    BF_ROW(MODE, PER, 1, 1) BF_ROW(MODE, PER, 1, 2) BF_ROW(MODE, PER, 1, 3) BF_ROW(MODE, PER, 1, 4) \
    BF_ROW(MODE, PER, 2, 1) BF_ROW(MODE, PER, 2, 2)
BF_ROWS(BF_DIRECT, 0)
BF_ROWS(BF_BLOCK, 0)
BF_ROWS(BF_GROUP, 1)
BF_ROWS(BF_GROUP, 2)
BF_ROWS(BF_GROUP, 4)
#undef BF_ROWS
#undef BF_ROW
#undef BF_UNIT

typedef void (*BfRowFn)(const BfInfo *d, int64_t o, const uint16_t *x, int64_t ldx, int64_t part,
                        float *dst, int64_t ld_dst, const float *s, const float *z);
#define BF_FNS(MODE, PER) \
    {{bf_row_##MODE##_##PER##_1_1, bf_row_##MODE##_##PER##_1_2, bf_row_##MODE##_##PER##_1_3, \
      bf_row_##MODE##_##PER##_1_4}, {bf_row_##MODE##_##PER##_2_1, bf_row_##MODE##_##PER##_2_2, NULL, NULL}}
/* DIRECT, BLOCK, then GROUP of 64, 128 and 256 inputs. */
static const BfRowFn BF_ROW_FNS[5][2][4] = {BF_FNS(BF_DIRECT, 0), BF_FNS(BF_BLOCK, 0),
                                            BF_FNS(BF_GROUP, 1), BF_FNS(BF_GROUP, 2),
                                            BF_FNS(BF_GROUP, 4)};
#undef BF_FNS

/* Scratch: a row's group scales and zero points (BLOCK: two per block);
 * many tokens: a tile of rows, their parameters, the chains' sums. */
static int64_t bf_params_len(const ColiFfnMat *m) { return 2 * (m->n_in / 32 + 2); }

static size_t bf_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)n0, (void)n1;
    int64_t words = 4 * 64 * ((m->n_in + COLI_FFN_BLOCK - 1) / COLI_FFN_BLOCK);
    if (tokens <= COLI_FFN_STREAM_TOKENS) return sizeof(float) * (size_t)(2 * bf_params_len(m));
    return 2 * (size_t)words + sizeof(float) * (size_t)(8 * bf_params_len(m) + 2 * 4 * 4 * 4 * 16);
}

/* Row o's scales and zero points: per group (GROUP), per half block (BLOCK). */
static void bf_params(const ColiFfnMat *m, int mode, int64_t o, float *s, float *z) {
    if (mode == BF_GROUP) {
        for (int64_t g = 0; g < m->groups; g++) {
            s[g] = coli_ffn_scale_at(m, o * m->groups + g);
            z[g] = (float)coli_ffn_zero_at(m, o, g);
        }
        return;
    }
    int64_t n = 2 * ((m->n_in + COLI_FFN_BLOCK - 1) / COLI_FFN_BLOCK), g = 0, left = m->group;
    for (int64_t i = 0; i < n; i++) {  /* halves of 32 inputs; a group is a whole number of them */
        s[i] = 32 * i < m->n_in ? coli_ffn_scale_at(m, o * m->groups + g) : 0.0f;
        z[i] = 32 * i < m->n_in ? (float)coli_ffn_zero_at(m, o, g) : 0.0f;
        if ((left -= 32) == 0) {
            g++;
            left = m->group;
        }
    }
}

/* ---- many tokens: four rows decoded once into a tile of bfloat16 words
 * (vector n of a row at word 32n), then every token block over the tile,
 * one chain at a time: the same sums as the rows above. */

enum { BT_ROWS = 4 };

BF16 static void bf_decode_rows(const BfInfo *d, int64_t o0, int nr, uint16_t *tile, int64_t ld,
                                const float *z, int64_t zl) {
    const ColiFfnMat *m = d->m;
    int64_t per = d->mode == BF_GROUP ? m->group / COLI_FFN_BLOCK : 1;
    for (int r = 0; r < BT_ROWS; r++) {
        uint16_t *w = tile + r * ld;
        if (r >= nr) {
            memset(w, 0, sizeof(uint16_t) * (size_t)ld);
            continue;
        }
        const uint8_t *row = m->data + (o0 + r) * d->row_bytes;
        const float *zr = z + r * zl;
        __m512i tab = _mm512_setzero_si512();
        for (int64_t b = 0, g = 0, left = 0; b < d->blocks; b++) {
            __m512i a, bb;
            if (d->mode == BF_DIRECT) {
                tab = bf_mx_table(d, o0 + r, b);
            } else if (d->mode == BF_BLOCK) {
                tab = bf_int4_table(zr[2 * b], zr[2 * b + 1]);
            } else if (left-- == 0) {  /* a group's first block */
                tab = bf_int4_table(zr[g], zr[g]);
                g++;
                left = per - 1;
            }
            bf_decode(bf_bytes(d, row, b), tab, d->mode == BF_GROUP, &a, &bb);
            _mm512_storeu_si512(w + 64 * b, a);
            _mm512_storeu_si512(w + 64 * b + 32, bb);
        }
    }
}

/* DIRECT: chain j of TB tokens by four rows sums vectors n = j mod 4. */
#define BT_DIRECT(TB)                                                                        \
    BF16 static void bt_direct_##TB(const uint16_t *tile, int64_t ld, int64_t nvec,          \
                                    const uint16_t *x, int64_t ldx, float *acc) {            \
        UNROLL for (int j = 0; j < 4; j++) {                                                 \
            __m512 a[TB][BT_ROWS];                                                           \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                UNROLL for (int r = 0; r < BT_ROWS; r++) a[t][r] = _mm512_setzero_ps();      \
            for (int64_t n = j; n < nvec; n += 4) {                                          \
                __m512bh w[BT_ROWS];                                                         \
                UNROLL for (int r = 0; r < BT_ROWS; r++)                                     \
                    w[r] = (__m512bh)_mm512_loadu_si512(tile + r * ld + 32 * n);             \
                UNROLL for (int t = 0; t < TB; t++) {                                        \
                    __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * ldx + 32 * n);        \
                    UNROLL for (int r = 0; r < BT_ROWS; r++)                                 \
                        a[t][r] = _mm512_dpbf16_ps(a[t][r], w[r], xv);                       \
                }                                                                            \
            }                                                                                \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                UNROLL for (int r = 0; r < BT_ROWS; r++)                                     \
                    _mm512_storeu_ps(acc + ((t * BT_ROWS + r) * 4 + j) * 16, a[t][r]);       \
        }                                                                                    \
    }
BT_DIRECT(1)
BT_DIRECT(2)
BT_DIRECT(3)
BT_DIRECT(4)
#undef BT_DIRECT

/* GROUP and BLOCK: chain j of TB tokens by two rows (r0, r0 + 1) sums
 * units u = j mod 4 of vpu vectors each, scaled per unit. */
#define BT_SCALED(TB)                                                                        \
    BF16 static void bt_scaled_##TB(const uint16_t *tile, int64_t ld, int64_t units, int vpu, \
                                    int block, const uint16_t *x, int64_t ldx, const float *s, \
                                    int64_t sl, int r0, float *acc) {                        \
        UNROLL for (int j = 0; j < 4; j++) {                                                 \
            __m512 a[TB][2];                                                                 \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                UNROLL for (int r = 0; r < 2; r++) a[t][r] = _mm512_setzero_ps();            \
            for (int64_t u = j; u < units; u += 4) {                                         \
                __m512 p[2][TB][2];  /* A vectors, B vectors */                              \
                UNROLL for (int h = 0; h < 2; h++)                                           \
                    UNROLL for (int t = 0; t < TB; t++)                                      \
                        UNROLL for (int r = 0; r < 2; r++) p[h][t][r] = _mm512_setzero_ps(); \
                for (int64_t n = u * vpu; n < (u + 1) * vpu; n += 2) {                       \
                    UNROLL for (int h = 0; h < 2; h++) {                                     \
                        __m512bh w[2];                                                       \
                        UNROLL for (int r = 0; r < 2; r++)                                   \
                            w[r] = (__m512bh)_mm512_loadu_si512(tile + (r0 + r) * ld + 32 * (n + h)); \
                        UNROLL for (int t = 0; t < TB; t++) {                                \
                            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * ldx + 32 * (n + h)); \
                            UNROLL for (int r = 0; r < 2; r++)                               \
                                p[h][t][r] = _mm512_dpbf16_ps(p[h][t][r], w[r], xv);         \
                        }                                                                    \
                    }                                                                        \
                }                                                                            \
                UNROLL for (int r = 0; r < 2; r++) {                                         \
                    const float *sr = s + (r0 + r) * sl;                                     \
                    __m512 sc = _mm512_set1_ps(sr[block ? 2 * u : u]);                       \
                    if (block) sc = _mm512_mask_mov_ps(sc, 0xff00, _mm512_set1_ps(sr[2 * u + 1])); \
                    UNROLL for (int t = 0; t < TB; t++)                                      \
                        a[t][r] = _mm512_fmadd_ps(_mm512_add_ps(p[0][t][r], p[1][t][r]), sc, a[t][r]); \
                }                                                                            \
            }                                                                                \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                UNROLL for (int r = 0; r < 2; r++)                                           \
                    _mm512_storeu_ps(acc + ((t * BT_ROWS + r0 + r) * 4 + j) * 16, a[t][r]);  \
        }                                                                                    \
    }
BT_SCALED(1)
BT_SCALED(2)
BT_SCALED(3)
BT_SCALED(4)
#undef BT_SCALED

/* One part of TB tokens over the tile into acc[t][r][j][16]. */
static void bt_part(const BfInfo *d, const uint16_t *tile, int64_t ld, const uint16_t *x,
                    int64_t ldx, int tb, const float *s, int64_t sl, float *acc) {
    int64_t nvec = 2 * d->blocks;
    if (d->mode == BF_DIRECT) {
        switch (tb) {
        case 1: bt_direct_1(tile, ld, nvec, x, ldx, acc); break;
        case 2: bt_direct_2(tile, ld, nvec, x, ldx, acc); break;
        case 3: bt_direct_3(tile, ld, nvec, x, ldx, acc); break;
        default: bt_direct_4(tile, ld, nvec, x, ldx, acc); break;
        }
        return;
    }
    int block = d->mode == BF_BLOCK;
    int vpu = block ? 2 : (int)(2 * (d->m->group / COLI_FFN_BLOCK));
    int64_t units = block ? d->blocks : d->m->groups;
    for (int r0 = 0; r0 < BT_ROWS; r0 += 2) switch (tb) {
        case 1: bt_scaled_1(tile, ld, units, vpu, block, x, ldx, s, sl, r0, acc); break;
        case 2: bt_scaled_2(tile, ld, units, vpu, block, x, ldx, s, sl, r0, acc); break;
        case 3: bt_scaled_3(tile, ld, units, vpu, block, x, ldx, s, sl, r0, acc); break;
        default: bt_scaled_4(tile, ld, units, vpu, block, x, ldx, s, sl, r0, acc); break;
        }
}

BF16 static void bf_tiled(const BfInfo *d, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    const ColiFfnMat *m = d->m;
    int64_t ld = 64 * d->blocks, sl = bf_params_len(m), part = ns == 2 ? task->ldx / 2 : 0;
    uint16_t *tile = (uint16_t *)task->scratch;
    float *s = (float *)(tile + BT_ROWS * ld), *z = s + BT_ROWS * sl;
    float *acc = z + BT_ROWS * sl;  /* [part][t][r][chain][16] */
    const uint16_t *x = (const uint16_t *)task->x;
    for (int64_t o0 = n0; o0 < n1; o0 += BT_ROWS) {
        int nr = n1 - o0 < BT_ROWS ? (int)(n1 - o0) : BT_ROWS;
        for (int r = 0; r < nr && d->mode != BF_DIRECT; r++)
            bf_params(m, d->mode, o0 + r, s + r * sl, z + r * sl);
        bf_decode_rows(d, o0, nr, tile, ld, z, sl);
        for (int t0 = 0; t0 < task->tokens; t0 += 4) {
            int tb = task->tokens - t0 < 4 ? task->tokens - t0 : 4;
            for (int p = 0; p < ns; p++)
                bt_part(d, tile, ld, x + t0 * task->ldx + p * part, task->ldx, tb, s, sl,
                        acc + p * 4 * BT_ROWS * 4 * 16);
            for (int t = 0; t < tb; t++)
                for (int r = 0; r < nr; r++) {
                    __m512 v = _mm512_setzero_ps();
                    for (int p = 0; p < ns; p++) {
                        const float *a = acc + ((p * 4 + t) * BT_ROWS + r) * 4 * 16;
                        __m512 c = _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16)),
                                                 _mm512_add_ps(_mm512_loadu_ps(a + 32), _mm512_loadu_ps(a + 48)));
                        v = p ? _mm512_add_ps(v, c) : c;
                    }
                    task->dst[(t0 + t) * task->ld_dst + o0 + r] = tree_512(v);
                }
        }
    }
}

/* Rows one after another; each row runs every token block while its bytes
 * are in cache. ns: input parts (1: bfloat16 tokens; 2: high and low). */
static void bf_rows(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task, int ns) {
    BfInfo d = {m, BF_DIRECT, m->n_in / 2, (m->n_in + COLI_FFN_BLOCK - 1) / COLI_FFN_BLOCK, NULL};
    int fns = 0;  /* BF_ROW_FNS' first index */
    if (m->format == COLI_TENSOR_FP4_NATIVE_BLOCK) {
        pthread_once(&mx_once, mx_tables);
        d.mx = &MX_TABLES[0][0];
    } else if (m->group % COLI_FFN_BLOCK) {
        d.mode = BF_BLOCK;
        fns = 1;
    } else {
        d.mode = BF_GROUP;
        fns = m->group == 64 ? 2 : m->group == 128 ? 3 : 4;
    }
    if (task->tokens > COLI_FFN_STREAM_TOKENS) {
        bf_tiled(&d, n0, n1, task, ns);
        return;
    }
    float *s = (float *)task->scratch, *z = s + bf_params_len(m);
    int step = 4 / ns;
    int64_t part = ns == 2 ? task->ldx / 2 : 0;
    for (int64_t o = n0; o < n1; o++) {
        if (d.mode != BF_DIRECT) bf_params(m, d.mode, o, s, z);
        for (int t0 = 0; t0 < task->tokens; t0 += step) {
            int tb = task->tokens - t0 < step ? task->tokens - t0 : step;
            BF_ROW_FNS[fns][ns - 1][tb - 1](&d, o, (const uint16_t *)task->x + t0 * task->ldx,
                                            task->ldx, part, task->dst + t0 * task->ld_dst + o,
                                            task->ld_dst, s, z);
        }
    }
}

static void bf_run_x(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    bf_rows(m, n0, n1, task, 1);
}

static void bf_run_split(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    bf_rows(m, n0, n1, task, 2);
}

/* Whether a matrix has a bf16 kernel: MXFP4; int4 in groups of 64, 128 or
 * 256 inputs or an odd multiple of 32. */
static int bf_takes(const ColiFfnMat *m) {
    if (m->format == COLI_TENSOR_FP4_NATIVE_BLOCK) return 1;
    if (m->format != COLI_TENSOR_INT4_BLOCK || m->group % 32) return 0;
    return m->group % 64 || m->group == 64 || m->group == 128 || m->group == 256;
}

#undef BF16
