"""The shape of the Python package, read from its source: no import loop,
no module reaching into another's private names, and modules and functions
of a readable size (docs/design.md, "Size limits", names the exceptions and
says why)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "colibri"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute name a ``from ... import`` names (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if _is_package(module) else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import
    of a colibri module, wherever it is in the file (a function's lazy
    import is a dependency too)."""
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "colibri"]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if source.split(".")[0] != "colibri":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                # "from package import submodule" depends on the submodule only
                found.append((sub, None, node.lineno) if sub in MODULES else (source, alias.name, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    return {m: {target for target, _, _ in _imports(m) if target in MODULES and target != m}
            for m in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Some import loop, as the list of modules around it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_has_no_loop() -> None:
    graph = _graph()
    assert graph["colibri.checkpoint.scan"] >= {"colibri.checkpoint.naming", "colibri.formats"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_loop_finder_finds_a_loop() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_imports_private_names_of_another() -> None:
    offences = []
    for module, path in MODULES.items():
        for source, name, line in _imports(module):
            if name is not None and _private(name):
                offences.append(f"{path.relative_to(ROOT)}:{line}: {name} from {source}")
        aliases = _module_aliases(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in aliases and _private(node.attr):
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not offences, "\n".join(offences)


def _module_aliases(module: str) -> set[str]:
    """Names a module binds to other colibri modules (``from colibri import x``, ``import colibri.x as y``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.asname and a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            names |= {a.asname or a.name for a in node.names if f"{source}.{a.name}" in MODULES}
    return names


def _exceptions() -> str:
    """docs/design.md's "Size limits" section: the long modules and functions it explains."""
    text = (ROOT / "docs" / "design.md").read_text()
    found = re.search(r"^## Size limits\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert found, "docs/design.md has no 'Size limits' section"
    return found.group(1)


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function without its docstring."""
    first = node.body[0]
    documented = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
        and isinstance(first.value.value, str) and len(node.body) > 1
    start = first.end_lineno + 1 if documented and first.end_lineno else node.lineno
    assert node.end_lineno is not None
    return node.end_lineno - start + 1


def test_modules_and_functions_are_of_a_readable_size() -> None:
    explained = _exceptions()
    offences = []
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES and f"`{rel}`" not in explained:
            offences.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and _function_lines(node) > MAX_FUNCTION_LINES and f"`{rel}:{node.name}`" not in explained:
                offences.append(f"{rel}:{node.name}: {_function_lines(node)} lines")
    assert not offences, "over the limits and not explained in docs/design.md:\n" + "\n".join(offences)


def test_every_module_imports_alone() -> None:
    """Each module imports first, with no other colibri module loaded (an
    import loop that bites in only some import order shows up here)."""
    import subprocess
    import sys

    script = "\n".join([
        "import importlib, sys",
        f"for name in {sorted(MODULES)!r}:",
        "    for loaded in [m for m in sys.modules if m == 'colibri' or m.startswith('colibri.')]:",
        "        del sys.modules[loaded]",
        "    importlib.import_module(name)",
    ])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
