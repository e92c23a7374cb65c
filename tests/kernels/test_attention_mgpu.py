"""The Mosaic GPU ragged paged attention kernel and the per-bucket kernel choice.

On CPU: the query windows, the dispatch rule, the kernel in Pallas' GPU interpreter (wgmma stood in
for: the in-place stores of its segments' rows and nothing else) and cross-lowering of the kernel for
CUDA (Pallas -> Mosaic GPU, no device needed: catches unsupported ops and layouts before device time
is spent). On the GPU (``-m gpu``): kernel == jnp reference on hypothesis-drawn ragged prompt batches
(segments on and off page boundaries, fresh prompts and chunks with history, padding segments and
rows, GQA, head_dim 64/128, stacked pool), and at Ouro-1.4B shapes.
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
    TILE_FIELDS,
    make_packing,
    packed_tiles,
    ragged_paged_attention_mgpu,
    supported,
    tile_rows,
)
from tests.kernels.conftest import assert_close, make_batch, oracle, pad_batch, run, skip_no_hopper

gpu = pytest.mark.gpu


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------


def check_windows(tiles, starts, lens, ctx, num_rows):
    """Each window: one segment, at most 128 rows from a multiple of ALIGN, its first ``lead`` rows
    (fewer than ALIGN, only in a segment's first window) before the segment; positions follow the
    segment's context; the windows' segment rows are every segment's rows exactly once."""
    owned = np.zeros(num_rows, np.int32)
    for seg, row0, nrows, pos0, lead in np.asarray(tiles):
        if not nrows:
            assert lead == 0
            continue
        assert 0 < nrows <= 128 and row0 % ALIGN == 0 and 0 <= lead < ALIGN and lead < nrows
        assert row0 + lead >= starts[seg] and row0 + nrows <= starts[seg] + lens[seg]
        assert lead == 0 or row0 + lead == starts[seg]
        assert pos0 == ctx[seg] - lens[seg] + (row0 - starts[seg])
        owned[row0 + lead : row0 + nrows] += 1
    want = np.zeros(num_rows, np.int32)
    for s0, ql in zip(starts, lens):
        want[s0 : s0 + ql] += 1
    np.testing.assert_array_equal(owned, want)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 3)), min_size=1, max_size=5), st.integers(0, 5))
def test_windows_cover_every_segment_row_once(segs, extra):
    starts, lens, row = [], [], 0
    for q_len, gap in segs:
        row += gap
        starts.append(row)
        lens.append(q_len)
        row += q_len
    num_rows = max(1, row + extra)
    ctx = [ql + 7 for ql in lens]
    tiles = jax.jit(tile_rows, static_argnames=("num_rows", "block_q"))(
        jnp.array(starts, jnp.int32),
        jnp.array(lens, jnp.int32),
        jnp.array(ctx, jnp.int32),
        num_rows=num_rows,
        block_q=64,
    )
    check_windows(tiles, starts, lens, ctx, num_rows)


def test_packing_meta_is_tiles_then_table():
    """The kernel reads window t's fields at meta[5t:5t+5] and the table at meta[5T + seg*MB + j]."""
    qs, ql, cl = (jnp.array(x, jnp.int32) for x in ([0, 300], [300, 5], [300, 900]))
    table = jnp.arange(2 * 7, dtype=jnp.int32).reshape(2, 7) + 100
    pk = make_packing(qs, ql, cl, table, num_rows=310)
    tiles = tile_rows(qs, ql, cl, num_rows=310, block_q=64)
    n_t = tiles.shape[0]
    assert packed_tiles(pk, table) == n_t and tiles.shape[1] == TILE_FIELDS
    np.testing.assert_array_equal(pk.meta[: TILE_FIELDS * n_t], np.asarray(tiles).reshape(-1))
    np.testing.assert_array_equal(pk.meta[TILE_FIELDS * n_t :], np.asarray(table).reshape(-1))
    check_windows(tiles, [0, 300], [300, 5], [300, 900], 310)


