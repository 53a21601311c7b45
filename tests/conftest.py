"""Shared test setup: hypothesis profiles, synthetic models, expected bytes.

Hypothesis profile, chosen by ``COLIBRI_HYPOTHESIS_PROFILE``:

    dev   (default)  quick: 30 examples, no deadline
    ci               100 examples, no deadline, too_slow health check off
    fuzz             2000 examples, no deadline

Synthetic models built here are session-scoped and shared: tests must not
modify their files. A test that damages a file builds its own model in its
own ``tmp_path`` (see ``fresh_model``).

The helpers below are plain functions too, importable as ``from conftest
import ...`` (this directory is put on ``sys.path`` so that works under every
pytest import mode).

The suite runs against the test build of the C core (tests/core_control.py),
installed here before anything imports colibri.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

import core_control  # noqa: E402

core_control.install()  # before colibri is imported: every store is the test build's

from colibri.synthetic import SyntheticModel, write_synthetic_model  # noqa: E402

settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("COLIBRI_HYPOTHESIS_PROFILE", "dev"))

ROLES = ("gate", "up", "down")


# ---------------------------------------------------------------------------
# plain helpers


# How long a state that must come is polled for before a test calls it a hang.
LIVENESS_S = 30.0


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll until condition() holds; fail after LIVENESS_S. Bounds a wait, asserts no timing."""
    deadline = time.monotonic() + LIVENESS_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


def load_all_tensors(model: SyntheticModel) -> dict[str, np.ndarray]:
    """Every tensor of the model, read with safetensors.numpy.load_file."""
    return load_safetensors(model.files)


