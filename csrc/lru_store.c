/*
 * lru_store.c: the per-layer LRU expert store.
 *
 * Each MoE layer owns a fixed array of slots carved from one page-aligned
 * arena, and an LRU list that holds exactly the slots that may be evicted:
 * empty ones and resident ones with no lease. As in SQLite's page cache,
 * "leased" means "not on the list", so the hit path unlinks in O(1) and the
 * victim is always the tail, also O(1). The list is circular around a
 * sentinel, so linking never tests for NULL.
 *
 *      sentinel <-> MRU ... LRU <-> sentinel         (lru.next is the MRU end)
 *
 *   one slot:   +-------------------------------------------------+
 *               | expert's runs, as read: gate | up | down (+scales)|
 *               +-------------------------------------------------+
 *               state EMPTY -> QUEUED -> READING -> RESIDENT -> ... -> EMPTY
 *
 * A slot is on the list iff it is EMPTY, or RESIDENT with zero leases.
 * QUEUED (a prefetch waiting for a worker) and READING slots are off the list
 * and owned by whoever reads them; lookups of their expert join the load,
 * and a demand lookup takes a QUEUED slot over instead of waiting behind
 * the queue. Every time a slot is given to another expert, or emptied after
 * a failed read, its generation goes up (lease contract rule 4).
 *
 * Locking: one mutex and one condition variable per layer guard that
 * layer's slots, list, expert table and counters. The condition is broadcast
 * when a lease is released or a load ends, if anyone waits. No lock is held
 * during a read. The pool mutex nests inside a layer mutex (prefetch posts
 * while holding its layer), never the reverse; so does the demand gate's
 * (a lookup that joins a prefetch wakes its paused reader).
 *
 * Prefetch reads go in chunks; before each one the worker stops if the
 * prefetch was retired as a wrong guess, and waits while a demand read is in
 * progress, unless a lookup is waiting for this very load (demanded).
 */
#define _GNU_SOURCE               /* madvise(MADV_HUGEPAGE), with POSIX clocks and conditions */
#include "lru_store.h"

#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "expert_reader.h"
#include "io_pool.h"

#define DEFAULT_QUEUE_DEPTH 256u
#define MAX_LAYER_ID 1000000
#define MAX_EXPERT_ID 1000000
#define ERRLEN COLI_ERR_LEN
#define DEFAULT_PREFETCH_CHUNK (1ull << 20)   /* a prefetch read can yield to demand reads this often */
#define MIN_PREFETCH_CHUNK (64ull << 10)
#define PAUSE_LIMIT_NS 50000000ll     /* longest a prefetch chunk waits for demand reads */

typedef enum { SLOT_EMPTY, SLOT_QUEUED, SLOT_READING, SLOT_RESIDENT } SlotState;

typedef struct Layer Layer;
typedef struct Slot Slot;

struct Slot {
    Slot *prev, *next;            /* LRU links; valid only while on_list */
    Layer *layer;                 /* owning layer, fixed */
    unsigned char *mem;           /* slot memory, fixed */
    int expert;                   /* expert held or loading; -1 when EMPTY */
    SlotState state;
    bool on_list;                 /* on the layer's LRU list */
    bool prefetched;              /* loaded by prefetch and not hit yet */
    _Atomic bool demanded;        /* a lookup waits for this load: it must not pause */
    _Atomic bool retired;         /* a prefetch known to be a wrong guess: stop reading it */
    uint32_t leases;              /* active leases; > 0 only when RESIDENT */
    uint64_t generation;          /* bumped whenever the slot is repurposed */
    /* The view of the expert given to this slot, minus the lease fields: a
     * hit copies it instead of reading the expert's (large, cold) entry. */
    ColiExpertView view;
    /* A READING slot of a lease_many batch may be read by an I/O worker;
     * the worker only reads, the batch's thread finishes the load. */
    uint8_t batch;                /* BATCH_NONE, _QUEUED, _RUNNING or _DONE */
    int batch_rc;                 /* the worker's read result, when DONE */
    uint64_t batch_nread;
    char batch_err[ERRLEN];
};

enum { BATCH_NONE, BATCH_QUEUED, BATCH_RUNNING, BATCH_DONE };
#define DEMAND_JOB (1ull << 63)   /* tag bit of a batch read job; the rest is the generation */

typedef struct {
    ColiExpertSource src;         /* formats and shapes for views */
    ColiReadPlan plan;
} Entry;

typedef struct {
    uint64_t requests, hits, misses, prefetched, prefetch_hits, bytes_read;
    uint64_t inflight_joins, loads_started, loads_failed, evictions, slot_waits;
} Counters;

struct Layer {
    /* Layers sit side by side in one array: each starts on its own cache
     * line so threads on different layers do not share one. */
    _Alignas(64) pthread_mutex_t mu;  /* guards everything below but the fixed fields and atomics */
    pthread_cond_t cv;            /* a lease was released or a load ended */
    int id;                       /* the model's layer index, fixed */
    int n_entries;                /* largest expert index + 1, fixed */
    Entry *entries;               /* indexed by expert; read on loads only */
    /* Compact per-expert state, so a hit over a large model touches a few
     * bytes per expert instead of a cold Entry of hundreds. */
    bool *present;                /* indexed by expert: the model has it; fixed */
    Slot **slot_of;               /* indexed by expert: slot holding or loading it, or NULL */
    Slot *slots;                  /* n_slots, fixed */
    int n_slots;
    uint64_t slot_bytes;          /* stride of the arena, fixed */
    unsigned char *arena;
    Slot list;                    /* LRU sentinel */
    uint32_t waiters;             /* threads in a wait on cv */
    uint32_t loading;             /* slots QUEUED or READING */
    uint32_t queued;              /* slots QUEUED */
    uint64_t resident_bytes;
    uint64_t leases;              /* leases held on this layer's slots */
    Counters c;
    bool sync_ready;              /* mu and cv were initialised */
    _Atomic uint64_t calls;       /* lookups of this layer in progress (close guard) */
};

typedef struct {
    ColiExpertStore base;         /* handed out; base.state points here */
    ColiFileSet files;
    Layer *layers;                /* n_layers, sorted by id */
    int n_layers;
    Layer **by_id;                /* layer id -> layer or NULL, max_id + 1 entries */
    int max_id;
    bool direct;
    int64_t wait_timeout_ns;
    ColiIoPool pool;
    ColiFaultHook fault;
    _Atomic uint64_t inflight;    /* loads QUEUED or READING, all layers */
    _Atomic uint64_t peak_inflight;
    _Atomic uint64_t prefetch_calls;  /* prefetches in progress (close guard) */
    _Atomic uint64_t generations; /* source of slot generations: unique in the store */
    _Atomic int closed;           /* set by coli_lru_close: slot memory is gone */
    /* Demand first: prefetch reads go in chunks and, before each chunk,
     * wait while a demand read is in progress (at most PAUSE_LIMIT_NS), so
     * a miss gets the disk to itself instead of a share of it. */
    bool demand_first;
    uint64_t prefetch_chunk;          /* bytes, a multiple of COLI_IO_ALIGN */
    _Atomic uint32_t demand_reads;    /* demand reads in progress, all layers */
    _Atomic uint64_t prefetch_pauses; /* chunks that waited */
    pthread_mutex_t gate_mu;          /* a leaf lock: paused prefetch reads wait on gate_cv */
    pthread_cond_t gate_cv;
    bool gate_ready;
    _Atomic int hold_prefetch;        /* test hook: prefetch reads wait before each chunk */
    _Atomic uint32_t held;            /* prefetch reads waiting on that hook now */
} LruStore;

