"""Read and validate safetensors headers without touching tensor data.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes
of UTF-8 JSON, then the data region. The JSON maps tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` where the offsets are
relative to the start of the data region; an optional ``__metadata__`` entry
maps strings to strings.

Everything here reads only headers, so scanning a 700 GB model costs a few
megabytes of I/O. Every problem, including a path that does not exist or
cannot be read, raises :class:`colibri.errors.FormatError` (a ``ValueError``)
whose message names the file and, where there is one, the tensor. Returned
paths are absolute and normalised so the C core does not depend on the
current directory.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any, Sequence, Union

import numpy as np

from colibri.checkpoint import dtypes
from colibri.errors import FormatError

__all__ = [
    "TensorInfo",
    "ModelSource",
    "MAX_HEADER_BYTES",
    "INDEX_NAME",
    "read_header",
    "resolve_files",
    "read_model_tensors",
    "read_ints",
    "read_array",
]

# Same order of magnitude as safetensors' own limit; real headers are < 10 MB.
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"
_METADATA_KEY = "__metadata__"

PathLike = Union[str, os.PathLike[str]]
# What the public entry points accept: a directory, one file, or a list of files.
ModelSource = Union[PathLike, Sequence[PathLike]]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives on disk.

    ``offset`` is absolute (``8 + header_len + data_offsets[0]``), so
    ``pread(fd, nbytes, offset)`` returns exactly the tensor's bytes.
    ``file`` is the index of ``path`` in the model's file list.
    """

    name: str
    file: int
    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        """Absolute offset one past the tensor's last byte."""
        return self.offset + self.nbytes


class _DuplicateKey(Exception):
    """Raised from the JSON hook; json would otherwise keep the last value."""


class _BadConstant(Exception):
    """NaN / Infinity are not JSON and have no place in a header."""


def _pairs_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _reject_constant(text: str) -> Any:
    raise _BadConstant(text)


def _is_int(value: Any) -> bool:
    # bool is an int subclass in Python but `true` is not a JSON integer.
    return isinstance(value, int) and not isinstance(value, bool)


def _fspath(path: Any, what: str) -> str:
    try:
        result = os.fspath(path)
    except TypeError:
        raise FormatError(
            f"{what} must be a str or os.PathLike, not {type(path).__name__}"
        ) from None
    if not isinstance(result, str):
        raise FormatError(f"{what} must be a str path, not bytes: {result!r}")
    return result


