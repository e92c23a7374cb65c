"""The plain-JAX baselines of the decode and prefill benchmarks compute the model: at fixed depth in
float32 their tokens equal the engine's, so a speed comparison with them is a fair one; and their
timing helpers restart, size and free the decoder's caches as they say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.plain_jax import PlainDecoder, plain_prefill, profile_decode, time_decode, time_prefill
from ouro_jax import LLM, SamplingParams, get_preset
from weights.random_init import random_params

CFG = get_preset("tiny")


@pytest.mark.slow
def test_plain_decoder_and_prefill_give_the_engines_tokens():
    params = random_params(CFG, 0)
    prompts = np.random.default_rng(3).integers(5, CFG.vocab_size, (2, 11))
    with LLM(CFG, params=params, max_num_seqs=2, max_model_len=64, progress=False) as llm:
        outs = llm.generate(list(prompts), SamplingParams(max_tokens=6, ignore_eos=True, exit_mode="fixed"))
    want = np.array([o.token_ids for o in outs])
    dev = jax.tree.map(jnp.asarray, params)
    dec = PlainDecoder(CFG, dev, batch=2, max_len=32, dtype="float32")
    got = [np.asarray(dec.prefill(prompts))] + [np.asarray(dec.step()) for _ in range(5)]
    np.testing.assert_array_equal(np.stack(got, 1), want)
    first, kvs = plain_prefill(dev, jnp.asarray(prompts), config=CFG, dtype_name="float32", cudnn=False)
    np.testing.assert_array_equal(np.asarray(first), want[:, 0])
    shape = (CFG.num_hidden_layers, 2, 11, CFG.num_key_value_heads, CFG.head_dim)
    assert len(kvs) == CFG.num_loops and kvs[0][0].shape == shape


def test_resumed_decoder_repeats_its_steps_and_time_decode_frees_its_caches():
    """``time_decode``'s rounds restart at one position: the same steps from the same tokens give
    the same tokens whatever the caches held before (the positions after are masked, then rewritten)."""
    dev = jax.tree.map(jnp.asarray, random_params(CFG, 0))
    dec = PlainDecoder(CFG, dev, batch=2, max_len=16, dtype="float32")
    assert PlainDecoder.cache_bytes(CFG, 2, 16, "float32") == sum(x.nbytes for x in jax.tree.leaves(dec.caches))
    runs = []
    for _ in range(2):
        dec.resume(9, [7, 8])
        runs.append([np.asarray(dec.step()) for _ in range(4)])
    np.testing.assert_array_equal(runs[0], runs[1])
    dec.free()
    assert dec.caches == [] and dec.last is None
    t = time_decode(CFG, dev, batch=2, context=9, tokens=3, dtype="float32", rounds=2)
    assert t["max_len"] == 12 and len(t["round_ms"]) == 2 and t["tpot_ms"] == min(t["round_ms"]) > 0
    assert all(0 < d <= r for d, r in zip(t["dispatch_ms"], t["round_ms"]))
    assert t["cache_bytes"] == PlainDecoder.cache_bytes(CFG, 2, 12, "float32")
    p = time_prefill(CFG, dev, np.ones((2, 5), np.int32), dtype="float32", rounds=2)
    assert (p["batch"], p["length"]) == (2, 5) and p["wall_s"] == min(p["seconds_all"])
    assert p["tok_s"] == pytest.approx(10 / p["wall_s"])


def test_profile_decode_counts_kernels_and_busy_time_per_token():
    """On a CPU the host plane's XLA thunks stand in for kernels: the plumbing, not the figures."""
    dev = jax.tree.map(jnp.asarray, random_params(CFG, 0))
    p = profile_decode(CFG, dev, batch=2, context=5, steps=3, dtype="float32")
    assert p["kernels_per_token"] > 0 and 0 < p["busy_ms_per_token"] <= p["span_ms_per_token"]
    assert p["traced_wall_ms_per_token"] > 0 and (p["batch"], p["steps"]) == (2, 3)
