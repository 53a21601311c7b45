"""A function's form as colibri.hf compares it with the formulas it knows:
its arguments (names and defaults) and the statements of its body, each as
``ast.unparse`` writes it, so that layout, comments, type hints and the
docstring do not count."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

__all__ = ["function_form", "source_form"]


def source_form(source: str) -> tuple[str, tuple[str, ...]] | None:
    """(arguments, body statements) of the first function in ``source``, or None."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except (SyntaxError, IndentationError, ValueError):
        return None
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef):
        return None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    args = func.args
    for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
        if arg is not None:
            arg.annotation = None
    return ast.unparse(args), tuple(ast.unparse(s) for s in body)


def function_form(function: Any) -> tuple[str, tuple[str, ...]] | None:
    """:func:`source_form` of a function's source, or None when it cannot be read."""
    if not callable(function):
        return None
    try:
        source = inspect.getsource(function)
    except (TypeError, OSError):
        return None
    return source_form(source)
