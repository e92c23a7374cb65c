"""Engine construction for the server, timed: load / compile (each executable's seconds, persistent-cache
hits) / ready.

The engine's own warm-up compiles every executable a run can launch, through the persistent
compilation cache that ``LLM`` enables (``EngineConfig.compile_cache_dir``);
here the cache hits are counted from jax's own monitoring events
(``/jax/compilation_cache/cache_hits``), and each executable's compile (or cache load) time is logged.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

log = logging.getLogger("ouro_jax.server")

__all__ = ["build_engine", "CacheEvents"]


class CacheEvents:
    """Counts jax's persistent-cache events (one listener per process, registered on first use)."""

    _lock = threading.Lock()
    _counts: dict[str, int] = {}
    _registered = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._registered:
                return
            import jax

            def listener(event: str, **kwargs) -> None:
                if event.startswith("/jax/compilation_cache/"):
                    name = event.rsplit("/", 1)[-1]
                    cls._counts[name] = cls._counts.get(name, 0) + 1

            jax.monitoring.register_event_listener(listener)
            cls._registered = True

    @classmethod
    def snapshot(cls) -> dict[str, int]:
        return dict(cls._counts)


def build_engine(model, engine_kwargs: Optional[dict] = None, warmup: bool = True, counter=None):
    """``(llm, timings)``: a warmed-up ``LLM``, and what each part of its start-up took.

    The warm-up shows its executables as they finish unless the config's ``progress`` is off: in
    ``counter`` (``runner.CompileProgress``, or a worker process's reports to its front) when given,
    else in a bar of its own. ``timings``: ``load_s`` (weights, tokenizer, KV pool), ``compile_s``
    and ``executables`` (one ``{"key", "seconds"}`` per executable), ``cache_hits`` / ``compiled``
    counts."""
    from ouro_jax.llm import LLM

    CacheEvents.install()
    kw = dict(engine_kwargs or {})
    warmup = kw.pop("warmup", warmup)  # the engine's own option (--no-warmup) wins; warmed here, timed
    kw["warmup"] = False
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    load_s = time.perf_counter() - t0
    log.info("start-up: loaded %s in %.2f s (%d KV blocks)", model, load_s, llm.scheduler_config.num_blocks)
    executables = []
    t1 = time.perf_counter()
    before = CacheEvents.snapshot()
    loads_before = llm.runner.store_loads
    if warmup:
        keys = llm.executable_keys()
        llm.runner.warmup(keys, progress=llm.config.progress, threads=llm.config.compile_threads, counter=counter)
        for key in keys:
            dt = llm.runner.compile_times.get(key, 0.0)
            executables.append({"key": str(key), "seconds": dt})
            log.debug("start-up: executable %s: %.2f s", key, dt)  # the bar showed them as they came
    compile_s = time.perf_counter() - t1
    llm.warmup_time = compile_s
    llm.config = llm.config.replace(warmup=warmup)  # what ran: warmed here rather than in LLM()
    after = CacheEvents.snapshot()
    # an executable comes from the executable store (no tracing), JAX's persistent cache, or XLA
    stored = min(len(executables), llm.runner.store_loads - loads_before)
    hits = min(len(executables) - stored, after.get("cache_hits", 0) - before.get("cache_hits", 0))
    compiled = len(executables) - stored - hits
    timings = dict(
        load_s=load_s,
        compile_s=compile_s,
        executables=executables,
        store_loads=stored,
        cache_hits=hits,
        compiled=compiled,
    )
    log.info(
        "start-up: %d executables in %.2f s (%d from the executable store, %d from the persistent cache, %d compiled)",
        len(executables), compile_s, stored, hits, compiled,
    )  # fmt: skip
    return llm, timings
