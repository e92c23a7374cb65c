"""The plain-JAX baselines of the decode and prefill benchmarks compute the model: at fixed depth in
float32 their tokens equal the engine's, so a speed comparison with them is a fair one."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.plain_jax import PlainDecoder, plain_prefill
from ouro_jax import LLM, SamplingParams, get_preset
from weights.random_init import random_params

CFG = get_preset("tiny")


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
