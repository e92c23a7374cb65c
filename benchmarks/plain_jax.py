"""What a JAX user would write without the engine: the baselines of issues #36 and #37.

* **decode** (``PlainDecoder``): one dense K/V pair per layer and loop (donated), the layers written
  out, one jit per loop, argmax; no paging, gates, planes or batching machinery. Fixed depth (every
  token runs the ``T`` loops), the same context for every stream. Caches lie ``[B, KVH, S, hd]``
  (gpt-fast's: the attention products' batch dimensions lead); ``[B, S, KVH, hd]`` was 11-18%
  slower and is gone (docs/decisions.md, "Decode").
* **prefill** (``plain_prefill``): one jit running each loop's layers over the whole prompts, cuDNN
  causal attention on a GPU (``jax.nn.dot_product_attention``; XLA's elsewhere), the K/V of every
  loop and layer returned (what a decode after it reads), and the first token.

Both use the model's own layers (``OuroModel``), so their tokens equal the engine's at fixed depth
in float32 (``tests/benchmarks/test_plain_jax.py``); what differs is everything around them.

``time_decode`` times decode steps from a given context without prefilling it: a step reads every
weight and all ``max_len`` positions of its dense caches whatever they hold (the mask, not the
contents, decides which count), so its time depends on the shapes alone; a prefill would cost one
more executable per shape (a loop executable compiles in ~41 s on the H200: docs/performance.md),
and at 128 streams of 1K its float32 attention scores (~10 GB a layer) would not fit beside the
116 GB of caches. ``benchmarks/decode.py`` runs it beside the engine's decode sweep (records
``path: "plain_jax"`` in ``decode.json``) and ``benchmarks/run.py`` runs ``time_prefill`` beside
``long4`` (records ``mode: "plain_jax"``), both on the engine's weights and the workloads' shapes.

    python -m benchmarks.plain_jax --preset ouro-1.4b --decode 1 8 32 --context 1024 \\
        --prefill 3x6000 [--profile] --out /tmp/plain.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from ouro_jax.model import OuroModel, dtype_of
from weights.config import OuroConfig

__all__ = ["PLAIN_MODE", "PlainDecoder", "plain_prefill", "profile_decode", "time_decode", "time_prefill"]

PLAIN_MODE = "plain_jax"  # the mode (and decode.json path) of these baselines' records


@dataclasses.dataclass(frozen=True)
class _DenseKV:
    """The attention boundary over one loop's dense caches, a ``(k, v)`` pair ``[B, KVH, S, hd]``
    per layer: the rows' K/V written at ``start..start+Sq-1``, their queries attend causally to
    everything up to there (softmax in float32)."""

    start: jax.Array  # int32 scalar: the first position of the rows
    scale: float

    def __call__(self, layer, q, k, v, cache):
        kc, vc = cache[layer]
        at = (0, 0, self.start, 0)
        kc = jax.lax.dynamic_update_slice(kc, k.transpose(0, 2, 1, 3).astype(kc.dtype), at)
        vc = jax.lax.dynamic_update_slice(vc, v.transpose(0, 2, 1, 3).astype(vc.dtype), at)
        cache = (*cache[:layer], (kc, vc), *cache[layer + 1 :])
        mask = jnp.arange(kc.shape[2])[None, :] <= (self.start + jnp.arange(q.shape[1]))[:, None]  # [Sq, Sk]
        b, sq, h, hd = q.shape
        kvh = kc.shape[1]
        qg = q.reshape(b, sq, kvh, h // kvh, hd).transpose(0, 2, 3, 1, 4)  # [B, KVH, G, Sq, hd]
        s = jnp.einsum("bkgqd,bksd->bkgqs", qg, kc, preferred_element_type=jnp.float32) * self.scale
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)  # a row always sees its own position
        o = jnp.einsum("bkgqs,bksd->bqkgd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
        return o.reshape(b, sq, h, hd).astype(q.dtype), cache


class PlainDecoder:
    """Greedy fixed-depth decoding of ``B`` streams over dense per-loop K/V caches of ``max_len``
    positions: ``prefill(ids [B, S])`` then ``step()`` per token (``T`` jitted loops + lm_head)."""

    def __init__(self, config: OuroConfig, params: dict, batch: int, max_len: int, dtype="bfloat16"):
        c = self.config = config
        self.dt = dtype_of(dtype)
        self.params = params
        self.model = OuroModel(c, self.dt)
        zeros = functools.partial(jnp.zeros, (batch, c.num_key_value_heads, max_len, c.head_dim), self.dt)
        self.caches = [tuple((zeros(), zeros()) for _ in range(c.num_hidden_layers)) for _ in range(c.num_loops)]
        self.pos = 0
        self.last = None

    @staticmethod
    def cache_bytes(config: OuroConfig, batch: int, max_len: int, dtype="bfloat16") -> int:
        """Bytes of the dense caches of ``batch`` streams of ``max_len`` positions (K and V, every loop)."""
        c = config
        per_loop = c.num_hidden_layers * batch * max_len * c.num_key_value_heads * c.head_dim
        return 2 * c.num_loops * per_loop * np.dtype(dtype_of(dtype)).itemsize

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=(4,))
    def _loop(self, params, x, start, cache):
        positions = start + jnp.arange(x.shape[1])[None, :]
        att = _DenseKV(start, self.config.attn_scale)
        h, _, cache = self.model.apply({"params": params}, x, positions, att, cache, method=OuroModel.recurrent)
        return h, cache

    @functools.partial(jax.jit, static_argnums=0)
    def _embed(self, params, ids):
        return self.model.apply({"params": params}, ids, method=OuroModel.prelude)

    @functools.partial(jax.jit, static_argnums=0)
    def _argmax(self, params, h):
        return jnp.argmax(self.model.apply({"params": params}, h[:, -1], method=OuroModel.coda), axis=-1)

    def _run(self, ids) -> jax.Array:
        x = self._embed(self.params, ids)
        start = jnp.int32(self.pos)
        for d in range(self.config.num_loops):
            x, self.caches[d] = self._loop(self.params, x, start, self.caches[d])
        self.pos += ids.shape[1]
        self.last = self._argmax(self.params, x).astype(jnp.int32)
        return self.last

    def prefill(self, ids) -> jax.Array:
        """The prompts ``[B, S]`` (equal lengths) through every loop; returns the first tokens ``[B]``."""
        return self._run(jnp.asarray(ids, jnp.int32))

    def step(self) -> jax.Array:
        """One more token of every stream ``[B]``, fed back on the device."""
        return self._run(self.last[:, None])

    def resume(self, pos: int, tokens) -> None:
        """Continue every stream at position ``pos`` from ``tokens [B]``, whatever the caches hold:
        positions from ``pos`` on are masked out until a step writes them."""
        self.pos = pos
        self.last = jnp.asarray(tokens, jnp.int32)

    def free(self) -> None:
        """Drop the caches now: the jit caches of the methods keep this object (their static
        argument) alive, and with it the caches, until the process ends."""
        self.caches.clear()
        self.last = None


@functools.partial(jax.jit, static_argnames=("config", "dtype_name", "cudnn"))
def plain_prefill(params, ids, *, config: OuroConfig, dtype_name: str, cudnn: bool):
    """One jit over prompts ``ids [B, S]``: every loop's layers over the whole prompts with causal
    attention, each loop's K/V kept. Returns ``(first tokens [B], [(k, v) per loop] [L, B, S, KVH, hd])``."""
    model = OuroModel(config, dtype_of(dtype_name))
    kvs = []

    def attention(layer, q, k, v, cache):
        cache.append((k, v))
        impl = "cudnn" if cudnn else "xla"
        o = jax.nn.dot_product_attention(q, k, v, scale=config.attn_scale, is_causal=True, implementation=impl)
        return o.astype(q.dtype), cache

    positions = jnp.arange(ids.shape[1])[None, :]
    x = model.apply({"params": params}, ids, method=OuroModel.prelude)
    for _ in range(config.num_loops):
        layers: list = []
        x, _, _ = model.apply({"params": params}, x, positions, attention, layers, method=OuroModel.recurrent)
        kvs.append((jnp.stack([k for k, _ in layers]), jnp.stack([v for _, v in layers])))
    logits = model.apply({"params": params}, x[:, -1], method=OuroModel.coda)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), kvs


