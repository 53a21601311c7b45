/*
 * router_topk.c: coli_router_topk (router_topk.h). The softmax follows
 * torch's CPU kernel: the row's maximum subtracted, exp, the sum, then a
 * multiplication by its reciprocal; a value differs from torch's only in
 * the last bits of exp and of the sum's order.
 */
#include "router_topk.h"

#include <math.h>

#include "coli_errors.h"
#include "ffn_internal.h"   /* coli_bf16_to_f32, coli_f32_to_bf16 */
#include "tensor.h"

/* The most experts a row may choose: the kept values live on the stack. */
enum { ROUTER_MAX_K = 256 };

static float load(const void *p, int format, int64_t i) {
    return format == COLI_TENSOR_BF16 ? coli_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Whether a ranks before b (NaN above any number, as torch.topk ranks). */
static int above(float a, float b) {
    return a > b || (isnan(a) && !isnan(b));
}

int coli_router_topk(const void *logits, int format, int64_t rows, int64_t n, int k, int renorm,
                     void *scores, int scores_format, int64_t *index, char *err, size_t err_len) {
    int ok_in = format == COLI_TENSOR_F32 || format == COLI_TENSOR_BF16;
    int ok_out = scores_format == COLI_TENSOR_F32 || scores_format == COLI_TENSOR_BF16;
    if (!ok_in || !ok_out)
        return coli_fail(err, err_len, COLI_EINVAL, "router_topk: logits and scores must be float32 or "
                         "bfloat16 (formats %d and %d)", format, scores_format);
    if (rows < 0 || n < 1 || k < 1 || k > n || k > ROUTER_MAX_K || !logits || !scores || !index)
        return coli_fail(err, err_len, COLI_EINVAL, "router_topk: %lld rows of %lld logits, k %d (1 to %d "
                         "and at most the logits)", (long long)rows, (long long)n, k, ROUTER_MAX_K);
    float kept[ROUTER_MAX_K];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * n;
        int64_t *at = index + r * k;
        float top = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            float v = load(logits, format, base + i);
            if (v > top || isnan(v)) top = v;
        }
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) sum += expf(load(logits, format, base + i) - top);
        const float inv = 1.0f / sum;
        /* kept: the k largest so far, in rank order; a later equal value
         * goes after the earlier ones */
        int count = 0;
        for (int64_t i = 0; i < n; i++) {
            float p = expf(load(logits, format, base + i) - top) * inv;
            if (count == k && !above(p, kept[k - 1])) continue;
            int j = count < k ? count++ : k - 1;
            while (j > 0 && above(p, kept[j - 1])) {
                kept[j] = kept[j - 1];
                at[j] = at[j - 1];
                j--;
            }
            kept[j] = p;
            at[j] = i;
        }
        float total = 0.0f;
        if (renorm)
            for (int j = 0; j < k; j++) total += kept[j];
        for (int j = 0; j < k; j++) {
            float v = renorm ? kept[j] / total : kept[j];
            if (scores_format == COLI_TENSOR_BF16)
                ((uint16_t *)scores)[r * k + j] = coli_f32_to_bf16(v);
            else
                ((float *)scores)[r * k + j] = v;
        }
    }
    return 0;
}
