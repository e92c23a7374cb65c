"""Data-parallel replicas as worker processes (``--replica-mode process``, the default for ``M > 1``).

Why processes: each engine's host scheduler is Python, and ``M`` of them in one process share one
GIL, so the replicas' host work runs one at a time. Here every replica is its own interpreter (one
GIL each), started with the ``spawn`` method (never a fork of a process that imported jax):

- the HTTP front keeps FastAPI, the ``Router`` and ``/metrics`` and never initialises a jax backend
  (on the GPU that would take most of every card's memory); ``probe_devices`` counts the devices in a
  short-lived child instead;
- worker ``i`` gets ``CUDA_VISIBLE_DEVICES`` set to its slice of the GPUs before jax starts in it
  (it sees them as ``0..N-1``); on the CPU each worker uses its own host devices; it builds an
  ``LLM`` (``startup.build_engine``) and drives it with the same :class:`EngineLoop` as the thread
  mode;
- :class:`RemoteReplica` is the front's stand-in for a worker's ``EngineLoop`` (``submit``,
  ``abort``, ``pending``, ``alive``, ``state``, ``cached_prefix_blocks`` ...).

IPC is two one-way ``multiprocessing`` pipes per worker carrying small pickled batches: commands
(``add`` / ``abort`` / ``stop``) from a sender thread, and per engine iteration one batch of the new
tokens / finishes of its requests, plus at each state publish the engine state, its ``stats()`` and
the prefix-cache changes (``KVBlockManager.cache_log``) that the front mirrors for prefix routing.

A worker that dies is seen as the end of its pipe: its unfinished requests end with an
``EngineDead`` error (HTTP 503) and ``alive`` turns false (``/health`` 503). Workers ignore SIGINT
and SIGTERM (a terminal's Ctrl-C reaches the whole process group): the front drains them with
``stop`` messages, and a worker whose front is gone (its command pipe closed) aborts and exits.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
import traceback
import weakref
from typing import Any, Optional, Sequence

from scheduler.block_manager import leading_matches

from .engine_loop import BoundedQueue, EngineDead, TokenEvent

log = logging.getLogger("ouro_jax.server")

__all__ = [
    "FrontModel",
    "RemoteReplica",
    "probe_devices",
    "check_process_replicas",
    "replica_env",
    "start_replica_processes",
]

_CTX = multiprocessing.get_context("spawn")
_ENV_LOCK = threading.Lock()  # os.environ is process-wide: one child started at a time
_LIVE: "weakref.WeakSet[RemoteReplica]" = weakref.WeakSet()  # workers to stop if the front exits first


@atexit.register
def _stop_workers_at_exit() -> None:
    """Workers ignore SIGTERM (multiprocessing's own exit handler would wait forever for them): closing
    their command pipes makes them abort and exit; one that does not is killed."""
    reps = [r for r in list(_LIVE) if r.process.pid is not None and r.process.is_alive()]
    for r in reps:
        with contextlib.suppress(Exception):
            r._cmd.close()
    for r in reps:
        r.process.join(10)
        if r.process.is_alive():
            r.process.kill()
            r.process.join(5)


# ------------------------------------------------------------------------------ front model
class FrontModel:
    """What the HTTP front needs of an ``LLM`` without weights or devices: the model config, the
    tokenizer, ``encode`` and ``check_request`` (the engine's own rules, through the public
    functions ``LLM`` uses), and a ``Scheduler`` of the workers' config for prefix hashes
    (``ReplicaSet.route``) and admission checks."""

    def __init__(self, model, scheduler_config=None):
        from ouro_jax.llm import load_tokenizer, resolve_model

        self.model_config, folder = resolve_model(model)  # config.json only: no weights
        self.tokenizer = load_tokenizer(folder, self.model_config)
        self.scheduler_config = self.scheduler = None
        if scheduler_config is not None:
            self.set_scheduler_config(scheduler_config)

    def set_scheduler_config(self, cfg) -> None:
        from scheduler import Scheduler

        self.scheduler_config = cfg
        self.scheduler = Scheduler(cfg)

    def encode(self, prompt):
        from ouro_jax.llm import encode_prompt

        return encode_prompt(prompt, self.tokenizer, self.model_config.vocab_size)

    def check_request(self, prompt, sampling_params=None):
        from ouro_jax.llm import check_request

        return check_request(self.scheduler, self.encode(prompt), sampling_params)


# ------------------------------------------------------------------------------- devices
def _probe_main(conn) -> None:
    try:
        import jax

        conn.send(("ok", jax.default_backend(), jax.device_count()))
    except BaseException as e:  # noqa: BLE001 - reported to the front
        conn.send(("failed", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def probe_devices(timeout: float = 300.0) -> tuple[str, int]:
    """``(backend, device count)`` as a fresh process with this environment sees them: this process
    initialises no jax backend (on the GPU that would take most of every card's memory)."""
    recv, send = _CTX.Pipe(duplex=False)
    with _child_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}):
        p = _CTX.Process(target=_probe_main, args=(send,), name="ouro-device-probe", daemon=True)
        p.start()
    send.close()
    try:
        if not recv.poll(timeout):
            raise RuntimeError(f"the device probe did not answer within {timeout} s")
        msg = recv.recv()
    except EOFError:
        msg = ("failed", f"the device probe exited with status {p.exitcode}")
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)
        recv.close()
    if msg[0] != "ok":
        raise RuntimeError(f"cannot count the devices: {msg[1]}")
    return msg[1], msg[2]


