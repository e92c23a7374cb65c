"""The split-K Mosaic GPU decode attention kernel (pallas_kernels/decode_attention_mgpu.py).

On CPU: the plan (tiles, split ranges), the jnp twin of the split decomposition (same tiles,
work items, page substitution, masks and merge as the kernel) against
``ragged_paged_attention_reference`` on drawn decode batches, the tuning and the limits, the
``mgpu_decode`` dispatch choice, and cross-lowering of the kernel for CUDA (Pallas -> Mosaic GPU
without a device: the ops, layouts, barriers and TMA slices are accepted; whether it runs, does
not deadlock and is fast only the GPU says). On the GPU (``-m gpu``): kernel == reference on drawn
decode batches and at Ouro-1.4B shapes, and kernel == its twin's partials merged.
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
from pallas_kernels.decode_attention_mgpu import (
    DecodePlan,
    decode_attention_mgpu,
    decode_attention_splits_reference,
    decode_tuning,
    make_decode_plan,
    supported,
)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.kernels.test_pallas_attention import assert_close, make_batch, run

ON_HOPPER = dispatch.hopper_available()
gpu = pytest.mark.gpu
skip_no_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper (sm90+) GPU")

# (H, KVH, hd): MHA, GQA g = 2, 3, 4, 8
HEADS = [(4, 4, 64), (4, 2, 64), (6, 2, 64), (8, 2, 64), (8, 1, 64), (2, 2, 128)]


@st.composite
def decode_batches(draw, max_ctx=300):
    """Decode-like batches: single rows, a few rows, chunks of up to 64 / g rows, padding segments,
    contexts on and off page / step / split boundaries (and shorter than one page)."""
    h, kvh, hd = draw(st.sampled_from(HEADS))
    g = h // kvh
    block_size = draw(st.sampled_from([8, 16]))
    block_kv = draw(st.sampled_from([64, 128]))
    specs = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["row", "row", "rows", "chunk", "pad"]))
        if kind == "pad":
            specs.append((0, 0))
            continue
        q_len = {"row": 1, "rows": draw(st.integers(2, 8)), "chunk": draw(st.integers(1, 64 // g))}[kind]
        edge = draw(st.sampled_from([block_size, block_kv, 2 * block_kv, 64, 128]))
        ctx = draw(
            st.one_of(
                st.integers(q_len, max_ctx),
                st.integers(1, max(1, max_ctx // edge)).map(lambda n: n * edge),  # on a boundary
                st.integers(1, block_size - 1),  # shorter than a page
            )
        )
        specs.append((q_len, max(ctx, q_len)))
    return dict(
        heads=(h, kvh, hd),
        block_size=block_size,
        specs=specs,
        extra_rows=draw(st.integers(0, 9)),
        layers=draw(st.sampled_from([None, 2])),
        knobs=dict(
            block_kv=block_kv,
            block_q=draw(st.sampled_from([8 * k for k in range(1, 64 // (8 * g) + 1)])),
            target_ctas=draw(st.sampled_from([1, 8, 40, 264, 2000])),
            min_split_tokens=draw(st.sampled_from([1, 64, 128, 200])),
        ),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _batch(case, dtype):
    h, kvh, hd = case["heads"]
    return make_batch(
        np.random.default_rng(case["seed"]),
        num_heads=h,
        kv_heads=kvh,
        head_dim=hd,
        block_size=case["block_size"],
        seg_specs=case["specs"],
        extra_rows=case["extra_rows"],
        num_layers=case["layers"],
        dtype=dtype,
        tail_poison=1e3,  # the kernel's contract: a last page's tail is finite (module docstring)
    )


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------


def _check_twin(case):
    b = _batch(case, np.float32)
    scale = 1.0 / math.sqrt(case["heads"][2])
    want = run(ragged_paged_attention_reference, b, scale)
    got = run(decode_attention_splits_reference, b, scale, **case["knobs"])
    assert_close(got, want, b, np.float32, f"twin {case}")


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_batches())
@pytest.mark.slow
def test_split_twin_matches_reference(case):
    """The kernel's decomposition (work items x KV heads, merged by log-sum-exp) in f32 is the
    reference to f32 rounding: every key is counted once, masked keys never."""
    _check_twin(case)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_batches())
def test_split_twin_matches_reference_many(case):
    _check_twin(case)


@pytest.mark.slow
def test_split_twin_bf16_and_default_knobs():
    """bf16 as the kernel runs it (bf16 probabilities into P.V), default knobs of an S = R bucket."""
    rng = np.random.default_rng(3)
    specs = [(1, 700), (1, 16), (0, 0), (4, 333), (8, 129), (1, 5)]
    b = make_batch(
        rng,
        num_heads=4,
        kv_heads=2,
        head_dim=64,
        block_size=16,
        seg_specs=specs,
        extra_rows=4,
        num_layers=3,
        dtype=jnp.bfloat16,
        tail_poison=1e3,
    )
    want = run(ragged_paged_attention_reference, b, 0.125)
    got = run(decode_attention_splits_reference, b, 0.125)
    assert_close(got, want, b, jnp.bfloat16, "twin bf16")


AWKWARD = {
    # (H, KVH, hd), specs, extra rows: engine-like S = R buckets with padding segments
    "1 active row in an 8-row bucket": ((16, 16, 64), [(1, 4096)] + [(0, 0)] * 7, 7),
    "mixed contexts: 1 token, page edges, 4K": ((8, 4, 64), [(1, 1), (1, 16), (1, 17), (1, 4096), (1, 128)], 3),
    "empty segments between rows": ((4, 2, 128), [(0, 0), (1, 300), (0, 0), (0, 0), (1, 64), (0, 0)], 4),
    "GQA g=4": ((8, 2, 64), [(1, 2000), (1, 33), (0, 0)], 5),
    "GQA g=8": ((8, 1, 64), [(1, 1500), (1, 1), (1, 640)], 5),
    "a short prompt among decode rows": ((4, 2, 64), [(1, 900), (7, 40), (1, 2), (0, 0)], 6),
}


# all in the slow suite (CPU time: the kernel is off by default, ``dispatch.MGPU_DECODE_MAX_ROWS = 0``;
# its plans and its CUDA lowering keep default-suite tests)
FAST_AWKWARD = ()


@pytest.mark.parametrize("name", [n if n in FAST_AWKWARD else pytest.param(n, marks=pytest.mark.slow) for n in AWKWARD])
def test_split_twin_awkward_batches(name):
    """The twin with default (dynamic) splits on engine-like batches: padding segments, contexts
    on and off page / step boundaries, one long row next to short ones, GQA, a prompt chunk."""
    (h, kvh, hd), specs, extra = AWKWARD[name]
    b = make_batch(
        np.random.default_rng(len(name)),
        num_heads=h,
        kv_heads=kvh,
        head_dim=hd,
        block_size=16,
        seg_specs=specs,
        extra_rows=extra,
        num_layers=2,
        tail_poison=1e3,
    )
    scale = hd**-0.5
    want = run(ragged_paged_attention_reference, b, scale)
    got = run(decode_attention_splits_reference, b, scale)
    assert_close(got, want, b, np.float32, name)


_jit_plan = jax.jit(make_decode_plan, static_argnames=("num_rows", "tuning"))


def _plan(q_len, ctx, q_start=None, num_rows=None, kvh=16, mb=None, **knobs):
    q_len = np.asarray(q_len, np.int32)
    ctx = np.asarray(ctx, np.int32)
    if q_start is None:
        q_start = np.concatenate([[0], np.cumsum(q_len)[:-1]]).astype(np.int32)
    num_rows = num_rows or max(1, int(q_len.sum()))
    mb = mb or max(1, -(-int(ctx.max()) // 16))
    table = np.arange(len(q_len) * mb, dtype=np.int32).reshape(len(q_len), mb)
    t = decode_tuning(num_rows, len(q_len), 16, kvh, mb, 16, **knobs)
    plan = _jit_plan(
        jnp.asarray(q_start), jnp.asarray(q_len), jnp.asarray(ctx), jnp.asarray(table), num_rows=num_rows, tuning=t
    )
    return plan, t


def _runs(plan: DecodePlan):
    """``{(seg, row0): (nrows, pos0, [(k0, k1), ...])}`` per tile, from the plan's items, in order."""
    items = np.asarray(plan.meta[: plan.num_items * 8]).reshape(plan.num_items, 8)
    tiles = {}
    for seg, row0, nrows, pos0, k0, k1, _, _ in items:
        if nrows == 0:
            assert k0 == k1 == 0, "padding items are empty"
            continue
        tiles.setdefault((int(seg), int(row0)), (int(nrows), int(pos0), []))[2].append((int(k0), int(k1)))
    return tiles


