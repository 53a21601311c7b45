"""A torch module's submodules and parameters, looked up without
``nn.Module.__getattr__``.

``module.weight`` on an ``nn.Module`` misses the instance's ``__dict__``
and ends in ``nn.Module.__getattr__``, a Python function that searches the
module's parameters, buffers and submodules, and raises (formatting a
message) when none has the name. A one-token decode step asks this of
dozens of modules per layer; these look in the same dictionaries, in the
same order, and give the same object.
"""

from __future__ import annotations

from typing import Any

__all__ = ["child", "parameter"]


def child(module: Any, name: str) -> Any:
    """``module.<name>`` for a submodule: where nn.Module's ``__getattr__``
    finds it (its ``_modules``), without that Python call on the hot path,
    when neither the instance's ``__dict__`` nor its class has the name and
    no parameter or buffer takes it; else the ordinary lookup."""
    d = module.__dict__
    if name not in d and not hasattr(type(module), name):
        found = d.get("_modules", {}).get(name)
        if found is not None and name not in d.get("_parameters", ()) and name not in d.get("_buffers", ()):
            return found
    return getattr(module, name)


def parameter(module: Any, name: str) -> Any:
    """``module.<name>`` for a parameter, found as :func:`child` finds a
    submodule (its ``_parameters``); None when the module has no such
    attribute."""
    d = module.__dict__
    if name not in d and not hasattr(type(module), name):
        params = d.get("_parameters")
        if params is not None and name in params:
            return params[name]
    return getattr(module, name, None)
