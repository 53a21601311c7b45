/*
 * stress_store.c: a multi-threaded stress of the store straight from C,
 * for sanitizer builds (ASan+UBSan, TSan) without a Python interpreter. It
 * is a test build of the core (-DCOLI_TEST_CONTROL, ls_test_control.c), so
 * it injects read faults through coli_test_control.
 *
 * It writes a model file whose every byte is a function of (layer, expert,
 * position), opens a store with few slots (constant eviction) and an I/O
 * pool, and runs threads that lookup, verify every byte, prefetch, lookup
 * many and release at random. It also exercises the contract edges: stale
 * and double releases, lookup into a leased view, NULL stores, faults.
 *
 * usage: stress_store DIR [threads] [iterations]     exit status 0 = pass
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coli_store.h"
#include "coli_test_control.h"

#define LAYERS 3
#define EXPERTS 10
#define ROWS 48
#define COLS 256
#define TENSOR_BYTES (ROWS * COLS * 2)   /* F16: 24 KiB, so an expert is two 64 KiB prefetch chunks */

static unsigned char byte_at(int layer, int expert, int role, size_t i) {
    return (unsigned char)(layer * 131 + expert * 31 + role * 7 + i * 13 + (i >> 8));
}

static int fail_count;
#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); __atomic_add_fetch(&fail_count, 1, __ATOMIC_SEQ_CST); } } while (0)

static int verify(const ColiExpertView *v) {
    const ColiTensorView *t[3] = {&v->gate, &v->up, &v->down};
    for (int r = 0; r < 3; r++) {
        const unsigned char *p = t[r]->data;
        if (t[r]->data_bytes != TENSOR_BYTES) return 0;
        /* every 7th byte and the last: a missing or misplaced chunk shows */
        for (size_t i = 0; i < TENSOR_BYTES; i += (i + 7 < TENSOR_BYTES) ? 7 : 1)
            if (p[i] != byte_at(v->key.layer, v->key.expert, r, i)) return 0;
    }
    return 1;
}

typedef struct { ColiExpertStore *store; unsigned seed; int iters; int replay; } Arg;

/* The bytes of a view: the file's, or none at all in a replay store. */
static int check_view(const Arg *a, const ColiExpertView *v) {
    if (a->replay) return v->gate.data == NULL && v->down.data == NULL && v->key.expert >= 0;
    return verify(v);
}

static void *worker(void *p) {
    Arg *a = p;
    unsigned s = a->seed;
    for (int i = 0; i < a->iters; i++) {
        int layer = rand_r(&s) % LAYERS, expert = rand_r(&s) % EXPERTS, op = rand_r(&s) % 10;
        char err[COLI_ERR_LEN];
        if (op < 2) {
            ColiExpertKey keys[3];
            for (int k = 0; k < 3; k++) keys[k] = (ColiExpertKey){layer, rand_r(&s) % (EXPERTS + 2) - 1};
            a->store->ops->prefetch(a->store, keys, 3);
            if (op == 1) coli_store_retire_prefetches(a->store, layer, &expert, 1);  /* the rest were wrong */
        } else if (op < 4) {
            int ids[2] = {expert, (expert + 3) % EXPERTS};
            ColiExpertView views[2];
            int rc = coli_store_lookup_many(a->store, layer, ids, 2, views, err, sizeof err);
            CHECK(rc == 0, "lookup_many: %s", err);
            if (rc == 0) {
                CHECK(check_view(a, &views[0]) && check_view(a, &views[1]), "lookup_many bytes differ");
                coli_expert_release(a->store, &views[0]);
                coli_expert_release(a->store, &views[1]);
            }
        } else {
            ColiExpertView v;
            memset(&v, 0, sizeof v);
            int rc = coli_store_lookup(a->store, layer, expert, &v, err, sizeof err);
            CHECK(rc == 0, "lookup: %s", err);
            if (rc == 0) {
                CHECK(check_view(a, &v), "bytes of layer %d expert %d differ", layer, expert);
                coli_expert_release(a->store, &v);
                coli_expert_release(a->store, &v);   /* zeroed now: a no-op */
            }
        }
    }
    return NULL;
}

static int write_model(const char *path) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    for (int l = 0; l < LAYERS; l++)
        for (int e = 0; e < EXPERTS; e++)
            for (int r = 0; r < 3; r++)
                for (size_t i = 0; i < TENSOR_BYTES; i++)
                    if (fputc(byte_at(l, e, r, i), f) == EOF) { fclose(f); return -1; }
    return fclose(f);
}

static ColiTensorSource tensor(int l, int e, int r) {
    ColiTensorSource t;
    memset(&t, 0, sizeof t);
    t.offset = ((uint64_t)(l * EXPERTS + e) * 3 + (uint64_t)r) * TENSOR_BYTES;
    t.nbytes = TENSOR_BYTES;
    t.format = COLI_TENSOR_F16;
    t.rows = ROWS;
    t.columns = COLS;
    return t;
}

