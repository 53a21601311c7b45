"""colibri.torch_interop: leased arrays as torch tensors, no copy."""

from __future__ import annotations

import gc
import warnings

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import colibri  # noqa: E402
from colibri.torch_interop import as_torch, expert_tensors  # noqa: E402


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype, torch_dtype", [
    ("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_leased_arrays_become_tensors_sharing_memory(model_factory, dtype: str, torch_dtype) -> None:
    model = model_factory(layout="mlp_experts", n_layers=2, n_experts=3, dtype=dtype)
    layer = model.layers[0]
    with colibri.open_store(model.path, prefetch_workers=0) as store:
        with store.lease(layer, 2) as ex:
            with warnings.catch_warnings():
                warnings.simplefilter("error")           # no "non-writable array" warning
                t = as_torch(ex.gate)
            assert t.dtype == torch_dtype and tuple(t.shape) == ex.gate.shape
            assert t.data_ptr() == _address(ex.gate)      # same bytes, no copy
            np.testing.assert_array_equal(t.float().numpy(), ex.gate.astype(np.float32))
            tt = as_torch(ex.down.T)                       # strided views work too
            assert tt.data_ptr() == _address(ex.down) and tt.stride() == (1, ex.down.shape[1])
            parts = expert_tensors(ex)
            assert set(parts) == {"gate", "up", "down"}
            y = torch.nn.functional.linear(torch.ones(1, model.hidden, dtype=torch_dtype), parts["gate"])
            del t, tt, parts
        assert store.active_leases == 0
        assert y.shape == (1, model.intermediate)          # results hold no lease


def test_fp8_arrays_and_scales() -> None:
    w = np.linspace(-3, 3, 12).astype(ml_dtypes.float8_e4m3fn).reshape(3, 4)
    w.flags.writeable = False
    t = as_torch(w)
    assert t.dtype == torch.float8_e4m3fn and t.data_ptr() == _address(w)
    np.testing.assert_array_equal(t.float().numpy(), w.astype(np.float32))
    e5 = np.ones((2, 2), ml_dtypes.float8_e5m2)
    assert as_torch(e5).dtype == torch.float8_e5m2
    with pytest.raises(TypeError, match="numpy array"):
        as_torch([1.0, 2.0])


def test_a_tensor_keeps_the_lease_alive(model_factory) -> None:
    model = model_factory(layout="mixtral", n_layers=2, n_experts=4, dtype="float32")
    layer = model.layers[0]
    with colibri.open_store(model.path, slots_per_layer=1, prefetch_workers=0) as store:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            with store.lease(layer, 0) as ex:
                t = as_torch(ex.up)
                want = ex.up.copy()
        assert store.active_leases == 1                    # held by the tensor
        np.testing.assert_array_equal(t.numpy(), want)     # still the expert's bytes
        view = t[1:]
        del t
        gc.collect()
        assert store.active_leases == 1                    # a view of the tensor is enough
        del view
        gc.collect()
        assert store.active_leases == 0
