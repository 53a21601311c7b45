/*
 * ffn_neon.c: the arm64 path, on baseline ARMv8-A AdvSIMD (every arm64 CPU
 * has it: no dotprod, bf16 or i8mm is assumed). Vectors are 4 float lanes.
 *
 * Kernels (float32 inputs; a bfloat16 call's tokens come as floats):
 *
 *   DOT, stored (out, in): BF16, F16, F32, FP8 e4m3 and e5m2 and FP8 with
 *   block scales in input order; compressed-tensors int4 and MXFP4 in EO64
 *   order (inside each block of 64 inputs the 32 even ones, then the 32
 *   odd ones: what a byte's low and high nibbles hold). A row's weights, in
 *   the kernel's order, are vectors n = 0, 1, ... of 4; vector n adds w * x
 *   into chain n mod 4 of the (token, output) with an FMA (vfmaq_f32), in
 *   increasing n; the result is s = (c0 + c1) + (c2 + c3), then
 *   (s0 + s2) + (s1 + s3) of its lanes. A weight is its value rounded once,
 *   as the scalar path decodes it: (q - z) * s, e2m1 * 2^(e - 127), an FP8
 *   value times its block scale.
 *
 *   SINGLE, stored (in, out): plain and FP8 (gpt-oss's and Llama 4's float
 *   experts), GPTQ (with or without act order) and AWQ. Lanes are outputs;
 *   one running sum per output, acc = fma(w_k, x_k, acc) in input order,
 *   w_k the weight as the scalar path rounds it: the plain value (times its
 *   FP8 block scale), or (q - z) * s of input k's group.
 *
 * DOT: batches of at most COLI_FFN_STREAM_TOKENS tokens stream the rows
 * one after another, decoded in registers; larger batches decode a tile of
 * 4 rows once and run blocks of four tokens over it (16 sums in registers,
 * chain by chain). SINGLE: panels of 64 outputs, their sums in L1; per 8
 * inputs, per segment of 16 outputs and block of four tokens the sums are
 * held in registers while the 8 inputs' weights are decoded and added (the
 * panel's bytes read from memory once, re-decoded from L1 per block). Every
 * loop performs the sums above, so a token's result does not depend on its
 * batch, its place in it, the split of the outputs or the thread.
 *
 * Decoding: BF16 is widened by a shift (shll), F16 and e5m2 (an f16's top
 * byte) converted (fcvtl), e4m3's bits moved into an f16 and times 2^8
 * (exact; 0x7f and 0xff made NaN). An int4 or MXFP4 group's 16 values are
 * a table of four byte planes (byte j of each float); tbl looks a vector
 * of 16 nibbles up in each plane and two rounds of zips put the bytes
 * back into floats. Int4 groups that are not a multiple of 32 inputs, and FP8 scale
 * blocks not a multiple of 4 columns, decode rows with the scalar code.
 * GPTQ's nibbles are a shift and a mask of each output's word; AWQ's, the
 * low and high nibbles of a segment's two words put in output order by one
 * tbl.
 */
#if defined(__aarch64__)

#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "ffn_internal.h"

/* The decoders reinterpret loaded bytes as little-endian lanes. */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the neon path assumes little-endian arm64"
#endif

/* Helpers are inlined so that vectors stay in registers and each kernel's
 * format is a constant in its loops. */
#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

enum { LN = 4, VPB = COLI_FFN_BLOCK / LN, TB_MAX = 4, TILE_ROWS = 4 };

