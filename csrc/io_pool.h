/*
 * io_pool.h (private): a bounded queue served by a fixed set of threads.
 *
 * One mutex and one condition variable guard the ring. post() never blocks:
 * a full queue refuses the job. Workers run each job's callback with no pool
 * lock held. Shutdown sets a flag, wakes everyone and joins every thread;
 * jobs still queued then are dropped without running (their owner cleans up).
 *
 * LOCK ORDER: callers may hold their own lock when they call post(); the
 * callback runs with no pool lock, so it may take any caller lock.
 */
#ifndef COLI_IO_POOL_H
#define COLI_IO_POOL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    void *item;
    uint64_t tag;
} ColiJob;

typedef void (*ColiJobFn)(void *ctx, ColiJob job);

typedef struct {
    pthread_mutex_t mu;           /* guards everything below */
    pthread_cond_t cv;            /* signalled on post and on shutdown */
    ColiJob *ring;
    uint32_t capacity;            /* ring slots */
    uint32_t head;                /* next job to run */
    uint32_t count;               /* jobs queued */
    uint32_t idle;                /* workers waiting for a job */
    bool stopping;
    bool initialized;             /* mutex and condition exist */
    pthread_t *threads;
    uint32_t n_threads;           /* threads started (joined on stop) */
    ColiJobFn run;
    void *ctx;
} ColiIoPool;

/* Starts n_threads workers (0: a pool that refuses every post). On failure
 * every started thread is joined, nothing is allocated and a COLI_E* code is
 * returned with a message in err. */
int coli_pool_start(ColiIoPool *pool, uint32_t n_threads, uint32_t capacity,
                    ColiJobFn run, void *ctx, char *err, size_t err_len);

/* Queues job at the back (front: ahead of everything queued, for work a
 * caller is waiting on); false when the pool has no threads, is stopping or
 * is full. */
bool coli_pool_post(ColiIoPool *pool, ColiJob job, bool front);

/* Stops and joins every worker, drops queued jobs, frees the pool.
 * Safe on a zeroed pool. */
void coli_pool_stop(ColiIoPool *pool);

#endif /* COLI_IO_POOL_H */
