"""The C core under AddressSanitizer+UBSan and ThreadSanitizer.

tests/c/stress_store.c drives the store straight from C (no interpreter, so
the sanitizer runtimes need no preloading): many threads, three slots per
layer, prefetch workers, buffered and O_DIRECT reads, the contract edges
(stale and double releases, lookup into a leased view, NULL store, injected
faults) and destroy with prefetches queued. Any sanitizer report fails it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
import build_ffi_loader  # noqa: E402,F401  (puts the project root on sys.path)
from build_ffi import LIBRARIES, SOURCES as CORE, TEST_DEFINE, TEST_SOURCES  # noqa: E402  (as the test build has them)

# A test build of the core: the product's sources, the test control and its define.
SOURCES = [ROOT / "tests" / "c" / "stress_store.c", *(CSRC / name for name in CORE + TEST_SOURCES)]

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def _build(tmp: Path, sanitize: str) -> Path:
    exe = tmp / f"stress_{sanitize.replace(',', '_')}"
    cmd = ["gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", f"-D{TEST_DEFINE}", "-g", "-O1", "-fno-omit-frame-pointer",
           f"-fsanitize={sanitize}", "-fno-sanitize-recover=all", f"-I{CSRC}",
           *map(str, SOURCES), "-o", str(exe), *(f"-l{lib}" for lib in LIBRARIES)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


@pytest.mark.parametrize("sanitize", ["address,undefined", "thread"])
def test_stress_under_sanitizer(tmp_path: Path, sanitize: str) -> None:
    try:
        exe = _build(tmp_path, sanitize)
    except subprocess.CalledProcessError as exc:
        if "cannot find" in exc.stderr or "-lasan" in exc.stderr or "-ltsan" in exc.stderr:
            pytest.skip(f"no {sanitize} runtime: {exc.stderr.strip()[:200]}")
        raise AssertionError(exc.stderr) from exc
    env = dict(os.environ,
               ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
               TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1")
    proc = subprocess.run([str(exe), str(tmp_path), "6", "1500"], env=env, capture_output=True,
                          text=True, timeout=300)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    assert "Sanitizer" not in report and "runtime error" not in report, report
    assert "all checks passed" in proc.stdout


def test_destroy_with_a_lease_held_asserts(tmp_path: Path) -> None:
    """Contract rule 5: a build with assertions aborts on destroy with leases."""
    exe = tmp_path / "stress_assert"
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", f"-D{TEST_DEFINE}", "-g", "-O0", "-UNDEBUG", f"-I{CSRC}",
                    *map(str, SOURCES), "-o", str(exe), *(f"-l{lib}" for lib in LIBRARIES)], check=True, capture_output=True)
    proc = subprocess.run([str(exe), str(tmp_path), "destroy-leased"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode < 0, proc.stdout + proc.stderr  # killed by SIGABRT
    assert "destroy with active leases" in proc.stderr
    assert "returned" not in proc.stdout
