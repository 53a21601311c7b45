/*
 * ls_internal.h (private): the store's data, shared by its files.
 *
 *   ls_api.c        the public entry points: each checks its handle and
 *                   calls the file that does the job; the ops table
 *   ls_ffn.c        leased experts computed from their slots (the kernels'
 *                   descriptions, holds, a batch over the compute pool)
 *   ls_create.c     life cycle: create (config, layers, slot counts and
 *                   memory, pins and warm experts, the pool), close, destroy
 *   ls_lookup.c     lookup, lookup_resident, lookup_many, release, replay,
 *                   view layouts
 *   ls_prefetch.c   prefetch, the I/O workers' jobs (prefetches, batch
 *                   reads, pins and warm experts), retire
 *   ls_slots.c      the slot state machine and its named transitions (ls_slots.h)
 *   ls_policy.c     the eviction policies behind the seam (ls_policy.h)
 *   ls_wait.c       waits: deadlines, a layer's condition, wait_idle, and
 *                   the demand gate where prefetch reads pause for demand reads
 *   ls_stats.c      counters and facts: stats, requests, pins, leases, parts
 *
 * A file calls only files listed after it (policies only through the seam's
 * table), so no two files call each other; ls_test_control.c, compiled in
 * test builds only, calls ls_api.c's handle check and the demand gate.
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
#include "coli_sources.h"
#include "coli_store.h"         /* ColiMoeCall */
#include "expert_reader.h"
#include "expert_store.h"
#include "ffn.h"
#include "io_pool.h"

#define LS_DEFAULT_QUEUE_DEPTH 256u
#define LS_ERRLEN COLI_ERR_LEN
#define LS_DEFAULT_PREFETCH_CHUNK (1ull << 20)   /* a prefetch read can yield to demand reads this often */
/* With O_DIRECT each chunk is a request of its own to the device, and each
 * request costs a fixed overhead besides its bytes: an expert of a few MiB
 * goes in one. */
#define LS_DEFAULT_DIRECT_PREFETCH_CHUNK (4ull << 20)
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
typedef struct LsPolicy LsPolicy;   /* the policy seam: ls_policy.h */
typedef struct ColiStoreConfig ColiStoreConfig;   /* coli_store.h */

struct LsSlot {
    LsSlot *prev, *next;          /* the list's links (keeps_list); valid only while evictable */
    LsLayer *layer;               /* owning layer, fixed */
    unsigned char *mem;           /* slot memory, fixed */
    int expert;                   /* expert held or loading; -1 when EMPTY */
    LsSlotState state;
    bool evictable;               /* in the policy's evictable set (ls_slots.c keeps it) */
    bool prefetched;              /* loaded by prefetch and not hit yet */
    bool early;                   /* a start_reads load: its first lookup counts a miss */
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

/* An extra part as the kernels see it (the source's record, kept: the
 * caller's array need not outlive create). */
typedef struct {
    uint64_t nbytes;
    int8_t kind;                  /* COLI_PART_* */
    int8_t role;                  /* 0 gate (or gate_up), 1 up, 2 down */
    ColiTensorFormat format;      /* a bias's elements */
} LsPart;

typedef struct {
    ColiExpertSource src;         /* formats and shapes for views; src.parts is NULL */
    ColiReadPlan plan;
    LsPart parts[COLI_MAX_PARTS]; /* src.n_parts of them */
} LsEntry;

typedef struct {
    uint64_t requests, hits, misses, prefetched, prefetch_hits, bytes_read;
    uint64_t inflight_joins, loads_started, loads_failed, evictions, slot_waits;
    uint64_t persistent_hits;     /* hits on pinned slots */
} LsCounters;

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
    unsigned char *arena;         /* slot memory: a mapping of its own (ls_create.c) */
    size_t arena_bytes;           /* the mapping's length, for munmap; 0 without an arena */
    const LsPolicy *policy;       /* fixed */
    void *pol;                    /* the policy's state of this layer (its init's) */
    double pol_param;             /* the policy's tuning constant; 0 = its default; fixed */
    uint64_t clock;               /* ticks once per lookup or lookup_many of this layer */
    LsSlot list;                  /* the list's sentinel, for a policy that keeps_list */
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

#ifdef COLI_TEST_CONTROL
/* What a test build's coli_test_control arms (ls_test_control.c). A
 * production build has none of it, and its reads and prefetch pauses check
 * nothing. */
typedef struct {
    ColiReadFault fault;              /* the nth read from now fails (the files point here) */
    _Atomic int hold_prefetch;        /* prefetch reads wait at the gate before each chunk */
    _Atomic uint32_t held;            /* prefetch reads waiting on that hold now */
} LsTestState;
#endif

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
    _Atomic uint64_t inflight;    /* loads QUEUED or READING, all layers */
    _Atomic uint64_t peak_inflight;
    _Atomic uint64_t prefetch_calls;  /* prefetches in progress (close guard) */
    _Atomic uint64_t generations; /* source of slot generations: unique in the store */
    _Atomic int closed;           /* set by coli_store_close: slot memory is gone */
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
#ifdef COLI_TEST_CONTROL
    LsTestState test;                 /* what coli_test_control sets (test builds only) */
#endif
    LsSlot **preloads;                /* the slots given to pins, then warm experts, at create */
    uint64_t *preload_gens;           /* each one's generation then: a changed one was taken */
    int n_preloads;
    _Atomic int next_preload;         /* the next of preloads a preload job looks at */
    _Atomic int stopping;             /* close or destroy stops the pool: preload jobs end */
} LsStore;

