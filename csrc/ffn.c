/*
 * ffn.c: the expert FFN driver: checks a call, chooses each matrix's kernel
 * for the path, and runs the phases on the compute pool:
 *
 *   0. the tokens' inputs the way the gate (and up) kernel wants them
 *      (float32 or bfloat16, in its order, with per-group sums);
 *   1. gate and up (or gate_up) outputs, split over the threads, into a
 *      float buffer of both halves (plus their biases);
 *   2. the activation, split over the intermediate units, written in the
 *      down kernel's input order;
 *   3. down outputs, split over the threads, into the output (bias added,
 *      rounded to bfloat16 when the output is).
 *
 * coli_linear runs phase 0 and the first phase's kernels alone, for one
 * matrix whose sums (plus bias) are the output.
 *
 * Buffers scale with the tokens of a batch; a call with more tokens than
 * one batch holds runs batch after batch (each re-reading the weights,
 * which at that size costs little next to the products). A token's result
 * does not depend on the batch: see ffn_internal.h.
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

/* A path's own kernel for the matrix, else the scalar one (NULL when none
 * computes it). input: what it multiplies (COLI_FFN_INPUT_*). */
static const ColiFfnKernel *kernel_for(int isa, const ColiFfnMat *m, int input) {
    const ColiFfnKernel *k = NULL;
#if defined(__x86_64__) || defined(__i386__)
    if (isa == COLI_FFN_ISA_AVX512) k = coli_ffn_kernel_avx512(m, input);
    if (isa == COLI_FFN_ISA_AVX2) k = coli_ffn_kernel_avx2(m);
#endif
#if defined(__aarch64__)
    if (isa == COLI_FFN_ISA_NEON) k = coli_ffn_kernel_neon(m);
#endif
    (void)isa, (void)input;
    return k ? k : coli_ffn_kernel_scalar(m);
}

static const ColiFfnConv *conv_for(int isa) {
#if defined(__x86_64__) || defined(__i386__)
    if (isa == COLI_FFN_ISA_AVX512) return &coli_ffn_conv_avx512;
#endif
    (void)isa;
    return NULL;
}

static ColiFfnActFn act_for(int isa) {
#if defined(__x86_64__) || defined(__i386__)
    if (isa == COLI_FFN_ISA_AVX512) return coli_ffn_act_avx512;
    if (isa == COLI_FFN_ISA_AVX2) return coli_ffn_act_avx2;
#endif
#if defined(__aarch64__)
    if (isa == COLI_FFN_ISA_NEON) return coli_ffn_act_neon;
#endif
    (void)isa;
    return coli_ffn_act_scalar;
}

#if !(defined(__x86_64__) || defined(__i386__))
int coli_ffn_amx_usable(void) { return 0; }
#endif

const char *coli_ffn_kernel_name(int isa, int format, int in_out) {
    if (isa < 0 || isa >= COLI_FFN_N_ISA) return NULL;
    ColiFfnMat m;  /* a typical matrix of the format: groups of 128 inputs */
    memset(&m, 0, sizeof m);
    m.format = (ColiTensorFormat)format;
    m.in_out = in_out != 0;
    m.n_out = m.n_in = 1024;
    m.group = m.block_columns = m.block_rows = 128;
    m.groups = 8;
    const ColiFfnKernel *k = kernel_for(isa, &m, COLI_FFN_INPUT_F32);
    return k ? k->name : NULL;
}

/* ------------------------------------------------------------ checks */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

/* Four int32 a vector (SSE2, NEON), for g_idx_check. */
typedef int32_t ColiI32x4 __attribute__((vector_size(16)));
typedef uint32_t ColiU32x4 __attribute__((vector_size(16)));

/* Every call reads a g_idx, cold like the weights: a line ahead of where
 * entry k is read (k a multiple of 16 starts a line), G_IDX_AHEAD lines
 * in all, the first of them at the start. Always inlined: GCC finds a
 * function that only prefetches pure and may drop its calls. */
enum { G_IDX_AHEAD = 16 };

static inline __attribute__((always_inline)) void g_idx_prefetch_start(const ColiFfnMat *m) {
    for (int64_t l = 0; l < ceil_div(4 * m->n_in, 64) && l < G_IDX_AHEAD; l++)
        __builtin_prefetch(m->g_idx + 64 * l);
}

static inline __attribute__((always_inline)) void g_idx_prefetch_at(const ColiFfnMat *m, int64_t k) {
    if (k % 16 == 0 && k / 16 + G_IDX_AHEAD < ceil_div(4 * m->n_in, 64))
        __builtin_prefetch(m->g_idx + 64 * (k / 16 + G_IDX_AHEAD));
}

/* m's g_idx (every call reads it, cold in memory like the weights): -1
 * if an entry names no group, else whether every input k is in group k /
 * group. Read ahead a line at a time (a hardware prefetcher may not
 * follow: g_idx_prefetch_at) and four entries a step, with no branch. */