def check_process_replicas(data_parallel_size, tensor_parallel_size, backend: str, num_devices: int) -> int:
    """``data_parallel_size`` as an int, or a ``ValueError``: on an accelerator the replicas need
    ``M x N`` devices; on the CPU every worker has its own host devices, so each needs ``N``."""
    from .replicas import check_data_parallel

    dp = check_data_parallel(data_parallel_size, tensor_parallel_size, num_devices=1 << 30)  # the types
    if backend == "cpu":
        if tensor_parallel_size > num_devices:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} devices in each "
                f"replica's process, but jax sees {num_devices} host devices"
            )
        return dp
    return check_data_parallel(dp, tensor_parallel_size, num_devices)


def replica_env(index: int, tensor_parallel_size: int, backend: str, num_devices: int, environ=None) -> dict:
    """The environment variables worker ``index`` starts with: on the GPU its slice of the visible
    devices (``CUDA_VISIBLE_DEVICES``, taken from the front's own list when it has one)."""
    environ = os.environ if environ is None else environ
    if backend != "gpu":
        return {}
    visible = [x.strip() for x in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if not visible:
        visible = [str(i) for i in range(num_devices)]
    n = tensor_parallel_size
    return {"CUDA_VISIBLE_DEVICES": ",".join(visible[index * n : (index + 1) * n])}


@contextlib.contextmanager
def _child_env(env: dict):
    """``os.environ`` with ``env`` while a spawned child starts (it copies the environment then)."""
    with _ENV_LOCK:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# -------------------------------------------------------------------------------- worker
def _error_of(e: Optional[BaseException]):
    return None if e is None else (type(e).__name__, str(e))


def _exception(err) -> Optional[BaseException]:
    """The front's exception for a worker's ``(type name, message)``: ``EngineDead`` answers 503,
    ``ValueError`` (a request the engine refused) 400, anything else 400 with its message."""
    if err is None:
        return None
    name, msg = err
    if name == "EngineDead":
        return EngineDead(msg)
    return ValueError(msg) if name == "ValueError" else RuntimeError(f"{name}: {msg}")


class _Outbox:
    """Worker side: events gathered during one engine iteration, sent as one batch."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()
        self.items: list = []

    def push(self, item) -> None:
        with self.lock:
            self.items.append(item)

    def flush(self, state=None) -> None:
        with self.lock:
            items, self.items = self.items, []
            if items or state is not None:
                self.conn.send(("batch", items, state))


@dataclasses.dataclass
class _WorkerSink:
    """An ``EngineLoop`` sink that puts the request's events into the worker's outbox."""

    outbox: _Outbox
    request_id: Any
    index: int = 0
    sent: int = 0

    def push(self, ev: TokenEvent) -> None:
        self.outbox.push(
            (
                self.request_id,
                ev.token_ids,
                ev.exit_depths,
                ev.finished,
                ev.finish_reason,
                _error_of(ev.error),
                ev.logprobs,
                ev.prompt_logprobs,
            )
        )


class _CompileReports:
    """A worker's warm-up counter (``runner.CompileProgress``'s ``add`` / ``done``): the counts go to
    the front, which draws one bar for every replica."""

    def __init__(self, conn):
        self.conn = conn

    def add(self, n: int) -> None:
        self.conn.send(("compile", "add", n))

    def done(self, n: int = 1) -> None:
        self.conn.send(("compile", "done", n))


def _worker_main(index, model, engine_kwargs, env, cmd_conn, evt_conn, max_pending, log_level, state_interval_s):
    """A replica's process: build the engine, report ready, then run its ``EngineLoop`` on commands."""
    os.environ.update(env)  # set by the front before the start too; here for a child of another launcher
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front drains us (stop messages), not the terminal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s[replica {index}]: %(message)s"
    )
    outbox = _Outbox(evt_conn)
    try:
        from .engine_loop import EngineLoop
        from .startup import build_engine

        t0 = time.perf_counter()
        llm, timings = build_engine(model, engine_kwargs, counter=_CompileReports(evt_conn))
        timings["ready_s"] = time.perf_counter() - t0
        bm = llm.scheduler.block_manager
        if llm.scheduler_config.enable_prefix_caching:
            bm.cache_log = []
        loop = EngineLoop(llm, max_pending, state_interval_s=state_interval_s, name=f"-{index}")
        devices = [str(d) for d in (llm.devices or llm.runner.k_pool.devices())]
        evt_conn.send(
            ("ready", dict(timings=timings, scheduler_config=llm.scheduler_config, pid=os.getpid(), devices=devices))
        )
    except BaseException as e:  # noqa: BLE001 - the front reports it and stops every worker
        with contextlib.suppress(Exception):
            evt_conn.send(("failed", _error_of(e), traceback.format_exc()))
        raise SystemExit(1) from None

    def tick(published: bool) -> None:
        state = None
        if published:
            changes = []
            if bm.cache_log:
                changes, bm.cache_log = bm.cache_log, []
            state = dict(state=dict(loop.state), stats=dict(loop.last_stats), cache=changes)
        outbox.flush(state)

    loop.on_tick = tick
    loop.start()
    front_gone = False
    while loop.running:
        try:
            if not cmd_conn.poll(0.1):
                continue
            msgs = cmd_conn.recv()
        except (EOFError, OSError):  # the front is gone: nobody waits for these requests
            front_gone = True
            loop.stop(drain=False)
            break
        for m in msgs:
            kind = m[0]
            if kind == "add":
                _, rid, ids, sp, prompt_from = m
                sink = _WorkerSink(outbox, rid)
                try:
                    if not loop.try_reserve(1):
                        raise EngineDead(f"replica {index} has no room")
                    loop.submit_sink(rid, ids, sp, sink, prompt_from)
                except EngineDead as e:
                    sink.push(TokenEvent(0, [], [], True, None, error=e))
            elif kind == "abort":
                loop.abort(m[1])
            elif kind == "stop":
                loop.stop(drain=m[1])
    loop.join()
    if not front_gone:
        with contextlib.suppress(Exception):
            outbox.flush()
            evt_conn.send(("exit", _error_of(loop.error)))
    raise SystemExit(1 if loop.error is not None else 0)


