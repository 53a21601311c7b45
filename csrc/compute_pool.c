/*
 * compute_pool.c: a fixed set of worker threads woken once per run.
 *
 * Between runs, workers spin on the run counter for up to IDLE_SPIN_NS
 * (calls come in quick succession: a layer's experts, a token's layers,
 * with the engine's own ops between them), then sleep on a condition
 * variable; the caller waits for the run's end the same way. The spin is
 * timed, not counted: a pause lasts 10 ns on one CPU and 140 cycles on
 * another, and waking a sleeping worker on a virtual machine (its vCPU
 * halted) costs tens of microseconds, more than most calls' share of work.
 * The barrier inside a run also spins, for up to BARRIER_SPIN_NS, then
 * sleeps, so a thread preempted on a shared machine does not keep the
 * others burning a core.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coli_errors.h"
#include "compute_pool.h"

enum { POOL_MAX_THREADS = 256 };
#define IDLE_SPIN_NS 1000000ULL     /* 1 ms: a decode step's gaps between kernel calls */
#define BARRIER_SPIN_NS 200000ULL   /* 0.2 ms: the threads of one call arrive together */

struct ColiComputePool {
    int threads;
    pthread_t *workers;             /* threads - 1 */
    int started;                    /* workers created */
    pthread_mutex_t run_lock;       /* held by the caller for a whole run */
    pthread_mutex_t mu;             /* guards the sleeps and wakes below */
    pthread_cond_t start_cv, done_cv;
    atomic_ullong generation;       /* bumped per run (release: fn and ctx are set) */
    atomic_int pending;             /* workers still inside the current run */
    atomic_int stop;
    int sleepers;                   /* workers asleep on start_cv (under mu) */
    ColiPoolFn fn;
    void *ctx;
    atomic_uint bar_count;          /* threads arrived at the current barrier */
    atomic_uint bar_generation;     /* bumped when a barrier opens */
    pthread_mutex_t bar_mu;
    pthread_cond_t bar_cv;
};

typedef struct {
    ColiComputePool *pool;
    int index;
} WorkerArg;

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static unsigned long long now_ns(void) {
    struct timespec t;
    if (clock_gettime(CLOCK_MONOTONIC, &t) != 0) return 0; /* then a spin ends at once */
    return (unsigned long long)t.tv_sec * 1000000000ULL + (unsigned long long)t.tv_nsec;
}

/* A timed spin: call spin_on(&spin) once per pause; it turns false after
 * budget_ns (the clock is read every 64 pauses). */
typedef struct {
    unsigned count;
    unsigned long long start, budget_ns;
} Spin;

static Spin spin_for(unsigned long long budget_ns) {
    Spin s = {0, 0, budget_ns};
    return s;
}

static int spin_on(Spin *s) {
    cpu_relax();
    if ((++s->count & 63) != 0) return 1;
    unsigned long long t = now_ns();
    if (t == 0) return 0;
    if (s->start == 0) s->start = t;
    return t - s->start < s->budget_ns;
}

/* The run after seen: spins, then sleeps; returns its generation (or seen
 * when the pool stops). */
static unsigned long long next_run(ColiComputePool *pool, unsigned long long seen) {
    Spin spin = spin_for(IDLE_SPIN_NS);
    do {
        unsigned long long g = atomic_load_explicit(&pool->generation, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&pool->stop, memory_order_acquire)) return g;
    } while (spin_on(&spin));
    pthread_mutex_lock(&pool->mu);
    pool->sleepers++;
    unsigned long long g;
    while ((g = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen &&
           !atomic_load_explicit(&pool->stop, memory_order_acquire))
        pthread_cond_wait(&pool->start_cv, &pool->mu);
    pool->sleepers--;
    pthread_mutex_unlock(&pool->mu);
    return g;
}

static void *worker_main(void *p) {
    WorkerArg arg = *(WorkerArg *)p;
    free(p);
    ColiComputePool *pool = arg.pool;
    unsigned long long seen = 0;
    for (;;) {
        seen = next_run(pool, seen);
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) return NULL;
        pool->fn(pool->ctx, arg.index, pool->threads);
        if (atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool->mu);  /* the caller may be asleep on done_cv */
            pthread_cond_signal(&pool->done_cv);
            pthread_mutex_unlock(&pool->mu);
        }
    }
}

static void pool_free(ColiComputePool *pool) {
    if (pool->started) {
        pthread_mutex_lock(&pool->mu);
        atomic_store_explicit(&pool->stop, 1, memory_order_release);
        pthread_cond_broadcast(&pool->start_cv);
        pthread_mutex_unlock(&pool->mu);
        for (int i = 0; i < pool->started; i++) pthread_join(pool->workers[i], NULL);
    }
    pthread_cond_destroy(&pool->bar_cv);
    pthread_mutex_destroy(&pool->bar_mu);
    pthread_cond_destroy(&pool->done_cv);
    pthread_cond_destroy(&pool->start_cv);
    pthread_mutex_destroy(&pool->mu);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool->workers);
    free(pool);
}

