/*
 * ffn_internal.h (private): what the FFN driver (ffn.c) shares with the
 * per-path kernels (ffn_scalar.c, ffn_x86.c, ffn_neon.c).
 *
 * A kernel computes one matrix (one format, one orientation, one path) for
 * a range of its outputs and every token of a batch, writing raw sums
 * (no bias) as floats. The driver prepares the tokens' inputs the way the
 * kernel asks (float32 or bfloat16, in its order, zero padded to whole
 * blocks of 64, with per-group sums when it wants them), splits outputs
 * between threads in multiples of the kernel's unit, adds biases and
 * converts.
 *
 * THE ORDER OF SUMMATION. A kernel may walk its weights differently for
 * different batch sizes (streaming rows for a few tokens, a decoded tile
 * reused across many), but every output of every token sees the same
 * sequence of float operations whatever the batch, the token's place in
 * it, the output range or the thread: each kernel documents that sequence
 * (its "sum") and every loop it has performs exactly it. So a token's
 * result is bit for bit the same alone or batched, on one thread or many;
 * only the path (and, on x86, the input type) changes it.
 */
#ifndef COLI_FFN_INTERNAL_H
#define COLI_FFN_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "ffn.h"

enum {
    COLI_FFN_BLOCK = 64,        /* inputs: EO64 and the DOT kernels work in blocks of this many */
    COLI_FFN_PAD = 128,         /* rows of inputs are zero padded to a multiple of this many */
    COLI_FFN_CHAINS = 4,        /* SIMD DOT kernels: independent sums per (token, output) */
    COLI_FFN_STREAM_TOKENS = 4, /* batches of at most this many stream rows through registers */
    COLI_FFN_PREFETCH = 8192,   /* streaming kernels prefetch this many bytes ahead */
    COLI_FFN_OWN_INPUTS = 8     /* calls of at most this many tokens prepare inputs per thread */
};

/* ColiFfnKernel.x_type and .x_order: how the kernel wants its inputs.
 * BF16: the call's bfloat16 tokens as they are. BF16_SPLIT: float inputs
 * as two bfloat16 parts, v's rounding then the rounding of the rest, each
 * row the high parts then the low ones (ldx / 2 apart). EO64: inside each
 * block of 64 inputs the 32 even ones first, in order, then the 32 odd
 * ones (what a byte's low and high nibbles hold). Q128: inside each block
 * of 128 inputs, input 4i + s at 32 s + i (the nibbles of 64 bytes read as
 * 32 little-endian words: nibble s of word i is input 4i + s). G8: inside
 * each 8 inputs, input j at 2j and input j + 4 at 2j + 1 (j < 4: the pairs
 * of a GPTQ word's nibbles j and j + 4). */
enum { COLI_FFN_X_F32 = 0, COLI_FFN_X_BF16 = 1, COLI_FFN_X_BF16_SPLIT = 2 };
/* What a matrix multiplies, for the kernel choice: float32 inputs that
 * must stay exact (a float32 call), the call's bfloat16 tokens (gate and
 * up of a bfloat16 call), or the float activations of a bfloat16 call
 * (down), which may be split. */
enum { COLI_FFN_INPUT_F32 = 0, COLI_FFN_INPUT_BF16 = 1, COLI_FFN_INPUT_ACT = 2 };
enum {
    COLI_FFN_ORDER_PLAIN = 0,
    COLI_FFN_ORDER_EO64 = 1,
    COLI_FFN_ORDER_Q128 = 2,
    COLI_FFN_ORDER_G8 = 3
};

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
    const uint8_t *order;       /* GPTQ in group order (gptq_group_order.h): int32 per stored
                                 * row, -1 - the input it holds; the driver gathers the inputs
                                 * through it and kernels see input / group; NULL: none */
    uint32_t block_rows, block_columns;
    int64_t groups;             /* scale groups along the inputs (int4, GPTQ, AWQ, MXFP4) */
    int64_t group;              /* inputs per group (int4, GPTQ and AWQ without g_idx, MXFP4) */
    int zero_plus_one;
} ColiFfnMat;

/* The 16 values of an e2m1 (FP4) nibble, in nibble order (defined in ffn_scalar.c). */
extern const float coli_ffn_e2m1[16];

/* The row kinds the SIMD DOT kernels specialise their loops for (a
 * runtime format in the inner loop costs more than the weights), and a
 * matrix's kind. */
