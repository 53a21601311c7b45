/*
 * ls_internal.h (private): the LRU store's data, shared by its files.
 *
 *   lru_store.c     life cycle: create (config, layers, slots), close,
 *                   destroy, stats, the small extras
 *   ls_slots.c      the slot state machine and its named transitions
 *   ls_policy.c     the eviction policies behind the seam (lru, lfu, lrfu, cooc)
 *   ls_lookup.c     lookup, lookup_resident, lookup_many, release, replay
 *   ls_prefetch.c   prefetch, the I/O workers' jobs (prefetches, batch
 *                   reads, pins and warm experts), pacing, retire
 *
 * Private names start with ls_ (functions) or Ls (types); public ones with
 * coli_ / Coli. Nothing here is seen by cffi.
 *
 * LOCKING. One mutex and one condition variable per layer guard that
 * layer's slots, evictable set, expert table and counters; the condition is
 * broadcast when a lease is released or a load ends, if anyone waits. No
 * lock is held during a read. The pool mutex nests inside a layer mutex
 * (prefetch posts while holding its layer), never the reverse; so does the
 * demand gate's (a lookup that joins a prefetch wakes its paused reader).
 * No thread holds two layer mutexes at once.
 */
#ifndef COLI_LS_INTERNAL_H
#define COLI_LS_INTERNAL_H

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "coli_errors.h"
#include "expert_reader.h"
#include "io_pool.h"
#include "lru_store.h"

#define LS_DEFAULT_QUEUE_DEPTH 256u
#define LS_MAX_LAYER_ID 1000000
#define LS_MAX_EXPERT_ID 1000000
#define LS_ERRLEN COLI_ERR_LEN
#define LS_DEFAULT_PREFETCH_CHUNK (1ull << 20)   /* a prefetch read can yield to demand reads this often */
#define LS_MIN_PREFETCH_CHUNK (64ull << 10)
#define LS_PAUSE_LIMIT_NS 50000000ll     /* longest a prefetch chunk waits for demand reads */
#define LS_DEMAND_JOB (1ull << 63)       /* tag bit of a batch read job; the rest is the generation */
#define LS_PRELOAD_JOB (1ull << 62)      /* tag of a job that loads preloads until none is left */

typedef enum { LS_EMPTY, LS_QUEUED, LS_READING, LS_RESIDENT } LsSlotState;

/* Where a READING slot of a lease_many batch is: an I/O worker may read it
 * for the batch; the batch's thread finishes the load. */
enum { LS_BATCH_NONE, LS_BATCH_QUEUED, LS_BATCH_RUNNING, LS_BATCH_DONE };

typedef struct LsLayer LsLayer;
typedef struct LsSlot LsSlot;

struct LsSlot {
    LsSlot *prev, *next;          /* the policy's links; valid only while evictable */
    LsLayer *layer;               /* owning layer, fixed */
    unsigned char *mem;           /* slot memory, fixed */
    int expert;                   /* expert held or loading; -1 when EMPTY */
    LsSlotState state;
    bool evictable;               /* in the policy's evictable set (ls_slots.c keeps it) */
    bool prefetched;              /* loaded by prefetch and not hit yet */
    bool pinned;                  /* holds (or loads) a pinned expert: never evictable */
    _Atomic bool demanded;        /* a lookup waits for this load: it must not pause */
    _Atomic bool retired;         /* a prefetch known to be a wrong guess: stop reading it */
    uint32_t leases;              /* active leases; > 0 only when RESIDENT */
    uint64_t generation;          /* bumped whenever the slot is repurposed */
    /* The view of the expert given to this slot, minus the lease fields: a
     * hit copies it instead of reading the expert's (large, cold) entry. */
    ColiExpertView view;
    /* The policy's own state of this slot (a policy may ignore it). */
    double pol_value;             /* e.g. a decayed use count */
    uint64_t pol_stamp;           /* e.g. the layer's clock at the last use */
    uint32_t pol_index;           /* e.g. the slot's place in a heap */
    uint8_t batch;                /* LS_BATCH_* */
    int batch_rc;                 /* the worker's read result, when DONE */
    uint64_t batch_nread;
    char batch_err[LS_ERRLEN];
};

