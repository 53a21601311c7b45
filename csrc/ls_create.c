/*
 * ls_create.c: the store's life cycle: create (the configuration, the
 * layers and their experts, slot counts and slot memory, pins and warm
 * experts, the I/O pool), close and destroy.
 *
 * The store's other parts are in ls_*.c; ls_internal.h says which file
 * holds what, and ls_slots.h describes the slot state machine.
 */
#define _GNU_SOURCE               /* MAP_ANONYMOUS, MADV_HUGEPAGE, with POSIX clocks and conditions */
#include "ls_slots.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "coli_store.h"

static void free_arena(LsLayer *L) {
    if (L->arena) (void)munmap(L->arena, L->arena_bytes);   /* our own mapping: cannot fail */
    L->arena = NULL;
    L->arena_bytes = 0;
}

static void free_store(LsStore *s) {
    atomic_store(&s->stopping, 1);       /* preload jobs end */
    if (s->gate_ready) ls_lift_holds(s);   /* a held read would keep the pool from stopping */
    coli_pool_stop(&s->pool);
    for (int i = 0; i < s->n_layers; i++) {
        LsLayer *L = &s->layers[i];
        if (L->sync_ready) {
            pthread_cond_destroy(&L->cv);
            pthread_mutex_destroy(&L->mu);
        }
        if (L->pol_ready && L->policy->fini) L->policy->fini(L);
        free_arena(L);
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

void ls_destroy_op(ColiExpertStore *store) {
    LsStore *s = store->state;   /* reached through ls_ops: a store of ours */
    assert(ls_active_leases(s) == 0 && "destroy with active leases (rule 5)");
    free_store(s);
}

/* ---- creation -------------------------------------------------------- */

static int init_layer_sync(LsLayer *L, char *err, size_t n) {
    int bad = ls_sync_init(&L->mu, &L->cv);
    if (bad)
        return coli_fail(err, n, COLI_ETHREAD, "cannot create the %s of layer %d",
                         bad == 1 ? "mutex" : "condition", L->id);
    L->sync_ready = true;
    return COLI_OK;
}

static int init_gate(LsStore *s, char *err, size_t n) {
    int bad = ls_sync_init(&s->gate_mu, &s->gate_cv);
    if (bad)
        return coli_fail(err, n, COLI_ETHREAD, "cannot create the demand gate's %s",
                         bad == 1 ? "mutex" : "condition");
    s->gate_ready = true;
    return COLI_OK;
}

/* Checks source x (against the files, which a replay store and a plan
 * have not) and plans its reads into e. With replay_expert_bytes the
 * source's tensors are not read: a read of that many bytes is planned. */
static int plan_entry(const LsStore *s, const ColiStoreConfig *cfg, const ColiExpertSource *x, LsEntry *e,
                      char *err, size_t n) {
    uint64_t bytes = cfg->replay_expert_bytes;
    if (bytes) {
        e->plan.runs[0] = (ColiReadRun){.length = bytes, .needed = bytes};
        e->plan.n_runs = 1;
        e->plan.footprint = e->plan.payload = bytes;
        return COLI_OK;
    }
    int rc = coli_check_expert(s->files.n ? &s->files : NULL, x, err, n);   /* none opened: 0 files */
    return rc ? rc : coli_plan_expert(x, s->direct, &e->plan, err, n);
}

/* Sorts and counts layers, fills entries with validated sources and plans. */
static int build_layers(LsStore *s, const ColiStoreConfig *cfg, char *err, size_t n) {
    int max_id = -1;
    for (int i = 0; i < cfg->n_experts; i++) {
        const ColiExpertSource *x = &cfg->experts[i];
        if (x->layer < 0 || x->layer > COLI_MAX_LAYER_ID || x->expert < 0 || x->expert > COLI_MAX_EXPERT_ID)
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
        int rc = plan_entry(s, cfg, x, e, err, n);
        if (rc) return rc;
        e->src = *x;
        e->src.parts = NULL;          /* the caller's array; the plan has what loads need */
        for (int k = 0; k < x->n_parts && !cfg->replay_expert_bytes; k++)
            e->parts[k] = (LsPart){x->parts[k].nbytes, (int8_t)x->parts[k].kind,
                                   (int8_t)x->parts[k].role, x->parts[k].format};
        L->present[x->expert] = true;
    }
    return COLI_OK;
}

#define HUGE_PAGE ((size_t)2 << 20)

/* Slot memory of one layer, page aligned for O_DIRECT: an anonymous
 * mapping of its own, never memory the allocator recycles. An O_DIRECT
 * read goes to the device as one request per run of physically contiguous
 * memory (a segment), and a request takes at most the device's
 * max_segments of them: a 3 MiB read into 4 KiB pages is split into several
 * requests, on a virtio disk without indirect descriptors each filling its
 * whole ring, so they run one after the other. Memory the heap hands back
 * was faulted in on 4 KiB pages by its earlier use, and advice cannot
 * change pages already there; a fresh mapping of 2 MiB or more is 2 MiB
 * aligned and advised to use transparent huge pages before its first
 * touch, so a read spans a few segments. NULL when out of memory; else
 * *mapped is the mapping's length. */
static unsigned char *map_arena(size_t bytes, size_t *mapped) {
    size_t len = (bytes + COLI_IO_ALIGN - 1) / COLI_IO_ALIGN * COLI_IO_ALIGN;
    size_t slack = len >= HUGE_PAGE ? HUGE_PAGE : 0;   /* room to align the start */
    if (len == 0 || len > SIZE_MAX - slack) return NULL;
    unsigned char *raw = mmap(NULL, len + slack, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    size_t head = slack ? (HUGE_PAGE - (uintptr_t)raw % HUGE_PAGE) % HUGE_PAGE : 0;
    /* Unmapping the slack around the aligned range cannot fail for ranges
     * of a mapping we own; a failure would only leave them mapped. */
    if (head) (void)munmap(raw, head);
    if (slack - head) (void)munmap(raw + head + len, slack - head);
    unsigned char *arena = raw + head;
    *mapped = len;
#ifdef MADV_HUGEPAGE
    if (slack && madvise(arena, len / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE) != 0) {
        /* advisory: without huge pages the arena works the same, with more segments per read */
    }
#endif
    return arena;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23      /* Linux 5.14's value; older kernels refuse it with EINVAL */
#endif

/* Faults an arena's pages in now instead of in the first read into each
 * slot (see SLOT MEMORY in coli_store.h): 0, or the errno of a kernel that
 * could not back them. Kernels without MADV_POPULATE_WRITE get a write to
 * every page. */
static int populate_arena(unsigned char *arena, size_t len) {
    if (madvise(arena, len, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno != EINVAL) return errno;
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) page = 4096;
    volatile unsigned char *p = arena;
    for (size_t off = 0; off < len; off += (size_t)page) p[off] = 0;
    return 0;
}

/* Decides every layer's slot stride (its largest expert's footprint, in
 * whole pages) and slot count (from the budget, at most its experts). */
static int count_slots(LsStore *s, const ColiStoreConfig *cfg, char *err, size_t n) {
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
    }
    return COLI_OK;
}

/* Allocates every layer's slots and arena (none for a replay store), starts
 * its policy and its lock, and puts every slot in its evictable set. */
static int build_slots(LsStore *s, const ColiStoreConfig *cfg, char *err, size_t n) {
    for (int i = 0; i < s->n_layers; i++) {
        LsLayer *L = &s->layers[i];
        uint64_t arena_bytes;
        if (__builtin_mul_overflow(L->slot_bytes, (uint64_t)L->n_slots, &arena_bytes) || arena_bytes > SIZE_MAX)
            return coli_fail(err, n, COLI_ENOMEM, "layer %d: %d slots of %llu bytes overflow",
                             L->id, L->n_slots, (unsigned long long)L->slot_bytes);
        unsigned char *arena = s->replay ? NULL : map_arena((size_t)arena_bytes, &L->arena_bytes);
        if (!arena && !s->replay)
            return coli_fail(err, n, COLI_ENOMEM, "cannot allocate %llu bytes for the %d slots of layer %d",
                             (unsigned long long)arena_bytes, L->n_slots, L->id);
        L->arena = arena;
        if (arena && !cfg->lazy_slots) {
            int e = populate_arena(arena, L->arena_bytes);
            if (e)
                return coli_fail(err, n, COLI_ENOMEM, "cannot commit the %llu bytes of the %d slots of layer %d: %s",
                                 (unsigned long long)L->arena_bytes, L->n_slots, L->id, strerror(e));
        }
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
static int build_warm(LsStore *s, const ColiStoreConfig *cfg, char *err, size_t n) {
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
static int build_preloads(LsStore *s, const ColiStoreConfig *cfg, char *err, size_t n) {
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

/* The checks of a config before anything is built, and the store's mode
 * from it: *out, or NULL with err set. */
static int new_store(const ColiStoreConfig *cfg, LsStore **out, char *err, size_t n) {
    *out = NULL;
    if (cfg->n_experts <= 0 || !cfg->experts)
        return coli_fail(err, n, COLI_ECONFIG, "config lists no experts");
    if (cfg->slots_per_layer == 0 && cfg->capacity_bytes == 0 && !cfg->layer_slots)
        return coli_fail(err, n, COLI_ECONFIG,
                         "config sets neither slots_per_layer nor capacity_bytes nor layer_slots");
    if (cfg->policy < 0 || !coli_store_policy_name(cfg->policy))
        return coli_fail(err, n, COLI_ECONFIG, "unknown eviction policy %d", cfg->policy);
    if (cfg->replay_expert_bytes && !cfg->replay)
        return coli_fail(err, n, COLI_ECONFIG, "replay_expert_bytes is for a replay store");
    LsStore *s = calloc(1, sizeof(LsStore));
    if (!s) return coli_fail(err, n, COLI_ENOMEM, "out of memory for the store");
    s->replay = cfg->replay != 0;
    s->direct = cfg->direct_io != 0 && !s->replay;
    *out = s;
    return COLI_OK;
}

int ls_plan_slots(const ColiStoreConfig *cfg, uint32_t *out, int n_out, char *err, size_t n) {
    LsStore *s;
    int rc = new_store(cfg, &s, err, n);
    if (rc == COLI_OK) rc = build_layers(s, cfg, err, n);   /* no files: checked without them */
    if (rc == COLI_OK) rc = count_slots(s, cfg, err, n);
    for (int i = 0; rc == COLI_OK && out && i < s->n_layers && i < n_out; i++)
        out[i] = (uint32_t)s->layers[i].n_slots;
    if (rc == COLI_OK) rc = s->n_layers;
    if (s) free_store(s);
    return rc;
}

int ls_create(const ColiStoreConfig *cfg, LsStore **out, char *err, size_t n) {
    LsStore *s;
    int rc = new_store(cfg, &s, err, n);
    *out = NULL;
    if (rc) return rc;
    s->wait_timeout_ns = cfg->slot_wait_timeout_ns;
    s->demand_first = cfg->prefetch_never_pauses == 0;
    rc = init_gate(s, err, n);
    if (rc == COLI_OK && !s->replay) {
        rc = coli_files_open(&s->files, cfg->files, cfg->n_files, s->direct, err, n);
#ifdef COLI_TEST_CONTROL
        s->files.fault = &s->test.fault;
#endif
        if (rc == COLI_OK)
            coli_files_tune(&s->files, cfg->read_chunk_bytes ? cfg->read_chunk_bytes : COLI_DEFAULT_READ_CHUNK,
                            cfg->read_without_advice == 0);
    }
    uint64_t chunk = cfg->prefetch_chunk_bytes ? cfg->prefetch_chunk_bytes
                     : s->files.direct ? LS_DEFAULT_DIRECT_PREFETCH_CHUNK : LS_DEFAULT_PREFETCH_CHUNK;
    if (chunk < LS_MIN_PREFETCH_CHUNK) chunk = LS_MIN_PREFETCH_CHUNK;
    if (chunk > (1ull << 40)) chunk = 1ull << 40;   /* no overflow rounding up */
    s->prefetch_chunk = (chunk + COLI_IO_ALIGN - 1) / COLI_IO_ALIGN * COLI_IO_ALIGN;
    if (rc == COLI_OK) rc = build_layers(s, cfg, err, n);
    if (rc == COLI_OK) rc = count_slots(s, cfg, err, n);
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
    ls_start_preloads(s);
    *out = s;
    return COLI_OK;
}

/* ---- close ----------------------------------------------------------- */

int ls_close(LsStore *s, char *err, size_t n) {
    if (atomic_exchange(&s->closed, 1)) return COLI_OK;   /* closed already */
    uint64_t calls = atomic_load(&s->prefetch_calls), leases = ls_active_leases(s);
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
    ls_lift_holds(s);
    coli_pool_stop(&s->pool);     /* queued prefetches are dropped, running reads end first */
    for (int i = 0; i < s->n_layers; i++) {
        LsLayer *L = &s->layers[i];
        pthread_mutex_lock(&L->mu);
        for (int j = 0; j < L->n_slots; j++)   /* their jobs are gone: no load is left */
            if (L->slots[j].state == LS_QUEUED) ls_slot_empty(s, L, &L->slots[j]);
        pthread_mutex_unlock(&L->mu);
        free_arena(L);
    }
    coli_files_close(&s->files);
    return COLI_OK;
}
