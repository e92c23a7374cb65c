"""``benchmarks/self_spec.py``: its options, the window ratios of the engine's cumulative stats,
the report section and plot, and the run end to end on the tiny preset (CPU): the baselines on any
engine, the speculative records with the engine's counters mocked, and the real thing once the
engine takes ``speculative_config``."""

import importlib.util
import json
import os

import pytest

from benchmarks import converging_agreement, report
from benchmarks import self_spec as ss
from benchmarks.floors import decode_step_floor
from ouro_jax import get_preset

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
TINY = ["--preset", "tiny", "--context", "24", "--quick-ceilings", "--no-plot"]
NO_SPEC_REASON = "the engine has no speculative_config yet (EngineConfig): self-speculative decoding has not landed"


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--spec", "4:3"], "below tiny's 4 loops"),
        (["--spec", "1x3"], "d:k pairs"),
        (["--spec", "0:3"], "d:k pairs"),
        (["--concurrency", "0"], "--concurrency"),
        (["--output-tokens", "1"], "--output-tokens"),
        (["--converging-scale", "1.5"], "--converging-scale"),
        (["--arrivals", "-1"], "--arrivals"),
        (["--arrivals", "2", "--arrival-every", "0"], "--arrival-every"),
    ],
)
def test_bad_options_fail_before_any_work(argv, msg, tmp_path):
    with pytest.raises(SystemExit, match=msg):
        ss.main(["--preset", "tiny"] + argv + ["--out", str(tmp_path)])
    assert not os.listdir(tmp_path)


def test_quick_and_defaults():
    a = ss.parser().parse_args(["--quick"])
    ss._resolve(a)
    assert a.concurrency == [1, 8] and a.specs == [(1, 3)]
    assert a.variants == [("random", None), ("converging", ss.DEFAULT_CONVERGING_SCALE)]
    # one model length for every engine: context + out + room for a round past max_tokens, a power of two
    assert a.max_model_len == 2048
    a = ss.parser().parse_args(["--concurrency", "4", "1", "4", "--spec", "2:3", "1:5", "2:3"])
    ss._resolve(a)
    assert a.concurrency == [1, 4] and a.specs == [(2, 3), (1, 5)] and a.max_k == 5
    # several scales: a converging variant each, labelled apart
    a = ss.parser().parse_args(["--models", "converging", "random", "--converging-scale", "0.01", "0.003"])
    ss._resolve(a)
    assert a.variants == [("random", None), ("converging", 0.01), ("converging", 0.003)]
    assert [ss.variant_name(v) for v in a.variants] == ["random", "converging(0.01)", "converging(0.003)"]


def test_window_ratio_recovers_the_timed_batch_from_cumulative_stats():
    # 10 drafts proposed before (4 accepted), 30 in the window (27 accepted)
    s0 = dict(spec_acceptance=0.4, spec_proposed_tokens=10)
    s1 = dict(spec_acceptance=31 / 40, spec_proposed_tokens=40)
    assert ss.window_ratio(s0, s1, "spec_acceptance", "spec_proposed_tokens") == pytest.approx(0.9)
    assert ss.window_ratio(s1, s1, "spec_acceptance", "spec_proposed_tokens") is None  # nothing in the window
    assert ss.window_ratio({}, s1, "spec_acceptance", "spec_proposed_tokens") == pytest.approx(31 / 40)


def test_first_difference():
    assert ss._first_difference([1, 2, 3], [1, 2, 3]) is None
    assert ss._first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert ss._first_difference([1, 2], [1, 2, 3]) == 2


def _spec_record(model, c, d, k, acc, tpot, base, scale=None):
    return dict(
        label=f"self_spec {model} c={c} d={d} k={k}",
        mode="spec",
        model=model,
        converging_scale=scale,
        concurrency=c,
        draft_loops=d,
        num_speculative_tokens=k,
        acceptance=acc,
        mean_accepted_length=1 + k * acc,
        tpot_ms=tpot,
        baseline_tpot_ms=base,
        speedup=base / tpot,
        tokens_equal=True,
        tpot_floor_ms=2.7,
    )


