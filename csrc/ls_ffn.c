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
#include <string.h>

#include "coli_kernels.h"
#include "compute_pool.h"
#include "gptq_group_order.h"
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
               ((en->src.flags & COLI_SOURCE_ZERO_PLUS_ONE) ? COLI_FFN_ZERO_PLUS_ONE : 0) |
               (t->format == COLI_TENSOR_INT4_GPTQ ? COLI_FFN_ORDER_CHECKED : 0);
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

/* Fills the batch's experts and kernels from the held slots. */
static int fill_batch(Batch *b, LsSlot **slots, int count, int activation, float alpha, float limit,
                      char *err, size_t n) {
    for (int i = 0; i < count; i++) {
        const LsEntry *en = &slots[i]->layer->entries[slots[i]->expert];
        int rc = fill_expert(&b->experts[i], slots[i], en, activation, alpha, limit, err, n);
        if (rc) return rc;
        b->kernels[i] = coli_format_info(slots[i]->view.gate.format)->kernel;
    }
    return COLI_OK;
}

/* Runs the batch whose calls are set (an expert without rows is skipped). */
static int run_calls(Batch *b, LsSlot **slots, int count, ColiComputePool *pool, char *err,
                     size_t n) {
    for (int i = 0; i < count; i++)
        if (b->calls[i].tokens > 0) b->order[b->n_order++] = i;
    run_batch(b, pool);
    if (b->rc)
        return coli_fail(err, n, b->rc, "layer %d expert %d: %s", slots[b->at]->layer->id,
                         slots[b->at]->expert, b->err);
    return COLI_OK;
}

/* Fills the batch from the held slots, each expert on its rows, and runs it. */
static int compute(Batch *b, LsSlot **slots, int count, const int64_t *rows, const ColiFfnCall *c,
                   int activation, float alpha, float limit, ColiComputePool *pool, char *err,
                   size_t n) {
    int rc = fill_batch(b, slots, count, activation, alpha, limit, err, n);
    if (rc == COLI_OK)
        rc = check_rows(c, rows, count, hidden_of(slots[0], &slots[0]->layer->entries[slots[0]->expert]),
                        err, n);
    if (rc) return rc;
    for (int i = 0; i < count; i++) b->calls[i] = rows_call(c, rows, i);
    return run_calls(b, slots, count, pool, err, n);
}

/* A batch's memory: on the stack for a few experts, else allocated. */
typedef struct {
    LsSlot *slots_s[FFN_ON_STACK];
    ColiFfnExpert experts_s[FFN_ON_STACK];
    ColiFfnCall calls_s[FFN_ON_STACK];
    const ColiFormatKernel *kernels_s[FFN_ON_STACK];
    int order_s[FFN_ON_STACK];
    LsSlot **slots;
} BatchMemory;

/* Points b and m->slots at memory for count experts; COLI_ENOMEM (nothing
 * to free) when an allocation fails. */
static int batch_alloc(BatchMemory *m, Batch *b, int count, char *err, size_t n) {
    bool small = count <= FFN_ON_STACK;
    m->slots = small ? m->slots_s : malloc(sizeof(LsSlot *) * (size_t)count);
    b->experts = small ? m->experts_s : malloc(sizeof(ColiFfnExpert) * (size_t)count);
    b->calls = small ? m->calls_s : malloc(sizeof(ColiFfnCall) * (size_t)count);
    b->kernels = small ? m->kernels_s : malloc(sizeof(ColiFormatKernel *) * (size_t)count);
    b->order = small ? m->order_s : malloc(sizeof(int) * (size_t)count);
    if (m->slots && b->experts && b->calls && b->kernels && b->order) return COLI_OK;
    if (!small) {
        free(m->slots);
        free(b->experts);
        free(b->calls);
        free(b->kernels);
        free(b->order);
    }
    return coli_fail(err, n, COLI_ENOMEM, "expert ffn: out of memory for %d experts", count);
}

