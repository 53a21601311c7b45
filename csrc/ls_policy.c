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
 */
#include "ls_internal.h"

static void lru_insert(LsLayer *L, LsSlot *s, bool cold) {
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

static void lru_remove(LsLayer *L, LsSlot *s) {
    (void)L;
    s->prev->next = s->next;
    s->next->prev = s->prev;
}

static LsSlot *lru_victim(LsLayer *L) {
    return L->list.prev == &L->list ? NULL : L->list.prev;
}

const LsPolicy ls_policy_lru = {
    .name = "lru",
    .insert = lru_insert,
    .remove = lru_remove,
    .hit = NULL,
    .victim = lru_victim,
};

const LsPolicy *const ls_policies[] = {
    [COLI_POLICY_LRU] = &ls_policy_lru,
    NULL,
};
