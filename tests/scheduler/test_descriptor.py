"""Buckets and the packed BatchDescriptor: shapes per key, padding, pack/unpack round trip."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import BatchDescriptor, BucketSpec, descriptor_layout
from scheduler.buckets import next_power_of_two
from scheduler.descriptor import ARRAY_NAMES, HEADER, build_descriptor


def spec(**kw):
    base = dict(max_num_batched_tokens=100, max_num_seqs=12, num_loops=4, max_model_len=70, block_size=16)
    base.update(kw)
    return BucketSpec(**base)


def test_default_buckets_are_powers_of_two_from_eight():
    s = spec()
    assert s.row_buckets == (8, 16, 32, 64, 128)
    assert s.coda_cap == 16 and s.max_blocks_per_seq == 5
    keys = s.keys()
    assert [k.R for k in keys] == [8, 16, 32, 64, 128]
    assert all(k.S == k.R and k.C == min(k.R, 16) and k.F == k.C * 3 and k.MB == 5 for k in keys)
    assert s.key_for(0).R == 8 and s.key_for(9).R == 16 and s.key_for(128).R == 128
    with pytest.raises(ValueError, match="exceed"):
        s.key_for(129)
    assert spec(has_finalize=False).key_for(3).F == 0
    assert spec(max_num_batched_tokens=3, max_num_seqs=3).row_buckets == (8,)
    assert spec(row_buckets=[1, 100]).key_for(2).R == 100
    assert [next_power_of_two(n) for n in (1, 2, 3, 8, 9)] == [1, 2, 4, 8, 16]


def test_every_array_shape_is_a_function_of_the_key():
    for key in spec().keys():
        d = BatchDescriptor(key)
        shapes = {n: getattr(d, n).shape for n in ARRAY_NAMES}
        assert shapes["row_ring"] == shapes["row_pos"] == shapes["row_slot"] == (key.R,)
        assert shapes["pre_ring"] == shapes["pre_token"] == (key.R,)
        assert shapes["seg_block_table"] == (key.S, key.MB)
        assert shapes["coda_row"] == shapes["coda_seed"] == (key.C,)
        assert shapes["fin_src"] == (key.F,)
        assert d.coda_seed.dtype == np.uint32 and d.coda_temperature.dtype == np.float32
        layout = descriptor_layout(key)
        assert d.pack().size == layout[-1].offset + layout[-1].size
        # padding defaults: no KV slot, no finalize, greedy coda with top_p 1
        assert (d.row_slot == -1).all() and (d.fin_dst == -1).all() and (d.coda_top_p == 1).all()
        assert (d.seg_q_len == 0).all() and (d.row_ring == 0).all()


def hand_tables():
    # two requests (batch slots 0 and 1), 2 planes, block size 4, 3 block columns
    t = np.zeros((2, 2, 3), np.int32)
    t[0] = [[5, 6, 7], [8, 9, 10]]
    t[1] = [[11, 12, 0], [13, 14, 0]]
    return t


def test_build_lays_out_segments_and_pads():
    s = BucketSpec(max_num_batched_tokens=16, max_num_seqs=2, num_loops=2, max_model_len=12, block_size=4)
    d = build_descriptor(
        s,
        hand_tables(),
        seg_slot=[1, 0, 0],
        seg_plane=[1, 0, 1],
        seg_pos=[6, 3, 0],
        seg_len=[1, 4, 3],
        seg_ring=[40, 13, 10],
        pre_ring=[13, 14, 15, 16],
        pre_token=[7, 8, 9, 10],
        coda_row=[0],
        coda_temperature=[0.5],
        coda_top_k=[3],
        coda_top_p=[0.9],
        coda_seed=[2**32 - 1],
        coda_step=[4],
        fin_src=[46],
        fin_dst=[49],
    )
    assert tuple(d.key) == (8, 8, 2, 2, 3, 1)  # M = 1: any segment lengths
    assert (d.num_rows, d.num_segments, d.num_prelude, d.num_coda, d.num_finalize) == (8, 3, 4, 1, 1)
    assert d.row_pos.tolist() == [6, 3, 4, 5, 6, 0, 1, 2]
    assert d.row_ring.tolist() == [40, 13, 14, 15, 16, 10, 11, 12]
    # slot = block * 4 + offset, block from the segment's plane table
    assert d.row_slot.tolist() == [14 * 4 + 2, 5 * 4 + 3, 6 * 4, 6 * 4 + 1, 6 * 4 + 2, 8 * 4, 8 * 4 + 1, 8 * 4 + 2]
    assert d.seg_q_start[:3].tolist() == [0, 1, 5] and d.seg_q_len.tolist() == [1, 4, 3, 0, 0, 0, 0, 0]
    assert d.seg_ctx_len[:3].tolist() == [7, 7, 3]
    assert d.seg_block_table[:3].tolist() == [[13, 14, 0], [5, 6, 7], [8, 9, 10]]
    assert (d.seg_block_table[3:] == 0).all()
    assert d.pre_ring.tolist() == [13, 14, 15, 16, 0, 0, 0, 0] and d.pre_token[:4].tolist() == [7, 8, 9, 10]
    assert d.coda_seed[0] == 2**32 - 1 and d.coda_temperature[0] == np.float32(0.5)
    assert d.coda_top_k.tolist() == [3, 0] and d.coda_top_p.tolist() == [np.float32(0.9), 1.0]
    assert d.fin_src.tolist() == [46, -1] and d.fin_dst.tolist() == [49, -1]


def test_bucket_grows_for_pending_finalize_pairs():
    s = BucketSpec(max_num_batched_tokens=64, max_num_seqs=16, num_loops=4, max_model_len=12, block_size=4)
    pairs = np.arange(30)  # ten tokens exited at depth 0: 3 pairs each
    d = build_descriptor(
        s,
        hand_tables(),
        seg_slot=[],
        seg_plane=[],
        seg_pos=[],
        seg_len=[],
        seg_ring=[],
        pre_ring=[],
        pre_token=[],
        coda_row=[],
        coda_temperature=[],
        coda_top_k=[],
        coda_top_p=[],
        coda_seed=[],
        coda_step=[],
        fin_src=pairs,
        fin_dst=pairs + 100,
    )
    assert d.key.R == 16 and d.key.F == 48 and d.num_finalize == 30 and d.num_rows == 0


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_pack_unpack_round_trip(data):
    s = spec(
        max_num_batched_tokens=data.draw(st.integers(1, 64)), max_num_seqs=1, num_loops=data.draw(st.integers(1, 4))
    )
    key = data.draw(st.sampled_from(s.keys()))
    d = BatchDescriptor(key)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    for name in ARRAY_NAMES:
        a = getattr(d, name)
        if a.dtype == np.float32:
            a[...] = rng.standard_normal(a.shape).astype(np.float32)
        elif a.dtype == np.uint32:
            a[...] = rng.integers(0, 2**32, a.shape, dtype=np.uint64).astype(np.uint32)
        else:
            a[...] = rng.integers(-(2**31), 2**31, a.shape, dtype=np.int64).astype(np.int32)
    d.set_header(**dict(zip(HEADER[:5], rng.integers(0, 9, 5))), feed_previous_tokens=True)
    packed = d.pack()
    assert packed.dtype == np.int32 and packed.ndim == 1
    e = BatchDescriptor.unpack(key, packed)
    assert e.key == key and all(getattr(e, h) == getattr(d, h) for h in HEADER)
    assert e.feed_previous_tokens is True and e.num_rows == int(packed[HEADER.index("num_rows")])
    for name in ARRAY_NAMES:
        np.testing.assert_array_equal(getattr(e, name), getattr(d, name))
        assert getattr(e, name).dtype == getattr(d, name).dtype
    # the layout's offsets address the same words the fields view
    for f in descriptor_layout(key):
        np.testing.assert_array_equal(
            packed[f.offset : f.offset + f.size].view(f.dtype).reshape(f.shape), getattr(d, f.name)
        )
    packed[0] += 1  # unpack copied: the original is not aliased
    assert e.header[0] != packed[0]
    with pytest.raises(ValueError, match="words"):
        BatchDescriptor.unpack(key, packed[:-1])


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    T=st.integers(1, 4),
    n=st.integers(1, 12),
    shared=st.booleans(),
    fin_pairs=st.integers(0, 9),
    with_coda=st.booleans(),
    feed=st.booleans(),
    forced=st.booleans(),
)
def test_decode_loops_equal_one_build_per_loop(data, T, n, shared, fin_pairs, with_coda, feed, forced):
    """``build_decode_loops`` (a fused step's token, built once) gives, loop by loop, the very
    buffers of ``build_descriptor`` with that loop's arguments, as ``fused_plan`` passed them
    before: prelude, finalize pairs and the feed flag at loop 0, the coda at the last loop, each
    loop's plane; with or without a forced key."""
    from scheduler.descriptor import build_decode_loops

    spec = BucketSpec(64, 16, T, 256, 4, has_finalize=not shared)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    slots_n = 16
    tables = rng.integers(1, 500, (slots_n, T, 64)).astype(np.int32)  # 64 = max_model_len / block_size
    slot = rng.choice(slots_n, n, replace=False)
    pos = rng.integers(0, 200, n)
    ring = rng.integers(1, 900, n)
    planes = [0] * T if shared else list(range(T))
    fin = rng.integers(0, 4000, (0 if shared or T == 1 else fin_pairs, 2))  # no plane above at T = 1
    tok = rng.integers(0, 1000, n)
    coda = (
        dict(
            row=np.arange(n),
            temperature=rng.random(n),
            top_k=rng.integers(0, 50, n),
            top_p=rng.random(n),
            seed=rng.integers(0, 2**32 - 1, n, dtype=np.uint64).astype(np.uint32),
            step=rng.integers(0, 100, n),
        )
        if with_coda
        else None
    )
    empty = np.zeros(0, np.int64)
    key = spec.key_for(max(n, 16)) if forced else None
    got = build_decode_loops(
        spec, tables, seg_slot=slot, planes=planes, seg_pos=pos, seg_ring=ring, pre_token=tok, coda=coda,
        fin_src=fin[:, 0], fin_dst=fin[:, 1], feed_previous_tokens=feed, key=key,
    )  # fmt: skip
    assert len(got) == T
    for d, desc in enumerate(got):
        last = d == T - 1 and coda is not None
        want = build_descriptor(
            spec,
            tables,
            seg_slot=slot,
            seg_plane=np.full(n, planes[d]),
            seg_pos=pos,
            seg_len=np.ones(n, np.int64),
            seg_ring=ring,
            pre_ring=ring if d == 0 else empty,
            pre_token=tok if d == 0 else empty,
            **{f"coda_{k}": (v if last else empty) for k, v in (coda or dict.fromkeys(
                ("row", "temperature", "top_k", "top_p", "seed", "step"), empty)).items()},
            fin_src=fin[:, 0] if d == 0 else empty,
            fin_dst=fin[:, 1] if d == 0 else empty,
            key=key if d == 0 else got[0].key,
            feed_previous_tokens=feed and d == 0,
        )  # fmt: skip
        assert desc.key == want.key
        np.testing.assert_array_equal(desc.pack(), want.pack())


def test_decode_loops_refuse_what_the_key_cannot_hold():
    from scheduler.descriptor import build_decode_loops

    spec = BucketSpec(64, 16, 4, 256, 4)
    tables = np.ones((4, 4, 64), np.int32)
    small = spec.key_for(8)
    with pytest.raises(ValueError, match="exceed key"):
        build_decode_loops(
            spec, tables, seg_slot=np.arange(4).repeat(3), planes=[0, 1, 2, 3], seg_pos=np.zeros(12),
            seg_ring=np.arange(12), pre_token=np.zeros(12), coda=None, fin_src=[], fin_dst=[], key=small,
        )  # fmt: skip
