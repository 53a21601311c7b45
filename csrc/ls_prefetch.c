/*
 * ls_prefetch.c: prefetch, the I/O workers' jobs, and retiring wrong
 * guesses, on top of the slot state machine (ls_slots.h).
 *
 * A prefetch claims the policy's victim (never an unhit prefetch) as a
 * QUEUED slot and posts a job tagged with the slot's generation; a job
 * whose slot moved on is stale and skipped. Prefetch reads go in chunks,
 * paced by the demand gate (ls_wait.c): before each one the worker stops if
 * the prefetch was retired as a wrong guess, and waits while a demand read
 * is in progress, unless a lookup is waiting for this very load.
 */
#define _GNU_SOURCE
#include "ls_slots.h"

typedef struct {
    LsStore *s;
    LsSlot *v;
} PrefetchPace;

static bool prefetch_pause(void *ctx) {
    const PrefetchPace *p = ctx;
    return ls_gate_pause(p->s, p->v);
}

/* Worker side of a lease_many read: reads the slot unless its batch took
 * the job back, and hands the result to the batch's thread. */
static void run_batch_read(LsStore *s, LsSlot *v, uint64_t generation) {
    LsLayer *L = v->layer;
    pthread_mutex_lock(&L->mu);
    if (v->generation != generation || v->batch != LS_BATCH_QUEUED) {
        pthread_mutex_unlock(&L->mu);
        return;
    }
    v->batch = LS_BATCH_RUNNING;
    const LsEntry *e = &L->entries[v->expert];
    pthread_mutex_unlock(&L->mu);
    uint64_t nread = 0;
    ls_demand_begin(s);
    int rc = ls_read(s, e, v->mem, NULL, &nread, v->batch_err, sizeof v->batch_err);
    ls_demand_end(s);
    pthread_mutex_lock(&L->mu);
    v->batch_rc = rc;
    v->batch_nread = nread;
    v->batch = LS_BATCH_DONE;
    ls_wake(L);
    pthread_mutex_unlock(&L->mu);
}

/* Loads preloaded slot v, unless a lookup took its load or its slot over
 * since create gave it generation gen. Paced like a prefetch. */
static void load_preload(LsStore *s, LsSlot *v, uint64_t gen) {
    LsLayer *L = v->layer;
    pthread_mutex_lock(&L->mu);
    if (v->state != LS_QUEUED || v->generation != gen) {
        pthread_mutex_unlock(&L->mu);
        return;
    }
    ls_slot_begin_read(L, v);
    LsEntry *e = &L->entries[v->expert];
    uint64_t nread = 0;
    char err[LS_ERRLEN];
    PrefetchPace pace = {s, v};
    ColiReadPacer pacer = {s->prefetch_chunk, prefetch_pause, &pace};
    if (!s->replay) pthread_mutex_unlock(&L->mu);
    int rc = ls_read(s, e, v->mem, &pacer, &nread, err, sizeof err);
    if (!s->replay) pthread_mutex_lock(&L->mu);
    ls_slot_finish_load(s, L, v, rc, nread, 0);
    pthread_mutex_unlock(&L->mu);
}

/* A preload job: loads the next preload not taken yet, until none is left
 * or the store closes. */
static void run_preload_job(LsStore *s) {
    while (!atomic_load(&s->stopping)) {
        int i = atomic_fetch_add(&s->next_preload, 1);
        if (i >= s->n_preloads) return;
        load_preload(s, s->preloads[i], s->preload_gens[i]);
    }
}

void ls_start_preloads(LsStore *s) {
    if (s->n_preloads == 0) return;
    uint32_t n = (uint32_t)s->n_preloads;
    uint32_t jobs = s->pool.n_threads < n ? s->pool.n_threads : n;
    uint32_t posted = 0;
    for (uint32_t j = 0; j < jobs; j++)
        posted += coli_pool_post(&s->pool, (ColiJob){s, LS_PRELOAD_JOB}, false);
    if (posted == 0) run_preload_job(s);   /* no workers (or a replay store): here and now */
}

