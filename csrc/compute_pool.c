/*
 * compute_pool.c: a fixed set of worker threads woken once per run.
 *
 * Workers sleep on a condition variable between runs. The barrier inside a
 * run spins briefly (phases of one call are short and even), then sleeps,
 * so a thread preempted on a shared machine does not keep the others
 * burning a core.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "coli_errors.h"
#include "compute_pool.h"

enum { POOL_MAX_THREADS = 256, BARRIER_SPINS = 4000 };

struct ColiComputePool {
    int threads;
    pthread_t *workers;             /* threads - 1 */
    int started;                    /* workers created */
    pthread_mutex_t run_lock;       /* held by the caller for a whole run */
    pthread_mutex_t mu;             /* guards everything below but the barrier */
    pthread_cond_t start_cv, done_cv;
    uint64_t generation;            /* bumped per run */
    int pending;                    /* workers still inside the current run */
    int stop;
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

static void *worker_main(void *p) {
    WorkerArg arg = *(WorkerArg *)p;
    free(p);
    ColiComputePool *pool = arg.pool;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool->mu);
        while (pool->generation == seen && !pool->stop) pthread_cond_wait(&pool->start_cv, &pool->mu);
        if (pool->stop) {
            pthread_mutex_unlock(&pool->mu);
            return NULL;
        }
        seen = pool->generation;
        ColiPoolFn fn = pool->fn;
        void *ctx = pool->ctx;
        pthread_mutex_unlock(&pool->mu);
        fn(ctx, arg.index, pool->threads);
        pthread_mutex_lock(&pool->mu);
        if (--pool->pending == 0) pthread_cond_signal(&pool->done_cv);
        pthread_mutex_unlock(&pool->mu);
    }
}

static void pool_free(ColiComputePool *pool) {
    if (pool->started) {
        pthread_mutex_lock(&pool->mu);
        pool->stop = 1;
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
    pthread_mutex_lock(&pool->mu);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->pending = pool->threads - 1;
    pool->generation++;
    pthread_cond_broadcast(&pool->start_cv);
    pthread_mutex_unlock(&pool->mu);
    fn(ctx, 0, pool->threads);
    pthread_mutex_lock(&pool->mu);
    while (pool->pending) pthread_cond_wait(&pool->done_cv, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
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
    for (int i = 0; i < BARRIER_SPINS; i++) {
        if (atomic_load_explicit(&pool->bar_generation, memory_order_acquire) != gen) return;
        cpu_relax();
    }
    pthread_mutex_lock(&pool->bar_mu);
    while (atomic_load_explicit(&pool->bar_generation, memory_order_acquire) == gen)
        pthread_cond_wait(&pool->bar_cv, &pool->bar_mu);
    pthread_mutex_unlock(&pool->bar_mu);
}
