/*
 * rms_norm.c: coli_rms_norm (rms_norm.h). Each step rounds where
 * transformers' forward rounds, so a row's result differs from the
 * framework's only through the order of the sum of squares (held here in
 * double, four running sums).
 */
#include "rms_norm.h"

#include <math.h>
#include <string.h>

#include "coli_errors.h"
#include "ffn_internal.h"   /* coli_bf16_to_f32, coli_f32_to_bf16 */
#include "tensor.h"

/* Rows go through in blocks of this many values, widened to float32 first
 * (the format's branch out of the per-value loops). */
enum { NORM_BLOCK = 256 };

static void widen(const void *p, int format, int64_t at, int64_t count, float *dst) {
    if (format == COLI_TENSOR_BF16) {
        const uint16_t *src = (const uint16_t *)p + at;
        for (int64_t i = 0; i < count; i++) dst[i] = coli_bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)p + at, sizeof(float) * (size_t)count);
    }
}

static void narrow(const float *v, int64_t count, void *p, int format, int64_t at) {
    if (format == COLI_TENSOR_BF16) {
        uint16_t *dst = (uint16_t *)p + at;
        for (int64_t i = 0; i < count; i++) dst[i] = coli_f32_to_bf16(v[i]);
    } else {
        memcpy((float *)p + at, v, sizeof(float) * (size_t)count);
    }
}

/* The sum of the float32 squares of v, in double: four running sums. */
static double sum_of_squares(const float *v, int64_t count) {
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t i = 0;
    for (; i + 4 <= count; i += 4)
        for (int j = 0; j < 4; j++) s[j] += (double)(v[i + j] * v[i + j]);
    for (; i < count; i++) s[0] += (double)(v[i] * v[i]);
    return (s[0] + s[1]) + (s[2] + s[3]);
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
    const int round_h = order == COLI_RMS_WEIGHT_AFTER_CAST && format == COLI_TENSOR_BF16;
    float h[NORM_BLOCK], w[NORM_BLOCK];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * n;
        double squares = 0.0;
        for (int64_t i = 0; i < n; i += NORM_BLOCK) {
            int64_t c = n - i < NORM_BLOCK ? n - i : NORM_BLOCK;
            widen(x, format, base + i, c, h);
            squares += sum_of_squares(h, c);
        }
        float variance = (float)(squares / (double)n);
        float scale = 1.0f / sqrtf(variance + eps);
        for (int64_t i = 0; i < n; i += NORM_BLOCK) {
            int64_t c = n - i < NORM_BLOCK ? n - i : NORM_BLOCK;
            widen(x, format, base + i, c, h);
            widen(weight, weight_format, i, c, w);
            for (int64_t j = 0; j < c; j++) {
                float v = h[j] * scale;
                if (round_h) v = coli_bf16_to_f32(coli_f32_to_bf16(v));
                h[j] = w[j] * v;
            }
            narrow(h, c, out, out_format, base + i);
        }
    }
    return 0;
}