static void batch_free(BatchMemory *m, Batch *b) {
    if (m->slots == m->slots_s) return;
    free(m->slots);
    free(b->experts);
    free(b->calls);
    free(b->kernels);
    free(b->order);
}

/* A computation on a batch of held slots: expert_ffn's (each view on its
 * rows of call) or moe_ffn's (the pairs of moe among the views' experts). */
typedef struct {
    const int64_t *rows;
    const ColiFfnCall *call;
    const ColiMoeCall *moe;
    int activation;
    float alpha, limit;
} Job;

typedef int (*BatchJob)(Batch *b, LsLayer *L, LsSlot **slots, const ColiExpertView *views, int count,
                        const Job *job, ColiComputePool *pool, char *err, size_t n);

/* Holds the views' slots (all of one layer of s) for job and runs it on a
 * batch; what names the call in messages. */
static int run_held(LsStore *s, const ColiExpertView *views, int count, const void *call,
                    const char *what, BatchJob run, const Job *job, ColiComputePool *pool,
                    char *err, size_t n) {
    if (!views || !call || count < 1)
        return coli_fail(err, n, COLI_EINVAL, "%s: %d views, views %p, call %p", what, count,
                         (const void *)views, call);
    if (s->replay) return coli_fail(err, n, COLI_EINVAL, "a replay store holds no bytes to compute");
    LsLayer *L;
    int rc = batch_layer(s, views, count, &L, err, n);
    if (rc) return rc;
    if (!ls_call_enter(s, &L->calls)) return coli_fail(err, n, COLI_ECLOSED, "the store is closed");
    BatchMemory m;
    Batch b = {0};
    rc = batch_alloc(&m, &b, count, err, n);
    if (rc == COLI_OK) {
        rc = hold_views(L, views, count, m.slots, err, n);
        if (rc == COLI_OK) {
            rc = run(&b, L, m.slots, views, count, job, pool, err, n);
            unhold_views(L, m.slots, count);
        }
        batch_free(&m, &b);
    }
    ls_call_leave(&L->calls);
    return rc;
}

static int run_rows(Batch *b, LsLayer *L, LsSlot **slots, const ColiExpertView *views, int count,
                    const Job *j, ColiComputePool *pool, char *err, size_t n) {
    (void)L;
    (void)views;
    return compute(b, slots, count, j->rows, j->call, j->activation, j->alpha, j->limit, pool, err, n);
}

int ls_expert_ffn(LsStore *s, const ColiExpertView *views, int count, const int64_t *rows,
                  const ColiFfnCall *call, int activation, float alpha, float limit,
                  ColiComputePool *pool, char *err, size_t n) {
    Job job = {.rows = rows, .call = call, .activation = activation, .alpha = alpha, .limit = limit};
    return run_held(s, views, count, call, "expert ffn", run_rows, &job, pool, err, n);
}

/* ---- a MoE layer's pairs ------------------------------------------------
 *
 * coli_store_moe_ffn computes, for the views of one lease group, the pairs
 * (token t, position j) routed to their experts, each into its own row
 * t * k + j of call->pairs. An expert with one pair reads its token's row
 * of x and writes its pair's row in place; an expert with more has its rows
 * gathered into scratch and its outputs scattered back, since the kernels
 * take evenly spaced rows. Which rows an expert gets does not change a
 * row's bits (the kernels' sums do not depend on the batch), and
 * coli_moe_combine adds a token's pairs in position order, so a token's
 * result is the same alone or in any batch, whatever the lease groups. */

/* The pairs of each view: pairs[start[i] .. start[i + 1]) are view i's, in
 * pair order. The first view of an expert takes its pairs (a view repeated
 * gets none). */
typedef struct {
    int64_t *start;               /* count + 1 */
    int64_t *pairs;               /* the pairs of the views' experts */
    int64_t gathered;             /* rows of the views with more than one pair */
} PairPlan;

/* Plans the pairs of call among the views' experts (the layer has
 * n_entries). COLI_ENOMEM; the caller frees plan's arrays either way. */
