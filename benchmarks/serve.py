#!/usr/bin/env python3
"""``colibri serve`` under 1, 2, 4 and 8 concurrent clients, with batching and without.

The model is benchmarks/generate.py's: transformers' ``Qwen3MoeConfig`` scaled
down (128 experts, top-8), random bf16 weights, written with
``save_pretrained`` (``--model DIR`` uses another), plus a word-level
tokenizer over its vocabulary. The cache is a quarter of each layer's
experts (``--slots``), so the experts are 4x the cache.

Every measured run starts ``colibri serve`` afresh (``python -m colibri
serve``, the installed package: the child runs outside the source tree),
cold: the page cache is dropped before it and it runs in a cgroup-v1 memory
cgroup whose limit, page cache included, is benchmarks/generate.py's (the
non-expert weights + the cache + ``--overhead-mb``). Once it is ready, C
clients (httpx, streaming ``/v1/completions``) start together, each with
its own random prompt of ``--prompt-len`` words, sampled (temperature 1,
seeded), ``--tokens`` new tokens each, ``--requests`` requests one after the
other. Per run:

- aggregate tokens/s: the tokens all clients received over the wall time
  from the first request sent to the last token received (prefill included);
- time to first token (TTFT): from sending a request to its first text chunk;
- disk MB per generated token: ``read_bytes`` of the server's
  ``/proc/PID/io`` over the run (page faults included) per token received;
  also the store's own ``bytes_read`` per token, its expert leases per token
  (prefill included: fewer than top-k x layers when sequences share experts),
  its hit rate and the mean batch (``/metrics``).

Before the clients start, one request of one word and one token takes the
server's one-time start-up work (first allocations and calls) out of the
figures; it leaves at most top-k experts per layer in the cache.

Each concurrency runs with ``--max-batch`` (batching) and with
``--max-batch 1`` (one request at a time). Goals, as ratios in one run: with
batching, 4 clients reach at least 2.5x the aggregate tokens/s of 1 client
and at most 0.5x its disk MB per token.

How many experts concurrent requests share depends on the routing, and the
synthetic model's random prompts share little. So the run ends with the same
question on a real model's routing: tests/data/traces' Qwen3.6-35B-A3B trace
replayed through colibri's own per-layer LRU (a replay store: no bytes),
B prompts decoding together from cold (``--trace-only`` runs just that).

Needs root (cgroups, drop_caches) and a cgroup-v1 memory controller;
``--no-limit`` runs without them (then the runs are not cold).

    python benchmarks/serve.py                 # the 5 GB model of generate.py
    python benchmarks/serve.py --quick         # a 40 MB model, 8 new tokens: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import Goals, drop_caches, table, write_json  # noqa: E402
from generate import CGROUP_ROOT, FULL_MODEL, QUICK_MODEL, MemoryCgroup, safetensors_sizes  # noqa: E402

MB = 1e6
MiB = 1 << 20
CONCURRENCY = (1, 2, 4, 8)


# -- the model and its tokenizer --

def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose words ``w0 .. w{vocab_size-1}`` are the
    model's token ids (no special tokens: completions run to max_tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##")     # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0").save_pretrained(model_dir)


def prepare_model(args: argparse.Namespace, workdir: Path) -> Path:
    if args.model is not None:
        model_dir = args.model
    else:
        shape = dict(QUICK_MODEL if args.quick else FULL_MODEL, embed_std=args.embed_std)
        model_dir = workdir / "model"
        approx = 2 * 3 * shape["hidden_size"] * shape["moe_intermediate_size"] * shape["num_experts"] \
            * shape["num_hidden_layers"]
        if approx * 1.1 > shutil.disk_usage(workdir).free:
            sys.exit(f"a model of {approx / 1e9:.1f} GB does not fit in {workdir}")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(HERE / "generate.py"), "--child", "write", "--model", str(model_dir),
                        "--child-plan", json.dumps(shape), "--seed", str(args.seed)],
                       check=True, cwd=str(workdir), env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"))
        print(f"model written in {time.perf_counter() - t0:.0f} s: Qwen3MoeForCausalLM "
              + ", ".join(f"{k}={v}" for k, v in shape.items()), flush=True)
    if not (model_dir / "tokenizer.json").exists():
        config = json.loads((model_dir / "config.json").read_text())
        write_tokenizer(model_dir, int(config["vocab_size"]))
    return model_dir


# -- one run: a server and its clients --

class ServerProcess:
    """``python -m colibri serve`` in a child process (outside the source
    tree), optionally cold and under a memory cgroup."""

    def __init__(self, model_dir: Path, args: argparse.Namespace, max_batch: int, slots: int,
                 workdir: Path, name: str, limit: int | None) -> None:
        self.log_path = workdir / f"serve-{name}.log"
        self.cold = drop_caches() if not args.no_limit else False
        self.group = None if args.no_limit else MemoryCgroup(f"colibri-servebench-{os.getpid()}-{name}", limit)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(args.threads),
                   MKL_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads),
                   TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
        if limit is not None:
            # The store's direct_io="auto" then judges by the memory this server really has.
            env["COLIBRI_AVAILABLE_MEMORY"] = str(limit)
        cmd = [sys.executable, "-m", "colibri", "serve", str(model_dir), "--port", "0", "--slots", str(slots),
               "--max-batch", str(max_batch), "--prefetch", args.prefetch, "--drain", "0", "--model-name", "bench"]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=str(workdir), preexec_fn=self.group.enter if self.group else None)
        self.url = self._wait_ready(args.ready_timeout)

    def _wait_ready(self, timeout: float) -> str:
        assert self.proc.stderr is not None
        found: list[str] = []

        def pump() -> None:     # the server's stderr to the log, watching for the ready line
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.write(line)
                self.log.flush()
                m = re.search(r"ready on (http://\S+)", line)
                if m:
                    found.append(m.group(1))

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError("colibri serve did not become ready:\n  " + "\n  ".join(tail))
            time.sleep(0.1)
        return found[0]

    def read_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
        return 0

    def metrics(self) -> dict[str, float]:
        import httpx

        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=60).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> dict[str, Any]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        memory = self.group.read() if self.group else {}
        if self.group:
            self.group.remove()
        self.log.close()
        return {"exit": self.proc.returncode, "memory": memory}


def client(url: str, prompts: list[str], tokens: int, seed: int, start: threading.Barrier) -> dict[str, Any]:
    """One client: its requests one after the other, streamed; per request TTFT and tokens."""
    import httpx

    out: list[dict[str, Any]] = []
    with httpx.Client(timeout=3600) as http:
        start.wait()
        for i, prompt in enumerate(prompts):
            body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 1.0,
                    "seed": seed + i, "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = None
            used = 0
            with http.stream("POST", url + "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if data.get("usage"):
                        used = data["usage"]["completion_tokens"]
                    if first is None and data.get("choices") and data["choices"][0]["text"]:
                        first = time.perf_counter()
            end = time.perf_counter()
            out.append({"t0": t0, "ttft": (first or end) - t0, "end": end, "tokens": used})
    return {"requests": out}


def run_one(model_dir: Path, args: argparse.Namespace, max_batch: int, clients: int, slots: int,
            workdir: Path, limit: int | None, rnd: int) -> dict[str, Any]:
    name = f"b{max_batch}-c{clients}-r{rnd}"
    server = ServerProcess(model_dir, args, max_batch, slots, workdir, name, limit)
    try:
        rng = random.Random(args.seed * 1000 + rnd * 100 + clients)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        prompts = [[" ".join(f"w{rng.randrange(vocab)}" for _ in range(args.prompt_len))
                    for _ in range(args.requests)] for _ in range(clients)]
        # One token of one word first, so the figures leave out the server's
        # one-time start-up work (allocations, first calls); it leaves at most
        # top-k experts per layer in the cache.
        client(server.url, ["w1"], 1, args.seed, threading.Barrier(1))
        m0, r0 = server.metrics(), server.read_bytes()
        start = threading.Barrier(clients + 1)
        results: list[dict[str, Any]] = [{} for _ in range(clients)]

        def go(c: int) -> None:
            try:
                results[c] = client(server.url, prompts[c], args.tokens, args.seed + 7919 * c, start)
            except Exception as exc:   # reported, not raised: the other clients still finish
                results[c] = {"error": f"{type(exc).__name__}: {exc}"}

        threads = [threading.Thread(target=go, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        start.wait()
        t_start = time.perf_counter()
        for t in threads:
            t.join()
        m1, r1 = server.metrics(), server.read_bytes()
    finally:
        stopped = server.stop()
    errors = [r["error"] for r in results if "error" in r]
    requests = [q for r in results for q in r.get("requests", [])]
    tokens = sum(q["tokens"] for q in requests)
    wall = max((q["end"] for q in requests), default=t_start) - t_start
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
    steps = d.get("colibri_serve_decode_steps_total", 0.0)
    store_requests = d.get("colibri_store_requests_total", 0.0)
    return {
        "max_batch": max_batch, "clients": clients, "round": rnd, "errors": errors,
        "requests": len(requests), "tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_median_s": statistics.median(q["ttft"] for q in requests) if requests else None,
        "ttft_max_s": max((q["ttft"] for q in requests), default=None),
        "disk_mb_per_token": (r1 - r0) / MB / tokens if tokens else None,
        "store_mb_per_token": d.get("colibri_store_bytes_read_total", 0.0) / MB / tokens if tokens else None,
        "hit_rate": d.get("colibri_store_hits_total", 0.0) / store_requests if store_requests else None,
        "leases_per_token": store_requests / tokens if tokens else None,
        "mean_batch": d.get("colibri_serve_decode_rows_total", 0.0) / steps if steps else None,
        "exit": stopped["exit"], "memory": stopped["memory"], "cold": server.cold,
    }


# -- the same question on real routing --

TRACE = HERE.parent / "tests" / "data" / "traces" / "qwen3.6-35b-a3b-fever.npz"


def trace_sharing(path: Path, fraction: float, batches: list[int]) -> dict[int, dict[str, float]]:
    """What batching does to expert reads on a real model's routing: the
    trace's prompts taken B at a time, each group decoding together from a
    cold store (one step leases, per layer, the union of the B tokens'
    experts) through colibri's own per-layer LRU of ``fraction`` of the
    experts, in a replay store (no bytes read). Per batch size: expert reads
    and union size per token (decode only; the trace has no prefill)."""
    import numpy as np

    from colibri.store import open_replay_store
    from colibri.trace import Trace

    trace = Trace.load(path)
    n_experts, layers = int(trace.num_experts), [int(layer) for layer in trace.layers]
    slots = max(1, int(n_experts * fraction))
    sequences = trace.sequences
    out = {}
    for batch in batches:
        misses = tokens = union = 0
        for g in range(0, len(sequences) - batch + 1, batch):
            rows = [np.flatnonzero(trace.sequence == s) for s in sequences[g:g + batch]]
            steps = min(len(r) for r in rows)
            pieces: list[np.ndarray] = []
            for p in range(steps):
                chosen = [np.unique(trace.experts[[r[p] for r in rows], i]) for i in range(len(layers))]
                union += sum(len(c) for c in chosen)
                width = max(len(c) for c in chosen)
                for start in range(0, width, 32):       # replay_tokens takes up to 32 experts a call
                    piece = np.full((len(layers), 32), -1, dtype=np.int32)
                    for i, c in enumerate(chosen):
                        part = c[start:start + 32]
                        piece[i, :len(part)] = part
                    pieces.append(piece)
            store = open_replay_store({layer: n_experts for layer in layers}, slots_per_layer=slots)
            try:
                store.replay_tokens(np.asarray(layers), np.stack(pieces))
                misses += store.stats().misses
            finally:
                store.close()
            tokens += steps * batch
        out[batch] = {"reads_per_token": misses / tokens / len(layers),
                      "union_per_token": union / tokens / len(layers)}
    return out


# -- the table and the goals --

def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an existing checkpoint (else generate.py's model is written)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"))
    ap.add_argument("--keep-model", action="store_true")
    ap.add_argument("--embed-std", type=float, default=0.6, help="see benchmarks/generate.py's write_model")
    ap.add_argument("--slots", type=int, default=None, help="slots per layer (default: experts / 4)")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument("--max-batch", type=int, default=8, help="the batching configuration's --max-batch")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    ap.add_argument("--prompt-len", type=int, default=16, help="words (tokens) per prompt")
    ap.add_argument("--requests", type=int, default=1, help="requests per client, one after the other")
    ap.add_argument("--prefetch", choices=["pilot", "off"], default="pilot")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--overhead-mb", type=int, default=1024, help="as benchmarks/generate.py")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--no-limit", action="store_true", help="no cgroup, no drop_caches (not cold)")
    ap.add_argument("--quick", action="store_true", help="generate.py's small model, 8 new tokens")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--no-trace", action="store_true", help="skip the replay of the real routing trace")
    ap.add_argument("--trace-only", action="store_true", help="only the replay of the real routing trace")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens = min(args.tokens, 8)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.trace_only:
        for b, v in trace_sharing(TRACE, 1 / 4, levels).items():
            print(f"{b} prompts together: {v['reads_per_token']:.2f} expert reads and "
                  f"{v['union_per_token']:.2f} distinct experts per token and layer")
        return 0
    if not args.no_limit and (os.geteuid() != 0 or not (CGROUP_ROOT / "memory.limit_in_bytes").exists()):
        ap.error(f"needs root and a cgroup-v1 memory controller at {CGROUP_ROOT} (or --no-limit)")
    t_all = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="colibri-servebench-", dir=args.workdir))
    try:
        model_dir = prepare_model(args, workdir)
        sizes = safetensors_sizes(model_dir)
        n_experts = min(sizes["experts_per_layer"].values())
        slots = args.slots or max(1, n_experts // 4)
        cache = slots * len(sizes["layers"]) * sizes["one_expert"]
        limit = sizes["other_bytes"] + cache + args.overhead_mb * MiB
        print(f"routed experts {sizes['expert_bytes'] / 1e9:.2f} GB ({len(sizes['layers'])} MoE layers x "
              f"{n_experts} x {sizes['one_expert'] / MB:.2f} MB), the rest {sizes['other_bytes'] / 1e9:.2f} GB; "
              f"cache {slots} slots/layer = {cache / 1e9:.2f} GB (experts / cache = "
              f"{sizes['expert_bytes'] / cache:.1f}x)")
        print("NO memory limit and no cache drop (--no-limit): not cold" if args.no_limit else
              f"memory limit {limit / 1e9:.2f} GB (page cache included), page cache dropped before each run")
        print(f"clients {levels}; each {args.requests} request(s) of {args.prompt_len} prompt words, "
              f"{args.tokens} new tokens, sampled; prefetch {args.prefetch}; server torch threads {args.threads}",
              flush=True)
        configs = [(args.max_batch, c) for c in levels] + [(1, c) for c in levels]
        runs: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            order = configs[:]
            random.Random(args.seed + rnd).shuffle(order)
            for max_batch, clients in order:
                r = run_one(model_dir, args, max_batch, clients, slots, workdir, None if args.no_limit else limit,
                            rnd)
                runs.append(r)
                print(f"  round {rnd + 1} max-batch {max_batch} clients {clients}: {r['tokens_per_s']:.2f} tok/s, "
                      f"TTFT {fmt(r['ttft_median_s'], '.1f')} s, disk {fmt(r['disk_mb_per_token'], '.1f')} MB/token"
                      f", mean batch {fmt(r['mean_batch'], '.2f')}, peak "
                      f"{r['memory'].get('peak', 0) / 1e9:.2f} GB, exit {r['exit']}"
                      + (f", ERRORS {r['errors']}" if r["errors"] else ""), flush=True)

        def med(max_batch: int, clients: int, key: str) -> float | None:
            vals = [r[key] for r in runs if r["max_batch"] == max_batch and r["clients"] == clients
                    and not r["errors"] and r[key] is not None]
            return statistics.median(vals) if vals else None

        rows = []
        for max_batch in (args.max_batch, 1):
            base_tps, base_disk = med(max_batch, 1, "tokens_per_s"), med(max_batch, 1, "disk_mb_per_token")
            for c in levels:
                tps, disk = med(max_batch, c, "tokens_per_s"), med(max_batch, c, "disk_mb_per_token")
                rows.append((f"--max-batch {max_batch}", str(c), fmt(tps, ".2f"),
                             fmt(tps / base_tps if tps and base_tps else None, ".2f") + "x",
                             fmt(med(max_batch, c, "ttft_median_s"), ".1f"), fmt(med(max_batch, c, "ttft_max_s"), ".1f"),
                             fmt(disk, ".1f"), fmt(disk / base_disk if disk and base_disk else None, ".2f") + "x",
                             fmt(med(max_batch, c, "store_mb_per_token"), ".1f"),
                             fmt(med(max_batch, c, "leases_per_token"), ".0f"),
                             fmt(med(max_batch, c, "hit_rate"), ".0%"), fmt(med(max_batch, c, "mean_batch"), ".2f")))
        print()
        print(table(f"colibri serve, median of {args.rounds} round(s); ratios against 1 client of the same row group",
                    ("configuration", "clients", "tok/s", "vs 1", "TTFT med s", "TTFT max s", "disk MB/tok",
                     "vs 1", "store MB/tok", "leases/tok", "hit", "mean batch"), rows))
        goals = Goals()
        one, four = med(args.max_batch, 1, "tokens_per_s"), med(args.max_batch, 4, "tokens_per_s")
        if one and four:
            goals.check("4 clients / 1 client, aggregate tokens/s (batching)", four / one, ">= 2.5x",
                        four / one >= 2.5, f"{four / one:.2f}x")
        d1, d4 = med(args.max_batch, 1, "disk_mb_per_token"), med(args.max_batch, 4, "disk_mb_per_token")
        if d1 and d4:
            goals.check("4 clients / 1 client, disk MB per token (batching)", d4 / d1, "<= 0.5x",
                        d4 / d1 <= 0.5, f"{d4 / d1:.2f}x")
        if TRACE.exists() and not args.no_trace:
            shared = trace_sharing(TRACE, 1 / 4, levels)
            base = shared[levels[0]]["reads_per_token"]
            print()
            print(table("real routing (Qwen3.6-35B-A3B trace, 40 layers x 256 experts, top-8): B prompts "
                        "decoding together, cold, LRU of a quarter of the experts, decode only",
                        ("clients", "expert reads/token/layer", f"vs {levels[0]}", "union/token/layer"),
                        [(str(b), f"{v['reads_per_token']:.2f}", f"{v['reads_per_token'] / base:.2f}x",
                          f"{v['union_per_token']:.2f}") for b, v in shared.items()]))
        b4 = med(1, 4, "tokens_per_s")
        if four and b4:
            goals.check("4 clients: batching / --max-batch 1, tokens/s", four / b4, "> 1x", four / b4 > 1,
                        f"{four / b4:.2f}x", info=True)
        print()
        print(goals.render())
        elapsed = time.perf_counter() - t_all
        print(f"\ntotal time {elapsed:.0f} s")
        payload = {"command": " ".join(["benchmarks/serve.py"] + (sys.argv[1:] if argv is None else list(argv))),
                   "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "sizes": {k: v for k, v in sizes.items() if k != "experts_per_layer"}, "slots": slots,
                   "limit": limit, "runs": runs, "goals": goals.items, "elapsed_s": elapsed}
        path = write_json("serve", payload)
        if args.json:
            args.json.write_text(json.dumps(payload, indent=1, default=str))
        print(f"results written to {path}")
    finally:
        if args.keep_model and args.model is None:
            print(f"model kept in {workdir / 'model'}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
