/*
 * ls_policy.h (private): the policy seam of the store, and the helpers
 * policies share (the list, a heap of slots). The policies are in
 * ls_policy.c; the state machine (ls_slots.h) is the seam's only caller.
 */
#ifndef COLI_LS_POLICY_H
#define COLI_LS_POLICY_H

#include "ls_internal.h"

/* THE POLICY SEAM. The evictable set of a layer (every EMPTY slot, and
 * every RESIDENT one without a lease and not pinned) belongs to its policy;
 * the state machine (ls_slots.c, ls_slots.h) tells it what changes, under
 * the layer mutex, and asks it for a victim. A policy keeps its state in
 * the slots' pol_* fields and in the layer's pol (its init allocates it),
 * and may read the layer's clock (one tick per lookup or lookup_many of the
 * layer), requests_of, and a slot's state and expert; it writes nothing
 * else.
 *
 * A policy whose set is ordered by recency (lru, cooc) says keeps_list: the
 * set is then the layer's list (L->list, ls_list_*), which the state
 * machine links and unlinks inline, so a hit makes no indirect call for
 * it; such a policy's insert and remove, when it has them, hear of each
 * change after the list's. Every other hook is optional too: NULL means the
 * policy does nothing then. victim is required, and so are insert and
 * remove for a policy that does not keep the list. */
struct LsPolicy {
    const char *name;
    bool keeps_list;
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
};

extern const LsPolicy ls_policy_lru, ls_policy_lfu, ls_policy_lrfu, ls_policy_cooc;
extern const LsPolicy *const ls_policies[];   /* indexed by COLI_POLICY_*, NULL-terminated */

/* The list of a policy that keeps_list (ls_policy.c describes it). */
static inline void ls_list_insert(LsLayer *L, LsSlot *s, bool cold) {
    if (cold) {               /* at the cold end, the list's tail */
        s->prev = L->list.prev;
        s->next = &L->list;
        L->list.prev->next = s;
        L->list.prev = s;
    } else {                  /* at the hot end, its head */
        s->next = L->list.next;
        s->prev = &L->list;
        L->list.next->prev = s;
        L->list.next = s;
    }
}

static inline void ls_list_remove(LsSlot *s) {
    s->prev->next = s->next;
    s->next->prev = s->prev;
}

/* The list's coldest slot, or NULL when it is empty. */
static inline LsSlot *ls_list_tail(LsLayer *L) {
    return L->list.prev == &L->list ? NULL : L->list.prev;
}

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

#endif /* COLI_LS_POLICY_H */
