/*
 * gptq_group_order.h (private): GPTQ with act order, held in group order.
 *
 * With act order a g_idx spreads each group's input rows over the whole
 * matrix, so the eight nibbles of a stored word mostly belong to eight
 * groups, and a kernel reading the words as stored must sort every
 * product by group on every call. When a matrix's groups are the
 * format's (group g has exactly min(group, inputs - g group) rows) and a
 * group is whole words, the store moves the rows once, as the expert
 * arrives in its slot: stored input row j then lies in group j / group,
 * as without act order, and g_idx entry j becomes -1 - the input it
 * holds. A g_idx of negative entries is this group-order form; the
 * kernels gather their inputs through it and colibri.dequantize moves
 * the rows back. A store's matrices carry COLI_FFN_ORDER_CHECKED: every
 * group-order g_idx in a slot was made or checked here.
 */
#ifndef COLI_GPTQ_GROUP_ORDER_H
#define COLI_GPTQ_GROUP_ORDER_H

#include <stddef.h>
#include <stdint.h>

/* Puts a GPTQ matrix (words: (rows / 8) x cols int32, rows input rows)
 * with act order into group order, rewriting its g_idx (rows int32), when
 * its g_idx has the format's groups of group rows and group is a multiple
 * of 8. Anything else (no act order, uneven groups, entries out of range,
 * already in group order) is left as it is: the kernels take every g_idx.
 * A g_idx already in group order (stored so) is checked: each input once.
 * Neither pointer need be aligned. Returns 1 when it moved the rows, 0
 * when it left them; COLI_ENOMEM when out of memory, COLI_ECONFIG for a
 * negative g_idx that is not group order (message in err, naming what), the
 * bytes unchanged. */
int coli_gptq_group_order(unsigned char *words, int64_t rows, int64_t cols, int64_t group,
                          unsigned char *g_idx, const char *what, char *err, size_t err_len);

#endif /* COLI_GPTQ_GROUP_ORDER_H */
