"""How misses read the disk: ``direct_io`` True, False and "auto", chunked
reads through the page cache, and the fallback where the file system refuses
O_DIRECT (ramfs, or tmpfs before Linux 6.6).

The auto rule compares the model's routed-expert bytes with the memory left
for the page cache (available memory minus the store's capacity); the tests
set the available memory through COLIBRI_AVAILABLE_MEMORY instead of writing
a model larger than the machine's RAM. Every mode must give the file's bytes,
also for tensors at offsets that are not 4 KiB-aligned and for experts read
in many chunks.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import colibri
from colibri.errors import FormatError
from colibri.store import AVAILABLE_MEMORY_ENV
from colibri.synthetic import write_synthetic_model
from conftest import assert_expert_matches, expected_experts, tensor_ranges
import core_control  # the test build's control

SHM = Path("/dev/shm")


def o_direct_works(directory: Path) -> bool:
    """Whether the file system under directory opens files with O_DIRECT."""
    probe = directory / f".o_direct_probe.{os.getpid()}"
    probe.write_bytes(b"\0" * 4096)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        probe.unlink()
    os.close(fd)
    return True


def drop_from_page_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def routed_bytes(model) -> int:
    return sum(model.expert_nbytes * model.n_experts for _ in model.layers)


@pytest.fixture(scope="module")
def odd_model(model_factory):
    """float16 experts of 3 x 100 x 36 (21,600 bytes each: several 4 KiB
    chunks) in 2 shards, so tensors start at offsets that are not aligned."""
    return model_factory(dtype="float16", shards=2, n_layers=3, n_experts=5, hidden=100,
                         intermediate=36, dense_layers=1)


def test_tensor_offsets_are_unaligned(odd_model):
    """What the byte-equality tests below rely on."""
    offsets = [begin for _, begin, _ in tensor_ranges(odd_model).values()]
    assert any(off % 4096 for off in offsets)
    assert odd_model.expert_nbytes > 4 * 4096


def lease_everything(store, model, workers: int) -> None:
    """Every expert twice through lease, then through lease_many and (with
    workers) prefetch, each compared byte for byte with the file."""
    want = expected_experts(model)
    for _ in range(2):
        for key in model.keys():
            with store.lease(*key) as ex:
                assert_expert_matches(ex, want[key])
    for layer in model.layers:
        experts = list(range(model.n_experts))[::-1]
        for at in range(0, len(experts), 2):
            with store.lease_many(layer, experts[at:at + 2]) as group:
                for ex in group:
                    assert_expert_matches(ex, want[(layer, ex.expert)])
    if workers:
        for layer in model.layers:
            store.prefetch([(layer, e) for e in range(model.n_experts)])
            store.wait_idle(timeout=30)
            for e in range(model.n_experts):
                with store.lease(layer, e) as ex:
                    assert_expert_matches(ex, want[(layer, e)])
    assert store.stats().loads_failed == 0


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "mode",
    ["direct", "buffered", "buffered-cold", "auto-small-ram", "auto-large-ram", "one-call",
     "4k-chunks", "no-advice"],
)
def test_every_mode_reads_the_files_bytes(odd_model, monkeypatch, mode, workers):
    options: dict = {}
    if mode == "direct":
        options["direct_io"] = True
    elif mode == "buffered":
        options["direct_io"] = False
    elif mode == "buffered-cold":   # misses that find nothing in the page cache
        options.update(direct_io=False, read_chunk_bytes=4096)
        drop_from_page_cache(odd_model.files)
    elif mode.startswith("auto"):
        monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "0" if mode == "auto-small-ram" else str(1 << 50))
    elif mode == "one-call":
        options.update(direct_io=False, read_chunk_bytes=1 << 40)
    elif mode == "4k-chunks":
        options.update(direct_io=False, read_chunk_bytes=1)   # rounded up to 4 KiB
    elif mode == "no-advice":
        options.update(direct_io=False, read_advice=False, read_chunk_bytes=4096)
    with colibri.open_store(odd_model.path, slots_per_layer=2, prefetch_workers=workers,
                            prefetch_chunk_bytes=64 << 10, **options) as store:
        lease_everything(store, odd_model, workers)
        s = store.stats()
        assert s.resident_bytes <= s.capacity_bytes


def test_auto_takes_o_direct_when_the_experts_exceed_the_memory_left(odd_model, monkeypatch):
    slots = 2
    store_bytes = len(odd_model.layers) * slots * odd_model.expert_nbytes
    experts = routed_bytes(odd_model)
    direct_here = o_direct_works(Path(odd_model.path))
    # Exactly enough memory for the experts beside the store: buffered.
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(experts + store_bytes))
    with colibri.open_store(odd_model.path, slots_per_layer=slots) as store:
        assert store.direct_io is False
    # One byte less: the experts cannot all stay cached, so O_DIRECT.
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(experts + store_bytes - 1))
    with colibri.open_store(odd_model.path, slots_per_layer=slots) as store:
        assert store.direct_io is direct_here
        lease_everything(store, odd_model, 0)
    # A capacity budget counts as the store's bytes the same way.
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(experts + 10 * odd_model.expert_nbytes))
    with colibri.open_store(odd_model.path, capacity_bytes=10 * odd_model.expert_nbytes) as store:
        assert store.direct_io is False
    with colibri.open_store(odd_model.path, capacity_bytes=10 * odd_model.expert_nbytes + 1) as store:
        assert store.direct_io is direct_here


def test_auto_is_the_default_and_keeps_a_model_that_fits_buffered(odd_model, monkeypatch):
    monkeypatch.delenv(AVAILABLE_MEMORY_ENV, raising=False)
    with colibri.open_store(odd_model.path) as store:   # a few KiB against this machine's RAM
        assert store.direct_io is False
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "0")
    with colibri.open_store(odd_model.path) as store:
        assert store.direct_io is o_direct_works(Path(odd_model.path))


def test_forced_modes_ignore_the_rule(odd_model, monkeypatch):
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "0")
    with colibri.open_store(odd_model.path, direct_io=False) as store:
        assert store.direct_io is False
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(1 << 50))
    with colibri.open_store(odd_model.path, direct_io=True) as store:
        assert store.direct_io is o_direct_works(Path(odd_model.path))


@pytest.mark.parametrize("value", ["lots", "-5", "1.5"])
def test_a_bad_available_memory_is_refused(odd_model, monkeypatch, value):
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, value)
    with pytest.raises(FormatError, match=AVAILABLE_MEMORY_ENV):
        colibri.open_store(odd_model.path)


@pytest.mark.parametrize("value", ["yes", 1, None, "AUTO"])
def test_a_bad_direct_io_is_refused(odd_model, value):
    with pytest.raises(FormatError, match="direct_io"):
        colibri.open_store(odd_model.path, direct_io=value)


def test_a_bad_read_chunk_is_refused(odd_model):
    with pytest.raises(FormatError, match="read_chunk_bytes"):
        colibri.open_store(odd_model.path, read_chunk_bytes=-1)


@pytest.mark.parametrize("direct", [True, False])
def test_o_direct_prefetch_reads_go_in_larger_chunks_by_default(odd_model, direct):
    """With O_DIRECT each chunk is a device request of its own: 4 MiB by
    default, 1 MiB through the page cache; a size given applies in both."""
    with colibri.open_store(odd_model.path, slots_per_layer=2, prefetch_workers=1,
                            direct_io=direct) as store:
        if direct and not store.direct_io:
            pytest.skip("this file system refuses O_DIRECT")
        assert core_control.prefetch_chunk(store) == (4 << 20 if direct else 1 << 20)
    with colibri.open_store(odd_model.path, slots_per_layer=2, prefetch_workers=1, direct_io=direct,
                            prefetch_chunk_bytes=100_000) as store:
        assert core_control.prefetch_chunk(store) == 100 << 10   # rounded up to 4 KiB


# Run in a child so its allocator settings stay there: big blocks come from
# the heap and freed ones stay in it, as in a process that has run a while
# (an engine that loaded a model, or one that opened stores before). The
# heap's memory was written first, so it sits on 4 KiB pages.
SLOT_MEMORY_CHILD = textwrap.dedent("""
    import ctypes, mmap, sys
    import colibri

    def huge_kb(lo, hi):
        total, overlaps = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    overlaps = start < hi and end > lo
                elif overlaps and head == "AnonHugePages:":
                    total += int(line.split()[1])
        return total

    probe = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe.madvise(mmap.MADV_HUGEPAGE)
    probe.write(b"\1" * (8 << 20))
    at = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    if huge_kb(at, at + (8 << 20)) == 0:
        print("no transparent huge pages for a fresh mapping here")
        sys.exit(3)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.mallopt(-3, 1 << 30)   # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)   # M_TRIM_THRESHOLD
    block = libc.malloc(ctypes.c_size_t(64 << 20))
    ctypes.memset(block, 1, 64 << 20)
    libc.free(ctypes.c_void_p(block))
    with colibri.open_store(sys.argv[1], slots_per_layer=8, prefetch_workers=0, direct_io=False) as store:
        starts = []
        for e in range(8):
            with store.lease(0, e) as ex:
                starts.append(ex.gate.__array_interface__["data"][0])
        lo, hi = min(starts), max(starts) + (3 << 20)
        print(huge_kb(lo, hi) << 10, hi - lo)