static int g_idx_check(const ColiFfnMat *m) {
    g_idx_prefetch_start(m);
    const ColiU32x4 groups = {(uint32_t)m->groups, (uint32_t)m->groups, (uint32_t)m->groups,
                              (uint32_t)m->groups};
    ColiI32x4 bad = {0, 0, 0, 0}, unsorted = {0, 0, 0, 0};
    for (int64_t g = 0; g < m->groups; g++) {
        const int64_t k1 = (g + 1) * m->group < m->n_in ? (g + 1) * m->group : m->n_in;
        const ColiI32x4 want = {(int32_t)g, (int32_t)g, (int32_t)g, (int32_t)g};
        int64_t k = g * m->group;
        for (; k + 4 <= k1; k += 4) {
            g_idx_prefetch_at(m, k);
            ColiI32x4 v;
            memcpy(&v, m->g_idx + 4 * k, sizeof v);
            bad |= (ColiI32x4)((ColiU32x4)v >= groups);
            unsorted |= v ^ want;
        }
        for (; k < k1; k++) {
            int32_t v;
            memcpy(&v, m->g_idx + 4 * k, sizeof v);
            bad[0] |= (uint32_t)v >= (uint32_t)m->groups;
            unsorted[0] |= v ^ (int32_t)g;
        }
    }
    if (bad[0] | bad[1] | bad[2] | bad[3]) return -1;
    return !(unsorted[0] | unsorted[1] | unsorted[2] | unsorted[3]);
}

/* A store's group order, checked when it was made: only that each entry is
 * in range, four at a time, as g_idx_check reads. Nonzero when one is not. */
static int group_order_out_of_range(const ColiFfnMat *m) {
    g_idx_prefetch_start(m);
    const ColiU32x4 n = {(uint32_t)m->n_in, (uint32_t)m->n_in, (uint32_t)m->n_in,
                         (uint32_t)m->n_in};
    ColiI32x4 bad = {0, 0, 0, 0};
    int64_t k = 0;
    for (; k + 4 <= m->n_in; k += 4) {
        g_idx_prefetch_at(m, k);
        ColiI32x4 v;
        memcpy(&v, m->g_idx + 4 * k, sizeof v);
        bad |= (ColiI32x4)((ColiU32x4)(-1 - v) >= n);
    }
    for (; k < m->n_in; k++) {
        int32_t v;
        memcpy(&v, m->g_idx + 4 * k, sizeof v);
        bad[0] |= (uint32_t)(-1 - (int64_t)v) >= (uint64_t)m->n_in;
    }
    return (bad[0] | bad[1] | bad[2] | bad[3]) != 0;
}

int64_t coli_ffn_group_order_fault(const unsigned char *g_idx, int64_t rows, uint8_t *seen) {
    memset(seen, 0, (size_t)rows);
    for (int64_t j = 0; j < rows; j++) {
        int32_t v;
        memcpy(&v, g_idx + 4 * j, sizeof v);
        int64_t in = -1 - (int64_t)v;
        if (in < 0 || in >= rows || seen[in]) return j;
        seen[in] = 1;
    }
    return -1;
}

/* A g_idx in group order: each entry -1 - an input, each input once
 * (COLI_FFN_ORDER_CHECKED: the store checked that; only the range here).
 * It becomes m's order; the kernels then see input / group. */
enum { ORDER_SEEN = 16384 };  /* inputs checked with a buffer on the stack */

static int check_group_order(ColiFfnMat *m, int checked, const char *what, char *err,
                             size_t err_len) {
    if (!checked || group_order_out_of_range(m)) {
        uint8_t local[ORDER_SEEN];
        uint8_t *seen = m->n_in <= ORDER_SEEN ? local : malloc((size_t)m->n_in);
        if (!seen)
            return coli_fail(err, err_len, COLI_ENOMEM, "%s: out of memory checking a g_idx in "
                             "group order", what);
        int64_t k = coli_ffn_group_order_fault(m->g_idx, m->n_in, seen);
        if (seen != local) free(seen);
        if (k >= 0) {
            int32_t v;
            memcpy(&v, m->g_idx + 4 * k, sizeof v);
            return coli_fail(err, err_len, COLI_EINVAL, "%s: g_idx[%lld] = %lld; a g_idx in "
                             "group order (negative) holds -1 - each of the %lld inputs once",
                             what, (long long)k, (long long)v, (long long)m->n_in);
        }
    }
    m->order = m->g_idx;
    m->g_idx = NULL;
    return COLI_OK;
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
        int32_t first;
        memcpy(&first, m->g_idx, sizeof first);
        if (first < 0)
            return check_group_order(m, (src->flags & COLI_FFN_ORDER_CHECKED) != 0, what, err,
                                     err_len);
        int sorted = g_idx_check(m);
        if (sorted < 0) {
            for (int64_t k = 0; k < m->n_in; k++) {
                int64_t g = coli_ffn_group_of(m, k);
                if (g < 0 || g >= m->groups)
                    return coli_fail(err, err_len, COLI_EINVAL, "%s: g_idx[%lld] = %lld, but "
                                     "there are %lld groups", what, (long long)k, (long long)g,
                                     (long long)m->groups);
            }
        }
        /* A g_idx that says what input / group says (no act order) is
         * dropped: kernels then know groups are runs of inputs. */
        if (sorted == 1) m->g_idx = NULL;
    }
    return COLI_OK;
}

