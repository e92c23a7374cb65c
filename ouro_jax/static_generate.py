"""``generate``: a pure, jitted static-batch generation with a dense per-loop KV cache.

The simple path users reach for first, and the baseline the engine must beat on mixed traffic.

* Prompts are right-padded to ``[B, P]`` with their true lengths in ``prompt_lengths``. Prefill runs
  all ``T`` loops over the padded block (causal, so the padding never leaks into real positions).
* The ``k``-th generated token sits at position ``len_b + k``. Each new token runs loops
  ``0, 1, ...`` while any row is still going (``lax.while_loop`` over depths inside a
  ``lax.while_loop`` over tokens); a row stops at its exit loop by the engine's ``ouro`` rule
  (``exit_rule``: ``min_loops``, ``max_loops``, ``exit_threshold``), and its logits come from its
  exit loop's hidden state.
* LAST_EXITED: a token that exits at ``e < T-1`` has its K/V of plane ``e`` copied into planes
  ``e+1 .. T-1`` so later tokens at deeper loops read its last version. Rows that already exited keep
  being computed while others go on (static batch), but what they write past their exit is
  overwritten by that copy.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import exit_rule
from .attention import DenseCacheAttention
from .config import OuroConfig
from .device_memory import device_memory
from .model import OuroModel, dtype_of
from .sampling import sample

__all__ = ["generate", "GenerateResult"]


class GenerateResult(NamedTuple):
    tokens: jax.Array  # [B, N] int32
    exit_depths: jax.Array  # [B, N] int32, 0-based loop that produced each token (first = T-1)


def dense_cache_bytes(config: OuroConfig, batch: int, max_len: int, dtype) -> int:
    """Bytes of ``generate()``'s dense per-loop K and V caches: every layer keeps ``T`` planes of
    ``[batch, max_len, KVH, hd]`` each, whatever the prompts' real lengths (the engine's paged
    cache holds only what requests use)."""
    per = batch * max_len * config.num_key_value_heads * config.head_dim * jnp.dtype(dtype).itemsize
    return 2 * config.num_hidden_layers * config.num_loops * per


def check_cache_fits(config: OuroConfig, batch: int, max_len: int, dtype, memory=None) -> None:
    """``ValueError`` before anything is compiled when the dense caches alone exceed what the
    device can still hold (``memory``: ``(bytes_limit, bytes_in_use)``, default the device's own;
    no stats, as on the CPU: no check). The caches are a lower bound of what the run needs."""
    memory = device_memory() if memory is None else memory
    if memory is None:
        return
    need = dense_cache_bytes(config, batch, max_len, dtype)
    free = memory[0] - memory[1]
    if need > free:
        gib = 1 << 30
        raise ValueError(
            f"generate()'s dense KV caches need {need / gib:.1f} GiB for batch {batch} x {max_len} "
            f"positions x {config.num_loops} loops, and the device has {free / gib:.1f} GiB free: lower the "
            "batch, the prompt length or max_new_tokens, or use LLM, whose paged cache holds only what "
            "requests use"
        )


def _sample_rows(model, params, h, temperature, top_k, top_p, rng, step):
    logits = model.apply({"params": params}, h, method=OuroModel.coda)
    b = h.shape[0]
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(rng, step), i))(jnp.arange(b))
    return sample(logits, jnp.full((b,), temperature), jnp.full((b,), top_k, jnp.int32), jnp.full((b,), top_p), keys)


@functools.partial(
    jax.jit, static_argnames=("config", "dtype_name", "max_new_tokens", "min_loops", "max_loops", "top_k")
)
def _generate(
    params,
    prompt_ids,
    prompt_lengths,
    exit_threshold,
    temperature,
    top_p,
    rng,
    *,
    config: OuroConfig,
    dtype_name: str,
    max_new_tokens: int,
    min_loops: int,
    max_loops: int,
    top_k: int,
):
    c = config
    dt = dtype_of(dtype_name)
    model = OuroModel(c, dt)
    T, L = c.num_loops, c.num_hidden_layers
    b, p = prompt_ids.shape
    smax = p + max_new_tokens
    cache_shape = (T, b, smax, c.num_key_value_heads, c.head_dim)
    caches = [(jnp.zeros(cache_shape, dt), jnp.zeros(cache_shape, dt)) for _ in range(L)]
    apply = functools.partial(model.apply, {"params": params})
    rows = jnp.arange(b)

    # ---- prefill: all T loops over the whole (padded) prompt block
    pos = jnp.broadcast_to(jnp.arange(p), (b, p))
    x = apply(prompt_ids, method=OuroModel.prelude)

    def prefill_loop(d, carry):
        x, caches = carry
        attn = DenseCacheAttention(d, None, True, c.attn_scale)
        h, _, caches = apply(x, pos, attn, caches, method=OuroModel.recurrent)
        return h, caches

    x, caches = jax.lax.fori_loop(0, T, prefill_loop, (x, caches))
    h_last = x[rows, prompt_lengths - 1]
    tok0 = _sample_rows(model, params, h_last, temperature, top_k, top_p, rng, 0)
    tokens = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(tok0)
    depths = jnp.full((b, max_new_tokens), T - 1, jnp.int32)

    # ---- decode: one token per outer iteration, loops until every row has exited
    def token_body(carry):
        n, tokens, depths, caches = carry
        posn = prompt_lengths + n - 1  # position of token n-1, whose loops run now
        x0 = apply(tokens[:, n - 1], method=OuroModel.prelude)[:, None]

        def depth_cond(s):
            d, _, _, exited, _, _, _ = s
            return (d < max_loops) & ~jnp.all(exited)

        def depth_body(s):
            d, x, remaining, exited, e, h_exit, caches = s
            attn = DenseCacheAttention(d, posn, False, c.attn_scale)
            h, g, caches = apply(x, posn[:, None], attn, caches, method=OuroModel.recurrent)
            remaining = exit_rule.fold_gate(remaining, g[:, 0])
            now = ~exited & exit_rule.decide_exit(d + 1, remaining, exit_threshold, min_loops, max_loops, "ouro")
            h_exit = jnp.where(now[:, None], h[:, 0], h_exit)
            e = jnp.where(now, d, e)
            return d + 1, h, remaining, exited | now, e, h_exit, caches

        init = (
            jnp.int32(0),
            x0,
            jnp.ones((b,), jnp.float32),
            jnp.zeros((b,), bool),
            jnp.full((b,), T - 1, jnp.int32),
            jnp.zeros((b, c.hidden_size), dt),
            caches,
        )
        _, _, _, _, e, h_exit, caches = jax.lax.while_loop(depth_cond, depth_body, init)

        # LAST_EXITED finalize: planes deeper than the exit loop take the exit loop's K/V
        def finalize(cache):
            src = cache[e, rows, posn]  # [B, KVH, hd]
            cur = cache[:, rows, posn]  # [T, B, KVH, hd]
            deeper = (jnp.arange(T)[:, None] > e[None, :])[..., None, None]
            return cache.at[:, rows, posn].set(jnp.where(deeper, src[None], cur))

        caches = [(finalize(k), finalize(v)) for k, v in caches]
        tok = _sample_rows(model, params, h_exit, temperature, top_k, top_p, rng, n)
        return n + 1, tokens.at[:, n].set(tok), depths.at[:, n].set(e), caches

    _, tokens, depths, _ = jax.lax.while_loop(
        lambda s: s[0] < max_new_tokens, token_body, (jnp.int32(1), tokens, depths, caches)
    )
    return GenerateResult(tokens, depths)


def generate(
    params,
    config: OuroConfig,
    prompt_ids,
    prompt_lengths,
    max_new_tokens: int,
    *,
    exit_threshold: float = 1.0,
    min_loops: int = 1,
    max_loops: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    rng=None,
) -> GenerateResult:
    """Generate ``max_new_tokens`` tokens for a static batch of right-padded prompts.

    ``prompt_ids [B, P]`` int, ``prompt_lengths [B]`` (1..P). Greedy when ``temperature == 0``.
    Returns ``GenerateResult(tokens [B, N], exit_depths [B, N])``. Jitted: one compilation per
    (config, dtype, shapes, max_new_tokens, min_loops, max_loops, top_k). Concrete inputs are checked
    on the host (``ValueError``: integer ids inside the vocabulary, lengths in ``[1, P]``); inside an
    outer ``jit`` only dtypes and shapes can be, and bad values give garbage tokens, not an error.
    """
    T = config.num_loops
    max_loops = T if max_loops is None else int(max_loops)
    for name, v in (("prompt_ids", prompt_ids), ("prompt_lengths", prompt_lengths)):
        dt = v.dtype if hasattr(v, "dtype") else np.asarray(v).dtype
        if not jnp.issubdtype(dt, jnp.integer):  # floats would be truncated, bools taken as 0/1
            raise ValueError(f"{name} must be integers, got dtype {dt}")
    if getattr(prompt_ids, "ndim", np.ndim(prompt_ids)) != 2 or np.shape(prompt_ids)[1] == 0:
        raise ValueError(f"prompt_ids must be [batch, prompt_len>0], got shape {np.shape(prompt_ids)}")
    b, p = np.shape(prompt_ids)
    if np.shape(prompt_lengths) != (b,):
        raise ValueError(f"prompt_lengths must have shape ({b},), got {np.shape(prompt_lengths)}")
    if not isinstance(prompt_ids, jax.core.Tracer) and not isinstance(prompt_lengths, jax.core.Tracer):
        # Concrete inputs are checked on the host. Under an outer jit the values cannot be: there a
        # length outside [1, P] or an id outside the vocabulary gives garbage tokens, not an error
        # (negative ids wrap around, ids >= vocab_size embed as NaN).
        ids, lengths_np = np.asarray(prompt_ids), np.asarray(prompt_lengths)
        lmin, lmax = int(lengths_np.min()), int(lengths_np.max())
        if lmin < 1 or lmax > p:
            raise ValueError(f"prompt_lengths must lie in [1, {p}], got [{lmin}, {lmax}]")
        real = np.arange(p)[None, :] < lengths_np[:, None]  # right padding is never read
        bad = ids[real & ((ids < 0) | (ids >= config.vocab_size))]
        if bad.size:
            raise ValueError(f"token ids {bad[:5].tolist()} are outside the vocabulary [0, {config.vocab_size})")
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if p + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({p}) + max_new_tokens ({max_new_tokens}) exceeds "
            f"max_position_embeddings ({config.max_position_embeddings})"
        )
    if not 1 <= min_loops <= max_loops <= T:
        raise ValueError(f"need 1 <= min_loops ({min_loops}) <= max_loops ({max_loops}) <= T ({T})")
    for name, v, lo, hi in (("exit_threshold", exit_threshold, 0.0, 1.0), ("top_p", top_p, 1e-9, 1.0)):
        if not (lo <= float(v) <= hi):
            raise ValueError(f"{name} must lie in [{lo}, {hi}], got {v}")
    if not float(temperature) >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if int(top_k) < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    dtype_name = str(jax.tree.leaves(params)[0].dtype)
    check_cache_fits(config, b, p + max_new_tokens, dtype_name)
    return _generate(
        params,
        prompt_ids,
        lengths,
        jnp.float32(exit_threshold),
        jnp.float32(temperature),
        jnp.float32(top_p),
        rng,
        config=config,
        dtype_name=dtype_name,
        max_new_tokens=max_new_tokens,
        min_loops=int(min_loops),
        max_loops=max_loops,
        top_k=int(top_k),
    )
