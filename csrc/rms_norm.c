/*
 * rms_norm.c: coli_rms_norm (rms_norm.h). Each step rounds where
 * transformers' forward rounds, so a row's result differs from the
 * framework's only through the order of the sum of squares (held here in
 * double).
 */
#include "rms_norm.h"

#include <math.h>

#include "coli_errors.h"
#include "ffn_internal.h"   /* coli_bf16_to_f32, coli_f32_to_bf16 */
#include "tensor.h"

static float load(const void *p, int format, int64_t i) {
    return format == COLI_TENSOR_BF16 ? coli_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void store(void *p, int format, int64_t i, float v) {
    if (format == COLI_TENSOR_BF16)
        ((uint16_t *)p)[i] = coli_f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* The format the framework gives weight * row: bfloat16 only when both are. */
static int product_format(int format, int weight_format) {
    return format == COLI_TENSOR_BF16 && weight_format == COLI_TENSOR_BF16 ? COLI_TENSOR_BF16 : COLI_TENSOR_F32;
}

int coli_rms_norm(const void *x, void *out, const void *weight, int64_t rows, int64_t n,
                  int format, int weight_format, int out_format, float eps, int order,
                  char *err, size_t err_len) {
    int ok_format = format == COLI_TENSOR_F32 || format == COLI_TENSOR_BF16;
    int ok_weight = weight_format == COLI_TENSOR_F32 || weight_format == COLI_TENSOR_BF16;
    if (!ok_format || !ok_weight)
        return coli_fail(err, err_len, COLI_EINVAL, "rms_norm: rows and weight must be float32 or bfloat16 "
                         "(formats %d and %d)", format, weight_format);
    if (order != COLI_RMS_WEIGHT_AFTER_CAST && order != COLI_RMS_WEIGHT_BEFORE_CAST)
        return coli_fail(err, err_len, COLI_EINVAL, "rms_norm: unknown weight order %d", order);
    int want = order == COLI_RMS_WEIGHT_AFTER_CAST ? product_format(format, weight_format) : format;
    if (out_format != want)
        return coli_fail(err, err_len, COLI_EINVAL, "rms_norm: out must have format %d, not %d", want, out_format);
    if (rows < 0 || n < 1 || !x || !out || !weight)
        return coli_fail(err, err_len, COLI_EINVAL, "rms_norm: %lld rows of %lld values", (long long)rows,
                         (long long)n);
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * n;
        double squares = 0.0;
        for (int64_t i = 0; i < n; i++) {
            float h = load(x, format, base + i);
            squares += (double)(h * h);
        }
        float variance = (float)(squares / (double)n);
        float scale = 1.0f / sqrtf(variance + eps);
        for (int64_t i = 0; i < n; i++) {
            float h = load(x, format, base + i) * scale;
            float w = load(weight, weight_format, i);
            if (order == COLI_RMS_WEIGHT_AFTER_CAST && format == COLI_TENSOR_BF16)
                h = coli_bf16_to_f32(coli_f32_to_bf16(h));
            store(out, out_format, base + i, w * h);
        }
    }
    return 0;
}
