/*
 * ffn_cases.c: runs coli_expert_ffn over experts described in a file, for
 * a build of the kernels on another architecture (arm64 under qemu-user).
 *
 *     ffn_cases CASES OUT [FORMAT:IN_OUT ...]
 *
 * CASES (written by tests/test_neon_qemu.py, little-endian): "CFC1", u32
 * count, then per case: i32 fused, activation, x_format, out_format; f32
 * alpha, limit; i64 tokens, hidden; per matrix (gate, up, down): i32 format,
 * scale_format; i64 rows, columns; u32 block_rows, block_columns, flags,
 * bias_format; blobs data, scales, zeros, g_idx, bias; then the blob x
 * (tokens rows of hidden). A blob is a u64 length (all ones: NULL) and its
 * bytes.
 *
 * OUT: per case, four results of tokens rows of hidden in out_format, one
 * after another: every path but scalar that this CPU runs by default (the
 * process default path) on the calling thread, the same on a pool of three
 * threads, each token alone on the default path, and the scalar path.
 * Prints the default path's name, then for each FORMAT:IN_OUT argument
 * (ColiTensorFormat numbers; IN_OUT 1 for stored (in, out)) a line
 * "kernel FORMAT IN_OUT NAME": the kernel the default path runs for it
 * (coli_ffn_kernel_name). Exits non-zero on any error.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ffn.h"

#define BLOB_NULL UINT64_MAX

typedef struct {
    FILE *f;
    const char *path;
} Reader;

static void die(const char *what, const char *detail) {
    fprintf(stderr, "ffn_cases: %s: %s\n", what, detail);
    exit(1);
}

static void read_exact(Reader *r, void *dst, size_t n) {
    if (n && fread(dst, 1, n, r->f) != n) die(r->path, "truncated");
}

static int32_t read_i32(Reader *r) { int32_t v; read_exact(r, &v, sizeof v); return v; }
static uint32_t read_u32(Reader *r) { uint32_t v; read_exact(r, &v, sizeof v); return v; }
static int64_t read_i64(Reader *r) { int64_t v; read_exact(r, &v, sizeof v); return v; }
static float read_f32(Reader *r) { float v; read_exact(r, &v, sizeof v); return v; }

/* A blob in 64-byte aligned memory (as a store slot's parts are), or NULL. */
static void *read_blob(Reader *r, size_t *len) {
    uint64_t n;
    read_exact(r, &n, sizeof n);
    *len = 0;
    if (n == BLOB_NULL) return NULL;
    if (n > ((uint64_t)1 << 32)) die(r->path, "blob too large");
    void *p = aligned_alloc(64, ((size_t)n + 64) / 64 * 64);
    if (!p) die("aligned_alloc", "out of memory");
    read_exact(r, p, (size_t)n);
    *len = (size_t)n;
    return p;
}

static void read_matrix(Reader *r, ColiFfnMatrix *m) {
    size_t len;
    m->view.format = (ColiTensorFormat)read_i32(r);
    m->view.scale_format = (ColiScaleFormat)read_i32(r);
    m->view.rows = read_i64(r);
    m->view.columns = read_i64(r);
    m->view.block_rows = read_u32(r);
    m->view.block_columns = read_u32(r);
    m->flags = read_u32(r);
    m->bias_format = (ColiTensorFormat)read_u32(r);
    m->view.data = read_blob(r, &m->view.data_bytes);
    m->view.scales = read_blob(r, &m->view.scale_bytes);
    m->zeros = read_blob(r, &m->zero_bytes);
    m->g_idx = read_blob(r, &len);
    m->g_idx_count = len / 4;
    m->bias = read_blob(r, &m->bias_bytes);
}

static void free_matrix(ColiFfnMatrix *m) {
    free((void *)m->view.data);
    free((void *)m->view.scales);
    free((void *)m->zeros);
    free((void *)m->g_idx);
    free((void *)m->bias);
}

static size_t element_bytes(ColiTensorFormat format) {
    if (format == COLI_TENSOR_F32) return 4;
    if (format == COLI_TENSOR_BF16) return 2;
    die("x or out format", "not F32 or BF16");
    return 0;
}