def load_safetensors(files) -> dict[str, np.ndarray]:
    """Every tensor of these .safetensors files (or of every one in a
    directory), read with safetensors.numpy.load_file."""
    from safetensors.numpy import load_file

    if isinstance(files, Path):
        files = sorted(files.glob("*.safetensors"))
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def gptq_group_order(words: np.ndarray, g_idx: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """What a store holds of a GPTQ matrix (int32 words ``(in / 8, out)``)
    and its g_idx, worked out here in numpy: with act order in the format's
    groups of ``group`` rows (a multiple of 8), the rows moved into group
    order and g_idx entry ``j`` made ``-1 -`` the input row ``j`` holds;
    anything else as it is."""
    g = np.asarray(g_idx).astype(np.int64)
    rows = g.size
    groups = -(-rows // group)
    want = np.minimum(group, rows - np.arange(groups) * group)
    if (group % 8 or g.min() < 0 or g.max() >= groups or np.array_equal(g, np.arange(rows) // group)
            or not np.array_equal(np.bincount(g, minlength=groups), want)):
        return words, g_idx
    order = np.argsort(g, kind="stable")
    u = np.asarray(words).view(np.uint32)
    nibbles = (u[:, None, :] >> (4 * np.arange(8, dtype=np.uint32))[None, :, None]) & 15
    moved = nibbles.reshape(rows, -1)[order].reshape(rows // 8, 8, -1)
    held = np.bitwise_or.reduce(moved << (4 * np.arange(8, dtype=np.uint32))[None, :, None], axis=1)
    return held.astype(np.uint32).view(np.int32), (-1 - order).astype(np.int32)


def assert_lease_parts_equal_safetensors(path: Path, *, prefetch_workers: int = 0) -> int:
    """Leases every expert of the checkpoint in ``path`` and checks each part
    (named "tensor", or "tensor[e]" for expert e of a stacked tensor) against
    what safetensors loads: shape, dtype, bytes, read-only. GPTQ matrices with
    act order are checked against :func:`gptq_group_order` of what
    safetensors loads. Returns the number of parts checked."""
    import colibri
    from colibri._ffi import lib
    from colibri.checkpoint.scan import scan_model

    tensors = load_safetensors(path)
    model = scan_model(path)
    checked = 0
    with colibri.open_store(path, slots_per_layer=2, prefetch_workers=prefetch_workers) as store:
        for layer, expert in model.keys():
            info = model.expert(layer, expert)
            with store.lease(layer, expert) as ex:
                parts = ex.parts
                assert list(parts) == [n for n in info.part_names() if n is not None]
                wants = {}
                for name, where in zip(info.part_names(), info.part_infos()):
                    if name is None:
                        continue
                    assert where is not None
                    if where.name.endswith("]"):
                        base, index = where.name[:-1].rsplit("[", 1)
                        wants[name] = tensors[base][int(index)]
                    else:
                        wants[name] = tensors[where.name]
                for role in ("gate", "up", "down"):
                    block = info.block_shape(role) if f"{role}_g_idx" in wants else None
                    if block is not None and info.coli_format(role) == int(lib.COLI_TENSOR_INT4_GPTQ):
                        wants[role], wants[f"{role}_g_idx"] = gptq_group_order(
                            wants[role], wants[f"{role}_g_idx"], block[0])
                for name, want in wants.items():
                    got = parts[name]
                    assert got.shape == want.shape and got.dtype == want.dtype
                    assert not got.flags.writeable
                    assert got.tobytes() == want.tobytes(), (layer, expert, name)
                    checked += 1
                del parts, got
    return checked


_EXPECTED_CACHE: dict[Path, dict] = {}


def expected_experts(model: SyntheticModel) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """``{(layer, expert): {"gate": array, "up": array, "down": array}}`` from the files.

    Cached per model directory; only for models whose files never change.
    """
    key = Path(model.path).resolve()
    cached = _EXPECTED_CACHE.get(key)
    if cached is None:
        tensors = load_all_tensors(model)
        cached = {
            (layer, expert): {role: tensors[name] for role, name in model.tensor_names(layer, expert).items()}
            for layer, expert in model.keys()
        }
        _EXPECTED_CACHE[key] = cached
    return cached


def expert_digests(model: SyntheticModel) -> dict[tuple[int, int], tuple[bytes, bytes, bytes]]:
    """blake2b digests of (gate, up, down) bytes per expert, from the files."""
    return {
        key: tuple(hashlib.blake2b(parts[role].tobytes()).digest() for role in ROLES)
        for key, parts in expected_experts(model).items()
    }


def lease_digests(ex) -> tuple[bytes, bytes, bytes]:
    return tuple(hashlib.blake2b(getattr(ex, role).tobytes()).digest() for role in ROLES)


def assert_expert_matches(ex, expected: dict[str, np.ndarray]) -> None:
    """The leased arrays equal the file's tensors: dtype, shape and every byte."""
    for role in ROLES:
        got = getattr(ex, role)
        want = expected[role]
        assert isinstance(got, np.ndarray), f"{role}: {type(got)!r} is not a numpy array"
        assert got.dtype == want.dtype, f"{role}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{role}: shape {got.shape} != {want.shape}"
        assert got.tobytes() == want.tobytes(), f"{role} of {ex.key}: bytes differ from the file"


def safetensors_header(path) -> tuple[int, dict]:
    """(data start offset, parsed header) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n, header


def tensor_ranges(model: SyntheticModel) -> dict[str, tuple[Path, int, int]]:
    """name -> (file, absolute begin, absolute end) for every tensor of the model."""
    out: dict[str, tuple[Path, int, int]] = {}
    for f in model.files:
        start, header = safetensors_header(f)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            out[name] = (Path(f), start + begin, start + end)
    return out


def assert_same_greedy(model, reference, bound: float) -> None:
    """Greedy generation of 8 tokens after a 7-token prompt: the same tokens
    from both transformers models, and each step's logits within ``bound``
    of the reference's largest."""
    import torch

    ids = torch.randint(3, reference.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=1, output_logits=True,
                   return_dict_in_generate=True)
    got, want = model.generate(ids, **options), reference.generate(ids, **options)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert float((a.float() - b.float()).abs().max() / b.float().abs().max()) <= bound


def assert_relative_within(got, want, bound: float) -> None:
    """Two torch tensors of one shape and dtype, each value of ``got``
    within ``bound`` of ``want``'s, relative to that value's magnitude."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().clamp_min(1e-30)
    err = float(((got.float() - want.float()).abs() / scale).max())
    assert err <= bound, f"relative error {err}"


def make_model(directory, **kwargs) -> SyntheticModel:
    return write_synthetic_model(directory, **kwargs)


# ---------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """``model_factory(**kwargs)``: a shared read-only synthetic model, one per kwargs."""
    cache: dict[tuple, SyntheticModel] = {}

    def build(**kwargs) -> SyntheticModel:
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            directory = tmp_path_factory.mktemp("model")
            cache[key] = write_synthetic_model(directory, **kwargs)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def small_model(model_factory) -> SyntheticModel:
    """4 decoder layers (layer 0 dense), 3 MoE layers x 8 experts, f32 64x32."""
    return model_factory(layout="mixtral", n_layers=4, n_experts=8, dense_layers=1, dtype="float32")


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> SyntheticModel:
    """2 MoE layers (1 and 2) x 6 experts of 16x8 f32, for many-step hypothesis tests."""
    return model_factory(
        layout="mlp_experts", n_layers=3, n_experts=6, hidden=16, intermediate=8,
        dense_layers=1, dtype="float32",
    )


@pytest.fixture
def fresh_model(tmp_path) -> SyntheticModel:
    """A model of this test's own, in its tmp_path: the test may damage its files."""
    return write_synthetic_model(tmp_path / "model", n_layers=3, n_experts=6, dense_layers=1, seed=7)


@pytest.fixture
def expected():
    """``expected(model)`` -> expected expert tensors, as in :func:`expected_experts`."""
    return expected_experts


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module of tiny models: faster, and far faster
    on a shared, busy machine (the colibri.hf tests use it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