# Layouts the in-place stores must get right: segments starting off the 8-row grid right after
# another segment's last row (shared 8-row groups both ways), one-row segments and windows, a
# 129-row segment (a second window of one row), padding segments and rows.
INTERPRET_LAYOUTS = [
    [(40, 100), (3, 50), (70, 70), (1, 9), (129, 200)],
    [(5, 5), (64, 64), (0, 0), (2, 30), (13, 13)],
    [(1, 20), (1, 33), (9, 9), (127, 140)],
]


@pytest.mark.parametrize(
    "specs,heads",
    [
        (INTERPRET_LAYOUTS[0], (2, 1, 64)),
        pytest.param(INTERPRET_LAYOUTS[1], (4, 2, 64), marks=pytest.mark.slow),
        pytest.param(INTERPRET_LAYOUTS[2], (2, 2, 128), marks=pytest.mark.slow),
    ],
)
def test_mgpu_interpreted_writes_its_rows_in_place(mosaic_attention_interpret, specs, heads):
    """The kernel in Pallas' GPU interpreter (CPU): the oracle on every segment row, and every
    other row of ``out`` as it came in (a sentinel), with segments packed back to back."""
    h, kvh, hd = heads
    b = make_batch(
        np.random.default_rng(len(specs)),
        num_heads=h,
        kv_heads=kvh,
        head_dim=hd,
        block_size=16,
        seg_specs=specs,
        extra_rows=5,
        num_layers=2,
        dtype=jnp.bfloat16,
        gap_prob=0.0,
        tail_poison=1e3,
    )
    scale = hd**-0.5
    want = oracle(b, scale)
    sentinel = jnp.full(b["q"].shape, 7.0, jnp.bfloat16)
    got = run(mosaic_attention_interpret, b, scale, out=sentinel)
    np.testing.assert_array_equal(got[~b["covered"]], 7.0, err_msg="a row of no segment was written")
    err = np.abs(got[b["covered"]] - want[b["covered"]]).max()
    assert err <= 3e-2 * max(1.0, np.abs(want).max()), f"max abs err {err}"
    # default ``out``: zeros on rows of no segment (the kernels' contract)
    assert_close(run(mosaic_attention_interpret, b, scale), want, b, jnp.bfloat16, "mgpu interpreted")


@pytest.mark.slow
@settings(
    max_examples=12,
    deadline=None,
    # the fixture only patches the kernel's module: the same for every example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(st.tuples(st.integers(0, 140), st.sampled_from([0, 1, 9, 60])), min_size=1, max_size=6),
    st.sampled_from([0.0, 0.4]),
    st.integers(0, 2**31 - 1),
)
def test_mgpu_interpreted_on_drawn_layouts(mosaic_attention_interpret, segs, gap_prob, seed):
    """Drawn layouts (segments of 0-140 rows, with or without history, back to back or with gaps),
    one compilation: the oracle on segment rows, a sentinel everywhere else."""
    specs = [(n, n + h if n else 0) for n, h in segs]
    b = make_batch(
        np.random.default_rng(seed),
        num_heads=2,
        kv_heads=1,
        head_dim=64,
        block_size=8,
        seg_specs=specs + [(0, 0)] * (6 - len(specs)),
        extra_rows=3,
        num_layers=2,
        dtype=jnp.bfloat16,
        gap_prob=gap_prob,
        tail_poison=1e3,
    )
    b = pad_batch(b, rows=896, table_cols=26, pages=120)
    want = oracle(b, 0.125)
    got = run(mosaic_attention_interpret, b, 0.125, out=jnp.full(b["q"].shape, 7.0, jnp.bfloat16))
    np.testing.assert_array_equal(got[~b["covered"]], 7.0, err_msg="a row of no segment was written")
    err = np.abs(got[b["covered"]] - want[b["covered"]]).max(initial=0.0)
    assert err <= 3e-2 * max(1.0, np.abs(want).max()), f"{specs}: max abs err {err}"


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
