"""A hypothesis state machine over one store: leases held across steps.

The machine keeps a model of every lease it holds (single leases and
lease_many groups) and of each layer's LRU (resident experts, their lease
counts, the order of unleased slots by last release). After every step it
checks that:

* ``resident_bytes <= capacity_bytes`` and ``hits + misses <= requests``
  (equality while no lookup has failed), counters never go backwards;
* ``store.active_leases`` equals the number of leases the model holds;
* every held lease's arrays still hold exactly the file's bytes, so no leased
  expert was evicted or overwritten;
* while the model of a layer is exact, hit/miss of each lookup, evictions and
  ``resident_bytes`` are as predicted.

A lookup fails with CacheFullError exactly when every slot of its layer is
held by other experts (slot_wait_timeout is tiny). Steps print as calls with
plain integer arguments, so a failure replays as a program.

The same machine runs with pinned experts: they hold slots of their layer
for good (lookups of other experts find fewer slots), every lookup of one is
a hit counted as persistent, they are never evicted, and store.pinned lists
them throughout. And with a warm start beside the pins: the warm experts are
resident at open, unleased, the last of each layer's list the most recent
(loaded in order: no workers), and evicted like any other.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import colibri
from conftest import ROLES, expected_experts

SLOTS = 3
MONOTONIC = (
    "requests", "hits", "misses", "prefetched", "prefetch_hits", "bytes_read",
    "persistent_hits", "transient_hits", "inflight_joins", "loads_started",
    "loads_failed", "evictions", "slot_waits", "peak_inflight",
)


class LayerModel:
    """One layer's LRU: resident experts with lease counts, unleased ones by
    last release; pinned experts are resident from the start and never on
    the LRU list."""

    def __init__(self, slots: int, pinned: frozenset = frozenset(), warm: tuple = ()):
        self.slots = slots
        self.pinned = pinned
        self.refs: dict[int, int] = {e: 0 for e in pinned}  # resident expert -> leases held
        self.lru: OrderedDict = OrderedDict()   # unleased resident experts, LRU first
        for e in warm[len(warm) - (slots - len(pinned)):] if len(warm) > slots - len(pinned) else warm:
            self.refs[e] = 0
            self.lru[e] = None
        self.evictions = 0
        self.exact = True                       # False once an outcome was left unspecified

    def copy(self) -> "LayerModel":
        other = LayerModel(self.slots, self.pinned)
        other.refs = dict(self.refs)
        other.lru = OrderedDict(self.lru)
        other.evictions = self.evictions
        other.exact = self.exact
        return other

    def lookup(self, expert: int) -> str:
        """Applies one lookup; returns "hit", "miss" or "full" (nothing changed)."""
        if expert in self.refs:
            self.refs[expert] += 1
            self.lru.pop(expert, None)
            return "hit"
        if len(self.refs) >= self.slots:
            if not self.lru:
                return "full"
            victim, _ = self.lru.popitem(last=False)
            del self.refs[victim]
            self.evictions += 1
        self.refs[expert] = 1
        return "miss"

    def release(self, expert: int) -> None:
        self.refs[expert] -= 1
        if self.refs[expert] == 0 and expert not in self.pinned:
            self.lru[expert] = None  # most recently used as of this release


class StoreMachine(RuleBasedStateMachine):
    model = None  # a SyntheticModel, set by the test function
    pins: tuple = ()  # (layer, expert) pinned at open
    warm: tuple = ()  # (layer, expert) warm at open, loaded in order (no workers then)

    def __init__(self):
        super().__init__()
        self.store = colibri.open_store(self.model.path, slots_per_layer=SLOTS, slot_wait_timeout=0.01,
                                        pin=self.pins, warm=self.warm,
                                        prefetch_workers=0 if self.warm else 2)
        self.store.wait_idle()  # pins load in the background
        self.want = expected_experts(self.model)
        self.singles: list = []   # single leases held
        self.groups: list = []    # (context manager, tuple of leases) of lease_many
        self.released: list = []  # leases released already
        self.layers = {layer: LayerModel(SLOTS, self.pinned(layer), tuple(e for la, e in self.warm if la == layer))
                       for layer in self.model.layers}
        self.failed_lookups = 0
        self.pinned_lookups = 0
        self.last = self.store.stats()

    # -- model helpers -----------------------------------------------------

    def held_leases(self):
        yield from self.singles
        for _, exs in self.groups:
            yield from exs

    def held_experts(self, layer: int) -> set[int]:
        return {ex.expert for ex in self.held_leases() if ex.layer == layer}

    def pinned(self, layer: int) -> frozenset:
        return frozenset(e for la, e in self.pins if la == layer)

    def fits(self, layer: int, experts) -> bool:
        """Whether these experts, with those held, fit the layer's slots:
        pinned ones in their own, the others in the rest."""
        pinned = self.pinned(layer)
        return len((self.held_experts(layer) | set(experts)) - pinned) <= SLOTS - len(pinned)

    def count_pinned(self, layer: int, experts) -> None:
        self.pinned_lookups += sum(e in self.pinned(layer) for e in experts)

    def check_bytes(self, ex) -> None:
        want = self.want[ex.key]
        for role in ROLES:
            a = getattr(ex, role)
            assert a.tobytes() == want[role].tobytes(), f"{role} of held lease {ex.key} changed"
            del a

    # -- rules ---------------------------------------------------------------

    @rule(layer=st.sampled_from([1, 2]), expert=st.integers(0, 5))
    def lease(self, layer, expert):
        lm = self.layers[layer]
        before = self.store.stats()
        full = not self.fits(layer, [expert])
        if full:
            with pytest.raises(colibri.CacheFullError):
                self.store.lease(layer, expert)
            self.failed_lookups += 1
            after = self.store.stats()
            assert after.slot_waits - before.slot_waits == 1
            assert (after.hits, after.misses, after.evictions) == (before.hits, before.misses, before.evictions)
            assert lm.lookup(expert) == "full"  # the model holds the same leases: no change
            return
        ex = self.store.lease(layer, expert)
        self.singles.append(ex)
        assert ex.key == (layer, expert)
        self.check_bytes(ex)
        self.count_pinned(layer, [expert])
        outcome = lm.lookup(expert)
        after = self.store.stats()
        if lm.exact:
            assert outcome != "full"
            assert after.hits - before.hits == (outcome == "hit"), (layer, expert, outcome)
            assert after.misses - before.misses == (outcome == "miss"), (layer, expert, outcome)
        assert after.requests - before.requests == 1

    @rule(layer=st.sampled_from([1, 2]), expert=st.integers(0, 5))
    def lease_in_with_block(self, layer, expert):
        if not self.fits(layer, [expert]):
            return  # the lease rule covers the full case
        lm = self.layers[layer]
        before = self.store.stats()
        active = self.store.active_leases
        with self.store.lease(layer, expert) as ex:
            self.check_bytes(ex)
            assert self.store.active_leases == active + 1
        assert ex.released
        assert self.store.active_leases == active
        self.count_pinned(layer, [expert])
        outcome = lm.lookup(expert)
        lm.release(expert)
        after = self.store.stats()
        if lm.exact:
            assert after.hits - before.hits == (outcome == "hit"), (layer, expert, outcome)

    @rule(layer=st.sampled_from([1, 2]), experts=st.lists(st.integers(0, 5), min_size=1, max_size=SLOTS + 1))
    def lease_many(self, layer, experts):
        lm = self.layers[layer]
        active = self.store.active_leases
        before = self.store.stats()
        fits = self.fits(layer, experts)
        if not fits:
            with pytest.raises(colibri.CacheFullError):
                cm = self.store.lease_many(layer, experts)
                cm.__enter__()
            self.failed_lookups += len(experts)
            assert self.store.active_leases == active, "a failed lease_many left leases held"
            # Which experts a failed lease_many loaded or evicted is unspecified.
            lm.exact = False
            return
        cm = self.store.lease_many(layer, experts)
        exs = cm.__enter__()
        self.groups.append((cm, exs))
        assert [ex.key for ex in exs] == [(layer, e) for e in experts]
        for ex in exs:
            self.check_bytes(ex)
        self.count_pinned(layer, experts)
        # Lookups in the given order, or hits taken first: predict only where both agree.
        seq, early = lm.copy(), lm.copy()
        seq_out = [seq.lookup(e) for e in experts]
        hits_first = [e for e in experts if e in early.refs]
        early_out = [early.lookup(e) for e in hits_first] + [early.lookup(e) for e in experts if e not in hits_first]
        after = self.store.stats()
        assert after.requests - before.requests == len(experts)
        if seq.exact and sorted(seq_out) == sorted(early_out) and seq.refs == early.refs and seq.lru == early.lru:
            assert after.hits - before.hits == seq_out.count("hit")
            assert after.misses - before.misses == seq_out.count("miss")
            self.layers[layer] = seq
        else:
            seq.exact = False
            self.layers[layer] = seq

    @precondition(lambda self: self.singles)
    @rule(i=st.integers(0, 10**6))
    def release(self, i):
        ex = self.singles.pop(i % len(self.singles))
        self.check_bytes(ex)
        ex.release()
        assert ex.released
        self.layers[ex.layer].release(ex.expert)
        self.released.append(ex)
        del self.released[:-8]

    @precondition(lambda self: self.groups)
    @rule(i=st.integers(0, 10**6))
    def release_group(self, i):
        cm, exs = self.groups.pop(i % len(self.groups))
        cm.__exit__(None, None, None)
        for ex in exs:
            assert ex.released
            self.layers[ex.layer].release(ex.expert)
        self.released.extend(exs)
        del self.released[:-8]

    @precondition(lambda self: self.released)
    @rule(i=st.integers(0, 10**6))
    def release_twice(self, i):
        ex = self.released[i % len(self.released)]
        active = self.store.active_leases
        before = self.store.stats()
        with pytest.raises(colibri.LeaseError):
            ex.release()
        with pytest.raises(colibri.LeaseError):
            ex.gate  # noqa: B018
        assert ex.released
        assert self.store.active_leases == active
        assert self.store.stats() == before

    def room(self, layer: int) -> int:
        """Slots of layer neither pinned nor leased."""
        pinned = self.pinned(layer)
        return SLOTS - len(pinned) - len(self.held_experts(layer) - pinned)

    @precondition(lambda self: any(self.room(layer) > 0 for layer in self.layers))
    @rule(data=st.data())
    def fill_layer_then_cache_full(self, data):
        layer = data.draw(st.sampled_from([la for la in sorted(self.layers) if self.room(la) > 0]))
        lm = self.layers[layer]
        free = [e for e in range(self.model.n_experts)
                if e not in self.held_experts(layer) and e not in self.pinned(layer)]
        need = self.room(layer)
        for expert in free[:need]:
            before = self.store.stats()
            ex = self.store.lease(layer, expert)
            self.singles.append(ex)
            self.check_bytes(ex)
            outcome = lm.lookup(expert)
            if lm.exact:
                assert self.store.stats().hits - before.hits == (outcome == "hit")
        other = free[need]
        before = self.store.stats()
        with pytest.raises(colibri.CacheFullError):
            self.store.lease(layer, other)
        self.failed_lookups += 1
        after = self.store.stats()
        assert after.slot_waits - before.slot_waits == 1
        assert after.evictions == before.evictions

    @rule()
    def stats_are_consistent(self):
        s = self.store.stats()
        assert s.hit_rate == pytest.approx(s.hits / s.requests if s.requests else s.hit_rate)
        assert s.transient_hits + s.persistent_hits == s.hits
        assert s.prefetched == 0 and s.prefetch_hits == 0

    # -- invariants ------------------------------------------------------------

    @invariant()
    def counters(self):
        s = self.store.stats()
        assert s.resident_bytes <= s.capacity_bytes
        assert s.hits + s.misses <= s.requests <= s.hits + s.misses + self.failed_lookups
        if self.failed_lookups == 0:
            assert s.requests == s.hits + s.misses
        for name in MONOTONIC:
            assert getattr(s, name) >= getattr(self.last, name), f"{name} went backwards"
        assert s.loads_failed == 0
        self.last = s
        if all(lm.exact for lm in self.layers.values()):
            assert s.evictions == sum(lm.evictions for lm in self.layers.values())
            resident = sum(len(lm.refs) for lm in self.layers.values())
            assert s.resident_bytes == resident * self.model.expert_nbytes

    @invariant()
    def pins_stay(self):
        s = self.store.stats()
        assert s.persistent_hits == self.pinned_lookups
        assert s.transient_hits + s.persistent_hits == s.hits
        assert self.store.pinned == tuple(sorted(self.pins))
        for layer, lm in self.layers.items():
            assert lm.pinned <= set(lm.refs)  # the model never evicts them either

    @invariant()
    def leases_are_counted(self):
        assert self.store.active_leases == sum(1 for _ in self.held_leases())

    @invariant()
    def held_leases_keep_their_bytes(self):
        for ex in self.held_leases():
            assert not ex.released
            self.check_bytes(ex)

    def teardown(self):
        for ex in self.singles:
            ex.release()
        for cm, _ in self.groups:
            cm.__exit__(None, None, None)
        self.singles.clear()
        self.groups.clear()
        assert self.store.active_leases == 0
        self.store.close()
        assert self.store.closed


def test_store_state_machine(tiny_model):
    class Machine(StoreMachine):
        model = tiny_model

    run_state_machine_as_test(Machine, settings=settings(settings(), stateful_step_count=40))


def test_store_state_machine_with_pins(tiny_model):
    class Machine(StoreMachine):
        model = tiny_model
        pins = ((1, 0), (2, 4), (2, 5))  # layer 2 keeps one slot for its other experts

    run_state_machine_as_test(Machine, settings=settings(settings(), stateful_step_count=40))


def test_store_state_machine_with_pins_and_a_warm_start(tiny_model):
    class Machine(StoreMachine):
        model = tiny_model
        pins = ((2, 4),)
        warm = ((1, 3), (1, 1), (1, 5), (1, 2), (2, 0), (2, 1))  # layer 1 keeps its last three

    run_state_machine_as_test(Machine, settings=settings(settings(), stateful_step_count=40))
