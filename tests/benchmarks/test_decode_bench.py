"""The ``decode`` workload (benchmarks/decode.py): its floor checked by hand for Ouro-1.4B, its
options, and the whole sweep end to end on the tiny preset (CPU): records, skips, profile, the
plain-JAX baseline beside the engine, plot and report."""

import importlib.util
import json
import os

import pytest

from benchmarks import decode as dec
from benchmarks import report
from benchmarks.floors import decode_step_floor, shape
from benchmarks.plain_jax import PlainDecoder
from benchmarks.profile_step import hide_partial_trace
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
    assert d["config"]["plain_baseline"]
    assert not [r for r in d["records"] if "error" in r]
    engine = [r for r in d["records"] if r["path"] == "engine"]
    plain = {r["concurrency"]: r for r in d["records"] if r["path"] == "plain_jax"}
    assert len(res["records"]) == len(d["records"]) == len(engine) + len(plain)
    assert len(engine) == 2 * 3  # c in 1, 2 x three exit kinds
    cfg = get_preset("tiny")
    bw, peak = d["ceilings"]["bandwidth"], d["ceilings"]["peak_flops"]
    # the plain-JAX baseline at every c (it has no KV pool to fill: c=4 too), fixed depth
    assert sorted(plain) == [1, 2, 4]
    for c, r in plain.items():
        assert r["mode"] == "plain_jax" and r["exit"] == "fixed" and r["context"] == 1024
        assert (r["prompt_len"], r["output_tokens_per_request"]) == (20, 3)
        assert len(r["round_ms"]) == 3 and r["tpot_p50_ms"] == pytest.approx(sorted(r["round_ms"])[1])
        assert 0 < r["tpot_best_ms"] <= r["tpot_p50_ms"] and r["first_call_s"] > 0
        assert r["dense_cache_bytes"] == PlainDecoder.cache_bytes(cfg, c, 20 + 3 - 1, cfg.torch_dtype)
        fl = decode_step_floor(cfg, c, 20 + 3 / 2, cfg.num_loops, bw, peak)
        assert r["tpot_floor_ms"] == pytest.approx(fl["floor_s"] * 1e3) and r["mean_loops_per_token"] == cfg.num_loops
        assert r["tpot_fraction_of_floor"] == pytest.approx(r["tpot_floor_ms"] / r["tpot_p50_ms"])
        assert r["headline"]["value"] == r["tpot_p50_ms"]
    for r in engine:
        if r["exit"] == "fixed":  # beside the baseline of its c
            base = plain[r["concurrency"]]["tpot_p50_ms"]
            assert r["baseline_tpot_ms"] == base
            assert r["engine_over_baseline"] == pytest.approx(base / r["tpot_p50_ms"]) and r["engine_over_baseline"] > 0
        else:  # early exit: no baseline runs its depths
            assert "baseline_tpot_ms" not in r and "engine_over_baseline" not in r
    for r in engine:
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
    md = open(report.write_report(out)).read()
    fixed_c1 = next(r for r in engine if r["exit"] == "fixed" and r["concurrency"] == 1)
    assert f"| {report._f(fixed_c1['engine_over_baseline'], 2)}x |" in md
    assert f"| 1024 | plain JAX | fixed | 4 | {report._f(plain[4]['tpot_p50_ms'], 2)} | – | – |" in md


@pytest.mark.slow  # compiles the static generate() twice (~20 s on a CPU)
def test_decode_generate_records_and_report(tmp_path):
    out = str(tmp_path)
    argv = TINY + ["--concurrency", "1", "--context", "1024", "--exit", "fixed", "ouro0.5", "synthetic2.5"]
    argv += ["--generate-batch", "1", "2", "--generate-reps", "1", "--profile-steps", "0", "--no-plain-baseline"]
    dec.main(argv + ["--generate-attention", "auto", "reference", "--out", out])
    with open(os.path.join(out, "decode.json")) as f:
        d = json.load(f)
    # --no-plain-baseline: no plain-JAX records, no ratio on the engine's
    assert not d["config"]["plain_baseline"] and {r["path"] for r in d["records"]} == {"engine", "generate"}
    assert not [r for r in d["records"] if "engine_over_baseline" in r]
    gen = [r for r in d["records"] if r.get("path") == "generate"]
    # both kernels, labelled apart, on the same tokens (on a CPU "auto" is the reference kernel)
    other = {r["label"].removesuffix(" attention=reference"): r for r in gen if r["attention"] == "reference"}
    gen = [r for r in gen if r["attention"] == "auto"]
    assert sorted(other) == sorted(r["label"] for r in gen)
    assert all(other[r["label"]]["exit_histogram"] == r["exit_histogram"] for r in gen)
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


