"""The C core's files depend on each other one way: no header includes
itself through others, and no two source files call each other (directly
or round a longer loop), in the product and in the test build."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import build_ffi_loader  # noqa: F401  (puts the project root on sys.path)
from build_ffi import SOURCES, TEST_DEFINE, TEST_SOURCES

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """A loop of graph (node -> nodes it depends on), or [] when there is none."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_header_includes_itself() -> None:
    graph = {
        path.name: set(re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M))
        for path in CSRC.iterdir() if path.suffix in (".h", ".c")
    }
    assert _cycle(graph) == []


def _symbols(obj: Path) -> tuple[set[str], set[str]]:
    """(defined, undefined) global symbols of an object file."""
    out = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[-2] == "U":
            undefined.add(parts[-1])
        elif len(parts) == 3 and parts[1] in "TDRB":
            defined.add(parts[2])
    return defined, undefined


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("nm") is None, reason="needs gcc and nm")
@pytest.mark.parametrize("test_build", [False, True], ids=["product", "test build"])
def test_no_two_source_files_call_each_other(tmp_path: Path, test_build: bool) -> None:
    sources = SOURCES + (TEST_SOURCES if test_build else ())
    flags = [f"-D{TEST_DEFINE}"] if test_build else []
    symbols = {}
    for name in sources:
        obj = tmp_path / (name + ".o")
        subprocess.run(["gcc", "-std=c11", "-O2", "-c", *flags, f"-I{CSRC}", str(CSRC / name), "-o", str(obj)],
                       check=True)
        symbols[name] = _symbols(obj)
    owner = {sym: name for name, (defined, _) in symbols.items() for sym in defined}
    graph = {name: {owner[s] for s in undefined if s in owner} - {name}
             for name, (_, undefined) in symbols.items()}
    assert _cycle(graph) == []
    assert graph["ls_api.c"] >= {"ls_create.c", "ls_lookup.c", "ls_prefetch.c", "ls_stats.c"}  # it saw the calls
