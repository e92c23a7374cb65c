"""REPORT.md from every JSON under ``benchmarks/results/``: each figure next to its floor.

    python -m benchmarks.report [--results benchmarks/results]

Reads ``<workload>.json`` (``benchmarks/run.py``), ``decode.json`` (``benchmarks/decode.py``),
``bucket_sweep.json`` / ``bucket_padding.json`` (``benchmarks/sweep_buckets.py``),
``generate.json`` (an earlier static-batch run; ``benchmarks.run`` now records ``generate()``
baselines in the workload JSONs), ``self_spec.json`` (``benchmarks/self_spec.py``) and
``soak.json`` (``benchmarks/soak.py``), and writes
``REPORT.md`` with the targets of docs/performance.md (issue 13's decode targets from
decode.json), one table per workload, the decode table, self-speculative decoding, the soak runs,
the bucket sweep, and plots (throughput vs chunk per mode, latency CDFs, prompt throughput vs decode
TPOT of the workloads with decode streams, TPOT vs floor per concurrency, speed-up vs acceptance,
bucket roofline, padding by bucket set). Records of the plain-JAX baselines (mode ``plain_jax``,
``benchmarks/plain_jax.py``) are shown beside the engine's: engine / plain JAX per c in the decode
table, per configuration under long4's table, and as lines in the plots.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import glob
import json
import math
import os
import re
from collections import defaultdict
from typing import Optional

from benchmarks import fmt

__all__ = [
    "load_results",
    "plot_workload",
    "plot_latency",
    "plot_tradeoff",
    "plot_bucket_sweep",
    "plot_decode",
    "decode_section",
    "decode_gemm_section",
    "gate_up_silu_section",
    "plot_self_spec",
    "self_spec_section",
    "soak_section",
    "write_report",
    "main",
]

GENERATE_MODE = "generate()"
PLAIN_MODE = "plain_jax"  # benchmarks.plain_jax.PLAIN_MODE (this module imports no jax)
MODE_ORDER = ("split", "mixed", "wavefront", GENERATE_MODE, PLAIN_MODE)
BASELINE_MODES = (GENERATE_MODE, PLAIN_MODE)  # records of a workload that are not the engine's


# ------------------------------------------------------------------------------------ loading
def load_results(folder: str) -> dict:
    out = {}
    for p in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            with open(p) as f:
                out[os.path.splitext(os.path.basename(p))[0]] = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"skipping {p}: {e}")
    return out


def _ok(records):
    return [r for r in records if "error" not in r and r.get("headline")]


# ------------------------------------------------------------------------------------ plotting
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(records):
    """(label, mode) -> records sorted by chunk."""
    s = defaultdict(list)
    for r in _ok(records):
        s[(r["label"], r["mode"])].append(r)
    for v in s.values():
        v.sort(key=lambda r: (r.get("chunk") is None, r.get("chunk") or 0))
    rank = {m: i for i, m in enumerate(MODE_ORDER)}
    return dict(sorted(s.items(), key=lambda kv: (kv[0][0], rank.get(kv[0][1], 9))))


def plot_workload(result: dict, path: str) -> Optional[str]:
    """Headline figure (and its floor) vs chunk per mode; bars when there is no chunk sweep."""
    recs = _ok(result.get("records", []))
    if not recs:
        return None
    plt = _plt()
    series = _series(recs)
    swept = any(len({r.get("chunk") for r in v}) > 1 for v in series.values())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    h0 = recs[0]["headline"]
    if swept:
        ax, axf = axes
        for i, ((label, mode), rs) in enumerate(series.items()):
            rs = [r for r in rs if r.get("chunk") is not None]
            if not rs:
                continue
            x = [r["chunk"] for r in rs]
            color = f"C{i}"
            name = f"{label} {mode}" if len({k[0] for k in series}) > 1 else mode
            ax.plot(x, [r["headline"]["value"] for r in rs], "o-", color=color, label=name)
            ax.plot(x, [r["headline"]["floor"] for r in rs], "--", color=color, alpha=0.6)
            axf.plot(x, [100 * r["headline"]["fraction"] for r in rs], "o-", color=color, label=name)
        chunks = sorted({r["chunk"] for r in recs if r.get("chunk") is not None})
        for a in (ax, axf):
            a.set_xscale("log", base=2)
            a.set_xticks(chunks, [str(c) for c in chunks])
            a.set_xlabel("prefill chunk size")
        ax.set_yscale("log")
        ax.set_ylabel(f"{h0['metric']} ({h0['unit']}); dashed: floor")
        axf.set_ylabel("% of floor")
        for r in recs:  # the baselines: horizontal lines
            if r["mode"] in BASELINE_MODES and r["headline"]["metric"] == h0["metric"]:
                ls = ":" if r["mode"] == GENERATE_MODE else "-."
                ax.axhline(r["headline"]["value"], color="k", ls=ls, label=f"{r['mode']} {r['label']}")
        ax.legend(fontsize=8)
    else:
        ax, axt = axes
        names = [f"{label}\n{mode}" for (label, mode) in series]
        vals = [v[0]["headline"]["value"] for v in series.values()]
        floors = [v[0]["headline"]["floor"] for v in series.values()]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], vals, 0.4, label="measured")
        ax.bar([i + 0.2 for i in x], floors, 0.4, label="floor", alpha=0.5)
        ax.set_xticks(list(x), names, fontsize=7, rotation=45, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel(f"{h0['metric']} ({h0['unit']})")
        ax.legend(fontsize=8)
        for i, v in enumerate(series.values()):
            ax.text(
                i,
                v[0]["headline"]["value"],
                f"{100 * v[0]['headline']['fraction']:.0f}%",
                ha="center",
                va="bottom",
                fontsize=7,
            )
        tp = [((v[0].get("latency") or {}).get("tpot") or {}).get("p50") for v in series.values()]
        tf = [_tpot_floor_s(v[0]) for v in series.values()]
        axt.bar([i - 0.2 for i in x], [1e3 * t if t else 0 for t in tp], 0.4, label="TPOT p50")
        axt.bar([i + 0.2 for i in x], [1e3 * t if t else 0 for t in tf], 0.4, label="decode step floor", alpha=0.5)
        axt.set_xticks(list(x), names, fontsize=7, rotation=45, ha="right")
        axt.set_ylabel("ms per output token")
        axt.set_yscale("log")
        axt.legend(fontsize=8)
    return _finish(
        plt, fig, path, f"{result.get('workload')} on {result.get('device')} (jax {result.get('jax_version')})"
    )


def _finish(plt, fig, path: str, title: Optional[str] = None) -> str:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency(result: dict, path: str) -> Optional[str]:
    """CDFs of TTFT and ITL (of the decode streams where there are tags) per record."""
    recs = [r for r in _ok(result.get("records", [])) if (r.get("latency") or {}).get("cdf")]
    if not recs:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    q = [i / 100 for i in range(101)]
    for i, r in enumerate(recs):
        lat = r["latency"]
        by = r.get("latency_by_tag") or {}
        name = f"{r['label']} {r['mode']} c{r.get('chunk')}"
        for ax, key, src in ((axes[0], "ttft", lat), (axes[1], "itl", by.get("decode", lat))):
            pts = (src.get("cdf") or {}).get(key)
            if pts:
                ax.plot(
                    [max(p, 1e-6) * 1e3 for p in pts], q, color=f"C{i % 10}", ls="-" if i < 10 else "--", label=name
                )
    axes[0].set_xlabel("TTFT (ms)")
    axes[1].set_xlabel("inter-token latency (ms)" + (" of the decode streams" if recs[0].get("latency_by_tag") else ""))
    for ax in axes:
        ax.set_xscale("log")
        ax.set_ylabel("fraction of requests / tokens")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6, ncol=2)
    return _finish(plt, fig, path, f"{result.get('workload')}: latency CDFs")


def tradeoff_points(result: dict, tag: str = "decode", prompt_tag: str = "long") -> list[dict]:
    """One point per record of a workload with decode streams: ``tpot_ms`` (p50 of the ``tag``
    streams), ``prompt_tok_s`` (the prompt work done on the ``prompt_tag`` prompts, finished or
    not, where the record has it; else the ``prompt_tag`` prompts that got a token; else every
    prompt), ``mode``, ``series`` (the mode and the engine options of the label), ``chunk`` and
    ``target_tpot_ms`` (None: unconstrained)."""
    out = []
    for r in _ok(result.get("records", [])):
        tpot = _lat(r, "tpot", "p50", tag)
        if not tpot or tag not in (r.get("latency_by_tag") or {}):
            continue
        by = r.get("prompt_work_tok_s_by_tag") or r.get("prompt_tok_s_by_tag") or {}
        # the engine's options beyond the mode (a " fused128x1" label part) make a series of their own
        engine = re.sub(r" target .*$", "", r.get("label", "")[len(r.get("workload", "")) :])
        out.append(
            dict(
                mode=r["mode"],
                series=r["mode"] + engine,
                chunk=r.get("chunk"),
                tpot_ms=1e3 * tpot,
                prompt_tok_s=by.get(prompt_tag, r.get("prompt_tok_s")),
                target_tpot_ms=r.get("target_tpot_ms"),
                floor_multiple=r.get("target_tpot_floor_multiple"),
                tpot_floor_ms=1e3 * _tpot_floor_s(r) if _tpot_floor_s(r) else None,
            )
        )
    return out


def plot_tradeoff(result: dict, path: str) -> Optional[str]:
    """Prompt throughput against decode TPOT p50: each mode's chunk sweep as a line, runs under a
    ``target_tpot_ms`` as stars (with their target as a dotted vertical line)."""
    pts = tradeoff_points(result)
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    order = {m: i for i, m in enumerate(MODE_ORDER)}
    series = sorted({p["series"]: p["mode"] for p in pts}.items(), key=lambda kv: (order.get(kv[1], 99), kv[0]))
    for i, (mode, _) in enumerate(series):
        color = f"C{i}"
        free = sorted(
            (p for p in pts if p["series"] == mode and p["target_tpot_ms"] is None), key=lambda p: p["chunk"] or 0
        )
        if free:
            ax.plot([p["tpot_ms"] for p in free], [p["prompt_tok_s"] for p in free], "o-", color=color, label=mode)
            for p in free:
                ax.annotate(f"c{p['chunk']}", (p["tpot_ms"], p["prompt_tok_s"]), fontsize=7, color=color)
        tgt = [p for p in pts if p["series"] == mode and p["target_tpot_ms"] is not None]
        if tgt:
            ax.plot(
                [p["tpot_ms"] for p in tgt],
                [p["prompt_tok_s"] for p in tgt],
                "*",
                ms=12,
                color=color,
                label=f"{mode} under target_tpot_ms",
            )
            for p in tgt:
                name = f"{p['floor_multiple']:g}x floor" if p["floor_multiple"] else f"{p['target_tpot_ms']:g} ms"
                ax.annotate(f"c{p['chunk']} {name}", (p["tpot_ms"], p["prompt_tok_s"]), fontsize=7, color=color)
                ax.axvline(p["target_tpot_ms"], color=color, ls=":", alpha=0.4)
    floors = [p["tpot_floor_ms"] for p in pts if p["tpot_floor_ms"]]
    if floors:
        ax.axvline(min(floors), color="k", ls="--", alpha=0.5, label="decode step floor")
    ax.set_xscale("log")
    ax.set_xlabel("decode TPOT p50 of the streams (ms)")
    ax.set_ylabel("prompt throughput of the long prompts (tok/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _finish(plt, fig, path, f"{result.get('workload')}: prompt throughput vs decode TPOT")


def plot_bucket_sweep(result: dict, path: str) -> Optional[str]:
    dev = (result.get("device_part") or {}).get("buckets")
    pad = result.get("padding")
    if not dev and not pad:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    if dev:
        ax = axes[0]
        ceil = result.get("ceilings") or {}
        bw, peak = ceil.get("bandwidth", 4e12), ceil.get("peak_flops", 785e12)
        xs = [b[k]["intensity"] for b in dev for k in ("decode", "prefill")]
        lo, hi = max(min(xs) / 2, 1e-2), max(xs) * 2
        grid = [lo * (hi / lo) ** (i / 100) for i in range(101)]
        ax.plot(grid, [min(peak, bw * g) / 1e12 for g in grid], "k-", lw=1, label="roofline (measured ceilings)")
        for kind, m in (("decode", "o"), ("prefill", "s")):
            ax.scatter([b[kind]["intensity"] for b in dev], [b[kind]["tflops"] for b in dev], marker=m, label=kind)
            for b in dev:
                ax.annotate(str(b["R"]), (b[kind]["intensity"], b[kind]["tflops"]), fontsize=6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("FLOP / byte")
        ax.set_ylabel("achieved TFLOP/s")
        ax.set_title("bucket roofline (labels: rows)")
        ax.legend(fontsize=7)
        ax = axes[1]
        R = [b["R"] for b in dev]
        for kind in ("decode", "prefill"):
            ax.plot(R, [b[kind]["device_s"] * 1e3 for b in dev], "o-", label=f"{kind} device")
            ax.plot(R, [b[kind]["floor_s"] * 1e3 for b in dev], "--", label=f"{kind} floor")
            ax.plot(R, [b[kind]["host_build_s"] * 1e3 for b in dev], ":", label=f"{kind} host build")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bucket rows R")
        ax.set_ylabel("ms per invocation")
        ax.legend(fontsize=7)
    if pad and pad.get("per_workload"):
        ax = axes[2]
        wls = list(pad["per_workload"])
        sets = list(pad["sets"])
        w = 0.8 / max(1, len(sets))
        for j, sname in enumerate(sets):
            ax.bar(
                [i + j * w for i in range(len(wls))],
                [100 * pad["per_workload"][wl]["by_set"][sname]["padding_fraction"] for wl in wls],
                w,
                label=f"{sname} ({len(pad['sets'][sname])})",
            )
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(wls))], wls, fontsize=7, rotation=20)
        ax.set_ylabel("% padded rows")
        ax.set_title("padding by bucket set (executables)")
        ax.legend(fontsize=6)
    return _finish(plt, fig, path)


def _engine_variant(r) -> str:
    """The engine options a decode record's label carries after its context (``Harness.
    label_suffix``, e.g. ``"fused16x4 sync"``); "" for none."""
    label, at = r.get("label", ""), f"ctx={r.get('context')}"
    return label.split(at, 1)[1].strip() if at in label else ""


def _decode_series(records) -> dict:
    """(context, path, exit) -> records sorted by concurrency (those with a positive TPOT and a floor;
    a generate() TPOT is a difference of two timings, which noise can make negative on a CPU). An
    engine's path names its fused-step variant ("engine fused16x4 sync"), and a generate() record
    its attention kernel where it is not ``auto`` ("generate attention=triton"), so that variants
    of one workload are series of their own."""
    s = defaultdict(list)
    for r in records:
        if "error" not in r and r.get("tpot_fraction_of_floor") and r.get("tpot_floor_ms"):
            path = r.get("path", "engine")
            if path == "engine" and _engine_variant(r):
                path = f"engine {_engine_variant(r)}"
            if path == "generate" and r.get("attention", "auto") != "auto":
                path = f"generate attention={r['attention']}"
            s[(r.get("context"), path, r.get("exit"))].append(r)
    for v in s.values():
        v.sort(key=lambda r: r["concurrency"])
    return dict(
        sorted(s.items(), key=lambda kv: (kv[0][0] or 0, not kv[0][1].startswith("engine"), kv[0][1], str(kv[0][2])))
    )


def plot_decode(result: dict, path: str) -> Optional[str]:
    """decode.json: TPOT p50 per concurrency, one line per exit kind with its floor (dashed), and
    the fraction of floor; one row of panels per context; generate() as open squares, the plain-JAX
    baseline as a black line."""
    series = _decode_series(result.get("records", []))
    if not series:
        return None
    plt = _plt()
    contexts = sorted({k[0] for k in series})
    exits = list(dict.fromkeys(k[2] for k in series))
    color = {e: f"C{i}" for i, e in enumerate(exits)}
    engines = list(dict.fromkeys(k[1] for k in series if k[1].startswith("engine")))
    style = {p: ("o-", "^:", "v-.", "D--")[i % 4] for i, p in enumerate(engines)}
    fig, axes = plt.subplots(len(contexts), 2, figsize=(12, 4 * len(contexts)), squeeze=False)
    for row, ctx in zip(axes, contexts):
        ax, axf = row
        for (c0, p, e), rs in series.items():
            if c0 != ctx:
                continue
            x = [r["concurrency"] for r in rs]
            if p.startswith("engine"):
                name = e if p == "engine" else f"{e} {p[len('engine ') :]}"
                ax.plot(x, [r["tpot_p50_ms"] for r in rs], style[p], color=color[e], label=name)
                ax.plot(x, [r["tpot_floor_ms"] for r in rs], "--", color=color[e], alpha=0.6, label=f"{name} floor")
                axf.plot(x, [100 * r["tpot_fraction_of_floor"] for r in rs], style[p], color=color[e], label=name)
            elif p == PLAIN_MODE:
                name = f"plain JAX {e}"
                ax.plot(x, [r["tpot_p50_ms"] for r in rs], "x-", color="k", label=name)
                axf.plot(x, [100 * r["tpot_fraction_of_floor"] for r in rs], "x-", color="k", label=name)
            else:  # generate(), its attention kernel named where it is not auto
                name, mark = f"{p.replace('generate', 'generate()', 1)} {e}", "s" if p == "generate" else "D"
                ax.plot(x, [r["tpot_p50_ms"] for r in rs], mark, mfc="none", ms=9, color=color[e], label=name)
                axf.plot(x, [100 * r["tpot_fraction_of_floor"] for r in rs], mark, mfc="none", ms=9, color=color[e])
        cs = sorted({r["concurrency"] for (c0, _, _), rs in series.items() if c0 == ctx for r in rs})
        for a in (ax, axf):
            a.set_xscale("log", base=2)
            a.set_xticks(cs, [str(c) for c in cs])
            a.set_xlabel("concurrent streams c")
        ax.set_yscale("log")
        ax.set_ylabel("TPOT p50 (ms); dashed: floor")
        ax.set_title(f"context {ctx}")
        axf.set_ylabel("% of the TPOT floor")
        axf.set_ylim(0, 100)
        axf.set_title(f"context {ctx}: floor / TPOT")
        ax.legend(fontsize=7)
        axf.legend(fontsize=7)
    return _finish(plt, fig, path, f"decode on {result.get('device')} (jax {result.get('jax_version')})")


def decode_section(res: dict) -> str:
    """The decode.json table: one row per record, grouped by context, path and exit kind; engine
    rows at fixed depth with the plain-JAX baseline's TPOT at the same c and engine / baseline."""
    rows = []
    path_name = {"generate": "generate()", PLAIN_MODE: "plain JAX"}
    for (ctx, p, e), rs in _decode_series(res.get("records", [])).items():
        for r in rs:
            ratio = r.get("engine_over_baseline")
            rows.append(
                [
                    ctx,
                    p if p.startswith("engine") else path_name.get(p, p.replace("generate", "generate()", 1)),
                    e,
                    r["concurrency"],
                    _f(r["tpot_p50_ms"], 2),
                    _f(r.get("baseline_tpot_ms"), 2),
                    f"{_f(ratio, 2)}x" if ratio else "–",
                    _f(r["tpot_floor_ms"], 2),
                    _pct(r["tpot_fraction_of_floor"]),
                    _f(r.get("mean_loops_per_token"), 2),
                    _f(r.get("fused_loops_per_token"), 2),
                    _f(r.get("kernels_per_loop"), 0),
                    _pct(r.get("device_busy_share")),
                ]
            )
    head = [
        "context",
        "path",
        "exit",
        "c",
        "TPOT p50 ms",
        "plain JAX ms",
        "engine / plain JAX",
        "floor ms",
        "of floor",
        "loops/token",
        "device loops/token step",
        "kernels/loop",
        "busy",
    ]
    out = _table(head, rows)
    bad = [r for r in res.get("records", []) if "error" in r]
    if bad:
        out += "\n\nFailed: " + "; ".join(f"{r.get('label')} ({r['error'][:120]})" for r in bad)
    if res.get("skipped"):
        out += "\n\nSkipped: " + "; ".join(f"{s['label']} ({s['reason']})" for s in res["skipped"])
    return out


