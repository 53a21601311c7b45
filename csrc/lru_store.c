/*
 * lru_store.c: the LRU store's life cycle: create (the configuration, the
 * layers and their experts, slot counts and slot memory, the I/O pool),
 * close, destroy and stats, and the small extras of lru_store.h.
 *
 * The store's other parts are in ls_*.c; ls_internal.h says which file
 * holds what, and ls_slots.h describes the slot state machine.
 */
#define _GNU_SOURCE               /* madvise(MADV_HUGEPAGE), with POSIX clocks and conditions */
#include "ls_internal.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "lru_test_hooks.h"

/* Adds layer L's counters to out. */
static void add_layer_stats(LsLayer *L, ColiExpertStoreStats *out) {
    pthread_mutex_lock(&L->mu);
    out->requests += L->c.requests;
    out->hits += L->c.hits;
    out->misses += L->c.misses;
    out->prefetched += L->c.prefetched;
    out->prefetch_hits += L->c.prefetch_hits;
    out->bytes_read += L->c.bytes_read;
    out->resident_bytes += L->resident_bytes;
    out->capacity_bytes += (uint64_t)L->n_slots * L->slot_bytes;
    out->inflight_joins += L->c.inflight_joins;
    out->loads_started += L->c.loads_started;
    out->loads_failed += L->c.loads_failed;
    out->evictions += L->c.evictions;
    out->slot_waits += L->c.slot_waits;
    out->persistent_hits += L->c.persistent_hits;
    out->transient_hits += L->c.hits - L->c.persistent_hits;
    pthread_mutex_unlock(&L->mu);
}

static void ls_stats_op(ColiExpertStore *store, ColiExpertStoreStats *out) {
    LsStore *s = ls_store_of(store);
    if (!out) return;
    memset(out, 0, sizeof(*out));
    if (!s) return;
    for (int i = 0; i < s->n_layers; i++) add_layer_stats(&s->layers[i], out);
    out->peak_inflight = atomic_load(&s->peak_inflight);
}

int coli_lru_layer_stats(ColiExpertStore *store, int layer, ColiExpertStoreStats *out) {
    LsStore *s = ls_store_of(store);
    LsLayer *L = s ? ls_find_layer(s, layer) : NULL;
    if (!out) return COLI_EINVAL;
    memset(out, 0, sizeof(*out));
    if (!L) return COLI_ENOTFOUND;
    add_layer_stats(L, out);
    return COLI_OK;
}

static void free_store(LsStore *s) {
    atomic_store(&s->stopping, 1);       /* preload jobs end */
    if (s->gate_ready) ls_set_hold(s, 0);   /* a held read would keep the pool from stopping */
    coli_pool_stop(&s->pool);
    for (int i = 0; i < s->n_layers; i++) {
        LsLayer *L = &s->layers[i];
        if (L->sync_ready) {
            pthread_cond_destroy(&L->cv);
            pthread_mutex_destroy(&L->mu);
        }
        if (L->pol_ready && L->policy->fini) L->policy->fini(L);
        free(L->arena);
        free(L->slots);
        free(L->entries);
        free(L->present);
        free(L->slot_of);
        free(L->requests_of);
    }
    free(s->preloads);
    free(s->preload_gens);
    free(s->layers);
    free(s->by_id);
    coli_files_close(&s->files);
    if (s->gate_ready) {
        pthread_cond_destroy(&s->gate_cv);
        pthread_mutex_destroy(&s->gate_mu);
    }
    free(s);
}

static void ls_destroy_op(ColiExpertStore *store) {
    LsStore *s = ls_store_of(store);
    if (!s) return;
    assert(coli_lru_active_leases(store) == 0 && "destroy with active leases (rule 5)");
    free_store(s);
}

const ColiExpertStoreOps ls_ops = {
    .lookup = ls_lookup_op,
    .release = ls_release_op,
    .prefetch = ls_prefetch_op,
    .stats = ls_stats_op,
    .destroy = ls_destroy_op,
};

/* ---- creation -------------------------------------------------------- */

/* A mutex and a condition on the monotonic clock (the one deadlines use).
 * Returns 1 if the mutex failed, 2 if the condition did (nothing left). */
