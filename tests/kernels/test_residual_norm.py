"""``residual_norm``: the residual add of a sublayer's normed output and the next RMSNorm in one kernel.

The kernel (interpret mode) against its jnp twin and the twin against the model's two norms as
the layer runs them without it; awkward shapes (one row, rows not a multiple of the program's
block, narrow and Ouro-1.4B-wide rows, bf16 and f32); a row's result independent of the other
rows (bucket invariance); bad input refused; the engine's tokens and exit depths equal with and
without it; on a GPU, the compiled kernel against the twin at Ouro-1.4B shapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax.model import rms_norm
from pallas_kernels.residual_norm import residual_norm, residual_norm_reference, supported
from tests.kernels.conftest import engine_with_and_without

EPS = 1e-6


def _case(R, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R, D)) * 3, jnp.float32)
    a = jnp.asarray(rng.standard_normal((R, D)) * 5, dtype)
    w_a = jnp.asarray(1 + 0.2 * rng.standard_normal(D), dtype)
    w_x = jnp.asarray(1 + 0.2 * rng.standard_normal(D), dtype)
    return x, a, w_a, w_x


def _close(got, want, dtype):
    x, h = got
    xr, hr = want
    assert x.dtype == jnp.float32 and h.dtype == jnp.dtype(dtype) and x.shape == xr.shape == h.shape
    np.testing.assert_allclose(np.asarray(x), np.asarray(xr), rtol=2e-6, atol=2e-6)
    # h: the same float32 value up to reduction order, rounded once: at most one ulp of its dtype apart
    ulp = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-22
    hf, hrf = np.asarray(h, np.float32), np.asarray(hr, np.float32)
    np.testing.assert_allclose(hf, hrf, rtol=ulp, atol=1e-6)


def test_twin_is_the_layers_two_norms():
    x, a, w_a, w_x = _case(5, 64, jnp.bfloat16)
    xr, hr = residual_norm_reference(x, a, w_a, w_x, eps=EPS, out_dtype=jnp.bfloat16)
    x2 = x + rms_norm(a, w_a, EPS).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(xr), np.asarray(x2))
    np.testing.assert_array_equal(np.asarray(hr), np.asarray(rms_norm(x2, w_x, EPS).astype(jnp.bfloat16)))


@pytest.mark.parametrize(
    "R,D,dtype,rpp",
    [(1, 16, jnp.float32, 1), (3, 64, jnp.bfloat16, 2), (13, 128, jnp.bfloat16, 4), (8, 2048, jnp.bfloat16, 1)],
)
def test_kernel_matches_twin(R, D, dtype, rpp):
    case = _case(R, D, dtype, seed=R)
    got = residual_norm(*case, eps=EPS, out_dtype=dtype, interpret=True, rows_per_program=rpp)
    _close(got, residual_norm_reference(*case, eps=EPS, out_dtype=dtype), dtype)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Bucket invariance: row i of a 16-row call equals the same row alone, bit for bit."""
    x, a, w_a, w_x = _case(16, 64, jnp.bfloat16, seed=4)
    full = residual_norm(x, a, w_a, w_x, eps=EPS, out_dtype=jnp.bfloat16, interpret=True)
    for i in (0, 7, 15):
        one = residual_norm(x[i : i + 1], a[i : i + 1], w_a, w_x, eps=EPS, out_dtype=jnp.bfloat16, interpret=True)
        for f, o in zip(full, one):
            np.testing.assert_array_equal(np.asarray(f[i : i + 1]), np.asarray(o))


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda c: (c[0].astype(jnp.bfloat16), *c[1:]), "float32 residual"),
        (lambda c: (c[0], c[1][:2], *c[2:]), "a must be"),
        (lambda c: (*c[:2], c[2][:8], c[3]), "weights"),
    ],
)
def test_bad_input_is_refused(change, match):
    case = change(_case(3, 16, jnp.bfloat16))
    with pytest.raises(ValueError, match=match):
        residual_norm(*case, eps=EPS, out_dtype=jnp.bfloat16, interpret=True)


def test_row_width_must_be_a_power_of_two():
    assert supported(2048) and supported(16) and not supported(48) and not supported(8)
    with pytest.raises(ValueError, match="power of two"):
        residual_norm(*_case(2, 48, jnp.float32), eps=EPS, out_dtype=jnp.float32, interpret=True)


@pytest.mark.slow  # ~1 min on a CPU: the engine's buckets compiled twice with interpreted kernels
def test_engine_same_tokens_and_depths_with_and_without_kernel(monkeypatch):
    """The engine with interpreted Pallas kernels (prefill chunks across buckets, fused decode
    steps, the model's exit rule, float32): the fused residual norm gives XLA's two norms' tokens
    and exit depths (that path forced by patching ``fuses_norms``), and is really called."""
    from ouro_jax import model as model_mod

    base, got, calls = engine_with_and_without(monkeypatch, "fuses_norms", model_mod, "residual_norm")
    assert len({d for _, depths in base for d in depths}) > 1  # the exit rule picked several depths
    assert got == base
    # traced twice per bucket's layer (after attention, after the MLP): decode and prefill buckets
    assert len(calls) % 2 == 0 and {s[0] for s in calls} == {8, 32}


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (jax.default_backend() != 'gpu')")
@pytest.mark.parametrize("R", [1, 8, 13, 1024])
def test_gpu_kernel_matches_twin(R):
    """The compiled kernel at Ouro-1.4B's width (2048, bf16) against its twin."""
    case = _case(R, 2048, jnp.bfloat16, seed=R)
    got = jax.jit(lambda *c: residual_norm(*c, eps=EPS, out_dtype=jnp.bfloat16))(*case)
    _close(got, residual_norm_reference(*case, eps=EPS, out_dtype=jnp.bfloat16), jnp.bfloat16)
