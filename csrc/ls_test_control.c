/*
 * ls_test_control.c: coli_test_control (coli_test_control.h), compiled
 * into test builds only.
 */
#ifndef COLI_TEST_CONTROL
#error "ls_test_control.c belongs to a test build: compile it with -DCOLI_TEST_CONTROL"
#endif

#include "ls_internal.h"

#include <stdarg.h>

#include "coli_test_control.h"

int coli_test_control(ColiExpertStore *store, int op, ...) {
    LsStore *s = ls_store_of(store);
    if (!s) return COLI_EINVAL;
    va_list ap;
    va_start(ap, op);
    int rc = COLI_OK;
    switch (op) {
    case COLI_TEST_READ_FAULT: {
        uint64_t nth = va_arg(ap, uint64_t);
        atomic_store(&s->test.fault.errno_value, va_arg(ap, int));
        atomic_store(&s->test.fault.countdown, nth);
        break;
    }
    case COLI_TEST_HOLD_PREFETCH:
        ls_gate_hold(s, va_arg(ap, int));
        break;
    case COLI_TEST_HELD_PREFETCH:
        rc = (int)atomic_load(&s->test.held);
        break;
    case COLI_TEST_SLOT_BYTES: {
        LsLayer *L = ls_find_layer(s, va_arg(ap, int));
        uint64_t *out = va_arg(ap, uint64_t *);
        if (out) *out = L ? L->slot_bytes : 0;
        break;
    }
    case COLI_TEST_PREFETCH_CHUNK: {
        uint64_t *out = va_arg(ap, uint64_t *);
        if (out) *out = s->prefetch_chunk;
        break;
    }
    default:
        rc = COLI_EINVAL;
    }
    va_end(ap);
    return rc;
}
