/*
 * gptq_group_order.c: moves a GPTQ matrix's input rows into group order
 * (see gptq_group_order.h), a panel of columns at a time: the panel's
 * words are copied aside (a few hundred KiB, in L2), then each new word is
 * put together from the eight nibbles its inputs had, sixteen columns a
 * step.
 */
#define _POSIX_C_SOURCE 200112L  /* posix_memalign */
#include "gptq_group_order.h"

#include <stdlib.h>
#include <string.h>

#include "coli_errors.h"
#include "ffn.h"

enum {
    PANEL_BYTES = 256 * 1024,   /* the copied columns of every word row, unless that is
                                 * under 8 steps of columns */
    LANES = 16,                 /* columns a step */
    PANEL_MAX = 4096            /* columns a panel at most */
};

typedef uint32_t Lanes __attribute__((vector_size(4 * LANES)));

static int32_t entry(const unsigned char *g_idx, int64_t i) {
    int32_t v;
    memcpy(&v, g_idx + 4 * i, sizeof v);
    return v;
}

/* Fills order (position -> input, inputs stable by group) when g_idx is act
 * order with the format's groups; 0 when it is not (next: a count per group). */
static int group_positions(const unsigned char *g_idx, int64_t rows, int64_t group,
                           int32_t *order, int64_t *next) {
    int64_t groups = (rows + group - 1) / group;
    int sorted = 1;
    memset(next, 0, sizeof(int64_t) * (size_t)groups);
    for (int64_t i = 0; i < rows; i++) {
        int32_t g = entry(g_idx, i);
        if (g < 0 || g >= groups) return 0;
        next[g]++;
        sorted &= g == i / group;
    }
    if (sorted) return 0;
    for (int64_t g = 0; g < groups; g++) {
        int64_t want = rows - g * group < group ? rows - g * group : group;
        if (next[g] != want) return 0;
        next[g] = g * group;
    }
    for (int64_t i = 0; i < rows; i++) order[next[entry(g_idx, i)]++] = (int32_t)i;
    return 1;
}

/* Word rows of columns [c0, c0 + pc) rebuilt from the panel (every word
 * row's P columns, as they were). */
static inline __attribute__((always_inline)) void
rebuild_body(unsigned char *words, int64_t cols, int64_t wr, const int32_t *order,
             const uint32_t *panel, int64_t P, int64_t c0, int64_t pc) {
    for (int64_t r = 0; r < wr; r++) {
        /* New nibble k is input in's: nibble in % 8 of word row in / 8,
         * shifted right, then left, into place. */
        const uint32_t *src[8];
        int right[8], left[8];
        for (int k = 0; k < 8; k++) {
            int32_t in = order[8 * r + k];
            int from = 4 * (in & 7), to = 4 * k;
            src[k] = panel + (in >> 3) * P;
            right[k] = from > to ? from - to : 0;
            left[k] = to > from ? to - from : 0;
        }
        unsigned char *dst = words + 4 * (r * cols + c0);
        for (int64_t b = 0; b < pc; b += LANES) {
            Lanes acc = {0};
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                Lanes v;
                memcpy(&v, src[k] + b, sizeof v);
                acc |= ((v >> right[k]) << left[k]) & (0xFu << 4 * k);
            }
            if (pc - b >= LANES) memcpy(dst + 4 * b, &acc, sizeof acc);
            else memcpy(dst + 4 * b, &acc, 4 * (size_t)(pc - b));
        }
    }
}

#define REBUILD_ARGS                                                                  \
    unsigned char *words, int64_t cols, int64_t wr, const int32_t *order,            \
        const uint32_t *panel, int64_t P, int64_t c0, int64_t pc
typedef void (*RebuildFn)(REBUILD_ARGS);

static void rebuild_baseline(REBUILD_ARGS) { rebuild_body(words, cols, wr, order, panel, P, c0, pc); }

