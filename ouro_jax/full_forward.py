"""``forward``: the full (dense, uncached) model over a batch of sequences, every loop, with the exit rules."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .attention import DenseCausalAttention
from .config import OuroConfig
from .model import OuroModel

__all__ = ["forward", "ForwardResult", "exit_distribution", "select_exit_loop"]


class ForwardResult(NamedTuple):
    hidden_states: jax.Array  # [T, B, S, D], after the final norm of each loop
    gate_logits: jax.Array  # [T, B, S] float32
    exit_probs: jax.Array  # [T, B, S] float32, sums to 1 over T
    exit_loop: jax.Array  # [B, S] int32, the loop whose hidden state gave `logits`
    logits: jax.Array  # [B, S, V]


def exit_distribution(gate_logits: jax.Array) -> jax.Array:
    """``p_t = sigmoid(g_t) * prod_{i<t} (1 - sigmoid(g_i))`` for ``t < T-1``; ``p_{T-1}`` = what is left."""
    lam = jax.nn.sigmoid(gate_logits.astype(jnp.float32))
    t = lam.shape[0]
    surv = jnp.cumprod(1.0 - lam, axis=0)
    before = jnp.concatenate([jnp.ones_like(surv[:1]), surv[:-1]], axis=0)
    p = lam * before
    return p.at[t - 1].set(before[t - 1])


def select_exit_loop(exit_probs, exit_at_step=None, exit_threshold=None):
    """Per token: ``exit_at_step`` if given; else the first loop whose cumulative exit probability
    reaches ``exit_threshold``; else (and by default) the last loop."""
    t = exit_probs.shape[0]
    shape = exit_probs.shape[1:]
    if exit_at_step is not None:
        if not 0 <= exit_at_step < t:
            raise ValueError(f"exit_at_step={exit_at_step} must lie in [0, {t - 1}]")
        return jnp.full(shape, exit_at_step, jnp.int32)
    if exit_threshold is None:
        return jnp.full(shape, t - 1, jnp.int32)
    reached = jnp.cumsum(exit_probs, axis=0) >= exit_threshold
    reached = reached.at[t - 1].set(True)
    return jnp.argmax(reached, axis=0).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "dtype_name", "exit_at_step"))
def _forward(params, token_ids, exit_threshold, *, config, dtype_name, exit_at_step):
    from .model import dtype_of

    model = OuroModel(config, dtype_of(dtype_name))
    b, s = token_ids.shape
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    attn = DenseCausalAttention(config.attn_scale)
    x = model.apply({"params": params}, token_ids, method=OuroModel.prelude)

    def one_loop(x, _):
        h, g, _ = model.apply({"params": params}, x, pos, attn, None, method=OuroModel.recurrent)
        return h, (h, g)

    _, (hs, gs) = jax.lax.scan(one_loop, x, None, length=config.num_loops)
    probs = exit_distribution(gs)
    loop = select_exit_loop(probs, exit_at_step, None if exit_at_step is not None else exit_threshold)
    h_sel = jnp.take_along_axis(hs, loop[None, ..., None], axis=0)[0]
    logits = model.apply({"params": params}, h_sel, method=OuroModel.coda)
    return ForwardResult(hs, gs, probs, loop, logits)


def forward(
    params, config: OuroConfig, token_ids, *, exit_at_step: int | None = None, exit_threshold: float | None = None
) -> ForwardResult:
    """Run every loop over ``token_ids [B, S]`` and select each token's logits.

    Default (both ``None``): the last loop, i.e. fixed full depth, which is what the reference's
    ``exit_threshold = 1.0`` means (its bfloat16 arithmetic can exit earlier; we do not copy that).
    """
    token_ids = jnp.asarray(token_ids, jnp.int32)
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids must be [batch, seq], got shape {token_ids.shape}")
    if exit_threshold is not None and not 0.0 <= float(exit_threshold) <= 1.0:
        raise ValueError(f"exit_threshold must lie in [0, 1], got {exit_threshold}")
    dtype_name = str(jax.tree.leaves(params)[0].dtype)
    thr = jnp.float32(2.0 if exit_threshold is None else exit_threshold)  # 2.0: never reached -> last loop
    return _forward(params, token_ids, thr, config=config, dtype_name=dtype_name, exit_at_step=exit_at_step)
