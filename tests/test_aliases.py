"""The names CHANGELOG.md lists as deprecated still work, for one release,
and are the new objects themselves."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import colibri
from colibri import formats
from colibri.checkpoint import experts, naming, safetensors, scan


def test_layouts_reexports_the_new_homes() -> None:
    from colibri import layouts

    assert layouts.Layout is naming.Layout is colibri.Layout
    assert layouts.StackedLayout is naming.StackedLayout is colibri.StackedLayout
    assert layouts.ExpertTensors is experts.ExpertTensors and layouts.ROLES == experts.ROLES
    assert layouts.scan_model is scan.scan_model
    assert layouts.SCHEMES == tuple(formats.FORMATS)
    assert layouts.scale_block is formats.fp8.scale_block
    for name in layouts.__all__:
        assert getattr(layouts, name) is not None, name


def test_safetensors_reader_is_checkpoint_safetensors() -> None:
    from colibri import safetensors_reader

    assert set(safetensors_reader.__all__) == set(safetensors.__all__)
    for name in safetensors_reader.__all__:
        assert getattr(safetensors_reader, name) is getattr(safetensors, name), name


def test_fp8_aliases_warn_and_give_the_same_answers(model_factory) -> None:
    from colibri import fp8

    w = np.linspace(-4, 4, 200 * 320, dtype=np.float32).reshape(200, 320).astype(ml_dtypes.float8_e4m3fn)
    s = np.full((2, 3), 0.5, np.float32)
    with pytest.warns(DeprecationWarning, match="fp8_to_float"):
        got = fp8.dequantize(w, s)
    np.testing.assert_array_equal(got, formats.fp8.fp8_to_float(w, s))
    model = model_factory(layout="mlp_experts", n_layers=1, n_experts=2, dtype="float32")
    with colibri.open_store(model.path, prefetch_workers=0) as store:
        with store.lease(store.layers[0], 1) as ex:
            with pytest.warns(DeprecationWarning, match="colibri.dequantize"):
                gate, up, down = fp8.dequantize_lease(ex)
            want = colibri.dequantize(ex)
    for got_role, role in ((gate, "gate"), (up, "up"), (down, "down")):
        np.testing.assert_array_equal(got_role, want[role])


def test_dequant_reexports_the_format_decoders() -> None:
    from colibri import dequant

    assert dequant.mxfp4_to_float is formats.mxfp4.mxfp4_to_float
    assert dequant.E2M1_VALUES is formats.mxfp4.E2M1_VALUES
    assert dequant.int4_to_float is formats.int4.int4_to_float
    assert dequant.unpack_int4 is formats.int4.unpack_int4
    assert dequant.gptq_to_float is formats.gptq.gptq_to_float
    assert dequant.awq_to_float is formats.awq.awq_to_float
    assert dequant.AWQ_ORDER == formats.awq.AWQ_ORDER
