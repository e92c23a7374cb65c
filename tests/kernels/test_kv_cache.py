"""KV pool updates: write_kv (new rows -> slots) and copy_kv_slots (LAST_EXITED finalize).

Every test poisons the pool with unique sentinels (and NaNs) and checks that exactly the intended
slots changed, bit for bit, against a plain numpy loop; the jnp twins are checked the same way.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.kv_cache import copy_kv_slots, copy_kv_slots_reference, write_kv, write_kv_reference
from tests.kernels.conftest import pool_copies


def _poisoned_pool(rng, shape, dtype):
    """Unique finite sentinels with a sprinkling of NaNs (NaN must survive untouched too)."""
    pool = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) * 0.5 - 7.0
    pool = pool.astype(dtype)
    nan_mask = rng.random(shape) < 0.05
    pool[nan_mask] = np.nan
    return pool


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint32) if x.dtype == np.float32 else x.view(np.uint16)


def _np_write(pool, new, slots, layer, bs):
    pool = pool.copy()
    for r, s in enumerate(slots):
        if s < 0:
            continue
        b, o = divmod(int(s), bs)
        if layer is None:
            pool[:, b, o] = new[r]
        else:
            pool[layer, :, b, o] = new[r]
    return pool


def _np_copy(pool, src, dst, bs):
    out = pool.copy()
    for s, d in zip(src, dst):
        if d < 0:
            continue
        sb, so = divmod(int(s), bs)
        db, do = divmod(int(d), bs)
        out[..., db, do, :] = pool[..., sb, so, :]  # reads from the old pool: simultaneous copy
    return out


@st.composite
def write_cases(draw):
    kvh = draw(st.sampled_from([1, 2, 4]))
    nb = draw(st.integers(2, 12))
    bs = draw(st.sampled_from([1, 4, 16]))
    hd = draw(st.sampled_from([8, 64]))
    layers = draw(st.sampled_from([None, 1, 3]))
    r = draw(st.integers(1, 24))
    n_slots = nb * bs
    n_real = draw(st.integers(0, min(r, n_slots)))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from([np.float32, jnp.bfloat16]))
    return kvh, nb, bs, hd, layers, r, n_real, seed, dtype


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(write_cases())
def test_write_kv_changes_exactly_the_slots(case):
    kvh, nb, bs, hd, layers, r, n_real, seed, dtype = case
    rng = np.random.default_rng(seed)
    shape = (kvh, nb, bs, hd) if layers is None else (layers, kvh, nb, bs, hd)
    layer = None if layers is None else int(rng.integers(0, layers))
    kp = _poisoned_pool(rng, shape, dtype)
    vp = _poisoned_pool(rng, shape, dtype) + np.asarray(1000, dtype)
    slots = np.full((r,), -1, np.int32)
    pos = rng.choice(r, size=n_real, replace=False)
    slots[pos] = rng.choice(nb * bs, size=n_real, replace=False)
    k_new = rng.standard_normal((r, kvh, hd)).astype(dtype)
    v_new = rng.standard_normal((r, kvh, hd)).astype(dtype)
    want_k = _np_write(kp, k_new, slots, layer, bs)
    want_v = _np_write(vp, v_new, slots, layer, bs)
    lyr = None if layer is None else jnp.int32(layer)
    for fn in (write_kv, write_kv_reference):
        ko, vo = jax.jit(fn)(
            jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slots), layer=lyr
        )
        np.testing.assert_array_equal(_bits(ko), _bits(want_k), err_msg=fn.__name__)
        np.testing.assert_array_equal(_bits(vo), _bits(want_v), err_msg=fn.__name__)


@st.composite
def copy_cases(draw):
    kvh = draw(st.sampled_from([1, 2]))
    nb = draw(st.integers(2, 10))
    bs = draw(st.sampled_from([1, 4, 16]))
    hd = draw(st.sampled_from([8, 64]))
    layers = draw(st.sampled_from([None, 2, 4]))
    f = draw(st.integers(1, 16))
    seed = draw(st.integers(0, 2**31 - 1))
    return kvh, nb, bs, hd, layers, f, seed


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(copy_cases())
def test_copy_kv_slots_changes_exactly_the_slots(case):
    kvh, nb, bs, hd, layers, f, seed = case
    rng = np.random.default_rng(seed)
    shape = (kvh, nb, bs, hd) if layers is None else (layers, kvh, nb, bs, hd)
    kp = _poisoned_pool(rng, shape, np.float32)
    vp = _poisoned_pool(rng, shape, np.float32) - 500.0
    n_slots = nb * bs
    n_real = int(rng.integers(0, min(f, n_slots) + 1))
    dst = np.full((f,), -1, np.int32)
    pos = rng.choice(f, size=n_real, replace=False)
    dst[pos] = rng.choice(n_slots, size=n_real, replace=False)
    src = rng.integers(0, n_slots, size=f).astype(np.int32)  # may overlap dst: simultaneous copy
    src[dst < 0] = rng.integers(-5, n_slots + 5, size=int((dst < 0).sum()))  # padding src: junk
    want_k, want_v = _np_copy(kp, src, dst, bs), _np_copy(vp, src, dst, bs)
    for fn in (copy_kv_slots, copy_kv_slots_reference):
        ko, vo = jax.jit(fn)(jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(src), jnp.asarray(dst))
        np.testing.assert_array_equal(_bits(ko), _bits(want_k), err_msg=fn.__name__)
        np.testing.assert_array_equal(_bits(vo), _bits(want_v), err_msg=fn.__name__)


def test_finalize_copy_last_exited_planes():
    """A token exiting at depth e: its plane-e slot is copied to planes e+1..T-1, every layer."""
    rng = np.random.default_rng(0)
    layers, kvh, nb, bs, hd, planes = 3, 2, 16, 4, 8, 4
    kp = _poisoned_pool(rng, (layers, kvh, nb, bs, hd), np.float32)
    vp = _poisoned_pool(rng, (layers, kvh, nb, bs, hd), np.float32)
    # one request, block table per plane: plane p uses blocks 1+4p .. 4+4p; token at position 5
    tables = np.arange(1, 1 + 4 * planes).reshape(planes, 4)
    pos, exit_depth = 5, 1
    slot = lambda p: tables[p, pos // bs] * bs + pos % bs  # noqa: E731
    src = np.array([slot(exit_depth)] * (planes - 1 - exit_depth) + [0, 0], np.int32)
    dst = np.array([slot(p) for p in range(exit_depth + 1, planes)] + [-1, -1], np.int32)
    ko, vo = copy_kv_slots(jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(src), jnp.asarray(dst))
    ko, vo = np.asarray(ko), np.asarray(vo)
    for p in range(planes):
        b, o = divmod(int(slot(p)), bs)
        sb, so = divmod(int(slot(exit_depth if p > exit_depth else p)), bs)
        np.testing.assert_array_equal(ko[:, :, b, o], kp[:, :, sb, so])
        np.testing.assert_array_equal(vo[:, :, b, o], vp[:, :, sb, so])
    np.testing.assert_array_equal(_bits(ko), _bits(_np_copy(kp, src, dst, bs)))


@pytest.mark.parametrize("layers", [None, 3])
def test_updates_are_in_place_under_donation(layers):
    """With the pool donated, XLA aliases input and output and never copies the pool."""
    kvh, nb, bs, hd = 2, 64, 16, 64
    shape = (kvh, nb, bs, hd) if layers is None else (layers, kvh, nb, bs, hd)
    kp, vp = jnp.ones(shape, jnp.float32), jnp.full(shape, 2.0, jnp.float32)
    new = jnp.full((8, kvh, hd), 3.0, jnp.float32)
    slots = jnp.arange(8, dtype=jnp.int32) * 3 + 16
    layer = None if layers is None else jnp.int32(1)

    wf = jax.jit(lambda k, v, a, b, s, l: write_kv(k, v, a, b, s, layer=l), donate_argnums=(0, 1))
    assert not pool_copies(wf.lower(kp, vp, new, new, slots, layer).compile().as_text(), shape)
    ptr = kp.unsafe_buffer_pointer()
    kp, vp = wf(kp, vp, new, new, slots, layer)
    assert kp.unsafe_buffer_pointer() == ptr

    cf = jax.jit(copy_kv_slots, donate_argnums=(0, 1))
    src, dst = slots, jnp.where(jnp.arange(8) < 6, slots + 200, -1)
    assert not pool_copies(cf.lower(kp, vp, src, dst).compile().as_text(), shape)
    ptr = kp.unsafe_buffer_pointer()
    kp2, _ = cf(kp, vp, src, dst)
    assert kp2.unsafe_buffer_pointer() == ptr


def test_padding_slots_never_written():
    """slot -1 rows (and copies with dst -1) leave the whole pool, trash page included, as it was."""
    rng = np.random.default_rng(3)
    shape = (2, 2, 4, 4, 8)
    kp = _poisoned_pool(rng, shape, np.float32)
    new = np.full((5, 2, 8), 99.0, np.float32)
    ko, _ = write_kv(
        jnp.asarray(kp),
        jnp.asarray(kp),
        jnp.asarray(new),
        jnp.asarray(new),
        jnp.full((5,), -1, jnp.int32),
        layer=jnp.int32(1),
    )
    np.testing.assert_array_equal(_bits(ko), _bits(kp))
    ko, _ = copy_kv_slots(
        jnp.asarray(kp), jnp.asarray(kp), jnp.arange(5, dtype=jnp.int32), jnp.full((5,), -1, jnp.int32)
    )
    np.testing.assert_array_equal(_bits(ko), _bits(kp))
