"""The build itself: the cdef comes from the real headers, a sanitizer run
really loads the sanitized extension, the installed package has no test
control while the suite runs against the test build, and the names of before
the rename still work."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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


# ---- the product has no test control; the suite runs against the test build

HOOK_WORDS = ("test_control", "coli_test", "read_fault", "inject", "hold_prefetch", "held_prefetch", "slot_bytes",
              "gate_hold")


def _hooks(names) -> list[str]:
    return [n for n in names if any(w in n.lower() for w in HOOK_WORDS)]


def _product() -> dict:
    """What a fresh interpreter (no conftest) sees of the installed package."""
    code = (
        "import json, colibri, colibri._colibri_cffi as core\n"
        "from colibri.store import Store\n"
        "print(json.dumps({'file': core.__file__, 'lib': dir(core.lib), 'colibri': dir(colibri),"
        " 'store': dir(Store)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_TEST_CORE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=str(ROOT / "tests"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def _symbols(path: str, *flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # nm under TSan's runtime may crash
    return subprocess.run(["nm", *flags, path], capture_output=True, text=True, env=env).stdout


def test_the_product_has_no_test_control() -> None:
    product = _product()
    assert _hooks(product["lib"]) == [] and "coli_store_lookup" in product["lib"]
    assert _hooks(product["colibri"]) == [] and _hooks(product["store"]) == []
    assert not any(n.startswith("_inject") or n.startswith("_hold") for n in product["store"])
    for flags in (("-D",), ()):   # exported symbols, then the whole symbol table
        assert _hooks(_symbols(product["file"], *flags).split()) == [], flags


def test_the_cdef_of_the_product_has_no_test_control() -> None:
    import build_ffi

    assert _hooks(re.findall(r"\w+", build_ffi._cdef())) == []
    assert "coli_test_control" in build_ffi._cdef(test=True)   # the check above can fail


def test_the_suite_runs_against_the_test_build() -> None:
    import colibri._colibri_cffi as core
    from colibri._ffi import lib

    assert hasattr(lib, "coli_test_control") and lib.COLI_TEST_READ_FAULT == 1
    assert "coli_test_control" in _symbols(core.__file__)
    assert core.__file__ != _product()["file"]


def test_the_old_names_stay_for_one_release(tmp_path: Path) -> None:
    """lru_store.h keeps the names of before the rename, in C and in cffi's lib."""
    from colibri._ffi import ffi, lib

    assert lib.coli_lru_policy_name(0) != ffi.NULL
    assert ffi.string(lib.coli_lru_policy_name(0)) == ffi.string(lib.coli_store_policy_name(0))
    assert ffi.sizeof("ColiLruConfig") == ffi.sizeof("ColiStoreConfig")
    src = tmp_path / "old.c"
    src.write_text('#include "lru_store.h"\n'
                   "int main(void) {\n"
                   "    ColiLruConfig cfg = {0};\n"
                   "    ColiExpertStore *store = NULL;\n"
                   "    char err[COLI_ERR_LEN];\n"
                   "    return coli_lru_store_create(&cfg, &store, err, sizeof err) == COLI_ECONFIG ? 0 : 1;\n"
                   "}\n")
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
                    f"-I{ROOT / 'csrc'}", str(src)], check=True)
