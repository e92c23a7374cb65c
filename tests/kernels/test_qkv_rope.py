"""``qkv_rope``: the fused Q/K/V projection with RoPE in its epilogue (Mosaic GPU).

On every machine: the jnp twin against a float64 numpy oracle (the model's RoPE on the projection,
one rounding at the end) and against the engine's path without the kernel (the projection, then
``rope_write_kv``'s twin), the shape rule, bad input refused before any work, and the kernel
cross-lowered for CUDA at both tilings. On a Hopper GPU (``-m gpu``): the kernel against the twin
on awkward shapes (GQA groups, tiles that are not a power of two, Ouro-1.4B's shapes) and a row's
result independent of the other rows. The warp-specialised pipeline has no Pallas interpreter, so
the kernel itself runs only there.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.qkv_rope_mgpu import Tuning, qkv_rope, qkv_rope_reference, supported
from pallas_kernels.rope import rope_cos_sin
from pallas_kernels.rope_write_kv import rope_write_kv_reference
from tests.kernels.conftest import skip_no_hopper

gpu = pytest.mark.gpu


def _case(M, D, G, g, hd=128, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, D)), dtype)
    w = jnp.asarray(rng.standard_normal((D, G, g + 2, hd)) / np.sqrt(D), dtype)
    cos, sin = rope_cos_sin(jnp.asarray(rng.integers(0, 8192, M)), hd, 1e6)
    return x, w, cos, sin


def test_twin_is_the_float64_rotation_rounded_once():
    x, w, cos, sin = _case(24, 96, 2, 2, hd=16)
    q, kv = qkv_rope_reference(x, w, cos, sin)
    assert q.shape == (24, 4, 16) and kv.shape == (24, 2, 2, 16) and q.dtype == kv.dtype == jnp.bfloat16
    y = np.einsum("md,dgth->mgth", np.asarray(x, np.float64), np.asarray(w, np.float64))
    c, s = np.asarray(cos, np.float64)[:, None], np.asarray(sin, np.float64)[:, None]

    def rope(t):  # [M, n, hd]
        return t * c + np.concatenate([-t[..., 8:], t[..., :8]], axis=-1) * s

    want_q = rope(y[:, :, :2].reshape(24, 4, 16))
    want_kv = np.stack([rope(y[:, :, 2]), y[:, :, 3]], axis=2)
    # float32 products rotated in float32, rounded once to bf16: within one bf16 ulp
    np.testing.assert_allclose(np.asarray(q, np.float64), want_q, rtol=2.0**-7, atol=1e-3)
    np.testing.assert_allclose(np.asarray(kv, np.float64), want_kv, rtol=2.0**-7, atol=1e-3)


def test_twin_equals_the_engine_path_in_float32():
    """In float32 the twin gives what the engine gives without the kernel: the projection, then
    ``rope_write_kv``'s rotation of q and k."""
    x, w, cos, sin = _case(40, 64, 3, 1, hd=32, seed=1, dtype=jnp.float32)
    q, kv = qkv_rope_reference(x, w, cos, sin)
    qkv = jnp.einsum("md,dgth->mgth", x, w, precision="highest")
    pool = jnp.zeros((1, 3, 8, 8, 32), jnp.float32)
    want_q, kp, vp = rope_write_kv_reference(qkv, cos, sin, pool, pool, jnp.arange(40, dtype=jnp.int32), layer=0)
    np.testing.assert_allclose(np.asarray(q), np.asarray(want_q), rtol=1e-5, atol=1e-5)
    for i, pool in enumerate((kp, vp)):  # rows 0..39 wrote slots 0..39
        written = np.asarray(pool[0].reshape(3, 64, 32)[:, :40].swapaxes(0, 1))
        np.testing.assert_allclose(np.asarray(kv[:, :, i]), written, rtol=1e-5, atol=1e-5)


def test_shape_rule():
    assert supported(1024, 2048, 16, 1, 128, jnp.bfloat16) is None  # Ouro-1.4B
    assert supported(1024, 2048, 16, 1, 128, jnp.bfloat16, Tuning(heads=2)) is None
    assert supported(256, 2048, 4, 3, 128, jnp.float16) is None  # GQA
    assert "dtype" in supported(1024, 2048, 16, 1, 128, jnp.float32)
    assert "head_dim" in supported(1024, 2048, 16, 1, 64, jnp.bfloat16)
    assert "rows" in supported(1000, 2048, 16, 1, 128, jnp.bfloat16)
    assert "rows" in supported(0, 2048, 16, 1, 128, jnp.bfloat16)
    assert "hidden" in supported(1024, 2000, 16, 1, 128, jnp.bfloat16)
    assert "heads" in supported(1024, 2048, 1, 1, 128, jnp.bfloat16, Tuning(heads=2))  # 3 heads
    assert "tiling" in supported(1024, 2048, 16, 1, 128, jnp.bfloat16, Tuning(block_m=64))  # 32 rows a warpgroup
    assert "tiling" in supported(1024, 2048, 16, 1, 128, jnp.bfloat16, Tuning(heads=3))


