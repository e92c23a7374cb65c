"""The Mosaic GPU ragged paged attention kernel and the per-bucket kernel choice.

On CPU: the tile packing round trip, the dispatch rule, and cross-lowering of the kernel for CUDA
(Pallas -> Mosaic GPU, no device needed: catches unsupported ops and layouts before device time is
spent). On the GPU (``-m gpu``): kernel == jnp reference on hypothesis-drawn ragged prompt batches
(segments on and off page boundaries, fresh prompts and chunks with history, padding segments and
rows, GQA, head_dim 64/128, stacked pool), and at Ouro-1.4B shapes. There is no CPU interpret mode
for this kernel (Pallas' GPU interpreter does not model wgmma).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pallas_kernels import dispatch
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_mgpu import (
    ALIGN,
    make_packing,
    ragged_paged_attention_mgpu,
    supported,
    tile_rows,
)
from tests.kernels.conftest import assert_close, make_batch, run, skip_no_hopper

gpu = pytest.mark.gpu


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 3)), min_size=1, max_size=5), st.integers(0, 5))
def test_tile_packing_round_trip(segs, extra):
    """q[src] packs every covered row exactly once into its tile; out[dst] unpacks; rows of no
    segment map to the zero row."""
    starts, lens, row = [], [], 0
    for q_len, gap in segs:
        row += gap
        starts.append(row)
        lens.append(q_len)
        row += q_len
    num_rows = max(1, row + extra)
    ctx = [ql + 7 for ql in lens]
    tiles, src, dst = jax.jit(tile_rows, static_argnames=("num_rows", "block_q"))(
        jnp.array(starts, jnp.int32),
        jnp.array(lens, jnp.int32),
        jnp.array(ctx, jnp.int32),
        num_rows=num_rows,
        block_q=64,
    )
    tiles, src, dst = map(np.asarray, (tiles, src, dst))
    q = np.arange(1, num_rows + 1, dtype=np.float32)
    packed = np.concatenate([q, [0.0]])[np.minimum(src, num_rows)]
    back = np.concatenate([packed, [0.0]])[dst]
    covered = np.zeros(num_rows, bool)
    for s0, ql in zip(starts, lens):
        covered[s0 : s0 + ql] = True
    np.testing.assert_array_equal(back, np.where(covered, q, 0.0))
    # each tile: one segment, <= 128 rows, positions follow the segment's context
    # each window: one segment, <= 128 rows from a multiple of ALIGN (at most ALIGN - 1 rows before
    # the segment's first), positions follow the segment's context
    for seg, row0, nrows, pos0 in tiles:
        if nrows:
            assert 0 < nrows <= 128 and row0 % ALIGN == 0 and row0 + nrows <= starts[seg] + lens[seg]
            assert starts[seg] - starts[seg] % ALIGN <= row0
            assert pos0 == ctx[seg] - lens[seg] + (row0 - starts[seg])


def test_packing_meta_is_tiles_then_table():
    """The kernel reads tile t's fields at meta[4t:4t+4] and the table at meta[4T + seg*MB + j]."""
    qs, ql, cl = (jnp.array(x, jnp.int32) for x in ([0, 300], [300, 5], [300, 900]))
    table = jnp.arange(2 * 7, dtype=jnp.int32).reshape(2, 7) + 100
    pk = make_packing(qs, ql, cl, table, num_rows=310)
    tiles, src, dst = tile_rows(qs, ql, cl, num_rows=310, block_q=64)
    n_t = tiles.shape[0]
    assert src.shape[0] == n_t * 128
    np.testing.assert_array_equal(pk.meta[: 4 * n_t], np.asarray(tiles).reshape(-1))
    np.testing.assert_array_equal(pk.meta[4 * n_t :], np.asarray(table).reshape(-1))
    np.testing.assert_array_equal(pk.src, src)
    np.testing.assert_array_equal(pk.dst, dst)


def test_select_kernel_rule():
    sel = dispatch.select_kernel
    assert sel(1024, 1, jnp.bfloat16, 128, 16, hopper=True) == "mgpu"
    assert sel(1024, 8, jnp.bfloat16, 128, 16, hopper=True) == "mgpu"
    assert sel(1024, 64, jnp.bfloat16, 128, 16, hopper=True) == "triton"  # 16 rows / segment
    assert sel(256, 1, jnp.bfloat16, 128, 16, hopper=True) == "triton"  # 2 tiles x 16 heads
    assert sel(512, 4, jnp.bfloat16, 128, 16, hopper=True) == "mgpu"  # 7 tiles x 16 heads
    assert sel(128, 128, jnp.bfloat16, 128, 16, hopper=True) == "triton"  # decode
    assert sel(1024, 1, jnp.bfloat16, 128, 16, hopper=False) == "triton"
    assert sel(1024, 1, jnp.float32, 128, 16, hopper=True) == "triton"
    assert sel(1024, 1, jnp.bfloat16, 128, 4, hopper=True) == "triton"  # pages < 8 tokens
    assert "dtype" in supported(jnp.float32, 128, 16)


