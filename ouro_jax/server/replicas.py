"""Data-parallel replicas behind one HTTP front (``ouro-jax serve --data-parallel-size M``).

``M`` engines, each an ``LLM`` on its own ``tensor_parallel_size`` devices (disjoint slices), in one
of two modes (``--replica-mode``):

- ``process`` (the default for ``M > 1``): one worker process per replica (``replica_process.py``).
  Each engine's host scheduler is Python; in one process the ``M`` schedulers share one GIL and run
  one at a time, which capped DP=2 at 1.39x one engine on two H200s. A process per replica gives
  each scheduler its own GIL; the front keeps HTTP, routing and ``/metrics``.
- ``thread``: ``M`` engines in this process, each driven by its own :class:`EngineLoop` thread
  (JAX dispatch is thread-safe; each replica's executables run on its own devices). For tests and
  single-host debugging; ``build_replicas`` builds them.

Either way the scheduler of each replica knows nothing of the others.

Routing (``Router``), per engine request, on the event-loop thread:

1. prefix-cache aware (only with ``enable_prefix_caching``): the prompt's leading full blocks are
   hashed the way the block manager keys its prefix cache (``Scheduler.prefix_hashes``); each
   replica's match is the longer of what its cache holds now and what the router sent it recently
   (a prefix is published only once its prefill finished, so a burst of requests sharing a system
   prompt would otherwise miss). The replica with the longest match takes the request unless it has
   more than ``prefix_slack`` unfinished requests above the least-loaded replica.
2. otherwise least-loaded: fewest unfinished requests (queued, waiting or running: ``pending``,
   exact and current, unlike the engine's published state), ties broken round-robin.

Back-pressure: every replica keeps its own bound (``max_num_seqs + max_queue``); a request is
answered 429 only when no replica has room. Aborts go to the replica that holds the request.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from .engine_loop import EngineDead, EngineLoop

log = logging.getLogger("ouro_jax.server")

__all__ = ["Router", "ReplicaSet", "check_data_parallel", "replica_devices", "build_replicas"]


def check_data_parallel(data_parallel_size, tensor_parallel_size=1, num_devices: Optional[int] = None) -> int:
    """``data_parallel_size`` as an int, or a ``ValueError`` (bad value, or fewer than ``M x N`` devices)."""
    for name, v in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if num_devices is None:
        import jax

        num_devices = len(jax.devices())
    need = data_parallel_size * tensor_parallel_size
    if need > num_devices:
        raise ValueError(
            f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tensor_parallel_size} needs "
            f"{need} devices, but jax sees {num_devices}"
        )
    return data_parallel_size


def replica_devices(data_parallel_size: int, tensor_parallel_size: int = 1, devices=None) -> list[list]:
    """Disjoint device sets, replica ``i`` taking ``devices[i*N:(i+1)*N]`` (neighbours share a link)."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    check_data_parallel(data_parallel_size, tensor_parallel_size, len(devices))
    n = tensor_parallel_size
    return [devices[i * n : (i + 1) * n] for i in range(data_parallel_size)]


