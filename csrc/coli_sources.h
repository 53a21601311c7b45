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
 * points): a byte range the store reads into the slot with the rest. */
typedef struct {
    int file;                   /* index into ColiStoreConfig.files */
    uint64_t offset;            /* absolute byte offset in the file */
    uint64_t nbytes;            /* > 0 */
} ColiPartSource;

enum {
    COLI_ROLE_PARTS = 6,            /* an expert's parts before its extra ones: gate, up and
                                     * down data, then their scales */
    COLI_MAX_PARTS = 12,            /* extra parts per expert at most */
    /* ColiExpertSource.flags */
    COLI_SOURCE_FUSED_GATE_UP = 1   /* gate holds the fused gate_up; up is absent (all zero) */
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
