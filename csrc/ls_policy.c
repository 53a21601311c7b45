/*
 * ls_policy.c: the eviction policies behind the seam (LsPolicy in
 * ls_policy.h), and their names. The state machine calls them under the
 * layer mutex.
 *
 * LRU. As in SQLite's page cache, "leased" means "not in the set", so the
 * set is one list: a hit unlinks in O(1) and the victim is always the tail,
 * also O(1). The list is circular around a sentinel (the layer's `list`),
 * so linking never tests for NULL.
 *
 *      sentinel <-> MRU ... LRU <-> sentinel         (list.next is the MRU end)
 *
 * LFU. Each tenancy counts its uses (the load that brought it, if a lookup
 * asked for it, and every hit since); the victim has the fewest, and of
 * those the oldest last use (the layer's clock). Emptied and demoted slots
 * go first. A binary heap keyed on (uses, last use) serves it in O(log n);
 * a hit changes the key of a slot that is leaving the heap anyway, so the
 * hit path does no heap work. It is the seam's example of a policy with
 * per-slot state; it forgets an expert's count when it is evicted.
 *
 * LRFU (least recently/frequently used, after Lee et al.). Each expert of
 * the layer has a decayed use count: a use adds 1 / (1 + rank), rank being
 * the expert's place in its lookup_many (engines pass top-k best first, and
 * on real routing the best-ranked experts come back far more often), and
 * the count halves every `half` requests of the layer, linearly in between.
 * The count outlives an eviction, so an expert that comes back is known.
 * The victim is the evictable slot whose expert has the smallest count.
 *
 * Counts are kept scaled to a common time, S = count * g(now), with g
 * doubling every `half` requests: a use at time t adds w * g(t), and nothing
 * changes while an expert is not used, so the order of two slots changes
 * only when one of them is used, and the heap serves it: insert and remove
 * O(log n), victim O(1). g is 2^q * (1 + r / half) for now - base =
 * q * half + r; when q reaches 512 every count is multiplied by 2^-512
 * (exact, order kept) and base moves on. `half` is the policy parameter
 * (default 2) times the layer's slots: the counts forget over about two
 * turnovers of the cache (docs/policies.md has the study behind both
 * choices). A slot's pol_value is its key, pol_stamp its join sequence.
 * The heap is lazy: a leased slot stays in it, keyed as when it joined,
 * until it reaches the top (the victim search pops it) or joins again
 * (re-keyed in place: keys of a used expert only grow, so it sinks), so a
 * lease does no heap work and a release one sift. The victim is still the
 * least evictable slot. A prefetched slot joins as if used now, its count
 * unchanged; empty and demoted slots join with negative keys, evicted
 * first, the last one first, as LRU's cold end.
 *
 * COOC (co-occurrence). Routing has structure across steps: which experts a
 * token picks says something about which ones the next token picks. The
 * policy learns, per layer and online, how often expert b was asked in the
 * lookup right after one that asked a (follow[a][b]), and how often each
 * expert was asked at all (count), both decayed with a half-life of `half`
 * lookups (the policy parameter, default 64), kept scaled as LRFU's counts
 * are (g doubles every half; at 64 doublings everything is multiplied by
 * 2^-64). Recency still matters most, so the set is LRU's list, and the
 * victim is chosen among its m oldest slots, m = max(n_slots / 2, 2 x the
 * lookup's experts), at most COOC_CANDIDATES: the one whose expert is least
 * likely to follow the current lookup's experts S, by the score
 *
 *      sum over a in S of follow[a][x]  +  prior * g * |S| * count[x] / total
 *
 * (the second term, the expert's overall share, speaks for x where S has
 * little history; prior is 1). Ties go to the older slot. A cold slot (empty
 * or demoted) at the list's end goes first. Costs: a lookup of k experts
 * adds k x (previous lookup's k) to follow, O(k^2); a victim costs
 * O(m k); memory is n_entries^2 doubles per layer. docs/policies.md has the
 * study behind it.
 */
#include "ls_policy.h"

#include <stdlib.h>

#include "coli_store.h"   /* COLI_POLICY_*, coli_store_policy_name */

/* The list's operations (ls_list_*, ls_policy.h) are the state machine's,
 * inline: LRU only names the tail. */