class Router:
    """Which replica takes a request, from loads and prefix matches alone (no engine, no jax).

    ``memory``: how many prefix-block hashes it remembers (least recently routed dropped first)."""

    def __init__(self, num_replicas: int, prefix_slack: int, memory: int = 1 << 16):
        if num_replicas < 1 or prefix_slack < 0 or memory < 0:
            raise ValueError(f"bad router settings: {num_replicas} replicas, slack {prefix_slack}, memory {memory}")
        self.num_replicas, self.prefix_slack, self.memory = num_replicas, prefix_slack, memory
        self._next = 0  # round-robin start among equally loaded replicas
        self._routed: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # hash -> replica

    def remembered(self, hashes: Sequence[bytes]) -> list[int]:
        """Per replica, how many leading blocks of ``hashes`` were last routed to it."""
        out = [0] * self.num_replicas
        for i, h in enumerate(hashes):
            r = self._routed.get(h)
            if r is None:
                break
            out[r] = i + 1
        return out

    def remember(self, hashes: Sequence[bytes], replica: int) -> None:
        for h in hashes:
            self._routed[h] = replica
            self._routed.move_to_end(h)
        while len(self._routed) > self.memory:
            self._routed.popitem(last=False)

    def _least(self, loads: Sequence[int], cands: Sequence[int]) -> int:
        low = min(loads[i] for i in cands)
        n = self.num_replicas
        for k in range(n):
            i = (self._next + k) % n
            if i in cands and loads[i] == low:
                self._next = (i + 1) % n
                return i
        raise AssertionError("unreachable")

    def choose(
        self, loads: Sequence[int], matches: Sequence[int], room: Sequence[bool]
    ) -> tuple[Optional[int], Optional[str]]:
        """``(replica, reason)``: ``"prefix"`` (the longest match, not overloaded), ``"least_loaded"``,
        or ``(None, None)`` when no replica has ``room``."""
        cands = [i for i in range(self.num_replicas) if room[i]]
        if not cands:
            return None, None
        best = max(matches[i] for i in cands)
        if best > 0:
            holders = [i for i in cands if matches[i] == best]
            h = min(holders, key=lambda i: loads[i])
            if loads[h] <= min(loads[i] for i in cands) + self.prefix_slack:
                return h, "prefix"
        return self._least(loads, cands), "least_loaded"


