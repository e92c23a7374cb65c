"""``rope_write_kv``: RoPE on q and k plus the paged K/V write in one Pallas kernel.

The kernel (interpret mode) against its jnp twin and the twin against a plain numpy loop: rotated
queries, and pools poisoned with unique sentinels and NaNs in which exactly the rows' slots change.
Awkward shapes: rows not a multiple of the program's block, padding rows (slot -1) anywhere, GQA
groups, one row, a row writing the pool's first slot beside padding rows, bf16 and f32.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.rope import rope_cos_sin
from pallas_kernels.rope_write_kv import rope_write_kv, rope_write_kv_reference
from tests.kernels.conftest import engine_with_and_without


def _case(rng, R, G, g, hd, L, NB, BS, dtype, pad_every=0, first_slot=False):
    qkv = rng.standard_normal((R, G, g + 2, hd)).astype(np.float32)
    pos = rng.integers(0, 4000, R)
    cos, sin = rope_cos_sin(jnp.asarray(pos), hd, 10000.0)
    n = NB * BS
    pool = (np.arange(L * G * n * hd, dtype=np.float64).reshape(L, G, NB, BS, hd) * 0.25 - 3.0).astype(np.float32)
    pool[rng.random(pool.shape) < 0.05] = np.nan
    slots = rng.permutation(n)[:R].astype(np.int32)
    if first_slot:  # row R // 2 writes slot 0: swapped there, so that no other row keeps it
        slots[slots == 0] = slots[R // 2]
        slots[R // 2] = 0
    if pad_every:
        slots[::pad_every] = -1
        if first_slot and (R // 2) % pad_every == 0:
            slots[R // 2] = 0
    _assert_distinct(slots)
    kp = jnp.asarray(pool, dtype)
    vp = jnp.asarray(pool[::-1].copy(), dtype)
    return jnp.asarray(qkv, dtype), cos, sin, kp, vp, jnp.asarray(slots)


def _assert_distinct(slots):
    """Real rows (slot >= 0) write distinct slots: two rows on one slot leave either value (the
    kernel's contract, and ``write_kv``'s), which the CPU's scatter orders and the GPU's does not."""
    real = np.asarray(slots)[np.asarray(slots) >= 0]
    assert len(np.unique(real)) == len(real), f"two real rows share a slot: {np.sort(real)}"


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("R, NB, BS, pad_every", [(37, 20, 4, 5), (16, 6, 16, 3), (8, 5, 16, 4), (5, 2, 4, 0)])
def test_case_builder_slots_distinct(seed, R, NB, BS, pad_every):
    """The builder's slots: distinct among real rows, row ``R // 2`` on slot 0 with ``first_slot``
    even where the permutation already put 0 elsewhere (the case that failed ``shape1`` on the GPU),
    padding rows -1."""
    slots = np.asarray(_case(np.random.default_rng(seed), R, 1, 1, 16, 1, NB, BS, jnp.float32, pad_every, True)[-1])
    _assert_distinct(slots)
    assert slots[R // 2] == 0
    if pad_every:
        assert all(slots[i] == -1 for i in range(0, R, pad_every) if i != R // 2)


def _np_expected(qkv, cos, sin, kp, vp, slots, layer):
    qkv = np.asarray(qkv.astype(jnp.float32))
    cos, sin = np.asarray(cos), np.asarray(sin)
    R, G, g2, hd = qkv.shape
    g, h = g2 - 2, hd // 2

    def rope(x):  # x [R, n, hd]
        rot = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
        return x * cos[:, None, :] + rot * sin[:, None, :]

    q = rope(qkv[:, :, :g].reshape(R, G * g, hd))
    k = rope(qkv[:, :, g])
    v = qkv[:, :, g + 1]
    kp, vp = np.array(kp.astype(jnp.float32)), np.array(vp.astype(jnp.float32))
    bs = kp.shape[3]
    for r, s in enumerate(np.asarray(slots)):
        if s >= 0:
            kp[layer, :, s // bs, s % bs] = k[r]
            vp[layer, :, s // bs, s % bs] = v[r]
    return q, kp, vp


def _f32(x):
    return np.asarray(x.astype(jnp.float32))


def _check(got, want, dtype):
    q, kp, vp = got
    wq, wk, wv = want
    tol = 0 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(_f32(q), wq, rtol=tol, atol=tol + 1e-6)
    # the NaN sentinels of untouched slots must survive where they are (NaN == NaN here)
    np.testing.assert_allclose(_f32(kp), wk, rtol=tol, atol=tol + 1e-6, equal_nan=True)
    np.testing.assert_allclose(_f32(vp), wv, rtol=tol, atol=tol + 1e-6, equal_nan=True)


SHAPES = [
    # R, G, g, hd, L, NB, BS, pad_every, first_slot
    (8, 4, 1, 64, 3, 10, 8, 0, False),
    (37, 2, 3, 32, 2, 20, 4, 5, True),  # R not a multiple of 16, GQA, the first slot written
    (1, 1, 1, 16, 1, 2, 16, 0, False),  # one row
    (16, 2, 2, 128, 2, 6, 16, 3, True),
    (40, 4, 1, 64, 2, 8, 8, 1, False),  # every row padding: nothing written
]


# bfloat16 on the awkward shape by default, on the others with the slow tests
CASES = [(s, jnp.float32) for s in SHAPES] + [
    pytest.param(s, jnp.bfloat16, marks=() if i == 1 else pytest.mark.slow) for i, s in enumerate(SHAPES)
]


@pytest.mark.parametrize("shape,dtype", CASES)
def test_kernel_matches_twin_and_numpy(shape, dtype):
    R, G, g, hd, L, NB, BS, pad_every, first_slot = shape
    rng = np.random.default_rng(R * 7 + G)
    args = _case(rng, R, G, g, hd, L, NB, BS, dtype, pad_every, first_slot)
    layer = L - 1
    got = rope_write_kv(*args, layer=jnp.int32(layer), interpret=True)
    twin = rope_write_kv_reference(*args, layer=layer)
    want = _np_expected(*args, layer)
    _check(twin, want, dtype)
    _check(got, want, dtype)
    # kernel and twin bit for bit (NaN sentinels included): V is copied, so always; rotated values
    # in bf16 (f32 RoPE rounded once); in f32 the two may differ in the last bit of a rotated value
    np.testing.assert_array_equal(_f32(got[2]), _f32(twin[2]))
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(_f32(got[0]), _f32(twin[0]))
        np.testing.assert_array_equal(_f32(got[1]), _f32(twin[1]))
    else:
        np.testing.assert_array_equal(np.isnan(_f32(got[1])), np.isnan(_f32(twin[1])))


@pytest.mark.slow  # ~20 s of interpreted kernels; the fixed shapes above stay in the default run
@settings(max_examples=15, deadline=None)
@given(
    R=st.integers(1, 40),
    G=st.sampled_from([1, 2, 4]),
    g=st.sampled_from([1, 2]),
    rows_per_program=st.sampled_from([4, 16]),
    pad=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_kernel_random_batches(R, G, g, rows_per_program, pad, seed):
    rng = np.random.default_rng(seed)
    NB, BS = max(2, -(-R // 4) + 1), 4
    args = _case(rng, R, G, g, 16, 2, NB, BS, jnp.bfloat16, pad, False)
    got = rope_write_kv(*args, layer=1, interpret=True, rows_per_program=rows_per_program)
    _check(got, _np_expected(*args, 1), jnp.bfloat16)


def test_bad_shapes_refused():
    rng = np.random.default_rng(0)
    qkv, cos, sin, kp, vp, slots = _case(rng, 8, 2, 1, 16, 1, 4, 4, jnp.float32)
    with pytest.raises(ValueError, match="qkv"):
        rope_write_kv(qkv[:, :, 0], cos, sin, kp, vp, slots, layer=0, interpret=True)
    with pytest.raises(ValueError, match=">= 3"):
        rope_write_kv(qkv[:, :, :2], cos, sin, kp, vp, slots, layer=0, interpret=True)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_write_kv(qkv, cos[:4], sin, kp, vp, slots, layer=0, interpret=True)
    with pytest.raises(ValueError, match="KV heads"):
        rope_write_kv(qkv, cos, sin, kp[:, :1], vp[:, :1], slots, layer=0, interpret=True)
    with pytest.raises(ValueError, match="pools"):
        rope_write_kv(qkv, cos, sin, kp[0], vp[0], slots, layer=0, interpret=True)
    with pytest.raises(ValueError, match="slots"):
        rope_write_kv(qkv, cos, sin, kp, vp, slots[:3], layer=0, interpret=True)
    with pytest.raises(ValueError, match="rows_per_program"):
        rope_write_kv(qkv, cos, sin, kp, vp, slots, layer=0, interpret=True, rows_per_program=12)


def test_triton_lowering_on_cpu():
    """The kernel lowers to Triton IR for an H200 from this CPU host at Ouro-1.4B shapes (decode
    and prefill buckets, a pool of ~2 GiB per layer: 64-bit offsets), with the pools aliased to
    outputs: catches an unsupported op before device time is spent."""
    import jax
    from jax._src.pallas.triton import gpu_info as gi
    from jax._src.pallas.triton import pallas_call_registration as pcr

    old = pcr.gpu_info_lib.get_gpu_info
    pcr.gpu_info_lib.get_gpu_info = lambda: gi.get_gpu_info_from_version(gi.GpuVersion.H200)
    try:
        for R in (8, 1024):
            sds = jax.ShapeDtypeStruct
            pool = sds((24, 16, 8192, 16, 128), jnp.bfloat16)
            args = (
                sds((R, 16, 3, 128), jnp.bfloat16),
                sds((R, 128), jnp.float32),
                sds((R, 128), jnp.float32),
                pool,
                pool,
                sds((R,), jnp.int32),
                sds((), jnp.int32),
            )

            def f(qkv, c, s, kp, vp, slots, layer):
                return rope_write_kv(qkv, c, s, kp, vp, slots, layer=layer)

            text = jax.jit(f, donate_argnums=(3, 4)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("xla.gpu.triton") == 1
            assert "output_operand_aliases" in text
    finally:
        pcr.gpu_info_lib.get_gpu_info = old


def test_kernel_wherever_attention_is_pallas():
    from ouro_jax import paged_attention as pa
    from pallas_kernels.dispatch import AttentionKernel

    triton = AttentionKernel("triton", 8, 4, 2, 16, interpret=True)
    reference = AttentionKernel("reference", 8, 4, 2, 16)
    assert pa.fuses_rope(triton) and not pa.fuses_rope(reference)


@pytest.mark.slow  # ~1 min on a CPU: the engine's buckets compiled twice with interpreted kernels
def test_engine_same_tokens_and_depths_with_and_without_kernel(monkeypatch):
    """The engine with the Triton attention kernel interpreted (prefill chunks across buckets,
    fused decode steps, the model's exit rule, float32): ``rope_write_kv`` gives XLA's RoPE +
    scatter path's tokens and exit depths (that path forced by patching ``fuses_rope``), and is
    really called (once per layer of every step)."""
    from ouro_jax import paged_attention as pa

    base, got, calls = engine_with_and_without(monkeypatch, "fuses_rope", pa, "rope_write_kv")
    assert len({d for _, depths in base for d in depths}) > 1  # the exit rule picked several depths
    assert got == base
    assert {s[0] for s in calls} == {8, 32}  # traced once per bucket's layer: decode and prefill


ON_GPU = __import__("jax").default_backend() == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (jax.default_backend() != 'gpu')")
@pytest.mark.parametrize("R", [8, 13, 1024])
def test_gpu_kernel_matches_twin_in_place(R):
    """The compiled kernel at Ouro-1.4B head shapes (16 KV heads, hd 128, bf16, pages of 16) gives
    its twin's queries and pools bit for bit, and under a jit that donates the pools writes them
    in place (the output pool is the input's buffer: no copy of the pool)."""
    import jax

    rng = np.random.default_rng(R)
    qkv, cos, sin, kp, vp, slots = _case(rng, R, 16, 1, 128, 3, 2 * R // 16 + 4, 16, jnp.bfloat16, 4, True)
    want = rope_write_kv_reference(qkv, cos, sin, kp, vp, slots, layer=2)
    want = [np.asarray(x) for x in want]
    ptrs = (kp.unsafe_buffer_pointer(), vp.unsafe_buffer_pointer())
    f = jax.jit(lambda *a: rope_write_kv(*a, layer=jnp.int32(2)), donate_argnums=(3, 4))
    got = f(qkv, cos, sin, kp, vp, slots)
    assert (got[1].unsafe_buffer_pointer(), got[2].unsafe_buffer_pointer()) == ptrs
    for a, b in zip(got, want):
        np.testing.assert_array_equal(_f32(a), b.astype(np.float32))
