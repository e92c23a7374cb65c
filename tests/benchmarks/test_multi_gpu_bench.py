"""``benchmarks/multi_gpu.py``: the figures against their goals (fast, made-up numbers), and the whole
script end to end on the tiny preset with two host devices (slow). Nothing about speed is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")

from benchmarks import multi_gpu  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _result(tpot1, tpot2, dp1, dp2):
    ar = dict(hidden=64, dtype="bfloat16", rows=[dict(rows=8, bytes=1024, seconds=1e-5, floor_s=1e-6, busbw_GBps=0.1),
              dict(rows=128, bytes=16384, seconds=2e-5, floor_s=1e-5, busbw_GBps=0.8)],
              busbw=dict(bytes=1 << 20, seconds=1e-3, GBps=1.0))  # fmt: skip
    tp = lambda t, thr: dict(c1=dict(tpot_s=t), batch=dict(requests=4, output_tok_per_s=thr))  # noqa: E731
    dp = dict(
        rate_req_s=10.0, load=3.0, requests=8, runs={"1": dict(output_tok_per_s=dp1), "2": dict(output_tok_per_s=dp2)}
    )
    return dict(preset="tiny", device="d", backend="cpu", settings=dict(buckets=[8, 128]),
                config=dict(num_hidden_layers=2, num_loops=4, hidden_size=64),
                tp1=tp(tpot1, 100.0), tp2=tp(tpot2, 150.0), allreduce=ar, dp=dp)  # fmt: skip


def test_summary_against_the_goals(tmp_path, capsys):
    r = _result(0.010, 0.0055, 100.0, 195.0)
    s = multi_gpu.summary(r)
    assert s["tp_c1_tpot_ratio"] == pytest.approx(0.55) and s["tp_c1_tpot_met"]
    assert s["dp_throughput_ratio"] == pytest.approx(1.95) and s["dp_met"]
    assert s["tp_batch_throughput_ratio"] == pytest.approx(1.5)
    assert s["allreduce_rows_c1"] == 8  # the smallest bucket: what a c=1 decode step all-reduces
    assert s["allreduce_per_layer_c1_s"] == pytest.approx(2e-5)  # two per layer
    assert s["allreduce_per_token_c1_s"] == pytest.approx(2e-5 * 2 * 4)
    s2 = multi_gpu.summary(_result(0.010, 0.007, 100.0, 150.0))
    assert not s2["tp_c1_tpot_met"] and not s2["dp_met"]
    r["summary"] = s
    multi_gpu.print_summary(r)
    out = capsys.readouterr().out
    assert "goal <= 0.6x: MET" in out and "goal >= 1.9x: MET" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(multi_gpu.plot(r, str(tmp_path / "p.png"))) > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown preset"):
        multi_gpu.main(["--preset", "ouro-9b"])
    with pytest.raises(ValueError, match="--batch"):
        multi_gpu.main(["--batch", "0"])
    with pytest.raises(ValueError, match="--ar-iters"):
        multi_gpu.main(["--ar-iters", "1"])


@pytest.mark.slow  # ~2.5 min on 2 CPU cores: four interpreters and two servers on the tiny preset
def test_end_to_end_on_two_host_devices(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false"
    cmd = [sys.executable, "-m", "benchmarks.multi_gpu", "--preset", "tiny", "--cpu-smoke", "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads((tmp_path / "multi_gpu_tiny.json").read_text())
    assert r["tp1"]["tp"] == 1 and r["tp2"]["tp"] == 2
    for tp in ("tp1", "tp2"):
        assert r[tp]["c1"]["tpot_s"] > 0 and r[tp]["batch"]["output_tokens"] == 4 * 6
    assert set(r["dp"]["runs"]) == {"1", "2"} and r["dp"]["replica_mode"] == "process"  # serve's default
    for run in r["dp"]["runs"].values():
        assert run["requests"] == 8 and run["output_tok_per_s"] > 0
    assert r["allreduce"]["busbw"]["GBps"] > 0 and all(x["seconds"] >= 0 for x in r["allreduce"]["rows"])
    assert {"tp_c1_tpot_ratio", "dp_throughput_ratio", "allreduce_per_layer_c1_s"} <= set(r["summary"])
    assert "goal <= 0.6x" in p.stdout and "goal >= 1.9x" in p.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "multi_gpu_tiny.png").stat().st_size > 0
