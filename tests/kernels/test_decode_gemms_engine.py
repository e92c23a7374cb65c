"""The engine's small buckets on the Mosaic decode GEMMs (``paged_attention.decode_gemms``).

Where they apply (Hopper, 16-bit floats, buckets of up to 16 rows, a Pallas attention), a layer's
Q/K/V and O projections and its MLP run on ``decode_gemm_mgpu`` / ``decode_mlp_mgpu`` and hand
their float32 split-K partials to ``rope_write_kv`` and ``residual_norm``, which sum them. On the
CPU: the rule, and the engine (bf16, Pallas' GPU interpreter with wgmma stood in for, the Triton
kernels interpreted) with them against the engine on XLA's GEMMs: the same tokens at fixed depth
up to near ties, and the kernels really called in the 8-row bucket only. On a Hopper GPU the same
comparison compiled is ``tests/engine/test_gpu_engine.py``'s.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax import paged_attention as pa
from pallas_kernels import dispatch
from pallas_kernels.dispatch import AttentionKernel
from tests.engine.bf16 import bf16_agree
from weights.config import get_preset

# tiny-gqa widened to shapes the kernels take (multiples of 64) with K of two 128-deep steps, so that
# every projection hands over two split-K partials: Q/K/V 256 -> 384, O 256 -> 256, MLP 256 x 256
CONFIG = dataclasses.replace(
    get_preset("tiny-gqa"), hidden_size=256, intermediate_size=256, num_attention_heads=8, head_dim=32
)


def _kernel(name="triton", rows=8):
    return AttentionKernel(name, rows, CONFIG.num_attention_heads, CONFIG.num_key_value_heads, CONFIG.head_dim)


def test_rule(monkeypatch):
    """On Hopper only; 16-bit floats; up to 16 rows; shapes the kernels take; a Pallas attention."""
    monkeypatch.setattr(dispatch, "hopper_available", lambda: False)
    assert not pa.decode_gemms(_kernel(), 8, jnp.bfloat16, CONFIG)
    monkeypatch.setattr(dispatch, "hopper_available", lambda: True)
    assert pa.decode_gemms(_kernel(), 8, jnp.bfloat16, CONFIG)
    assert pa.decode_gemms(_kernel("hybrid", 16), 16, jnp.float16, CONFIG)
    assert not pa.decode_gemms(_kernel(rows=32), 32, jnp.bfloat16, CONFIG)  # past MAX_ROWS
    assert not pa.decode_gemms(_kernel(), 8, jnp.float32, CONFIG)
    assert not pa.decode_gemms(_kernel("reference"), 8, jnp.bfloat16, CONFIG)
    assert not pa.decode_gemms(_kernel(), 8, jnp.bfloat16, get_preset("tiny-gqa"))  # MLP 80 wide


def test_config_gives_every_projection_two_splits():
    from pallas_kernels.decode_gemm_mgpu import gemm_tuning
    from pallas_kernels.decode_mlp_mgpu import mlp_tuning

    c = CONFIG
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    assert gemm_tuning(c.hidden_size, qkv).splits == gemm_tuning(c.q_size, c.hidden_size).splits == 2
    assert mlp_tuning(c.hidden_size, c.intermediate_size).down.splits == 2


def test_one_loop_with_and_without_decode_gemms(mosaic_interpret):
    """One loop of the stack over 8 decode rows with context in the pool (bf16): with the decode
    GEMMs (every projection's two partials summed in ``rope_write_kv`` and ``residual_norm``) the
    rows' hidden states, gates and written K/V are XLA's GEMMs' up to bf16 rounding."""
    from ouro_jax.model import OuroModel
    from ouro_jax.paged_attention import PagedAttention
    from ouro_jax.static_generate import fuse_params
    from weights.random_init import random_params

    del mosaic_interpret
    c, R, bs, m = CONFIG, 8, 4, 4  # rows; pages of 4 slots, 4 pages a row
    rng = np.random.default_rng(0)
    bf16 = jnp.bfloat16
    params = fuse_params(jax.tree.map(lambda x: jnp.asarray(x, bf16), random_params(c, 0)), c)
    pool_shape = (c.num_hidden_layers, c.num_key_value_heads, R * m, bs, c.head_dim)
    pools = tuple(jnp.asarray(rng.standard_normal(pool_shape), bf16) for _ in range(2))
    ctx = np.arange(R) + 5  # row r attends to 5 + r tokens, the last its own
    seg = (
        jnp.arange(R, dtype=jnp.int32),
        jnp.ones(R, jnp.int32),
        jnp.asarray(ctx, jnp.int32),
        jnp.asarray(np.arange(R * m).reshape(R, m), jnp.int32),
    )
    slots = jnp.asarray(np.arange(R) * m * bs + ctx - 1, jnp.int32)
    x = jnp.asarray(rng.standard_normal((R, c.hidden_size)), jnp.float32)
    kernel = AttentionKernel("triton", R, c.num_attention_heads, c.num_key_value_heads, c.head_dim, interpret=True)
    model = OuroModel(c, bf16, fused_projections=True)
    out = {}
    for gemms in (False, True):
        attn = PagedAttention(slots, *seg, c.attn_scale, kernel, kernel.plan(*seg), True, True, gemms)
        out[gemms] = model.apply({"params": params}, x, jnp.asarray(ctx - 1), attn, pools, method=OuroModel.recurrent)
    (h0, g0, (k0, v0)), (h1, g1, (k1, v1)) = out[False], out[True]
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(h1), f32(h0), rtol=0.05, atol=0.05)
    np.testing.assert_allclose(f32(g1), f32(g0), rtol=0.05, atol=0.05)
    for new, old, pool in ((k1, k0, pools[0]), (v1, v0, pools[1])):
        written = np.arange(R) * m * bs + ctx - 1  # flat slots of the rows
        flat = lambda p: f32(p).reshape(c.num_hidden_layers, c.num_key_value_heads, -1, c.head_dim)  # noqa: E731
        np.testing.assert_allclose(flat(new)[:, :, written], flat(old)[:, :, written], rtol=0.05, atol=0.05)
        untouched = np.setdiff1d(np.arange(R * m * bs), written)
        np.testing.assert_array_equal(flat(new)[:, :, untouched], flat(pool)[:, :, untouched])
    assert np.abs(f32(h1) - f32(h0)).max() > 0  # the two paths did round differently


