/*
 * ffn_internal.h (private): what the FFN driver (ffn.c) shares with the
 * per-path kernels (ffn_scalar.c, ffn_x86.c, ffn_neon.c).
 *
 * A matrix is computed in panels of outputs. Each panel walks its inputs in
 * chunks; a chunk of weights is decoded into a float tile in L1, and a
 * micro-kernel applies the tile to every token. Two tile layouts:
 *
 *   DOT   for matrices stored (out, in): the tile holds PANEL_ROWS outputs,
 *         each a run of the chunk's inputs (tile[r * ld + p]); the
 *         micro-kernel keeps a vector of partial sums per (token, output)
 *         and reduces them when the panel ends. Inside each block of 32
 *         inputs a kernel may store them in its own order (kpos), so a
 *         decoder can leave nibbles where they fall; the tokens' inputs are
 *         laid out in the same order once per call.
 *   AXPY  for matrices stored (in, out): the tile holds the chunk's inputs,
 *         each a run of the panel's outputs (tile[k * ld + p]); the
 *         micro-kernel adds input k's row times x[t][k] to a row of sums
 *         per token. A kernel may store a panel's outputs in its own order
 *         (colpos), undone when the panel's sums are written out.
 *
 * A kernel (one format, one orientation, one path) is a ColiFfnKernel;
 * the path's micro-kernels and activation are its ColiFfnIsaOps.
 */
#ifndef COLI_FFN_INTERNAL_H
#define COLI_FFN_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "ffn.h"

enum {
    COLI_FFN_KBLOCK = 32,       /* DOT: kpos permutes inputs within blocks of this many */
    COLI_FFN_DOT_ROWS = 4,      /* DOT: outputs per panel */
    COLI_FFN_DOT_KC = 256,      /* DOT: inputs per chunk (a multiple of KBLOCK) */
    COLI_FFN_AXPY_KC = 64,      /* AXPY: inputs per chunk (a multiple of 8: GPTQ's words) */
    COLI_FFN_MAX_PANEL = 128,   /* AXPY: outputs per panel at most */
    COLI_FFN_DOT_LANES = 16,    /* DOT: partial sums kept per (token, output) */
    COLI_FFN_FUSED_TOKENS = 4,  /* fused kernels take batches of at most this many tokens */
    COLI_FFN_PREFETCH = 512     /* fused kernels prefetch this many bytes ahead in each row */
};

enum { COLI_FFN_DOT = 0, COLI_FFN_AXPY = 1 };

/* A matrix checked and described for the kernels: logical outputs x inputs
 * (what the stored rows and columns mean follows the orientation). */
typedef struct {
    ColiTensorFormat format;
    ColiScaleFormat scale_format;
    int in_out;                 /* stored (in, out) */
    int64_t n_out, n_in;        /* logical */
    int64_t rows, cols;         /* as stored */
    const uint8_t *data;
    const uint8_t *scales;
    const uint8_t *zeros;       /* NULL: none */
    const uint8_t *g_idx;       /* int32 per input, maybe unaligned; NULL: input / group */
    uint32_t block_rows, block_columns;
    int64_t groups;             /* scale groups along the inputs (int4, GPTQ, AWQ) */
    int64_t group;              /* inputs per group (int4, GPTQ and AWQ without g_idx) */
    int zero_plus_one;
} ColiFfnMat;

typedef struct ColiFfnKernel ColiFfnKernel;

/* Decodes outputs [n0, n0 + nr) x inputs [k0, k0 + kc) of m into tile
 * (see the layouts above; ld = the kernel's row length). DOT: rows r < nr,
 * positions [0, round_up(kc, KBLOCK)), zero where no input falls. AXPY:
 * kc rows of the kernel's panel positions, zero where no output falls.
 * aux: what the kernel's prepare wrote for this panel. */
typedef void (*ColiFfnDecodeFn)(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                                int64_t k0, int kc, float *tile, const float *aux);
/* Decodes and applies a panel's whole rows (k0 0, kc all inputs) in
 * registers, for at most COLI_FFN_FUSED_TOKENS tokens (acc as the layout's
 * micro-kernel's); 0 when it declines (a partial panel or block), and the
 * panel takes the tile path. */
typedef int (*ColiFfnFusedFn)(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                              int64_t k0, int kc, const float *x, int64_t ldx, int tokens,
                              float *acc, const float *aux);
/* Per-panel set-up (GPTQ and AWQ: float scales and scaled zeros of every
 * group for the panel's outputs, in the tile's order) into aux. */
typedef void (*ColiFfnPrepareFn)(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                                 float *aux);

struct ColiFfnKernel {
    const char *name;
    int layout;                 /* COLI_FFN_DOT or COLI_FFN_AXPY */
    int panel;                  /* DOT: COLI_FFN_DOT_ROWS; AXPY: outputs per panel (16k) */
    int kc;                     /* inputs per chunk */
    const uint8_t *kpos;        /* DOT: position of input k % 32 in its block; NULL: in order */
    const uint8_t *colpos;      /* AXPY: position of output c of the panel; NULL: in order */
    ColiFfnPrepareFn prepare;   /* NULL: nothing per panel */
    int64_t (*aux_floats)(const ColiFfnMat *m, const ColiFfnKernel *k);  /* NULL: 0 */
    ColiFfnDecodeFn decode;
    ColiFfnFusedFn fused;       /* NULL: always the tile path */
};