def _check_plan(plan: DecodePlan, t, q_len):
    """Every tile's runs are contiguous items, whole K/V steps, non-empty, balanced to a step, no
    shorter than ``min_split_tokens`` unless the context is, at most ``max_splits`` of them, and
    cover ``[0, pos0 + nrows)`` exactly; every row finds its tile's items; the items fit the grid."""
    tiles = _runs(plan)
    min_steps = t.min_split_tokens // t.block_kv
    for nrows, pos0, runs in tiles.values():
        kv_len = pos0 + nrows
        assert 1 <= len(runs) <= t.max_splits
        assert runs[0][0] == 0 and runs[-1][1] == kv_len
        assert all(r[1] == n[0] for r, n in zip(runs, runs[1:])), runs
        assert all(k0 % t.block_kv == 0 and k1 > k0 for k0, k1 in runs)
        steps = [-(-(k1 - k0) // t.block_kv) for k0, k1 in runs]
        assert max(steps) - min(steps) <= 1, steps
        if len(runs) > 1:
            assert min(steps) >= min_steps, (steps, min_steps)
    assert sum(len(r[2]) for r in tiles.values()) <= t.num_items
    assert sum(r[0] for r in tiles.values()) == sum(q_len)
    item_tile, row_tile, local = (np.asarray(a) for a in (plan.item_tile, plan.row_tile, plan.row_local))
    items = np.asarray(plan.meta[: plan.num_items * 8]).reshape(plan.num_items, 8)
    real = items[:, 2] > 0
    assert (item_tile[real] < t.num_tiles).all() and (item_tile[~real] == t.num_tiles).all()
    assert (np.diff(item_tile) >= 0).all(), "items come tile by tile (sorted segment ids)"
    for r in range(len(row_tile)):
        if row_tile[r] < 0:
            continue
        mine = items[item_tile == row_tile[r]]
        assert len(mine) and (mine[:, 1] + local[r] == r).all() and (local[r] < mine[:, 2]).all()
        assert len(tiles[int(mine[0, 0]), int(mine[0, 1])][2]) == len(mine)
    assert (row_tile >= 0).sum() == sum(q_len)
    return tiles


@pytest.mark.parametrize(
    "q_len,ctx,knobs",
    [
        ([1], [4096], {}),
        pytest.param([1], [100], {}, marks=pytest.mark.slow),
        ([1, 1, 0, 3], [1, 1000, 7, 64], dict(target_ctas=64)),
        pytest.param([8, 1], [2048, 129], dict(target_ctas=80, min_split_tokens=64), marks=pytest.mark.slow),
        pytest.param([20], [20], dict(block_q=8, target_ctas=48, min_split_tokens=1), marks=pytest.mark.slow),
        ([1] * 8, [1, 16, 17, 64, 65, 4096, 4000, 129], {}),
    ],
)
def test_plan_items_cover_each_tile_context_once(q_len, ctx, knobs):
    plan, t = _plan(q_len, ctx, **knobs)
    _check_plan(plan, t, q_len)


def test_plan_follows_the_active_work():
    """An 8-row bucket (Ouro: 16 KV heads, 4K table): the item count follows the active rows, not
    the bucket; long contexts get the splits; runs never drop below ``min_split_tokens``."""
    pad = dict(q_start=None, num_rows=8)
    one, t = _plan([1] + [0] * 7, [4096] + [0] * 7, **pad)  # 1 stream: 16 x 16 CTAs of 4 steps
    assert (t.num_items, t.max_splits) == (17, 16)
    assert [len(r[2]) for r in _runs(one).values()] == [16]
    short, _ = _plan([1] + [0] * 7, [1024] + [0] * 7, **pad)  # 1K: 8 runs of the 128-token minimum
    assert [len(r[2]) for r in _runs(short).values()] == [8]
    full, _ = _plan([1] * 8, [4096] * 8)  # 8 streams: 2 runs each, 256 CTAs
    assert [len(r[2]) for r in _runs(full).values()] == [2] * 8
    mixed, tm = _plan([1] * 4 + [0] * 4, [4096, 64, 1, 2048] + [0] * 4, **pad)
    n = {row0: len(r[2]) for (_, row0), r in _runs(mixed).items()}
    assert n[0] > n[3] > n[1] == n[2] == 1 and sum(n.values()) <= tm.target_items
    _check_plan(mixed, tm, [1] * 4)
    big, t = _plan([1] * 32, [4096] * 32)  # more tiles than the target: one item each
    assert t.num_items == 32 and [len(r[2]) for r in _runs(big).values()] == [1] * 32


PLAN_LOADS = st.tuples(
    st.lists(st.tuples(st.sampled_from([0, 1, 1, 1, 2, 8, 20]), st.integers(0, 5000)), min_size=1, max_size=12),
    st.sampled_from([2, 4, 16]),  # KV heads of 16 query heads: g = 8, 4, 1
    st.sampled_from([1, 16, 100, 264, 1000]),  # target_ctas
    st.sampled_from([1, 64, 128, 500]),  # min_split_tokens
    st.sampled_from([64, 128]),  # block_kv
    st.integers(0, 1),  # spare rows (x 6)
)


def _check_load(load):
    specs, kvh, target, min_split, block_kv, extra = load
    specs = specs + [(0, 0)] * (12 - len(specs))  # fixed shapes: one compilation per tuning
    q_len = [q for q, _ in specs]
    ctx = [max(c, q) if q else c for q, c in specs]
    plan, t = _plan(
        q_len, ctx, num_rows=12 * 20 + 6 * extra, kvh=kvh, mb=313, target_ctas=target, min_split_tokens=min_split,
        block_kv=block_kv,
    )  # fmt: skip
    _check_plan(plan, t, q_len)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PLAN_LOADS)
def test_plan_bounds_hold_for_any_load(load):
    """The static item count and per-tile bound of ``decode_tuning`` hold for any segments: no
    item is dropped (every context covered), none exceeds the merge's gather width."""
    _check_load(load)


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PLAN_LOADS)
def test_plan_bounds_hold_for_any_load_many(load):
    _check_load(load)


