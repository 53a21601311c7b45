/*
 * ls_lookup.c: the lookups (one expert, its hit alone, a layer's batch) and
 * release, on top of the slot state machine (ls_slots.h).
 *
 * A lookup hits a resident expert, joins a load in flight, or claims a slot
 * and reads the expert itself (demand first: ahead of every queued
 * prefetch). When every slot of the layer is leased it waits for a release,
 * up to the store's timeout. A batch (lookup_many) never holds a lease
 * while it waits for room, so two batches cannot each hold what the other
 * needs; its steps are prepare, wait for room, commit, read, join, finish.
 */
#define _GNU_SOURCE
#include "ls_slots.h"

#include <errno.h>
#include <stdlib.h>

#include "coli_store.h"   /* coli_view_layout */

/* A wait for room in a layer none of whose slots a lookup could take. While
 * a load is in flight it waits for that load, which frees or fills a slot.
 * Else every slot is leased and it waits for a release, up to the store's
 * timeout counted from the lookup's first such wait (which counts one
 * slot_wait). Returns ETIMEDOUT once that timeout has passed, else 0.
 * Called with L->mu held. */
typedef struct {
    bool started;
    struct timespec deadline;
} RoomWait;

static int wait_for_room(LsStore *s, LsLayer *L, RoomWait *w) {
    if (L->loading > 0) return ls_layer_wait(L, NULL);
    if (!w->started) {
        w->started = true;
        L->c.slot_waits++;
        if (s->wait_timeout_ns >= 0) ls_deadline_after(&w->deadline, s->wait_timeout_ns);
    }
    return ls_layer_wait(L, s->wait_timeout_ns >= 0 ? &w->deadline : NULL);
}

/* Reads the expert of v, which the caller has claimed (READING), into its
 * memory as a demand read: prefetch readers pause for it. Called and
 * returns with L->mu held; drops it to read (a replay store reads nothing
 * and keeps it). */
static int read_claimed(LsStore *s, LsLayer *L, LsSlot *v, uint64_t *nread, char *err, size_t n) {
    const LsEntry *e = &L->entries[v->expert];
    if (s->replay) return ls_read(s, e, v->mem, NULL, nread, err, n);
    pthread_mutex_unlock(&L->mu);
    ls_demand_begin(s);
    int rc = ls_read(s, e, v->mem, NULL, nread, err, n);
    ls_demand_end(s);
    pthread_mutex_lock(&L->mu);
    return rc;
}

/* Reads v's expert, which the caller has claimed (READING), and leases it to
 * view. Called and returns with L->mu held. */
static int demand_read(LsStore *s, LsLayer *L, LsSlot *v, ColiExpertView *view, char *err,
                       size_t n) {
    uint64_t nread = 0;
    int rc = read_claimed(s, L, v, &nread, err, n);
    ls_slot_finish_load(s, L, v, rc, nread, 1);
    if (rc == COLI_OK) ls_fill_view(view, v);
    return rc;
}

/* ---- one expert ------------------------------------------------------ */

/* The lookup. With hit_only, an expert that is not resident now is not
 * waited for or read: COLI_EAGAIN, nothing counted, the view zeroed. */
