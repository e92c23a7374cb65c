"""The "hybrid" attention split (pallas_kernels/dispatch.py): in one invocation, segments of at least
``HYBRID_MIN_SEGMENT_ROWS`` rows go to the Mosaic GPU kernel and every other segment to the Triton
kernel; each writes its own rows of one array.

On CPU: (a) the Triton half (Pallas interpret mode) gives reference values on rows of short
segments and zeros on rows of long segments and of no segment, and both halves together give the
reference on every row (the Mosaic half interpreted too, or stood in for by the reference on its
segments' rows);
(b) the Mosaic half's packing covers exactly the rows of long segments within the small static
tile bound, on adversarial layouts too; (c) the whole hybrid path, one plan for two layers,
cross-lowers for CUDA at an engine bucket (R = S = 512, 256 block-table columns); (d) the dispatch
rule, the forced choice and the interpret-mode refusal. On a Hopper GPU (``-m gpu``): hybrid ==
reference on hypothesis-drawn mixes of long and short segments.
"""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pallas_kernels import dispatch
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_mgpu import ALIGN, TILE_FIELDS, make_packing, mgpu_tiles, packed_tiles
from tests.kernels.conftest import assert_close, make_batch, pad_batch, skip_no_hopper

gpu = pytest.mark.gpu
LONG = dispatch.HYBRID_MIN_SEGMENT_ROWS


# ----------------------------------------------------------------------------------------------
# Batches: decode rows, short and long segments, padding segments, GQA, optionally S = R
# ----------------------------------------------------------------------------------------------