static int describe(ColiFfnMat *m, const ColiFfnMatrix *src, const char *what, char *err,
                    size_t err_len) {
    const ColiTensorView *v = &src->view;
    memset(m, 0, sizeof *m);
    if (src->flags & ~(uint32_t)(COLI_FFN_IN_OUT | COLI_FFN_ZERO_PLUS_ONE | COLI_FFN_ORDER_CHECKED))
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
    if (!coli_ffn_format_computed(v->format, m->in_out))
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

/* The call's tokens and operands: rows of n_in values in, n_out out. */
static int check_io(const ColiFfnCall *c, int64_t n_in, int64_t n_out, char *err, size_t err_len) {
    if (c->tokens < 1 || !c->x || !c->out)
        return coli_fail(err, err_len, COLI_EINVAL, "call: %lld tokens, x %p, out %p",
                         (long long)c->tokens, c->x, c->out);
    if ((c->x_format != COLI_TENSOR_F32 && c->x_format != COLI_TENSOR_BF16) ||
        (c->out_format != COLI_TENSOR_F32 && c->out_format != COLI_TENSOR_BF16))
        return coli_fail(err, err_len, COLI_EINVAL, "x and out must be F32 or BF16 (formats %d "
                         "and %d)", (int)c->x_format, (int)c->out_format);
    if (c->x_stride < n_in || c->out_stride < n_out)
        return coli_fail(err, err_len, COLI_EINVAL, "row strides %lld (x) and %lld (out) are "
                         "shorter than the rows, %lld in and %lld out", (long long)c->x_stride,
                         (long long)c->out_stride, (long long)n_in, (long long)n_out);
    return COLI_OK;
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
    return check_io(c, gate->n_in, gate->n_in, err, err_len);
}

/* ------------------------------------------------------------ one call */

/* A matrix of a phase: its kernel, its inputs, where its sums go. */
typedef struct {
    const ColiFfnMat *m;
    const ColiFfnKernel *k;
    const float *bias;          /* float, or NULL */
    int64_t units;              /* of k->unit outputs */
    int input;                  /* which prepared input (gate and up) */
    float *dst;                 /* sums: dst[t * ld_dst + n] */
    int64_t ld_dst;
} MatJob;

/* The tokens' inputs the way a kernel wants them. */
typedef struct {
    const ColiFfnKernel *k;
    const ColiFfnMat *m;
    void *x;                    /* batch rows of ldx elements */
    int64_t ldx;
    float *xs;                  /* per-group sums, batch rows of groups, or NULL */
} Input;

typedef struct {
    const ColiFfnExpert *e;
    const ColiFfnCall *c;
    ColiFfnActFn act;
    const ColiFfnConv *conv;    /* the path's conversions, or NULL */
    ColiComputePool *pool;
    MatJob first[2];            /* gate, up (n_first 1 when fused) */
    int n_first;
    MatJob down;
    Input in[2];                /* gate's and, when it wants them otherwise, up's */
    int n_in;
    Input h;                    /* the activations, down's way (sums per thread) */
    int32_t *h_at;              /* down in group order: the row of each activation; else NULL */
    int64_t hidden, inter;
    int64_t t0, tokens;         /* this batch */
    float *gu;                  /* tokens x 2 inter: gate then up (or the fused order) */
    float *y;                   /* BF16 output: tokens x y_cols sums; NULL: into out */
    int64_t y_cols;             /* outputs of the last matrix (hidden; a linear's n_out) */
    uint8_t *scratch;           /* per thread */
    size_t scratch_bytes, kernel_bytes, temp_bytes;
    int by_units;               /* inputs per thread (a few tokens); an expert's gate and up
                                 * then split by units, one barrier */
    int64_t unit_step;          /* intermediate units per step of that split */
    size_t in_bytes;            /* the inputs' bytes: each thread's copy that far from the last */
} Run;

static int same_order(const ColiFfnMat *ma, const ColiFfnMat *mb) {
    if (!ma->order || !mb->order) return !ma->order && !mb->order;
    return ma->order == mb->order || !memcmp(ma->order, mb->order, 4 * (size_t)ma->n_in);
}

static int same_input(const ColiFfnKernel *a, const ColiFfnMat *ma, const ColiFfnKernel *b,
                      const ColiFfnMat *mb) {
    return a->x_type == b->x_type && a->x_order == b->x_order && a->group_sums == b->group_sums &&
           (!a->group_sums || ma->group == mb->group) && same_order(ma, mb);
}

static void split(int64_t n, int thread, int threads, int64_t *lo, int64_t *hi) {
    *lo = n * thread / threads;
    *hi = n * (thread + 1) / threads;
}

/* Per-group sums of a row of n floats (groups of group). */
static void group_sums(const float *row, int64_t n, int64_t group, float *out) {
    for (int64_t g = 0, k = 0; k < n; g++, k += group)
        out[g] = coli_ffn_group_sum(row + k, n - k < group ? n - k : group);
}

/* Writes inputs [i0, i0 + n) of token t (values v, in order) the way in
 * wants them, one at a time; with at, value i goes to row at[i] (a matrix
 * in group order), else to i0 + i. */
static void put_each(const Input *in, int64_t t, int64_t i0, const float *v, int64_t n,
                     const int32_t *at) {
    int order = in->k->x_order;
    if (in->k->x_type == COLI_FFN_X_F32) {
        float *dst = (float *)in->x + t * in->ldx;
        if (order == COLI_FFN_ORDER_PLAIN && !at) memcpy(dst + i0, v, sizeof(float) * (size_t)n);
        else for (int64_t i = 0; i < n; i++) dst[coli_ffn_pos(order, at ? at[i] : i0 + i)] = v[i];
        return;
    }
    uint16_t *dst = (uint16_t *)in->x + t * in->ldx;
    for (int64_t i = 0; i < n; i++) {
        int64_t p = coli_ffn_pos(order, at ? at[i] : i0 + i);
        uint16_t hi = coli_f32_to_bf16(v[i]);
        dst[p] = hi;
        if (in->k->x_type == COLI_FFN_X_BF16_SPLIT)
            dst[in->ldx / 2 + p] = coli_f32_to_bf16(v[i] - coli_bf16_to_f32(hi));
    }
}

/* put_each, whole blocks through the path's conversion when it has one. */
static void put_values(const Run *run, const Input *in, int64_t t, int64_t i0, const float *v,
                       int64_t n) {
    if (!run->conv || (in->k->x_type == COLI_FFN_X_F32 && in->k->x_order == COLI_FFN_ORDER_PLAIN)) {
        put_each(in, t, i0, v, n, NULL);
        return;
    }
    int64_t a = coli_ffn_round_up(i0, COLI_FFN_PAD), b = (i0 + n) / COLI_FFN_PAD * COLI_FFN_PAD;
    if (a >= b) {
        put_each(in, t, i0, v, n, NULL);
        return;
    }
    put_each(in, t, i0, v, a - i0, NULL);
    void *row = in->k->x_type == COLI_FFN_X_F32 ? (void *)((float *)in->x + t * in->ldx)
                                                : (void *)((uint16_t *)in->x + t * in->ldx);
    run->conv->put(in->k->x_type, in->k->x_order, v + (a - i0), a, (b - a) / COLI_FFN_PAD, row,
                   in->ldx / 2);
    put_each(in, t, b, v + (b - i0), i0 + n - b, NULL);
}

/* Writes one token's float inputs (natural order) the way in wants them;
 * row has room for n more floats, where a matrix in group order gathers
 * them. */
static void put_input(const Run *run, const Input *in, int64_t t, float *row, int64_t n) {
    if (in->m->order) {
        float *moved = row + n;
        for (int64_t k = 0; k < n; k++) {
            int32_t v;
            memcpy(&v, in->m->order + 4 * k, sizeof v);
            moved[k] = row[-1 - v];
        }
        row = moved;
    }
    put_values(run, in, t, 0, row, n);
    if (in->xs) group_sums(row, n, in->m->group, in->xs + t * in->m->groups);
}

/* Phase 0: tokens [lo, hi) into the inputs in (run->n_in of them). */
static void load_inputs(const Run *run, const Input *in, float *row, int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; t++) {
        int64_t src_row = (run->t0 + t) * run->c->x_stride;
        if (run->c->x_format == COLI_TENSOR_F32) {
            memcpy(row, (const float *)run->c->x + src_row, sizeof(float) * (size_t)run->hidden);
        } else {
            const uint16_t *src = (const uint16_t *)run->c->x + src_row;
            if (run->conv) run->conv->from_bf16(src, row, run->hidden);
            else for (int64_t i = 0; i < run->hidden; i++) row[i] = coli_bf16_to_f32(src[i]);
        }
        for (int i = 0; i < run->n_in; i++) put_input(run, &in[i], t, row, run->hidden);
    }
}

