"""The skinny Mosaic GPU matmul (pallas_kernels/skinny_matmul_mgpu.py).

On CPU: the jnp twin (the kernel's split decomposition) against ``jnp.dot`` in float32 on awkward
shapes, the default tuning, the refused launches, and cross-lowering of the kernel for CUDA
(Pallas -> Mosaic GPU without a device: TMA slices, transforms, the transposed wgmma operands and
the barrier ring are accepted; whether it runs and how fast only the GPU says). On the GPU
(``-m gpu``): kernel == twin (f32 partials) and == ``jnp.dot`` (bf16) on the Ouro-1.4B shapes and
awkward ones.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels import skinny_matmul_mgpu as sk
from pallas_kernels.skinny_matmul_mgpu import (
    SMEM_LIMIT,
    SMEM_TWO_CTAS,
    TARGET_CTAS,
    skinny_matmul_mgpu,
    skinny_matmul_reference,
    skinny_tuning,
    smem_bytes,
    supported,
)

ON_HOPPER = dispatch.hopper_available()
gpu = pytest.mark.gpu
skip_no_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper (sm90+) GPU")

# Ouro-1.4B per layer: (K, out shape of the stored kernel)
OURO = {
    "qkv": (2048, (16, 3, 128)),
    "o": (2048, (2048,)),
    "gate_up": (2048, (2, 5632)),
    "down": (5632, (2048,)),
}
# awkward: K / N tails of the blocks, more splits than steps, one step
AWKWARD = [
    (192, (192,), dict(block_n=128, block_k=128)),  # K and N tails
    (320, (7, 64), dict(block_n=128, block_k=128, splits=2)),  # N = 448: a tail; K: 3 steps in 2 splits
    (256, (128,), dict(splits=16)),  # splits cut to the K steps
    (64, (64,), {}),  # one step, one block
    (640, (320,), dict(block_k=64, splits=3, stages=2)),  # 10 steps: splits of 4, 4, 2
]


def _args(m, k, out, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, *out), jnp.float32) / np.sqrt(k)).astype(dtype)
    return x, w


def _dot(x, w):
    k = x.shape[1]
    y = jnp.dot(x.astype(jnp.float32), w.reshape(k, -1).astype(jnp.float32), precision="highest")
    return y.reshape(x.shape[0], *w.shape[1:])


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------


# M = 8 by default (an engine bucket), the other row counts in the slow suite (CPU time)
@pytest.mark.parametrize(
    "m",
    [
        pytest.param(1, marks=pytest.mark.slow),
        pytest.param(3, marks=pytest.mark.slow),
        8,
        pytest.param(16, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "k,out,knobs", [a if i == 4 else pytest.param(*a, marks=pytest.mark.slow) for i, a in enumerate(AWKWARD)]
)
def test_twin_matches_dot(m, k, out, knobs):
    """float32: the split partials sum to the product; each partial is its own K range's product."""
    x, w = _args(m, k, out, jnp.float32, seed=m)
    want = _dot(x, w)
    got = skinny_matmul_reference(x, w, **knobs)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    part = skinny_matmul_reference(x, w, reduce=False, **knobs)
    n = int(np.prod(out))
    t = skinny_tuning(m, k, n, **knobs)
    assert part.shape == (t.splits, m, *out) and part.dtype == jnp.float32
    chunk = t.steps_per_split * t.block_k
    for s in range(t.splits):
        lo, hi = s * chunk, min(k, (s + 1) * chunk)
        assert hi > lo  # no split is empty
        np.testing.assert_allclose(np.asarray(part[s]), np.asarray(_dot(x[:, lo:hi], w[lo:hi])), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [n if n == "o" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(OURO)])
def test_twin_matches_dot_ouro_shapes(name):
    k, out = OURO[name]
    x, w = _args(16, k, out, jnp.float32)
    np.testing.assert_allclose(np.asarray(skinny_matmul_reference(x, w)), np.asarray(_dot(x, w)), rtol=1e-4, atol=1e-4)


def test_twin_bf16_output_dtype():
    x, w = _args(8, 256, (128,), jnp.bfloat16)
    y = skinny_matmul_reference(x, w)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(_dot(x, w)), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m", [1, 8, 16, 64])