class ReplicaSet:
    """``M`` engine loops with the interface of one (``submit`` returns the loop that took the request):
    ``EngineLoop`` threads or ``RemoteReplica`` worker processes (``replica_process.py``)."""

    def __init__(self, loops: Sequence, prefix_slack: Optional[int] = None):
        if not loops:
            raise ValueError("a replica set needs at least one engine")
        self.replicas = list(loops)
        self.llm = self.replicas[0].llm
        cfg = self.llm.scheduler_config
        self.prefix_routing = bool(cfg.enable_prefix_caching)
        slack = max(1, cfg.max_num_seqs // 4) if prefix_slack is None else prefix_slack
        self.router = Router(len(self.replicas), slack)
        self._lock = threading.Lock()
        self._unsubmitted = 0  # places taken by try_reserve and not yet submitted to a replica
        self.on_route: Optional[Callable[[int, str], None]] = None  # (replica, reason), for /metrics

    def start(self) -> "ReplicaSet":
        for r in self.replicas:
            r.start()
        return self

    @property
    def max_pending(self) -> int:
        return sum(r.max_pending for r in self.replicas)

    @property
    def alive(self) -> bool:
        """Every replica alive: one that died makes the server unhealthy rather than silently smaller."""
        return all(r.alive for r in self.replicas)

    @property
    def pending(self) -> int:
        return self._unsubmitted + sum(r.pending for r in self.replicas)

    @property
    def error(self) -> Optional[BaseException]:
        return next((r.error for r in self.replicas if r.error is not None), None)

    def try_reserve(self, n: int) -> bool:
        """Take ``n`` places among all replicas (each request later goes to one with room)."""
        with self._lock:
            if self.pending + n > self.max_pending:
                return False
            self._unsubmitted += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._unsubmitted -= n

    def route(self, prompt_ids) -> tuple[int, str, list]:
        """``(replica, reason, hashes)`` for a prompt, from current loads and prefix matches."""
        loads = [r.pending for r in self.replicas]
        room = [r.pending < r.max_pending for r in self.replicas]
        hashes: list = []
        matches = [0] * len(self.replicas)
        if self.prefix_routing:
            hashes = self.llm.scheduler.prefix_hashes(prompt_ids)
            if hashes:
                mem = self.router.remembered(hashes)
                held = [r.cached_prefix_blocks(hashes) for r in self.replicas]
                matches = [max(a, b) for a, b in zip(mem, held)]
        i, reason = self.router.choose(loads, matches, room)
        if i is None:  # cannot happen while reservations are honoured; a clear error if it does
            raise EngineDead("no replica has room")
        return i, reason, hashes

    def submit(
        self, request_id, prompt_ids, sampling_params, out, index: int, prompt_from=None, near=None
    ) -> EngineLoop:
        """Route one reserved request and queue it there; returns the replica's loop (for aborts).
        ``near``: the replica of the request it shares its prompt with (``prompt_from``), taken
        while it has room: the prompt's blocks are there."""
        # on failure the place stays reserved here: the caller releases it with the rest of its job
        with self._lock:
            if near in self.replicas and near.pending < near.max_pending:
                i, reason, hashes = self.replicas.index(near), "sibling", []
            else:
                i, reason, hashes = self.route(prompt_ids)
            loop = self.replicas[i]
            if not loop.try_reserve(1):
                raise EngineDead(f"replica {i} has no room")
            self._unsubmitted -= 1
        try:
            loop.submit(request_id, prompt_ids, sampling_params, out, index, prompt_from)
        except EngineDead:
            with self._lock:
                loop.release(1)
                self._unsubmitted += 1
            raise
        if hashes:
            self.router.remember(hashes, i)
        if self.on_route is not None:
            self.on_route(i, reason)
        return loop

    def abort(self, request_id) -> None:
        """Requests are aborted through the loop ``submit`` returned; this reaches every replica."""
        for r in self.replicas:
            r.abort(request_id)

    def stop(self, drain: bool = True) -> None:
        """Ask every replica to stop, drained or aborting (``shutdown`` without waiting)."""
        for r in self.replicas:
            r.stop(drain)

    def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop every replica (drained or aborting), together, within ``timeout`` overall."""
        self.stop(drain)
        deadline = None if timeout is None else time.monotonic() + timeout
        for r in self.replicas:
            r.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def build_replicas(model, engine_kwargs: Optional[dict], data_parallel_size: int, warmup: bool = True):
    """``(llms, timings)``: ``M`` warmed-up engines on disjoint device sets, the same pool size each.

    Weights are loaded one replica after the other (host memory and disk); the replicas' warm-ups
    run in parallel threads (each compiles its own executables: an executable belongs to its
    devices), counted in one progress bar. ``timings`` is replica 0's start-up timings with
    ``replicas`` (each one's) added."""
    from .startup import CacheEvents, build_engine

    kw = dict(engine_kwargs or {})
    tp = kw.get("tensor_parallel_size", 1)
    sets = replica_devices(data_parallel_size, tp)
    llms, timings = [], []
    for i, devs in enumerate(sets):
        llm, t = build_engine(model, dict(kw, devices=devs), warmup=False)
        if i == 0 and kw.get("num_blocks") is None:
            kw["num_blocks"] = llm.scheduler_config.num_blocks  # replicas alike: one admission rule
        llms.append(llm)
        timings.append(t)
    t0 = time.perf_counter()
    before = CacheEvents.snapshot()
    loads_before = sum(llm.runner.store_loads for llm in llms)
    if warmup:
        from ouro_jax.runner import CompileProgress

        counter = CompileProgress()  # one bar for every replica's executables
        try:
            with ThreadPoolExecutor(max_workers=len(llms)) as pool:
                list(pool.map(lambda x: x.runner.warmup(x.executable_keys(), x.config.progress, counter=counter), llms))
        finally:
            counter.close()
    compile_s = time.perf_counter() - t0
    for llm, t in zip(llms, timings):
        llm.warmup_time = compile_s
        keys = llm.executable_keys() if warmup else []
        t["executables"] = [{"key": str(k), "seconds": llm.runner.compile_times.get(k, 0.0)} for k in keys]
        t["compile_s"] = compile_s
    log.info("start-up: %d replicas warmed up in %.2f s", len(llms), compile_s)
    n = sum(len(t["executables"]) for t in timings)
    stored = min(n, sum(llm.runner.store_loads for llm in llms) - loads_before)
    hits = min(n - stored, CacheEvents.snapshot().get("cache_hits", 0) - before.get("cache_hits", 0))
    out = dict(timings[0], replicas=timings, load_s=sum(t["load_s"] for t in timings), cache_hits=hits)
    out.update(
        store_loads=stored, compiled=n - stored - hits, executables=[e for t in timings for e in t["executables"]]
    )
    return llms, out
