/*
 * rotary.c: coli_rotary (rotary.h). Each value is computed as the
 * framework computes it, op by op, so the results are the same bits.
 */
#include "rotary.h"

#include "coli_errors.h"
#include "ffn_internal.h"   /* coli_bf16_to_f32, coli_f32_to_bf16 */
#include "tensor.h"

static float round_bf16(float v) {
    return coli_bf16_to_f32(coli_f32_to_bf16(v));
}

int coli_rotary(const void *x, void *out, int64_t rows, int64_t heads, int64_t d, const void *cos,
                const void *sin, int format, char *err, size_t err_len) {
    if (format != COLI_TENSOR_F32 && format != COLI_TENSOR_BF16)
        return coli_fail(err, err_len, COLI_EINVAL, "rotary: float32 or bfloat16 values, not format %d", format);
    if (rows < 0 || heads < 1 || d < 2 || d % 2 || !x || !out || !cos || !sin)
        return coli_fail(err, err_len, COLI_EINVAL, "rotary: %lld rows of %lld values (even), %lld heads",
                         (long long)rows, (long long)d, (long long)heads);
    const size_t size = format == COLI_TENSOR_BF16 ? 2 : 4;
    const uintptr_t x0 = (uintptr_t)x, x1 = x0 + (uintptr_t)(rows * d) * size;
    const uintptr_t o0 = (uintptr_t)out, o1 = o0 + (uintptr_t)(rows * d) * size;
    if (rows && x0 < o1 && o0 < x1) return coli_fail(err, err_len, COLI_EINVAL, "rotary: out overlaps x");
    const int64_t half = d / 2;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * d, angle = (r / heads) * d;
        for (int64_t i = 0; i < d; i++) {
            const int64_t j = i < half ? i + half : i - half;  /* the value rotate_half puts at i */
            if (format == COLI_TENSOR_BF16) {
                const uint16_t *xv = x, *cv = cos, *sv = sin;
                float v = coli_bf16_to_f32(xv[base + i]), w = coli_bf16_to_f32(xv[base + j]);
                float a = round_bf16(v * coli_bf16_to_f32(cv[angle + i]));
                float b = round_bf16((i < half ? -w : w) * coli_bf16_to_f32(sv[angle + i]));
                ((uint16_t *)out)[base + i] = coli_f32_to_bf16(a + b);
            } else {
                const float *xv = x, *cv = cos, *sv = sin;
                float w = xv[base + j];
                /* two statements: no contraction into a fused multiply-add */
                float a = xv[base + i] * cv[angle + i];
                float b = (i < half ? -w : w) * sv[angle + i];
                ((float *)out)[base + i] = a + b;
            }
        }
    }
    return 0;
}
