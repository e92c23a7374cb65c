"""The engine compiled on a GPU with the Pallas kernel (skipped without a GPU).

On the GPU the runner's attention is the Pallas ragged paged kernel; these tests check that it gives
the same tokens and exit depths as the jnp reference attention and as the dense ``generate()``.
"""

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


@pytest.fixture(scope="module")
def model():
    cfg = get_preset("ouro-small")
    return cfg, jax.tree.map(jnp.asarray, random_params(cfg, 0))


def _diff(a, b):
    """Where two lists of (tokens, depths) first differ, for the failure message."""
    out = []
    for i, ((ta, da), (tb, db)) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(zip(ta, da), zip(tb, db))):
            if x != y:
                out.append(f"prompt {i} token {j}: {x} vs {y}")
                break
    return "; ".join(out)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_probe(model, seed):
    """bf16, where the Mosaic GPU kernel applies: the engine forced onto it (every bucket, decode
    rows included) or onto the per-segment split ("hybrid": segments of >= 128 rows on Mosaic,
    the rest on Triton) gives the tokens and exit depths of the engine on the Triton kernel, and
    the automatic choice ("pallas") gives them too. Chunks of up to 192 rows put long segments in
    play next to short ones in one invocation: a fresh 129-row prompt (two tiles, the second of
    one row) with 64-, 56- and 7-row prompts, then a 136-row chunk after 56 rows of history."""
    from pallas_kernels.dispatch import hopper_available

    if not hopper_available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    cfg, params = model
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in (300, 129, 64, 7)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.6)
    got = {}
    for attention in ("triton", "mgpu"):
        llm = LLM(
            cfg,
            params=params,
            dtype="bfloat16",
            max_num_seqs=4,
            max_num_batched_tokens=256,
            prefill_chunk_size=192,
            max_model_len=512,
            buckets=[8, 32, 256],
            attention=attention,
            kv_cache_bytes=1 << 30,
            progress=False,
        )
        got[attention] = [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got["mgpu"] == got["triton"], "mgpu vs triton kernel: " + _diff(got["mgpu"], got["triton"])