static LsSlot *lru_victim(LsLayer *L) { return ls_list_tail(L); }

const LsPolicy ls_policy_lru = {
    .name = "lru",
    .keeps_list = true,
    .victim = lru_victim,
};

/* ---- heap ----------------------------------------------------------- */

static void heap_set(LsHeap *h, uint32_t i, LsSlot *v) {
    h->at[i] = v;
    v->pol_index = i;
}

static void sift_up(LsHeap *h, uint32_t i, LsLess less) {
    LsSlot *v = h->at[i];
    while (i > 0) {
        uint32_t parent = (i - 1) / 2;
        if (!less(v, h->at[parent])) break;
        heap_set(h, i, h->at[parent]);
        i = parent;
    }
    heap_set(h, i, v);
}

static void sift_down(LsHeap *h, uint32_t i, LsLess less) {
    LsSlot *v = h->at[i];
    for (;;) {
        uint32_t child = 2 * i + 1;
        if (child >= h->n) break;
        if (child + 1 < h->n && less(h->at[child + 1], h->at[child])) child++;
        if (!less(h->at[child], v)) break;
        heap_set(h, i, h->at[child]);
        i = child;
    }
    heap_set(h, i, v);
}

void ls_heap_push(LsHeap *h, LsSlot *v, LsLess less) {
    heap_set(h, h->n++, v);
    sift_up(h, h->n - 1, less);
}

void ls_heap_remove(LsHeap *h, LsSlot *v, LsLess less) {
    uint32_t i = v->pol_index;
    assert(i < h->n && h->at[i] == v);
    LsSlot *last = h->at[--h->n];
    if (last == v) return;
    heap_set(h, i, last);
    sift_down(h, i, less);
    sift_up(h, last->pol_index, less);
}

void ls_heap_update(LsHeap *h, LsSlot *v, LsLess less) {
    sift_down(h, v->pol_index, less);
    sift_up(h, v->pol_index, less);
}

/* ---- LFU ------------------------------------------------------------ */

static bool lfu_less(const LsSlot *a, const LsSlot *b) {
    return a->pol_value < b->pol_value || (a->pol_value == b->pol_value && a->pol_stamp < b->pol_stamp);
}

static int lfu_init(LsLayer *L, char *err, size_t n) {
    LsHeap *h = calloc(1, sizeof(LsHeap));
    if (h) h->at = calloc((size_t)L->n_slots, sizeof(LsSlot *));
    if (!h || !h->at) {
        free(h);
        return coli_fail(err, n, COLI_ENOMEM, "out of memory for the policy of layer %d", L->id);
    }
    L->pol = h;
    return COLI_OK;
}

static void lfu_fini(LsLayer *L) {
    LsHeap *h = L->pol;
    if (h) free(h->at);
    free(h);
    L->pol = NULL;
}

static void lfu_insert(LsLayer *L, LsSlot *v, bool cold) {
    if (cold) {               /* before every slot with a use: an empty or demoted slot */
        v->pol_value = -1.0;
        v->pol_stamp = L->clock;
    }
    ls_heap_push(L->pol, v, lfu_less);
}

static void lfu_remove(LsLayer *L, LsSlot *v) { ls_heap_remove(L->pol, v, lfu_less); }

static LsSlot *lfu_victim(LsLayer *L) {
    const LsHeap *h = L->pol;
    return h->n ? h->at[0] : NULL;
}

static void lfu_hit(LsLayer *L, LsSlot *v, int rank) {
    (void)rank;
    v->pol_value += 1.0;      /* v is leaving the heap (or is not in it): no sift */
    v->pol_stamp = L->clock;
}

static void lfu_assign(LsLayer *L, LsSlot *v, int rank) {
    v->pol_value = rank >= 0 ? 1.0 : 0.0;   /* a prefetch or a pin: no use yet */
    v->pol_stamp = L->clock;
}

const LsPolicy ls_policy_lfu = {
    .name = "lfu",
    .insert = lfu_insert,
    .remove = lfu_remove,
    .victim = lfu_victim,
    .hit = lfu_hit,
    .assign = lfu_assign,
    .init = lfu_init,
    .fini = lfu_fini,
};