static const ColiExpertStoreOps LRU_OPS;

/* ---- list ------------------------------------------------------------ */

/* Caller holds the slot's layer mutex for every list function. */
static void list_unlink(Slot *s) {
    assert(s->on_list);
    s->prev->next = s->next;
    s->next->prev = s->prev;
    s->on_list = false;
}

static void list_push_mru(Layer *L, Slot *s) {
    assert(!s->on_list);
    s->next = L->list.next;
    s->prev = &L->list;
    L->list.next->prev = s;
    L->list.next = s;
    s->on_list = true;
}

static void list_push_lru(Layer *L, Slot *s) {
    assert(!s->on_list);
    s->prev = L->list.prev;
    s->next = &L->list;
    L->list.prev->next = s;
    L->list.prev = s;
    s->on_list = true;
}

static Slot *list_victim(Layer *L) {
    return L->list.prev == &L->list ? NULL : L->list.prev;
}

/* ---- helpers --------------------------------------------------------- */

static LruStore *store_of(ColiExpertStore *store) {
    return (store && store->ops == &LRU_OPS) ? (LruStore *)store->state : NULL;
}

/* Brackets a call that touches slot memory or the pool, against close().
 * Both sides write their flag then read the other's (sequentially
 * consistent), so either close sees the call or the call sees close. The
 * counter is per layer (or the store's, for prefetch) so that threads on
 * different layers never write one cache line. */
static bool call_enter(LruStore *s, _Atomic uint64_t *calls) {
    atomic_fetch_add(calls, 1);
    if (!atomic_load(&s->closed)) return true;
    atomic_fetch_sub(calls, 1);
    return false;
}

static void call_leave(_Atomic uint64_t *calls) { atomic_fetch_sub(calls, 1); }

static uint64_t next_generation(LruStore *s) { return atomic_fetch_add(&s->generations, 1) + 1; }

static Layer *find_layer(LruStore *s, int layer) {
    return (layer >= 0 && layer <= s->max_id) ? s->by_id[layer] : NULL;
}

static Entry *find_entry(Layer *L, int expert) {
    return (expert >= 0 && expert < L->n_entries && L->present[expert])
               ? &L->entries[expert] : NULL;
}

static void inflight_up(LruStore *s) {
    uint64_t now = atomic_fetch_add(&s->inflight, 1) + 1;
    uint64_t peak = atomic_load(&s->peak_inflight);
    while (now > peak && !atomic_compare_exchange_weak(&s->peak_inflight, &peak, now)) {}
}

static void wake(Layer *L) {
    if (L->waiters > 0) pthread_cond_broadcast(&L->cv);
}

static void deadline_after(struct timespec *ts, int64_t ns);

static void gate_wake(LruStore *s) {
    pthread_mutex_lock(&s->gate_mu);
    pthread_cond_broadcast(&s->gate_cv);
    pthread_mutex_unlock(&s->gate_mu);
}

/* Bracket every read a lookup waits for. */
static void demand_begin(LruStore *s) { atomic_fetch_add(&s->demand_reads, 1); }

static void demand_end(LruStore *s) {
    if (atomic_fetch_sub(&s->demand_reads, 1) == 1 && s->demand_first) gate_wake(s);
}

/* A lookup now waits for the load of v (READING): it must run unpaused. */
static void demand_join(LruStore *s, Slot *v) {
    if (!atomic_exchange(&v->demanded, true) && s->demand_first) gate_wake(s);
}

static void set_hold(LruStore *s, int hold) {
    atomic_store(&s->hold_prefetch, hold != 0);
    if (!hold) gate_wake(s);
}

typedef struct {
    LruStore *s;
    Slot *v;
} PrefetchPace;

/* Before each chunk of a prefetch read: stop if it was retired as a wrong
 * guess (and no lookup waits for it); else wait while demand reads run,
 * unless a lookup waits for this very load. The flags are read again under
 * gate_mu, which their writers take before they broadcast, so no wake-up is
 * lost. */
static bool prefetch_pause(void *ctx) {
    const PrefetchPace *p = ctx;
    LruStore *s = p->s;
    if (atomic_load(&s->hold_prefetch)) {
        pthread_mutex_lock(&s->gate_mu);
        atomic_fetch_add(&s->held, 1);
        while (atomic_load(&s->hold_prefetch)) pthread_cond_wait(&s->gate_cv, &s->gate_mu);
        atomic_fetch_sub(&s->held, 1);
        pthread_mutex_unlock(&s->gate_mu);
    }
    if (atomic_load(&p->v->demanded)) return true;
    if (atomic_load(&p->v->retired)) return false;
    if (!s->demand_first || !atomic_load(&s->demand_reads)) return true;
    atomic_fetch_add(&s->prefetch_pauses, 1);
    struct timespec deadline;
    deadline_after(&deadline, PAUSE_LIMIT_NS);
    pthread_mutex_lock(&s->gate_mu);
    while (atomic_load(&s->demand_reads) && !atomic_load(&p->v->demanded))
        if (pthread_cond_timedwait(&s->gate_cv, &s->gate_mu, &deadline) == ETIMEDOUT) break;
    pthread_mutex_unlock(&s->gate_mu);
    return !atomic_load(&p->v->retired) || atomic_load(&p->v->demanded);
}

static void fill_template(ColiExpertView *view, const Layer *L, const Entry *e, int expert,
                          const unsigned char *mem);

/* Gives slot v to entry e in state st: drops whatever v held (counting an
 * eviction), gives it the new generation (from next_generation()) and
 * builds the view its leases will copy.
 * Caller holds L->mu; v is on the list. */
static void repurpose(LruStore *s, Layer *L, Slot *v, Entry *e, int expert, SlotState st,
                      uint64_t generation) {
    list_unlink(v);
    if (v->state == SLOT_RESIDENT) {
        L->slot_of[v->expert] = NULL;
        L->resident_bytes -= L->entries[v->expert].plan.payload;
        L->c.evictions++;
    }
    v->generation = generation;
    v->expert = expert;
    v->state = st;
    v->prefetched = (st == SLOT_QUEUED);
    atomic_store(&v->demanded, false);
    atomic_store(&v->retired, false);
    L->slot_of[expert] = v;
    fill_template(&v->view, L, e, expert, v->mem);
    L->loading++;
    if (st == SLOT_QUEUED) L->queued++;
    L->c.loads_started++;
    inflight_up(s);
}

