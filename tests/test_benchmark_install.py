"""The benchmarks run against colibri as installed, plainly (``pip install .``) and editable.

A benchmark is started from a checkout, so its own directory comes first on
``sys.path``; its child processes must not put the checkout's ``colibri/``
(whose extensions a plain install never compiles there) before the installed
package. Each way runs ``benchmarks/generate.py --quick`` end to end, child
processes and the decode simulation included, and checks from the JSON it
writes that every process imported the installed colibri.

The plain install goes into a fresh virtual environment that sees this test
environment's packages through a ``.pth`` path line (so torch and
transformers are not installed twice; a path line adds no import hooks, so an
editable colibri there stays invisible), built from a copy of the tree
without compiled files by ``pip install --no-deps --no-build-isolation``.
About a minute for the build and one per run on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("torch")
pytest.importorskip("transformers")

# The quick smoke of generate.py: a 40 MB model, transformers in RAM and both
# colibri configurations (so the decode simulation runs as a third child), no
# cgroup, llama.cpp left out whether or not it is installed.
SMOKE = ["--quick", "--no-limit", "--configs", "acd"]


def _run_generate(python: str, checkout: Path, workdir: Path) -> tuple[dict, str]:
    out = workdir / "generate.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([python, str(checkout / "benchmarks" / "generate.py"), *SMOKE,
                           "--workdir", str(workdir), "--json", str(out)],
                          cwd=str(workdir), env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _imported_from(result: dict) -> set[str]:
    """The colibri package files the parent and every child reported."""
    found = {result["colibri"]}
    for rnd in result["rounds"]:
        for run in rnd.values():
            assert run["ok"], run
            found.add(run["colibri"])
    assert result["decode_sim"]["ok"], result["decode_sim"]
    found.add(str(Path(result["decode_sim"]["colibri"]).resolve()))
    return found


def _check_prefill(result: dict, stdout: str) -> None:
    """The prefill ratio of each colibri configuration, from the 256-token prompt's touched experts
    read with O_DIRECT, printed as a table row and a goal line."""
    assert result["args"]["prompt_len"] == 256
    (reads,) = result["prefill_reads"]
    for fmt in ("bf16", "4bit"):
        assert reads[fmt]["experts"] > 0 and reads[fmt]["bytes"] > 0 and reads[fmt]["seconds"] > 0
        for config in "cd":
            touched = result["rounds"][0][f"{fmt}/1t/{config}"]["touched_experts"]
            assert sum(map(len, touched.values())) <= reads[fmt]["experts"]
    rows = {p["label"]: p for p in result["prefill"]}
    assert set(rows) == {f"{fmt} 1t {name}" for fmt in ("bf16", "4bit")
                         for name in ("(c) colibri, no prefetch", "(d) colibri + PILOT")}
    assert "prefill at the limit, 256-token prompt" in stdout
    goals = {g["goal"] for g in result["goals"]}
    for label, p in rows.items():
        (ratio,) = p["ratios"]
        assert ratio == pytest.approx(p["colibri_s"][0] / max(p["in_ram_s"][0], p["read_s"][0]))
        assert any(line.startswith(label) and line.split()[-2] == f"{ratio:.2f}x" for line in stdout.splitlines())
        assert f"{label} prefill / max(in RAM, O_DIRECT read)" in goals


def test_generate_quick_from_the_test_environment(tmp_path: Path) -> None:
    import colibri

    result, stdout = _run_generate(sys.executable, ROOT, tmp_path)
    assert _imported_from(result) == {str(Path(colibri.__file__).resolve())}
    _check_prefill(result, stdout)


def _copy_tree(dst: Path) -> None:
    """The checkout without compiled files, build output or environments."""
    skip = shutil.ignore_patterns(".git", ".ci-venv", "build", "dist", "*.egg-info", "*.so", "*.o",
                                  "__pycache__", ".hypothesis", ".pytest_cache", "results", "_colibri_cffi.c")
    shutil.copytree(ROOT, dst, ignore=skip)


def test_generate_quick_from_a_plain_install(tmp_path: Path) -> None:
    src, venv = tmp_path / "src", tmp_path / "venv"
    _copy_tree(src)
    assert not list((src / "colibri").glob("*.so"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    (purelib / "test_environment.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    install = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps",
                              "--no-build-isolation", "--no-index", str(src)],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert not list((src / "colibri").glob("*.so"))   # the checkout stays uncompiled

    result, _ = _run_generate(python, src, tmp_path)
    installed = purelib / "colibri" / "__init__.py"
    assert _imported_from(result) == {str(installed)}
