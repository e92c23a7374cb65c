"""KVBlockManager: block 0 is never handed out, reservations cover every plane, nothing leaks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import KVBlockManager, Request, SamplingParams


def req(rid, n, max_tokens):
    return Request(rid, list(range(n)), SamplingParams(max_tokens=max_tokens))


def test_reserves_prompt_plus_generated_tokens_in_every_plane():
    bm = KVBlockManager(num_blocks=33, block_size=4, num_planes=4)
    r = req("a", 5, 4)  # positions 0..7 get KV: 2 blocks per plane
    assert r.max_kv_tokens == 8 and bm.blocks_needed(8) == 8
    table = bm.allocate(r)
    assert table.shape == (4, 2) and 0 not in table and len(set(table.ravel())) == 8
    assert bm.num_free_blocks == 24 and bm.num_used_blocks == 8
    assert (bm.block_table("a") == table).all()
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate(r)
    bm.free(r)
    bm.free(r)  # idempotent
    assert bm.num_free_blocks == 32 and bm.num_used_blocks == 0 and not bm.holds("a")


def test_can_allocate_and_watermark():
    bm = KVBlockManager(num_blocks=11, block_size=4, num_planes=2, watermark=0.2)
    assert bm.watermark_blocks == 2 and bm.capacity_blocks == 8
    assert bm.can_ever_fit(16) and not bm.can_ever_fit(17)
    a = req("a", 8, 5)  # 12 tokens: 3 blocks x 2 planes
    assert bm.can_allocate(a)
    bm.allocate(a)
    b = req("b", 4, 1)  # 1 block x 2 planes: 4 free, 2 kept back
    assert bm.can_allocate(b)
    c = req("c", 5, 1)  # 2 blocks x 2 planes: would dig into the watermark
    assert not bm.can_allocate(c)
    with pytest.raises(RuntimeError, match="not enough free blocks"):
        bm.allocate(c)


@pytest.mark.parametrize("kw", [dict(num_blocks=1), dict(block_size=0), dict(num_planes=0), dict(watermark=1.0)])
def test_constructor_errors(kw):
    base = dict(num_blocks=8, block_size=4, num_planes=1)
    base.update(kw)
    with pytest.raises(ValueError):
        KVBlockManager(**base)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 20), st.integers(1, 6)), max_size=40),
    st.integers(1, 4),
    st.integers(1, 4),
)
def test_random_alloc_free_never_leaks_or_double_books(ops, planes, bs):
    bm = KVBlockManager(num_blocks=40, block_size=bs, num_planes=planes)
    live = {}
    for i, (do_alloc, n, m) in enumerate(ops):
        if do_alloc or not live:
            r = req(i, n, m)
            if bm.can_allocate(r):
                live[i] = (r, bm.allocate(r))
        else:
            rid = sorted(live)[n % len(live)]
            bm.free(live.pop(rid)[0])
        held = np.concatenate([t.ravel() for _, t in live.values()]) if live else np.zeros(0, int)
        assert 0 not in held and len(set(held.tolist())) == held.size
        assert bm.num_used_blocks == held.size and bm.num_free_blocks + held.size == 39
    for r, _ in list(live.values()):
        bm.free(r)
    assert bm.num_free_blocks == 39
