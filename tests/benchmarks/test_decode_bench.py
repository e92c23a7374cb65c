"""The ``decode`` workload (benchmarks/decode.py): its floor checked by hand for Ouro-1.4B, its
options, and the whole sweep end to end on the tiny preset (CPU): records, skips, profile, plot."""

import importlib.util
import json
import os

import pytest

from benchmarks import decode as dec
from benchmarks import report
from benchmarks.floors import decode_step_floor, shape
from benchmarks.workloads import DECODE_EXITS, decode_workload, exit_params
from ouro_jax import get_preset

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def test_decode_floor_of_ouro_1_4b_by_hand():
    c = get_preset("ouro-1.4b")  # 24 layers, hidden 2048, 16 x 128 heads (MHA), intermediate 5632, vocab 49152
    s = shape(c)
    per_layer = 4 * 2048 * 2048 + 3 * 2048 * 5632  # q, k, v, o + gate, up, down
    assert per_layer == 51_380_224
    assert s["layer_bytes"] == 2 * 24 * per_layer == 2_466_250_752  # 2.47 GB of bf16 weights read per loop
    assert s["head_bytes"] == 2 * 2048 * 49152 == 201_326_592  # lm_head, once per token
    assert s["kv_bytes_per_token_plane"] == 24 * 8192  # K + V: 2 x 16 x 128 x 2 B = 8 KiB per token, layer, plane
    bw, peak = 4.0e12, 785e12
    # one stream at 1K prompt, mid-output (context 1088), full depth: the 2.7 ms of docs/performance.md
    f = decode_step_floor(c, 1, 1088, 4, bw, peak)
    by_hand = 4 * 2_466_250_752 + 4 * 1088 * 196_608 + 201_326_592
    assert f["bytes"] == by_hand and f["bound"] == "bandwidth"
    assert f["floor_s"] == pytest.approx(by_hand / bw) and 2.70e-3 < f["floor_s"] < 2.75e-3
    assert f["weight_bytes"] + f["kv_bytes"] + f["head_bytes"] == f["bytes"]
    # early exit: weights and K/V scale with the loops run, the lm_head does not
    e = decode_step_floor(c, 1, 1088, 2.5, bw, peak)
    assert e["bytes"] == pytest.approx(2.5 * (2_466_250_752 + 1088 * 196_608) + 201_326_592)
    # 128 streams: the K/V dominates (4 x 128 x 1088 x 192 KiB = 109.5 GB) and it stays bandwidth-bound
    b = decode_step_floor(c, 128, 1088, 4, bw, peak)
    assert b["kv_bytes"] == 4 * 128 * 1088 * 196_608 and b["bound"] == "bandwidth"
    assert 29e-3 < b["floor_s"] < 30.5e-3


def test_exit_kinds():
    assert DECODE_EXITS == ("fixed", "synthetic2.5", "ouro0.5")
    f = exit_params("fixed", 8)
    assert f.exit_mode == "fixed" and f.max_tokens == 8 and f.ignore_eos
    s = exit_params("synthetic2.5", 8)
    assert s.exit_mode == "synthetic" and s.synthetic_mean_loops == 2.5
    o = exit_params("ouro0.5", 8)
    assert o.exit_mode == "ouro" and o.exit_threshold == 0.5
    for bad in ("early", "ouro1.5", "ouro", "synthetic0.5", "synthx", "Fixed", ""):
        with pytest.raises(ValueError, match="exit kind"):
            exit_params(bad, 8)


def test_decode_workload_shares_prompts_across_concurrency():
    a = decode_workload(128, 2, "fixed", 1024, scale=0.02)
    b = decode_workload(128, 4, "ouro0.5", 1024, scale=0.02)
    assert a.concurrency == 2 and len(a.requests) == 2 and a.arrival == "batch" and a.exit == "fixed"
    assert all((x.prompt == y.prompt).all() for x, y in zip(a.requests, b.requests))  # a prefix of one list
    assert a.requests[0].num_prompt_tokens == round(1024 * 0.02) and a.requests[0].params.max_tokens == 3
    assert decode_workload(128, 1, "fixed", 4096, scale=0.02).requests[0].num_prompt_tokens == round(4096 * 0.02)
    with pytest.raises(ValueError, match="concurrency"):
        decode_workload(128, 0, "fixed", 1024)


def test_decode_shape_keeps_the_bucket_set_small():
    a = dec.parser().parse_args([])
    sh = dec.decode_shape(a)
    assert sh.buckets == (8, 16, 32, 64, 128, 1024) and sh.max_num_seqs == 128
    assert sh.max_model_len >= 4096 + 128
    a = dec.parser().parse_args(["--max-num-seqs", "8", "--max-num-batched-tokens", "64"])
    assert dec.decode_shape(a).buckets == (8, 64)


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--exit", "early"], "exit kind"),
        (["--concurrency", "0"], "--concurrency"),
        (["--output-tokens", "1"], "--output-tokens"),
        (["--time-budget", "0"], "--time-budget"),
    ],
)
def test_bad_options_fail_before_any_work(argv, msg, tmp_path):
    with pytest.raises(SystemExit, match=msg):
        dec.main(argv + ["--out", str(tmp_path)])
    assert not os.listdir(tmp_path)


