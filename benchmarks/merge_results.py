"""Merge a newer run's ``<workload>.json`` into the committed one, record by record.

A configuration (label, mode, chunk) measured again replaces the older record, unless the newer
one was cut short (``truncated``) and the older one was not: then the older stays and the newer
is listed under ``skipped``. Records kept from the older file are tagged with its ``run``
(``--old-tag``) so that a table never mixes engine versions silently.

    python -m benchmarks.merge_results OLD.json NEW.json --old-tag "run 1" -o OUT.json
"""

from __future__ import annotations

import argparse
import json


def record_key(r: dict) -> tuple:
    """A record's configuration: ``(label, mode, chunk)`` (a newer record of it replaces the older;
    ``benchmarks.ab`` compares two trees by it)."""
    return (r.get("label"), r.get("mode"), r.get("chunk"))


def merge_records(old: list, new: list, old_tag: str | None = None, new_tag: str | None = None) -> tuple[list, list]:
    """The rule of the module docstring on two record lists: ``(records, skipped)``, where
    ``skipped`` lists the newer records that lost to a complete older one. Tags are added only
    when given (``benchmarks.run --append`` merges runs of one engine version)."""
    new_by = {record_key(r): r for r in new}
    out, skipped = [], []
    for r in old:
        n = new_by.get(record_key(r))
        if n is None or (n.get("truncated") and not r.get("truncated")):
            r = dict(r)
            if old_tag:
                r.setdefault("run", old_tag)
            out.append(r)
            if n is not None:
                skipped.append(
                    dict(
                        label=n.get("label"),
                        mode=n.get("mode"),
                        chunk=n.get("chunk"),
                        reason=f"{new_tag or 'newer run'}: truncated (kept {old_tag or 'the earlier record'})",
                    )
                )
                del new_by[record_key(r)]
    for r in new:
        if record_key(r) in new_by:
            r = dict(r)
            if new_tag:
                r.setdefault("run", new_tag)
            out.append(r)
    return out, skipped


def merge_lists(
    old_records: list,
    old_skipped: list,
    records: list,
    skipped: list,
    old_tag: str | None = None,
    new_tag: str | None = None,
) -> dict:
    """``records`` and ``skipped`` of two results merged (``merge_records``'s rule). A skip note
    stays only while its configuration has no record, or when it says a newer run was cut short
    and lost to the older record; ``benchmarks.run --append`` and ``merge`` both use this."""
    out, lost = merge_records(old_records, records, old_tag, new_tag)
    done = {record_key(r) for r in out}
    notes = list(old_skipped) + list(skipped) + lost
    kept = [s for s in notes if record_key(s) not in done or "truncated" in s.get("reason", "")]
    return dict(records=out, skipped=kept)


def merge(old: dict, new: dict, old_tag: str, new_tag: str) -> dict:
    return dict(
        new,
        **merge_lists(
            old.get("records", []),
            old.get("skipped", []),
            new.get("records", []),
            new.get("skipped", []),
            old_tag,
            new_tag,
        ),
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--old-tag", default="earlier run")
    ap.add_argument("--new-tag", default="latest run")
    a = ap.parse_args(argv)
    with open(a.old) as f:
        old = json.load(f)
    with open(a.new) as f:
        new = json.load(f)
    with open(a.out, "w") as f:
        json.dump(merge(old, new, a.old_tag, a.new_tag), f, indent=1)


if __name__ == "__main__":
    main()