@pytest.mark.parametrize(
    "prompt, new, ref",
    [
        (1024, 64, 49),  # 68 pages a row for 49..64 tokens
        (1024, 128, 113),
        (20, 3, 1),  # one page boundary away: down to one token
        (1023, 2, 1),  # 2 tokens open page 65, 1 token does not: no shorter call shares the pools
        (1008, 16, 1),
        (1008, 20, 17),
    ],
)
def test_generate_reference_call_shares_the_pool_shape(prompt, new, ref):
    from ouro_jax.static_generate import pages_per_row

    got = dec.reference_tokens(prompt, new)
    assert got == ref and 1 <= got < new
    if got > 1:  # the fewest such tokens
        assert pages_per_row(prompt + got) == pages_per_row(prompt + new) != pages_per_row(prompt + got - 1)


def test_partial_traces_of_fused_steps_report_no_kernel_figures():
    prof = dict(device_plane="/device:GPU:0", kernels_per_loop=104.3, device_busy_share=0.24)
    got = hide_partial_trace(dict(prof), 127)
    assert got["kernels_per_loop"] is None and got["device_busy_share"] is None
    assert (got["traced_kernels_per_loop"], got["traced_device_busy_share"]) == (104.3, 0.24)
    assert "127 fused steps" in got["note"] and got["fused_launches"] == 127
    # loop by loop, or no device plane (CPU: host thunks, complete): unchanged
    assert hide_partial_trace(dict(prof), 0)["kernels_per_loop"] == 104.3
    cpu = dict(prof, device_plane=None)
    assert hide_partial_trace(dict(cpu), 5)["kernels_per_loop"] == 104.3


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


def test_traceable_fused_options_take_the_loops_out_of_cuda_graphs():
    from ouro_jax.compiler_options import FUSED_COMMAND_BUFFER
    from ouro_jax.engine_config import parse_xla_options

    got = parse_xla_options(dec.traceable_fused_options("xla_gpu_autotune_level=0"), "t")
    kinds = got["xla_gpu_enable_command_buffer"].split(",")
    assert "CONDITIONAL" not in kinds and "WHILE" not in kinds and "FUSION" in kinds
    assert set(kinds) == set(FUSED_COMMAND_BUFFER.split(",")) - {"CONDITIONAL", "WHILE"}
    assert got["xla_gpu_autotune_level"] == 0  # the caller's options stay
    # a caller's own command-buffer kinds give way: the later entry wins
    own = parse_xla_options(dec.traceable_fused_options("xla_gpu_enable_command_buffer="), "t")
    assert own["xla_gpu_enable_command_buffer"] == ",".join(kinds)


def test_fused_profile_share_is_busy_time_per_token_over_the_timed_tpot():
    rec = dict(tpot_p50_ms=8.0, fused_loops_per_token=4.0, mean_loops_per_token=3.5)
    prof = dict(kernels_per_loop=350.0, busy_ms_per_loop=1.5, device_busy_share=0.6)
    dec.attach_fused_profile(rec, prof)
    assert rec["kernels_per_loop"] == 350.0 and rec["device_busy_share"] == pytest.approx(1.5 * 4 / 8)
    assert rec["profile"]["traced_wall_device_busy_share"] == 0.6 and rec["profile"]["loops_traced"]
    rec = dict(tpot_p50_ms=None, mean_loops_per_token=4.0)
    assert dec.attach_fused_profile(rec, dict(prof))["device_busy_share"] is None


def test_fused_profile_share_of_a_loop_by_loop_window_counts_the_streams_loops():
    """Gated streams past the lock-step cap run loop by loop: a window without fused launches runs
    one loop of every stream an invocation, so a token costs its stream's mean loops, not the
    deepest row's of the fused steps that ran at the tail of the timed batch (run 61: 85% read
    for 43%)."""
    rec = dict(tpot_p50_ms=10.56, fused_loops_per_token=2.95, mean_loops_per_token=1.49)
    prof = dict(kernels_per_loop=341.0, busy_ms_per_loop=3.05, device_busy_share=0.3, fused_launches=0)
    dec.attach_fused_profile(rec, prof)
    assert rec["device_busy_share"] == pytest.approx(3.05 * 1.49 / 10.56)
    assert rec["profile"]["loops_per_token_basis"] == "mean_loops_per_token"
    dec.attach_fused_profile(rec, dict(prof, fused_launches=2))
    assert rec["device_busy_share"] == pytest.approx(3.05 * 2.95 / 10.56)
    assert rec["profile"]["loops_per_token_basis"] == "fused_loops_per_token"