TINY = [
    "--preset",
    "tiny",
    "--scale",
    "0.02",
    "--max-num-seqs",
    "2",
    "--max-num-batched-tokens",
    "8",
    "--buckets",
    "8",
    "--quick-ceilings",
    "--no-progress",
    "--profile-steps",
    "2",
]
ENGINE_KEYS = {
    "workload",
    "path",
    "concurrency",
    "exit",
    "context",
    "tpot_p50_ms",
    "tpot_floor_ms",
    "tpot_floor",
    "tpot_fraction_of_floor",
    "kernels_per_loop",
    "device_busy_share",
    "mean_loops_per_token",
    "exit_histogram",
    "profile",
    "first_token_spread_s",
    "prefix_cache_hit_share",
    "compilations",
    "xla_compilations",
    "headline",
}


@pytest.mark.slow  # one engine compile: ~10 s on an idle 2-core CPU, 20-30 s on a busy one
def test_decode_sweep_end_to_end_on_tiny(tmp_path):
    out = str(tmp_path)
    argv = TINY + ["--concurrency", "1", "2", "4", "--context", "1024", "--generate-batch", "--out", out]
    res = dec.main(argv)
    with open(os.path.join(out, "decode.json")) as f:
        d = json.load(f)
    assert d["benchmark"] == "decode" and d["workload"] == "decode" and d["config"]["prefix_warm"]
    assert len(res["records"]) == len(d["records"]) == 2 * 3  # c in 1, 2 x three exit kinds
    cfg = get_preset("tiny")
    bw, peak = d["ceilings"]["bandwidth"], d["ceilings"]["peak_flops"]
    for r in d["records"]:
        assert "error" not in r, r.get("error")
        assert ENGINE_KEYS <= set(r), ENGINE_KEYS - set(r)
        assert r["workload"] == "decode" and r["path"] == "engine" and r["context"] == 1024
        assert r["exit"] in DECODE_EXITS and r["concurrency"] in (1, 2)
        assert r["compilations"] == 0 and r["xla_compilations"] == 0
        assert r["requests_finished"] == r["concurrency"]
        # the floor of a decode step of c rows at the mean decode context and the loops run
        p, n = r["prompt_len"], r["output_tokens_per_request"]
        assert (p, n) == (20, 3)
        fl = decode_step_floor(cfg, r["concurrency"], p + n / 2, r["mean_loops_per_token"], bw, peak)
        assert r["tpot_floor_ms"] == pytest.approx(fl["floor_s"] * 1e3)
        assert r["tpot_fraction_of_floor"] == pytest.approx(r["tpot_floor_ms"] / r["tpot_p50_ms"])
        assert r["tpot_p50_ms"] == pytest.approx(r["latency"]["tpot"]["p50"] * 1e3)
        assert r["headline"]["metric"] == "TPOT p50" and r["headline"]["lower_is_better"]
        # warmed prompts: only each prompt's last (partial) block is recomputed
        assert r["prefix_cache_hit_share"] == pytest.approx(16 / 20)
        assert 1 <= r["mean_loops_per_token"] <= cfg.num_loops
        if r["exit"] == "fixed":
            assert r["mean_loops_per_token"] == cfg.num_loops
        prof = r["profile"]
        assert prof["loops"] >= 1 and prof["kernels"] > 0 and r["kernels_per_loop"] == prof["kernels_per_loop"] > 0
        assert 0 < r["device_busy_share"] <= 1.0 + 1e-9
    # c=4 exceeds max_num_seqs 2: skipped with the reason, once per exit kind
    sk = d["skipped"]
    assert len(sk) == 3 and all("c=4" in s["label"] and "holds 2" in s["reason"] for s in sk)
    if HAVE_MPL:
        assert os.path.getsize(os.path.join(out, "decode.png")) > 0


