"""The decode MLP in one Mosaic GPU launch (pallas_kernels/decode_mlp_fused_mgpu.py).

On CPU: the default tuning at Ouro-1.4B shapes (one CTA an SM, both rings in shared memory), the
refused launches, and cross-lowering for CUDA (the interpreter cannot run the global semaphores of
the grid barrier). On the GPU (``-m gpu``): kernel == twin (``decode_mlp_reference``'s f32 partials)
at Ouro-1.4B shapes, awkward ones and other knobs, and launches back to back (the barrier's
semaphores come back to zero).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_gemm_mgpu import NUM_SMS, SMEM_LIMIT
from pallas_kernels.decode_mlp_fused_mgpu import decode_mlp_fused_mgpu, fused_mlp_tuning, supported
from pallas_kernels.decode_mlp_mgpu import decode_mlp_reference
from tests.kernels.conftest import first_by_default, skip_no_hopper
from tests.kernels.test_decode_mlp import AWKWARD, OURO, _args, _model_mlp, _pair

gpu = pytest.mark.gpu

TWIN_KNOBS = ("block_k", "down_splits")  # what the partials' decomposition depends on


def _twin(x, w_gu, w_d, knobs):
    return decode_mlp_reference(x, w_gu, w_d, reduce=False, **{k: v for k, v in knobs.items() if k in TWIN_KNOBS})


def test_default_tuning_ouro():
    """Ouro-1.4B: 128 CTAs (32 down column blocks x 4 splits; 88 of them also run gate/up), both
    rings at least two slots deep at 128-row steps, within a CTA's shared memory."""
    t = fused_mlp_tuning(*OURO)
    assert (t.ctas, t.down.splits, t.block_k) == (128, 4, 128)
    assert t.gate_up_stages >= 2 and t.down.stages >= 2
    assert t.smem_bytes() <= SMEM_LIMIT and t.ctas <= NUM_SMS