def _spec_records(result: dict) -> list:
    """self_spec.json's speculative records with a speed-up (failed ones and baselines left out)."""
    return [r for r in result.get("records", []) if r.get("mode") == "spec" and r.get("speedup") and "error" not in r]


def _spec_variant(r: dict) -> str:
    """'random d=1 k=3', 'converging(0.01) d=1 k=3': what a marker of the self_spec plot stands for."""
    model = r["model"] if r.get("converging_scale") is None else f"{r['model']}({r['converging_scale']:g})"
    beside = f" arrivals={r['arrivals']}" if r.get("arrivals") else ""
    return f"{model} d={r['draft_loops']} k={r['num_speculative_tokens']}{beside}"


def _spec_beside(r: dict) -> str:
    """The prompts that arrived while a record's streams decoded (``--arrivals``)."""
    if not r.get("arrivals"):
        return "–"
    rounds = r.get("spec_loop_rounds")
    size = f" x {r['arrival_tokens']}" if r.get("arrival_tokens") else ""
    return f"{r['arrivals']}{size}" + ("" if rounds is None else f" ({rounds} loop-by-loop rounds)")


def plot_self_spec(result: dict, path: str) -> Optional[str]:
    """self_spec.json: speed-up over plain decoding against the acceptance the engine measured, a
    marker per (variant, d, k), a colour per concurrency; and speed-up per concurrency."""
    recs = _spec_records(result)
    if not recs:
        return None
    plt = _plt()
    variants = list(dict.fromkeys(_spec_variant(r) for r in recs))
    marker = {v: "osD^v<>pPX*h"[i % 12] for i, v in enumerate(variants)}
    cs = sorted({r["concurrency"] for r in recs})
    color = {c: plt.get_cmap("viridis")(i / max(1, len(cs) - 1)) for i, c in enumerate(cs)}
    fig, (ax, axc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in recs:
        if r.get("acceptance") is not None:
            ax.scatter(r["acceptance"], r["speedup"], marker=marker[_spec_variant(r)], color=color[r["concurrency"]])
    for i, v in enumerate(variants):
        rs = sorted((r for r in recs if _spec_variant(r) == v), key=lambda r: r["concurrency"])
        axc.plot([r["concurrency"] for r in rs], [r["speedup"] for r in rs], marker=marker[v], color=f"C{i}", label=v)
    for a in (ax, axc):
        a.axhline(1.0, color="k", ls=":", lw=1)
        a.set_ylabel("speed-up (plain TPOT / speculative TPOT)")
    ax.set_xlabel("acceptance (accepted / proposed drafts)")
    ax.set_xlim(-0.02, 1.02)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="", marker=marker[v], color="k", label=v) for v in variants]
    handles += [Line2D([], [], ls="", marker="o", color=color[c], label=f"c={c}") for c in cs]
    ax.legend(handles=handles, fontsize=7)
    axc.set_xscale("log", base=2)
    axc.set_xticks(cs, [str(c) for c in cs])
    axc.set_xlabel("concurrent streams c")
    axc.legend(fontsize=7)
    title = f"self-speculative decoding, {result.get('preset')} on {result.get('device')}"
    return _finish(plt, fig, path, f"{title} (jax {result.get('jax_version')})")


