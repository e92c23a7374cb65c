"""``benchmarks/decode_mlp.py`` off the GPU: the XLA chain is timed against its floor, the knob
sweep covers the defaults' neighbours, and the record file is written."""

import json

import pytest

from benchmarks import decode_mlp
from ouro_jax import get_preset


def test_cpu_run_times_the_xla_chain(tmp_path):
    out = decode_mlp.main(["--preset", "tiny", "--rows", "2", "--chain", "2", "--reps", "1", "--out", str(tmp_path)])
    (rec,) = out["records"]  # no Hopper GPU: the xla path alone
    assert rec["path"] == "xla" and rec["rows"] == 2 and "error" not in rec
    assert rec["us_per_layer"] > 0 and rec["floor_us"] > 0
    assert rec["of_floor"] == pytest.approx(rec["floor_us"] / rec["us_per_layer"])
    assert json.loads((tmp_path / "decode_mlp.json").read_text())["records"] == out["records"]


def test_sweep_starts_at_the_defaults_and_repeats_none():
    knobs = decode_mlp.sweep_knobs(get_preset("ouro-1.4b"))
    assert knobs[0] == {} and len(knobs) > 8
    assert len({json.dumps(k, sort_keys=True) for k in knobs}) == len(knobs)