/* Phase 2: the activation of intermediate units [lo, hi). */
static void activate(const Run *run, float *tmp, int64_t lo, int64_t hi) {
    int64_t n = hi - lo;
    if (n <= 0) return;
    float *g = tmp, *u = g + n, *h = u + n;
    for (int64_t t = 0; t < run->tokens; t++) {
        const float *row = run->gu + t * 2 * run->inter;
        if (run->e->fused == COLI_FFN_INTERLEAVED) {
            for (int64_t i = 0; i < n; i++) {
                g[i] = row[2 * (lo + i)];
                u[i] = row[2 * (lo + i) + 1];
            }
            run->act(run->e->activation, run->e->alpha, run->e->limit, g, u, h, n);
        } else {
            run->act(run->e->activation, run->e->alpha, run->e->limit, row + lo,
                     row + run->inter + lo, h, n);
        }
        if (run->h_at) put_each(&run->h, t, lo, h, n, run->h_at + lo);
        else put_values(run, &run->h, t, lo, h, n);
    }
}

/* Outputs [n0, n1) of a matrix (n0 a multiple of the kernel's unit): the
 * kernel's sums, then the bias. */
static void run_rows(const Run *run, const MatJob *j, const Input *in, const float *xs, int64_t n0,
                     int64_t n1, uint8_t *scratch) {
    if (n1 > j->m->n_out) n1 = j->m->n_out;
    if (n0 >= n1) return;
    ColiFfnTask task = {in->x, in->ldx, xs, j->m->groups, (int)run->tokens, j->dst, j->ld_dst,
                        scratch};
    j->k->run(j->m, n0, n1, &task);
    if (!j->bias) return;
    for (int64_t t = 0; t < run->tokens; t++)
        for (int64_t n = n0; n < n1; n++) j->dst[t * j->ld_dst + n] += j->bias[n];
}

