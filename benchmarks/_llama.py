"""llama.cpp for benchmarks/generate.py: its converter, its quantizer, its decode loop, the disk's readahead.

llama.cpp comes from llama-cpp-python (the ``bench`` extra; it compiles
llama.cpp for this CPU when it installs). Its converter,
``convert_hf_to_gguf.py`` with the ``conversion`` package and ``gguf-py``
beside it, is not in the wheel: it ships in the source distribution of the
same version, which :func:`converter_dir` unpacks once into a cache directory
(``pip download`` of that sdist, or ``--llama-cpp-src`` naming a llama.cpp
tree). GGUF files are written by that converter (bf16) and by
``llama_model_quantize`` (4-bit), never by this module.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

LLAMA_PACKAGE = "llama-cpp-python"
PINNED_VERSION = "0.3.36"
INSTALL_HINT = (
    f"llama.cpp rows need {LLAMA_PACKAGE} (it compiles llama.cpp from source: tens of minutes on 2 cores): "
    f"CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install '.[bench]'   "
    f"(or pip install {LLAMA_PACKAGE}=={PINNED_VERSION} scikit-build-core)")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colibri-bench"

# llama_ftype values (llama.h) and ggml_type values (ggml.h) that the quantizer takes
FTYPES = {"q4_0": 2, "q4_k_m": 15}
GGML_TYPE_BF16 = 30
# the files of llama.cpp's tree the converter needs, relative to its root
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


def installed() -> str | None:
    """The installed llama-cpp-python's version, or None (not imported: it loads a large library)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        return importlib.metadata.version(LLAMA_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------
# the converter


def converter_dir(source: Path | None = None, cache: Path = CACHE) -> Path:
    """A directory with llama.cpp's ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``.

    ``source``: a llama.cpp tree (or llama-cpp-python's unpacked sdist) to
    take them from. Otherwise the sdist of the installed llama-cpp-python is
    fetched with ``pip download`` (metadata needs ``scikit-build-core``, in the
    ``bench`` extra) and its ``vendor/llama.cpp`` parts cached, so the
    converter always matches the compiled library.
    """
    if source is not None:
        for root in (source, source / "vendor" / "llama.cpp"):
            if all((root / part).exists() for part in CONVERTER_PARTS):
                return root
        raise FileNotFoundError(f"{source}: no {', '.join(CONVERTER_PARTS)} (a llama.cpp tree, or "
                                f"llama-cpp-python's unpacked source distribution)")
    version = installed()
    if version is None:
        raise RuntimeError(INSTALL_HINT)
    root = cache / f"llama.cpp-{version}"
    if all((root / part).exists() for part in CONVERTER_PARTS):
        return root
    with tempfile.TemporaryDirectory(prefix="colibri-llama-sdist-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-build-isolation",
               "--no-binary", ":all:", f"{LLAMA_PACKAGE}=={version}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or not archives:
            raise RuntimeError(f"could not fetch the {LLAMA_PACKAGE} {version} sdist for llama.cpp's converter "
                               f"({' '.join(cmd[2:])}): {proc.stderr.strip()[-800:]}\n"
                               f"pip install scikit-build-core, or pass --llama-cpp-src DIR")
        staging = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=_mkdir(cache)))
        with tarfile.open(archives[0]) as tar:
            members = []
            for m in tar.getmembers():
                parts = Path(m.name).parts   # <pkg>-<version>/vendor/llama.cpp/<rest>
                if len(parts) > 3 and parts[1:3] == ("vendor", "llama.cpp") and parts[3] in CONVERTER_PARTS \
                        and (m.isfile() or m.isdir()):
                    m.name = str(Path(*parts[3:]))
                    members.append(m)
            tar.extractall(staging, members=members, filter="data")
        if not all((staging / part).exists() for part in CONVERTER_PARTS):
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(f"{archives[0].name} has no vendor/llama.cpp/{{{', '.join(CONVERTER_PARTS)}}}")
        shutil.rmtree(root, ignore_errors=True)
        os.replace(staging, root)
    return root


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_tokenizer(model_dir: Path) -> None:
    """A byte-level BPE tokenizer for a synthetic checkpoint, which has none.

    The converter reads the vocabulary through transformers' AutoTokenizer and
    llama.cpp's BPE vocabulary needs at least one merge: 256 byte tokens and
    one merge. The ids past them become unused padding tokens in the GGUF, as
    the converter pads any vocabulary smaller than ``vocab_size``. Generation
    runs on token ids in every engine, so the tokenizer never tokenizes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(sorted(alphabet))}
    vocab["\u0120t"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "t")]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=core).save_pretrained(model_dir)


# The converter recognizes a BPE pre-tokenizer by hashing how the tokenizer
# splits a fixed text, and refuses an unknown hash. The synthetic tokenizer
# is no released one, so the driver declares its pre-tokenizer instead
# (Qwen2's, as for Qwen3-MoE releases); everything else is the converter's own.
_DRIVER = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(converter: Path, model_dir: Path, out: Path, outtype: str = "bf16") -> float:
    """llama.cpp's converter: ``model_dir`` (a transformers checkpoint) to the GGUF ``out``; seconds taken."""
    t0 = time.perf_counter()
    tmp = out.with_suffix(".gguf.part")
    cmd = [sys.executable, "-c", _DRIVER, str(converter), str(model_dir), "--outtype", outtype,
           "--outfile", str(tmp)]
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    env.pop("NO_LOCAL_GGUF", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py {model_dir} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    os.replace(tmp, out)
    return time.perf_counter() - t0


def quantize(src: Path, out: Path, kind: str, threads: int) -> float:
    """``llama_model_quantize`` of the GGUF ``src`` to ``kind`` (q4_0, q4_k_m); seconds taken.

    The token embedding and the output head stay bf16, as the
    compressed-tensors counterpart keeps them (the quantizer would make them
    4-bit and 6-bit by default); norms and routers stay float, as always.
    Runs in a child process, which takes the library's log of every tensor.
    """
    t0 = time.perf_counter()
    tmp = out.with_suffix(".gguf.part")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "quantize", str(src), str(tmp), kind,
                           str(threads)], capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src.name} -> {kind}) failed:\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    os.replace(tmp, out)
    return time.perf_counter() - t0


