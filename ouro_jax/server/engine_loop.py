"""The one thread that drives the engine.

The ``LLM`` is not thread-safe and its loop (``add_request`` / ``step`` / ``abort``) must never wait
for the event loop, nor the event loop for a step. So one thread owns the ``LLM``: asyncio handlers
hand it commands through a thread-safe queue, and it hands each request's new tokens back with
``loop.call_soon_threadsafe`` into the asyncio queue the handler waits on.

Only the public engine API is used. After this thread aborts a request it sends that request's final
event itself and forgets it; the engine's own final output of the abort (handed out by the next
``step``) then finds no listener and is dropped.

A data-parallel worker process (``replica_process.py``) runs the same loop with sinks that batch
events for its pipe (``submit_sink``) and flushes them once per iteration (``on_tick``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger("ouro_jax.server")

__all__ = ["EngineLoop", "TokenEvent", "EngineDead", "SPEC_STATE"]

#: The engine's self-speculative counters a loop publishes for ``/metrics`` (``LLM.stats`` names)
SPEC_STATE = (
    "spec_acceptance",
    "spec_mean_accepted_length",
    "spec_row_rounds",
    "spec_draft_time_s",
    "spec_verify_time_s",
)


@dataclasses.dataclass
class TokenEvent:
    """New tokens of one request (``index``: its place among the choices of one HTTP request)."""

    index: int
    token_ids: list[int]
    exit_depths: list[int]
    finished: bool = False
    finish_reason: Optional[str] = None
    error: Optional[BaseException] = None
    logprobs: Optional[list] = None  # a TokenLogprobs per token, when the request asks for them
    prompt_logprobs: Optional[list] = None  # with the final event, when the request asks for them


class EngineDead(RuntimeError):
    """The engine thread stopped (a step raised, or the server shut down)."""


@dataclasses.dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    sent: int = 0  # tokens already handed out

    def push(self, ev: TokenEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class BoundedQueue:
    """Places in a bounded queue of requests: ``_pending`` of ``max_pending`` taken, under ``_lock``
    (an engine loop, or the front's handle on a worker process)."""

    _lock: threading.Lock
    _pending: int
    max_pending: int

    def try_reserve(self, n: int) -> bool:
        """Take ``n`` places in the bounded queue; False (and nothing taken) if they do not fit."""
        with self._lock:
            if self._pending + n > self.max_pending:
                return False
            self._pending += n
            return True

    def release(self, n: int) -> None:
        """Give back places taken by ``try_reserve`` that were never submitted."""
        with self._lock:
            self._pending -= n


class EngineLoop(BoundedQueue):
    """Owns ``llm``; ``submit`` / ``abort`` are called from the event loop, everything else runs here."""

    def __init__(self, llm, max_pending: int, state_interval_s: float = 0.1, idle_wait_s: float = 0.05, name: str = ""):
        self.llm = llm
        self.max_pending = int(max_pending)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[Any, _Sink] = {}  # engine thread only
        self._lock = threading.Lock()
        self._pending = 0  # submitted and not finished (queued here, waiting or running in the engine)
        self._stopping = False
        self._drain = True
        self._state_interval, self._idle_wait = state_interval_s, idle_wait_s
        self.error: Optional[BaseException] = None
        self.state = dict(running=0, waiting=0, kv_usage=0.0, steps=0)  # replaced whole, read by /metrics
        self.last_stats: dict = {}  # the engine's stats() at the last state publish
        # called on the engine thread once per iteration (True when the state was just published) and
        # once when the thread ends: a worker process flushes its batched events there
        self.on_tick: Optional[Callable[[bool], None]] = None
        self._thread = threading.Thread(target=self._run, name=f"ouro-engine-loop{name}", daemon=True)

    # ---------------------------------------------------------------- event-loop side
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def running(self) -> bool:
        """The thread has not ended (it may have failed: see ``alive``)."""
        return self._thread.is_alive()

    @property
    def pending(self) -> int:
        return self._pending

    def cached_prefix_blocks(self, hashes) -> int:
        """How many leading blocks of ``hashes`` this engine's prefix cache holds (for routing)."""
        return self.llm.scheduler.cached_prefix_blocks(hashes)

    def submit(
        self,
        request_id,
        prompt_ids: Sequence[int],
        sampling_params,
        out: asyncio.Queue,
        index: int,
        prompt_from=None,
        near=None,
    ) -> "EngineLoop":
        """Queue an already validated request (its place taken with ``try_reserve``); its ``TokenEvent`` s
        arrive in ``out``. Called from the event loop thread. Returns the loop that holds the request
        (this one; a ``ReplicaSet`` returns the replica it chose), which its aborts go to.
        ``prompt_from``: ``LLM.add_request``'s (another choice of the same prompt); ``near``: the loop
        holding that request (a ``ReplicaSet`` routes there; one loop has no choice)."""
        if not self.alive or self._stopping:  # before the sink: a dead engine answers EngineDead
            raise EngineDead("the engine is not running")
        sink = _Sink(asyncio.get_running_loop(), out, index)
        return self.submit_sink(request_id, prompt_ids, sampling_params, sink, prompt_from)

    def submit_sink(
        self, request_id, prompt_ids: Sequence[int], sampling_params, sink, prompt_from=None
    ) -> "EngineLoop":
        """``submit`` with any sink: an object with ``index``, ``sent`` (0) and ``push(TokenEvent)``,
        which is called on the engine thread."""
        if not self.alive or self._stopping:
            raise EngineDead("the engine is not running")
        self._cmds.put(("add", request_id, prompt_ids, sampling_params, sink, prompt_from))
        return self

    def abort(self, request_id) -> None:
        """Cancel a request (its stream then ends with finish_reason ``abort``); unknown ids are ignored."""
        self._cmds.put(("abort", request_id))

    def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop the thread: after every unfinished request completes (``drain``) or aborting them."""
        self.stop(drain)
        self.join(timeout)

    def stop(self, drain: bool = True) -> None:
        """Ask the thread to stop (``shutdown`` without waiting)."""
        self._drain = drain
        self._stopping = True
        self._cmds.put(("wake",))

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ----------------------------------------------------------------------- engine thread
    def _finish(self, rid, sink: _Sink, ev: TokenEvent) -> None:
        sink.push(ev)
        self._sinks.pop(rid, None)
        with self._lock:
            self._pending -= 1

    def _command(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, sp, sink, prompt_from = cmd
            try:
                self.llm.add_request(ids, sp, request_id=rid, prompt_from=prompt_from)
            except Exception as e:  # noqa: BLE001 - validated before; a race (e.g. a duplicate id) lands here
                sink.push(TokenEvent(sink.index, [], [], True, None, error=e))
                with self._lock:
                    self._pending -= 1
                return
            self._sinks[rid] = sink
        elif kind == "abort":
            rid = cmd[1]
            sink = self._sinks.get(rid)
            if sink is not None:
                self.llm.abort(rid)
                self._finish(rid, sink, TokenEvent(sink.index, [], [], True, "abort"))

    def _dispatch(self, outs) -> None:
        for o in outs:
            sink = self._sinks.get(o.request_id)
            if sink is None:
                continue
            new_ids = list(o.token_ids[sink.sent :])
            new_depths = list(o.exit_depths[sink.sent :])
            lps = None if o.logprobs is None else o.logprobs[sink.sent :]
            sink.sent += len(new_ids)
            reason = o.finish_reason if o.finished else None
            ev = TokenEvent(sink.index, new_ids, new_depths, bool(o.finished), reason, logprobs=lps)
            if o.finished:
                ev.prompt_logprobs = o.prompt_logprobs
            if o.finished:
                self._finish(o.request_id, sink, ev)
            elif new_ids:
                sink.push(ev)

    def _publish_state(self) -> None:
        """The engine's state for ``/metrics`` (``ServerMetrics.engine_state``), from its stats."""
        st = self.last_stats = self.llm.stats()
        usable = max(1, st["kv_blocks"] - 1)
        self.state = dict(
            running=st["running"],
            waiting=st["waiting"] + self._cmds.qsize(),
            kv_usage=1.0 - st["free_blocks"] / usable,
            steps=self.state["steps"],
            **{k: st[k] for k in SPEC_STATE},
        )

    def _run(self) -> None:
        llm = self.llm
        last_state = 0.0
        steps = 0
        try:
            while True:
                busy = llm.has_unfinished()
                try:
                    cmd = self._cmds.get_nowait() if busy else self._cmds.get(timeout=self._idle_wait)
                    while True:
                        self._command(cmd)
                        cmd = self._cmds.get_nowait()
                except queue.Empty:
                    pass
                if self._stopping and not self._drain:
                    for rid, sink in list(self._sinks.items()):
                        llm.abort(rid)
                        self._finish(rid, sink, TokenEvent(sink.index, [], [], True, "abort"))
                if llm.has_unfinished():
                    self._dispatch(llm.step())
                    steps += 1
                elif self._stopping and self._cmds.empty():
                    break
                now = time.monotonic()
                # at most every state interval while busy, and at once when the engine falls idle (an
                # idle server's gauges must not keep the last busy reading: KV use, running)
                published = now - last_state >= self._state_interval or (steps and not llm.has_unfinished() and busy)
                if published:
                    last_state = now
                    self.state["steps"] = steps
                    self._publish_state()
                if self.on_tick is not None:
                    self.on_tick(bool(published))
        except BaseException as e:  # noqa: BLE001 - every waiting client must hear of it
            self.error = e
            log.exception("the engine loop stopped")
            for rid, sink in list(self._sinks.items()):
                self._finish(rid, sink, TokenEvent(sink.index, [], [], True, None, error=EngineDead(str(e))))
            self._fail_queued(e)
        else:
            self._fail_queued(EngineDead("the server is shutting down"))
        finally:
            try:
                self._publish_state()
            except Exception:  # noqa: BLE001
                pass
            if self.on_tick is not None:
                try:
                    self.on_tick(True)
                except Exception:  # noqa: BLE001 - e.g. the pipe of a worker whose front is gone
                    log.exception("the engine loop's last tick failed")

    def _fail_queued(self, e: BaseException) -> None:
        """Answer commands that arrived after the loop stopped, so that no handler waits forever."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                sink = cmd[4]
                sink.push(TokenEvent(sink.index, [], [], True, None, error=EngineDead(str(e))))
                with self._lock:
                    self._pending -= 1
