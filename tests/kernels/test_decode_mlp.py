"""The decode MLP's two Mosaic GPU kernels (pallas_kernels/decode_mlp_mgpu.py).

On CPU: the jnp twin against the model's own MLP (``OuroMLP``) in float32 on awkward shapes, each
down partial against its own K range, the default tuning at Ouro-1.4B shapes, the refused
launches, and cross-lowering of the kernels for CUDA (Pallas -> Mosaic GPU without a device: the
TMA slices, swizzles, wgmma operands and layouts are accepted), and both launches in Pallas' GPU
interpreter with wgmma stood in for (the data movement; wgmma and speed only the GPU checks). On
the GPU (``-m gpu``): kernel == twin (f32 partials) and close to the model's MLP
in bf16, at Ouro-1.4B shapes and awkward ones.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax.model import OuroMLP
from pallas_kernels.decode_gemm_mgpu import NUM_SMS, SMEM_LIMIT
from pallas_kernels.decode_mlp_mgpu import MAX_ROWS, decode_mlp_mgpu, decode_mlp_reference, mlp_tuning, supported
from tests.kernels.conftest import first_by_default, skip_no_hopper
from weights.config import OuroConfig

gpu = pytest.mark.gpu

OURO = (2048, 5632)  # Ouro-1.4B: hidden size D, intermediate size I
# (D, I, knobs): K tails of both kernels, more splits than steps, one step, uneven splits
AWKWARD = [
    (192, 448, {}),  # D = 1.5 steps of 128: a K tail in kernel 1; I: 3.5 steps in kernel 2
    (256, 320, dict(block_k=64, down_splits=2)),  # I = 5 steps in splits of 3 and 2
    (128, 128, dict(down_splits=16)),  # splits cut to the one step there is
    (640, 1216, dict(block_k=64, gate_up_stages=2, down_stages=3)),  # short rings, 19 steps in 4 splits
]


def _args(m, d, inter, dtype, seed=0):
    kx, kg, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (m, d), jnp.float32).astype(dtype)
    w_gu = (jax.random.normal(kg, (d, 2, inter), jnp.float32) / np.sqrt(d)).astype(dtype)
    w_d = (jax.random.normal(kd, (inter, d), jnp.float32) / np.sqrt(inter)).astype(dtype)
    return x, w_gu, w_d


def _model_mlp(x, w_gu, w_d):
    """The model's MLP (fused gate/up projection) on these weights, in their dtype."""
    d, _, inter = w_gu.shape
    cfg = OuroConfig(hidden_size=d, intermediate_size=inter)
    params = {"gate_up_proj": {"kernel": w_gu}, "down_proj": {"kernel": w_d}}
    return OuroMLP(cfg, w_gu.dtype, fused=True).apply({"params": params}, x)


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------


# M = 8 by default (an engine bucket), the other row counts in the slow suite (CPU time)
@pytest.mark.parametrize("m", [8, *(pytest.param(m, marks=pytest.mark.slow) for m in (1, 3, 16))])
@pytest.mark.parametrize("d,inter,knobs", first_by_default(AWKWARD))
def test_twin_matches_model_mlp(m, d, inter, knobs):
    """float32: the twin's partials sum to the model's MLP; each is its own K range's product."""
    x, w_gu, w_d = _args(m, d, inter, jnp.float32, seed=m)
    want = np.asarray(_model_mlp(x, w_gu, w_d))
    got = decode_mlp_reference(x, w_gu, w_d, **knobs)
    assert got.shape == (m, d) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    part = decode_mlp_reference(x, w_gu, w_d, reduce=False, **knobs)
    t = mlp_tuning(d, inter, **knobs)
    assert part.shape == (t.down.splits, m, d)
    g, u = np.einsum("md,djn->jmn", np.asarray(x, np.float64), np.asarray(w_gu, np.float64))
    h = g / (1 + np.exp(-g)) * u
    chunk = t.down.steps_per_split * t.block_k
    for s in range(t.down.splits):
        lo, hi = s * chunk, min(inter, (s + 1) * chunk)
        assert hi > lo  # no split is empty
        np.testing.assert_allclose(np.asarray(part[s]), h[:, lo:hi] @ np.asarray(w_d, np.float64)[lo:hi], atol=1e-5)


def _pair(w_gu):
    """The checkpoint's layout of the same weights: separate ``gate_proj`` and ``up_proj`` kernels."""
    return w_gu[:, 0], w_gu[:, 1]


