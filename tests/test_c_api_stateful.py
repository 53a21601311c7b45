"""A model-based state machine over the raw C lease API (through cffi).

Views are ColiExpertView structs driven with coli_expert_lookup and
coli_expert_release, exactly as a C engine would, including misuse: double
releases, releases of zeroed views, forged stale copies released after their
slot was repurposed, lookups into a view that still holds a lease, keys out
of range and a NULL store. The model counts the leases each view holds;
after every step the store's active leases equal the model's, and every
held view's bytes equal the file's (rule 4).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import colibri
from colibri._ffi import ffi, lib
from conftest import ROLES, expected_experts

VIEW_SIZE = ffi.sizeof("ColiExpertView")


def zeroed(view) -> bool:
    return ffi.buffer(view, VIEW_SIZE)[:] == b"\0" * VIEW_SIZE


def make_machine(model):
    want = expected_experts(model)
    layers = model.layers
    n_experts = model.n_experts

    class CApiMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.store = None
            self.held: list = []     # views holding a lease
            self.stale: list = []    # byte copies of released views (forged, as a buggy engine would)

        @initialize(slots=st.integers(1, 3))
        def open(self, slots: int) -> None:
            self.store = colibri.open_store(model.path, slots_per_layer=slots, prefetch_workers=0,
                                            slot_wait_timeout=0.0)
            self.slots = slots
            self.handle = self.store._handle

        def leased_in(self, layer: int) -> set[int]:
            return {v.key.expert for v in self.held if v.key.layer == layer}

        @rule(layer=st.sampled_from(layers), expert=st.integers(0, n_experts - 1))
        def lookup(self, layer: int, expert: int) -> None:
            view = ffi.new("ColiExpertView *")
            full = expert not in self.leased_in(layer) and len(self.leased_in(layer)) >= self.slots
            rc = lib.coli_expert_lookup(self.handle, (layer, expert), view)
            if full:
                assert rc == lib.COLI_EFULL and zeroed(view)  # rule 2
                return
            assert rc == 0
            self.held.append(view)

        @rule(layer=st.integers(-3, max(layers) + 3), expert=st.integers(-3, n_experts + 3))
        def lookup_out_of_range(self, layer: int, expert: int) -> None:
            if layer in layers and 0 <= expert < n_experts:
                return
            view = ffi.new("ColiExpertView *")
            assert lib.coli_expert_lookup(self.handle, (layer, expert), view) == lib.COLI_ENOTFOUND
            assert zeroed(view)

        @precondition(lambda self: bool(self.held))
        @rule(i=st.integers(0, 99), keep_copy=st.booleans())
        def release(self, i: int, keep_copy: bool) -> None:
            view = self.held.pop(i % len(self.held))
            if keep_copy:
                copy = ffi.new("ColiExpertView *")
                ffi.memmove(copy, view, VIEW_SIZE)
                self.stale.append(copy)
            lib.coli_expert_release(self.handle, view)
            assert zeroed(view)                                 # rule 3
            lib.coli_expert_release(self.handle, view)          # a zeroed view: no-op

        @precondition(lambda self: bool(self.stale))
        @rule(i=st.integers(0, 99))
        def release_stale_copy(self, i: int) -> None:
            """Releasing a copy of an already released view must never drop
            someone else's lease: ignored when its slot was repurposed, and
            (contract breach) at worst one lease of the same tenancy, which
            the model tolerates only when that tenancy is still held."""
            copy = self.stale.pop(i % len(self.stale))
            same = [v for v in self.held
                    if v.lease == copy.lease and v.lease_generation == copy.lease_generation]
            before = int(lib.coli_store_active_leases(self.handle))
            lib.coli_expert_release(self.handle, copy)
            after = int(lib.coli_store_active_leases(self.handle))
            if not same:
                assert after == before                          # rule 4: stale release ignored
            else:
                # A copied view is a breach of rule 1; the store cannot tell it from the
                # original, so it drops one lease of that same tenancy. Forget one holder.
                assert after == before - 1
                self.held.remove(same[0])
                self.lost = getattr(self, "lost", []) + [same[0]]

        @precondition(lambda self: bool(self.held))
        @rule(i=st.integers(0, 99), expert=st.integers(0, n_experts - 1))
        def lookup_into_leased_view(self, i: int, expert: int) -> None:
            view = self.held.pop(i % len(self.held))
            layer = view.key.layer
            assert lib.coli_expert_lookup(self.handle, (layer, expert), view) == lib.COLI_ELEASE
            assert zeroed(view)                                 # refused, and its lease released

        @rule()
        def null_store(self) -> None:
            view = ffi.new("ColiExpertView *")
            view.lease = ffi.cast("void *", 8)
            assert lib.coli_expert_lookup(ffi.NULL, (layers[0], 0), view) == -1
            assert zeroed(view)
            lib.coli_expert_release(ffi.NULL, view)

        @invariant()
        def leases_match_the_model(self) -> None:
            if self.store is not None:
                assert int(lib.coli_store_active_leases(self.handle)) == len(self.held)

        @invariant()
        def held_bytes_are_the_files(self) -> None:
            for view in self.held:
                expect = want[(view.key.layer, view.key.expert)]
                for role in ROLES:
                    t = getattr(view, role)
                    assert ffi.buffer(t.data, t.data_bytes)[:] == expect[role].tobytes()

        def teardown(self) -> None:
            if self.store is None:
                return
            for view in self.held:
                lib.coli_expert_release(self.handle, view)
            # Leases dropped through a forged copy leave their original views
            # pointing at a tenancy they no longer hold; releasing those is
            # now stale (or drops nothing, the lease count being 0).
            for view in getattr(self, "lost", []):
                lib.coli_expert_release(self.handle, view)
            assert int(lib.coli_store_active_leases(self.handle)) == 0
            self.store.close()

    return CApiMachine


def test_c_api_state_machine(tiny_model):
    make_machine(tiny_model).TestCase().runTest()