@st.composite
def mixed_batches(draw, heads, block_sizes=(8, 16), layers=(None, 2), max_segments=4, max_long=200, max_extra=40):
    h, kvh, hd = draw(st.sampled_from(heads))
    specs = []
    for _ in range(draw(st.integers(1, max_segments))):
        kind = draw(st.sampled_from(["decode", "short", "long", "long", "pad"]))
        if kind == "pad":
            specs.append((0, 0))
        elif kind == "decode":
            specs.append((1, draw(st.integers(1, 150))))
        else:
            n = draw(st.integers(1, LONG - 1) if kind == "short" else st.integers(LONG, max_long))
            specs.append((n, n + draw(st.sampled_from([0, 0, 1, 37, 100]))))  # fresh or with history
    return dict(
        heads=(h, kvh, hd),
        block_size=draw(st.sampled_from(block_sizes)),
        specs=specs,
        extra_rows=draw(st.integers(0, max_extra)),
        layers=draw(st.sampled_from(layers)),
        engine=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build(case, dtype, tail_poison=np.nan, fixed=None):
    """The batch of ``case``; ``fixed=(R, MB, NB)`` pads rows, block-table columns and pool pages to
    fixed sizes (NaN rows and pages, read by no segment) so that examples share compilations."""
    h, kvh, hd = case["heads"]
    b = make_batch(
        np.random.default_rng(case["seed"]),
        num_heads=h,
        kv_heads=kvh,
        head_dim=hd,
        block_size=case["block_size"],
        seg_specs=case["specs"],
        extra_rows=case["extra_rows"],
        num_layers=case["layers"],
        dtype=dtype,
        tail_poison=tail_poison,
    )
    if fixed is not None:
        b = pad_batch(b, *fixed)
    r, s = b["q"].shape[0], len(case["specs"])
    # the engine's buckets: as many segment slots as rows; otherwise a fixed 8 (padding segments)
    pad = max((r if case["engine"] else 8) - s, 0)
    b["q_start"] = np.concatenate([b["q_start"], np.arange(pad, dtype=np.int32) % r])
    b["q_len"] = np.concatenate([b["q_len"], np.zeros(pad, np.int32)])
    b["ctx_len"] = np.concatenate([b["ctx_len"], np.full(pad, 3, np.int32)])
    b["tables"] = np.concatenate([b["tables"], np.zeros((pad, b["tables"].shape[1]), np.int32)])
    long_row = np.zeros(r, bool)
    for s0, n in zip(b["q_start"], b["q_len"]):
        if n >= LONG:
            long_row[s0 : s0 + n] = True
    b["long_row"] = long_row
    return b


def call(fn, b, sm_scale, q_len=None, **kw):
    layer = None if b["layer"] is None else jnp.int32(b["layer"])
    q_len = b["q_len"] if q_len is None else q_len
    return np.asarray(
        fn(
            jnp.asarray(b["q"]),
            jnp.asarray(b["k"]),
            jnp.asarray(b["v"]),
            jnp.asarray(b["q_start"]),
            jnp.asarray(q_len),
            jnp.asarray(b["ctx_len"]),
            jnp.asarray(b["tables"]),
            layer=layer,
            sm_scale=sm_scale,
            **kw,
        ),
        np.float32,
    )


def reference(b, case, sm_scale):
    """The jnp reference on the batch's own segments (and padding up to 8): the padding segments
    of an ``S = R`` batch change nothing but would make it gather a context per row (its tiles
    follow ``R / S``)."""
    n = max(8, len(case["specs"]))
    trimmed = dict(b, q_start=b["q_start"][:n], q_len=b["q_len"][:n], ctx_len=b["ctx_len"][:n], tables=b["tables"][:n])
    return call(ragged_paged_attention_reference, trimmed, sm_scale)


# one compilation per shape (op by op, the plan's many small ops compile one at a time)
make_plan = jax.jit(lambda kernel, *seg: kernel.plan(*seg), static_argnums=0)


def plan_for(b):
    h, hd = b["q"].shape[1:]
    return make_plan(
        dispatch.AttentionKernel("hybrid", b["q"].shape[0], h, b["k"].shape[-4], hd),
        jnp.asarray(b["q_start"]),
        jnp.asarray(b["q_len"]),
        jnp.asarray(b["ctx_len"]),
        jnp.asarray(b["tables"]),
    )


def reference_mgpu_half(q, k, v, qs, ql, cl, bt, *, layer=None, sm_scale, packing, out=None):
    """Stand-in for the Mosaic launch on CPU: the reference on the rows of its segments, ``out``
    (zeros by default) on every other row."""
    del packing
    ref = ragged_paged_attention_reference(q, k, v, qs, ql, cl, bt, layer=layer, sm_scale=sm_scale)
    rows = jnp.arange(q.shape[0])[:, None]
    mine = ((rows >= qs[None, :]) & (rows < qs[None, :] + ql[None, :])).any(axis=1)
    base = jnp.zeros_like(q) if out is None else out
    return jnp.where(mine[:, None, None], ref, base)


# ----------------------------------------------------------------------------------------------
# (a) the segment split: Triton half and both halves (CPU, interpret mode)
# ----------------------------------------------------------------------------------------------


# Fixed shapes on CPU (every new shape compiles the interpreted kernel, ~1-2 s): up to 4
# segments of <= 180 rows with <= 100 rows of history, 8-token pages, 4 query heads on 2 KV heads,
# a 2-layer pool; rows, table columns and pages padded to the sizes below.
CPU_FIXED = (768, 40, 160)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_batches(heads=[(4, 2, 64)], block_sizes=[8], layers=[2], max_long=180, max_extra=24))
def test_triton_half_serves_short_segments_and_both_give_reference(case):
    b = build(case, np.float32, fixed=CPU_FIXED)
    scale = 1.0 / math.sqrt(case["heads"][2])
    plan = plan_for(b)
    want = reference(b, case, scale)
    # Triton half alone: its plan and its q_len (long segments are padding to it)
    got_t = call(
        dispatch.AttentionKernel("triton", b["q"].shape[0], *case["heads"], interpret=True),
        b,
        scale,
        q_len=plan.triton_q_len,
        plan=plan.triton,
    )
    short = b["covered"] & ~b["long_row"]
    assert not np.isnan(got_t).any()
    np.testing.assert_array_equal(got_t[~short], 0.0, err_msg="the Triton half wrote a row it does not own")
    err = np.abs(got_t[short] - want[short]).max(initial=0.0)
    assert err <= 2e-5 * max(1.0, np.abs(want).max()), f"Triton half: max abs err {err}"
    # both halves, with the Mosaic half stood in for by the reference on its rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch.mgpu, "ragged_paged_attention_mgpu", reference_mgpu_half)
        got = call(dispatch.hybrid_attention, b, scale, plan=plan, triton_interpret=True)
    assert_close(got, want, b, np.float32, f"hybrid {case}")


