"""``benchmarks/decode_gemm.py`` off the GPU: the XLA chains are timed against their floors, the
knob sweeps start at the defaults and repeat nothing, and the record file is written."""

import json

import pytest

from benchmarks import decode_gemm
from ouro_jax import get_preset


def test_cpu_run_times_the_xla_chains(tmp_path):
    argv = ["--preset", "tiny", "--rows", "2", "--chain", "2", "--reps", "1", "--profile", "--out", str(tmp_path)]
    out = decode_gemm.main(argv)
    recs = out["records"]  # no Hopper GPU: the xla paths alone
    assert [(r["block"], r["path"], r["rows"]) for r in recs] == [("mlp", "xla", 2), ("attn_proj", "xla", 2)]
    for rec in recs:
        assert "error" not in rec and rec["us_per_layer"] > 0 and rec["floor_us"] > 0
        assert rec["of_floor"] == pytest.approx(rec["floor_us"] / rec["us_per_layer"])
        kernels = rec["kernels"]  # on the CPU: the host plane's XLA thunks
        assert kernels and all(k["us_per_layer"] > 0 and k["count_per_layer"] > 0 for k in kernels)
        assert rec["kernel_us_per_layer"] == pytest.approx(sum(k["us_per_layer"] for k in kernels))
    assert json.loads((tmp_path / "decode_gemm.json").read_text())["records"] == recs


@pytest.mark.parametrize("block", decode_gemm.BLOCKS)
def test_sweep_starts_at_the_defaults_and_repeats_none(block):
    knobs = decode_gemm.sweep_knobs(block, get_preset("ouro-1.4b"))
    assert knobs[0] == {} and len(knobs) > 5
    assert len({json.dumps(k, sort_keys=True) for k in knobs}) == len(knobs)