def test_report_section_and_plot(tmp_path):
    recs = [
        _spec_record("random", 1, 1, 3, 0.05, 4.1, 3.0),
        _spec_record("converging", 8, 1, 3, 0.81, 2.0, 3.4, scale=0.01),
        dict(_spec_record("converging", 1, 1, 3, 0.83, 1.6, 3.0, scale=0.01), tokens_equal=False, first_difference=37),
        dict(
            _spec_record("converging", 4, 1, 3, 0.7, 3.0, 3.0, scale=0.01),
            output_tokens=128,
            arrivals=4,
            arrival_tokens=2048,
            spec_loop_rounds=87,
        ),
        dict(label="self_spec random c=1 plain", mode="plain", model="random", concurrency=1, tpot_ms=3.0),
        dict(label="self_spec random c=8 d=2 k=3", mode="spec", model="random", concurrency=8, error="Boom: x"),
    ]
    res = dict(benchmark="self_spec", preset="ouro-1.4b", device="H200", config=dict(context=1024), records=recs)
    md = report.self_spec_section(res)
    lines = md.splitlines()
    assert lines[0].startswith(
        "| model | c | d | k | out | prompts beside | acceptance | tokens/round | TPOT p50 ms | plain TPOT ms"
    )
    body = [x for x in lines[2:] if x.startswith("|")]
    assert len(body) == 4  # spec records only; random first, then by prompts beside, then by c
    assert body[0].startswith("| random | 1 | 1 | 3 | – | – | 5.0% |") and "0.73x" in body[0]
    assert body[1].startswith("| converging (0.01) | 1 | 1 | 3 | – | – | 83.0% | 3.49 |") and "1.88x" in body[1]
    assert body[3].startswith("| converging (0.01) | 4 | 1 | 3 | 128 | 4 x 2048 (87 loop-by-loop rounds) | 70.0% |")
    assert body[1].endswith("| NO (from token 37) |") and body[0].endswith("| yes |")
    assert "Failed: self_spec random c=8 d=2 k=3 (Boom: x)" in md
    with open(tmp_path / "self_spec.json", "w") as f:
        json.dump(res, f)
    text = open(report.write_report(str(tmp_path))).read()
    assert "## Self-speculative decoding (benchmarks/self_spec.py)" in text and "| converging (0.01) | 8 |" in text
    if HAVE_MPL:
        assert "![self_spec](self_spec.png)" in text and os.path.getsize(tmp_path / "self_spec.png") > 0


