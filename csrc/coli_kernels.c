/*
 * coli_kernels.c: the kernel entries of the format table (coli_kernels.h).
 * Every format is computed by the one driver, coli_expert_ffn, which picks
 * the format's tile decoder per instruction-set path; the records differ in
 * what a slot must give it.
 */
#include "coli_kernels.h"

#define BIAS COLI_PART_BIT(COLI_PART_BIAS)
#define ZERO COLI_PART_BIT(COLI_PART_ZERO)
#define G_IDX COLI_PART_BIT(COLI_PART_G_IDX)

const ColiFormatKernel coli_kernel_plain = {"plain", BIAS, COLI_FFN_IN_OUT, coli_expert_ffn};
const ColiFormatKernel coli_kernel_fp8_block = {"fp8_block", BIAS, COLI_FFN_IN_OUT, coli_expert_ffn};
const ColiFormatKernel coli_kernel_mxfp4 = {"mxfp4", BIAS, 0, coli_expert_ffn};
const ColiFormatKernel coli_kernel_int4 = {"int4", BIAS | ZERO, 0, coli_expert_ffn};
const ColiFormatKernel coli_kernel_gptq = {"gptq", BIAS | ZERO | G_IDX,
                                           COLI_FFN_IN_OUT | COLI_FFN_ZERO_PLUS_ONE |
                                               COLI_FFN_ORDER_CHECKED, coli_expert_ffn};
const ColiFormatKernel coli_kernel_awq = {"awq", BIAS | ZERO, COLI_FFN_IN_OUT, coli_expert_ffn};
