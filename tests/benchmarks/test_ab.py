"""benchmarks.ab: processes of two trees interleaved, records compared by configuration."""

import json
import os

import pytest

from benchmarks import ab

# A benchmark that writes one TPOT record (its tree's VALUE, plus the process's round from ORDER's
# length) and logs which tree ran, so the test sees the order and the values.
FAKE = """
import argparse, json, os, sys
from value import VALUE
VALUE = float(os.environ.get("AB_TEST_VALUE", VALUE))  # a side's --new-env / --base-env
ap = argparse.ArgumentParser(); ap.add_argument("--c", type=int); ap.add_argument("--out")
a = ap.parse_args()
order = os.environ["AB_TEST_ORDER"]
with open(order, "a") as f:
    f.write(os.path.basename(os.getcwd()) + "\\n")
if VALUE < 0:
    sys.exit(3)
n = sum(1 for _ in open(order))
rec = lambda label, v, unit, lower: dict(label=label, mode="split", chunk=None,
    headline=dict(metric="TPOT p50", value=v, unit=unit, **({"lower_is_better": lower} if lower is not None else {})))
records = [rec(f"c={a.c}", VALUE + 0.01 * n, "ms", True), rec("tok/s", 1000 * VALUE, "tok/s", None)]
json.dump(dict(device="Fake GPU", records=records), open(os.path.join(a.out, "fake.json"), "w"))
"""


def _tree(path, value):
    os.makedirs(path)
    with open(os.path.join(path, "fakebench.py"), "w") as f:
        f.write(FAKE)
    with open(os.path.join(path, "value.py"), "w") as f:
        f.write(f"VALUE = {value}\n")
    return str(path)


def test_sides_interleave_and_each_configuration_is_compared(tmp_path, monkeypatch, capsys):
    new, base = _tree(tmp_path / "new", 5.0), _tree(tmp_path / "base", 6.0)
    monkeypatch.setenv("AB_TEST_ORDER", str(tmp_path / "order"))
    out = str(tmp_path / "ab.json")
    res = ab.main(
        [
            "--base",
            base,
            "--new",
            new,
            "--rounds",
            "3",
            "-o",
            out,
            "--work",
            str(tmp_path / "w"),
            "--",
            "fakebench",
            "--c",
            "8",
        ]
    )
    with open(tmp_path / "order") as f:
        assert f.read().split() == ["new", "base", "base", "new", "new", "base"]
    with open(out) as f:
        assert json.load(f) == json.loads(json.dumps(res))
    rows = {r["label"]: r for r in res["configurations"]}
    tpot = rows["c=8"]
    assert tpot["new"] == pytest.approx([5.01, 5.04, 5.05]) and tpot["base"] == pytest.approx([6.02, 6.03, 6.06])
    assert tpot["new_median"] == pytest.approx(5.04) and tpot["base_spread"] == pytest.approx([6.02, 6.06])
    assert tpot["ratio"] == pytest.approx(5.04 / 6.03) and tpot["lower_is_better"] and tpot["new_better"]
    assert tpot["spreads_overlap"] is False
    thr = rows["tok/s"]  # higher is better: fewer tok/s on the new side loses
    assert not thr["lower_is_better"] and thr["ratio"] == pytest.approx(5 / 6) and thr["new_better"] is False
    assert [p["side"] for p in res["processes"]] == ab.side_order(3) and all(p["rc"] == 0 for p in res["processes"])
    assert res["devices"] == ["Fake GPU"] and all(p["devices"] == ["Fake GPU"] for p in res["processes"])
    # every process's records travel in the one file, not only the headlines
    assert [p["results"][0]["headline"]["value"] for p in res["processes"]] == pytest.approx(
        [5.01, 6.02, 6.03, 5.04, 5.05, 6.06]
    )
    assert "c=8" in capsys.readouterr().out


def test_slim_drops_latency_cdfs_only():
    rec = dict(label="x", latency=dict(tpot=dict(p50=1.0, cdf=[1, 2]), cdf=dict(a=[3])), rows=[dict(cdf=1, n=2)])
    assert ab.slim(rec) == dict(label="x", latency=dict(tpot=dict(p50=1.0)), rows=[dict(n=2)])


def test_one_tree_under_two_settings(tmp_path, monkeypatch):
    tree = _tree(tmp_path / "t", 5.0)
    monkeypatch.setenv("AB_TEST_ORDER", str(tmp_path / "order"))
    monkeypatch.setenv("AB_TEST_VALUE", "7.0")  # the base side keeps the caller's environment
    res = ab.main(
        [
            "--base",
            tree,
            "--new",
            tree,
            "--new-env",
            "AB_TEST_VALUE=4.0",
            "--rounds",
            "1",
            "-o",
            str(tmp_path / "a.json"),
        ]
        + ["--", "fakebench"]
    )
    rows = {r["label"]: r for r in res["configurations"]}
    assert rows["tok/s"]["new"] == [4000.0] and rows["tok/s"]["base"] == [7000.0]
    assert res["env"] == {"new": {"AB_TEST_VALUE": "4.0"}, "base": {}}


