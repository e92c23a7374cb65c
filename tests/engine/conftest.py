"""Shared by the engine tests: a small scheduler config and the tiny preset's engine, built with
the shapes every engine here shares (so its buckets compile once per session)."""

import functools

import numpy as np

from scheduler import SchedulerConfig

T = 4


def config(num_blocks, mode="split", layout="last_exited", **kw):
    args = dict(
        num_loops=T,
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        prefill_chunk_size=4,
        max_model_len=64,
        kv_layout=layout,
        prefill_mode=mode,
    )
    args.update(kw)
    return SchedulerConfig(**args)


def tokens(objs):
    return {rid: (req.output_token_ids, req.exit_depths) for rid, (req, _) in objs.items()}


@functools.cache
def engine_parts():
    """The tiny preset's config, weights and prompts, built once (jax imported only here)."""
    import jax
    import jax.numpy as jnp

    from ouro_jax import get_preset
    from weights.random_init import random_params

    cfg = get_preset("tiny")
    params = jax.tree.map(jnp.asarray, random_params(cfg, 0))
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in (33, 17, 16, 9)]
    return cfg, params, prompts


def make_llm(**kw):
    from ouro_jax import LLM

    cfg, params, _ = engine_parts()
    args = dict(
        params=params,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_chunk_size=8,
        block_size=4,
        max_model_len=64,
        buckets=[8, 16, 64],
        # one 64-token request; the wavefront ring: every engine here has the same shapes (compiled once)
        num_blocks=4 * 17 + 1,
        num_ring_rows=1 + 4 * 8 * 4,
        progress=False,
    )
    args.update(kw)
    return LLM(cfg, **args)


@functools.cache
def tiny_fused_parts():
    """The tiny preset's config, device weights, float64 reference and three prompts (fused-step tests)."""
    import jax
    import jax.numpy as jnp

    from ouro_jax import get_preset
    from ouro_jax.reference import from_param_tree
    from weights.random_init import random_params

    cfg = get_preset("tiny")
    params = jax.tree.map(jnp.asarray, random_params(cfg, 0))
    ref = from_param_tree(cfg, random_params(cfg, 0))
    prompts = [list(map(int, np.random.default_rng(1).integers(1, cfg.vocab_size, n))) for n in (3, 9, 17)]
    return cfg, params, ref, prompts


def fused_engine(**kw):
    """The tiny engine of the fused-step tests (two buckets, 48-token requests)."""
    from ouro_jax import LLM

    cfg, params, _, _ = tiny_fused_parts()
    return LLM(
        cfg,
        params=params,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        prefill_chunk_size=8,
        block_size=4,
        max_model_len=48,
        buckets=[8, 32],
        progress=False,
        **kw,
    )
