/*
 * rotary.h: transformers' rotary position embedding (apply_rotary_pos_emb
 * with rotate_half) of a decode step's queries or keys, in one call
 * instead of the ten tensor ops a framework runs for it.
 */
#ifndef COLI_ROTARY_H
#define COLI_ROTARY_H

#include <stddef.h>
#include <stdint.h>

/* out[r] = x[r] * c + rotate_half(x[r]) * s for rows rows of d values
 * (contiguous, d even), where c and s are row r / heads of cos and sin (d
 * values each) and rotate_half(v) = (-v[d/2 ..], v[.. d/2]). format
 * (COLI_TENSOR_F32 or BF16) is every operand's; in bfloat16 each product
 * and the sum are rounded to nearest even, as the framework's three ops
 * round. out may not overlap x. 0, or COLI_EINVAL with err set. */
int coli_rotary(const void *x, void *out, int64_t rows, int64_t heads, int64_t d, const void *cos,
                const void *sin, int format, char *err, size_t err_len);

#endif /* COLI_ROTARY_H */
