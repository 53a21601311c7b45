/*
 * decode_layer.h: the one-token step of a pre-norm decoder layer with
 * grouped-query attention and a routed MoE block, in two calls around the
 * key/value cache's append (which the engine owns):
 *
 *   coli_decode_qkv    input norm, q/k/v projections, the q and k heads'
 *                      norms (when the family has them), rotary embedding;
 *   coli_decode_route  one-query attention over the cache, o projection,
 *                      residual add, post-attention norm, router, top-k.
 *
 * Each piece is the public call of its own header (coli_rms_norm,
 * coli_linear, coli_rotary, coli_decode_attention, coli_router_topk) on
 * the same operands in the same order, so the results are the same bits
 * as those calls one by one; what the two calls save is the engine's
 * per-call overhead, a dozen times per layer and token.
 */
#ifndef COLI_DECODE_LAYER_H
#define COLI_DECODE_LAYER_H

#include <stddef.h>
#include <stdint.h>

#include "decode_attention.h"
#include "ffn.h"

/* An RMS norm's weight (in the step's format), epsilon and weight order
 * (COLI_RMS_WEIGHT_*). */
typedef struct {
    const void *weight;
    float eps;
    int order;
} ColiDecodeNorm;

/* The attention half's first part. format (COLI_TENSOR_F32 or BF16) is
 * every activation's and norm weight's; isa as in ColiFfnCall. h is the
 * layer's input (hidden values); normed (hidden), q (heads * d) and k
 * (kv_heads * d) are scratch, as are q_normed and k_normed when qk_norm;
 * q_rotated (heads * d), k_rotated and v (kv_heads * d each) are the
 * outputs. Buffers do not overlap. */
typedef struct {
    int format;
    int isa;
    int64_t hidden, heads, kv_heads, d;
    int qk_norm;
    ColiDecodeNorm input_norm, q_norm, k_norm;
    const ColiFfnMatrix *q_proj, *k_proj, *v_proj;
    const void *h, *cos, *sin;
    void *normed, *q, *k, *q_normed, *k_normed;
    void *q_rotated, *k_rotated, *v;
} ColiDecodeQkv;

/* The attention half's second part and the router. With attend, the
 * attention (its q the step's rotated queries, its out attended) runs
 * first; without, attended already holds its output. Then o = o_proj
 * attended, residual = h + o (rounded to the format), post = the post
 * norm of residual, logits = router post (experts values), and top_k
 * scores (scores_format) and indices of the logits, renormalized when
 * renorm. attended holds attention.heads * attention.dv values, with or
 * without attend. */
typedef struct {
    int format;
    int isa;
    int64_t hidden, experts;
    int attend;
    ColiDecodeAttention attention;
    const ColiFfnMatrix *o_proj, *router;
    ColiDecodeNorm post_norm;
    const void *h;
    void *attended, *o, *residual, *post, *logits;
    int top_k, renorm, scores_format;
    void *scores;
    int64_t *index;
} ColiDecodeRoute;

/* 0, or the failing piece's negative COLI_E* code with err naming it
 * (COLI_EINVAL for a NULL step, a format other than F32 or BF16, or, in
 * the route, a NULL h, o or residual). */
int coli_decode_qkv(const ColiDecodeQkv *s, ColiComputePool *pool, char *err, size_t err_len);
int coli_decode_route(const ColiDecodeRoute *s, ColiComputePool *pool, char *err, size_t err_len);

#endif /* COLI_DECODE_LAYER_H */
