/*
 * coli_store.h: the expert store.
 *
 * Experts stay on disk in their safetensors shards and are read into a
 * bounded set of RAM slots: one cache per MoE layer, each with its own slot
 * budget and eviction policy (LRU by default), so layers never evict each
 * other's experts. A pool of I/O worker threads loads prefetched experts in
 * the background.
 *
 * THREADS. Every function here, and every op of the ColiExpertStore it
 * creates except destroy, is safe to call concurrently from many threads on
 * one store. One view is never used by two threads at once. destroy must be
 * the last call and must not race any other call.
 *
 * LOCK ORDER. Each layer has a mutex; the I/O pool has one, and so has the
 * demand gate (where paused prefetch reads wait). A thread may take the pool
 * or the gate mutex while it holds one layer mutex, never the other way
 * round, never holds both of them, and never holds two layer mutexes at
 * once. No lock is held during a read.
 *
 * DEMAND FIRST. A lookup that misses reads the expert itself (or with the
 * I/O workers, for lease_many) ahead of every queued prefetch. Prefetch
 * reads already running go in chunks (prefetch_chunk_bytes) and wait before
 * each chunk while a demand read is in progress (up to 50 ms a chunk),
 * unless a lookup is waiting for that very load; so a miss shares the disk
 * with at most one chunk per worker.
 *
 * GENERATIONS. Every slot tenancy (an expert loaded into a slot) gets a
 * generation that is unique within the store and never reused, so a view's
 * lease_generation names one tenancy of one slot.
 *
 * ERRORS. Functions return 0 or a negative COLI_E* code; where a message
 * buffer is passed, a failure writes a NUL-terminated message naming what
 * and where (file, offset, errno) into it, truncated to its size.
 */
#ifndef COLI_STORE_H
#define COLI_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "coli_errors.h"   /* the COLI_E* codes every function here returns, COLI_ERR_LEN */
#include "coli_sources.h"  /* ColiExpertSource: where each expert's bytes are */
#include "expert_store.h"
#include "ffn.h"           /* ColiFfnExpert, ColiFfnCall, ColiComputePool: the kernels */

typedef struct ColiStoreConfig {
    const char *const *files;       /* paths of the model's files */
    int n_files;
    const ColiExpertSource *experts;
    int n_experts;
    uint32_t slots_per_layer;       /* > 0: slots in every layer's cache */
    uint64_t capacity_bytes;        /* used when slots_per_layer == 0: split evenly across layers */
    uint32_t prefetch_workers;      /* I/O threads; 0 = no pool, prefetch accepts nothing */
    uint32_t prefetch_queue_depth;  /* queued prefetches at most; 0 = a default */
    int direct_io;                  /* nonzero: open files with O_DIRECT where the file system allows */
    int64_t slot_wait_timeout_ns;   /* how long a lookup waits when every slot is leased; < 0 = forever */
    int prefetch_never_pauses;      /* nonzero: prefetch reads share the disk with demand reads
                                     * instead of pausing for them (for comparisons) */
    uint64_t prefetch_chunk_bytes;  /* prefetch reads go in chunks of this size, rounded up to
                                     * 4 KiB, at least 64 KiB; 0 = 1 MiB, or 4 MiB when the
                                     * store reads with O_DIRECT */
    /* Reads through the page cache (no O_DIRECT) go in preads of this many
     * bytes, rounded up to 4 KiB; 0 = COLI_DEFAULT_READ_CHUNK. A size past
     * an expert's bytes reads each run in one call. O_DIRECT reads always
     * take one call per run. */
    uint64_t read_chunk_bytes;
    int read_without_advice;        /* nonzero: buffered reads leave the kernel's readahead on
                                     * and give no POSIX_FADV_WILLNEED (for comparisons) */
    /* Appended for per-layer budgets, policies, pins and replay. */
    const uint32_t *layer_slots;    /* NULL, or n_layer_slots (> 0 each): the slots of every MoE
                                     * layer in ascending layer-id order; overrides slots_per_layer
                                     * and capacity_bytes */
    int n_layer_slots;              /* must equal the number of layers when layer_slots is set */
    int policy;                     /* a COLI_POLICY_* value: how each layer chooses its victim */
    const ColiExpertKey *pinned;    /* experts kept resident, never evicted (see below) */
    int n_pinned;
    int replay;                     /* nonzero: a replay store (see below) */
    double policy_param;            /* the policy's tuning constant; 0 = its default */
    /* Appended for a warm start. */
    const ColiExpertKey *warm;      /* experts loaded at create into free slots, not pinned (see below) */
    int n_warm;
    /* Appended for replay stores of a model without files. */
    uint64_t replay_expert_bytes;   /* > 0, replay only: every expert takes this many bytes (its slot,
                                     * and what a load counts), and only the layer and expert of
                                     * each source are read */
    /* Appended for slot memory committed at create. */
    int lazy_slots;                 /* nonzero: each slot's pages are faulted in by its first read
                                     * instead of at create (see below) */
} ColiStoreConfig;