/* ---- decayed counts, kept scaled ----------------------------------- */

/* Counts that halve every `half` ticks are kept scaled to a common time:
 * a use at tick t adds w * g(t), g doubling every half ticks, linearly in
 * between, so nothing changes while an expert is not used. g is
 * 2^q * (1 + r / half) for now - base = q * half + r. When q reaches
 * `limit`, shrink multiplies every count by 2^-limit (exact: order and
 * ratios kept) and base moves on. */
typedef struct {
    uint64_t half;                /* ticks per halving, >= 1 */
    uint64_t base;                /* tick of the last rescale */
    uint64_t q;                   /* whole half-lives from base, as of the last g */
    double pow;                   /* 2^q */
} LsGrowth;

static double growth_now(LsGrowth *d, uint64_t now, uint64_t limit, void (*shrink)(LsLayer *), LsLayer *L) {
    uint64_t t = now - d->base;
    while (t >= d->half * (d->q + 1)) {
        d->q++;
        d->pow *= 2.0;
        if (d->q == limit) {
            shrink(L);
            d->base += limit * d->half;
            d->q = 0;
            d->pow = 1.0;
            t = now - d->base;
        }
    }
    return d->pow * (1.0 + (double)(t - d->q * d->half) / (double)d->half);
}

/* ---- LRFU ----------------------------------------------------------- */

#define LRFU_RESCALE 512          /* q at which the counts are scaled by 2^-512 */
#define LRFU_OUT UINT32_MAX       /* pol_index of a slot not in the heap */

typedef struct {
    LsHeap heap;                  /* every evictable slot, and leased ones not popped yet */
    double *count;                /* indexed by expert: decayed use count, scaled */
    double *use;                  /* indexed by expert: weight of its uses since its slot last joined */
    LsGrowth growth;              /* ticks: requests of the layer */
    uint64_t seq;                 /* joins of the set so far */
} LsLrfu;

static int lrfu_init(LsLayer *L, char *err, size_t n) {
    double mult = L->pol_param > 0 ? L->pol_param : 2.0;
    if (!(mult <= 1e6))
        return coli_fail(err, n, COLI_ECONFIG, "lrfu: half-life multiple %g is out of range", mult);
    LsLrfu *p = calloc(1, sizeof(LsLrfu));
    if (p) {
        p->heap.at = calloc((size_t)L->n_slots, sizeof(LsSlot *));
        p->count = calloc((size_t)L->n_entries, sizeof(double));
        p->use = calloc((size_t)L->n_entries, sizeof(double));
    }
    if (!p || !p->heap.at || !p->count || !p->use) {
        if (p) {
            free(p->heap.at);
            free(p->count);
            free(p->use);
        }
        free(p);
        return coli_fail(err, n, COLI_ENOMEM, "out of memory for the policy of layer %d", L->id);
    }
    uint64_t half = (uint64_t)(mult * (double)L->n_slots + 0.5);   /* rounded: both are positive */
    p->growth.half = half < 1 ? 1 : half;
    p->growth.pow = 1.0;
    for (int j = 0; j < L->n_slots; j++) L->slots[j].pol_index = LRFU_OUT;
    L->pol = p;
    return COLI_OK;
}

static void lrfu_fini(LsLayer *L) {
    LsLrfu *p = L->pol;
    if (p) {
        free(p->heap.at);
        free(p->count);
        free(p->use);
    }
    free(p);
    L->pol = NULL;
}

/* Every count and key by 2^-512 (LRFU_RESCALE doublings). */
static void lrfu_shrink(LsLayer *L) {
    LsLrfu *p = L->pol;
    for (int x = 0; x < L->n_entries; x++) p->count[x] *= 0x1p-512;
    for (uint32_t i = 0; i < p->heap.n; i++)
        if (p->heap.at[i]->pol_value > 0) p->heap.at[i]->pol_value *= 0x1p-512;
}

static double lrfu_scale_now(LsLayer *L, LsLrfu *p) {
    return growth_now(&p->growth, L->c.requests, LRFU_RESCALE, lrfu_shrink, L);
}

static bool lrfu_less(const LsSlot *a, const LsSlot *b) {
    return a->pol_value < b->pol_value || (a->pol_value == b->pol_value && a->pol_stamp < b->pol_stamp);
}

