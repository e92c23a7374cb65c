"""The Mosaic GPU decode attention (``decode_attention_mgpu``): its plan, what it refuses, the kernel
in Pallas' GPU interpreter (wgmma stood in for) and cross-lowered for CUDA on CPU; on the GPU
(``-m gpu``) kernel == jnp reference on decode batches at Ouro-1.4B shapes (one and eight rows, 1K
and 4K, split and unsplit items) and on drawn ones.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import dispatch
from pallas_kernels.decode_attention_mgpu import (
    ITEM_FIELDS,
    decode_attention_mgpu,
    decode_partials,
    make_decode_plan,
    num_items,
    supported,
)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.kernels.conftest import assert_close, make_batch, oracle, pad_batch, run, skip_no_hopper

gpu = pytest.mark.gpu


def decode_batch(seed, ctxs, *, heads=2, head_dim=64, block_size=16, rows=8, layers=2, gap_prob=0.3):
    """One decode row per segment (``ctxs``: each row's context; 0 = a padding segment), padded to
    ``rows`` rows (more, a multiple of 8, where gaps between them need it), bfloat16, the unread
    tails of pages finite (the kernel's contract)."""
    b = make_batch(
        np.random.default_rng(seed),
        num_heads=heads,
        kv_heads=heads,
        head_dim=head_dim,
        block_size=block_size,
        seg_specs=[(1 if c else 0, c) for c in ctxs],
        extra_rows=0,
        num_layers=layers,
        dtype=jnp.bfloat16,
        gap_prob=gap_prob,
        tail_poison=1e3,
    )
    rows = max(rows, 8 * math.ceil(b["q"].shape[0] / 8))
    return pad_batch(b, rows=rows, table_cols=b["tables"].shape[1], pages=b["k"].shape[-3])


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------


def test_plan_splits_to_fill_the_gpu():
    """One row at 1K: chunks of 128 tokens, 8 items (x 16 heads = 128 CTAs); eight rows at 1K:
    one item a row. Every item's range starts on a step and the items of a row tile its context."""

    def items(ctxs, rows=8):
        n = len(ctxs)
        z = jnp.arange(n, dtype=jnp.int32)
        plan = make_decode_plan(
            z,
            jnp.ones(n, jnp.int32),
            jnp.asarray(ctxs, jnp.int32),
            jnp.zeros((n, 64), jnp.int32),
            num_rows=rows,
            num_kv_heads=16,
        )
        w = num_items(plan, jnp.zeros((n, 64), jnp.int32))
        return np.asarray(plan.meta[: w * ITEM_FIELDS]).reshape(w, ITEM_FIELDS)

    one = items([1024])
    real = one[one[:, 6] > 0]
    assert len(real) == 8 and (real[:, 6] == 8).all()
    np.testing.assert_array_equal(real[:, 4], np.arange(8) * 128)
    np.testing.assert_array_equal(real[:, 5], np.arange(1, 9) * 128)
    eight = items([1024] * 8)
    real = eight[eight[:, 6] > 0]
    assert len(real) == 8 and (real[:, 6] == 1).all() and (real[:, 5] - real[:, 4] == 1024).all()
    odd = items([1000, 3, 517], rows=16)
    for row, ctx in enumerate([1000, 3, 517]):
        mine = odd[(odd[:, 6] > 0) & (odd[:, 1] == row)]
        assert (mine[:, 4] % 64 == 0).all() and mine[0, 4] == 0 and mine[-1, 5] == ctx
        np.testing.assert_array_equal(mine[1:, 4], mine[:-1, 5])


def test_unsupported_launches_are_refused():
    assert "dtype" in supported(jnp.float32, 16, 16, 128, 16, 8)
    assert "MHA" in supported(jnp.bfloat16, 16, 4, 128, 16, 8)
    assert "head_dim" in supported(jnp.bfloat16, 16, 16, 96, 16, 8)
    assert "block_size" in supported(jnp.bfloat16, 16, 16, 128, 4, 8)
    assert "rows" in supported(jnp.bfloat16, 16, 16, 128, 16, 12)
    assert supported(jnp.bfloat16, 16, 16, 128, 16, 8) is None
    q = jnp.zeros((8, 2, 64), jnp.float32)
    kp = jnp.zeros((2, 8, 16, 64), jnp.float32)
    z = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="dtype float32"):
        decode_attention_mgpu(q, kp, kp, z, z, z, jnp.zeros((1, 4), jnp.int32), sm_scale=0.1)


def test_decode_only_invocations_choose_the_decode_kernel(monkeypatch):
    """``pallas`` on Hopper: decode-only invocations (fused steps, ``generate()``, drafts) of small
    buckets run the decode kernel where it serves them; larger buckets, other invocations, forced
    kernels, float32, GQA, CPU interpretation and other GPUs keep their kernel."""
    kw = dict(num_rows=8, num_segments=8, num_heads=16, num_kv_heads=16, head_dim=128, block_size=16)
    kw["dtype"] = jnp.bfloat16

    def pick(attention="pallas", **over):
        return dispatch.choose_attention(attention, **{**kw, **over}).name

    monkeypatch.setattr(dispatch, "hopper_available", lambda: True)
    assert pick(decode_only=True) == "decode"
    assert pick(decode_only=True, num_rows=dispatch.DECODE_MGPU_MAX_ROWS * 2, num_segments=16) == "triton"
    assert pick() == "triton"
    assert pick("triton", decode_only=True) == "triton"
    assert pick(decode_only=True, dtype=jnp.float32) == "triton"
    assert pick(decode_only=True, num_kv_heads=4) == "triton"
    assert pick(decode_only=True, interpret=True) == "triton"
    monkeypatch.setattr(dispatch, "hopper_available", lambda: False)
    assert pick(decode_only=True) == "triton"
    with pytest.raises(ValueError, match="interpret"):
        dispatch.AttentionKernel("decode", 8, 16, 16, 128, interpret=True)


def test_generate_decodes_on_the_decode_kernel(monkeypatch):
    """``generate()``'s decode is ``decode_only``: on Hopper it runs the decode kernel, as the
    engine's fused steps do (docs/decisions.md, "`generate()` decodes on the decode kernel")."""
    from ouro_jax import static_generate as sg
    from weights.config import get_preset

    monkeypatch.setattr(dispatch, "hopper_available", lambda: True)
    monkeypatch.setattr(sg.jax, "default_backend", lambda: "gpu")  # no interpret mode: a GPU's pick
    for batch in (1, 8):
        assert sg.decode_kernel("pallas", get_preset("ouro-1.4b"), batch, "bfloat16").name == "decode"


@pytest.mark.parametrize(
    "ctxs,rows",
    [
        ([300, 0, 17, 64, 1, 129], 8),  # split and one-item rows, a padding segment, off page ends
        pytest.param([1000], 8, marks=pytest.mark.slow),  # one row split into many chunks
        pytest.param([70, 200, 5, 130, 64, 33, 900, 2, 15, 80], 16, marks=pytest.mark.slow),
    ],
)
def test_interpreted_matches_oracle(mosaic_decode_interpret, ctxs, rows):
    """The kernel in Pallas' GPU interpreter (CPU), its combine in Pallas' interpret mode: the
    float64 oracle on every decode row, zeros on rows of no segment."""
    b = decode_batch(len(ctxs), ctxs, rows=rows)
    scale = 64**-0.5
    assert_close(run(mosaic_decode_interpret, b, scale), oracle(b, scale), b, jnp.bfloat16, "decode interpreted")


@pytest.mark.slow
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.sampled_from([0, 1, 15, 16, 17, 63, 64, 65, 191, 300]), min_size=1, max_size=8), st.integers())
def test_interpreted_on_drawn_batches(mosaic_decode_interpret, ctxs, seed):
    """Drawn decode batches at one compilation (8 rows, 20 table columns, 160 pages)."""
    b = make_batch(
        np.random.default_rng(seed % 2**31),
        num_heads=2,
        kv_heads=2,
        head_dim=64,
        block_size=16,
        seg_specs=[(1 if c else 0, c) for c in ctxs] + [(0, 0)] * (8 - len(ctxs)),
        extra_rows=0,
        num_layers=2,
        dtype=jnp.bfloat16,
        gap_prob=0.0,
        tail_poison=1e3,
    )
    b = pad_batch(b, rows=8, table_cols=20, pages=160)
    assert_close(run(mosaic_decode_interpret, b, 0.125), oracle(b, 0.125), b, jnp.bfloat16, f"drawn {ctxs}")


