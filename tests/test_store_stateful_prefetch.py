"""A model-based state machine over the whole Python API with prefetch on.

Each example opens one of several models (layouts, dtypes, shard counts,
layer and expert counts differ) with a random budget and number of I/O workers,
then interleaves leases, lease_many, releases, prefetches, waits for idle,
misuse (use after release, release twice, close while leased) and a final
close. With asynchronous loads the exact hit/miss sequence is not
deterministic, so the model tracks what must hold whatever the timing: which
leases are held and their bytes, and the counter invariants of docs/contract.md ("Stats").
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

import colibri
from conftest import expected_experts

pytestmark = pytest.mark.filterwarnings("error::ResourceWarning")


def make_machine(models):
    wants = [expected_experts(m) for m in models]

    class PrefetchMachine(RuleBasedStateMachine):
        leases = Bundle("leases")

        def __init__(self) -> None:
            super().__init__()
            self.store: colibri.Store | None = None
            self.held: list[colibri.ExpertLease] = []
            self.closed = False
            self.failed_requests = 0   # lookups refused as cache full: requests, not hits or misses
            self.started_reads = 0     # loads start_reads queued

        @initialize(m=st.integers(0, len(models) - 1), slots=st.integers(1, 4), workers=st.integers(0, 3),
                    demand_first=st.booleans(), policy=st.sampled_from(colibri.POLICIES))
        def open(self, m: int, slots: int, workers: int, demand_first: bool, policy: str) -> None:
            model = models[m]
            self.want = wants[m]
            self.layers, self.n_experts = model.layers, model.n_experts
            self.store = colibri.open_store(model.path, slots_per_layer=slots, prefetch_workers=workers,
                                            slot_wait_timeout=0.0, demand_first=demand_first, policy=policy)
            self.demand_first = demand_first
            assert self.store.layers == self.layers
            self.slots = min(slots, self.n_experts)
            self.workers = workers

        def key(self, li: int, ei: int) -> tuple[int, int]:
            """Maps raw draws onto the chosen model's keys."""
            return self.layers[li % len(self.layers)], ei % self.n_experts

        def check(self, ex: colibri.ExpertLease) -> None:
            expect = self.want[(ex.layer, ex.expert)]
            for role in ("gate", "up", "down"):
                assert getattr(ex, role).tobytes() == expect[role].tobytes(), (ex, role)

        def held_in(self, layer: int) -> set[int]:
            return {ex.expert for ex in self.held if ex.layer == layer}

        @precondition(lambda self: not self.closed)
        @rule(target=leases, li=st.integers(0, 63), ei=st.integers(0, 63))
        def lease(self, li: int, ei: int):
            layer, expert = self.key(li, ei)
            held = self.held_in(layer)
            if expert not in held and len(held) >= self.slots:
                with pytest.raises(colibri.CacheFullError):
                    self.store.lease(layer, expert)
                self.failed_requests += 1
                return None
            ex = self.store.lease(layer, expert)
            self.check(ex)
            self.held.append(ex)
            return ex

        @precondition(lambda self: not self.closed)
        @rule(li=st.integers(0, 63), eis=st.lists(st.integers(0, 63), min_size=1, max_size=3))
        def lease_many_and_release(self, li: int, eis: list[int]) -> None:
            layer = self.key(li, 0)[0]
            experts = [self.key(li, e)[1] for e in eis]
            need = self.held_in(layer) | set(experts)
            if len(need) > self.slots:
                before = self.store.active_leases
                with pytest.raises(colibri.CacheFullError):
                    self.store.lease_many(layer, experts)
                assert self.store.active_leases == before  # all or nothing
                # More distinct experts than slots is refused before any lookup.
                self.failed_requests += len(experts) if len(set(experts)) <= self.slots else 0
                return
            with self.store.lease_many(layer, experts) as group:
                assert [ex.expert for ex in group] == experts
                for ex in group:
                    self.check(ex)

        @precondition(lambda self: not self.closed)
        @rule(ex=consumes(leases))
        def release(self, ex) -> None:
            if ex is None:
                return
            self.check(ex)
            ex.release()
            self.held.remove(ex)
            with pytest.raises(colibri.LeaseError):
                ex.gate
            with pytest.raises(colibri.LeaseError):
                ex.release()

        @precondition(lambda self: not self.closed)
        @rule(raw=st.lists(st.tuples(st.integers(-1, 63), st.integers(-1, 63), st.booleans()), max_size=6))
        def prefetch(self, raw: list[tuple[int, int, bool]]) -> None:
            # Mostly valid keys, some out of range (negative, unknown layer, expert past the end).
            keys = [self.key(li, ei) if ok and li >= 0 and ei >= 0 else (li, ei) for li, ei, ok in raw]
            before = self.store.stats()
            accepted = self.store.prefetch(keys)
            after = self.store.stats()
            valid = [k for k in keys if k[0] in self.layers and 0 <= k[1] < self.n_experts]
            assert 0 <= accepted <= len(valid)
            if self.workers == 0:
                assert accepted == 0
            assert after.prefetched - before.prefetched == accepted

        @precondition(lambda self: not self.closed)
        @rule(li=st.integers(0, 63), eis=st.lists(st.integers(0, 63), max_size=4))
        def start_reads(self, li: int, eis: list[int]) -> None:
            layer = self.key(li, 0)[0]
            before = self.store.stats()
            started = self.store.start_reads(layer, [self.key(li, e)[1] for e in eis])
            after = self.store.stats()
            assert 0 <= started <= len(set(eis)) and (self.workers > 0 or started == 0)
            assert after.prefetched == before.prefetched and after.requests == before.requests
            self.started_reads += started

        @precondition(lambda self: not self.closed)
        @rule(li=st.integers(0, 63), eis=st.lists(st.integers(0, 63), min_size=1, max_size=4))
        def lease_hits_then_the_rest(self, li: int, eis: list[int]) -> None:
            layer = self.key(li, 0)[0]
            experts = list(dict.fromkeys(self.key(li, e)[1] for e in eis))
            before = self.store.stats()
            with self.store.lease_hits(layer, experts) as hits:
                got = [ex.expert for ex in hits]
                assert got == [e for e in experts if e in got]      # in the order asked
                for ex in hits:
                    self.check(ex)
                assert self.store.stats().requests - before.requests == len(hits)
            rest = [e for e in experts if e not in got]
            if rest and len(self.held_in(layer) | set(rest)) <= self.slots:
                self.started_reads += self.store.start_reads(layer, rest)
                with self.store.lease_many(layer, rest) as group:
                    for ex in group:
                        self.check(ex)

        @precondition(lambda self: not self.closed)
        @rule(li=st.integers(0, 63), eis=st.lists(st.integers(0, 63), max_size=3))
        def retire_prefetches(self, li: int, eis: list[int]) -> None:
            layer = self.key(li, 0)[0]
            retired = self.store.retire_prefetches(layer, [self.key(li, e)[1] for e in eis])
            assert 0 <= retired <= self.slots
            for ex in self.held:   # retiring never touches a leased slot
                self.check(ex)

        @precondition(lambda self: not self.closed)
        @rule()
        def wait_idle(self) -> None:
            self.store.wait_idle(timeout=30)
            s = self.store.stats()
            # every load has ended; start_reads' loads count as misses once leased
            assert 0 <= s.loads_started - s.misses - s.prefetched <= self.started_reads
            for ex in self.held:
                self.check(ex)

        @precondition(lambda self: not self.closed and bool(self.held))
        @rule()
        def close_while_leased_is_refused(self) -> None:
            with pytest.raises(colibri.LeaseError):
                self.store.close()
            assert not self.store.closed

        @precondition(lambda self: not self.closed)
        @rule()
        def close(self) -> None:
            for ex in self.held:
                ex.release()
            self.held.clear()
            self.store.close()
            self.closed = True

        @precondition(lambda self: self.closed)
        @rule(li=st.integers(0, 63), ei=st.integers(0, 63))
        def calls_after_close_raise(self, li: int, ei: int) -> None:
            layer, expert = self.key(li, ei)
            for call in (lambda: self.store.lease(layer, expert),
                         lambda: self.store.lease_many(layer, [expert]),
                         lambda: self.store.prefetch([(layer, expert)]),
                         lambda: self.store.start_reads(layer, [expert]),
                         lambda: self.store.lease_hits(layer, [expert]),
                         lambda: self.store.wait_idle(),
                         lambda: self.store.stats(),
                         lambda: self.store.active_leases):
                with pytest.raises(colibri.StoreClosedError):
                    call()
            self.store.close()  # a second close does nothing

        @invariant()
        def counters_hold(self) -> None:
            if self.store is None or self.closed:
                return
            s = self.store.stats()
            assert s.resident_bytes <= s.capacity_bytes
            assert s.prefetch_hits <= s.prefetched
            assert s.requests == s.hits + s.misses + self.failed_requests
            assert s.loads_failed == 0
            assert self.store.active_leases == len(self.held)
            if not self.demand_first or self.workers == 0:
                assert s.prefetch_pauses == 0

        @invariant()
        def held_bytes_unchanged(self) -> None:
            for ex in self.held:
                self.check(ex)

        def teardown(self) -> None:
            if self.store is not None and not self.closed:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ResourceWarning)
                    for ex in self.held:
                        ex.release()
                self.store.close()

    return PrefetchMachine


def test_prefetch_state_machine(tiny_model, model_factory):
    models = [
        tiny_model,
        model_factory(layout="mixtral", n_layers=3, n_experts=5, hidden=24, intermediate=8, dtype="bfloat16"),
        model_factory(layout="mlp_experts", n_layers=5, n_experts=3, hidden=8, intermediate=16,
                      dtype="float16", dense_layers=1, shards=3, shared_experts=True),
    ]
    make_machine(models).TestCase().runTest()
