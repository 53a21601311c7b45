/*
 * ls_ffn.c: leased experts computed straight from their slots
 * (coli_store_expert_ffn, coli_store_ffn_expert).
 *
 * A view names its slot; the slot has the expert's tensors (its view), and
 * its entry says where the extra parts lie (the plan) and what each is
 * (zero points, g_idx, a bias, of which matrix), how the matrices are stored
 * (the source's flags) and, through the format table, which kernel computes
 * them. From these a ColiFfnExpert is filled per view, with addresses into
 * slot memory.
 *
 * The views' slots are held for the call (ls_slot_hold: one lease more
 * each, taken and dropped under the layer's mutex, no lock while
 * computing), so a release of the caller's lease meanwhile cannot free the
 * bytes, and close refuses while a computation runs. A batch is split over
 * the compute pool: experts whose rows are a thread's share of the work or
 * more run one at a time on every thread (the driver splits their output
 * rows), the rest one expert per thread at a time, the largest first.
 */
#include "ls_internal.h"

#include <stdlib.h>

#include "coli_kernels.h"
#include "compute_pool.h"
#include "ls_slots.h"

enum {
    FFN_ON_STACK = 16,            /* experts of a batch described without an allocation */
    FFN_EXPERT_COST = 4           /* what reading an expert's weights costs, in rows of compute */
};

static const char *const ROLE_NAMES[3] = {"gate", "up", "down"};

static const char *part_name(int kind) {
    return kind == COLI_PART_BIAS ? "bias" : kind == COLI_PART_ZERO ? "zero points" : "g_idx";
}

/* Matrix role of the expert in slot v (entry en): the slot's tensor, the
 * source's flags, the extra parts of that role, all checked against the
 * kernel of the tensor's format. */
static int fill_matrix(ColiFfnMatrix *m, const LsSlot *v, const LsEntry *en, int role,
                       const ColiTensorView *t, char *err, size_t n) {
    const char *name = role == 0 && (en->src.flags & COLI_SOURCE_FUSED_GATE_UP) ? "gate_up"
                                                                                 : ROLE_NAMES[role];
    int layer = v->layer->id, expert = v->expert;
    const ColiFormatInfo *f = coli_format_info(t->format);
    const ColiFormatKernel *k = f ? f->kernel : NULL;
    if (!k)
        return coli_fail(err, n, COLI_EINVAL, "layer %d expert %d %s: format %s has no kernel",
                         layer, expert, name, f ? f->name : "?");
    memset(m, 0, sizeof *m);
    m->view = *t;
    m->flags = ((en->src.flags & COLI_SOURCE_IN_OUT) ? COLI_FFN_IN_OUT : 0) |
               ((en->src.flags & COLI_SOURCE_ZERO_PLUS_ONE) ? COLI_FFN_ZERO_PLUS_ONE : 0);
    if (m->flags & ~k->flags)
        return coli_fail(err, n, COLI_EINVAL, "layer %d expert %d %s: the %s kernel computes no "
                         "matrix stored %s", layer, expert, name, k->name,
                         (m->flags & ~k->flags & COLI_FFN_IN_OUT) ? "(in, out)"
                                                                  : "with GPTQ's zero points");
    for (int j = 0; j < en->src.n_parts; j++) {
        const LsPart *p = &en->parts[j];
        if (p->kind == COLI_PART_OTHER || p->role != role) continue;
        if (!(k->parts & COLI_PART_BIT(p->kind)))
            return coli_fail(err, n, COLI_EINVAL, "layer %d expert %d %s: the %s kernel reads "
                             "no %s (extra part %d)", layer, expert, name, k->name,
                             part_name(p->kind), j);
        const void *at = v->mem + en->plan.part_at[j];
        if (p->kind == COLI_PART_ZERO) {
            m->zeros = at;
            m->zero_bytes = p->nbytes;
        } else if (p->kind == COLI_PART_G_IDX) {
            m->g_idx = at;
            m->g_idx_count = p->nbytes / 4;
        } else {
            m->bias = at;
            m->bias_format = p->format;
            m->bias_bytes = p->nbytes;
        }
    }
    return COLI_OK;
}

