"""Fused decode steps compiled on a GPU (skipped without one): the same tokens and exit depths as
the loop-by-loop engine, with the Pallas kernels and bfloat16 weights (ouro-small)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax import LLM, SamplingParams, get_preset
from weights.random_init import random_params

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Pallas kernels compiled)"),
]


@pytest.mark.parametrize("kv_layout,tokens", [("last_exited", 1), ("last_exited", 4), ("shared", 2)])
def test_fused_engine_equals_loop_by_loop_engine(kv_layout, tokens):
    cfg = get_preset("ouro-small")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), random_params(cfg, 0))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in (5, 40, 77)]
    sp = [
        SamplingParams(max_tokens=11, ignore_eos=True, exit_mode="fixed"),
        SamplingParams(max_tokens=9, ignore_eos=True, exit_mode="fixed", temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(max_tokens=10, ignore_eos=True, exit_mode="fixed"),
    ]
    got = {}
    for fused in (0, 4):
        llm = LLM(
            cfg,
            params=params,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            prefill_chunk_size=32,
            max_model_len=256,
            buckets=[8, 64],
            kv_layout=kv_layout,
            kv_cache_bytes=1 << 30,
            fused_decode_max_rows=fused,
            fused_decode_tokens=tokens,
            progress=False,
        )
        got[fused] = [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, sp, use_tqdm=False)]
        st = llm.stats()
        assert st["compilations"] == len(llm.executable_keys())
        assert (st["fused_launches"] > 0) == bool(fused)
    assert got[0] == got[4]