def test_plan_empty_rows_and_padding_segments():
    plan, _ = _plan([0, 2, 0], [50, 40, 9], q_start=[0, 3, 1], num_rows=7)
    np.testing.assert_array_equal(np.asarray(plan.row_tile) >= 0, [0, 0, 0, 1, 1, 0, 0])


def test_decode_tuning_defaults():
    """Engine buckets (S = R): 8-row tiles, 64-token steps; the static item count is
    ``max(tiles, ceil(264 / KVH))`` (capped by the runs a context can hold)."""
    t1 = decode_tuning(1, 1, 16, 16, 256, 16)
    assert (t1.block_q, t1.block_kv, t1.num_items, t1.max_splits) == (8, 64, 16, 16)
    assert decode_tuning(1, 1, 16, 16, 4, 16).num_items == 1  # a 64-token context: one run
    assert decode_tuning(1, 1, 16, 16, 16, 16).num_items == 2  # 256 tokens: two runs of 128
    assert decode_tuning(8, 8, 16, 16, 256, 16).num_items == 17
    assert decode_tuning(16, 16, 16, 16, 256, 16).num_items == 17
    assert decode_tuning(128, 128, 16, 16, 256, 16).num_items == 128
    t = decode_tuning(8, 8, 8, 2, 256, 16)  # g = 4: 132 items aimed at, 64 runs at most per tile
    assert (t.target_items, t.max_splits, t.num_items) == (132, 32, 132)
    assert decode_tuning(8, 8, 16, 16, 256, 16, target_ctas=528).num_items == 33
    assert decode_tuning(8, 8, 16, 16, 256, 16, min_split_tokens=100).min_split_tokens == 128  # whole steps
    assert decode_tuning(64, 1, 16, 16, 256, 16).block_q == 64  # one segment of 64 rows: one tile
    assert decode_tuning(64, 1, 8, 2, 256, 16).block_q == 16  # g = 4
    assert decode_tuning(8, 8, 16, 16, 8, 128).block_kv == 128  # pages of 128 tokens
    with pytest.raises(ValueError, match="block_q"):
        decode_tuning(8, 8, 8, 2, 256, 16, block_q=32)  # 32 x 4 > 64
    with pytest.raises(ValueError, match="block_q"):
        decode_tuning(8, 8, 16, 16, 256, 16, block_q=12)
    with pytest.raises(ValueError, match="target_ctas"):
        decode_tuning(8, 8, 16, 16, 256, 16, target_ctas=0)
    with pytest.raises(ValueError, match="block_kv"):
        decode_tuning(8, 8, 16, 16, 256, 16, block_kv=40)