def time_decode(config, params, batch: int, context: int, tokens: int, dtype="bfloat16", rounds: int = 3) -> dict:
    """Milliseconds per token of ``batch`` streams taking ``tokens`` steps from position ``context``
    (caches of ``context + tokens`` positions, not prefilled: see the module doc); every round starts
    at ``context`` again. ``tpot_ms``: the best round; ``round_ms``: every round; ``dispatch_ms``: the
    host's part of each (until its last step is issued); ``first_call_s``: the first step,
    compilation included."""
    dec = PlainDecoder(config, params, batch, context + tokens, dtype)
    start = np.random.default_rng(0).integers(5, config.vocab_size, batch)
    try:
        t = time.perf_counter()
        dec.resume(context, start)
        dec.step().block_until_ready()
        first_call_s = time.perf_counter() - t
        rounds_s, dispatch_s = [], []
        for _ in range(rounds):
            dec.resume(context, start)
            t = time.perf_counter()
            for _ in range(tokens):
                dec.step()
            dispatch_s.append((time.perf_counter() - t) / tokens)
            dec.last.block_until_ready()
            rounds_s.append((time.perf_counter() - t) / tokens)
    finally:
        dec.free()
    return dict(
        baseline="plain_jax_decode",
        batch=batch,
        context=context,
        tokens=tokens,
        max_len=context + tokens,
        cache_bytes=PlainDecoder.cache_bytes(config, batch, context + tokens, dtype),
        first_call_s=first_call_s,
        round_ms=[x * 1e3 for x in rounds_s],
        # the host's time to issue a round's steps (dispatch is asynchronous): near round_ms, the
        # loop waits on the host or on a full launch queue, not on the device alone
        dispatch_ms=[x * 1e3 for x in dispatch_s],
        tpot_ms=min(rounds_s) * 1e3,
    )