static const float IOTA[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

INLINE float32x4_t f32_of_u8(uint8x16_t v) { return vreinterpretq_f32_u8(v); }

/* ------------------------------------------------------------ plain elements */

/* 16 e4m3 bytes as floats, four vectors. */
INLINE void e4m3_16(uint8x16_t b, float32x4_t *w) {
    const float32x4_t nan = vdupq_n_f32(NAN), k256 = vdupq_n_f32(256.0f);
    for (int h = 0; h < 2; h++) {
        uint16x8_t v = h ? vmovl_high_u8(b) : vmovl_u8(vget_low_u8(b));
        uint16x8_t mag = vandq_u16(v, vdupq_n_u16(0x7f));
        uint16x8_t f16 = vorrq_u16(vshlq_n_u16(vandq_u16(v, vdupq_n_u16(0x80)), 8), vshlq_n_u16(mag, 7));
        int16x8_t isnan = vreinterpretq_s16_u16(vceqq_u16(mag, vdupq_n_u16(0x7f)));
        float16x8_t hf = vreinterpretq_f16_u16(f16);
        float32x4_t lo = vmulq_f32(vcvt_f32_f16(vget_low_f16(hf)), k256);
        float32x4_t hi = vmulq_f32(vcvt_high_f32_f16(hf), k256);
        w[2 * h] = vbslq_f32(vreinterpretq_u32_s32(vmovl_s16(vget_low_s16(isnan))), nan, lo);
        w[2 * h + 1] = vbslq_f32(vreinterpretq_u32_s32(vmovl_high_s16(isnan)), nan, hi);
    }
}

/* 16 plain elements of a kind at p as 4 vectors. */
INLINE void plain16(int kind, const uint8_t *p, float32x4_t *w) {
    switch (kind) {
    case K_F32:
        UNROLL for (int v = 0; v < 4; v++) w[v] = f32_of_u8(vld1q_u8(p + 16 * v));
        return;
    case K_BF16:
        UNROLL for (int i = 0; i < 2; i++) {
            uint16x8_t h = vreinterpretq_u16_u8(vld1q_u8(p + 16 * i));
            w[2 * i] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
            w[2 * i + 1] = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
        }
        return;
    case K_F16:
        UNROLL for (int i = 0; i < 2; i++) {
            float16x8_t h = vreinterpretq_f16_u8(vld1q_u8(p + 16 * i));
            w[2 * i] = vcvt_f32_f16(vget_low_f16(h));
            w[2 * i + 1] = vcvt_high_f32_f16(h);
        }
        return;
    case K_E5M2: {
        uint8x16_t b = vld1q_u8(p);
        float16x8_t lo = vreinterpretq_f16_u16(vshll_n_u8(vget_low_u8(b), 8));
        float16x8_t hi = vreinterpretq_f16_u16(vshll_high_n_u8(b, 8));
        w[0] = vcvt_f32_f16(vget_low_f16(lo));
        w[1] = vcvt_high_f32_f16(lo);
        w[2] = vcvt_f32_f16(vget_low_f16(hi));
        w[3] = vcvt_high_f32_f16(hi);
        return;
    }
    default: e4m3_16(vld1q_u8(p), w); return;
    }
}

INLINE int kind_bytes(int kind) { return kind == K_F32 ? 4 : kind == K_F16 || kind == K_BF16 ? 2 : 1; }

/* 64 plain elements of a kind at p as 16 vectors. */
INLINE void plain_block(int kind, const uint8_t *p, float32x4_t w[VPB]) {
    const int eb = kind_bytes(kind);
    UNROLL for (int i = 0; i < 4; i++) plain16(kind, p + 16 * eb * i, w + 4 * i);
}

/* ------------------------------------------------------------ nibble tables */

/* A group's 16 values as four byte planes (plane j: byte j of each). */
typedef uint8x16x4_t Table;

INLINE Table table_of(const float t[16]) { return vld4q_u8((const uint8_t *)t); }

/* int4's ((q - zero) * scale) or MXFP4's e2m1 * 2^(e - 127) for q = 0..15,
 * as the scalar path rounds them. */
static Table nibble_table(const ColiFfnMat *m, int64_t o, int64_t g) {
    float t[16] __attribute__((aligned(16)));
    if (m->format == COLI_TENSOR_FP4_NATIVE_BLOCK) {
        int e = m->scales[o * m->groups + g];
        if (e == 255) {
            for (int q = 0; q < 16; q++) t[q] = ldexpf(coli_ffn_e2m1[q], 128);
        } else {
            float32x4_t p = vdupq_n_f32(coli_ffn_ue8m0(e));
            for (int i = 0; i < 4; i++) vst1q_f32(t + 4 * i, vmulq_f32(vld1q_f32(coli_ffn_e2m1 + 4 * i), p));
        }
        return table_of(t);
    }
    float32x4_t z = vdupq_n_f32((float)coli_ffn_zero_at(m, o, g));
    float32x4_t s = vdupq_n_f32(coli_ffn_scale_at(m, o * m->groups + g));
    for (int i = 0; i < 4; i++)
        vst1q_f32(t + 4 * i, vmulq_f32(vsubq_f32(vld1q_f32(IOTA + 4 * i), z), s));
    return table_of(t);
}

/* The table's values of 16 nibbles (bytes 0..15), in order, four vectors. */
INLINE void lookup16(Table t, uint8x16_t q, float32x4_t *w) {
    uint8x16_t b0 = vqtbl1q_u8(t.val[0], q), b1 = vqtbl1q_u8(t.val[1], q);
    uint8x16_t b2 = vqtbl1q_u8(t.val[2], q), b3 = vqtbl1q_u8(t.val[3], q);
    uint16x8_t l01 = vreinterpretq_u16_u8(vzip1q_u8(b0, b1)), h01 = vreinterpretq_u16_u8(vzip2q_u8(b0, b1));
    uint16x8_t l23 = vreinterpretq_u16_u8(vzip1q_u8(b2, b3)), h23 = vreinterpretq_u16_u8(vzip2q_u8(b2, b3));
    w[0] = vreinterpretq_f32_u16(vzip1q_u16(l01, l23));
    w[1] = vreinterpretq_f32_u16(vzip2q_u16(l01, l23));
    w[2] = vreinterpretq_f32_u16(vzip1q_u16(h01, h23));
    w[3] = vreinterpretq_f32_u16(vzip2q_u16(h01, h23));
}

/* ------------------------------------------------------------ DOT rows */

typedef struct {
    const ColiFfnMat *m;
    int kind, slow, eb;
    int64_t row_bytes, blocks;
} DotInfo;

static DotInfo dot_info(const ColiFfnMat *m) {
    DotInfo d;
    memset(&d, 0, sizeof d);
    d.m = m;
    d.kind = coli_ffn_row_kind(m);
    int nib = d.kind == K_NIB;
    d.eb = nib ? 0 : kind_bytes(d.kind);
    d.slow = nib ? m->group % 32 != 0
                 : m->format == COLI_TENSOR_FP8_E4M3_BLOCK && m->block_columns % LN != 0;
    d.row_bytes = nib ? m->n_in / 2 : m->n_in * d.eb;
    d.blocks = (m->n_in + COLI_FFN_BLOCK - 1) / COLI_FFN_BLOCK;
    return d;
}

/* Where a row walk is: its next block's bytes, the group (nibbles) or FP8
 * scale block and how many inputs are left in it. */
typedef struct {
    const uint8_t *src;
    int64_t o, g, left;
    Table tab;
    const float *srow;
    float32x4_t sc;
} Walk;

INLINE void walk_start(const DotInfo *d, int64_t o, Walk *k) {
    const ColiFfnMat *m = d->m;
    k->src = m->data + o * d->row_bytes;
    k->o = o;
    k->g = 0;
    k->srow = NULL;
    k->sc = vdupq_n_f32(1.0f);
    k->left = 0;
    if (d->kind == K_NIB) {
        k->tab = nibble_table(m, o, 0);
        k->left = m->group;
    } else if (m->format == COLI_TENSOR_FP8_E4M3_BLOCK) {
        k->srow = (const float *)m->scales +
                  (o / m->block_rows) * ((m->cols + m->block_columns - 1) / m->block_columns);
        k->sc = vdupq_n_f32(*k->srow);
        k->left = m->block_columns;
    }
}

/* Block b of the row (the walk's next) as 16 vectors in the kernel's order:
 * a last, partial block through a zeroed copy. */
INLINE void walk_block(int kind, const DotInfo *d, Walk *k, int64_t b, float32x4_t w[VPB]) {
    const ColiFfnMat *m = d->m;
    const uint8_t *p = k->src;
    int64_t k0 = b * COLI_FFN_BLOCK;
    uint8_t pad[COLI_FFN_BLOCK * 4] __attribute__((aligned(16)));
    int bb = kind == K_NIB ? COLI_FFN_BLOCK / 2 : COLI_FFN_BLOCK * kind_bytes(kind);
    if (k0 + COLI_FFN_BLOCK > m->n_in) {
        memset(pad, 0, sizeof pad);
        memcpy(pad, p, (size_t)(kind == K_NIB ? (m->n_in - k0) / 2 : (m->n_in - k0) * kind_bytes(kind)));
        p = pad;
    }
    for (int i = 0; i < bb; i += 64) ffn_prefetch2((const char *)k->src + i, COLI_FFN_PREFETCH);
    k->src += bb;
    if (kind == K_NIB) {
        Table th[2];
        for (int h = 0; h < 2; h++) {  /* the table of each half block (32 inputs) */
            th[h] = k->tab;
            k->left -= 32;
            if (k->left == 0 && k->g + 1 < m->groups) {
                k->tab = nibble_table(m, k->o, ++k->g);
                k->left = m->group;
            }
        }
        /* bytes 0..15: inputs 0..31 (low nibbles: positions 0..15, high:
         * 32..47); bytes 16..31: inputs 32..63 (16..31, 48..63). */
        for (int h = 0; h < 2; h++) {
            uint8x16_t q = vld1q_u8(p + 16 * h);
            lookup16(th[h], vandq_u8(q, vdupq_n_u8(0xf)), w + 4 * h);
            lookup16(th[h], vshrq_n_u8(q, 4), w + 8 + 4 * h);
        }
        return;
    }
    plain_block(kind, p, w);
    if (!k->srow) return;
    UNROLL for (int v = 0; v < VPB; v++) {  /* FP8 blocks: a scale per run of block_columns */
        w[v] = vmulq_f32(w[v], k->sc);
        k->left -= LN;
        if (k->left == 0 && k0 + (v + 1) * LN < m->n_in) {
            k->sc = vdupq_n_f32(*++k->srow);
            k->left = m->block_columns;
        }
    }
}

/* Row o decoded by the scalar code into buf, in the kernel's order
 * (natural: n_in floats of scratch). */
static void dot_slow_row(const DotInfo *d, int64_t o, float *buf, float *natural) {
    int order = d->kind == K_NIB ? COLI_FFN_ORDER_EO64 : COLI_FFN_ORDER_PLAIN;
    coli_ffn_dot_row(d->m, o, natural);
    memset(buf, 0, sizeof(float) * (size_t)(d->blocks * COLI_FFN_BLOCK));
    for (int64_t k = 0; k < d->m->n_in; k++) buf[coli_ffn_pos(order, k)] = natural[k];
}

INLINE float dot_result(float32x4_t c0, float32x4_t c1, float32x4_t c2, float32x4_t c3) {
    float32x4_t s = vaddq_f32(vaddq_f32(c0, c1), vaddq_f32(c2, c3));
    float32x2_t h = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    return vget_lane_f32(h, 0) + vget_lane_f32(h, 1);
}

/* Streaming: rows [n0, n1) one after another for tokens t0 .. t0 + tb. */
INLINE void dot_stream(int kind, int tb, const DotInfo *d, int64_t n0, int64_t n1,
                       const ColiFfnTask *task, int t0, float *buf) {
    const float *x = (const float *)task->x + t0 * task->ldx;
    const int64_t ldx = task->ldx;
    for (int64_t o = n0; o < n1; o++) {
        float32x4_t c[TB_MAX][4];
        UNROLL for (int t = 0; t < tb; t++)
            UNROLL for (int j = 0; j < 4; j++) c[t][j] = vdupq_n_f32(0.0f);
        if (d->slow) {
            dot_slow_row(d, o, buf, buf + d->blocks * COLI_FFN_BLOCK);
            for (int64_t b = 0; b < d->blocks; b++)
                UNROLL for (int v = 0; v < VPB; v++) {
                    float32x4_t w = vld1q_f32(buf + b * COLI_FFN_BLOCK + v * LN);
                    UNROLL for (int t = 0; t < tb; t++)
                        c[t][v % 4] = vfmaq_f32(c[t][v % 4], w,
                                                vld1q_f32(x + t * ldx + b * COLI_FFN_BLOCK + v * LN));
                }
        } else {
            Walk k;
            walk_start(d, o, &k);
            for (int64_t b = 0; b < d->blocks; b++) {
                float32x4_t w[VPB];
                walk_block(kind, d, &k, b, w);
                UNROLL for (int v = 0; v < VPB; v++)
                    UNROLL for (int t = 0; t < tb; t++)
                        c[t][v % 4] = vfmaq_f32(c[t][v % 4], w[v],
                                                vld1q_f32(x + t * ldx + b * COLI_FFN_BLOCK + v * LN));
            }
        }
        UNROLL for (int t = 0; t < tb; t++)
            task->dst[(t0 + t) * task->ld_dst + o] = dot_result(c[t][0], c[t][1], c[t][2], c[t][3]);
    }
}

typedef void (*DotStreamFn)(const DotInfo *d, int64_t n0, int64_t n1, const ColiFfnTask *task,
                            int t0, float *buf);
#define DOT_STREAM(KIND, TB)                                                                 \
    static void dot_stream_##KIND##_##TB(const DotInfo *d, int64_t n0, int64_t n1,          \
                                         const ColiFfnTask *task, int t0, float *buf) {      \
        dot_stream(KIND, TB, d, n0, n1, task, t0, buf);                                      \
    }
