"""ragged_paged_attention: kernel (Pallas interpret mode on CPU, compiled on GPU) == jnp reference
== a float64 numpy dense-softmax oracle, on hypothesis-drawn ragged batches.

Batches mix decode rows (q_len 1) and prompt segments, several block tables (planes) per batch,
segment starts on and off page boundaries, contexts of one to several pages, padding segments
(q_len 0, junk fields) and padding rows (covered by no segment, poisoned with NaN in q), GQA and
MHA, head_dim 64 and 128, f32 and bf16, with and without the stacked ``[L, ...]`` pool. Pages that
no segment may read (the trash page 0, unused pages, block-table tails) are filled with NaN: any
out-of-context read shows up as NaN in the output.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pallas_kernels.ragged_paged_attention import (
    COMBINE_TARGET_PROGRAMS,
    MAX_PROGRAMS,
    combine_heads,
    default_tuning,
    make_plan,
    num_tiles,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
skip_no_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (jax.default_backend() != 'gpu')")


from tests.kernels.conftest import assert_close, make_batch, oracle, run  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------------

HEADS = [(4, 4, 64), (4, 2, 64), (2, 2, 128), (6, 2, 64), (8, 1, 64), (4, 2, 128)]


@st.composite
def batches(draw, max_segments=5, max_q=20, max_pages=5):
    num_heads, kv_heads, head_dim = draw(st.sampled_from(HEADS))
    block_size = draw(st.sampled_from([4, 8, 16]))
    n_seg = draw(st.integers(1, max_segments))
    specs = []
    for _ in range(n_seg):
        kind = draw(st.sampled_from(["decode", "decode", "prompt", "pad"]))
        if kind == "pad":
            specs.append((0, 0))
            continue
        ctx = draw(st.integers(1, max_pages * block_size))
        if kind == "decode":
            specs.append((1, ctx))
        else:
            specs.append((draw(st.integers(1, min(ctx, max_q))), ctx))
    return dict(
        heads=(num_heads, kv_heads, head_dim),
        block_size=block_size,
        specs=specs,
        extra_rows=draw(st.integers(0, 3)),
        layers=draw(st.sampled_from([None, None, 2, 3])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build(case, dtype):
    rng = np.random.default_rng(case["seed"])
    h, kvh, hd = case["heads"]
    return make_batch(
        rng,
        num_heads=h,
        kv_heads=kvh,
        head_dim=hd,
        block_size=case["block_size"],
        seg_specs=case["specs"],
        extra_rows=case["extra_rows"],
        num_layers=case["layers"],
        dtype=dtype,
    )


# ----------------------------------------------------------------------------------------------
# CPU tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_segments=6, max_q=24, max_pages=6))
def test_reference_matches_numpy_oracle(case):
    b = build(case, np.float32)
    sm_scale = 1.0 / math.sqrt(case["heads"][2])
    got = run(ragged_paged_attention_reference, b, sm_scale)
    assert_close(got, oracle(b, sm_scale), b, np.float32, "reference")


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_segments=4, max_q=20, max_pages=4), st.sampled_from([1, 4, 16]))
def test_reference_any_tile_height(case, block_q):
    b = build(case, np.float32)
    got = run(ragged_paged_attention_reference, b, 0.3, block_q=block_q)
    assert_close(got, oracle(b, 0.3), b, np.float32, f"reference block_q={block_q}")


TUNINGS = st.fixed_dictionaries(
    dict(
        block_q=st.sampled_from([1, 2, 8, 16]),
        block_k=st.sampled_from([16, 32]),
        min_split_tokens=st.sampled_from([1, 16, 64, 4096]),
        extra_items=st.sampled_from([1, 3, 8]),
        prefetch=st.booleans(),
        max_programs=st.sampled_from([1, 5, MAX_PROGRAMS]),  # small caps: programs loop over items
    )
)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_segments=4, max_q=18, max_pages=4), TUNINGS, st.sampled_from([np.float32, np.float32, jnp.bfloat16]))
def test_kernel_interpret_matches_reference(case, tuning, dtype):
    b = build(case, dtype)
    sm_scale = 1.0 / math.sqrt(case["heads"][2])
    want = run(ragged_paged_attention_reference, b, sm_scale)
    got = run(ragged_paged_attention, b, sm_scale, interpret=True, **tuning)
    assert_close(got, want, b, dtype, f"kernel {tuning}")
    if dtype == np.float32:
        assert_close(got, oracle(b, sm_scale), b, dtype, "kernel vs oracle")


def test_kernel_interpret_fixed_mixed_batch():
    """Deterministic mix: decode rows on/off page boundaries, a long prompt split along the context,
    a padding segment, padding rows, stacked pool, MHA decode path (block_q 1) and the MMA path."""
    rng = np.random.default_rng(7)
    specs = [(1, 16), (1, 17), (0, 0), (12, 40), (1, 1), (5, 5), (1, 33)]
    b = make_batch(rng, num_heads=4, kv_heads=4, head_dim=64, block_size=8, seg_specs=specs, extra_rows=2, num_layers=2)
    want = oracle(b, 0.125)
    for bq in (1, 16):
        got = run(
            ragged_paged_attention, b, 0.125, interpret=True, block_q=bq, block_k=16, min_split_tokens=16, extra_items=6
        )
        assert_close(got, want, b, np.float32, f"block_q={bq}")


def test_all_padding_gives_zeros():
    rng = np.random.default_rng(1)
    b = make_batch(rng, num_heads=2, kv_heads=1, head_dim=64, block_size=4, seg_specs=[(0, 0), (0, 0)], extra_rows=3)
    for fn, kw in ((ragged_paged_attention_reference, {}), (ragged_paged_attention, dict(interpret=True))):
        got = run(fn, b, 0.1, **kw)
        np.testing.assert_array_equal(got, 0.0)


@pytest.mark.slow
def test_plan_bounds_and_reuse():
    """A plan built once can be passed in (what the runner does once per step, for all layers);
    the work list never overflows its static capacity, whatever the lengths."""
    rng = np.random.default_rng(2)
    specs = [(1, 60), (7, 7), (1, 3), (0, 0)]
    b = make_batch(rng, num_heads=4, kv_heads=2, head_dim=64, block_size=4, seg_specs=specs, extra_rows=1, num_layers=3)
    r, s = b["q"].shape[0], len(specs)
    t = default_tuning(r, s, 4, 2, 64, block_q=4, block_k=16, min_split_tokens=16, extra_items=5)
    plan = make_plan(
        jnp.asarray(b["q_start"]),
        jnp.asarray(b["q_len"]),
        jnp.asarray(b["ctx_len"]),
        num_rows=r,
        num_q_per_kv=2,
        tuning=t,
    )
    items = np.asarray(plan.items)
    k0, k1, nrows = items[:, 4], items[:, 5], items[:, 2]
    real = nrows > 0
    assert (k1[real] > k0[real]).all() and (k1[~real] == k0[~real]).all()
    # every (tile, position) pair covered exactly once
    cover = {}
    for seg, row0, n, pos0, a, z, _, _ in items[real]:
        for p in range(a, z):
            cover[(row0, p)] = cover.get((row0, p), 0) + 1
    assert all(c == 1 for c in cover.values())
    assert sum(1 for (r0, _) in cover if r0 == b["q_start"][0]) == 60
    got = run(
        ragged_paged_attention,
        b,
        0.2,
        interpret=True,
        block_q=4,
        block_k=16,
        min_split_tokens=16,
        extra_items=5,
        plan=plan,
    )
    assert_close(got, oracle(b, 0.2), b, np.float32, "with plan")


def _grids(fn, *args, **kw):
    """Grids of the pallas_calls ``fn`` launches, in order (traced, nothing run)."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                found.append(tuple(e.params["grid_mapping"].grid))
            for v in e.params.values():
                sub = getattr(v, "jaxpr", v)
                if hasattr(sub, "eqns"):  # a sub-jaxpr (jit, cond, loops)
                    walk(sub)

    walk(jax.make_jaxpr(functools.partial(fn, **kw))(*args).jaxpr)
    return found


