/*
 * tensor.h: a non-owning view of one weight tensor in memory.
 *
 * ABI-compatible with colibri's tensor.h: the enum values and the field order
 * of ColiTensorView must not change. Formats this package adds are appended
 * after COLI_TENSOR_INT4_BLOCK so the original values keep their numbers.
 *
 * This header is fed to cffi's cdef after '#' lines are stripped, so it holds
 * only declarations cdef can parse.
 */
#ifndef COLI_TENSOR_H
#define COLI_TENSOR_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    COLI_TENSOR_F32 = 0,
    COLI_TENSOR_Q8_ROW = 1,
    COLI_TENSOR_Q4_ROW = 2,
    COLI_TENSOR_Q2_ROW = 3,
    COLI_TENSOR_FP8_E4M3_BLOCK = 4,
    COLI_TENSOR_FP4_NATIVE_BLOCK = 5,
    COLI_TENSOR_INT8_BLOCK = 6,
    COLI_TENSOR_INT4_BLOCK = 7,
    /* Appended by this package: plain element types as safetensors stores them. */
    COLI_TENSOR_F16 = 8,
    COLI_TENSOR_BF16 = 9,
    COLI_TENSOR_F8_E4M3 = 10,   /* fp8 without block scales */
    COLI_TENSOR_F8_E5M2 = 11
} ColiTensorFormat;

typedef enum {
    COLI_SCALE_NONE = 0,
    COLI_SCALE_F32 = 1,
    COLI_SCALE_UE8M0 = 2
} ColiScaleFormat;

/* A view never owns its bytes: data and scales point into memory owned by
 * whoever produced the view (for the expert store: a leased slot). */
typedef struct {
    ColiTensorFormat format;
    ColiScaleFormat scale_format;
    const void *data;
    const void *scales;         /* NULL when scale_format == COLI_SCALE_NONE */
    size_t data_bytes;
    size_t scale_bytes;
    int64_t rows;
    int64_t columns;
    uint32_t block_rows;        /* scale block shape; 0 when unscaled */
    uint32_t block_columns;
} ColiTensorView;

#endif /* COLI_TENSOR_H */
