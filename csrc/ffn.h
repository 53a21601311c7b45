/*
 * ffn.h: one routed expert's feed-forward block, computed from its bytes as
 * stored, for a batch of tokens routed to that expert:
 *
 *     y = down(act(gate x + gate_bias, up x + up_bias)) + down_bias
 *
 * act is SiLU-gated (silu(g) * u) or gpt-oss's clamped SwiGLU
 * (g' = min(g, limit), u' = clamp(u, -limit, limit),
 *  (u' + 1) * g' * sigmoid(alpha * g')).
 *
 * Every weight format the expert store reads is computed in place: no float
 * copy of a whole matrix is made. Each block of weights is decoded into a
 * small tile (a few KiB, in L1) and applied to every token of the call, so
 * each weight byte is read once per call whatever the batch. Products
 * accumulate in float32.
 *
 * THREADS. A call splits its output rows over a compute pool (its own
 * threads, never the store's I/O pool); a NULL pool computes on the calling
 * thread. One pool runs one call at a time: concurrent calls on one pool
 * take turns. Calls on different pools, or without a pool, run in parallel.
 *
 * ERRORS. Functions return 0 or a negative COLI_E* code and write a message
 * naming what is wrong into err (truncated to err_len).
 *
 * This header is fed to cffi's cdef after '#' lines are stripped.
 */
#ifndef COLI_FFN_H
#define COLI_FFN_H

#include <stddef.h>
#include <stdint.h>

#include "tensor.h"

/* The instruction-set paths. AUTO: the process default, which is the best
 * path the CPU runs unless COLIBRI_KERNEL_ISA (scalar, avx2, avx512, neon)
 * names another one. */
enum {
    COLI_FFN_ISA_AUTO = -1,
    COLI_FFN_ISA_SCALAR = 0,
    COLI_FFN_ISA_AVX2 = 1,      /* x86-64: AVX2, FMA, F16C */
    COLI_FFN_ISA_AVX512 = 2,    /* x86-64: AVX-512 F, BW, VL (and AVX2's) */
    COLI_FFN_ISA_NEON = 3,      /* arm64 */
    COLI_FFN_N_ISA = 4
};

/* ColiFfnExpert.activation */
enum { COLI_FFN_ACT_SILU = 0, COLI_FFN_ACT_GPT_OSS = 1 };

/* ColiFfnExpert.fused: how a fused gate_up holds its two halves, along its
 * output dimension. */
enum {
    COLI_FFN_SEPARATE = 0,      /* gate and up are two matrices */
    COLI_FFN_CONCATENATED = 1,  /* outputs 0..I-1 are gate, I..2I-1 up (Llama 4, transformers) */
    COLI_FFN_INTERLEAVED = 2    /* outputs 2j are gate, 2j+1 up (gpt-oss) */
};

/* ColiFfnMatrix.flags */
enum {
    COLI_FFN_IN_OUT = 1,        /* stored (in, out): view.rows are inputs. GPTQ and AWQ always
                                 * are; plain and FP8 matrices may be (gpt-oss float, Llama 4) */
    COLI_FFN_ZERO_PLUS_ONE = 2, /* GPTQ's original format: each stored zero point is one less
                                 * than the zero point */
    COLI_FFN_ORDER_CHECKED = 4  /* GPTQ: a g_idx in group order was made by a store, which
                                 * checked it: a call checks only that its entries are in
                                 * range, not that each input appears once */
};

/* One matrix of the expert, as stored.
 *
 * view: the format, the data and its scales, the stored shape in elements
 * (GPTQ and AWQ: rows = inputs, columns = outputs; MXFP4 and pack-quantized
 * int4: rows = outputs, columns = inputs), and the scale block
 * (block_rows x block_columns stored elements per scale; GPTQ and AWQ:
 * group x 1, MXFP4 1 x 32, int4 1 x group, FP8 e.g. 128 x 128).
 *
 * What the view lacks:
 *   flags      orientation and the GPTQ zero convention (COLI_FFN_*);
 *   zeros      packed zero points as stored, or NULL: int4
 *              (ceil(outputs / 8), groups) int32 words, eight down each
 *              column; GPTQ (groups, outputs / 8) and AWQ (the same, in
 *              AWQ's nibble order) int32 words, eight along each row;
 *   g_idx      GPTQ: the group of each input row (inputs entries), or NULL
 *              for row / block_rows; or, every entry negative, the rows in
 *              group order (row j in group j / block_rows, holding input
 *              -1 - g_idx[j]: what the store makes of act order, see
 *              gptq_group_order.h);
 *   bias       one per output (of the fused gate_up: in its order), or NULL,
 *              in bias_format F32, F16 or BF16. */
