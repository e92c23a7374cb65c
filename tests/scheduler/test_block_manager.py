"""KVBlockManager: block 0 is never handed out, tables cover every plane, prefix-cache columns are
shared by reference and evicted LRU, nothing leaks and reference counts return to zero."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import KVBlockManager, prefix_block_hashes


def test_tables_cover_every_plane_and_grow_by_columns():
    bm = KVBlockManager(num_blocks=33, block_size=4, num_planes=4, max_seqs=4, max_blocks_per_seq=8)
    table, hits = bm.allocate("a", 5)  # positions 0..4: 2 blocks per plane
    assert hits == 0 and table.shape == (4, 2) and 0 not in table and len(set(table.ravel())) == 8
    assert bm.num_free_blocks == 24 and bm.num_used_blocks == 8 and bm.num_held_tokens("a") == 8
    assert (bm.block_table("a") == table).all()
    assert bm.grow("a", 8).shape == (4, 0)  # still covered
    new = bm.grow("a", 9)
    assert new.shape == (4, 1) and (bm.block_table("a")[:, 2] == new[:, 0]).all()
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate("a", 3)
    bm.free("a")
    bm.free("a")  # idempotent
    assert bm.num_free_blocks == 32 and bm.num_used_blocks == 0 and not bm.holds("a")
    assert (bm.ref_counts()[1:] == 0).all()


def test_allocation_refuses_without_changing_anything():
    bm = KVBlockManager(num_blocks=11, block_size=4, num_planes=2, max_seqs=4, max_blocks_per_seq=5, watermark=0.2)
    assert bm.watermark_blocks == 2 and bm.capacity_blocks == 8
    assert bm.can_ever_fit(20) and not bm.can_ever_fit(21)
    assert bm.allocate("a", 12, keep_free=2) is not None  # 3 blocks x 2 planes, 4 left
    assert bm.allocate("c", 5, keep_free=2) is None  # 4 blocks would dig into the kept 2
    assert not bm.holds("c") and bm.num_free_blocks == 4
    assert bm.allocate("b", 4, keep_free=2) is not None  # 2 blocks: exactly the margin left
    assert bm.grow("a", 20) is None and bm.num_held_tokens("a") == 12  # needs 4 more, 2 free
    assert bm.grow("a", 16).shape == (2, 1) and bm.num_free_blocks == 0


def test_one_dense_table_with_a_row_per_request():
    bm = KVBlockManager(num_blocks=17, block_size=2, num_planes=2, max_seqs=2, max_blocks_per_seq=3)
    ta, _ = bm.allocate("a", 3)
    tb, _ = bm.allocate("b", 1)
    assert (bm.slot("a"), bm.slot("b")) == (0, 1)
    assert (bm.tables[0, :, :2] == ta).all() and (bm.tables[1, :, :1] == tb).all()
    assert (bm.tables[0, :, 2:] == 0).all() and (bm.tables[1, :, 1:] == 0).all()
    with pytest.raises(ValueError):
        bm.tables[0, 0, 0] = 5  # read-only: only the manager writes tables
    assert bm.allocate("c", 1) is None and not bm.holds("c")  # no free slot: nothing changes
    new = bm.grow("b", 4)
    assert (bm.tables[1, :, 1:2] == new).all()
    with pytest.raises(ValueError, match="table holds 3 blocks"):
        bm.grow("a", 7)
    with pytest.raises(ValueError, match="no column 2"):
        bm.publish("a", 2, b"h")
    bm.free("a")
    assert (bm.tables[0] == 0).all() and bm.allocate("c", 6) is not None and bm.slot("c") == 0
    with pytest.raises(ValueError, match="table holds 3 blocks"):
        bm.allocate("d", 7)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_blocks=1),
        dict(block_size=0),
        dict(num_planes=0),
        dict(watermark=1.0),
        dict(max_seqs=0),
        dict(max_blocks_per_seq=0),
        dict(max_seqs=2.0),
    ],
)
def test_constructor_errors(kw):
    base = dict(num_blocks=8, block_size=4, num_planes=1, max_seqs=2, max_blocks_per_seq=4)
    base.update(kw)
    with pytest.raises(ValueError):
        KVBlockManager(**base)


def test_hash_chain_names_a_block_and_everything_before_it():
    a = prefix_block_hashes(np.arange(12), 4, b"x", 3)
    b = prefix_block_hashes(np.r_[np.arange(8), [0, 0, 0, 0]], 4, b"x", 3)
    c = prefix_block_hashes(np.r_[[99], np.arange(1, 12)], 4, b"x", 3)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c))  # a change in block 0 changes every later hash
    assert prefix_block_hashes(np.arange(12), 4, b"y", 3)[0] != a[0]  # the salt (layout) counts


def test_prefix_columns_are_shared_kept_idle_and_evicted_lru():
    bm = KVBlockManager(
        num_blocks=1 + 2 * 6, block_size=2, num_planes=2, max_seqs=3, max_blocks_per_seq=6, enable_prefix_caching=True
    )
    h = prefix_block_hashes(np.arange(6), 2, b"", 3)
    ta, _ = bm.allocate("a", 6)
    assert bm.publish("a", 0, h[0]) and bm.publish("a", 1, h[1]) and not bm.publish("a", 1, h[1])
    tb, hits = bm.allocate("b", 6, h)
    assert hits == 2 and (tb[:, :2] == ta[:, :2]).all() and (tb[:, 2] != ta[:, 2]).all()
    assert bm.ref_counts()[ta[:, 0]].tolist() == [2, 2] and bm.num_cached_blocks == 4
    assert not bm.publish("b", 0, h[0])
    bm.free("a")
    bm.free("b")  # the cached columns stay, idle; b's last cached column is released first
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 12 and bm.num_cached_blocks == 4
    assert (bm.ref_counts()[1:] == 0).all()
    # a request needing all 12 blocks evicts the idle columns, later prefix blocks first
    _, hits = bm.allocate("c", 12)
    assert hits == 0 and bm.num_cached_blocks == 0 and bm.num_free_blocks == 0
    bm.free("c")
    assert bm.num_free_blocks == 12


def test_idle_hit_counts_against_the_free_blocks():
    bm = KVBlockManager(
        num_blocks=1 + 4, block_size=1, num_planes=1, max_seqs=2, max_blocks_per_seq=5, enable_prefix_caching=True
    )
    h = prefix_block_hashes(np.arange(2), 1, b"", 2)
    bm.allocate("a", 2)
    bm.publish("a", 0, h[0])
    bm.free("a")
    assert bm.num_free_blocks == 4
    assert bm.allocate("b", 5, h) is None  # 1 hit + 4 fresh > 4 free
    assert bm.allocate("b", 4, h, keep_free=1) is None
    assert bm.allocate("b", 4, h)[1] == 1 and bm.num_free_blocks == 0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20), st.integers(0, 3)), max_size=50),
    st.integers(1, 4),
    st.integers(1, 4),
    st.booleans(),
)
def test_random_ops_never_leak_or_double_book(ops, planes, bs, caching):
    bm = KVBlockManager(
        num_blocks=40,
        block_size=bs,
        num_planes=planes,
        max_seqs=39,
        max_blocks_per_seq=60,
        enable_prefix_caching=caching,
    )
    prompts = [np.arange(20) % (k + 2) for k in range(4)]
    live = {}
    for i, (op, n, which) in enumerate(ops):
        if op == 0 or not live:
            hashes = prefix_block_hashes(prompts[which], bs, b"", n // bs)
            if bm.allocate(i, n, hashes) is not None:
                live[i] = hashes
        elif op == 1:
            bm.free(sorted(live)[n % len(live)])
            live.pop(sorted(live)[n % len(live)])
        elif op == 2:
            rid = sorted(live)[n % len(live)]
            bm.grow(rid, bm.num_held_tokens(rid) + n)
        else:
            rid = sorted(live)[n % len(live)]
            for c, h in enumerate(live[rid][: bm.block_table(rid).shape[1]]):
                bm.publish(rid, c, h)
        tables = [bm.block_table(r) for r in live]
        for r, t in zip(live, tables):  # the dense array is the one table: a request's row, 0 past its columns
            row = bm.tables[bm.slot(r)]
            assert (row[:, : t.shape[1]] == t).all() and (row[:, t.shape[1] :] == 0).all()
        free_slots = set(range(39)) - {bm.slot(r) for r in live}
        assert len(free_slots) == 39 - len(live) and (bm.tables[sorted(free_slots)] == 0).all()
        held = np.concatenate([t.ravel() for t in tables]) if tables else np.zeros(0, int)
        assert 0 not in held
        ref = bm.ref_counts()
        uniq, cnt = np.unique(held, return_counts=True)
        assert (ref[uniq] == cnt).all(), "reference counts differ from the tables"
        assert bm.num_used_blocks == uniq.size
        assert bm.num_free_blocks + uniq.size == 39
        free = set(bm._free)
        assert not free & set(uniq.tolist()) and len(free) == len(bm._free)
    for r in list(live):
        bm.free(r)
    assert bm.num_free_blocks == 39 and (bm.ref_counts()[1:] == 0).all()