/* Output units [a, b) of a matrix. */
static void run_units(const Run *run, const MatJob *j, const Input *in, const float *xs,
                      int64_t a, int64_t b, uint8_t *scratch) {
    run_rows(run, j, in, xs, a * j->k->unit, b * j->k->unit, scratch);
}

/* The last matrix's outputs [n0, n1) of the batch from its sums into the
 * call's output. */
static void store_output(const Run *run, int64_t n0, int64_t n1) {
    if (!run->y) return;  /* F32: the sums were the output */
    const ColiFfnCall *c = run->c;
    for (int64_t t = 0; t < run->tokens; t++) {
        uint16_t *dst = (uint16_t *)c->out + (run->t0 + t) * c->out_stride;
        if (run->conv) {
            run->conv->to_bf16(run->y + t * run->y_cols + n0, dst + n0, n1 - n0);
            continue;
        }
        for (int64_t n = n0; n < n1; n++) dst[n] = coli_f32_to_bf16(run->y[t * run->y_cols + n]);
    }
}

/* Input k of token t as the kernel multiplies it (a split's two parts added). */
static float input_value(const Input *in, int64_t t, int64_t k) {
    int64_t p = coli_ffn_pos(in->k->x_order, k);
    if (in->k->x_type == COLI_FFN_X_F32) return ((const float *)in->x)[t * in->ldx + p];
    const uint16_t *row = (const uint16_t *)in->x + t * in->ldx;
    float v = coli_bf16_to_f32(row[p]);
    return in->k->x_type == COLI_FFN_X_BF16_SPLIT ? v + coli_bf16_to_f32(row[in->ldx / 2 + p]) : v;
}

/* Gate and up (or gate_up), outputs split over the threads. */
static void first_by_outputs(const Run *run, int thread, int threads, uint8_t *scratch) {
    int64_t total = 0, lo, hi;
    for (int i = 0; i < run->n_first; i++) total += run->first[i].units;
    split(total, thread, threads, &lo, &hi);
    for (int i = 0, base = 0; i < run->n_first; base += (int)run->first[i].units, i++) {
        const MatJob *j = &run->first[i];
        const Input *in = &run->in[j->input];
        int64_t a = lo > base ? lo - base : 0, b = hi - base < j->units ? hi - base : j->units;
        if (a < b) run_units(run, j, in, in->xs, a, b, scratch);
    }
}

/* Gate and up rows of intermediate units [a, b), from inputs in. */
static void first_by_units(const Run *run, const Input *in, int64_t a, int64_t b, uint8_t *scratch) {
    const MatJob *j = &run->first[0];
    const Input *ij = &in[j->input];
    if (run->e->fused == COLI_FFN_INTERLEAVED) {
        run_rows(run, j, ij, ij->xs, 2 * a, 2 * b, scratch);
    } else if (run->e->fused) {
        run_rows(run, j, ij, ij->xs, a, b, scratch);
        run_rows(run, j, ij, ij->xs, run->inter + a, run->inter + b, scratch);
    } else {
        run_rows(run, j, ij, ij->xs, a, b, scratch);
        const Input *iu = &in[run->first[1].input];
        run_rows(run, &run->first[1], iu, iu->xs, a, b, scratch);
    }
}

/* This thread's copy of the inputs (in_bytes on from the last thread's),
 * loaded with every token of the batch. */
static void own_inputs(const Run *run, int thread, Input mine[2], float *tmp) {
    for (int i = 0; i < run->n_in; i++) {
        mine[i] = run->in[i];
        mine[i].x = (uint8_t *)mine[i].x + (size_t)thread * run->in_bytes;
        if (mine[i].xs) mine[i].xs = (float *)((uint8_t *)mine[i].xs + (size_t)thread * run->in_bytes);
    }
    load_inputs(run, mine, tmp, 0, run->tokens);
}

