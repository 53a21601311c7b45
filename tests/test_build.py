"""The build itself: the cdef comes from the real headers, and a sanitizer run
really loads the sanitized extension."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import build_ffi_loader  # noqa: F401  (tests/build_ffi_loader.py puts the project root on sys.path)

ROOT = Path(__file__).resolve().parent.parent


def test_cdef_is_read_from_the_headers() -> None:
    import build_ffi

    text = build_ffi._declarations((ROOT / "csrc" / "expert_store.h").read_text())
    assert "memset" not in text  # inline bodies cut to declarations
    assert "int coli_expert_lookup(ColiExpertStore *store, ColiExpertKey key," in text
    assert not any(line.lstrip().startswith("#") for line in text.splitlines())


def test_exported_wrappers_behave_like_the_header() -> None:
    from colibri._ffi import ffi, lib

    view = ffi.new("ColiExpertView *")
    view.lease = ffi.cast("void *", 1)
    assert lib.coli_expert_lookup(ffi.NULL, (0, 0), view) == -1
    assert view.lease == ffi.NULL


def test_sanitizer_build_is_the_one_loaded() -> None:
    want = os.environ.get("COLIBRI_EXPECT_SANITIZER")
    if not want:
        pytest.skip("not a sanitizer run (.ci/sanitizers sets COLIBRI_EXPECT_SANITIZER)")
    import colibri._colibri_cffi as compiled

    assert Path(compiled.__file__).resolve().is_relative_to(Path(os.environ["PYTHONPATH"]).resolve())
    maps = Path("/proc/self/maps").read_text()
    runtime = "libtsan" if want == "thread" else "libasan"
    assert runtime in maps