static int plan_pairs(PairPlan *plan, const ColiExpertView *views, int count, const ColiMoeCall *call,
                      int n_entries, char *err, size_t n) {
    int64_t total = call->tokens * call->k;
    int *view_of = malloc(sizeof(int) * (size_t)n_entries);
    plan->start = calloc((size_t)count + 1, sizeof(int64_t));
    plan->pairs = NULL;
    if (!view_of || !plan->start) {
        free(view_of);
        return coli_fail(err, n, COLI_ENOMEM, "moe ffn: out of memory for %d experts", n_entries);
    }
    for (int e = 0; e < n_entries; e++) view_of[e] = -1;
    for (int i = count - 1; i >= 0; i--) view_of[views[i].key.expert] = i;
    for (int64_t p = 0; p < total; p++) {
        int64_t e = call->index[p];
        if (e >= 0 && e < n_entries && view_of[e] >= 0) plan->start[view_of[e] + 1]++;
    }
    plan->gathered = 0;
    for (int i = 0; i < count; i++) {
        int64_t m = plan->start[i + 1];
        if (m > 1) plan->gathered += m;
        plan->start[i + 1] += plan->start[i];
    }
    plan->pairs = malloc(sizeof(int64_t) * (size_t)(plan->start[count] ? plan->start[count] : 1));
    int64_t *fill = calloc((size_t)count, sizeof(int64_t));
    if (!plan->pairs || !fill) {
        free(view_of);
        free(fill);
        return coli_fail(err, n, COLI_ENOMEM, "moe ffn: out of memory for %lld pairs",
                         (long long)total);
    }
    for (int64_t p = 0; p < total; p++) {
        int64_t e = call->index[p];
        if (e < 0 || e >= n_entries || view_of[e] < 0) continue;
        int i = view_of[e];
        plan->pairs[plan->start[i] + fill[i]++] = p;
    }
    free(view_of);
    free(fill);
    return COLI_OK;
}

/* Checks call for experts of hidden inputs: its sizes, formats, strides,
 * and that the pairs' rows do not overlap x. */
static int check_moe_call(const ColiMoeCall *c, int64_t hidden, char *err, size_t n) {
    int xs = elem_size(c->x_format);
    if (!c->index || !c->x || !c->pairs || !xs)
        return coli_fail(err, n, COLI_EINVAL, "moe ffn: index, x and pairs are needed, x F32 or "
                         "BF16 (format %d)", (int)c->x_format);
    uint64_t xspan, pspan;
    if (c->tokens < 1 || c->k < 1 || c->tokens > ((int64_t)1 << 32) || c->k > 4096 ||
        c->x_stride < hidden || c->x_stride > ((int64_t)1 << 32) ||
        __builtin_mul_overflow((uint64_t)(c->tokens - 1), (uint64_t)c->x_stride, &xspan) ||
        __builtin_mul_overflow((uint64_t)(c->tokens * c->k), (uint64_t)hidden * 4, &pspan) ||
        xspan > UINT64_MAX / 8 - (uint64_t)hidden)
        return coli_fail(err, n, COLI_EINVAL, "moe ffn: %lld tokens of %lld pairs, x stride %lld "
                         "for hidden %lld", (long long)c->tokens, (long long)c->k,
                         (long long)c->x_stride, (long long)hidden);
    uintptr_t x0 = (uintptr_t)c->x, p0 = (uintptr_t)c->pairs;
    uintptr_t x1 = x0 + (uintptr_t)((xspan + (uint64_t)hidden) * (uint64_t)xs), p1 = p0 + (uintptr_t)pspan;
    if (x0 < p1 && p0 < x1) return coli_fail(err, n, COLI_EINVAL, "moe ffn: pairs overlap x");
    return COLI_OK;
}

/* Sets each view's call: in place for one pair, else on gathered rows of
 * scratch (plan->gathered rows of x, then as many of floats). */