enum { K_NIB, K_F32, K_F16, K_BF16, K_E4M3, K_E5M2, N_KINDS };

static inline int coli_ffn_row_kind(const ColiFfnMat *m) {
    switch (m->format) {
    case COLI_TENSOR_INT4_BLOCK:
    case COLI_TENSOR_FP4_NATIVE_BLOCK: return K_NIB;
    case COLI_TENSOR_F32: return K_F32;
    case COLI_TENSOR_F16: return K_F16;
    case COLI_TENSOR_BF16: return K_BF16;
    case COLI_TENSOR_F8_E5M2: return K_E5M2;
    default: return K_E4M3;
    }
}

/* One kernel call: outputs [n0, n1) of the matrix for every token. */
typedef struct {
    const void *x;              /* tokens rows of ldx elements, in the kernel's type and order */
    int64_t ldx;                /* elements; a multiple of COLI_FFN_PAD */
    const float *xs;            /* group_sums: token t's sum over group g at xs[t * ldxs + g] */
    int64_t ldxs;
    int tokens;
    float *dst;                 /* output n of token t at dst[t * ld_dst + n] */
    int64_t ld_dst;
    uint8_t *scratch;           /* this thread's, the kernel's scratch() bytes, 64-byte aligned */
} ColiFfnTask;

typedef struct ColiFfnKernel ColiFfnKernel;
struct ColiFfnKernel {
    const char *name;
    int x_type, x_order;        /* COLI_FFN_X_*, COLI_FFN_ORDER_* */
    int group_sums;             /* wants ColiFfnTask.xs */
    int unit;                   /* outputs are split between threads in multiples of this */
    /* Scratch bytes for outputs [n0, n1) and tokens tokens. */
    size_t (*scratch)(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens);
    void (*run)(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task);
};

/* A path's activation: h[i] = act(g[i], u[i]) for n values (COLI_FFN_ACT_*).
 * Every value is computed alike wherever it falls (no scalar tail on a
 * vector path), so a unit's result does not depend on the split. */
typedef void (*ColiFfnActFn)(int activation, float alpha, float limit, const float *g,
                             const float *u, float *h, int64_t n);

/* A path's conversions for the driver (NULL members, or no table: the
 * driver's portable loops; the results are the same bits). */
typedef struct {
    /* Inputs [i0, i0 + COLI_FFN_PAD * blocks) of one row of a kernel's
     * inputs (i0 a multiple of COLI_FFN_PAD) from their values v in natural
     * order: x_type and x_order as ColiFfnKernel's; half: the elements
     * between a split row's high and low parts. */
    void (*put)(int x_type, int x_order, const float *v, int64_t i0, int64_t blocks, void *row,
                int64_t half);
    void (*to_bf16)(const float *v, uint16_t *dst, int64_t n);     /* coli_f32_to_bf16 of each */
    void (*from_bf16)(const uint16_t *src, float *dst, int64_t n);
} ColiFfnConv;

/* Each path's kernel for a matrix (NULL: the path has none, the scalar one
 * runs) and activation. input: COLI_FFN_INPUT_*. */
const ColiFfnKernel *coli_ffn_kernel_scalar(const ColiFfnMat *m);
extern const ColiFfnActFn coli_ffn_act_scalar;
#if defined(__x86_64__) || defined(__i386__)
const ColiFfnKernel *coli_ffn_kernel_avx2(const ColiFfnMat *m);
const ColiFfnKernel *coli_ffn_kernel_avx512(const ColiFfnMat *m, int input);
extern const ColiFfnActFn coli_ffn_act_avx2, coli_ffn_act_avx512;
extern const ColiFfnConv coli_ffn_conv_avx512;
/* Whether the CPU runs the avx512 path's kernels of bfloat16 calls
 * (ffn_x86_i16.h: AVX512_BF16 and AVX512_VNNI). */
int coli_ffn_cpu_runs_i16(void);
#endif
#if defined(__aarch64__)
const ColiFfnKernel *coli_ffn_kernel_neon(const ColiFfnMat *m);
extern const ColiFfnActFn coli_ffn_act_neon;
#endif
/* Whether the format is computed stored that way at all (the scalar path
 * computes every such matrix). */
int coli_ffn_format_computed(ColiTensorFormat format, int in_out);

