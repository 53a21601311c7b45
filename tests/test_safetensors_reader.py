"""Tests of colibri.checkpoint.safetensors: header parsing, validation, file resolution."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.checkpoint import dtypes as _dtypes
from colibri.formats import FORMATS
from colibri.errors import FormatError
from colibri.checkpoint.safetensors import (
    INDEX_NAME,
    MAX_HEADER_BYTES,
    TensorInfo,
    read_header,
    read_model_tensors,
    resolve_files,
)

# ---------------------------------------------------------------- helpers


def tensor_nbytes(dtype: _dtypes.DType, shape: tuple[int, ...]) -> int | None:
    """Bytes a dense tensor of ``shape`` occupies, or None when a packed
    sub-byte tensor would not end on a byte boundary (safetensors rejects it)."""
    bits = dtype.bits
    for dim in shape:
        bits *= dim
    return None if bits % 8 else bits // 8


def raw_file(path: Path, header: bytes | str | dict[str, Any], data: bytes = b"",
             header_len: int | None = None) -> Path:
    """Write a safetensors-shaped file byte by byte, however wrong the parts are."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8")
    n = len(header) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + header + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def save_any(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """safetensors.numpy.save_file cannot write fp8; serialize_file can."""
    keep = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    specs = {
        k: safetensors.TensorSpec(dtype=v.dtype.name, shape=v.shape,
                                  data_ptr=v.ctypes.data, data_len=v.nbytes)
        for k, v in keep.items()
    }
    safetensors.serialize_file(specs, str(path))
    return path


def bytes_at(info: TensorInfo) -> bytes:
    with open(info.path, "rb") as fh:
        fh.seek(info.offset)
        return fh.read(info.nbytes)


def rng_array(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------- good files


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_offsets_are_absolute_and_match_safetensors(tmp_path: Path, dtype: Any) -> None:
    tensors = {
        "a": rng_array((3, 5), dtype, 1),
        "b.weight": rng_array((7,), dtype, 2),
        "c": rng_array((2, 3, 4), dtype, 3),
    }
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    infos = read_header(path, file_index=3)
    loaded = safetensors.numpy.load_file(str(path))
    assert set(infos) == set(loaded) == set(tensors)
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    for name, info in infos.items():
        assert info.name == name
        assert info.file == 3
        assert info.path == str(path)
        assert info.shape == tensors[name].shape
        assert info.offset == 8 + header_len + header[name]["data_offsets"][0]
        assert info.nbytes == tensors[name].nbytes
        assert info.end == info.offset + info.nbytes
        assert bytes_at(info) == loaded[name].tobytes()
        assert loaded[name].dtype == _dtypes.DTYPES[info.dtype].numpy


def test_dtype_strings_and_fp8_bytes(tmp_path: Path) -> None:
    tensors = {
        "f32": rng_array((2, 2), np.float32),
        "f16": rng_array((2, 2), np.float16),
        "bf16": rng_array((2, 2), ml_dtypes.bfloat16),
        "e4m3": rng_array((4, 8), ml_dtypes.float8_e4m3fn),
        "e5m2": rng_array((4, 8), ml_dtypes.float8_e5m2),
        "i64": np.arange(5, dtype=np.int64),
        "u8": np.arange(3, dtype=np.uint8),
    }
    path = save_any(tmp_path / "m.safetensors", tensors)
    infos = read_header(path)
    assert {n: i.dtype for n, i in infos.items()} == {
        "f32": "F32", "f16": "F16", "bf16": "BF16", "e4m3": "F8_E4M3",
        "e5m2": "F8_E5M2", "i64": "I64", "u8": "U8",
    }
    for name, arr in tensors.items():
        assert bytes_at(infos[name]) == arr.tobytes()
        assert _dtypes.DTYPES[infos[name].dtype].numpy == arr.dtype


def test_dtype_table() -> None:
    assert set(FORMATS["plain"].coli_formats) == {"F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
    assert _dtypes.DTYPES["BF16"].itemsize == 2
    assert _dtypes.DTYPES["F8_E4M3"].itemsize == 1
    assert _dtypes.DTYPES["F4"].itemsize == 0  # packed, 4 bits
    plain, fp8 = FORMATS["plain"], FORMATS["fp8_block"]
    assert plain.coli_format("F32") == 0
    assert fp8.coli_format("F8_E4M3") == 4
    assert plain.coli_format("F16") == 8
    assert plain.coli_format("BF16") == 9
    assert plain.coli_format("F8_E4M3") == 10
    assert plain.coli_format("F8_E5M2") == 11
    with pytest.raises(ValueError):
        plain.coli_format("I32")
    with pytest.raises(ValueError):
        fp8.coli_format("BF16")


def test_metadata_empty_scalar_and_packed_tensors(tmp_path: Path) -> None:
    header = {
        "__metadata__": {"format": "pt", "note": "x"},
        "scalar": entry("F32", [], 0, 4),
        "empty": entry("BF16", [0, 5], 4, 4),
        "f4": entry("F4", [2, 3], 4, 7),
        "f6": entry("F6_E3M2", [4], 7, 10),
    }
    path = raw_file(tmp_path / "m.safetensors", header, bytes(10))
    infos = read_header(path)
    assert infos["scalar"].shape == () and infos["scalar"].nbytes == 4
    assert infos["empty"].nbytes == 0
    assert infos["f4"].nbytes == 3 and infos["f6"].nbytes == 3
    assert "__metadata__" not in infos
    # safetensors itself agrees these are valid.
    assert len(safetensors.deserialize(path.read_bytes())) == 4


def test_no_tensors_and_null_metadata(tmp_path: Path) -> None:
    assert read_header(raw_file(tmp_path / "a.safetensors", "{}")) == {}
    path = raw_file(tmp_path / "b.safetensors", {"__metadata__": None})
    assert read_header(path) == {}


def test_gaps_and_padding_are_fine(tmp_path: Path) -> None:
    # Holes between tensors and space padding after the JSON are legal for us.
    text = json.dumps({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 6, 8)}) + "   "
    infos = read_header(raw_file(tmp_path / "m.safetensors", text, bytes(range(8))))
    assert bytes_at(infos["b"]) == bytes([6, 7])


def test_reads_only_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import colibri.checkpoint.safetensors as reader

    big = np.zeros((512, 1024), dtype=np.float32)  # 2 MiB of data
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": big}, str(path))
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    total = [0]
    real_open = open

    class Counting:
        def __init__(self, fh: Any) -> None:
            self._fh = fh

        def read(self, n: int = -1) -> bytes:
            out: bytes = self._fh.read(n)
            total[0] += len(out)
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(self._fh, name)

        def __enter__(self) -> "Counting":
            return self

        def __exit__(self, *exc: object) -> None:
            self._fh.close()

    monkeypatch.setattr(reader, "open", lambda *a, **k: Counting(real_open(*a, **k)),
                        raising=False)
    read_header(path)
    assert total[0] == 8 + header_len


# ---------------------------------------------------------------- bad files


def expect_error(path: Path, *fragments: str) -> FormatError:
    with pytest.raises(FormatError) as info:
        read_header(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    assert isinstance(info.value, ValueError)
    return info.value


def test_missing_file_and_directory(tmp_path: Path) -> None:
    expect_error(tmp_path / "nope.safetensors")
    expect_error(tmp_path, "not a regular file")


@pytest.mark.parametrize("content", [b"", b"\x01", b"1234567"])
def test_too_short_for_length(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(content)
    expect_error(path, "too short")


def test_header_length_zero(tmp_path: Path) -> None:
    expect_error(raw_file(tmp_path / "m.safetensors", b"{}", header_len=0), "length is 0")


def test_header_length_past_eof(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "m.safetensors", b"{}", header_len=1000)
    expect_error(path, "1000", "past the end")


def test_header_length_over_limit(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "m.safetensors", b"{}", header_len=MAX_HEADER_BYTES + 1)
    expect_error(path, "limit")
    # A length taken from a file that is not safetensors at all, e.g. text.
    path.write_bytes(b"hello world, not a model")
    expect_error(path)


@pytest.mark.parametrize(
    "header, fragment",
    [
        (b"\xff\xfe{}", "UTF-8"),
        (b'{"a": "\xc3"}', "UTF-8"),
        (b"{not json}", "JSON"),
        (b'{"a": 1', "JSON"),
        (b"", "length is 0"),
        (b"[]", "JSON object"),
        (b"42", "JSON object"),
        (b'"str"', "JSON object"),
        (b"null", "JSON object"),
        (b'{"a": NaN}', "NaN"),
        (b'{"__metadata__": {}, "__metadata__": {}}', "twice"),
        (b'{"x": {"dtype": "F32", "dtype": "F32", "shape": [], "data_offsets": [0, 4]}}',
         "twice"),
        pytest.param(b"[" * 100000 + b"]" * 100000, "JSON", id="deep-array"),
        pytest.param(b'{"a":' * 50000 + b"1" + b"}" * 50000, "JSON", id="deep-object"),
    ],
)
def test_undecodable_headers(tmp_path: Path, header: bytes, fragment: str) -> None:
    expect_error(raw_file(tmp_path / "m.safetensors", header, bytes(8)), fragment)


@pytest.mark.parametrize(
    "tensor, fragment",
    [
        ([1, 2], "must be an object"),
        ({"shape": [1], "data_offsets": [0, 4]}, "missing 'dtype'"),
        ({"dtype": "F32", "data_offsets": [0, 4]}, "missing 'shape'"),
        ({"dtype": "F32", "shape": [1]}, "missing 'data_offsets'"),
        (entry("F128", [1], 0, 4), "unknown dtype 'F128'"),
        (entry("f32", [1], 0, 4), "unknown dtype"),
        ({"dtype": 5, "shape": [1], "data_offsets": [0, 4]}, "unknown dtype"),
        ({"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}, "shape"),
        (entry("F32", [-1], 0, 4), "shape"),
        (entry("F32", [1.0], 0, 4), "shape"),  # type: ignore[list-item]
        (entry("F32", [True], 0, 4), "shape"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}, "data_offsets"),
        ({"dtype": "F32", "shape": [1], "data_offsets": "0-4"}, "data_offsets"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}, "data_offsets"),
        (entry("F32", [1], -4, 0), "begin"),
        (entry("F32", [1], 8, 4), "begin"),
        (entry("F32", [3], 0, 12), "past the end"),
        (entry("F32", [2], 4, 12), "past the end"),
        (entry("F32", [2], 0, 4), "needs 8 bytes"),
        (entry("BF16", [3], 0, 8), "needs 6 bytes"),
        (entry("F4", [3], 0, 2), "whole number of bytes"),
        (entry("F32", [2**62, 2**62, 2**62], 0, 8), "more than"),
    ],
)
def test_bad_tensor_entries(tmp_path: Path, tensor: Any, fragment: str) -> None:
    path = raw_file(tmp_path / "m.safetensors", {"w.weight": tensor}, bytes(8))
    expect_error(path, "'w.weight'", fragment)


@pytest.mark.parametrize("metadata", [[], "x", {"k": 1}, {"k": None}, {"k": ["v"]}])
def test_bad_metadata(tmp_path: Path, metadata: Any) -> None:
    path = raw_file(tmp_path / "m.safetensors", {"__metadata__": metadata}, b"")
    expect_error(path, "__metadata__")


def test_overlapping_ranges_name_both(tmp_path: Path) -> None:
    header = {
        "first": entry("F32", [2], 0, 8),
        "empty": entry("F32", [0], 4, 4),  # empty tensors overlap nothing
        "second": entry("F32", [2], 4, 12),
    }
    err = expect_error(raw_file(tmp_path / "m.safetensors", header, bytes(12)), "overlap")
    assert "'first'" in str(err) and "'second'" in str(err)
    # A tensor nested inside a larger one is caught too.
    header = {
        "outer": entry("U8", [10], 0, 10),
        "a": entry("U8", [2], 2, 4),
    }
    expect_error(raw_file(tmp_path / "n.safetensors", header, bytes(10)), "overlap")
    # Same range twice.
    header = {"x": entry("U8", [4], 0, 4), "y": entry("U8", [4], 0, 4)}
    expect_error(raw_file(tmp_path / "o.safetensors", header, bytes(4)), "overlap")


def test_lone_surrogate_name(tmp_path: Path) -> None:
    text = '{"bad\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'
    expect_error(raw_file(tmp_path / "m.safetensors", text, b"\x00"), "Unicode")


def test_truncated_after_valid_header(tmp_path: Path) -> None:
    arrays = {"w": np.ones((4, 4), dtype=np.float32)}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    path.write_bytes(path.read_bytes()[:-1])
    expect_error(path, "'w'", "past the end")


def test_path_types(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "m.safetensors", {"a": entry("U8", [1], 0, 1)}, b"\x07")
    assert read_header(str(path)) == read_header(path)
    with pytest.raises(FormatError):
        read_header(b"/bytes/path")  # type: ignore[arg-type]
    with pytest.raises(FormatError):
        read_header(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------- hypothesis

json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
small_ints = st.integers(-3, 80) | st.booleans() | st.just(2**64)
tensor_like = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(sorted(_dtypes.DTYPES) + ["X", "f32"]) | json_scalars,
        "shape": st.lists(small_ints, max_size=3) | json_values,
        "data_offsets": st.lists(small_ints, min_size=0, max_size=3) | json_values,
    }
)
headers = st.dictionaries(
    st.sampled_from(["a", "b", "c", "__metadata__", "w.weight"]) | st.text(max_size=4),
    tensor_like | json_values,
    max_size=5,
) | json_values


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def check_result(path: Path, infos: dict[str, TensorInfo]) -> None:
    """What a header that passes validation guarantees."""
    size = path.stat().st_size
    ranges = []
    for info in infos.values():
        assert 0 <= info.offset <= info.end <= size
        nbytes = tensor_nbytes(_dtypes.DTYPES[info.dtype], info.shape)
        assert nbytes == info.nbytes
        if info.nbytes:
            ranges.append((info.offset, info.end))
    ranges.sort()
    for (_, end), (begin, _) in zip(ranges, ranges[1:]):
        assert end <= begin


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=64), header_len=st.none() | st.integers(0, 2**64 - 1))
def test_fuzz_random_bytes(fuzz_dir: Path, data: bytes, header_len: int | None) -> None:
    path = fuzz_dir / "bytes.safetensors"
    if header_len is None:
        path.write_bytes(data)
    else:
        path.write_bytes(struct.pack("<Q", header_len) + data)
    try:
        infos = read_header(path)
    except FormatError:
        return
    check_result(path, infos)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=headers, data_len=st.integers(0, 96), raw_text=st.booleans())
