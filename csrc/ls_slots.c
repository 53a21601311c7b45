/*
 * ls_slots.c: the slot state machine's transitions (see ls_slots.h for the
 * states and the diagram). Every function here runs under the slot's layer
 * mutex; none reads a file or waits.
 */
#define _GNU_SOURCE
#include "ls_slots.h"

static void inflight_up(LsStore *s) {
    uint64_t now = atomic_fetch_add(&s->inflight, 1) + 1;
    uint64_t peak = atomic_load(&s->peak_inflight);
    while (now > peak && !atomic_compare_exchange_weak(&s->peak_inflight, &peak, now)) {}
}

static void fill_tensor(ColiTensorView *t, const ColiTensorSource *src, const unsigned char *mem,
                        uint64_t data_at, uint64_t scales_at) {
    t->format = src->format;
    t->scale_format = src->scale_format;
    t->data = mem ? mem + data_at : NULL;   /* a replay store has no slot memory */
    t->scales = src->scale_format == COLI_SCALE_NONE || !mem ? NULL : mem + scales_at;
    t->data_bytes = (size_t)src->nbytes;
    t->scale_bytes = src->scale_format == COLI_SCALE_NONE ? 0 : (size_t)src->scale_nbytes;
    t->rows = src->rows;
    t->columns = src->columns;
    t->block_rows = src->scale_format == COLI_SCALE_NONE ? 0 : src->block_rows;
    t->block_columns = src->scale_format == COLI_SCALE_NONE ? 0 : src->block_columns;
}

/* The view of expert e held in slot memory mem, without a lease. */
static void fill_template(ColiExpertView *view, const LsLayer *L, const LsEntry *e, int expert,
                          const unsigned char *mem) {
    memset(view, 0, sizeof(*view));
    view->key.layer = L->id;
    view->key.expert = expert;
    fill_tensor(&view->gate, &e->src.gate, mem, e->plan.data_at[0], e->plan.scales_at[0]);
    fill_tensor(&view->up, &e->src.up, mem, e->plan.data_at[1], e->plan.scales_at[1]);
    fill_tensor(&view->down, &e->src.down, mem, e->plan.data_at[2], e->plan.scales_at[2]);
    if (e->src.flags & COLI_SOURCE_FUSED_GATE_UP) memset(&view->up, 0, sizeof(view->up));
}

/* Whatever v held or was loading is gone: v is EMPTY with a new
 * generation, evicted first. */
static void to_empty(LsStore *s, LsLayer *L, LsSlot *v) {
    if (v->pinned) {              /* a pin that could not be loaded is dropped */
        v->pinned = false;
        L->n_pinned--;
    }
    L->slot_of[v->expert] = NULL;
    v->expert = -1;
    v->state = LS_EMPTY;
    v->prefetched = false;
    v->generation = ls_next_generation(s);
    ls_set_insert(L, v, true);
}

void ls_slot_repurpose(LsStore *s, LsLayer *L, LsSlot *v, LsEntry *e, int expert,
                       LsSlotState st, uint64_t generation) {
    ls_set_remove(L, v);
    if (v->state == LS_RESIDENT) {
        L->slot_of[v->expert] = NULL;
        L->resident_bytes -= L->entries[v->expert].plan.payload;
        L->c.evictions++;
    }
    v->generation = generation;
    v->expert = expert;
    v->state = st;
    v->prefetched = (st == LS_QUEUED);
    v->early = false;
    atomic_store(&v->demanded, false);
    atomic_store(&v->retired, false);
    L->slot_of[expert] = v;
    fill_template(&v->view, L, e, expert, v->mem);
    L->loading++;
    if (st == LS_QUEUED) L->queued++;
    L->c.loads_started++;
    inflight_up(s);
}

void ls_slot_queue_prefetch(LsStore *s, LsLayer *L, LsSlot *v, LsEntry *e, int expert,
                            uint64_t generation, bool early) {
    ls_slot_repurpose(s, L, v, e, expert, LS_QUEUED, generation);
    if (L->policy->assign) L->policy->assign(L, v, -1);
    if (early) {
        v->early = true;
        atomic_store(&v->demanded, true);
    } else {
        L->c.prefetched++;
    }
}

void ls_slot_begin_read(LsLayer *L, LsSlot *v) {
    assert(v->state == LS_QUEUED);
    v->state = LS_READING;
    L->queued--;
}

void ls_slot_finish_load(LsStore *s, LsLayer *L, LsSlot *v, int rc, uint64_t nread,
                         uint32_t leases) {
    LsEntry *e = &L->entries[v->expert];
    bool ok = rc == COLI_OK;
    L->c.bytes_read += nread;
    L->loading--;
    atomic_fetch_sub(&s->inflight, 1);
    if (ok) {
        v->state = LS_RESIDENT;
        v->leases = leases;
        L->resident_bytes += e->plan.payload;
        if (leases == 0 && !v->pinned) ls_set_insert(L, v, false);
        else L->leases += leases;
    } else {
        if (rc != COLI_READ_STOPPED) L->c.loads_failed++;
        to_empty(s, L, v);
    }
    ls_wake(L);
}

void ls_slot_empty(LsStore *s, LsLayer *L, LsSlot *v) {
    assert(v->state == LS_QUEUED);
    L->queued--;
    L->loading--;
    atomic_fetch_sub(&s->inflight, 1);
    to_empty(s, L, v);
    ls_wake(L);
}

/* A QUEUED slot of another expert that a demand miss may take, or NULL. */
static LsSlot *queued_slot(LsLayer *L) {
    for (int i = 0; i < L->n_slots; i++)
        if (L->slots[i].state == LS_QUEUED && !L->slots[i].pinned) return &L->slots[i];
    return NULL;
}

LsSlot *ls_slot_claim(LsStore *s, LsLayer *L, LsEntry *e, int expert, int rank) {
    LsSlot *v = L->slot_of[expert];
    if (v) {
        if (L->policy->hit) L->policy->hit(L, v, rank);
        ls_slot_begin_read(L, v);
        ls_count_request(L, expert);
        if (v->early) {
            L->c.misses++;
        } else {
            L->c.hits++;
            L->c.inflight_joins++;
            if (v->pinned) L->c.persistent_hits++;
            if (v->prefetched) L->c.prefetch_hits++;
        }
        v->early = v->prefetched = false;
        return v;
    }
    v = ls_victim(L);
    if (!v && (v = queued_slot(L)) != NULL) ls_slot_empty(s, L, v);
    if (!v) return NULL;
    ls_slot_repurpose(s, L, v, e, expert, LS_READING, ls_next_generation(s));
    if (L->policy->assign) L->policy->assign(L, v, rank);
    ls_count_request(L, expert);
    L->c.misses++;
    return v;
}

void ls_slot_preload(LsStore *s, LsLayer *L, LsSlot *v, LsEntry *e, int expert, bool pin) {
    assert(v->state == LS_EMPTY && v->evictable);
    ls_slot_repurpose(s, L, v, e, expert, LS_QUEUED, ls_next_generation(s));
    if (L->policy->assign) L->policy->assign(L, v, -1);
    v->prefetched = false;
    v->pinned = pin;
    L->n_pinned += pin;
}

void ls_slot_demote(LsLayer *L, LsSlot *v) {
    assert(v->state == LS_RESIDENT && v->leases == 0);
    ls_set_remove(L, v);
    ls_set_insert(L, v, true);
    v->prefetched = false;
}