#define DOT_STREAMS_OF(KIND) DOT_STREAM(KIND, 1) DOT_STREAM(KIND, 2) DOT_STREAM(KIND, 3) DOT_STREAM(KIND, 4)
DOT_STREAMS_OF(K_NIB)
DOT_STREAMS_OF(K_F32)
DOT_STREAMS_OF(K_F16)
DOT_STREAMS_OF(K_BF16)
DOT_STREAMS_OF(K_E4M3)
DOT_STREAMS_OF(K_E5M2)
#undef DOT_STREAMS_OF
#undef DOT_STREAM
#define DOT_ROW_OF(KIND) \
    {dot_stream_##KIND##_1, dot_stream_##KIND##_2, dot_stream_##KIND##_3, dot_stream_##KIND##_4}
static const DotStreamFn DOT_STREAMS[N_KINDS][TB_MAX] = {
    DOT_ROW_OF(K_NIB), DOT_ROW_OF(K_F32), DOT_ROW_OF(K_F16), DOT_ROW_OF(K_BF16),
    DOT_ROW_OF(K_E4M3), DOT_ROW_OF(K_E5M2)};
#undef DOT_ROW_OF

/* Tile: row o decoded into row (the kernel's order). */
INLINE void dot_decode(int kind, const DotInfo *d, int64_t o, float *row) {
    Walk k;
    walk_start(d, o, &k);
    for (int64_t b = 0; b < d->blocks; b++) {
        float32x4_t w[VPB];
        walk_block(kind, d, &k, b, w);
        UNROLL for (int v = 0; v < VPB; v++) vst1q_f32(row + b * COLI_FFN_BLOCK + v * LN, w[v]);
    }
}

#define DOT_DECODE(KIND) \
    static void dot_decode_##KIND(const DotInfo *d, int64_t o, float *row) { dot_decode(KIND, d, o, row); }
DOT_DECODE(K_NIB)
DOT_DECODE(K_F32)
DOT_DECODE(K_F16)
DOT_DECODE(K_BF16)
DOT_DECODE(K_E4M3)
DOT_DECODE(K_E5M2)
#undef DOT_DECODE
static void (*const DOT_DECODES[N_KINDS])(const DotInfo *, int64_t, float *) = {
    dot_decode_K_NIB, dot_decode_K_F32, dot_decode_K_F16, dot_decode_K_BF16,
    dot_decode_K_E4M3, dot_decode_K_E5M2};

/* Tile: chain j of tb tokens over TILE_ROWS decoded rows (of ld floats),
 * chain after chain, into acc[t][r][j]: each chain's FMAs in the order the
 * streaming loops make them. */
INLINE void dot_tile(int tb, const float *tile, int64_t ld, int64_t nvec, const float *x,
                     int64_t ldx, float *acc) {
    UNROLL for (int j = 0; j < 4; j++) {
        float32x4_t a[TB_MAX][TILE_ROWS];
        UNROLL for (int t = 0; t < tb; t++)
            UNROLL for (int r = 0; r < TILE_ROWS; r++) a[t][r] = vdupq_n_f32(0.0f);
        for (int64_t v = j; v < nvec; v += 4) {
            float32x4_t w[TILE_ROWS];
            UNROLL for (int r = 0; r < TILE_ROWS; r++) w[r] = vld1q_f32(tile + r * ld + v * LN);
            UNROLL for (int t = 0; t < tb; t++) {
                float32x4_t xv = vld1q_f32(x + t * ldx + v * LN);
                UNROLL for (int r = 0; r < TILE_ROWS; r++) a[t][r] = vfmaq_f32(a[t][r], w[r], xv);
            }
        }
        UNROLL for (int t = 0; t < tb; t++)
            UNROLL for (int r = 0; r < TILE_ROWS; r++)
                vst1q_f32(acc + ((t * TILE_ROWS + r) * 4 + j) * LN, a[t][r]);
    }
}

static void dot_tile_1(const float *tl, int64_t ld, int64_t nv, const float *x, int64_t ldx, float *acc) {
    dot_tile(1, tl, ld, nv, x, ldx, acc);
}
static void dot_tile_2(const float *tl, int64_t ld, int64_t nv, const float *x, int64_t ldx, float *acc) {
    dot_tile(2, tl, ld, nv, x, ldx, acc);
}
static void dot_tile_3(const float *tl, int64_t ld, int64_t nv, const float *x, int64_t ldx, float *acc) {
    dot_tile(3, tl, ld, nv, x, ldx, acc);
}
static void dot_tile_4(const float *tl, int64_t ld, int64_t nv, const float *x, int64_t ldx, float *acc) {
    dot_tile(4, tl, ld, nv, x, ldx, acc);
}
static void (*const DOT_TILES[TB_MAX])(const float *, int64_t, int64_t, const float *, int64_t,
                                       float *) = {dot_tile_1, dot_tile_2, dot_tile_3, dot_tile_4};

static size_t dot_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)n0, (void)n1, (void)tokens;  /* the tile's size serves every batch */
    int64_t row = coli_ffn_round_up(m->n_in, COLI_FFN_BLOCK);
    return sizeof(float) * (size_t)(TILE_ROWS * row + m->n_in + TB_MAX * TILE_ROWS * 4 * LN);
}