@pytest.mark.slow  # ~1-2 min on a CPU: the engine's buckets compiled twice, Mosaic kernels interpreted
def test_engine_tokens_with_and_without_decode_gemms(monkeypatch, mosaic_interpret):
    from ouro_jax import LLM, SamplingParams, step_program
    from ouro_jax import model as model_mod
    from ouro_jax import runner as runner_mod
    from weights.random_init import random_params

    del mosaic_interpret  # its patches of plgpu are what this test needs
    real_init = runner_mod.ModelRunner.__init__
    monkeypatch.setattr(
        runner_mod.ModelRunner, "__init__", lambda self, *a, **k: real_init(self, *a, **{**k, "interpret": True})
    )
    calls = []
    for name in ("decode_gemm_mgpu", "decode_mlp_mgpu"):
        real = getattr(model_mod, name)
        monkeypatch.setattr(
            model_mod, name, lambda *a, _real=real, _name=name, **k: calls.append((_name, a[0].shape)) or _real(*a, **k)
        )
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), random_params(CONFIG, 0))
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(1, CONFIG.vocab_size, n))) for n in (3, 21, 9)]
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=1.0, logprobs=2)

    def run():
        llm = LLM(
            CONFIG,
            params=params,
            dtype="bfloat16",
            attention="triton",
            kv_cache_bytes=1 << 22,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            prefill_chunk_size=8,
            block_size=4,
            max_model_len=64,
            buckets=[8, 32],
            fused_decode_max_rows=4,
            progress=False,
            executable_store=False,
        )
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        return [(o.token_ids, o.exit_depths, o.logprobs) for o in outs]

    monkeypatch.setattr(dispatch, "hopper_available", lambda: True)
    with monkeypatch.context() as m:
        m.setattr(step_program, "decode_gemms", lambda *a: False)
        without = run()
    assert not calls, "the XLA-GEMM run called the Mosaic kernels"
    with_gemms = run()
    bf16_agree(with_gemms, without, "decode GEMMs vs XLA's")
    # traced per layer of the 8-row bucket's programs only (one-loop steps, fused steps)
    assert {n for n, _ in calls} == {"decode_gemm_mgpu", "decode_mlp_mgpu"}
    assert {s[0] for _, s in calls} == {8}