def _bucket_args(r, h, kvh, hd, s=None, dt=jnp.bfloat16):
    s = r if s is None else s
    pages = jax.ShapeDtypeStruct((2, kvh, 64, 16, hd), dt)
    i = jax.ShapeDtypeStruct((s,), jnp.int32)
    return (jax.ShapeDtypeStruct((r, h, hd), dt), pages, pages, i, i, i, jax.ShapeDtypeStruct((s, 8), jnp.int32))


@pytest.mark.parametrize("h,kvh,hd", [(16, 16, 128), (16, 8, 64), (8, 1, 64)])
def test_default_grid_one_item_per_program_in_decode_buckets(h, kvh, hd):
    """Engine decode buckets (S = R up to 128 rows) keep kernel 1's grid (W, KVH): one work item
    per program, as without a cap; 1024/2048-row buckets launch at most MAX_PROGRAMS programs."""
    for r in (8, 16, 32, 64, 128, 1024, 2048):
        t = default_tuning(r, r, h, kvh, hd)
        w = num_tiles(r, r, t.block_q) + t.extra_items
        grids = _grids(ragged_paged_attention, *_bucket_args(r, h, kvh, hd), layer=1, sm_scale=0.1, interpret=True)
        assert grids[1] == (r, h // combine_heads(r, h)), grids
        if r >= COMBINE_TARGET_PROGRAMS:
            assert grids[1] == (r, 1), grids  # a program per row, all heads
        p, heads = grids[0]
        assert heads == kvh
        if r <= 128:
            assert p == w, (r, p, w)
        assert p == min(w, MAX_PROGRAMS // kvh) and p * kvh <= MAX_PROGRAMS, (r, p, w)
        if (h, kvh) == (16, 16) and r >= 1024:  # Ouro-1.4B: 256 programs per head loop over 1056 / 2080 items
            assert (p, w) == (256, r + 32)


@pytest.mark.parametrize(
    "h,kvh,layers,bq,programs",
    [
        pytest.param(4, 4, 2, 1, (2, "n+1"), marks=pytest.mark.slow),  # MHA one-row path, stacked pool
        (6, 2, None, 16, (3,)),  # GQA MMA path (the engine's decode tiles)
        pytest.param(8, 2, 2, 4, (1, 3, "n+1"), marks=pytest.mark.slow),
        pytest.param(4, 4, None, 16, (1, 3, "n+1"), marks=pytest.mark.slow),
    ],
)
def test_kernel_interpret_capped_programs_loop(h, kvh, layers, bq, programs):
    """Programs capped to a few per KV head loop over several items (real, split along the context;
    the plan's empty tail is never walked): bitwise the uncapped kernel, and close to the reference.
    Decode rows, prompt chunks, padding segments and rows; ``n + 1`` programs leave one idle."""
    specs = [(1, 16), (1, 17), (0, 0), (12, 40), (1, 1), (5, 5), (1, 33), (0, 0), (3, 50)]
    rng = np.random.default_rng(100 + h + kvh + bq)
    b = make_batch(
        rng, num_heads=h, kv_heads=kvh, head_dim=64, block_size=8, seg_specs=specs, extra_rows=3, num_layers=layers
    )
    want = run(ragged_paged_attention_reference, b, 0.125)
    kw = dict(block_q=bq, block_k=16, min_split_tokens=16, extra_items=8)
    t = default_tuning(b["q"].shape[0], len(specs), h, kvh, 64, **kw)
    plan = make_plan(
        jnp.asarray(b["q_start"]),
        jnp.asarray(b["q_len"]),
        jnp.asarray(b["ctx_len"]),
        num_rows=b["q"].shape[0],
        num_q_per_kv=h // kvh,
        tuning=t,
    )
    items = np.asarray(plan.items)
    n, w = int(items[0, 7]), items.shape[0]
    # the plan packs its real items first, and carries their count in every row
    assert (items[:, 7] == n).all() and (items[:n, 6] > 0).all() and (items[n:, 6] == 0).all()
    assert 4 < n < w - 1  # several items per looped program, and an empty tail
    base = run(ragged_paged_attention, b, 0.125, interpret=True, **kw)
    assert_close(base, want, b, np.float32, f"uncapped {h}/{kvh} bq={bq}")
    args = _bucket_args(b["q"].shape[0], h, kvh, 64, s=len(specs), dt=jnp.float32)
    for p in programs:
        p = n + 1 if p == "n+1" else p
        grid = _grids(ragged_paged_attention, *args, layer=1, sm_scale=0.1, max_programs=p * kvh, **kw)[0]
        assert grid == (p, kvh)
        got = run(ragged_paged_attention, b, 0.125, interpret=True, max_programs=p * kvh, **kw)
        assert_close(got, want, b, np.float32, f"{h}/{kvh} bq={bq} programs={p}")
        np.testing.assert_array_equal(got, base, err_msg=f"{h}/{kvh} bq={bq} programs={p}")
        if len(programs) > 2:  # slow cases: the plan built once and passed in
            got = run(ragged_paged_attention, b, 0.125, interpret=True, max_programs=p * kvh, plan=plan, **kw)
            np.testing.assert_array_equal(got, base, err_msg=f"{h}/{kvh} bq={bq} programs={p}, shared plan")


@pytest.mark.slow  # test_all_padding_gives_zeros keeps the uncapped grid in the default suite
def test_all_padding_capped_gives_zeros():
    """No real item at all: every looped program returns at once, the combine writes zeros."""
    rng = np.random.default_rng(3)
    b = make_batch(rng, num_heads=2, kv_heads=1, head_dim=64, block_size=4, seg_specs=[(0, 0)] * 3, extra_rows=4)
    got = run(ragged_paged_attention, b, 0.1, interpret=True, max_programs=2)
    np.testing.assert_array_equal(got, 0.0)


def test_max_programs_must_be_positive():
    with pytest.raises(ValueError, match="max_programs"):
        default_tuning(8, 8, 4, 4, 64, max_programs=0)


def test_triton_lowering_on_cpu():
    """The kernels lower to Triton IR (cross-lowering for CUDA from a CPU host, no GPU needed):
    catches unsupported ops in the kernel body before any device time is spent."""
    # private modules: jax is pinned (==0.11.2), so a move shows up here as a failure, not a skip
    from jax._src.pallas.triton import gpu_info as gi
    from jax._src.pallas.triton import pallas_call_registration as pcr

    old = pcr.gpu_info_lib.get_gpu_info
    pcr.gpu_info_lib.get_gpu_info = lambda: gi.get_gpu_info_from_version(gi.GpuVersion.H200)
    try:
        for h, kvh, hd, layered, dt, bq, cap in [
            (16, 16, 128, False, jnp.bfloat16, 1, None),
            (16, 16, 128, True, jnp.bfloat16, 64, None),
            (8, 2, 64, True, jnp.float32, 16, None),
            (16, 16, 128, True, jnp.bfloat16, 1, 64),  # capped: programs loop over items
            (16, 16, 128, False, jnp.bfloat16, 16, 64),
        ]:
            r, s, mb, nb, bs = 64, 8, 32, 256, 16
            shape = (4, kvh, nb, bs, hd) if layered else (kvh, nb, bs, hd)
            qa = jax.ShapeDtypeStruct((r, h, hd), dt)
            ka = jax.ShapeDtypeStruct(shape, dt)
            ia = jax.ShapeDtypeStruct((s,), jnp.int32)
            ta = jax.ShapeDtypeStruct((s, mb), jnp.int32)
            la = jax.ShapeDtypeStruct((), jnp.int32) if layered else None

            def f(q, k, v, a, b_, c, d, lyr, bq=bq, cap=cap):
                return ragged_paged_attention(
                    q, k, v, a, b_, c, d, layer=lyr, sm_scale=0.1, block_q=bq, max_programs=cap
                )

            text = jax.jit(f).trace(qa, ka, ka, ia, ia, ia, ta, la).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("xla.gpu.triton") == 2
    finally:
        pcr.gpu_info_lib.get_gpu_info = old


# ----------------------------------------------------------------------------------------------
# GPU tests (compiled Triton kernels)
# ----------------------------------------------------------------------------------------------


@gpu
@skip_no_gpu
# no shrinking on the GPU: every example compiles kernels; report the first failure as drawn
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(batches(max_segments=6, max_q=40, max_pages=8), TUNINGS, st.sampled_from([np.float32, jnp.bfloat16]))
def test_kernel_gpu_matches_reference(case, tuning, dtype):
    b = build(case, dtype)
    sm_scale = 1.0 / math.sqrt(case["heads"][2])
    want = run(ragged_paged_attention_reference, b, sm_scale)
    got = run(ragged_paged_attention, b, sm_scale, **tuning)
    assert_close(got, want, b, dtype, f"gpu kernel {tuning}")
    if dtype == np.float32:
        assert_close(got, oracle(b, sm_scale), b, dtype, "gpu kernel vs oracle")


@gpu
@skip_no_gpu
@pytest.mark.parametrize("bq", [None, 1, 16, 64, 128])
def test_kernel_gpu_ouro_shapes(bq):
    """Ouro-1.4B heads (H=KVH=16, hd=128, bf16, block 16), default and explicit tilings, long
    contexts (split along the context), stacked pool."""
    rng = np.random.default_rng(11)
    specs = [(1, 3000), (1, 16), (1, 17), (200, 1500), (0, 0), (64, 64), (1, 777)]
    b = make_batch(
        rng,
        num_heads=16,
        kv_heads=16,
        head_dim=128,
        block_size=16,
        seg_specs=specs,
        extra_rows=5,
        num_layers=2,
        dtype=jnp.bfloat16,
    )
    want = run(ragged_paged_attention_reference, b, 128**-0.5)
    got = run(ragged_paged_attention, b, 128**-0.5, block_q=bq)
    assert_close(got, want, b, jnp.bfloat16, f"ouro bq={bq}")


@pytest.mark.slow  # ~8 s interpreted; the compiled kernel's GPU tests split long contexts too
def test_kernel_interpret_combine_many_items():
    """A row whose context is split into more items than the combine reads per iteration
    (``combine_chunk``: 16 at 4 heads of 64), so its merge loops three times with a partial last
    chunk; beside it a decode row of 9 items and one that is not split."""
    from pallas_kernels.ragged_paged_attention import combine_chunk

    assert combine_chunk(4, 64) == 16
    rng = np.random.default_rng(11)
    specs = [(1, 37 * 16 - 5), (1, 9 * 16), (1, 12)]
    b = make_batch(rng, num_heads=4, kv_heads=4, head_dim=64, block_size=8, seg_specs=specs, extra_rows=1)
    want = oracle(b, 0.125)
    for bq in (1, 16):
        kw = dict(block_q=bq, block_k=16, min_split_tokens=16, extra_items=64)
        r = b["q"].shape[0]
        segs = [jnp.asarray(b[k]) for k in ("q_start", "q_len", "ctx_len")]
        plan = make_plan(*segs, num_rows=r, num_q_per_kv=1, tuning=default_tuning(r, 3, 4, 4, 64, **kw))
        counts = sorted(np.asarray(plan.rows)[:, 1].tolist())
        assert counts[-2:] == [9, 37], counts
        got = run(ragged_paged_attention, b, 0.125, interpret=True, **kw)
        assert_close(got, want, b, np.float32, f"block_q={bq}")


def test_combine_heads_split_small_buckets():
    """Kernel 2 splits a row's heads over programs until the grid holds ~COMBINE_TARGET_PROGRAMS:
    a one-row decode merge no longer runs on one SM."""
    assert combine_heads(8, 16) == 1  # Ouro-1.4B decode:8: 128 programs of one head
    assert combine_heads(128, 16) == 8
    assert combine_heads(256, 16) == 16 and combine_heads(1024, 16) == 16
    assert combine_heads(128, 6) == 4  # 2 programs a row; the second's heads 6 and 7 are masked
    for r, h in [(1, 1), (8, 6), (64, 40), (2048, 16)]:
        hp = combine_heads(r, h)
        assert hp & (hp - 1) == 0 and 1 <= hp <= max(1, 1 << (h - 1).bit_length())


def test_kernel_interpret_combine_head_groups_past_num_heads():
    """128 rows of 6 heads: each row's merge runs in two programs of 4 heads, the second masking
    heads 6 and 7; split rows, unsplit rows and rows of no segment all come out right."""
    rng = np.random.default_rng(3)
    specs = [(1, 300), (1, 45), (3, 90), (1, 7)]
    b = make_batch(
        rng, num_heads=6, kv_heads=2, head_dim=32, block_size=8, seg_specs=specs, extra_rows=122, gap_prob=0.0
    )
    r = b["q"].shape[0]
    assert r == 128 and combine_heads(r, 6) == 4
    kw = dict(block_q=1, block_k=16, min_split_tokens=16, extra_items=24)
    got = run(ragged_paged_attention, b, 0.2, interpret=True, **kw)
    assert_close(got, oracle(b, 0.2), b, np.float32, "head groups")
