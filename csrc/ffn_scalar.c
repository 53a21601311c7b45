/*
 * ffn_scalar.c: the portable path, and the reference every SIMD path is
 * tested against: element conversions, one decoder per format (also the
 * SIMD kernels' fallback at the edges of a matrix), plain C micro-kernels
 * and the activations.
 *
 * The micro-kernels keep COLI_FFN_DOT_LANES independent partial sums (DOT)
 * or one per output (AXPY), written as loops a compiler can vectorise with
 * the baseline instruction set.
 */
#include <math.h>
#include <string.h>

#include "ffn_internal.h"

/* ------------------------------------------------------------ element conversions */

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float coli_bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

uint16_t coli_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
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

float coli_ffn_scale(const ColiFfnMat *m, int64_t i) {
    uint16_t h;
    switch (m->scale_format) {
    case COLI_SCALE_F32:
    case COLI_SCALE_BF16: return coli_ffn_scale_at(m, i);
    case COLI_SCALE_F16:
        memcpy(&h, m->scales + 2 * i, sizeof h);
        return coli_f16_to_f32(h);
    case COLI_SCALE_UE8M0: return ldexpf(1.0f, (int)m->scales[i] - 127);
    default: return 1.0f;
    }
}

/* Nibble n (0..7) of little-endian int32 word number w of p. */
static int nibble(const uint8_t *p, int64_t w, int n) {
    return (p[4 * w + n / 2] >> (4 * (n & 1))) & 0xf;
}

/* AWQ's packing: nibble j holds column AWQ_ORDER[j] of its eight, so column
 * c is in nibble AWQ_NIBBLE[c]. */
static const int AWQ_NIBBLE[8] = {0, 4, 1, 5, 2, 6, 3, 7};

int coli_ffn_zero(const ColiFfnMat *m, int64_t n, int64_t g) {
    switch (m->format) {
    case COLI_TENSOR_INT4_BLOCK:  /* eight per word down each column; none: the stored 8 */
        return m->zeros ? nibble(m->zeros, (n / 8) * m->groups + g, (int)(n % 8)) : 8;
    case COLI_TENSOR_INT4_GPTQ:
        return nibble(m->zeros, g * (m->n_out / 8) + n / 8, (int)(n % 8)) + m->zero_plus_one;
    case COLI_TENSOR_INT4_AWQ:
        return nibble(m->zeros, g * (m->n_out / 8) + n / 8, AWQ_NIBBLE[n % 8]);
    default: return 0;
    }
}

/* Stored element (row, col) of a plain or FP8 matrix as float. */
static float plain_at(const ColiFfnMat *m, int64_t row, int64_t col) {
    int64_t i = row * m->cols + col;
    uint16_t h;
    float f;
    switch (m->format) {
    case COLI_TENSOR_F32:
        memcpy(&f, m->data + 4 * i, sizeof f);
        return f;
    case COLI_TENSOR_F16:
        memcpy(&h, m->data + 2 * i, sizeof h);
        return coli_f16_to_f32(h);
    case COLI_TENSOR_BF16:
        memcpy(&h, m->data + 2 * i, sizeof h);
        return coli_bf16_to_f32(h);
    case COLI_TENSOR_F8_E5M2: return coli_e5m2_to_f32(m->data[i]);
    case COLI_TENSOR_F8_E4M3: return coli_e4m3_to_f32(m->data[i]);
    case COLI_TENSOR_FP8_E4M3_BLOCK: {
        int64_t per_row = (m->cols + m->block_columns - 1) / m->block_columns;
        return coli_e4m3_to_f32(m->data[i]) *
               coli_ffn_scale(m, (row / m->block_rows) * per_row + col / m->block_columns);
    }
    default: return 0.0f;
    }
}

/* The 16 values of an e2m1 nibble. */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Logical weight W[n][k] (output n, input k) of any format. */
static float weight_at(const ColiFfnMat *m, int64_t n, int64_t k) {
    switch (m->format) {
    case COLI_TENSOR_FP4_NATIVE_BLOCK: {
        int q = (m->data[n * (m->n_in / 2) + k / 2] >> (4 * (k & 1))) & 0xf;
        return ldexpf(E2M1[q], (int)m->scales[n * (m->n_in / 32) + k / 32] - 127);
    }
    case COLI_TENSOR_INT4_BLOCK: {
        int q = (m->data[n * (m->n_in / 2) + k / 2] >> (4 * (k & 1))) & 0xf;
        int64_t g = k / m->group;
        return (float)(q - coli_ffn_zero(m, n, g)) * coli_ffn_scale(m, n * m->groups + g);
    }
    case COLI_TENSOR_INT4_GPTQ: {
        int q = nibble(m->data, (k / 8) * m->n_out + n, (int)(k % 8));
        int64_t g = coli_ffn_group_of(m, k);
        return (float)(q - coli_ffn_zero(m, n, g)) * coli_ffn_scale(m, g * m->n_out + n);
    }
    case COLI_TENSOR_INT4_AWQ: {
        int q = nibble(m->data, k * (m->n_out / 8) + n / 8, AWQ_NIBBLE[n % 8]);
        int64_t g = k / m->group;
        return (float)(q - coli_ffn_zero(m, n, g)) * coli_ffn_scale(m, g * m->n_out + n);
    }
    default:
        return m->in_out ? plain_at(m, k, n) : plain_at(m, n, k);
    }
}

/* ------------------------------------------------------------ decoding */

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

