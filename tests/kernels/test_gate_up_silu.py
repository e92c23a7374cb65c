"""``gate_up_silu``: SwiGLU's gate/up GEMM with SiLU x up in its epilogue (Mosaic GPU).

On every machine: the jnp twin against a float64 numpy oracle (one rounding, at the end), the
shape rule (``supported``) and bad input refused before any work. On a Hopper GPU (``-m gpu``):
the kernel against the twin on awkward shapes (tiles that are not a power of two, one tile,
Ouro-1.4B's shapes) and a row's result independent of the other rows. The warp-specialised
pipeline has no Pallas interpreter, so the kernel itself runs only there.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gate_up_silu_mgpu import GROUP, Tuning, gate_up_silu, gate_up_silu_reference, supported
from tests.kernels.conftest import skip_no_hopper

gpu = pytest.mark.gpu


def _case(M, D, I, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, D)), dtype)
    w = jnp.asarray(rng.standard_normal((D, 2, I)) / np.sqrt(D), dtype)
    return x, w


def _oracle(x, w):
    xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
    g, u = xf @ wf[:, 0], xf @ wf[:, 1]
    return g / (1 + np.exp(-g)) * u


def test_twin_is_the_float64_product_rounded_once():
    x, w = _case(24, 96, 40)
    got = gate_up_silu_reference(x, w)
    assert got.dtype == jnp.bfloat16 and got.shape == (24, 40)
    want = _oracle(x, w)
    # float32 products rounded once to bf16: within one bf16 ulp of the float64 value
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2.0**-7, atol=1e-3)


def test_shape_rule():
    assert supported(1024, 2048, 5632, jnp.bfloat16) is None
    assert supported(256, 2048, 2816, jnp.float16) is None  # half of Ouro's MLP (tensor parallel 2)
    assert "dtype" in supported(1024, 2048, 5632, jnp.float32)
    assert "rows" in supported(1000, 2048, 5632, jnp.bfloat16)
    assert "rows" in supported(0, 2048, 5632, jnp.bfloat16)
    assert "hidden" in supported(1024, 2000, 5632, jnp.bfloat16)
    assert "intermediate" in supported(1024, 2048, 5632 + GROUP, jnp.bfloat16)
    assert supported(192, 2048, 5632, jnp.bfloat16, Tuning(block_m=64)) is None


def test_bad_input_is_refused_before_any_work():
    x, w = _case(128, 128, 128)
    with pytest.raises(ValueError, match=r"\[D=128, 2, I\]"):
        gate_up_silu(x, w.reshape(128, 256))
    with pytest.raises(ValueError, match="share a dtype"):
        gate_up_silu(x, w.astype(jnp.float16))
    with pytest.raises(ValueError, match="rows"):
        gate_up_silu(x[:100], w)
    with pytest.raises(ValueError, match="dtype float32"):
        gate_up_silu(x.astype(jnp.float32), w.astype(jnp.float32))
    with pytest.raises(ValueError, match="ctas -1"):
        gate_up_silu(x, w, Tuning(ctas=-1))


def _assert_kernel_matches_twin(got, want):
    g, r = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # both accumulate in float32 (in another order) and round once: at most ~2 bf16 ulps apart
    np.testing.assert_allclose(g, r, rtol=2.0**-6, atol=2e-3)


@gpu
@skip_no_hopper
@pytest.mark.parametrize(
    "M,D,I,tuning",
    [
        (128, 64, 128, None),  # one tile, one K step
        (384, 320, 384, None),  # 3 x 3 tiles, 5 K steps
        (1024, 2048, 5632, None),  # Ouro-1.4B at a prompt bucket
        (192, 2048, 2816, Tuning(block_m=64, stages=3, minor_n=False)),  # tensor-parallel half, other knobs
        (384, 320, 384, Tuning(ctas=4)),  # 9 tiles over a capped grid of 4 CTAs: uneven, several a CTA
    ],
)
def test_kernel_matches_twin(M, D, I, tuning):
    x, w = _case(M, D, I, seed=M + I)
    got = gate_up_silu(x, w, tuning)
    assert got.shape == (M, I) and got.dtype == x.dtype
    _assert_kernel_matches_twin(got, gate_up_silu_reference(x, w))


@gpu
@skip_no_hopper
def test_a_row_does_not_depend_on_the_others():
    x, w = _case(512, 256, 256, seed=3)
    full = np.asarray(gate_up_silu(x, w))
    other = x.at[128:].set(-x[128:])  # every tile but the first changes
    np.testing.assert_array_equal(np.asarray(gate_up_silu(other, w))[:128], full[:128])


def test_engine_rule(monkeypatch):
    """A bucket runs the kernel on a Hopper GPU, from ``SILU_EPILOGUE_MIN_ROWS`` rows, at shapes it
    serves, unless the Pallas kernels are refused (``attention="reference"``, or ``auto`` off a GPU)."""
    from pallas_kernels import dispatch

    rows = dispatch.SILU_EPILOGUE_MIN_ROWS
    assert not dispatch.silu_epilogue(rows, 2048, 5632, jnp.bfloat16, "pallas")  # this machine: no Hopper
    monkeypatch.setattr(dispatch, "hopper_available", lambda: True)
    assert dispatch.silu_epilogue(rows, 2048, 5632, jnp.bfloat16, "pallas")
    assert dispatch.silu_epilogue(2 * rows, 2048, 2816, jnp.bfloat16, "triton")  # a tensor-parallel shard
    assert not dispatch.silu_epilogue(rows, 2048, 5632, jnp.bfloat16, "reference")
    assert not dispatch.silu_epilogue(rows // 2, 2048, 5632, jnp.bfloat16, "pallas")
    assert not dispatch.silu_epilogue(rows, 2048, 5632, jnp.float32, "pallas")
    assert not dispatch.silu_epilogue(rows, 256, 704, jnp.bfloat16, "pallas")  # ouro-small's MLP width
    if jax.default_backend() != "gpu":
        assert not dispatch.silu_epilogue(rows, 2048, 5632, jnp.bfloat16, "auto")


@pytest.mark.parametrize(
    "M,D,I,tuning",
    [(1024, 2048, 5632, None), (192, 320, 384, Tuning(block_m=64, stages=3)), (384, 320, 384, Tuning(ctas=4))],
)
def test_kernel_cross_lowers_for_cuda(M, D, I, tuning):
    """Pallas -> Mosaic GPU without a device: the TMA slices, swizzles and wgmma operands of the
    warp-specialised pipeline and the epilogue's layouts are checked here, on any machine."""
    sd = jax.ShapeDtypeStruct
    args = sd((M, D), jnp.bfloat16), sd((D, 2, I), jnp.bfloat16)
    text = jax.jit(lambda x, w: gate_up_silu(x, w, tuning)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1