/* Ends the load of slot v (READING) with the read's result rc: on success
 * it becomes RESIDENT with `leases` leases; on failure, or when the read was
 * stopped (not a failure), it becomes EMPTY at the LRU end. Caller holds
 * L->mu. */
static void finish_load(LruStore *s, Layer *L, Slot *v, int rc, uint64_t nread, uint32_t leases) {
    Entry *e = &L->entries[v->expert];
    bool ok = rc == COLI_OK;
    L->c.bytes_read += nread;
    L->loading--;
    atomic_fetch_sub(&s->inflight, 1);
    if (ok) {
        v->state = SLOT_RESIDENT;
        v->leases = leases;
        L->resident_bytes += e->plan.payload;
        if (leases == 0) list_push_mru(L, v);
        else L->leases += leases;
    } else {
        if (rc != COLI_READ_STOPPED) L->c.loads_failed++;
        L->slot_of[v->expert] = NULL;
        v->expert = -1;
        v->state = SLOT_EMPTY;
        v->prefetched = false;
        v->generation = next_generation(s);
        list_push_lru(L, v);
    }
    wake(L);
}

static void fill_tensor(ColiTensorView *t, const ColiTensorSource *src, const unsigned char *mem,
                        uint64_t data_at, uint64_t scales_at) {
    t->format = src->format;
    t->scale_format = src->scale_format;
    t->data = mem + data_at;
    t->scales = src->scale_format == COLI_SCALE_NONE ? NULL : mem + scales_at;
    t->data_bytes = (size_t)src->nbytes;
    t->scale_bytes = src->scale_format == COLI_SCALE_NONE ? 0 : (size_t)src->scale_nbytes;
    t->rows = src->rows;
    t->columns = src->columns;
    t->block_rows = src->scale_format == COLI_SCALE_NONE ? 0 : src->block_rows;
    t->block_columns = src->scale_format == COLI_SCALE_NONE ? 0 : src->block_columns;
}

/* The view of expert e held in slot memory mem, without a lease. */
static void fill_template(ColiExpertView *view, const Layer *L, const Entry *e, int expert,
                          const unsigned char *mem) {
    memset(view, 0, sizeof(*view));
    view->key.layer = L->id;
    view->key.expert = expert;
    fill_tensor(&view->gate, &e->src.gate, mem, e->plan.data_at[0], e->plan.scales_at[0]);
    fill_tensor(&view->up, &e->src.up, mem, e->plan.data_at[1], e->plan.scales_at[1]);
    fill_tensor(&view->down, &e->src.down, mem, e->plan.data_at[2], e->plan.scales_at[2]);
}

static void fill_view(ColiExpertView *view, Slot *v) {
    *view = v->view;
    view->lease = v;
    view->lease_generation = v->generation;
}

/* Takes a lease on resident slot v as a hit. Caller holds L->mu. */
static void lease_hit(Layer *L, Slot *v, ColiExpertView *view) {
    if (v->on_list) list_unlink(v);
    v->leases++;
    L->leases++;
    L->c.requests++;
    L->c.hits++;
    if (v->prefetched) {
        L->c.prefetch_hits++;
        v->prefetched = false;
    }
    fill_view(view, v);
}

/* Reads entry's expert into v, which the caller has marked READING, and
 * leases it to view. Called and returns with L->mu held; drops it to read. */
static int demand_read(LruStore *s, Layer *L, Slot *v, ColiExpertView *view, char *err, size_t n) {
    Entry *e = &L->entries[v->expert];
    uint64_t nread = 0;
    pthread_mutex_unlock(&L->mu);
    demand_begin(s);
    int rc = coli_read_expert(&s->files, &e->plan, v->mem, &s->fault, NULL, &nread, err, n);
    demand_end(s);
    pthread_mutex_lock(&L->mu);
    finish_load(s, L, v, rc, nread, 1);
    if (rc == COLI_OK) fill_view(view, v);
    return rc;
}

/* A QUEUED slot of another expert that a demand miss may take, or NULL. */
static Slot *queued_slot(Layer *L) {
    for (int i = 0; i < L->n_slots; i++)
        if (L->slots[i].state == SLOT_QUEUED) return &L->slots[i];
    return NULL;
}

/* Cancels the queued prefetch in v (its job goes stale by generation) and
 * makes v an empty evictable slot. Caller holds L->mu. Wakes waiters: one
 * load fewer (wait_idle) and one free slot more (lookups). */
static void cancel_queued(LruStore *s, Layer *L, Slot *v) {
    L->slot_of[v->expert] = NULL;
    L->queued--;
    L->loading--;
    atomic_fetch_sub(&s->inflight, 1);
    v->expert = -1;
    v->state = SLOT_EMPTY;
    v->prefetched = false;
    v->generation = next_generation(s);
    list_push_lru(L, v);
    wake(L);
}

/* Gives the entry's expert, which is neither resident nor being read, a
 * slot to read it into, marked READING: its own queued prefetch, taken over
 * (the worker will find it READING and skip the job), else the LRU victim,
 * else another expert's queued prefetch, cancelled. Counts the request.
 * NULL when no slot is free now. Caller holds L->mu. */
static Slot *claim_slot(LruStore *s, Layer *L, Entry *e, int expert) {
    Slot *v = L->slot_of[expert];
    if (v) {
        assert(v->state == SLOT_QUEUED);
        v->state = SLOT_READING;
        L->queued--;
        L->c.requests++;
        L->c.hits++;
        L->c.inflight_joins++;
        L->c.prefetch_hits++;
        v->prefetched = false;
        return v;
    }
    v = list_victim(L);
    if (!v && (v = queued_slot(L)) != NULL) cancel_queued(s, L, v);
    if (!v) return NULL;
    repurpose(s, L, v, e, expert, SLOT_READING, next_generation(s));
    L->c.requests++;
    L->c.misses++;
    return v;
}

static void deadline_after(struct timespec *ts, int64_t ns) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ns / 1000000000;
    ts->tv_nsec += ns % 1000000000;
    if (ts->tv_nsec >= 1000000000) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000;
    }
}

/* Waits on L->cv, until deadline when given. Returns ETIMEDOUT or 0. */
static int layer_wait(Layer *L, const struct timespec *deadline) {
    L->waiters++;
    int rc = deadline ? pthread_cond_timedwait(&L->cv, &L->mu, deadline)
                      : pthread_cond_wait(&L->cv, &L->mu);
    L->waiters--;
    return rc;
}

static bool release_locked(Layer *L, ColiExpertView *view);

/* ---- ops ------------------------------------------------------------- */