static const ColiExpertKey PINS[2] = {{0, 5}, {2, 8}};

static ColiExpertStore *open_store(const char *path, ColiExpertSource *src, uint32_t workers, int direct,
                                   int never_pause, int pins, int replay, int policy) {
    const char *files[1] = {path};
    ColiStoreConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.files = files;
    cfg.n_files = 1;
    cfg.experts = src;
    cfg.n_experts = LAYERS * EXPERTS;
    cfg.slots_per_layer = 3;
    cfg.prefetch_workers = workers;
    cfg.prefetch_queue_depth = 4;
    cfg.direct_io = direct;
    cfg.slot_wait_timeout_ns = 30LL * 1000000000LL;
    cfg.prefetch_never_pauses = never_pause;
    cfg.prefetch_chunk_bytes = 64 << 10;
    cfg.pinned = pins ? PINS : NULL;
    cfg.n_pinned = pins ? 2 : 0;
    cfg.replay = replay;
    cfg.policy = policy;
    ColiExpertStore *store = NULL;
    char err[COLI_ERR_LEN];
    int rc = coli_store_create(&cfg, &store, err, sizeof err);
    CHECK(rc == 0, "create: %s", err);
    return store;
}

static void contract_edges(ColiExpertStore *store) {
    ColiExpertView v, w, stale;
    char err[COLI_ERR_LEN];
    /* NULL store: -1 and a zeroed view */
    memset(&v, 0xab, sizeof v);
    CHECK(coli_expert_lookup(NULL, (ColiExpertKey){0, 0}, &v) == -1, "NULL store lookup");
    CHECK(v.lease == NULL && v.gate.data == NULL, "NULL store view not zeroed");
    coli_expert_release(NULL, &v);
    /* out of range keys */
    CHECK(coli_expert_lookup(store, (ColiExpertKey){0, EXPERTS}, &v) == COLI_ENOTFOUND, "expert too large");
    CHECK(coli_expert_lookup(store, (ColiExpertKey){-1, 0}, &v) == COLI_ENOTFOUND, "negative layer");
    /* stale generation: hold a copy, force the slot to be reused, release the copy */
    memset(&v, 0, sizeof v);
    CHECK(coli_expert_lookup(store, (ColiExpertKey){1, 0}, &v) == 0, "lookup 1/0");
    stale = v;
    coli_expert_release(store, &v);
    for (int e = 1; e <= 3; e++) {    /* three other experts fill the three slots */
        memset(&w, 0, sizeof w);
        CHECK(coli_expert_lookup(store, (ColiExpertKey){1, e}, &w) == 0, "lookup 1/%d", e);
        coli_expert_release(store, &w);
    }
    memset(&w, 0, sizeof w);
    CHECK(coli_expert_lookup(store, (ColiExpertKey){1, 4}, &w) == 0, "lookup 1/4");
    uint64_t before = coli_store_active_leases(store);
    coli_expert_release(store, &stale);
    CHECK(coli_store_active_leases(store) == before, "a stale release dropped another lease");
    CHECK(verify(&w), "bytes changed under a lease");
    /* lookup into a view holding a lease: refused, and that lease is dropped */
    CHECK(coli_store_lookup(store, 1, 5, &w, err, sizeof err) == COLI_ELEASE, "lookup into a leased view");
    CHECK(w.lease == NULL, "refused lookup left the view set");
    CHECK(coli_store_active_leases(store) == before - 1, "refused lookup leaked the old lease");
    /* a fault fails one lookup, then the expert loads */
    CHECK(coli_test_control(store, COLI_TEST_READ_FAULT, (uint64_t)1, EIO) == 0, "arm a read fault");
    memset(&v, 0, sizeof v);
    CHECK(coli_store_lookup(store, 2, 9, &v, err, sizeof err) == COLI_EIO, "injected fault");
    CHECK(strstr(err, "offset") != NULL, "fault message lacks the offset: %s", err);
    CHECK(coli_store_lookup(store, 2, 9, &v, err, sizeof err) == 0 && verify(&v), "retry after fault: %s", err);
    coli_expert_release(store, &v);
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s DIR [threads] [iterations]\n", argv[0]); return 2; }
    bool destroy_leased = argc > 2 && strcmp(argv[2], "destroy-leased") == 0;
    int threads = argc > 2 && !destroy_leased ? atoi(argv[2]) : 6, iters = argc > 3 ? atoi(argv[3]) : 2000;
    char path[4096];
    snprintf(path, sizeof path, "%s/stress_model.bin", argv[1]);
    if (write_model(path) != 0) { perror(path); return 2; }
    static ColiExpertSource src[LAYERS * EXPERTS];
    for (int l = 0; l < LAYERS; l++)
        for (int e = 0; e < EXPERTS; e++)
            src[l * EXPERTS + e] = (ColiExpertSource){l, e, tensor(l, e, 0), tensor(l, e, 1), tensor(l, e, 2), 0, 0, NULL};
    if (destroy_leased) {          /* rule 5: must abort in a build with assertions */
        ColiExpertStore *store = open_store(path, src, 1, 0, 0, 0, 0, COLI_POLICY_LRU);
        ColiExpertView v;
        memset(&v, 0, sizeof v);
        if (!store || coli_expert_lookup(store, (ColiExpertKey){0, 0}, &v) != 0) return 2;
        store->ops->destroy(store);
        puts("destroy with a lease held returned");
        return 0;
    }
    for (int mode = 0; mode < 7; mode++) {
        uint32_t workers = (mode & 1) || mode == 4 || mode == 6 ? 2 : 0;
        /* mode 3 also lets prefetch reads share the disk instead of pausing;
         * mode 4 pins two experts (their loads race the threads below) and
         * evicts by LFU (a heap policy under threads),
         * mode 5 is a replay store with the same pins,
         * mode 6 is mode 4 evicting by LRFU (the other heap policy) */
        int pins = mode >= 4, replay = mode == 5;
        int policy = mode == 4 ? COLI_POLICY_LFU : mode == 6 ? COLI_POLICY_LRFU : COLI_POLICY_LRU;
        ColiExpertStore *store = open_store(path, src, workers, mode == 2 || mode == 3, mode == 3, pins, replay,
                                            policy);
        if (!store) return 1;
        /* contract_edges' fault check needs an expert that LRU has evicted by then */
        int edges = !replay && policy != COLI_POLICY_LRFU;
        /* the injected fault must meet contract_edges' own read, not a pin's
         * background load (mode 6 keeps pins loading while the threads run) */
        if (edges && pins && workers)
            CHECK(coli_store_wait_idle(store, -1, -1) == 0, "pins never finished loading");
        if (edges) contract_edges(store);
        pthread_t t[16];
        Arg a[16];
        if (threads > 16) threads = 16;
        for (int i = 0; i < threads; i++) {
            a[i] = (Arg){store, (unsigned)(i * 7919 + mode), iters, replay};
            if (pthread_create(&t[i], NULL, worker, &a[i]) != 0) { perror("pthread_create"); return 2; }
        }
        for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
        ColiExpertStoreStats st;
        store->ops->stats(store, &st);
        CHECK(coli_store_active_leases(store) == 0, "leases left: %llu", (unsigned long long)coli_store_active_leases(store));
        CHECK(st.resident_bytes <= st.capacity_bytes, "resident over capacity");
        CHECK(st.prefetch_hits <= st.prefetched, "prefetch_hits > prefetched");
        CHECK(st.persistent_hits + st.transient_hits == st.hits, "persistent + transient != hits");
        ColiExpertKey pinned[4];
        CHECK(coli_store_pinned(store, pinned, 4) == (pins ? 2 : 0), "pins lost");
        CHECK(!pins || (st.persistent_hits > 0 && pinned[0].layer == 0 && pinned[0].expert == 5 &&
                        pinned[1].layer == 2 && pinned[1].expert == 8), "pins wrong or never hit");
        CHECK(st.loads_failed == (edges ? 1u : 0u) && st.requests == st.hits + st.misses + 0,
              "counters: requests %llu hits %llu misses %llu failed %llu",
              (unsigned long long)st.requests, (unsigned long long)st.hits,
              (unsigned long long)st.misses, (unsigned long long)st.loads_failed);
        /* leave prefetches queued and running at destroy */
        ColiExpertKey keys[LAYERS * EXPERTS];
        for (int i = 0; i < LAYERS * EXPERTS; i++) keys[i] = (ColiExpertKey){i / EXPERTS, i % EXPERTS};
        store->ops->prefetch(store, keys, LAYERS * EXPERTS);
        printf("mode %d (workers %u, direct %d, pins %d, replay %d): requests %llu hits %llu misses %llu prefetched %llu "
               "prefetch_hits %llu joins %llu evictions %llu peak_inflight %llu\n",
               mode, workers, mode == 2 || mode == 3, pins, replay, (unsigned long long)st.requests, (unsigned long long)st.hits,
               (unsigned long long)st.misses, (unsigned long long)st.prefetched,
               (unsigned long long)st.prefetch_hits, (unsigned long long)st.inflight_joins,
               (unsigned long long)st.evictions, (unsigned long long)st.peak_inflight);
        store->ops->destroy(store);
    }
    remove(path);
    if (fail_count) { fprintf(stderr, "%d checks failed\n", fail_count); return 1; }
    puts("stress_store: all checks passed");
    return 0;
}