typedef struct {
    ColiExpertSource src;         /* formats and shapes for views */
    ColiReadPlan plan;
} LsEntry;

typedef struct {
    uint64_t requests, hits, misses, prefetched, prefetch_hits, bytes_read;
    uint64_t inflight_joins, loads_started, loads_failed, evictions, slot_waits;
    uint64_t persistent_hits;     /* hits on pinned slots */
} LsCounters;

/* THE POLICY SEAM. The evictable set of a layer (every EMPTY slot, and
 * every RESIDENT one without a lease and not pinned) belongs to its policy;
 * the state machine (ls_slots.c) tells it what changes, under the layer
 * mutex, and asks it for a victim. A policy keeps its state in the slots'
 * pol_* fields, in the layer's pol (its init allocates it) and may read
 * the layer's clock (one tick per lookup or lookup_many of the layer) and
 * requests_of. Only victim, and insert and remove unless lru_list, are
 * required. For a policy whose set is the LRU list (lru, cooc) the state
 * machine calls the list operations directly (ls_lru_insert/remove,
 * inlined) instead of through the table, so its hit path has no indirect
 * call for them. */
typedef struct {
    const char *name;
    /* The set is the layer's LRU list (list, ls_lru_insert/remove), which
     * the state machine keeps inline, a slot's pol_value 1 if it joined
     * cold, else 0; insert and remove are then unused. */
    bool lru_list;
    /* v joins the set: at the hot end (just released or loaded) or, with
     * cold, ahead of every slot there for eviction (emptied, demoted). */
    void (*insert)(LsLayer *L, LsSlot *v, bool cold);
    void (*remove)(LsLayer *L, LsSlot *v);   /* v leaves the set: leased or taken */
    LsSlot *(*victim)(LsLayer *L);           /* the slot to give up next, or NULL */
    /* A lookup used v's resident (or queued, taken over) expert; rank is the
     * expert's place in the request (0 for a single lookup). Called before
     * v leaves the set. */
    void (*hit)(LsLayer *L, LsSlot *v, int rank);
    /* v was given to a new expert: by a demand miss (used, with its rank),
     * or by a prefetch or a pin (not used, rank -1). */
    void (*assign)(LsLayer *L, LsSlot *v, int rank);
    /* A lookup (count 1) or lookup_many of these experts (in request
     * order, repeats possible) begins, before any of its hits or misses. */
    void (*step)(LsLayer *L, const int *experts, int count);
    int (*init)(LsLayer *L, char *err, size_t n);   /* before any slot joins the set */
    void (*fini)(LsLayer *L);                       /* frees what init allocated */
} LsPolicy;

extern const LsPolicy ls_policy_lru, ls_policy_lfu, ls_policy_lrfu, ls_policy_cooc;

/* The LRU list (ls_policy.c describes it), inline for the hit path. */
static inline void ls_lru_insert(LsLayer *L, LsSlot *s, bool cold);
static inline void ls_lru_remove(LsSlot *s);

/* A binary min-heap of slots for policies that order by a key: each slot's
 * pol_index is its place. less orders two slots. O(log n) per change. */
typedef bool (*LsLess)(const LsSlot *a, const LsSlot *b);
typedef struct {
    LsSlot **at;                  /* n_slots places */
    uint32_t n;
} LsHeap;

void ls_heap_push(LsHeap *h, LsSlot *v, LsLess less);
void ls_heap_remove(LsHeap *h, LsSlot *v, LsLess less);
/* After v's key changed (v in the heap). */
void ls_heap_update(LsHeap *h, LsSlot *v, LsLess less);
extern const LsPolicy *const ls_policies[];   /* indexed by COLI_POLICY_*, NULL-terminated */