@pytest.mark.slow  # four engines on the tiny preset (two timed, two profiling)
def test_fused_steps_with_loops_in_cuda_graphs_are_profiled_in_a_traceable_engine(tmp_path, monkeypatch):
    """Where fused steps run their loops in CUDA graphs (a GPU; stood in for here), the timed engine
    is not profiled: after the plan, an engine of each fused-step variant built with
    ``traceable_fused_options`` profiles each record's batch, whole."""
    monkeypatch.setattr(dec, "loops_in_graphs", lambda llm: True)
    options = []
    init = dec.EngineRunner.__init__

    def spy(self, h, a, fused_xla_options=None):
        options.append((h.fused_decode_tokens, fused_xla_options))
        init(self, h, a, fused_xla_options)

    monkeypatch.setattr(dec.EngineRunner, "__init__", spy)
    out = str(tmp_path)
    argv = TINY + ["--concurrency", "2", "--context", "1024", "--exit", "fixed"]
    argv += ["--fused-decode-max-rows", "2", "--fused-decode-tokens", "1", "2", "--generate-batch", "--out", out]
    dec.main(argv)
    traceable = dec.traceable_fused_options()
    assert options == [(1, None), (2, None), (1, traceable), (2, traceable)]
    with open(os.path.join(out, "decode.json")) as f:
        recs = [r for r in json.load(f)["records"] if r.get("path") == "engine"]
    assert len(recs) == 2
    for r in recs:
        prof = r["profile"]
        assert prof["loops_traced"] and prof["fused_launches"] > 0 and r["kernels_per_loop"] > 0
        want = prof["busy_ms_per_loop"] * r["fused_loops_per_token"] / r["tpot_p50_ms"]
        assert r["device_busy_share"] == pytest.approx(want)


def _report_record(path, label, c, exit_kind, tpot, floor, loops, **extra):
    """A decode record with what the report reads: its series, TPOT and floor."""
    return dict(
        workload="decode",
        path=path,
        label=label,
        concurrency=c,
        exit=exit_kind,
        context=1024,
        tpot_p50_ms=tpot,
        tpot_floor_ms=floor,
        tpot_fraction_of_floor=floor / tpot,
        mean_loops_per_token=loops,
        **extra,
    )


def test_report_keeps_fused_variants_apart():
    """Records of one workload from engines of different fused-step options are rows and series of
    their own in the report (their label suffix), with the device loops per token step shown."""

    def rec(suffix, tpot, loops=None):
        label = f"decode c=8 ouro0.5 ctx=1024{suffix}"
        return _report_record("engine", label, 8, "ouro0.5", tpot, 1.35, 1.29, fused_loops_per_token=loops)

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
    assert "| 1024 | engine fused16x8 | ouro0.5 | 8 | 2.90 | – | – | 1.35 | 46.6% | 1.29 | 1.55 |" in md
    assert "| 1024 | engine | ouro0.5 | 8 | 4.10 |" in md
    res["records"] = [dict(r, concurrency=1) for r in res["records"]]
    rows = [r for r in report._decode_targets({"decode": res}) if r[2] != "not run"]
    assert [r[0] for r in rows] == [
        "decode.json engine c=1, early exit, context 1024 (ouro0.5) [fused16x1]",
        "decode.json engine c=1, early exit, context 1024 (ouro0.5) [fused16x8]",
        "decode.json engine c=1, early exit, context 1024 (ouro0.5)",
    ]


