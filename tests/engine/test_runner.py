"""The runner on hand-built descriptors (no scheduler): one loop per invocation over the paged
pool must reproduce the dense forward, loop by loop, and padding must change nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax import forward, get_preset
from ouro_jax.runner import ModelRunner
from ouro_jax.sampling import row_keys, sample
from scheduler.buckets import BucketKey
from scheduler.descriptor import BatchDescriptor, StepResult
from scheduler.fake_runner import FakeRunner
from weights.random_init import random_params

BS, NB = 4, 24


def _desc(key: BucketKey, rows, segs, prelude=(), coda=(), fin=()):
    """rows: (ring, pos, slot); segs: (q_start, q_len, ctx_len, table); prelude: (ring, token);
    coda: (row, temperature, top_k, top_p, seed, step); fin: (src, dst). Everything else padding."""
    d = BatchDescriptor(key)
    for i, (ring, pos, slot) in enumerate(rows):
        d.row_ring[i], d.row_pos[i], d.row_slot[i] = ring, pos, slot
    for i, (qs, ql, cl, table) in enumerate(segs):
        d.seg_q_start[i], d.seg_q_len[i], d.seg_ctx_len[i] = qs, ql, cl
        d.seg_block_table[i, : len(table)] = table
    for i, (ring, tok) in enumerate(prelude):
        d.pre_ring[i], d.pre_token[i] = ring, tok
    for i, (row, temp, k, p, seed, step) in enumerate(coda):
        d.coda_row[i], d.coda_temperature[i], d.coda_top_k[i], d.coda_top_p[i] = row, temp, k, p
        d.coda_seed[i], d.coda_step[i] = seed, step
    for i, (s, t) in enumerate(fin):
        d.fin_src[i], d.fin_dst[i] = s, t
    return d


def _slot(table, pos):
    return table[pos // BS] * BS + pos % BS


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_runner_reproduces_dense_forward(preset):
    cfg = get_preset(preset)
    T = cfg.num_loops
    params = jax.tree.map(jnp.asarray, random_params(cfg, 0))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 7)
    full = forward(params, cfg, ids[None])
    runner = ModelRunner(cfg, params, num_blocks=NB, block_size=BS, num_ring_rows=16)
    key = BucketKey(R=8, S=8, C=8, F=24, MB=3)
    runner.warmup([key], progress=False)
    tables = [[1 + 3 * d, 2 + 3 * d, 3 + 3 * d] for d in range(T)]  # one block table per plane
    n = 5
    # prompt: 5 tokens, one invocation per depth (split style), ring rows 1..5
    for d in range(T):
        rows = [(1 + i, i, _slot(tables[d], i)) for i in range(n)]
        prelude = [(1 + i, ids[i]) for i in range(n)] if d == 0 else ()
        coda = [(n - 1, 0.0, 0, 1.0, 0, 0)] if d == T - 1 else ()
        h = runner.step(_desc(key, rows, [(0, n, n, tables[d])], prelude, coda))
        np.testing.assert_allclose(h.gates()[:n], full.gate_logits[d, 0, :n], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(runner.ring[1 : 1 + n], full.hidden_states[d, 0, :n], rtol=2e-5, atol=2e-5)
    assert runner.compilations == 1
    # decode two positions, each a 1-row segment per depth, with padding rows around it
    for pos in (5, 6):
        for d in range(T):
            rows = [(0, 0, -1), (9, pos, _slot(tables[d], pos))]
            prelude = [(9, ids[pos])] if d == 0 else ()
            h = runner.step(_desc(key, rows, [(0, 0, 0, []), (1, 1, pos + 1, tables[d])], prelude))
            np.testing.assert_allclose(h.gates()[1], full.gate_logits[d, 0, pos], rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(runner.ring[9], full.hidden_states[d, 0, pos], rtol=2e-5, atol=2e-5)
    assert runner.compilations == 1  # warmed up: nothing compiled during the run


def test_runner_coda_and_finalize():
    cfg = get_preset("tiny")
    T = cfg.num_loops
    params = jax.tree.map(jnp.asarray, random_params(cfg, 1))
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 4)
    runner = ModelRunner(cfg, params, num_blocks=NB, block_size=BS, num_ring_rows=8)
    key = BucketKey(R=8, S=8, C=8, F=24, MB=2)
    tables = [[1 + 2 * d, 2 + 2 * d] for d in range(T)]
    for d in range(T):
        rows = [(1 + i, i, _slot(tables[d], i)) for i in range(4)]
        coda = [(3, 0.0, 0, 1.0, 0, 0), (3, 1.0, 5, 0.9, 7, 0)] if d == T - 1 else ()
        h = runner.step(
            _desc(key, rows, [(0, 4, 4, tables[d])], [(1 + i, ids[i]) for i in range(4)] if d == 0 else (), coda)
        )
    full = forward(params, cfg, ids[None])
    assert int(h.tokens()[0]) == int(np.argmax(full.logits[0, 3]))
    # the sampled row went through the separate sampler: what `sample` draws from the same logits
    logits = jnp.stack([full.logits[0, 3]] * 2)
    keys = row_keys(jnp.array([0, 7], jnp.uint32), jnp.array([0, 0], jnp.int32))
    want = sample(logits, jnp.array([0.0, 1.0]), jnp.array([0, 5]), jnp.array([1.0, 0.9]), keys)
    assert [int(t) for t in h.tokens()[:2]] == [int(t) for t in want]
    assert runner.sampler_launches == 1
    # finalize: copy position 2 of plane 0 into planes 1..3, nothing else changes
    k_before = np.asarray(runner.k_pool)
    fin = [(_slot(tables[0], 2), _slot(tables[p], 2)) for p in range(1, T)]
    runner.step(_desc(key, [], [], (), (), fin))
    k_after = np.asarray(runner.k_pool)
    kf = k_before.reshape(*k_before.shape[:2], -1, cfg.head_dim)
    expect = kf.copy()
    for s, t in fin:
        expect[:, :, t] = kf[:, :, s]
    np.testing.assert_array_equal(k_after.reshape(expect.shape), expect)


def test_model_and_fake_runner_share_step():
    """``LLM``'s loop can drive either runner: ``step(descriptor) -> StepResult`` whose gates and
    tokens are read (once) when asked for, with the same shapes and dtypes."""
    cfg = get_preset("tiny")
    params = jax.tree.map(jnp.asarray, random_params(cfg, 2))
    key = BucketKey(R=8, S=8, C=8, F=24, MB=2)
    table = [1, 2]
    d = _desc(key, [(1, 0, _slot(table, 0))], [(0, 1, 1, table)], [(1, 5)], [(0, 0.0, 0, 1.0, 0, 0)])
    d.set_header(num_rows=1, num_segments=1, num_prelude=1, num_coda=1)
    runners = (
        ModelRunner(cfg, params, num_blocks=NB, block_size=BS, num_ring_rows=8),
        FakeRunner(NB, BS, 8, cfg.vocab_size),
    )
    for runner in runners:
        res = runner.step(d)
        assert isinstance(res, StepResult)
        gates, tokens = res.gates(), res.tokens()
        assert gates.shape == (key.R,) and gates.dtype == np.float32, type(runner)
        assert tokens.shape == (key.C,) and tokens.dtype == np.int32, type(runner)
        assert res.gates() is gates and res.tokens() is tokens  # converted once
        assert 0 <= tokens[0] < cfg.vocab_size


def test_fused_xla_option_overrides(monkeypatch):
    """``EngineConfig.fused_xla_options`` (default ``$OURO_JAX_FUSED_XLA_OPTIONS``) adds typed XLA
    options to fused steps only (GPU), ``step_xla_options`` to one-loop steps only, and a malformed
    entry is refused by the config, naming the field."""
    from ouro_jax import compiler_options as co
    from ouro_jax.engine_config import EngineConfig, parse_xla_options

    parse = lambda text: parse_xla_options(text, "fused_xla_options")  # noqa: E731
    assert parse("") == {} and parse(" ; ") == {}
    got = parse("xla_gpu_command_buffer_update_mode=SKIP_TEMP; xla_gpu_enable_cublaslt=false;xla_gpu_autotune_level=2")
    assert got == {
        "xla_gpu_command_buffer_update_mode": "SKIP_TEMP",
        "xla_gpu_enable_cublaslt": False,
        "xla_gpu_autotune_level": 2,
    }
    assert parse("xla_gpu_enable_command_buffer=FUSION,WHILE") == {"xla_gpu_enable_command_buffer": "FUSION,WHILE"}
    assert parse("xla_gpu_enable_command_buffer=") == {"xla_gpu_enable_command_buffer": ""}
    for bad in ("xla_gpu_x", "gpu_x=1", "=1"):
        with pytest.raises(ValueError, match="fused_xla_options"):
            EngineConfig(fused_xla_options=bad)
        with pytest.raises(ValueError, match="step_xla_options"):
            EngineConfig(step_xla_options=bad)
    # the variables are the fields' defaults, read when a config is built
    monkeypatch.setenv("OURO_JAX_FUSED_XLA_OPTIONS", "xla_gpu_command_buffer_update_mode=SKIP_TEMP")
    monkeypatch.setenv("OURO_JAX_STEP_XLA_OPTIONS", "xla_gpu_enable_triton_gemm=false")
    engine = EngineConfig()
    assert engine.fused_xla_options == "xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    assert engine.step_xla_options == "xla_gpu_enable_triton_gemm=false"
    cfg = get_preset("tiny")
    runner = ModelRunner(cfg, random_params(cfg, 0), num_blocks=NB, block_size=BS, num_ring_rows=8, engine=engine)
    step_key = BucketKey(R=8, S=8, C=8, F=24, MB=2)
    fused_key = (step_key, 4)
    assert runner.compiler_options(fused_key) == {}  # off the GPU: no XLA options at all
    monkeypatch.setattr(co.jax, "default_backend", lambda: "gpu")
    fused, plain = runner.compiler_options(fused_key), runner.compiler_options(step_key)
    assert fused["xla_gpu_command_buffer_update_mode"] == "SKIP_TEMP"
    assert fused["xla_gpu_enable_cub_radix_sort"] is False
    assert "xla_gpu_command_buffer_update_mode" not in plain and "xla_gpu_enable_cub_radix_sort" not in plain
    assert plain["xla_gpu_enable_triton_gemm"] is False and "xla_gpu_enable_triton_gemm" not in fused
    # generate() has no engine config: it reads the fused steps' variable
    assert co.step_options(fused=True)["xla_gpu_command_buffer_update_mode"] == "SKIP_TEMP"


def test_runner_picks_the_long_segment_variant():
    """Where a bucket splits attention per segment ("hybrid"), a descriptor whose every segment
    holds ``HYBRID_MIN_SEGMENT_ROWS`` rows runs on the bucket's long-segment variant (the Mosaic
    kernel alone); any shorter segment, no segment, or a runner whose buckets do not split keeps
    the bucket's own executable. Only picked here: nothing is traced."""
    from ouro_jax.engine_config import EngineConfig
    from pallas_kernels.dispatch import HYBRID_MIN_SEGMENT_ROWS as LONG

    cfg = get_preset("tiny")
    params = jax.tree.map(jnp.asarray, random_params(cfg, 0))
    kw = dict(num_blocks=NB, block_size=BS, num_ring_rows=16)
    runner = ModelRunner(cfg, params, engine=EngineConfig(attention="hybrid"), **kw)
    key = BucketKey(R=128, S=128, C=8, F=24, MB=3)
    long = key._replace(M=LONG)
    assert runner.long_segment_key(key) == long and runner.long_segment_key(long) is None
    assert runner.long_segment_keys([key, (key, 4), long]) == [long]

    def segments(*lens):
        d = _desc(key, [], [(0, n, n, [1]) for n in lens])
        d.set_header(num_segments=len(lens))
        return d

    assert runner.executable_key(segments(LONG, 64, 0, 31 + LONG)) == long  # a padding slot between
    for lens in ((LONG, LONG - 1), (1, 100), ()):  # a short chunk, a decode row, nothing
        assert runner.executable_key(segments(*lens)) == key
    hidden = segments(LONG, 64)
    hidden.seg_q_len[5] = 1  # a short segment past the header's count still counts
    assert runner.executable_key(hidden) == key
    for attention in ("triton", "reference"):
        other = ModelRunner(cfg, params, engine=EngineConfig(attention=attention), **kw)
        assert other.long_segment_key(key) is None and other.executable_key(segments(LONG, LONG)) == key