/* ---- small helpers (every file) ------------------------------------- */

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

/* Puts the GPTQ matrices with act order of entry e, just read into slot
 * memory mem, into group order (gptq_group_order.h). COLI_OK, COLI_ENOMEM,
 * or COLI_ECONFIG for a stored g_idx that is negative but not group order.
 * Runs in the reader, no lock held. (ls_ffn.c) */
int ls_group_order(const LsEntry *e, unsigned char *mem, char *err, size_t n);

/* Reads entry e into slot memory mem (see coli_read_expert) and puts it in
 * the order the kernels read; a replay store reads nothing and counts the
 * bytes a read would bring. */
static inline int ls_read(LsStore *s, const LsEntry *e, unsigned char *mem,
                          const ColiReadPacer *pacer, uint64_t *nread, char *err, size_t n) {
    if (s->replay) {
        *nread = ls_plan_bytes(&e->plan);
        return COLI_OK;
    }
    int rc = coli_read_expert(&s->files, &e->plan, mem, pacer, nread, err, n);
    return rc == COLI_OK ? ls_group_order(e, mem, err, n) : rc;
}

/* Wakes the layer's waiters, if any. Caller holds L->mu. */
static inline void ls_wake(LsLayer *L) {
    if (L->waiters > 0) pthread_cond_broadcast(&L->cv);
}

/* ---- the handle (ls_api.c) ------------------------------------------ */

/* The ops every store of this library carries: its identity. An op is
 * reached only through this table, so it may take store->state as ours. */
extern const ColiExpertStoreOps ls_ops;

/* The store behind a public handle, or NULL when it is not one of ours. */
static inline LsStore *ls_store_of(ColiExpertStore *store) {
    return (store && store->ops == &ls_ops) ? (LsStore *)store->state : NULL;
}

/* ---- life cycle (ls_create.c) ---------------------------------------- */

/* The store of coli_store_create, its handle not filled in yet: *out on
 * success; on failure NULL, nothing left allocated, err says why. Its pins
 * and warm experts are loading (or loaded, with no workers) on return. */
int ls_create(const ColiStoreConfig *config, LsStore **out, char *err, size_t n);
/* coli_store_plan_slots, config not NULL. */
int ls_plan_slots(const ColiStoreConfig *config, uint32_t *out, int n_out, char *err, size_t n);
/* coli_store_close on a store of ours. */
int ls_close(LsStore *s, char *err, size_t n);
void ls_destroy_op(ColiExpertStore *store);

/* ---- lookups (ls_lookup.c) ------------------------------------------- */

/* coli_store_lookup (hit_only: coli_store_lookup_resident) on a store of
 * ours, with the close guard. */
int ls_lookup(LsStore *s, int layer, int expert, ColiExpertView *view, bool hit_only,
              char *err, size_t n);
/* coli_store_lookup_many on a store of ours, with the close guard. */
int ls_lookup_many(LsStore *s, int layer, const int *experts, int count, ColiExpertView *views,
                   char *err, size_t n);
/* coli_store_replay on a store of ours. */
int ls_replay(LsStore *s, const int *layers, int n_layers, const int32_t *experts,
              int64_t n_tokens, int k, char *err, size_t n);
