"""``colibri generate`` end to end on a tiny checkpoint: exit status 0, stdout
is exactly what transformers' own ``generate`` gives on the fully loaded model
(decoded), stderr ends with the summary, and ``--trace`` writes a routing
trace of every forwarded token. Bad input exits 2 with a message.

Needs torch and transformers; skipped without them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import colibri  # noqa: E402
from colibri.__main__ import main as cli_main  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402

PROMPT = "the old cat and the big dog run to the river"
NEW = 10
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_moe(str(tmp_path_factory.mktemp("tiny-moe")), "qwen3_moe", dtype="bfloat16")


def _stock_text(path: str) -> tuple[str, int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True), int(inputs["input_ids"].shape[1])


def test_generate_end_to_end_equals_transformers(tiny: str, tmp_path) -> None:
    want, prompt_tokens = _stock_text(tiny)
    trace_file = tmp_path / "routing.npz"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "colibri", "generate", tiny, "--prompt", PROMPT, "--max-new-tokens", str(NEW),
         "--slots", "2", "--stats", "--trace", str(trace_file)],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == want.strip()
    assert want.startswith(PROMPT)
    err = proc.stderr
    assert "prefill: " in err and "lease group" in err
    summary = [line for line in err.splitlines() if "tokens/s" in line]
    assert summary and "hit rate" in summary[0] and "prefetch precision" in summary[0]
    assert re.search(r"prefill \d+ tokens in [\d.]+ s \([\d.]+ tokens/s\)", summary[0])
    assert "native kernels" in err
    assert "prefetch_hits" in err and '"precision"' in err          # --stats
    trace = colibri.Trace.load(trace_file)
    # every forwarded token: the prompt, and each new token but the last
    assert len(trace) == prompt_tokens + NEW - 1
    assert trace.experts.shape[2] == 4 and (trace.experts >= 0).all()
    assert trace.weights is not None and np.isfinite(trace.weights).all()


def test_generate_prefetch_off_and_ram_budget(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    want, _ = _stock_text(tiny)
    rc = cli_main(["generate", tiny, "--prompt", PROMPT, "--max-new-tokens", str(NEW),
                   "--ram-gb", "0.0001", "--prefetch", "off", "--kernels", "torch"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.strip() == want.strip()
    assert "prefetch precision off" in out.err and "torch kernels" in out.err


def test_generate_ram_auto_fills_the_memory_left(tiny: str, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """--ram-gb auto with COLIBRI_AVAILABLE_MEMORY: the reserve, the rest of
    the checkpoint and 3 experts a layer give the slots of a budget of 3
    experts a layer (fewer where slots round up to pages)."""
    from colibri.checkpoint.scan import scan_model
    from colibri.memory_room import AUTO_RESERVE_MIN_BYTES

    experts = scan_model(tiny)
    routed = sum(experts.expert_nbytes(l) * experts.num_experts(l) for l in experts.layers)
    rest = sum(os.path.getsize(f) for f in experts.files) - routed
    per_layer = experts.expert_nbytes(experts.layers[0])
    budget = 3 * len(experts.layers) * per_layer
    monkeypatch.setenv("COLIBRI_AVAILABLE_MEMORY", str(AUTO_RESERVE_MIN_BYTES + rest + budget))
    with colibri.open_store(tiny, capacity_bytes=budget, prefetch_workers=0) as store:
        slots = store.slots(experts.layers[0])
    assert 1 <= slots <= 3
    want, _ = _stock_text(tiny)
    rc = cli_main(["generate", tiny, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--ram-gb", "auto"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.strip() == want.strip()
    assert f"{slots} slots per layer" in out.err


@pytest.mark.parametrize("argv, message", [
    (["--slots", "0"], "slots_per_layer must be >= 1"),
    (["--ram-gb", "0.000000001"], "too small"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
])
def test_generate_bad_input_exits_2(tiny: str, capsys: pytest.CaptureFixture[str], argv, message) -> None:
    rc = cli_main(["generate", tiny, "--prompt", PROMPT, *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_generate_ram_gb_other_words_are_refused(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", tiny, "--prompt", PROMPT, "--ram-gb", "lots"])
    assert exit_info.value.code == 2
    assert "a number of GiB or auto, not 'lots'" in capsys.readouterr().err


def test_generate_unsupported_checkpoint(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["generate", str(tmp_path), "--prompt", PROMPT])
    assert rc == 2
    assert "no config.json" in capsys.readouterr().err
