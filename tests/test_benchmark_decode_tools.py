"""benchmarks/decode_profile.py and decode_switch.py's switches run
end to end on a tiny model (in child processes: the profile wraps
transformers' classes for the life of its process) and print their tables.

Needs torch and transformers; skipped without them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri.tiny_moe import write_tiny_moe  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_moe(str(tmp_path_factory.mktemp("decode-tools")), "qwen3_moe", dtype="bfloat16",
                          hidden_size=64, seed=3)


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_decode_profile_splits_a_step(tiny: str) -> None:
    out = _run(str(BENCHMARKS / "decode_profile.py"), "--model", tiny, "--threads", "1,2", "--steps", "8",
               "--prompt-len", "16")
    rows = {line[:40].strip(): [float(v) for v in line[40:].split()] for line in out.splitlines()
            if line[:40].strip() in ("step", "experts kernel", "linear kernels", "attention", "kernels")}
    assert set(rows) == {"step", "experts kernel", "linear kernels", "attention", "kernels"}, out
    for t in range(2):
        assert 0 < rows["experts kernel"][t] < rows["step"][t] and 0 < rows["linear kernels"][t]
        assert rows["kernels"][t] < rows["step"][t] and rows["attention"][t] < rows["step"][t]
    assert "step time 2 / 1 thread(s)" in out


def test_decode_switch_compares_the_kv_caches(tiny: str) -> None:
    out = _run(str(BENCHMARKS / "decode_switch.py"), "--model", tiny, "--switch", "kv_cache", "--steps", "6",
               "--prompt-len", "16")
    assert "kv_cache (['GrowingLayer'] against ['PlainLayer'])" in out and "on / off" in out, out


def test_decode_switch_toggles_the_native_attention(tiny: str) -> None:
    out = _run(str(BENCHMARKS / "decode_switch.py"), "--model", tiny, "--switch", "attention", "--steps", "6",
               "--prompt-len", "16")
    assert "attention (1 modules), 1 thread(s), 6 steps" in out and "on / off" in out, out


@pytest.mark.parametrize("switch", ["hits_first", "pilot"])
def test_decode_switch_streaming_switches(tiny: str, switch: str) -> None:
    out = _run(str(BENCHMARKS / "decode_switch.py"), "--model", tiny, "--switch", switch, "--steps", "6",
               "--prompt-len", "16")
    assert f"{switch} (" in out and "of the requests missed), 1 thread(s), 6 steps" in out, out
    assert "on / off" in out and "(means: " in out, out


def test_decode_switch_toggles_the_lean_layers(tiny: str) -> None:
    out = _run(str(BENCHMARKS / "decode_switch.py"), "--model", tiny, "--switch", "layers", "--steps", "6",
               "--prompt-len", "16")
    assert "layers (4 modules), 1 thread(s), 6 steps" in out and "on / off" in out, out


def test_decode_switch_toggles_the_one_token_experts(tiny: str) -> None:
    out = _run(str(BENCHMARKS / "decode_switch.py"), "--model", tiny, "--switch", "one_token", "--steps", "6",
               "--prompt-len", "16")
    assert "one_token (4 layers), 1 thread(s), 6 steps" in out and "on / off" in out, out
