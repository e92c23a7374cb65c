"""ModelRunner: executes one ``BatchDescriptor`` (one loop for a bucket of rows) on the device.

The runner decides *how* a plan runs; the scheduler decided *what*. It owns the device state:

* the stacked paged KV pools ``K, V: [L, KVH, num_blocks, block_size, hd]`` and the hidden-state
  ring ``[num_ring_rows, D]``, donated to every step so XLA updates them in place;
* one compiled executable per bucket (rows, segments, block-table width, prelude, coda, finalize
  sizes), compiled ahead of time by :meth:`warmup` and reused for every invocation of that shape,
  the way PyTorch engines replay CUDA graphs. A shape that was not warmed up is compiled on first
  use and counted in ``compilations`` (a test asserts a warmed run compiles nothing).

One step does, in order (``docs/contracts.md``): LAST_EXITED finalize copies, prelude (embed into
ring rows), one loop of the stack for the rows (K/V written at each row's slot, ragged paged
attention per segment, output scattered back to the ring), the exit gate, and the coda (lm_head +
sampling) of the coda rows. Only the gate logits ``[R]`` and sampled tokens ``[C]`` come back,
copied to the host asynchronously; the host reads them only when the scheduler needs them.

The descriptor travels as two packed arrays (int32 and float32) because every host-to-device
transfer costs tens of microseconds on the H200 (``docs/performance.md``).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import copy_kv_slots

from .config import OuroConfig
from .model import OuroDecoderLayer, OuroModel, dtype_of, rope_cos_sin
from .paged_attention import PagedAttention, attention_plan
from .sampling import row_keys, sample

__all__ = ["ModelRunner", "BucketDims", "StepHandle", "INT_FIELDS", "FLOAT_FIELDS", "pack_descriptor"]


@dataclasses.dataclass(frozen=True, order=True)
class BucketDims:
    """The static shape of one executable: rows, segments, block-table width, prelude, coda, finalize."""
    R: int
    S: int
    MB: int
    P: int
    C: int
    F: int


# (field, size expression over BucketDims) in packing order
INT_FIELDS = (("row_ring", "R"), ("row_pos", "R"), ("row_slot", "R"), ("seg_q_start", "S"),
              ("seg_q_len", "S"), ("seg_ctx_len", "S"), ("seg_block_table", "S*MB"), ("pre_ring", "P"),
              ("pre_token", "P"), ("coda_row", "C"), ("coda_top_k", "C"), ("coda_seed", "C"),
              ("coda_step", "C"), ("fin_src", "F"), ("fin_dst", "F"))
FLOAT_FIELDS = (("coda_temperature", "C"), ("coda_top_p", "C"))


def _size(expr: str, d: BucketDims) -> int:
    n = 1
    for part in expr.split("*"):
        n *= getattr(d, part)
    return n


def dims_of(desc) -> BucketDims:
    R = desc.row_ring.shape[0]
    S, MB = desc.seg_block_table.shape
    return BucketDims(R=R, S=S, MB=MB, P=desc.pre_ring.shape[0], C=desc.coda_row.shape[0], F=desc.fin_src.shape[0])


def pack_descriptor(desc) -> tuple[BucketDims, np.ndarray, np.ndarray]:
    """Descriptor -> (dims, one int32 array, one float32 array) in the static packing order."""
    d = dims_of(desc)
    ints = np.concatenate([np.asarray(getattr(desc, f)).astype(np.int64).astype(np.int32, copy=False).reshape(-1)
                           if f != "coda_seed" else np.asarray(desc.coda_seed).astype(np.uint32).view(np.int32).reshape(-1)
                           for f, _ in INT_FIELDS])
    floats = np.concatenate([np.asarray(getattr(desc, f), np.float32).reshape(-1) for f, _ in FLOAT_FIELDS])
    return d, ints, floats


def _unpack(d: BucketDims, ints, floats) -> dict:
    out, off = {}, 0
    for f, e in INT_FIELDS:
        n = _size(e, d)
        out[f] = ints[off:off + n]
        off += n
    out["seg_block_table"] = out["seg_block_table"].reshape(d.S, d.MB)
    off = 0
    for f, e in FLOAT_FIELDS:
        n = _size(e, d)
        out[f] = floats[off:off + n]
        off += n
    return out


class StepHandle:
    """Results of one invocation, still on the device; reading them blocks only then."""

    def __init__(self, runner: "ModelRunner", gates: jax.Array, tokens: jax.Array):
        self._runner, self._gates, self._tokens = runner, gates, tokens
        self._gates_np = self._tokens_np = None

    def gates(self) -> np.ndarray:
        if self._gates_np is None:
            t = time.perf_counter()
            self._gates_np = np.asarray(self._gates)
            self._runner.wait_time += time.perf_counter() - t
        return self._gates_np

    def tokens(self) -> np.ndarray:
        if self._tokens_np is None:
            t = time.perf_counter()
            self._tokens_np = np.asarray(self._tokens)
            self._runner.wait_time += time.perf_counter() - t
        return self._tokens_np


def _step(params, kp, vp, ring, ints, floats, *, dims: BucketDims, config: OuroConfig, dtype_name: str,
          impl: str, interpret: bool, layer_loop: str):
    c = config
    dt = dtype_of(dtype_name)
    model = OuroModel(c, dt)
    a = _unpack(dims, ints, floats)

    # 1. LAST_EXITED finalize: deeper planes of exited tokens take the exit plane's K/V
    kp, vp = copy_kv_slots(kp, vp, a["fin_src"], a["fin_dst"])
    # 2. prelude: embed into ring rows (padding writes the scratch row 0)
    emb = model.apply({"params": params["top"]}, a["pre_token"], method=OuroModel.prelude)
    ring = ring.at[a["pre_ring"]].set(emb.astype(ring.dtype))
    # 3. one loop for every row
    x = ring[a["row_ring"]]
    plan = attention_plan(impl, dims.R, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          a["seg_q_start"], a["seg_q_len"], a["seg_ctx_len"])
    attn = PagedAttention(a["row_slot"], a["seg_q_start"], a["seg_q_len"], a["seg_ctx_len"],
                          a["seg_block_table"], c.attn_scale, impl, interpret, plan)
    if layer_loop == "unrolled":
        h, g, (kp, vp) = model.apply({"params": params["top"] | params["layers"]}, x, a["row_pos"], attn,
                                     (kp, vp), method=OuroModel.recurrent)
    else:
        cos, sin = rope_cos_sin(a["row_pos"], c.head_dim, c.rope_theta)
        layer = OuroDecoderLayer(c, dt)

        def body(carry, xs):
            x, pools = carry
            i, p = xs
            x, pools = layer.apply({"params": p}, x, cos, sin, attn, pools, layer=i)
            return (x, pools), None

        (x, (kp, vp)), _ = jax.lax.scan(body, (x.astype(jnp.float32), (kp, vp)),
                                        (jnp.arange(c.num_hidden_layers), params["layers"]))
        h, g = model.apply({"params": params["top"]}, x, method=OuroModel.finish_loop)
    ring = ring.at[a["row_ring"]].set(h.astype(ring.dtype))
    # 4. coda for the rows that may produce a token
    logits = model.apply({"params": params["top"]}, h[a["coda_row"]], method=OuroModel.coda)
    keys = row_keys(a["coda_seed"].view(jnp.uint32), a["coda_step"])
    tokens = sample(logits, a["coda_temperature"], a["coda_top_k"], a["coda_top_p"], keys)
    return kp, vp, ring, g.astype(jnp.float32), tokens


class ModelRunner:
    """Device state + one executable per bucket. See the module docstring."""

    def __init__(self, config: OuroConfig, params: dict, *, num_blocks: int, block_size: int,
                 num_ring_rows: int, attention: str = "auto", layer_loop: str = "scan",
                 interpret: bool = False):
        if attention == "auto":
            attention = "pallas" if jax.default_backend() == "gpu" else "reference"
        if attention not in ("pallas", "reference"):
            raise ValueError(f"attention must be 'auto', 'pallas' or 'reference', got {attention!r}")
        if layer_loop not in ("scan", "unrolled"):
            raise ValueError(f"layer_loop must be 'scan' or 'unrolled', got {layer_loop!r}")
        self.config = config
        self.attention, self.layer_loop, self.interpret = attention, layer_loop, interpret
        leaves = jax.tree.leaves(params)
        self.dtype = leaves[0].dtype
        self.dtype_name = str(self.dtype)
        self.params = self._arrange(params)
        c = config
        pool_shape = (c.num_hidden_layers, c.num_key_value_heads, num_blocks, block_size, c.head_dim)
        self.k_pool = jnp.zeros(pool_shape, self.dtype)
        self.v_pool = jnp.zeros(pool_shape, self.dtype)
        self.ring = jnp.zeros((num_ring_rows, c.hidden_size), self.dtype)
        self.num_blocks, self.block_size, self.num_ring_rows = num_blocks, block_size, num_ring_rows
        self._jitted = jax.jit(
            functools.partial(_step, config=c, dtype_name=self.dtype_name, impl=attention,
                              interpret=interpret, layer_loop=layer_loop),
            static_argnames=("dims",), donate_argnums=(1, 2, 3))
        self._exe: dict[BucketDims, Any] = {}
        self.compilations = 0
        self.compile_time = 0.0
        self.compile_times: dict[BucketDims, float] = {}
        self.dispatch_time = 0.0
        self.wait_time = 0.0
        self.invocations = 0

    # ------------------------------------------------------------------------------- setup
    def _arrange(self, params: dict) -> dict:
        """Split the tree into ``top`` (embed, norm, gate, lm_head) and ``layers``: a dict of
        ``layers_i`` (unrolled) or one stacked ``[L, ...]`` tree (scan)."""
        L = self.config.num_hidden_layers
        top = {k: v for k, v in params.items() if not k.startswith("layers_")}
        layers = {f"layers_{i}": params[f"layers_{i}"] for i in range(L)}
        if self.layer_loop == "scan":
            layers = jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[f"layers_{i}"] for i in range(L)])
        return {"top": jax.tree.map(jnp.asarray, top), "layers": jax.tree.map(jnp.asarray, layers)}

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k_pool.size * self.k_pool.dtype.itemsize

    def _compile(self, dims: BucketDims):
        t = time.perf_counter()
        sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
        n_int = sum(_size(e, dims) for _, e in INT_FIELDS)
        n_float = sum(_size(e, dims) for _, e in FLOAT_FIELDS)
        lowered = self._jitted.lower(jax.tree.map(sds, self.params), sds(self.k_pool), sds(self.v_pool),
                                     sds(self.ring), jax.ShapeDtypeStruct((n_int,), jnp.int32),
                                     jax.ShapeDtypeStruct((n_float,), jnp.float32), dims=dims)
        exe = lowered.compile()
        dt = time.perf_counter() - t
        self._exe[dims] = exe
        self.compilations += 1
        self.compile_time += dt
        self.compile_times[dims] = dt
        return exe

    def warmup(self, dims_list: Iterable[BucketDims], progress: bool = True) -> float:
        """Compile every bucket ahead of time (with a progress bar); returns the seconds spent."""
        todo = [d for d in dict.fromkeys(dims_list) if d not in self._exe]
        t = time.perf_counter()
        it = todo
        if progress and todo:
            from tqdm.auto import tqdm
            it = tqdm(todo, desc="compiling buckets", unit="exe")
        for d in it:
            self._compile(d)
        return time.perf_counter() - t

    # ----------------------------------------------------------------------------- execute
    def execute(self, desc) -> StepHandle:
        dims, ints, floats = pack_descriptor(desc)
        exe = self._exe.get(dims)
        if exe is None:
            exe = self._compile(dims)  # not warmed up: counted in `compilations`
        t = time.perf_counter()
        self.k_pool, self.v_pool, self.ring, gates, tokens = exe(
            self.params, self.k_pool, self.v_pool, self.ring, jnp.asarray(ints), jnp.asarray(floats))
        for arr in (gates, tokens):
            arr.copy_to_host_async()
        self.invocations += 1
        self.dispatch_time += time.perf_counter() - t
        return StepHandle(self, gates, tokens)

    def synchronize(self) -> None:
        self.ring.block_until_ready()