def read_header(path: PathLike, file_index: int = 0) -> dict[str, TensorInfo]:
    """Parse and validate the header of one safetensors file.

    Returns ``{tensor name: TensorInfo}`` (``__metadata__`` is validated and
    dropped). ``file_index`` is stored in each ``TensorInfo.file``. Only the
    header bytes are read. Raises FormatError for every problem, including a
    missing or unreadable file.
    """
    spath = _fspath(path, "a safetensors path")
    try:
        st = os.stat(spath)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{spath}: not a regular file")
        with open(spath, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise FormatError(
                    f"{spath}: file is {size} bytes, too short to hold the "
                    "8-byte header length of a safetensors file"
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len == 0:
                raise FormatError(f"{spath}: header length is 0")
            if header_len > MAX_HEADER_BYTES:
                raise FormatError(
                    f"{spath}: header length {header_len} exceeds the "
                    f"{MAX_HEADER_BYTES}-byte limit (not a safetensors file?)"
                )
            if header_len > size - 8:
                raise FormatError(
                    f"{spath}: header length {header_len} runs past the end of "
                    f"the file ({size} bytes)"
                )
            raw = fh.read(header_len)
            if len(raw) != header_len:  # the file shrank under us
                raise FormatError(
                    f"{spath}: read {len(raw)} of {header_len} header bytes"
                )
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise FormatError(f"{spath}: cannot read safetensors file: {reason}") from exc
    return _parse_header(raw, spath, file_index, 8 + header_len, size)


def _load_json(raw: bytes, where: str) -> Any:
    """Decode strict UTF-8 JSON; every failure becomes FormatError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(
            f"{where}: header is not valid UTF-8 (bad byte at {exc.start})"
        ) from None
    try:
        return json.loads(
            text,
            object_pairs_hook=_pairs_without_duplicates,
            parse_constant=_reject_constant,
        )
    except _DuplicateKey as exc:
        raise FormatError(f"{where}: key {exc.args[0]!r} appears twice") from None
    except _BadConstant as exc:
        raise FormatError(f"{where}: {exc.args[0]} is not valid JSON") from None
    except json.JSONDecodeError as exc:
        raise FormatError(
            f"{where}: not valid JSON: {exc.msg} at character {exc.pos}"
        ) from None
    except (ValueError, RecursionError) as exc:
        # Huge integer literals (int digit limit) and absurd nesting land here.
        raise FormatError(f"{where}: not valid JSON: {exc}") from None


def _check_name(name: str, path: str) -> None:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from "\udXXX" escapes
        raise FormatError(
            f"{path}: tensor name {name!r} is not valid Unicode"
        ) from None


def _parse_header(
    raw: bytes, path: str, file_index: int, data_start: int, file_size: int
) -> dict[str, TensorInfo]:
    header = _load_json(raw, f"{path}: header")
    if not isinstance(header, dict):
        raise FormatError(
            f"{path}: header must be a JSON object, got {type(header).__name__}"
        )
    data_size = file_size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == _METADATA_KEY:
            _check_metadata(entry, path)
            continue
        _check_name(name, path)
        tensors[name] = _parse_entry(name, entry, path, file_index, data_start, data_size)
    _check_overlaps(tensors, path)
    return tensors


def _check_metadata(entry: Any, path: str) -> None:
    if entry is None:
        return
    if not isinstance(entry, dict):
        raise FormatError(
            f"{path}: {_METADATA_KEY} must be an object of strings, "
            f"got {type(entry).__name__}"
        )
    for key, value in entry.items():
        if not isinstance(value, str):
            raise FormatError(
                f"{path}: {_METADATA_KEY}[{key!r}] must be a string, "
                f"got {type(value).__name__}"
            )


def _parse_entry(
    name: str, entry: Any, path: str, file_index: int, data_start: int, data_size: int
) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise FormatError(f"{where}: entry must be an object, got {type(entry).__name__}")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise FormatError(f"{where}: missing {key!r}")

    dtype_name = entry["dtype"]
    dtype = dtypes.lookup(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise FormatError(f"{where}: unknown dtype {dtype_name!r}")

    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise FormatError(
            f"{where}: shape must be a list of non-negative integers, got {shape!r}"
        )

    offsets = entry["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
    ):
        raise FormatError(
            f"{where}: data_offsets must be [begin, end] integers, got {offsets!r}"
        )
    begin, end = offsets
    if not 0 <= begin <= end:
        raise FormatError(f"{where}: data_offsets [{begin}, {end}] need 0 <= begin <= end")
    if end > data_size:
        raise FormatError(
            f"{where}: data [{begin}, {end}) runs past the end of the file "
            f"(data region is {data_size} bytes)"
        )

    span = end - begin
    bits = _shape_bits(dtype, shape, span)
    if bits is None or bits % 8 or bits // 8 != span:
        if bits is None:
            needs = f"more than {span} bytes"
        elif bits % 8:
            needs = f"{bits} bits, not a whole number of bytes"
        else:
            needs = f"{bits // 8} bytes"
        raise FormatError(
            f"{where}: shape {shape} of {dtype.name} needs {needs}, "
            f"but data_offsets span {span} bytes"
        )
    return TensorInfo(
        name=name,
        file=file_index,
        path=path,
        dtype=dtype.name,
        shape=tuple(shape),
        offset=data_start + begin,
        nbytes=end - begin,
    )


def _shape_bits(dtype: dtypes.DType, shape: list[int], limit: int) -> int | None:
    """Size of ``shape`` in bits, or None once it exceeds ``limit`` bytes
    (and 2**64 bytes, so ordinary mismatches still report the exact size).

    Stops multiplying past the cap so a hostile shape cannot make us build
    astronomically large integers.
    """
    if 0 in shape:
        return 0
    bits = dtype.bits
    cap = max(limit, 2**64) * 8
    for dim in shape:
        bits *= dim
        if bits > cap:
            return None
    return bits


def _check_overlaps(tensors: dict[str, TensorInfo], path: str) -> None:
    # Empty tensors occupy no bytes and cannot overlap anything.
    ranges = sorted(
        (t.offset, t.end, t.name) for t in tensors.values() if t.nbytes > 0
    )
    reach = -1
    reach_name = ""
    for begin, end, name in ranges:
        if begin < reach:
            raise FormatError(
                f"{path}: tensors {reach_name!r} and {name!r} have overlapping data"
            )
        if end > reach:
            reach, reach_name = end, name


def _file_list(items: Sequence[Any]) -> list[str]:
    if len(items) == 0:
        raise FormatError("the list of safetensors files is empty")
    files: list[str] = []
    seen: dict[str, str] = {}
    for item in items:
        spath = os.path.abspath(_fspath(item, "each file in the list"))
        if not os.path.exists(spath):
            raise FormatError(f"{spath}: no such file")
        if not os.path.isfile(spath):
            raise FormatError(f"{spath}: not a regular file")
        real = os.path.realpath(spath)
        if real in seen:
            raise FormatError(f"{spath}: listed twice (also as {seen[real]})")
        seen[real] = spath
        files.append(spath)
    return files


def _read_index(index_path: str) -> tuple[list[str], dict[str, str]]:
    """Shards named by an index file, sorted by name, and its tensor -> shard map."""
    base = os.path.dirname(index_path)
    try:
        with open(index_path, "rb") as fh:
            raw = fh.read(MAX_HEADER_BYTES + 1)
    except OSError as exc:
        raise FormatError(f"{index_path}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) > MAX_HEADER_BYTES:
        raise FormatError(f"{index_path}: larger than {MAX_HEADER_BYTES} bytes")
    index = _load_json(raw, index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise FormatError(f"{index_path}: no 'weight_map' object")
    if not weight_map:
        raise FormatError(f"{index_path}: 'weight_map' is empty")

    shard_of: dict[str, str] = {}
    by_name: dict[str, str] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise FormatError(
                f"{index_path}: tensor {tensor!r} maps to {shard!r}, not a file name"
            )
        # Shards live beside the index; refuse paths that leave the model dir.
        parts = shard.replace("\\", "/").split("/")
        if os.path.isabs(shard) or ".." in parts:
            raise FormatError(
                f"{index_path}: shard {shard!r} is outside the model directory"
            )
        full = by_name.get(shard)
        if full is None:
            full = os.path.normpath(os.path.join(base, shard))
            if not os.path.isfile(full):
                raise FormatError(
                    f"{index_path}: shard {shard!r} (holding {tensor!r}) is missing: "
                    f"{full} does not exist"
                )
            by_name[shard] = full
        shard_of[tensor] = full
    return [by_name[name] for name in sorted(by_name)], shard_of


def _resolve(source: Any) -> tuple[list[str], dict[str, str] | None, str | None]:
    """Files of a model, plus the index's tensor -> shard map and path if any."""
    if isinstance(source, (list, tuple)):
        return _file_list(source), None, None
    spath = os.path.abspath(_fspath(source, "the model path"))
    if os.path.isdir(spath):
        index_path = os.path.join(spath, INDEX_NAME)
        if os.path.exists(index_path):
            files, shard_of = _read_index(index_path)
            return files, shard_of, index_path
        try:
            names = sorted(os.listdir(spath))
        except OSError as exc:
            raise FormatError(f"{spath}: cannot list: {exc.strerror or exc}") from exc
        files = [
            os.path.join(spath, n)
            for n in names
            # Skip dotfiles such as macOS "._x.safetensors" resource forks.
            if n.endswith(".safetensors")
            and not n.startswith(".")
            and os.path.isfile(os.path.join(spath, n))
        ]
        if not files:
            raise FormatError(f"{spath}: directory holds no .safetensors files")
        return files, None, None
    if not os.path.exists(spath):
        raise FormatError(f"{spath}: no such file or directory")
    if not os.path.isfile(spath):
        raise FormatError(f"{spath}: not a regular file or directory")
    if spath.endswith(".index.json"):
        files, shard_of = _read_index(spath)
        return files, shard_of, spath
    return [spath], None, None


def resolve_files(source: ModelSource) -> list[str]:
    """The safetensors files of a model, as absolute paths.

    ``source`` is one of:

    * a directory: with ``model.safetensors.index.json``, the shards its
      ``weight_map`` names (sorted, each must exist); otherwise every
      ``*.safetensors`` file in it (sorted, dotfiles skipped);
    * a single ``.safetensors`` file (or an ``*.index.json`` file, read as above);
    * a list or tuple of files (str or PathLike), kept in the given order.

    Missing files, an empty directory or list, and a file listed twice raise
    FormatError.
    """
    return _resolve(source)[0]


def read_model_tensors(source: ModelSource) -> tuple[list[str], dict[str, TensorInfo]]:
    """Resolve a model's files and merge all their headers.

    Returns ``(files, tensors)``; ``tensors[name].file`` indexes ``files``.
    A tensor present in two files is an error, and so is an index entry whose
    tensor is missing or sits in a different shard than the index says.
    """
    files, shard_of, index_path = _resolve(source)
    merged: dict[str, TensorInfo] = {}
    for file_index, path in enumerate(files):
        for name, info in read_header(path, file_index).items():
            earlier = merged.get(name)
            if earlier is not None:
                raise FormatError(
                    f"tensor {name!r} appears in both {earlier.path} and {path}"
                )
            merged[name] = info
    if shard_of is not None:
        for name, shard in shard_of.items():
            found = merged.get(name)
            if found is None:
                raise FormatError(
                    f"{index_path}: maps tensor {name!r} to {shard}, "
                    "but that file does not hold it"
                )
            if found.path != shard:
                raise FormatError(
                    f"{index_path}: maps tensor {name!r} to {shard}, "
                    f"but it is in {found.path}"
                )
    return files, merged


def read_ints(info: TensorInfo, max_bytes: int, expected: str) -> np.ndarray:
    """The values of a small I32 or I64 tensor (a ``weight_shape``) in its
    shape, read from its file. FormatError naming the tensor, saying it must
    be ``expected``, when it has another dtype or more than ``max_bytes``."""
    if info.dtype not in ("I32", "I64") or info.nbytes > max_bytes:
        raise FormatError(f"tensor {info.name!r} ({info.path}) must be {expected}, not "
                          f"{info.dtype}{list(info.shape)}")
    return read_array(info)


def read_array(info: TensorInfo) -> np.ndarray:
    """A tensor's values in its shape and numpy dtype (bfloat16 and fp8
    through ml_dtypes), read from its file into a new writable array.
    FormatError for a dtype numpy cannot hold or a file that ends early."""
    dt = dtypes.lookup(info.dtype)
    if dt is None or dt.numpy is None:
        raise FormatError(f"tensor {info.name!r} ({info.path}) is {info.dtype}, which numpy cannot hold")
    out = np.empty(info.shape, dtype=dt.numpy.newbyteorder("<"))
    if out.nbytes != info.nbytes:
        raise FormatError(f"tensor {info.name!r} ({info.path}): {info.nbytes} bytes for "
                          f"{info.dtype}{list(info.shape)}")
    try:
        with open(info.path, "rb") as f:
            f.seek(info.offset)
            got = f.readinto(out.reshape(-1).view(np.uint8).data)
    except OSError as exc:
        raise FormatError(f"cannot read {info.name!r} from {info.path}: {exc}") from None
    if got != info.nbytes:
        raise FormatError(f"{info.path} ends inside tensor {info.name!r}")
    return out
