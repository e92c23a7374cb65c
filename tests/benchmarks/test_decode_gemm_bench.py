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


def test_report_section(tmp_path):
    """decode_gemm.json in REPORT.md: a row per record (knobs flattened, kernel device time against
    the floor, the longest kernels), the cut-short note, and the section in the written report."""
    from benchmarks import report

    kern = [dict(name="entry_mosaic_gpu_kernel", us_per_layer=23.0, count_per_layer=2.0)]
    recs = [
        dict(block="mlp", path="xla", rows=8, knobs={}, floor_us=16.0, us_per_layer=30.0),
        dict(block="attn_proj", path="mgpu", rows=8, knobs={"o": {"splits": 2}}, floor_us=8.0, us_per_layer=20.0)
        | dict(kernels=kern, kernel_us_per_layer=16.0),
        dict(block="mlp", path="mgpu", rows=8, knobs={"block_k": 96}, floor_us=16.0, error="ValueError: block_k=96"),
    ]
    res = dict(benchmark="decode_gemm", preset="ouro-1.4b", device="H200", chain=24, records=recs, truncated="time")
    body = [ln for ln in report.decode_gemm_section(res).splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert body[0].startswith("| mlp | 8 | xla | defaults | 30.00 | – | 16.00 | – | – |")
    assert (
        body[1] == "| attn_proj | 8 | mgpu | o.splits=2 | 20.00 | 16.00 | 8.00 | 50.0% | entry_mosaic_gpu_kernel 23.0 |"
    )
    assert "block_k=96" in body[2] and "ValueError" in body[2]
    assert "Cut short: time." in report.decode_gemm_section(res)
    (tmp_path / "decode_gemm.json").write_text(json.dumps(res))
    report.write_report(str(tmp_path))
    assert "## Decode GEMM kernels (benchmarks/decode_gemm.py)" in (tmp_path / "REPORT.md").read_text()
