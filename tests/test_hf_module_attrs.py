"""colibri.hf.module_attrs: a module's submodules and parameters found
without nn.Module.__getattr__, which must be the very objects ordinary
attribute lookup gives, however they were set.

Needs torch; skipped without it."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from colibri.hf.module_attrs import child, parameter  # noqa: E402


class _Shadowed(torch.nn.Linear):
    """A class whose ``weight`` and ``inner`` are properties."""

    @property  # type: ignore[override]
    def weight(self) -> Any:
        return "the property"

    @property
    def inner(self) -> Any:
        return "the inner property"


def _cases() -> dict[str, tuple[Any, str]]:
    linear = torch.nn.Linear(3, 2, bias=False)
    replaced = torch.nn.Linear(3, 2)
    replaced.weight = torch.nn.Parameter(torch.ones(2, 3))
    in_dict = torch.nn.Linear(3, 2)
    del in_dict.weight
    object.__setattr__(in_dict, "weight", torch.zeros(1))      # an instance attribute, not a parameter
    outer = torch.nn.Module()
    outer.inner = torch.nn.Linear(2, 2)
    shadowed = _Shadowed.__new__(_Shadowed)
    torch.nn.Module.__init__(shadowed)
    shadowed.register_module("sub", torch.nn.Identity())
    return {
        "parameter": (linear, "weight"),
        "no bias (registered as None)": (linear, "bias"),
        "replaced parameter": (replaced, "weight"),
        "instance attribute": (in_dict, "weight"),
        "missing": (linear, "scale"),
        "submodule": (outer, "inner"),
        "class property": (shadowed, "weight"),
        "submodule of a class with properties": (shadowed, "sub"),
    }


@pytest.mark.parametrize("name", sorted(_cases()))
def test_parameter_is_what_getattr_gives(name: str) -> None:
    module, attr = _cases()[name]
    assert parameter(module, attr) is getattr(module, attr, None)


@pytest.mark.parametrize("name", ["submodule", "submodule of a class with properties", "parameter"])
def test_child_is_what_getattr_gives(name: str) -> None:
    module, attr = _cases()[name]
    assert child(module, attr) is getattr(module, attr)


def test_a_missing_child_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such"):
        child(torch.nn.Linear(2, 2), "no_such")


def test_a_class_property_wins_over_a_submodule_of_the_same_name() -> None:
    module = _Shadowed.__new__(_Shadowed)
    torch.nn.Module.__init__(module)
    module._modules["inner"] = torch.nn.Identity()     # what nn.Module's lookup would give without the property
    assert child(module, "inner") == "the inner property" == module.inner
