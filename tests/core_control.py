"""The test build of the C core, and the control only it has.

The installed package's core has no test control (tests/test_build.py checks
that). The suite runs against a test build instead, as SQLite's tests run
against a testable build: ``build_ffi.make_builder(test=True)`` compiles the
same sources with ``-DCOLI_TEST_CONTROL`` and ``coli_test_control``, under
the product's module name. :func:`install` (called by conftest.py before
anything imports colibri) loads it in the product's place, so every store a
test opens is a store of the test build. It is built once per hash of the
sources and build flags into ``build/test-core/`` (or
``$COLIBRI_TEST_CORE_CACHE``); ``$COLIBRI_TEST_CORE`` names a directory
built beforehand (.ci/sanitizers builds a sanitized one there).

The functions below reach the control for one store.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import build_ffi  # noqa: E402

_FLAGS = ("COLIBRI_SANITIZE", "COLIBRI_DEBUG")


def _key() -> str:
    """A hash of what the build depends on: sources, builder, flags, interpreter."""
    import cffi

    h = hashlib.blake2b(digest_size=12)
    for path in sorted((ROOT / "csrc").iterdir()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update((ROOT / "build_ffi.py").read_bytes())
    for name in _FLAGS:
        h.update(f"{name}={os.environ.get(name, '')}".encode())
    h.update(f"{sys.version}|{sysconfig.get_config_var('SOABI')}|{cffi.__version__}".encode())
    return h.hexdigest()


def _module_file(directory: Path) -> Path:
    found = sorted(directory.glob("colibri/_colibri_cffi*.so"))
    if not found:
        raise FileNotFoundError(f"no test build of the core in {directory}")
    return found[0]


def build() -> Path:
    """The test build's module file: $COLIBRI_TEST_CORE's, or the cached one
    for this hash, compiled first if missing."""
    given = os.environ.get("COLIBRI_TEST_CORE")
    if given:
        return _module_file(Path(given))
    cache = Path(os.environ.get("COLIBRI_TEST_CORE_CACHE", ROOT / "build" / "test-core"))
    target = cache / _key()
    if not target.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="building-", dir=cache))
        here = os.getcwd()
        try:
            os.chdir(ROOT)  # cffi's compile reads ./pyproject.toml
            build_ffi.build_test_core(str(scratch))
        finally:
            os.chdir(here)
        try:
            scratch.rename(target)
        except OSError:  # another process finished the same build first
            shutil.rmtree(scratch, ignore_errors=True)
    return _module_file(target)


def install() -> None:
    """Load the test build as ``colibri._colibri_cffi`` for this process.
    Must run before colibri is imported."""
    name = build_ffi.MODULE
    loaded = sys.modules.get(name)
    if loaded is not None:
        if not hasattr(loaded.lib, "coli_test_control"):
            raise RuntimeError(f"{name} was imported before the test build was installed")
        return
    spec = importlib.util.spec_from_file_location(name, build())
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module


def _control(store: Any, op: str, *args: Any) -> int:
    from colibri._ffi import lib

    handle = getattr(store, "_handle", store)  # a Store, or a raw handle
    return int(lib.coli_test_control(handle, getattr(lib, op), *args))


def inject_read_fault(store: Any, nth: int, errno_value: int) -> None:
    """The nth read from now (1: the next) fails with errno_value; 0 disarms."""
    from colibri._ffi import ffi

    _control(store, "COLI_TEST_READ_FAULT", ffi.cast("uint64_t", nth), ffi.cast("int", errno_value))


def hold_prefetch_reads(store: Any, hold: bool) -> None:
    """While held, prefetch reads a worker has begun wait before each chunk."""
    from colibri._ffi import ffi

    _control(store, "COLI_TEST_HOLD_PREFETCH", ffi.cast("int", int(bool(hold))))


def held_prefetch_reads(store: Any) -> int:
    """Prefetch reads waiting on the hold now."""
    return _control(store, "COLI_TEST_HELD_PREFETCH")


def slot_bytes(store: Any, layer: int) -> int:
    """Bytes of each slot of layer (its slot memory's stride); 0 for no such layer."""
    from colibri._ffi import ffi

    out = ffi.new("uint64_t *")
    _control(store, "COLI_TEST_SLOT_BYTES", ffi.cast("int", layer), out)
    return int(out[0])


def prefetch_chunk(store: Any) -> int:
    """The size of the chunks prefetch reads go in, as the store resolved it."""
    from colibri._ffi import ffi

    out = ffi.new("uint64_t *")
    _control(store, "COLI_TEST_PREFETCH_CHUNK", out)
    return int(out[0])