/* Limits and counts of this API. */
enum {
    COLI_MAX_LAYER_ID = 1000000,    /* layer ids run 0..COLI_MAX_LAYER_ID */
    COLI_MAX_EXPERT_ID = 1000000,   /* expert ids run 0..COLI_MAX_EXPERT_ID */
    COLI_VIEW_LAYOUT_LEN = 8        /* the entries coli_view_layout writes */
};

#define COLI_DEFAULT_READ_CHUNK (256u << 10)

/* Eviction policies (coli_store_policy_name gives each one's name). */
enum {
    COLI_POLICY_LRU = 0,            /* least recently used */
    COLI_POLICY_LFU = 1,            /* least frequently used since loaded, then least recently */
    COLI_POLICY_LRFU = 2,           /* least decayed use count, uses weighted by rank in lookup_many;
                                     * policy_param: half-life in multiples of the layer's slots
                                     * (default 2) */
    COLI_POLICY_COOC = 3            /* among the older half of the evictable slots, the expert least
                                     * likely to be asked right after the current lookup's experts,
                                     * learnt from the layer's own sequence of lookups;
                                     * policy_param: half-life of what it learnt, in lookups of the
                                     * layer (default 64) */
};

/* PINNED EXPERTS. Each pinned expert takes one slot out of its layer's
 * budget for good: pinned + evictable slots = the layer's slots. A layer may
 * pin all its slots only when they hold all its experts. The pins are loaded
 * after create returns: by the I/O workers (paced like prefetches: demand
 * reads go first), or, with no workers, by create itself. A lookup of a pin
 * still loading joins or takes over its load. Hits on pinned slots count as
 * persistent_hits, every other hit as a transient hit. A pin whose load
 * fails is dropped: its slot joins the layer's evictable slots.
 *
 * WARM START. Each warm expert takes one of its layer's unpinned slots and
 * is loaded after create returns, after the pins and in the same way, but
 * it is not pinned: once loaded it is an ordinary resident expert, evicted
 * by the layer's policy like any other. Loads that end later count as more
 * recently used, so with no workers (and in a replay store) the last warm
 * expert of a layer is its most recent. A layer warms at most as many
 * experts as it has unpinned slots: the last ones of its list, as if each
 * had been looked up in turn. An expert listed twice, or both pinned and
 * warm, is an error. A lookup may take a warm load over (its
 * own expert) or take its slot (another expert) before it starts. Loading a
 * warm expert counts a load, not a request; hits on it are transient hits.
 *
 * REPLAY. A replay store opens no file (files may be NULL), reads nothing
 * and allocates no slot memory, and starts no worker; otherwise it is the
 * same store: lookups, leases, evictions and every counter behave as in a
 * live store fed the same calls (a load counts the bytes it would read),
 * but views carry no bytes (data and scales are NULL). Pins and warm
 * experts are resident when create returns. Its sources are checked for
 * format and shape but not against files; with replay_expert_bytes, it
 * needs none: only their layer and expert.
 *
 * SLOT MEMORY. Create faults every slot's pages in (zeroed once, on huge
 * pages where the kernel gives them), so that no read waits for the kernel
 * to zero the pages it is about to fill, and a budget the machine cannot
 * back fails at create. With lazy_slots, a slot's pages are faulted in by
 * the first read into it instead: create is quicker for a cache much
 * larger than a run will fill. */