static int lookup_impl(LsStore *s, int layer, int expert, ColiExpertView *view,
                       bool hit_only, char *err, size_t n) {
    if (!view) return coli_fail(err, n, COLI_EINVAL, "lookup of layer %d expert %d: view is NULL", layer, expert);
    LsLayer *held = view->lease ? ls_find_layer(s, view->key.layer) : NULL;
    if (held) {
        /* Overwriting a live lease would leak it for good, so drop it and
         * refuse. Anything else in the view is garbage we may overwrite. */
        pthread_mutex_lock(&held->mu);
        bool live = ls_slot_release_view(held, view);
        pthread_mutex_unlock(&held->mu);
        if (live) {
            memset(view, 0, sizeof(*view));
            return coli_fail(err, n, COLI_ELEASE,
                             "lookup of layer %d expert %d: the view already holds a lease "
                             "(it was released); pass a zeroed view", layer, expert);
        }
    }
    memset(view, 0, sizeof(*view));
    LsLayer *L = ls_find_layer(s, layer);
    if (!L) return coli_fail(err, n, COLI_ENOTFOUND, "layer %d has no routed experts", layer);
    LsEntry *e = ls_find_entry(L, expert);
    if (!e)
        return coli_fail(err, n, COLI_ENOTFOUND, "layer %d has no expert %d (experts 0..%d)",
                         layer, expert, L->n_entries - 1);

    pthread_mutex_lock(&L->mu);
    bool joined = false, ticked = false;
    RoomWait room = {0};
    for (;;) {
        LsSlot *v = L->slot_of[expert];
        if (v && v->state == LS_RESIDENT) {
            if (!ticked) ls_tick(L, &expert, 1);
            ls_slot_lease(L, v, view, 0);
            pthread_mutex_unlock(&L->mu);
            return COLI_OK;
        }
        if (hit_only) {           /* no tick: the full lookup that follows ticks */
            pthread_mutex_unlock(&L->mu);
            return COLI_EAGAIN;
        }
        if (!ticked) ls_tick(L, &expert, 1);
        ticked = true;
        if (v && v->state == LS_READING) {   /* join that load */
            if (!joined && !v->early) L->c.inflight_joins++;   /* an early read is our miss */
            joined = joined || !v->early;
            ls_demand_join(s, v);
            ls_layer_wait(L, NULL);
            continue;
        }
        /* Missing, or a queued prefetch we take over rather than wait
         * behind the queue for. */
        LsSlot *mine = ls_slot_claim(s, L, e, expert, 0);
        if (mine) {
            int rc = demand_read(s, L, mine, view, err, n);
            pthread_mutex_unlock(&L->mu);
            return rc;
        }
        /* No slot to take: wait; past the timeout, fail unless room came. */
        if (wait_for_room(s, L, &room) == ETIMEDOUT && !ls_victim(L) && L->loading == 0 &&
            !L->slot_of[expert]) {
            ls_count_request(L, expert);
            pthread_mutex_unlock(&L->mu);
            return coli_fail(err, n, COLI_EFULL,
                             "cache full: all %d slots of layer %d stayed leased for %.3f s "
                             "while looking up expert %d; release leases or raise slots",
                             L->n_slots, layer, (double)s->wait_timeout_ns / 1e9, expert);
        }
    }
}

int ls_lookup(LsStore *s, int layer, int expert, ColiExpertView *view, bool hit_only,
              char *err, size_t n) {
    LsLayer *L = ls_find_layer(s, layer);
    if (L && !ls_call_enter(s, &L->calls)) {
        if (view) memset(view, 0, sizeof(*view));
        return coli_fail(err, n, COLI_ECLOSED, "lookup of layer %d expert %d: the store is closed",
                         layer, expert);
    }
    int rc = lookup_impl(s, layer, expert, view, hit_only, err, n);
    if (L) ls_call_leave(&L->calls);
    return rc;
}

int ls_lookup_op(ColiExpertStore *store, ColiExpertKey key, ColiExpertView *view) {
    return ls_lookup(store->state, key.layer, key.expert, view, false, NULL, 0);   /* through ls_ops */
}

void ls_release_op(ColiExpertStore *store, ColiExpertView *view) {
    LsStore *s = store->state;   /* reached through ls_ops: a store of ours */
    if (!view || !view->lease) return;
    LsLayer *L = ls_find_layer(s, view->key.layer);
    if (!L) return;
    pthread_mutex_lock(&L->mu);
    ls_slot_release_view(L, view);
    pthread_mutex_unlock(&L->mu);
}

/* ---- a layer's batch -------------------------------------------------- */

#define BATCH_ON_STACK 32

typedef struct {
    LsStore *s;
    LsLayer *L;
    const int *experts;
    int count;
    ColiExpertView *views;
    int *first;                   /* first[i]: index of the first occurrence of experts[i] */
    int *at;                      /* at[k]: the index whose expert reading[k] loads */
    LsSlot **reading;             /* slots this batch claimed to read */
    int n_reading;
    char *err;
    size_t n;
} Batch;

