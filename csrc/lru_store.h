/*
 * lru_store.h: the store's names from before it was renamed to coli_store.h
 * (the store has several eviction policies, not only LRU). They stay for
 * one release as aliases of the new names; include coli_store.h and use
 * those instead.
 *
 * build_ffi.py reads the #define lines below, so the Python binding's lib
 * answers to the old names too.
 */
#ifndef COLI_LRU_STORE_H
#define COLI_LRU_STORE_H

#include "coli_store.h"

typedef ColiStoreConfig ColiLruConfig;

#define coli_lru_store_create coli_store_create
#define coli_lru_lookup coli_store_lookup
#define coli_lru_lookup_many coli_store_lookup_many
#define coli_lru_lookup_resident coli_store_lookup_resident
#define coli_lru_close coli_store_close
#define coli_lru_retire_prefetches coli_store_retire_prefetches
#define coli_lru_wait_idle coli_store_wait_idle
#define coli_lru_expert_parts coli_store_expert_parts
#define coli_lru_prefetch_pauses coli_store_prefetch_pauses
#define coli_lru_active_leases coli_store_active_leases
#define coli_lru_layer_slots coli_store_layer_slots
#define coli_lru_direct_io_fallback coli_store_direct_io_fallback
#define coli_lru_policy_name coli_store_policy_name
#define coli_lru_replay coli_store_replay
#define coli_lru_layer_stats coli_store_layer_stats
#define coli_lru_expert_requests coli_store_expert_requests
#define coli_lru_pinned coli_store_pinned

#endif /* COLI_LRU_STORE_H */