@pytest.mark.parametrize("rows,heads,hd", [(8, 16, 128), (128, 4, 64)])
def test_mosaic_lowering_on_cpu(rows, heads, hd):
    """Pallas -> Mosaic GPU lowering of the first launch for CUDA from a CPU host: the kernel's ops,
    layouts, barriers and TMA slices are accepted (PTX compilation needs the GPU)."""
    s, mb, nb, bs = rows, 70, 600, 16
    sd = jax.ShapeDtypeStruct
    pool = sd((3, heads, nb, bs, hd), jnp.bfloat16)
    args = [sd((rows, heads, hd), jnp.bfloat16), pool, pool]
    args += [sd((s,), jnp.int32)] * 3 + [sd((s, mb), jnp.int32), sd((), jnp.int32)]

    def f(q, k, v, qs, ql, cl, bt, layer):
        plan = make_decode_plan(qs, ql, cl, bt, num_rows=rows, num_kv_heads=heads)
        return decode_partials(q, k, v, bt, layer, plan, sm_scale=0.1)

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@gpu
@skip_no_hopper
@pytest.mark.parametrize(
    "ctxs,rows",
    [
        ([1024], 8),  # one row: eight chunks of 128
        ([1024] * 8, 8),  # eight rows: one item each
        ([4096, 4000, 17], 8),
        ([1, 2, 3, 700, 1500, 0, 64, 65], 8),
        ([900 + 37 * i for i in range(40)], 128),  # a large bucket
    ],
)
def test_matches_reference_at_ouro_shapes(ctxs, rows):
    b = decode_batch(7, ctxs, heads=16, head_dim=128, rows=rows, layers=3)
    scale = 128**-0.5
    want = run(ragged_paged_attention_reference, b, scale)
    assert_close(run(decode_attention_mgpu, b, scale), want, b, jnp.bfloat16, f"decode {ctxs}")


@gpu
@skip_no_hopper
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.integers(0, 2500), min_size=1, max_size=16),
    st.sampled_from([(4, 64), (8, 128)]),
    st.sampled_from([8, 16]),
    st.integers(0, 2**31 - 1),
)
def test_matches_reference_on_drawn_batches(ctxs, heads, block_size, seed):
    h, hd = heads
    rows = 8 * math.ceil(len(ctxs) / 8)
    b = decode_batch(seed, ctxs, heads=h, head_dim=hd, block_size=block_size, rows=rows, layers=2)
    scale = hd**-0.5
    want = run(ragged_paged_attention_reference, b, scale)
    assert_close(run(decode_attention_mgpu, b, scale), want, b, jnp.bfloat16, f"decode drawn {ctxs}")
