"""Compiled executables on disk, keyed by everything that determines the program, so that a start
loads each one without tracing, lowering or XLA's persistent-cache lookup (docs/decisions.md,
"Start-up").

JAX's persistent cache is keyed by the lowered program, so a hit still pays tracing and lowering
(~0.5 s an Ouro-1.4B step executable on the H200). This store's key is computed before any tracing,
from the program's inputs: the caller's own description of the program (bucket key, config, dtype,
attention, shapes of every argument, compiler options) plus :func:`environment` (jax / jaxlib /
flax versions, backend and device kinds, ``XLA_FLAGS``, JAX's trace-affecting config) and a hash of
the source of the packages that build the programs. A change to any of them is a new key; old
entries are never read again.

An entry is ``MAGIC + sha256(payload) + payload`` (the payload a pickle of
``jax.experimental.serialize_executable``'s output) written to a temporary file and renamed, so a
reader never sees half a file, and a corrupt or truncated one fails its checksum before any byte
reaches XLA's deserializer. Any failure to load falls back to compiling, with one warning per
process. The store trusts its directory as JAX's cache does: loading an executable runs its code.

Only executables XLA compiled in this process are saved, not ones JAX's persistent cache answered
(seen by its ``cache_hits`` event in the compiling thread): on the CPU an executable deserialized
once serializes into an entry that fails at run time ("Function ... not found"), so a second
round trip is not trusted on backends not listed in ``RESERIALIZABLE_PLATFORMS``.

A stored executable runs only once the custom-call targets it calls are registered: the Pallas
Triton and Mosaic GPU modules, which ``ouro_jax.runner`` imports at import time (keep them eager).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import tempfile
import threading
import warnings
from typing import Any, Callable, Optional, Sequence

import jax

__all__ = ["ExecutableStore", "environment", "fresh_compile", "jax_cache_hits_in_thread", "source_hash"]

MAGIC = b"OUROEXE1"
_DIGEST = 32
# the packages whose Python source builds the programs (model, kernels, descriptor layout, weight drawers)
_PACKAGES = ("ouro_jax", "pallas_kernels", "scheduler", "weights")
# backends on which an executable loaded from JAX's persistent cache may be serialized again
# (`benchmarks.startup --check-reserialize`: the GPU passes, the CPU fails; module docstring)
RESERIALIZABLE_PLATFORMS: frozenset = frozenset({"gpu"})

_thread = threading.local()


def _count_jax_cache_hit(name: str, **_) -> None:
    if name.endswith("/compilation_cache/cache_hits"):
        _thread.hits = getattr(_thread, "hits", 0) + 1
    elif name.endswith("/compilation_cache/compile_requests_use_cache"):
        _thread.requests = getattr(_thread, "requests", 0) + 1


def jax_cache_hits_in_thread() -> tuple[int, int]:
    """``(persistent-cache requests, hits)`` seen so far by this thread: JAX records both in the
    thread that compiles; pass the value taken before a compile to :func:`fresh_compile`."""
    return getattr(_thread, "requests", 0), getattr(_thread, "hits", 0)


def fresh_compile(before: tuple[int, int]) -> bool:
    """Did XLA compile the program since ``before``? Yes after a request to JAX's persistent cache
    that missed, or with that cache off; no when the cache answered, and no when the cache is on
    but was not asked: then JAX's in-memory cache handed back an executable that an earlier
    compile may have deserialized from disk."""
    requests, hits = jax_cache_hits_in_thread()
    if requests == before[0]:
        return not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)
    return hits == before[1]


jax.monitoring.register_event_listener(_count_jax_cache_hit)


@functools.cache
def source_hash(packages: Sequence[str] = _PACKAGES) -> str:
    """sha256 over the ``.py`` files of ``packages`` (relative path and bytes): an edit to the code
    that builds a program is a new store key. Hashed once per process (~ms)."""
    import importlib.util

    h = hashlib.sha256()
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            h.update(f"{pkg}:missing".encode())
            continue
        root = list(spec.submodule_search_locations)[0]
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(f for f in filenames if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                h.update(f"{pkg}/{os.path.relpath(path, root)}\0".encode())
                with open(path, "rb") as fh:
                    h.update(fh.read())
                h.update(b"\0")
    return h.hexdigest()


def _trace_config() -> tuple:
    """JAX's config values that change what tracing produces (``jax_default_matmul_precision``,
    ``jax_enable_x64``, ...), by name; values without a stable repr (objects at an address) are left out."""
    try:
        from jax._src import config as jc

        names, values = jc.trace_context_names(), jc.trace_context()
    except Exception:  # noqa: BLE001 - a private API: without it the key still has the versions
        return ()
    return tuple((n, repr(v)) for n, v in zip(names, values) if " at 0x" not in repr(v))


def environment() -> tuple:
    """Everything outside the caller's key that decides what a program compiles to."""
    import flax
    import jaxlib

    dev = jax.devices()
    client = dev[0].client
    return (
        ("jax", jax.__version__),
        ("jaxlib", jaxlib.__version__),
        ("flax", flax.__version__),
        ("python", sys.version_info[:2]),
        ("backend", client.platform, client.platform_version),
        ("devices", tuple(sorted({d.device_kind for d in dev})), len(dev)),
        ("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")),
        ("LIBTPU_INIT_ARGS", os.environ.get("LIBTPU_INIT_ARGS", "")),
        ("trace_config", _trace_config()),
        ("source", source_hash()),
    )