def _tokens_equal(r: dict) -> str:
    if r.get("tokens_equal") is None:
        return "–"
    if r["tokens_equal"]:
        return "yes"
    first = r.get("first_difference")
    return "NO" if first is None else f"NO (from token {first})"


def _knobs(k: dict) -> str:
    """``{'qkv': {'splits': 2}}`` -> ``qkv.splits=2``; ``{}`` -> ``defaults``."""
    flat = []
    for name, v in k.items():
        flat += [f"{name}.{a}={b}" for a, b in v.items()] if isinstance(v, dict) else [f"{name}={v}"]
    return ", ".join(flat) or "defaults"


def decode_gemm_section(res: dict) -> str:
    """decode_gemm.json: per block, rows, path and knobs, a layer's wall-clock and kernel device
    time against one read of the block's weights; the three longest kernels."""
    rows = []
    for r in res.get("records", []):
        kernels = ", ".join(f"{k['name']} {k['us_per_layer']:.1f}" for k in r.get("kernels", [])[:3])
        dev = r.get("kernel_us_per_layer")
        rows.append(
            [
                r["block"],
                r["rows"],
                r["path"],
                _knobs(r.get("knobs") or {}),
                _f(r.get("us_per_layer"), 2),
                _f(dev, 2),
                _f(r.get("floor_us"), 2),
                _pct(None if not dev else r["floor_us"] / dev),
                kernels or r.get("error", "–")[:80],
            ]
        )
    head = ["block", "rows", "path", "knobs", "us a layer", "kernel us a layer", "floor us", "of floor", "kernels (us)"]
    out = _table(head, rows)
    if res.get("truncated"):
        out += f"\n\nCut short: {res['truncated']}."
    return out


