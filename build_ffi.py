"""cffi builder (API mode, out of line) for colibri's C core, and the
CPython extension of the lease type (csrc/py_lease.c), built with the same flags.

The cdef is read from the headers themselves, so they stay the single source
of truth: the public headers and the test hooks' header with '#' lines dropped
and the bodies of static inline functions cut down to declarations, and the
error codes' enum from the private coli_errors.h.

Environment:
  COLIBRI_SANITIZE  "address,undefined" or "thread": a sanitizer build (assertions on)
  COLIBRI_DEBUG     "1": -O0 -g with assertions on
  COLIBRI_WERROR    "1": warnings are errors (CI)
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from cffi import FFI

if TYPE_CHECKING:
    from setuptools import Extension

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
PUBLIC_HEADERS = ("tensor.h", "expert_store.h", "lru_store.h", "ffn.h")
ERRORS_HEADER = "coli_errors.h"        # private: only its enum of error codes goes to cdef
TEST_HOOKS_HEADER = "lru_test_hooks.h"  # compiled in, for the tests only
SOURCES = ("lru_store.c", "ls_slots.c", "ls_policy.c", "ls_lookup.c", "ls_prefetch.c",
           "expert_reader.c", "io_pool.c", "ffn.c", "ffn_scalar.c", "ffn_x86.c", "ffn_neon.c",
           "compute_pool.c")
LIBRARIES = ("pthread", "m")


def _declarations(header_text: str) -> str:
    """Header text as cdef can read it."""
    lines = [ln for ln in header_text.splitlines() if not ln.lstrip().startswith("#")]
    text = "\n".join(lines)
    out, pos = [], 0
    for match in re.finditer(r"static\s+inline\s+([^;{]*?\))\s*\{", text):
        out.append(text[pos : match.start()])
        out.append(match.group(1) + ";")
        depth, i = 1, match.end()
        while depth:  # skip the body, braces balanced
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        pos = i
    out.append(text[pos:])
    return "".join(out)


def _enums(header_text: str) -> str:
    """The anonymous enums of a header (its error codes), as cdef reads them."""
    return "\n".join(m.group(0) for m in re.finditer(r"^enum\s*\{.*?^\};", header_text, re.S | re.M))


def _cdef() -> str:
    def read(name: str) -> str:
        return open(os.path.join(CSRC, name), encoding="utf-8").read()

    parts = [_enums(read(ERRORS_HEADER))]
    parts += [_declarations(read(h)) for h in (*PUBLIC_HEADERS, TEST_HOOKS_HEADER)]
    return "\n".join(parts)


def _compile_args() -> tuple[list[str], list[str]]:
    compile_args = ["-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden"]
    link_args: list[str] = []
    sanitize = os.environ.get("COLIBRI_SANITIZE", "").strip()
    if sanitize:
        flags = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g", "-O1", "-UNDEBUG"]
        if "undefined" in sanitize:
            flags.append("-fno-sanitize-recover=undefined")
        compile_args += flags
        link_args += [f"-fsanitize={sanitize}"]
    elif os.environ.get("COLIBRI_DEBUG") == "1":
        compile_args += ["-O0", "-g", "-UNDEBUG"]
    else:
        compile_args += ["-O2"]
    if os.environ.get("COLIBRI_WERROR") == "1":
        compile_args.append("-Werror")
    return compile_args, link_args


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
_compile, _link = _compile_args()
ffibuilder.set_source(
    "colibri._colibri_cffi",
    '#include "lru_store.h"\n#include "lru_test_hooks.h"\n#include "ffn.h"',
    sources=[os.path.join(CSRC, s) for s in SOURCES],
    include_dirs=[CSRC],
    depends=[os.path.join(CSRC, h) for h in os.listdir(CSRC) if h.endswith(".h")],
    extra_compile_args=_compile,
    extra_link_args=_link,
    libraries=list(LIBRARIES),
)


def lease_extension() -> "Extension":
    """colibri._lease: links none of the core (it gets the core's entry
    points from the cffi module at run time), same flags as the core."""
    from setuptools import Extension

    return Extension(
        "colibri._lease",
        sources=[os.path.join("csrc", "py_lease.c")],  # relative: setuptools wants it so
        include_dirs=[CSRC],
        depends=[os.path.join(CSRC, h) for h in PUBLIC_HEADERS],
        extra_compile_args=_compile,
        extra_link_args=_link,
    )


def build_in_place() -> None:
    """Both extensions into ./colibri, for a tree that is not pip-installed
    (.ci/sanitizers). cffi's compile reads ./pyproject.toml, which takes
    setuptools 77 or later (the test extra asks for it)."""
    from setuptools import Distribution

    ffibuilder.compile(tmpdir=".", verbose=False)
    dist = Distribution({"name": "colibri", "ext_modules": [lease_extension()]})
    build = dist.get_command_obj("build_ext")
    build.inplace = True
    dist.run_command("build_ext")


if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