/* Validates config, opens its files and allocates every slot. On success
 * *out is a store owned by the caller (free it with its destroy op) and 0 is
 * returned; on failure *out is NULL, nothing is left open or allocated, and
 * err holds the reason. */
int coli_store_create(const ColiStoreConfig *config, ColiExpertStore **out,
                      char *err, size_t err_len);

/* The slots of every MoE layer, in ascending layer-id order, that
 * coli_store_create would give config, without opening a file or
 * allocating slot memory: up to n of them into out. Returns the number of
 * layers, or a negative COLI_E* code (err says why) for a config that
 * create refuses for its budget, policy or experts. Files are not checked
 * (create checks them) and direct_io is taken as granted: a file system
 * that refuses O_DIRECT can only give a layer more slots, never fewer. */
int coli_store_plan_slots(const ColiStoreConfig *config, uint32_t *out, int n,
                          char *err, size_t err_len);

/* The lookup op with the key as two ints and a message: on failure the view
 * is zeroed and err says what went wrong. err may be NULL. A view that
 * already holds a lease of this store is refused with COLI_ELEASE, and that
 * lease is released first so that it cannot leak (rule 1). */
int coli_store_lookup(ColiExpertStore *store, int layer, int expert,
                      ColiExpertView *view, char *err, size_t err_len);

/* Leases a layer's experts all or nothing: on failure no lease is held, every
 * view is zeroed and err names the expert that failed. */
int coli_store_lookup_many(ColiExpertStore *store, int layer, const int *experts,
                           int count, ColiExpertView *views, char *err,
                           size_t err_len);

/* The lookup's hit and nothing else: when the expert is resident now, leases
 * it to view exactly as coli_store_lookup would and returns 0; otherwise
 * (missing, loading, unknown, closed, anything) returns COLI_EAGAIN having
 * changed nothing but zeroing the view. It never waits for a read, only for
 * the layer's mutex, so a binding may call it without dropping its
 * interpreter lock and fall back to coli_store_lookup. */
int coli_store_lookup_resident(ColiExpertStore *store, int layer, int expert,
                               ColiExpertView *view);

/* The lease entry points behind one pointer, for a binding that calls the
 * store without linking the library (colibri's CPython lease type gets
 * this address from the cffi extension). Release is the store's op
 * (coli_expert_release). */
typedef struct {
    int (*lookup)(ColiExpertStore *store, int layer, int expert, ColiExpertView *view,
                  char *err, size_t err_len);
    int (*lookup_resident)(ColiExpertStore *store, int layer, int expert, ColiExpertView *view);
    int (*lookup_many)(ColiExpertStore *store, int layer, const int *experts, int count,
                       ColiExpertView *views, char *err, size_t err_len);
    int (*view_layout)(const ColiExpertView *view, uint64_t *out);
} ColiLeaseEntryPoints;

const ColiLeaseEntryPoints *coli_lease_entry_points(void);

/* Frees the slot memory, stops the I/O pool and closes the files, unless a
 * lease is held or a lookup or prefetch is in progress (COLI_ELEASE, nothing
 * changed). After it, lookups fail with COLI_ECLOSED, prefetch accepts
 * nothing, and stats, release and the counters stay safe to call; destroy
 * still frees the rest. Closing twice is fine. */
int coli_store_close(ColiExpertStore *store, char *err, size_t err_len);

/* Tells the store which experts of layer the engine really used, once it
 * knows: prefetches of that layer for any other expert are wrong guesses.
 * Queued ones are cancelled (their reads never start), running reads stop
 * before their next chunk unless a lookup waits for them (the slot is then
 * emptied; not a failed load), and loaded ones that were never hit move to
 * the cold end of their layer's policy, to be evicted first. Returns how many were retired; 0 for an
 * unknown layer. */
int coli_store_retire_prefetches(ColiExpertStore *store, int layer, const int *keep,
                                 int n_keep);

/* Starts reads of experts of layer on the I/O workers for lookups the
 * caller makes right after (computing meanwhile with what is resident):
 * ahead of every queued prefetch, and read as demand reads (prefetch reads
 * pause for them, they pause for nothing). They are not guesses: the first
 * lookup of each counts a miss, not a hit or an in-flight join, and they
 * are neither counted as prefetched nor retired.
 * Experts resident or loading, unknown, or without a slot to take now are
 * skipped. Returns how many reads were queued (0 without workers or for an
 * unknown layer). */