static int init_sync(pthread_mutex_t *mu, pthread_cond_t *cv) {
    if (pthread_mutex_init(mu, NULL) != 0) return 1;
    pthread_condattr_t attr;
    bool bad = pthread_condattr_init(&attr) != 0;
    if (!bad) {
        bad = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) != 0 || pthread_cond_init(cv, &attr) != 0;
        pthread_condattr_destroy(&attr);
    }
    if (bad) pthread_mutex_destroy(mu);
    return bad ? 2 : 0;
}

static int init_layer_sync(LsLayer *L, char *err, size_t n) {
    int bad = init_sync(&L->mu, &L->cv);
    if (bad)
        return coli_fail(err, n, COLI_ETHREAD, "cannot create the %s of layer %d",
                         bad == 1 ? "mutex" : "condition", L->id);
    L->sync_ready = true;
    return COLI_OK;
}

static int init_gate(LsStore *s, char *err, size_t n) {
    int bad = init_sync(&s->gate_mu, &s->gate_cv);
    if (bad)
        return coli_fail(err, n, COLI_ETHREAD, "cannot create the demand gate's %s",
                         bad == 1 ? "mutex" : "condition");
    s->gate_ready = true;
    return COLI_OK;
}

/* Sorts and counts layers, fills entries with validated sources and plans. */
static int build_layers(LsStore *s, const ColiLruConfig *cfg, char *err, size_t n) {
    int max_id = -1;
    for (int i = 0; i < cfg->n_experts; i++) {
        const ColiExpertSource *x = &cfg->experts[i];
        if (x->layer < 0 || x->layer > LS_MAX_LAYER_ID || x->expert < 0 || x->expert > LS_MAX_EXPERT_ID)
            return coli_fail(err, n, COLI_ECONFIG, "expert %d of layer %d: index out of range",
                             x->expert, x->layer);
        if (x->layer > max_id) max_id = x->layer;
    }
    s->max_id = max_id;
    s->by_id = calloc((size_t)max_id + 1, sizeof(LsLayer *));
    int *max_expert = malloc(sizeof(int) * ((size_t)max_id + 1));
    if (!s->by_id || !max_expert) {
        free(max_expert);
        return coli_fail(err, n, COLI_ENOMEM, "out of memory indexing %d layers", max_id + 1);
    }
    for (int i = 0; i <= max_id; i++) max_expert[i] = -1;
    for (int i = 0; i < cfg->n_experts; i++) {
        const ColiExpertSource *x = &cfg->experts[i];
        if (x->expert > max_expert[x->layer]) max_expert[x->layer] = x->expert;
    }
    for (int i = 0; i <= max_id; i++) s->n_layers += max_expert[i] >= 0;
    /* aligned_alloc: LsLayer is cache-line aligned, calloc does not promise that */
    s->layers = aligned_alloc(_Alignof(LsLayer), sizeof(LsLayer) * (size_t)s->n_layers);
    if (s->layers) memset(s->layers, 0, sizeof(LsLayer) * (size_t)s->n_layers);
    if (!s->layers) {
        free(max_expert);
        return coli_fail(err, n, COLI_ENOMEM, "out of memory for %d layers", s->n_layers);
    }
    int k = 0;
    for (int id = 0; id <= max_id; id++) {
        if (max_expert[id] < 0) continue;
        LsLayer *L = &s->layers[k++];
        L->id = id;
        L->n_entries = max_expert[id] + 1;
        L->entries = calloc((size_t)L->n_entries, sizeof(LsEntry));
        L->present = calloc((size_t)L->n_entries, sizeof(bool));
        L->slot_of = calloc((size_t)L->n_entries, sizeof(LsSlot *));
        L->requests_of = calloc((size_t)L->n_entries, sizeof(uint64_t));
        s->by_id[id] = L;
        if (!L->entries || !L->present || !L->slot_of || !L->requests_of) {
            free(max_expert);
            return coli_fail(err, n, COLI_ENOMEM, "out of memory for layer %d", id);
        }
    }
    free(max_expert);
    for (int i = 0; i < cfg->n_experts; i++) {
        const ColiExpertSource *x = &cfg->experts[i];
        LsLayer *L = s->by_id[x->layer];
        LsEntry *e = &L->entries[x->expert];
        if (L->present[x->expert])
            return coli_fail(err, n, COLI_ECONFIG, "layer %d expert %d is listed twice", x->layer, x->expert);
        int rc = s->replay ? COLI_OK : coli_check_expert(&s->files, x, err, n);   /* no files */
        if (rc) return rc;
        rc = coli_plan_expert(x, s->direct, &e->plan, err, n);
        if (rc) return rc;
        e->src = *x;
        e->src.parts = NULL;          /* the caller's array; the plan has what loads need */
        L->present[x->expert] = true;
    }
    return COLI_OK;
}