def test_refusals():
    bf = jnp.bfloat16
    assert supported(bf, 8, *OURO) is None
    assert "172 CTAs" in supported(bf, 8, 4096, 11008)  # more gate/up blocks than SMs
    assert "17 rows" in supported(bf, 17, *OURO)
    x, w_gu, w_d = _args(8, 4096, 11008 // 64 * 64, bf)
    with pytest.raises(ValueError, match="CTAs"):
        decode_mlp_fused_mgpu(x, w_gu, w_d)
    with pytest.raises(ValueError, match="shared memory"):
        fused_mlp_tuning(*OURO, gate_up_stages=4, down_stages=4)
    with pytest.raises(ValueError, match="down_stages=0"):
        fused_mlp_tuning(*OURO, down_stages=0)


def _lower(m, d, inter, pair=False, **knobs):
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16

    def f(x, w_gu, w_d):
        return decode_mlp_fused_mgpu(x, w_gu, w_d, **knobs)

    w_gu = (sd((d, inter), bf), sd((d, inter), bf)) if pair else sd((d, 2, inter), bf)
    text = jax.jit(f).trace(sd((m, d), bf), w_gu, sd((inter, d), bf)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize(
    "m,knobs,pair",
    first_by_default([(8, {}, False), (1, dict(block_k=64), True), (16, dict(down_block_n=32, down_splits=2), False)]),
)
def test_mosaic_lowering_ouro_shapes(m, knobs, pair):
    _lower(m, *OURO, pair=pair, **knobs)


@pytest.mark.parametrize("d,inter,knobs", first_by_default(AWKWARD))
def test_mosaic_lowering_awkward_shapes(d, inter, knobs):
    _lower(3, d, inter, **knobs)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


GPU_CASES = [
    (1, *OURO, {}),
    (8, *OURO, {}),
    (16, *OURO, {}),
    (8, *OURO, dict(block_k=64)),
    (8, *OURO, dict(down_block_n=32, down_splits=2)),
    (8, *OURO, dict(gate_up_stages=1, down_stages=4)),
    *[(3, *case) for case in AWKWARD],
]


@gpu
@skip_no_hopper
@pytest.mark.parametrize("m,d,inter,knobs", GPU_CASES)
def test_kernel_matches_twin(m, d, inter, knobs):
    """bf16: the kernel's f32 partials equal the twin's up to summation order, in both weight
    layouts, close to the model's MLP; three launches in a row give the same bits (the barrier's
    semaphores are back at zero after each)."""
    x, w_gu, w_d = _args(m, d, inter, jnp.bfloat16, seed=m)
    got = np.asarray(decode_mlp_fused_mgpu(x, w_gu, w_d, reduce=False, **knobs))
    for _ in range(2):
        again = decode_mlp_fused_mgpu(x, _pair(w_gu), w_d, reduce=False, **knobs)
        np.testing.assert_array_equal(np.asarray(again), got)
    want = np.asarray(_twin(x, w_gu, w_d, knobs))
    assert got.shape == want.shape and np.isfinite(got).all()
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=2e-2 * scale, rtol=0)
    model = np.asarray(_model_mlp(x, w_gu, w_d), np.float32)
    np.testing.assert_allclose(got.sum(0), model, atol=5e-2 * scale, rtol=0)


@gpu
@skip_no_hopper
def test_many_launches_in_one_jit():
    """24 layers' launches chained in one jit (as the engine's step would): each equals its own
    launch alone, so no launch passes the barrier before every CTA of it has written h."""
    x, w_gu, w_d = _args(8, *OURO, jnp.bfloat16, seed=3)

    @jax.jit
    def chain(x):
        outs = []
        for i in range(24):
            y = decode_mlp_fused_mgpu(x, w_gu, w_d)
            outs.append(y)
            x = (x.astype(jnp.float32) + 1e-3 * y * (i + 1)).astype(x.dtype)
        return outs, x

    outs, _ = chain(x)
    for i in range(24):
        want = decode_mlp_fused_mgpu(x, w_gu, w_d)
        np.testing.assert_array_equal(np.asarray(outs[i]), np.asarray(want))
        x = (x.astype(jnp.float32) + 1e-3 * want * (i + 1)).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# Wiring (CPU): the engine with the one-launch MLP, a jnp stand-in for the kernel
# ----------------------------------------------------------------------------------------------


def _stand_in(x, w_gate_up, w_down, *, reduce):
    """The MLP's f32 down partials over two halves of I, as the kernel returns them."""
    assert not reduce
    f32 = jnp.float32
    y = jnp.dot(x.astype(f32), w_gate_up.reshape(x.shape[1], -1).astype(f32), precision="highest")
    inter = w_down.shape[0]
    h = jax.nn.silu(y[:, :inter]) * y[:, inter:]
    half = inter // 2
    wd = w_down.astype(f32)
    return jnp.stack([jnp.dot(h[:, :half], wd[:half], precision="highest"), jnp.dot(h[:, half:], wd[half:])])


@pytest.mark.slow  # ~1 min on a CPU: the engine's buckets compiled twice with interpreted kernels
def test_engine_same_tokens_and_depths_with_one_launch_mlp(monkeypatch):
    """The engine (interpreted Pallas attention and residual norms, prefill chunks across buckets,
    fused decode steps, the model's exit rule, float32) with every bucket of 16 rows or fewer on the
    one-launch MLP path, a jnp stand-in for the kernel returning two partials: the same tokens and
    exit depths as the XLA MLP, and the path really taken (the residual norm sums the partials)."""
    from ouro_jax import model as model_mod
    from ouro_jax import step_program
    from tests.kernels.conftest import engine_with_and_without

    monkeypatch.setattr(step_program, "mlp_one_launch", lambda rows, *a, **k: rows <= 16)
    monkeypatch.setattr(model_mod, "decode_mlp_fused_mgpu", _stand_in)
    flag = "mlp_one_launch"
    base, got, calls = engine_with_and_without(monkeypatch, flag, model_mod, "decode_mlp_fused_mgpu")
    assert len({d for _, depths in base for d in depths}) > 1
    assert got == base
    assert calls and {s[0] for s in calls} == {8}  # the 8-row bucket's layers; 32 rows stay on XLA
