"""The decode projections' Mosaic GPU GEMM (pallas_kernels/decode_gemm_mgpu.py).

On CPU: the jnp twin against ``x @ w`` in float32 on awkward shapes, each split's partial against
its own K range, the default tuning at Ouro-1.4B's projections, the refused launches, and
cross-lowering for CUDA (no device: TMA slices, swizzles, the wgmma operands and layouts are
accepted), and the kernel in Pallas' GPU interpreter (its TMA ring, K splits and tails, with wgmma
stood in for) against the twin. On the GPU (``-m gpu``): kernel == twin (f32 partials) and close
to XLA's bf16 product.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_gemm_mgpu import (
    MAX_ROWS,
    NUM_SMS,
    SMEM_LIMIT,
    decode_gemm_mgpu,
    decode_gemm_reference,
    gemm_tuning,
    supported,
)
from tests.kernels.conftest import first_by_default, skip_no_hopper

gpu = pytest.mark.gpu

# Ouro-1.4B's projections of a layer outside the MLP's gate/up: (K, out shape of the stored kernel)
OURO = {"qkv": (2048, (16, 3, 128)), "o": (2048, (2048,)), "down": (5632, (2048,))}
# (K, out, knobs): K tails, more splits than steps, uneven splits, narrow CTAs, one step
AWKWARD = [
    (640, (96,), dict(block_k=64, splits=3, stages=2, block_n=32)),  # 10 steps: 4, 4, 2; 32-column CTAs
    (192, (192,), dict(block_k=128)),  # a K tail
    (320, (7, 64), dict(block_k=128, splits=2)),  # N = 448; K: 3 steps in splits of 2 and 1
    (256, (128,), dict(splits=16)),  # splits cut to the steps
    (64, (64,), dict(block_n=16)),  # one step, 16-column CTAs
]


def _args(m, k, out, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, *out), jnp.float32) / np.sqrt(k)).astype(dtype)
    return x, w


def _dot(x, w):
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64).reshape(x.shape[1], -1)
    return y.reshape(x.shape[0], *w.shape[1:])


@pytest.mark.parametrize("m", [8, *(pytest.param(m, marks=pytest.mark.slow) for m in (1, 16))])
@pytest.mark.parametrize("k,out,knobs", first_by_default(AWKWARD))
def test_twin_matches_dot(m, k, out, knobs):
    """float32: the split partials sum to the product; each is its own K range's product."""
    x, w = _args(m, k, out, jnp.float32, seed=m)
    got = decode_gemm_reference(x, w, **knobs)
    assert got.shape == (m, *out) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), _dot(x, w), rtol=1e-5, atol=1e-5)
    part = decode_gemm_reference(x, w, reduce=False, **knobs)
    assert_split_partials(part, x, w, gemm_tuning(k, int(np.prod(out)), **knobs))


