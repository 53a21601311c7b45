"""cffi builder (API mode, out of line) for colibri's C core, and the
CPython extension of the lease type (csrc/py_lease.c), built with the same flags.

The cdef is read from the headers themselves, so they stay the single source
of truth: the public headers with '#' lines dropped and the bodies of static
inline functions cut down to declarations, the error codes' enums from the
private coli_errors.h, and the old names of the compatibility header.

Two builds share the sources. ``ffibuilder`` is the product: the package
installs it. ``make_builder(test=True)`` is the test build of the core: the
same sources compiled with -DCOLI_TEST_CONTROL plus ls_test_control.c, and
coli_test_control in its cdef. The test suite builds it once per source
hash (``build_test_core``) and runs against it; the product has no test
control at all.

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
MODULE = "colibri._colibri_cffi"
PUBLIC_HEADERS = ("tensor.h", "expert_store.h", "coli_sources.h", "ffn.h", "rms_norm.h", "router_topk.h",
                  "rotary.h", "decode_attention.h", "decode_layer.h", "coli_store.h")
COMPAT_HEADER = "lru_store.h"           # the names before the rename, for one release
ERRORS_HEADER = "coli_errors.h"         # private: only its anonymous enums go to cdef
SOURCES = ("ls_api.c", "ls_create.c", "ls_lookup.c", "ls_prefetch.c", "ls_slots.c", "ls_policy.c",
           "ls_wait.c", "ls_stats.c", "expert_reader.c", "coli_formats.c", "io_pool.c",
           "ffn.c", "ffn_scalar.c", "ffn_x86.c", "ffn_neon.c", "compute_pool.c", "coli_kernels.c",
           "ls_ffn.c", "rms_norm.c", "router_topk.c", "rotary.c", "decode_attention.c",
           "decode_layer.c", "gptq_group_order.c")
LIBRARIES = ("pthread", "m")  # m: expf and ldexpf of the kernels
# The test build only: the control, its header and the define that compiles it in.
TEST_CONTROL_HEADER = "coli_test_control.h"
TEST_SOURCES = ("ls_test_control.c",)
TEST_DEFINE = "COLI_TEST_CONTROL"


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


def _aliases(compat_text: str, cdef_text: str) -> str:
    """The compatibility header as cdef reads it: its typedefs, and for each
    ``#define old_name new_name`` of a function, new_name's declaration
    under old_name (the C macro then maps cffi's call to the new function)."""
    out = [_declarations(compat_text)]
    for old, new in re.findall(r"^#define\s+(coli_\w+)\s+(coli_\w+)\s*$", compat_text, re.M):
        found = re.search(r"^[A-Za-z_][^;{}\n]*?\b" + new + r"\([^;]*\);", cdef_text, re.M)
        if not found:
            raise ValueError(f"{COMPAT_HEADER}: {old} names {new}, which no public header declares")
        out.append(found.group(0).replace(new + "(", old + "(", 1))
    return "\n".join(out)


def _read(name: str) -> str:
    return open(os.path.join(CSRC, name), encoding="utf-8").read()


def _cdef(test: bool = False) -> str:
    """The product's cdef; with test, the test build's (plus coli_test_control)."""
    text = "\n".join([_enums(_read(ERRORS_HEADER)), *(_declarations(_read(h)) for h in PUBLIC_HEADERS)])
    text += "\n" + _aliases(_read(COMPAT_HEADER), text)
    if test:
        text += "\n" + _declarations(_read(TEST_CONTROL_HEADER))
    return text


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


def make_builder(test: bool = False) -> FFI:
    """The core's builder: the product, or (test) the test build, which is
    compiled with -DCOLI_TEST_CONTROL, ls_test_control.c and -Werror."""
    builder = FFI()
    builder.cdef(_cdef(test))
    compile_args, link_args = _compile_args()
    headers = ["coli_store.h", COMPAT_HEADER, "ffn.h", "rms_norm.h", "router_topk.h", "rotary.h",
               "decode_attention.h", "decode_layer.h"]
    if test:
        compile_args += [f"-D{TEST_DEFINE}", "-Werror"]
        headers.append(TEST_CONTROL_HEADER)
    builder.set_source(
        MODULE,
        "".join(f'#include "{h}"\n' for h in headers),
        sources=[os.path.join(CSRC, s) for s in SOURCES + (TEST_SOURCES if test else ())],
        include_dirs=[CSRC],
        depends=[os.path.join(CSRC, h) for h in os.listdir(CSRC) if h.endswith(".h")],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        libraries=list(LIBRARIES),
    )
    return builder


ffibuilder = make_builder()
_compile, _link = _compile_args()


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


def build_test_core(directory: str) -> str:
    """Compiles the test build of the core into directory (made if missing)
    and returns the path of its module file. It keeps the product's module
    name, so a process that loads it in the product's place (the test
    suite's conftest) runs every test against it; cffi's compile reads
    ./pyproject.toml, as in build_in_place."""
    os.makedirs(directory, exist_ok=True)
    return str(make_builder(test=True).compile(tmpdir=directory, verbose=False))


if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