def test_fuzz_random_json_headers(fuzz_dir: Path, header: Any, data_len: int,
                                  raw_text: bool) -> None:
    path = fuzz_dir / "json.safetensors"
    text = json.dumps(header)
    if raw_text:  # also corrupt the JSON text itself
        text = text[: len(text) // 2 + 1]
    raw_file(path, text, bytes(data_len))
    try:
        infos = read_header(path)
    except FormatError:
        return
    check_result(path, infos)
    # safetensors demands data that tiles its region without holes; when ours
    # does, it must agree with us that the file is valid.
    if _tiles_data_region(path, infos):
        safetensors.deserialize(path.read_bytes())


def _tiles_data_region(path: Path, infos: dict[str, TensorInfo]) -> bool:
    raw = path.read_bytes()
    data_start = 8 + struct.unpack("<Q", raw[:8])[0]
    pos = data_start
    for begin, end in sorted((i.offset, i.end) for i in infos.values()):
        if begin != pos:
            return False
        pos = end
    return pos == len(raw)


roundtrip_dtypes = st.sampled_from(
    [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.uint8, np.float64]
)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    specs=st.dictionaries(
        st.text("abcdefgh.", min_size=1, max_size=10),
        st.tuples(roundtrip_dtypes, st.lists(st.integers(0, 5), max_size=3)),
        min_size=1, max_size=6,
    )
)
def test_roundtrip_against_safetensors(fuzz_dir: Path, specs: dict[str, Any]) -> None:
    arrays = {
        name: np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape).astype(dtype)
        for name, (dtype, shape) in specs.items()
    }
    path = fuzz_dir / "roundtrip.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    infos = read_header(path)
    loaded = safetensors.numpy.load_file(str(path))
    assert set(infos) == set(arrays)
    for name, info in infos.items():
        assert info.shape == arrays[name].shape
        assert bytes_at(info) == loaded[name].tobytes() == arrays[name].tobytes()