/* One path's micro-kernels.
 *
 * dot: tile (COLI_FFN_DOT_ROWS rows of ld), kcp positions (a multiple of
 *   KBLOCK); x: tokens rows of ldx floats laid out like the tile's rows;
 *   acc: [t][r][COLI_FFN_DOT_LANES] partial sums, added to.
 * axpy: tile (kc rows of ld = panel), x: tokens rows (x[t * ldx + k]);
 *   acc: [t][panel] sums, added to.
 * act: h[i] = act(g[i], u[i]) for n values (COLI_FFN_ACT_*). */
typedef struct {
    void (*dot)(const float *tile, int ld, int kcp, const float *x, int64_t ldx, int tokens,
                float *acc);
    void (*axpy)(const float *tile, int ld, int kc, int panel, const float *x, int64_t ldx,
                 int tokens, float *acc);
    void (*act)(int activation, float alpha, float limit, const float *g, const float *u, float *h,
                int64_t n);
} ColiFfnIsaOps;

/* Each path's ops and kernels. A path with no kernel of its own for a
 * format (NULL) uses the scalar decoder with its own micro-kernels. */
extern const ColiFfnIsaOps coli_ffn_ops_scalar;
const ColiFfnKernel *coli_ffn_kernel_scalar(ColiTensorFormat format, int in_out);
#if defined(__x86_64__) || defined(__i386__)
extern const ColiFfnIsaOps coli_ffn_ops_avx2;
extern const ColiFfnIsaOps coli_ffn_ops_avx512;
const ColiFfnKernel *coli_ffn_kernel_avx2(ColiTensorFormat format, int in_out);
const ColiFfnKernel *coli_ffn_kernel_avx512(ColiTensorFormat format, int in_out);
#endif
#if defined(__aarch64__)
extern const ColiFfnIsaOps coli_ffn_ops_neon;
#endif

/* Scalar decoding, also the SIMD kernels' fallback for the edges of a
 * matrix (a partial panel or block): honours k->kpos and k->colpos. */
void coli_ffn_decode_scalar(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                            int64_t k0, int kc, float *tile, const float *aux);
/* GPTQ/AWQ per-panel scales (scalar; honours colpos): aux holds, for group
 * g, panel floats of scales then panel floats of scale * zero. */
void coli_ffn_prepare_quant(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                            float *aux);
int64_t coli_ffn_quant_aux(const ColiFfnMat *m, const ColiFfnKernel *k);

/* Element conversions shared by the paths. */
float coli_f16_to_f32(uint16_t h);
float coli_bf16_to_f32(uint16_t b);
uint16_t coli_f32_to_bf16(float f);     /* round to nearest even; NaN stays NaN */
float coli_e4m3_to_f32(uint8_t b);      /* e4m3fn: 0x7f and 0xff are NaN */
float coli_e5m2_to_f32(uint8_t b);
float coli_ffn_scale(const ColiFfnMat *m, int64_t index);  /* scale number index, as float */

/* The zero point of output n in group g as the stored nibble it is
 * subtracted from: int4 without zero points 8, GPTQ's original format the
 * stored nibble plus one. */
int coli_ffn_zero(const ColiFfnMat *m, int64_t n, int64_t g);
/* Scale number i as float, and the zero point as coli_ffn_zero, inline so
 * that SIMD code calls no function per group. */
static inline float coli_ffn_scale_at(const ColiFfnMat *m, int64_t i) {
    if (m->scale_format == COLI_SCALE_F32 || m->scale_format == COLI_SCALE_BF16) {
        uint32_t u = 0;
        float f;
        if (m->scale_format == COLI_SCALE_F32) {
            memcpy(&u, m->scales + 4 * i, sizeof u);
        } else {
            uint16_t h;
            memcpy(&h, m->scales + 2 * i, sizeof h);
            u = (uint32_t)h << 16;
        }
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return coli_ffn_scale(m, i);
}

static inline int coli_ffn_nibble_at(const uint8_t *p, int64_t word, int n) {
    return (p[4 * word + n / 2] >> (4 * (n & 1))) & 0xf;
}

static inline int coli_ffn_zero_at(const ColiFfnMat *m, int64_t n, int64_t g) {
    if (m->format == COLI_TENSOR_INT4_BLOCK)
        return m->zeros ? coli_ffn_nibble_at(m->zeros, (n / 8) * m->groups + g, (int)(n % 8)) : 8;
    return coli_ffn_zero(m, n, g);
}

/* The group of input k (GPTQ: g_idx). */
static inline int64_t coli_ffn_group_of(const ColiFfnMat *m, int64_t k) {
    if (!m->g_idx) return k / m->group;
    int32_t g;
    memcpy(&g, m->g_idx + 4 * k, sizeof g);
    return g;
}

/* The group of each input k0 .. k0 + kc - 1, without a division per input. */
static inline void coli_ffn_chunk_groups(const ColiFfnMat *m, int64_t k0, int kc, int64_t *out) {
    if (m->g_idx) {
        for (int j = 0; j < kc; j++) out[j] = coli_ffn_group_of(m, k0 + j);
        return;
    }
    int64_t g = k0 / m->group, next = (g + 1) * m->group;
    for (int j = 0; j < kc; j++) {
        if (k0 + j == next) {
            g++;
            next += m->group;
        }
        out[j] = g;
    }
}

#endif /* COLI_FFN_INTERNAL_H */
