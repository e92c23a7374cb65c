"""``generate``: a pure, jitted static-batch generation on the engine's decode path.

The simple path users reach for first, and the baseline the engine must beat on mixed traffic. Its
decode runs what the engine's fused decode step runs, so that a static batch is as fast per token:

* Weights in the runner's layout: Q/K/V and gate/up as one kernel each (``fuse_layer_params``, once
  per call, outside the token loops); with the checkpoint's separate kernels XLA concatenates them
  on every loop.
* K/V in one stacked paged pool pair ``[L, KVH, NB, BS, hd]`` (``BLOCK_SIZE`` tokens a page) with a
  static identity block table: plane ``t`` of batch row ``b`` owns pages ``(t*B + b)*M .. +M-1``
  (``M = pages_per_row(P + N)``). Decode attention is the engine's ``AttentionKernel`` of a decode
  bucket (one segment per row, ``dispatch.choose_attention`` with ``decode_only``: on Hopper the
  decode kernel, on other GPUs the Triton ragged paged kernel, the jnp twin on the CPU), reading
  only each row's ``position + 1`` keys of its plane; a dense cache sliced per plane and a softmax
  over all ``S_max`` positions cost more than that.
* Decode rows are padded to a multiple of ``MIN_DECODE_ROWS`` (the engine's smallest bucket: XLA's
  one-row kernels are slower than eight rows, docs/performance.md); padding rows write no K/V and
  attend to nothing.

Semantics:

* Prompts are right-padded to ``[B, P]`` with their true lengths in ``prompt_lengths``. Prefill runs
  all ``T`` loops over the padded block with dense causal attention over the rows' own keys (the
  padding never leaks into real positions) and writes every position's K/V into its plane.
* The ``k``-th generated token sits at position ``len_b + k``. Each new token runs loops
  ``0, 1, ...`` while any row is still going (``lax.while_loop`` over depths inside a
  ``lax.while_loop`` over tokens); a row stops at its exit loop by the engine's ``ouro`` rule
  (``exit_rule``: ``min_loops``, ``max_loops``, ``exit_threshold``), and its logits come from its
  exit loop's hidden state. Rows that exited keep being computed while others go on (static batch)
  but write no K/V and attend to nothing.
* LAST_EXITED: a token that exits at ``e < T-1`` has its K/V of plane ``e`` copied into planes
  ``e+1 .. T-1`` (``copy_kv_slots``) so later tokens at deeper loops read its last version.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import copy_kv_slots, write_kv
from pallas_kernels.choices import check_attention
from pallas_kernels.dispatch import AttentionKernel, choose_attention
from weights.config import OuroConfig

from . import exit_rule
from .attention import DenseCausalAttention
from .compiler_options import step_options
from .device_memory import device_memory
from .model import OuroModel, dtype_of, fuse_layer_params
from .paged_attention import PagedAttention, fuses_norms, fuses_rope
from .sampling import sample

__all__ = ["generate", "GenerateResult", "BLOCK_SIZE", "MIN_DECODE_ROWS"]

# Tokens per page of the pool (the engine's default ``block_size``).
BLOCK_SIZE = 16
# Decode rows are padded to a multiple of this (the engine's smallest row bucket).
MIN_DECODE_ROWS = 8


class GenerateResult(NamedTuple):
    tokens: jax.Array  # [B, N] int32
    exit_depths: jax.Array  # [B, N] int32, 0-based loop that produced each token (first = T-1)


def pages_per_row(max_len: int) -> int:
    """Pages of one plane of one batch row: ``max_len`` positions rounded up to whole pages."""
    return -(-int(max_len) // BLOCK_SIZE)


def decode_rows(batch: int) -> int:
    """Rows of a decode invocation for ``batch`` sequences (a multiple of ``MIN_DECODE_ROWS``)."""
    return -(-int(batch) // MIN_DECODE_ROWS) * MIN_DECODE_ROWS


def kv_pool_bytes(config: OuroConfig, batch: int, max_len: int, dtype) -> int:
    """Bytes of ``generate()``'s K and V pools: every layer keeps ``T`` planes of ``batch`` rows of
    ``max_len`` positions (rounded up to pages), whatever the prompts' real lengths (the engine's
    pool holds only what requests use)."""
    tokens = batch * pages_per_row(max_len) * BLOCK_SIZE
    per = tokens * config.num_key_value_heads * config.head_dim * jnp.dtype(dtype).itemsize
    return 2 * config.num_hidden_layers * config.num_loops * per


def check_cache_fits(config: OuroConfig, batch: int, max_len: int, dtype, memory=None) -> None:
    """``ValueError`` before anything is compiled when the K/V pools alone exceed what the
    device can still hold (``memory``: ``(bytes_limit, bytes_in_use)``, default the device's own;
    no stats, as on the CPU: no check). The pools are a lower bound of what the run needs."""
    memory = device_memory() if memory is None else memory
    if memory is None:
        return
    need = kv_pool_bytes(config, batch, max_len, dtype)
    free = memory[0] - memory[1]
    if need > free:
        gib = 1 << 30
        raise ValueError(
            f"generate()'s KV pools need {need / gib:.1f} GiB for batch {batch} x {max_len} "
            f"positions x {config.num_loops} loops, and the device has {free / gib:.1f} GiB free: lower the "
            "batch, the prompt length or max_new_tokens, or use LLM, whose paged cache holds only what "
            "requests use"
        )


def plane_slot(plane, rows, positions, batch: int, pages: int):
    """Flat pool slot of ``(plane, batch row, position)`` in the identity layout (broadcasts)."""
    return (plane * batch + rows) * (pages * BLOCK_SIZE) + positions


def plane_block_table(plane, batch: int, pages: int):
    """``[batch, pages]`` block table of plane ``plane``'s rows in the identity layout."""
    return (plane * batch + jnp.arange(batch, dtype=jnp.int32))[:, None] * pages + jnp.arange(pages, dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class PrefillPoolAttention:
    """Prefill rows ``[B, P]``: causal attention over the rows' own keys (dense), and their K/V
    written into the stacked pool pair at ``slots [B, P]`` (the threaded cache)."""

    slots: jax.Array
    scale: float

    def __call__(self, layer, q, k, v, cache):
        kp, vp = cache
        flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
        kp, vp = write_kv(kp, vp, flat(k), flat(v), self.slots.reshape(-1), layer=layer)
        out, _ = DenseCausalAttention(self.scale)(layer, q, k, v, None)
        return out, (kp, vp)


def _sample_rows(model, params, h, temperature, top_k, top_p, rng, step):
    logits = model.apply({"params": params}, h, method=OuroModel.coda)
    b = h.shape[0]
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(rng, step), i))(jnp.arange(b))
    return sample(logits, jnp.full((b,), temperature), jnp.full((b,), top_k, jnp.int32), jnp.full((b,), top_p), keys)


