"""The colibri exception family.

Every error the package raises is a :class:`ColibriError`. Where a builtin
exception says the same thing, the error inherits from it too, so callers can
catch either: an unknown expert is also a ``KeyError``, a failed read also an
``OSError``, a malformed file or layout also a ``ValueError``.
"""

from __future__ import annotations

from colibri._ffi import lib

__all__ = [
    "ColibriError",
    "UnknownExpertError",
    "ExpertLoadError",
    "CacheFullError",
    "LeaseError",
    "StoreClosedError",
    "FormatError",
    "WaitTimeoutError",
    "CacheMemoryError",
]


class ColibriError(Exception):
    """Base class of every error raised by colibri."""


class UnknownExpertError(ColibriError, KeyError):
    """A (layer, expert) key that the model does not have."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class ExpertLoadError(ColibriError, OSError):
    """Reading an expert from disk failed; the message names file and offset."""


class CacheFullError(ColibriError):
    """Every slot of a layer stayed leased until the slot wait timeout."""


class LeaseError(ColibriError):
    """A lease was used against the contract (after release, released twice...)."""


class StoreClosedError(ColibriError):
    """A call on a store that has been closed."""


class FormatError(ColibriError, ValueError):
    """A malformed safetensors file, an unusable layout or a bad configuration."""


class WaitTimeoutError(ColibriError, TimeoutError):
    """A wait for outstanding loads ended at its timeout."""


class CacheMemoryError(ColibriError, MemoryError):
    """The cache's slot memory (or the store's bookkeeping) could not be allocated."""


# The C error codes (COLI_E* of csrc/coli_errors.h, read from the compiled
# library) mapped to the classes above. The codes left out (COLI_EINVAL,
# COLI_ETHREAD, COLI_EAGAIN) become a plain ColibriError; docs/contract.md
# says what each code means.
_BY_CODE: dict[int, type[ColibriError]] = {
    lib.COLI_ENOTFOUND: UnknownExpertError,
    lib.COLI_EFULL: CacheFullError,
    lib.COLI_EIO: ExpertLoadError,
    lib.COLI_ENOMEM: CacheMemoryError,
    lib.COLI_ECONFIG: FormatError,
    lib.COLI_ELEASE: LeaseError,
    lib.COLI_ETIMEOUT: WaitTimeoutError,
    lib.COLI_ECLOSED: StoreClosedError,
}


def error_for(code: int, message: str) -> ColibriError:
    """The exception for a negative C return code, carrying C's message."""
    cls = _BY_CODE.get(code, ColibriError)
    return cls(message or f"colibri C core failed with code {code}")