/* Step 1, before any lock: every expert exists and the distinct ones fit
 * the layer. Fills first[]. */
static int batch_prepare(Batch *b) {
    LsLayer *L = b->L;
    int distinct = 0;
    for (int i = 0; i < b->count; i++) {
        if (!ls_find_entry(L, b->experts[i]))
            return coli_fail(b->err, b->n, COLI_ENOTFOUND, "layer %d has no expert %d (experts 0..%d)",
                             L->id, b->experts[i], L->n_entries - 1);
        b->first[i] = i;
        for (int j = 0; j < i; j++)
            if (b->experts[j] == b->experts[i]) { b->first[i] = j; break; }
        distinct += b->first[i] == i;
    }
    if (distinct > L->n_slots)
        return coli_fail(b->err, b->n, COLI_EFULL,
                         "cache full: %d distinct experts asked of layer %d, which has %d slots",
                         distinct, L->id, L->n_slots);
    return COLI_OK;
}

/* Whether the batch's missing experts fit in the slots it may take:
 * evictable ones except those holding its own resident experts, plus other
 * experts' queued prefetches. */
static bool batch_fits(const Batch *b) {
    LsLayer *L = b->L;
    int missing = 0;
    for (int i = 0; i < b->count; i++)
        missing += b->first[i] == i && !L->slot_of[b->experts[i]];
    if (missing == 0) return true;
    int room = 0;
    if (L->queued == 0) {         /* the common case, in O(count) */
        room = (int)L->evictable;
        for (int i = 0; i < b->count; i++) {
            const LsSlot *v = L->slot_of[b->experts[i]];
            room -= b->first[i] == i && v && v->evictable;
        }
        return missing <= room;
    }
    for (int j = 0; j < L->n_slots; j++) {
        LsSlot *v = &L->slots[j];
        bool ours = false;
        for (int i = 0; i < b->count && !ours && v->state == LS_RESIDENT; i++) ours = v->expert == b->experts[i];
        if (v->state == LS_QUEUED && !v->pinned) {
            for (int i = 0; i < b->count && !ours; i++) ours = v->expert == b->experts[i];
            room += !ours;
        } else if (v->evictable && !ours) {
            room++;
        }
    }
    return missing <= room;
}

/* Step 2: waits, holding no lease, until the whole batch fits, up to the
 * timeout. A batch whose experts could never fit beside the pins of other
 * experts fails at once. */
static int batch_wait_room(Batch *b) {
    LsStore *s = b->s;
    LsLayer *L = b->L;
    if (L->n_pinned > 0) {
        int unpinned = 0;
        for (int i = 0; i < b->count; i++) {
            const LsSlot *v = L->slot_of[b->experts[i]];
            unpinned += b->first[i] == i && !(v && v->pinned);
        }
        if (unpinned > L->n_slots - L->n_pinned)
            return coli_fail(b->err, b->n, COLI_EFULL,
                             "cache full: %d experts asked of layer %d, which has %d slots besides "
                             "its %d pinned ones", unpinned, L->id, L->n_slots - L->n_pinned,
                             L->n_pinned);
    }
    RoomWait room = {0};
    while (!batch_fits(b)) {
        if (wait_for_room(s, L, &room) == ETIMEDOUT) {
            for (int i = 0; i < b->count; i++) ls_count_request(L, b->experts[i]);
            return coli_fail(b->err, b->n, COLI_EFULL,
                             "cache full: %d experts of layer %d could not be leased together: its %d "
                             "slots stayed leased for %.3f s", b->count, L->id, L->n_slots,
                             (double)s->wait_timeout_ns / 1e9);
        }
    }
    return COLI_OK;
}

/* Step 3: takes every slot at once, in three passes: resident experts are
 * leased, then the batch's queued prefetches are taken over, and only then
 * are victims chosen, so a victim is never one of the batch's own experts.
 * Experts another thread is loading are joined after our own reads. */
