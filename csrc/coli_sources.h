/*
 * coli_sources.h: where an expert's bytes lie in the model's files. A store
 * is created from these records (ColiStoreConfig.experts, coli_store.h);
 * the reader (expert_reader.h) checks them and plans each expert's reads.
 *
 * This header is fed to cffi's cdef after '#' lines are stripped, so it holds
 * only declarations cdef can parse.
 */
#ifndef COLI_SOURCES_H
#define COLI_SOURCES_H

#include <stdint.h>

#include "tensor.h"

/* Where one tensor's bytes are: a range of one file, plus its scales. */
typedef struct {
    int file;                   /* index into ColiStoreConfig.files */
    uint64_t offset;            /* absolute byte offset in the file */
    uint64_t nbytes;            /* data length in bytes */
    ColiTensorFormat format;
    int64_t rows;
    int64_t columns;
    ColiScaleFormat scale_format;  /* COLI_SCALE_NONE: the scale fields are unused */
    int scale_file;
    uint64_t scale_offset;
    uint64_t scale_nbytes;
    uint32_t block_rows;
    uint32_t block_columns;
} ColiTensorSource;

/* A part of an expert beyond the roles' data and scales (a bias, zero
 * points): a byte range the store reads into the slot with the rest. What it
 * is (kind, role, format) matters only to the kernels that compute the
 * expert from its slot (coli_store_expert_ffn); the reader only reads it. */
typedef struct {
    int file;                   /* index into ColiStoreConfig.files */
    uint64_t offset;            /* absolute byte offset in the file */
    uint64_t nbytes;            /* > 0 */
    /* Appended for the kernels; zeroed, a part is COLI_PART_OTHER. */
    int kind;                   /* COLI_PART_* */
    int role;                   /* whose part: 0 gate (or the fused gate_up), 1 up, 2 down */
    ColiTensorFormat format;    /* a bias's elements (the kernels take F32, F16, BF16) */
} ColiPartSource;

enum {
    COLI_ROLE_PARTS = 6,            /* an expert's parts before its extra ones: gate, up and
                                     * down data, then their scales */
    COLI_MAX_PARTS = 12,            /* extra parts per expert at most */
    /* ColiExpertSource.flags */
    COLI_SOURCE_FUSED_GATE_UP = 1,  /* gate holds the fused gate_up; up is absent (all zero) */
    /* How the kernels read the expert (the reader reads it the same way): */
    COLI_SOURCE_IN_OUT = 2,         /* every matrix is stored (in, out) (GPTQ, AWQ, gpt-oss and
                                     * Llama 4 floats); else (out, in) */
    COLI_SOURCE_INTERLEAVED = 4,    /* with FUSED_GATE_UP: gate and up alternate along the fused
                                     * outputs (gpt-oss); without it they are concatenated */
    COLI_SOURCE_ZERO_PLUS_ONE = 8,  /* GPTQ's original format: each stored zero point is one less
                                     * than the zero point */
    /* ColiPartSource.kind */
    COLI_PART_OTHER = 0,            /* bytes the kernels do not read */
    COLI_PART_BIAS = 1,             /* one value per output of its role, in its format */
    COLI_PART_ZERO = 2,             /* its role's packed zero points, as the role's format stores them */
    COLI_PART_G_IDX = 3             /* GPTQ: the group of each input row of its role, int32; a
                                     * slot holds act order in group order (gptq_group_order.h) */
};

/* One routed expert of the model and where its tensors are.
 *
 * A zeroed tail (no flags, no parts) is a plain expert of three tensors. An
 * expert of a fused layout (gpt-oss, Llama 4) sets COLI_SOURCE_FUSED_GATE_UP,
 * describes the fused tensor as gate and leaves up zeroed; its leased view
 * then has gate pointing at the fused tensor and up zeroed (data NULL,
 * 0 x 0). Extra parts are copied at creation (parts need not outlive
 * coli_store_create) and read into the slot with the rest; the view
 * (expert_store.h) has no field for them, so coli_store_expert_parts says
 * where each lies in the slot. */
typedef struct {
    int layer;
    int expert;
    ColiTensorSource gate;
    ColiTensorSource up;
    ColiTensorSource down;
    uint32_t flags;             /* COLI_SOURCE_* bits */
    int n_parts;                /* extra parts, 0..COLI_MAX_PARTS */
    const ColiPartSource *parts;  /* n_parts of them; NULL when n_parts == 0 */
} ColiExpertSource;

#endif /* COLI_SOURCES_H */