int coli_compute_pool_create(int threads, ColiComputePool **out, char *err, size_t err_len) {
    if (!out) return coli_fail(err, err_len, COLI_EINVAL, "compute pool: NULL output pointer");
    *out = NULL;
    if (threads < 1 || threads > POOL_MAX_THREADS)
        return coli_fail(err, err_len, COLI_EINVAL, "compute pool: %d threads (1..%d)", threads,
                         POOL_MAX_THREADS);
    ColiComputePool *pool = calloc(1, sizeof *pool);
    if (!pool) return coli_fail(err, err_len, COLI_ENOMEM, "compute pool: out of memory");
    pool->threads = threads;
    int rc = pthread_mutex_init(&pool->run_lock, NULL);
    if (!rc) rc = pthread_mutex_init(&pool->mu, NULL);
    if (!rc) rc = pthread_cond_init(&pool->start_cv, NULL);
    if (!rc) rc = pthread_cond_init(&pool->done_cv, NULL);
    if (!rc) rc = pthread_mutex_init(&pool->bar_mu, NULL);
    if (!rc) rc = pthread_cond_init(&pool->bar_cv, NULL);
    if (rc) {  /* glibc's init does not fail; a failure leaves nothing to destroy worth the care */
        free(pool);
        return coli_fail(err, err_len, COLI_ETHREAD, "compute pool: lock init failed (%s)",
                         strerror(rc));
    }
    atomic_init(&pool->bar_count, 0);
    atomic_init(&pool->bar_generation, 0);
    atomic_init(&pool->generation, 0);
    atomic_init(&pool->pending, 0);
    atomic_init(&pool->stop, 0);
    if (threads > 1) {
        pool->workers = calloc((size_t)threads - 1, sizeof *pool->workers);
        if (!pool->workers) {
            pool_free(pool);
            return coli_fail(err, err_len, COLI_ENOMEM, "compute pool: out of memory");
        }
    }
    for (int i = 1; i < threads; i++) {
        WorkerArg *arg = malloc(sizeof *arg);
        if (!arg) {
            pool_free(pool);
            return coli_fail(err, err_len, COLI_ENOMEM, "compute pool: out of memory");
        }
        arg->pool = pool;
        arg->index = i;
        rc = pthread_create(&pool->workers[i - 1], NULL, worker_main, arg);
        if (rc) {
            free(arg);
            pool_free(pool);
            return coli_fail(err, err_len, COLI_ETHREAD, "compute pool: thread %d of %d: %s", i,
                             threads, strerror(rc));
        }
        pool->started = i;
    }
    *out = pool;
    return COLI_OK;
}

void coli_compute_pool_destroy(ColiComputePool *pool) {
    if (pool) pool_free(pool);
}

int coli_compute_pool_threads(const ColiComputePool *pool) { return pool ? pool->threads : 1; }

void coli_compute_pool_run(ColiComputePool *pool, ColiPoolFn fn, void *ctx) {
    if (!pool || pool->threads == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool->run_lock);
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store_explicit(&pool->pending, pool->threads - 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    pthread_mutex_lock(&pool->mu);  /* a sleeper checks the generation under mu */
    if (pool->sleepers) pthread_cond_broadcast(&pool->start_cv);
    pthread_mutex_unlock(&pool->mu);
    fn(ctx, 0, pool->threads);
    Spin spin = spin_for(IDLE_SPIN_NS);
    while (atomic_load_explicit(&pool->pending, memory_order_acquire)) {
        if (spin_on(&spin)) continue;
        pthread_mutex_lock(&pool->mu);
        while (atomic_load_explicit(&pool->pending, memory_order_acquire))
            pthread_cond_wait(&pool->done_cv, &pool->mu);
        pthread_mutex_unlock(&pool->mu);
    }
    pthread_mutex_unlock(&pool->run_lock);
}

void coli_compute_pool_barrier(ColiComputePool *pool) {
    if (!pool || pool->threads == 1) return;
    unsigned gen = atomic_load_explicit(&pool->bar_generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool->bar_count, 1, memory_order_acq_rel) + 1 ==
        (unsigned)pool->threads) {
        /* Last in: reset the count before opening, so that no thread can
         * arrive at the next barrier and see this one's count. */
        atomic_store_explicit(&pool->bar_count, 0, memory_order_relaxed);
        pthread_mutex_lock(&pool->bar_mu);
        atomic_store_explicit(&pool->bar_generation, gen + 1, memory_order_release);
        pthread_cond_broadcast(&pool->bar_cv);
        pthread_mutex_unlock(&pool->bar_mu);
        return;
    }
    Spin spin = spin_for(BARRIER_SPIN_NS);
    do {
        if (atomic_load_explicit(&pool->bar_generation, memory_order_acquire) != gen) return;
    } while (spin_on(&spin));
    pthread_mutex_lock(&pool->bar_mu);
    while (atomic_load_explicit(&pool->bar_generation, memory_order_acquire) == gen)
        pthread_cond_wait(&pool->bar_cv, &pool->bar_mu);
    pthread_mutex_unlock(&pool->bar_mu);
}