static void run(const ColiFfnExpert *e, ColiFfnCall call, int isa, ColiComputePool *pool,
                int case_no) {
    char err[256] = "";
    call.isa = isa;
    int rc = coli_expert_ffn(e, &call, pool, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "ffn_cases: case %d, path %s: rc %d: %s\n", case_no, coli_ffn_isa_name(isa),
                rc, err);
        exit(1);
    }
}

/* The four results of one case into out. */
static void run_case(Reader *r, FILE *out, int case_no, int isa, ColiComputePool *pool) {
    ColiFfnExpert e;
    memset(&e, 0, sizeof e);
    e.fused = read_i32(r);
    e.activation = read_i32(r);
    ColiTensorFormat x_format = (ColiTensorFormat)read_i32(r);
    ColiTensorFormat out_format = (ColiTensorFormat)read_i32(r);
    e.alpha = read_f32(r);
    e.limit = read_f32(r);
    int64_t tokens = read_i64(r), hidden = read_i64(r);
    read_matrix(r, &e.gate);
    read_matrix(r, &e.up);
    read_matrix(r, &e.down);
    size_t x_len;
    const uint8_t *x = read_blob(r, &x_len);
    size_t xb = element_bytes(x_format), ob = element_bytes(out_format);
    if (tokens < 1 || hidden < 1 || !x || x_len != (size_t)(tokens * hidden) * xb)
        die(r->path, "bad x");
    size_t row = (size_t)hidden * ob, all = (size_t)tokens * row;
    uint8_t *y = malloc(4 * all);
    if (!y) die("malloc", "out of memory");
    memset(y, 0xa5, 4 * all);   /* a row left unwritten shows */
    ColiFfnCall call = {x, x_format, hidden, y, out_format, hidden, tokens, isa};
    run(&e, call, isa, NULL, case_no);
    call.out = y + all;
    run(&e, call, isa, pool, case_no);
    for (int64_t t = 0; t < tokens; t++) {
        ColiFfnCall one = {x + (size_t)t * (size_t)hidden * xb, x_format, hidden,
                           y + 2 * all + (size_t)t * row, out_format, hidden, 1, isa};
        run(&e, one, isa, NULL, case_no);
    }
    call.out = y + 3 * all;
    run(&e, call, COLI_FFN_ISA_SCALAR, NULL, case_no);
    if (fwrite(y, 1, 4 * all, out) != 4 * all) die("write", "short");
    free(y);
    free((void *)x);
    free_matrix(&e.gate);
    free_matrix(&e.up);
    free_matrix(&e.down);
}

int main(int argc, char **argv) {
    if (argc < 3) die("usage", "ffn_cases CASES OUT [FORMAT:IN_OUT ...]");
    Reader r = {fopen(argv[1], "rb"), argv[1]};
    if (!r.f) die(argv[1], "cannot open");
    FILE *out = fopen(argv[2], "wb");
    if (!out) die(argv[2], "cannot open");
    char magic[4];
    read_exact(&r, magic, sizeof magic);
    if (memcmp(magic, "CFC1", 4) != 0) die(argv[1], "not a cases file");
    uint32_t count = read_u32(&r);
    char err[256] = "";
    int isa = coli_ffn_isa_default(err, sizeof err);
    if (isa < 0) die("default path", err);
    ColiComputePool *pool = NULL;
    if (coli_compute_pool_create(3, &pool, err, sizeof err) != 0) die("pool", err);
    for (uint32_t i = 0; i < count; i++) run_case(&r, out, (int)i, isa, pool);
    coli_compute_pool_destroy(pool);
    if (fclose(out) != 0) die(argv[2], "cannot write");
    fclose(r.f);
    printf("path %s: %u cases\n", coli_ffn_isa_name(isa), count);
    for (int i = 3; i < argc; i++) {
        int format, in_out;
        if (sscanf(argv[i], "%d:%d", &format, &in_out) != 2) die(argv[i], "not FORMAT:IN_OUT");
        const char *name = coli_ffn_kernel_name(isa, format, in_out);
        printf("kernel %d %d %s\n", format, in_out, name ? name : "none");
    }
    return 0;
}
