"""Token sampling on the device: greedy, temperature, top-k, top-p, one key per row.

Every row carries its own parameters so that one coda call serves requests with different
sampling settings. The key of a row is derived from the request's seed and the index of the token
being sampled, never from the batch it happens to be in, so sampled tokens do not depend on
scheduling (chunk size, bucket, batch composition).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scheduler.sampling_params import MAX_LOGPROBS

__all__ = ["greedy", "sample", "sample_stochastic", "row_keys", "token_logprobs"]


def row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """``fold_in(PRNGKey(seed), step)`` per row -> ``[R, 2]`` raw uint32 keys."""

    def one(seed, step):
        return jax.random.fold_in(jax.random.PRNGKey(seed), step)

    return jax.vmap(one)(seeds.astype(jnp.uint32), steps.astype(jnp.uint32))


def _filtered_logits(logits, temperature, top_k, top_p):
    """Scale by temperature and mask everything outside top-k / top-p (per row)."""
    v = logits.shape[-1]
    x = logits / jnp.maximum(temperature, 1e-6)[:, None]
    srt = jnp.sort(x, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(srt, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    keep_sorted = (cum - probs) < top_p[:, None]
    n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)
    thresh = jnp.maximum(kth, pth)
    return jnp.where(x >= thresh, x, -jnp.inf)


def greedy(logits) -> jax.Array:
    """Token ids ``[R]`` int32 of the largest logits (what a temperature-0 row gets)."""
    return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)


def sample_stochastic(logits, temperature, top_k, top_p, keys):
    """``sample`` with the sort over the vocabulary always paid: for programs that only run when
    some row samples (the runner's separate sampler)."""
    logits = logits.astype(jnp.float32)
    masked = _filtered_logits(logits, temperature, top_k, top_p)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, masked).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy(logits))


def sample(logits, temperature, top_k, top_p, keys):
    """``logits [R, V]`` (any float), per-row ``temperature [R]``, ``top_k [R]`` (0 = off),
    ``top_p [R]``, ``keys [R, 2]`` -> token ids ``[R]`` int32. Rows with temperature 0 are greedy.

    The sort over the vocabulary is only paid for when some row really samples, through a
    ``lax.cond``; on the GPU its predicate may be read by the host (a wait for the device), so
    the engine's one-loop steps decide on the host instead (``ModelRunner``)."""
    return jax.lax.cond(
        jnp.any(temperature > 0),
        lambda _: sample_stochastic(logits, temperature, top_k, top_p, keys),
        lambda _: greedy(logits),
        None,
    )


def token_logprobs(logits, tokens) -> jax.Array:
    """The logprob records of ``tokens [R]`` under raw ``logits [R, V]`` (before temperature and
    masks): ``[R, LOGPROB_WORDS]`` int32, the token's logprob, the top ``MAX_LOGPROBS`` logprobs
    (float32 bits) and their ids (``scheduler.sampling_params.read_logprobs`` reads them). Top-k
    on the device: only ``R x LOGPROB_WORDS`` words come back to the host, never the vocabulary."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens.astype(jnp.int32)[:, None], axis=-1)
    top, ids = jax.lax.top_k(logp, MAX_LOGPROBS)
    bits = jax.lax.bitcast_convert_type(jnp.concatenate([chosen, top], axis=-1), jnp.int32)
    return jnp.concatenate([bits, ids.astype(jnp.int32)], axis=-1)
