/*
 * decode_attention.h: the attention of a decode step (one query per head)
 * over a key/value cache, grouped-query or not, computed on the compute
 * pool's threads instead of a framework's one-query kernel on one thread.
 */
#ifndef COLI_DECODE_ATTENTION_H
#define COLI_DECODE_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "ffn.h"   /* ColiComputePool, COLI_FFN_ISA_* */

/* For batch row b and query head h, with g = h / (heads / kv_heads):
 * out[b, h] = sum over j < n of p_j v[b, g, j], where p = softmax over j of
 * scale * (q[b, h] . k[b, g, j]); products, sums and the softmax in
 * float32. q is batch x heads rows of d values and out batch x heads rows
 * of dv values, both contiguous; row j of key head g of batch row b starts
 * at element b * k_batch + g * k_head + j * k_token of k (d contiguous
 * values), and likewise for v (dv values). q, k, v and out hold format
 * (COLI_TENSOR_F32 or BF16, rounded to nearest even). The query heads split
 * over pool's threads (NULL: this thread); isa is a COLI_FFN_ISA_* path
 * (AUTO: the process default). n >= 1 and heads a multiple of kv_heads.
 * 0, or COLI_EINVAL / COLI_ENOMEM with err set. */
typedef struct {
    const void *q, *k, *v;
    void *out;
    int64_t batch, heads, kv_heads, n, d, dv;
    int64_t k_batch, k_head, k_token;
    int64_t v_batch, v_head, v_token;
    float scale;
    int format;
    int isa;
} ColiDecodeAttention;

int coli_decode_attention(const ColiDecodeAttention *a, ColiComputePool *pool, char *err,
                          size_t err_len);

#endif /* COLI_DECODE_ATTENTION_H */
