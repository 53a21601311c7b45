/*
 * coli_formats.c: the table of tensor and scale formats (coli_formats.h
 * says how to add one).
 */
#include "coli_formats.h"

#include "coli_kernels.h"

#include <stddef.h>

#define PLAIN_SCALES (COLI_SCALE_BIT(COLI_SCALE_NONE) | COLI_SCALE_BIT(COLI_SCALE_F32))
#define INT4_SCALES (COLI_SCALE_BIT(COLI_SCALE_F32) | COLI_SCALE_BIT(COLI_SCALE_BF16) | \
                     COLI_SCALE_BIT(COLI_SCALE_F16))

/* Indexed by ColiTensorFormat. tensor.h says what each format means. */
static const ColiFormatInfo FORMATS[] = {
    [COLI_TENSOR_F32] = {"f32", COLI_PACK_ROWS, 32, PLAIN_SCALES, &coli_kernel_plain},
    [COLI_TENSOR_Q8_ROW] = {"q8_row", COLI_PACK_REFUSED, 0, 0, NULL},
    [COLI_TENSOR_Q4_ROW] = {"q4_row", COLI_PACK_REFUSED, 0, 0, NULL},
    [COLI_TENSOR_Q2_ROW] = {"q2_row", COLI_PACK_REFUSED, 0, 0, NULL},
    [COLI_TENSOR_FP8_E4M3_BLOCK] = {"fp8_e4m3_block", COLI_PACK_ROWS, 8,
                                    COLI_SCALE_BIT(COLI_SCALE_F32), &coli_kernel_fp8_block},
    [COLI_TENSOR_FP4_NATIVE_BLOCK] = {"mxfp4", COLI_PACK_ROWS, 4, COLI_SCALE_BIT(COLI_SCALE_UE8M0),
                                     &coli_kernel_mxfp4},
    [COLI_TENSOR_INT8_BLOCK] = {"int8_block", COLI_PACK_REFUSED, 0, 0, NULL},
    [COLI_TENSOR_INT4_BLOCK] = {"int4_block", COLI_PACK_ROWS, 4, INT4_SCALES, &coli_kernel_int4},
    [COLI_TENSOR_F16] = {"f16", COLI_PACK_ROWS, 16, PLAIN_SCALES, &coli_kernel_plain},
    [COLI_TENSOR_BF16] = {"bf16", COLI_PACK_ROWS, 16, PLAIN_SCALES, &coli_kernel_plain},
    [COLI_TENSOR_F8_E4M3] = {"f8_e4m3", COLI_PACK_ROWS, 8, PLAIN_SCALES, &coli_kernel_plain},
    [COLI_TENSOR_F8_E5M2] = {"f8_e5m2", COLI_PACK_ROWS, 8, PLAIN_SCALES, &coli_kernel_plain},
    [COLI_TENSOR_INT4_GPTQ] = {"int4_gptq", COLI_PACK_WORDS_DOWN_COLUMNS, 4, INT4_SCALES,
                                &coli_kernel_gptq},
    [COLI_TENSOR_INT4_AWQ] = {"int4_awq", COLI_PACK_WORDS_ALONG_ROWS, 4, INT4_SCALES,
                               &coli_kernel_awq},
};

/* Indexed by ColiScaleFormat. */
static const ColiScaleInfo SCALES[] = {
    [COLI_SCALE_NONE] = {"none", 0},
    [COLI_SCALE_F32] = {"f32", 4},
    [COLI_SCALE_UE8M0] = {"ue8m0", 1},
    [COLI_SCALE_BF16] = {"bf16", 2},
    [COLI_SCALE_F16] = {"f16", 2},
};

const ColiFormatInfo *coli_format_info(ColiTensorFormat f) {
    size_t i = (size_t)f;   /* an out-of-range enum value becomes a large index */
    return i < sizeof FORMATS / sizeof FORMATS[0] && FORMATS[i].name ? &FORMATS[i] : NULL;
}

const ColiScaleInfo *coli_scale_info(ColiScaleFormat sf) {
    size_t i = (size_t)sf;
    return i < sizeof SCALES / sizeof SCALES[0] && SCALES[i].name ? &SCALES[i] : NULL;
}

bool coli_format_bytes(const ColiFormatInfo *f, int64_t rows, int64_t columns, uint64_t *out) {
    if (rows <= 0 || columns <= 0) return false;
    uint64_t r = (uint64_t)rows, c = (uint64_t)columns, row_bytes, total;
    uint64_t per_word = f->bits ? 32u / f->bits : 0;
    switch (f->packing) {
    case COLI_PACK_ROWS:
        if (__builtin_mul_overflow(c, (uint64_t)f->bits, &row_bytes)) return false;
        row_bytes = (row_bytes + 7) / 8;
        break;
    case COLI_PACK_WORDS_DOWN_COLUMNS:   /* (rows / per_word) x columns words */
        if (r % per_word) return false;
        r /= per_word;
        if (__builtin_mul_overflow(c, 4u, &row_bytes)) return false;
        break;
    case COLI_PACK_WORDS_ALONG_ROWS:     /* rows x (columns / per_word) words */
        if (c % per_word) return false;
        row_bytes = c / per_word * 4;
        break;
    default:
        return false;
    }
    if (__builtin_mul_overflow(row_bytes, r, &total)) return false;
    *out = total;
    return true;
}