def fuse_params(params: dict, config: OuroConfig) -> dict:
    """The checkpoint tree with every layer's projections fused (``fuse_layer_params``)."""
    return {k: fuse_layer_params(v, config) if k.startswith("layers_") else v for k, v in params.items()}


_STATIC = ("config", "dtype_name", "max_new_tokens", "min_loops", "max_loops", "top_k", "kernel")


@functools.cache
def _jitted(options: tuple):
    """``_generate`` jitted with the XLA options ``options`` (sorted items): one ``jax.jit`` per
    option set, so its compilation cache is kept across calls."""
    return jax.jit(_generate, static_argnames=_STATIC, compiler_options=dict(options) or None)


def xla_options() -> dict:
    """The XLA options ``generate()`` compiles with when called at the top level: the fused steps'
    (``compiler_options.step_options``), so that on the GPU its token and depth ``while_loop``s run
    as CUDA-graph conditional nodes instead of waiting for the host after every loop. A caller that
    wraps ``generate()`` in its own ``jax.jit`` passes these to that ``jit`` (JAX applies compiler
    options only at the top level)."""
    return step_options(fused=True)


def _top_level() -> bool:
    """Whether this call runs outside any JAX trace (a nested ``jit`` refuses compiler options)."""
    from jax._src import core  # jax 0.11.2 has no public form of this check

    return core.trace_state_clean()


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
    kernel: AttentionKernel,
):
    c = config
    dt = dtype_of(dtype_name)
    model = OuroModel(c, dt, fused_projections=True)
    T, L = c.num_loops, c.num_hidden_layers
    b, p = prompt_ids.shape
    R = kernel.num_rows
    m = pages_per_row(p + max_new_tokens)
    pool_shape = (L, c.num_key_value_heads, T * b * m, BLOCK_SIZE, c.head_dim)
    pools = (jnp.zeros(pool_shape, dt), jnp.zeros(pool_shape, dt))
    params = fuse_params(params, c)  # once per call, outside the loops
    apply = functools.partial(model.apply, {"params": params})
    rows = jnp.arange(b)

    # ---- prefill: all T loops over the whole (padded) prompt block, K/V into each plane
    pos = jnp.broadcast_to(jnp.arange(p), (b, p))
    x = apply(prompt_ids, method=OuroModel.prelude)

    def prefill_loop(d, carry):
        x, pools = carry
        attn = PrefillPoolAttention(plane_slot(d, rows[:, None], pos, b, m), c.attn_scale)
        h, _, pools = apply(x, pos, attn, pools, method=OuroModel.recurrent)
        return h, pools

    x, pools = jax.lax.fori_loop(0, T, prefill_loop, (x, pools))
    h_last = x[rows, prompt_lengths - 1]
    tok0 = _sample_rows(model, params, h_last, temperature, top_k, top_p, rng, 0)
    tokens = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(tok0)
    depths = jnp.full((b, max_new_tokens), T - 1, jnp.int32)

    # ---- decode: R rows (the first b real), one segment each; one token per outer iteration
    real = jnp.arange(R) < b
    row_ids = jnp.arange(R, dtype=jnp.int32)
    pad = lambda a: jnp.pad(a, (0, R - b))  # noqa: E731
    table0 = jnp.zeros((R, m), jnp.int32).at[:b].set(plane_block_table(0, b, m))

    def token_body(carry):
        n, tokens, depths, pools = carry
        posn = prompt_lengths + n - 1  # position of token n-1, whose loops run now
        pos_r = pad(posn)
        x0 = apply(pad(tokens[:, n - 1]), method=OuroModel.prelude)

        def depth_cond(s):
            d, _, _, exited, _, _, _ = s
            return (d < max_loops) & ~jnp.all(exited)

        def depth_body(s):
            d, x, remaining, exited, e, h_exit, pools = s
            live = ~exited  # exited and padding rows write no K/V and attend to nothing
            seg = (
                row_ids,
                live.astype(jnp.int32),
                jnp.where(live, pos_r + 1, 0),
                jnp.where(real[:, None], table0 + d * (b * m), 0),
            )
            slot = jnp.where(live, plane_slot(d, row_ids, pos_r, b, m), -1)
            attn = PagedAttention(
                slot, *seg, c.attn_scale, kernel, kernel.plan(*seg), fuses_rope(kernel), fuses_norms(kernel)
            )
            h, g, pools = apply(x, pos_r, attn, pools, method=OuroModel.recurrent)
            remaining = exit_rule.fold_gate(remaining, g)
            now = live & exit_rule.decide_exit(d + 1, remaining, exit_threshold, min_loops, max_loops, "ouro")
            h_exit = jnp.where(now[:, None], h, h_exit)
            e = jnp.where(now, d, e)
            return d + 1, h, remaining, exited | now, e, h_exit, pools

        init = (
            jnp.int32(0),
            x0,
            jnp.ones((R,), jnp.float32),
            ~real,
            jnp.full((R,), T - 1, jnp.int32),
            jnp.zeros((R, c.hidden_size), dt),
            pools,
        )
        _, _, _, _, e, h_exit, pools = jax.lax.while_loop(depth_cond, depth_body, init)
        e = e[:b]

        # LAST_EXITED finalize: planes deeper than the exit loop take the exit loop's K/V
        if T > 1:
            above = jnp.arange(1, T)[:, None]  # [T-1, 1]
            dst = jnp.where(above > e[None, :], plane_slot(above, rows[None, :], posn[None, :], b, m), -1)
            src = jnp.broadcast_to(plane_slot(e, rows, posn, b, m), dst.shape)
            pools = copy_kv_slots(*pools, src.reshape(-1), dst.reshape(-1))
        tok = _sample_rows(model, params, h_exit[:b], temperature, top_k, top_p, rng, n)
        return n + 1, tokens.at[:, n].set(tok), depths.at[:, n].set(e), pools

    _, tokens, depths, _ = jax.lax.while_loop(
        lambda s: s[0] < max_new_tokens, token_body, (jnp.int32(1), tokens, depths, pools)
    )
    return GenerateResult(tokens, depths)


