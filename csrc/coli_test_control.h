/*
 * coli_test_control.h: the one door through which tests make the store
 * misbehave on purpose, in the spirit of SQLite's sqlite3_test_control. It
 * exists only in a test build of the core (compiled with
 * -DCOLI_TEST_CONTROL and ls_test_control.c: build_ffi.py's test builder,
 * which the test suite runs against). A production build has neither the
 * entry point nor the state it sets, and its reads and prefetch pauses
 * check nothing.
 *
 * This header is fed to the test build's cffi cdef after '#' lines are
 * stripped.
 */
#ifndef COLI_TEST_CONTROL_H
#define COLI_TEST_CONTROL_H

#include "coli_store.h"

/* The ops, each with the arguments that follow op. */
enum {
    /* (uint64_t nth, int errno_value): the nth read from now (1: the next),
     * counted over every thread of the store, fails with errno_value;
     * nth 0 disarms. Returns 0. */
    COLI_TEST_READ_FAULT = 1,
    /* (int hold): while hold is nonzero, prefetch reads a worker has begun
     * wait before each chunk, even if a lookup waits for them; close and
     * destroy lift the hold. Returns 0. */
    COLI_TEST_HOLD_PREFETCH = 2,
    /* (): returns how many prefetch reads wait on that hold now. */
    COLI_TEST_HELD_PREFETCH = 3,
    /* (int layer, uint64_t *out): *out gets the bytes of each slot of
     * layer (the stride of its slot memory), 0 for a layer without
     * experts. Returns 0. */
    COLI_TEST_SLOT_BYTES = 4,
    /* (uint64_t *out): *out gets the size of the chunks prefetch reads go
     * in (prefetch_chunk_bytes as the store resolved it). Returns 0. */
    COLI_TEST_PREFETCH_CHUNK = 5
};

/* Does op (a COLI_TEST_* value) on store with the arguments that follow.
 * Returns what the op says, or COLI_EINVAL for an unknown op or a handle
 * that is not a store of this library. */
int coli_test_control(ColiExpertStore *store, int op, ...);

#endif /* COLI_TEST_CONTROL_H */