struct LsLayer {
    /* Layers sit side by side in one array: each starts on its own cache
     * line so threads on different layers do not share one. */
    _Alignas(64) pthread_mutex_t mu;  /* guards everything below but the fixed fields and atomics */
    pthread_cond_t cv;            /* a lease was released or a load ended */
    int id;                       /* the model's layer index, fixed */
    int n_entries;                /* largest expert index + 1, fixed */
    LsEntry *entries;             /* indexed by expert; read on loads only */
    /* Compact per-expert state, so a hit over a large model touches a few
     * bytes per expert instead of a cold LsEntry of hundreds. */
    bool *present;                /* indexed by expert: the model has it; fixed */
    LsSlot **slot_of;             /* indexed by expert: slot holding or loading it, or NULL */
    uint64_t *requests_of;        /* indexed by expert: its requests (they sum to c.requests) */
    LsSlot *slots;                /* n_slots, fixed */
    int n_slots;
    int n_pinned;                 /* slots pinned now */
    uint64_t slot_bytes;          /* stride of the arena, fixed */
    unsigned char *arena;
    const LsPolicy *policy;       /* fixed */
    void *pol;                    /* the policy's state of this layer (its init's) */
    double pol_param;             /* the policy's tuning constant; 0 = its default; fixed */
    uint64_t clock;               /* ticks once per lookup or lookup_many of this layer */
    LsSlot list;                  /* the LRU policy's sentinel */
    uint32_t waiters;             /* threads in a wait on cv */
    uint32_t loading;             /* slots QUEUED or READING */
    uint32_t queued;              /* slots QUEUED */
    uint32_t evictable;           /* slots in the evictable set */
    uint64_t resident_bytes;
    uint64_t leases;              /* leases held on this layer's slots */
    LsCounters c;
    bool sync_ready;              /* mu and cv were initialised */
    bool pol_ready;               /* the policy's init succeeded: its fini runs */
    _Atomic uint64_t calls;       /* lookups of this layer in progress (close guard) */
};

typedef struct {
    ColiExpertStore base;         /* handed out; base.state points here */
    ColiFileSet files;
    LsLayer *layers;              /* n_layers, sorted by id */
    int n_layers;
    LsLayer **by_id;              /* layer id -> layer or NULL, max_id + 1 entries */
    int max_id;
    bool direct;
    bool replay;                  /* no files, no slot memory: loads read nothing */
    int64_t wait_timeout_ns;
    ColiIoPool pool;
    ColiFaultHook fault;
    _Atomic uint64_t inflight;    /* loads QUEUED or READING, all layers */
    _Atomic uint64_t peak_inflight;
    _Atomic uint64_t prefetch_calls;  /* prefetches in progress (close guard) */
    _Atomic uint64_t generations; /* source of slot generations: unique in the store */
    _Atomic int closed;           /* set by coli_lru_close: slot memory is gone */
    /* Demand first: prefetch reads go in chunks and, before each chunk,
     * wait while a demand read is in progress (at most LS_PAUSE_LIMIT_NS), so
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
    LsSlot **preloads;                /* the slots given to pins, then warm experts, at create */
    uint64_t *preload_gens;           /* each one's generation then: a changed one was taken */
    int n_preloads;
    _Atomic int next_preload;         /* the next of preloads a preload job looks at */
    _Atomic int stopping;             /* close or destroy stops the pool: preload jobs end */
} LsStore;

/* ---- small helpers (every file) ------------------------------------- */

static inline void ls_lru_insert(LsLayer *L, LsSlot *s, bool cold) {
    if (cold) {               /* at the LRU end */
        s->prev = L->list.prev;
        s->next = &L->list;
        L->list.prev->next = s;
        L->list.prev = s;
    } else {                  /* at the MRU end */
        s->next = L->list.next;
        s->prev = &L->list;
        L->list.next->prev = s;
        L->list.next = s;
    }
}

static inline void ls_lru_remove(LsSlot *s) {
    s->prev->next = s->next;
    s->next->prev = s->prev;
}

extern const ColiExpertStoreOps ls_ops;

