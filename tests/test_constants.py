"""Every constant the Python layer shares with the C core agrees with the
compiled library: error codes, dtype codes, the role order, the stats
fields, the message buffer size and the key range."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

import colibri
from colibri import errors, store
from colibri.checkpoint import dtypes as _dtypes
from colibri._ffi import ffi, lib
from colibri.checkpoint.experts import ROLES
from colibri.formats import FORMATS


def _names(prefix: str) -> dict[str, int]:
    return {n: getattr(lib, n) for n in dir(lib) if n.startswith(prefix)}


# What each C error code becomes. A code added to csrc/coli_errors.h without a
# decision here fails test_every_error_code_has_a_class.
EXPECTED_CLASS = {
    "COLI_EINVAL": colibri.ColibriError,
    "COLI_ENOTFOUND": colibri.UnknownExpertError,
    "COLI_EFULL": colibri.CacheFullError,
    "COLI_EIO": colibri.ExpertLoadError,
    "COLI_ENOMEM": colibri.CacheMemoryError,
    "COLI_ECONFIG": colibri.FormatError,
    "COLI_ELEASE": colibri.LeaseError,
    "COLI_ETHREAD": colibri.ColibriError,
    "COLI_ETIMEOUT": colibri.WaitTimeoutError,
    "COLI_ECLOSED": colibri.StoreClosedError,
    "COLI_EAGAIN": colibri.ColibriError,
}


def test_every_error_code_has_a_class() -> None:
    codes = {n: c for n, c in _names("COLI_E").items() if n != "COLI_ERR_LEN"}
    assert set(codes) == set(EXPECTED_CLASS)
    assert len(set(codes.values())) == len(codes), "two codes share a value"
    assert all(c < 0 for c in codes.values()) and lib.COLI_OK == 0
    for name, code in codes.items():
        exc = errors.error_for(code, f"{name} happened")
        assert type(exc) is EXPECTED_CLASS[name], name
        assert str(exc) == f"{name} happened"
    # every code the Python side maps is one the library defines
    assert set(errors._BY_CODE) <= set(codes.values())


def test_format_codes_are_the_librarys() -> None:
    tensor, scale = _names("COLI_TENSOR_"), _names("COLI_SCALE_")
    for fmt in FORMATS.values():
        assert set(fmt.coli_formats.values()) <= set(tensor.values()), fmt.name
        assert set(fmt.scale_formats.values()) <= set(scale.values()), fmt.name
    for name, code in FORMATS["plain"].coli_formats.items():
        assert code == tensor[f"COLI_TENSOR_{name}"], name
    assert FORMATS["fp8_block"].coli_format("F8_E4M3") == lib.COLI_TENSOR_FP8_E4M3_BLOCK
    assert FORMATS["int4"].coli_format("I32") == lib.COLI_TENSOR_INT4_BLOCK
    assert FORMATS["mxfp4"].coli_scale_format("U8") == lib.COLI_SCALE_UE8M0
    # the numpy type of each expert dtype has the width the C core reads
    widths = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
    assert set(FORMATS["plain"].coli_formats) == set(widths)
    for name, width in widths.items():
        assert _dtypes.DTYPES[name].numpy is not None
        assert _dtypes.DTYPES[name].numpy.itemsize == width == _dtypes.DTYPES[name].itemsize
    assert _dtypes.DTYPES["BF16"].numpy == np.dtype(ml_dtypes.bfloat16)


def test_roles_follow_the_c_structs() -> None:
    source = [name for name, field in ffi.typeof("ColiExpertSource").fields
              if field.type is ffi.typeof("ColiTensorSource")]
    assert tuple(source) == ROLES
    view = {name for name, field in ffi.typeof("ColiExpertView").fields
            if field.type is ffi.typeof("ColiTensorView")}
    assert view == set(ROLES)


def test_stats_fields_follow_the_c_struct() -> None:
    c_fields = [name for name, _ in ffi.typeof("ColiExpertStoreStats").fields]
    py_fields = [f.name for f in dataclasses.fields(colibri.StoreStats)]
    assert py_fields[: len(c_fields)] == c_fields
    assert py_fields[len(c_fields):] == ["prefetch_pauses"]  # kept outside the struct


def test_limits_are_the_librarys() -> None:
    assert store._ERR_LEN == lib.COLI_ERR_LEN > 0
    assert store._INT_MAX == 2 ** (8 * ffi.sizeof("int") - 1) - 1
    assert store._U64_MAX == 2 ** (8 * ffi.sizeof("uint64_t")) - 1
    for field in ("prefetch_chunk_bytes", "read_chunk_bytes"):
        assert dict(ffi.typeof("ColiStoreConfig").fields)[field].type.cname == "uint64_t", field
    key = ffi.typeof("ColiExpertKey")
    assert [(n, f.type.cname) for n, f in key.fields] == [("layer", "int"), ("expert", "int")]



def test_byte_settings_beyond_uint64_are_capped_not_refused(small_model) -> None:
    big = 2 ** 70
    with colibri.open_store(small_model.path, slots_per_layer=2, prefetch_chunk_bytes=big,
                            read_chunk_bytes=big, direct_io=False) as s:
        layer = s.layers[0]
        with s.lease(layer, 0) as ex:
            assert ex.gate.nbytes > 0
