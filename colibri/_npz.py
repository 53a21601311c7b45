"""The numpy archives (.npz) colibri keeps, routing traces and usage
histories: read with every failure a FormatError naming the file, written so
that readers see the old file or the new one, never half of either."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np

from colibri.errors import FormatError

PathLike = Union[str, "os.PathLike[str]"]


def load_npz(path: PathLike, what: str, required: Sequence[str],
             optional: Sequence[str] = ()) -> tuple[str, dict[str, np.ndarray]]:
    """Reads the arrays ``required`` and those of ``optional`` that are
    present from the archive at ``path``. ``what`` names the kind of file
    (e.g. "routing trace file") in the messages. A missing file, one that is
    not an archive of arrays, one without a required array, damaged bytes or
    a pickled object array is a FormatError naming the file (and the missing
    arrays). Returns the path as text, for the caller's own messages, and the
    arrays by name."""
    where = os.fspath(path)
    try:
        with np.load(where, allow_pickle=False) as z:
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise FormatError(f"{where}: not a {what} (not a .npz archive of arrays)")
            missing = [n for n in required if n not in z.files]
            if missing:
                raise FormatError(f"{where}: not a {what}: no {', '.join(missing)} "
                                  f"array{'s' if len(missing) > 1 else ''}")
            return where, {n: z[n] for n in (*required, *optional) if n in z.files}
    except FormatError:
        raise
    except FileNotFoundError:
        raise FormatError(f"{where}: no such {what}") from None
    except Exception as exc:  # zipfile and numpy raise many kinds on damaged bytes
        raise FormatError(f"{where}: corrupt or unreadable {what} ({exc})") from None


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
