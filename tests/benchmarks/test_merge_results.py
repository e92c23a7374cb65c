"""benchmarks.merge_results: a re-run replaces a record unless it was cut short and the older one
was not (the rule `benchmarks.run --append` uses too)."""

from benchmarks.merge_results import merge, merge_lists, merge_records


def rec(label, mode, chunk, value, truncated=False):
    return dict(label=label, mode=mode, chunk=chunk, value=value, truncated=truncated)


def test_merge_records_rule():
    old = [rec("a", "split", 16, 1), rec("b", "split", 16, 2), rec("c", "split", 16, 3, True)]
    new = [
        rec("a", "split", 16, 10),
        rec("b", "split", 16, 20, True),
        rec("c", "split", 16, 30, True),
        rec("d", "split", 16, 40),
    ]
    out, lost = merge_records(old, new, "old", "new")
    got = {r["label"]: (r["value"], r["run"]) for r in out}
    assert got == {"a": (10, "new"), "b": (2, "old"), "c": (30, "new"), "d": (40, "new")}
    assert [(s["label"], "truncated" in s["reason"]) for s in lost] == [("b", True)]


def test_merge_tags_the_run_of_each_file():
    old = dict(config=dict(), records=[rec("a", "split", 16, 1)], skipped=[])
    new = dict(
        config=dict(),
        records=[rec("b", "wavefront", 16, 2)],
        skipped=[dict(label="c", mode="mixed", chunk=16, reason="time budget")],
    )
    res = merge(old, new, "run 1", "run 2")
    assert [(r["label"], r["run"]) for r in res["records"]] == [("a", "run 1"), ("b", "run 2")]
    assert [s["label"] for s in res["skipped"]] == ["c"]


def test_merge_lists_keeps_a_skip_note_only_while_its_configuration_is_missing():
    old_skips = [
        dict(label="a", mode="split", chunk=16, reason="time budget"),
        dict(label="e", mode="split", chunk=16, reason="time budget"),
    ]
    new_skips = [dict(label="b", mode="split", chunk=16, reason="time budget")]
    res = merge_lists(
        [rec("b", "split", 16, 2)], old_skips, [rec("a", "split", 16, 1), rec("b", "split", 16, 20, True)], new_skips
    )
    assert sorted(r["label"] for r in res["records"]) == ["a", "b"]
    # a and b have records now; e is still missing; b's truncated re-run lost to the old record
    assert [(s["label"], "truncated" in s["reason"]) for s in res["skipped"]] == [("e", False), ("b", True)]
