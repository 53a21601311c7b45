/*
 * ls_api.c: the store's public entry points (coli_store.h). Each checks
 * that its handle is a store of this library (ls_store_of: its ops are
 * ls_ops), answers what a foreign or NULL handle gets, and calls the file
 * that does the job; ls_internal.h says which file that is.
 */
#include "ls_internal.h"

#include "coli_store.h"

const ColiExpertStoreOps ls_ops = {
    .lookup = ls_lookup_op,
    .release = ls_release_op,
    .prefetch = ls_prefetch_op,
    .stats = ls_stats_op,
    .destroy = ls_destroy_op,
};

int coli_store_create(const ColiStoreConfig *config, ColiExpertStore **out, char *err, size_t n) {
    if (!out) return coli_fail(err, n, COLI_EINVAL, "create: out is NULL");
    *out = NULL;
    if (!config) return coli_fail(err, n, COLI_EINVAL, "create: config is NULL");
    LsStore *s;
    int rc = ls_create(config, &s, err, n);
    if (rc != COLI_OK) return rc;
    s->base.ops = &ls_ops;
    s->base.state = s;
    *out = &s->base;
    return COLI_OK;
}

int coli_store_plan_slots(const ColiStoreConfig *config, uint32_t *out, int n_out, char *err, size_t n) {
    if (!config) return coli_fail(err, n, COLI_EINVAL, "plan_slots: config is NULL");
    if (n_out < 0 || (n_out > 0 && !out)) return coli_fail(err, n, COLI_EINVAL, "plan_slots: bad out array");
    return ls_plan_slots(config, out, n_out, err, n);
}

int coli_store_close(ColiExpertStore *store, char *err, size_t n) {
    LsStore *s = ls_store_of(store);
    if (!s) return coli_fail(err, n, COLI_EINVAL, "close: not an expert store of this library");
    return ls_close(s, err, n);
}

/* ---- lookups ---------------------------------------------------------- */

/* What a lookup through a handle that is not a store of ours gets. */
static int not_a_store(ColiExpertView *views, int count, const char *what, char *err, size_t n) {
    if (views && count > 0) memset(views, 0, sizeof(*views) * (size_t)count);
    return coli_fail(err, n, COLI_EINVAL, "%s: not an expert store of this library", what);
}

int coli_store_lookup(ColiExpertStore *store, int layer, int expert, ColiExpertView *view,
                      char *err, size_t n) {
    LsStore *s = ls_store_of(store);
    if (!s) return not_a_store(view, 1, "lookup", err, n);
    return ls_lookup(s, layer, expert, view, false, err, n);
}

int coli_store_lookup_resident(ColiExpertStore *store, int layer, int expert, ColiExpertView *view) {
    LsStore *s = ls_store_of(store);
    if (!s) {
        not_a_store(view, 1, "lookup", NULL, 0);
        return COLI_EAGAIN;
    }
    return ls_lookup(s, layer, expert, view, true, NULL, 0) == COLI_OK ? COLI_OK : COLI_EAGAIN;
}

int coli_store_lookup_many(ColiExpertStore *store, int layer, const int *experts, int count,
                           ColiExpertView *views, char *err, size_t n) {
    LsStore *s = ls_store_of(store);
    if (!s) return not_a_store(views, count, "lookup_many", err, n);
    return ls_lookup_many(s, layer, experts, count, views, err, n);
}

int coli_store_replay(ColiExpertStore *store, const int *layers, int n_layers,
                      const int32_t *experts, int64_t n_tokens, int k, char *err, size_t n) {
    LsStore *s = ls_store_of(store);
    if (!s) return not_a_store(NULL, 0, "replay", err, n);
    return ls_replay(s, layers, n_layers, experts, n_tokens, k, err, n);
}

static const ColiLeaseEntryPoints LEASE_ENTRY_POINTS = {
    .lookup = coli_store_lookup,
    .lookup_resident = coli_store_lookup_resident,
    .lookup_many = coli_store_lookup_many,
    .view_layout = coli_view_layout,
};

const ColiLeaseEntryPoints *coli_lease_entry_points(void) { return &LEASE_ENTRY_POINTS; }

/* ---- prefetch and waits ------------------------------------------------ */

int coli_store_retire_prefetches(ColiExpertStore *store, int layer, const int *keep, int n_keep) {
    LsStore *s = ls_store_of(store);
    LsLayer *L = s ? ls_find_layer(s, layer) : NULL;
    return L ? ls_retire_prefetches(s, L, keep, n_keep) : 0;
}