static void batch_commit(Batch *b) {
    LsLayer *L = b->L;
    b->n_reading = 0;
    for (int pass = 0; pass < 3; pass++) {
        for (int i = 0; i < b->count; i++) {
            if (b->first[i] != i) continue;
            LsEntry *e = &L->entries[b->experts[i]];
            LsSlot *v = L->slot_of[b->experts[i]];
            if (pass == 0) {
                if (v && v->state == LS_RESIDENT) ls_slot_lease(L, v, &b->views[i], i);
                else if (v && v->state == LS_READING) ls_demand_join(b->s, v);
                continue;
            }
            if (v ? v->state != LS_QUEUED || pass != 1 : pass != 2) continue;
            b->at[b->n_reading] = i;
            b->reading[b->n_reading++] = ls_slot_claim(b->s, L, e, b->experts[i], i);   /* room was counted */
        }
    }
}

/* Step 4: reads the claimed slots. Several misses: all but the first go to
 * the I/O workers, ahead of queued prefetches, so the reads overlap; the
 * rest are read here. A job no worker has started when we get to it is
 * taken back. Returns the first failure (its message in err). */
static int batch_read(Batch *b) {
    LsStore *s = b->s;
    LsLayer *L = b->L;
    int rc = COLI_OK;
    for (int k = 1; k < b->n_reading; k++) {
        LsSlot *v = b->reading[k];
        v->batch = LS_BATCH_QUEUED;
        if (!coli_pool_post(&s->pool, (ColiJob){v, v->generation | LS_DEMAND_JOB}, true))
            v->batch = LS_BATCH_NONE;
    }
    for (int k = 0; k < b->n_reading; k++) {
        LsSlot *v = b->reading[k];
        int r;
        uint64_t nread = 0;
        if (v->batch == LS_BATCH_NONE || v->batch == LS_BATCH_QUEUED) {
            v->batch = LS_BATCH_NONE;
            char local[LS_ERRLEN];   /* only the first failure's message is kept */
            r = read_claimed(s, L, v, &nread, rc == COLI_OK ? b->err : local,
                             rc == COLI_OK ? b->n : sizeof local);
        } else {
            while (v->batch != LS_BATCH_DONE) ls_layer_wait(L, NULL);
            v->batch = LS_BATCH_NONE;
            r = v->batch_rc;
            nread = v->batch_nread;
            if (r != COLI_OK && rc == COLI_OK) coli_fail(b->err, b->n, r, "%s", v->batch_err);
        }
        ls_slot_finish_load(s, L, v, r, nread, r == COLI_OK ? 1 : 0);
        if (r == COLI_OK) ls_fill_view(&b->views[b->at[k]], v);
        else if (rc == COLI_OK) rc = r;
    }
    return rc;
}

/* Step 5: loads of ours that a worker or another thread runs are waited for
 * now, holding our leases. That cannot deadlock: a read never waits for a
 * lease. One that failed, or was evicted before we woke, is read here if a
 * slot is free; else *again is set: the batch must give everything back
 * and start over. */
static int batch_join(Batch *b, bool *joined, bool *again) {
    LsStore *s = b->s;
    LsLayer *L = b->L;
    int rc = COLI_OK;
    while (rc == COLI_OK) {
        bool pending = false, joins = false;   /* joins: waits on a load not started early for us */
        for (int i = 0; i < b->count && rc == COLI_OK && !*again; i++) {
            if (b->first[i] != i || b->views[i].lease) continue;
            LsEntry *e = &L->entries[b->experts[i]];
            LsSlot *v = L->slot_of[b->experts[i]];
            if (v && v->state == LS_RESIDENT) {
                ls_slot_lease(L, v, &b->views[i], i);
            } else if (v && v->state == LS_READING) {
                pending = true;
                joins = joins || !v->early;
                ls_demand_join(s, v);
            } else if ((v = ls_slot_claim(s, L, e, b->experts[i], i)) != NULL) {
                rc = demand_read(s, L, v, &b->views[i], b->err, b->n);
            } else {
                *again = true;
            }
        }
        if (*again || !pending) break;
        if (!*joined && joins) L->c.inflight_joins++;
        *joined = *joined || joins;
        ls_layer_wait(L, NULL);
    }
    return rc;
}