def time_prefill(config, params, ids, dtype="bfloat16", rounds: int = 3) -> dict:
    """Seconds and tokens/s of one ``plain_prefill`` of the prompts ``ids [B, S]``: ``wall_s`` the
    best of ``rounds`` calls, ``seconds_all`` every call, ``first_call_s`` the first (compilation
    included)."""
    ids = jnp.asarray(ids, jnp.int32)
    batch, length = ids.shape
    run = functools.partial(
        plain_prefill, config=config, dtype_name=np.dtype(dtype_of(dtype)).name, cudnn=jax.default_backend() == "gpu"
    )
    t = time.perf_counter()
    jax.block_until_ready(run(params, ids))
    first_call_s = time.perf_counter() - t
    seconds = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(run(params, ids))
        seconds.append(time.perf_counter() - t)
    best = min(seconds)
    return dict(
        baseline="plain_jax_prefill",
        batch=batch,
        length=length,
        first_call_s=first_call_s,
        seconds_all=seconds,
        wall_s=best,
        tok_s=batch * length / best,
    )


def profile_decode(config, params, batch: int, context: int, steps: int = 10, dtype="bfloat16") -> dict:
    """``steps`` decode steps of ``batch`` streams at ``context`` under the profiler: kernels a token,
    device-busy time a token (the union of kernel intervals) and the traced wall a token. Busy well
    under the wall means the loop waits on kernel launches, not on the device's work."""
    from benchmarks.metrics import interval_union
    from benchmarks.profile_step import trace_kernels

    dec = PlainDecoder(config, params, batch, context + steps + 1, dtype)
    try:
        dec.resume(context, np.random.default_rng(0).integers(5, config.vocab_size, batch))
        dec.step().block_until_ready()  # compiled before the trace

        def run() -> float:
            t = time.perf_counter()
            for _ in range(steps):
                dec.step()
            dec.last.block_until_ready()
            return time.perf_counter() - t

        wall, plane, events, _, _ = trace_kernels(run)
    finally:
        dec.free()
    busy, span = interval_union([(e["start_ns"], e["start_ns"] + e["duration_ns"]) for e in events])
    return dict(
        baseline="plain_jax_decode_profile",
        batch=batch,
        context=context,
        steps=steps,
        device_plane=plane,
        kernels_per_token=len(events) / steps,
        busy_ms_per_token=busy / 1e6 / steps,
        span_ms_per_token=span / 1e6 / steps,
        traced_wall_ms_per_token=wall * 1e3 / steps,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--decode", nargs="*", type=int, default=[1, 8, 32], help="decode batch sizes")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill", nargs="*", default=["3x6000"], help="BATCHxLENGTH prompts")
    ap.add_argument("--profile", action="store_true", help="also each decode batch's kernels and busy time a token")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from ouro_jax import get_preset
    from ouro_jax.model import init_params

    config = get_preset(a.preset)
    params = init_params(config, 0, a.dtype)
    records = []
    for b in a.decode:
        records.append(time_decode(config, params, b, a.context, a.tokens, a.dtype))
        print(json.dumps(records[-1]), flush=True)
        if a.profile:
            records.append(profile_decode(config, params, b, a.context, dtype=a.dtype))
            print(json.dumps(records[-1]), flush=True)
    for spec in a.prefill:
        b, n = map(int, spec.split("x"))
        ids = np.random.default_rng(0).integers(5, config.vocab_size, (b, n))
        records.append(time_prefill(config, params, ids, a.dtype))
        print(json.dumps(records[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(benchmark="plain_jax", device=jax.devices()[0].device_kind, records=records), f, indent=1)


if __name__ == "__main__":
    main()
