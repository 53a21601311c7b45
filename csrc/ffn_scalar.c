/*
 * ffn_scalar.c: the portable path (every CPU; arm64's neon path too), the
 * element conversions every path shares, and the reference the SIMD paths
 * are tested against.
 *
 * Each kernel decodes a whole row of weights (an output's inputs, or an
 * input's outputs) into floats once, format by format in a loop of its own,
 * then applies it to every token of the batch in loops the compiler can
 * vectorise with the baseline instruction set.
 *
 * Sums (see ffn_internal.h), in double (a float product is exact in it),
 * rounded to float at the end: the reference the SIMD paths are held to,
 * more exact than they are where an activation amplifies the error of its
 * input (silu(g) for g near -50 is e^g to within the error of g times 50).
 *   DOT  (stored (out, in)): weight w_k = the dequantized value, rounded once
 *        to float ((q - z) * s, e2m1 * 2^e, fp8 * scale); input k adds
 *        w_k * x_k to lane k mod 16 of the output's 16 running sums, in
 *        input order; the lanes are then added as a tree (lane_sum).
 *   AXPY (stored (in, out)): one running sum per output, adding w_k * x_k in
 *        input order.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ffn_internal.h"

/* ------------------------------------------------------------ element conversions */

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float coli_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));  /* inf, NaN */
    if (exp == 0) {  /* zero or subnormal: man * 2^-24, exact in float */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

float coli_e4m3_to_f32(uint8_t b) {
    uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
    float v;
    if ((b & 0x7f) == 0x7f) v = NAN;
    else if (exp == 0) v = (float)man * 0x1p-9f;
    else v = bits_f32(((exp + 120u) << 23) | (man << 20));
    return (b & 0x80) ? -v : v;
}

float coli_e5m2_to_f32(uint8_t b) { return coli_f16_to_f32((uint16_t)(b << 8)); }

float coli_ffn_ue8m0(int e) {
    if (e == 255) return INFINITY;
    return bits_f32(e ? (uint32_t)e << 23 : 0x00400000u);
}

float coli_ffn_scale(const ColiFfnMat *m, int64_t i) {
    uint16_t h;
    switch (m->scale_format) {
    case COLI_SCALE_F32:
    case COLI_SCALE_BF16: return coli_ffn_scale_at(m, i);
    case COLI_SCALE_F16:
        memcpy(&h, m->scales + 2 * i, sizeof h);
        return coli_f16_to_f32(h);
    case COLI_SCALE_UE8M0: return coli_ffn_ue8m0(m->scales[i]);
    default: return 1.0f;
    }
}

const uint8_t COLI_AWQ_NIBBLE[8] = {0, 4, 1, 5, 2, 6, 3, 7};

float coli_ffn_group_sum(const float *x, int64_t n) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += x[i + j];
    for (int j = 0; i < n; i++, j++) s[j] += x[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

int coli_ffn_format_computed(ColiTensorFormat format, int in_out) {
    switch (format) {
    case COLI_TENSOR_F32:
    case COLI_TENSOR_F16:
    case COLI_TENSOR_BF16:
    case COLI_TENSOR_F8_E4M3:
    case COLI_TENSOR_F8_E5M2:
    case COLI_TENSOR_FP8_E4M3_BLOCK: return 1;
    case COLI_TENSOR_FP4_NATIVE_BLOCK:
    case COLI_TENSOR_INT4_BLOCK: return !in_out;
    case COLI_TENSOR_INT4_GPTQ:
    case COLI_TENSOR_INT4_AWQ: return in_out;
    default: return 0;
    }
}

/* ------------------------------------------------------------ decoding rows */

/* The 16 values of an e2m1 nibble (declared in ffn_internal.h). */
const float coli_ffn_e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Stored elements [c0, c0 + n) of stored row r of a plain or FP8 matrix,
 * times their FP8 block scale. */
static void plain_row(const ColiFfnMat *m, int64_t r, int64_t c0, int64_t n, float *w) {
    const uint8_t *p = m->data;
    int64_t i0 = r * m->cols + c0;
    switch (m->format) {
    case COLI_TENSOR_F32: memcpy(w, p + 4 * i0, sizeof(float) * (size_t)n); return;
    case COLI_TENSOR_F16:
    case COLI_TENSOR_BF16:
        for (int64_t j = 0; j < n; j++) {
            uint16_t h;
            memcpy(&h, p + 2 * (i0 + j), sizeof h);
            w[j] = m->format == COLI_TENSOR_F16 ? coli_f16_to_f32(h) : coli_bf16_to_f32(h);
        }
        return;
    case COLI_TENSOR_F8_E5M2:
        for (int64_t j = 0; j < n; j++) w[j] = coli_e5m2_to_f32(p[i0 + j]);
        return;
    case COLI_TENSOR_F8_E4M3:
        for (int64_t j = 0; j < n; j++) w[j] = coli_e4m3_to_f32(p[i0 + j]);
        return;
    default: {  /* FP8 blocks: one scale per run of block_columns */
        int64_t per_row = (m->cols + m->block_columns - 1) / m->block_columns;
        const int64_t srow = (r / m->block_rows) * per_row;
        for (int64_t j = 0; j < n;) {
            int64_t c = c0 + j, end = (c / m->block_columns + 1) * m->block_columns - c0;
            float s = coli_ffn_scale(m, srow + c / m->block_columns);
            for (end = end < n ? end : n; j < end; j++) w[j] = coli_e4m3_to_f32(p[i0 + j]) * s;
        }
        return;
    }
    }
}

/* The 16 values of group g of output o of an int4 or MXFP4 matrix. */
static void nibble_table(const ColiFfnMat *m, int64_t o, int64_t g, float *t) {
    if (m->format == COLI_TENSOR_FP4_NATIVE_BLOCK) {
        int e = m->scales[o * m->groups + g];
        for (int q = 0; q < 16; q++)
            t[q] = e == 255 ? ldexpf(coli_ffn_e2m1[q], 128) : coli_ffn_e2m1[q] * coli_ffn_ue8m0(e);
        return;
    }
    float s = coli_ffn_scale(m, o * m->groups + g), z = (float)coli_ffn_zero_at(m, o, g);
    for (int q = 0; q < 16; q++) t[q] = ((float)q - z) * s;
}

void coli_ffn_dot_row(const ColiFfnMat *m, int64_t o, float *w) {
    if (m->format != COLI_TENSOR_INT4_BLOCK && m->format != COLI_TENSOR_FP4_NATIVE_BLOCK) {
        plain_row(m, o, 0, m->n_in, w);
        return;
    }
    const uint8_t *src = m->data + o * (m->n_in / 2);
    for (int64_t g = 0; g < m->groups; g++) {
        float t[16];
        nibble_table(m, o, g, t);
        for (int64_t k = g * m->group; k < (g + 1) * m->group; k++)
            w[k] = t[(src[k / 2] >> (4 * (k & 1))) & 0xf];
    }
}

/* Per-output zero points and scales of group g for outputs [n0, n0 + n). */
static void quant_params(const ColiFfnMat *m, int64_t g, int64_t n0, int64_t n, float *z, float *s) {
    for (int64_t c = 0; c < n; c++) {
        z[c] = (float)coli_ffn_zero_at(m, n0 + c, g);
        s[c] = coli_ffn_scale(m, g * m->n_out + n0 + c);
    }
}

/* Input k's weights to outputs [n0, n0 + n) of a matrix stored (in, out). */
static void axpy_row(const ColiFfnMat *m, int64_t k, int64_t n0, int64_t n, const float *z,
                     const float *s, float *w) {
    if (m->format == COLI_TENSOR_INT4_GPTQ) {
        const uint8_t *p = m->data + ((k / 8) * m->n_out + n0) * 4;
        int shift = 4 * (int)(k % 8);
        for (int64_t c = 0; c < n; c++) {
            uint32_t word;
            memcpy(&word, p + 4 * c, sizeof word);
            w[c] = ((float)((word >> shift) & 0xf) - z[c]) * s[c];
        }
    } else if (m->format == COLI_TENSOR_INT4_AWQ) {
        const uint8_t *p = m->data + k * (m->n_out / 2);
        for (int64_t c = 0; c < n; c++) {
            int64_t col = n0 + c;
            w[c] = ((float)coli_ffn_nibble_at(p, col / 8, COLI_AWQ_NIBBLE[col % 8]) - z[c]) * s[c];
        }
    } else {
        plain_row(m, k, n0, n, w);
    }
}

/* ------------------------------------------------------------ kernels */

enum { LANES = 16 };

/* The sum of a DOT output's lanes, as a tree. */
static float lane_sum(const double *a) {
    double s[LANES / 2];
    for (int l = 0; l < LANES / 2; l++) s[l] = a[l] + a[l + LANES / 2];
    for (int l = 0; l < LANES / 4; l++) s[l] += s[l + LANES / 4];
    return (float)((s[0] + s[2]) + (s[1] + s[3]));
}

static size_t dot_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)n0, (void)n1, (void)tokens;
    return sizeof(float) * (size_t)coli_ffn_round_up(m->n_in, LANES);
}