def gate_up_silu_section(res: dict) -> str:
    """gate_up_silu.json: per rows, XLA's gate/up GEMM + SiLU fusion against the Mosaic kernel with
    SiLU x up in its epilogue (default knobs and the sweep), kernel device time against the FLOP floor."""
    rows = []
    for r in res.get("records", []):
        us = r.get("kernel_us")
        xla = next((x.get("kernel_us") for x in res["records"] if x["rows"] == r["rows"] and x["path"] == "xla"), None)
        rows.append(
            [
                r["rows"],
                r["path"],
                _knobs(r.get("knobs") or {}),
                _f(us, 2),
                _f(r.get("floor_us"), 2),
                _pct(None if not us else r["floor_us"] / us),
                _f(None if not (us and xla) else us / xla, 3),
                r.get("error", "–")[:80],
            ]
        )
    return _table(["rows", "path", "knobs", "kernel us", "floor us", "of floor", "/ xla", "error"], rows)


def self_spec_section(res: dict) -> str:
    """self_spec.json: per variant, c and d:k, the engine's acceptance and tokens per round, TPOT
    beside plain decoding's of the same run, and whether the tokens stayed the same."""
    order = {m: i for i, m in enumerate(("random", "converging"))}
    recs = sorted(
        (r for r in res.get("records", []) if r.get("mode") == "spec" and "error" not in r),
        key=lambda r: (
            order.get(r["model"], 9),
            r.get("arrivals") or 0,
            r["concurrency"],
            r["draft_loops"],
            r["num_speculative_tokens"],
        ),
    )
    rows = [
        [
            r["model"] if r.get("converging_scale") is None else f"{r['model']} ({r['converging_scale']:g})",
            r["concurrency"],
            r["draft_loops"],
            r["num_speculative_tokens"],
            _f(r.get("output_tokens"), 0),
            _spec_beside(r),
            _pct(r.get("acceptance")),
            _f(r.get("mean_accepted_length"), 2),
            _f(r.get("tpot_ms"), 2),
            _f(r.get("baseline_tpot_ms"), 2),
            "–" if r.get("speedup") is None else f"{r['speedup']:.2f}x",
            _f(r.get("tpot_floor_ms"), 2),
            _tokens_equal(r),
        ]
        for r in recs
    ]
    head = [
        "model",
        "c",
        "d",
        "k",
        "out",
        "prompts beside",
        "acceptance",
        "tokens/round",
        "TPOT p50 ms",
        "plain TPOT ms",
        "speed-up",
        "plain floor ms",
        "tokens equal",
    ]
    out = _table(head, rows)
    bad = [r for r in res.get("records", []) if "error" in r]
    if bad:
        out += "\n\nFailed: " + "; ".join(f"{r.get('label')} ({r['error'][:120]})" for r in bad)
    return out


# ----------------------------------------------------------------------------------- markdown
def _f(x, nd=1, scale=1.0, unit=""):
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "–"
    v = x * scale
    if abs(v) >= 1000:
        return f"{v:,.0f}{unit}"
    if v and abs(v) < 10**-nd:
        return f"{v:.3g}{unit}"
    return f"{v:.{nd}f}{unit}"


_pct = functools.partial(fmt.pct, missing="–")


def _tpot_floor_s(r: dict) -> Optional[float]:
    """The decode-step floor a record's TPOT is read against. Records of batch-arrival workloads
    written before ``tpot_floor.batch_from`` existed priced the step at every request decoding at
    once, which lies above what a stream measures (streams reach decode one after another); they
    carry no per-request timing to price it again, so they get no floor instead of a wrong one."""
    tf = r.get("tpot_floor") or {}
    if not tf or (r.get("arrival") == "batch" and "batch_from" not in tf):
        return None
    return tf.get("floor_s")


def _lat(r, key, p, tag=None):
    src = ((r.get("latency_by_tag") or {}).get(tag) if tag else None) or r.get("latency") or {}
    return (src.get(key) or {}).get(p)


def _table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


_MODE_ORDER = {"split": 0, "mixed": 1, "wavefront": 2}


def _row_order(r: dict) -> tuple:
    """Rows of one variant grouped by chunk, modes side by side: the comparison a table is read for."""
    return (r.get("label", ""), r.get("chunk") or 0, _MODE_ORDER.get(r.get("mode"), 3), r.get("mode", ""))


def _run_short(r: dict) -> str:
    """'run N' out of a merged record's tag ('2026-11-30 run 7 (unrolled, ...)'); records of one
    table can come from different device calls and engine versions, and the table says which."""
    m = re.search(r"run \d+", r.get("run") or "")
    return m.group(0) if m else "–"


# generate() baselines of benchmarks.run timed before run 53 compiled without generate()'s options
# (no ``xla_options`` in the record): on a GPU their loops waited for the host (decisions.md)
GENERATE_HOST_LOOPS = " (loops waited for the host: before run 53)"


def _label(r: dict) -> str:
    """A workload record's label with what qualifies its figures."""
    s = r["label"] + (" (truncated)" if r.get("truncated") else "")
    if r.get("mode") == GENERATE_MODE and r.get("path") != "generate" and "xla_options" not in r:
        s += GENERATE_HOST_LOOPS
    return s


def _workload_table(res: dict) -> str:
    rows = []
    tag = "decode" if res.get("workload") == "decode_under_prefill" else None
    for r in sorted(res.get("records", []), key=_row_order):
        if "error" in r:
            rows.append(
                [r.get("label", ""), r.get("mode", ""), r.get("chunk") or "–", f"ERROR: {r['error'][:120]}"]
                + [""] * 14
                + [_run_short(r)]
            )
            continue
        h = r["headline"]
        hist = r.get("exit_histogram") or {}
        mem = r.get("peak_bytes_in_use")
        rows.append(
            [
                _label(r),
                r["mode"],
                r.get("chunk") or "–",
                f"{h['metric']}: **{_f(h['value'])}** / {_f(h['floor'])} {h['unit']}",
                f"**{_pct(h['fraction'])}** {h['bound']}",
                f"{_pct(r['fraction_of_floor'])} {r['floor_bound']}",
                _f(r.get("output_tok_s")),
                f"{_f(_lat(r, 'ttft', 'p50', tag), 1, 1e3)} / {_f(_lat(r, 'ttft', 'p99', tag), 1, 1e3)}",
                f"{_f(_lat(r, 'itl', 'p50', tag), 2, 1e3)} / {_f(_lat(r, 'itl', 'p99', tag), 2, 1e3)}",
                f"{_f(_lat(r, 'tpot', 'p50', tag), 2, 1e3)} / {_f(_lat(r, 'tpot', 'p99', tag), 2, 1e3)}"
                + (f" (floor {_f(_tpot_floor_s(r), 2, 1e3)})" if _tpot_floor_s(r) else ""),
                _f(r.get("rows_per_invocation")),
                _f(r.get("invocations_per_s"), 0),
                _f(r.get("schedule_time_per_invocation_s"), 3, 1e3),
                _f(r.get("host_time_per_invocation_s"), 3, 1e3),
                _f(r.get("time_per_invocation_s"), 3, 1e3),
                _f(hist.get("mean_loops"), 2),
                r.get("compilations", "–"),
                _f(mem / 2**30 if mem else None, 1),
                _run_short(r),
            ]
        )
    header = [
        "variant",
        "mode",
        "chunk",
        "headline: measured / floor",
        "of floor",
        "whole run of floor",
        "out tok/s",
        "TTFT p50/p99 ms",
        "ITL p50/p99 ms",
        "TPOT p50/p99 ms",
        "rows/inv",
        "inv/s",
        "schedule/inv ms",
        "host/inv ms",
        "wall/inv ms",
        "mean loops",
        "compiles",
        "peak GiB",
        "run",
    ]
    return _table(header, rows)


