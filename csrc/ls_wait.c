/*
 * ls_wait.c: every wait of the store: deadlines on the monotonic clock, a
 * layer's condition, wait_idle, and the demand gate.
 *
 * THE DEMAND GATE. Demand reads (a lookup's miss, a lease_many batch's
 * reads) bracket themselves with ls_demand_begin/end. Prefetch reads go in
 * chunks, and before each one ls_gate_pause stops a read retired as a
 * wrong guess and waits while a demand read is in progress (at most
 * LS_PAUSE_LIMIT_NS a chunk), unless a lookup waits for that very load
 * (ls_demand_join). gate_mu is a leaf lock: taken under a layer mutex (a
 * lookup that joins a prefetch wakes its paused reader), never the reverse.
 */
#define _GNU_SOURCE
#include "ls_internal.h"

#include <errno.h>

int ls_sync_init(pthread_mutex_t *mu, pthread_cond_t *cv) {
    if (pthread_mutex_init(mu, NULL) != 0) return 1;
    pthread_condattr_t attr;
    bool bad = pthread_condattr_init(&attr) != 0;
    if (!bad) {
        bad = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) != 0 || pthread_cond_init(cv, &attr) != 0;
        pthread_condattr_destroy(&attr);
    }
    if (bad) pthread_mutex_destroy(mu);
    return bad ? 2 : 0;
}

void ls_deadline_after(struct timespec *ts, int64_t ns) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ns / 1000000000;
    ts->tv_nsec += ns % 1000000000;
    if (ts->tv_nsec >= 1000000000) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000;
    }
}

int ls_layer_wait(LsLayer *L, const struct timespec *deadline) {
    L->waiters++;
    int rc = deadline ? pthread_cond_timedwait(&L->cv, &L->mu, deadline)
                      : pthread_cond_wait(&L->cv, &L->mu);
    L->waiters--;
    return rc;
}

int ls_wait_idle(LsStore *s, int layer, int64_t timeout_ns) {
    struct timespec deadline;
    if (timeout_ns >= 0) ls_deadline_after(&deadline, timeout_ns);
    for (int i = 0; i < s->n_layers; i++) {
        LsLayer *L = &s->layers[i];
        if (layer >= 0 && L->id != layer) continue;
        pthread_mutex_lock(&L->mu);
        while (L->loading > 0) {
            if (ls_layer_wait(L, timeout_ns >= 0 ? &deadline : NULL) == ETIMEDOUT && L->loading > 0) {
                pthread_mutex_unlock(&L->mu);
                return COLI_ETIMEOUT;
            }
        }
        pthread_mutex_unlock(&L->mu);
    }
    return COLI_OK;
}

/* ---- the demand gate ------------------------------------------------- */

static void gate_wake(LsStore *s) {
    pthread_mutex_lock(&s->gate_mu);
    pthread_cond_broadcast(&s->gate_cv);
    pthread_mutex_unlock(&s->gate_mu);
}

void ls_demand_begin(LsStore *s) { atomic_fetch_add(&s->demand_reads, 1); }

void ls_demand_end(LsStore *s) {
    if (atomic_fetch_sub(&s->demand_reads, 1) == 1 && s->demand_first) gate_wake(s);
}

void ls_demand_join(LsStore *s, LsSlot *v) {
    if (!atomic_exchange(&v->demanded, true) && s->demand_first) gate_wake(s);
}

#ifdef COLI_TEST_CONTROL
void ls_gate_hold(LsStore *s, int hold) {
    atomic_store(&s->test.hold_prefetch, hold != 0);
    if (!hold) gate_wake(s);
}

/* Waits while a test holds prefetch reads at the gate. */
static void wait_while_held(LsStore *s) {
    if (!atomic_load(&s->test.hold_prefetch)) return;
    pthread_mutex_lock(&s->gate_mu);
    atomic_fetch_add(&s->test.held, 1);
    while (atomic_load(&s->test.hold_prefetch)) pthread_cond_wait(&s->gate_cv, &s->gate_mu);
    atomic_fetch_sub(&s->test.held, 1);
    pthread_mutex_unlock(&s->gate_mu);
}
#endif

/* The flags are read again under gate_mu, which their writers take before
 * they broadcast, so no wake-up is lost. */
bool ls_gate_pause(LsStore *s, LsSlot *v) {
#ifdef COLI_TEST_CONTROL
    wait_while_held(s);
#endif
    if (atomic_load(&v->demanded)) return true;
    if (atomic_load(&v->retired)) return false;
    if (!s->demand_first || !atomic_load(&s->demand_reads)) return true;
    atomic_fetch_add(&s->prefetch_pauses, 1);
    struct timespec deadline;
    ls_deadline_after(&deadline, LS_PAUSE_LIMIT_NS);
    pthread_mutex_lock(&s->gate_mu);
    while (atomic_load(&s->demand_reads) && !atomic_load(&v->demanded))
        if (pthread_cond_timedwait(&s->gate_cv, &s->gate_mu, &deadline) == ETIMEDOUT) break;
    pthread_mutex_unlock(&s->gate_mu);
    return !atomic_load(&v->retired) || atomic_load(&v->demanded);
}
