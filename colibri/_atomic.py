"""Write a numpy archive so that readers see the old file or the new one, never half of either."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np


def save_npz_atomically(target: Path, arrays: Mapping[str, Any], *, compressed: bool = False,
                        before_rename: Callable[[str], None] | None = None) -> None:
    """Writes ``arrays`` to a temporary file beside ``target``, flushes it to
    disk and renames it over ``target``. On any failure the temporary file is
    removed and ``target`` is left as it was. ``before_rename`` (tests only)
    runs on the temporary path just before the rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            save = np.savez_compressed if compressed else np.savez
            save(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