def test_supported_and_refused_launches():
    assert supported(jnp.bfloat16, 128, 16) is None
    assert supported(jnp.float16, 64, 8, 8) is None
    assert "dtype" in supported(jnp.float32, 128, 16)
    assert "head_dim" in supported(jnp.bfloat16, 96, 16)
    assert "block_size" in supported(jnp.bfloat16, 128, 4)
    assert "block_kv 32" in supported(jnp.bfloat16, 128, 16, block_kv=32)
    assert "query heads" in supported(jnp.bfloat16, 128, 16, 16)
    z = jnp.zeros((1,), jnp.int32)
    table = jnp.zeros((1, 4), jnp.int32)
    kp = jnp.zeros((2, 8, 16, 64), jnp.float32)
    with pytest.raises(ValueError, match="dtype float32"):
        decode_attention_mgpu(jnp.zeros((4, 2, 64), jnp.float32), kp, kp, z, z, z, table, sm_scale=0.1)
    kp = kp.astype(jnp.bfloat16)
    q = jnp.zeros((4, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        decode_attention_mgpu(q, kp, kp, z, z, z, table, sm_scale=0.1, block_kv=256, max_concurrent_steps=4)
    with pytest.raises(ValueError, match="query heads"):
        decode_attention_mgpu(jnp.zeros((4, 32, 64), jnp.bfloat16), kp[:1], kp[:1], z, z, z, table, sm_scale=0.1)


def test_dispatch_mgpu_decode_choice(monkeypatch):
    """Forced ``mgpu_decode`` takes the buckets the rule gives to Triton, on Hopper, where the
    kernel's limits allow; elsewhere the rule's answer stands. It is no bucket's default."""
    monkeypatch.delenv("OURO_JAX_ATTENTION_KERNEL", raising=False)
    sel = dispatch.select_kernel
    assert "mgpu_decode" not in {
        sel(r, s, jnp.bfloat16, 128, 16, hopper=True) for r, s in [(1, 1), (8, 8), (128, 128), (1024, 1024)]
    }
    monkeypatch.setenv("OURO_JAX_ATTENTION_KERNEL", "MGPU_DECODE")
    assert sel(8, 8, jnp.bfloat16, 128, 16, hopper=True) == "mgpu_decode"
    assert sel(128, 128, jnp.bfloat16, 128, 16, hopper=True) == "mgpu_decode"
    assert sel(8, 8, jnp.bfloat16, 128, 16, num_heads=8, num_kv_heads=2, hopper=True) == "mgpu_decode"
    assert sel(1024, 1, jnp.bfloat16, 128, 16, hopper=True) == "mgpu"  # a long prompt: the rule's
    assert sel(1024, 1024, jnp.bfloat16, 128, 16, hopper=True) == "hybrid"
    assert sel(8, 8, jnp.float32, 128, 16, hopper=True) == "triton"  # dtype
    assert sel(8, 8, jnp.bfloat16, 128, 16, num_heads=16, num_kv_heads=1, hopper=True) == "triton"  # g = 16
    assert sel(8, 8, jnp.bfloat16, 128, 16, hopper=False) == "triton"
    monkeypatch.delenv("OURO_JAX_ATTENTION_KERNEL")
    kw = dict(num_rows=8, num_segments=8, num_heads=16, num_kv_heads=16, head_dim=128, block_size=16)
    k = dispatch.choose_attention("mgpu_decode", dtype=jnp.bfloat16, **kw)
    assert k.name == ("mgpu_decode" if ON_HOPPER else "triton")
    assert dispatch.choose_attention("mgpu_decode", dtype=jnp.float32, **kw).name == "triton"
    with pytest.raises(ValueError, match="interpret"):
        dispatch.AttentionKernel("mgpu_decode", 8, 16, 16, 128, interpret=True, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        dispatch.AttentionKernel("mgpu_decode", 8, 16, 16, 128)


@pytest.mark.slow
def test_dispatch_plan_drives_the_twin():
    """The dispatcher's per-invocation plan (built once, shared by every layer) has the bucket's
    tuning, and the twin run with it is the reference."""
    rng = np.random.default_rng(5)
    b = make_batch(
        rng,
        num_heads=4,
        kv_heads=2,
        head_dim=64,
        block_size=8,
        seg_specs=[(1, 300), (1, 9), (2, 64)],
        extra_rows=2,
        num_layers=2,
        tail_poison=1e3,
    )
    r = b["q"].shape[0]
    kernel = dispatch.AttentionKernel("mgpu_decode", r, 4, 2, 64, block_size=8)
    seg = [jnp.asarray(b[k]) for k in ("q_start", "q_len", "ctx_len", "tables")]
    plan = kernel.plan(*seg)
    t = kernel.decode_tuning(*b["tables"].shape)
    assert isinstance(plan, DecodePlan) and plan.tuning == t
    want = run(ragged_paged_attention_reference, b, 0.125)
    got = run(functools.partial(decode_attention_splits_reference, plan=plan), b, 0.125)
    assert_close(got, want, b, np.float32, "twin with the dispatcher's plan")
    with pytest.raises(ValueError, match="plan built for"):
        run(functools.partial(decode_attention_splits_reference, plan=plan, block_kv=128), b, 0.125)
    with pytest.raises(ValueError, match="another bucket"):  # a plan of a wider block table
        other = kernel.plan(*seg[:3], jnp.pad(seg[3], ((0, 0), (0, 64))))
        run(functools.partial(decode_attention_splits_reference, plan=other), b, 0.125)


def _lower(r, s, h, kvh, hd, mb, bs, layered, **knobs):
    sd = jax.ShapeDtypeStruct
    shape = (3, kvh, 2 * s * mb + 1, bs, hd) if layered else (kvh, 2 * s * mb + 1, bs, hd)
    args = [sd((r, h, hd), jnp.bfloat16), sd(shape, jnp.bfloat16), sd(shape, jnp.bfloat16)]
    args += [sd((s,), jnp.int32)] * 3 + [sd((s, mb), jnp.int32)]
    if layered:
        args.append(sd((), jnp.int32))

        def f(q, k, v, a, b, c, d, lyr):
            return decode_attention_mgpu(q, k, v, a, b, c, d, layer=lyr, sm_scale=0.1, **knobs)
    else:

        def f(q, k, v, a, b, c, d):
            return decode_attention_mgpu(q, k, v, a, b, c, d, sm_scale=0.1, **knobs)

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize(
    "r,s,mb",
    [(1, 1, 256), (8, 8, 256)]
    + [
        pytest.param(*a, marks=pytest.mark.slow)
        for a in [(16, 16, 256), (32, 32, 256), (128, 128, 256), (8, 8, 512), (64, 1, 64)]
    ],
)
def test_mosaic_lowering_ouro_shapes(r, s, mb):
    """Ouro-1.4B (16 heads = KV heads, head_dim 128, pages of 16, stacked pool): 1 / 8 / 16 / 32 /
    128 rows of an engine bucket at up to 4K (8K) context, and one 64-row segment."""
    _lower(r, s, 16, 16, 128, mb, 16, True)


@pytest.mark.parametrize(
    "h,kvh,hd,bs,layered,knobs",
    [
        (8, 2, 64, 8, False, {}),
        pytest.param(8, 1, 64, 16, False, {}, marks=pytest.mark.slow),
        pytest.param(6, 2, 128, 16, True, dict(block_q=16), marks=pytest.mark.slow),
        (4, 4, 64, 16, True, dict(block_kv=128, max_concurrent_steps=3, target_ctas=64)),
        pytest.param(
            16,
            16,
            128,
            16,
            True,
            dict(block_kv=64, max_concurrent_steps=4, min_split_tokens=64),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_mosaic_lowering_test_shapes(h, kvh, hd, bs, layered, knobs):
    """GQA g = 4 / 8 / 3, head_dim 64 / 128, pages of 8, a 4-D pool, other step shapes."""
    _lower(9, 4, h, kvh, hd, 40, bs, layered, **knobs)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@gpu
@skip_no_hopper
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(decode_batches(max_ctx=1200))
def test_mgpu_decode_matches_reference(case):
    b = _batch(case, jnp.bfloat16)
    scale = 1.0 / math.sqrt(case["heads"][2])
    want = run(ragged_paged_attention_reference, b, scale)
    got = run(decode_attention_mgpu, b, scale, **case["knobs"])
    assert_close(got, want, b, jnp.bfloat16, f"mgpu_decode {case}")
    twin = run(decode_attention_splits_reference, b, scale, **case["knobs"])
    assert_close(got, twin, b, jnp.bfloat16, f"mgpu_decode vs its twin {case}")


@gpu
@skip_no_hopper
@pytest.mark.parametrize(
    "specs,extra",
    [
        ([(1, 4096)], 0),  # one stream at 4K
        ([(1, 4096)] + [(0, 0)] * 7, 7),  # one stream in an 8-row bucket: 16 items of the 17
        ([(1, 4096), (1, 1), (1, 17), (1, 1024)] + [(0, 0)] * 12, 12),  # mixed, 16-row bucket
        ([(1, 1024)] * 8, 0),  # 8 streams at 1K
        ([(1, 2048 + 7 * i) for i in range(8)], 0),  # off page boundaries
        ([(1, 513 + 61 * i) for i in range(100)] + [(0, 0)] * 28, 28),  # 100 streams in a 128 bucket
        ([(64, 2048), (1, 900), (3, 17), (0, 0)], 9),  # a 64-row chunk next to decode rows
    ],
)
def test_mgpu_decode_ouro_shapes(specs, extra):
    rng = np.random.default_rng(11)
    b = make_batch(
        rng,
        num_heads=16,
        kv_heads=16,
        head_dim=128,
        block_size=16,
        seg_specs=specs,
        extra_rows=extra,
        num_layers=3,
        dtype=jnp.bfloat16,
        tail_poison=1e3,
    )
    want = run(ragged_paged_attention_reference, b, 128**-0.5)
    # as the engine runs it: S = R segment slots (padding segments past the real ones)
    r = b["q"].shape[0]
    s = len(specs)
    pad = max(0, r - s)
    b["q_start"] = np.concatenate([b["q_start"], np.zeros(pad, np.int32)])
    b["q_len"] = np.concatenate([b["q_len"], np.zeros(pad, np.int32)])
    b["ctx_len"] = np.concatenate([b["ctx_len"], np.zeros(pad, np.int32)])
    b["tables"] = np.concatenate([b["tables"], np.zeros((pad, b["tables"].shape[1]), np.int32)])
    kernel = dispatch.AttentionKernel("mgpu_decode", r, 16, 16, 128, block_size=16)
    plan = kernel.plan(*(jnp.asarray(b[k]) for k in ("q_start", "q_len", "ctx_len", "tables")))
    got = run(functools.partial(kernel, plan=plan), b, 128**-0.5)
    assert_close(got, want, b, jnp.bfloat16, f"mgpu_decode ouro {specs[:3]}")
    got2 = run(decode_attention_mgpu, b, 128**-0.5)
    np.testing.assert_array_equal(got2, got)
