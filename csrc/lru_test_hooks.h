/*
 * lru_test_hooks.h: hooks of the LRU store for tests only.
 *
 * They are compiled into the library (the Python tests reach them through
 * the cffi module, via Store's underscore methods; tests/c/stress_store.c
 * links them), but no engine should call them: they make reads fail or
 * stall on purpose. build_ffi.py feeds this header to cffi's cdef.
 */
#ifndef COLI_LRU_TEST_HOOKS_H
#define COLI_LRU_TEST_HOOKS_H

#include <stdint.h>

#include "lru_store.h"

/* The nth read from now (1 = the next) fails with errno_value. n = 0
 * disarms. Reads are counted across all threads of this store. */
void coli_lru_inject_read_fault(ColiExpertStore *store, uint64_t nth,
                                int errno_value);

/* While hold is nonzero, prefetch reads that a worker has begun wait before
 * each chunk, even if a lookup waits for them; close and destroy lift the
 * hold. held_prefetch_reads says how many wait now. */
void coli_lru_hold_prefetch_reads(ColiExpertStore *store, int hold);
int coli_lru_held_prefetch_reads(ColiExpertStore *store);

/* Bytes per slot of layer (the stride of its slot memory); 0 for a layer
 * without experts. */
uint64_t coli_lru_slot_bytes(ColiExpertStore *store, int layer);

#endif /* COLI_LRU_TEST_HOOKS_H */
