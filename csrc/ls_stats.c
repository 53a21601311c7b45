/*
 * ls_stats.c: the store's counters and facts: stats of the store and of a
 * layer, requests per expert, the pinned experts, the leases held, and
 * where an expert's parts lie in its slot. Each takes its layer's mutex
 * (parts excepted: plans are fixed at creation).
 */
#include "ls_internal.h"

void ls_add_layer_stats(LsLayer *L, ColiExpertStoreStats *out) {
    pthread_mutex_lock(&L->mu);
    out->requests += L->c.requests;
    out->hits += L->c.hits;
    out->misses += L->c.misses;
    out->prefetched += L->c.prefetched;
    out->prefetch_hits += L->c.prefetch_hits;
    out->bytes_read += L->c.bytes_read;
    out->resident_bytes += L->resident_bytes;
    out->capacity_bytes += (uint64_t)L->n_slots * L->slot_bytes;
    out->inflight_joins += L->c.inflight_joins;
    out->loads_started += L->c.loads_started;
    out->loads_failed += L->c.loads_failed;
    out->evictions += L->c.evictions;
    out->slot_waits += L->c.slot_waits;
    out->persistent_hits += L->c.persistent_hits;
    out->transient_hits += L->c.hits - L->c.persistent_hits;
    pthread_mutex_unlock(&L->mu);
}

void ls_stats_op(ColiExpertStore *store, ColiExpertStoreStats *out) {
    LsStore *s = store->state;   /* reached through ls_ops: a store of ours */
    if (!out) return;
    memset(out, 0, sizeof(*out));
    for (int i = 0; i < s->n_layers; i++) ls_add_layer_stats(&s->layers[i], out);
    out->peak_inflight = atomic_load(&s->peak_inflight);
}

uint64_t ls_active_leases(LsStore *s) {
    uint64_t total = 0;
    for (int i = 0; i < s->n_layers; i++) {
        pthread_mutex_lock(&s->layers[i].mu);
        total += s->layers[i].leases;
        pthread_mutex_unlock(&s->layers[i].mu);
    }
    return total;
}

int ls_expert_requests(LsLayer *L, uint64_t *out, int n) {
    pthread_mutex_lock(&L->mu);
    for (int e = 0; out && e < n && e < L->n_entries; e++) out[e] = L->requests_of[e];
    pthread_mutex_unlock(&L->mu);
    return L->n_entries;
}

int ls_pinned(LsStore *s, ColiExpertKey *out, int n) {
    int total = 0;
    for (int i = 0; i < s->n_layers; i++) {
        LsLayer *L = &s->layers[i];
        pthread_mutex_lock(&L->mu);
        for (int e = 0; e < L->n_entries; e++) {   /* by expert: the order the header promises */
            const LsSlot *v = L->slot_of[e];
            if (!v || !v->pinned) continue;
            if (out && total < n) out[total] = (ColiExpertKey){L->id, e};
            total++;
        }
        pthread_mutex_unlock(&L->mu);
    }
    return total;
}

int ls_expert_parts(const LsEntry *e, uint64_t *out, int cap) {
    bool fused = (e->src.flags & COLI_SOURCE_FUSED_GATE_UP) != 0;
    const ColiTensorSource *t[3] = {&e->src.gate, &e->src.up, &e->src.down};
    int total = COLI_ROLE_PARTS + e->plan.n_parts;
    for (int i = 0; i < total && i < cap; i++) {
        if (i < 3) out[i] = i == 1 && fused ? UINT64_MAX : e->plan.data_at[i];
        else if (i < COLI_ROLE_PARTS) out[i] = t[i - 3]->scale_format == COLI_SCALE_NONE
                                                   ? UINT64_MAX : e->plan.scales_at[i - 3];
        else out[i] = e->plan.part_at[i - COLI_ROLE_PARTS];
    }
    return total;
}
