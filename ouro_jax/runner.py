"""ModelRunner: executes one ``BatchDescriptor`` (one loop for a bucket of rows) on the device.

The runner decides *how* a plan runs; the scheduler decided *what*. It owns the device state:

* the stacked paged KV pools ``K, V: [L, KVH, num_blocks, block_size, hd]`` and the hidden-state
  ring ``[num_ring_rows, D]``, donated to every step so XLA updates them in place;
* one compiled executable per bucket (rows, segments, block-table width, prelude, coda, finalize
  sizes), compiled ahead of time by :meth:`warmup` and reused for every invocation of that shape,
  the way PyTorch engines replay CUDA graphs. A shape that was not warmed up is compiled on first
  use and counted in ``compilations`` (a test asserts a warmed run compiles nothing). A bucket
  that splits attention per segment has a second executable, its long-segment variant (the
  Mosaic kernel alone), which :meth:`executable_key` picks for descriptors whose every segment
  is long (``pallas_kernels/dispatch.py``).

One step does, in order (``docs/contracts.md``): LAST_EXITED finalize copies, prelude (embed into
ring rows), one loop of the stack for the rows (K/V written at each row's slot, ragged paged
attention per segment, output scattered back to the ring), the exit gate, and the coda (lm_head +
argmax) of the coda rows. Where a coda row samples (temperature above 0, known to the host), a
small separate executable (``SamplerKey``) samples those rows from the step's coda hidden states,
queued behind it: deciding that inside the step took a ``lax.cond`` whose predicate the GPU host
waited for. Only the gate logits ``[R]`` and tokens ``[C]`` come back, copied to the host
asynchronously; the host reads them only when the scheduler needs them. The layers' Q/K/V and
gate/up weights are laid out as one kernel each (``model.fuse_layer_params``) at load time.

Fused decode steps (``scheduler`` decides when; ``fused_decode_max_rows``): one executable runs
``tokens`` tokens of the same decode rows, each token's loops in a device-side ``while_loop`` that
decides every row's exit after each loop with the host's rule and stops once all rows exited,
then finalizes, samples and feeds the sampled ids to the next token's prelude on the device: at
small batches a loop is short next to the host's fixed cost per launch, upload and readback, and
with early exit the host would otherwise wait for every loop's gate (docs/decisions.md, "Fused
decode steps"). The depth loop compiles into CUDA-graph conditional nodes (``compiler_options.step_options``),
so that no loop waits for the host; a fused step also takes the previous fused step's last samples
and returns its own, so that the scheduler can launch the next step before the host has read this
one (``scheduler/pipeline.py``).

The traced programs live in ``step_program.py`` (one loop, the separate sampler) and
``fused_step.py`` (fused decode steps, rows in lock step); this module compiles, stores and
launches them.

The descriptor travels as one packed int32 array (``scheduler/descriptor.py`` fixes its layout per
bucket key) because every host-to-device transfer has a fixed cost.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.dispatch import long_segment_rows, resolve_attention
from scheduler.buckets import BucketKey
from scheduler.descriptor import StepResult
from scheduler.speculation import SpecDescriptor, SpecKey
from weights.config import OuroConfig

from . import fused_step, speculative
from .compiler_options import step_options
from .engine_config import EngineConfig
from .executable_store import ExecutableStore, fresh_compile, jax_cache_hits_in_thread
from .model import OuroModel, dtype_of, fuse_layer_params
from .parallel import (
    check_devices,
    check_tensor_parallel,
    kv_spec,
    local_config,
    make_mesh,
    param_specs,
    place_params,
)
from .sampling import ADJUST_ENTRY_WORDS, ADJUST_ROW_WORDS, free_adjust, token_logprobs
from .step_program import SamplerKey, coda_words, one_loop, packed_shape, packed_size, sample_coda
from .structured import bitmask_words, new_bitmask

__all__ = ["ModelRunner", "CompileProgress", "SamplerKey", "packed_size", "packed_shape", "is_fused"]


# XLA compile threads of a cold start (``ModelRunner.warmup``): more made the GPU autotuner warn
COLD_COMPILE_THREADS = 4


def _flat_params(fn, treedef):
    """``fn(params, ...)`` as ``g(leaves, ...)``: the weights travel as a flat tuple (host dispatch)."""

    def g(leaves, kp, vp, ring, packed, *extra, key):
        return fn(jax.tree.unflatten(treedef, leaves), kp, vp, ring, packed, *extra, key=key)

    return g


# Persistent-cache hits seen in this process (JAX's own monitoring event): ``warmup`` compiles in
# threads once it knows the cache is warm.
_CACHE_HITS = [0]


def _count_cache_hit(name: str, **_) -> None:
    if name.endswith("/compilation_cache/cache_hits"):
        _CACHE_HITS[0] += 1


jax.monitoring.register_event_listener(_count_cache_hit)


class CompileProgress:
    """Executables ready out of those to warm up, drawn as one tqdm bar on stderr as each one
    finishes (every update written and flushed at once, on a terminal or not). Warm-ups that run
    together (data-parallel replicas) share one: each adds its count to the total. While the bar is
    drawn, log lines go above it rather than through it."""

    def __init__(self, desc: str = "compiling executables"):
        self.desc = desc
        self._lock = threading.Lock()
        self._bar = None
        self._redirect = None

    def add(self, n: int) -> None:
        """``n`` more executables to wait for."""
        with self._lock:
            if self._bar is None:
                import sys

                from tqdm.auto import tqdm
                from tqdm.contrib.logging import logging_redirect_tqdm

                self._redirect = logging_redirect_tqdm()
                self._redirect.__enter__()
                # every executable shown (they take seconds each, the bar is no flood)
                self._bar = tqdm(total=n, desc=self.desc, unit="exe", file=sys.stderr, mininterval=0, miniters=1)
            else:
                self._bar.total += n
                self._bar.refresh()

    def done(self, n: int = 1) -> None:
        """``n`` executables ready."""
        with self._lock:
            if self._bar is not None and n:
                self._bar.update(n)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._redirect.__exit__(None, None, None)
                self._bar = self._redirect = None


class _DeferredTokens:
    """A deferred fused step's result ``[1, C + R + C * LOGPROB_WORDS]`` as the scheduler reads it:
    the step's exit depths with the separate sampler's tokens and logprob records in place."""

    def __init__(self, out, tokens, records, key: BucketKey):
        self.out, self.tokens, self.records, self.key = out, tokens, records, key

    def __array__(self, dtype=None, copy=None):
        C, R = self.key.C, self.key.R
        out = np.array(self.out)
        out[0, :C] = np.asarray(self.tokens)
        out[0, C + R :] = np.asarray(self.records).reshape(-1)
        return out if dtype is None else out.astype(dtype)


def is_fused(key) -> bool:
    """Whether ``key`` names a fused decode step ``(BucketKey, n)`` (not a bucket, a sampler or a round)."""
    return not isinstance(key, (BucketKey, SamplerKey, SpecKey))


class _RoundResult:
    """A round's result ``[C, 2 + 2 * positions]`` as the scheduler reads it; reading it first
    waits for the draft's tokens, then for the verify, so that the runner learns how long each
    took on the device (the host launched both at once and did nothing else meanwhile)."""

    def __init__(self, runner: "ModelRunner", draft_tokens, out, launched: float):
        # launched: when the draft was handed to the device (an idle one: the round before was read)
        self.runner, self.draft_tokens, self.out, self.launched = runner, draft_tokens, out, launched

    def __array__(self, dtype=None, copy=None):
        np.asarray(self.draft_tokens)
        t = time.perf_counter()
        out = np.asarray(self.out)
        r = self.runner
        r.spec_draft_time += max(0.0, t - self.launched)
        r.spec_verify_time += time.perf_counter() - t
        return out if dtype is None else out.astype(dtype)


def samples(desc) -> bool:
    """Whether a one-loop descriptor has a coda row that samples (temperature above 0; padding rows
    hold 0), exactly where the in-program ``sample`` would have taken its sampling branch."""
    return bool(np.any(desc.coda_temperature > 0))


class ModelRunner:
    """Device state + one executable per bucket. See the module docstring. The step writes the
    ``L`` layers out (unrolled); each reads the stacked KV pool in place.

    ``engine.tensor_parallel_size=N > 1``: the step runs under ``jax.shard_map`` on a 1-D ``"tp"`` mesh of
    the first ``N`` devices (``ouro_jax/parallel.py``): params and the KV pools' head axis split,
    the ring, descriptor, gates and tokens replicated. ``N = 1`` builds no mesh and no shard_map.

    ``devices``: the ``N`` devices this runner owns (default: the first ``N`` of ``jax.devices()``);
    data-parallel replicas each get a disjoint set (``ouro_jax/server/replicas.py``).

    ``engine``: the engine's options (``EngineConfig``: attention, tensor parallelism, devices, XLA
    options); the executable store's key holds its ``compile_hash``. ``interpret``: Pallas kernels
    in interpret mode (CPU tests).
    """

    def __init__(
        self,
        config: OuroConfig,
        params: dict,
        *,
        num_blocks: int,
        block_size: int,
        num_ring_rows: int,
        engine: Optional[EngineConfig] = None,
        interpret: bool = False,
        executable_store: Optional[ExecutableStore] = None,
    ):
        self.engine = engine = engine or EngineConfig()
        attention = resolve_attention(engine.attention)
        tp = check_tensor_parallel(config, engine.tensor_parallel_size)
        self.tensor_parallel_size = tp
        devices = check_devices(engine.devices, tp)
        # pinned: a device set was given (a data-parallel replica); every array and executable is
        # placed on it explicitly, since jax's default device is the first of the process
        self._pinned = devices is not None
        self._device = devices[0] if devices is not None else jax.devices()[0]
        self.mesh = make_mesh(tp, devices) if tp > 1 else None
        self.config = config
        self.attention, self.interpret = attention, interpret
        leaves = jax.tree.leaves(params)
        self.dtype = leaves[0].dtype
        self.dtype_name = str(self.dtype)
        self.params = self._arrange(params)
        c = config
        pool_shape = (c.num_hidden_layers, c.num_key_value_heads, num_blocks, block_size, c.head_dim)
        ring_shape = (num_ring_rows, c.hidden_size)
        jit_kw: dict = {}
        fused_kw: dict = {}
        step = functools.partial(
            one_loop,
            config=c,
            dtype_name=self.dtype_name,
            attention=attention,
            interpret=interpret,
        )
        program_kw = dict(step.keywords)  # what every step program takes besides its key
        fused = functools.partial(fused_step.lockstep, **program_kw)
        # one-loop steps leave sampling to a separate small executable, launched only when a coda
        # row samples: a lax.cond in the step made the GPU host wait for its predicate at the end
        # of every invocation (docs/decisions.md, "Sampling on the host's word"); under tensor
        # parallelism the step still samples itself (its lm_head is split by vocabulary)
        self.separate_sampler = self.mesh is None
        step = functools.partial(step, separate_sampler=self.separate_sampler)
        if self.mesh is None:
            dev = self._device if self._pinned else None
            self.k_pool = jnp.zeros(pool_shape, self.dtype, device=dev)
            self.v_pool = jnp.zeros(pool_shape, self.dtype, device=dev)
            self.ring = jnp.zeros(ring_shape, self.dtype, device=dev)
            self._upload_to = SingleDeviceSharding(self._device) if self._pinned else self._device
        else:
            kv, rep = NamedSharding(self.mesh, kv_spec()), NamedSharding(self.mesh, P())
            # allocated in place on every shard: each device holds KVH/N heads of the pools
            zeros = lambda shape, s: jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=s)()  # noqa: E731
            self.k_pool, self.v_pool, self.ring = zeros(pool_shape, kv), zeros(pool_shape, kv), zeros(ring_shape, rep)
            self._upload_to = rep
            step, fused = self._sharded(step, tp), self._sharded(fused, tp, extra_in=1, extra_out=2)
            # input shardings come from the arguments (_compile; jit takes no in_shardings with a static kwarg)
            jit_kw = dict(out_shardings=(kv, kv, rep, rep, rep))
            fused_kw = dict(out_shardings=(kv, kv, rep, rep, rep, rep, rep))
        self.num_blocks, self.block_size, self.num_ring_rows = num_blocks, block_size, num_ring_rows
        # executables take the weights as one flat tuple: flattening the nested dict on every launch
        # cost more host time than the call itself (docs/decisions.md, "Host dispatch")
        self._param_leaves, treedef = jax.tree.flatten(self.params)
        self._param_leaves = tuple(self._param_leaves)
        step, fused = _flat_params(step, treedef), _flat_params(fused, treedef)
        self._top_leaves, top_treedef = jax.tree.flatten(self.params["top"])
        self._top_leaves = tuple(self._top_leaves)
        sampler = functools.partial(sample_coda, config=c, dtype_name=self.dtype_name)
        self._jitted_sampler = jax.jit(
            lambda leaves, h, w, mask, rw, ent: sampler(jax.tree.unflatten(top_treedef, leaves), h, w, mask, rw, ent)
        )
        # per coda size: every token allowed, and no bias, penalty or min-p (sampler inputs of free rows)
        self._free_masks: dict[int, jax.Array] = {}
        self._free_adjust: dict[int, tuple] = {}
        # prompt logprobs: lm_head of ring rows a step left at full depth (compiled per row count)
        self._jitted_prompt_logprobs = jax.jit(
            lambda leaves, ring, rows, next_ids: token_logprobs(
                OuroModel(c, dtype_of(self.dtype_name)).apply(
                    {"params": jax.tree.unflatten(top_treedef, leaves)}, ring[rows], method=OuroModel.coda
                ),
                next_ids,
            )
        )
        # a round of self-speculative decoding: its draft and its verify (speculative.py); one device only
        self._jitted_spec = {
            stage: jax.jit(
                _flat_params(functools.partial(fn, **program_kw), treedef),
                static_argnames=("key",),
                donate_argnums=(1, 2, 3),
            )
            for stage, fn in (("draft", speculative.draft), ("verify", speculative.verify))
        }
        self._jitted = jax.jit(step, static_argnames=("key",), donate_argnums=(1, 2, 3), **jit_kw)
        self._jitted_fused = jax.jit(fused, static_argnames=("key",), donate_argnums=(1, 2, 3), **fused_kw)
        # per coda size: the last tokens the latest fused step sampled (its ``previous`` output),
        # which a step scheduled ahead of reading them embeds (``Scheduler.schedule_ahead``)
        self._fused_last: dict[int, jax.Array] = {}
        self._coda_h = None  # the latest fused step's last coda states (ModelRunner.complete)
        # executables by bucket key, and by (key, n) for fused decode steps of n sub-steps
        self._exe: dict[Any, Any] = {}
        self._long_keys: dict[BucketKey, Optional[BucketKey]] = {}  # long_segment_key's answers
        self._compile_lock = threading.Lock()
        self.compilations = 0  # executables obtained: compiled, from XLA's cache, or from the store
        self.store_loads = 0  # of which loaded from `executable_store` (no tracing, no compile)
        self.store_save_time = 0.0
        self.compile_time = 0.0
        self.store = executable_store
        self._store_devices = list(self.mesh.devices.flat) if self.mesh is not None else [self._device]
        self._store_program = self._program_description() if executable_store is not None else None
        self.compile_times: dict[BucketKey, float] = {}
        self.dispatch_time = 0.0  # in step(): upload_time + call_time + starting the copies back
        self.upload_time = 0.0  # the descriptor's transfer (device_put)
        self.call_time = 0.0  # the executables' calls (launch)
        self.wait_time = 0.0
        self.invocations = 0
        self.sampler_launches = 0  # separate sampler runs (one-loop invocations where a row sampled)
        self.spec_rounds = 0  # rounds of self-speculative decoding launched
        # seconds from a round's launch to its draft's end, and from there to its verify's end
        self.spec_draft_time = self.spec_verify_time = 0.0
        # the latest launches' results, whose copies to the host ``close`` waits for: earlier
        # launches finished before these started (each step takes the pools the one before wrote)
        self._recent: collections.deque = collections.deque(maxlen=4)
        self.kv_bytes = 2 * self.k_pool.size * self.k_pool.dtype.itemsize  # the pools' size (kept after close)
        self.closed = False

    # ------------------------------------------------------------------------------- setup
    def _arrange(self, params: dict) -> dict:
        """Split the tree into ``top`` (embed, norm, gate, lm_head) and ``layers`` (a dict of
        ``layers_i``). With a mesh every leaf goes straight into its shards."""
        L = self.config.num_hidden_layers
        top = {k: v for k, v in params.items() if not k.startswith("layers_")}
        layers = {f"layers_{i}": params[f"layers_{i}"] for i in range(L)}
        # Q/K/V and gate/up as one kernel each, laid out once here (``fuse_layer_params``)
        on_host = all(isinstance(x, np.ndarray) for x in jax.tree.leaves(layers))
        cat = np.concatenate if on_host else None
        layers = {k: fuse_layer_params(v, self.config, cat) for k, v in layers.items()}
        if self.mesh is not None:
            return place_params({"top": top, "layers": layers}, self.mesh)
        if self._pinned:
            return jax.device_put({"top": top, "layers": layers}, self._device)
        return {"top": jax.tree.map(jnp.asarray, top), "layers": jax.tree.map(jnp.asarray, layers)}

    def _sharded(self, fn, tp: int, extra_in: int = 0, extra_out: int = 0):
        """``fn`` (a step) as the body of a ``shard_map`` over ``"tp"``: each shard sees its slice
        of the params and pools. ``check_vma=False``: Pallas kernels carry no replication types;
        the body's psum/all_gather make the replicated outputs equal on every shard. ``extra_in``,
        ``extra_out``: replicated arguments after the descriptor and outputs after the tokens (a
        fused step's previous tokens in, its last tokens and coda states out)."""
        kv = kv_spec()
        in_specs = (param_specs(self.params), kv, kv, P(), P()) + (P(),) * extra_in
        out_specs = (kv, kv, P(), P(), P()) + (P(),) * extra_out

        def run(params, kp, vp, ring, packed, *more, key):
            body = functools.partial(fn, key=key, tp_size=tp)
            return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
                params, kp, vp, ring, packed, *more
            )

        return run

    def lower(self, key):
        """Trace and lower ``key``: a ``BucketKey`` (one loop) or ``(BucketKey, n)`` (a fused decode step)."""
        # tensor parallel or pinned: the arguments' shardings (the pools' in place, donated); None on
        # the default device, so that its executables stay exactly the unpinned ones
        mesh = self.mesh is not None or self._pinned
        sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if mesh else None)  # noqa: E731
        if isinstance(key, SamplerKey):
            on = self._upload_to if mesh else None
            return self._jitted_sampler.lower(
                tuple(sds(x) for x in self._top_leaves),
                jax.ShapeDtypeStruct((key.C, self.config.hidden_size), self.dtype, sharding=on),
                jax.ShapeDtypeStruct(packed_shape(key), jnp.int32, sharding=on),
                jax.ShapeDtypeStruct((key.C, bitmask_words(self.config.vocab_size)), jnp.int32, sharding=on),
                jax.ShapeDtypeStruct((ADJUST_ROW_WORDS, key.C), jnp.int32, sharding=on),
                jax.ShapeDtypeStruct((ADJUST_ENTRY_WORDS, key.C, key.H), jnp.int32, sharding=on),
            )
        on = self._upload_to if mesh else None
        if isinstance(key, SpecKey):
            extra = ()
            if key.stage == "verify":  # the draft's tokens, depths, remaining mass and logits
                C, R, k1, V = key.draft.C, key.draft.R, key.positions, self.config.vocab_size
                shapes = (((k1, C), jnp.int32), ((k1, R), jnp.int32), ((k1, R), jnp.float32), ((k1, C, V), jnp.float32))
                extra = tuple(jax.ShapeDtypeStruct(s, t, sharding=on) for s, t in shapes)
            return self._jitted_spec[key.stage].lower(
                tuple(sds(x) for x in self._param_leaves),
                sds(self.k_pool),
                sds(self.v_pool),
                sds(self.ring),
                jax.ShapeDtypeStruct(packed_shape(key), jnp.int32, sharding=on),
                *extra,
                key=key,
            )
        fused = is_fused(key)
        fn, bucket = (self._jitted_fused, key[0]) if fused else (self._jitted, key)
        extra = (jax.ShapeDtypeStruct((bucket.C,), jnp.int32, sharding=on),) if fused else ()
        return fn.lower(
            tuple(sds(x) for x in self._param_leaves),
            sds(self.k_pool),
            sds(self.v_pool),
            sds(self.ring),
            jax.ShapeDtypeStruct(packed_shape(key), jnp.int32, sharding=on),
            *extra,
            key=bucket,
        )

    def _program_description(self) -> tuple:
        """Everything of this runner that decides a step's program, bar the bucket key: the store
        key's part from the runner (``executable_store.environment`` adds versions and source).
        The options are the engine config's ``compile_hash`` (every field that is not declared
        compile-free), never a list kept by hand; the rest is what the options and the model made:
        the model, the weights' and pools' shapes, dtypes and shardings, the devices."""
        mesh = self.mesh is not None or self._pinned  # as `_lower`: shardings are part of the program
        leaves, _ = jax.tree_util.tree_flatten_with_path(self.params)
        params = tuple(
            (jax.tree_util.keystr(p), x.shape, str(x.dtype), repr(x.sharding) if mesh else None) for p, x in leaves
        )
        arrays = tuple(
            (x.shape, str(x.dtype), repr(x.sharding) if mesh else None) for x in (self.k_pool, self.v_pool, self.ring)
        )
        return (
            "ouro_jax.runner step",
            self.engine.compile_hash(),
            repr(self.config),
            self.dtype_name,
            self.attention,
            self.interpret,
            tuple(d.id for d in self._store_devices),
            arrays,
            params,
        )

    def store_key(self, key) -> str:
        """The executable store's entry name of ``key`` (a ``BucketKey`` or ``(BucketKey, n)``)."""
        if self.store is None:
            raise ValueError("this runner has no executable store")
        return self.store.key(self._store_program, repr(key), packed_shape(key))

    def _load_stored(self, key) -> bool:
        """Take ``key``'s executable from the store: True if it was there and loaded."""
        t = time.perf_counter()
        exe = self.store.load(self.store_key(key), self._store_devices)
        if exe is None:
            return False
        with self._compile_lock:
            self._record_compile(key, exe, time.perf_counter() - t)
            self.store_loads += 1
        return True

    def _compile(self, key, lowered=None, try_store: bool = True):
        """``key``'s executable: from the store when it has it, else traced, lowered and compiled
        (XLA's persistent cache may still answer the compile), then saved to the store."""
        if try_store and lowered is None and self.store is not None and self._load_stored(key):
            return self._exe[key]
        t = time.perf_counter()
        before = jax_cache_hits_in_thread()
        exe = (lowered or self.lower(key)).compile(self.compiler_options(key))
        dt = time.perf_counter() - t
        if self.store is not None:
            t = time.perf_counter()
            self.store.save(self.store_key(key), exe, from_jax_cache=not fresh_compile(before))
            with self._compile_lock:
                self.store_save_time += time.perf_counter() - t
        with self._compile_lock:  # warmup compiles in threads
            self._record_compile(key, exe, dt)
        return exe

    def compiler_options(self, key) -> dict:
        """XLA options of ``key``'s executable: ``compiler_options.step_options`` with the engine's
        extra options for its kind (fused decode step or one loop)."""
        fused = is_fused(key) or isinstance(key, SpecKey)  # a round's loops run as a fused step's
        return step_options(fused, self.engine.fused_xla_options if fused else self.engine.step_xla_options)

    def _record_compile(self, key, exe, dt: float) -> None:
        self._exe[key] = exe
        self.compilations += 1
        self.compile_time += dt
        self.compile_times[key] = dt

    def warmup(
        self, keys: Iterable, progress: bool = True, threads: int | None = None, counter: Optional[Any] = None
    ) -> float:
        """Compile every bucket ahead of time; returns the seconds spent. ``keys``: ``BucketKey`` s
        and ``(BucketKey, n)`` fused decode steps. ``progress``: count the executables as they
        finish in ``counter`` (shared by warm-ups running together; anything with ``add(n)`` and
        ``done(n)``), by default a bar of its own (:class:`CompileProgress`).

        Executables in the store load first, in threads (no tracing). The rest are traced and
        lowered one key at a time (Python); XLA compiles them in ``threads`` threads (default: the
        first key alone, then ``COLD_COMPILE_THREADS`` while the persistent cache misses, up to 8 once
        the first key came from the cache, where a compile is a load): more cold threads made XLA's
        GPU autotuner warn about its timing (docs/decisions.md, "Start-up")."""
        todo = [k for k in dict.fromkeys(keys) if k not in self._exe]
        if threads is not None and not (isinstance(threads, int) and threads >= 1):
            raise ValueError(f"threads must be a positive integer or None, got {threads!r}")
        t = time.perf_counter()
        own = None
        if not progress or not todo:
            counter = None
        elif counter is None:
            counter = own = CompileProgress()
        if counter is not None:
            counter.add(len(todo))
        done = counter.done if counter is not None else (lambda n: None)
        try:
            if self.store is not None and todo:
                with ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
                    for f in as_completed([pool.submit(self._load_stored, k) for k in todo]):
                        done(int(f.result()))
                todo = [k for k in todo if k not in self._exe]
            if threads is None:
                threads = COLD_COMPILE_THREADS
                if todo:
                    hits = _CACHE_HITS[0]
                    self._compile(todo.pop(0), try_store=False)
                    done(1)
                    if _CACHE_HITS[0] > hits:
                        threads = 8
            if threads <= 1:
                for k in todo:
                    self._compile(k, try_store=False)
                    done(1)
            elif todo:
                lowered = [(k, self.lower(k)) for k in todo]
                with ThreadPoolExecutor(max_workers=min(threads, len(lowered))) as pool:
                    for f in as_completed([pool.submit(self._compile, k, lo, try_store=False) for k, lo in lowered]):
                        f.result()
                        done(1)
        finally:
            if own is not None:
                own.close()
        return time.perf_counter() - t

    # ----------------------------------------------------------------------------- execute
    def step(
        self,
        desc,
        bitmask: Optional[np.ndarray] = None,
        logprobs: bool = False,
        adjust: Optional[tuple[np.ndarray, np.ndarray]] = None,
        defer_coda: bool = False,
    ) -> StepResult:
        """Launch ``desc`` (a ``BatchDescriptor``, or a ``StackedDescriptor``: one fused step); its
        gates and tokens start copying back at once and are waited for only when read.
        ``bitmask [C, ceil(V/32)]`` int32: the coda rows' allowed tokens (structured outputs; one
        loop steps only), sampled by the separate sampler. ``logprobs``: a coda row's request asks
        for logprobs; a one-loop step then runs the separate sampler, which takes them (a fused
        step returns them with its tokens when its descriptor asks). ``adjust``: the coda rows'
        ``(row_words [4, C], entries [4, C, H])`` of logit bias, penalties and min-p
        (``sampling.adjust_logits``). ``defer_coda``: a fused step of one token whose tokens come
        from the separate sampler, launched by :meth:`complete` once the host knows their mask."""
        if isinstance(desc, SpecDescriptor):
            if bitmask is not None or logprobs or adjust is not None or defer_coda:
                raise ValueError("a round of self-speculative decoding takes no bitmask, logprobs, penalties, deferral")
            return self._step_round(desc)
        key = self.executable_key(desc)
        single = isinstance(key, BucketKey)
        if key not in self._exe:
            self._compile(key)  # not warmed up: counted in `compilations`, not in `dispatch_time`
        t = time.perf_counter()
        packed = self.upload(desc)
        t_call = time.perf_counter()
        self.upload_time += t_call - t
        special = bitmask is not None or logprobs or adjust is not None
        if special and not self.separate_sampler:
            raise ValueError("a token bitmask, logprobs or penalties need the separate sampler (no tensor parallel)")
        if not single and special:
            raise ValueError("a fused step takes no bitmask, logprobs flag or penalties (defer its coda)")
        if defer_coda and (single or desc.n != self.config.num_loops or not self.separate_sampler):
            raise ValueError("only a fused step of one token defers its coda to the separate sampler")
        if bitmask is not None:
            bitmask = self.put(bitmask)
        if adjust is not None:
            adjust = (self.put(adjust[0]), self.put(adjust[1]))
        sample = single and (special or samples(desc))
        gates, tokens, records = self.launch(key, packed, sample=sample, mask=bitmask, adjust=adjust)
        self.call_time += time.perf_counter() - t_call
        if defer_coda:  # its exit depths now, its tokens once complete() samples the coda states
            tokens.copy_to_host_async()
            self.invocations += 1
            self.dispatch_time += time.perf_counter() - t
            result = StepResult(gates, None, self._waited)
            result.deferred = (desc, tokens, self._coda_h)
            self._recent.append(result)
            return result
        # a fused step's gates are never read (its exits were decided on the device)
        copies = (gates, tokens) if single else (tokens,)
        records = records if single and logprobs else None
        for arr in copies if records is None else (*copies, records):
            arr.copy_to_host_async()
        self.invocations += 1
        self.dispatch_time += time.perf_counter() - t
        result = StepResult(gates, tokens, self._waited, logprobs=records)
        self._recent.append(result)
        return result

    def _step_round(self, desc: SpecDescriptor) -> StepResult:
        """Launch a round's draft and verify back to back (``speculative.py``); its tokens are the
        verify's ``[C, 2 + 2 * positions]`` (``scheduler.speculation.split_spec_output``)."""
        if self.mesh is not None:
            raise ValueError("self-speculative decoding runs on one device (no tensor parallelism)")
        draft_key, verify_key = desc.key.at("draft"), desc.key.at("verify")
        for k in (draft_key, verify_key):
            if k not in self._exe:
                self._compile(k)  # not warmed up: counted in `compilations`
        t = time.perf_counter()
        packed = self.upload(desc)
        t_call = time.perf_counter()
        self.upload_time += t_call - t
        leaves = self._param_leaves
        kp, vp, ring, *state = self._exe[draft_key](leaves, self.k_pool, self.v_pool, self.ring, packed)
        self.k_pool, self.v_pool, self.ring, out = self._exe[verify_key](leaves, kp, vp, ring, packed, *state)
        launched = time.perf_counter()
        self.call_time += launched - t_call
        for arr in (state[0], out):
            arr.copy_to_host_async()
        self.invocations += 1
        self.spec_rounds += 1
        self.dispatch_time += launched - t
        result = StepResult(np.zeros(0, np.float32), _RoundResult(self, state[0], out, t_call), self._waited)
        self._recent.append(result)
        return result

    def _waited(self, seconds: float) -> None:
        self.wait_time += seconds  # time the host waited on the device

    def launch(
        self, key, packed, sample: bool = False, mask: Optional[jax.Array] = None, adjust: Optional[tuple] = None
    ) -> tuple[jax.Array, jax.Array, Optional[jax.Array]]:
        """Run ``key``'s executable on an uploaded descriptor (``upload``), the pools and the ring
        updated in place; returns ``(gates, tokens, logprob records)`` on the device, the records
        None unless the separate sampler ran. ``step`` without its bookkeeping: benchmarks time
        the device with it. A key not warmed up compiles first.

        ``sample``: some coda row has a temperature above 0, a grammar or logprobs (the host knows):
        its one-loop step's greedy tokens are replaced by the separate sampler's. Without it a
        one-loop step's tokens are the argmax of every coda row. ``mask``, ``adjust``: the coda
        rows' allowed tokens and penalties on the device (``step``); none without them."""
        exe = self._exe.get(key)
        if exe is None:
            exe = self._compile(key)  # not warmed up: counted in `compilations`
        fused = is_fused(key)
        if fused:  # the previous fused step's last tokens in, its own out
            out = exe(self._param_leaves, self.k_pool, self.v_pool, self.ring, packed, self._previous(key[0].C))
            self._fused_last[key[0].C] = out[5]
        else:
            out = exe(self._param_leaves, self.k_pool, self.v_pool, self.ring, packed)
        self.k_pool, self.v_pool, self.ring, gates, tokens = out[:5]
        if fused:
            self._coda_h = out[6]  # the last token's coda states: a deferred coda samples them
        records = None
        if sample and not fused and len(out) > 5:
            skey = SamplerKey(key.C, 0 if adjust is None else adjust[1].shape[-1])
            tokens, records = self.launch_sampler(skey, out[5], out[6], mask, adjust)
            self.sampler_launches += 1
        return gates, tokens, records

    def launch_sampler(
        self,
        key: SamplerKey,
        h: jax.Array,
        words: jax.Array,
        mask: Optional[jax.Array] = None,
        adjust: Optional[tuple] = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Run the separate sampler of coda size ``key.C`` on hidden states ``h [C, d]`` and sampling
        words ``[packed_shape(key)]`` on the runner's device (``put``); returns its tokens and their
        logprob records on the device. ``mask``, ``adjust``: as ``step`` takes them, on the device
        (none: free rows). ``launch`` runs it after a one-loop step whose coda row samples;
        benchmarks time it alone. A key not warmed up compiles first (a penalty batch's ``H``)."""
        sampler = self._exe.get(key)
        if sampler is None:
            sampler = self._compile(key)  # not warmed up: counted in `compilations`
        if mask is None:
            mask = self._free_mask(key.C)
        if adjust is None:
            adjust = self._free_adjust.get(key.C)
            if adjust is None:
                adjust = self._free_adjust[key.C] = tuple(map(self.put, free_adjust(key.C)))
        return sampler(self._top_leaves, h, words, mask, *adjust)

    def prompt_logprobs(self, ring_rows: np.ndarray, next_ids: np.ndarray) -> jax.Array:
        """The logprob records ``[P, LOGPROB_WORDS]`` of tokens ``next_ids [P]`` under the logits of
        ring rows ``ring_rows [P]`` as the latest step left them (prompt positions it ran at full
        depth); copying to the host. Queued behind that step, ahead of the next, which overwrites
        the ring."""
        records = self._jitted_prompt_logprobs(self._top_leaves, self.ring, self.put(ring_rows), self.put(next_ids))
        records.copy_to_host_async()
        return records

    def complete(
        self, result: StepResult, bitmask: Optional[np.ndarray] = None, adjust: Optional[tuple] = None
    ) -> None:
        """Sample the coda of a fused step launched with ``defer_coda``: the separate sampler on its
        coda states under ``bitmask`` and ``adjust`` (a grammar's mask, penalties: known once the
        host read the token before; as ``step`` takes them) gives its tokens and logprob records,
        which feed the next fused step's first token."""
        desc, out, coda_h = result.deferred
        result.deferred = None
        key = desc.key
        words = self.put(coda_words(key, desc.pack()[-1, : packed_size(key)]))
        mask = None if bitmask is None else self.put(bitmask)
        if adjust is not None:
            adjust = (self.put(adjust[0]), self.put(adjust[1]))
        skey = SamplerKey(key.C, 0 if adjust is None else adjust[1].shape[-1])
        tokens, records = self.launch_sampler(skey, coda_h, words, mask, adjust)
        self.sampler_launches += 1
        self._fused_last[key.C] = tokens
        for arr in (tokens, records):
            arr.copy_to_host_async()
        result.set_tokens(_DeferredTokens(out, tokens, records, key))

    def _free_mask(self, C: int) -> jax.Array:
        """Every token allowed for ``C`` coda rows, on the device (kept: a fused step takes one always)."""
        mask = self._free_masks.get(C)
        if mask is None:
            mask = self._free_masks[C] = self.put(new_bitmask(C, self.config.vocab_size))
        return mask

    def _previous(self, C: int) -> jax.Array:
        """The last tokens of the latest fused step of coda size ``C`` (zeros before the first):
        read only by a step whose first sub-step feeds previous tokens, which the scheduler builds
        only right after a fused step of the same rows."""
        last = self._fused_last.get(C)
        if last is None:
            last = self._fused_last[C] = jax.device_put(np.zeros(C, np.int32), self._upload_to)
        return last

    def upload(self, desc) -> jax.Array:
        """``desc``'s packed buffer on the runner's device (``device_put``: ``jnp.asarray`` would
        stage it through a small jitted copy per shape)."""
        return self.put(desc.pack())

    def put(self, array) -> jax.Array:
        """A host array on the runner's device, placed as the executables take their inputs (a
        packed descriptor, the sampler's inputs: ``launch_sampler``)."""
        return jax.device_put(array, self._upload_to)

    def sampler_keys(self, keys: Iterable) -> list:
        """The separate samplers the one-loop buckets among ``keys`` may launch (none under tensor
        parallelism, where the step samples itself)."""
        if not self.separate_sampler:
            return []
        return list(dict.fromkeys(SamplerKey(k.C) for k in keys if isinstance(k, BucketKey) and k.C > 0))

    def long_segment_key(self, key) -> Optional[BucketKey]:
        """The long-segment variant of a one-loop bucket (``dispatch.long_segment_rows``: where the
        bucket splits attention per segment), or None where it has none."""
        if not isinstance(key, BucketKey) or key.M != 1:
            return None
        if key not in self._long_keys:
            c = local_config(self.config, self.tensor_parallel_size)
            m = long_segment_rows(
                self.attention,
                num_rows=key.R,
                num_segments=key.S,
                dtype=self.dtype,
                head_dim=c.head_dim,
                block_size=self.block_size,
                num_heads=c.num_attention_heads,
            )
            self._long_keys[key] = key._replace(M=m) if m else None
        return self._long_keys[key]

    def long_segment_keys(self, keys: Iterable) -> list:
        """The long-segment variants of ``keys`` (the runner compiles them beside their buckets)."""
        return [v for v in map(self.long_segment_key, keys) if v is not None]

    def executable_key(self, desc):
        """The executable a descriptor runs on: ``(key, n)`` for a fused step; for a one-loop step
        its bucket's long-segment variant when every segment holds enough rows (picked here, on the
        host: the same descriptor, one attention kernel instead of two), else its ``BucketKey``."""
        if hasattr(desc, "steps"):
            return (desc.key, desc.n)
        long = self.long_segment_key(desc.key)
        if long is not None:
            q_len = desc.seg_q_len[desc.seg_q_len > 0]  # every slot: a header cannot hide a short one
            if q_len.size and int(q_len.min()) >= long.M:
                return long
        return desc.key

    def executable(self, key):
        """The compiled executable of ``key`` (``KeyError`` if it was never compiled): for its memory
        analysis and HLO text."""
        return self._exe[key]

    def executables(self) -> dict:
        """Every compiled executable by key (a copy): a runner of the same shapes can ``adopt`` them."""
        return dict(self._exe)

    def adopt(self, executables: dict) -> None:
        """Use executables compiled by another runner of the same shapes (pools, ring, params, options)."""
        self._exe.update(executables)

    @property
    def device(self):
        return self._device

    def synchronize(self) -> None:
        self.ring.block_until_ready()

    def close(self) -> None:
        """Wait for every launch still running and every copy to the host still in flight, then
        drop the pools, the ring, the runner's weight layout and the executables, freeing their
        device memory (arrays the caller passed in stay theirs). Idempotent."""
        if self.closed:
            return
        self.closed = True
        for result in self._recent:
            result.wait()
            if result.deferred is not None:  # never completed: its exit depths are still copying
                np.asarray(result.deferred[1])
        self._recent.clear()
        jax.block_until_ready((self.k_pool, self.v_pool, self.ring, *self._fused_last.values()))
        self.k_pool = self.v_pool = self.ring = None
        self.params, self._param_leaves, self._top_leaves = None, (), ()
        self._fused_last.clear()
        self._coda_h = None
        self._free_masks.clear()
        self._free_adjust.clear()
        self._exe.clear()