/* The lookup. With hit_only, an expert that is not resident now is not
 * waited for or read: COLI_EAGAIN, nothing counted, the view zeroed. */
static int lookup_impl(LruStore *s, int layer, int expert, ColiExpertView *view,
                       bool hit_only, char *err, size_t n);

static int guarded_lookup(ColiExpertStore *store, int layer, int expert, ColiExpertView *view,
                          bool hit_only, char *err, size_t n) {
    LruStore *s = store_of(store);
    Layer *L = s ? find_layer(s, layer) : NULL;
    if (L && !call_enter(s, &L->calls)) {
        if (view) memset(view, 0, sizeof(*view));
        return coli_fail(err, n, COLI_ECLOSED, "lookup of layer %d expert %d: the store is closed",
                         layer, expert);
    }
    int rc = lookup_impl(s, layer, expert, view, hit_only, err, n);
    if (L) call_leave(&L->calls);
    return rc;
}

int coli_lru_lookup(ColiExpertStore *store, int layer, int expert,
                    ColiExpertView *view, char *err, size_t n) {
    return guarded_lookup(store, layer, expert, view, false, err, n);
}

int coli_lru_lookup_resident(ColiExpertStore *store, int layer, int expert, ColiExpertView *view) {
    int rc = guarded_lookup(store, layer, expert, view, true, NULL, 0);
    return rc == COLI_OK ? COLI_OK : COLI_EAGAIN;
}


static int lookup_impl(LruStore *s, int layer, int expert, ColiExpertView *view,
                       bool hit_only, char *err, size_t n) {
    if (!view) return coli_fail(err, n, COLI_EINVAL, "lookup of layer %d expert %d: view is NULL", layer, expert);
    if (!s) {
        memset(view, 0, sizeof(*view));
        return coli_fail(err, n, COLI_EINVAL, "lookup: not an LRU expert store");
    }
    Layer *held = view->lease ? find_layer(s, view->key.layer) : NULL;
    if (held) {
        /* Overwriting a live lease would leak it for good, so drop it and
         * refuse. Anything else in the view is garbage we may overwrite. */
        pthread_mutex_lock(&held->mu);
        bool live = release_locked(held, view);
        pthread_mutex_unlock(&held->mu);
        if (live) {
            memset(view, 0, sizeof(*view));
            return coli_fail(err, n, COLI_ELEASE,
                             "lookup of layer %d expert %d: the view already holds a lease "
                             "(it was released); pass a zeroed view", layer, expert);
        }
    }
    memset(view, 0, sizeof(*view));
    Layer *L = find_layer(s, layer);
    if (!L) return coli_fail(err, n, COLI_ENOTFOUND, "layer %d has no routed experts", layer);
    Entry *e = find_entry(L, expert);
    if (!e)
        return coli_fail(err, n, COLI_ENOTFOUND, "layer %d has no expert %d (experts 0..%d)",
                         layer, expert, L->n_entries - 1);

    pthread_mutex_lock(&L->mu);
    bool joined = false, full_wait = false;
    struct timespec deadline;
    for (;;) {
        Slot *v = L->slot_of[expert];
        if (v && v->state == SLOT_RESIDENT) {
            lease_hit(L, v, view);
            pthread_mutex_unlock(&L->mu);
            return COLI_OK;
        }
        if (hit_only) {
            pthread_mutex_unlock(&L->mu);
            return COLI_EAGAIN;
        }
        if (v && v->state == SLOT_READING) {   /* join that load */
            if (!joined) L->c.inflight_joins++;
            joined = true;
            demand_join(s, v);
            layer_wait(L, NULL);
            continue;
        }
        /* Missing, or a queued prefetch we take over rather than wait
         * behind the queue for. */
        Slot *mine = claim_slot(s, L, e, expert);
        if (mine) {
            int rc = demand_read(s, L, mine, view, err, n);
            pthread_mutex_unlock(&L->mu);
            return rc;
        }
        if (L->loading > 0) {     /* a load ends soon and frees or fills a slot */
            layer_wait(L, NULL);
            continue;
        }
        /* Every slot is leased: wait for a release, up to the timeout. */
        if (!full_wait) {
            full_wait = true;
            L->c.slot_waits++;
            if (s->wait_timeout_ns >= 0) deadline_after(&deadline, s->wait_timeout_ns);
        }
        int rc = layer_wait(L, s->wait_timeout_ns >= 0 ? &deadline : NULL);
        if (rc == ETIMEDOUT && !list_victim(L) && L->loading == 0 && !L->slot_of[expert]) {
            L->c.requests++;
            pthread_mutex_unlock(&L->mu);
            return coli_fail(err, n, COLI_EFULL,
                             "cache full: all %d slots of layer %d stayed leased for %.3f s "
                             "while looking up expert %d; release leases or raise slots",
                             L->n_slots, layer, (double)s->wait_timeout_ns / 1e9, expert);
        }
    }
}

static int lru_lookup_op(ColiExpertStore *store, ColiExpertKey key, ColiExpertView *view) {
    return coli_lru_lookup(store, key.layer, key.expert, view, NULL, 0);
}

/* Drops the lease of view if it is current; false when view holds no live
 * lease of layer L (stale generation, or not one of L's slots). Caller holds
 * L->mu. */
static bool release_locked(Layer *L, ColiExpertView *view) {
    Slot *v = view->lease;
    uintptr_t p = (uintptr_t)v, lo = (uintptr_t)L->slots;
    if (p < lo || p >= lo + sizeof(Slot) * (size_t)L->n_slots || (p - lo) % sizeof(Slot) != 0)
        return false;             /* not one of this layer's slots */
    if (v->generation != view->lease_generation || v->state != SLOT_RESIDENT ||
        v->leases == 0 || v->expert != view->key.expert)
        return false;             /* stale: the slot was repurposed since */
    v->leases--;
    L->leases--;
    if (v->leases == 0) {
        list_push_mru(L, v);
        wake(L);
    }
    return true;
}

static void lru_release_op(ColiExpertStore *store, ColiExpertView *view) {
    LruStore *s = store_of(store);
    if (!s || !view || !view->lease) return;
    Layer *L = find_layer(s, view->key.layer);
    if (!L) return;
    pthread_mutex_lock(&L->mu);
    release_locked(L, view);
    pthread_mutex_unlock(&L->mu);
}

/* Drops one lease of resident slot v. Caller holds L->mu. */
static void unlease_locked(Layer *L, Slot *v) {
    v->leases--;
    L->leases--;
    if (v->leases == 0) {
        list_push_mru(L, v);
        wake(L);
    }
}

