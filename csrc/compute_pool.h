/*
 * compute_pool.h (private): the threads a kernel call computes with.
 *
 * A run executes fn(ctx, thread, threads) once on each of the pool's
 * threads (the caller is thread 0) and returns when all have returned.
 * Inside a run, coli_compute_pool_barrier separates phases (every thread
 * waits until all have reached it). One run at a time per pool: a second
 * caller waits for the first run to end. The pool has nothing to do with
 * the store's I/O pool; its threads only compute.
 */
#ifndef COLI_COMPUTE_POOL_H
#define COLI_COMPUTE_POOL_H

#include "ffn.h"

typedef void (*ColiPoolFn)(void *ctx, int thread, int threads);

/* pool NULL: fn(ctx, 0, 1) on the calling thread. */
void coli_compute_pool_run(ColiComputePool *pool, ColiPoolFn fn, void *ctx);
/* Inside a run of pool (NULL: no-op): waits for every thread of the run. */
void coli_compute_pool_barrier(ColiComputePool *pool);

#endif /* COLI_COMPUTE_POOL_H */
