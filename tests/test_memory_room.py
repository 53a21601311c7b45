"""The memory a process may still take (MemAvailable, cgroup v1 and v2
limits, every limited ancestor, a cgroup namespace) read from fake /proc
and /sys trees, and ``open_store(capacity_bytes="auto")``, which fills it
less the checkpoint's other tensors and a reserve."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import colibri
from colibri.checkpoint.scan import scan_model
from colibri import memory_room
from colibri.errors import FormatError
from colibri.memory_room import (AUTO_RESERVE_MIN_BYTES, AUTO_RESERVE_SHARE, AVAILABLE_MEMORY_ENV, auto_capacity,
                                 available_memory)

GiB = 1 << 30
NO_LIMIT_V1 = 9223372036854771712


def fake_tree(root: Path, *, mem_available: int | None = None, cgroup: str = "",
              files: dict[str, str] | None = None) -> Path:
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    if mem_available is not None:
        (root / "proc/meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {mem_available // 1024} kB\n")
    (root / "proc/self/cgroup").write_text(cgroup)
    for name, text in (files or {}).items():
        path = root / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def v1_files(directory: str, *, limit: int, usage: int, inactive_file: int) -> dict[str, str]:
    return {f"memory/{directory}/memory.limit_in_bytes": f"{limit}\n",
            f"memory/{directory}/memory.usage_in_bytes": f"{usage}\n",
            f"memory/{directory}/memory.stat": f"rss 1000\nhierarchical_memory_limit {limit}\n"
                                               f"total_active_file 7\ntotal_inactive_file {inactive_file}\n"}


def v2_files(directory: str, *, limit: int | str, usage: int, inactive_file: int) -> dict[str, str]:
    prefix = f"{directory}/" if directory else ""
    return {f"{prefix}memory.max": f"{limit}\n", f"{prefix}memory.current": f"{usage}\n",
            f"{prefix}memory.stat": f"anon 1000\nactive_file 7\ninactive_file {inactive_file}\n"}


@pytest.fixture(autouse=True)
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AVAILABLE_MEMORY_ENV, raising=False)


def test_meminfo_alone(tmp_path: Path) -> None:
    assert available_memory(fake_tree(tmp_path, mem_available=5 * GiB)) == 5 * GiB


def test_nothing_known_is_none(tmp_path: Path) -> None:
    assert available_memory(fake_tree(tmp_path)) is None


def test_a_v1_limit_counts_usage_less_inactive_file_pages(tmp_path: Path) -> None:
    root = fake_tree(tmp_path, mem_available=10 * GiB, cgroup="5:memory:/jobs/one\n4:cpu:/\n",
                     files=v1_files("jobs/one", limit=2 * GiB, usage=GiB, inactive_file=GiB // 2))
    assert available_memory(root) == 2 * GiB - GiB // 2
    # MemAvailable binds when it is the smaller
    assert available_memory(fake_tree(tmp_path, mem_available=GiB)) == GiB


def test_a_v1_cgroup_without_a_limit_leaves_meminfo(tmp_path: Path) -> None:
    root = fake_tree(tmp_path, mem_available=3 * GiB, cgroup="5:memory:/\n",
                     files=v1_files("", limit=NO_LIMIT_V1, usage=GiB, inactive_file=0))
    assert available_memory(root) == 3 * GiB


def test_a_v1_cgroup_over_its_limit_has_no_room(tmp_path: Path) -> None:
    root = fake_tree(tmp_path, mem_available=3 * GiB, cgroup="5:memory:/a\n",
                     files=v1_files("a", limit=GiB, usage=2 * GiB, inactive_file=0))
    assert available_memory(root) == 0


def test_v2_takes_the_tightest_ancestor(tmp_path: Path) -> None:
    files = {**v2_files("", limit="max", usage=5 * GiB, inactive_file=0),
             **v2_files("user", limit=2 * GiB, usage=3 * GiB // 2, inactive_file=GiB // 2),
             **v2_files("user/app", limit=4 * GiB, usage=GiB, inactive_file=0)}
    root = fake_tree(tmp_path, mem_available=10 * GiB, cgroup="0::/user/app\n", files=files)
    # user/app: 4 - 1 = 3 GiB; user: 2 - (1.5 - 0.5) = 1 GiB
    assert available_memory(root) == GiB


def test_v2_without_limits_leaves_meminfo(tmp_path: Path) -> None:
    files = v2_files("app", limit="max", usage=GiB, inactive_file=0)
    root = fake_tree(tmp_path, mem_available=7 * GiB, cgroup="0::/app\n", files=files)
    assert available_memory(root) == 7 * GiB


def test_a_namespaced_cgroup_reads_the_mount_itself(tmp_path: Path) -> None:
    """In a cgroup namespace /proc/self/cgroup may name a path the mount
    does not show: the mount is then the process's own cgroup."""
    root = fake_tree(tmp_path, mem_available=10 * GiB, cgroup="0::/../../outside\n",
                     files=v2_files("", limit=3 * GiB, usage=GiB, inactive_file=0))
    assert available_memory(root) == 2 * GiB