static void moe_calls(Batch *b, const PairPlan *plan, int count, const ColiMoeCall *c, int64_t hidden,
                      unsigned char *scratch) {
    size_t xs = (size_t)elem_size(c->x_format), xrow = (size_t)hidden * xs;
    unsigned char *gx = scratch;
    float *gy = (float *)(scratch + (size_t)plan->gathered * xrow);
    for (int i = 0; i < count; i++) {
        int64_t m = plan->start[i + 1] - plan->start[i];
        const int64_t *pairs = plan->pairs + plan->start[i];
        ColiFfnCall *call = &b->calls[i];
        *call = (ColiFfnCall){.x_format = c->x_format, .x_stride = hidden, .out_format = COLI_TENSOR_F32,
                              .out_stride = hidden, .tokens = m, .isa = c->isa};
        if (m == 1) {
            call->x = (const unsigned char *)c->x + (size_t)(pairs[0] / c->k * c->x_stride) * xs;
            call->out = c->pairs + pairs[0] * hidden;
        } else if (m > 1) {
            for (int64_t r = 0; r < m; r++)
                memcpy(gx + (size_t)r * xrow,
                       (const unsigned char *)c->x + (size_t)(pairs[r] / c->k * c->x_stride) * xs, xrow);
            call->x = gx;
            call->out = gy;
            gx += (size_t)m * xrow;
            gy += m * hidden;
        }
    }
}

/* Copies the gathered experts' outputs to their pairs' rows. */
static void moe_scatter(const PairPlan *plan, int count, const ColiMoeCall *c, int64_t hidden,
                        const unsigned char *scratch) {
    const float *gy = (const float *)(scratch + (size_t)plan->gathered * (size_t)hidden *
                                                    (size_t)elem_size(c->x_format));
    for (int i = 0; i < count; i++) {
        int64_t m = plan->start[i + 1] - plan->start[i];
        if (m < 2) continue;
        for (int64_t r = 0; r < m; r++, gy += hidden)
            memcpy(c->pairs + plan->pairs[plan->start[i] + r] * hidden, gy, sizeof(float) * (size_t)hidden);
    }
}

/* Fills the batch from the held slots, plans the pairs and runs them. */
static int moe_compute(Batch *b, LsLayer *L, LsSlot **slots, const ColiExpertView *views, int count,
                       const ColiMoeCall *c, int activation, float alpha, float limit,
                       ColiComputePool *pool, char *err, size_t n) {
    int rc = fill_batch(b, slots, count, activation, alpha, limit, err, n);
    int64_t hidden = hidden_of(slots[0], &L->entries[slots[0]->expert]);
    if (rc == COLI_OK) rc = check_moe_call(c, hidden, err, n);
    if (rc) return rc;
    PairPlan plan = {0};
    unsigned char *scratch = NULL;
    rc = plan_pairs(&plan, views, count, c, L->n_entries, err, n);
    if (rc == COLI_OK && plan.gathered) {
        scratch = malloc((size_t)plan.gathered * (size_t)hidden * ((size_t)elem_size(c->x_format) + 4));
        if (!scratch)
            rc = coli_fail(err, n, COLI_ENOMEM, "moe ffn: out of memory for %lld gathered rows",
                           (long long)plan.gathered);
    }
    if (rc == COLI_OK) {
        moe_calls(b, &plan, count, c, hidden, scratch);
        rc = run_calls(b, slots, count, pool, err, n);
        if (rc == COLI_OK && scratch) moe_scatter(&plan, count, c, hidden, scratch);
    }
    free(scratch);
    free(plan.start);
    free(plan.pairs);
    return rc;
}

static int run_moe(Batch *b, LsLayer *L, LsSlot **slots, const ColiExpertView *views, int count,
                   const Job *j, ColiComputePool *pool, char *err, size_t n) {
    return moe_compute(b, L, slots, views, count, j->moe, j->activation, j->alpha, j->limit, pool, err, n);
}

int ls_moe_ffn(LsStore *s, const ColiExpertView *views, int count, const ColiMoeCall *call,
               int activation, float alpha, float limit, ColiComputePool *pool, char *err, size_t n) {
    Job job = {.moe = call, .activation = activation, .alpha = alpha, .limit = limit};
    return run_held(s, views, count, call, "moe ffn", run_moe, &job, pool, err, n);
}

