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
its own prompt (``--workload``: ``random``, ``--prompt-len`` random words;
``template``, the same ``--template-words`` words for every client, as a
shared system prompt and chat template, then ``--prompt-len`` random words
of its own), sampled (temperature 1, seeded), ``--tokens`` new tokens each,
``--requests`` requests one after the other. Per run:

- aggregate tokens/s: the tokens all clients received over the wall time
  from the first request sent to the last token received (prefill included);
- time to first token (TTFT): from sending a request to its first text chunk;
- disk MB per generated token: ``read_bytes`` of the server's
  ``/proc/PID/io`` over the run (page faults included) per token received;
  also the store's own ``bytes_read`` per token, the experts PILOT began to
  prefetch per token and the share of them a lease then used, its expert leases
  per token (prefill included: fewer than top-k x layers when sequences
  share experts), its hit rate and the mean batch (``/metrics``).

Before the clients start, one request of one word and one token takes the
server's one-time start-up work (first allocations and calls) out of the
figures; it leaves at most top-k experts per layer in the cache.

Each concurrency runs with ``--max-batch`` (batching) and with
``--max-batch 1`` (one request at a time). Goals, as ratios in one run: with
batching, 4 clients reach at least 2.5x the aggregate tokens/s of 1 client
and at most 0.5x its disk MB per token.

How many experts concurrent requests share depends on the routing. So the
run ends with the same question on real routing (benchmarks/serve_replay.py
at this run's cache fraction: both traces of tests/data/traces replayed as
batches through the store's policies and Belady's bound; ``--trace-only``
runs all of it, ``--trace FILE`` adds a trace). ``--record-routing FILE``
records the benchmark model's own decode routing under ``--workload``
(in-process, every expert cached, no cgroup) for that replay.

Needs root (cgroups, drop_caches) and a cgroup-v1 memory controller;
``--no-limit`` runs without them (then the runs are not cold).

    python benchmarks/serve.py                 # the 5 GB model of generate.py
    python benchmarks/serve.py --quick         # a 40 MB model, 8 new tokens: a smoke run
    python benchmarks/serve.py --trace-only    # the replay of real routing alone, about two minutes
    python benchmarks/serve.py --record-routing synth.npz --workload template
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
import serve_replay  # noqa: E402
from _common import Goals, drop_caches, table, write_json  # noqa: E402
from generate import CGROUP_ROOT, FULL_MODEL, QUICK_MODEL, MemoryCgroup, safetensors_sizes  # noqa: E402

MB = 1e6
MiB = 1 << 20
CONCURRENCY = (1, 2, 4, 8)
WORKLOADS = ("random", "template")


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


def make_prompts(args: argparse.Namespace, vocab: int, clients: int, salt: int) -> list[list[str]]:
    """``args.requests`` prompts for each client (``salt`` varies them between
    runs): ``--prompt-len`` random words, after ``--template-words`` words
    every prompt shares when the workload is ``template``."""
    shared = random.Random(args.seed)
    template = [f"w{shared.randrange(vocab)}" for _ in range(args.template_words)] \
        if args.workload == "template" else []
    rng = random.Random(args.seed * 1000 + salt)
    return [[" ".join(template + [f"w{rng.randrange(vocab)}" for _ in range(args.prompt_len)])
             for _ in range(args.requests)] for _ in range(clients)]


def client_seed(args: argparse.Namespace, c: int) -> int:
    """The sampling seed of client ``c``'s first request (its i-th adds i)."""
    return args.seed + 7919 * c


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
        if args.policy:
            cmd += ["--policy", args.policy]
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
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        prompts = make_prompts(args, vocab, clients, rnd * 100 + clients)
        # One token of one word first, so the figures leave out the server's
        # one-time start-up work (allocations, first calls); it leaves at most
        # top-k experts per layer in the cache.
        client(server.url, ["w1"], 1, args.seed, threading.Barrier(1))
        m0, r0 = server.metrics(), server.read_bytes()
        start = threading.Barrier(clients + 1)
        results: list[dict[str, Any]] = [{} for _ in range(clients)]

        def go(c: int) -> None:
            try:
                results[c] = client(server.url, prompts[c], args.tokens, client_seed(args, c), start)
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
        "prefetched_per_token": d.get("colibri_store_prefetched_total", 0.0) / tokens if tokens else None,
        "prefetch_used": (d.get("colibri_store_prefetch_hits_total", 0.0) / d["colibri_store_prefetched_total"]
                          if d.get("colibri_store_prefetched_total") else None),
        "policy": next((k.split('"')[1] for k in m1 if k.startswith("colibri_store_info{")), None),
        "mean_batch": d.get("colibri_serve_decode_rows_total", 0.0) / steps if steps else None,
        "exit": stopped["exit"], "memory": stopped["memory"], "cold": server.cold,
    }


# -- the benchmark model's own routing, for benchmarks/serve_replay.py --