void coli_ffn_decode_scalar(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                            int64_t k0, int kc, float *tile, const float *aux) {
    if (k->layout == COLI_FFN_DOT) {
        int kcp = (int)round_up(kc, COLI_FFN_KBLOCK);
        for (int r = 0; r < nr; r++) {
            float *row = tile + (int64_t)r * k->kc;
            memset(row + (kc & ~(COLI_FFN_KBLOCK - 1)), 0,
                   sizeof(float) * (size_t)(kcp - (kc & ~(COLI_FFN_KBLOCK - 1))));
            for (int j = 0; j < kc; j++) {
                int pos = k->kpos ? (j & ~(COLI_FFN_KBLOCK - 1)) + k->kpos[j % COLI_FFN_KBLOCK] : j;
                row[pos] = weight_at(m, n0 + r, k0 + j);
            }
        }
        return;
    }
    int panel = k->panel;
    for (int j = 0; j < kc; j++) {
        float *row = tile + (int64_t)j * panel;
        if (nr < panel) memset(row, 0, sizeof(float) * (size_t)panel);
        if (aux) {  /* GPTQ, AWQ: the panel's float scales and zero points */
            int64_t kk = k0 + j;
            const float *s = aux + 2 * panel * coli_ffn_group_of(m, kk);
            for (int c = 0; c < nr; c++) {
                int pos = k->colpos ? k->colpos[c] : c;
                int q = m->format == COLI_TENSOR_INT4_GPTQ
                            ? nibble(m->data, (kk / 8) * m->n_out + n0 + c, (int)(kk % 8))
                            : nibble(m->data, kk * (m->n_out / 8) + (n0 + c) / 8,
                                     AWQ_NIBBLE[(n0 + c) % 8]);
                row[pos] = ((float)q - s[panel + pos]) * s[pos];
            }
            continue;
        }
        for (int c = 0; c < nr; c++)
            row[k->colpos ? k->colpos[c] : c] = weight_at(m, n0 + c, k0 + j);
    }
}

int64_t coli_ffn_quant_aux(const ColiFfnMat *m, const ColiFfnKernel *k) {
    return 2 * (int64_t)k->panel * m->groups;
}

void coli_ffn_prepare_quant(const ColiFfnMat *m, const ColiFfnKernel *k, int64_t n0, int nr,
                            float *aux) {
    int panel = k->panel;
    for (int64_t g = 0; g < m->groups; g++) {
        float *s = aux + 2 * panel * g, *z = s + panel;
        for (int c = 0; c < panel; c++) s[c] = z[c] = 0.0f;
        for (int c = 0; c < nr; c++) {
            int pos = k->colpos ? k->colpos[c] : c;
            s[pos] = coli_ffn_scale(m, g * m->n_out + n0 + c);
            z[pos] = (float)coli_ffn_zero(m, n0 + c, g);
        }
    }
}

/* ------------------------------------------------------------ micro-kernels */

static void dot_scalar(const float *tile, int ld, int kcp, const float *x, int64_t ldx,
                       int tokens, float *acc) {
    for (int t = 0; t < tokens; t++)
        for (int r = 0; r < COLI_FFN_DOT_ROWS; r++) {
            float *a = acc + ((int64_t)t * COLI_FFN_DOT_ROWS + r) * COLI_FFN_DOT_LANES;
            const float *w = tile + (int64_t)r * ld, *xt = x + t * ldx;
            for (int p = 0; p < kcp; p += COLI_FFN_DOT_LANES)
                for (int l = 0; l < COLI_FFN_DOT_LANES; l++) a[l] += w[p + l] * xt[p + l];
        }
}

static void axpy_scalar(const float *tile, int ld, int kc, int panel, const float *x, int64_t ldx,
                        int tokens, float *acc) {
    for (int t = 0; t < tokens; t++) {
        float *a = acc + (int64_t)t * panel;
        for (int j = 0; j < kc; j++) {
            float xv = x[t * ldx + j];
            const float *w = tile + (int64_t)j * ld;
            for (int c = 0; c < panel; c++) a[c] += w[c] * xv;
        }
    }
}

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

const ColiFfnIsaOps coli_ffn_ops_scalar = {dot_scalar, axpy_scalar, act_scalar};

/* ------------------------------------------------------------ kernel table */

static const ColiFfnKernel DOT_SCALAR = {
    "scalar", COLI_FFN_DOT, COLI_FFN_DOT_ROWS, COLI_FFN_DOT_KC, NULL, NULL, NULL, NULL,
    coli_ffn_decode_scalar, NULL};
static const ColiFfnKernel AXPY_SCALAR = {
    "scalar", COLI_FFN_AXPY, 64, COLI_FFN_AXPY_KC, NULL, NULL, NULL, NULL,
    coli_ffn_decode_scalar, NULL};
static const ColiFfnKernel QUANT_SCALAR = {
    "scalar", COLI_FFN_AXPY, 64, COLI_FFN_AXPY_KC, NULL, NULL, coli_ffn_prepare_quant,
    coli_ffn_quant_aux, coli_ffn_decode_scalar, NULL};

const ColiFfnKernel *coli_ffn_kernel_scalar(ColiTensorFormat format, int in_out) {
    switch (format) {
    case COLI_TENSOR_F32:
    case COLI_TENSOR_F16:
    case COLI_TENSOR_BF16:
    case COLI_TENSOR_F8_E4M3:
    case COLI_TENSOR_F8_E5M2:
    case COLI_TENSOR_FP8_E4M3_BLOCK: return in_out ? &AXPY_SCALAR : &DOT_SCALAR;
    case COLI_TENSOR_FP4_NATIVE_BLOCK:
    case COLI_TENSOR_INT4_BLOCK: return in_out ? NULL : &DOT_SCALAR;
    case COLI_TENSOR_INT4_GPTQ:
    case COLI_TENSOR_INT4_AWQ: return in_out ? &QUANT_SCALAR : NULL;
    default: return NULL;
    }
}