static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, NaN to the quiet NaN 0x7fc0 (as torch rounds). */
static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Token t's sum, in out_format at dst; acc is scratch of hidden floats. */
static void combine_token(const float *pairs, const void *weights, ColiTensorFormat wf, int64_t t,
                          int64_t k, int64_t hidden, float *acc, void *dst, ColiTensorFormat of) {
    for (int64_t j = 0; j < k; j++) {
        int64_t p = t * k + j;
        float w = wf == COLI_TENSOR_F32 ? ((const float *)weights)[p]
                                        : bf16_to_f32(((const uint16_t *)weights)[p]);
        const float *y = pairs + p * hidden;
        if (j == 0)
            for (int64_t h = 0; h < hidden; h++) acc[h] = w * y[h];
        else
            for (int64_t h = 0; h < hidden; h++) acc[h] = acc[h] + w * y[h];
    }
    if (of == COLI_TENSOR_F32) return;  /* acc is dst */
    uint16_t *o = dst;
    for (int64_t h = 0; h < hidden; h++) o[h] = f32_to_bf16(acc[h]);
}

int coli_moe_combine(const float *pairs, const void *weights, ColiTensorFormat weights_format,
                     int64_t tokens, int64_t k, int64_t hidden, void *out, ColiTensorFormat out_format,
                     char *err, size_t n) {
    if (!pairs || !weights || !out || tokens < 1 || k < 1 || hidden < 1 || tokens > ((int64_t)1 << 32) ||
        k > 4096 || hidden > ((int64_t)1 << 24) || !elem_size(weights_format) || !elem_size(out_format))
        return coli_fail(err, n, COLI_EINVAL, "moe combine: %lld tokens of %lld pairs of %lld, formats "
                         "%d (weights) and %d (out)", (long long)tokens, (long long)k,
                         (long long)hidden, (int)weights_format, (int)out_format);
    size_t os = (size_t)elem_size(out_format);
    uintptr_t p0 = (uintptr_t)pairs, p1 = p0 + (uintptr_t)(tokens * k * hidden) * 4;
    uintptr_t o0 = (uintptr_t)out, o1 = o0 + (uintptr_t)(tokens * hidden) * os;
    if (p0 < o1 && o0 < p1) return coli_fail(err, n, COLI_EINVAL, "moe combine: out overlaps pairs");
    float *acc = NULL;
    if (out_format != COLI_TENSOR_F32 && !(acc = malloc(sizeof(float) * (size_t)hidden)))
        return coli_fail(err, n, COLI_ENOMEM, "moe combine: out of memory");
    for (int64_t t = 0; t < tokens; t++) {
        void *dst = (unsigned char *)out + (size_t)(t * hidden) * os;
        combine_token(pairs, weights, weights_format, t, k, hidden, acc ? acc : dst, dst, out_format);
    }
    free(acc);
    return COLI_OK;
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

/* ---- group order ------------------------------------------------------ */

int ls_group_order(const LsEntry *e, unsigned char *mem, char *err, size_t n) {
    const ColiTensorSource *t[3] = {&e->src.gate, &e->src.up, &e->src.down};
    for (int j = 0; j < e->src.n_parts; j++) {
        const LsPart *p = &e->parts[j];
        if (p->kind != COLI_PART_G_IDX || p->role < 0 || p->role > 2) continue;
        const ColiTensorSource *m = t[p->role];
        if (m->format != COLI_TENSOR_INT4_GPTQ || p->nbytes != 4 * (uint64_t)m->rows) continue;
        char what[64];
        snprintf(what, sizeof what, "layer %d expert %d %s", e->src.layer, e->src.expert,
                 ROLE_NAMES[p->role]);
        int rc = coli_gptq_group_order(mem + e->plan.data_at[p->role], m->rows, m->columns,
                                       m->block_rows, mem + e->plan.part_at[j], what, err, n);
        if (rc < 0) return rc;
    }
    return COLI_OK;
}
