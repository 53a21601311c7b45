/*
 * decode_layer.c: a decoder layer's one-token step in two calls (see
 * decode_layer.h): the public calls of the pieces, in the engine's order.
 */
#include "decode_layer.h"

#include <stdio.h>
#include <string.h>

#include "coli_errors.h"
#include "ffn_internal.h"   /* coli_bf16_to_f32, coli_f32_to_bf16 */
#include "rms_norm.h"
#include "rotary.h"
#include "router_topk.h"
#include "tensor.h"

/* A piece's failure, its message prefixed with the piece's name. */
static int piece_failed(int rc, const char *piece, char *err, size_t err_len) {
    if (err && err_len > 0) {
        char inner[COLI_ERR_LEN];
        snprintf(inner, sizeof inner, "%s", err);
        snprintf(err, err_len, "decode layer: %s: %s", piece, inner);
    }
    return rc;
}

static int norm(const ColiDecodeNorm *w, const void *x, void *out, int64_t rows, int64_t n, int format,
                const char *piece, char *err, size_t err_len) {
    int rc = coli_rms_norm(x, out, w->weight, rows, n, format, format, format, w->eps, w->order, err,
                           err_len);
    return rc < 0 ? piece_failed(rc, piece, err, err_len) : 0;
}

static int project(const ColiFfnMatrix *m, const void *x, int64_t n_in, void *out, int64_t n_out,
                   int format, int isa, ColiComputePool *pool, const char *piece, char *err,
                   size_t err_len) {
    ColiFfnCall c;
    memset(&c, 0, sizeof c);
    c.x = x;
    c.x_format = format;
    c.x_stride = n_in;
    c.out = out;
    c.out_format = format;
    c.out_stride = n_out;
    c.tokens = 1;
    c.isa = isa;
    int rc = coli_linear(m, &c, pool, err, err_len);
    return rc < 0 ? piece_failed(rc, piece, err, err_len) : 0;
}

static int check_format(int format, char *err, size_t err_len) {
    if (format != COLI_TENSOR_F32 && format != COLI_TENSOR_BF16)
        return coli_fail(err, err_len, COLI_EINVAL, "decode layer: format %d (F32 or BF16)", format);
    return 0;
}

int coli_decode_qkv(const ColiDecodeQkv *s, ColiComputePool *pool, char *err, size_t err_len) {
    if (!s) return coli_fail(err, err_len, COLI_EINVAL, "decode layer: NULL step");
    int rc = check_format(s->format, err, err_len);
    if (rc) return rc;
    int64_t nq = s->heads * s->d, nk = s->kv_heads * s->d;
    rc = norm(&s->input_norm, s->h, s->normed, 1, s->hidden, s->format, "input norm", err, err_len);
    if (!rc) rc = project(s->q_proj, s->normed, s->hidden, s->q, nq, s->format, s->isa, pool, "q projection",
                          err, err_len);
    if (!rc) rc = project(s->k_proj, s->normed, s->hidden, s->k, nk, s->format, s->isa, pool, "k projection",
                          err, err_len);
    if (!rc) rc = project(s->v_proj, s->normed, s->hidden, s->v, nk, s->format, s->isa, pool, "v projection",
                          err, err_len);
    if (rc) return rc;
    const void *q = s->q, *k = s->k;
    if (s->qk_norm) {
        rc = norm(&s->q_norm, s->q, s->q_normed, s->heads, s->d, s->format, "q norm", err, err_len);
        if (!rc) rc = norm(&s->k_norm, s->k, s->k_normed, s->kv_heads, s->d, s->format, "k norm", err, err_len);
        if (rc) return rc;
        q = s->q_normed;
        k = s->k_normed;
    }
    rc = coli_rotary(q, s->q_rotated, s->heads, s->heads, s->d, s->cos, s->sin, s->format, err, err_len);
    if (rc < 0) return piece_failed(rc, "q rotary", err, err_len);
    rc = coli_rotary(k, s->k_rotated, s->kv_heads, s->kv_heads, s->d, s->cos, s->sin, s->format, err, err_len);
    return rc < 0 ? piece_failed(rc, "k rotary", err, err_len) : 0;
}

/* residual = h + o, each sum rounded to the format as the framework's add rounds. */
static void add_rows(const void *h, const void *o, void *residual, int64_t n, int format) {
    if (format == COLI_TENSOR_F32) {
        const float *a = h, *b = o;
        float *r = residual;
        for (int64_t i = 0; i < n; i++) r[i] = a[i] + b[i];
        return;
    }
    const uint16_t *a = h, *b = o;
    uint16_t *r = residual;
    for (int64_t i = 0; i < n; i++) r[i] = coli_f32_to_bf16(coli_bf16_to_f32(a[i]) + coli_bf16_to_f32(b[i]));
}

int coli_decode_route(const ColiDecodeRoute *s, ColiComputePool *pool, char *err, size_t err_len) {
    if (!s) return coli_fail(err, err_len, COLI_EINVAL, "decode layer: NULL step");
    int rc = check_format(s->format, err, err_len);
    if (rc) return rc;
    if (!s->h || !s->o || !s->residual)    /* the add reads and writes them itself */
        return coli_fail(err, err_len, COLI_EINVAL, "decode layer: NULL h, o or residual");
    if (s->attend) {
        rc = coli_decode_attention(&s->attention, pool, err, err_len);
        if (rc < 0) return piece_failed(rc, "attention", err, err_len);
    }
    int64_t nq = s->attention.heads * s->attention.dv;
    rc = project(s->o_proj, s->attended, nq, s->o, s->hidden, s->format, s->isa, pool, "o projection", err,
                 err_len);
    if (rc) return rc;
    add_rows(s->h, s->o, s->residual, s->hidden, s->format);
    rc = norm(&s->post_norm, s->residual, s->post, 1, s->hidden, s->format, "post-attention norm", err,
              err_len);
    if (!rc) rc = project(s->router, s->post, s->hidden, s->logits, s->experts, s->format, s->isa, pool,
                          "router", err, err_len);
    if (rc) return rc;
    rc = coli_router_topk(s->logits, s->format, 1, s->experts, s->top_k, s->renorm, s->scores,
                          s->scores_format, s->index, err, err_len);
    return rc < 0 ? piece_failed(rc, "top-k", err, err_len) : 0;
}