static void dot_tiled(const DotInfo *d, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    int64_t ld = d->blocks * COLI_FFN_BLOCK, nvec = ld / LN;
    float *tile = (float *)task->scratch, *natural = tile + TILE_ROWS * ld;
    float *acc = natural + d->m->n_in;
    for (int64_t p0 = n0; p0 < n1; p0 += TILE_ROWS) {
        int nr = n1 - p0 < TILE_ROWS ? (int)(n1 - p0) : TILE_ROWS;
        for (int r = 0; r < TILE_ROWS; r++) {
            float *row = tile + r * ld;
            if (r >= nr) memset(row, 0, sizeof(float) * (size_t)ld);
            else if (d->slow) dot_slow_row(d, p0 + r, row, natural);
            else DOT_DECODES[d->kind](d, p0 + r, row);
        }
        for (int t0 = 0; t0 < task->tokens; t0 += TB_MAX) {
            int tb = task->tokens - t0 < TB_MAX ? task->tokens - t0 : TB_MAX;
            DOT_TILES[tb - 1](tile, ld, nvec, (const float *)task->x + t0 * task->ldx, task->ldx, acc);
            for (int t = 0; t < tb; t++)
                for (int r = 0; r < nr; r++) {
                    const float *a = acc + (t * TILE_ROWS + r) * 4 * LN;
                    task->dst[(t0 + t) * task->ld_dst + p0 + r] =
                        dot_result(vld1q_f32(a), vld1q_f32(a + LN), vld1q_f32(a + 2 * LN),
                                   vld1q_f32(a + 3 * LN));
                }
        }
    }
}