/* The ColiFfnExpert of resident slot v. Caller holds a lease on v. */
static int fill_expert(ColiFfnExpert *e, const LsSlot *v, const LsEntry *en, int activation,
                       float alpha, float limit, char *err, size_t n) {
    bool fused = (en->src.flags & COLI_SOURCE_FUSED_GATE_UP) != 0;
    memset(e, 0, sizeof *e);
    e->fused = !fused ? COLI_FFN_SEPARATE
               : (en->src.flags & COLI_SOURCE_INTERLEAVED) ? COLI_FFN_INTERLEAVED
                                                           : COLI_FFN_CONCATENATED;
    e->activation = activation;
    e->alpha = alpha;
    e->limit = limit;
    int rc = fill_matrix(&e->gate, v, en, 0, &v->view.gate, err, n);
    if (rc == COLI_OK && !fused) rc = fill_matrix(&e->up, v, en, 1, &v->view.up, err, n);
    if (rc == COLI_OK) rc = fill_matrix(&e->down, v, en, 2, &v->view.down, err, n);
    return rc;
}

/* ---- holding the views ------------------------------------------------ */

/* Holds the slot of every view (all of layer L), or none: COLI_ELEASE
 * naming the first view that holds no live lease of L. */
static int hold_views(LsLayer *L, const ColiExpertView *views, int count, LsSlot **slots,
                      char *err, size_t n) {
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < count; i++) {
        slots[i] = views[i].lease ? ls_slot_of_view(L, &views[i]) : NULL;
        if (slots[i]) {
            ls_slot_hold(L, slots[i]);
            continue;
        }
        for (int j = 0; j < i; j++) ls_slot_unlease(L, slots[j]);
        pthread_mutex_unlock(&L->mu);
        return coli_fail(err, n, COLI_ELEASE, "layer %d expert %d: the view holds no lease of "
                         "this store (released, or never leased)", L->id, views[i].key.expert);
    }
    pthread_mutex_unlock(&L->mu);
    return COLI_OK;
}

static void unhold_views(LsLayer *L, LsSlot **slots, int count) {
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < count; i++) ls_slot_unlease(L, slots[i]);
    pthread_mutex_unlock(&L->mu);
}

/* The layer of a batch of views, every view's, into *out. */
static int batch_layer(LsStore *s, const ColiExpertView *views, int count, LsLayer **out,
                       char *err, size_t n) {
    int layer = views[0].key.layer;
    for (int i = 1; i < count; i++)
        if (views[i].key.layer != layer)
            return coli_fail(err, n, COLI_EINVAL, "view %d is of layer %d, view 0 of layer %d: a "
                             "batch is one layer's experts", i, views[i].key.layer, layer);
    *out = ls_find_layer(s, layer);
    if (!*out)
        return coli_fail(err, n, COLI_ELEASE, "layer %d expert %d: the view holds no lease of this "
                         "store (no such layer)", layer, views[0].key.expert);
    return COLI_OK;
}

/* ---- a batch ---------------------------------------------------------- */

typedef struct {
    ColiFfnExpert *experts;       /* count */
    ColiFfnCall *calls;           /* count: each expert's rows */
    const ColiFormatKernel **kernels;
    int *order;                   /* experts with rows, costliest first */
    int n_order;
    _Atomic int next;             /* the next of order a thread takes */
    _Atomic int failed;
    int rc, at;                   /* the first failure: its code and expert */
    char err[COLI_ERR_LEN];
} Batch;

/* A pool thread's share: whole experts, one at a time, until none is left
 * or one failed. */
static void run_experts(void *ctx, int thread, int threads) {
    Batch *b = ctx;
    (void)thread;
    (void)threads;
    char err[COLI_ERR_LEN];
    while (!atomic_load(&b->failed)) {
        int i = atomic_fetch_add(&b->next, 1);
        if (i >= b->n_order) return;
        int x = b->order[i];
        err[0] = '\0';
        int rc = b->kernels[x]->ffn(&b->experts[x], &b->calls[x], NULL, err, sizeof err);
        if (rc && !atomic_exchange(&b->failed, 1)) {
            b->rc = rc;
            b->at = x;
            memcpy(b->err, err, sizeof err);
        }
    }
}

static int64_t cost_of(const Batch *b, int x) { return b->calls[x].tokens + FFN_EXPERT_COST; }

/* Sorts order by cost, costliest first (insertion: batches are small). */
static void sort_order(Batch *b) {
    for (int i = 1; i < b->n_order; i++) {
        int x = b->order[i], j = i - 1;
        while (j >= 0 && cost_of(b, b->order[j]) < cost_of(b, x)) {
            b->order[j + 1] = b->order[j];
            j--;
        }
        b->order[j + 1] = x;
    }
}

