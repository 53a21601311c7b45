/*
 * io_pool.c: the bounded worker pool behind prefetch.
 */
#define _POSIX_C_SOURCE 200809L
#include "io_pool.h"

#include <stdlib.h>
#include <string.h>

#include "coli_errors.h"

static void *worker_main(void *arg) {
    ColiIoPool *pool = arg;
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        while (pool->count == 0 && !pool->stopping) {
            pool->idle++;
            pthread_cond_wait(&pool->cv, &pool->mu);
            pool->idle--;
        }
        if (pool->stopping) break;
        ColiJob job = pool->ring[pool->head];
        pool->head = (pool->head + 1) % pool->capacity;
        pool->count--;
        pthread_mutex_unlock(&pool->mu);
        pool->run(pool->ctx, job);
        pthread_mutex_lock(&pool->mu);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

int coli_pool_start(ColiIoPool *pool, uint32_t n_threads, uint32_t capacity,
                    ColiJobFn run, void *ctx, char *err, size_t err_len) {
    memset(pool, 0, sizeof(*pool));
    if (n_threads == 0) return COLI_OK;
    if (capacity == 0) capacity = 1;
    if (pthread_mutex_init(&pool->mu, NULL) != 0)
        return coli_fail(err, err_len, COLI_ETHREAD, "cannot create the I/O pool mutex");
    if (pthread_cond_init(&pool->cv, NULL) != 0) {
        pthread_mutex_destroy(&pool->mu);
        return coli_fail(err, err_len, COLI_ETHREAD, "cannot create the I/O pool condition");
    }
    pool->initialized = true;
    pool->ring = calloc(capacity, sizeof(ColiJob));
    pool->threads = calloc(n_threads, sizeof(pthread_t));
    if (!pool->ring || !pool->threads) {
        coli_pool_stop(pool);
        return coli_fail(err, err_len, COLI_ENOMEM, "out of memory for an I/O pool of %u", n_threads);
    }
    pool->capacity = capacity;
    pool->run = run;
    pool->ctx = ctx;
    for (uint32_t i = 0; i < n_threads; i++) {
        if (pthread_create(&pool->threads[i], NULL, worker_main, pool) != 0) {
            coli_pool_stop(pool);
            return coli_fail(err, err_len, COLI_ETHREAD, "cannot start I/O worker %u of %u", i, n_threads);
        }
        pool->n_threads = i + 1;
    }
    return COLI_OK;
}

bool coli_pool_post(ColiIoPool *pool, ColiJob job, bool front) {
    if (pool->n_threads == 0) return false;
    pthread_mutex_lock(&pool->mu);
    bool ok = !pool->stopping && pool->count < pool->capacity;
    if (ok) {
        if (front) {
            pool->head = (pool->head + pool->capacity - 1) % pool->capacity;
            pool->ring[pool->head] = job;
        } else {
            pool->ring[(pool->head + pool->count) % pool->capacity] = job;
        }
        pool->count++;
        if (pool->idle > 0) pthread_cond_signal(&pool->cv);
    }
    pthread_mutex_unlock(&pool->mu);
    return ok;
}

void coli_pool_stop(ColiIoPool *pool) {
    if (!pool->initialized) return;   /* zeroed or a pool of no threads */
    pthread_mutex_lock(&pool->mu);
    pool->stopping = true;
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    for (uint32_t i = 0; i < pool->n_threads; i++) pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->cv);
    pthread_mutex_destroy(&pool->mu);
    free(pool->ring);
    free(pool->threads);
    memset(pool, 0, sizeof(*pool));
}