/* Step 6, all or nothing: on failure (or to start over) gives back every
 * lease held; on success a repeated expert gets one more lease. */
static void batch_finish(Batch *b, bool ok) {
    LsLayer *L = b->L;
    if (!ok) {
        for (int i = 0; i < b->count; i++)
            if (b->first[i] == i && b->views[i].lease) ls_slot_unlease(L, b->views[i].lease);
        memset(b->views, 0, sizeof(*b->views) * (size_t)b->count);
        return;
    }
    for (int i = 0; i < b->count; i++)
        if (b->first[i] != i) ls_slot_lease(L, L->slot_of[b->experts[i]], &b->views[i], b->first[i]);
}

static int lookup_many_impl(LsStore *s, int layer, const int *experts,
                            int count, ColiExpertView *views, char *err, size_t n) {
    if (count < 0 || (count > 0 && (!experts || !views)))
        return coli_fail(err, n, COLI_EINVAL, "lookup_many: bad arguments");
    memset(views, 0, sizeof(*views) * (size_t)count);
    if (count == 0) return COLI_OK;
    LsLayer *L = ls_find_layer(s, layer);
    if (!L) return coli_fail(err, n, COLI_ENOTFOUND, "layer %d has no routed experts", layer);
    Batch b = {.s = s, .L = L, .experts = experts, .count = count, .views = views, .err = err, .n = n};
    int first_here[2 * BATCH_ON_STACK];   /* most batches are small: no allocation */
    LsSlot *reading_here[BATCH_ON_STACK];
    bool small = count <= BATCH_ON_STACK;
    b.first = small ? first_here : malloc(sizeof(int) * 2 * (size_t)count);
    b.reading = small ? reading_here : malloc(sizeof(LsSlot *) * (size_t)count);
    if (!b.first || !b.reading) {
        free(b.first);
        free(b.reading);
        return coli_fail(err, n, COLI_ENOMEM, "lookup_many: out of memory for %d experts", count);
    }
    b.at = b.first + count;
    int rc = batch_prepare(&b);
    if (rc == COLI_OK) {
        pthread_mutex_lock(&L->mu);
        ls_tick(L, experts, count);
        bool joined = false, again;
        do {
            again = false;
            rc = batch_wait_room(&b);
            if (rc != COLI_OK) break;
            batch_commit(&b);
            rc = batch_read(&b);
            if (rc == COLI_OK) rc = batch_join(&b, &joined, &again);
            batch_finish(&b, rc == COLI_OK && !again);
        } while (rc == COLI_OK && again);
        pthread_mutex_unlock(&L->mu);
    }
    if (!small) {
        free(b.first);
        free(b.reading);
    }
    return rc;
}

int ls_lookup_many(LsStore *s, int layer, const int *experts, int count, ColiExpertView *views,
                   char *err, size_t n) {
    LsLayer *L = ls_find_layer(s, layer);
    if (L && !ls_call_enter(s, &L->calls)) {
        if (views && count > 0) memset(views, 0, sizeof(*views) * (size_t)count);
        return coli_fail(err, n, COLI_ECLOSED, "lookup_many of layer %d: the store is closed", layer);
    }
    int rc = lookup_many_impl(s, layer, experts, count, views, err, n);
    if (L) ls_call_leave(&L->calls);
    return rc;
}

/* ---- replay ------------------------------------------------------------ */

/* Releases the leases of count views of layer L under one lock. */
static void release_views(LsLayer *L, ColiExpertView *views, int count) {
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < count; i++) ls_slot_release_view(L, &views[i]);
    pthread_mutex_unlock(&L->mu);
    memset(views, 0, sizeof(*views) * (size_t)count);
}

/* Gathers the distinct experts >= 0 of row (k of them, in order) into ids,
 * at most cap. Returns how many. */