def record_routing(model_dir: Path, args: argparse.Namespace, out: Path, prompts: int) -> None:
    """Decode ``prompts`` prompts of ``--workload`` one at a time, each as a
    client of the live run would (``--tokens`` tokens, temperature 1, its
    seed), through colibri serve's engine in this process with every expert
    cached, and save the decode steps' routing as a trace (one sequence per
    prompt; the first token of each comes from its prefill and is not in it)."""
    import queue

    import colibri.hf as hf
    from colibri import Trace
    from colibri.serve.engine import Engine, Sampling

    config = json.loads((model_dir / "config.json").read_text())
    experts = max(safetensors_sizes(model_dir)["experts_per_layer"].values())
    model = hf.from_pretrained(model_dir, slots_per_layer=experts, prefetch="off")
    runtime = hf.runtime_of(model)
    layers = list(runtime.moe_layers)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [p for client in make_prompts(args, int(config["vocab_size"]), prompts, 0) for p in client[:1]]
    rows: list[dict[int, list[int]]] = []
    sequence: list[int] = []

    def route(layer: int, index: Any, weights: Any) -> None:   # a decode step of one sequence has one row
        if index.shape[0] == 1:
            if layer == layers[0]:
                rows.append({})
            rows[-1][layer] = index[0].tolist()

    runtime.routing = route
    engine = Engine(model, max_batch=1).start()
    try:
        for i, text in enumerate(texts):
            events: queue.Queue[Any] = queue.Queue()
            engine.submit(tokenizer(text)["input_ids"], Sampling(max_tokens=args.tokens, temperature=1.0,
                                                                 seed=client_seed(args, i)), events.put)
            while (event := events.get(timeout=3600)).kind == "token":
                pass
            if event.kind != "done":
                raise RuntimeError(f"prompt {i}: {event}")
            sequence += [i] * (len(rows) - len(sequence))
            print(f"  prompt {i + 1}/{len(texts)}: {len(rows)} decode steps recorded", flush=True)
    finally:
        engine.shutdown(timeout=120)
        model.colibri_close()
    trace = Trace.from_arrays(layers, [[r[layer] for layer in layers] for r in rows], None, sequence, experts)
    trace.save(out)
    print(f"routing of {len(texts)} {args.workload} prompts ({len(trace)} decode tokens) written to {out}")


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
    ap.add_argument("--prompt-len", type=int, default=16, help="random words (tokens) of each prompt's own")
    ap.add_argument("--workload", choices=WORKLOADS, default="random",
                    help="random: prompts of random words; template: a prefix every prompt shares, then those")
    ap.add_argument("--template-words", type=int, default=64, help="the shared prefix of --workload template")
    ap.add_argument("--policy", default=None, help="colibri serve --policy (default: the server's)")
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
    ap.add_argument("--no-trace", action="store_true", help="skip the replay of real routing after the live runs")
    ap.add_argument("--trace-only", action="store_true", help="only the replay of real routing (serve_replay.py)")
    ap.add_argument("--trace", type=Path, action="append", default=[], help="another trace for the replay")
    ap.add_argument("--record-routing", type=Path, default=None, metavar="FILE",
                    help="only record the model's decode routing under --workload into FILE (a trace)")
    ap.add_argument("--record-prompts", type=int, default=16, help="prompts --record-routing decodes")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens = min(args.tokens, 8)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.trace_only:
        serve_replay.run(args.trace, batches=sorted({1, *levels}))
        return 0
    if args.record_routing is not None:
        workdir = Path(tempfile.mkdtemp(prefix="colibri-servebench-", dir=args.workdir))
        try:
            record_routing(prepare_model(args, workdir), args, args.record_routing, args.record_prompts)
        finally:
            if args.model is None and not args.keep_model:
                shutil.rmtree(workdir, ignore_errors=True)
            elif args.model is None:
                print(f"model kept in {workdir / 'model'}")
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
        print(f"clients {levels}; each {args.requests} request(s) of "
              + (f"{args.template_words} shared + " if args.workload == "template" else "")
              + f"{args.prompt_len} prompt words, "
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
                             fmt(med(max_batch, c, "hit_rate"), ".0%"),
                             fmt(med(max_batch, c, "prefetched_per_token"), ".0f"),
                             fmt(med(max_batch, c, "prefetch_used"), ".0%"), fmt(med(max_batch, c, "mean_batch"), ".2f")))
        policies = sorted({str(r["policy"]) for r in runs})
        print()
        print(table(f"colibri serve ({args.workload} prompts, policy {', '.join(policies)}), median of {args.rounds} "
                    "round(s); ratios against 1 client of the same row group",
                    ("configuration", "clients", "tok/s", "vs 1", "TTFT med s", "TTFT max s", "disk MB/tok",
                     "vs 1", "store MB/tok", "leases/tok", "hit", "prefetched/tok", "used", "mean batch"), rows))
        goals = Goals()
        one, four = med(args.max_batch, 1, "tokens_per_s"), med(args.max_batch, 4, "tokens_per_s")
        if one and four:
            goals.check("4 clients / 1 client, aggregate tokens/s (batching)", four / one, ">= 2.5x",
                        four / one >= 2.5, f"{four / one:.2f}x")
        d1, d4 = med(args.max_batch, 1, "disk_mb_per_token"), med(args.max_batch, 4, "disk_mb_per_token")
        if d1 and d4:
            goals.check("4 clients / 1 client, disk MB per token (batching)", d4 / d1, "<= 0.5x",
                        d4 / d1 <= 0.5, f"{d4 / d1:.2f}x")
        if not args.no_trace:
            print()
            serve_replay.run(args.trace, fractions=[slots / n_experts], batches=sorted({1, *levels}))
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
