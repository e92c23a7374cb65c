"""Fused decode steps compiled on a GPU (skipped without one): the same tokens and exit depths as
the loop-by-loop engine, with the Pallas kernels and bfloat16 weights (ouro-small); with exits
decided on the device (every exit rule in one batch), in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax import LLM, SamplingParams, get_preset
from ouro_jax.runner import is_fused
from weights.random_init import random_params

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Pallas kernels compiled)"),
]


def _engine(cfg, params, max_num_seqs, kv_layout, fused, tokens):
    """The engine both tests compare with fused steps on (``fused`` rows) and off (0)."""
    return LLM(
        cfg,
        params=params,
        max_num_seqs=max_num_seqs,
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


CASES = [("last_exited", 1), ("last_exited", 4), ("shared", 2)]


@pytest.mark.parametrize("kv_layout,tokens", CASES)
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
        llm = _engine(cfg, params, 4, kv_layout, fused, tokens)
        got[fused] = [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, sp, use_tqdm=False)]
        st = llm.stats()
        assert st["compilations"] == len(llm.executable_keys())
        assert (st["fused_launches"] > 0) == bool(fused)
    assert got[0] == got[4]


def _run(llm, prompts, sp):
    """Outputs under request ids 0.. (synthetic draws depend on the id)."""
    for i, (p, s) in enumerate(zip(prompts, sp)):
        llm.add_request(p, s, request_id=i)
    final = {}
    while len(final) < len(sp):
        final.update((o.request_id, o) for o in llm.step() if o.finished)
    return [(final[i].token_ids, final[i].exit_depths, final[i].finish_reason) for i in range(len(sp))]


@pytest.mark.parametrize("kv_layout,tokens", CASES)
def test_fused_early_exit_equals_loop_by_loop_float32(kv_layout, tokens):
    """Exits decided on the device (ouro at three thresholds, delayed, synthetic, fixed, min/max
    loops), float32: tokens, exit depths and finish reasons of the loop-by-loop engine."""
    cfg = get_preset("ouro-small")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), random_params(cfg, 0))
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in (5, 40, 77, 9, 23, 3, 60)]
    modes = [
        dict(exit_mode="ouro", exit_threshold=0.3),
        dict(exit_mode="ouro", exit_threshold=0.5, temperature=0.8, top_p=0.9),
        dict(exit_mode="ouro", exit_threshold=0.9),
        dict(exit_mode="delayed", exit_threshold=0.5),
        dict(exit_mode="synthetic", synthetic_mean_loops=2.5),
        dict(exit_mode="fixed"),
        dict(exit_mode="ouro", exit_threshold=0.5, min_loops=2, max_loops=3),
    ]
    sp = [SamplingParams(max_tokens=12, ignore_eos=True, seed=i, **m) for i, m in enumerate(modes)]
    got = {}
    for fused in (0, 8):
        llm = _engine(cfg, params, 8, kv_layout, fused, tokens)
        got[fused] = _run(llm, prompts, sp)
        if fused:  # one stream: only the loops its tokens need
            one = [SamplingParams(max_tokens=12, ignore_eos=True, exit_threshold=0.5)]
            before = llm.stats()["fused_loops"]
            got["one"] = _run(llm, prompts[:1], one)
            assert llm.stats()["fused_loops"] - before == sum(d + 1 for d in got["one"][0][1][1:])
        else:
            got["one_plain"] = _run(
                llm, prompts[:1], [SamplingParams(max_tokens=12, ignore_eos=True, exit_threshold=0.5)]
            )
        st = llm.stats()
        assert st["compilations"] == len(llm.executable_keys())
        assert (st["fused_launches"] > 0) == bool(fused)
    assert got[0] == got[8]
    assert got["one"] == got["one_plain"]


def test_fused_128_rows_samples_with_xla_sort():
    """A 128-row fused step samples with XLA's sort, not CUB's (a CUB sort keeps the sampling branch,
    and so the whole launch, off the CUDA graph: compiler_options.step_options), and its sampled
    tokens are those of the loop-by-loop engine, whose separate sampler does sort with CUB."""
    cfg = get_preset("ouro-small")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), random_params(cfg, 0))
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in rng.integers(3, 60, 12)]
    sp = [
        SamplingParams(max_tokens=8, ignore_eos=True, seed=i, temperature=0.9, top_p=0.8, top_k=(0, 50)[i % 2])
        for i in range(len(prompts))
    ]
    got = {}
    for fused in (0, 128):
        llm = LLM(
            cfg,
            params=params,
            max_num_seqs=128,
            max_num_batched_tokens=256,
            max_model_len=256,
            buckets=[8, 128, 256],
            kv_cache_bytes=1 << 30,
            fused_decode_max_rows=fused,
            progress=False,
        )
        got[fused] = _run(llm, prompts, sp)
        if fused:
            assert llm.stats()["fused_launches"] > 0
            keys = [k for k in llm.runner.executables() if is_fused(k) and k[0].R == 128]
            assert keys
            for k in keys:
                assert 'custom_call_target="xla.gpu.ext.cub_sort' not in llm.runner.executable(k).as_text()
    assert got[0] == got[128]


def test_generate_in_cuda_graphs_equals_generate_without():
    """``generate()`` at top level compiles its token and depth loops into CUDA-graph conditional
    nodes (the fused steps' options) and its sampler keeps XLA's sort; under a caller's ``jit`` it
    compiles with XLA's defaults. Both give the same sampled tokens and exit depths (gate rule,
    top-k and top-p sampling, a batch padded to 8 rows)."""
    from ouro_jax import generate, static_generate

    cfg = get_preset("ouro-small")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), random_params(cfg, 0))
    rng = np.random.default_rng(3)
    lengths = np.array([17, 5, 40, 33, 9], np.int32)
    ids = np.zeros((len(lengths), int(lengths.max())), np.int32)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(1, cfg.vocab_size, n)
    kw = dict(exit_threshold=0.5, temperature=0.9, top_k=40, top_p=0.8, rng=jax.random.PRNGKey(7))
    top = generate(params, cfg, ids, lengths, 12, **kw)
    nested = jax.jit(lambda p, x, n: generate(p, cfg, x, n, 12, **kw))(params, jnp.asarray(ids), jnp.asarray(lengths))
    np.testing.assert_array_equal(np.asarray(top.tokens), np.asarray(nested.tokens))
    np.testing.assert_array_equal(np.asarray(top.exit_depths), np.asarray(nested.exit_depths))
    # a caller's jit with generate()'s own options (as benchmarks.run's baseline compiles it)
    wrapped = jax.jit(lambda p, x, n: generate(p, cfg, x, n, 12, **kw), compiler_options=static_generate.xla_options())
    got = wrapped(params, jnp.asarray(ids), jnp.asarray(lengths))
    np.testing.assert_array_equal(np.asarray(top.tokens), np.asarray(got.tokens))
    np.testing.assert_array_equal(np.asarray(top.exit_depths), np.asarray(got.exit_depths))