static int distinct_experts(const int32_t *row, int k, int *ids, int cap) {
    int count = 0;
    for (int j = 0; j < k && count < cap; j++) {
        bool seen = row[j] < 0;
        for (int q = 0; q < count && !seen; q++) seen = ids[q] == row[j];
        if (!seen) ids[count++] = row[j];
    }
    return count;
}

/* Replays the tokens into buffers ids and views of cap entries each. */
static int replay_rows(LsStore *s, const int *layers, int n_layers, const int32_t *experts,
                       int64_t n_tokens, int k, int *ids, ColiExpertView *views, int cap,
                       char *err, size_t n) {
    char local[LS_ERRLEN];
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int i = 0; i < n_layers; i++) {
            const int32_t *row = experts + ((size_t)t * (size_t)n_layers + (size_t)i) * (size_t)k;
            int count = distinct_experts(row, k, ids, cap);
            if (count == 0) continue;
            int rc = ls_lookup_many(s, layers[i], ids, count, views, local, sizeof local);
            if (rc != COLI_OK)
                return coli_fail(err, n, rc, "replay: token %lld, layer %d: %s", (long long)t,
                                 layers[i], local);
            release_views(ls_find_layer(s, layers[i]), views, count);
        }
    }
    return COLI_OK;
}

int ls_replay(LsStore *s, const int *layers, int n_layers, const int32_t *experts,
              int64_t n_tokens, int k, char *err, size_t n) {
    if (n_layers < 0 || n_tokens < 0 || k < 0 || (n_layers > 0 && !layers) ||
        (n_tokens > 0 && n_layers > 0 && k > 0 && !experts))
        return coli_fail(err, n, COLI_EINVAL, "replay: bad arguments (%d layers, %lld tokens, k %d)",
                         n_layers, (long long)n_tokens, k);
    int widest = 0;               /* a row has at most this many valid distinct experts */
    for (int i = 0; i < n_layers; i++) {
        LsLayer *L = ls_find_layer(s, layers[i]);
        if (!L) return coli_fail(err, n, COLI_ENOTFOUND, "replay: layer %d has no routed experts", layers[i]);
        if (L->n_entries > widest) widest = L->n_entries;
    }
    /* One more than any layer's experts: a row with more distinct ones than
     * that holds an unknown expert among its first cap, which fails its
     * lookup as it would among all of them. */
    int cap = k < widest + 1 ? k : widest + 1;
    int ids_here[BATCH_ON_STACK];
    ColiExpertView views_here[BATCH_ON_STACK];
    bool small = cap <= BATCH_ON_STACK;
    int *ids = small ? ids_here : malloc(sizeof(int) * (size_t)cap);
    ColiExpertView *views = small ? views_here : calloc((size_t)cap, sizeof(ColiExpertView));
    if (!ids || !views) {
        if (!small) {
            free(ids);
            free(views);
        }
        return coli_fail(err, n, COLI_ENOMEM, "replay: out of memory for %d experts per token", cap);
    }
    if (small) memset(views_here, 0, sizeof views_here);
    int rc = replay_rows(s, layers, n_layers, experts, n_tokens, k, ids, views, cap, err, n);
    if (!small) {
        free(ids);
        free(views);
    }
    return rc;
}

/* ---- views ------------------------------------------------------------ */

int coli_view_layout(const ColiExpertView *view, uint64_t out[COLI_VIEW_LAYOUT_LEN]) {
    if (!view || !view->lease || !out) return COLI_EINVAL;
    const ColiTensorView *t[3] = {&view->gate, &view->up, &view->down};
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (int i = 0; i < 3; i++) {
        uintptr_t d = (uintptr_t)t[i]->data, sc = (uintptr_t)t[i]->scales;
        if (!t[i]->data) continue;    /* up of a fused gate_up */
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
        out[2 + i] = t[i]->data ? (uintptr_t)t[i]->data - lo : UINT64_MAX;
        out[5 + i] = t[i]->scales ? (uintptr_t)t[i]->scales - lo : UINT64_MAX;
    }
    return COLI_OK;
}
