"""The fused norm + matvec decode kernels (``pallas_kernels/decode_matvec.py``) against their jnp
twins in interpret mode, and the engine's ``decode_matmul="fused"`` path (``ouro_jax/fused_layers.py``)
against the default one: same tokens and exit depths (float32)."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_matvec as dm

# (rows of the input, real rows, K, N): one real row of an 8-row bucket, a full 8-row bucket, a
# 16-row bucket with 11 real rows, K not a multiple of the default block (96 = 3 x 32), N = 16
SHAPES = [(8, 1, 64, 48), (8, 8, 128, 96), (16, 11, 96, 32), (8, 3, 512, 16)]


def _operands(rows_in, k, n, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(ks[0], (rows_in, k), jnp.float32) * 3.0
    u = jax.random.normal(ks[1], (rows_in, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(ks[2], (n, k), jnp.float32) / np.sqrt(k)).astype(dtype)
    w2 = (jax.random.normal(ks[3], (2 * n, k), jnp.float32) / np.sqrt(k)).astype(dtype)
    wn = (1 + 0.2 * jax.random.normal(ks[4], (k,))).astype(dtype)
    wu = (1 + 0.2 * jax.random.normal(ks[5], (k,))).astype(dtype)
    return x, u, w, w2, wn, wu


def _close(a, b, dtype):
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows_in,n_rows,k,n", SHAPES)
def test_kernels_match_their_twins(rows_in, n_rows, k, n, dtype):
    x, u, w, w2, wn, wu = _operands(rows_in, k, n, dtype)
    small = dm.MatvecTuning(block_n=16, block_k=32)  # several K steps and programs at test sizes
    nr = jnp.int32(n_rows)

    y = dm.matvec(u, w, nr, tuning=small, interpret=True)
    assert y.shape == (dm.MAX_ROWS, n) and y.dtype == dtype
    _close(y, dm.matvec_reference(u, w, nr), dtype)

    y, xo = dm.norm_matvec(x, w, nr, norm_weight=wn, eps=1e-6, branch=u, branch_weight=wu, tuning=small, interpret=True)
    yr, xr = dm.norm_matvec_reference(x, w, nr, norm_weight=wn, eps=1e-6, branch=u, branch_weight=wu)
    _close(y, yr, dtype)
    np.testing.assert_allclose(xo, xr, atol=1e-5, rtol=1e-5)
    assert xo.shape == (dm.MAX_ROWS, k) and xo.dtype == jnp.float32

    y = dm.matvec(u, w2, nr, swiglu=True, tuning=small, interpret=True)
    _close(y, dm.matvec_reference(u, w2, nr, swiglu=True), dtype)

    y = dm.norm_matvec(x, w2, nr, norm_weight=wn, eps=1e-6, swiglu=True, tuning=small, interpret=True)
    _close(y, dm.norm_matvec_reference(x, w2, nr, norm_weight=wn, eps=1e-6, swiglu=True), dtype)
    # rows at or past n_rows are never read: garbage there changes nothing, and they come out zero
    junk = x.at[n_rows:].set(jnp.nan)
    y2 = dm.norm_matvec(junk, w2, nr, norm_weight=wn, eps=1e-6, swiglu=True, tuning=small, interpret=True)
    np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(y, np.float32))
    assert not np.asarray(y2, np.float32)[n_rows:].any()


def test_twins_are_the_model_arithmetic():
    """The twins against plain model code: ``RMSNorm`` then ``x @ w`` (the layer's own order)."""
    from ouro_jax.model import RMSNorm

    x, u, w, w2, wn, wu = _operands(8, 64, 32, jnp.float32)
    norm = RMSNorm(1e-6, jnp.float32)
    x1 = x + norm.apply({"params": {"scale": wu}}, u, jnp.float32)
    expect = norm.apply({"params": {"scale": wn}}, x1) @ w.T
    y, xr = dm.norm_matvec_reference(x, w, 8, norm_weight=wn, eps=1e-6, branch=u, branch_weight=wu)
    np.testing.assert_allclose(xr[:8], x1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y[:8], expect, rtol=1e-5, atol=1e-5)
    gu = norm.apply({"params": {"scale": wn}}, x) @ w2.T
    expect = jax.nn.silu(gu[:, :32]) * gu[:, 32:]
    np.testing.assert_allclose(
        dm.norm_matvec_reference(x, w2, 8, norm_weight=wn, eps=1e-6, swiglu=True)[:8], expect, rtol=1e-5, atol=1e-5
    )


def test_tuning_fits_the_shapes_and_shared_memory(monkeypatch):
    t = dm.tuning_for(2048, 6144, dm.MatvecTuning(32, 512, 4, 8))
    assert (t.block_n, t.block_k) == (32, 512)
    # a step: 16 x 512 inputs + 32 x 512 weights, bf16 = 48 KB: 4 stages fit SMEM_BUDGET
    assert t.num_stages == dm.SMEM_BUDGET // ((16 + 32) * 512 * 2)
    # the float32 residual and the branch loaded a step, swiglu's two weight tiles: fewer stages
    t2 = dm.tuning_for(2048, 5632, dm.MatvecTuning(16, 512, 4, 8), halves=2, norm=True)
    assert t2.num_stages == dm.SMEM_BUDGET // (16 * 512 * 6 + 2 * 16 * 512 * 2) < t.num_stages
    assert dm.tuning_for(96, 48, dm.MatvecTuning(64, 512, 4, 4)) == dm.MatvecTuning(16, 32, 4, 4)
    assert dm.tuning_for(5632, 2048).block_k == 256  # 22 steps of the default 256
    monkeypatch.setenv(dm.TUNING_ENV, "32,256,8,3")
    assert dm.default_tuning() == dm.MatvecTuning(32, 256, 8, 3)
    monkeypatch.setenv(dm.TUNING_ENV, "32,x")
    with pytest.raises(ValueError, match=dm.TUNING_ENV):
        dm.default_tuning()


def test_bad_shapes_are_refused():
    x, u, w, w2, wn, wu = _operands(8, 64, 48, jnp.float32)
    assert dm.supported(17, 64, 48) and dm.supported(8, 60, 48) and dm.supported(8, 64, 40)
    assert dm.supported(16, 2048, 6144) is None
    with pytest.raises(ValueError, match="rows"):
        dm.matvec(jnp.zeros((32, 64)), w, 1, interpret=True)
    with pytest.raises(ValueError, match="multiples of 16"):
        dm.matvec(jnp.zeros((8, 60)), jnp.zeros((48, 60)), 1, interpret=True)
    with pytest.raises(ValueError, match="w_t"):
        dm.norm_matvec(x, jnp.zeros((49, 64)), 1, norm_weight=wn, eps=1e-6, swiglu=True, interpret=True)  # not [2N, K]
    with pytest.raises(ValueError, match="does not cover"):
        dm.norm_matvec(x, w, 1, norm_weight=wn, eps=1e-6, branch=u[:4], branch_weight=wu, interpret=True)
    with pytest.raises(ValueError, match="together"):
        dm.norm_matvec(x, w, 1, norm_weight=wn, eps=1e-6, branch=u, interpret=True)


# ----------------------------------------------------------------------------------------------
# The engine path (CPU, interpret mode)
# ----------------------------------------------------------------------------------------------


def _engine_run(cfg, params, prompts, sampling, **kw):
    from ouro_jax import LLM

    llm = LLM(
        cfg,
        params=params,
        kv_cache_bytes=1 << 22,  # a GPU run keeps earlier engines' pools: size this one
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_chunk_size=8,
        block_size=4,
        max_model_len=64,
        buckets=[8, 16, 64],
        progress=False,
        executable_store=False,
        **kw,
    )
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    return [(o.token_ids, o.exit_depths) for o in outs], llm


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_engine_fused_layers_same_tokens_and_depths(preset, monkeypatch):
    """``decode_matmul="fused"`` (small buckets through the fused kernels, interpret mode on the
    CPU) gives the default path's tokens and exit depths, with the model's exit rule, fused decode
    steps and a prefill that spans small and large buckets (float32)."""
    from ouro_jax import SamplingParams, fused_layers, get_preset
    from weights.random_init import random_params

    cfg = get_preset(preset)
    params = jax.tree.map(jnp.asarray, random_params(cfg, 0))
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in (3, 17, 9)]
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.5)
    calls = []
    real = fused_layers.run_fused_layers

    def spy(*a, **k):
        calls.append(a[2].shape)
        return real(*a, **k)

    from ouro_jax import step_program as program

    monkeypatch.setattr(program, "run_fused_layers", spy)
    base, _ = _engine_run(cfg, params, prompts, sampling)
    assert not calls
    assert len({d for _, depths in base for d in depths}) > 1  # the exit rule picked several depths
    got, llm = _engine_run(cfg, params, prompts, sampling, decode_matmul="fused")
    assert got == base
    assert calls and {s[0] for s in calls} <= {8, 16}
    assert "decode" in llm.runner.params
    # the norms inside the kernels (norm_matvec) instead of XLA fusions: the same again
    calls.clear()
    described = llm.runner._program_description()  # the store's key reads the option when asked
    monkeypatch.setenv(fused_layers.NORMS_ENV, "kernel")
    got, llm2 = _engine_run(cfg, params, prompts, sampling, decode_matmul="fused")
    assert got == base and calls
    assert llm2.runner._program_description() != described


