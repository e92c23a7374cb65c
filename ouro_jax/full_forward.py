"""``forward``: the full (dense, uncached) model over a batch of sequences, every loop, with the exit rules."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from weights.config import OuroConfig

from . import exit_rule
from .attention import DenseCausalAttention
from .model import OuroModel

__all__ = ["forward", "ForwardResult", "exit_distribution"]


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
    if exit_at_step is not None:  # fixed depth: exit_at_step + 1 loops
        loop = exit_rule.exit_loops(gs, 1.0, 1, exit_at_step + 1, "fixed") - 1
    else:
        loop = exit_rule.exit_loops(gs, exit_threshold, 1, config.num_loops, "ouro") - 1
    h_sel = jnp.take_along_axis(hs, loop[None, ..., None], axis=0)[0]
    logits = model.apply({"params": params}, h_sel, method=OuroModel.coda)
    return ForwardResult(hs, gs, probs, loop, logits)


def forward(
    params, config: OuroConfig, token_ids, *, exit_at_step: int | None = None, exit_threshold: float | None = None
) -> ForwardResult:
    """Run every loop over ``token_ids [B, S]`` and select each token's logits.

    ``exit_at_step=k``: loop ``k`` (fixed depth ``k + 1``); ``exit_threshold=q``: the engine's
    ``ouro`` rule (``exit_rule``, ``min_loops=1``). Default (both ``None``, or ``q = 1.0``): the last
    loop, i.e. fixed full depth (the reference's bfloat16 arithmetic can exit earlier; we do not
    copy that).
    """
    token_ids = jnp.asarray(token_ids, jnp.int32)
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids must be [batch, seq], got shape {token_ids.shape}")
    if exit_at_step is not None and exit_threshold is not None:
        raise ValueError("give exit_at_step or exit_threshold, not both")
    if exit_at_step is not None and not 0 <= exit_at_step < config.num_loops:
        raise ValueError(f"exit_at_step={exit_at_step} must lie in [0, {config.num_loops - 1}]")
    if exit_threshold is not None and not 0.0 <= float(exit_threshold) <= 1.0:
        raise ValueError(f"exit_threshold must lie in [0, 1], got {exit_threshold}")
    dtype_name = str(jax.tree.leaves(params)[0].dtype)
    thr = jnp.float32(1.0 if exit_threshold is None else exit_threshold)  # 1.0: fixed full depth
    return _forward(params, token_ids, thr, config=config, dtype_name=dtype_name, exit_at_step=exit_at_step)