static void run_thread(void *ctx, int thread, int threads) {
    const Run *run = ctx;
    uint8_t *scratch = run->scratch + (size_t)thread * run->scratch_bytes;
    float *tmp = (float *)(scratch + run->kernel_bytes);
    int64_t lo, hi;
    if (run->by_units) {
        /* Each thread its own copy of the (few) tokens' inputs, then the
         * gate and up rows of its intermediate units and their activation:
         * one barrier, before down. */
        Input mine[2];
        own_inputs(run, thread, mine, tmp);
        split(coli_ffn_round_up(run->inter, run->unit_step) / run->unit_step, thread, threads, &lo, &hi);
        int64_t a = lo * run->unit_step, b = hi * run->unit_step < run->inter ? hi * run->unit_step : run->inter;
        if (a < b) {
            first_by_units(run, mine, a, b, scratch);
            activate(run, tmp, a, b);
        }
    } else {
        split(run->tokens, thread, threads, &lo, &hi);
        load_inputs(run, run->in, tmp, lo, hi);
        coli_compute_pool_barrier(run->pool);
        first_by_outputs(run, thread, threads, scratch);
        coli_compute_pool_barrier(run->pool);
        split(run->inter, thread, threads, &lo, &hi);
        activate(run, tmp, lo, hi);
    }
    coli_compute_pool_barrier(run->pool);
    float *hs = NULL;
    if (run->down.k->group_sums) {  /* every thread needs them all: each adds them up itself */
        const ColiFfnMat *m = run->down.m;
        hs = (float *)(scratch + run->kernel_bytes + run->temp_bytes);
        for (int64_t t = 0; t < run->tokens; t++)
            for (int64_t g = 0; g < m->groups; g++) {
                float *row = tmp;
                int64_t k0 = g * m->group, n = m->n_in - k0 < m->group ? m->n_in - k0 : m->group;
                for (int64_t i = 0; i < n; i++) row[i] = input_value(&run->h, t, k0 + i);
                hs[t * m->groups + g] = coli_ffn_group_sum(row, n);
            }
    }
    split(run->down.units, thread, threads, &lo, &hi);
    run_units(run, &run->down, &run->h, hs, lo, hi, scratch);
    int64_t unit = run->down.k->unit;
    store_output(run, lo * unit, hi * unit < run->hidden ? hi * unit : run->hidden);
}

/* One matrix: the inputs (per thread for a few tokens, else split and one
 * barrier), then its outputs split over the threads. */
static void linear_thread(void *ctx, int thread, int threads) {
    const Run *run = ctx;
    uint8_t *scratch = run->scratch + (size_t)thread * run->scratch_bytes;
    float *tmp = (float *)(scratch + run->kernel_bytes);
    const MatJob *j = &run->first[0];
    Input mine[2];
    int64_t lo, hi;
    if (run->by_units) {
        own_inputs(run, thread, mine, tmp);
    } else {
        split(run->tokens, thread, threads, &lo, &hi);
        load_inputs(run, run->in, tmp, lo, hi);
        coli_compute_pool_barrier(run->pool);
        mine[0] = run->in[0];
    }
    split(j->units, thread, threads, &lo, &hi);
    run_units(run, j, &mine[0], mine[0].xs, lo, hi, scratch);
    store_output(run, lo * j->k->unit, hi * j->k->unit < run->y_cols ? hi * j->k->unit : run->y_cols);
}

/* The step (in intermediate units) that splits gate and up between threads
 * on their kernels' units, or 0 when no step does. */
