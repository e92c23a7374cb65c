"""Running the app: ``serve`` (the CLI's blocking server, SIGTERM drains) and ``BackgroundServer``
(uvicorn in a thread on a loopback port, for tests and benchmarks)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

import uvicorn

from .app import ServerState, create_app
from .chat_template import load_chat_template
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
) -> ServerState:
    """The server around a built ``llm`` (or a list of data-parallel replicas: ``replicas.py``): its
    engine thread(s) (started) and the checkpoint's chat template. With ``replicas`` (worker
    processes from ``replica_process.start_replica_processes``), ``llm`` is their ``FrontModel``.

    At most ``max_num_seqs + max_queue`` requests are unfinished at once per engine; more are
    answered 429 (worker processes took their bound when they were started)."""
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    llms = list(llm) if isinstance(llm, (list, tuple)) else [llm]
    if not llms:
        raise ValueError("make_state needs at least one engine")
    folder = os.fspath(model_path) if model_path is not None and os.path.isdir(os.fspath(model_path)) else None
    template = load_chat_template(folder)
    if replicas is not None:
        engine = ReplicaSet(replicas, prefix_slack=prefix_slack).start()
    elif len(llms) == 1:
        engine = EngineLoop(llms[0], llms[0].scheduler_config.max_num_seqs + max_queue).start()
    else:
        loops = [EngineLoop(x, x.scheduler_config.max_num_seqs + max_queue, name=f"-{i}") for i, x in enumerate(llms)]
        engine = ReplicaSet(loops, prefix_slack=prefix_slack).start()
    return ServerState(llm=llms[0], engine=engine, model_name=model_name, chat_template=template, startup=startup)


class _Server(uvicorn.Server):
    """uvicorn's server, which answers 503 from the first SIGTERM/SIGINT on while open requests finish."""

    def __init__(self, config, state: ServerState, t_start: Optional[float] = None):
        super().__init__(config)
        self.state, self.t_start = state, t_start

    def handle_exit(self, sig, frame) -> None:
        if not self.state.draining:
            log.info("shutting down: draining %d unfinished requests", self.state.engine.pending)
        self.state.draining = True
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once it has stopped, which would kill the process before the
        # engine thread is joined; a drained shutdown is a clean exit instead (status 0)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

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
):
    """Serve until SIGTERM / SIGINT; running requests are finished before the engine stops."""
    config = uvicorn.Config(
        create_app(state), host=host, port=port, log_level=log_level, timeout_keep_alive=5, access_log=access_log
    )
    server = _Server(config, state, t_start)
    try:
        server.run()
    finally:
        state.engine.shutdown(drain=True, timeout=60)
    return 0


class BackgroundServer:
    """The app on ``127.0.0.1:<free port>`` in a daemon thread; ``stop`` drains and joins (bounded)."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.state = state
        config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level, lifespan="off")
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
        self.state.draining = True
        self.server.should_exit = True
        self._thread.join(timeout)
        self.state.engine.shutdown(drain=False, timeout=timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