""")


def test_slot_memory_is_on_huge_pages_after_the_heap_was_used(tmp_path):
    """A 3 MiB O_DIRECT read into 4 KiB pages needs more segments than one
    device request takes, and is split. Slot memory is a fresh mapping
    advised to use huge pages, never recycled heap memory already on small
    pages: checked in a child whose heap holds 64 MiB freed."""
    model = write_synthetic_model(tmp_path / "model", n_layers=1, n_experts=8, hidden=1024,
                                  intermediate=512, dtype="float16")
    assert model.expert_nbytes == 3 << 20
    run = subprocess.run([sys.executable, "-c", SLOT_MEMORY_CHILD, str(model.path)],
                         capture_output=True, text=True, timeout=120)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr
    huge, span = map(int, run.stdout.split())
    # All of it but a 2 MiB page at either end, which the slots may share
    # with memory outside the arena.
    assert huge >= span - (4 << 20), f"{huge:,} of {span:,} bytes of slot memory on huge pages"


@pytest.fixture(scope="module")
def no_direct_dir(tmp_path_factory):
    """A directory on a file system that refuses O_DIRECT: /dev/shm where
    its tmpfs does (before Linux 6.6), else a ramfs mounted for this module
    (needs root), else the tests using it skip."""
    if SHM.is_dir() and not o_direct_works(SHM):
        directory = SHM / f"colibri-test-{os.getpid()}"
        directory.mkdir()
        yield directory
        shutil.rmtree(directory, ignore_errors=True)
        return
    mount_point = tmp_path_factory.mktemp("ramfs")
    mounted = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount_point)],
                             capture_output=True).returncode == 0 if shutil.which("mount") else False
    if not mounted:
        pytest.skip("no file system here refuses O_DIRECT (tmpfs takes it since Linux 6.6) "
                    "and ramfs cannot be mounted")
    try:
        if o_direct_works(mount_point):
            pytest.skip("ramfs takes O_DIRECT here")
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


@pytest.fixture(scope="module")
def no_direct_model(no_direct_dir):
    return write_synthetic_model(no_direct_dir / "model", dtype="float16", n_layers=2, n_experts=4,
                                 hidden=100, intermediate=36, shards=2)


@pytest.mark.parametrize("how", ["forced", "auto"])
@pytest.mark.parametrize("workers", [0, 2])
def test_refused_o_direct_falls_back_to_the_page_cache(no_direct_model, monkeypatch, how, workers):
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "0")   # auto wants O_DIRECT too
    options = {"direct_io": True} if how == "forced" else {}
    with colibri.open_store(no_direct_model.path, slots_per_layer=2, prefetch_workers=workers,
                            **options) as store:
        assert store.direct_io is False
        lease_everything(store, no_direct_model, workers)


def anonymous_rss() -> int:
    """This process's resident anonymous memory, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    pytest.skip("no RssAnon in /proc/self/status")


@pytest.mark.parametrize("populate", [True, False])
def test_slot_memory_is_committed_at_open_unless_lazy(tmp_path, populate):
    """With populate_slots (the default) the slots' pages are resident when
    open returns, so no read waits for the kernel to zero them; without,
    they come with the first read into each slot."""
    model = write_synthetic_model(tmp_path / "model", n_layers=1, n_experts=8, hidden=1024,
                                  intermediate=512, dtype="float16")
    arena = 8 * model.expert_nbytes
    want = expected_experts(model)
    before = anonymous_rss()
    with colibri.open_store(model.path, slots_per_layer=8, prefetch_workers=0,
                            populate_slots=populate) as store:
        at_open = anonymous_rss() - before
        for e in range(8):
            with store.lease(0, e) as ex:
                assert_expert_matches(ex, want[(0, e)])
        after_reads = anonymous_rss() - before
    # a tenth of slack: the rest of the process may give memory back meanwhile
    if populate:
        assert at_open >= arena * 9 // 10, f"{at_open:,} bytes resident at open for {arena:,} bytes of slots"
    else:
        assert at_open < arena // 4, f"{at_open:,} bytes resident at open with lazy slots"
    assert after_reads >= arena * 9 // 10
