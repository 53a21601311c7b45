/*
 * coli_kernels.h (private): each tensor format's kernel entry, the record
 * the format table (coli_formats.c) points at. The store computes a leased
 * expert through the entry of its matrices' format (coli_store_expert_ffn):
 * the record says which extra parts of the expert the format's matrices
 * read and which ColiFfnMatrix flags it takes, and its ffn computes the
 * expert (ffn.h). A format whose record has no kernel is not computed.
 *
 * Adding a format's kernel: write it behind coli_expert_ffn (ffn.h,
 * docs/kernels.md), give the format an entry here (coli_kernels.c) and
 * point its record in coli_formats.c at it.
 */
#ifndef COLI_KERNELS_H
#define COLI_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "coli_formats.h"
#include "coli_sources.h"   /* COLI_PART_* */
#include "ffn.h"

#define COLI_PART_BIT(kind) (1u << (unsigned)(kind))

struct ColiFormatKernel {
    const char *name;             /* e.g. "int4" */
    uint32_t parts;               /* COLI_PART_BIT()s of the extra parts its matrices read
                                   * (a bias: every format) */
    uint32_t flags;               /* the ColiFfnMatrix flags it takes (COLI_FFN_IN_OUT, ...) */
    int (*ffn)(const ColiFfnExpert *expert, const ColiFfnCall *call, ColiComputePool *pool,
               char *err, size_t err_len);
};

extern const ColiFormatKernel coli_kernel_plain;      /* F32, F16, BF16, F8 without scales */
extern const ColiFormatKernel coli_kernel_fp8_block;  /* FP8 e4m3 with block scales */
extern const ColiFormatKernel coli_kernel_mxfp4;
extern const ColiFormatKernel coli_kernel_int4;       /* compressed-tensors pack-quantized */
extern const ColiFormatKernel coli_kernel_gptq;
extern const ColiFormatKernel coli_kernel_awq;

#endif /* COLI_KERNELS_H */
