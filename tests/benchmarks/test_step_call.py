"""benchmarks/step_call.py (and the host-span aggregation it shares with profile_step, on a made-up
trace): the script end to end on the tiny preset (CPU)."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest

from benchmarks import profile_step as ps
from benchmarks import step_call as sc
from benchmarks.run import Harness
from benchmarks.workloads import suite_shape


def _plane(name, lines):
    return NS(name=name, lines=[NS(name=ln, events=[NS(name=n, duration_ns=d) for n, d in evs]) for ln, evs in lines])


def test_host_spans_per_launch_from_host_planes_only():
    profile = NS(
        planes=[
            _plane("/host:CPU", [("python", [("Execute", 3e6), ("Execute", 1e6), ("shard_args", 2e5)])]),
            _plane("/host:metadata", [("other", [("flush", 4e5)])]),
            _plane("/device:GPU:0", [("Stream #1", [("kernel", 9e9)])]),
        ]
    )
    spans = ps.host_spans(profile, launches=2, top=2)
    assert list(spans) == ["python | Execute", "other | flush"]  # largest first, cut at top
    assert spans["python | Execute"] == pytest.approx([2.0, 1.0])  # ms and count per launch
    assert spans["other | flush"] == pytest.approx([0.2, 0.5])
    assert not any("kernel" in k for k in ps.host_spans(profile, 1))


def test_time_calls_waits_for_every_result():
    done = []
    res = sc.time_calls(lambda: done.append(1) or len(done), lambda out: out, reps=5, warmup=2)
    assert len(done) == 7
    assert 0 <= res["p10"] <= res["p50"] <= res["p90"]


def test_graph_nodes_alone_need_no_engine(tmp_path):
    out = str(tmp_path / "graphs.json")
    res = sc.main(["--graph-nodes", "2", "5", "--reps", "2", "--warmup", "1", "--out", out])
    with open(out) as f:
        d = json.load(f)
    assert d == res and d["buckets"] == [] and "engine_shape" not in d
    assert [(g["nodes"], g["graph"]) for g in d["graph_launch"]] == [(2, True), (2, False), (5, True), (5, False)]
    assert all(g["call"]["p50"] > 0 and g["rows"] == 64 for g in d["graph_launch"])
    with pytest.raises(SystemExit):
        sc.main(["--graph-nodes", "0", "--out", out])
    with pytest.raises(SystemExit):
        sc.main(["--graph-nodes", "2", "--graph-rows", "0", "--out", out])


def test_graph_rows_each_timed_at_every_node_count(tmp_path):
    out = str(tmp_path / "graphs.json")
    res = sc.main(["--graph-nodes", "1", "3", "--graph-rows", "8", "16", "--reps", "2", "--warmup", "1", "--out", out])
    got = [(g["rows"], g["nodes"], g["graph"]) for g in res["graph_launch"]]
    assert got == [(r, n, gr) for r in (8, 16) for n in (1, 3) for gr in (True, False)]


@pytest.fixture(scope="module")
def harness():
    shape = suite_shape(0.02, 0.05, max_num_seqs=8, max_num_batched_tokens=8, buckets=(8,))
    return Harness("tiny", None, shape, quick_ceilings=True, progress=False)


def test_main_on_tiny(harness, tmp_path):
    out = str(tmp_path / "step_call.json")
    argv = ["--preset", "tiny", "--buckets", "decode:8", "--decode-context", "32", "--reps", "3", "--steps", "2"]
    res = sc.main(argv + ["--warmup", "1", "--no-progress", "--top", "5", "--out", out], harness=harness)
    with open(out) as f:
        d = json.load(f)
    assert d["benchmark"] == "step_call" and d["preset"] == "tiny" and len(res["buckets"]) == 1
    (b,) = d["buckets"]
    assert b["bucket"] == "decode:8" and b["weight_leaves"] > b["stacked_arrays"] > 0
    for name in ("launch", "upload_launch", "upload", "noop_weights", "noop_stacked", "noop_no_weights"):
        assert 0 < b[name]["p10"] <= b[name]["p50"] <= b[name]["p90"], name
    assert "trace_error" not in b, b.get("traceback")
    assert 0 < len(b["host_spans_ms_per_launch"]) <= 5 and b["traced_launches"] == 2