static void dot_run(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    float *w = (float *)task->scratch;
    int64_t kp = coli_ffn_round_up(m->n_in, LANES);
    for (int64_t k = m->n_in; k < kp; k++) w[k] = 0.0f;
    for (int64_t o = n0; o < n1; o++) {
        coli_ffn_dot_row(m, o, w);
        for (int t = 0; t < task->tokens; t++) {
            const float *x = (const float *)task->x + t * task->ldx;
            double a[LANES] = {0};
            for (int64_t k = 0; k < kp; k += LANES)
                for (int l = 0; l < LANES; l++) a[l] += (double)w[k + l] * x[k + l];
            task->dst[t * task->ld_dst + o] = lane_sum(a);
        }
    }
}

static size_t axpy_scratch(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)m;
    return sizeof(double) * (size_t)((n1 - n0) * (3 + tokens));
}

static void axpy_run(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    int64_t n = n1 - n0;
    double *acc = (double *)task->scratch;
    float *w = (float *)(acc + n * task->tokens), *z = w + n, *s = z + n;
    int quant = m->format == COLI_TENSOR_INT4_GPTQ || m->format == COLI_TENSOR_INT4_AWQ;
    memset(acc, 0, sizeof(double) * (size_t)(n * task->tokens));
    int64_t have = -1;  /* the group whose parameters z and s hold */
    for (int64_t k = 0; k < m->n_in; k++) {
        int64_t g = quant ? coli_ffn_group_of(m, k) : -1;
        if (quant && g != have) quant_params(m, have = g, n0, n, z, s);
        axpy_row(m, k, n0, n, z, s, w);
        for (int t = 0; t < task->tokens; t++) {
            double xv = ((const float *)task->x)[t * task->ldx + k], *a = acc + t * n;
            for (int64_t c = 0; c < n; c++) a[c] += w[c] * xv;
        }
    }
    for (int t = 0; t < task->tokens; t++)
        for (int64_t c = 0; c < n; c++) task->dst[t * task->ld_dst + n0 + c] = (float)acc[t * n + c];
}