# ------------------------------------------------------------------------ the front's proxy
@dataclasses.dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int


def _deliver(items) -> None:
    for q, ev in items:
        q.put_nowait(ev)


class RemoteReplica(BoundedQueue):
    """The front's handle on one worker process, with the interface of an ``EngineLoop``.

    ``submit`` / ``abort`` / ``stop`` are queued for a sender thread (the event loop never blocks on
    a pipe); a reader thread hands the worker's events to the waiting handlers and keeps ``state``,
    ``stats`` and the prefix-cache mirror current."""

    def __init__(
        self,
        index: int,
        model,
        engine_kwargs: dict,
        max_pending: int,
        env: Optional[dict] = None,
        log_level: str = "info",
        state_interval_s: float = 0.1,
    ):
        self.index, self.max_pending = index, int(max_pending)
        self.llm: Optional[FrontModel] = None  # set by start_replica_processes once the worker is ready
        self.env = dict(env or {})
        cmd_r, self._cmd = _CTX.Pipe(duplex=False)
        self._evt, evt_w = _CTX.Pipe(duplex=False)
        args = (index, model, engine_kwargs, self.env, cmd_r, evt_w, self.max_pending, log_level, state_interval_s)
        self.process = _CTX.Process(target=_worker_main, args=args, name=f"ouro-replica-{index}", daemon=True)
        self._child_ends = (cmd_r, evt_w)
        self.info: dict = {}  # the worker's ready message: timings, scheduler_config, pid, devices
        self.state = dict(running=0, waiting=0, kv_usage=0.0, steps=0)
        self.stats: dict = {}
        self.error: Optional[BaseException] = None
        self._cached: set = set()  # the worker's prefix cache, mirrored
        self._sinks: dict[Any, _Sink] = {}
        self._lock = threading.Lock()
        # the reader and ``join`` both wait for the worker's exit: one reaps it, and the other's
        # waitpid would then fail and take the dead worker for a live one (a spurious kill)
        self._reap_lock = threading.Lock()
        self._pending = 0
        self._stopping = self._gone = False
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name=f"ouro-replica-{index}-reader", daemon=True)
        self._sender = threading.Thread(target=self._send, name=f"ouro-replica-{index}-sender", daemon=True)

    # ------------------------------------------------------------------------ start-up
    def launch(self) -> "RemoteReplica":
        with _child_env(self.env):
            self.process.start()
        _LIVE.add(self)
        for c in self._child_ends:  # the worker's ends: its death then closes our pipes
            c.close()
        return self

    def poll_ready(self, counter=None) -> Optional[dict]:
        """The ready message once it came (None while still starting); raises if the worker failed.
        The worker's warm-up counts before it go to ``counter`` (``runner.CompileProgress``)."""
        while True:
            try:
                if not self._evt.poll(0):
                    return None
                msg = self._evt.recv()
            except (EOFError, OSError):
                self.process.join(5)
                raise RuntimeError(
                    f"replica {self.index} exited while starting (exit code {self.process.exitcode})"
                ) from None
            if msg[0] != "compile":
                break
            if counter is not None:
                getattr(counter, msg[1])(msg[2])
        if msg[0] == "failed":
            name, text = msg[1]
            err = f"replica {self.index} failed to start: {name}: {text}"
            log.error("%s\n%s", err, msg[2])
            raise (ValueError if name == "ValueError" else RuntimeError)(err)
        assert msg[0] == "ready", msg[0]
        self.info = msg[1]
        return self.info

    def start(self) -> "RemoteReplica":
        """Start the reader and sender threads (after the worker reported ready); a second call does nothing."""
        if self._reader.ident is None:
            self._reader.start()
            self._sender.start()
        return self

    # ------------------------------------------------------------------ event-loop side
    @property
    def alive(self) -> bool:
        return self.error is None and not self._gone and self.process.is_alive()

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid

    def cached_prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` in the worker's prefix cache, as of its last state report."""
        return leading_matches(hashes, self._cached)

    def submit(
        self, request_id, prompt_ids, sampling_params, out: asyncio.Queue, index: int, prompt_from=None, near=None
    ) -> "RemoteReplica":
        with self._lock:
            if self.error is not None or self._gone or self._stopping:
                raise EngineDead(f"replica {self.index} is not running")
            self._sinks[request_id] = _Sink(asyncio.get_running_loop(), out, index)
        self._out.put(("add", request_id, prompt_ids, sampling_params, prompt_from))
        return self

    def abort(self, request_id) -> None:
        self._out.put(("abort", request_id))

    def stop(self, drain: bool = True) -> None:
        self._stopping = True
        self._out.put(("stop", drain))

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the worker to exit; killed if it outlives ``timeout``."""
        with self._reap_lock:
            self.process.join(timeout)
            alive = self.process.is_alive()
        if alive:
            log.warning("replica %d did not stop in time: killing it", self.index)
            self.process.kill()
            self.process.join(10)
        self._out.put(None)
        for t in (self._reader, self._sender):
            if t.is_alive():
                t.join(10)
        for c in (self._cmd, self._evt):
            c.close()
        _LIVE.discard(self)

    def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        self.stop(drain)
        self.join(timeout)

    # --------------------------------------------------------------------- threads
    def _send(self) -> None:
        while True:
            batch = [self._out.get()]
            while True:
                try:
                    batch.append(self._out.get_nowait())
                except queue.Empty:
                    break
            last = None in batch
            batch = [m for m in batch if m is not None]
            try:
                if batch:
                    self._cmd.send(batch)
            except (OSError, ValueError):  # the worker is gone: the reader reports it
                return
            if last:
                return

    def _read(self) -> None:
        exit_error = None
        clean = False
        while True:
            try:
                msg = self._evt.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "batch":
                self._on_batch(msg[1], msg[2])
            elif msg[0] == "exit":
                exit_error, clean = msg[1], msg[1] is None
        with self._reap_lock:
            self.process.join(5)
        if clean and self._stopping:
            err = EngineDead("the server is shutting down")
        elif exit_error is not None:
            err = EngineDead(f"replica {self.index} stopped: {exit_error[0]}: {exit_error[1]}")
        else:
            err = EngineDead(f"replica {self.index} exited unexpectedly (exit code {self.process.exitcode})")
        with self._lock:
            self._gone = True
            if not (clean and self._stopping):
                self.error = err
                log.error("%s", err)
            sinks, self._sinks = self._sinks, {}
            self._pending -= len(sinks)
        self._push_all([(s, TokenEvent(s.index, [], [], True, None, error=err)) for s in sinks.values()])

    def _on_batch(self, items, state) -> None:
        # the state first: a handler that sees a request finish then sees the state after it
        if state is not None:
            for h, added in state["cache"]:
                if added:
                    self._cached.add(h)
                else:
                    self._cached.discard(h)
            self.stats = state["stats"]
            self.state = state["state"]
        out = []
        with self._lock:
            for rid, ids, depths, finished, reason, err, lps, prompt_lps in items:
                sink = self._sinks.pop(rid, None) if finished else self._sinks.get(rid)
                if sink is None:
                    continue
                if finished:
                    self._pending -= 1
                ev = TokenEvent(
                    sink.index, ids, depths, finished, reason, _exception(err), logprobs=lps, prompt_logprobs=prompt_lps
                )
                out.append((sink, ev))
        self._push_all(out)

    @staticmethod
    def _push_all(pairs) -> None:
        """One wake-up of each event loop for the whole batch."""
        by_loop: dict = collections.defaultdict(list)
        for sink, ev in pairs:
            by_loop[sink.loop].append((sink.queue, ev))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass


# ------------------------------------------------------------------------------ start-up
def start_replica_processes(
    model,
    engine_kwargs: Optional[dict],
    data_parallel_size,
    max_queue: int = 256,
    log_level: str = "info",
    startup_timeout: Optional[float] = None,
    devices: Optional[tuple[str, int]] = None,
) -> tuple[FrontModel, list[RemoteReplica], dict]:
    """``(front model, replicas, timings)``: ``M`` worker processes, each ready (engine built and
    warmed up), started together; ``ReplicaSet(replicas).start()`` (``run.make_state``) serves them.
    Bad sizes fail before any worker starts; a worker that fails to start stops the others and
    raises (``ValueError`` for a bad setting it found).

    ``devices``: ``(backend, count)`` when known (else ``probe_devices``). The workers' executables
    are drawn in one bar as they finish (workers whose ``progress`` option is on report them)."""
    kw = dict(engine_kwargs or {})
    tp = kw.get("tensor_parallel_size", 1)
    from .replicas import check_data_parallel

    check_data_parallel(data_parallel_size, tp, num_devices=1 << 30)  # types first, before the probe
    front = FrontModel(model)  # config and tokenizer: a bad model fails here
    backend, count = devices or probe_devices()
    dp = check_process_replicas(data_parallel_size, tp, backend, count)
    max_num_seqs = kw.get("max_num_seqs", 32)
    t0 = time.perf_counter()
    from ouro_jax.runner import CompileProgress

    counter = CompileProgress()
    reps = [
        RemoteReplica(i, model, kw, max_num_seqs + max_queue, replica_env(i, tp, backend, count), log_level)
        for i in range(dp)
    ]
    try:
        for r in reps:
            r.launch()
            log.info("start-up: replica %d started (pid %d, %s)", r.index, r.pid, r.env or "its host devices")
        waiting = list(reps)
        deadline = None if startup_timeout is None else t0 + startup_timeout
        while waiting:
            for r in list(waiting):
                if r.poll_ready(counter) is not None:
                    waiting.remove(r)
                    t = r.info["timings"]
                    log.info(
                        "start-up: replica %d ready after %.2f s on %s (load %.2f s, compile %.2f s: %d executables, "
                        "%d from the executable store, %d from the persistent cache, %d compiled)",
                        r.index, time.perf_counter() - t0, ",".join(r.info["devices"]), t["load_s"], t["compile_s"],
                        len(t["executables"]), t["store_loads"], t["cache_hits"], t["compiled"],
                    )  # fmt: skip
            if deadline is not None and time.perf_counter() > deadline:
                raise RuntimeError(f"replicas {[r.index for r in waiting]} not ready within {startup_timeout} s")
            if waiting:
                multiprocessing.connection.wait([r._evt for r in waiting], timeout=0.5)
    except BaseException:
        counter.close()
        for r in reps:
            if r.process.pid is not None and r.process.is_alive():
                r.process.kill()
            if r.process.pid is not None:
                r.process.join(10)
            r._cmd.close()
            r._evt.close()
        raise
    counter.close()
    cfgs = [r.info["scheduler_config"] for r in reps]
    # every replica admits what the front's admission check admits: the smallest pool decides
    cfg = min(cfgs, key=lambda c: c.num_blocks)
    if len({c.num_blocks for c in cfgs}) > 1:
        log.warning("start-up: the replicas' KV pools differ (%s blocks)", [c.num_blocks for c in cfgs])
    front.set_scheduler_config(cfg)
    for r in reps:
        r.llm = front
    timings = [r.info["timings"] for r in reps]
    wall = time.perf_counter() - t0
    out = dict(
        timings[0],
        replicas=timings,
        load_s=max(t["load_s"] for t in timings),
        compile_s=max(t["compile_s"] for t in timings),
        executables=[e for t in timings for e in t["executables"]],
        store_loads=sum(t["store_loads"] for t in timings),
        cache_hits=sum(t["cache_hits"] for t in timings),
        compiled=sum(t["compiled"] for t in timings),
        replicas_ready_s=wall,
        pids=[r.pid for r in reps],
    )
    log.info("start-up: %d replica processes ready in %.2f s", dp, wall)
    return front, reps, out