class _MockSpecEngine:
    """A plain engine that reports speculation counters as if each request's rounds of the timed
    length accepted 2 of 3 drafts and those of any other length none: the benchmark must read the
    timed batch alone out of the cumulative ratios."""

    def __init__(self, llm, spec, timed_tokens: int):
        self.llm, self.k, self.timed = llm, spec[1], timed_tokens
        self.n = dict(spec_rounds=0, spec_row_rounds=0, spec_proposed_tokens=0, spec_accepted_tokens=0)

    def generate(self, prompts, sp, use_tqdm=False):
        rounds = max(1, sp.max_tokens // 2)
        self.n["spec_rounds"] += rounds
        self.n["spec_row_rounds"] += rounds * len(prompts)
        self.n["spec_proposed_tokens"] += self.k * rounds * len(prompts)
        self.n["spec_accepted_tokens"] += (2 if sp.max_tokens == self.timed else 0) * rounds * len(prompts)
        return self.llm.generate(prompts, sp, use_tqdm=use_tqdm)

    def stats(self):
        n = self.n
        return dict(
            self.llm.stats(),
            **n,
            spec_acceptance=n["spec_accepted_tokens"] / max(1, n["spec_proposed_tokens"]),
            spec_mean_accepted_length=1 + n["spec_accepted_tokens"] / max(1, n["spec_row_rounds"]),
            spec_draft_time_s=0.001 * n["spec_rounds"],
            spec_verify_time_s=0.002 * n["spec_rounds"],
        )

    def close(self):
        self.llm.close()


def _check_records(d, models, specs, concurrency, out_tokens=8):
    cfg = get_preset("tiny")
    bw, peak = d["ceilings"]["bandwidth"], d["ceilings"]["peak_flops"]
    recs = d["records"]
    assert len(recs) == len(models) * (1 + len(specs)) * len(concurrency)
    base = {(r["model"], r["concurrency"]): r for r in recs if r["mode"] == "plain"}
    for r in recs:
        assert "error" not in r, r.get("error")
        assert r["preset"] == "tiny" and r["context"] == 24 and r["output_tokens"] == out_tokens
        assert r["command"].startswith("python -m benchmarks.self_spec --preset tiny")
        assert r["device"] == d["device"] and r["compilations"] == 0
        assert r["output_tokens_total"] == out_tokens * r["concurrency"]
        fl = decode_step_floor(cfg, r["concurrency"], 24 + out_tokens / 2, cfg.num_loops, bw, peak)
        assert r["tpot_floor_ms"] == pytest.approx(fl["floor_s"] * 1e3)
        assert r["converging_scale"] == (0.02 if r["model"] == "converging" else None)
        # warmed prompts: each timed prompt recomputes only its last (partial) block
        assert r["prefix_cache_hit_share"] == pytest.approx(16 / 24)
        b = base[(r["model"], r["concurrency"])]
        assert r["baseline_tpot_ms"] == b["tpot_ms"] > 0
        assert r["speedup"] == pytest.approx(b["tpot_ms"] / r["tpot_ms"])
        assert r["tokens_equal"] is True
        if r["mode"] == "spec":
            assert r["requests_equal"] == r["concurrency"] and r["first_difference"] is None
        if r["mode"] == "plain":
            assert r["draft_loops"] is None and r["speedup"] == 1.0
        else:
            assert (r["draft_loops"], r["num_speculative_tokens"]) in specs
            for key in ("acceptance", "mean_accepted_length", "draft_time_s", "verify_time_s", "spec_row_rounds"):
                assert r[key] is not None, key
    return recs


@pytest.mark.slow  # two tiny engines: ~10 s with a warm compilation cache, ~45 s cold on 2 cores
def test_baselines_and_mocked_speculation_end_to_end_on_tiny(tmp_path, monkeypatch):
    out = str(tmp_path)
    # plain decoding alone runs on any engine: the baseline records
    argv = ["--models", "converging", "--converging-scale", "0.02", "--concurrency", "1", "2", "--output-tokens", "8"]
    res = ss.main(TINY + argv + ["--spec", "--out", out])
    with open(os.path.join(out, "self_spec.json")) as f:
        d = json.load(f)
    assert d["benchmark"] == "self_spec" and d["config"]["exit"] == "fixed" and len(res["records"]) == 2
    _check_records(d, ["converging"], [], [1, 2])

    # the speculative path's plumbing, the engine's counters mocked on a plain engine; the timed
    # batch's 16 tokens tell its calls from the warm runs' (14 tokens) and the prefix warm's (1)
    real = ss.build_engine

    def mock_build(config, params, spec, **kw):
        llm = real(config, params, None, **kw)
        return llm if spec is None else _MockSpecEngine(llm, spec, timed_tokens=16)

    monkeypatch.setattr(ss, "has_speculative_config", lambda: True)
    monkeypatch.setattr(ss, "build_engine", mock_build)
    argv = ["--models", "random", "--concurrency", "2", "--spec", "1:3", "--output-tokens", "16", "--append"]
    ss.main(TINY + argv + ["--out", out])
    with open(os.path.join(out, "self_spec.json")) as f:
        d = json.load(f)
    assert len(d["records"]) == 4  # --append kept the converging baselines
    recs = [r for r in d["records"] if r["model"] == "random"]
    d["records"] = recs
    _check_records(d, ["random"], [(1, 3)], [2], out_tokens=16)
    (spec,) = [r for r in recs if r["mode"] == "spec"]
    # the timed batch alone: 2 of 3 drafts, 3 tokens a round; the warm runs accepted none
    assert spec["acceptance"] == pytest.approx(2 / 3) and spec["mean_accepted_length"] == pytest.approx(3.0)
    assert spec["spec_row_rounds"] == 2 * 8 and spec["verify_time_s"] == pytest.approx(0.016)


@pytest.mark.slow  # two tiny engines per variant (~30-60 s on 2 cores)
@pytest.mark.skipif(not ss.has_speculative_config(), reason=NO_SPEC_REASON)
def test_self_spec_end_to_end_on_tiny(tmp_path):
    out = str(tmp_path)
    argv = ["--converging-scale", "0.02", "--concurrency", "2", "--spec", "1:3", "--output-tokens", "8"]
    ss.main(TINY + argv + ["--out", out])
    with open(os.path.join(out, "self_spec.json")) as f:
        d = json.load(f)
    recs = _check_records(d, ["random", "converging"], [(1, 3)], [2])
    spec = {r["model"]: r for r in recs if r["mode"] == "spec"}
    for r in spec.values():
        assert 0.0 <= r["acceptance"] <= 1.0 and 1.0 <= r["mean_accepted_length"] <= 4.0
        assert r["spec_rounds"] >= 1
    # measured, not set: the converging weights' depth 1 agrees with depth 4 far more often
    assert spec["converging"]["acceptance"] > spec["random"]["acceptance"] + 0.3


@pytest.mark.slow  # two tiny engines (~30 s on 2 cores)
@pytest.mark.skipif(not ss.has_speculative_config(), reason=NO_SPEC_REASON)
def test_arrivals_put_rounds_beside_prompt_rows(tmp_path):
    """``--arrivals``: long prompts join while the streams decode, so rounds run loop by loop
    beside their rows; tokens stay the baseline's, and the records say so under their own labels."""
    out = str(tmp_path)
    argv = ["--models", "converging", "--converging-scale", "0.001", "--concurrency", "2", "--spec", "1:3"]
    argv += ["--output-tokens", "12", "--arrivals", "3", "--arrival-tokens", "40", "--arrival-every", "2"]
    ss.main(TINY + argv + ["--out", out])
    with open(os.path.join(out, "self_spec.json")) as f:
        recs = json.load(f)["records"]
    assert {r["label"] for r in recs} == {
        "self_spec converging(0.001) c=2 plain arrivals=3",
        "self_spec converging(0.001) c=2 d=1 k=3 arrivals=3",
    }
    spec = next(r for r in recs if r["mode"] == "spec")
    assert spec["arrivals"] == 3 and spec["arrival_tokens"] == 40 and spec["arrival_every"] == 2
    assert spec["spec_loop_rounds"] >= 1 and spec["tokens_equal"]


@pytest.mark.slow  # compiles the static generate() and forward() of the tiny preset (~15 s)
def test_converging_agreement_on_tiny():
    argv = ["--preset", "tiny", "--context", "8", "--new-tokens", "16", "--batch", "2", "--scale", "1", "0"]
    plain, flat = converging_agreement.main(argv)
    assert flat["by_depth"] == [1.0] * 4 and plain["by_depth"][-1] == 1.0 and plain["by_depth"][0] < 0.5
    assert plain["forward_equals_generate"] == flat["forward_equals_generate"] == 1.0  # float32
