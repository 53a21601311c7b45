/*
 * ffn_neon.c: the arm64 path. No format has a NEON kernel yet: the path
 * runs the scalar kernels (decoded rows applied in loops the compiler
 * vectorises for the baseline NEON), with the scalar activation.
 */
#if defined(__aarch64__)

#include "ffn_internal.h"

const ColiFfnKernel *coli_ffn_kernel_neon(const ColiFfnMat *m) {
    (void)m;
    return NULL;
}

#else

/* Not arm64: nothing here (ISO C wants a translation unit to declare something). */
typedef int coli_ffn_neon_unused;

#endif
