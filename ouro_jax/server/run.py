"""Running the app: ``serve`` (the CLI's blocking server, SIGTERM drains) and ``BackgroundServer``
(uvicorn in a thread on a loopback port, for tests and benchmarks)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Optional

import uvicorn

from .app import ServerState, create_app
from .chat_template import chat_template_of, load_chat_template
from .engine_loop import EngineLoop
from .replicas import ReplicaSet

log = logging.getLogger("ouro_jax.server")

__all__ = ["make_state", "serve", "BackgroundServer"]


def make_state(
    llm,
    model_name: str,
    model_path=None,
    max_queue: int = 256,
    startup: Optional[dict] = None,
    prefix_slack: Optional[int] = None,
    replicas: Optional[list] = None,
    reasoning_parser: Optional[str] = None,
    max_n: int = 16,
) -> ServerState:
    """The server around a built ``llm`` (or a list of data-parallel replicas: ``replicas.py``): its
    engine thread(s) (started) and the checkpoint's chat template (without a folder: the preset's). With
    ``replicas`` (worker processes from ``replica_process.start_replica_processes``), ``llm`` is their ``FrontModel``.

    At most ``max_num_seqs + max_queue`` requests are unfinished at once per engine; more are
    answered 429 (worker processes took their bound when they were started)."""
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    llms = list(llm) if isinstance(llm, (list, tuple)) else [llm]
    if not llms:
        raise ValueError("make_state needs at least one engine")
    folder = os.fspath(model_path) if model_path is not None and os.path.isdir(os.fspath(model_path)) else None
    template = load_chat_template(folder)
    if folder is None and llms[0].tokenizer is not None:  # random weights: the preset tokenizer's template
        from weights.tokenizer import PRESET_TOKENIZER_CONFIG

        template = chat_template_of(PRESET_TOKENIZER_CONFIG)
    if replicas is not None:
        engine = ReplicaSet(replicas, prefix_slack=prefix_slack).start()
    elif len(llms) == 1:
        engine = EngineLoop(llms[0], llms[0].scheduler_config.max_num_seqs + max_queue).start()
    else:
        loops = [EngineLoop(x, x.scheduler_config.max_num_seqs + max_queue, name=f"-{i}") for i, x in enumerate(llms)]
        engine = ReplicaSet(loops, prefix_slack=prefix_slack).start()
    return ServerState(
        llm=llms[0], engine=engine, model_name=model_name, chat_template=template, startup=startup,
        reasoning_parser=reasoning_parser, max_n=max_n,
    )  # fmt: skip


# after the drain, the responses still open have only their last bytes to write
_CLOSE_GRACE_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server with a drain (the README's "Serve it" describes it for users).

    The first SIGTERM / SIGINT (or ``request_drain``) keeps the listening socket open: from then on new
    requests and ``/health`` are answered 503 (``ServerState.draining``) while the requests in flight
    run. Once those have been answered and the engine has nothing unfinished (``engine.pending``),
    or ``drain_timeout_s`` passed and the rest were aborted, uvicorn is told to exit; it closes the
    socket and waits (at most ``_CLOSE_GRACE_S``) for responses still being written. A second
    signal aborts everything at once (exit status 128 + signal)."""

    def __init__(self, config, state: ServerState, drain_timeout_s: float = 30.0, t_start: Optional[float] = None):
        super().__init__(config)
        self.state, self.t_start = state, t_start
        self.drain_timeout_s = drain_timeout_s
        self.drain_asked: Optional[float] = None  # monotonic time of the first signal / request_drain
        self.forced_by: Optional[int] = None  # the second signal, which cut the drain short
        self.drain_result: Optional[dict] = None  # finished, aborted, seconds, reason: set when it ended
        self._in_flight: Optional[list] = None  # the HTTP requests open when the drain started

    def handle_exit(self, sig, frame) -> None:
        # a signal handler: it only sets flags, on_tick acts on them on the event loop
        if self.drain_asked is None:
            self.request_drain()
        else:
            self.forced_by = sig

    def request_drain(self) -> None:
        """Start the drain (from any thread): 503 from now on, exit once nothing is unfinished."""
        self.state.draining = True
        if self.drain_asked is None:
            self.drain_asked = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self.drain_asked is not None and self._drain_ended()

    def _drain_ended(self) -> bool:
        """One look at the drain (every 0.1 s): True once uvicorn may exit."""
        engine = self.state.engine
        if self._in_flight is None:
            # requests that arrive later are answered 503; one that passed that check just before
            # holds a place in the engine (``pending``) until it is answered
            self._in_flight = list(self.server_state.tasks)
            log.info(
                "drain: started: new requests are answered 503; %d in flight get up to %g s to finish",
                len(self._in_flight), self.drain_timeout_s,
            )  # fmt: skip
        seconds = time.monotonic() - self.drain_asked
        open_ = [t for t in self._in_flight if not t.done()]
        if self.forced_by is not None:
            reason = f"second signal ({signal.Signals(self.forced_by).name})"
        elif not open_ and engine.pending == 0:
            reason = "done"
        elif seconds >= self.drain_timeout_s:
            reason = f"timeout of {self.drain_timeout_s:g} s"
        else:
            return False
        if engine.pending:
            engine.stop(drain=False)  # every unfinished stream ends with finish_reason "abort"
        finished, aborted = len(self._in_flight) - len(open_), len(open_)
        self.drain_result = dict(finished=finished, aborted=aborted, seconds=seconds, reason=reason)
        log.info("drain: ended (%s) after %.2f s: %d requests finished, %d aborted", reason, seconds, finished, aborted)
        return True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.t_start is not None and self.started:
            st = self.state.startup or {}
            log.info(
                "start-up: ready in %.2f s (load %.2f s, compile %.2f s: %d executables from the store, "
                "%d from the persistent cache, %d compiled)",
                time.perf_counter() - self.t_start, st.get("load_s", 0.0), st.get("compile_s", 0.0),
                st.get("store_loads", 0), st.get("cache_hits", 0), st.get("compiled", 0),
            )  # fmt: skip


