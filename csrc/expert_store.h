/*
 * expert_store.h: the expert store contract.
 *
 * An expert store hands out read-only views of one routed expert's three
 * tensors (gate, up, down) under a lease. ABI: the field order and the
 * first eight stats counters never change; new counters are appended.
 *
 * THE LEASE CONTRACT
 *
 * Rule 1. After a successful lookup the caller releases exactly once, with the
 *         same view, on the same store. A view is never copied, and a view
 *         that holds a lease is never passed to lookup again.
 * Rule 2. A failed lookup leaves the view zeroed; the caller neither uses nor
 *         releases it. coli_expert_lookup() zeroes it even if an
 *         implementation forgot to.
 * Rule 3. release clears the whole view (coli_expert_release() does it after
 *         the implementation returns); releasing a zeroed view is a no-op.
 * Rule 4. While a lease is held, the bytes its tensors point at do not change
 *         and the slot behind it is never evicted or reused. Whenever a slot
 *         is repurposed its generation changes; a release whose
 *         lease_generation does not match the slot's is ignored, so it can
 *         never drop another expert's lease.
 * Rule 5. destroy requires zero active leases (debug builds assert; the
 *         Python layer refuses to close a store with leases held).
 * Rule 6. Thread safety belongs to each implementation and is documented in
 *         its header. One view is never used by two threads at once.
 * Rule 7. prefetch is advisory: unsupported or rejected requests return 0,
 *         and 0 does not mean "loaded". It holds no lease and never evicts a
 *         slot that is leased or loading.
 *
 * This header is fed to cffi's cdef after '#' lines are stripped and the
 * bodies of the static inline wrappers are cut to declarations.
 */
#ifndef COLI_EXPERT_STORE_H
#define COLI_EXPERT_STORE_H

#include <stdint.h>
#include <string.h>

#include "tensor.h"

typedef struct ColiExpertStore ColiExpertStore;

typedef struct {
    int layer;                  /* the model's own layer index */
    int expert;                 /* routed expert index within that layer */
} ColiExpertKey;

/* An expert's tensors. A fused gate_up (gpt-oss, Llama 4) is described by
 * gate, with up zeroed (data NULL). Parts the view has no field for (biases,
 * zero points) are in the same slot: the store says where with
 * coli_store_expert_parts (coli_store.h). */
typedef struct {
    ColiExpertKey key;
    ColiTensorView gate;
    ColiTensorView down;
    ColiTensorView up;
    void *lease;                /* opaque; NULL when the view holds no lease */
    uint64_t lease_generation;  /* generation of the slot when leased (rule 4) */
} ColiExpertView;

typedef struct {
    /* the first eight counters, in this order for good */
    uint64_t requests;          /* lookups of a valid key */
    uint64_t hits;              /* served from a resident slot or a joined load */
    uint64_t misses;            /* lookups that started a demand load */
    uint64_t prefetched;        /* prefetch keys that started a load */
    uint64_t prefetch_hits;     /* prefetched loads hit before reuse, once each */
    uint64_t bytes_read;        /* bytes read from storage */
    uint64_t resident_bytes;    /* bytes of experts resident now */
    uint64_t capacity_bytes;    /* the budget; resident_bytes <= capacity_bytes */
    /* appended after them */
    uint64_t persistent_hits;   /* hits served by pinned experts */
    uint64_t transient_hits;    /* every other hit: hits = persistent + transient */
    uint64_t inflight_joins;    /* lookups that waited for a load in flight */
    uint64_t loads_started;     /* demand and prefetch loads started */
    uint64_t loads_failed;      /* loads that ended in an error */
    uint64_t evictions;         /* resident experts dropped to make room */
    uint64_t slot_waits;        /* lookups that waited for a release */
    uint64_t peak_inflight;     /* most loads in flight at once */
} ColiExpertStoreStats;

typedef struct {
    /* Returns zero on success. The view remains valid until release(). */
    int (*lookup)(ColiExpertStore *store, ColiExpertKey key,
                  ColiExpertView *view);
    /* Ends the lease held by view. Stale or zeroed views are ignored. */
    void (*release)(ColiExpertStore *store, ColiExpertView *view);
    /* Advisory; returns how many keys were accepted (rule 7). */
    int (*prefetch)(ColiExpertStore *store, const ColiExpertKey *keys,
                    int count);
    void (*stats)(ColiExpertStore *store, ColiExpertStoreStats *out);
    /* Requires zero active leases (rule 5). */
    void (*destroy)(ColiExpertStore *store);
} ColiExpertStoreOps;

struct ColiExpertStore {
    const ColiExpertStoreOps *ops;
    void *state;
};

/* Looks key up in store. A NULL store, ops table or lookup function gives -1
 * and a zeroed view; any failure leaves the view zeroed (rule 2). */
static inline int coli_expert_lookup(ColiExpertStore *store, ColiExpertKey key,
                                     ColiExpertView *view) {
    if (!store || !store->ops || !store->ops->lookup) {
        if (view) memset(view, 0, sizeof(*view));
        return -1;
    }
    int result = store->ops->lookup(store, key, view);
    if (result != 0 && view) memset(view, 0, sizeof(*view));
    return result;
}

/* Releases the lease held by view, then zeroes the view (rule 3). Safe on a
 * NULL store, a NULL view and a zeroed view. */
static inline void coli_expert_release(ColiExpertStore *store,
                                       ColiExpertView *view) {
    if (store && store->ops && store->ops->release && view)
        store->ops->release(store, view);
    if (view) memset(view, 0, sizeof(*view));
}

#endif /* COLI_EXPERT_STORE_H */