def test_both_halves_interpreted_write_only_their_rows(mosaic_attention_interpret):
    """Both kernels in Pallas' interpreters (the Mosaic half with wgmma stood in for), bf16: decode
    rows, a short chunk and long segments packed back to back off the 8-row grid, padding rows; the
    reference on every segment row and zeros on the others, with no merge between the halves."""
    case = dict(
        heads=(2, 1, 64),
        block_size=8,
        specs=[(LONG + 5, LONG + 40), (1, 30), (3, 3), (LONG, LONG), (0, 0), (1, 7)],
        extra_rows=6,
        layers=2,
        engine=False,
        seed=3,
    )
    b = build(case, jnp.bfloat16, tail_poison=1e3)
    scale = 1.0 / math.sqrt(case["heads"][2])
    want = reference(b, case, scale)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch.mgpu, "ragged_paged_attention_mgpu", mosaic_attention_interpret)
        got = call(dispatch.hybrid_attention, b, scale, plan=plan_for(b), triton_interpret=True)
    assert b["long_row"].any() and (b["covered"] & ~b["long_row"]).any()
    assert_close(got, want, b, jnp.bfloat16, "hybrid, both halves interpreted")


@pytest.mark.slow
def test_triton_half_writes_into_the_mosaic_half_on_one_mix():
    """Slow-suite case of the test above: decode rows, a short chunk, two long segments (one with
    history, one crossing a 128-row tile), padding rows; the Triton half's two kernels write their
    rows into the Mosaic half's output and nothing else is touched."""
    case = dict(
        heads=(4, 2, 64),
        block_size=8,
        specs=[(1, 40), (LONG + 3, LONG + 103), (5, 5), (130, 130), (0, 0), (1, 7)],
        extra_rows=9,
        layers=2,
        engine=False,
        seed=7,
    )
    b = build(case, np.float32, fixed=CPU_FIXED)
    scale = 1.0 / math.sqrt(case["heads"][2])
    plan = plan_for(b)
    want = reference(b, case, scale)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch.mgpu, "ragged_paged_attention_mgpu", reference_mgpu_half)
        got = call(dispatch.hybrid_attention, b, scale, plan=plan, triton_interpret=True)
    assert not np.isnan(got[b["covered"]]).any()
    np.testing.assert_array_equal(got[~b["covered"]], 0.0, err_msg="a row of no segment is not zero")
    assert_close(got, want, b, np.float32, "hybrid")


# ----------------------------------------------------------------------------------------------
# (b) the Mosaic half's packing and its static tile bound
# ----------------------------------------------------------------------------------------------