def test_unsupported_launch_is_refused():
    q = jnp.zeros((128, 2, 64), jnp.float32)
    kp = jnp.zeros((2, 8, 16, 64), jnp.float32)
    z = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="dtype float32"):
        ragged_paged_attention_mgpu(q, kp, kp, z, z, z, jnp.zeros((1, 4), jnp.int32), sm_scale=0.1)
    with pytest.raises(ValueError, match="interpret"):
        dispatch.AttentionKernel("mgpu", 128, 2, 2, 64, interpret=True)


@pytest.mark.parametrize("h,kvh,hd,layered,r", [(16, 16, 128, True, 512), (8, 2, 64, False, 281)])
def test_mosaic_lowering_on_cpu(h, kvh, hd, layered, r):
    """Pallas -> Mosaic GPU lowering for CUDA from a CPU host (jax.export): the kernel body's ops,
    layouts, barriers and TMA slices are accepted (also for a row count that is not a multiple of
    the query windows' alignment); PTX compilation needs the GPU."""
    s, mb, nb, bs = 3, 40, 128, 16
    shape = (4, kvh, nb, bs, hd) if layered else (kvh, nb, bs, hd)
    sd = jax.ShapeDtypeStruct
    args = [
        sd((r, h, hd), jnp.bfloat16),
        sd(shape, jnp.bfloat16),
        sd(shape, jnp.bfloat16),
        sd((s,), jnp.int32),
        sd((s,), jnp.int32),
        sd((s,), jnp.int32),
        sd((s, mb), jnp.int32),
    ]

    if layered:

        def f(q, k, v, a, b, c, d, lyr):
            return ragged_paged_attention_mgpu(q, k, v, a, b, c, d, layer=lyr, sm_scale=0.1)

        args.append(sd((), jnp.int32))
    else:

        def f(q, k, v, a, b, c, d):
            return ragged_paged_attention_mgpu(q, k, v, a, b, c, d, sm_scale=0.1)

    text = jax.export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in text


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

HEADS = [(4, 4, 64), (4, 2, 128), (2, 2, 128), (8, 1, 64), (6, 2, 64)]


@st.composite
def prompt_batches(draw):
    h, kvh, hd = draw(st.sampled_from(HEADS))
    block_size = draw(st.sampled_from([8, 16]))
    specs = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["fresh", "chunk", "chunk", "short", "pad"]))
        if kind == "pad":
            specs.append((0, 0))
        elif kind == "fresh":  # a whole causal prompt
            n = draw(st.integers(1, 300))
            specs.append((n, n))
        elif kind == "short":  # a few rows, even a decode row
            specs.append((draw(st.integers(1, 5)), draw(st.integers(5, 200))))
        else:  # a chunk after some history
            n = draw(st.integers(1, 260))
            specs.append((n, n + draw(st.integers(1, 400))))
    return dict(
        heads=(h, kvh, hd),
        block_size=block_size,
        specs=specs,
        extra_rows=draw(st.integers(0, 70)),
        layers=draw(st.sampled_from([None, 2])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@gpu
@skip_no_hopper
@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(prompt_batches())
def test_mgpu_matches_reference(case):
    h, kvh, hd = case["heads"]
    rng = np.random.default_rng(case["seed"])
    b = make_batch(
        rng,
        num_heads=h,
        kv_heads=kvh,
        head_dim=hd,
        block_size=case["block_size"],
        seg_specs=case["specs"],
        extra_rows=case["extra_rows"],
        num_layers=case["layers"],
        dtype=jnp.bfloat16,
        tail_poison=1e3,
    )
    scale = 1.0 / math.sqrt(hd)
    want = run(ragged_paged_attention_reference, b, scale)
    got = run(ragged_paged_attention_mgpu, b, scale)
    assert_close(got, want, b, jnp.bfloat16, f"mgpu {case}")


@gpu
@skip_no_hopper
@pytest.mark.parametrize(
    "specs",
    [
        [(1024, 1024)],  # a fresh 1024-token prompt
        [(1024, 5000), (0, 0), (512, 512)],  # a chunk with history, padding, a fresh prompt
        [(128, 2048)] * 4 + [(1, 900)] * 3,  # chunks next to decode rows
        [(37, 1000), (200, 201), (64, 64)],  # off page boundaries
    ],
)
def test_mgpu_ouro_shapes(specs):
    rng = np.random.default_rng(7)
    b = make_batch(
        rng,
        num_heads=16,
        kv_heads=16,
        head_dim=128,
        block_size=16,
        seg_specs=specs,
        extra_rows=9,
        num_layers=3,
        dtype=jnp.bfloat16,
        tail_poison=1e3,
    )
    want = run(ragged_paged_attention_reference, b, 128**-0.5)
    got = run(ragged_paged_attention_mgpu, b, 128**-0.5)
    assert_close(got, want, b, jnp.bfloat16, f"mgpu ouro {specs}")
    # the dispatcher's plan path gives the same result
    kernel = dispatch.AttentionKernel("mgpu", b["q"].shape[0], 16, 16, 128)
    plan = kernel.plan(
        jnp.asarray(b["q_start"]), jnp.asarray(b["q_len"]), jnp.asarray(b["ctx_len"]), jnp.asarray(b["tables"])
    )
    got2 = run(functools.partial(kernel, plan=plan), b, 128**-0.5)
    np.testing.assert_array_equal(got2, got)
