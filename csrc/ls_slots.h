/*
 * ls_slots.h (private): the slot state machine of the store.
 *
 * Each MoE layer owns a fixed array of slots carved from one page-aligned
 * arena. A slot is in one of four states, and only the transitions below
 * (defined in ls_slots.c, the two on the hit path inline here) change a
 * slot's state, expert, generation, leases or membership of the evictable
 * set; every other file calls them.
 *
 *                 queue_prefetch (a prefetch)
 *         +--------------------------------------> QUEUED
 *         |    +------------ empty ------------------+  |
 *         |    v                                        |  begin_read (a worker), or
 *        EMPTY                                          |  claim (a lookup takes it over)
 *         |    ^                                        v
 *         |    +--- finish_load (failed or stopped) -- READING
 *         |                                             ^    |
 *         +------ claim / repurpose (a demand miss) ----+    |  finish_load (ok)
 *                                                            v
 *      An unleased RESIDENT slot is taken by claim        RESIDENT   lease, unlease,
 *      and repurpose like an EMPTY one (an eviction).                demote
 *
 *   transition      from                              to
 *   repurpose       EMPTY, or RESIDENT unleased       QUEUED (prefetch) or READING
 *                   (an eviction, counted)            (a demand miss), new generation
 *   queue_prefetch  as repurpose                      QUEUED, for a posted prefetch job
 *   claim           its own QUEUED prefetch           READING (taken over), else as
 *                                                     repurpose (victim or queued slot)
 *   begin_read      QUEUED                            READING (a worker starts it)
 *   finish_load     READING                           RESIDENT with n leases, or EMPTY
 *   empty           QUEUED                            EMPTY (cancelled), new generation
 *   lease           RESIDENT                          RESIDENT, one lease more (a hit)
 *   hold            RESIDENT leased                   RESIDENT, one lease more (a kernel
 *                                                     computes from it; not a request)
 *   unlease         RESIDENT leased                   RESIDENT, one lease fewer
 *   demote          RESIDENT unleased, unhit prefetch RESIDENT, evicted first
 *   preload         EMPTY (at create)                 QUEUED: a pin (never evictable) or a warm expert
 *
 * A pinned slot goes QUEUED -> READING -> RESIDENT like a prefetch and then
 * stays: lease and unlease never put it in the evictable set. A failed
 * load unpins it (finish_load: EMPTY, an ordinary slot).
 *
 * A slot is in its layer's evictable set iff it is EMPTY, or RESIDENT with
 * zero leases and not pinned. The set is the policy's (ls_policy.h, the
 * seam): "leased" means "not in the set", so a hit leaves it in O(1) and the
 * victim is the policy's choice (for LRU the tail of a list, also O(1)).
 *
 *   one slot:   +-------------------------------------------------+
 *               | expert's runs, as read: gate | up | down (+scales)|
 *               +-------------------------------------------------+
 *
 * QUEUED (a prefetch waiting for a worker) and READING slots are out of the
 * set and owned by whoever reads them; lookups of their expert join the
 * load, and a demand lookup takes a QUEUED slot over instead of waiting
 * behind the queue. Every time a slot is given to another expert, or
 * emptied, its generation changes (lease contract rule 4).
 *
 * Every function here: caller holds the slot's layer mutex.
 */
#ifndef COLI_LS_SLOTS_H
#define COLI_LS_SLOTS_H

#include "ls_internal.h"
#include "ls_policy.h"

/* v joins the evictable set (hot end, or cold: evicted first). */
static inline void ls_set_insert(LsLayer *L, LsSlot *v, bool cold) {
    const LsPolicy *p = L->policy;
    assert(!v->evictable);
    if (p->keeps_list) ls_list_insert(L, v, cold);
    if (p->insert) p->insert(L, v, cold);
    v->evictable = true;
    L->evictable++;
}

/* v leaves the evictable set. */
static inline void ls_set_remove(LsLayer *L, LsSlot *v) {
    const LsPolicy *p = L->policy;
    assert(v->evictable);
    if (p->keeps_list) ls_list_remove(v);
    if (p->remove) p->remove(L, v);
    v->evictable = false;
    L->evictable--;
}

/* A lookup or lookup_many of these experts begins: the layer's clock
 * ticks and the policy hears of it. */
static inline void ls_tick(LsLayer *L, const int *experts, int count) {
    L->clock++;
    if (L->policy->step) L->policy->step(L, experts, count);
}

/* The slot an eviction would take now, or NULL. */
static inline LsSlot *ls_victim(LsLayer *L) { return L->policy->victim(L); }

/* Copies slot v's view and its lease into view. */
static inline void ls_fill_view(ColiExpertView *view, const LsSlot *v) {
    *view = v->view;
    view->lease = (void *)v;
    view->lease_generation = v->generation;
}

/* lease: a hit. Takes a lease on resident slot v and counts it; rank is
 * the expert's place in the request (for the policy). */
