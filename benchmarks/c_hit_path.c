/*
 * c_hit_path.c: the C-level cost of a hit, lookup + release of a resident
 * expert, straight against csrc/ (no Python). Built and run by
 * benchmarks/c_hit_path.py.
 *
 * It writes its own model file (raw bytes: LAYERS x EXPERTS experts of three
 * F16 ROWS x COLS tensors, back to back), opens a store with a slot for
 * every expert, loads them all, then times:
 *
 *   mutex        an uncontended pthread mutex lock + unlock pair (baseline:
 *                the store's hit path takes one layer mutex twice)
 *   seq 1T       one thread: coli_expert_lookup + coli_expert_release of
 *                layer 0's experts in turn
 *   direct 1T    the same through coli_store_lookup (no ops table, err NULL)
 *   2T           two threads, thread t on layer t, the same loop; throughput
 *                of both against one thread alone
 *   scatter 1T   (scale mode) a decode-like key sequence over every layer:
 *                for each layer in order, TOPK pseudo-random experts
 *
 * usage: c_hit_path DIR [layers experts iters reps rows cols]
 * Prints one JSON object on stdout.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coli_store.h"

#define TOPK 8
#define SEQ_LEN 65536

static int LAYERS = 2, EXPERTS = 8, ROWS = 16, COLS = 24;
static long ITERS = 2000000;
static int REPS = 5;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static size_t tensor_bytes(void) { return (size_t)ROWS * (size_t)COLS * 2; }

static int write_model(const char *path) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t n = tensor_bytes();
    unsigned char *buf = malloc(n);
    if (!buf) { fclose(f); return -1; }
    for (int l = 0; l < LAYERS; l++)
        for (int e = 0; e < EXPERTS; e++)
            for (int r = 0; r < 3; r++) {
                for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(l * 131 + e * 31 + r * 7 + i);
                if (fwrite(buf, 1, n, f) != n) { free(buf); fclose(f); return -1; }
            }
    free(buf);
    return fclose(f);
}

static ColiTensorSource tensor(int l, int e, int r) {
    ColiTensorSource t;
    memset(&t, 0, sizeof t);
    t.offset = ((uint64_t)(l * EXPERTS + e) * 3 + (uint64_t)r) * tensor_bytes();
    t.nbytes = tensor_bytes();
    t.format = COLI_TENSOR_F16;
    t.rows = ROWS;
    t.columns = COLS;
    return t;
}

typedef struct {
    ColiExpertStore *store;
    int layer;
    long iters;
    int direct;
    pthread_barrier_t *start;
    uint64_t t0, t1;
    long failures;
} Arg;

static void *loop(void *p) {
    Arg *a = p;
    ColiExpertView v;
    memset(&v, 0, sizeof v);
    long fails = 0;
    if (a->start) pthread_barrier_wait(a->start);
    a->t0 = now_ns();
    int e = 0;
    if (a->direct) {
        for (long i = 0; i < a->iters; i++) {
            fails += coli_store_lookup(a->store, a->layer, e, &v, NULL, 0) != 0;
            coli_expert_release(a->store, &v);
            if (++e == EXPERTS) e = 0;
        }
    } else {
        for (long i = 0; i < a->iters; i++) {
            fails += coli_expert_lookup(a->store, (ColiExpertKey){a->layer, e}, &v) != 0;
            coli_expert_release(a->store, &v);
            if (++e == EXPERTS) e = 0;
        }
    }
    a->t1 = now_ns();
    a->failures = fails;
    return NULL;
}

static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ns per pair of one thread on layer 0 */
static double one_thread(ColiExpertStore *store, int direct, long *fails) {
    Arg a = {store, 0, ITERS, direct, NULL, 0, 0, 0};
    loop(&a);
    *fails += a.failures;
    return (double)(a.t1 - a.t0) / (double)ITERS;
}

/* pairs per second of two threads on layers 0 and 1, ITERS each */
static double two_threads(ColiExpertStore *store, long *fails) {
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    Arg a[2] = {{store, 0, ITERS, 0, &bar, 0, 0, 0}, {store, 1 % LAYERS, ITERS, 0, &bar, 0, 0, 0}};
    pthread_t th;
    pthread_create(&th, NULL, loop, &a[1]);
    loop(&a[0]);
    pthread_join(th, NULL);
    pthread_barrier_destroy(&bar);
    *fails += a[0].failures + a[1].failures;
    uint64_t t0 = a[0].t0 < a[1].t0 ? a[0].t0 : a[1].t0;
    uint64_t t1 = a[0].t1 > a[1].t1 ? a[0].t1 : a[1].t1;
    return 2.0 * (double)ITERS / ((double)(t1 - t0) / 1e9);
}

static double mutex_pair(void) {
    pthread_mutex_t mu;
    pthread_mutex_init(&mu, NULL);
    uint64_t t0 = now_ns();
    for (long i = 0; i < ITERS; i++) {
        pthread_mutex_lock(&mu);
        __asm__ __volatile__("" ::: "memory");
        pthread_mutex_unlock(&mu);
    }
    uint64_t t1 = now_ns();
    pthread_mutex_destroy(&mu);
    return (double)(t1 - t0) / (double)ITERS;
}

/* The machine's own 2-thread ceiling: an arithmetic loop that shares
 * nothing, in one thread and then in two. Returns the throughput ratio. */
static void *spin(void *p) {
    volatile uint64_t x = (uint64_t)(uintptr_t)p;
    for (long i = 0; i < ITERS * 4; i++) x = x * 6364136223846793005ull + 1;
    return NULL;
}