typedef struct {
    ColiTensorView view;
    uint32_t flags;
    const void *zeros;
    size_t zero_bytes;
    const void *g_idx;          /* int32 values; need not be aligned */
    size_t g_idx_count;
    const void *bias;
    ColiTensorFormat bias_format;
    size_t bias_bytes;
} ColiFfnMatrix;

/* One expert: gate and up (I x H each, as outputs x inputs), or the fused
 * gate_up (2I x H) in gate with up zeroed, and down (H x I). */
typedef struct {
    ColiFfnMatrix gate;
    ColiFfnMatrix up;
    ColiFfnMatrix down;
    int fused;                  /* COLI_FFN_SEPARATE, _CONCATENATED or _INTERLEAVED */
    int activation;             /* COLI_FFN_ACT_* */
    float alpha;                /* gpt-oss: the sigmoid's slope (1.702) */
    float limit;                /* gpt-oss: the clamp (7.0) */
} ColiFfnExpert;

/* One call: tokens rows of x (hidden each; a linear's inputs) in, tokens
 * rows of out (hidden each; a linear's outputs) out. x and out are F32 or
 * BF16; strides count elements between rows (>= the row). out must not
 * overlap x. */
typedef struct {
    const void *x;
    ColiTensorFormat x_format;
    int64_t x_stride;
    void *out;
    ColiTensorFormat out_format;
    int64_t out_stride;
    int64_t tokens;             /* >= 1 */
    int isa;                    /* COLI_FFN_ISA_*: AUTO, or a path this CPU runs */
} ColiFfnCall;

typedef struct ColiComputePool ColiComputePool;

/* A pool of threads computing together: the caller plus threads - 1
 * workers (1..256). */
int coli_compute_pool_create(int threads, ColiComputePool **out, char *err, size_t err_len);
/* Joins the workers; no call may be running on the pool. NULL is a no-op. */
void coli_compute_pool_destroy(ColiComputePool *pool);
int coli_compute_pool_threads(const ColiComputePool *pool);

/* Computes the expert for call->tokens tokens. The GIL-free entry: it
 * touches no Python object. */
int coli_expert_ffn(const ColiFfnExpert *expert, const ColiFfnCall *call, ColiComputePool *pool,
                    char *err, size_t err_len);

/* One matrix alone: out = W x (+ bias) for call->tokens tokens, W described
 * as an expert's matrix is (any format and orientation the expert kernels
 * compute), x rows of its inputs and out rows of its outputs. A token's
 * result does not depend on the batch or the threads (only on the path).
 * The GIL-free entry: it touches no Python object. */
int coli_linear(const ColiFfnMatrix *matrix, const ColiFfnCall *call, ColiComputePool *pool,
                char *err, size_t err_len);

/* 1 if this build has the path and this CPU runs it, else 0. */
int coli_ffn_isa_supported(int isa);

/* A g_idx in group order (rows int32 entries, maybe unaligned; see
 * ColiFfnMatrix.g_idx): the first entry that is not -1 - an input, or
 * repeats one, or -1 when each input appears once. seen: rows bytes of
 * scratch. The one definition of the form: the kernels' check and the
 * store's loader both call it. */
int64_t coli_ffn_group_order_fault(const unsigned char *g_idx, int64_t rows, uint8_t *seen);
/* The process default (see COLI_FFN_ISA_AUTO), resolved once; a negative
 * COLI_E* code with a message when COLIBRI_KERNEL_ISA names an unknown path
 * or one this CPU cannot run. */
int coli_ffn_isa_default(char *err, size_t err_len);
/* 1 if bfloat16 calls of more than one token of compressed-tensors int4
 * (groups of a multiple of 32) and MXFP4 use AMX tiles on the avx512
 * path here: the CPU has AMX-TILE and AMX-INT8, the OS grants the tile
 * state, and the COLIBRI_KERNEL_AMX environment variable is not "0". Same
 * bits either way. */
int coli_ffn_amx_usable(void);
/* "scalar", "avx2", "avx512", "neon"; NULL for another value. */
const char *coli_ffn_isa_name(int isa);
/* The name of the kernel a path uses for a format stored one way
 * (in_out: COLI_FFN_IN_OUT or 0), e.g. "int4/avx512", or NULL when the
 * format cannot be computed stored that way. */
const char *coli_ffn_kernel_name(int isa, int format, int in_out);

#endif /* COLI_FFN_H */