/* Runs the batch on pool (see the file's comment). */
static void run_batch(Batch *b, ColiComputePool *pool) {
    int threads = pool ? coli_compute_pool_threads(pool) : 1;
    int64_t left = 0;
    sort_order(b);
    for (int i = 0; i < b->n_order; i++) left += cost_of(b, b->order[i]);
    int first = 0;
    /* One at a time on every thread while an expert is a share or more. */
    while (first < b->n_order && (threads == 1 || cost_of(b, b->order[first]) * threads >= left)) {
        int x = b->order[first++];
        left -= cost_of(b, x);
        int rc = b->kernels[x]->ffn(&b->experts[x], &b->calls[x], pool, b->err, sizeof b->err);
        if (rc) {
            b->rc = rc;
            b->at = x;
            return;
        }
    }
    if (first == b->n_order) return;
    atomic_store(&b->next, first);
    coli_compute_pool_run(pool, run_experts, b);
}

/* ---- the calls -------------------------------------------------------- */

static int elem_size(ColiTensorFormat f) {
    return f == COLI_TENSOR_F32 ? 4 : f == COLI_TENSOR_BF16 ? 2 : 0;
}

/* Checks rows (count + 1 offsets from 0 to the call's tokens, nondecreasing;
 * NULL for one expert: all rows) and that out does not overlap x over the
 * rows' span of hidden elements each. */
static int check_rows(const ColiFfnCall *c, const int64_t *rows, int count, int64_t hidden,
                      char *err, size_t n) {
    int xs = elem_size(c->x_format), os = elem_size(c->out_format);
    if (!xs || !os)
        return coli_fail(err, n, COLI_EINVAL, "x and out must be F32 or BF16 (formats %d and %d)",
                         (int)c->x_format, (int)c->out_format);
    if (c->tokens < 0 || c->tokens > ((int64_t)1 << 40) || c->x_stride < hidden ||
        c->out_stride < hidden || c->x_stride > ((int64_t)1 << 40) || c->out_stride > ((int64_t)1 << 40))
        return coli_fail(err, n, COLI_EINVAL, "call: %lld tokens, strides %lld (x) and %lld (out) "
                         "for hidden %lld", (long long)c->tokens, (long long)c->x_stride,
                         (long long)c->out_stride, (long long)hidden);
    if (!rows && count != 1)
        return coli_fail(err, n, COLI_EINVAL, "%d experts need their rows", count);
    if (rows && (rows[0] != 0 || rows[count] != c->tokens))
        return coli_fail(err, n, COLI_EINVAL, "rows run from %lld to %lld, not 0 to the call's %lld "
                         "tokens", (long long)rows[0], (long long)rows[count], (long long)c->tokens);
    for (int i = 0; rows && i < count; i++)
        if (rows[i + 1] < rows[i])
            return coli_fail(err, n, COLI_EINVAL, "rows[%d] = %lld is less than rows[%d] = %lld",
                             i + 1, (long long)rows[i + 1], i, (long long)rows[i]);
    if (c->tokens == 0) return COLI_OK;
    if (!c->x || !c->out) return coli_fail(err, n, COLI_EINVAL, "call: x or out is NULL");
    /* The spans x and out cover, checked for overflow (strides and tokens are only bounded). */
    uint64_t xspan, ospan;
    if (__builtin_mul_overflow((uint64_t)(c->tokens - 1), (uint64_t)c->x_stride, &xspan) ||
        __builtin_mul_overflow((uint64_t)(c->tokens - 1), (uint64_t)c->out_stride, &ospan) ||
        xspan > UINT64_MAX / 8 || ospan > UINT64_MAX / 8)
        return coli_fail(err, n, COLI_EINVAL, "call: %lld rows of these strides do not fit in memory",
                         (long long)c->tokens);
    uintptr_t x0 = (uintptr_t)c->x, o0 = (uintptr_t)c->out;
    uintptr_t x1 = x0 + (uintptr_t)((xspan + (uint64_t)hidden) * (uint64_t)xs);
    uintptr_t o1 = o0 + (uintptr_t)((ospan + (uint64_t)hidden) * (uint64_t)os);
    if (x0 < o1 && o0 < x1) return coli_fail(err, n, COLI_EINVAL, "out overlaps x");
    return COLI_OK;
}

/* Expert i's call: rows [rows[i], rows[i + 1]) of c. */
static ColiFfnCall rows_call(const ColiFfnCall *c, const int64_t *rows, int i) {
    ColiFfnCall sub = *c;
    if (!rows) return sub;
    sub.tokens = rows[i + 1] - rows[i];
    if (sub.tokens == 0) return sub;    /* skipped */
    sub.x = (const char *)c->x + rows[i] * c->x_stride * elem_size(c->x_format);
    sub.out = (char *)c->out + rows[i] * c->out_stride * elem_size(c->out_format);
    return sub;
}

/* The hidden size of a slot's expert: down's outputs. */
static int64_t hidden_of(const LsSlot *v, const LsEntry *en) {
    return (en->src.flags & COLI_SOURCE_IN_OUT) ? v->view.down.columns : v->view.down.rows;
}