static double machine_ceiling(void) {
    uint64_t t0 = now_ns();
    spin((void *)1);
    double one = (double)(now_ns() - t0);
    pthread_t th[2];
    t0 = now_ns();
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, spin, (void *)(uintptr_t)(i + 2));
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    return 2.0 * one / (double)(now_ns() - t0);
}

static double scatter(ColiExpertStore *store, long *fails) {
    static ColiExpertKey seq[SEQ_LEN];
    uint32_t x = 12345u;
    int n = 0;
    while (n < SEQ_LEN)
        for (int l = 0; l < LAYERS && n < SEQ_LEN; l++)
            for (int k = 0; k < TOPK && n < SEQ_LEN; k++) {
                x = x * 1664525u + 1013904223u;
                seq[n++] = (ColiExpertKey){l, (int)((x >> 8) % (uint32_t)EXPERTS)};
            }
    ColiExpertView v;
    memset(&v, 0, sizeof v);
    uint64_t t0 = now_ns();
    for (long i = 0; i < ITERS; i++) {
        *fails += coli_expert_lookup(store, seq[i & (SEQ_LEN - 1)], &v) != 0;
        coli_expert_release(store, &v);
    }
    return (double)(now_ns() - t0) / (double)ITERS;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR [layers experts iters reps rows cols policy]\n", argv[0]);
        return 2;
    }
    if (argc > 2) LAYERS = atoi(argv[2]);
    if (argc > 3) EXPERTS = atoi(argv[3]);
    if (argc > 4) ITERS = atol(argv[4]);
    if (argc > 5) REPS = atoi(argv[5]);
    if (argc > 6) ROWS = atoi(argv[6]);
    if (argc > 7) COLS = atoi(argv[7]);
    int policy = argc > 8 ? atoi(argv[8]) : COLI_POLICY_LRU;
    if (LAYERS < 1 || EXPERTS < 1 || ITERS < 1 || REPS < 1 || REPS > 64) return 2;

    char path[4096];
    snprintf(path, sizeof path, "%s/c_hit_model.bin", argv[1]);
    if (write_model(path) != 0) { perror("write model"); return 1; }

    int n = LAYERS * EXPERTS;
    ColiExpertSource *src = calloc((size_t)n, sizeof *src);
    if (!src) return 1;
    for (int l = 0; l < LAYERS; l++)
        for (int e = 0; e < EXPERTS; e++) {
            ColiExpertSource *x = &src[l * EXPERTS + e];
            x->layer = l;
            x->expert = e;
            x->gate = tensor(l, e, 0);
            x->up = tensor(l, e, 1);
            x->down = tensor(l, e, 2);
        }
    const char *files[1] = {path};
    ColiStoreConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.files = files;
    cfg.n_files = 1;
    cfg.experts = src;
    cfg.n_experts = n;
    cfg.slots_per_layer = (uint32_t)EXPERTS;
    cfg.prefetch_workers = 0;
    cfg.slot_wait_timeout_ns = -1;
    cfg.policy = policy;
    ColiExpertStore *store = NULL;
    char err[512];
    if (coli_store_create(&cfg, &store, err, sizeof err) != 0) {
        fprintf(stderr, "create: %s\n", err);
        return 1;
    }
    long fails = 0;
    for (int l = 0; l < LAYERS; l++)      /* load every expert: all later lookups hit */
        for (int e = 0; e < EXPERTS; e++) {
            ColiExpertView v;
            memset(&v, 0, sizeof v);
            if (coli_store_lookup(store, l, e, &v, err, sizeof err) != 0) {
                fprintf(stderr, "load: %s\n", err);
                return 1;
            }
            coli_expert_release(store, &v);
        }

    double mu[64], seq1[64], dir1[64], thr1[64], thr2[64], sc[64], ceil2[64];
    one_thread(store, 0, &fails);   /* warm up */
    for (int r = 0; r < REPS; r++) {  /* interleaved, so drift hits every figure alike */
        mu[r] = mutex_pair();
        seq1[r] = one_thread(store, 0, &fails);
        dir1[r] = one_thread(store, 1, &fails);
        thr1[r] = 1e9 / seq1[r];
        thr2[r] = LAYERS >= 2 ? two_threads(store, &fails) : 0.0;
        sc[r] = scatter(store, &fails);
        ceil2[r] = machine_ceiling();
    }
    ColiExpertStoreStats st;
    store->ops->stats(store, &st);
    double mu_m = median(mu, REPS), seq_m = median(seq1, REPS), seq_best = seq1[0];
    double dir_m = median(dir1, REPS), sc_m = median(sc, REPS);
    double thr1_m = median(thr1, REPS), thr1_best = thr1[REPS - 1];
    double thr2_m = median(thr2, REPS), thr2_best = thr2[REPS - 1];
    printf("{\"layers\": %d, \"experts\": %d, \"iters\": %ld, \"reps\": %d, \"tensor_bytes\": %zu, "
           "\"mutex_pair_ns\": %.2f, \"pair_ns\": %.2f, \"pair_ns_best\": %.2f, \"direct_pair_ns\": %.2f, "
           "\"scatter_pair_ns\": %.2f, \"thr1_per_s\": %.0f, \"thr1_best_per_s\": %.0f, "
           "\"thr2_per_s\": %.0f, \"thr2_best_per_s\": %.0f, "
           "\"machine_2t_ratio\": %.3f, "
           "\"failures\": %ld, \"hits\": %llu, \"misses\": %llu}\n",
           LAYERS, EXPERTS, ITERS, REPS, tensor_bytes(), mu_m, seq_m, seq_best, dir_m, sc_m,
           thr1_m, thr1_best, thr2_m, thr2_best, median(ceil2, REPS),
           fails, (unsigned long long)st.hits, (unsigned long long)st.misses);
    store->ops->destroy(store);
    free(src);
    remove(path);
    return fails ? 1 : 0;
}
