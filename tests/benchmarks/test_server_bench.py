"""``benchmarks/serve_bench.py`` on the tiny preset: a couple of requests through HTTP and through the
engine directly, the JSON it writes and its plot. Nothing about speed is asserted."""

import importlib.util
import json
import os

import pytest

pytest.importorskip("fastapi")

from benchmarks import serve_bench  # noqa: E402

TINY = [
    "--model", "tiny", "--prompt-len", "12", "--output-len", "4",
    "--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--prefill-chunk-size", "8", "--block-size", "4",
    "--max-model-len", "64", "--buckets", "16", "--fused-decode-max-rows", "0",
]  # fmt: skip


@pytest.mark.slow
def test_rates_http_against_offline(tmp_path):
    out = tmp_path / "serve.json"
    res = serve_bench.main(TINY + ["--rates", "20,40", "--num-requests", "3", "--server", "inproc", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["device"] and saved["workload"]["prompt_len"] == 12
    assert [r["rate"] for r in saved["runs"]] == [20.0, 40.0]
    for r in saved["runs"]:
        for mode in ("offline", "http"):
            s = r[mode]
            assert s["requests"] == 3 and 0.0 <= s["goodput_share"] <= 1.0
            assert s["ttft"]["n"] == 3 and s["tpot"]["n"] == 3 and s["e2e"]["p99"] >= s["ttft"]["p99"] > 0
            assert s["output_tok_per_s"] > 0
    assert res["startup"]["executables"]
    if importlib.util.find_spec("matplotlib") is not None:  # plots are optional (extra "plots")
        assert (tmp_path / "serve.png").stat().st_size > 0


def test_overhead_mode(tmp_path):
    out = tmp_path / "overhead.json"
    res = serve_bench.main(TINY + ["--overhead", "--overhead-requests", "2", "--server", "inproc", "--out", str(out)])
    o = json.loads(out.read_text())["overhead"]
    assert o["requests"] == 2 and o["engine_tpot_s"] > 0 and o["http_tpot_s"] > 0
    assert o["overhead_share"] == pytest.approx((o["http_tpot_s"] - o["engine_tpot_s"]) / o["engine_tpot_s"])
    assert res["runs"] == []


def test_summary_goodput_and_arrivals(tmp_path):
    rows = [
        dict(ttft=0.5, tpot=0.01, e2e=1.0, tokens=4),  # meets both SLOs
        dict(ttft=2.0, tpot=0.01, e2e=2.5, tokens=4),  # TTFT too long
        dict(ttft=0.2, tpot=0.2, e2e=3.0, tokens=4),  # TPOT too long
        dict(ttft=0.3, tpot=None, e2e=0.3, tokens=1),  # one token: no TPOT, meets the TTFT SLO
    ]
    s = serve_bench.summarize(rows, 2.0, slo_ttft=1.0, slo_tpot=0.05)
    assert s["goodput_share"] == 0.5 and s["goodput_req_per_s"] == 1.0
    assert s["output_tok_per_s"] == 6.5 and s["tpot"]["n"] == 3 and s["ttft"]["max"] == 2.0
    a = serve_bench.arrival_times(2000, 50.0, seed=0)
    assert a == sorted(a) and a[0] > 0 and abs(len(a) / a[-1] - 50.0) < 5.0  # Poisson at the asked rate
    assert a == serve_bench.arrival_times(2000, 50.0, seed=0)
    if importlib.util.find_spec("matplotlib") is not None:
        run = dict(rate=1.0, http=s, offline=s)
        result = dict(model="m", device="d", runs=[run, dict(run, rate=2.0)], workload=dict(
            prompt_len=1, output_len=1, num_requests=4, slo_ttft_s=1.0, slo_tpot_s=0.05))  # fmt: skip
        assert os.path.getsize(serve_bench.plot(result, str(tmp_path / "p.png"))) > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="rates"):
        serve_bench.main(TINY + ["--rates", "0"])
    with pytest.raises(ValueError, match="output-len"):
        serve_bench.main(TINY + ["--output-len", "0"])


@pytest.mark.slow
def test_subprocess_server(tmp_path):
    out = tmp_path / "sub.json"
    serve_bench.main(TINY + ["--rates", "20", "--num-requests", "2", "--server", "subprocess", "--out", str(out)])
    run = json.loads(out.read_text())["runs"][0]
    assert run["http"]["requests"] == 2 and run["offline"]["requests"] == 2