def test_twin_takes_either_layout():
    x, w_gu, w_d = _args(8, 192, 448, jnp.float32)
    fused = decode_mlp_reference(x, w_gu, w_d, reduce=False)
    np.testing.assert_array_equal(np.asarray(decode_mlp_reference(x, _pair(w_gu), w_d, reduce=False)), fused)
    with pytest.raises(ValueError, match="two \\[D, I\\] kernels"):
        decode_mlp_reference(x, (w_gu[:, 0], w_gu[:, 1, :64]), w_d)


def test_twin_rounds_h_to_the_model_dtype():
    """In bf16 the twin stores ``h`` in bf16 as the kernel does; the sum stays close to the model's
    MLP, which also rounds the gate and up outputs."""
    x, w_gu, w_d = _args(8, 256, 320, jnp.bfloat16)
    got = np.asarray(decode_mlp_reference(x, w_gu, w_d))
    f32 = [a.astype(jnp.float32) for a in (x, w_gu, w_d)]
    exact = np.asarray(decode_mlp_reference(*f32))
    assert not np.array_equal(got, exact)  # h was rounded
    np.testing.assert_allclose(got, exact, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(_model_mlp(x, w_gu, w_d), np.float32), got, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("d,inter", [OURO, (1024, 2816), (4096, 11008)])
def test_default_tuning(d, inter):
    """Every CTA of both launches resident at once (one per SM) with its shared memory under the
    limit, no empty split, at least two slots in flight; Ouro-1.4B: 88 gate/up CTAs, 32 x 4 down."""
    t = mlp_tuning(d, inter)
    k1, k2 = t.smem_bytes()
    assert k1 <= SMEM_LIMIT and k2 <= SMEM_LIMIT
    assert inter // 64 <= 2 * NUM_SMS and (d // 64) * t.down.splits <= NUM_SMS
    assert t.gate_up_stages >= 2 and t.down.stages >= 2
    steps = -(-inter // t.block_k)
    assert (t.down.splits - 1) * t.down.steps_per_split < steps <= t.down.splits * t.down.steps_per_split
    if (d, inter) == OURO:
        assert (inter // 64, d // 64, t.down.splits, t.block_k) == (88, 32, 4, 128)


def test_refusals():
    bf = jnp.bfloat16
    x, w_gu, w_d = _args(8, 256, 320, bf)
    assert supported(bf, 8, 256, 320) is None
    assert "float32" in supported(jnp.float32, 8, 256, 320)
    assert "17 rows" in supported(bf, MAX_ROWS + 1, 256, 320)
    assert "intermediate size 100" in supported(bf, 8, 256, 100)
    with pytest.raises(ValueError, match="17 rows"):
        decode_mlp_mgpu(jnp.zeros((17, 256), bf), w_gu, w_d)
    with pytest.raises(ValueError, match="w_down"):
        decode_mlp_mgpu(x, w_gu, w_d.T)
    with pytest.raises(ValueError, match="disagree on D"):
        decode_mlp_mgpu(x[:, :128], w_gu, w_d)
    with pytest.raises(ValueError, match="share a dtype"):
        decode_mlp_mgpu(x.astype(jnp.float16), w_gu, w_d)
    with pytest.raises(ValueError, match="float32"):
        decode_mlp_mgpu(*(a.astype(jnp.float32) for a in (x, w_gu, w_d)))
    with pytest.raises(ValueError, match="block_k=96"):
        mlp_tuning(256, 320, block_k=96)
    with pytest.raises(ValueError, match="gate_up_block_n=48"):
        mlp_tuning(256, 320, gate_up_block_n=48)
    with pytest.raises(ValueError, match="down_block_n=64 must be one of .* and divide 224"):
        mlp_tuning(224, 320)
    with pytest.raises(ValueError, match="shared memory"):
        mlp_tuning(4096, 4096, block_k=512, gate_up_stages=4)
    # the twin refuses the same shapes (but takes float32)
    with pytest.raises(ValueError, match="17 rows"):
        decode_mlp_reference(jnp.zeros((17, 256), jnp.float32), w_gu.astype(jnp.float32), w_d.astype(jnp.float32))


def _lower(m, d, inter, pair=False, **knobs):
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16

    def f(x, w_gu, w_d):
        return decode_mlp_mgpu(x, w_gu, w_d, **knobs)

    w_gu = (sd((d, inter), bf), sd((d, inter), bf)) if pair else sd((d, 2, inter), bf)
    args = sd((m, d), bf), w_gu, sd((inter, d), bf)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2  # both launches


@pytest.mark.parametrize("m,pair", [(8, True), *(pytest.param(m, False, marks=pytest.mark.slow) for m in (1, 16))])
def test_mosaic_lowering_ouro_shapes(m, pair):
    _lower(m, *OURO, pair=pair)


@pytest.mark.parametrize(
    "gate_up_block_n,down_block_n,splits", first_by_default([(32, 32, 2), (16, 64, 4), (64, 16, 1)])
)
def test_mosaic_lowering_narrow_blocks(gate_up_block_n, down_block_n, splits):
    """Narrower CTAs: 16 / 32 columns, their tiles and the A tiles in 32 / 64-byte swizzles."""
    _lower(8, *OURO, gate_up_block_n=gate_up_block_n, down_block_n=down_block_n, down_splits=splits)


@pytest.mark.parametrize("d,inter,knobs", first_by_default(AWKWARD))
def test_mosaic_lowering_awkward_shapes(d, inter, knobs):
    _lower(3, d, inter, **knobs)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


# K tails in both kernels, rings that wrap, uneven splits, narrow CTAs, both weight layouts
INTERPRET = [
    (5, 256, 128, dict(block_k=64, gate_up_stages=2, down_splits=1, down_stages=1, gate_up_block_n=32), False),
    pytest.param(
        5,
        640,
        1216,
        dict(block_k=64, gate_up_stages=2, down_stages=3, gate_up_block_n=32, down_block_n=16),
        False,
        marks=pytest.mark.slow,
    ),
    pytest.param(3, 192, 448, dict(gate_up_stages=1, down_splits=2, down_stages=1), True, marks=pytest.mark.slow),
    pytest.param(16, 256, 320, dict(block_k=64, down_splits=2), False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("m,d,inter,knobs,pair", INTERPRET)
def test_kernels_in_the_interpreter_match_twin(mosaic_interpret, m, d, inter, knobs, pair):
    """Both launches' data movement on the CPU (Pallas' GPU interpreter, wgmma stood in for): the
    partials equal the twin's up to the bf16 rounding of an ``h`` whose f32 sums ran in another
    order (a misplaced tile would be off by the size of the values)."""
    x, w_gu, w_d = _args(m, d, inter, jnp.bfloat16, seed=m)
    weights = _pair(w_gu) if pair else w_gu
    got = np.asarray(mosaic_interpret(decode_mlp_mgpu)(x, weights, w_d, reduce=False, **knobs))
    want = np.asarray(decode_mlp_reference(x, weights, w_d, reduce=False, **knobs))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * max(1.0, float(np.abs(want).max())))


# Ouro-1.4B at every bucket size the engine sends, narrow CTAs, and the awkward shapes at 3 rows
GPU_CASES = [
    (1, *OURO, {}),
    (8, *OURO, {}),
    (16, *OURO, {}),
    (8, *OURO, dict(gate_up_block_n=32, down_block_n=16, down_splits=1)),
    *[(3, *case) for case in AWKWARD],
]


@gpu
@skip_no_hopper
@pytest.mark.parametrize("m,d,inter,knobs", GPU_CASES)
def test_kernel_matches_twin(m, d, inter, knobs):
    """bf16: the kernel's f32 partials equal the twin's up to summation order (the same bf16 ``h``
    but where a product's rounding of ``h`` flips), in both weight layouts, and the output is close
    to the model's MLP."""
    x, w_gu, w_d = _args(m, d, inter, jnp.bfloat16, seed=m)
    got = np.asarray(decode_mlp_mgpu(x, w_gu, w_d, reduce=False, **knobs))
    np.testing.assert_array_equal(np.asarray(decode_mlp_mgpu(x, _pair(w_gu), w_d, reduce=False, **knobs)), got)
    want = np.asarray(decode_mlp_reference(x, w_gu, w_d, reduce=False, **knobs))
    assert got.shape == want.shape and np.isfinite(got).all()
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=2e-2 * scale, rtol=0)
    np.testing.assert_allclose(got.sum(0), want.sum(0), atol=2e-2 * scale, rtol=0)
    model = np.asarray(_model_mlp(x, w_gu, w_d), np.float32)
    np.testing.assert_allclose(got.sum(0), model, atol=5e-2 * scale, rtol=0)