def test_fused_layers_option_checked():
    from ouro_jax import fused_layers, get_preset
    from ouro_jax.fused_layers import fused_layers_supported
    from ouro_jax.runner import check_decode_matmul

    assert check_decode_matmul("fused") == "fused"
    with pytest.raises(ValueError, match="unrolled"):
        check_decode_matmul("fused", "scan")
    assert fused_layers_supported(get_preset("ouro-1.4b"), 8) is None
    assert fused_layers_supported(get_preset("ouro-1.4b"), 32)
    odd = dataclasses.replace(get_preset("tiny"), intermediate_size=88)
    with pytest.raises(ValueError, match=fused_layers.NORMS_ENV):
        os.environ[fused_layers.NORMS_ENV] = "triton"
        try:
            fused_layers.norms_option()
        finally:
            del os.environ[fused_layers.NORMS_ENV]
    assert "multiples of 16" in fused_layers_supported(odd, 8)


def test_kv_pool_budget_counts_the_transposed_copies(monkeypatch):
    """On a device with a memory limit, ``decode_matmul="fused"`` leaves the transposed layer
    copies out of the KV budget: exactly the layers' bytes fewer for the pool."""
    from ouro_jax import LLM, get_preset
    from ouro_jax import llm as llm_mod
    from weights.random_init import random_params

    # 16 MiB over the 2 GiB kept for activations: a small pool
    monkeypatch.setattr(llm_mod, "device_memory", lambda device=None: ((2 << 30) + (16 << 20), 0))
    cfg = get_preset("tiny")
    params = jax.tree.map(jnp.asarray, random_params(cfg, 0))
    layer_bytes = sum(
        x.size * x.dtype.itemsize for k, v in params.items() if k.startswith("layers_") for x in jax.tree.leaves(v)
    )
    kw = dict(
        params=params,
        max_num_seqs=2,
        max_model_len=64,
        block_size=4,
        gpu_memory_utilization=1.0,
        progress=False,
        executable_store=False,
        warmup=False,  # sizing only: nothing runs
    )
    plain = LLM(cfg, **kw)
    fused = LLM(cfg, decode_matmul="fused", **kw)
    block_bytes = cfg.kv_bytes_per_token_plane(4) * 4
    assert layer_bytes > 0
    assert plain.runner.num_blocks - fused.runner.num_blocks == pytest.approx(layer_bytes / block_bytes, abs=1)