int ls_lookup_op(ColiExpertStore *store, ColiExpertKey key, ColiExpertView *view);
void ls_release_op(ColiExpertStore *store, ColiExpertView *view);

/* ---- prefetch and the workers' jobs (ls_prefetch.c) ------------------ */

int ls_prefetch_op(ColiExpertStore *store, const ColiExpertKey *keys, int count);
int ls_start_reads(LsStore *s, LsLayer *L, const int *experts, int count);
/* coli_store_retire_prefetches on layer L. */
int ls_retire_prefetches(LsStore *s, LsLayer *L, const int *keep, int n_keep);
/* Loads the pins and warm experts (LS_PRELOAD_JOB jobs, or here with no
 * workers). */
void ls_start_preloads(LsStore *s);
/* The pool's job function: batch reads (LS_DEMAND_JOB) and prefetches. */
void ls_run_job(void *ctx, ColiJob job);

/* ---- waits and the demand gate (ls_wait.c) --------------------------- */

/* A mutex and a condition on the monotonic clock (the one deadlines use).
 * Returns 0, 1 if the mutex failed, 2 if the condition did (nothing left). */
int ls_sync_init(pthread_mutex_t *mu, pthread_cond_t *cv);
/* The monotonic time ns from now. */
void ls_deadline_after(struct timespec *ts, int64_t ns);
/* Waits on L->cv, until deadline when given. Returns ETIMEDOUT or 0. */
int ls_layer_wait(LsLayer *L, const struct timespec *deadline);
/* coli_store_wait_idle on a store of ours. */
int ls_wait_idle(LsStore *s, int layer, int64_t timeout_ns);
/* Bracket every read a lookup waits for. */
void ls_demand_begin(LsStore *s);
void ls_demand_end(LsStore *s);
/* A lookup now waits for the load of v (READING): it must run unpaused. */
void ls_demand_join(LsStore *s, LsSlot *v);
/* Before each chunk of prefetch read v: false to stop it (retired as a
 * wrong guess); else it may go on, after waiting while demand reads run
 * unless a lookup waits for v. */
bool ls_gate_pause(LsStore *s, LsSlot *v);
#ifdef COLI_TEST_CONTROL
/* Test builds: holds begun prefetch reads at the gate, or lets them go. */
void ls_gate_hold(LsStore *s, int hold);
#endif

/* Close and destroy let held prefetch reads go (nothing to do in a
 * production build, which cannot hold them). */
static inline void ls_lift_holds(LsStore *s) {
#ifdef COLI_TEST_CONTROL
    ls_gate_hold(s, 0);
#else
    (void)s;
#endif
}

/* ---- leased experts computed (ls_ffn.c) ------------------------------ */

/* coli_store_expert_ffn and coli_store_ffn_expert on a store of ours. */
int ls_expert_ffn(LsStore *s, const ColiExpertView *views, int count, const int64_t *rows,
                  const ColiFfnCall *call, int activation, float alpha, float limit,
                  ColiComputePool *pool, char *err, size_t n);
int ls_ffn_expert(LsStore *s, const ColiExpertView *view, int activation, float alpha,
                  float limit, ColiFfnExpert *out, char *err, size_t n);
/* coli_store_moe_ffn on a store of ours. */
int ls_moe_ffn(LsStore *s, const ColiExpertView *views, int count, const ColiMoeCall *call,
               int activation, float alpha, float limit, ColiComputePool *pool, char *err, size_t n);

/* ---- counters and facts (ls_stats.c) --------------------------------- */

void ls_stats_op(ColiExpertStore *store, ColiExpertStoreStats *out);
/* Adds layer L's counters to out (capacity_bytes: its slots' bytes). */
void ls_add_layer_stats(LsLayer *L, ColiExpertStoreStats *out);
/* Leases held now, over all layers. */
uint64_t ls_active_leases(LsStore *s);
/* coli_store_expert_requests, coli_store_pinned and coli_store_expert_parts
 * on a store of ours. */
int ls_expert_requests(LsLayer *L, uint64_t *out, int n);
int ls_pinned(LsStore *s, ColiExpertKey *out, int n);
int ls_expert_parts(const LsEntry *e, uint64_t *out, int cap);

#endif /* COLI_LS_INTERNAL_H */