#define HUGE_PAGE (2u << 20)

/* Slot memory of one layer, page aligned for O_DIRECT. Arenas of 2 MiB or
 * more are 2 MiB aligned and advised to use transparent huge pages, so a
 * fresh cache does not take a page fault per 4 KiB on its first reads.
 * NULL when out of memory. */
static unsigned char *alloc_arena(size_t bytes) {
    void *arena = NULL;
    size_t align = bytes >= HUGE_PAGE ? HUGE_PAGE : COLI_IO_ALIGN;
    if (posix_memalign(&arena, align, bytes) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    if (align == HUGE_PAGE && madvise(arena, bytes / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE) != 0) {
        /* advisory: without huge pages the arena works the same, only slower to fill */
    }
#endif
    return arena;
}

/* Decides every layer's slot count and allocates slots and arenas (none
 * for a replay store). */
static int build_slots(LsStore *s, const ColiLruConfig *cfg, char *err, size_t n) {
    if (cfg->layer_slots && cfg->n_layer_slots != s->n_layers)
        return coli_fail(err, n, COLI_ECONFIG, "layer_slots gives %d slot counts for %d layers",
                         cfg->n_layer_slots, s->n_layers);
    uint64_t per_layer_budget = cfg->slots_per_layer ? 0 : cfg->capacity_bytes / (uint64_t)s->n_layers;
    for (int i = 0; i < s->n_layers; i++) {
        LsLayer *L = &s->layers[i];
        uint64_t footprint = 0;
        int present = 0;
        for (int x = 0; x < L->n_entries; x++) {
            if (!L->present[x]) continue;
            present++;
            if (L->entries[x].plan.footprint > footprint) footprint = L->entries[x].plan.footprint;
        }
        L->slot_bytes = (footprint + COLI_IO_ALIGN - 1) / COLI_IO_ALIGN * COLI_IO_ALIGN;
        uint64_t slots = cfg->slots_per_layer ? cfg->slots_per_layer : per_layer_budget / L->slot_bytes;
        if (cfg->layer_slots) {
            slots = cfg->layer_slots[i];
            if (slots == 0)
                return coli_fail(err, n, COLI_ECONFIG, "layer_slots gives layer %d no slot", L->id);
        }
        if (slots == 0)
            return coli_fail(err, n, COLI_ECONFIG,
                             "capacity_bytes %llu is too small: layer %d needs %llu bytes for one slot "
                             "(%llu for one slot in each of %d layers)",
                             (unsigned long long)cfg->capacity_bytes, L->id,
                             (unsigned long long)L->slot_bytes,
                             (unsigned long long)L->slot_bytes * (uint64_t)s->n_layers, s->n_layers);
        if (slots > (uint64_t)present) slots = (uint64_t)present;   /* more slots than experts is waste */
        L->n_slots = (int)slots;
        uint64_t arena_bytes;
        if (__builtin_mul_overflow(L->slot_bytes, slots, &arena_bytes) || arena_bytes > SIZE_MAX)
            return coli_fail(err, n, COLI_ENOMEM, "layer %d: %llu slots of %llu bytes overflow",
                             L->id, (unsigned long long)slots, (unsigned long long)L->slot_bytes);
        unsigned char *arena = s->replay ? NULL : alloc_arena((size_t)arena_bytes);
        if (!arena && !s->replay)
            return coli_fail(err, n, COLI_ENOMEM, "cannot allocate %llu bytes for the %d slots of layer %d",
                             (unsigned long long)arena_bytes, L->n_slots, L->id);
        L->arena = arena;
        L->slots = calloc((size_t)L->n_slots, sizeof(LsSlot));
        if (!L->slots)
            return coli_fail(err, n, COLI_ENOMEM, "out of memory for the slots of layer %d", L->id);
        L->policy = ls_policies[cfg->policy];
        L->pol_param = cfg->policy_param;
        L->list.next = L->list.prev = &L->list;
        if (L->policy->init) {
            int rc = L->policy->init(L, err, n);
            if (rc) return rc;
        }
        L->pol_ready = true;
        for (int j = 0; j < L->n_slots; j++) {
            LsSlot *v = &L->slots[j];
            v->layer = L;
            v->mem = L->arena ? L->arena + (size_t)j * L->slot_bytes : NULL;
            v->expert = -1;
            v->state = LS_EMPTY;
            v->generation = ls_next_generation(s);   /* never 0: a zeroed view never matches */
            ls_set_insert(L, v, true);
        }
        int rc = init_layer_sync(L, err, n);
        if (rc) return rc;
    }
    return COLI_OK;
}

/* Gives each layer's last warm experts, as many as it has unpinned slots,
 * a slot, QUEUED for ls_start_preloads. */
static int build_warm(LsStore *s, const ColiLruConfig *cfg, char *err, size_t n) {
    int *skip = calloc((size_t)s->n_layers, sizeof(int));   /* per layer: its warm experts to leave out */
    if (!skip) return coli_fail(err, n, COLI_ENOMEM, "out of memory for %d layers", s->n_layers);
    int rc = COLI_OK;
    for (int i = 0; i < cfg->n_warm && rc == COLI_OK; i++) {
        ColiExpertKey key = cfg->warm[i];
        LsLayer *L = ls_find_layer(s, key.layer);
        if (!L || !ls_find_entry(L, key.expert))
            rc = coli_fail(err, n, COLI_ECONFIG, "warm expert %d of layer %d is not in the model",
                           key.expert, key.layer);
        else
            skip[L - s->layers]++;
    }
    for (int i = 0; i < s->n_layers; i++) {
        int room = s->layers[i].n_slots - s->layers[i].n_pinned;
        skip[i] = skip[i] > room ? skip[i] - room : 0;
    }
    for (int i = 0; i < cfg->n_warm && rc == COLI_OK; i++) {
        ColiExpertKey key = cfg->warm[i];
        LsLayer *L = ls_find_layer(s, key.layer);
        if (skip[L - s->layers] > 0) {
            skip[L - s->layers]--;
            continue;
        }
        if (L->slot_of[key.expert]) {
            rc = coli_fail(err, n, COLI_ECONFIG, "expert %d of layer %d is %s", key.expert, key.layer,
                           L->slot_of[key.expert]->pinned ? "both pinned and warm" : "warm twice");
            break;
        }
        LsSlot *v = ls_victim(L);   /* EMPTY: empty slots go first, and one is left for each */
        ls_slot_preload(s, L, v, ls_find_entry(L, key.expert), key.expert, false);
        s->preload_gens[s->n_preloads] = v->generation;
        s->preloads[s->n_preloads++] = v;
    }
    free(skip);
    return rc;
}

/* Gives every pinned expert, then every warm one, a slot of its layer,
 * QUEUED for ls_start_preloads. */
static int build_preloads(LsStore *s, const ColiLruConfig *cfg, char *err, size_t n) {
    if (cfg->n_pinned < 0 || (cfg->n_pinned > 0 && !cfg->pinned))
        return coli_fail(err, n, COLI_ECONFIG, "config pins %d experts from a NULL list", cfg->n_pinned);
    if (cfg->n_warm < 0 || (cfg->n_warm > 0 && !cfg->warm))
        return coli_fail(err, n, COLI_ECONFIG, "config warms %d experts from a NULL list", cfg->n_warm);
    if (cfg->n_pinned > INT_MAX - cfg->n_warm)
        return coli_fail(err, n, COLI_ECONFIG, "config preloads too many experts");
    int total = cfg->n_pinned + cfg->n_warm;
    if (total == 0) return COLI_OK;
    s->preloads = calloc((size_t)total, sizeof(LsSlot *));
    s->preload_gens = calloc((size_t)total, sizeof(uint64_t));
    if (!s->preloads || !s->preload_gens)
        return coli_fail(err, n, COLI_ENOMEM, "out of memory for %d pinned and warm experts", total);
    for (int i = 0; i < cfg->n_pinned; i++) {
        ColiExpertKey key = cfg->pinned[i];
        LsLayer *L = ls_find_layer(s, key.layer);
        LsEntry *e = L ? ls_find_entry(L, key.expert) : NULL;
        if (!e)
            return coli_fail(err, n, COLI_ECONFIG, "pinned expert %d of layer %d is not in the model",
                             key.expert, key.layer);
        if (L->slot_of[key.expert])
            return coli_fail(err, n, COLI_ECONFIG, "expert %d of layer %d is pinned twice",
                             key.expert, key.layer);
        if (L->n_pinned == L->n_slots)
            return coli_fail(err, n, COLI_ECONFIG, "layer %d pins more experts than its %d slots",
                             L->id, L->n_slots);
        ls_slot_preload(s, L, ls_victim(L), e, key.expert, true);   /* every slot is EMPTY yet */
        LsSlot *v = L->slot_of[key.expert];
        s->preload_gens[s->n_preloads] = v->generation;
        s->preloads[s->n_preloads++] = v;
    }
    for (int i = 0; i < s->n_layers; i++) {
        LsLayer *L = &s->layers[i];
        int present = 0;
        for (int x = 0; x < L->n_entries; x++) present += L->present[x];
        if (L->n_pinned == L->n_slots && L->n_pinned < present)
            return coli_fail(err, n, COLI_ECONFIG,
                             "layer %d pins all its %d slots, leaving none for its other %d experts",
                             L->id, L->n_slots, present - L->n_pinned);
    }
    return cfg->n_warm > 0 ? build_warm(s, cfg, err, n) : COLI_OK;
}

int coli_lru_store_create(const ColiLruConfig *cfg, ColiExpertStore **out, char *err, size_t n) {
    if (!out) return coli_fail(err, n, COLI_EINVAL, "create: out is NULL");
    *out = NULL;
    if (!cfg) return coli_fail(err, n, COLI_EINVAL, "create: config is NULL");
    if (cfg->n_experts <= 0 || !cfg->experts)
        return coli_fail(err, n, COLI_ECONFIG, "config lists no experts");
    if (cfg->slots_per_layer == 0 && cfg->capacity_bytes == 0 && !cfg->layer_slots)
        return coli_fail(err, n, COLI_ECONFIG,
                         "config sets neither slots_per_layer nor capacity_bytes nor layer_slots");
    if (cfg->policy < 0 || !coli_lru_policy_name(cfg->policy))
        return coli_fail(err, n, COLI_ECONFIG, "unknown eviction policy %d", cfg->policy);
    LsStore *s = calloc(1, sizeof(LsStore));
    if (!s) return coli_fail(err, n, COLI_ENOMEM, "out of memory for the store");
    s->replay = cfg->replay != 0;
    s->direct = cfg->direct_io != 0 && !s->replay;
    s->wait_timeout_ns = cfg->slot_wait_timeout_ns;
    s->demand_first = cfg->prefetch_never_pauses == 0;
    uint64_t chunk = cfg->prefetch_chunk_bytes ? cfg->prefetch_chunk_bytes : LS_DEFAULT_PREFETCH_CHUNK;
    if (chunk < LS_MIN_PREFETCH_CHUNK) chunk = LS_MIN_PREFETCH_CHUNK;
    if (chunk > (1ull << 40)) chunk = 1ull << 40;   /* no overflow rounding up */
    s->prefetch_chunk = (chunk + COLI_IO_ALIGN - 1) / COLI_IO_ALIGN * COLI_IO_ALIGN;
    int rc = init_gate(s, err, n);
    if (rc == COLI_OK && !s->replay) {
        rc = coli_files_open(&s->files, cfg->files, cfg->n_files, s->direct, err, n);
        if (rc == COLI_OK)
            coli_files_tune(&s->files, cfg->read_chunk_bytes ? cfg->read_chunk_bytes : COLI_DEFAULT_READ_CHUNK,
                            cfg->read_without_advice == 0);
    }
    if (rc == COLI_OK) rc = build_layers(s, cfg, err, n);
    if (rc == COLI_OK) rc = build_slots(s, cfg, err, n);
    if (rc == COLI_OK) rc = build_preloads(s, cfg, err, n);
    if (rc == COLI_OK)
        rc = coli_pool_start(&s->pool, s->replay ? 0 : cfg->prefetch_workers,
                             cfg->prefetch_queue_depth ? cfg->prefetch_queue_depth : LS_DEFAULT_QUEUE_DEPTH,
                             ls_run_job, s, err, n);
    if (rc != COLI_OK) {
        free_store(s);
        return rc;
    }
    s->base.ops = &ls_ops;
    s->base.state = s;
    ls_start_preloads(s);
    *out = &s->base;
    return COLI_OK;
}

/* ---- extras ---------------------------------------------------------- */

int coli_lru_close(ColiExpertStore *store, char *err, size_t n) {
    LsStore *s = ls_store_of(store);
    if (!s) return coli_fail(err, n, COLI_EINVAL, "close: not an LRU expert store");
    if (atomic_exchange(&s->closed, 1)) return COLI_OK;   /* closed already */
    uint64_t calls = atomic_load(&s->prefetch_calls), leases = coli_lru_active_leases(store);
    for (int i = 0; i < s->n_layers; i++) calls += atomic_load(&s->layers[i].calls);
    if (calls || leases) {
        atomic_store(&s->closed, 0);
        return leases ? coli_fail(err, n, COLI_ELEASE,
                                  "cannot close the store: %llu leases are still held (release them, "
                                  "and delete arrays kept from them)", (unsigned long long)leases)
                      : coli_fail(err, n, COLI_ELEASE,
                                  "cannot close the store: %llu calls are in progress in other threads",
                                  (unsigned long long)calls);
    }
    atomic_store(&s->stopping, 1);   /* preload jobs end after the expert they load */
    ls_set_hold(s, 0);
    coli_pool_stop(&s->pool);     /* queued prefetches are dropped, running reads end first */
    for (int i = 0; i < s->n_layers; i++) {
        LsLayer *L = &s->layers[i];
        pthread_mutex_lock(&L->mu);
        for (int j = 0; j < L->n_slots; j++)   /* their jobs are gone: no load is left */
            if (L->slots[j].state == LS_QUEUED) ls_slot_empty(s, L, &L->slots[j]);
        pthread_mutex_unlock(&L->mu);
        free(L->arena);
        L->arena = NULL;
    }
    coli_files_close(&s->files);
    return COLI_OK;
}

int coli_lru_wait_idle(ColiExpertStore *store, int layer, int64_t timeout_ns) {
    LsStore *s = ls_store_of(store);
    if (!s) return COLI_EINVAL;
    struct timespec deadline;
    if (timeout_ns >= 0) ls_deadline_after(&deadline, timeout_ns);
    for (int i = 0; i < s->n_layers; i++) {
        LsLayer *L = &s->layers[i];
        if (layer >= 0 && L->id != layer) continue;
        pthread_mutex_lock(&L->mu);
        while (L->loading > 0) {
            if (ls_layer_wait(L, timeout_ns >= 0 ? &deadline : NULL) == ETIMEDOUT && L->loading > 0) {
                pthread_mutex_unlock(&L->mu);
                return COLI_ETIMEOUT;
            }
        }
        pthread_mutex_unlock(&L->mu);
    }
    return COLI_OK;
}

int coli_view_layout(const ColiExpertView *view, uint64_t out[8]) {
    if (!view || !view->lease || !out) return COLI_EINVAL;
    const ColiTensorView *t[3] = {&view->gate, &view->up, &view->down};
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (int i = 0; i < 3; i++) {
        uintptr_t d = (uintptr_t)t[i]->data, sc = (uintptr_t)t[i]->scales;
        if (!t[i]->data) continue;    /* up of a fused gate_up */
        if (d < lo) lo = d;
        if (d + t[i]->data_bytes > hi) hi = d + t[i]->data_bytes;
        if (t[i]->scales) {
            if (sc < lo) lo = sc;
            if (sc + t[i]->scale_bytes > hi) hi = sc + t[i]->scale_bytes;
        }
    }
    out[0] = lo;
    out[1] = hi - lo;
    for (int i = 0; i < 3; i++) {
        out[2 + i] = t[i]->data ? (uintptr_t)t[i]->data - lo : UINT64_MAX;
        out[5 + i] = t[i]->scales ? (uintptr_t)t[i]->scales - lo : UINT64_MAX;
    }
    return COLI_OK;
}

int coli_lru_expert_parts(ColiExpertStore *store, int layer, int expert, uint64_t *out, int cap) {
    LsStore *s = ls_store_of(store);
    LsLayer *L = s ? ls_find_layer(s, layer) : NULL;
    const LsEntry *e = L ? ls_find_entry(L, expert) : NULL;
    if (!e) return COLI_ENOTFOUND;
    bool fused = (e->src.flags & COLI_SOURCE_FUSED_GATE_UP) != 0;
    const ColiTensorSource *t[3] = {&e->src.gate, &e->src.up, &e->src.down};
    int total = 6 + e->plan.n_parts;
    for (int i = 0; i < total && i < cap; i++) {
        if (i < 3) out[i] = i == 1 && fused ? UINT64_MAX : e->plan.data_at[i];
        else if (i < 6) out[i] = t[i - 3]->scale_format == COLI_SCALE_NONE
                                     ? UINT64_MAX : e->plan.scales_at[i - 3];
        else out[i] = e->plan.part_at[i - 6];
    }
    return total;
}

uint64_t coli_lru_active_leases(ColiExpertStore *store) {
    LsStore *s = ls_store_of(store);
    uint64_t total = 0;
    for (int i = 0; s && i < s->n_layers; i++) {
        pthread_mutex_lock(&s->layers[i].mu);
        total += s->layers[i].leases;
        pthread_mutex_unlock(&s->layers[i].mu);
    }
    return total;
}

int coli_lru_layer_slots(ColiExpertStore *store, int layer) {
    LsStore *s = ls_store_of(store);
    LsLayer *L = s ? ls_find_layer(s, layer) : NULL;
    return L ? L->n_slots : 0;
}

uint64_t coli_lru_slot_bytes(ColiExpertStore *store, int layer) {
    LsStore *s = ls_store_of(store);
    LsLayer *L = s ? ls_find_layer(s, layer) : NULL;
    return L ? L->slot_bytes : 0;
}

void coli_lru_inject_read_fault(ColiExpertStore *store, uint64_t nth, int errno_value) {
    LsStore *s = ls_store_of(store);
    if (!s) return;
    atomic_store(&s->fault.errno_value, errno_value);
    atomic_store(&s->fault.countdown, nth);
}

int coli_lru_direct_io_fallback(ColiExpertStore *store) {
    LsStore *s = ls_store_of(store);
    return s ? s->files.direct_fallback : 0;
}

static const ColiLeaseEntryPoints LEASE_ENTRY_POINTS = {
    .lookup = coli_lru_lookup,
    .lookup_resident = coli_lru_lookup_resident,
    .lookup_many = coli_lru_lookup_many,
    .view_layout = coli_view_layout,
};

const ColiLeaseEntryPoints *coli_lease_entry_points(void) { return &LEASE_ENTRY_POINTS; }

const char *coli_lru_policy_name(int policy) {
    for (int i = 0; ls_policies[i]; i++)
        if (i == policy) return ls_policies[i]->name;
    return NULL;
}

int coli_lru_expert_requests(ColiExpertStore *store, int layer, uint64_t *out, int n) {
    LsStore *s = ls_store_of(store);
    LsLayer *L = s ? ls_find_layer(s, layer) : NULL;
    if (out && n > 0) memset(out, 0, sizeof(*out) * (size_t)n);
    if (!L) return 0;
    pthread_mutex_lock(&L->mu);
    for (int e = 0; out && e < n && e < L->n_entries; e++) out[e] = L->requests_of[e];
    pthread_mutex_unlock(&L->mu);
    return L->n_entries;
}

int coli_lru_pinned(ColiExpertStore *store, ColiExpertKey *out, int n) {
    LsStore *s = ls_store_of(store);
    int total = 0;
    for (int i = 0; s && i < s->n_layers; i++) {
        LsLayer *L = &s->layers[i];
        pthread_mutex_lock(&L->mu);
        for (int e = 0; e < L->n_entries; e++) {   /* by expert: the order the header promises */
            const LsSlot *v = L->slot_of[e];
            if (!v || !v->pinned) continue;
            if (out && total < n) out[total] = (ColiExpertKey){L->id, e};
            total++;
        }
        pthread_mutex_unlock(&L->mu);
    }
    return total;
}