static void dot_run(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    DotInfo d = dot_info(m);
    if (task->tokens > COLI_FFN_STREAM_TOKENS) {
        dot_tiled(&d, n0, n1, task);
        return;
    }
    const DotStreamFn *fns = DOT_STREAMS[d.kind];
    for (int t0 = 0; t0 < task->tokens; t0 += TB_MAX) {
        int tb = task->tokens - t0 < TB_MAX ? task->tokens - t0 : TB_MAX;
        fns[tb - 1](&d, n0, n1, task, t0, (float *)task->scratch);
    }
}

/* ------------------------------------------------------------ SINGLE: stored (in, out) */

enum { SEG = 16, PANEL = 64 };  /* outputs per decoded segment, and per panel of sums */
enum { K_GPTQ = N_KINDS, K_AWQ };  /* SINGLE's 4-bit kinds */

/* 16 of 0..15: output i of a segment's two AWQ words (8 bytes, low
 * nibbles then high ones in a 16-byte vector) is nibble COLI_AWQ_NIBBLE[i %
 * 8] of word i / 8. */
static const uint8_t AWQ_PICK[SEG] = {0, 2, 8, 10, 1, 3, 9, 11, 4, 6, 12, 14, 5, 7, 13, 15};

INLINE int single_bytes(int kind) { return kind == K_GPTQ ? 4 : kind == K_AWQ ? 1 : kind_bytes(kind); }