def _plain_prefill_table(res: dict) -> str:
    """The engine records of a workload against its plain-JAX one-shot prefill of the same run
    (``engine_over_baseline``); "" where there is none (older results, other workloads)."""
    recs = sorted((r for r in _ok(res.get("records", [])) if r.get("engine_over_baseline")), key=_row_order)
    rows = [
        [
            r["label"],
            r["mode"],
            r.get("chunk") or "–",
            _f(r["prefill_span"]["prompt_tok_s"]),
            _f(r["prefill_span"]["seconds"], 3),
            _f(r.get("baseline_prompt_tok_s")),
            _f(r.get("baseline_wall_s"), 3),
            f"**{_f(r['engine_over_baseline'], 2)}x**",
        ]
        for r in recs
    ]
    head = ["variant", "mode", "chunk", "engine prompt tok/s", "engine s", "plain JAX tok/s", "plain JAX s"]
    return _table(head + ["engine / plain JAX"], rows) if rows else ""


def _find(results, workload, pred):
    res = results.get(workload)
    if not res:
        return []
    return [r for r in _ok(res.get("records", [])) if pred(r)]


def _decode_targets(results: dict) -> list:
    """Issue 13's decode targets, read from decode.json (1K context) where it exists."""
    res = results.get("decode")
    if not res or res.get("benchmark") != "decode":
        return []
    recs = [r for r in res.get("records", []) if "error" not in r and r.get("tpot_fraction_of_floor")]
    ctx = min((r.get("context") for r in recs), default=None)
    rows = []
    for path, exit_ok, c, goal in (
        ("engine", lambda e: e == "fixed", 1, 0.60),
        ("engine", lambda e: e == "fixed", 8, 0.55),
        ("engine", lambda e: e == "fixed", 128, 0.80),
        ("engine", lambda e: e != "fixed", 1, 0.50),
        ("generate", lambda e: e == "fixed", 1, 0.60),
        ("generate", lambda e: e == "fixed", 8, 0.55),
    ):
        match = [
            r
            for r in recs
            if r.get("path") == path
            and exit_ok(r.get("exit"))
            and r["concurrency"] == c
            and r["context"] == ctx
            and r.get("attention", "auto") == "auto"  # generate()'s own choice, not a forced kernel
        ]
        kind = "fixed depth" if exit_ok("fixed") else "early exit"
        what = f"decode.json {'generate()' if path == 'generate' else 'engine'} c={c}, {kind}, context {ctx}"
        if not match:
            rows.append([what, f">= {goal:.0%} of the TPOT floor (issue 13)", "not run", "", ""])
            continue
        for r in match:
            f = r["tpot_fraction_of_floor"]
            rows.append(
                [
                    what
                    + ("" if kind == "fixed depth" else f" ({r['exit']})")
                    + (f" [{_engine_variant(r)}]" if path == "engine" and _engine_variant(r) else ""),
                    f">= {goal:.0%} of the TPOT floor (issue 13)",
                    f"TPOT p50 {_f(r['tpot_p50_ms'], 2)} ms vs floor {_f(r['tpot_floor_ms'], 2)} ms at "
                    f"{_f(r.get('mean_loops_per_token'), 2)} loops/token",
                    _pct(f),
                    "met" if f >= goal else "not met",
                ]
            )
    return rows