def _quantize_here(src: str, out: str, kind: str, threads: int) -> int:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = FTYPES[kind]
    params.output_tensor_type = GGML_TYPE_BF16
    params.token_embedding_type = GGML_TYPE_BF16
    return int(llama_cpp.llama_model_quantize(src.encode(), out.encode(), params))


def gguf_sizes(path: Path, converter: Path) -> dict[str, int]:
    """Bytes of the routed experts (``ffn_*_exps``) and of the rest, from the GGUF's tensor table."""
    sys.path[:0] = [str(converter / "gguf-py")]
    try:
        import gguf
    finally:
        del sys.path[0]
    reader = gguf.GGUFReader(str(path))
    experts = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    other = sum(int(t.n_bytes) for t in reader.tensors if "_exps." not in t.name)
    return {"expert_bytes": experts, "other_bytes": other, "file_bytes": path.stat().st_size}


def gguf_tensor(path: Path, name: str, converter: Path) -> Any:
    """One tensor of a GGUF as float32, dequantized by gguf-py (for the equal-weights check)."""
    sys.path[:0] = [str(converter / "gguf-py")]
    try:
        import gguf
        from gguf.quants import dequantize
    finally:
        del sys.path[0]
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == name)
    return dequantize(t.data, t.tensor_type)


# ---------------------------------------------------------------------------
# the disk's readahead


def readahead_file(path: Path) -> Path | None:
    """``/sys/block/<dev>/queue/read_ahead_kb`` of the disk holding ``path`` (None: no block device)."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not dev.exists():
        return None
    dev = dev.resolve()
    for d in (dev, dev.parent):        # a partition's queue is its disk's
        if (d / "queue" / "read_ahead_kb").exists():
            return d / "queue" / "read_ahead_kb"
    return None


@contextlib.contextmanager
def readahead(path: Path, kb: int | None) -> Iterator[int | None]:
    """Sets the readahead of ``path``'s disk to ``kb`` KiB (None: leaves it) for the block and
    restores it afterwards, on any exit; yields the value in force."""
    ra = readahead_file(path)
    if ra is None or kb is None:
        yield int(ra.read_text()) if ra is not None else None
        return
    old = ra.read_text().strip()
    ra.write_text(str(kb))
    try:
        yield int(ra.read_text())
    finally:
        ra.write_text(old)


# ---------------------------------------------------------------------------
# the child: greedy decode of token ids


def decode(gguf_path: Path, prompt: list[int], continuation: list[int], threads: int, use_mmap: bool,
           read_bytes: Any) -> dict[str, Any]:
    """Loads ``gguf_path`` and decodes ``continuation`` after ``prompt``, one token a step.

    One ``llama_decode`` for the prompt, then one per token of the
    continuation but the last; after each, the greedy prediction (the argmax
    of the last logits; ties: the lowest id, as torch.argmax) is recorded and
    the continuation's token is fed next. Marks as generate.py's streamer
    takes them: before the prompt, after each token. ``read_bytes()`` is the
    process's bytes read from disk so far.

    With ``use_mmap`` the weights are computed on where they are mapped
    (``use_extra_bufts`` off, llama.cpp's ``--no-repack``): by default its CPU
    backend copies Q4_0 and other quantized weights into a repacked layout in
    anonymous memory at load, which holds the whole model in RAM and is
    killed under a limit smaller than the model. In RAM it repacks (its
    fastest).
    """
    import llama_cpp
    import llama_cpp.llama_cpp as lib
    import numpy as np

    defaults = lib.llama_model_default_params

    def params() -> Any:
        p = defaults()
        p.use_extra_bufts = not use_mmap
        return p

    t0 = time.perf_counter()
    lib.llama_model_default_params = params    # Llama() takes its model parameters from here
    try:
        llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=len(prompt) + len(continuation) + 8,
                              n_batch=max(len(prompt), 8), n_threads=threads, n_threads_batch=threads,
                              use_mmap=use_mmap, use_mlock=False, logits_all=False, verbose=False)
    finally:
        lib.llama_model_default_params = defaults
    if llm.model_params.use_extra_bufts != (not use_mmap):
        raise RuntimeError("llama_cpp.Llama did not take use_extra_bufts from llama_model_default_params")
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def next_token() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    marks = [(time.perf_counter(), read_bytes())]
    llm.eval(prompt)
    predicted = [next_token()]
    marks.append((time.perf_counter(), read_bytes()))
    for token in continuation[:-1]:
        llm.eval([token])
        predicted.append(next_token())
        marks.append((time.perf_counter(), read_bytes()))
    llm.close()
    return {"load_s": load_s, "marks": marks, "predicted": predicted,
            "llama_cpp": importlib.metadata.version(LLAMA_PACKAGE)}


def system_info() -> str:
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


if __name__ == "__main__":   # python benchmarks/_llama.py: where the converter is, or why not
    if sys.argv[1:2] == ["quantize"]:
        sys.exit(_quantize_here(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
    try:
        print(converter_dir())
    except RuntimeError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
    print(json.dumps({"llama-cpp-python": installed()}))