static void lrfu_insert(LsLayer *L, LsSlot *v, bool cold) {
    LsLrfu *p = L->pol;
    v->pol_stamp = ++p->seq;
    if (cold) {
        v->pol_value = -(double)v->pol_stamp;   /* the latest cold slot first */
    } else {
        double g = lrfu_scale_now(L, p);
        double *c = &p->count[v->expert];
        double w = p->use[v->expert];
        p->use[v->expert] = 0;
        if (w > 0) {
            *c += w * g;
            v->pol_value = *c;
        } else {
            v->pol_value = *c + g;            /* loaded unasked: as if used now, uncounted */
        }
    }
    if (v->pol_index == LRFU_OUT) ls_heap_push(&p->heap, v, lrfu_less);
    else ls_heap_update(&p->heap, v, lrfu_less);   /* still there from before its lease */
}

/* Lazy: a slot leaving the set stays in the heap with its key until it
 * reaches the top (victim pops it) or joins again (insert re-keys it), so
 * a lease does no heap work. */
static void lrfu_remove(LsLayer *L, LsSlot *v) {
    (void)L;
    (void)v;
}

static LsSlot *lrfu_victim(LsLayer *L) {
    LsLrfu *p = L->pol;
    while (p->heap.n > 0 && !p->heap.at[0]->evictable) {
        LsSlot *top = p->heap.at[0];
        ls_heap_remove(&p->heap, top, lrfu_less);
        top->pol_index = LRFU_OUT;
    }
    return p->heap.n ? p->heap.at[0] : NULL;
}

static void lrfu_hit(LsLayer *L, LsSlot *v, int rank) {
    LsLrfu *p = L->pol;
    p->use[v->expert] += 1.0 / (double)(1 + rank);
}

static void lrfu_assign(LsLayer *L, LsSlot *v, int rank) {
    LsLrfu *p = L->pol;
    p->use[v->expert] = rank >= 0 ? 1.0 / (double)(1 + rank) : 0.0;   /* a prefetch or a pin: no use */
}

const LsPolicy ls_policy_lrfu = {
    .name = "lrfu",
    .insert = lrfu_insert,
    .remove = lrfu_remove,
    .victim = lrfu_victim,
    .hit = lrfu_hit,
    .assign = lrfu_assign,
    .init = lrfu_init,
    .fini = lrfu_fini,
};

/* ---- COOC ----------------------------------------------------------- */

#define COOC_RESCALE 64           /* q at which everything is scaled by 2^-64 */
#define COOC_CANDIDATES 64        /* the most slots a victim search looks at */
#define COOC_PRIOR 1.0            /* weight of an expert's overall share in its score */

typedef struct {
    double *follow;               /* n_entries^2: [a * n_entries + b], scaled */
    double *count;                /* n_entries: uses, scaled */
    double total;                 /* sum of count */
    int *cur, *prev;              /* this lookup's and the previous one's distinct experts (n_slots places) */
    int n_cur, n_prev;
    double g;                     /* the scale of the last step */
    uint64_t steps;               /* lookups of the layer */
    LsGrowth growth;              /* ticks: steps */
} LsCooc;

static void cooc_free(LsCooc *p) {
    if (!p) return;
    free(p->follow);
    free(p->count);
    free(p->cur);
    free(p->prev);
    free(p);
}

static int cooc_init(LsLayer *L, char *err, size_t n) {
    double half = L->pol_param > 0 ? L->pol_param : 64.0;
    if (!(half <= 1e12))
        return coli_fail(err, n, COLI_ECONFIG, "cooc: half-life of %g lookups is out of range", half);
    size_t e = (size_t)L->n_entries;
    LsCooc *p = calloc(1, sizeof(LsCooc));
    if (p) {
        p->follow = e <= SIZE_MAX / sizeof(double) / (e ? e : 1) ? calloc(e * e, sizeof(double)) : NULL;
        p->count = calloc(e, sizeof(double));
        p->cur = calloc((size_t)L->n_slots, sizeof(int));
        p->prev = calloc((size_t)L->n_slots, sizeof(int));
    }
    if (!p || !p->follow || !p->count || !p->cur || !p->prev) {
        cooc_free(p);
        return coli_fail(err, n, COLI_ENOMEM, "out of memory for the cooc policy of layer %d (%zu x %zu counts)",
                         L->id, e, e);
    }
    uint64_t h = (uint64_t)(half + 0.5);
    p->growth.half = h < 1 ? 1 : h;
    p->growth.pow = 1.0;
    p->g = 1.0;
    L->pol = p;
    return COLI_OK;
}