int coli_store_start_reads(ColiExpertStore *store, int layer, const int *experts, int count);

/* Waits until no load is queued or in flight in layer (layer < 0: in any
 * layer), at most timeout_ns (< 0: forever). Returns 0 or COLI_ETIMEOUT. */
int coli_store_wait_idle(ColiExpertStore *store, int layer, int64_t timeout_ns);

/* For bindings: where a leased view's bytes are, in one call. out[0] is the
 * lowest address of any tensor or scale, out[1] the bytes from there to the
 * end of the highest; out[2..4] are the offsets of gate, up and down data from
 * out[0], out[5..7] of their scales (UINT64_MAX when unscaled). Returns
 * COLI_EINVAL (out untouched) for a view that holds no lease. */
int coli_view_layout(const ColiExpertView *view, uint64_t out[COLI_VIEW_LAYOUT_LEN]);

/* Where every part of an expert lies in its slot: out[0..2] get the slot
 * offsets of gate, up and down data, out[3..5] of their scales, out[6..]
 * (from COLI_ROLE_PARTS on) of the extra parts in the order they were given
 * (UINT64_MAX for a part the expert has not), at most cap entries. A leased
 * view's gate.data minus out[0] is the slot's start, so each part's address
 * follows. Returns the number of entries the expert has (COLI_ROLE_PARTS +
 * its extra parts), or COLI_ENOTFOUND for an unknown key. Plans are fixed at
 * creation: no lock. */
int coli_store_expert_parts(ColiExpertStore *store, int layer, int expert, uint64_t *out, int cap);

/* ---- leased experts computed from their slots ---------------------------
 *
 * The kernels of ffn.h compute an expert straight from its bytes as stored
 * (GPTQ with act order as the slot holds it: in group order, see
 * gptq_group_order.h).
 * The store knows what they need of each expert: its tensors (the view), its
 * extra parts and what each is (ColiPartSource.kind, role, format), how the
 * matrices are stored and a fused gate_up split (ColiExpertSource.flags),
 * and which kernel computes each format (the format table). A computation
 * holds the views' slots for its length (one lease more each, not counted as
 * a request), so the bytes stay put even if the caller's lease is released
 * meanwhile, and close refuses while it runs. */

/* Fills *out with the ColiFfnExpert of the expert leased by view, its
 * addresses in the slot (valid while that lease is held), with the given
 * activation (COLI_FFN_ACT_*) and gpt-oss's alpha and limit: for an engine
 * that calls coli_expert_ffn itself. Returns 0; COLI_ELEASE when view holds
 * no live lease of this store; COLI_ECLOSED on a closed store; COLI_EINVAL
 * for a format or layout without a kernel (out zeroed, err says why). */
int coli_store_ffn_expert(ColiExpertStore *store, const ColiExpertView *view, int activation,
                          float alpha, float limit, ColiFfnExpert *out, char *err, size_t err_len);

/* Computes count leased experts of one layer (e.g. the views of one
 * lookup_many) for their tokens, with the GIL-free driver of ffn.h: expert i
 * takes rows [rows[i], rows[i + 1]) of call->x and writes the same rows of
 * call->out (rows: count + 1 nondecreasing offsets from 0 to call->tokens;
 * NULL when count is 1: all of the call's rows; an expert without rows is
 * skipped). out must not overlap x. call->isa picks the path as in
 * coli_expert_ffn. The experts run on pool's threads (NULL: the caller's):
 * an expert whose rows are a thread's share of the batch or more on all of
 * them, its output rows split, and the others one expert per thread, the
 * largest first. Returns 0; COLI_ELEASE when a view holds no live lease of
 * this store (nothing computed); COLI_ECLOSED on a closed store;
 * COLI_EINVAL for views of two layers, bad rows or call, or a format
 * without a kernel; COLI_ENOMEM. err names the expert. */
int coli_store_expert_ffn(ColiExpertStore *store, const ColiExpertView *views, int count,
                          const int64_t *rows, const ColiFfnCall *call, int activation,
                          float alpha, float limit, ColiComputePool *pool, char *err,
                          size_t err_len);

