"""The transposed decode GEMM with ``x`` resident (pallas_kernels/decode_gemm_t_mgpu.py).

On CPU: the jnp twin against ``x @ w`` in float32 with each split's partial its own K range's
product, the default tuning at Ouro-1.4B's four projections (every CTA resident, the weight ring
deep), the refused launches, cross-lowering for CUDA (the transposed wgmma operands, x's resident
slices and the one-behind refill are accepted), and the kernel in Pallas' GPU interpreter (its TMA
ring and x's copies, K splits and tails, wgmma stood in for) against the twin. On the GPU (``-m
gpu``): kernel == twin (f32 partials) and close to XLA's bf16 product.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_gemm_mgpu import NUM_SMS, SMEM_LIMIT
from pallas_kernels.decode_gemm_t_mgpu import (
    SMEM_TWO_CTAS,
    decode_gemm_t_mgpu,
    decode_gemm_t_reference,
    supported,
    t_tuning,
)
from tests.kernels.conftest import first_by_default, skip_no_hopper
from tests.kernels.test_decode_gemm import _args, _dot, assert_split_partials

gpu = pytest.mark.gpu

# Ouro-1.4B's decode projections: (K, out shape of the stored kernel)
OURO = {"qkv": (2048, (16, 3, 128)), "o": (2048, (2048,)), "gate_up": (2048, (2, 5632)), "down": (5632, (2048,))}
# (K, out, knobs): uneven splits, a ring that wraps, one step a split, the deepest ring
AWKWARD = [
    (640, (192,), dict(block_k=64, splits=3, stages=2)),  # 10 steps: 4, 4, 2; the ring wraps
    (384, (64,), dict(block_k=128, splits=2)),  # 3 steps: 2 and 1
    (256, (2, 64), dict(splits=16)),  # splits cut to the steps (one each)
    (1024, (128,), dict(block_k=64, splits=1, stages=8)),  # 16 steps, 8 in flight
]


@pytest.mark.parametrize("m", [8, *(pytest.param(m, marks=pytest.mark.slow) for m in (1, 3, 16))])
@pytest.mark.parametrize("k,out,knobs", first_by_default(AWKWARD))
def test_twin_matches_dot(m, k, out, knobs):
    x, w = _args(m, k, out, jnp.float32, seed=m)
    got = decode_gemm_t_reference(x, w, **knobs)
    assert got.shape == (m, *out) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), _dot(x, w), rtol=1e-5, atol=1e-5)
    part = decode_gemm_t_reference(x, w, reduce=False, **knobs)
    assert_split_partials(part, x, w, t_tuning(m, k, int(np.prod(out)), **knobs))


@pytest.mark.parametrize("name", sorted(OURO))
@pytest.mark.parametrize("m", [1, 8, 16])
def test_default_tuning_ouro_shapes(name, m):
    """Every CTA resident at once (one an SM, or two where the column blocks outnumber the SMs:
    gate/up's 176), the ring at least two weight tiles deep and as deep as a split allows up to 8
    where one CTA holds an SM."""
    k, out = OURO[name]
    n = int(np.prod(out))
    t = t_tuning(m, k, n)
    ctas = (n // 64) * t.splits
    per_sm = 1 if ctas <= NUM_SMS else 2
    assert ctas <= per_sm * NUM_SMS and t.stages >= 2 and t.rows == (8 if m <= 8 else 16)
    assert t.smem_bytes() <= (SMEM_LIMIT if per_sm == 1 else SMEM_TWO_CTAS)
    if per_sm == 1:
        assert t.stages == min(8, t.steps_per_split)
    assert {"qkv": 1, "o": 4, "gate_up": 1, "down": 4}[name] == t.splits


def test_refusals():
    bf = jnp.bfloat16
    assert supported(bf, 8, 2048, 2048) is None
    assert "float32" in supported(jnp.float32, 8, 2048, 2048)
    assert "17 rows" in supported(bf, 17, 2048, 2048)
    assert "K=96" in supported(bf, 8, 96, 2048) and "N=80" in supported(bf, 8, 2048, 80)
    x, w = _args(8, 256, (128,), bf)
    with pytest.raises(ValueError, match="disagree on K"):
        decode_gemm_t_mgpu(x[:, :128], w)
    with pytest.raises(ValueError, match="share a dtype"):
        decode_gemm_t_mgpu(x.astype(jnp.float16), w)
    with pytest.raises(ValueError, match="block_k=96"):
        t_tuning(8, 256, 128, block_k=96)
    with pytest.raises(ValueError, match="stages=1 must be >= 2"):
        t_tuning(8, 1024, 128, block_k=64, splits=1, stages=1)
    with pytest.raises(ValueError, match="B >"):
        t_tuning(16, 8192, 128, block_k=256, splits=1, stages=8)


def _lower(m, k, out, **knobs):
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    f = jax.jit(lambda x, w: decode_gemm_t_mgpu(x, w, **knobs))
    assert "mosaic_gpu" in f.trace(sd((m, k), bf), sd((k, *out), bf)).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name", sorted(OURO))
@pytest.mark.parametrize("m", [8, pytest.param(16, marks=pytest.mark.slow)])
def test_mosaic_lowering_ouro_shapes(name, m):
    _lower(m, *OURO[name])


@pytest.mark.parametrize("k,out,knobs", first_by_default(AWKWARD))
def test_mosaic_lowering_awkward_shapes(k, out, knobs):
    _lower(3, k, out, **knobs)


@pytest.mark.parametrize("m,k,out,knobs", [(5, *AWKWARD[0]), pytest.param(16, *AWKWARD[3], marks=pytest.mark.slow)])
def test_kernel_in_the_interpreter_matches_twin(mosaic_interpret, m, k, out, knobs):
    """The data movement on the CPU: TMA ring with the one-behind refill, x's resident slices, K
    splits and the transposed partials' layout; a misplaced tile would be off by the values' size."""
    x, w = _args(m, k, out, jnp.bfloat16, seed=m)
    got = np.asarray(mosaic_interpret(decode_gemm_t_mgpu)(x, w, reduce=False, **knobs))
    want = np.asarray(decode_gemm_t_reference(x, w, reduce=False, **knobs))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(np.abs(want).max())))


GPU_CASES = [(m, *OURO[name], {}) for name in sorted(OURO) for m in (1, 8, 16)]
GPU_CASES += [(3, *case) for case in AWKWARD]


@gpu
@skip_no_hopper
@pytest.mark.parametrize("m,k,out,knobs", GPU_CASES)
def test_kernel_matches_twin(m, k, out, knobs):
    """bf16: the kernel's f32 partials equal the twin's up to summation order; the sum is close
    to XLA's bf16 product; two launches give the same bits."""
    x, w = _args(m, k, out, jnp.bfloat16, seed=m)
    got = np.asarray(decode_gemm_t_mgpu(x, w, reduce=False, **knobs))
    np.testing.assert_array_equal(np.asarray(decode_gemm_t_mgpu(x, w, reduce=False, **knobs)), got)
    want = np.asarray(decode_gemm_t_reference(x, w, reduce=False, **knobs))
    assert got.shape == want.shape and np.isfinite(got).all()
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=1e-3 * scale, rtol=0)
    xla = np.asarray(jnp.dot(x, w.reshape(k, -1)).reshape(m, *out), np.float32)
    np.testing.assert_allclose(got.sum(0), xla, atol=2e-2 * scale, rtol=0)