/* Stored bytes of input k's weights to output c (c a multiple of 8 for the
 * 4-bit kinds). */
INLINE const uint8_t *single_at(int kind, const ColiFfnMat *m, int64_t k, int64_t c) {
    if (kind == K_GPTQ) return m->data + ((k / 8) * m->n_out + c) * 4;
    if (kind == K_AWQ) return m->data + k * (m->n_out / 2) + c / 2;
    return m->data + (k * m->n_out + c) * kind_bytes(kind);
}

/* The stored nibbles of input k to a segment's 16 outputs at p, as floats. */
INLINE void single_nibbles(int kind, const uint8_t *p, int64_t k, float32x4_t q[4]) {
    if (kind == K_GPTQ) {
        const int32x4_t sh = vdupq_n_s32(-4 * (int)(k % 8));
        UNROLL for (int v = 0; v < 4; v++) {
            uint32x4_t word = vreinterpretq_u32_u8(vld1q_u8(p + 16 * v));
            q[v] = vcvtq_f32_u32(vandq_u32(vshlq_u32(word, sh), vdupq_n_u32(0xf)));
        }
        return;
    }
    uint8x8_t b = vld1_u8(p);
    uint8x16_t both = vcombine_u8(vand_u8(b, vdup_n_u8(0xf)), vshr_n_u8(b, 4));
    uint8x16_t n = vqtbl1q_u8(both, vld1q_u8(AWQ_PICK));
    uint16x8_t lo = vmovl_u8(vget_low_u8(n)), hi = vmovl_high_u8(n);
    q[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
    q[1] = vcvtq_f32_u32(vmovl_high_u16(lo));
    q[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
    q[3] = vcvtq_f32_u32(vmovl_high_u16(hi));
}

/* Input k's weights to outputs c .. c + n (n <= SEG; what lies past n is
 * never stored) as four vectors; zs: the zero points then the scales of
 * the segment's outputs for k's group (4-bit kinds). */
INLINE void single_seg(int kind, const ColiFfnMat *m, int64_t k, int64_t c, int n, const float *zs,
                       float32x4_t w[4]) {
    const int eb = single_bytes(kind);
    const uint8_t *p = single_at(kind, m, k, c);
    uint8_t pad[SEG * 4] __attribute__((aligned(16)));
    if (n < SEG) {  /* the 4-bit kinds' outputs come in whole words of 8 */
        memset(pad, 0, sizeof pad);
        memcpy(pad, p, (size_t)(kind == K_AWQ ? n / 2 : n * eb));
        p = pad;
    }
    if (kind == K_GPTQ || kind == K_AWQ) {
        float32x4_t q[4];
        single_nibbles(kind, p, k, q);
        UNROLL for (int v = 0; v < 4; v++)
            w[v] = vmulq_f32(vsubq_f32(q[v], vld1q_f32(zs + LN * v)), vld1q_f32(zs + PANEL + LN * v));
        return;
    }
    plain16(kind, p, w);
    if (m->format != COLI_TENSOR_FP8_E4M3_BLOCK) return;
    /* Block scales per lane (a block's columns need not be a multiple of 4). */
    int64_t per_row = (m->cols + m->block_columns - 1) / m->block_columns;
    const float *srow = (const float *)m->scales + (k / m->block_rows) * per_row;
    float s[SEG] __attribute__((aligned(16)));
    for (int i = 0; i < SEG; i++) s[i] = i < n ? srow[(c + i) / m->block_columns] : 1.0f;
    for (int v = 0; v < 4; v++) w[v] = vmulq_f32(w[v], vld1q_f32(s + 4 * v));
}

/* Zero points and scales of every group for outputs p0 .. p0 + np: group
 * g's at zs + 2 PANEL g (zeros, then scales; padding lanes 0 and 1). */
static void single_params(const ColiFfnMat *m, int64_t p0, int np, float *zs) {
    for (int64_t g = 0; g < m->groups; g++, zs += 2 * PANEL)
        for (int c = 0; c < PANEL; c++) {
            zs[c] = c < np ? (float)coli_ffn_zero_at(m, p0 + c, g) : 0.0f;
            zs[PANEL + c] = c < np ? coli_ffn_scale(m, g * m->n_out + p0 + c) : 1.0f;
        }
}

enum { CHUNK = 8 };  /* inputs whose terms a segment's sums take in registers */

/* Inputs k0 .. k0 + nk (in order) into one segment's sums of tb tokens (a:
 * tb rows of PANEL floats), held in registers over the chunk; zs: each
 * input's group parameters at the segment (4-bit kinds). */
INLINE void single_chunk(int kind, int tb, const ColiFfnMat *m, int64_t k0, int nk, int64_t c,
                         int n, const float *const *zs, const float *x, int64_t ldx, float *a) {
    float32x4_t s[TB_MAX][4];
    UNROLL for (int t = 0; t < tb; t++)
        UNROLL for (int v = 0; v < 4; v++) s[t][v] = vld1q_f32(a + t * PANEL + LN * v);
    for (int j = 0; j < nk; j++) {
        float32x4_t w[4];
        single_seg(kind, m, k0 + j, c, n, zs[j], w);
        UNROLL for (int t = 0; t < tb; t++) {
            float32x4_t xv = vdupq_n_f32(x[t * ldx + k0 + j]);
            UNROLL for (int v = 0; v < 4; v++) s[t][v] = vfmaq_f32(s[t][v], w[v], xv);
        }
    }
    UNROLL for (int t = 0; t < tb; t++)
        UNROLL for (int v = 0; v < 4; v++) vst1q_f32(a + t * PANEL + LN * v, s[t][v]);
}

/* Outputs [n0, n1), a panel of PANEL at a time: every input, in order, adds
 * its weights times each token's value into the panel's sums (acc, in L1),
 * CHUNK inputs at a time per segment of SEG outputs and block of at most
 * four tokens. */
INLINE void single(int kind, const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    float *acc = (float *)task->scratch, *params = acc + task->tokens * PANEL;
    const int quant = kind == K_GPTQ || kind == K_AWQ;
    /* Prefetch: the panel's bytes this many inputs ahead, a line at a time. */
    const int line = kind == K_GPTQ ? 8 : 1;  /* inputs per stored row */
    const int64_t panel_bytes = kind == K_AWQ ? PANEL / 2 : PANEL * single_bytes(kind);
    const int64_t ahead = line * (COLI_FFN_PREFETCH / panel_bytes);
    const float *x = (const float *)task->x;
    const int64_t ldx = task->ldx;
    for (int64_t p0 = n0; p0 < n1; p0 += PANEL) {
        int np = n1 - p0 < PANEL ? (int)(n1 - p0) : PANEL, nseg = (np + SEG - 1) / SEG;
        memset(acc, 0, sizeof(float) * (size_t)(task->tokens * PANEL));
        if (quant) single_params(m, p0, np, params);
        for (int64_t k0 = 0; k0 < m->n_in; k0 += CHUNK) {
            int nk = m->n_in - k0 < CHUNK ? (int)(m->n_in - k0) : CHUNK;
            const float *zg[CHUNK];
            for (int j = 0; j < nk; j++) {
                int64_t k = k0 + j;
                zg[j] = quant ? params + 2 * PANEL * coli_ffn_group_of(m, k) : NULL;
                if (k % line == 0 && k + ahead < m->n_in)
                    for (int i = 0; i < np * panel_bytes / PANEL; i += 64)
                        __builtin_prefetch(single_at(kind, m, k + ahead, p0) + i, 0, 3);
            }
            for (int s = 0; s < nseg; s++) {
                int n = np - SEG * s < SEG ? np - SEG * s : SEG;
                const float *zs[CHUNK];
                for (int j = 0; j < nk; j++) zs[j] = quant ? zg[j] + SEG * s : NULL;
                for (int t0 = 0; t0 < task->tokens; t0 += TB_MAX) {
                    const float *xt = x + t0 * ldx;
                    float *a = acc + t0 * PANEL + SEG * s;
                    int64_t c = p0 + SEG * s;
                    switch (task->tokens - t0 < TB_MAX ? task->tokens - t0 : TB_MAX) {
                    case 1: single_chunk(kind, 1, m, k0, nk, c, n, zs, xt, ldx, a); break;
                    case 2: single_chunk(kind, 2, m, k0, nk, c, n, zs, xt, ldx, a); break;
                    case 3: single_chunk(kind, 3, m, k0, nk, c, n, zs, xt, ldx, a); break;
                    default: single_chunk(kind, 4, m, k0, nk, c, n, zs, xt, ldx, a); break;
                    }
                }
            }
        }
        for (int t = 0; t < task->tokens; t++)
            memcpy(task->dst + t * task->ld_dst + p0, acc + t * PANEL, sizeof(float) * (size_t)np);
    }
}

#define SINGLE(KIND) \
    static void single_##KIND(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) { \
        single(KIND, m, n0, n1, task);                                                       \
    }
SINGLE(K_F32)
SINGLE(K_F16)
SINGLE(K_BF16)
SINGLE(K_E4M3)
SINGLE(K_E5M2)
SINGLE(K_GPTQ)
SINGLE(K_AWQ)
#undef SINGLE

static size_t single_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)n0, (void)n1;
    int quant = m->format == COLI_TENSOR_INT4_GPTQ || m->format == COLI_TENSOR_INT4_AWQ;
    return sizeof(float) * (size_t)((tokens + (quant ? 2 * m->groups : 0)) * PANEL);
}