/* One MoE layer's routing, for coli_store_moe_ffn: tokens x k pairs, pair
 * p = t * k + j (token t's j-th choice) routed to expert index[p]. x holds
 * the tokens' rows (hidden each, F32 or BF16, x_stride elements apart);
 * pairs, tokens * k rows of hidden floats, gets each pair's expert output
 * in row p. pairs must not overlap x. isa picks the path as in
 * coli_expert_ffn. */
typedef struct {
    const int64_t *index;
    int64_t tokens;             /* >= 1 */
    int64_t k;                  /* >= 1 */
    const void *x;
    ColiTensorFormat x_format;
    int64_t x_stride;
    float *pairs;
    int isa;
} ColiMoeCall;

/* Computes the pairs of call routed to the experts of count leased views of
 * one layer (e.g. one lease group of the layer's union): row p of
 * call->pairs becomes expert index[p] applied to token p / k, for every
 * pair whose expert is one of the views'; other rows are left as they are.
 * A row's bits do not depend on which other pairs the call has. Threads,
 * holds and errors as coli_store_expert_ffn. */
int coli_store_moe_ffn(ColiExpertStore *store, const ColiExpertView *views, int count,
                       const ColiMoeCall *call, int activation, float alpha, float limit,
                       ColiComputePool *pool, char *err, size_t err_len);

/* The routed output of tokens tokens from their k pairs' rows (pairs, as
 * coli_store_moe_ffn fills them): out row t = the sum over j = 0 .. k - 1,
 * in that order, of weights[t * k + j] * pairs row t * k + j, in float32
 * (each product rounded, then added), then stored as out_format (F32, or
 * BF16 rounded to nearest even). weights are F32 or BF16, tokens x k; out
 * is tokens x hidden, not overlapping pairs. Returns 0; COLI_EINVAL for
 * bad sizes or formats; COLI_ENOMEM. */
int coli_moe_combine(const float *pairs, const void *weights, ColiTensorFormat weights_format,
                     int64_t tokens, int64_t k, int64_t hidden, void *out,
                     ColiTensorFormat out_format, char *err, size_t err_len);

/* Times a prefetch read paused between chunks for a demand read. */
uint64_t coli_store_prefetch_pauses(ColiExpertStore *store);

/* Leases held now, over all layers. */
uint64_t coli_store_active_leases(ColiExpertStore *store);

/* Slots in layer's cache; 0 for a layer without experts. */
int coli_store_layer_slots(ColiExpertStore *store, int layer);

/* Nonzero when the store was built with direct_io and O_DIRECT was refused
 * by the file system, so reads go through the page cache. */
int coli_store_direct_io_fallback(ColiExpertStore *store);

/* The name of policy (a COLI_POLICY_* value), or NULL past the last one. */
const char *coli_store_policy_name(int policy);

/* Runs a routing trace through the store: for each token t and each i <
 * n_layers, one lookup_many on layer layers[i] of the experts
 * experts[(t * n_layers + i) * k + j], j < k, that are >= 0 (repeats
 * dropped), whose leases are released before the next. Stops at the first
 * failure (err names token and layer). On a replay store this measures a
 * policy on a trace at millions of lookups a second; on a live store it
 * reads what a live run would. */
int coli_store_replay(ColiExpertStore *store, const int *layers, int n_layers,
                      const int32_t *experts, int64_t n_tokens, int k,
                      char *err, size_t err_len);

/* The counters of one layer (capacity_bytes: its slots' bytes). Returns 0,
 * or COLI_ENOTFOUND (out zeroed) for a layer without experts. */
int coli_store_layer_stats(ColiExpertStore *store, int layer, ColiExpertStoreStats *out);

/* Requests (lookups of a valid key, as counted in stats) of each expert of
 * layer since create: out[e] for e < n (n larger than the layer's expert
 * range: the rest is zeroed). Returns the layer's expert range (largest
 * expert index + 1), or 0 for a layer without experts. */
int coli_store_expert_requests(ColiExpertStore *store, int layer, uint64_t *out, int n);

/* The experts pinned now (see PINNED EXPERTS): up to n keys into out,
 * ordered by layer and expert. Returns how many are pinned. */
int coli_store_pinned(ColiExpertStore *store, ColiExpertKey *out, int n);

#endif /* COLI_STORE_H */