static const ColiFfnKernel DOT_SCALAR = {"scalar", COLI_FFN_X_F32, COLI_FFN_ORDER_PLAIN, 0, 1,
                                         dot_scratch, dot_run};
static const ColiFfnKernel AXPY_SCALAR = {"scalar", COLI_FFN_X_F32, COLI_FFN_ORDER_PLAIN, 0, 16,
                                          axpy_scratch, axpy_run};

const ColiFfnKernel *coli_ffn_kernel_scalar(const ColiFfnMat *m) {
    if (!coli_ffn_format_computed(m->format, m->in_out)) return NULL;
    return m->in_out ? &AXPY_SCALAR : &DOT_SCALAR;
}

/* ------------------------------------------------------------ activation */

static void act_scalar(int activation, float alpha, float limit, const float *g, const float *u,
                       float *h, int64_t n) {
    if (activation == COLI_FFN_ACT_SILU) {
        for (int64_t i = 0; i < n; i++) h[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i] > limit ? limit : g[i];  /* NaN stays NaN, as torch's clamp */
        float ui = u[i] > limit ? limit : u[i] < -limit ? -limit : u[i];
        h[i] = (ui + 1.0f) * (gi / (1.0f + expf(-alpha * gi)));
    }
}

const ColiFfnActFn coli_ffn_act_scalar = act_scalar;
