"""How much more memory this process may take, and the cache that fills it.

:func:`available_memory` is the smaller of the system's ``MemAvailable``
and, inside memory cgroups (v1 or v2, every limited ancestor included), each
limit less what its cgroup holds that the kernel would not drop first (its
usage less its inactive file pages). A container's or a systemd unit's limit
is what ends a process there, not the machine's free memory, and
``MemAvailable`` does not see it. The environment variable
``COLIBRI_AVAILABLE_MEMORY`` (bytes) overrides both.

:func:`auto_capacity` is ``open_store(capacity_bytes="auto")``: that memory,
less the checkpoint's other tensors as stored (the engine loads them after
the store opens), less a reserve for activations, the key/value cache,
kernel scratch, the allocator and the page cache of its own libraries (a
quarter of the available memory, at least 512 MiB), at most every routed
expert.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from colibri.checkpoint.experts import ModelExperts
from colibri.errors import FormatError

__all__ = ["AUTO_RESERVE_MIN_BYTES", "AUTO_RESERVE_SHARE", "AVAILABLE_MEMORY_ENV", "auto_capacity",
           "available_memory", "ram_gb_argument"]

#: bytes that replace the available memory: to see what the store would pick on a smaller machine
AVAILABLE_MEMORY_ENV = "COLIBRI_AVAILABLE_MEMORY"
#: the reserve ``capacity_bytes="auto"`` leaves: available // AUTO_RESERVE_SHARE, at least AUTO_RESERVE_MIN_BYTES
AUTO_RESERVE_SHARE = 4
AUTO_RESERVE_MIN_BYTES = 512 << 20
# cgroup v1 writes a huge page-rounded number for "no limit"
_NO_LIMIT = 1 << 60


def available_memory(root: str | os.PathLike[str] = "/") -> int | None:
    """Bytes this process may still take (see the module's description);
    None when neither /proc/meminfo nor a cgroup limit says. ``root`` is
    where /proc and /sys are looked for (tests give a fake tree)."""
    raw = os.environ.get(AVAILABLE_MEMORY_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise FormatError(f"{AVAILABLE_MEMORY_ENV}={raw!r} is not a byte count >= 0")
        return value
    base = Path(root)
    known = [n for n in (_mem_available(base), _cgroup_room(base)) if n is not None]
    return min(known) if known else None


def auto_capacity(model: ModelExperts, available: int | None) -> tuple[int, str]:
    """``capacity_bytes="auto"``'s bytes for ``model`` given ``available``
    memory, and the sum that gave them (for the log). FormatError when the
    available memory is unknown or leaves less than one expert per layer."""
    if available is None:
        raise FormatError(f'capacity_bytes="auto": the available memory is unknown here (no MemAvailable in '
                          f"/proc/meminfo, no cgroup limit); set {AVAILABLE_MEMORY_ENV} or give capacity_bytes")
    experts = model.routed_nbytes()
    stored = 0
    for name in model.files:
        try:
            stored += os.path.getsize(name)
        except OSError as e:
            raise FormatError(f'capacity_bytes="auto": cannot size {name}: {e}') from e
    other = max(0, stored - experts)
    reserve = max(AUTO_RESERVE_MIN_BYTES, available // AUTO_RESERVE_SHARE)
    capacity = min(available - other - reserve, experts)
    why = (f"available {available:,} B - the checkpoint's other tensors {other:,} B - reserve {reserve:,} B "
           f"= {available - other - reserve:,} B (routed experts {experts:,} B)")
    one_each = sum(model.expert_nbytes(l) for l in model.layers)
    if capacity < one_each:
        raise FormatError(f'capacity_bytes="auto": {why}: less than one expert per layer ({one_each:,} B); '
                          "free memory, raise the limit or give capacity_bytes")
    return capacity, why


def ram_gb_argument(text: str) -> float | str:
    """A command line's ``--ram-gb``: a number of GiB, or ``auto``."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of GiB or auto, not {text!r}") from None


def _mem_available(root: Path) -> int | None:
    try:
        with open(root / "proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(root: Path) -> int | None:
    """The least room under any memory limit of this process's cgroups."""
    try:
        lines = (root / "proc/self/cgroup").read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    rooms: list[int] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        relative = path.strip().lstrip("/")
        if "memory" in controllers.split(","):
            room = _v1_room(root / "sys/fs/cgroup/memory", relative)
        elif hierarchy == "0" and not controllers:
            room = _v2_room(root / "sys/fs/cgroup", relative)
        else:
            continue
        if room is not None:
            rooms.append(room)
    return min(rooms) if rooms else None


def _stat(directory: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in (directory / "memory.stat").read_text(encoding="ascii").splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _own_directory(mount: Path, relative: str) -> Path | None:
    """The cgroup's directory; inside a cgroup namespace the mount itself
    is the process's cgroup while /proc/self/cgroup may name a path the
    namespace does not show."""
    for directory in (mount / relative, mount):
        if directory.is_dir():
            return directory
    return None


def _v1_room(mount: Path, relative: str) -> int | None:
    directory = _own_directory(mount, relative)
    if directory is None:
        return None
    stat = _stat(directory)
    limit = stat.get("hierarchical_memory_limit")
    if limit is None:
        limit = _read_int(directory / "memory.limit_in_bytes")
    usage = _read_int(directory / "memory.usage_in_bytes")
    if limit is None or usage is None or limit >= _NO_LIMIT:
        return None
    return max(0, limit - max(0, usage - stat.get("total_inactive_file", 0)))


def _v2_room(mount: Path, relative: str) -> int | None:
    directory = _own_directory(mount, relative)
    if directory is None:
        return None
    rooms: list[int] = []
    while True:   # every ancestor's limit binds too
        limit = _read_int(directory / "memory.max")  # "max": None
        usage = _read_int(directory / "memory.current")
        if limit is not None and usage is not None:
            rooms.append(max(0, limit - max(0, usage - _stat(directory).get("inactive_file", 0))))
        if directory == mount or mount not in directory.parents:
            break
        directory = directory.parent
    return min(rooms) if rooms else None