int coli_store_start_reads(ColiExpertStore *store, int layer, const int *experts, int count) {
    LsStore *s = ls_store_of(store);
    LsLayer *L = s ? ls_find_layer(s, layer) : NULL;
    return L ? ls_start_reads(s, L, experts, count) : 0;
}

int coli_store_wait_idle(ColiExpertStore *store, int layer, int64_t timeout_ns) {
    LsStore *s = ls_store_of(store);
    return s ? ls_wait_idle(s, layer, timeout_ns) : COLI_EINVAL;
}

uint64_t coli_store_prefetch_pauses(ColiExpertStore *store) {
    LsStore *s = ls_store_of(store);
    return s ? atomic_load(&s->prefetch_pauses) : 0;
}

/* ---- counters and facts ------------------------------------------------ */

int coli_store_layer_stats(ColiExpertStore *store, int layer, ColiExpertStoreStats *out) {
    LsStore *s = ls_store_of(store);
    LsLayer *L = s ? ls_find_layer(s, layer) : NULL;
    if (!out) return COLI_EINVAL;
    memset(out, 0, sizeof(*out));
    if (!L) return COLI_ENOTFOUND;
    ls_add_layer_stats(L, out);
    return COLI_OK;
}

int coli_store_expert_requests(ColiExpertStore *store, int layer, uint64_t *out, int n) {
    LsStore *s = ls_store_of(store);
    LsLayer *L = s ? ls_find_layer(s, layer) : NULL;
    if (out && n > 0) memset(out, 0, sizeof(*out) * (size_t)n);
    return L ? ls_expert_requests(L, out, n) : 0;
}

int coli_store_pinned(ColiExpertStore *store, ColiExpertKey *out, int n) {
    LsStore *s = ls_store_of(store);
    return s ? ls_pinned(s, out, n) : 0;
}

int coli_store_expert_parts(ColiExpertStore *store, int layer, int expert, uint64_t *out, int cap) {
    LsStore *s = ls_store_of(store);
    LsLayer *L = s ? ls_find_layer(s, layer) : NULL;
    const LsEntry *e = L ? ls_find_entry(L, expert) : NULL;
    return e ? ls_expert_parts(e, out, cap) : COLI_ENOTFOUND;
}

uint64_t coli_store_active_leases(ColiExpertStore *store) {
    LsStore *s = ls_store_of(store);
    return s ? ls_active_leases(s) : 0;
}

int coli_store_layer_slots(ColiExpertStore *store, int layer) {
    LsStore *s = ls_store_of(store);
    LsLayer *L = s ? ls_find_layer(s, layer) : NULL;
    return L ? L->n_slots : 0;   /* fixed at creation: no lock */
}

int coli_store_direct_io_fallback(ColiExpertStore *store) {
    LsStore *s = ls_store_of(store);
    return s ? s->files.direct_fallback : 0;
}

/* ---- leased experts computed ------------------------------------------- */

int coli_store_ffn_expert(ColiExpertStore *store, const ColiExpertView *view, int activation,
                          float alpha, float limit, ColiFfnExpert *out, char *err, size_t n) {
    LsStore *s = ls_store_of(store);
    if (!s) {
        if (out) memset(out, 0, sizeof *out);
        return coli_fail(err, n, COLI_EINVAL, "ffn_expert: not an expert store of this library");
    }
    return ls_ffn_expert(s, view, activation, alpha, limit, out, err, n);
}

int coli_store_expert_ffn(ColiExpertStore *store, const ColiExpertView *views, int count,
                          const int64_t *rows, const ColiFfnCall *call, int activation,
                          float alpha, float limit, ColiComputePool *pool, char *err, size_t n) {
    LsStore *s = ls_store_of(store);
    if (!s) return coli_fail(err, n, COLI_EINVAL, "expert ffn: not an expert store of this library");
    return ls_expert_ffn(s, views, count, rows, call, activation, alpha, limit, pool, err, n);
}

int coli_store_moe_ffn(ColiExpertStore *store, const ColiExpertView *views, int count,
                       const ColiMoeCall *call, int activation, float alpha, float limit,
                       ColiComputePool *pool, char *err, size_t n) {
    LsStore *s = ls_store_of(store);
    if (!s) return coli_fail(err, n, COLI_EINVAL, "moe ffn: not an expert store of this library");
    return ls_moe_ffn(s, views, count, call, activation, alpha, limit, pool, err, n);
}