def serve(
    state: ServerState,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    t_start=None,
    access_log: bool = True,
    drain_timeout_s: float = 30.0,
) -> int:
    """Serve until SIGTERM / SIGINT, then drain (``_Server``); returns the exit status: 0, or 128 +
    signal when a second signal cut the drain short."""
    config = uvicorn.Config(
        create_app(state), host=host, port=port, log_level=log_level, timeout_keep_alive=5, access_log=access_log,
        timeout_graceful_shutdown=_CLOSE_GRACE_S,
    )  # fmt: skip
    server = _Server(config, state, drain_timeout_s, t_start)
    try:
        server.run()
    finally:
        state.engine.shutdown(drain=False, timeout=60)  # drained already: anything left is aborted
    return 0 if server.forced_by is None else 128 + server.forced_by


class BackgroundServer:
    """The app on ``127.0.0.1:<free port>`` in a daemon thread; ``stop`` drains (as SIGTERM does) and joins."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.state = state
        config = uvicorn.Config(
            create_app(state), host=host, port=port, log_level=log_level, lifespan="off",
            timeout_graceful_shutdown=_CLOSE_GRACE_S,
        )  # fmt: skip
        self.server = _Server(config, state)
        self._thread = threading.Thread(target=self.server.run, name="ouro-uvicorn", daemon=True)
        self.host = host
        self.port: Optional[int] = None

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        """Drain as SIGTERM does (``timeout``: the drain's limit), then stop the engine."""
        self.server.drain_timeout_s = timeout
        self.server.request_drain()
        self._thread.join(timeout + _CLOSE_GRACE_S + 5.0)
        self.state.engine.shutdown(drain=False, timeout=timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