static int64_t unit_step(const Run *run) {
    int64_t u0 = run->first[0].k->unit;
    if (!run->e->fused) {
        int64_t u1 = run->first[1].k->unit;
        return u0 % u1 == 0 ? u0 : u1 % u0 == 0 ? u1 : 0;  /* units are 1, 8, 16, 64 or 128 */
    }
    if (run->e->fused == COLI_FFN_CONCATENATED) return run->inter % u0 == 0 ? u0 : 0;
    return u0 % 2 == 0 ? u0 / 2 : u0;  /* interleaved: unit j is rows 2j and 2j + 1 */
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
static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

static int64_t input_floats(const Input *in) {
    int64_t per = in->k->x_type != COLI_FFN_X_F32 ? (in->ldx + 1) / 2 : in->ldx;
    return per + (in->k->group_sums ? in->m->groups : 0);
}

/* Elements of a row of inputs (a split row has both parts). */
static int64_t input_ld(const ColiFfnKernel *k, int64_t n) {
    int64_t ld = coli_ffn_round_up(n, COLI_FFN_PAD);
    return k->x_type == COLI_FFN_X_BF16_SPLIT ? 2 * ld : ld;
}

/* Tokens per batch: as many as keep the batch's float buffers near 64 MiB,
 * at least 64. */
static int64_t batch_tokens(int64_t tokens, int64_t per_token_floats) {
    int64_t cap = max64(64, ((int64_t)16 << 20) / max64(1, per_token_floats));
    return tokens < cap ? tokens : cap;
}

/* Lays out the batch buffers in block; returns its bytes (block NULL: only
 * counts). With by_units, the inputs come once per thread. A linear has
 * no activations (h.k NULL) and no intermediate. */
static size_t layout(Run *run, int64_t batch, int threads, uint8_t *block) {
    size_t off = 0;
#define TAKE(ptr, type, count)                                         \
    do {                                                               \
        if (block) ptr = (type *)(block + off);                        \
        off += align64(sizeof(type) * (size_t)(count));                \
    } while (0)
    for (int i = 0; i < run->n_in; i++) {
        Input *in = &run->in[i];
        if (in->k->x_type != COLI_FFN_X_F32) TAKE(in->x, uint16_t, batch * in->ldx);
        else TAKE(in->x, float, batch * in->ldx);
        if (in->k->group_sums) TAKE(in->xs, float, batch * in->m->groups);
    }
    run->in_bytes = off;
    if (run->by_units) off += run->in_bytes * (size_t)(threads - 1);
    if (run->h.k && run->h.k->x_type != COLI_FFN_X_F32) TAKE(run->h.x, uint16_t, batch * run->h.ldx);
    else if (run->h.k) TAKE(run->h.x, float, batch * run->h.ldx);
    if (run->inter) TAKE(run->gu, float, batch * 2 * run->inter);
    if (run->h.m && run->h.m->order) TAKE(run->h_at, int32_t, run->inter);
    if (run->c->out_format == COLI_TENSOR_BF16) TAKE(run->y, float, batch * run->y_cols);
    TAKE(run->scratch, uint8_t, 0);
#undef TAKE
    return off;
}

/* The batch buffers, laid out in one block, and each thread's scratch
 * after them; NULL when out of memory (total: the bytes asked for). */
static void *run_block(Run *run, int64_t batch, int threads, size_t *total) {
    size_t shared = layout(run, batch, threads, NULL);
    *total = shared + run->scratch_bytes * (size_t)threads;
    void *block = NULL;
    if (posix_memalign(&block, 64, *total)) return NULL;
    layout(run, batch, threads, block);
    /* Padding positions of the inputs stay zero: they meet zero weights. */
    memset(block, 0, shared);
    return block;
}

/* The call's path (AUTO: the default), or a negative COLI_E* code. */
static int resolve_isa(int isa, char *err, size_t err_len) {
    if (isa == COLI_FFN_ISA_AUTO) return coli_ffn_isa_default(err, err_len);
    if (!coli_ffn_isa_supported(isa))
        return coli_fail(err, err_len, COLI_EINVAL, "kernel path %d (%s) is not one this CPU and "
                         "build can run", isa, coli_ffn_isa_name(isa) ? coli_ffn_isa_name(isa) : "?");
    return isa;
}

int coli_expert_ffn(const ColiFfnExpert *e, const ColiFfnCall *c, ColiComputePool *pool,
                    char *err, size_t err_len) {
    if (!e || !c) return coli_fail(err, err_len, COLI_EINVAL, "expert ffn: NULL expert or call");
    int isa = resolve_isa(c->isa, err, err_len);
    if (isa < 0) return isa;
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
    run.act = act_for(isa);
    run.conv = conv_for(isa);
    run.pool = pool;
    run.hidden = run.y_cols = mats[0].n_in;
    run.inter = e->fused ? mats[0].n_out / 2 : mats[0].n_out;
    run.n_first = e->fused ? 1 : 2;
    const ColiFfnMatrix *srcs[3] = {&e->gate, e->fused ? NULL : &e->up, &e->down};
    const ColiFfnMat *mp[3] = {&mats[0], e->fused ? NULL : &mats[1], &mats[2]};
    float *bias[3];
    float *bias_block = float_biases(srcs, mp, bias);
    if ((e->gate.bias || (!e->fused && e->up.bias) || e->down.bias) && !bias_block)
        return coli_fail(err, err_len, COLI_ENOMEM, "expert ffn: out of memory for the biases");
    int bf16_call = c->x_format == COLI_TENSOR_BF16;
    for (int i = 0; i < 3; i++) {
        if (!mp[i]) continue;
        MatJob *j = i == 2 ? &run.down : &run.first[i];
        j->m = mp[i];
        j->k = kernel_for(isa, mp[i], !bf16_call ? COLI_FFN_INPUT_F32
                                      : i < 2 ? COLI_FFN_INPUT_BF16 : COLI_FFN_INPUT_ACT);
        j->bias = bias[i];
        j->units = ceil_div(mp[i]->n_out, j->k->unit);
        if (i == 2) continue;
        if (i == 1 && same_input(run.in[0].k, run.in[0].m, j->k, j->m)) continue;
        j->input = run.n_in;
        run.in[run.n_in++] = (Input){j->k, j->m, NULL, input_ld(j->k, run.hidden), NULL};
    }
    run.h = (Input){run.down.k, run.down.m, NULL, input_ld(run.down.k, run.inter), NULL};
    int threads = coli_compute_pool_threads(pool);
    int64_t per_token = 2 * run.inter + input_floats(&run.h) +
                        (c->out_format == COLI_TENSOR_BF16 ? run.hidden : 0);
    for (int i = 0; i < run.n_in; i++) per_token += input_floats(&run.in[i]);
    int64_t batch = batch_tokens(c->tokens, per_token);
    size_t kernel = 0;
    for (int i = 0; i < 3; i++)
        if (mp[i]) {
            const ColiFfnKernel *k = i == 2 ? run.down.k : run.first[i].k;
            kernel = kernel > k->scratch(mp[i], 0, mp[i]->n_out, (int)batch)
                         ? kernel : k->scratch(mp[i], 0, mp[i]->n_out, (int)batch);
        }
    run.kernel_bytes = align64(kernel);
    run.temp_bytes = align64(sizeof(float) * (size_t)max64(2 * run.hidden, 3 * run.inter));
    size_t sums = run.down.k->group_sums ? sizeof(float) * (size_t)(batch * mats[2].groups) : 0;
    run.scratch_bytes = run.kernel_bytes + run.temp_bytes + align64(sums);
    /* A few tokens run with one barrier when gate and up split on their units. */
    run.unit_step = unit_step(&run);
    run.by_units = run.unit_step > 0 && c->tokens <= COLI_FFN_OWN_INPUTS;
    size_t total;
    void *block = run_block(&run, batch, threads, &total);
    if (!block) {
        free(bias_block);
        return coli_fail(err, err_len, COLI_ENOMEM, "expert ffn: out of memory for %lld tokens "
                         "(%zu bytes of buffers)", (long long)batch, total);
    }
    for (int64_t k = 0; run.h_at && k < run.inter; k++) {
        int32_t v;
        memcpy(&v, mats[2].order + 4 * k, sizeof v);
        run.h_at[-1 - v] = (int32_t)k;
    }
    for (int i = 0; i < run.n_first; i++) {
        run.first[i].dst = run.gu + i * run.inter;
        run.first[i].ld_dst = 2 * run.inter;
    }
    for (run.t0 = 0; run.t0 < c->tokens; run.t0 += batch) {
        run.tokens = c->tokens - run.t0 < batch ? c->tokens - run.t0 : batch;
        if (run.y) {
            run.down.dst = run.y;
            run.down.ld_dst = run.hidden;
        } else {
            run.down.dst = (float *)c->out + run.t0 * c->out_stride;
            run.down.ld_dst = c->out_stride;
        }
        coli_compute_pool_run(pool, run_thread, &run);
    }
    free(block);
    free(bias_block);
    return COLI_OK;
}

/* A linear is the first phase of an expert alone: one matrix, its inputs
 * prepared as gate's are, its sums (plus bias) the output. */
static void linear_setup(Run *run, const ColiFfnMat *m, int isa, int64_t *batch) {
    MatJob *j = &run->first[0];
    j->m = m;
    j->k = kernel_for(isa, m, run->c->x_format == COLI_TENSOR_BF16 ? COLI_FFN_INPUT_BF16
                                                                   : COLI_FFN_INPUT_F32);
    j->units = ceil_div(m->n_out, j->k->unit);
    run->n_first = run->n_in = 1;
    run->in[0] = (Input){j->k, m, NULL, input_ld(j->k, m->n_in), NULL};
    run->hidden = m->n_in;
    run->y_cols = m->n_out;
    int64_t per_token = input_floats(&run->in[0]) +
                        (run->c->out_format == COLI_TENSOR_BF16 ? m->n_out : 0);
    *batch = batch_tokens(run->c->tokens, per_token);
    run->kernel_bytes = align64(j->k->scratch(m, 0, m->n_out, (int)*batch));
    run->temp_bytes = align64(sizeof(float) * (size_t)(2 * m->n_in));
    run->scratch_bytes = run->kernel_bytes + run->temp_bytes;
    run->by_units = run->c->tokens <= COLI_FFN_OWN_INPUTS;
}

int coli_linear(const ColiFfnMatrix *src, const ColiFfnCall *c, ColiComputePool *pool, char *err,
                size_t err_len) {
    if (!src || !c) return coli_fail(err, err_len, COLI_EINVAL, "linear: NULL matrix or call");
    int isa = resolve_isa(c->isa, err, err_len);
    if (isa < 0) return isa;
    ColiFfnMat m;
    int rc = describe(&m, src, "linear", err, err_len);
    if (!rc) rc = check_io(c, m.n_in, m.n_out, err, err_len);
    if (rc) return rc;
    Run run;
    memset(&run, 0, sizeof run);
    run.c = c;
    run.conv = conv_for(isa);
    run.pool = pool;
    int64_t batch;
    linear_setup(&run, &m, isa, &batch);
    const ColiFfnMatrix *srcs[3] = {src, NULL, NULL};
    const ColiFfnMat *mp[3] = {&m, NULL, NULL};
    float *bias[3];
    float *bias_block = float_biases(srcs, mp, bias);
    if (src->bias && !bias_block)
        return coli_fail(err, err_len, COLI_ENOMEM, "linear: out of memory for the bias");
    run.first[0].bias = bias[0];
    size_t total;
    void *block = run_block(&run, batch, coli_compute_pool_threads(pool), &total);
    if (!block) {
        free(bias_block);
        return coli_fail(err, err_len, COLI_ENOMEM, "linear: out of memory for %lld tokens "
                         "(%zu bytes of buffers)", (long long)batch, total);
    }
    for (run.t0 = 0; run.t0 < c->tokens; run.t0 += batch) {
        run.tokens = c->tokens - run.t0 < batch ? c->tokens - run.t0 : batch;
        run.first[0].dst = run.y ? run.y : (float *)c->out + run.t0 * c->out_stride;
        run.first[0].ld_dst = run.y ? run.y_cols : c->out_stride;
        coli_compute_pool_run(pool, linear_thread, &run);
    }
    free(block);
    free(bias_block);
    return COLI_OK;
}