/* x86: the same loop built for AVX2 and AVX-512 too, chosen as the kernels'
 * paths are (coli_ffn_isa_supported); the loader runs it once per expert
 * read, beside the compute. */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static void rebuild_avx2(REBUILD_ARGS) {
    rebuild_body(words, cols, wr, order, panel, P, c0, pc);
}
__attribute__((target("avx512f"))) static void rebuild_avx512(REBUILD_ARGS) {
    rebuild_body(words, cols, wr, order, panel, P, c0, pc);
}
#endif

static RebuildFn rebuild_for_cpu(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (coli_ffn_isa_supported(COLI_FFN_ISA_AVX512)) return rebuild_avx512;
    if (coli_ffn_isa_supported(COLI_FFN_ISA_AVX2)) return rebuild_avx2;
#endif
    return rebuild_baseline;
}

int coli_gptq_group_order(unsigned char *words, int64_t rows, int64_t cols, int64_t group,
                          unsigned char *g_idx, const char *what, char *err, size_t err_len) {
    if (rows <= 0 || cols <= 0 || rows % 8 || group <= 0) return 0;
    if (entry(g_idx, 0) < 0) {  /* stored so: the kernels will trust it, so check it now */
        uint8_t *seen = malloc((size_t)rows);
        if (!seen)
            return coli_fail(err, err_len, COLI_ENOMEM, "%s: out of memory checking a g_idx in "
                             "group order (%lld entries)", what, (long long)rows);
        int64_t j = coli_ffn_group_order_fault(g_idx, rows, seen);
        free(seen);
        if (j < 0) return 0;
        return coli_fail(err, err_len, COLI_ECONFIG, "%s: g_idx[%lld] = %lld; a g_idx of "
                         "negative entries is in group order, -1 - each of the %lld inputs once",
                         what, (long long)j, (long long)entry(g_idx, j), (long long)rows);
    }
    if (group % 8) return 0;
    int64_t wr = rows / 8, groups = (rows + group - 1) / group;
    int64_t P = PANEL_BYTES / (4 * wr) / LANES * LANES;
    int64_t all = (cols + LANES - 1) / LANES * LANES;
    if (P < 8 * LANES) P = 8 * LANES;  /* a row's eight sources are set up once per 8 steps or more */
    if (P > PANEL_MAX) P = PANEL_MAX;
    if (P > all) P = all;
    size_t order_bytes = (sizeof(int32_t) * (size_t)rows + 63) / 64 * 64;
    size_t next_bytes = (sizeof(int64_t) * (size_t)groups + 63) / 64 * 64;
    size_t panel_bytes = sizeof(uint32_t) * (size_t)(wr * P);
    void *block = NULL;
    if (posix_memalign(&block, 64, order_bytes + next_bytes + panel_bytes))
        return coli_fail(err, err_len, COLI_ENOMEM, "%s: out of memory putting act order into "
                         "group order (%zu bytes for %lld x %lld)", what,
                         order_bytes + next_bytes + panel_bytes, (long long)rows, (long long)cols);
    int32_t *order = block;
    int64_t *next = (int64_t *)((unsigned char *)block + order_bytes);
    uint32_t *panel = (uint32_t *)((unsigned char *)block + order_bytes + next_bytes);
    if (!group_positions(g_idx, rows, group, order, next)) {
        free(block);
        return 0;
    }
    /* Lanes past a short last panel's columns are computed, never stored. */
    memset(panel, 0, panel_bytes);
    RebuildFn rebuild = rebuild_for_cpu();
    for (int64_t c0 = 0; c0 < cols; c0 += P) {
        int64_t pc = cols - c0 < P ? cols - c0 : P;
        for (int64_t r = 0; r < wr; r++)
            memcpy(panel + r * P, words + 4 * (r * cols + c0), 4 * (size_t)pc);
        rebuild(words, cols, wr, order, panel, P, c0, pc);
    }
    for (int64_t j = 0; j < rows; j++) {
        int32_t v = -1 - order[j];
        memcpy(g_idx + 4 * j, &v, sizeof v);
    }
    free(block);
    return 1;
}