def assert_split_partials(part, x, w, t):
    """``part [splits, M, *out]``: split ``s`` is the product over its own K range
    (``t.steps_per_split`` steps of ``t.block_k``, the last clipped at K), none empty."""
    k = x.shape[1]
    assert part.shape == (t.splits, x.shape[0], *w.shape[1:])
    chunk = t.steps_per_split * t.block_k
    for s in range(t.splits):
        lo, hi = s * chunk, min(k, (s + 1) * chunk)
        assert hi > lo  # no split is empty
        np.testing.assert_allclose(np.asarray(part[s]), _dot(x[:, lo:hi], w[lo:hi]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(OURO))
def test_default_tuning_ouro_shapes(name):
    """One CTA an SM at most (132), under the shared-memory limit, at least two slots in flight."""
    k, out = OURO[name]
    n = int(np.prod(out))
    t = gemm_tuning(k, n)
    blocks, splits = t.grid(n)
    assert blocks * splits <= NUM_SMS and t.smem_bytes() <= SMEM_LIMIT and t.stages >= 2
    assert {"qkv": 1, "o": 4, "down": 4}[name] == splits and t.block_n == 64


def test_refusals():
    bf = jnp.bfloat16
    x, w = _args(8, 256, (128,), bf)
    assert supported(bf, 8, 256, 128) is None
    assert "float32" in supported(jnp.float32, 8, 256, 128)
    assert f"{MAX_ROWS + 1} rows" in supported(bf, MAX_ROWS + 1, 256, 128)
    assert "N=72" in supported(bf, 8, 256, 72) and supported(bf, 8, 256, 80) is None
    assert gemm_tuning(256, 80).block_n == 16 and gemm_tuning(256, 96).block_n == 32
    with pytest.raises(ValueError, match="disagree on K"):
        decode_gemm_mgpu(x, w[:128])
    with pytest.raises(ValueError, match="share a dtype"):
        decode_gemm_mgpu(x.astype(jnp.float16), w)
    with pytest.raises(ValueError, match="K=100"):
        decode_gemm_reference(jnp.zeros((8, 100), jnp.float32), jnp.zeros((100, 128), jnp.float32))
    with pytest.raises(ValueError, match="block_n=48"):
        gemm_tuning(256, 192, block_n=48)
    with pytest.raises(ValueError, match="stages=8 need"):
        gemm_tuning(8192, 128, block_k=512, splits=1, stages=8)


def _lower(m, k, out, **knobs) -> str:
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    lowered = jax.jit(lambda x, w: decode_gemm_mgpu(x, w, **knobs)).trace(sd((m, k), bf), sd((k, *out), bf))
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return text


@pytest.mark.parametrize("m,padded", [(8, False), (16, False), (3, True)])
def test_rows_padded_only_to_a_group_of_8(m, padded):
    """The engine's buckets (8, 16 rows) go to the launch as they are: a pad is one more kernel."""
    assert ("stablehlo.pad" in _lower(m, *OURO["o"])) == padded


@pytest.mark.parametrize("name", sorted(OURO))
def test_mosaic_lowering_ouro_shapes(name):
    _lower(8, *OURO[name])


@pytest.mark.parametrize("k,out,knobs", first_by_default(AWKWARD))
def test_mosaic_lowering_awkward_shapes(k, out, knobs):
    _lower(3, k, out, **knobs)


# K tails, uneven splits, rings that wrap (more steps than slots), narrow CTAs
INTERPRET = [
    (3, 256, (64,), dict(block_k=64, splits=2, stages=1, block_n=32)),
    pytest.param(3, 640, (96,), dict(block_k=64, splits=3, stages=2, block_n=32), marks=pytest.mark.slow),
    pytest.param(5, 320, (7, 64), dict(block_k=128, splits=2, stages=1), marks=pytest.mark.slow),
    pytest.param(16, 1024, (64,), dict(block_k=64, splits=1, stages=3, block_n=16), marks=pytest.mark.slow),
    pytest.param(1, 192, (192,), dict(block_k=128), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("m,k,out,knobs", INTERPRET)
def test_kernel_in_the_interpreter_matches_twin(mosaic_interpret, m, k, out, knobs):
    """The kernel's data movement on the CPU (Pallas' GPU interpreter, wgmma stood in for): its
    partials equal the twin's."""
    x, w = _args(m, k, out, jnp.bfloat16, seed=m)
    got = np.asarray(mosaic_interpret(decode_gemm_mgpu)(x, w, reduce=False, **knobs))
    want = np.asarray(decode_gemm_reference(x, w, reduce=False, **knobs))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@gpu
@skip_no_hopper
@pytest.mark.parametrize(
    "m,k,out,knobs",
    [(1, *OURO["qkv"], {}), (8, *OURO["o"], {}), (16, *OURO["down"], {}), *[(3, *case) for case in AWKWARD]],
)
def test_kernel_matches_twin(m, k, out, knobs):
    """bf16: the kernel's f32 partials equal the twin's up to summation order; the sum is close to
    XLA's bf16 product."""
    x, w = _args(m, k, out, jnp.bfloat16, seed=m)
    got = np.asarray(decode_gemm_mgpu(x, w, reduce=False, **knobs))
    want = np.asarray(decode_gemm_reference(x, w, reduce=False, **knobs))
    assert got.shape == want.shape and np.isfinite(got).all()
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=1e-3 * scale, rtol=0)
    xla = np.asarray(jnp.einsum("mk,k...->m...", x, w), np.float32)
    np.testing.assert_allclose(got.sum(0), xla, atol=2e-2 * scale, rtol=0)