static int lookup_many_impl(LruStore *s, int layer, const int *experts,
                            int count, ColiExpertView *views, char *err, size_t n) {
    if (!s || count < 0 || (count > 0 && (!experts || !views)))
        return coli_fail(err, n, COLI_EINVAL, "lookup_many: bad arguments");
    memset(views, 0, sizeof(*views) * (size_t)count);
    if (count == 0) return COLI_OK;
    Layer *L = find_layer(s, layer);
    if (!L) return coli_fail(err, n, COLI_ENOTFOUND, "layer %d has no routed experts", layer);
    /* first[i]: index of the first occurrence of experts[i]; at[k]: the
     * index whose expert reading[k] loads */
    int *first = malloc(sizeof(int) * 2 * (size_t)count);
    Slot **reading = malloc(sizeof(Slot *) * (size_t)count);
    if (!first || !reading) {
        free(first);
        free(reading);
        return coli_fail(err, n, COLI_ENOMEM, "lookup_many: out of memory for %d experts", count);
    }
    int *at = first + count;
    int distinct = 0, rc = COLI_OK;
    for (int i = 0; i < count && rc == COLI_OK; i++) {
        if (!find_entry(L, experts[i]))
            rc = coli_fail(err, n, COLI_ENOTFOUND, "layer %d has no expert %d (experts 0..%d)",
                           layer, experts[i], L->n_entries - 1);
        first[i] = i;
        for (int j = 0; j < i; j++)
            if (experts[j] == experts[i]) { first[i] = j; break; }
        distinct += first[i] == i;
    }
    if (rc == COLI_OK && distinct > L->n_slots)
        rc = coli_fail(err, n, COLI_EFULL,
                       "cache full: %d distinct experts asked of layer %d, which has %d slots",
                       distinct, layer, L->n_slots);
    if (rc != COLI_OK) {
        free(first);
        free(reading);
        return rc;
    }

    pthread_mutex_lock(&L->mu);
    bool joined = false;
restart:;
    /* Never hold a lease while waiting for a release (two batches could each
     * hold what the other needs): wait until the whole batch fits, then take
     * every slot at once, then read the missing experts. */
    bool full_wait = false, again = false;
    struct timespec deadline;
    for (;;) {
        int missing = 0;
        for (int i = 0; i < count; i++)
            missing += first[i] == i && !L->slot_of[experts[i]];
        /* Slots the batch may take: evictable ones except those holding its
         * own resident experts, plus other experts' queued prefetches. */
        int room = 0;
        for (int j = 0; j < L->n_slots; j++) {
            Slot *v = &L->slots[j];
            bool ours = false;
            for (int i = 0; i < count && !ours && v->state == SLOT_RESIDENT; i++) ours = v->expert == experts[i];
            if (v->state == SLOT_QUEUED) {
                for (int i = 0; i < count && !ours; i++) ours = v->expert == experts[i];
                room += !ours;
            } else if (v->on_list && !ours) {
                room++;
            }
        }
        if (missing <= room) break;
        if (L->loading > 0) {     /* a load ends soon and fills or frees a slot */
            layer_wait(L, NULL);
            continue;
        }
        if (!full_wait) {
            full_wait = true;
            L->c.slot_waits++;
            if (s->wait_timeout_ns >= 0) deadline_after(&deadline, s->wait_timeout_ns);
        }
        if (layer_wait(L, s->wait_timeout_ns >= 0 ? &deadline : NULL) == ETIMEDOUT) {
            L->c.requests += (uint64_t)count;
            pthread_mutex_unlock(&L->mu);
            free(first);
            free(reading);
            return coli_fail(err, n, COLI_EFULL,
                             "cache full: %d experts of layer %d could not be leased together: its %d "
                             "slots stayed leased for %.3f s", count, layer, L->n_slots,
                             (double)s->wait_timeout_ns / 1e9);
        }
    }

    /* Commit in three passes: resident experts leave the list, then our
     * queued prefetches are taken over, and only then are victims chosen,
     * so a victim is never one of the batch's own experts. Experts another
     * thread is loading are joined after our own reads. */
    int n_reading = 0;
    for (int pass = 0; pass < 3; pass++) {
        for (int i = 0; i < count; i++) {
            if (first[i] != i) continue;
            Entry *e = &L->entries[experts[i]];
            Slot *v = L->slot_of[experts[i]];
            if (pass == 0) {
                if (v && v->state == SLOT_RESIDENT) lease_hit(L, v, &views[i]);
                else if (v && v->state == SLOT_READING) demand_join(s, v);
                continue;
            }
            if (v ? v->state != SLOT_QUEUED || pass != 1 : pass != 2) continue;
            at[n_reading] = i;
            reading[n_reading++] = claim_slot(s, L, e, experts[i]);   /* room was counted */
        }
    }
    /* Several misses: hand all but the first to the I/O workers, ahead of
     * queued prefetches, so the reads overlap; read the rest here. A job no
     * worker has started when we get to it is taken back. */
    for (int k = 1; k < n_reading; k++) {
        Slot *v = reading[k];
        v->batch = BATCH_QUEUED;
        if (!coli_pool_post(&s->pool, (ColiJob){v, v->generation | DEMAND_JOB}, true))
            v->batch = BATCH_NONE;
    }
    for (int k = 0; k < n_reading; k++) {
        Slot *v = reading[k];
        int r;
        uint64_t nread = 0;
        if (v->batch == BATCH_NONE || v->batch == BATCH_QUEUED) {
            v->batch = BATCH_NONE;
            char local[ERRLEN];
            const ColiReadPlan *plan = &L->entries[v->expert].plan;
            pthread_mutex_unlock(&L->mu);
            demand_begin(s);
            r = coli_read_expert(&s->files, plan, v->mem, &s->fault, NULL, &nread,
                                 rc == COLI_OK ? err : local, rc == COLI_OK ? n : sizeof local);
            demand_end(s);
            pthread_mutex_lock(&L->mu);
        } else {
            while (v->batch != BATCH_DONE) layer_wait(L, NULL);
            v->batch = BATCH_NONE;
            r = v->batch_rc;
            nread = v->batch_nread;
            if (r != COLI_OK && rc == COLI_OK) coli_fail(err, n, r, "%s", v->batch_err);
        }
        finish_load(s, L, v, r, nread, r == COLI_OK ? 1 : 0);
        if (r == COLI_OK) fill_view(&views[at[k]], v);
        else if (rc == COLI_OK) rc = r;
    }
    /* Loads of ours that a worker or another thread runs: wait for them now,
     * holding our leases. That cannot deadlock: a read never waits for a
     * lease. One that failed, or was evicted before we woke, we read here if
     * a slot is free, else we give everything back and start over. */
    while (rc == COLI_OK) {
        bool pending = false;
        for (int i = 0; i < count && rc == COLI_OK && !again; i++) {
            if (first[i] != i || views[i].lease) continue;
            Entry *e = &L->entries[experts[i]];
            Slot *v = L->slot_of[experts[i]];
            if (v && v->state == SLOT_RESIDENT) {
                lease_hit(L, v, &views[i]);
            } else if (v && v->state == SLOT_READING) {
                pending = true;
                demand_join(s, v);
            } else if ((v = claim_slot(s, L, e, experts[i])) != NULL) {
                rc = demand_read(s, L, v, &views[i], err, n);
            } else {
                again = true;
            }
        }
        if (again || !pending) break;
        if (!joined) L->c.inflight_joins++;
        joined = true;
        layer_wait(L, NULL);
    }
    if (rc != COLI_OK || again) { /* all or nothing: give back what we hold */
        for (int i = 0; i < count; i++)
            if (first[i] == i && views[i].lease) unlease_locked(L, views[i].lease);
        memset(views, 0, sizeof(*views) * (size_t)count);
        if (rc == COLI_OK) goto restart;
    } else {
        for (int i = 0; i < count; i++)   /* a repeated expert: one more lease */
            if (first[i] != i) lease_hit(L, L->slot_of[experts[i]], &views[i]);
    }
    pthread_mutex_unlock(&L->mu);
    free(first);
    free(reading);
    return rc;
}

