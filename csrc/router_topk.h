/*
 * router_topk.h: the routing of a softmax top-k MoE router (Qwen, Mixtral,
 * OLMoE and their kin) from its logits, in one call instead of the four
 * to six tensor ops a framework runs for it, for a decode step's few rows.
 */
#ifndef COLI_ROUTER_TOPK_H
#define COLI_ROUTER_TOPK_H

#include <stddef.h>
#include <stdint.h>

/* For each of rows rows of n logits (COLI_TENSOR_F32 or BF16, rows
 * contiguous, n apart): p = softmax of the logits in float32; the k
 * largest p, largest first, equal ones by lower position (NaN counts as
 * the largest, as in torch.topk); their positions to index (rows x k
 * int64) and their values, divided by their sum when renorm is nonzero,
 * to scores (rows x k, scores_format F32 or BF16, rounded to nearest
 * even). 1 <= k <= n. 0, or COLI_EINVAL with err set. */
int coli_router_topk(const void *logits, int format, int64_t rows, int64_t n, int k, int renorm,
                     void *scores, int scores_format, int64_t *index, char *err, size_t err_len);

#endif /* COLI_ROUTER_TOPK_H */
