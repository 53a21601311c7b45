"""colibri.hf's decode threads: with kernels="native" (and decode_threads,
the default) a forward of at most DECODE_ROWS token rows runs torch's own
ops on one thread and colibri's kernels on torch.get_num_threads(), and
both are as before once the forward ends, also when it raises; longer
forwards and kernels="torch" are untouched. And colibri.kernels.torch_threads,
which carries the kernels' number: per thread, nested, restored.

Needs torch and transformers; skipped without them."""

from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri.hf as hf  # noqa: E402
from colibri.hf.linears import DECODE_ROWS  # noqa: E402
from colibri.kernels import default_threads, torch_threads  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_moe(str(tmp_path_factory.mktemp("decode-threads")), "qwen3_moe", dtype="bfloat16",
                          hidden_size=64, seed=6)


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _seen(model: Any) -> list[tuple[int, int]]:
    """(torch's threads, the kernels' threads) inside each forward of the first layer."""
    seen: list[tuple[int, int]] = []
    model.model.layers[0].register_forward_pre_hook(
        lambda *_: seen.append((torch.get_num_threads(), default_threads(True))))
    return seen


def _ids(rows: int, length: int, vocab: int = 64) -> Any:
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(rows + length))


@pytest.mark.usefixtures("two_threads")
def test_a_few_rows_give_torchs_threads_to_the_kernels(path: str) -> None:
    model = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    try:
        assert model.colibri.decode_threads
        seen = _seen(model)
        with torch.no_grad():
            for rows, length in ((1, 1), (DECODE_ROWS, 1), (1, DECODE_ROWS), (1, DECODE_ROWS + 1), (2, 7)):
                model(_ids(rows, length))
                assert torch.get_num_threads() == 2 and default_threads(True) == 2
        assert seen == [(1, 2), (1, 2), (1, 2), (2, 2), (2, 2)]
    finally:
        model.colibri_close()


@pytest.mark.usefixtures("two_threads")
def test_threads_come_back_when_the_forward_raises(path: str) -> None:
    model = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    try:
        def fail(*_: Any) -> None:
            raise RuntimeError("injected")

        handle = model.model.layers[1].register_forward_pre_hook(fail)
        with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
            model(_ids(1, 1))
        handle.remove()
        assert torch.get_num_threads() == 2 and default_threads(True) == 2
        seen = _seen(model)
        with torch.no_grad():
            model(_ids(1, 1))
        assert seen == [(1, 2)]
    finally:
        model.colibri_close()


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("options", [dict(decode_threads=False), dict(kernels="torch")])
def test_off_or_with_the_torch_path_nothing_changes(path: str, options: dict[str, Any]) -> None:
    model = hf.from_pretrained(path, torch_dtype=torch.bfloat16, **options)
    try:
        assert not model.colibri.decode_threads
        seen = _seen(model)
        with torch.no_grad():
            model(_ids(1, 1))
        assert seen == [(2, 2)]
    finally:
        model.colibri_close()


@pytest.mark.usefixtures("two_threads")
def test_greedy_tokens_equal_with_and_without(path: str) -> None:
    on = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    off = hf.from_pretrained(path, torch_dtype=torch.bfloat16, decode_threads=False)
    try:
        ids = _ids(1, 6)
        options = dict(max_new_tokens=8, do_sample=False, pad_token_id=1)
        assert torch.equal(on.generate(ids, **options), off.generate(ids, **options))
    finally:
        on.colibri_close()
        off.colibri_close()


def test_torch_threads_nests_restores_and_stays_in_its_thread() -> None:
    outside = default_threads(True)
    other: list[int] = []
    with torch_threads(3):
        assert default_threads(True) == 3
        with torch_threads(5):
            assert default_threads(True) == 5
            worker = threading.Thread(target=lambda: other.append(default_threads(True)))
            worker.start()
            worker.join()
        assert default_threads(True) == 3
    assert default_threads(True) == outside == torch.get_num_threads()
    assert other == [torch.get_num_threads()]
    with pytest.raises(RuntimeError), torch_threads(2):
        raise RuntimeError("inside")
    assert default_threads(True) == outside
    for bad in (0, -1, 257, 2.0, True):
        with pytest.raises(ValueError):
            with torch_threads(bad):  # type: ignore[arg-type]
                pass