def test_the_environment_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "12345")
    assert available_memory(fake_tree(tmp_path, mem_available=GiB)) == 12345
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "-1")
    with pytest.raises(FormatError, match=AVAILABLE_MEMORY_ENV):
        available_memory(tmp_path)


@settings(max_examples=60, deadline=None)
@given(mem=st.integers(0, 1 << 40), limit=st.integers(1, 1 << 40), usage=st.integers(0, 1 << 40),
       inactive=st.integers(0, 1 << 40), more=st.integers(0, 1 << 30))
def test_v1_room_is_bounded_and_shrinks_as_usage_grows(tmp_path_factory: pytest.TempPathFactory, mem: int,
                                                        limit: int, usage: int, inactive: int, more: int) -> None:
    inactive = min(inactive, usage)

    def room(used: int) -> int | None:
        root = fake_tree(tmp_path_factory.mktemp("tree"), mem_available=mem, cgroup="3:cpu,memory:/c\n",
                         files=v1_files("c", limit=limit, usage=used, inactive_file=inactive))
        return available_memory(root)

    now, later = room(usage), room(usage + more)
    assert now is not None and later is not None
    assert 0 <= later <= now <= min(limit, mem - mem % 1024)


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory(dtype="float16", n_layers=3, n_experts=8, hidden=64, intermediate=32, dense_layers=1)


def routed(m) -> int:
    return len(m.layers) * m.n_experts * m.expert_nbytes


def other_bytes(m) -> int:
    files = scan_model(m.path).files
    return sum(os.path.getsize(f) for f in files) - routed(m)


def test_auto_capacity_is_the_room_less_the_rest_and_the_reserve(model, monkeypatch: pytest.MonkeyPatch) -> None:
    experts = scan_model(model.path)
    layer_bytes = len(model.layers) * model.expert_nbytes
    assert other_bytes(model) > 0
    # far more room than experts: every expert
    capacity, why = auto_capacity(experts, 10 * AUTO_RESERVE_MIN_BYTES)
    assert capacity == routed(model) and "reserve" in why
    # the least reserve binds in a small room
    capacity, _ = auto_capacity(experts, AUTO_RESERVE_MIN_BYTES + other_bytes(model) + 5 * layer_bytes)
    assert capacity == 5 * layer_bytes
    # the share binds in a large one (the least reserve lowered to reach it with a small model)
    monkeypatch.setattr(memory_room, "AUTO_RESERVE_MIN_BYTES", 1)
    available = (other_bytes(model) + 4 * layer_bytes) * AUTO_RESERVE_SHARE // (AUTO_RESERVE_SHARE - 1) + 64
    capacity, _ = auto_capacity(experts, available)
    assert capacity == available - other_bytes(model) - available // AUTO_RESERVE_SHARE
    assert 4 * layer_bytes <= capacity < routed(model)


def test_auto_capacity_refuses_too_little_or_unknown_memory(model) -> None:
    experts = scan_model(model.path)
    too_little = AUTO_RESERVE_MIN_BYTES + other_bytes(model) + len(model.layers) * model.expert_nbytes - 1
    with pytest.raises(FormatError, match="less than one expert per layer"):
        auto_capacity(experts, too_little)
    with pytest.raises(FormatError, match="unknown"):
        auto_capacity(experts, None)


def test_open_store_auto_sizes_its_slots(model, monkeypatch: pytest.MonkeyPatch) -> None:
    room = AUTO_RESERVE_MIN_BYTES + other_bytes(model) + 3 * len(model.layers) * model.expert_nbytes
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(room))
    with colibri.open_store(model.path, capacity_bytes="auto", prefetch_workers=0) as store:
        assert store.stats().capacity_bytes == 3 * len(model.layers) * model.expert_nbytes
        assert all(store.slots(layer) == 3 for layer in model.layers)
        for e in range(model.n_experts):          # more experts than slots: evictions, no error
            with store.lease(model.layers[0], e):
                pass
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "1000")
    with pytest.raises(FormatError, match="less than one expert per layer"):
        colibri.open_store(model.path, capacity_bytes="auto")


@pytest.mark.parametrize("value", ["AUTO", "all", ""])
def test_other_strings_are_refused(model, value: str) -> None:
    with pytest.raises(FormatError, match='an int or "auto"'):
        colibri.open_store(model.path, capacity_bytes=value)