def check_packing(lens, num_rows, num_segments=None, gaps=None):
    """Lay the segments out in order (with ``gaps`` rows between them), pad to ``num_segments``
    slots, build the hybrid plan and check the Mosaic packing against the layout."""
    s_real = len(lens)
    num_segments = num_segments or max(s_real, 1)
    gaps = gaps or [0] * s_real
    starts, row = [], 0
    for n, gap in zip(lens, gaps):
        row += gap
        starts.append(row)
        row += n
    assert row <= num_rows
    pad = num_segments - s_real
    qs = np.array(starts + [0] * pad, np.int32)
    ql = np.array(list(lens) + [0] * pad, np.int32)
    cl = np.array([n + 5 for n in lens] + [0] * pad, np.int32)
    table = np.zeros((num_segments, 2), np.int32)
    kernel = dispatch.AttentionKernel("hybrid", num_rows, 2, 2, 64)
    plan = make_plan(kernel, jnp.asarray(qs), jnp.asarray(ql), jnp.asarray(cl), jnp.asarray(table))
    bound = dispatch.hybrid_tiles(num_rows, num_segments)
    # at most R // LONG segments reach the Mosaic launch, each needing ceil(n / 128) tiles
    assert bound <= max(1, (num_rows + (num_rows // LONG) * (127 + ALIGN - 1)) // 128), (num_rows, bound)
    assert bound < max(2, num_rows // 16), (num_rows, bound)  # far below one tile per row
    assert packed_tiles(plan.mgpu, table) == bound
    tiles = np.asarray(plan.mgpu.meta[: TILE_FIELDS * bound]).reshape(bound, TILE_FIELDS)
    # every row of a long segment in exactly one window, nothing else
    owned = np.zeros(num_rows, np.int32)
    for seg, row0, nrows, _, lead in tiles:
        owned[row0 + lead : row0 + nrows] += 1
    long_row = np.zeros(num_rows, bool)
    for s0, n in zip(starts, lens):
        if n >= LONG:
            long_row[s0 : s0 + n] = True
    np.testing.assert_array_equal(owned, long_row.astype(np.int32), err_msg="a long row dropped or twice")
    # windows start at a multiple of ALIGN: a segment's first one begins up to ALIGN - 1 rows early
    needed = sum(-(-(n + s0 % ALIGN) // 128) for s0, n in zip(starts, lens) if n >= LONG)
    assert (tiles[:, 2] > 0).sum() == needed <= bound
    for seg, row0, nrows, pos0, lead in tiles:
        if nrows:
            assert ql[seg] >= LONG and 0 < nrows <= 128 and row0 % ALIGN == 0
            assert qs[seg] - qs[seg] % ALIGN <= row0 and row0 + nrows <= qs[seg] + ql[seg]
            assert pos0 == cl[seg] - ql[seg] + (row0 - qs[seg])
            assert lead == max(qs[seg] - row0, 0)
    # the Triton half gets everything else
    tq = np.asarray(plan.triton_q_len)
    np.testing.assert_array_equal(tq, np.where(ql >= LONG, 0, ql))
    np.testing.assert_array_equal(np.asarray(plan.mgpu_q_len), np.where(ql >= LONG, ql, 0))
    return needed, bound


@pytest.mark.parametrize("r", [256, 512, 1024, 2048])
def test_tile_bound_on_adversarial_layouts(r):
    """Engine buckets (S = R): segments of exactly 128 rows (full tiles), of 129 (two tiles, the
    second of one row), of the threshold's rows (one tile each: the most tiles R rows can need),
    129/threshold-1 alternating (short ones stay on Triton), one segment of R rows, no long segment
    at all, decode rows only."""
    layouts = {
        "128s": [128] * (r // 128),
        "129s": [129] * (r // 129),
        "LONGs": [LONG] * (r // LONG),
        "129/short": [129, LONG - 1] * (r // (128 + LONG)),
        "one": [r],
        "none": [LONG - 1] * (r // (LONG - 1)),
        "decode": [1] * r,
        "mixed": [1, 200, 64, 1, 128, 3] * (r // 400) or [1, 129],
    }
    for name, lens in layouts.items():
        needed, bound = check_packing(lens, r, num_segments=r)
        if name == "LONGs":
            tight = (r + (r // LONG) * (ALIGN - 1)) // 128 + 1
            assert needed == r // LONG and bound - needed <= tight, "the bound should be nearly tight"
    # the generic bound (any segment lengths) would launch one tile per row
    assert mgpu_tiles(r, r) == r and dispatch.hybrid_tiles(r, r) < r // 16


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([0, 1, 5, 127, 128, 129, 200, 255, 256, 257, 300]), st.integers(0, 3)),
        min_size=1,
        max_size=8,
    ),
    st.integers(0, 50),
    st.booleans(),
)
def test_packing_covers_exactly_the_long_rows(segs, extra, engine):
    lens = [n for n, _ in segs]
    used = sum(n + g for n, g in segs) + extra
    num_rows = 1024 * -(-max(used, 1) // 1024)  # few shapes: few compilations
    check_packing(lens, num_rows, num_segments=num_rows if engine else 8, gaps=[g for _, g in segs])


# ----------------------------------------------------------------------------------------------
# (c) cross-lowering for CUDA at an engine bucket
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _h200_triton_info():
    """Triton lowering asks the local GPU for its compute capability; there is none on CPU."""
    # private modules: jax is pinned (==0.11.2), so a move shows up here as a failure, not a skip
    from jax._src.pallas.triton import gpu_info as gi
    from jax._src.pallas.triton import pallas_call_registration as pcr

    old = pcr.gpu_info_lib.get_gpu_info
    pcr.gpu_info_lib.get_gpu_info = lambda: gi.get_gpu_info_from_version(gi.GpuVersion.H200)
    try:
        yield
    finally:
        pcr.gpu_info_lib.get_gpu_info = old


@pytest.mark.parametrize("r", [256, 512])
def test_hybrid_lowering_on_cpu(r):
    """One plan, two layers (as the runner does): both kernels lower (Pallas -> Mosaic GPU and
    Pallas -> Triton, for CUDA, from a CPU host), and the Mosaic launch takes the small bound of
    windows (``(R + (R // 32) * 134) // 128``: 20 for R = 512, not the generic R)."""
    h, kvh, hd, bs, mb, nb, layers = 16, 16, 128, 16, 4096 // 16, 512, 2
    sd = jax.ShapeDtypeStruct
    pool = sd((layers, kvh, nb, bs, hd), jnp.bfloat16)
    seg = sd((r,), jnp.int32)

    def step(q, k, v, qs, ql, cl, bt):
        kernel = dispatch.AttentionKernel("hybrid", r, h, kvh, hd)
        plan = kernel.plan(qs, ql, cl, bt)
        for layer in range(layers):
            q = kernel(q, k, v, qs, ql, cl, bt, layer=jnp.int32(layer), sm_scale=hd**-0.5, plan=plan)
        return q

    # Triton custom calls carry no serialisation guarantee; only the lowering is wanted here.
    unchecked = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with _h200_triton_info():
        exp = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=unchecked)(
            sd((r, h, hd), jnp.bfloat16), pool, pool, seg, seg, seg, sd((r, mb), jnp.int32)
        )
    text = exp.mlir_module()
    # each kernel lowered once (attention + combine for Triton) and called once per layer
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton(") == 2
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert text.count("call @ragged_paged_attention(") == layers
    assert text.count("call @ragged_paged_attention_mgpu(") == layers
    t = dispatch.hybrid_tiles(r, r)
    m = dispatch.HYBRID_MIN_SEGMENT_ROWS
    assert t == (r + (r // m) * (127 + ALIGN - 1)) // 128 and t < r // 8
    assert f"tensor<{t * TILE_FIELDS + r * mb}xi32>" in text  # the Mosaic launch's windows and table
    # each half writes into the array it is given (the Mosaic half's output is the Triton half's)
    assert text.count("output_operand_aliases") >= 2


@pytest.mark.parametrize("r", [512, 1024])
def test_long_segment_variant_lowering_on_cpu(r):
    """The long-segment variant of an engine bucket: the hybrid's Mosaic launch alone (no Triton
    launch, no combine), packed for the hybrid's small window bound."""
    h, kvh, hd, bs, mb, nb, layers = 16, 16, 128, 16, 4096 // 16, 512, 2
    sd = jax.ShapeDtypeStruct
    pool = sd((layers, kvh, nb, bs, hd), jnp.bfloat16)
    seg = sd((r,), jnp.int32)
    kernel = dispatch.AttentionKernel("mgpu", r, h, kvh, hd, min_segment_rows=LONG)

    def step(q, k, v, qs, ql, cl, bt):
        plan = kernel.plan(qs, ql, cl, bt)
        for layer in range(layers):
            q = kernel(q, k, v, qs, ql, cl, bt, layer=jnp.int32(layer), sm_scale=hd**-0.5, plan=plan)
        return q

    exp = jax.export.export(jax.jit(step), platforms=["cuda"])(
        sd((r, h, hd), jnp.bfloat16), pool, pool, seg, seg, seg, sd((r, mb), jnp.int32)
    )
    text = exp.mlir_module()
    assert "__gpu$xla.gpu.triton" not in text
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert text.count("call @ragged_paged_attention_mgpu(") == layers
    t = dispatch.hybrid_tiles(r, r)
    assert f"tensor<{t * TILE_FIELDS + r * mb}xi32>" in text


# ----------------------------------------------------------------------------------------------
# (d) the dispatch rule, the forced choice, interpret mode
# ----------------------------------------------------------------------------------------------


def test_select_kernel_hybrid_rule():
    def sel(r, s, dtype=jnp.bfloat16, hd=128, bs=16, heads=16, hopper=True):
        return dispatch.select_kernel(r, s, dtype, hd, bs, num_heads=heads, hopper=hopper)

    # engine buckets (S = R): split per segment once the bucket can fill the GPU with long tiles
    for r in (512, 1024, 2048, 8192):
        assert sel(r, r) == "hybrid"
    assert sel(256, 256) == "triton"  # at most 2 long tiles x 16 heads = 32 CTAs
    assert sel(256, 256, heads=32) == "hybrid"
    assert sel(128, 128, heads=64) == "triton"  # below HYBRID_MIN_ROWS
    assert sel(64, 64) == "triton" and sel(8, 8) == "triton"
    assert sel(1024, 1024, heads=4) == "triton"  # 8 tiles x 4 heads
    # where the Mosaic kernel cannot serve, Triton alone
    assert sel(1024, 1024, hopper=False) == "triton"
    assert sel(1024, 1024, dtype=jnp.float32) == "triton"
    assert sel(1024, 1024, hd=96) == "triton"
    assert sel(1024, 1024, bs=4) == "triton"
    # few segment slots: the per-bucket rule as before
    assert sel(1024, 1) == "mgpu" and sel(1024, 8) == "mgpu"
    assert sel(1024, 64) == "triton" and sel(256, 1) == "triton"
    # the attention option forces the kernel whatever the rule says; unknown names list "hybrid"
    kw = dict(num_rows=8, num_segments=8, num_heads=16, num_kv_heads=16, head_dim=128, block_size=16)
    assert dispatch.choose_attention("hybrid", dtype=jnp.bfloat16, **kw).name == "hybrid"
    with pytest.raises(ValueError, match="hybrid"):
        dispatch.choose_attention("bogus", dtype=jnp.bfloat16, **kw)


def test_long_segment_variant_rule(monkeypatch):
    """A bucket that splits per segment has a long-segment variant (segments of ``LONG`` rows or
    more: the Mosaic kernel alone); no other bucket has one, and the variant's packing is the
    hybrid's Mosaic packing of the same segments, whose Triton half would get no row."""
    monkeypatch.setattr(dispatch, "hopper_available", lambda: True)
    kw = dict(num_heads=16, num_kv_heads=16, head_dim=128, block_size=16, dtype=jnp.bfloat16)
    bucket = {k: kw[k] for k in ("num_heads", "head_dim", "block_size", "dtype")}

    def choose(attention, r, m=1):
        k = dispatch.choose_attention(attention, num_rows=r, num_segments=r, min_segment_rows=m, **kw)
        return k.name, k.min_segment_rows

    for attention in ("pallas", "hybrid"):
        assert dispatch.long_segment_rows(attention, num_rows=1024, num_segments=1024, **bucket) == LONG
        assert choose(attention, 1024) == ("hybrid", 1)
        assert choose(attention, 1024, LONG) == ("mgpu", LONG)
        assert choose(attention, 1024, LONG - 1) == ("hybrid", LONG - 1)  # a shorter segment may come
    # buckets that do not split: no variant, and a variant's bound changes nothing
    for attention, r in (("pallas", 128), ("pallas", 256), ("triton", 1024), ("mgpu", 1024), ("reference", 1024)):
        assert dispatch.long_segment_rows(attention, num_rows=r, num_segments=r, **bucket) == 0
    assert choose("pallas", 128, LONG)[0] == "triton" and choose("triton", 1024, LONG)[0] == "triton"
    # same windows as the hybrid's Mosaic half when every segment is long
    r, mb = 512, 8
    lens = [LONG, 129, 64, 200, 40]
    qs = np.zeros(r, np.int32)
    ql = np.zeros(r, np.int32)
    ql[: len(lens)] = lens
    qs[: len(lens)] = np.cumsum([0, *lens[:-1]]) + np.arange(len(lens)) * 3  # rows of no segment between
    cl = ql + 300
    bt = np.arange(r * mb, dtype=np.int32).reshape(r, mb) % 97
    args = [jnp.asarray(a) for a in (qs, ql, cl, bt)]
    variant = dispatch.AttentionKernel("mgpu", r, 16, 16, 128, min_segment_rows=LONG).plan(*args)
    hybrid = dispatch.AttentionKernel("hybrid", r, 16, 16, 128).plan(*args)
    np.testing.assert_array_equal(np.asarray(variant.meta), np.asarray(hybrid.mgpu.meta))
    assert not np.asarray(hybrid.triton_q_len).any()
    # a plain "mgpu" bucket (min_segment_rows = 1) keeps the bound for any segments
    plain = dispatch.AttentionKernel("mgpu", r, 16, 16, 128).plan(*args)
    np.testing.assert_array_equal(np.asarray(plain.meta), np.asarray(make_packing(*args, num_rows=r).meta))


def test_interpret_mode_refuses_hybrid():
    """No CPU interpret for the Mosaic half: the kernel choice and the engine (forced onto "hybrid"
    in interpret mode) fail with the same clear error as "mgpu"; unknown names list "hybrid", and
    names are taken in any case."""
    from ouro_jax import get_preset
    from ouro_jax.engine_config import EngineConfig
    from ouro_jax.runner import ModelRunner
    from scheduler.buckets import BucketKey
    from weights.random_init import random_params

    for kernel in ("mgpu", "hybrid", "HYBRID"):
        with pytest.raises(ValueError, match="no CPU interpret mode"):
            dispatch.AttentionKernel(kernel, 8, 2, 2, 64, interpret=True)
    assert dispatch.AttentionKernel(" Triton", 8, 2, 2, 64, interpret=True).name == "triton"
    for bad in ("cudnn", "pallas", None):  # "pallas" is an option, not a kernel: choose_attention resolves it
        with pytest.raises(ValueError, match="must be one of"):
            dispatch.AttentionKernel(bad, 8, 2, 2, 64)
    assert dispatch.check_attention("Reference") == "reference"
    assert dispatch.resolve_attention("AUTO") == ("pallas" if jax.default_backend() == "gpu" else "reference")
    cfg = get_preset("tiny")
    params = jax.tree.map(jnp.asarray, random_params(cfg, 0))
    with pytest.raises(ValueError, match="'hybrid'"):
        EngineConfig(attention="bogus")
    runner = ModelRunner(
        cfg,
        params,
        num_blocks=8,
        block_size=4,
        num_ring_rows=8,
        engine=EngineConfig(attention="Hybrid"),
        interpret=True,
    )
    assert runner.attention == "hybrid"
    with pytest.raises(ValueError, match="no CPU interpret mode"):
        runner.warmup([BucketKey(R=8, S=8, C=8, F=24, MB=2)], progress=False)


# ----------------------------------------------------------------------------------------------
# GPU (Hopper): hybrid == reference
# ----------------------------------------------------------------------------------------------


@gpu
@skip_no_hopper
@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(mixed_batches(heads=[(4, 4, 64), (4, 2, 128), (8, 1, 64), (16, 16, 128)], max_segments=6, max_long=400))
def test_hybrid_matches_reference(case):
    # the Mosaic kernel reads the tail of a segment's last page: finite there (its contract)
    b = build(case, jnp.bfloat16, tail_poison=1e3)
    scale = 1.0 / math.sqrt(case["heads"][2])
    want = reference(b, case, scale)
    kernel = dispatch.AttentionKernel("hybrid", b["q"].shape[0], *case["heads"])
    got = call(kernel, b, scale)
    assert_close(got, want, b, jnp.bfloat16, f"hybrid {case}")
    # the runner's path: a plan built once, passed in
    got2 = call(kernel, b, scale, plan=plan_for(b))
    np.testing.assert_array_equal(got2, got)


@gpu
@skip_no_hopper
@pytest.mark.parametrize(
    "specs",
    [
        [(512, 512), (1, 900), (1, 17), (64, 64), (0, 0), (200, 1000)],  # prefill chunks + decode
        [(1024, 3000)] + [(1, 2000)] * 8,  # one long chunk + decode
        [(1, 100)] * 16,  # no long segment at all
    ],
)
def test_hybrid_ouro_shapes(specs):
    """Ouro-1.4B heads in an engine-like bucket (S = R, padded), stacked pool."""
    case = dict(heads=(16, 16, 128), block_size=16, specs=specs, extra_rows=11, layers=3, engine=True, seed=5)
    b = build(case, jnp.bfloat16, tail_poison=1e3)
    want = reference(b, case, 128**-0.5)
    kernel = dispatch.AttentionKernel("hybrid", b["q"].shape[0], 16, 16, 128)
    got = call(kernel, b, 128**-0.5, plan=plan_for(b))
    assert_close(got, want, b, jnp.bfloat16, f"hybrid ouro {specs}")
