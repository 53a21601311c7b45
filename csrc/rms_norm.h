/*
 * rms_norm.h: the RMS norm of transformers' decoder layers, in one call
 * instead of the six tensor ops a framework runs for it, for the few rows
 * of a decode step where each op's overhead outweighs its arithmetic.
 */
#ifndef COLI_RMS_NORM_H
#define COLI_RMS_NORM_H

#include <stddef.h>
#include <stdint.h>

/* Where the weight multiplies: after the normalized row is cast to the
 * input's format (Llama and most families: weight * h.to(dtype)), or
 * before, in float32, with the product cast (OLMo-2, gpt-oss:
 * (weight * h).to(dtype)). */
enum { COLI_RMS_WEIGHT_AFTER_CAST = 0, COLI_RMS_WEIGHT_BEFORE_CAST = 1 };

/* out[r] = the norm of rows x[r] (rows of n contiguous values each, rows
 * apart by n): h = x in float32, h * 1 / sqrt(mean(h * h) + eps), times
 * weight (n values) at the place `order` says. x and out are
 * COLI_TENSOR_F32 or COLI_TENSOR_BF16 (format, the same for both);
 * weight is F32 or BF16 (weight_format). With AFTER_CAST the product of a
 * bfloat16 weight and row is rounded to bfloat16, of any other pair held
 * in float32: out_format says which out holds (the framework's promotion
 * of the two), and must be the row's format, or F32 for a float32 weight.
 * out may be x when their formats agree. 0, or COLI_EINVAL with err set. */
int coli_rms_norm(const void *x, void *out, const void *weight, int64_t rows, int64_t n,
                  int format, int weight_format, int out_format, float eps, int order,
                  char *err, size_t err_len);

#endif /* COLI_RMS_NORM_H */