static inline LsStore *ls_store_of(ColiExpertStore *store) {
    return (store && store->ops == &ls_ops) ? (LsStore *)store->state : NULL;
}

static inline LsLayer *ls_find_layer(LsStore *s, int layer) {
    return (layer >= 0 && layer <= s->max_id) ? s->by_id[layer] : NULL;
}

static inline LsEntry *ls_find_entry(LsLayer *L, int expert) {
    return (expert >= 0 && expert < L->n_entries && L->present[expert])
               ? &L->entries[expert] : NULL;
}

static inline uint64_t ls_next_generation(LsStore *s) {
    return atomic_fetch_add(&s->generations, 1) + 1;
}

/* Brackets a call that touches slot memory or the pool, against close().
 * Both sides write their flag then read the other's (sequentially
 * consistent), so either close sees the call or the call sees close. The
 * counter is per layer (or the store's, for prefetch) so that threads on
 * different layers never write one cache line. */
static inline bool ls_call_enter(LsStore *s, _Atomic uint64_t *calls) {
    atomic_fetch_add(calls, 1);
    if (!atomic_load(&s->closed)) return true;
    atomic_fetch_sub(calls, 1);
    return false;
}

static inline void ls_call_leave(_Atomic uint64_t *calls) { atomic_fetch_sub(calls, 1); }

/* Counts a request of expert (stats and the per-expert counts). */
static inline void ls_count_request(LsLayer *L, int expert) {
    L->c.requests++;
    L->requests_of[expert]++;
}

/* Bytes a read of plan brings (what a replay store counts for a load). */
static inline uint64_t ls_plan_bytes(const ColiReadPlan *plan) {
    uint64_t total = 0;
    for (int i = 0; i < plan->n_runs; i++) total += plan->runs[i].length;
    return total;
}

/* Reads plan into slot memory mem (see coli_read_expert); a replay store
 * reads nothing and counts the bytes a read would bring. */
static inline int ls_read(LsStore *s, const ColiReadPlan *plan, unsigned char *mem,
                          const ColiReadPacer *pacer, uint64_t *nread, char *err, size_t n) {
    if (s->replay) {
        *nread = ls_plan_bytes(plan);
        return COLI_OK;
    }
    return coli_read_expert(&s->files, plan, mem, &s->fault, pacer, nread, err, n);
}

/* Wakes the layer's waiters, if any. Caller holds L->mu. */
static inline void ls_wake(LsLayer *L) {
    if (L->waiters > 0) pthread_cond_broadcast(&L->cv);
}

/* The monotonic time ns from now. */
void ls_deadline_after(struct timespec *ts, int64_t ns);

/* Waits on L->cv, until deadline when given. Returns ETIMEDOUT or 0. */
int ls_layer_wait(LsLayer *L, const struct timespec *deadline);

/* ---- demand first (ls_prefetch.c) ----------------------------------- */

/* Bracket every read a lookup waits for. */
void ls_demand_begin(LsStore *s);
void ls_demand_end(LsStore *s);
/* A lookup now waits for the load of v (READING): it must run unpaused. */
void ls_demand_join(LsStore *s, LsSlot *v);
/* The test hook's hold on prefetch reads (lifted by close and destroy). */
void ls_set_hold(LsStore *s, int hold);
/* Loads the pins and warm experts (LS_PRELOAD_JOB jobs, or here with no
 * workers). */
void ls_start_preloads(LsStore *s);
/* The pool's job function: batch reads (LS_DEMAND_JOB) and prefetches. */
void ls_run_job(void *ctx, ColiJob job);

/* ---- ops (ls_lookup.c, ls_prefetch.c) ------------------------------- */

int ls_lookup_op(ColiExpertStore *store, ColiExpertKey key, ColiExpertView *view);
void ls_release_op(ColiExpertStore *store, ColiExpertView *view);
int ls_prefetch_op(ColiExpertStore *store, const ColiExpertKey *keys, int count);

#include "ls_slots.h"

#endif /* COLI_LS_INTERNAL_H */
