"""Two trees of the engine side by side: one benchmark run in each, processes interleaved, the
records compared configuration by configuration.

One process's figures move by more than most changes do (run 38: a c=1 TPOT came out at ~6.52 or
~6.85 ms a process on one H100, whatever the code; run 53: ``generate()`` b=8 at 7.93-8.42 ms over
three processes with identical GEMM configs), so a change wins only against its base measured in
several processes of each side, interleaved on one machine, and the table marks a configuration
whose two sides' spreads overlap. ``ab`` runs ``python -m MODULE ARGS
--out DIR`` in this tree ("new") and in the base tree ("base"), in the order new, base, base, new,
new, base, ... (each side first as often as the other), and writes for each configuration
(``merge_results.record_key``) both sides' headline figures, their medians and spreads, and new /
base of the medians.

    python -m benchmarks.ab --base 88fe624 --rounds 3 -o ab.json -- benchmarks.decode \\
        --context 1024 --concurrency 1 8 --exit fixed --fused-decode-max-rows 128 --generate-batch
    python -m benchmarks.ab --base .scratch/base -- benchmarks.run --workload long4 --chunk 64 128
    python -m benchmarks.ab --base . --new-env OURO_JAX_FUSED_XLA_OPTIONS=xla_gpu_experimental_force_split_k=1 \
        -- benchmarks.decode --context 1024 --concurrency 1 8

``--new-env`` / ``--base-env NAME=VALUE`` set a variable in one side's processes only: with
``--base .`` the two sides are one tree under two settings (XLA options, say).

``--time-budget SECONDS`` starts no round (a process a side) that would end past it, judged by the
slowest process so far after the first (the first compiles), so a device call with a hard limit
keeps whole rounds; ``-o`` is rewritten after every process (``complete`` false until the end), so a
run cut short still leaves the comparison of the processes it finished.

The comparison also holds each process's records (``processes[i]["results"]``, without their
latency CDF points), so the one file carries every figure of the A/B, not only the headlines: a
device call returns few files, and ``--work`` holds two a process.

``--base`` is a folder holding the older tree, or a commit, extracted with ``git archive`` (the
device machine gets no ``.git``: extract it here into a carried folder and name that). The benchmark
must take ``--out DIR`` and write JSON files ``{"records": [...]}`` there, each record with a
``headline`` (``benchmarks.run``, ``benchmarks.decode``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from benchmarks.merge_results import record_key

SIDES = ("new", "base")


def side_order(rounds: int) -> list[str]:
    """new, base, base, new, ...: each side first in half the rounds (drift over a call hits both)."""
    return [s for i in range(rounds) for s in (SIDES if i % 2 == 0 else SIDES[::-1])]


def extract_base(base: str, into: str, repo: str = ".") -> str:
    """The base tree's folder: ``base`` itself when it is one, else commit ``base`` of ``repo``
    extracted under ``into`` (``git archive``)."""
    if os.path.isdir(base):
        return os.path.abspath(base)
    dest = os.path.join(into, "base")
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.run(["git", "-C", repo, "archive", base], capture_output=True)
    if archive.returncode != 0:
        raise ValueError(
            f"--base {base!r} is neither a folder nor a commit of {repo!r}: {archive.stderr.decode()[:300]}"
        )
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return dest


def run_side(
    tree: str, module: str, args: Sequence[str], out_dir: str, log_path: str, timeout: float, env_extra=None
) -> dict:
    """``python -m module args --out out_dir`` in ``tree`` (its own code first on the path, the
    variables of ``env_extra`` set); the exit status, seconds, the records it wrote and the devices
    its files name (their top-level ``device``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p))
    env.update(env_extra or {})
    t = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(
                [sys.executable, "-m", module, *args, "--out", out_dir],
                cwd=tree,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    records, devices = [], set()
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        with open(path) as f:
            doc = json.load(f)
        records += doc.get("records", [])
        if doc.get("device"):
            devices.add(str(doc["device"]))
    return dict(rc=rc, seconds=time.perf_counter() - t, records=records, devices=sorted(devices), log=log_path)


def slim(record):
    """``record`` without its ``cdf`` entries (a hundred points per latency metric): what the
    comparison keeps of each process's records."""
    if isinstance(record, dict):
        return {k: slim(v) for k, v in record.items() if k != "cdf"}
    if isinstance(record, list):
        return [slim(v) for v in record]
    return record


def parse_env(items: Sequence[str], flag: str) -> dict:
    """``["NAME=VALUE", ...]`` as a dict (the value may hold ``=``); a clear error otherwise."""
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not name.replace("_", "").isalnum() or name[0].isdigit():
            raise ValueError(f"{flag} takes NAME=VALUE with NAME a variable name, got {item!r}")
        env[name] = value
    return env


def compare(runs: Sequence[tuple[str, list]]) -> list[dict]:
    """Per configuration, in first-seen order: the headline values of each side (process order),
    their medians, min and max, ``ratio`` = new / base of the medians with ``new_better``, and
    ``spreads_overlap``: the two sides' [min, max] meet, so the processes do not separate them."""
    rows: dict[tuple, dict] = {}
    for side, records in runs:
        for r in records:
            h = r.get("headline") or {}
            if h.get("value") is None:
                continue
            row = rows.setdefault(
                record_key(r),
                dict(
                    label=r.get("label"),
                    mode=r.get("mode"),
                    chunk=r.get("chunk"),
                    metric=h.get("metric"),
                    unit=h.get("unit"),
                    lower_is_better=bool(h.get("lower_is_better")),  # the headlines' rule: else higher
                    **{s: [] for s in SIDES},
                ),
            )
            row[side].append(float(h["value"]))
    out = []
    for row in rows.values():
        for s in SIDES:
            v = row[s]
            row[f"{s}_median"] = statistics.median(v) if v else None
            row[f"{s}_spread"] = [min(v), max(v)] if v else None
        n, b = row["new_median"], row["base_median"]
        row["ratio"] = n / b if n is not None and b else None
        row["new_better"] = None if row["ratio"] is None else (row["ratio"] < 1) == row["lower_is_better"]
        # the two sides' [min, max] meet: their processes do not separate them, whatever the ratio
        ns, bs = row["new_spread"], row["base_spread"]
        row["spreads_overlap"] = None if ns is None or bs is None else ns[0] <= bs[1] and bs[0] <= ns[1]
        out.append(row)
    return out


def _result(head: dict, runs, processes: list, *, complete: bool, stopped: Optional[str] = None) -> dict:
    """The comparison so far: ``head`` (command, trees, ...) with the processes and their rows."""
    # the machine the figures come from: a ratio is only meaningful on one kind of card
    devices = sorted({d for p in processes for d in p["devices"]})
    return dict(
        head,
        rounds_run=len(processes) // 2,  # whole rounds: a process a side
        complete=complete,
        stopped=stopped,
        devices=devices,
        processes=processes,
        configurations=compare(runs),
    )


def _write(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:,.4g}"


def table(rows: Sequence[dict]) -> str:
    lines = [f"{'configuration':44} {'metric':14} {'new (median; min-max)':28} {'base':28} new/base"]
    for r in rows:
        name = " ".join(str(x) for x in (r["label"], r["mode"], r["chunk"]) if x is not None)
        cols = []
        for s in SIDES:
            lo, hi = r[f"{s}_spread"] or (None, None)
            cols.append(f"{_fmt(r[f'{s}_median'])} ({_fmt(lo)}-{_fmt(hi)})")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}{' (better)' if r['new_better'] else ''}"
        ratio += " (spreads overlap)" if r["spreads_overlap"] else ""
        lines.append(f"{name[:44]:44} {str(r['metric'])[:14]:14} {cols[0]:28} {cols[1]:28} {ratio}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m benchmarks.ab --base TREE_OR_COMMIT [options] -- MODULE [ARGS...]")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the older tree: a folder, or a commit of this repository")
    ap.add_argument("--new", default=".", help="the newer tree (default: here)")
    ap.add_argument("--rounds", type=int, default=2, help="processes a side (default 2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a process may run")
    ap.add_argument(
        "--time-budget", type=float, default=None, help="start no round that would end past this many seconds"
    )
    ap.add_argument("--work", default=None, help="keep each process's output and log here (default: a temp folder)")
    ap.add_argument("-o", "--out", default="ab.json", help="the comparison's JSON")
    for side in SIDES:
        ap.add_argument(
            f"--{side}-env",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=f"a variable of the {side} side only",
        )
    a = ap.parse_args(argv[:cut])
    bench = argv[cut + 1 :]
    if not bench:
        ap.error("name the benchmark module after --")
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    if a.time_budget is not None and not a.time_budget > 0:
        ap.error(f"--time-budget must be positive, got {a.time_budget}")
    if "--out" in bench:
        ap.error("the benchmark's --out is set by ab (one folder a process)")
    try:
        envs = {side: parse_env(getattr(a, f"{side}_env"), f"--{side}-env") for side in SIDES}
    except ValueError as e:
        ap.error(str(e))
    work = a.work or tempfile.mkdtemp(prefix="ab-")
    trees = dict(new=os.path.abspath(a.new), base=extract_base(a.base, work, a.new))
    runs, processes = [], []
    result = dict(benchmark="ab", command=bench, trees=trees, env=envs, rounds=a.rounds)
    t0, stopped = time.perf_counter(), None
    for i, side in enumerate(side_order(a.rounds)):
        if i % 2 == 0 and i and a.time_budget is not None:
            # the slowest process after the first (which compiles) prices the next round
            per = max(p["seconds"] for p in processes[1:])
            if time.perf_counter() - t0 + 2 * per > a.time_budget:
                stopped = f"time budget: {i // 2} of {a.rounds} rounds in {a.time_budget:.0f} s"
                print(f"ab: {stopped}", flush=True)
                break
        out_dir = os.path.join(work, f"{i:02d}-{side}")
        os.makedirs(out_dir, exist_ok=True)
        log = os.path.join(work, f"{i:02d}-{side}.log")
        res = run_side(trees[side], bench[0], bench[1:], out_dir, log, a.timeout, envs[side])
        processes.append(
            dict(
                side=side,
                rc=res["rc"],
                seconds=res["seconds"],
                records=len(res["records"]),
                devices=res["devices"],
                log=res["log"],
                results=[slim(r) for r in res["records"]],
            )
        )
        print(
            f"ab: {i + 1:2d} {side:4} rc={res['rc']} {res['seconds']:.0f} s, {len(res['records'])} records", flush=True
        )
        runs.append((side, res["records"]))
        _write(a.out, _result(result, runs, processes, complete=False))
    result = _result(result, runs, processes, complete=True, stopped=stopped)
    _write(a.out, result)
    rows, devices = result["configurations"], result["devices"]
    print(table(rows))
    failed = [p for p in processes if p["rc"] != 0]
    if failed:
        print(f"ab: {len(failed)} of {len(processes)} processes failed: " + ", ".join(p["log"] for p in failed))
    if len(devices) > 1:
        print(f"ab: the processes ran on different devices ({', '.join(devices)}): the ratios mix cards")
    print(f"ab: wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