@pytest.mark.parametrize("name", sorted(OURO))
def test_default_tuning_ouro_shapes(name, m):
    """Every weight tile of the launch in flight: 132..264 CTAs (1-2 per SM of an H200), two CTAs'
    shared memory per SM, no empty split, at least two stages where a split has two steps."""
    k, out = OURO[name]
    n = int(np.prod(out))
    t = skinny_tuning(m, k, n)
    nb, sp = t.grid(n)
    assert 128 <= nb * sp <= TARGET_CTAS, t
    assert (sp - 1) * t.steps_per_split < -(-k // t.block_k) <= sp * t.steps_per_split, t
    assert smem_bytes(t.m_pad, t.block_n, t.block_k, t.stages) <= SMEM_TWO_CTAS, t
    assert t.stages == min(t.steps_per_split, t.stages) and (t.stages >= 2 or t.steps_per_split == 1), t
    assert t.block_k * t.block_n * 2 == 16 * 1024  # 16 KB weight tiles


def test_default_tuning_values():
    assert skinny_tuning(8, 2048, 6144) == skinny_tuning(8, 2048, 6144, block_n=128, block_k=64, splits=5, stages=6)
    t = skinny_tuning(16, 2048, 2048)
    assert (t.block_n, t.block_k, t.splits, t.steps_per_split, t.m_pad) == (64, 128, 8, 2, 16)
    t = skinny_tuning(8, 5632, 2048)
    assert (t.splits, t.steps_per_split) == (8, 6)  # 44 steps: 7 splits of 6 and one of 2
    assert skinny_tuning(3, 2048, 2048).m_pad == 8 and skinny_tuning(33, 2048, 2048).m_pad == 64
    t = skinny_tuning(8, 256, 128, splits=5)  # 2 steps of 128: 2 splits
    assert (t.splits, t.steps_per_split, t.stages) == (2, 1, 1)
    t = skinny_tuning(8, 640, 128, block_k=64, splits=3)  # 10 steps -> 4 + 4 + 2
    assert (t.splits, t.steps_per_split) == (3, 4)
    assert skinny_tuning(8, 2048, 64).block_n == 64


def test_supported_and_refused_launches():
    assert supported(jnp.bfloat16, 8, 2048, 6144) is None
    assert supported(jnp.float16, 64, 64, 64) is None
    assert "dtype" in supported(jnp.float32, 8, 2048, 2048)
    assert "rows" in supported(jnp.bfloat16, 65, 2048, 2048)
    assert "rows" in supported(jnp.bfloat16, 0, 2048, 2048)
    assert "K=100" in supported(jnp.bfloat16, 8, 100, 2048)
    assert "N=72" in supported(jnp.bfloat16, 8, 2048, 72)
    bf = jnp.bfloat16
    x, w = jnp.zeros((8, 256), bf), jnp.zeros((256, 128), bf)
    with pytest.raises(ValueError, match="dtype float32"):
        skinny_matmul_mgpu(x.astype(jnp.float32), w.astype(jnp.float32))
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_matmul_mgpu(x, w.astype(jnp.float16))
    with pytest.raises(ValueError, match="disagree on K"):
        skinny_matmul_mgpu(x, jnp.zeros((128, 128), bf))
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        skinny_matmul_mgpu(x[None], w)
    with pytest.raises(ValueError, match="rows"):
        skinny_matmul_mgpu(jnp.zeros((65, 256), bf), w)
    with pytest.raises(ValueError, match="N=72"):
        skinny_matmul_mgpu(x, jnp.zeros((256, 72), bf))
    with pytest.raises(ValueError, match="block_n=96"):
        skinny_matmul_mgpu(x, w, block_n=96)
    with pytest.raises(ValueError, match="block_n=256 must be <= N"):
        skinny_matmul_mgpu(x, w, block_n=256)
    with pytest.raises(ValueError, match="block_k=32"):
        skinny_matmul_mgpu(x, w, block_k=32)
    with pytest.raises(ValueError, match="splits=0"):
        skinny_matmul_mgpu(x, w, splits=0)
    with pytest.raises(ValueError, match="stages=0"):
        skinny_matmul_mgpu(x, w, stages=0)
    big = jnp.zeros((8, 4096), bf)
    with pytest.raises(ValueError, match="shared memory"):
        skinny_matmul_mgpu(big, jnp.zeros((4096, 256), bf), block_n=256, block_k=256, splits=1, stages=4)
    assert smem_bytes(8, 256, 256, 4) > SMEM_LIMIT
    # the twin has the same shape rules (but takes float32)
    with pytest.raises(ValueError, match="N=72"):
        skinny_matmul_reference(x.astype(jnp.float32), jnp.zeros((256, 72), jnp.float32))


def _lower(m, k, out, dtype=jnp.bfloat16, **knobs):
    sd = jax.ShapeDtypeStruct

    def f(x, w):
        return skinny_matmul_mgpu(x, w, **knobs)

    text = jax.jit(f).trace(sd((m, k), dtype), sd((k, *out), dtype)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("m", [8, pytest.param(16, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "name", [n if n in ("qkv", "down") else pytest.param(n, marks=pytest.mark.slow) for n in sorted(OURO)]
)
def test_mosaic_lowering_ouro_shapes(name, m):
    k, out = OURO[name]
    _lower(m, k, out)
    _lower(m, k, out, reduce=False)


@pytest.mark.parametrize(
    "m,k,out,knobs",
    [
        (1, 192, (192,), dict(block_n=128, block_k=128)),
        (3, 320, (7, 64), dict(block_n=128, block_k=128, splits=2)),
        pytest.param(64, 2048, (2048,), {}, marks=pytest.mark.slow),
        (33, 640, (320,), dict(block_k=64, splits=3, stages=2)),
        pytest.param(16, 2048, (2048,), dict(block_n=256, block_k=64, stages=4), marks=pytest.mark.slow),
        pytest.param(8, 2048, (6144,), dict(block_n=192, block_k=128, splits=1, stages=3), marks=pytest.mark.slow),
    ],
)
def test_mosaic_lowering_other_shapes(m, k, out, knobs):
    """Rows padded to 8 / 64, K and N tails, wider and odd blocks, float16."""
    _lower(m, k, out, **knobs)
    _lower(m, k, out, jnp.float16, **knobs)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

# bf16 outputs: one bf16 rounding of values of size ~1 (inputs drawn so that y ~ N(0, 1)), plus
# f32 summation-order differences; f32 partials: summation order only.
BF16_TOL = dict(rtol=1e-2, atol=2e-2)
F32_TOL = dict(rtol=1e-4, atol=1e-4)


def _check_gpu(m, k, out, **knobs):
    x, w = _args(m, k, out, jnp.bfloat16, seed=k + m)
    got = skinny_matmul_mgpu(x, w, **knobs)
    assert got.dtype == jnp.bfloat16 and got.shape == (m, *out)
    ref = np.asarray(_dot(x, w))
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, **BF16_TOL)
    xla = jax.jit(lambda a, b: jnp.dot(a, b.reshape(k, -1)).reshape(m, *out))(x, w)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(xla, np.float32), **BF16_TOL)
    part = skinny_matmul_mgpu(x, w, reduce=False, **knobs)
    twin = skinny_matmul_reference(x, w, reduce=False, **knobs)
    assert part.shape == twin.shape
    np.testing.assert_allclose(np.asarray(part), np.asarray(twin), **F32_TOL)


@gpu
@skip_no_hopper
@pytest.mark.parametrize("m", [1, 8, 16, 64])
@pytest.mark.parametrize("name", sorted(OURO))
def test_gpu_kernel_ouro_shapes(name, m):
    k, out = OURO[name]
    _check_gpu(m, k, out)


@gpu
@skip_no_hopper
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k,out,knobs", AWKWARD)
def test_gpu_kernel_awkward_shapes(m, k, out, knobs):
    _check_gpu(m, k, out, **knobs)


@gpu
@skip_no_hopper
@pytest.mark.parametrize(
    "knobs",
    [
        dict(block_n=256, block_k=64, stages=4),
        dict(block_n=192, block_k=128, splits=1, stages=3),
        dict(block_n=64, block_k=64, splits=32, stages=1),
    ],
)
def test_gpu_kernel_other_knobs(knobs):
    _check_gpu(16, 2048, (6144,), **knobs)


@pytest.mark.slow
def test_sweep_smoke_and_gpu_refusal(tmp_path):
    """benchmarks/matmul_sweep.py: the CPU plumbing (twin in the kernel's place: check, timing,
    JSON naming the device); without --smoke off a Hopper GPU it refuses with exit code 2."""
    import json

    from benchmarks import matmul_sweep

    assert matmul_sweep.main(["--smoke", "--check", "--rows", "1,3", "--reps", "1", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "matmul_sweep.json").read_text())
    assert rec["complete"] and rec["smoke"] and rec["device"]
    assert {(r["shape"], r["m"]) for r in rec["records"]} == {(s, m) for s in ("a", "b") for m in (1, 3)}
    assert all(r["mgpu_us"] > 0 and r["best_knobs"] and r["bytes"] > 0 for r in rec["records"])
    if not ON_HOPPER:
        assert matmul_sweep.main(["--check", "--out", str(tmp_path)]) == 2


# ----------------------------------------------------------------------------------------------
# Engine hook (CPU): decode_matmul
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_engine_decode_matmul_plumbing(monkeypatch):
    """With the twin in the kernel's place (``decode_matmul="reference"``, let through the LLM's
    check here) the small buckets' projections go through it and the tokens and depths are the
    default path's (float32 tiny preset); bigger buckets keep XLA's dot."""
    import functools

    from ouro_jax import LLM, SamplingParams, get_preset
    from ouro_jax import llm as llm_mod
    from ouro_jax import step_program as program
    from weights.random_init import random_params

    calls = []
    real = program.decode_matmul_fn

    def spy(name):
        f = real(name)
        if f is None:
            return None

        def g(x, w):
            calls.append((x.shape, w.shape))
            return f(x, w)

        return g

    monkeypatch.setattr(program, "decode_matmul_fn", spy)
    monkeypatch.setattr(llm_mod, "check_decode_matmul", functools.partial(program.check_decode_matmul, internal=True))
    cfg = get_preset("tiny")
    params = jax.tree.map(jnp.asarray, random_params(cfg, 0))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in (3, 17, 9)]

    def run(**kw):
        llm = LLM(
            cfg,
            params=params,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            prefill_chunk_size=8,
            block_size=4,
            max_model_len=64,
            buckets=[8, 16, 64],
            progress=False,
            executable_store=False,
            **kw,
        )
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        return [(o.token_ids, o.exit_depths) for o in outs], llm

    base, llm0 = run()
    assert not calls
    got, llm1 = run(decode_matmul="reference")
    assert got == base
    rows = {x[0] for x, _ in calls}
    assert calls and rows <= {8, 16}, rows
    # qkv, o and gate_up (K = 64, N = 192 / 64 / 192) took the twin; down (K = 96) kept XLA's dot
    assert {w for _, w in calls} >= {(64, 4, 3, 16), (64, 64), (64, 2, 96), (96, 64)}
    assert llm1.runner.decode_matmul == "reference" and llm0.runner.decode_matmul == "xla"
    assert llm0.runner._program_description() != llm1.runner._program_description()


def test_decode_matmul_option_checked():
    from ouro_jax import LLM, get_preset
    from ouro_jax.runner import DECODE_MATMUL_MAX_ROWS, check_decode_matmul

    assert DECODE_MATMUL_MAX_ROWS == 16
    assert check_decode_matmul("XLA") == "xla"
    assert check_decode_matmul("reference", internal=True) == "reference"
    with pytest.raises(ValueError, match="decode_matmul"):
        check_decode_matmul("reference")  # tests only
    with pytest.raises(ValueError, match="decode_matmul"):
        LLM(get_preset("tiny"), decode_matmul="cublas", progress=False)
    if not ON_HOPPER:
        with pytest.raises(ValueError, match="Hopper"):
            LLM(get_preset("tiny"), decode_matmul="mgpu", progress=False)
    else:
        with pytest.raises(ValueError, match="unrolled"):
            check_decode_matmul("mgpu", "scan")


def test_tuning_overrides_parse_and_merge(monkeypatch):
    """``OURO_JAX_SKINNY_TUNING``: global and per-shape knobs, the shape's own winning knob by
    knob; unreadable entries are refused naming the variable."""
    ov = sk.tuning_overrides("splits=4, stages=3; 2048x6144:block_n=64,splits=1")
    assert ov == {None: {"splits": 4, "stages": 3}, (2048, 6144): {"block_n": 64, "splits": 1}}
    assert sk.knobs_for(2048, 6144, ov) == {"splits": 1, "stages": 3, "block_n": 64}
    assert sk.knobs_for(2048, 2048, ov) == {"splits": 4, "stages": 3}
    assert sk.tuning_overrides("") == {}
    monkeypatch.setenv(sk.TUNING_ENV, "64x192:splits=2")
    assert sk.knobs_for(64, 192) == {"splits": 2}
    for bad in ("splits", "warps=2", "2048:splits=1", "axb:splits=1", "splits=x"):
        with pytest.raises(ValueError, match=sk.TUNING_ENV):
            sk.tuning_overrides(bad)


def test_tuning_overrides_reach_the_projections(monkeypatch):
    """The engine's projections take the override knobs (the twin's split decomposition changes
    with ``splits``: partial sums of other K ranges, same product) and the store key names them."""
    from ouro_jax import step_program as program

    monkeypatch.setenv(sk.TUNING_ENV, "64x192:splits=2,block_k=64")
    seen = []
    real = sk.skinny_matmul_reference

    def spy(x, w, **kw):
        seen.append((w.shape, kw))
        return real(x, w, **kw)

    monkeypatch.setattr(sk, "skinny_matmul_reference", spy)
    mm = program.decode_matmul_fn("reference")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 192)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    np.testing.assert_allclose(mm(x, w), x @ w, rtol=1e-5, atol=1e-5)
    mm(x, w2)
    assert seen == [((64, 192), {"splits": 2, "block_k": 64}), ((64, 64), {})]