def _targets(results: dict) -> str:
    rows = []

    def serve(fixed_c):
        recs = _find(results, "serve1k", lambda r: r["mode"] not in BASELINE_MODES and r.get("exit") == "fixed")
        if not recs:
            return None
        cs = sorted({r["concurrency"] for r in recs})
        c = cs[0] if fixed_c == "min" else cs[-1]
        # Several variants at the same concurrency (fused steps, layer loops, runs): the target is
        # judged on the best one measured, which the row names; the first found was arbitrary.
        at_c = [r for r in recs if r["concurrency"] == c]
        return max(at_c, key=lambda r: r.get("tpot_fraction_of_floor") or 0.0)

    for what, pick, goal in (
        ("decode, batch 1 (serve1k c=1, fixed depth)", "min", 0.90),
        ("decode, serve1k c=128, fixed depth", "max", 0.85),
    ):
        r = serve(pick)
        if r is None:
            rows.append([what, f">= {goal:.0%} of the bandwidth floor", "not run", "", ""])
            continue
        f = r.get("tpot_fraction_of_floor")
        if r.get("tpot_floor") is None:  # cut short before a token came out
            rows.append(
                [
                    what,
                    f">= {goal:.0%} of the bandwidth floor",
                    f"no TPOT ({'truncated' if r.get('truncated') else 'no tokens'})",
                    "",
                    "",
                ]
            )
            continue
        rows.append(
            [
                what,
                f">= {goal:.0%} of the bandwidth floor",
                f"TPOT p50 {_f(_lat(r, 'tpot', 'p50'), 2, 1e3)} ms vs floor "
                f"{_f(r['tpot_floor']['floor_s'], 2, 1e3)} ms ({r['tpot_floor']['bound']}); whole run "
                f"{_pct(r['fraction_of_floor'])} ({r['label']}, {r['mode']})",
                _pct(f),
                "met" if f and f >= goal else "not met",
            ]
        )
    rows += _decode_targets(results)
    l4 = {(r["mode"], r.get("chunk")): r for r in _find(results, "long4", lambda r: r["mode"] not in BASELINE_MODES)}
    plain = _find(results, "long4", lambda r: r["mode"] == PLAIN_MODE)
    w16, s16 = l4.get(("wavefront", 16)), l4.get(("split", 16))
    if w16:
        h = w16["headline"]
        ratio = h["value"] / s16["headline"]["value"] if s16 else None
        ok = h["fraction"] >= 0.85 and (ratio or 0) >= 1.4
        rows.append(
            [
                "prefill long4, wavefront chunk 16",
                ">= 85% of its floor and >= 1.4x split chunk 16",
                f"{_f(h['value'])} tok/s vs floor {_f(h['floor'])} ({h['bound']}); {_f(ratio, 2)}x split",
                _pct(h["fraction"]),
                "met" if ok else "not met",
            ]
        )
    else:
        rows.append(["prefill long4, wavefront chunk 16", ">= 85% of its floor and >= 1.4x split", "not run", "", ""])
    c128 = [r for (m, c), r in l4.items() if c == 128]
    if c128:
        best = max(c128, key=lambda r: r["headline"]["value"])
        h = best["headline"]
        rows.append(
            [
                "prefill long4, chunk 128",
                ">= 75% of the FLOP floor (>= 45,000 tok/s)",
                f"best {best['mode']}: {_f(h['value'])} tok/s vs floor {_f(h['floor'])} ({h['bound']}); "
                + ", ".join(f"{r['mode']} {_f(r['headline']['value'])}" for r in c128)
                + (
                    f"; plain JAX one-shot {_f(plain[0]['prompt_tok_s'])} tok/s "
                    # a ratio only of one run's records: the engine record carries it then
                    + (
                        f"(best / plain JAX {_f(best['engine_over_baseline'], 2)}x)"
                        if best.get("engine_over_baseline") is not None
                        else "(the best not measured beside it)"
                    )
                    if plain
                    else ""
                ),
                _pct(h["fraction"]),
                "met" if h["fraction"] >= 0.75 else "not met",
            ]
        )
    else:
        rows.append(["prefill long4, chunk 128", ">= 75% of the FLOP floor", "not run", "", ""])
    att = [r for r in (results.get("attention_sweep") or {}).get("records", []) if r.get("ratio_to_cudnn")]
    for kind, goal, unit in (("decode", 0.90, "bandwidth"), ("prefill", 0.85, "TFLOP/s")):
        rs = sorted(att_r["ratio_to_cudnn"] for att_r in att if att_r.get("kind") == kind)
        what = f"paged attention kernel, {kind} {'rows' if kind == 'decode' else 'segments'}"
        if not rs:
            rows.append(
                [what, f">= {goal:.0%} of cuDNN's {unit}", "not measured (benchmarks/attention_sweep.py)", "", ""]
            )
            continue
        med = rs[len(rs) // 2]
        rows.append(
            [
                what,
                f">= {goal:.0%} of cuDNN's {unit} at the same shape",
                f"attention_sweep.json: ours / cuDNN median {med:.2f}, range {rs[0]:.2f}..{rs[-1]:.2f} over "
                f"{len(rs)} shapes",
                _pct(med),
                "met" if rs[0] >= goal else "not met",
            ]
        )
    eng = [
        r
        for res in results.values()
        if res.get("benchmark") == "workload"
        for r in _ok(res.get("records", []))
        if r["mode"] not in BASELINE_MODES
    ]
    if eng:

        def sched(r):  # the host's own work: schedule (builds the descriptor) + update, less device waits
            return (
                r.get("schedule_time_per_invocation_s", 0.0)
                + r.get("update_time_per_invocation_s", 0.0)
                - r.get("device_wait_per_invocation_s", 0.0)
            )

        timed = [r for r in eng if r.get("time_per_invocation_s")]
        shares = sorted(sched(r) / r["time_per_invocation_s"] for r in timed)
        worst = max(timed, key=lambda r: sched(r) / r["time_per_invocation_s"])
        rows.append(
            [
                "host overhead",
                "scheduling + descriptor < 10% of device time per invocation",
                f"(schedule + update - device wait) / wall per invocation: median "
                f"{_pct(shares[len(shares) // 2])}, worst {_pct(shares[-1])} ({worst['label']} "
                f"{worst['mode']} c{worst.get('chunk')}); wall per invocation bounds device time from "
                f"above; kernel launches (dispatch) are reported apart",
                _pct(shares[len(shares) // 2]),
                "met" if shares[-1] < 0.10 else "not met",
            ]
        )
        comp = sum(r.get("compilations", 0) + r.get("xla_compilations", 0) for r in eng)
        rows.append(
            ["recompiles during a run", "0", f"{comp} over {len(eng)} runs", "", "met" if comp == 0 else "not met"]
        )
    rows += _startup_rows(results)
    return _table(["figure", "target", "measured", "of floor", "status"], rows)


def _startup_rows(results: dict) -> list:
    """The start-up target from ``startup.json`` (``benchmarks.startup``: the default ``LLM``'s cold
    and cached starts, timed for that purpose) where it exists; otherwise from the start-ups that
    workload runs record (their engines have other bucket sets, and older runs predate the
    executable store, so they are a fallback, not the measurement)."""
    target = "all buckets <= 45 s cold, <= 8 s with the persistent cache (docs/performance.md)"
    bench = results.get("startup") or {}
    if bench.get("workload") == "startup" and bench.get("starts"):
        starts = bench["starts"]
        cold = [s["ready_s"] for s in starts if s.get("kind") == "cold" and s.get("ready_s")]
        warm = [s["ready_s"] for s in starts if s.get("kind") == "cached" and s.get("ready_s")]
        n = max(len(s.get("executables") or []) for s in starts)
        status = "–" if not (cold and warm) else "met" if max(cold) <= 45 and max(warm) <= 8 else "not met"
        measured = (
            f"startup.json (`{bench.get('preset', '?')}`, {n} executables, ready to serve): cold "
            f"{', '.join(_f(x) + ' s' for x in cold) or 'not seen'}; cached "
            f"{', '.join(_f(x) + ' s' for x in warm) or 'not seen'}"
        )
        return [["start-up", target, measured, "", status]]
    seen, starts = set(), []
    for res in results.values():
        if res.get("benchmark") != "workload":
            continue
        for s in res.get("startup", []) + [res.get("process_startup")]:
            if s and (s.get("elapsed_s"), s.get("warmup_s")) not in seen:
                seen.add((s.get("elapsed_s"), s.get("warmup_s")))
                starts.append(s)
    cold = [s for s in starts if s.get("source") == "compiled"]
    # "compiled + persistent cache": every executable came from the cache and only small helper
    # jits compiled (a start-up is cached when it has at least one cache hit per executable)
    warm = [
        s
        for s in starts
        if "persistent cache" in (s.get("source") or "")
        and (s.get("persistent_cache_hits") or 0) >= (s.get("executables") or 1)
    ]
    rows = []
    if starts:
        rows.append(
            [
                "start-up",
                target,
                f"cold: {', '.join(_f(s['warmup_s']) + ' s' for s in cold) or 'not seen'} "
                f"({cold[0]['executables'] if cold else '–'} executables); cached: "
                f"{', '.join(_f(s['warmup_s']) + ' s' for s in warm) or 'not seen'}",
                "",
                "–"
                if not (cold and warm)
                else "met"
                if max(s["warmup_s"] for s in cold) <= 45 and max(s["warmup_s"] for s in warm) <= 8
                else "not met",
            ]
        )
    return rows


def _bucket_section(bs: dict, pad_only: Optional[dict]) -> str:
    out = []
    dev = (bs or {}).get("device_part")
    if dev:
        out.append(
            f"Synthetic full descriptors per bucket: decode rows at context {dev['decode_context']}, prefill "
            f"segments of {dev['prefill_segment']} rows ending at {dev['prefill_context']}; device time of "
            f"back-to-back invocations with the descriptor on the device ({dev['reps']} reps). Executables: "
            f"{dev['startup']['source']} ({_f(dev['startup']['warmup_s'])} s).\n"
        )
        rows = []
        for b in dev["buckets"]:
            d, p, m = b["decode"], b["prefill"], b.get("memory") or {}
            rows.append(
                [
                    b["R"],
                    b["C"],
                    b["F"],
                    b["MB"],
                    _f(b.get("compile_s"), 2),
                    _f(m.get("temp_bytes", 0) / 2**20 if m else None, 1),
                    _f(m.get("generated_code_bytes", 0) / 2**20 if m else None, 2),
                    f"{_f(d['device_s'], 3, 1e3)} ({_pct(d['fraction_of_floor'])} {d['bound']})",
                    f"{_f(d['gbs'], 0)} GB/s",
                    f"{_f(p['device_s'], 3, 1e3)} ({_pct(p['fraction_of_floor'])} {p['bound']})",
                    f"{_f(p['tflops'], 1)} TFLOP/s",
                    f"{_f(d['host_build_s'], 0, 1e6)} / {_f(p['host_build_s'], 0, 1e6)}",
                    f"{_f(d['upload_s'], 0, 1e6)} / {_f(p['upload_s'], 0, 1e6)}",
                ]
            )
        out.append(
            _table(
                [
                    "R",
                    "C",
                    "F",
                    "MB",
                    "compile s",
                    "temp MiB",
                    "code MiB",
                    "decode ms (floor)",
                    "decode GB/s",
                    "prefill ms (floor)",
                    "prefill TFLOP/s",
                    "host build us (dec/pre)",
                    "upload us (dec/pre)",
                ],
                rows,
            )
        )
    pad = (bs or {}).get("padding") or (pad_only or {}).get("padding")
    if pad:
        out.append(
            f"\n**Padding** (scheduler simulated, no device; {pad['num_blocks']} KV blocks, scale "
            f"{pad['scale']}): padded rows / rows of the buckets run, and the floor overhead if padding rows "
            f"cost their matmul FLOPs.\n"
        )
        sets = list(pad["sets"])
        rows = []
        for wl, v in list(pad["per_workload"].items()) + (
            [("all", pad["all_workloads"])] if pad.get("all_workloads") else []
        ):
            bs_ = v["by_set"]
            rows.append(
                [wl] + [f"{_pct(bs_[s]['padding_fraction'])} / +{_pct(bs_[s]['floor_overhead'])}" for s in sets]
            )
        out.append(_table(["workload"] + [f"{s} ({len(pad['sets'][s])})" for s in sets], rows))
        rows = []
        for wl, v in list(pad["per_workload"].items()) + (
            [("all", pad["all_workloads"])] if pad.get("all_workloads") else []
        ):
            for k, o in v["optimal"].items():
                rows.append(
                    [
                        wl,
                        k,
                        ", ".join(map(str, o["buckets"])),
                        _pct(o["padding_fraction"]),
                        "+" + _pct(o["floor_overhead"]),
                    ]
                )
        out.append("\nBest bucket sets (DP over multiples of 8; objective: padded floor time or padded rows):\n")
        out.append(_table(["workload", "k, objective", "buckets", "padded rows", "floor overhead"], rows))
    return "\n".join(out)


def soak_section(res: dict) -> str:
    """One row per soak run: load, errors, latency, memory and threads, what was left, the drain."""
    rows = []
    for r in res["records"]:
        lat, rss, th, left, d = r["latency"], r["rss"], r["threads"], r["leftovers"], r["drain"]
        refused = sum(n for o in r["outcomes"].values() for code, n in o.items() if code.startswith("4"))
        p = lambda k: f"{fmt.ms((lat[k] or {}).get('p50'))} / {fmt.ms((lat[k] or {}).get('p99'))}"  # noqa: E731
        rows.append(
            [
                r["label"],
                f"{r['load_s']:.0f} s, c={r['concurrency']}",
                f"{sum(r['requests'].values()):,} ({refused:,} 4xx expected)",
                r["unexpected"],
                p("ttft"),
                p("e2e"),
                f"{rss['first_mb']:.0f} / {rss['last_mb']:.0f} / {rss['max_mb']:.0f} "
                f"({fmt.num(rss['growth_mb'])} in the last {rss['window_s']:.0f} s)",
                f"{th['start']} -> {th['end']}",
                f"{left['running']:g} / {left['waiting']:g} / {left['kv_usage']:g}",
                f"exit {d['exit_code']} in {d['seconds']:.1f} s, {d['finished']}/{d['streams']} whole, "
                f"503 {'seen' if d['saw_503'] else 'NOT seen'}",
                "pass" if not r.get("problems") else "; ".join(r["problems"]),
            ]
        )
    head = [
        "run", "load", "requests", "errors", "TTFT p50 / p99 ms", "E2E p50 / p99 ms", "RSS first / last / max MB",
        "threads", "left: running / waiting / KV", "drain", "checks",
    ]  # fmt: skip
    return (
        "Clients loop over streaming and non-streaming completions and chats, dropped streams and bad "
        "requests, with bursts past the queue (429); then SIGTERM with streams in flight.\n\n" + _table(head, rows)
    )


# issue #34's cost targets: TPOT of a path over the free streams' in the same run
_FEATURE_TARGETS = {"json_schema": 1.10, "top_logprobs=5": 1.05}


def serve_features_section(res: dict) -> str:
    """TPOT per API feature beside the free streams of the same engine and run; ``n`` choices beside
    separate requests."""
    rows = []
    for r in (x for x in res["records"] if x["kind"] == "tpot"):
        target = _FEATURE_TARGETS.get(r["path"])
        verdict = "" if target is None else ("met" if r["ratio"] <= target else "NOT met")
        rows.append(
            [
                r["path"],
                r["concurrency"],
                _f(r["tpot_ms"], 2),
                f"{r['ratio']:.3f}",
                "" if target is None else f"<= {target:.2f} ({verdict})",
                _pct(r.get("fused_share")),
            ]
        )
    out = _table(["path", "c", "TPOT p50 ms", "/ free", "target", "fused launches"], rows)
    n_rows = [
        [
            r["path"],
            f"{r['prompt_tokens']} + {r['output_tokens']}",
            _f(r["wall_s"], 3),
            _f(r["last_ttft_s"], 3),
            r["prompt_positions_computed"],
            r["shared_prompt_tokens"],
            "yes" if r["tokens_equal"] else "NO",
        ]
        for r in res["records"]
        if r["kind"] == "n"
    ]
    if n_rows:
        head = [
            "request",
            "prompt + out",
            "wall s",
            "last TTFT s",
            "prompt positions computed",
            "shared",
            "same tokens",
        ]
        out += (
            "\n\n" + _table(head, n_rows) + "\n\nSame tokens: choice j against the request seeded seed + j alone. "
            "In bfloat16 the batch a prompt is computed in changes its rounding, so sampled choices can part; "
            "in float32 they are equal (tests/engine/test_choices.py)."
        )
    return out


def report_device(workloads: dict) -> Optional[str]:
    """The card most workload files were measured on (the first of a tie): the header's device."""
    devices = [v.get("device") for v in workloads.values() if v.get("device")]
    return max(dict.fromkeys(devices), key=devices.count) if devices else None


def write_report(folder: str) -> str:
    results = load_results(folder)
    lines = [
        "# ouro-jax benchmark report",
        "",
        f"Generated {datetime.datetime.now().isoformat(timespec='seconds')} from `{folder}`. Every figure is "
        f"printed next to its floor (`benchmarks/floors.py` model, ceilings measured in the same run); "
        f"'whole run of floor' prices the schedule actually run (`benchmarks/metrics.py`).",
        "",
    ]
    wl = {k: v for k, v in results.items() if v.get("benchmark") == "workload"}
    main_device = report_device(wl)
    # workload files of another card (``long4_h100.json``) keep their section but not the targets
    other = {k for k, v in wl.items() if main_device and v.get("device") not in (None, main_device)}
    same_card = {k: v for k, v in results.items() if k not in other}
    any_res = next((v for k, v in wl.items() if k not in other), None)
    any_res = any_res or results.get("bucket_sweep") or results.get("generate")
    if any_res:
        c = any_res.get("ceilings") or {}
        lines += [
            f"Device: **{any_res.get('device')}**, jax {any_res.get('jax_version')}; ceilings "
            f"{_f(c.get('peak_flops'), 0, 1e-12)} TFLOP/s, {_f(c.get('bandwidth'), 2, 1e-12)} TB/s "
            f"({'measured in the run' if c.get('measured') else 'H200 defaults, not measured'}).",
            "",
        ]
    lines += ["## Targets (docs/performance.md)", "", _targets(same_card), ""]
    order = ["serve1k", "long4", "mixed32", "decode_under_prefill", "mixed128"]
    for name in sorted(wl, key=lambda n: order.index(n) if n in order else 99):
        res = wl[name]
        cfg = res.get("config", {})
        lines += [f"## {name}", ""]
        if name in other:
            lines.append(f"Measured on **{res['device']}**, not the {main_device} of the header: not in the targets.")
        for v in cfg.get("variants", [])[:1]:
            lines.append(f"{v.get('description', '')}.")
        lines.append(
            f"Scale {cfg.get('scale')} (counts x{cfg.get('count_scale')}), preset {cfg.get('preset')} "
            f"{cfg.get('dtype')}, engine shape `{cfg.get('engine_shape')}`, time budget "
            f"{cfg.get('time_budget_s')} s."
        )
        st = res.get("startup", [])
        s0 = res.get("process_startup") or (st[0] if st else None)
        if s0:
            lines.append(
                f"Start-up of the process's first engine: {s0['executables']} executables, {s0['source']} "
                f"in {_f(s0['warmup_s'])} s ({s0['xla_compiles']} XLA compiles, "
                f"{s0['persistent_cache_hits']} persistent-cache hits); the {len(st)} engines of this "
                f"workload: {', '.join(sorted({x['source'] for x in st}))}."
            )
        lines += ["", _workload_table(res), ""]
        plain = _plain_prefill_table(res)
        if plain:
            lines += [
                "Against the plain-JAX one-shot prefill of the same prompts and weights in the same run "
                "(`benchmarks/plain_jax.py`: every loop's layers over the whole prompts in one jit, cuDNN causal "
                "attention on a GPU; best of 3 calls): engine / plain JAX = the engine's prompt tok/s until the "
                "last first token / the baseline's (above 1: the engine is faster).",
                "",
                plain,
                "",
            ]
        if res.get("skipped"):
            lines.append(
                "Skipped: "
                + "; ".join(f"{s['label']} {s['mode']} c{s.get('chunk')} ({s['reason']})" for s in res["skipped"])
            )
            lines.append("")
        for fn, suffix in ((plot_workload, ""), (plot_latency, "_latency"), (plot_tradeoff, "_tradeoff")):
            try:
                p = fn(res, os.path.join(folder, f"{name}{suffix}.png"))
            except ImportError:
                p = None
            if p:
                lines += [f"![{name}{suffix}]({os.path.basename(p)})", ""]
    dec = results.get("decode")
    if dec and dec.get("benchmark") == "decode" and dec.get("records"):
        cfg = dec.get("config", {})
        lines += [
            "## decode (benchmarks/decode.py)",
            "",
            f"c requests at t=0, {cfg.get('output_tokens')} out, prompts warmed into the prefix cache: "
            f"{cfg.get('prefix_warm')}; preset {cfg.get('preset')} {cfg.get('dtype')}, scale {cfg.get('scale')}. "
            "TPOT p50 against `floors.decode_step_floor` at c rows, the mean decode context and the mean "
            "loops per token run; kernels per loop and device-busy share from a profiler trace. Plain JAX: "
            "`benchmarks/plain_jax.py` (dense K/V per layer, donated, a jit per loop, argmax) at the same c, "
            "shapes and weights in the same run; engine / plain JAX = its TPOT / the engine's (above 1: the "
            "engine is faster).",
            "",
            decode_section(dec),
            "",
        ]
        try:
            p = plot_decode(dec, os.path.join(folder, "decode.png"))
        except ImportError:
            p = None
        if p:
            lines += ["![decode](decode.png)", ""]
    gen = results.get("generate")
    if gen and gen.get("records"):
        lines += ["## generate() static batch (generate.json)", ""]
        lines.append(
            _table(
                ["batch", "prompt", "new", "out tok/s", "floor tok/s", "of floor", "first call s"],
                [
                    [
                        r["batch"],
                        r["prompt"],
                        r["new_tokens"],
                        _f(r["output_tok_s"]),
                        _f(r["floor_output_tok_s"]),
                        _pct(r["fraction_of_floor"]),
                        _f(r["first_call_s"]),
                    ]
                    for r in gen["records"]
                ],
            )
        )
        lines.append("")
    att = [r for r in (results.get("attention_sweep") or {}).get("records", []) if r.get("ratio_to_cudnn")]
    if att:
        lines += ["## Paged attention kernel (benchmarks/attention_sweep.py)", ""]
        rows = []
        for r in att:
            sh = r.get("shape", {})
            fig = (
                f"{_f(r.get('gbps'), 0)} / {_f(r.get('cudnn_gbps'), 0)} GB/s"
                if r.get("kind") == "decode"
                else f"{_f(r.get('tflops'), 0)} / {_f(r.get('cudnn_tflops'), 0)} TFLOP/s"
            )
            rows.append(
                [
                    r.get("kind"),
                    f"{sh.get('n_seg')} x {sh.get('q_len')} @ {sh.get('ctx')}",
                    _f(r.get("ours_ms"), 4),
                    _f(r.get("cudnn_ms"), 4),
                    fig,
                    _f(r.get("ratio_to_cudnn"), 2),
                ]
            )
        lines += [
            _table(["kind", "segments x rows @ context", "ours ms", "cuDNN ms", "ours / cuDNN", "ratio"], rows),
            "",
        ]
    feat = results.get("serve_features")
    if feat and feat.get("records"):
        lines += [
            "## API features (benchmarks/serve_features.py)",
            "",
            f"Preset {feat.get('preset')} on {feat.get('device')}; every path on one engine, in turn.",
            "",
            serve_features_section(feat),
            "",
        ]
    gemm = results.get("decode_gemm")
    if gemm and gemm.get("benchmark") == "decode_gemm" and gemm.get("records"):
        bw = (gemm.get("ceilings") or {}).get("bandwidth")
        lines += [
            "## Decode GEMM kernels (benchmarks/decode_gemm.py)",
            "",
            f"A decode layer's MLP block (norm, MLP, norm, residual) and attention projections (norm, Q/K/V, "
            f"O of Q, norm, residual), each chained over {gemm.get('chain')} layers of their own weights, "
            f"XLA against the Mosaic GPU kernels (`pallas_kernels/decode_mlp_mgpu.py`, "
            f"`decode_gemm_mgpu.py`); preset {gemm.get('preset')} on {gemm.get('device')}, {gemm.get('run')}. "
            "`us a layer`: wall clock, (t(2n) - t(n)) / n; `kernel us a layer`: the kernels' device time "
            "in a profiler trace (the steadier figure); the floor is one read of the block's weights at "
            + ("the copy bandwidth measured in the run" if not bw else f"{bw / 1e12:.2f} TB/s, measured in the run")
            + ".",
            "",
            decode_gemm_section(gemm),
            "",
        ]
    gus = results.get("gate_up_silu")
    if gus and gus.get("benchmark") == "gate_up_silu" and gus.get("records"):
        lines += [
            "## Gate/up GEMM with SiLU x up in its epilogue (benchmarks/gate_up_silu.py)",
            "",
            f"One layer's `silu(x @ gate) * (x @ up)` at prompt-sized rows, preset {gus.get('preset')} on "
            f"{gus.get('device')}: XLA's GEMM and SiLU fusion against `pallas_kernels/gate_up_silu_mgpu.py`, "
            "kernel device time (CUPTI, median of 20 calls); the floor is the GEMM's FLOPs at the matmul "
            "ceiling measured in the run. The engine uses the kernel from "
            "`dispatch.SILU_EPILOGUE_MIN_ROWS` rows.",
            "",
            gate_up_silu_section(gus),
            "",
        ]
    spec = results.get("self_spec")
    if spec and spec.get("benchmark") == "self_spec" and spec.get("records"):
        cfg = spec.get("config", {})
        lines += [
            "## Self-speculative decoding (benchmarks/self_spec.py)",
            "",
            f"c streams at t=0, {cfg.get('context')}-token prompts warmed into the prefix cache, "
            f"`out` tokens each, greedy, fixed full depth; preset {spec.get('preset')} "
            f"{cfg.get('dtype')} on {spec.get('device')}. d loops draft k tokens, full depth verifies them; "
            "acceptance and tokens per round are the engine's (`LLM.stats()`) over the timed batch; plain "
            "TPOT is the same variant and c without `speculative_config`, in the same run; the floor is a "
            "plain decode step's (`floors.decode_step_floor`, T loops). `converging (s)`: each layer adds s "
            "of its update (`weights/converging.py`). `prompts beside`: prompts (count x tokens) that "
            "arrived while the streams decoded, so that rounds ran loop by loop beside their chunks.",
            "",
            self_spec_section(spec),
            "",
        ]
        try:
            p = plot_self_spec(spec, os.path.join(folder, "self_spec.png"))
        except ImportError:
            p = None
        if p:
            lines += ["![self_spec](self_spec.png)", ""]
    soak = results.get("soak")
    if soak and soak.get("benchmark") == "soak" and soak.get("records"):
        lines += ["## Soak (benchmarks/soak.py)", "", soak_section(soak), ""]
    bs, bp = results.get("bucket_sweep"), results.get("bucket_padding")
    if bs or bp:
        lines += ["## Bucket sweep", "", _bucket_section(bs, bp), ""]
        merged = dict(bp or {}, **(bs or {}))
        if not merged.get("padding") and bp:
            merged["padding"] = bp.get("padding")
        try:
            p = plot_bucket_sweep(merged, os.path.join(folder, "bucket_sweep.png"))
        except ImportError:
            p = None
        if p:
            lines += [f"![bucket sweep]({os.path.basename(p)})", ""]
    path = os.path.join(folder, "REPORT.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="benchmarks/results")
    a = ap.parse_args(argv)
    path = write_report(a.results)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