void ls_run_job(void *ctx, ColiJob job) {
    if (job.tag == LS_PRELOAD_JOB) {
        run_preload_job(ctx);
        return;
    }
    if (job.tag & LS_DEMAND_JOB) {
        run_batch_read(ctx, job.item, job.tag & ~LS_DEMAND_JOB);
        return;
    }
    LsStore *s = ctx;
    LsSlot *v = job.item;
    LsLayer *L = v->layer;
    pthread_mutex_lock(&L->mu);
    if (v->state != LS_QUEUED || v->generation != job.tag) {
        pthread_mutex_unlock(&L->mu);
        return;
    }
    ls_slot_begin_read(L, v);
    LsEntry *e = &L->entries[v->expert];
    bool early = v->early;   /* a start_reads load is a demand read: prefetch reads pause for it */
    pthread_mutex_unlock(&L->mu);
    uint64_t nread = 0;
    char err[LS_ERRLEN];
    PrefetchPace pace = {s, v};
    ColiReadPacer pacer = {s->prefetch_chunk, prefetch_pause, &pace};
    if (early) ls_demand_begin(s);
    int rc = ls_read(s, e, v->mem, early ? NULL : &pacer, &nread, err, sizeof err);
    if (early) ls_demand_end(s);
    pthread_mutex_lock(&L->mu);
    ls_slot_finish_load(s, L, v, rc, nread, 0);
    pthread_mutex_unlock(&L->mu);
}

/* Queues a worker's read of expert (entry e) of layer L, neither resident
 * nor loading, into the policy's victim; an early read (start_reads) goes
 * ahead of every queued prefetch. Returns whether it was queued. */
static bool queue_read(LsStore *s, LsLayer *L, LsEntry *e, int expert, bool early) {
    pthread_mutex_lock(&L->mu);
    LsSlot *v = L->slot_of[expert] ? NULL : ls_victim(L);
    /* An unhit prefetch as the victim means only unhit prefetches are left
     * to evict: taking one would let a batch undo itself. A read the engine
     * waits for next may, as its own lookup would. */
    if (v && v->prefetched && !early) v = NULL;
    /* Post with the generation repurpose is about to give the slot; a
     * worker that pops it first blocks on L->mu until we are done. */
    uint64_t generation = v ? ls_next_generation(s) : 0;
    bool queued = v && coli_pool_post(&s->pool, (ColiJob){v, generation}, early);
    if (queued) ls_slot_queue_prefetch(s, L, v, e, expert, generation, early);
    pthread_mutex_unlock(&L->mu);
    return queued;
}

int ls_prefetch_op(ColiExpertStore *store, const ColiExpertKey *keys, int count) {
    LsStore *s = store->state;   /* reached through ls_ops: a store of ours */
    if (!keys || count <= 0 || s->pool.n_threads == 0 || !ls_call_enter(s, &s->prefetch_calls))
        return 0;
    int accepted = 0;
    for (int i = 0; i < count; i++) {
        LsLayer *L = ls_find_layer(s, keys[i].layer);
        LsEntry *e = L ? ls_find_entry(L, keys[i].expert) : NULL;
        accepted += e && queue_read(s, L, e, keys[i].expert, false);
    }
    ls_call_leave(&s->prefetch_calls);
    return accepted;
}

int ls_start_reads(LsStore *s, LsLayer *L, const int *experts, int count) {
    if (!experts || count <= 0 || s->pool.n_threads == 0 || !ls_call_enter(s, &s->prefetch_calls))
        return 0;
    int started = 0;
    for (int i = 0; i < count; i++) {
        LsEntry *e = ls_find_entry(L, experts[i]);
        started += e && queue_read(s, L, e, experts[i], true);
    }
    ls_call_leave(&s->prefetch_calls);
    return started;
}

int ls_retire_prefetches(LsStore *s, LsLayer *L, const int *keep, int n_keep) {
    if (n_keep < 0 || (n_keep > 0 && !keep)) return 0;
    int retired = 0;
    pthread_mutex_lock(&L->mu);
    for (int j = 0; j < L->n_slots; j++) {
        LsSlot *v = &L->slots[j];
        if (!v->prefetched || v->early || v->state == LS_EMPTY || (v->state == LS_RESIDENT && v->leases))
            continue;
        bool kept = false;
        for (int i = 0; i < n_keep && !kept; i++) kept = keep[i] == v->expert;
        if (kept) continue;
        if (v->state == LS_QUEUED) {
            ls_slot_empty(s, L, v);
        } else if (v->state == LS_READING) {   /* a worker reads it: stop at its next chunk */
            atomic_store(&v->retired, true);
        } else {                  /* resident, unleased, never hit: evict it first */
            ls_slot_demote(L, v);
        }
        retired++;
    }
    pthread_mutex_unlock(&L->mu);
    return retired;
}
