"""The one door to the compiled core: everything else imports ffi and lib from here."""

from __future__ import annotations

try:
    from colibri._colibri_cffi import ffi, lib
    from colibri._lease import LeaseBase, Leaser, Tenancies, Tenancy, copy_views
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "colibri's C core is not built; install the package with `pip install .` "
        "(it compiles csrc/: the core through cffi, the lease type as a CPython "
        "extension). From a source checkout, run `colibri` "
        "rather than `python -m colibri`, or install with `pip install -e .`, so "
        "that the uncompiled source folder does not shadow the installed package"
    ) from exc

__all__ = ["ffi", "lib", "LeaseBase", "Leaser", "Tenancies", "Tenancy", "copy_views"]
