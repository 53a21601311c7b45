/*
 * ffn_neon.c: the arm64 path. Micro-kernels with four-lane FMAs over the
 * tiles the scalar decoders fill (no format has a NEON decoder yet), and
 * the activations computed lane by lane with the C library's expf, as the
 * scalar path does. The loops mirror the scalar ones line for line, so
 * what the scalar tests establish carries over.
 */
#if defined(__aarch64__)

#include <arm_neon.h>

#include "ffn_internal.h"

enum { ROWS = COLI_FFN_DOT_ROWS, LANES = COLI_FFN_DOT_LANES };

/* DOT: one token and four rows at a time; the four-lane sums land in lanes
 * 0..3 of each (token, row) accumulator. */
static void dot_neon(const float *tile, int ld, int kcp, const float *x, int64_t ldx, int tokens,
                     float *acc) {
    for (int t = 0; t < tokens; t++) {
        const float *xt = x + t * ldx;
        float *a = acc + (int64_t)t * ROWS * LANES;
        float32x4_t a0 = vld1q_f32(a), a1 = vld1q_f32(a + LANES);
        float32x4_t a2 = vld1q_f32(a + 2 * LANES), a3 = vld1q_f32(a + 3 * LANES);
        for (int p = 0; p < kcp; p += 4) {
            float32x4_t xv = vld1q_f32(xt + p);
            a0 = vfmaq_f32(a0, vld1q_f32(tile + p), xv);
            a1 = vfmaq_f32(a1, vld1q_f32(tile + ld + p), xv);
            a2 = vfmaq_f32(a2, vld1q_f32(tile + 2 * ld + p), xv);
            a3 = vfmaq_f32(a3, vld1q_f32(tile + 3 * ld + p), xv);
        }
        vst1q_f32(a, a0);
        vst1q_f32(a + LANES, a1);
        vst1q_f32(a + 2 * LANES, a2);
        vst1q_f32(a + 3 * LANES, a3);
    }
}

/* AXPY: one token at a time, four outputs per vector. */
static void axpy_neon(const float *tile, int ld, int kc, int panel, const float *x, int64_t ldx,
                      int tokens, float *acc) {
    for (int t = 0; t < tokens; t++) {
        float *a = acc + (int64_t)t * panel;
        for (int j = 0; j < kc; j++) {
            float32x4_t xv = vdupq_n_f32(x[t * ldx + j]);
            const float *w = tile + (int64_t)j * ld;
            for (int c = 0; c < panel; c += 4)
                vst1q_f32(a + c, vfmaq_f32(vld1q_f32(a + c), vld1q_f32(w + c), xv));
        }
    }
}

static void act_neon(int activation, float alpha, float limit, const float *g, const float *u,
                     float *h, int64_t n) {
    coli_ffn_ops_scalar.act(activation, alpha, limit, g, u, h, n);
}

const ColiFfnIsaOps coli_ffn_ops_neon = {dot_neon, axpy_neon, act_neon};

#else

/* Not arm64: nothing here (ISO C wants a translation unit to declare something). */
typedef int coli_ffn_neon_unused;

#endif