static inline void ls_slot_lease(LsLayer *L, LsSlot *v, ColiExpertView *view, int rank) {
    if (L->policy->hit) L->policy->hit(L, v, rank);
    if (v->evictable) ls_set_remove(L, v);
    v->leases++;
    L->leases++;
    ls_count_request(L, v->expert);
    if (v->early) {
        L->c.misses++;
        v->early = v->prefetched = false;
    } else {
        L->c.hits++;
        if (v->pinned) L->c.persistent_hits++;
        if (v->prefetched) {
            L->c.prefetch_hits++;
            v->prefetched = false;
        }
    }
    ls_fill_view(view, v);
}

/* unlease: drops one lease of resident slot v; the last one makes it
 * evictable (unless pinned) and wakes waiters. */
static inline void ls_slot_unlease(LsLayer *L, LsSlot *v) {
    v->leases--;
    L->leases--;
    if (v->leases == 0) {
        if (!v->pinned) ls_set_insert(L, v, false);
        ls_wake(L);
    }
}

/* The slot whose live lease view holds, or NULL (stale generation, or not
 * one of L's slots). */
static inline LsSlot *ls_slot_of_view(LsLayer *L, const ColiExpertView *view) {
    LsSlot *v = view->lease;
    uintptr_t p = (uintptr_t)v, lo = (uintptr_t)L->slots;
    if (p < lo || p >= lo + sizeof(LsSlot) * (size_t)L->n_slots || (p - lo) % sizeof(LsSlot) != 0)
        return NULL;              /* not one of this layer's slots */
    if (v->generation != view->lease_generation || v->state != LS_RESIDENT ||
        v->leases == 0 || v->expert != view->key.expert)
        return NULL;              /* stale: the slot was repurposed since */
    return v;
}

/* Drops the lease of view if it is current: false when view holds no live
 * lease of layer L. */
static inline bool ls_slot_release_view(LsLayer *L, const ColiExpertView *view) {
    LsSlot *v = ls_slot_of_view(L, view);
    if (!v) return false;
    ls_slot_unlease(L, v);
    return true;
}

/* hold: one lease more on leased slot v for the length of a computation
 * from its bytes (coli_store_expert_ffn), so that a release of the
 * caller's lease meanwhile cannot free the slot under it. Not a request:
 * nothing is counted and the policy hears nothing. unlease ends it. */
static inline void ls_slot_hold(LsLayer *L, LsSlot *v) {
    assert(v->state == LS_RESIDENT && v->leases > 0 && !v->evictable);
    v->leases++;
    L->leases++;
}

/* repurpose: gives evictable slot v to entry e's expert in state st
 * (QUEUED or READING) with the given generation (from
 * ls_next_generation()): drops whatever v held (counting an eviction) and
 * builds the view its leases will copy. */
void ls_slot_repurpose(LsStore *s, LsLayer *L, LsSlot *v, LsEntry *e, int expert,
                       LsSlotState st, uint64_t generation);

/* queue_prefetch: gives evictable slot v to entry e's expert for a prefetch
 * whose job the caller posted with this generation (QUEUED, counted as
 * prefetched; the policy hears of it). early: a start_reads load instead,
 * not a guess: not counted as prefetched, read as a demand read, and its
 * first lookup counts a miss. */
void ls_slot_queue_prefetch(LsStore *s, LsLayer *L, LsSlot *v, LsEntry *e, int expert,
                            uint64_t generation, bool early);

/* claim: gives a demand miss of entry e's expert (neither resident nor
 * being read) a slot to read it into, marked READING: its own queued
 * prefetch, taken over (the worker will find it READING and skip the job),
 * else the policy's victim, else another expert's queued prefetch, emptied.
 * Counts the request. NULL when no slot is free now. */
LsSlot *ls_slot_claim(LsStore *s, LsLayer *L, LsEntry *e, int expert, int rank);

/* begin_read: a worker starts the queued prefetch in v (QUEUED -> READING). */
void ls_slot_begin_read(LsLayer *L, LsSlot *v);

/* finish_load: ends the load of slot v (READING) with the read's result
 * rc: on success it becomes RESIDENT with `leases` leases; on failure, or
 * when the read was stopped (not a failure), it becomes EMPTY, evicted
 * first. Wakes waiters. */
void ls_slot_finish_load(LsStore *s, LsLayer *L, LsSlot *v, int rc, uint64_t nread,
                         uint32_t leases);

/* empty: cancels the queued prefetch in v (its job goes stale by
 * generation) and makes v an empty slot, evicted first. Wakes waiters: one
 * load fewer (wait_idle) and one free slot more (lookups). */
void ls_slot_empty(LsStore *s, LsLayer *L, LsSlot *v);

/* preload: gives EMPTY slot v to entry e's expert, for good with pin,
 * QUEUED for a preload job (or loaded at once by create). Counts a load
 * started, no request. */
void ls_slot_preload(LsStore *s, LsLayer *L, LsSlot *v, LsEntry *e, int expert, bool pin);

/* demote: resident v, unleased and never hit since its prefetch, goes to
 * the cold end of the set, to be evicted first. */
void ls_slot_demote(LsLayer *L, LsSlot *v);

#endif /* COLI_LS_SLOTS_H */
