/*
 * tensor.h: a non-owning view of one weight tensor in memory.
 *
 * ABI: the enum values and the field order of ColiTensorView never change;
 * a new format or scale format is appended with the next number.
 *
 * This header is fed to cffi's cdef after '#' lines are stripped, so it holds
 * only declarations cdef can parse.
 */
#ifndef COLI_TENSOR_H
#define COLI_TENSOR_H

#include <stddef.h>
#include <stdint.h>

/* What the formats mean. rows x columns counts elements, whatever the
 * packing. The expert store accepts only the formats a checkpoint maps to;
 * Q8_ROW, Q4_ROW, Q2_ROW and INT8_BLOCK keep their numbers but are refused
 * (the core's format table, coli_formats.c, says so for each value).
 *
 *   F32, F16, BF16, F8_*   plain row-major elements, no scales.
 *   FP8_E4M3_BLOCK         e4m3 elements; F32 scales, one per block_rows x
 *                          block_columns block (DeepSeek-V3: 128 x 128).
 *   FP4_NATIVE_BLOCK       MXFP4: e2m1 elements, two per byte, the low nibble
 *                          first; UE8M0 scales (2^(byte - 127)), one per
 *                          1 x 32 block (gpt-oss).
 *   INT4_BLOCK             int4 elements stored as value + 8, two per byte,
 *                          the low nibble first (compressed-tensors
 *                          pack-quantized words, little-endian); F32, BF16 or
 *                          F16 scales, one per 1 x group block. Zero points,
 *                          when the checkpoint has them, are an extra part of
 *                          the expert (see coli_sources.h).
 *   INT4_GPTQ              GPTQ: the matrix is stored (in, out); unsigned
 *                          4-bit values, eight per little-endian int32 down
 *                          each column (input row 8k + j in bits 4j..4j+3),
 *                          so the words are (rows / 8) x columns; F16, BF16
 *                          or F32 scales (groups x columns), one per
 *                          group x 1 block. Zero points and g_idx (the group
 *                          of each input row) are extra parts of the expert.
 *   INT4_AWQ               AWQ (GEMM packing): stored (in, out); unsigned
 *                          4-bit values, eight per little-endian int32 along
 *                          each row, nibble j holding column 8k + (0, 2, 4,
 *                          6, 1, 3, 5, 7)[j], so the words are rows x
 *                          (columns / 8); scales as INT4_GPTQ; zero points
 *                          (packed like the values) are an extra part. */
typedef enum {
    COLI_TENSOR_F32 = 0,
    COLI_TENSOR_Q8_ROW = 1,         /* refused by the store: nothing produces it */
    COLI_TENSOR_Q4_ROW = 2,         /* refused */
    COLI_TENSOR_Q2_ROW = 3,         /* refused */
    COLI_TENSOR_FP8_E4M3_BLOCK = 4,
    COLI_TENSOR_FP4_NATIVE_BLOCK = 5,
    COLI_TENSOR_INT8_BLOCK = 6,     /* refused */
    COLI_TENSOR_INT4_BLOCK = 7,
    /* Plain element types as safetensors stores them. */
    COLI_TENSOR_F16 = 8,
    COLI_TENSOR_BF16 = 9,
    COLI_TENSOR_F8_E4M3 = 10,   /* fp8 without block scales */
    COLI_TENSOR_F8_E5M2 = 11,
    COLI_TENSOR_INT4_GPTQ = 12,
    COLI_TENSOR_INT4_AWQ = 13
} ColiTensorFormat;

typedef enum {
    COLI_SCALE_NONE = 0,
    COLI_SCALE_F32 = 1,
    COLI_SCALE_UE8M0 = 2,       /* one byte: the scale is 2^(byte - 127) */
    COLI_SCALE_BF16 = 3,
    COLI_SCALE_F16 = 4
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