static void single_run(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    if (m->format == COLI_TENSOR_INT4_GPTQ) {
        single_K_GPTQ(m, n0, n1, task);
        return;
    }
    if (m->format == COLI_TENSOR_INT4_AWQ) {
        single_K_AWQ(m, n0, n1, task);
        return;
    }
    switch (coli_ffn_row_kind(m)) {
    case K_F32: single_K_F32(m, n0, n1, task); return;
    case K_F16: single_K_F16(m, n0, n1, task); return;
    case K_BF16: single_K_BF16(m, n0, n1, task); return;
    case K_E5M2: single_K_E5M2(m, n0, n1, task); return;
    default: single_K_E4M3(m, n0, n1, task); return;
    }
}

/* ------------------------------------------------------------ activation */

/* exp(v): 2^n * p(r), r = v - n ln 2 in two parts, p of degree 6
 * (relative error about 2e-7); 2^n as two factors so that n = 128 stays
 * finite; 0 and inf past float's range, NaN kept. */
INLINE float32x4_t exp4(float32x4_t v) {
    const float32x4_t hi = vdupq_n_f32(88.7228f), lo = vdupq_n_f32(-87.3365f);
    uint32x4_t num = vceqq_f32(v, v), over = vcgtq_f32(v, hi), under = vcltq_f32(v, lo);
    float32x4_t c = vminq_f32(vmaxq_f32(v, lo), hi);
    float32x4_t n = vrndnq_f32(vmulq_f32(c, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(c, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    int32x4_t ni = vcvtq_s32_f32(vbslq_f32(num, n, vdupq_n_f32(0.0f))), half = vshrq_n_s32(ni, 1);
    float32x4_t f1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(half, vdupq_n_s32(127)), 23));
    float32x4_t f2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vsubq_s32(ni, half), vdupq_n_s32(127)), 23));
    p = vmulq_f32(vmulq_f32(p, f1), f2);
    p = vbslq_f32(over, vdupq_n_f32(INFINITY), p);
    p = vbslq_f32(under, vdupq_n_f32(0.0f), p);
    return vbslq_f32(num, p, v);
}