int coli_lru_lookup_many(ColiExpertStore *store, int layer, const int *experts,
                         int count, ColiExpertView *views, char *err, size_t n) {
    LruStore *s = store_of(store);
    Layer *L = s ? find_layer(s, layer) : NULL;
    if (L && !call_enter(s, &L->calls)) {
        if (views && count > 0) memset(views, 0, sizeof(*views) * (size_t)count);
        return coli_fail(err, n, COLI_ECLOSED, "lookup_many of layer %d: the store is closed", layer);
    }
    int rc = lookup_many_impl(s, layer, experts, count, views, err, n);
    if (L) call_leave(&L->calls);
    return rc;
}

/* Worker side of a lease_many read: reads the slot unless its batch took
 * the job back, and hands the result to the batch's thread. */
static void run_batch_read(LruStore *s, Slot *v, uint64_t generation) {
    Layer *L = v->layer;
    pthread_mutex_lock(&L->mu);
    if (v->generation != generation || v->batch != BATCH_QUEUED) {
        pthread_mutex_unlock(&L->mu);
        return;
    }
    v->batch = BATCH_RUNNING;
    const ColiReadPlan *plan = &L->entries[v->expert].plan;
    pthread_mutex_unlock(&L->mu);
    uint64_t nread = 0;
    demand_begin(s);
    int rc = coli_read_expert(&s->files, plan, v->mem, &s->fault, NULL, &nread, v->batch_err,
                              sizeof v->batch_err);
    demand_end(s);
    pthread_mutex_lock(&L->mu);
    v->batch_rc = rc;
    v->batch_nread = nread;
    v->batch = BATCH_DONE;
    wake(L);
    pthread_mutex_unlock(&L->mu);
}

/* The pool's job function: batch reads (DEMAND_JOB) and prefetches. */
static void run_job(void *ctx, ColiJob job) {
    if (job.tag & DEMAND_JOB) {
        run_batch_read(ctx, job.item, job.tag & ~DEMAND_JOB);
        return;
    }
    LruStore *s = ctx;
    Slot *v = job.item;
    Layer *L = v->layer;
    pthread_mutex_lock(&L->mu);
    if (v->state != SLOT_QUEUED || v->generation != job.tag) {
        pthread_mutex_unlock(&L->mu);
        return;
    }
    v->state = SLOT_READING;
    L->queued--;
    Entry *e = &L->entries[v->expert];
    pthread_mutex_unlock(&L->mu);
    uint64_t nread = 0;
    char err[ERRLEN];
    PrefetchPace pace = {s, v};
    ColiReadPacer pacer = {s->prefetch_chunk, prefetch_pause, &pace};
    int rc = coli_read_expert(&s->files, &e->plan, v->mem, &s->fault, &pacer, &nread, err, sizeof err);
    pthread_mutex_lock(&L->mu);
    finish_load(s, L, v, rc, nread, 0);
    pthread_mutex_unlock(&L->mu);
}

static int lru_prefetch_op(ColiExpertStore *store, const ColiExpertKey *keys, int count) {
    LruStore *s = store_of(store);
    if (!s || !keys || count <= 0 || s->pool.n_threads == 0 || !call_enter(s, &s->prefetch_calls))
        return 0;
    int accepted = 0;
    for (int i = 0; i < count; i++) {
        Layer *L = find_layer(s, keys[i].layer);
        Entry *e = L ? find_entry(L, keys[i].expert) : NULL;
        if (!e) continue;
        pthread_mutex_lock(&L->mu);
        Slot *v = L->slot_of[keys[i].expert] ? NULL : list_victim(L);
        /* An unhit prefetch at the LRU end means only unhit prefetches are
         * left to evict: taking one would let a batch undo itself. */
        if (v && v->prefetched) v = NULL;
        /* Post with the generation repurpose() is about to give the slot; a
         * worker that pops it first blocks on L->mu until we are done. */
        uint64_t generation = v ? next_generation(s) : 0;
        if (v && coli_pool_post(&s->pool, (ColiJob){v, generation}, false)) {
            repurpose(s, L, v, e, keys[i].expert, SLOT_QUEUED, generation);
            L->c.prefetched++;
            accepted++;
        }
        pthread_mutex_unlock(&L->mu);
    }
    call_leave(&s->prefetch_calls);
    return accepted;
}

static void lru_stats_op(ColiExpertStore *store, ColiExpertStoreStats *out) {
    LruStore *s = store_of(store);
    if (!out) return;
    memset(out, 0, sizeof(*out));
    if (!s) return;
    for (int i = 0; i < s->n_layers; i++) {
        Layer *L = &s->layers[i];
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
        pthread_mutex_unlock(&L->mu);
    }
    out->transient_hits = out->hits;   /* no pinned tier: every hit is the LRU's */
    out->persistent_hits = 0;
    out->peak_inflight = atomic_load(&s->peak_inflight);
}

static void free_store(LruStore *s) {
    if (s->gate_ready) set_hold(s, 0);   /* a held read would keep the pool from stopping */
    coli_pool_stop(&s->pool);
    for (int i = 0; i < s->n_layers; i++) {
        Layer *L = &s->layers[i];
        if (L->sync_ready) {
            pthread_cond_destroy(&L->cv);
            pthread_mutex_destroy(&L->mu);
        }
        free(L->arena);
        free(L->slots);
        free(L->entries);
        free(L->present);
        free(L->slot_of);
    }
    free(s->layers);
    free(s->by_id);
    coli_files_close(&s->files);
    if (s->gate_ready) {
        pthread_cond_destroy(&s->gate_cv);
        pthread_mutex_destroy(&s->gate_mu);
    }
    free(s);
}

static void lru_destroy_op(ColiExpertStore *store) {
    LruStore *s = store_of(store);
    if (!s) return;
    assert(coli_lru_active_leases(store) == 0 && "destroy with active leases (rule 5)");
    free_store(s);
}