/* Fills the batch from the held slots and runs it. */
static int compute(Batch *b, LsSlot **slots, int count, const int64_t *rows, const ColiFfnCall *c,
                   int activation, float alpha, float limit, ColiComputePool *pool, char *err,
                   size_t n) {
    for (int i = 0; i < count; i++) {
        const LsEntry *en = &slots[i]->layer->entries[slots[i]->expert];
        int rc = fill_expert(&b->experts[i], slots[i], en, activation, alpha, limit, err, n);
        if (rc == COLI_OK && i == 0) rc = check_rows(c, rows, count, hidden_of(slots[0], en), err, n);
        if (rc) return rc;
        b->kernels[i] = coli_format_info(slots[i]->view.gate.format)->kernel;
        b->calls[i] = rows_call(c, rows, i);
        if (b->calls[i].tokens > 0) b->order[b->n_order++] = i;
    }
    run_batch(b, pool);
    if (b->rc)
        return coli_fail(err, n, b->rc, "layer %d expert %d: %s", slots[b->at]->layer->id,
                         slots[b->at]->expert, b->err);
    return COLI_OK;
}

int ls_expert_ffn(LsStore *s, const ColiExpertView *views, int count, const int64_t *rows,
                  const ColiFfnCall *call, int activation, float alpha, float limit,
                  ColiComputePool *pool, char *err, size_t n) {
    if (!views || !call || count < 1)
        return coli_fail(err, n, COLI_EINVAL, "expert ffn: %d views, views %p, call %p", count,
                         (const void *)views, (const void *)call);
    if (s->replay) return coli_fail(err, n, COLI_EINVAL, "a replay store holds no bytes to compute");
    LsLayer *L;
    int rc = batch_layer(s, views, count, &L, err, n);
    if (rc) return rc;
    if (!ls_call_enter(s, &L->calls)) return coli_fail(err, n, COLI_ECLOSED, "the store is closed");
    bool small = count <= FFN_ON_STACK;
    LsSlot *slots_s[FFN_ON_STACK];
    ColiFfnExpert experts_s[FFN_ON_STACK];
    ColiFfnCall calls_s[FFN_ON_STACK];
    const ColiFormatKernel *kernels_s[FFN_ON_STACK];
    int order_s[FFN_ON_STACK];
    Batch b = {0};
    LsSlot **slots = small ? slots_s : malloc(sizeof(LsSlot *) * (size_t)count);
    b.experts = small ? experts_s : malloc(sizeof(ColiFfnExpert) * (size_t)count);
    b.calls = small ? calls_s : malloc(sizeof(ColiFfnCall) * (size_t)count);
    b.kernels = small ? kernels_s : malloc(sizeof(ColiFormatKernel *) * (size_t)count);
    b.order = small ? order_s : malloc(sizeof(int) * (size_t)count);
    rc = slots && b.experts && b.calls && b.kernels && b.order
             ? hold_views(L, views, count, slots, err, n)
                 : coli_fail(err, n, COLI_ENOMEM, "expert ffn: out of memory for %d experts", count);
    if (rc == COLI_OK) {
        rc = compute(&b, slots, count, rows, call, activation, alpha, limit, pool, err, n);
        unhold_views(L, slots, count);
    }
    if (!small) {
        free(slots);
        free(b.experts);
        free(b.calls);
        free(b.kernels);
        free(b.order);
    }
    ls_call_leave(&L->calls);
    return rc;
}

int ls_ffn_expert(LsStore *s, const ColiExpertView *view, int activation, float alpha,
                  float limit, ColiFfnExpert *out, char *err, size_t n) {
    if (!view || !out) return coli_fail(err, n, COLI_EINVAL, "ffn_expert: NULL view or out");
    memset(out, 0, sizeof *out);
    if (s->replay) return coli_fail(err, n, COLI_EINVAL, "a replay store holds no bytes to compute");
    LsLayer *L;
    int rc = batch_layer(s, view, 1, &L, err, n);
    if (rc) return rc;
    if (!ls_call_enter(s, &L->calls)) return coli_fail(err, n, COLI_ECLOSED, "the store is closed");
    LsSlot *v;
    rc = hold_views(L, view, 1, &v, err, n);
    if (rc == COLI_OK) {
        rc = fill_expert(out, v, &L->entries[v->expert], activation, alpha, limit, err, n);
        unhold_views(L, &v, 1);
    }
    ls_call_leave(&L->calls);
    if (rc) memset(out, 0, sizeof *out);
    return rc;
}