def test_report_keeps_generate_kernels_apart_and_judges_generate_s_own_choice():
    def rec(attention, tpot):
        suffix = "" if attention == "auto" else f" attention={attention}"
        label = f"decode generate() b=1 fixed ctx=1024{suffix}"
        return _report_record("generate", label, 1, "fixed", tpot, 3.66, 4.0, attention=attention)

    res = dict(benchmark="decode", records=[rec("auto", 6.58), rec("triton", 6.63)])
    assert set(report._decode_series(res["records"])) == {
        (1024, "generate", "fixed"),
        (1024, "generate attention=triton", "fixed"),
    }
    md = report.decode_section(res)
    assert (
        "| 1024 | generate() | fixed | 1 | 6.58 |" in md
        and "| 1024 | generate() attention=triton | fixed | 1 | 6.63 |" in md
    )
    rows = [r for r in report._decode_targets({"decode": res}) if r[2] != "not run"]
    assert len(rows) == 1 and "generate() c=1" in rows[0][0]  # the forced kernel is not judged


def test_attach_baseline_marks_the_fixed_depth_engine_records_of_its_c():
    def eng(c, exit_kind, tpot, ctx=1024, suffix=""):
        label = f"decode c={c} {exit_kind} ctx={ctx}{suffix}"
        return dict(path="engine", label=label, concurrency=c, exit=exit_kind, context=ctx, tpot_p50_ms=tpot)

    recs = [eng(8, "fixed", 4.0), eng(8, "fixed", 2.0, suffix=" fused8x1"), eng(8, "ouro0.5", 1.5)]
    recs += [eng(1, "fixed", 3.0), eng(8, "fixed", 5.0, ctx=4096), dict(eng(8, "fixed", None), error="x")]
    base = dict(path="plain_jax", concurrency=8, context=1024, tpot_p50_ms=6.0)
    got = dec.attach_baseline(recs + [base], base)
    assert got == recs[:2]  # both engine variants at fixed depth, c=8, 1K
    assert [r["engine_over_baseline"] for r in got] == [1.5, 3.0] and got[0]["baseline_tpot_ms"] == 6.0
    assert not [r for r in recs[2:] if "engine_over_baseline" in r]


def test_report_shows_the_plain_baseline_and_renders_older_files(tmp_path):
    """decode.json with plain-JAX records: a row of their own and engine / plain JAX on the engine's
    fixed-depth rows; the committed decode.json's records without them (as written before the
    baseline existed) still render."""
    floor = dict(tpot_floor_ms=1.0, mean_loops_per_token=4.0, exit="fixed", context=1024, concurrency=8)
    eng = dict(floor, path="engine", label="decode c=8 fixed ctx=1024", tpot_p50_ms=4.0, tpot_fraction_of_floor=0.25)
    base = dict(floor, path="plain_jax", label="decode plain_jax b=8 ctx=1024", tpot_p50_ms=8.0)
    base["tpot_fraction_of_floor"] = 0.125
    dec.attach_baseline([eng], base)
    md = report.decode_section(dict(benchmark="decode", records=[eng, base]))
    assert "| 1024 | engine | fixed | 8 | 4.00 | 8.00 | 2.00x | 1.00 | 25.0% |" in md
    assert "| 1024 | plain JAX | fixed | 8 | 8.00 | – | – | 1.00 | 12.5% |" in md
    old = os.path.join(os.path.dirname(report.__file__), "results", "decode.json")
    with open(old) as f:
        d = json.load(f)
    fields = ("baseline_tpot_ms", "engine_over_baseline")
    engine = [r for r in d["records"] if r.get("path") != "plain_jax"]
    d["records"] = [{k: v for k, v in r.items() if k not in fields} for r in engine]
    md = report.decode_section(d)
    assert "engine / plain JAX" in md and "plain JAX |" not in md.split("\n", 2)[2]
    if HAVE_MPL:
        assert os.path.getsize(report.plot_decode(dict(d, records=d["records"] + [base]), str(tmp_path / "d.png")))


def test_generate_tpot_is_the_median_of_adjacent_pairs():
    """Run 54's b=8 calls (ms): one fast 64-token call after a buffer moved. The fastest of each
    length read 6.37 ms a token; the pairs' median reads the steady 8.4."""
    long_s = [755.1, 786.8, 787.0, 787.6, 786.8]
    short_s = [661.0, 661.0, 660.7, 659.6, 660.3]
    tpot, paired = dec.paired_tpot(long_s, short_s, 15)
    assert (min(long_s) - min(short_s)) / 15 < 6.4
    assert tpot == pytest.approx((787.0 - 660.7) / 15) and len(paired) == 5
    with pytest.raises(ValueError):
        dec.paired_tpot([1.0, 2.0], [1.0], 1)