static void cooc_fini(LsLayer *L) {
    cooc_free(L->pol);
    L->pol = NULL;
}

/* Everything learnt by 2^-64 (COOC_RESCALE doublings). */
static void cooc_shrink(LsLayer *L) {
    LsCooc *p = L->pol;
    size_t e = (size_t)L->n_entries;
    for (size_t i = 0; i < e * e; i++) p->follow[i] *= 0x1p-64;
    for (size_t i = 0; i < e; i++) p->count[i] *= 0x1p-64;
    p->total *= 0x1p-64;
}

static void cooc_step(LsLayer *L, const int *experts, int count) {
    LsCooc *p = L->pol;
    int *swap = p->prev;
    p->prev = p->cur;
    p->n_prev = p->n_cur;
    p->cur = swap;
    p->n_cur = 0;
    for (int i = 0; i < count; i++) {
        bool seen = false;
        for (int j = 0; j < p->n_cur && !seen; j++) seen = p->cur[j] == experts[i];
        if (!seen && p->n_cur < L->n_slots) p->cur[p->n_cur++] = experts[i];
    }
    p->steps++;
    double g = growth_now(&p->growth, p->steps, COOC_RESCALE, cooc_shrink, L);
    size_t e = (size_t)L->n_entries;
    for (int i = 0; i < p->n_prev; i++) {
        int a = p->prev[i];
        double *row = p->follow + (size_t)a * e;
        for (int j = 0; j < p->n_cur; j++) row[p->cur[j]] += g;
    }
    for (int j = 0; j < p->n_cur; j++) p->count[p->cur[j]] += g;
    p->total += g * (double)p->n_cur;
    p->g = g;
}

/* The list is the state machine's; cooc marks a slot that joins it cold
 * (pol_value 1), for the victim search. */
static void cooc_insert(LsLayer *L, LsSlot *v, bool cold) {
    (void)L;
    v->pol_value = cold;
}

static LsSlot *cooc_victim(LsLayer *L) {
    LsCooc *p = L->pol;
    LsSlot *v = ls_list_tail(L);
    if (!v) return NULL;
    if (v->pol_value != 0.0) return v;        /* cold: empty or demoted */
    int m = L->n_slots / 2;
    if (m < 2 * p->n_cur) m = 2 * p->n_cur;
    if (m > COOC_CANDIDATES) m = COOC_CANDIDATES;
    double c = p->total > 0 ? COOC_PRIOR * p->g * (double)p->n_cur / p->total : 0.0;
    size_t e = (size_t)L->n_entries;
    LsSlot *best = NULL;
    double best_score = 0.0;
    for (int i = 0; i < m && v != &L->list; i++, v = v->prev) {
        int x = v->expert;
        double score = 0.0;
        for (int j = 0; j < p->n_cur; j++) score += p->follow[(size_t)p->cur[j] * e + (size_t)x];
        score += c * p->count[x];
        if (!best || score < best_score) {
            best = v;
            best_score = score;
        }
    }
    return best;
}

const LsPolicy ls_policy_cooc = {
    .name = "cooc",
    .keeps_list = true,
    .insert = cooc_insert,
    .victim = cooc_victim,
    .step = cooc_step,
    .init = cooc_init,
    .fini = cooc_fini,
};

const LsPolicy *const ls_policies[] = {
    [COLI_POLICY_LRU] = &ls_policy_lru,
    [COLI_POLICY_LFU] = &ls_policy_lfu,
    [COLI_POLICY_LRFU] = &ls_policy_lrfu,
    [COLI_POLICY_COOC] = &ls_policy_cooc,
    NULL,
};

const char *coli_store_policy_name(int policy) {
    for (int i = 0; ls_policies[i]; i++)
        if (i == policy) return ls_policies[i]->name;
    return NULL;
}