/* Output o's weights of a matrix stored (out, in), all n_in of them, in
 * input order, as the scalar path computes them (the SIMD paths' fallback
 * for rows their decoders do not take). */
void coli_ffn_dot_row(const ColiFfnMat *m, int64_t o, float *w);

/* The sum of a group's inputs as every path computes it: four running sums
 * over inputs 4i, 4i+1, 4i+2, 4i+3 of the group, then (s0 + s1) + (s2 + s3). */
float coli_ffn_group_sum(const float *x, int64_t n);

/* Element conversions shared by the paths. */
float coli_f16_to_f32(uint16_t h);
/* bfloat16 <-> float32 inline: the per-value loops of the norms, the
 * routers and the scalar path call them once per element. */
static inline float coli_bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even; NaN stays NaN (quieted). */
static inline uint16_t coli_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
float coli_e4m3_to_f32(uint8_t b);      /* e4m3fn: 0x7f and 0xff are NaN */
float coli_e5m2_to_f32(uint8_t b);
float coli_ffn_scale(const ColiFfnMat *m, int64_t index);  /* scale number index, as float */
float coli_ffn_ue8m0(int e);            /* 2^(e - 127), exact (e = 0: 2^-127; 255: +inf) */

/* Scale number i as float, inline so that SIMD code calls no function per
 * group for the common F32 and BF16 scales. */
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

/* Nibble n (0..7) of little-endian int32 word number word of p. */
static inline int coli_ffn_nibble_at(const uint8_t *p, int64_t word, int n) {
    return (p[4 * word + n / 2] >> (4 * (n & 1))) & 0xf;
}

/* AWQ's packing: nibble j of a word holds column COLI_AWQ_ORDER[j] of its
 * eight, so column c is in nibble COLI_AWQ_NIBBLE[c]. */
extern const uint8_t COLI_AWQ_NIBBLE[8];

/* The zero point of output n in group g as the stored nibble it is
 * subtracted from: int4 without zero points 8, GPTQ's original format the
 * stored nibble plus one. */
static inline int coli_ffn_zero_at(const ColiFfnMat *m, int64_t n, int64_t g) {
    switch (m->format) {
    case COLI_TENSOR_INT4_BLOCK:  /* eight per word down each column; none: the stored 8 */
        return m->zeros ? coli_ffn_nibble_at(m->zeros, (n / 8) * m->groups + g, (int)(n % 8)) : 8;
    case COLI_TENSOR_INT4_GPTQ:
        return coli_ffn_nibble_at(m->zeros, g * (m->n_out / 8) + n / 8, (int)(n % 8)) +
               m->zero_plus_one;
    case COLI_TENSOR_INT4_AWQ:
        return coli_ffn_nibble_at(m->zeros, g * (m->n_out / 8) + n / 8, COLI_AWQ_NIBBLE[n % 8]);
    default: return 0;
    }
}

/* The group of input k (GPTQ: g_idx). */
static inline int64_t coli_ffn_group_of(const ColiFfnMat *m, int64_t k) {
    if (!m->g_idx) return k / m->group;
    int32_t g;
    memcpy(&g, m->g_idx + 4 * k, sizeof g);
    return g;
}

/* The position of input k in its row under an order. */
static inline int64_t coli_ffn_pos(int order, int64_t k) {
    if (order == COLI_FFN_ORDER_PLAIN) return k;
    if (order == COLI_FFN_ORDER_Q128) return (k & ~(int64_t)127) + (k & 3) * 32 + ((k & 127) >> 2);
    if (order == COLI_FFN_ORDER_G8) return (k & ~(int64_t)7) + (k & 3) * 2 + ((k >> 2) & 1);
    return (k & ~(int64_t)63) + (k & 1) * 32 + ((k & 63) >> 1);
}

/* Streaming kernels: a line `ahead` bytes on into L1, and twice as far
 * into L2 (more misses in flight than L1's alone: measured faster cold).
 * Always inlined: GCC finds a function that only prefetches pure and may
 * drop its calls. */
static inline __attribute__((always_inline)) void ffn_prefetch2(const char *p, int64_t ahead) {
    __builtin_prefetch(p + 2 * ahead, 0, 1);
    __builtin_prefetch(p + ahead, 0, 3);
}

static inline int64_t coli_ffn_round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

#endif /* COLI_FFN_INTERNAL_H */
