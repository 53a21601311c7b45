"""A running ``colibri serve``: the engine thread, uvicorn in a thread, and an orderly stop.

    model, tokenizer = load("path/to/model", slots=8)
    with Server(model, tokenizer, port=0) as server:      # port 0: any free port
        print(server.url)                                 # http://127.0.0.1:PORT
    # leaving the block stops it and closes the model's store

The command line (``colibri serve``) is this plus signal handling.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from typing import Any, TextIO

from colibri.errors import ColibriError

__all__ = ["load", "eos_ids", "bind", "Server", "DEFAULT_POLICY"]

#: The store's eviction policy unless told otherwise. On both real routing
#: traces, replayed as batches of 1 to 8 requests at 12.5-50% of the experts,
#: cooc read at most 0.4% more than lru and up to 9% less (docs/serve.md).
DEFAULT_POLICY = "cooc"


def load(model_dir: str, *, ram_gb: float | str | None = None, slots: int | None = None, prefetch: str = "pilot",
         policy: str = DEFAULT_POLICY, out: TextIO | None = None) -> tuple[Any, Any]:
    """The tokenizer and the :func:`colibri.hf.from_pretrained` model of
    ``model_dir`` (``ram_gb``: the expert cache in GiB, or ``"auto"``: see
    ``open_store(capacity_bytes="auto")``; ``slots``: slots per
    MoE layer; neither: the store's default; ``policy``: the store's eviction
    policy, one of :data:`colibri.POLICIES`). Progress goes to ``out``."""
    import colibri.hf as hf

    out = out if out is not None else sys.stderr
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise hf.UnsupportedModelError("colibri serve needs torch and transformers: "
                                       "pip install 'colibri[serve]'") from exc
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise hf.UnsupportedModelError(f"{model_dir}: not a model directory (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ColibriError(f"{model_dir}: no usable tokenizer ({exc})") from None
    budget: dict[str, Any] = {}
    if ram_gb is not None:
        budget["capacity_bytes"] = "auto" if ram_gb == "auto" else int(float(ram_gb) * 2**30)
    if slots is not None:
        budget["slots_per_layer"] = slots
    print(f"colibri serve: loading {model_dir} (the non-expert weights; the experts stay on disk)",
          file=out, flush=True)
    t0 = time.perf_counter()
    model = hf.from_pretrained(model_dir, prefetch=prefetch, policy=policy, **budget)
    model.eval()
    runtime = hf.runtime_of(model)
    store = runtime.store
    layer = runtime.moe_layers[0]
    print(f"colibri serve: {type(model).__name__} loaded in {time.perf_counter() - t0:.1f} s: "
          f"{len(runtime.moe_layers)} MoE layers x {store.num_experts(layer)} experts, "
          f"{store.slots(layer)} slots per layer ({_size(store.stats().capacity_bytes)} of cache), "
          f"policy {store.policy}, prefetch {prefetch}", file=out, flush=True)
    return model, tokenizer


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a completion: the model's generation config's
    ``eos_token_id`` (what ``generate`` stops at), else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (not listening yet: connections
    are refused until the server is ready)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ColibriError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ColibriError(f"cannot listen on {host}:{port}: {exc}") from None
    return sock


class Server:
    """``colibri serve`` for a loaded model, in this process.

    ``start()`` starts the engine and uvicorn (in threads) and returns when
    the server answers; ``stop()`` refuses new requests, lets running ones
    finish for up to ``drain`` seconds, cancels the rest, stops both threads
    and closes the model's store. ``sock`` is a socket from :func:`bind`
    (else one is bound to ``host``:``port``; port 0 picks a free one).
    """

    def __init__(self, model: Any, tokenizer: Any, *, host: str = "127.0.0.1", port: int = 8000,
                 max_batch: int = 8, api_key: str | None = None, model_name: str | None = None,
                 context: int | None = None, drain: float = 10.0, sock: socket.socket | None = None,
                 model_dir: str | None = None) -> None:
        import uvicorn

        import colibri.hf as hf
        from colibri.serve.api import create_app
        from colibri.serve.engine import Engine

        self.model = model
        self.runtime = hf.runtime_of(model)
        self.engine = Engine(model, max_batch=max_batch, context=context, eos=eos_ids(model, tokenizer))
        if model_name is None:
            source = model_dir or getattr(model, "name_or_path", "") or "model"
            model_name = os.path.basename(os.path.normpath(str(source))) or "model"
        self.model_name = model_name
        self.drain = drain
        self.sock = sock if sock is not None else bind(host, port)
        self._address = self.sock.getsockname()[:2]
        self.app = create_app(self.engine, tokenizer, model_id=model_name, api_key=api_key)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=math.ceil(drain))
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._address
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 60.0) -> "Server":
        self.engine.start()
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self.sock]},
                                        name="colibri-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ColibriError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def force(self) -> None:
        """Stop at once: cancel every running request (a second signal)."""
        self._uvicorn.force_exit = True
        self._uvicorn.should_exit = True
        self.engine.stop_accepting()
        self.engine.cancel_running()

    def stop(self) -> None:
        """Refuse new requests, drain, cancel what is left, close the store (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self.engine.stop_accepting()
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(self.drain + 10)
            if self._thread.is_alive():
                self.force()
                self._thread.join(10)
        self.engine.shutdown(timeout=120)
        self.sock.close()
        self.runtime.close()

    def __enter__(self) -> "Server":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