@pytest.mark.slow  # compiles the static generate() twice (~20 s on a CPU)
def test_decode_generate_records_and_report(tmp_path):
    out = str(tmp_path)
    argv = TINY + ["--concurrency", "1", "--context", "1024", "--exit", "fixed", "ouro0.5", "synthetic2.5"]
    dec.main(argv + ["--generate-batch", "1", "2", "--generate-reps", "1", "--profile-steps", "0", "--out", out])
    with open(os.path.join(out, "decode.json")) as f:
        d = json.load(f)
    gen = [r for r in d["records"] if r.get("path") == "generate"]
    # fixed and ouro0.5 at batch 1 and 2; synthetic has no generate() counterpart
    assert sorted((r["concurrency"], r["exit"]) for r in gen) == [
        (1, "fixed"),
        (1, "ouro0.5"),
        (2, "fixed"),
        (2, "ouro0.5"),
    ]
    for r in gen:
        assert r["mode"] == "generate()" and r["output_tokens_per_request"] == 3 and r["prompt_len"] == 20
        assert r["tpot_floor_ms"] > 0 and "tpot_p50_ms" in r and "tpot_fraction_of_floor" in r
        assert r["exit_histogram"]["tokens"] == r["concurrency"] * 2
    assert next(r for r in gen if r["exit"] == "fixed")["mean_loops_per_token"] == get_preset("tiny").num_loops
    eng = [r for r in d["records"] if r.get("path") == "engine"]
    assert len(eng) == 3 and all("profile" not in r for r in eng)
    md = open(report.write_report(out)).read()
    assert "## decode (benchmarks/decode.py)" in md and "decode.json engine c=1, fixed depth" in md


def test_partial_traces_of_fused_steps_report_no_kernel_figures():
    prof = dict(device_plane="/device:GPU:0", kernels_per_loop=104.3, device_busy_share=0.24)
    got = dec.hide_partial_trace(dict(prof), 127)
    assert got["kernels_per_loop"] is None and got["device_busy_share"] is None
    assert (got["traced_kernels_per_loop"], got["traced_device_busy_share"]) == (104.3, 0.24)
    assert "127 fused steps" in got["note"] and got["fused_launches"] == 127
    # loop by loop, or no device plane (CPU: host thunks, complete): unchanged
    assert dec.hide_partial_trace(dict(prof), 0)["kernels_per_loop"] == 104.3
    cpu = dict(prof, device_plane=None)
    assert dec.hide_partial_trace(dict(cpu), 5)["kernels_per_loop"] == 104.3


@pytest.mark.slow  # two engine compiles on the tiny preset
def test_decode_records_fused_loops_per_token_of_each_variant(tmp_path):
    """One run, fused steps of one and of two tokens (an engine each): the records carry the loops
    the device ran per token step, are labelled apart, and exit at the same depths."""
    out = str(tmp_path)
    argv = TINY + ["--concurrency", "2", "--context", "1024", "--exit", "synthetic2.5", "--profile-steps", "0"]
    argv += ["--fused-decode-max-rows", "2", "--fused-decode-tokens", "1", "2"]
    dec.main(argv + ["--generate-batch", "--out", out])
    with open(os.path.join(out, "decode.json")) as f:
        d = json.load(f)
    assert d["config"]["fused_variants"] == [1, 2]
    recs = [r for r in d["records"] if r.get("path") == "engine"]
    assert [r["label"] for r in recs] == [
        "decode c=2 synthetic2.5 ctx=1024 fused2x1",
        "decode c=2 synthetic2.5 ctx=1024 fused2x2",
    ]
    for r in recs:
        assert "error" not in r, r.get("error")
        assert 1 <= r["fused_loops_per_token"] <= get_preset("tiny").num_loops
    assert recs[0]["exit_histogram"] == recs[1]["exit_histogram"]


def test_report_keeps_fused_variants_apart():
    """Records of one workload from engines of different fused-step options are rows and series of
    their own in the report (their label suffix), with the device loops per token step shown."""

    def rec(suffix, tpot, loops=None):
        return dict(
            workload="decode",
            path="engine",
            label=f"decode c=8 ouro0.5 ctx=1024{suffix}",
            concurrency=8,
            exit="ouro0.5",
            context=1024,
            tpot_p50_ms=tpot,
            tpot_floor_ms=1.35,
            tpot_fraction_of_floor=1.35 / tpot,
            mean_loops_per_token=1.29,
            fused_loops_per_token=loops,
        )

    res = dict(
        benchmark="decode",
        records=[rec(" fused16x1", 3.69, 1.98), rec(" fused16x8", 2.9, 1.55), rec("", 4.1)],
    )
    series = report._decode_series(res["records"])
    assert set(series) == {
        (1024, "engine", "ouro0.5"),
        (1024, "engine fused16x1", "ouro0.5"),
        (1024, "engine fused16x8", "ouro0.5"),
    }
    md = report.decode_section(res)
    assert "| 1024 | engine fused16x8 | ouro0.5 | 8 | 2.90 | 1.35 | 46.6% | 1.29 | 1.55 |" in md
    assert "| 1024 | engine | ouro0.5 | 8 | 4.10 |" in md
    res["records"] = [dict(r, concurrency=1) for r in res["records"]]
    rows = [r for r in report._decode_targets({"decode": res}) if r[2] != "not run"]
    assert [r[0] for r in rows] == [
        "decode.json engine c=1, early exit, context 1024 (ouro0.5) [fused16x1]",
        "decode.json engine c=1, early exit, context 1024 (ouro0.5) [fused16x8]",
        "decode.json engine c=1, early exit, context 1024 (ouro0.5)",
    ]
