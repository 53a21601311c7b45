/*
 * ffn.c: the expert FFN driver: checks a call, chooses each matrix's kernel
 * for the path, and runs the phases on the compute pool:
 *
 *   0. the tokens' inputs as float, in the gate kernel's input order;
 *   1. gate and up (or gate_up) panels, split over the threads, into a
 *      float buffer of both halves (plus their biases);
 *   2. the activation, split over the intermediate units, written in the
 *      down kernel's input order;
 *   3. down panels, split over the threads, straight into the output.
 *
 * Buffers scale with the tokens of a batch; a call with more tokens than
 * one batch holds runs batch after batch (each re-reading the weights).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "coli_errors.h"
#include "compute_pool.h"
#include "ffn_internal.h"

/* ------------------------------------------------------------ paths */

static const char *const ISA_NAMES[COLI_FFN_N_ISA] = {"scalar", "avx2", "avx512", "neon"};

const char *coli_ffn_isa_name(int isa) {
    return isa >= 0 && isa < COLI_FFN_N_ISA ? ISA_NAMES[isa] : NULL;
}

int coli_ffn_isa_supported(int isa) {
    switch (isa) {
    case COLI_FFN_ISA_SCALAR: return 1;
#if defined(__x86_64__) || defined(__i386__)
    case COLI_FFN_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    case COLI_FFN_ISA_AVX512:
        return coli_ffn_isa_supported(COLI_FFN_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#endif
#if defined(__aarch64__)
    case COLI_FFN_ISA_NEON: return 1;
#endif
    default: return 0;
    }
}

/* The process default, resolved once and read-only after. */
static struct {
    int isa;                    /* >= 0, or a COLI_E* code */
    char message[192];
} isa_default;
static pthread_once_t isa_once = PTHREAD_ONCE_INIT;

static void resolve_isa_default(void) {
    const char *forced = getenv("COLIBRI_KERNEL_ISA");
    if (forced && *forced && strcmp(forced, "auto") != 0) {
        for (int isa = 0; isa < COLI_FFN_N_ISA; isa++) {
            if (strcmp(forced, ISA_NAMES[isa]) != 0) continue;
            if (coli_ffn_isa_supported(isa)) {
                isa_default.isa = isa;
            } else {
                isa_default.isa = COLI_EINVAL;
                snprintf(isa_default.message, sizeof isa_default.message,
                         "COLIBRI_KERNEL_ISA=%s: this CPU or build cannot run the %s path",
                         forced, forced);
            }
            return;
        }
        isa_default.isa = COLI_EINVAL;
        snprintf(isa_default.message, sizeof isa_default.message,
                 "COLIBRI_KERNEL_ISA=%.40s: not a path (scalar, avx2, avx512, neon or auto)",
                 forced);
        return;
    }
    static const int best_first[] = {COLI_FFN_ISA_AVX512, COLI_FFN_ISA_AVX2, COLI_FFN_ISA_NEON};
    isa_default.isa = COLI_FFN_ISA_SCALAR;
    for (size_t i = 0; i < sizeof best_first / sizeof best_first[0]; i++)
        if (coli_ffn_isa_supported(best_first[i])) {
            isa_default.isa = best_first[i];
            break;
        }
}

int coli_ffn_isa_default(char *err, size_t err_len) {
    pthread_once(&isa_once, resolve_isa_default);
    if (isa_default.isa < 0) return coli_fail(err, err_len, isa_default.isa, "%s", isa_default.message);
    return isa_default.isa;
}

static const ColiFfnIsaOps *ops_for(int isa) {
    switch (isa) {
#if defined(__x86_64__) || defined(__i386__)
    case COLI_FFN_ISA_AVX2: return &coli_ffn_ops_avx2;
    case COLI_FFN_ISA_AVX512: return &coli_ffn_ops_avx512;
#endif
#if defined(__aarch64__)
    case COLI_FFN_ISA_NEON: return &coli_ffn_ops_neon;
#endif
    default: return &coli_ffn_ops_scalar;
    }
}

/* A path's own kernel for the format, else the scalar decoder (run with
 * the path's micro-kernels); NULL when no kernel computes it. */
static const ColiFfnKernel *kernel_for(int isa, ColiTensorFormat format, int in_out) {
    const ColiFfnKernel *k = NULL;
#if defined(__x86_64__) || defined(__i386__)
    if (isa == COLI_FFN_ISA_AVX512) k = coli_ffn_kernel_avx512(format, in_out);
    if (isa == COLI_FFN_ISA_AVX2) k = coli_ffn_kernel_avx2(format, in_out);
#endif
    (void)isa;
    return k ? k : coli_ffn_kernel_scalar(format, in_out);
}

const char *coli_ffn_kernel_name(int isa, int format, int in_out) {
    if (isa < 0 || isa >= COLI_FFN_N_ISA) return NULL;
    const ColiFfnKernel *k = kernel_for(isa, (ColiTensorFormat)format, in_out != 0);
    return k ? k->name : NULL;
}

/* ------------------------------------------------------------ checks */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round_up(int64_t v, int64_t to) { return ceil_div(v, to) * to; }

static int scale_size(ColiScaleFormat f) {
    switch (f) {
    case COLI_SCALE_F32: return 4;
    case COLI_SCALE_BF16:
    case COLI_SCALE_F16: return 2;
    case COLI_SCALE_UE8M0: return 1;
    default: return 0;
    }
}

static int float_size(ColiTensorFormat f) {
    return f == COLI_TENSOR_F32 ? 4 : f == COLI_TENSOR_F16 || f == COLI_TENSOR_BF16 ? 2 : 0;
}

/* Bytes of the data; 0 when the format cannot hold the shape. */
static uint64_t data_bytes(ColiTensorFormat f, int64_t rows, int64_t cols) {
    uint64_t r = (uint64_t)rows, c = (uint64_t)cols;
    switch (f) {
    case COLI_TENSOR_F32: return r * c * 4;
    case COLI_TENSOR_F16:
    case COLI_TENSOR_BF16: return r * c * 2;
    case COLI_TENSOR_F8_E4M3:
    case COLI_TENSOR_F8_E5M2:
    case COLI_TENSOR_FP8_E4M3_BLOCK: return r * c;
    case COLI_TENSOR_FP4_NATIVE_BLOCK: return c % 32 ? 0 : r * c / 2;
    case COLI_TENSOR_INT4_BLOCK: return c % 8 ? 0 : r * c / 2;
    case COLI_TENSOR_INT4_GPTQ: return r % 8 || c % 8 ? 0 : r * c / 2;
    case COLI_TENSOR_INT4_AWQ: return c % 8 ? 0 : r * c / 2;
    default: return 0;
    }
}

/* The scales, zero points and g_idx of a 4-bit matrix, and its groups. */
static int check_quant(ColiFfnMat *m, const ColiFfnMatrix *src, const char *what, char *err,
                       size_t err_len) {
    const ColiTensorView *v = &src->view;
    int ss = scale_size(v->scale_format);
    if (m->format == COLI_TENSOR_FP4_NATIVE_BLOCK) {
        if (v->scale_format != COLI_SCALE_UE8M0 || v->block_rows != 1 || v->block_columns != 32)
            return coli_fail(err, err_len, COLI_EINVAL,
                             "%s: MXFP4 takes UE8M0 scales in 1 x 32 blocks (got scale format %d, "
                             "%u x %u)", what, (int)v->scale_format, v->block_rows, v->block_columns);
        m->groups = m->n_in / 32;
        m->group = 32;
    } else if (v->scale_format != COLI_SCALE_F32 && v->scale_format != COLI_SCALE_BF16 &&
               v->scale_format != COLI_SCALE_F16) {
        return coli_fail(err, err_len, COLI_EINVAL, "%s: 4-bit scales must be F32, BF16 or F16 "
                         "(scale format %d)", what, (int)v->scale_format);
    } else if (m->format == COLI_TENSOR_INT4_BLOCK) {
        if (v->block_rows != 1 || v->block_columns == 0 || m->n_in % v->block_columns)
            return coli_fail(err, err_len, COLI_EINVAL, "%s: int4 scale blocks %u x %u do not cut "
                             "rows of %lld inputs into groups", what, v->block_rows,
                             v->block_columns, (long long)m->n_in);
        m->group = v->block_columns;
        m->groups = m->n_in / m->group;
        if (src->zeros && src->zero_bytes != (uint64_t)ceil_div(m->n_out, 8) * m->groups * 4)
            return coli_fail(err, err_len, COLI_EINVAL, "%s: %zu bytes of zero points, %lld "
                             "expected (%lld x %lld int32)", what, src->zero_bytes,
                             (long long)(ceil_div(m->n_out, 8) * m->groups * 4),
                             (long long)ceil_div(m->n_out, 8), (long long)m->groups);
    } else {  /* GPTQ, AWQ: groups of input rows */
        if (v->block_columns != 1 || v->block_rows == 0)
            return coli_fail(err, err_len, COLI_EINVAL, "%s: scale blocks %u x %u; GPTQ and AWQ "
                             "take group x 1", what, v->block_rows, v->block_columns);
        m->group = v->block_rows;
        m->groups = ceil_div(m->n_in, m->group);
        if (!src->zeros || src->zero_bytes != (uint64_t)(m->groups * m->n_out / 2))
            return coli_fail(err, err_len, COLI_EINVAL, "%s: %zu bytes of zero points, %lld "
                             "expected (%lld x %lld int32)", what, src->zeros ? src->zero_bytes : 0,
                             (long long)(m->groups * m->n_out / 2), (long long)m->groups,
                             (long long)(m->n_out / 8));
    }
    if (v->scale_bytes != (uint64_t)(m->groups * m->n_out * ss) || !v->scales)
        return coli_fail(err, err_len, COLI_EINVAL, "%s: %zu scale bytes, %lld expected", what,
                         v->scale_bytes, (long long)(m->groups * m->n_out * ss));
    if (src->g_idx) {
        if (m->format != COLI_TENSOR_INT4_GPTQ || src->g_idx_count != (size_t)m->n_in)
            return coli_fail(err, err_len, COLI_EINVAL, "%s: a g_idx needs GPTQ and one group per "
                             "input (%zu for %lld inputs)", what, src->g_idx_count,
                             (long long)m->n_in);
        int sorted = 1;
        for (int64_t k = 0; k < m->n_in; k++) {
            int64_t g = coli_ffn_group_of(m, k);
            if (g < 0 || g >= m->groups)
                return coli_fail(err, err_len, COLI_EINVAL, "%s: g_idx[%lld] = %lld, but there "
                                 "are %lld groups", what, (long long)k, (long long)g,
                                 (long long)m->groups);
            sorted &= g == k / m->group;
        }
        /* A g_idx that says what input / group says (no act order) is
         * dropped: kernels then know groups are runs of inputs. */
        if (sorted) m->g_idx = NULL;
    }
    return COLI_OK;
}

static int describe(ColiFfnMat *m, const ColiFfnMatrix *src, const char *what, char *err,
                    size_t err_len) {
    const ColiTensorView *v = &src->view;
    memset(m, 0, sizeof *m);
    if (src->flags & ~(uint32_t)(COLI_FFN_IN_OUT | COLI_FFN_ZERO_PLUS_ONE))
        return coli_fail(err, err_len, COLI_EINVAL, "%s: unknown flags 0x%x", what,
                         (unsigned)src->flags);
    m->format = v->format;
    m->scale_format = v->scale_format;
    m->in_out = (src->flags & COLI_FFN_IN_OUT) != 0;
    m->zero_plus_one = (src->flags & COLI_FFN_ZERO_PLUS_ONE) != 0;
    m->rows = v->rows;
    m->cols = v->columns;
    m->n_out = m->in_out ? v->columns : v->rows;
    m->n_in = m->in_out ? v->rows : v->columns;
    m->data = v->data;
    m->scales = v->scales;
    m->zeros = src->zeros;
    m->g_idx = src->g_idx;
    m->block_rows = v->block_rows;
    m->block_columns = v->block_columns;
    if (!v->data || v->rows <= 0 || v->columns <= 0 || v->rows > (1 << 30) || v->columns > (1 << 30))
        return coli_fail(err, err_len, COLI_EINVAL, "%s: no data, or shape %lld x %lld", what,
                         (long long)v->rows, (long long)v->columns);
    if (!coli_ffn_kernel_scalar(v->format, m->in_out))
        return coli_fail(err, err_len, COLI_EINVAL, "%s: format %d stored %s is not computed",
                         what, (int)v->format, m->in_out ? "(in, out)" : "(out, in)");
    uint64_t want = data_bytes(v->format, v->rows, v->columns);
    if (!want || v->data_bytes != want)
        return coli_fail(err, err_len, COLI_EINVAL, "%s: %zu data bytes do not hold format %d "
                         "of shape %lld x %lld (%llu expected)", what, v->data_bytes,
                         (int)v->format, (long long)v->rows, (long long)v->columns,
                         (unsigned long long)want);
    if (m->zero_plus_one && v->format != COLI_TENSOR_INT4_GPTQ)
        return coli_fail(err, err_len, COLI_EINVAL, "%s: COLI_FFN_ZERO_PLUS_ONE is GPTQ's", what);
    if (src->zeros && v->format != COLI_TENSOR_INT4_BLOCK && v->format != COLI_TENSOR_INT4_GPTQ &&
        v->format != COLI_TENSOR_INT4_AWQ)
        return coli_fail(err, err_len, COLI_EINVAL, "%s: format %d has no zero points", what,
                         (int)v->format);
    if (src->bias) {
        int bs = float_size(src->bias_format);
        if (!bs || src->bias_bytes != (size_t)(m->n_out * bs))
            return coli_fail(err, err_len, COLI_EINVAL, "%s: bias of format %d and %zu bytes; "
                             "%lld F32, F16 or BF16 values expected", what, (int)src->bias_format,
                             src->bias_bytes, (long long)m->n_out);
    }
    switch (v->format) {
    case COLI_TENSOR_FP8_E4M3_BLOCK: {
        if (v->scale_format != COLI_SCALE_F32 || !v->block_rows || !v->block_columns || !v->scales)
            return coli_fail(err, err_len, COLI_EINVAL, "%s: FP8 blocks take F32 scales and a "
                             "block shape", what);
        uint64_t ws = (uint64_t)(ceil_div(v->rows, v->block_rows) *
                                 ceil_div(v->columns, v->block_columns) * 4);
        if (v->scale_bytes != ws)
            return coli_fail(err, err_len, COLI_EINVAL, "%s: %zu scale bytes, %llu expected for "
                             "%u x %u blocks", what, v->scale_bytes, (unsigned long long)ws,
                             v->block_rows, v->block_columns);
        return COLI_OK;
    }
    case COLI_TENSOR_FP4_NATIVE_BLOCK:
    case COLI_TENSOR_INT4_BLOCK:
    case COLI_TENSOR_INT4_GPTQ:
    case COLI_TENSOR_INT4_AWQ: return check_quant(m, src, what, err, err_len);
    default:
        if (v->scale_format != COLI_SCALE_NONE)
            return coli_fail(err, err_len, COLI_EINVAL, "%s: format %d takes no scales", what,
                             (int)v->format);
        return COLI_OK;
    }
}

static int check_call(const ColiFfnExpert *e, const ColiFfnCall *c, const ColiFfnMat *gate,
                      const ColiFfnMat *down, char *err, size_t err_len) {
    if (e->activation != COLI_FFN_ACT_SILU && e->activation != COLI_FFN_ACT_GPT_OSS)
        return coli_fail(err, err_len, COLI_EINVAL, "activation %d is not one of COLI_FFN_ACT_*",
                         e->activation);
    int64_t inter = e->fused ? gate->n_out / 2 : gate->n_out;
    if (e->fused && gate->n_out % 2)
        return coli_fail(err, err_len, COLI_EINVAL, "fused gate_up has %lld outputs, not 2 x "
                         "intermediate", (long long)gate->n_out);
    if (down->n_out != gate->n_in || down->n_in != inter)
        return coli_fail(err, err_len, COLI_EINVAL, "down is %lld x %lld (outputs x inputs); the "
                         "gate's hidden %lld and intermediate %lld need %lld x %lld",
                         (long long)down->n_out, (long long)down->n_in, (long long)gate->n_in,
                         (long long)inter, (long long)gate->n_in, (long long)inter);
    if (c->tokens < 1 || !c->x || !c->out)
        return coli_fail(err, err_len, COLI_EINVAL, "call: %lld tokens, x %p, out %p",
                         (long long)c->tokens, c->x, c->out);
    if ((c->x_format != COLI_TENSOR_F32 && c->x_format != COLI_TENSOR_BF16) ||
        (c->out_format != COLI_TENSOR_F32 && c->out_format != COLI_TENSOR_BF16))
        return coli_fail(err, err_len, COLI_EINVAL, "x and out must be F32 or BF16 (formats %d "
                         "and %d)", (int)c->x_format, (int)c->out_format);
    if (c->x_stride < gate->n_in || c->out_stride < gate->n_in)
        return coli_fail(err, err_len, COLI_EINVAL, "row strides %lld (x) and %lld (out) are "
                         "shorter than hidden %lld", (long long)c->x_stride,
                         (long long)c->out_stride, (long long)gate->n_in);
    return COLI_OK;
}

/* ------------------------------------------------------------ one call */

/* One matrix of a phase: its kernel, where its outputs go. */
typedef struct {
    const ColiFfnMat *m;
    const ColiFfnKernel *k;
    const float *bias;          /* float, or NULL */
    int64_t panels;
    float *dst;                 /* F32 destination, or NULL */
    uint16_t *dst_bf16;         /* BF16 destination, or NULL */
    int64_t dst_stride;
    int64_t dst_offset;         /* column of output 0 */
} MatJob;

typedef struct {
    const ColiFfnExpert *e;
    const ColiFfnCall *c;
    const ColiFfnIsaOps *ops;
    ColiComputePool *pool;
    MatJob first[2];            /* gate, up (n_first 1 when fused) */
    int n_first;
    MatJob down;
    int64_t hidden, inter;
    int64_t t0, tokens;         /* this batch */
    float *x;                   /* tokens x ldx, in the gate kernel's input order */
    int64_t ldx;
    float *gu;                  /* tokens x 2 inter: gate then up (or the fused order) */
    float *h;                   /* tokens x ldh, in the down kernel's input order */
    int64_t ldh;
    uint8_t *scratch;           /* per thread */
    size_t scratch_bytes;
    int64_t tile_floats, acc_floats, aux_floats;
} Run;

static int64_t kpos_of(const ColiFfnKernel *k, int64_t j) {
    if (k->layout != COLI_FFN_DOT || !k->kpos) return j;
    return (j & ~(int64_t)(COLI_FFN_KBLOCK - 1)) + k->kpos[j % COLI_FFN_KBLOCK];
}

static void split(int64_t n, int thread, int threads, int64_t *lo, int64_t *hi) {
    *lo = n * thread / threads;
    *hi = n * (thread + 1) / threads;
}

/* The sum of a DOT accumulator's lanes, as a tree: independent adds, not
 * a chain of sixteen (which costs more than the whole row at T = 1). */
static float lane_sum(const float *a) {
    float s[COLI_FFN_DOT_LANES / 2];
    for (int l = 0; l < COLI_FFN_DOT_LANES / 2; l++) s[l] = a[l] + a[l + COLI_FFN_DOT_LANES / 2];
    for (int l = 0; l < COLI_FFN_DOT_LANES / 4; l++) s[l] += s[l + COLI_FFN_DOT_LANES / 4];
    return (s[0] + s[2]) + (s[1] + s[3]);
}

static void finish_panel(const Run *run, const MatJob *j, int64_t n0, int nr, const float *acc) {
    const ColiFfnKernel *k = j->k;
    int panel = k->panel;
    for (int64_t t = 0; t < run->tokens; t++) {
        int64_t row = t * j->dst_stride + j->dst_offset + n0;
        for (int r = 0; r < nr; r++) {
            float v;
            if (k->layout == COLI_FFN_DOT) {
                v = lane_sum(acc + (t * COLI_FFN_DOT_ROWS + r) * COLI_FFN_DOT_LANES);
            } else {
                v = acc[t * panel + (k->colpos ? k->colpos[r] : r)];
            }
            if (j->bias) v += j->bias[n0 + r];
            if (j->dst_bf16) j->dst_bf16[row + r] = coli_f32_to_bf16(v);
            else j->dst[row + r] = v;
        }
    }
}

static void run_panels(const Run *run, const MatJob *j, int64_t p0, int64_t p1, const float *x,
                       int64_t ldx, uint8_t *scratch) {
    const ColiFfnMat *m = j->m;
    const ColiFfnKernel *k = j->k;
    float *tile = (float *)scratch;
    float *acc = tile + run->tile_floats;
    float *aux = k->prepare ? acc + run->acc_floats : NULL;
    int tokens = (int)run->tokens;
    int64_t acc_n = run->tokens * (k->layout == COLI_FFN_DOT
                                       ? COLI_FFN_DOT_ROWS * COLI_FFN_DOT_LANES : k->panel);
    for (int64_t p = p0; p < p1; p++) {
        int64_t n0 = p * k->panel;
        int nr = (int)(m->n_out - n0 < k->panel ? m->n_out - n0 : k->panel);
        if (k->prepare) k->prepare(m, k, n0, nr, aux);
        memset(acc, 0, sizeof(float) * (size_t)acc_n);
        if (k->layout == COLI_FFN_DOT && nr < COLI_FFN_DOT_ROWS)
            memset(tile + (int64_t)nr * k->kc, 0,
                   sizeof(float) * (size_t)((COLI_FFN_DOT_ROWS - nr) * k->kc));
        /* A fused kernel takes whole rows at once (one stream per row for
         * the prefetchers), or declines and the tile path runs. */
        int fused = k->fused && tokens <= COLI_FFN_FUSED_TOKENS &&
                    k->fused(m, k, n0, nr, 0, (int)m->n_in, x, ldx, tokens, acc, aux);
        for (int64_t k0 = 0; !fused && k0 < m->n_in; k0 += k->kc) {
            int kc = (int)(m->n_in - k0 < k->kc ? m->n_in - k0 : k->kc);
            k->decode(m, k, n0, nr, k0, kc, tile, aux);
            if (k->layout == COLI_FFN_DOT)
                run->ops->dot(tile, k->kc, (int)round_up(kc, COLI_FFN_KBLOCK), x + k0, ldx,
                              tokens, acc);
            else
                run->ops->axpy(tile, k->panel, kc, k->panel, x + k0, ldx, tokens, acc);
        }
        finish_panel(run, j, n0, nr, acc);
    }
}

/* Phase 0: this thread's tokens as float, in the first kernel's order. */
static void load_inputs(const Run *run, int thread, int threads) {
    int64_t lo, hi;
    split(run->tokens, thread, threads, &lo, &hi);
    const ColiFfnKernel *k = run->first[0].k;
    for (int64_t t = lo; t < hi; t++) {
        float *dst = run->x + t * run->ldx;
        int64_t src_row = (run->t0 + t) * run->c->x_stride;
        if (run->c->x_format == COLI_TENSOR_F32) {
            const float *src = (const float *)run->c->x + src_row;
            for (int64_t i = 0; i < run->hidden; i++) dst[kpos_of(k, i)] = src[i];
        } else {
            const uint16_t *src = (const uint16_t *)run->c->x + src_row;
            for (int64_t i = 0; i < run->hidden; i++) dst[kpos_of(k, i)] = coli_bf16_to_f32(src[i]);
        }
    }
}

/* Phase 2: the activation of this thread's intermediate units. */
static void activate(const Run *run, uint8_t *scratch, int thread, int threads) {
    int64_t lo, hi;
    split(run->inter, thread, threads, &lo, &hi);
    int64_t n = hi - lo;
    if (n <= 0) return;
    float *g = (float *)scratch, *u = g + n, *h = u + n;
    const ColiFfnKernel *k = run->down.k;
    for (int64_t t = 0; t < run->tokens; t++) {
        const float *row = run->gu + t * 2 * run->inter;
        if (run->e->fused == COLI_FFN_INTERLEAVED) {
            for (int64_t i = 0; i < n; i++) {
                g[i] = row[2 * (lo + i)];
                u[i] = row[2 * (lo + i) + 1];
            }
            run->ops->act(run->e->activation, run->e->alpha, run->e->limit, g, u, h, n);
        } else {
            run->ops->act(run->e->activation, run->e->alpha, run->e->limit, row + lo,
                          row + run->inter + lo, h, n);
        }
        float *dst = run->h + t * run->ldh;
        for (int64_t i = 0; i < n; i++) dst[kpos_of(k, lo + i)] = h[i];
    }
}

static void run_thread(void *ctx, int thread, int threads) {
    const Run *run = ctx;
    uint8_t *scratch = run->scratch + (size_t)thread * run->scratch_bytes;
    load_inputs(run, thread, threads);
    coli_compute_pool_barrier(run->pool);
    int64_t total = 0, lo, hi;
    for (int i = 0; i < run->n_first; i++) total += run->first[i].panels;
    split(total, thread, threads, &lo, &hi);
    for (int i = 0, base = 0; i < run->n_first; base += (int)run->first[i].panels, i++) {
        int64_t a = lo > base ? lo - base : 0;
        int64_t b = hi - base < run->first[i].panels ? hi - base : run->first[i].panels;
        if (a < b) run_panels(run, &run->first[i], a, b, run->x, run->ldx, scratch);
    }
    coli_compute_pool_barrier(run->pool);
    activate(run, scratch, thread, threads);
    coli_compute_pool_barrier(run->pool);
    split(run->down.panels, thread, threads, &lo, &hi);
    run_panels(run, &run->down, lo, hi, run->h, run->ldh, scratch);
}

/* The biases as float (NULL where none), in one allocation. */
static float *float_biases(const ColiFfnMatrix *const src[3], const ColiFfnMat *const m[3],
                           float *out[3]) {
    int64_t n = 0;
    for (int i = 0; i < 3; i++) n += src[i] && src[i]->bias ? m[i]->n_out : 0;
    float *all = n ? malloc(sizeof(float) * (size_t)n) : NULL;
    float *p = all;
    for (int i = 0; i < 3; i++) {
        out[i] = NULL;
        if (!all || !src[i] || !src[i]->bias) continue;
        out[i] = p;
        for (int64_t j = 0; j < m[i]->n_out; j++, p++) {
            if (src[i]->bias_format == COLI_TENSOR_F32) {
                memcpy(p, (const float *)src[i]->bias + j, sizeof *p);
            } else {
                uint16_t v;
                memcpy(&v, (const uint16_t *)src[i]->bias + j, sizeof v);
                *p = src[i]->bias_format == COLI_TENSOR_BF16 ? coli_bf16_to_f32(v)
                                                              : coli_f16_to_f32(v);
            }
        }
    }
    return all;
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Tokens per batch: as many as keep the batch's float buffers near 64 MiB,
 * at least 64. */
static int64_t batch_tokens(int64_t tokens, int64_t per_token_floats) {
    int64_t cap = max64(64, ((int64_t)16 << 20) / max64(1, per_token_floats));
    return tokens < cap ? tokens : cap;
}

int coli_expert_ffn(const ColiFfnExpert *e, const ColiFfnCall *c, ColiComputePool *pool,
                    char *err, size_t err_len) {
    if (!e || !c) return coli_fail(err, err_len, COLI_EINVAL, "expert ffn: NULL expert or call");
    int isa = c->isa;
    if (isa == COLI_FFN_ISA_AUTO) {
        isa = coli_ffn_isa_default(err, err_len);
        if (isa < 0) return isa;
    } else if (!coli_ffn_isa_supported(isa)) {
        return coli_fail(err, err_len, COLI_EINVAL, "kernel path %d (%s) is not one this CPU and "
                         "build can run", isa, coli_ffn_isa_name(isa) ? coli_ffn_isa_name(isa) : "?");
    }
    if (e->fused != COLI_FFN_SEPARATE && e->fused != COLI_FFN_CONCATENATED &&
        e->fused != COLI_FFN_INTERLEAVED)
        return coli_fail(err, err_len, COLI_EINVAL, "fused %d is not one of COLI_FFN_*", e->fused);
    ColiFfnMat mats[3];
    static const char *const names[3] = {"gate", "up", "down"};
    for (int i = 0; i < 3; i++) {
        if (i == 1 && e->fused) continue;
        int rc = describe(&mats[i], i == 0 ? &e->gate : i == 1 ? &e->up : &e->down,
                          i == 0 && e->fused ? "gate_up" : names[i], err, err_len);
        if (rc) return rc;
    }
    if (!e->fused && (mats[1].n_out != mats[0].n_out || mats[1].n_in != mats[0].n_in))
        return coli_fail(err, err_len, COLI_EINVAL, "up is %lld x %lld but gate %lld x %lld "
                         "(outputs x inputs)", (long long)mats[1].n_out, (long long)mats[1].n_in,
                         (long long)mats[0].n_out, (long long)mats[0].n_in);
    int rc = check_call(e, c, &mats[0], &mats[2], err, err_len);
    if (rc) return rc;

    Run run;
    memset(&run, 0, sizeof run);
    run.e = e;
    run.c = c;
    run.ops = ops_for(isa);
    run.pool = pool;
    run.hidden = mats[0].n_in;
    run.inter = e->fused ? mats[0].n_out / 2 : mats[0].n_out;
    run.n_first = e->fused ? 1 : 2;
    const ColiFfnMatrix *srcs[3] = {&e->gate, e->fused ? NULL : &e->up, &e->down};
    const ColiFfnMat *mp[3] = {&mats[0], e->fused ? NULL : &mats[1], &mats[2]};
    float *bias[3];
    float *bias_block = float_biases(srcs, mp, bias);
    int64_t aux = 0;
    for (int i = 0; i < 3; i++) {
        if (!mp[i]) continue;
        MatJob *j = i == 2 ? &run.down : &run.first[i];
        j->m = mp[i];
        j->k = kernel_for(isa, mp[i]->format, mp[i]->in_out);
        j->bias = bias[i];
        j->panels = ceil_div(mp[i]->n_out, j->k->panel);
        if (j->k->aux_floats) aux = max64(aux, j->k->aux_floats(mp[i], j->k));
    }
    if ((e->gate.bias || (!e->fused && e->up.bias) || e->down.bias) && !bias_block)
        return coli_fail(err, err_len, COLI_ENOMEM, "expert ffn: out of memory for the biases");
    int threads = coli_compute_pool_threads(pool);
    run.ldx = round_up(run.hidden, COLI_FFN_KBLOCK) + COLI_FFN_KBLOCK;
    run.ldh = round_up(run.inter, COLI_FFN_KBLOCK) + COLI_FFN_KBLOCK;
    int64_t per_token = run.ldx + run.ldh + 2 * run.inter;
    int64_t batch = batch_tokens(c->tokens, per_token);
    run.tile_floats = max64(COLI_FFN_DOT_ROWS * COLI_FFN_DOT_KC, COLI_FFN_AXPY_KC * COLI_FFN_MAX_PANEL);
    run.acc_floats = batch * max64(COLI_FFN_DOT_ROWS * COLI_FFN_DOT_LANES, COLI_FFN_MAX_PANEL);
    run.aux_floats = aux;
    int64_t act_floats = 3 * (run.inter / threads + 1);
    int64_t thread_floats = round_up(max64(run.tile_floats + run.acc_floats + aux, act_floats), 16);
    run.scratch_bytes = sizeof(float) * (size_t)thread_floats;
    size_t shared = sizeof(float) * (size_t)(batch * per_token);
    void *block = NULL;
    if (posix_memalign(&block, 64, shared + run.scratch_bytes * (size_t)threads)) {
        free(bias_block);
        return coli_fail(err, err_len, COLI_ENOMEM, "expert ffn: out of memory for %lld tokens "
                         "(%zu bytes of buffers)", (long long)batch,
                         shared + run.scratch_bytes * (size_t)threads);
    }
    run.x = block;
    run.h = run.x + batch * run.ldx;
    run.gu = run.h + batch * run.ldh;
    run.scratch = (uint8_t *)(run.gu + batch * 2 * run.inter);
    /* Padding positions of x and h stay zero: they meet zero weights. */
    memset(run.x, 0, sizeof(float) * (size_t)(batch * (run.ldx + run.ldh)));
    for (int i = 0; i < run.n_first; i++) {
        run.first[i].dst = run.gu;
        run.first[i].dst_stride = 2 * run.inter;
        run.first[i].dst_offset = i * run.inter;
    }
    for (run.t0 = 0; run.t0 < c->tokens; run.t0 += batch) {
        run.tokens = c->tokens - run.t0 < batch ? c->tokens - run.t0 : batch;
        run.down.dst_stride = c->out_stride;
        if (c->out_format == COLI_TENSOR_F32)
            run.down.dst = (float *)c->out + run.t0 * c->out_stride;
        else
            run.down.dst_bf16 = (uint16_t *)c->out + run.t0 * c->out_stride;
        coli_compute_pool_run(pool, run_thread, &run);
    }
    free(block);
    free(bias_block);
    return COLI_OK;
}
