"""``benchmarks/l2_prefetch.py`` off the GPU: the stand-in kernel cross-lowers for CUDA with and
without its L2 prefetches, bad arguments are refused, and without a
Hopper GPU the benchmark says so and writes nothing."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import l2_prefetch as lp


def _lowered(mode, fraction=1.0, shape=(256, 640), ctas=3, spin=10):
    sds = (
        jax.ShapeDtypeStruct((8, shape[0]), jnp.bfloat16),
        jax.ShapeDtypeStruct(shape, jnp.bfloat16),
        jax.ShapeDtypeStruct((1024,), jnp.float32),
    )
    f = jax.jit(lambda x, w, fl: lp.chain(x, w, fl, mode=mode, ctas=ctas, spin=spin, fraction=fraction))
    return f.trace(*sds).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("mode", lp.MODES)
def test_cross_lowers(mode):
    text = _lowered(mode)
    assert "mosaic_gpu" in text and "dot_general" in text
    assert ("reduce" in text) == (mode != "warm")  # the flush


def test_only_prefetch_mode_prefetches():
    # the lowering is not deterministic text (a hash); the Mosaic GPU op's name in the module is
    assert "async_prefetch" in _lowered("prefetch", 0.5)
    assert "async_prefetch" not in _lowered("cold") and "async_prefetch" not in _lowered("prefetch", 0.0)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(mode="hot"), "mode must be"),
        (dict(mode="prefetch", shape=(200, 640)), "multiples of"),
        (dict(mode="prefetch", fraction=1.5), "fraction"),
        (dict(mode="cold", spin=-1), "spin"),
    ],
)
def test_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        _lowered(**kw)


def test_shape_argument():
    assert lp._shape("o=2048x1024") == ("o", (2048, 1024))
    with pytest.raises(Exception, match="NAME=KxN"):
        lp._shape("2048x1024")


def test_off_hopper_writes_nothing(tmp_path, capsys):
    assert lp.main(["--out", str(tmp_path)]) is None
    assert "needs a Hopper GPU" in capsys.readouterr().out and not list(tmp_path.iterdir())
