"""The build itself: the cdef comes from the real headers, and a sanitizer run
really loads the sanitized extension."""

from __future__ import annotations

import os
import subprocess
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
    import colibri._lease as lease_type

    runtime = "libtsan" if want == "thread" else "libasan"
    assert runtime in Path("/proc/self/maps").read_text()
    for module in (compiled, lease_type):   # both extensions: built here, with the sanitizer
        path = Path(module.__file__ or "")
        assert path.resolve().is_relative_to(Path(os.environ["PYTHONPATH"]).resolve())
        needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
        assert runtime in needed, f"{path.name} is not linked with {runtime}"