class ExecutableStore:
    """A directory of serialized executables. ``load`` returns ``None`` on a miss or any failure
    (the caller compiles); ``save`` never raises. Counters: ``hits``, ``misses``, ``failures``, ``saved``,
    ``not_saved`` (answered by JAX's cache, see the module docstring)."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self.hits = self.misses = self.failures = self.saved = self.not_saved = 0
        self._lock = threading.Lock()
        self._warned = False
        self._env: Optional[str] = None

    def key(self, *parts: Any) -> str:
        """The entry name of a program described by ``parts`` (reprs must be stable across
        processes: tuples, strings, numbers, dataclasses of those)."""
        if self._env is None:
            self._env = repr(environment())
        return hashlib.sha256(repr((self._env, parts)).encode()).hexdigest()[:40]

    def _file(self, key: str) -> str:
        return os.path.join(self.path, f"{key}.exe")

    def _warn(self, what: str, err: BaseException) -> None:
        with self._lock:
            self.failures += 1
            first, self._warned = not self._warned, True
        if first:
            warnings.warn(
                f"executable store {self.path}: {what} ({type(err).__name__}: {err}); compiling instead "
                "(said once per process)",
                RuntimeWarning,
                stacklevel=3,
            )

    def load(self, key: str, devices: Sequence) -> Optional[Any]:
        """The ``jax.stages.Compiled`` stored under ``key``, loaded onto ``devices`` (the devices it
        was compiled for, in order), or ``None``."""
        path = self._file(key)
        try:
            with open(path, "rb") as fh:
                blob = fh.read()
        except FileNotFoundError:
            with self._lock:
                self.misses += 1
            return None
        except OSError as e:
            self._warn(f"cannot read {os.path.basename(path)}", e)
            return None
        try:
            if blob[: len(MAGIC)] != MAGIC:
                raise ValueError("not an executable store entry")
            digest, payload = blob[len(MAGIC) : len(MAGIC) + _DIGEST], blob[len(MAGIC) + _DIGEST :]
            if hashlib.sha256(payload).digest() != digest:
                raise ValueError("checksum mismatch (truncated or corrupt)")
            from jax.experimental import serialize_executable

            serialized, in_tree, out_tree = pickle.loads(payload)
            exe = serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, backend=devices[0].client, execution_devices=list(devices)
            )
        except Exception as e:  # noqa: BLE001 - any failure to load means: compile
            self._warn(f"cannot load {os.path.basename(path)}", e)
            try:
                os.unlink(path)  # the compile that follows writes a good one
            except OSError:
                pass
            return None
        with self._lock:
            self.hits += 1
        return exe

    def save(self, key: str, compiled, from_jax_cache: bool = False) -> bool:
        """Store ``compiled`` under ``key`` (atomically); False if it cannot be serialized or written,
        or if it may have come from JAX's persistent cache (``from_jax_cache``: not known to be a
        fresh XLA compile) on a backend whose executables do not survive a second serialization."""
        if from_jax_cache and jax.default_backend() not in RESERIALIZABLE_PLATFORMS:
            with self._lock:
                self.not_saved += 1
            return False
        try:
            from jax.experimental import serialize_executable

            payload = pickle.dumps(serialize_executable.serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
            os.makedirs(self.path, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-", suffix=".exe")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(MAGIC + hashlib.sha256(payload).digest() + payload)
                os.chmod(tmp, 0o644)  # as other cache files (mkstemp makes it private)
                os.replace(tmp, self._file(key))
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except Exception as e:  # noqa: BLE001 - a start must not fail because the store cannot be written
            self._warn("cannot save an executable", e)
            return False
        with self._lock:
            self.saved += 1
        return True

    def load_or_compile(self, key: str, devices: Sequence, compile_fn: Callable[[], Any]) -> tuple[Any, bool]:
        """``(executable, loaded)``: from the store, else ``compile_fn()`` saved for the next start."""
        exe = self.load(key, devices)
        if exe is not None:
            return exe, True
        before = jax_cache_hits_in_thread()
        exe = compile_fn()
        self.save(key, exe, from_jax_cache=not fresh_compile(before))
        return exe, False