def test_bad_input_is_refused_before_any_work():
    x, w, c, s = _case(128, 128, 2, 1)
    with pytest.raises(ValueError, match=r"\[D=128, G, g \+ 2, hd\]"):
        qkv_rope(x, w.reshape(128, 2, 384), c, s)
    with pytest.raises(ValueError, match="share a dtype"):
        qkv_rope(x, w.astype(jnp.float16), c, s)
    with pytest.raises(ValueError, match="g >= 1"):
        qkv_rope(x, w[:, :, 1:], c, s)
    with pytest.raises(ValueError, match="cos/sin"):
        qkv_rope(x, w, c[:, :64], s[:, :64])
    with pytest.raises(ValueError, match="rows"):
        qkv_rope(x[:100], w, c[:100], s[:100])


@pytest.mark.parametrize(
    "M,D,G,g,tuning",
    [(1024, 2048, 16, 1, None), (1024, 2048, 16, 1, Tuning(heads=2)), (256, 320, 2, 3, Tuning(heads=2, stages=3))],
)
def test_kernel_cross_lowers_for_cuda(M, D, G, g, tuning):
    """Pallas -> Mosaic GPU without a device: the TMA slices, swizzles and wgmma operands of the
    pipeline, the epilogue's layouts (the cos/sin loads in the accumulators' layout) and both
    stores are checked here, on any machine."""
    sd = jax.ShapeDtypeStruct
    table = sd((M, 128), jnp.float32)
    args = sd((M, D), jnp.bfloat16), sd((D, G, g + 2, 128), jnp.bfloat16), table, table
    lowered = jax.jit(lambda x, w, c, s: qkv_rope(x, w, c, s, tuning)).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 1


def _assert_kernel_matches_twin(got, want):
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        # both accumulate in float32 (in another order), rotate in float32 and round once
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2.0**-6, atol=2e-3)


@gpu
@skip_no_hopper
@pytest.mark.parametrize(
    "M,D,G,g,tuning",
    [
        (128, 64, 1, 1, None),  # one tile of each kind, one K step
        (384, 320, 2, 3, Tuning(heads=2)),  # GQA, 3 x 5 tiles, 5 K steps
        (1024, 2048, 16, 1, None),  # Ouro-1.4B at a prompt bucket
        (1024, 2048, 16, 1, Tuning(heads=2, stages=3, minor_n=False)),
    ],
)
def test_kernel_matches_twin(M, D, G, g, tuning):
    x, w, cos, sin = _case(M, D, G, g, seed=M + G)
    _assert_kernel_matches_twin(qkv_rope(x, w, cos, sin, tuning), qkv_rope_reference(x, w, cos, sin))


@gpu
@skip_no_hopper
def test_a_row_does_not_depend_on_the_others():
    x, w, cos, sin = _case(512, 256, 2, 1, seed=3)
    full = [np.asarray(o) for o in qkv_rope(x, w, cos, sin)]
    other = x.at[128:].set(-x[128:])  # every row tile but the first changes
    for a, b in zip(qkv_rope(other, w, cos, sin), full):
        np.testing.assert_array_equal(np.asarray(a)[:128], b[:128])


def test_engine_rule(monkeypatch):
    """A bucket runs the kernel on a Hopper GPU, from ``QKV_ROPE_MIN_ROWS`` rows, at shapes it
    serves, unless the Pallas kernels are refused (``attention="reference"``, or ``auto`` off a GPU)."""
    from pallas_kernels import dispatch

    rows = dispatch.QKV_ROPE_MIN_ROWS
    assert not dispatch.qkv_rope_epilogue(rows, 2048, 16, 1, 128, jnp.bfloat16, "pallas")  # this machine: no Hopper
    monkeypatch.setattr(dispatch, "hopper_available", lambda: True)
    assert dispatch.qkv_rope_epilogue(rows, 2048, 16, 1, 128, jnp.bfloat16, "pallas")
    assert dispatch.qkv_rope_epilogue(2 * rows, 2048, 8, 1, 128, jnp.bfloat16, "triton")  # a tensor-parallel shard
    assert not dispatch.qkv_rope_epilogue(rows, 2048, 16, 1, 128, jnp.bfloat16, "reference")
    assert not dispatch.qkv_rope_epilogue(rows // 2, 2048, 16, 1, 128, jnp.bfloat16, "pallas")
    assert not dispatch.qkv_rope_epilogue(rows, 2048, 16, 1, 128, jnp.float32, "pallas")
    assert not dispatch.qkv_rope_epilogue(rows, 256, 4, 1, 64, jnp.bfloat16, "pallas")  # ouro-small's head_dim
    if jax.default_backend() != "gpu":
        assert not dispatch.qkv_rope_epilogue(rows, 2048, 16, 1, 128, jnp.bfloat16, "auto")
