"""The static ``generate()`` on the engine's decode path (fused projections, paged pool, the
decode bucket's ``AttentionKernel``): its identity pool layout, and tokens and exit depths equal to
the float64 numpy reference for fixed depth and early exit, at batches that pad the decode rows
(1, 3) and fill them (8), with prompts and outputs crossing page boundaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ouro_jax.static_generate as sg
from ouro_jax import generate, get_preset
from ouro_jax.reference import from_param_tree, reference_greedy_generate
from weights.random_init import random_params


def _setup(preset, seed=0):
    cfg = get_preset(preset)
    params = jax.tree.map(jnp.asarray, random_params(cfg, seed, np.float32))
    return cfg, params, from_param_tree(cfg, random_params(cfg, seed, np.float32))


def _prompts(cfg, lengths, seed):
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), max(lengths)), np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(0, cfg.vocab_size, n)
    return ids


def test_identity_layout_gives_every_plane_row_its_own_pages():
    """Slot of (plane, row, position) = its block-table entry's page and offset; no two
    (plane, row, position) share a slot, and every slot lies inside the pool."""
    T, B, S = 3, 5, 40
    m = sg.pages_per_row(S)
    assert m == 3 and sg.pages_per_row(48) == 3 and sg.pages_per_row(49) == 4
    seen = set()
    for t in range(T):
        bt = np.asarray(sg.plane_block_table(t, B, m))
        assert bt.shape == (B, m)
        for b in range(B):
            for pos in range(S):
                slot = int(sg.plane_slot(t, b, pos, B, m))
                assert slot == bt[b, pos // sg.BLOCK_SIZE] * sg.BLOCK_SIZE + pos % sg.BLOCK_SIZE
                seen.add(slot)
    assert len(seen) == T * B * S and max(seen) < T * B * m * sg.BLOCK_SIZE
    assert [sg.decode_rows(b) for b in (1, 7, 8, 9, 16)] == [8, 8, 8, 16, 16]


def test_pool_bytes_round_positions_up_to_pages():
    cfg = get_preset("tiny-gqa")
    per_token = 2 * cfg.num_hidden_layers * cfg.num_loops * cfg.num_key_value_heads * cfg.head_dim * 4
    assert sg.kv_pool_bytes(cfg, 3, 16, jnp.float32) == 3 * 16 * per_token
    assert sg.kv_pool_bytes(cfg, 3, 17, jnp.float32) == 3 * 32 * per_token


@pytest.mark.parametrize(
    "preset,lengths,new,kw",
    [
        # one row (7 padding decode rows), output crossing the page boundary at 16, fixed depth (slow:
        # test_model's generate tests cover one row at fixed depth in the default suite)
        pytest.param("tiny", [13], 6, {}, marks=pytest.mark.slow),
        # three rows, prompts around page boundaries, early exit
        ("tiny-gqa", [15, 17, 4], 6, dict(exit_threshold=0.45)),
        # eight rows (no padding), min/max loops
        pytest.param(
            "tiny",
            [16, 3, 31, 9, 18, 1, 24, 33],
            5,
            dict(exit_threshold=0.6, min_loops=2, max_loops=3),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_generate_equals_reference(preset, lengths, new, kw):
    cfg, params, ref = _setup(preset)
    ids = _prompts(cfg, lengths, seed=len(lengths))
    out = generate(params, cfg, ids, lengths, new, **kw)
    assert out.tokens.shape == out.exit_depths.shape == (len(lengths), new)
    checked, depths = 0, set()
    for b, n in enumerate(lengths):
        r = reference_greedy_generate(ref, cfg, list(ids[b, :n]), new, **kw)
        if r.min_logit_gap < 1e-4 or (kw and r.min_margin < 1e-4):
            continue  # float32 could legitimately decide differently
        checked += 1
        assert list(np.asarray(out.tokens[b])) == list(r.tokens), f"row {b}"
        assert list(np.asarray(out.exit_depths[b])) == list(r.exit_depths), f"row {b}"
        depths.update(r.exit_depths[1:])
    assert checked >= max(1, len(lengths) - 1)
    if kw:
        assert len(depths) >= 2, "the case should exercise several exit depths"


def test_generate_rejects_a_bad_attention_choice_before_tracing(monkeypatch):
    cfg, params, _ = _setup("tiny")
    monkeypatch.setattr(sg, "_jitted", lambda options: pytest.fail("traced before the choice was checked"))
    ids = np.ones((1, 4), np.int32)
    with pytest.raises(ValueError, match="attention must be one of"):
        generate(params, cfg, ids, [4], 2, attention="dense")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="no CPU interpret mode"):
            generate(params, cfg, ids, [4], 2, attention="mgpu")
    kernels = []
    monkeypatch.setattr(sg, "_jitted", lambda options: lambda *a, **k: kernels.append(k["kernel"]))
    generate(params, cfg, ids, [4], 2, attention="Reference")
    assert [(k.name, k.num_rows) for k in kernels] == [("reference", 8)]


@pytest.mark.slow
def test_generate_compiles_with_the_fused_steps_options_at_top_level_only(monkeypatch):
    """At top level ``generate()`` compiles with the fused steps' XLA options (on the GPU: its
    while_loops as CUDA-graph conditional nodes); under a caller's ``jit``, where JAX refuses
    compiler options on a nested jit, it runs with none and gives the same tokens."""
    cfg, params, _ = _setup("tiny")
    ids = _prompts(cfg, [5, 3], seed=2)
    # an option the CPU compiler accepts stands in for the GPU's command-buffer kinds
    monkeypatch.setattr(sg, "step_options", lambda fused=False: {"xla_cpu_enable_fast_math": False} if fused else {})
    seen = []
    jitted = sg._jitted
    monkeypatch.setattr(sg, "_jitted", lambda options: seen.append(dict(options)) or jitted(options))
    top = generate(params, cfg, ids, [5, 3], 3)
    nested = jax.jit(lambda p, x: generate(p, cfg, x, jnp.array([5, 3]), 3))(params, jnp.asarray(ids))
    assert seen == [{"xla_cpu_enable_fast_math": False}, {}]
    np.testing.assert_array_equal(nested.tokens, top.tokens)
    np.testing.assert_array_equal(nested.exit_depths, top.exit_depths)


@pytest.mark.slow  # ~20 s on a CPU: two compilations, one with the Triton kernel interpreted
def test_generate_triton_interpret_equals_reference_kernel():
    """The Pallas (Triton) decode kernel in interpret mode gives the jnp twin's tokens and depths."""
    cfg, params, _ = _setup("tiny-gqa")
    lengths = [14, 3, 17]
    ids = _prompts(cfg, lengths, seed=1)
    kw = dict(exit_threshold=0.5)
    want = generate(params, cfg, ids, lengths, 4, attention="reference", **kw)
    got = generate(params, cfg, ids, lengths, 4, attention="triton", **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.exit_depths, want.exit_depths)
    assert len(set(np.asarray(want.exit_depths)[:, 1:].ravel().tolist())) >= 2
