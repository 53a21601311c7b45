/*
 * ls_policy.c: the eviction policies behind the seam (LsPolicy in
 * ls_internal.h). The state machine calls them under the layer mutex.
 *
 * LRU. As in SQLite's page cache, "leased" means "not in the set", so the
 * set is one list: a hit unlinks in O(1) and the victim is always the tail,
 * also O(1). The list is circular around a sentinel (the layer's `list`),
 * so linking never tests for NULL.
 *
 *      sentinel <-> MRU ... LRU <-> sentinel         (list.next is the MRU end)
 *
 * LFU. Each tenancy counts its uses (the load that brought it, if a lookup
 * asked for it, and every hit since); the victim has the fewest, and of
 * those the oldest last use (the layer's clock). Emptied and demoted slots
 * go first. A binary heap keyed on (uses, last use) serves it in O(log n);
 * a hit changes the key of a slot that is leaving the heap anyway, so the
 * hit path does no heap work. It is the seam's example of a policy with
 * per-slot state; it forgets an expert's count when it is evicted.
 */
#include "ls_internal.h"

#include <stdlib.h>

/* The list operations are ls_lru_insert and ls_lru_remove (ls_internal.h),
 * which the state machine inlines for LRU; the table has them too. */
static void lru_insert(LsLayer *L, LsSlot *s, bool cold) { ls_lru_insert(L, s, cold); }

static void lru_remove(LsLayer *L, LsSlot *s) {
    (void)L;
    ls_lru_remove(s);
}

static LsSlot *lru_victim(LsLayer *L) {
    return L->list.prev == &L->list ? NULL : L->list.prev;
}

const LsPolicy ls_policy_lru = {
    .name = "lru",
    .insert = lru_insert,
    .remove = lru_remove,
    .victim = lru_victim,
};

/* ---- heap ----------------------------------------------------------- */

static void heap_set(LsHeap *h, uint32_t i, LsSlot *v) {
    h->at[i] = v;
    v->pol_index = i;
}

static void sift_up(LsHeap *h, uint32_t i, LsLess less) {
    LsSlot *v = h->at[i];
    while (i > 0) {
        uint32_t parent = (i - 1) / 2;
        if (!less(v, h->at[parent])) break;
        heap_set(h, i, h->at[parent]);
        i = parent;
    }
    heap_set(h, i, v);
}

static void sift_down(LsHeap *h, uint32_t i, LsLess less) {
    LsSlot *v = h->at[i];
    for (;;) {
        uint32_t child = 2 * i + 1;
        if (child >= h->n) break;
        if (child + 1 < h->n && less(h->at[child + 1], h->at[child])) child++;
        if (!less(h->at[child], v)) break;
        heap_set(h, i, h->at[child]);
        i = child;
    }
    heap_set(h, i, v);
}

void ls_heap_push(LsHeap *h, LsSlot *v, LsLess less) {
    heap_set(h, h->n++, v);
    sift_up(h, h->n - 1, less);
}

void ls_heap_remove(LsHeap *h, LsSlot *v, LsLess less) {
    uint32_t i = v->pol_index;
    assert(i < h->n && h->at[i] == v);
    LsSlot *last = h->at[--h->n];
    if (last == v) return;
    heap_set(h, i, last);
    sift_down(h, i, less);
    sift_up(h, last->pol_index, less);
}

void ls_heap_update(LsHeap *h, LsSlot *v, LsLess less) {
    sift_down(h, v->pol_index, less);
    sift_up(h, v->pol_index, less);
}

/* ---- LFU ------------------------------------------------------------ */

static bool lfu_less(const LsSlot *a, const LsSlot *b) {
    return a->pol_value < b->pol_value || (a->pol_value == b->pol_value && a->pol_stamp < b->pol_stamp);
}

static int lfu_init(LsLayer *L, char *err, size_t n) {
    LsHeap *h = calloc(1, sizeof(LsHeap));
    if (h) h->at = calloc((size_t)L->n_slots, sizeof(LsSlot *));
    if (!h || !h->at) {
        free(h);
        return coli_fail(err, n, COLI_ENOMEM, "out of memory for the policy of layer %d", L->id);
    }
    L->pol = h;
    return COLI_OK;
}

static void lfu_fini(LsLayer *L) {
    LsHeap *h = L->pol;
    if (h) free(h->at);
    free(h);
    L->pol = NULL;
}

static void lfu_insert(LsLayer *L, LsSlot *v, bool cold) {
    if (cold) {               /* before every slot with a use: an empty or demoted slot */
        v->pol_value = -1.0;
        v->pol_stamp = L->clock;
    }
    ls_heap_push(L->pol, v, lfu_less);
}

static void lfu_remove(LsLayer *L, LsSlot *v) { ls_heap_remove(L->pol, v, lfu_less); }

static LsSlot *lfu_victim(LsLayer *L) {
    const LsHeap *h = L->pol;
    return h->n ? h->at[0] : NULL;
}

static void lfu_hit(LsLayer *L, LsSlot *v, int rank) {
    (void)rank;
    v->pol_value += 1.0;      /* v is leaving the heap (or is not in it): no sift */
    v->pol_stamp = L->clock;
}

static void lfu_assign(LsLayer *L, LsSlot *v, int rank) {
    v->pol_value = rank >= 0 ? 1.0 : 0.0;   /* a prefetch or a pin: no use yet */
    v->pol_stamp = L->clock;
}

const LsPolicy ls_policy_lfu = {
    .name = "lfu",
    .insert = lfu_insert,
    .remove = lfu_remove,
    .victim = lfu_victim,
    .hit = lfu_hit,
    .assign = lfu_assign,
    .init = lfu_init,
    .fini = lfu_fini,
};

const LsPolicy *const ls_policies[] = {
    [COLI_POLICY_LRU] = &ls_policy_lru,
    [COLI_POLICY_LFU] = &ls_policy_lfu,
    NULL,
};