# ---------------------------------------------------------------- resolve_files


def small_file(path: Path, name: str = "t", value: int = 1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file({name: np.full((2,), value, dtype=np.float32)}, str(path))
    return path


def test_resolve_single_file_and_dir(tmp_path: Path) -> None:
    f = small_file(tmp_path / "only" / "model.safetensors")
    assert resolve_files(f) == [str(f)]
    assert resolve_files(str(f)) == [str(f)]
    assert resolve_files(f.parent) == [str(f)]


def test_resolve_dir_without_index_sorts_and_filters(tmp_path: Path) -> None:
    b = small_file(tmp_path / "b.safetensors", "b")
    a = small_file(tmp_path / "a.safetensors", "a")
    small_file(tmp_path / "._a.safetensors", "hidden")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub.safetensors").mkdir()  # a directory with the suffix is skipped
    assert resolve_files(tmp_path) == [str(a), str(b)]


def test_resolve_relative_paths_become_absolute(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    small_file(tmp_path / "m.safetensors")
    monkeypatch.chdir(tmp_path)
    assert resolve_files("m.safetensors") == [str(tmp_path / "m.safetensors")]
    assert resolve_files(".") == [str(tmp_path / "m.safetensors")]


def write_sharded(root: Path, shards: dict[str, dict[str, np.ndarray]],
                  weight_map: dict[str, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    computed: dict[str, str] = {}
    for shard, arrays in shards.items():
        safetensors.numpy.save_file(arrays, str(root / shard))
        computed.update({name: shard for name in arrays})
    index = {"metadata": {"total_size": 0},
             "weight_map": computed if weight_map is None else weight_map}
    (root / INDEX_NAME).write_text(json.dumps(index))
    return root


def two_shards() -> dict[str, dict[str, np.ndarray]]:
    return {
        "model-00002-of-00002.safetensors": {"z": np.zeros(3, np.float32),
                                             "y": np.ones(2, np.float16)},
        "model-00001-of-00002.safetensors": {"a": np.full(4, 2, np.float32)},
    }


def test_resolve_with_index(tmp_path: Path) -> None:
    root = write_sharded(tmp_path / "m", two_shards())
    small_file(root / "stray.safetensors", "stray")  # not in the index: ignored
    expected = [str(root / "model-00001-of-00002.safetensors"),
                str(root / "model-00002-of-00002.safetensors")]
    assert resolve_files(root) == expected
    assert resolve_files(root / INDEX_NAME) == expected
    files, tensors = read_model_tensors(root)
    assert files == expected
    assert set(tensors) == {"a", "y", "z"}
    assert tensors["a"].file == 0 and tensors["z"].file == 1 and tensors["y"].file == 1
    assert tensors["y"].path == expected[1]
    assert np.frombuffer(bytes_at(tensors["y"]), np.float16).tolist() == [1.0, 1.0]


def test_resolve_list_keeps_order(tmp_path: Path) -> None:
    a = small_file(tmp_path / "a.safetensors", "a")
    b = small_file(tmp_path / "b.safetensors", "b")
    assert resolve_files([b, str(a)]) == [str(b), str(a)]
    assert resolve_files((a,)) == [str(a)]
    files, tensors = read_model_tensors([b, a])
    assert files == [str(b), str(a)]
    assert tensors["b"].file == 0 and tensors["a"].file == 1


def resolve_error(source: Any, *fragments: str) -> str:
    with pytest.raises(FormatError) as info:
        resolve_files(source)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_resolve_errors(tmp_path: Path) -> None:
    a = small_file(tmp_path / "a.safetensors", "a")
    resolve_error(tmp_path / "missing", "missing", "no such")
    resolve_error([], "empty")
    resolve_error([a, tmp_path / "gone.safetensors"], "gone.safetensors")
    resolve_error([a, tmp_path], "not a regular file")
    resolve_error([a, str(a)], "twice")
    resolve_error([a, tmp_path / "." / "a.safetensors"], "twice")
    resolve_error([a, 3], "int")
    resolve_error(3.5, "float")
    empty = tmp_path / "empty"
    empty.mkdir()
    resolve_error(empty, "no .safetensors")
    os.symlink(a, tmp_path / "link.safetensors")
    resolve_error([a, tmp_path / "link.safetensors"], "twice")


def test_resolve_index_errors(tmp_path: Path) -> None:
    root = write_sharded(tmp_path / "missing", two_shards())
    os.remove(root / "model-00002-of-00002.safetensors")
    resolve_error(root, "model-00002-of-00002.safetensors", "missing")

    bad = tmp_path / "bad"
    bad.mkdir()
    small_file(bad / "model.safetensors")
    for content, fragment in [
        ("{", "JSON"),
        ("[]", "weight_map"),
        ('{"weight_map": []}', "weight_map"),
        ('{"weight_map": {}}', "empty"),
        ('{"weight_map": {"t": 3}}', "not a file name"),
        ('{"weight_map": {"t": "../model.safetensors"}}', "outside"),
        ('{"weight_map": {"t": "/etc/passwd"}}', "outside"),
    ]:
        (bad / INDEX_NAME).write_text(content)
        message = resolve_error(bad, fragment)
        assert INDEX_NAME in message


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    a = small_file(tmp_path / "a.safetensors", "same")
    b = small_file(tmp_path / "b.safetensors", "same")
    with pytest.raises(FormatError) as info:
        read_model_tensors([a, b])
    assert "'same'" in str(info.value)
    assert str(a) in str(info.value) and str(b) in str(info.value)
    with pytest.raises(FormatError):
        read_model_tensors(tmp_path)  # the directory form catches it too


def test_index_disagrees_with_shards(tmp_path: Path) -> None:
    shards = two_shards()
    # Both shards are listed, but "a" is said to be in the second one.
    wrong = {"a": "model-00002-of-00002.safetensors", "y": "model-00001-of-00002.safetensors",
             "z": "model-00002-of-00002.safetensors"}
    root = write_sharded(tmp_path / "wrong", shards, wrong)
    with pytest.raises(FormatError) as info:
        read_model_tensors(root)
    message = str(info.value)
    assert "'a'" in message and "but it is in" in message
    assert message.endswith("model-00001-of-00002.safetensors")

    # Only the second shard is listed, so "a" is not found at all.
    only_second = {"a": "model-00002-of-00002.safetensors"}
    root = write_sharded(tmp_path / "only_second", shards, only_second)
    with pytest.raises(FormatError) as info:
        read_model_tensors(root)
    assert "'a'" in str(info.value) and "does not hold it" in str(info.value)

    absent = {"a": "model-00001-of-00002.safetensors", "ghost": "model-00002-of-00002.safetensors"}
    root = write_sharded(tmp_path / "absent", shards, absent)
    with pytest.raises(FormatError) as info:
        read_model_tensors(root)
    assert "'ghost'" in str(info.value)


def test_bad_shard_is_reported_with_its_path(tmp_path: Path) -> None:
    root = write_sharded(tmp_path / "m", two_shards())
    broken = root / "model-00002-of-00002.safetensors"
    broken.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(FormatError) as info:
        read_model_tensors(root)
    assert str(broken) in str(info.value)


def test_special_files(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)  # opening it for reading would block: we must not
    expect_error(fifo, "not a regular file")
    resolve_error(fifo, "not a regular file")
    model = tmp_path / "m"
    small_file(model / "model.safetensors")
    (model / INDEX_NAME).mkdir()
    resolve_error(model, INDEX_NAME, "cannot read")