static const ColiExpertStoreOps LRU_OPS = {
    .lookup = lru_lookup_op,
    .release = lru_release_op,
    .prefetch = lru_prefetch_op,
    .stats = lru_stats_op,
    .destroy = lru_destroy_op,
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

static int init_layer_sync(Layer *L, char *err, size_t n) {
    int bad = init_sync(&L->mu, &L->cv);
    if (bad)
        return coli_fail(err, n, COLI_ETHREAD, "cannot create the %s of layer %d",
                         bad == 1 ? "mutex" : "condition", L->id);
    L->sync_ready = true;
    return COLI_OK;
}

static int init_gate(LruStore *s, char *err, size_t n) {
    int bad = init_sync(&s->gate_mu, &s->gate_cv);
    if (bad)
        return coli_fail(err, n, COLI_ETHREAD, "cannot create the demand gate's %s",
                         bad == 1 ? "mutex" : "condition");
    s->gate_ready = true;
    return COLI_OK;
}

/* Sorts and counts layers, fills entries with validated sources and plans. */
static int build_layers(LruStore *s, const ColiLruConfig *cfg, char *err, size_t n) {
    int max_id = -1;
    for (int i = 0; i < cfg->n_experts; i++) {
        const ColiExpertSource *x = &cfg->experts[i];
        if (x->layer < 0 || x->layer > MAX_LAYER_ID || x->expert < 0 || x->expert > MAX_EXPERT_ID)
            return coli_fail(err, n, COLI_ECONFIG, "expert %d of layer %d: index out of range",
                             x->expert, x->layer);
        if (x->layer > max_id) max_id = x->layer;
    }
    s->max_id = max_id;
    s->by_id = calloc((size_t)max_id + 1, sizeof(Layer *));
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
    /* aligned_alloc: Layer is cache-line aligned, calloc does not promise that */
    s->layers = aligned_alloc(_Alignof(Layer), sizeof(Layer) * (size_t)s->n_layers);
    if (s->layers) memset(s->layers, 0, sizeof(Layer) * (size_t)s->n_layers);
    if (!s->layers) {
        free(max_expert);
        return coli_fail(err, n, COLI_ENOMEM, "out of memory for %d layers", s->n_layers);
    }
    int k = 0;
    for (int id = 0; id <= max_id; id++) {
        if (max_expert[id] < 0) continue;
        Layer *L = &s->layers[k++];
        L->id = id;
        L->n_entries = max_expert[id] + 1;
        L->entries = calloc((size_t)L->n_entries, sizeof(Entry));
        L->present = calloc((size_t)L->n_entries, sizeof(bool));
        L->slot_of = calloc((size_t)L->n_entries, sizeof(Slot *));
        s->by_id[id] = L;
        if (!L->entries || !L->present || !L->slot_of) {
            free(max_expert);
            return coli_fail(err, n, COLI_ENOMEM, "out of memory for layer %d", id);
        }
    }
    free(max_expert);
    for (int i = 0; i < cfg->n_experts; i++) {
        const ColiExpertSource *x = &cfg->experts[i];
        Layer *L = s->by_id[x->layer];
        Entry *e = &L->entries[x->expert];
        if (L->present[x->expert])
            return coli_fail(err, n, COLI_ECONFIG, "layer %d expert %d is listed twice", x->layer, x->expert);
        char what[96];
        const ColiTensorSource *t[3] = {&x->gate, &x->up, &x->down};
        static const char *const names[3] = {"gate", "up", "down"};
        for (int r = 0; r < 3; r++) {
            snprintf(what, sizeof what, "layer %d expert %d %s", x->layer, x->expert, names[r]);
            int rc = coli_check_tensor(&s->files, t[r], what, err, n);
            if (rc) return rc;
        }
        int rc = coli_plan_expert(x, s->direct, &e->plan, err, n);
        if (rc) return rc;
        e->src = *x;
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

/* Decides every layer's slot count and allocates slots and arenas. */
static int build_slots(LruStore *s, const ColiLruConfig *cfg, char *err, size_t n) {
    uint64_t per_layer_budget = cfg->slots_per_layer ? 0 : cfg->capacity_bytes / (uint64_t)s->n_layers;
    for (int i = 0; i < s->n_layers; i++) {
        Layer *L = &s->layers[i];
        uint64_t footprint = 0;
        int present = 0;
        for (int x = 0; x < L->n_entries; x++) {
            if (!L->present[x]) continue;
            present++;
            if (L->entries[x].plan.footprint > footprint) footprint = L->entries[x].plan.footprint;
        }
        L->slot_bytes = (footprint + COLI_IO_ALIGN - 1) / COLI_IO_ALIGN * COLI_IO_ALIGN;
        uint64_t slots = cfg->slots_per_layer ? cfg->slots_per_layer : per_layer_budget / L->slot_bytes;
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
        unsigned char *arena = alloc_arena((size_t)arena_bytes);
        if (!arena)
            return coli_fail(err, n, COLI_ENOMEM, "cannot allocate %llu bytes for the %d slots of layer %d",
                             (unsigned long long)arena_bytes, L->n_slots, L->id);
        L->arena = arena;
        L->slots = calloc((size_t)L->n_slots, sizeof(Slot));
        if (!L->slots)
            return coli_fail(err, n, COLI_ENOMEM, "out of memory for the slots of layer %d", L->id);
        L->list.next = L->list.prev = &L->list;
        for (int j = 0; j < L->n_slots; j++) {
            Slot *v = &L->slots[j];
            v->layer = L;
            v->mem = L->arena + (size_t)j * L->slot_bytes;
            v->expert = -1;
            v->state = SLOT_EMPTY;
            v->generation = next_generation(s);   /* never 0: a zeroed view never matches */
            list_push_lru(L, v);
        }
        int rc = init_layer_sync(L, err, n);
        if (rc) return rc;
    }
    return COLI_OK;
}

int coli_lru_store_create(const ColiLruConfig *cfg, ColiExpertStore **out, char *err, size_t n) {
    if (!out) return coli_fail(err, n, COLI_EINVAL, "create: out is NULL");
    *out = NULL;
    if (!cfg) return coli_fail(err, n, COLI_EINVAL, "create: config is NULL");
    if (cfg->n_experts <= 0 || !cfg->experts)
        return coli_fail(err, n, COLI_ECONFIG, "config lists no experts");
    if (cfg->slots_per_layer == 0 && cfg->capacity_bytes == 0)
        return coli_fail(err, n, COLI_ECONFIG, "config sets neither slots_per_layer nor capacity_bytes");
    LruStore *s = calloc(1, sizeof(LruStore));
    if (!s) return coli_fail(err, n, COLI_ENOMEM, "out of memory for the store");
    s->direct = cfg->direct_io != 0;
    s->wait_timeout_ns = cfg->slot_wait_timeout_ns;
    s->demand_first = cfg->prefetch_never_pauses == 0;
    uint64_t chunk = cfg->prefetch_chunk_bytes ? cfg->prefetch_chunk_bytes : DEFAULT_PREFETCH_CHUNK;
    if (chunk < MIN_PREFETCH_CHUNK) chunk = MIN_PREFETCH_CHUNK;
    if (chunk > (1ull << 40)) chunk = 1ull << 40;   /* no overflow rounding up */
    s->prefetch_chunk = (chunk + COLI_IO_ALIGN - 1) / COLI_IO_ALIGN * COLI_IO_ALIGN;
    int rc = init_gate(s, err, n);
    if (rc == COLI_OK) rc = coli_files_open(&s->files, cfg->files, cfg->n_files, s->direct, err, n);
    if (rc == COLI_OK)
        coli_files_tune(&s->files, cfg->read_chunk_bytes ? cfg->read_chunk_bytes : COLI_DEFAULT_READ_CHUNK,
                        cfg->read_without_advice == 0);
    if (rc == COLI_OK) rc = build_layers(s, cfg, err, n);
    if (rc == COLI_OK) rc = build_slots(s, cfg, err, n);
    if (rc == COLI_OK)
        rc = coli_pool_start(&s->pool, cfg->prefetch_workers,
                             cfg->prefetch_queue_depth ? cfg->prefetch_queue_depth : DEFAULT_QUEUE_DEPTH,
                             run_job, s, err, n);
    if (rc != COLI_OK) {
        free_store(s);
        return rc;
    }
    s->base.ops = &LRU_OPS;
    s->base.state = s;
    *out = &s->base;
    return COLI_OK;
}

/* ---- extras ---------------------------------------------------------- */

int coli_lru_retire_prefetches(ColiExpertStore *store, int layer, const int *keep, int n_keep) {
    LruStore *s = store_of(store);
    Layer *L = s ? find_layer(s, layer) : NULL;
    if (!L || n_keep < 0 || (n_keep > 0 && !keep)) return 0;
    int retired = 0;
    pthread_mutex_lock(&L->mu);
    for (int j = 0; j < L->n_slots; j++) {
        Slot *v = &L->slots[j];
        if (!v->prefetched || v->state == SLOT_EMPTY || (v->state == SLOT_RESIDENT && v->leases))
            continue;
        bool kept = false;
        for (int i = 0; i < n_keep && !kept; i++) kept = keep[i] == v->expert;
        if (kept) continue;
        if (v->state == SLOT_QUEUED) {
            cancel_queued(s, L, v);
        } else if (v->state == SLOT_READING) {   /* a worker reads it: stop at its next chunk */
            atomic_store(&v->retired, true);
        } else {                  /* resident, unleased, never hit: evict it first */
            list_unlink(v);
            list_push_lru(L, v);
            v->prefetched = false;
        }
        retired++;
    }
    pthread_mutex_unlock(&L->mu);
    return retired;
}

int coli_lru_close(ColiExpertStore *store, char *err, size_t n) {
    LruStore *s = store_of(store);
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
    set_hold(s, 0);
    coli_pool_stop(&s->pool);     /* queued prefetches are dropped, running reads end first */
    for (int i = 0; i < s->n_layers; i++) {
        Layer *L = &s->layers[i];
        pthread_mutex_lock(&L->mu);
        for (int j = 0; j < L->n_slots; j++)   /* their jobs are gone: no load is left */
            if (L->slots[j].state == SLOT_QUEUED) cancel_queued(s, L, &L->slots[j]);
        pthread_mutex_unlock(&L->mu);
        free(L->arena);
        L->arena = NULL;
    }
    coli_files_close(&s->files);
    return COLI_OK;
}

int coli_lru_wait_idle(ColiExpertStore *store, int layer, int64_t timeout_ns) {
    LruStore *s = store_of(store);
    if (!s) return COLI_EINVAL;
    struct timespec deadline;
    if (timeout_ns >= 0) deadline_after(&deadline, timeout_ns);
    for (int i = 0; i < s->n_layers; i++) {
        Layer *L = &s->layers[i];
        if (layer >= 0 && L->id != layer) continue;
        pthread_mutex_lock(&L->mu);
        while (L->loading > 0) {
            if (layer_wait(L, timeout_ns >= 0 ? &deadline : NULL) == ETIMEDOUT && L->loading > 0) {
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
        out[2 + i] = (uintptr_t)t[i]->data - lo;
        out[5 + i] = t[i]->scales ? (uintptr_t)t[i]->scales - lo : UINT64_MAX;
    }
    return COLI_OK;
}

void coli_lru_hold_prefetch_reads(ColiExpertStore *store, int hold) {
    LruStore *s = store_of(store);
    if (s) set_hold(s, hold);
}

int coli_lru_held_prefetch_reads(ColiExpertStore *store) {
    LruStore *s = store_of(store);
    return s ? (int)atomic_load(&s->held) : 0;
}

uint64_t coli_lru_prefetch_pauses(ColiExpertStore *store) {
    LruStore *s = store_of(store);
    return s ? atomic_load(&s->prefetch_pauses) : 0;
}

uint64_t coli_lru_active_leases(ColiExpertStore *store) {
    LruStore *s = store_of(store);
    uint64_t total = 0;
    for (int i = 0; s && i < s->n_layers; i++) {
        pthread_mutex_lock(&s->layers[i].mu);
        total += s->layers[i].leases;
        pthread_mutex_unlock(&s->layers[i].mu);
    }
    return total;
}

int coli_lru_layer_slots(ColiExpertStore *store, int layer) {
    LruStore *s = store_of(store);
    Layer *L = s ? find_layer(s, layer) : NULL;
    return L ? L->n_slots : 0;
}

uint64_t coli_lru_slot_bytes(ColiExpertStore *store, int layer) {
    LruStore *s = store_of(store);
    Layer *L = s ? find_layer(s, layer) : NULL;
    return L ? L->slot_bytes : 0;
}

void coli_lru_inject_read_fault(ColiExpertStore *store, uint64_t nth, int errno_value) {
    LruStore *s = store_of(store);
    if (!s) return;
    atomic_store(&s->fault.errno_value, errno_value);
    atomic_store(&s->fault.countdown, nth);
}

int coli_lru_direct_io_fallback(ColiExpertStore *store) {
    LruStore *s = store_of(store);
    return s ? s->files.direct_fallback : 0;
}

static const ColiLeaseEntryPoints LEASE_ENTRY_POINTS = {
    .lookup = coli_lru_lookup,
    .lookup_resident = coli_lru_lookup_resident,
    .lookup_many = coli_lru_lookup_many,
    .view_layout = coli_view_layout,
};

const ColiLeaseEntryPoints *coli_lease_entry_points(void) { return &LEASE_ENTRY_POINTS; }