def test_overlapping_spreads_are_marked():
    def rec(v):
        return dict(label="c=1", mode="split", headline=dict(metric="TPOT p50", value=v, lower_is_better=True))

    rows = ab.compare([("new", [rec(6.0)]), ("base", [rec(6.4)]), ("base", [rec(5.9)]), ("new", [rec(6.1)])])
    assert rows[0]["new_better"] and rows[0]["spreads_overlap"]  # 6.0-6.1 inside 5.9-6.4
    assert "(spreads overlap)" in ab.table(rows)
    rows = ab.compare([("new", [rec(6.0)]), ("base", [rec(6.4)]), ("base", [rec(6.2)]), ("new", [rec(6.1)])])
    assert rows[0]["spreads_overlap"] is False and "overlap" not in ab.table(rows)
    assert ab.compare([("new", [rec(6.0)])])[0]["spreads_overlap"] is None  # one side only


def test_a_failed_process_is_reported_not_compared(tmp_path, monkeypatch, capsys):
    new, base = _tree(tmp_path / "new", 5.0), _tree(tmp_path / "base", -1)
    monkeypatch.setenv("AB_TEST_ORDER", str(tmp_path / "order"))
    res = ab.main(["--base", base, "--new", new, "--rounds", "1", "-o", str(tmp_path / "ab.json"), "--", "fakebench"])
    assert [p["rc"] for p in res["processes"]] == [0, 3]
    row = res["configurations"][0]
    assert row["base"] == [] and row["base_median"] is None and row["ratio"] is None and row["new_better"] is None
    assert "1 of 2 processes failed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, match",
    [
        (["--base", "."], "usage"),
        (["--base", ".", "--"], "name the benchmark"),
        (["--base", ".", "--rounds", "0", "--", "m"], "rounds"),
        (["--base", ".", "--", "m", "--out", "x"], "--out is set by ab"),
        (["--base", ".", "--new-env", "NOVALUE", "--", "m"], "NAME=VALUE"),
        (["--base", ".", "--base-env", "1X=2", "--", "m"], "NAME=VALUE"),
        (["--base", ".", "--time-budget", "0", "--", "m"], "--time-budget must be positive"),
    ],
)
def test_bad_arguments_are_refused(args, match, capsys):
    with pytest.raises(SystemExit) as exc:
        ab.main(args)
    assert match in str(exc.value.code) + capsys.readouterr().err


def test_base_from_a_commit(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a clone, as CI's
    tree = ab.extract_base("HEAD", str(tmp_path), repo)
    assert os.path.isfile(os.path.join(tree, "benchmarks", "merge_results.py"))
    with pytest.raises(ValueError, match="neither a folder nor a commit"):
        ab.extract_base("no-such-commit-xyz", str(tmp_path / "x"), repo)


class _Clock:
    """``time.perf_counter`` that only the fake processes move (each takes its ``seconds``)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _fake_sides(monkeypatch, clock, seconds, watch=None):
    """``ab.run_side`` replaced: process ``i`` takes ``seconds[i]`` on ``clock`` and writes one
    record. Returns the trees run and, per process, what the file ``watch`` held when it started."""
    calls, seen = [], []

    def run_side(tree, module, args, out_dir, log_path, timeout, env_extra=None):
        if watch is not None:
            seen.append(json.load(open(watch)) if os.path.exists(watch) else None)
        i = len(calls)
        calls.append(tree)
        clock.now += seconds[i]
        rec = dict(label="c=1", mode="split", headline=dict(metric="TPOT p50", value=5.0 + i, lower_is_better=True))
        return dict(rc=0, seconds=seconds[i], records=[rec], devices=["Fake GPU"], log=log_path)

    monkeypatch.setattr(ab, "run_side", run_side)
    monkeypatch.setattr(ab.time, "perf_counter", clock)
    return calls, seen


def test_time_budget_keeps_whole_rounds(tmp_path, monkeypatch, capsys):
    # the first process compiles (100 s), the others take 30: after two rounds (190 s) a third
    # would end at 250 s, past the 240 s budget, so it does not start
    clock = _Clock()
    calls, _ = _fake_sides(monkeypatch, clock, [100, 30, 30, 30, 30, 30])
    out = tmp_path / "ab.json"
    res = ab.main(["--base", str(tmp_path), "--rounds", "3", "--time-budget", "240", "-o", str(out), "--", "m"])
    assert len(calls) == 4 and [p["side"] for p in res["processes"]] == ["new", "base", "base", "new"]
    assert res["rounds_run"] == 2 and res["complete"] and "2 of 3 rounds" in res["stopped"]
    assert res["configurations"][0]["new"] == [5.0, 8.0] and "time budget" in capsys.readouterr().out
    # with room for the third round all six run
    clock.now = 0.0
    calls.clear()
    res = ab.main(["--base", str(tmp_path), "--rounds", "3", "--time-budget", "250", "-o", str(out), "--", "m"])
    assert len(calls) == 6 and res["rounds_run"] == 3 and res["stopped"] is None


def test_the_comparison_is_written_after_every_process(tmp_path, monkeypatch):
    out = str(tmp_path / "ab.json")
    _, seen = _fake_sides(monkeypatch, _Clock(), [1, 1, 1, 1], watch=out)
    res = ab.main(["--base", str(tmp_path), "--rounds", "2", "-o", out, "--", "m"])
    assert seen[0] is None  # nothing before the first process
    for i, doc in enumerate(seen[1:], start=1):  # a kill here would leave the first i processes compared
        assert not doc["complete"] and len(doc["processes"]) == i
        row = doc["configurations"][0]
        assert len(row["new"]) + len(row["base"]) == i
    assert res["complete"] and json.load(open(out)) == json.loads(json.dumps(res))
    assert not os.path.exists(out + ".tmp")