def decode_kernel(attention: str, config: OuroConfig, batch: int, dtype) -> AttentionKernel:
    """The decode bucket's kernel, as the engine's fused steps pick it for ``decode_rows(batch)`` rows
    of one segment each (``dispatch.choose_attention``, ``decode_only``); Pallas kernels run in
    interpret mode off a GPU."""
    r = decode_rows(batch)
    return choose_attention(
        attention,
        num_rows=r,
        num_segments=r,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        block_size=BLOCK_SIZE,
        dtype=dtype_of(dtype),
        interpret=jax.default_backend() != "gpu",
        decode_only=True,
    )


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
    attention: str = "auto",
) -> GenerateResult:
    """Generate ``max_new_tokens`` tokens for a static batch of right-padded prompts.

    ``prompt_ids [B, P]`` int, ``prompt_lengths [B]`` (1..P). Greedy when ``temperature == 0``.
    ``attention``: the decode attention kernel, as ``LLM``'s option (``auto``: the engine's choice
    for a decode bucket on a GPU, the jnp ``reference`` elsewhere; a Pallas kernel off a GPU runs
    in interpret mode, for tests).
    Returns ``GenerateResult(tokens [B, N], exit_depths [B, N])``. Inside a ``jax.jit`` of the
    caller's, pass ``compiler_options=static_generate.xla_options()`` to that ``jit``: without
    them every loop waits for the host on a GPU. Jitted: one compilation per
    (config, dtype, shapes, max_new_tokens, min_loops, max_loops, top_k, kernel). Concrete inputs are checked
    on the host (``ValueError``: integer ids inside the vocabulary, lengths in ``[1, P]``); inside an
    outer ``jit`` only dtypes and shapes can be, and bad values give garbage tokens, not an error.
    """
    T = config.num_loops
    max_loops = T if max_loops is None else int(max_loops)
    attention = check_attention(attention)
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
    kernel = decode_kernel(attention, config, b, dtype_name)
    check_cache_fits(config, b, p + max_new_tokens, dtype_name)
    # the fused steps' options (compiler_options.step_options): on the GPU the token and depth
    # while_loops become CUDA-graph conditional nodes instead of a host round trip per loop. JAX
    # takes compiler options only at the top-level jit: under a caller's trace the caller's options
    # hold (and theirs decide whether the loops wait for the host).
    options = xla_options() if _top_level() else {}
    return _jitted(tuple(sorted(options.items())))(
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
        kernel=kernel,
    )
