"""``benchmarks/weight_stream.py`` off the GPU: the case grid keeps what fits a CTA, every mode and
tile order cross-lowers for CUDA (TMA ring, wgmma, waits), bad knobs are refused, and without a
Hopper GPU the benchmark says so and writes nothing."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import weight_stream as ws


def test_cases_fit_a_cta():
    got = ws.cases([88, 128], [2, 8], [64, 128, 256], ws.MODES, ws.ORDERS)
    assert all((c["stages"] * c["bk"] * 64 + 64 * c["bk"]) * 2 <= ws.SMEM_BUDGET for c in got)
    assert {"ctas": 128, "stages": 8, "bk": 128, "mode": "mma_wait1", "order": "bands"} in got
    assert not any(c["stages"] == 8 and c["bk"] == 256 for c in got)  # 256 KB of ring


@pytest.mark.parametrize("mode", ws.MODES)
@pytest.mark.parametrize("order", ws.ORDERS)
def test_cross_lowers(mode, order):
    sd = jax.ShapeDtypeStruct((256, 640), jnp.bfloat16)  # 2 x 10 tiles of [128, 64]: uneven over 3 CTAs
    f = jax.jit(lambda w: ws.stream(w, ctas=3, stages=2, bk=128, mode=mode, order=order))
    assert "mosaic_gpu" in f.trace(sd).lower(lowering_platforms=("cuda",)).as_text()


def test_refusals():
    w = jax.ShapeDtypeStruct((256, 640), jnp.bfloat16)
    with pytest.raises(ValueError, match="mode must be"):
        jax.jit(lambda w: ws.stream(w, ctas=3, stages=2, bk=128, mode="copy")).trace(w)
    with pytest.raises(ValueError, match="multiple of bk=96"):
        jax.jit(lambda w: ws.stream(w, ctas=3, stages=2, bk=96)).trace(w)


def test_off_hopper_writes_nothing(tmp_path, capsys):
    assert ws.main(["--out", str(tmp_path)]) is None
    assert "needs a Hopper GPU" in capsys.readouterr().out and not list(tmp_path.iterdir())