/* min and max keep a NaN operand (as torch's clamp and the scalar path). */
INLINE float32x4_t act4(int activation, float32x4_t alpha, float32x4_t lim, float32x4_t gv,
                        float32x4_t uv) {
    const float32x4_t one = vdupq_n_f32(1.0f);
    if (activation == COLI_FFN_ACT_SILU)
        return vmulq_f32(vdivq_f32(gv, vaddq_f32(one, exp4(vnegq_f32(gv)))), uv);
    gv = vminq_f32(lim, gv);
    uv = vmaxq_f32(vnegq_f32(lim), vminq_f32(lim, uv));
    float32x4_t e = exp4(vnegq_f32(vmulq_f32(alpha, gv)));
    return vmulq_f32(vaddq_f32(uv, one), vdivq_f32(gv, vaddq_f32(one, e)));
}

/* The last n % 4 values go through the same vector code, from a padded
 * copy, so every value is computed alike wherever the split falls. */
static void act_neon(int activation, float alpha, float limit, const float *g, const float *u,
                     float *h, int64_t n) {
    const float32x4_t al = vdupq_n_f32(alpha), lim = vdupq_n_f32(limit);
    int64_t i = 0;
    for (; i + LN <= n; i += LN)
        vst1q_f32(h + i, act4(activation, al, lim, vld1q_f32(g + i), vld1q_f32(u + i)));
    if (i == n) return;
    float gp[LN] = {0}, up[LN] = {0}, hp[LN];
    memcpy(gp, g + i, sizeof(float) * (size_t)(n - i));
    memcpy(up, u + i, sizeof(float) * (size_t)(n - i));
    vst1q_f32(hp, act4(activation, al, lim, vld1q_f32(gp), vld1q_f32(up)));
    memcpy(h + i, hp, sizeof(float) * (size_t)(n - i));
}

const ColiFfnActFn coli_ffn_act_neon = act_neon;

/* ------------------------------------------------------------ kernel table */

static const ColiFfnKernel NEON_INT4 = {"int4/neon", COLI_FFN_X_F32, COLI_FFN_ORDER_EO64, 0, 1,
                                        dot_scratch, dot_run};
static const ColiFfnKernel NEON_MXFP4 = {"mxfp4/neon", COLI_FFN_X_F32, COLI_FFN_ORDER_EO64, 0, 1,
                                         dot_scratch, dot_run};
static const ColiFfnKernel NEON_PLAIN = {"plain/neon", COLI_FFN_X_F32, COLI_FFN_ORDER_PLAIN, 0, 1,
                                         dot_scratch, dot_run};
static const ColiFfnKernel NEON_PLAIN_T = {"plain-in-out/neon", COLI_FFN_X_F32, COLI_FFN_ORDER_PLAIN,
                                           0, SEG, single_scratch, single_run};
static const ColiFfnKernel NEON_GPTQ = {"gptq/neon", COLI_FFN_X_F32, COLI_FFN_ORDER_PLAIN, 0, SEG,
                                        single_scratch, single_run};
static const ColiFfnKernel NEON_AWQ = {"awq/neon", COLI_FFN_X_F32, COLI_FFN_ORDER_PLAIN, 0, SEG,
                                       single_scratch, single_run};

const ColiFfnKernel *coli_ffn_kernel_neon(const ColiFfnMat *m) {
    if (!coli_ffn_format_computed(m->format, m->in_out)) return NULL;
    switch (m->format) {
    case COLI_TENSOR_FP4_NATIVE_BLOCK: return &NEON_MXFP4;
    case COLI_TENSOR_INT4_BLOCK: return &NEON_INT4;
    case COLI_TENSOR_INT4_GPTQ: return &NEON_GPTQ;
    case COLI_TENSOR_INT4_AWQ: return &NEON_AWQ;
    default: return m->in_out ? &NEON_PLAIN_T : &NEON_PLAIN;
    }
}

#else

/* Not arm64: nothing here (ISO C wants a translation unit to declare something). */
typedef int coli_ffn_neon_unused;

#endif
