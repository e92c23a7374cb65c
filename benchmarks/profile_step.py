"""Where the device time of one recurrent invocation goes: kernels per bucket, from a profiler trace.

    python -m benchmarks.profile_step --preset ouro-1.4b --buckets decode:8 decode:128 prefill:1024 \\
        --steps 20 --out benchmarks/results/profile_step.json

A bucket is ``KIND:R`` (``decode`` or ``prefill``, ``R`` rows), optionally ``KIND:R:CONTEXT``: the
synthetic *full* descriptor of ``sweep_buckets.synthetic_descriptor`` (decode: R rows of one segment
each at ``--decode-context``, every row sampled; prefill: segments of ``--prefill-segment`` rows
ending at ``--prefill-context``, no coda), run back to back with the descriptor already on the
device, exactly as ``sweep_buckets.device_sweep`` times it. The engine is the harness's
(``benchmarks.run.Harness``, random weights); its row buckets are the requested ``R`` (so only those
compile) and every other setting is the standard engine shape, so the executables are the ones the
sweep and the workloads run.

Per bucket: compile (or load from the persistent cache) and a few warm-up invocations; ``--reps``
invocations timed without the profiler (wall per invocation, and the host time spent in the
dispatch calls alone: an upper bound on the host's cost, since a call also waits there when the
device's queue is full; on the H200 prefill:2048 read 0.55 ms in one call and 6.1-6.2 ms, about
half its wall, in others); ``--reps`` more each with the descriptor uploaded before each launch
three ways (``time_uploads``: as the engine's steps do, copied into one device buffer, one step
ahead; on the H200 the engine's way took 0.09-0.42 ms more a step than one descriptor uploaded
once, runs 36-37); then ``--steps`` invocations under ``jax.profiler.trace``, parsed with
``jax.profiler.ProfileData``. Kernel events come from the device plane (``/device:GPU:<i>``, lines
``Stream #...``; derived lines such as ``XLA Ops`` are left out). On a CPU there is no device plane:
the XLA thread-pool events of the host plane stand in (``device_plane: null``), so the figures
there are thunk times on host threads, good for checking the script and little else.

Reported per bucket: wall, device busy time (union of kernel intervals), kernel time (sum),
kernel span (first start to last end), and ``gap = wall - busy`` per invocation; kernels per
invocation; per category (name heuristics, ``categorise``) and per kernel (numeric suffixes
stripped, ``base_name``; the raw names kept): time and count per invocation, share of the kernel
time, mean duration, the HLO instruction and JAX op it came from where the trace or the compiled
HLO says so; per JAX op (``by_op``). The floor of the invocation (``metrics.invocation_cost`` with
the ceilings measured in the run) stands next to wall and busy time.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from typing import Iterable, Optional, Sequence

import numpy as np

from benchmarks import fmt
from benchmarks.floors import shape as model_shape
from benchmarks.metrics import floor_of, interval_union, invocation_cost
from benchmarks.sweep_buckets import synthetic_descriptor
from benchmarks.workloads import EngineShape, shape_from_args
from pallas_kernels.choices import ATTENTION

__all__ = [
    "parse_bucket",
    "base_name",
    "categorise",
    "CATEGORIES",
    "aggregate",
    "kernel_events",
    "hlo_op_names",
    "trace_kernels",
    "profile_engine_window",
    "hide_partial_trace",
    "profile_bucket",
    "main",
]

KINDS = ("decode", "prefill")

# (category, substrings of the lower-cased kernel name); the first match wins
CATEGORIES: tuple = (
    ("attention", ("ragged_paged_attention", "paged_attention", "attention", "flash", "fmha")),
    ("kv_write", ("write_kv", "copy_kv", "kv_slots")),
    ("gemm", ("gemm", "cublas", "cutlass", "matmul", "nvjet", "xmma", "wgmma", "convolution")),
    ("sort_topk", ("sort", "topk", "top_k", "cub::")),
    ("scatter_gather", ("scatter", "gather", "dynamic_update_slice", "dynamic_slice")),
    ("copy_memset", ("memcpy", "memset", "copy")),
    ("xla_fusion", ("fusion", "loop_", "input_", "wrapped_")),
)
_DOT = re.compile(r"(^|[._])dot([._]|$)")
_HLO_OPS = (
    "add",
    "multiply",
    "subtract",
    "divide",
    "convert",
    "select",
    "reduce",
    "broadcast",
    "concatenate",
    "slice",
    "pad",
    "transpose",
    "iota",
    "compare",
    "exponential",
    "tanh",
    "rsqrt",
    "negate",
    "bitcast",
    "reshape",
    "maximum",
    "minimum",
    "and",
    "or",
    "xor",
    "clamp",
    "power",
    "sqrt",
    "log",
)
# idle gaps longer than this between two kernels are attributed to their (before, after) pair
GAP_SITE_MIN_NS = 2000.0
_SUFFIX = re.compile(r"^(.*?[A-Za-z])((?:[._]\d+)+)$")

# lines of a device plane that are derived views, not kernels
DERIVED_LINES = {
    "XLA Modules",
    "XLA Ops",
    "Async XLA Ops",
    "Framework Ops",
    "Framework Name Scope",
    "TensorFlow Ops",
    "TensorFlow Name Scope",
    "Steps",
    "Launch Stats",
    "Source code",
    "CUPTI overhead",
    "_counters_",
    "Host Offload Ops",
    "Sparse Core Steps",
    "Sparse Core Ops",
    "Sparse Core Modules",
}
# host-plane events of the CPU fallback that are not work
_HOST_SKIP_PREFIX = ("ThreadpoolListener", "end: ", "ThunkExecutor", "$", "PjitFunction", "Wait for")
_KEEP_STATS = ("hlo_op", "hlo_module", "kernel_details", "correlation_id")


# ---------------------------------------------------------------------------------- buckets
def parse_bucket(spec: str, decode_context: int, prefill_context: int) -> dict:
    """``"decode:8"`` -> ``{bucket, kind, R, context}``; ``"prefill:1024:2048"`` sets the context."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in KINDS:
        raise ValueError(f"bucket {spec!r}: want KIND:R or KIND:R:CONTEXT with KIND in {KINDS}")
    try:
        rows = int(parts[1])
        ctx = int(parts[2]) if len(parts) == 3 else (decode_context if parts[0] == "decode" else prefill_context)
    except ValueError:
        raise ValueError(f"bucket {spec!r}: R and CONTEXT must be integers") from None
    if rows < 1 or ctx < 1:
        raise ValueError(f"bucket {spec!r}: R and CONTEXT must be positive")
    return dict(bucket=spec, kind=parts[0], R=rows, context=ctx)


# ------------------------------------------------------------------------------ aggregation
def base_name(raw: str) -> str:
    """A kernel name without XLA's numeric instance suffixes: ``loop_add_fusion_12`` and
    ``loop_add_fusion.3`` -> ``loop_add_fusion``, ``fusion_7_2`` -> ``fusion``. Names with templates,
    arguments or spaces (demangled C++) and names whose digits follow a letter (``nvjet_..._v_bz_TNT``,
    ``ragged_paged_attention_bq16_bk64``, ``..._align8``) stay as they are."""
    s = raw.strip()
    if any(c in s for c in "<>( :"):
        return s
    m = _SUFFIX.match(s)
    return m.group(1) if m else s


def categorise(name: str) -> str:
    """The category of a kernel by its name (first match of ``CATEGORIES``; ``dot`` = gemm,
    unfused HLO op kernels such as ``reduce_3`` = xla_fusion; else ``other``)."""
    n = name.lower()
    for cat, keys in CATEGORIES:
        if cat == "xla_fusion" and _DOT.search(n):
            return "gemm"
        if any(k in n for k in keys):
            return cat
    if _DOT.search(n):
        return "gemm"
    if base_name(n) in _HLO_OPS:
        return "xla_fusion"
    return "other"


def _op_of(op_name: Optional[str]) -> Optional[str]:
    return op_name.rsplit("/", 1)[-1] if op_name else None


def _scope_of(op_name: str) -> str:
    """The scope of a JAX op: its op_name less the outer ``jit(...)``, the last component (the
    primitive) and layer numbers (``layers_7`` -> ``layers_*``), so all layers add up."""
    parts = op_name.split("/")
    if len(parts) > 1 and parts[0].startswith("jit("):
        parts = parts[1:]
    parts = parts[:-1] or parts
    return re.sub(r"layers_\d+", "layers_*", "/".join(parts))


def _lookup_op(ev: dict, hlo_ops: Optional[dict]) -> tuple[Optional[str], Optional[str]]:
    """(HLO instruction, JAX op_name) of a kernel event: the trace's ``hlo_op`` stat, else the
    kernel name itself or with its last ``_N`` read as ``.N`` (XLA GPU sanitises ``.`` to ``_``)."""
    stats = ev.get("stats") or {}
    hop = stats.get("hlo_op")
    if not hlo_ops:
        return hop, None
    cands = [hop] if hop else []
    raw = ev["name"]
    cands += [raw, re.sub(r"_(\d+)$", r".\1", raw)]
    for c in cands:
        if c and c in hlo_ops:
            return c, hlo_ops[c]
    return hop, None


def aggregate(events: Iterable[dict], invocations: int, top: int = 25, hlo_ops: Optional[dict] = None) -> dict:
    """Kernel statistics of ``invocations`` invocations from kernel events
    ``{"name", "start_ns", "duration_ns", "stats"?}`` (``stats``: the trace's ``hlo_op``, ...).

    Busy time is the union of the kernel intervals (kernels of several streams may overlap), kernel
    time their sum; shares are of the kernel time. ``hlo_ops`` (``hlo_op_names``) maps HLO
    instruction names to JAX op names for ``top_kernels[].op_name``, ``by_op`` (the primitive) and
    ``by_scope`` (the module path, all layers together)."""
    n = max(1, int(invocations))
    evs = [e for e in events if e.get("duration_ns") is not None]
    total = float(sum(e["duration_ns"] for e in evs))
    busy, span = interval_union([(float(e["start_ns"]), float(e["start_ns"]) + float(e["duration_ns"])) for e in evs])
    starts = sorted(float(e["start_ns"]) for e in evs)
    ends = sorted(float(e["start_ns"]) + float(e["duration_ns"]) for e in evs)
    # gaps between one kernel's end and the next kernel's start on a serial timeline (launch latency)
    order = sorted(evs, key=lambda e: float(e["start_ns"]))
    gaps = [
        max(0.0, float(b["start_ns"]) - (float(a["start_ns"]) + float(a["duration_ns"])))
        for a, b in zip(order, order[1:])
    ]
    # where the device waits: idle time between consecutive kernels, by (kernel before, kernel after)
    sites: dict = {}
    for a, b, g in zip(order, order[1:], gaps):
        if g > GAP_SITE_MIN_NS:
            site = sites.setdefault((base_name(a["name"]), base_name(b["name"])), [0.0, 0])
            site[0] += g
            site[1] += 1
    gap_sites = [
        dict(before=k[0], after=k[1], ms_per_inv=t / n / 1e6, count_per_inv=c / n, mean_us=t / c / 1e3)
        for k, (t, c) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    ]
    by_base: dict = collections.OrderedDict()
    by_raw: dict = {}
    by_op: dict = {}
    by_scope: dict = {}
    for e in evs:
        raw, d = e["name"], float(e["duration_ns"])
        b = base_name(raw)
        k = by_base.get(b)
        if k is None:
            k = by_base[b] = dict(
                name=b,
                category=categorise(b),
                total_ns=0.0,
                count=0,
                raw=collections.Counter(),
                hlo_ops=collections.Counter(),
                op_names=collections.Counter(),
                example_stats=None,
            )
        k["total_ns"] += d
        k["count"] += 1
        k["raw"][raw] += 1
        hop, op_name = _lookup_op(e, hlo_ops)
        if hop:
            k["hlo_ops"][hop] += 1
        if op_name:
            k["op_names"][op_name] += d
            for tab, k2 in ((by_op, _op_of(op_name)), (by_scope, _scope_of(op_name))):
                o = tab.setdefault(k2, [0.0, 0])
                o[0] += d
                o[1] += 1
        elif hlo_ops:
            for tab in (by_op, by_scope):
                o = tab.setdefault("(unmapped)", [0.0, 0])
                o[0] += d
                o[1] += 1
        if k["example_stats"] is None and e.get("stats"):
            k["example_stats"] = {s: e["stats"][s] for s in _KEEP_STATS if s in e["stats"]} or None
        r = by_raw.setdefault(raw, [0.0, 0])
        r[0] += d
        r[1] += 1

    def row(name, t, c, extra=None):
        out = dict(
            name=name,
            ms_per_inv=t / n / 1e6,
            count_per_inv=c / n,
            total_ms=t / 1e6,
            count=c,
            mean_us=t / max(1, c) / 1e3,
            share=t / total if total else 0.0,
        )
        out.update(extra or {})
        return out

    kernels = sorted(by_base.values(), key=lambda k: -k["total_ns"])
    cats: dict = {}
    for k in kernels:
        c = cats.setdefault(k["category"], dict(total_ns=0.0, count=0, kernels=0))
        c["total_ns"] += k["total_ns"]
        c["count"] += k["count"]
        c["kernels"] += 1
    categories = {
        c: row(c, v["total_ns"], v["count"], dict(distinct_kernels=v["kernels"]))
        for c, v in sorted(cats.items(), key=lambda kv: -kv[1]["total_ns"])
    }
    for v in categories.values():
        v.pop("name")
    top_kernels = []
    for k in kernels[:top]:
        op = k["op_names"].most_common(1)
        top_kernels.append(
            row(
                k["name"],
                k["total_ns"],
                k["count"],
                dict(
                    category=k["category"],
                    distinct_raw_names=len(k["raw"]),
                    raw_names=[r for r, _ in k["raw"].most_common(5)],
                    hlo_ops=[h for h, _ in k["hlo_ops"].most_common(3)],
                    op_name=op[0][0] if op else None,
                    op=_op_of(op[0][0]) if op else None,
                    example_stats=k["example_stats"],
                ),
            )
        )
    top_raw = [
        row(r, t, c, dict(category=categorise(r)))
        for r, (t, c) in sorted(by_raw.items(), key=lambda kv: -kv[1][0])[:top]
    ]

    def table(d):
        out = {o: row(o, t, c) for o, (t, c) in sorted(d.items(), key=lambda kv: -kv[1][0])}
        for v in out.values():
            v.pop("name")
        return out or None

    return dict(
        invocations=n,
        kernels=len(evs),
        kernels_per_inv=len(evs) / n,
        distinct_kernels=len(by_base),
        distinct_raw_kernels=len(by_raw),
        busy_ms_per_inv=busy / n / 1e6,
        kernel_ms_per_inv=total / n / 1e6,
        span_ms_per_inv=span / n / 1e6,
        idle_in_span_ms_per_inv=(span - busy) / n / 1e6,
        first_start_ns=starts[0] if starts else None,
        last_end_ns=ends[-1] if ends else None,
        inter_kernel_gap_us=dict(
            mean=float(np.mean(gaps)) / 1e3,
            median=float(np.median(gaps)) / 1e3,
            p90=float(np.percentile(gaps, 90)) / 1e3,
        )
        if gaps
        else None,
        gap_sites=gap_sites,
        categories=categories,
        top_kernels=top_kernels,
        top_raw_kernels=top_raw,
        by_op=table(by_op),
        by_scope=table(by_scope),
    )


# ------------------------------------------------------------------------------- the trace
def _stats(ev) -> dict:
    try:
        return {k: v for k, v in ev.stats if k in _KEEP_STATS}
    except Exception:  # noqa: BLE001 - stats are optional
        return {}


def kernel_events(profile, device_index: int = 0) -> tuple[Optional[str], list, dict]:
    """Kernel events of a ``jax.profiler.ProfileData``: the device plane ``/device:GPU:<i>`` (any
    ``/device:`` plane if that one is missing), its ``Stream #`` lines (or every line not in
    ``DERIVED_LINES``). Without a device plane: the host plane's XLA thread-pool events (names
    starting ``ThreadpoolListener``, ``end: ``, ``ThunkExecutor``... left out). Returns
    ``(device plane name or None, events, info)``."""
    planes = list(profile.planes)
    names = [p.name for p in planes]
    dev = [p for p in planes if p.name == f"/device:GPU:{device_index}"] or [
        p for p in planes if p.name.startswith("/device:") and "CUSTOM" not in p.name
    ]
    info: dict = dict(planes=names)
    out = []
    if dev:
        plane = dev[0]
        lines = list(plane.lines)
        info["lines"] = [ln.name for ln in lines]
        kern = [ln for ln in lines if ln.name.startswith("Stream #")] or [
            ln for ln in lines if ln.name not in DERIVED_LINES
        ]
        info["kernel_lines"] = [ln.name for ln in kern]
        mods = collections.Counter()
        for ln in lines:
            if ln.name == "XLA Modules":
                mods.update(ev.name for ev in ln.events)
        info["xla_modules"] = dict(mods) or None
        for ln in kern:
            for ev in ln.events:
                out.append(
                    dict(
                        name=ev.name,
                        start_ns=float(ev.start_ns),
                        duration_ns=float(ev.duration_ns),
                        stats=_stats(ev),
                        line=ln.name,
                    )
                )
        return plane.name, out, info
    host = [p for p in planes if p.name == "/host:CPU"]
    if not host:
        raise RuntimeError(f"no device plane and no /host:CPU plane in the trace (planes: {names})")
    lines = list(host[0].lines)
    kern = [ln for ln in lines if ln.name.startswith("tf_XLA")] or [ln for ln in lines if ln.name != "python"]
    info["lines"] = [ln.name for ln in lines]
    info["kernel_lines"] = [ln.name for ln in kern]
    for ln in kern:
        for ev in ln.events:
            if ev.duration_ns <= 0 or ev.name.startswith(_HOST_SKIP_PREFIX):
                continue
            out.append(
                dict(
                    name=ev.name,
                    start_ns=float(ev.start_ns),
                    duration_ns=float(ev.duration_ns),
                    stats=None,
                    line=ln.name,
                )
            )
    return None, out, info


_HLO_LINE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{[^}]*?op_name="([^"]*)"')


def hlo_op_names(hlo_text: str) -> dict:
    """HLO instruction name -> JAX ``op_name`` (metadata) of a compiled module's text."""
    out = {}
    for line in hlo_text.splitlines():
        m = _HLO_LINE.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _newest_xplane(trace_dir: str) -> str:
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise RuntimeError(f"the profiler wrote no *.xplane.pb under {trace_dir}")
    return max(files, key=os.path.getmtime)


def profile_engine_window(llm, window, loops_traced: bool = False, host_top: int = 0) -> dict:
    """An engine's kernels over ``window()`` (engine steps that end by waiting for the device and
    return their wall seconds) under the profiler: kernels, device-busy time and where the device
    waits (``gap_sites``), per loop (one-loop invocation) and as a share of the wall
    (``benchmarks.decode`` over decode steps, ``benchmarks.run --profile`` over a workload).
    ``loops_traced``: the engine's fused steps keep their loops out of CUDA graphs, so a window
    with fused steps is traced whole (else ``hide_partial_trace``). ``host_top > 0``: also the
    host's ``host_top`` largest spans per launch (``host_spans_ms_per_launch``; the host tracer
    slows the window, so the spans rank the host's costs rather than time them)."""
    s0 = llm.stats()
    device = getattr(llm.runner.device, "local_hardware_id", None) or 0
    wall, plane, events, info, _ = trace_kernels(window, None, device, host_top)
    s1 = llm.stats()
    loops = traced_loops(s0, s1) if loops_traced else s1["invocations"] - s0["invocations"]
    agg = aggregate(events, max(1, loops), top=8)
    busy_s = agg["busy_ms_per_inv"] * max(1, loops) / 1e3
    out = dict(
        loops=loops,
        tokens=s1["tokens"] - s0["tokens"],
        wall_s=wall,
        wall_ms_per_loop=wall / max(1, loops) * 1e3,
        kernels=agg["kernels"],
        kernels_per_loop=agg["kernels_per_inv"],
        busy_ms_per_loop=agg["busy_ms_per_inv"],
        kernel_ms_per_loop=agg["kernel_ms_per_inv"],
        device_busy_share=busy_s / wall if wall > 0 else None,
        inter_kernel_gap_us=agg["inter_kernel_gap_us"],
        # where the device waits between kernels (kernel before / after the largest gaps)
        gap_sites=agg["gap_sites"][:8],
        categories={
            c: dict(ms_per_loop=v["ms_per_inv"], per_loop=v["count_per_inv"]) for c, v in agg["categories"].items()
        },
        top_kernels=[
            dict(name=k["name"], category=k["category"], ms_per_loop=k["ms_per_inv"], per_loop=k["count_per_inv"])
            for k in agg["top_kernels"]
        ],
        device_plane=plane,
        source="device plane" if plane else "host plane (no device plane: CPU)",
    )
    if plane is None:
        out["note"] = "no device plane in the trace: kernel figures are XLA thunk events on host threads"
    if host_top > 0:
        out["launches"] = s1.get("launches", 0) - s0.get("launches", 0)
        out["host_spans_ms_per_launch"] = spans_per_launch(info["host_spans"], out["launches"])
    fused = s1.get("fused_launches", 0) - s0.get("fused_launches", 0)
    if loops_traced:
        out["fused_launches"] = fused
        return out
    return hide_partial_trace(out, fused)


def traced_loops(s0: dict, s1: dict) -> int:
    """Loops whose kernels a window between engine stats ``s0`` and ``s1`` traced whole. A fused
    step's loops are counted when its output is applied, but the window also traces the step it
    launched ahead and applies next (run 54: 9 fused steps traced, 8 applied, so every per-loop
    figure came out 9/8 too high): its fused loops are the fused steps launched in the window
    (``fused_tokens``, counted at launch) times the loops per token of those applied."""
    d = {k: s1.get(k, 0) - s0.get(k, 0) for k in ("invocations", "fused_loops", "fused_tokens", "fused_row_tokens")}
    if not d["fused_row_tokens"]:
        return d["invocations"]
    per_token = d["fused_loops"] / d["fused_row_tokens"]
    return round(d["invocations"] - d["fused_loops"] + per_token * d["fused_tokens"])


def hide_partial_trace(prof: dict, fused_launches: int) -> dict:
    """A device trace of a window with fused steps is partial: a fused step runs its depth loop as
    CUDA graphs, and the profiler records few of the kernels inside them (run 23: 104 of ~336
    kernels a loop, "24% busy" at a device-bound c=1). Then the traced figures move to
    ``traced_kernels_per_loop`` / ``traced_device_busy_share`` and the config reports none."""
    prof["fused_launches"] = fused_launches
    if prof.get("device_plane") is None or not fused_launches:
        return prof
    prof["traced_kernels_per_loop"] = prof.pop("kernels_per_loop")
    prof["traced_device_busy_share"] = prof.pop("device_busy_share")
    prof["kernels_per_loop"] = prof["device_busy_share"] = None
    prof["note"] = (
        f"{fused_launches} fused steps in the window: their CUDA graphs hide most kernels from the profiler, "
        "so kernels per loop and device-busy share are not reported (traced_* keep the partial view)"
    )
    return prof


def host_spans(profile, launches: int, top: int = 40) -> dict:
    """Spans of the host planes (``/host:...``) of a ``jax.profiler.ProfileData``, keyed
    ``"line | name"``: ``[milliseconds, count]`` per launch, the ``top`` largest by time. Spans nest
    (a call's span holds its executable's), so the figures overlap and do not sum."""
    agg: dict = collections.defaultdict(lambda: [0.0, 0])
    for plane in profile.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            for ev in line.events:
                k = f"{line.name} | {ev.name}"
                agg[k][0] += ev.duration_ns / 1e6
                agg[k][1] += 1
    ranked = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
    return spans_per_launch(dict(ranked), launches)


def spans_per_launch(spans: dict, launches: int) -> dict:
    """``host_spans``' ``[milliseconds, count]`` entries divided by ``launches`` (at least 1)."""
    n = max(1, launches)
    return {k: [ms / n, c / n] for k, (ms, c) in spans.items()}


def host_trace_options():
    """``jax.profiler.ProfileOptions`` whose host trace holds PJRT's and XLA's own spans (not only
    JAX's), without Python's."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = 3
    options.python_tracer_level = 0
    return options


def trace_kernels(fn, trace_dir: Optional[str] = None, device_index: int = 0, host_top: int = 0) -> tuple:
    """Run ``fn()`` under ``jax.profiler.trace`` and parse the trace (``kernel_events``): returns
    ``(fn's result, device plane or None, kernel events, info, trace file or None)``. The trace goes
    to a temporary folder removed afterwards unless ``trace_dir`` names one to keep it in. ``fn``
    should end by waiting for the device, so that every kernel it launched is in the trace.
    ``host_top > 0``: the host is traced at PJRT's and XLA's level too (``host_trace_options``) and
    ``info["host_spans"]`` holds its ``host_top`` largest spans (``host_spans``, totals: divide with
    ``spans_per_launch``)."""
    import jax

    PD = getattr(jax.profiler, "ProfileData", None)
    if PD is None:
        raise RuntimeError(f"jax.profiler.ProfileData is not available in jax {jax.__version__}")
    own = trace_dir is None
    tdir = tempfile.mkdtemp(prefix="ouro_trace_") if own else trace_dir
    try:
        with jax.profiler.trace(tdir, profiler_options=host_trace_options() if host_top > 0 else None):
            out = fn()
        path = _newest_xplane(tdir)
        profile = PD.from_file(path)
        plane, events, info = kernel_events(profile, device_index)
        if host_top > 0:
            info["host_spans"] = host_spans(profile, 1, host_top)
    finally:
        if own:
            shutil.rmtree(tdir, ignore_errors=True)
    return out, plane, events, info, None if own else path


# ------------------------------------------------------------------------------ one bucket
def _invoke(r, key, packed, n: int):
    import jax

    g = tok = None
    for _ in range(n):
        g, tok, _ = r.launch(key, packed)
    jax.block_until_ready((r.ring, g, tok))


def _into_slot(slot, new):
    """``new`` written over ``slot`` (donated): the result keeps ``slot``'s device buffer."""
    import jax

    return jax.lax.dynamic_update_slice(slot, new, (0,) * slot.ndim)


UPLOAD_VARIANTS = ("uploaded", "slot", "ahead")


def time_uploads(r, key, desc, reps: int) -> dict:
    """Wall per invocation with the descriptor uploaded before every launch, three ways, each with
    the host's time in its upload and launch calls (``*_dispatch_ms_per_inv``: near the wall means
    the host, not the device, sets the pace):

    * ``uploaded``: a fresh upload, then the launch (the engine's ``step``);
    * ``slot``: a fresh upload copied on the device into one buffer donated from launch to launch,
      so the executable sees the same address every time (a CUDA graph whose arguments moved is
      re-recorded at its launch; one whose did not is not);
    * ``ahead``: the next launch's descriptor uploaded before this launch.

    Against ``wall_ms_per_inv`` (one descriptor uploaded once) these say whether the wait after a
    fresh descriptor is its copy, the executable's update for a new address, or the host."""
    import jax

    into_slot = jax.jit(_into_slot, donate_argnums=0)
    pack = desc.pack()
    out = {}
    for variant in UPLOAD_VARIANTS:
        slot = r.upload(desc)
        nxt = r.upload(desc)
        jax.block_until_ready(into_slot(r.upload(desc), nxt))  # compiled before the clock
        jax.block_until_ready((slot, nxt))
        host = 0.0
        t = time.perf_counter()
        for _ in range(reps):
            t1 = time.perf_counter()
            if variant == "uploaded":
                packed = r.put(pack)
            elif variant == "slot":
                packed = slot = into_slot(slot, r.put(pack))
            else:
                packed, nxt = nxt, r.put(pack)
            g, tok, _ = r.launch(key, packed)
            host += time.perf_counter() - t1
        jax.block_until_ready((r.ring, g, tok))
        out[f"{variant}_wall_ms_per_inv"] = (time.perf_counter() - t) / reps * 1e3
        out[f"{variant}_dispatch_ms_per_inv"] = host / reps * 1e3
    return out


def profile_bucket(
    llm,
    b: dict,
    steps: int,
    reps: int,
    warmup: int,
    prefill_segment: int,
    bw: float,
    peak: float,
    trace_dir: Optional[str] = None,
    top: int = 25,
) -> dict:
    """Time and profile one bucket (``parse_bucket``'s dict) on ``llm.runner``; see the module doc."""
    import jax
    import jax.numpy as jnp

    r = llm.runner
    spec = llm.scheduler.bucket_spec
    bucket = spec.key_for_bucket(b["R"])
    if bucket not in r.executables():
        raise ValueError(f"bucket R={b['R']} is not one of the engine's row buckets {spec.row_buckets}")
    desc = synthetic_descriptor(spec, b["R"], b["kind"], b["context"], prefill_segment, r.num_blocks)
    assert desc.key == bucket, (desc.key, bucket)
    key = r.executable_key(desc)  # the bucket's long-segment variant where the segments allow
    exe = r.executable(key)
    packed = jnp.asarray(desc.pack())
    packed.block_until_ready()
    nseg = desc.num_segments
    s = model_shape(r.config, np.dtype(r.dtype).itemsize)
    cost = invocation_cost(
        s, desc.num_rows, desc.num_coda, desc.num_finalize, desc.seg_q_len[:nseg], desc.seg_ctx_len[:nseg], key.R
    )
    fl = floor_of(cost, bw, peak)
    rec = dict(
        b,
        key=dict(R=key.R, S=key.S, C=key.C, F=key.F, MB=key.MB, M=key.M),
        rows=desc.num_rows,
        segments=nseg,
        coda=desc.num_coda,
        finalize=desc.num_finalize,
        context=int(desc.seg_ctx_len[0]),
        steps=steps,
        reps=reps,
        floor_ms=fl["floor_s"] * 1e3,
        floor_bound=fl["bound"],
        floor_bytes=fl["bytes"],
        floor_flops=fl["flops"],
        compile_s=r.compile_times.get(key),
    )
    # warm-up, then the timed loop without the profiler (dispatch = host time inside the calls)
    _invoke(r, key, packed, warmup)
    disp = 0.0
    t = time.perf_counter()
    g = tok = None
    for _ in range(reps):
        t1 = time.perf_counter()
        g, tok, _ = r.launch(key, packed)
        disp += time.perf_counter() - t1
    jax.block_until_ready((r.ring, g, tok))
    wall = (time.perf_counter() - t) / reps
    rec.update(
        wall_ms_per_inv=wall * 1e3,
        dispatch_ms_per_inv=disp / reps * 1e3,
        fraction_of_floor=fl["floor_s"] / wall if wall > 0 else None,
        **time_uploads(r, key, desc, reps),
    )
    # the profiled loop
    try:

        def profiled():
            t = time.perf_counter()
            _invoke(r, key, packed, steps)
            return time.perf_counter() - t

        wall_s, plane, events, info, path = trace_kernels(
            profiled, trace_dir, getattr(r.device, "local_hardware_id", None) or 0
        )
        rec["profiled_wall_ms_per_inv"] = wall_s / steps * 1e3  # under the profiler
        if path:
            rec["trace_file"] = path
        try:
            hlo = hlo_op_names(exe.as_text())
        except Exception:  # noqa: BLE001 - the mapping is a bonus
            hlo = None
        agg = aggregate(events, steps, top, hlo)
        rec.update(
            device_plane=plane,
            source="device plane" if plane else "host plane (no device plane: CPU)",
            trace_info=info,
            **agg,
        )
        if plane is None:
            rec["note"] = (
                "no device plane in the trace"
                + (
                    " (CPU backend)"
                    if jax.default_backend() == "cpu"
                    else f" although the backend is {jax.default_backend()} (profiler plugin / CUPTI missing?)"
                )
                + ": kernel figures are XLA thunk events on host threads, busy time their union over threads"
            )
        rec["gap_ms_per_inv"] = rec["wall_ms_per_inv"] - rec["busy_ms_per_inv"]
        rec["busy_fraction_of_floor"] = (
            fl["floor_s"] * 1e3 / rec["busy_ms_per_inv"] if rec["busy_ms_per_inv"] > 0 else None
        )
        if rec["kernels"] == 0:
            rec["error"] = "the trace holds no kernel events"
    except Exception as e:  # noqa: BLE001 - keep the wall time, record why the profile is missing
        rec["error"] = f"profile: {type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc(limit=6)
    return rec


# ---------------------------------------------------------------------------------- output
_ms = functools.partial(fmt.num, missing="?")  # of figures already in milliseconds


def _trunc(s: str, n: int, tail: bool = False) -> str:
    if len(s) <= n:
        return s
    return "~" + s[-(n - 1) :] if tail else s[: n - 1] + "~"


def print_bucket(rec: dict, top: int = 25) -> None:
    head = (
        f"== {rec['bucket']} (R={rec['R']}, rows {rec.get('rows')}, context {rec.get('context')}): "
        f"wall {_ms(rec.get('wall_ms_per_inv'))} ms/inv (dispatch {_ms(rec.get('dispatch_ms_per_inv'))} ms; "
        f"uploading each step's descriptor: {_ms(rec.get('uploaded_wall_ms_per_inv'))}, into one buffer "
        f"{_ms(rec.get('slot_wall_ms_per_inv'))}, one step ahead {_ms(rec.get('ahead_wall_ms_per_inv'))}) "
        f"against a floor of {_ms(rec.get('floor_ms'))} ms ({rec.get('floor_bound')}): "
        f"{100 * (rec.get('fraction_of_floor') or 0):.1f}% of floor"
    )
    print(head)
    if "busy_ms_per_inv" not in rec:
        print(f"   no profile: {rec.get('error')}", flush=True)
        return
    print(
        f"   {rec['source']}: busy {rec['busy_ms_per_inv']:.3f} ms/inv (kernel sum {rec['kernel_ms_per_inv']:.3f}, "
        f"span {rec['span_ms_per_inv']:.3f}), gap wall-busy {rec['gap_ms_per_inv']:.3f} ms, "
        f"{rec['kernels_per_inv']:.1f} kernels/inv ({rec['distinct_kernels']} distinct)"
        + (
            f", inter-kernel gap median {rec['inter_kernel_gap_us']['median']:.2f} us"
            if rec.get("inter_kernel_gap_us")
            else ""
        )
    )
    print(f"   {'category':16s} {'ms/inv':>9s} {'n/inv':>8s} {'mean us':>9s} {'share':>7s}")
    for c, v in rec["categories"].items():
        print(
            f"   {c:16s} {v['ms_per_inv']:9.4f} {v['count_per_inv']:8.1f} {v['mean_us']:9.2f} {100 * v['share']:6.1f}%"
        )
    print(f"   {'kernel':60s} {'category':14s} {'ms/inv':>9s} {'n/inv':>7s} {'mean us':>9s} {'share':>7s}  op")
    for k in rec["top_kernels"][:top]:
        print(
            f"   {_trunc(k['name'], 60):60s} {k['category']:14s} {k['ms_per_inv']:9.4f} {k['count_per_inv']:7.1f} "
            f"{k['mean_us']:9.2f} {100 * k['share']:6.1f}%  {k.get('op') or ''}"
        )
    if rec.get("gap_sites"):
        print(f"   {'device idle between kernels: before -> after':90s} {'ms/inv':>9s} {'n/inv':>7s} {'mean us':>9s}")
        for g in rec["gap_sites"][:8]:
            pair = f"{_trunc(g['before'], 44)} -> {_trunc(g['after'], 44)}"
            print(f"   {pair:90s} {g['ms_per_inv']:9.4f} {g['count_per_inv']:7.1f} {g['mean_us']:9.2f}")
    if rec.get("by_scope"):
        print(f"   {'scope (JAX op_name, layers together)':75s} {'ms/inv':>9s} {'n/inv':>7s} {'share':>7s}")
        for sc, v in list(rec["by_scope"].items())[:10]:
            print(
                f"   {_trunc(sc, 75, tail=True):75s} {v['ms_per_inv']:9.4f} {v['count_per_inv']:7.1f} "
                f"{100 * v['share']:6.1f}%"
            )
    if rec.get("error"):
        print(f"   error: {rec['error']}")
    print(flush=True)


# -------------------------------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--dtype", default=None)
    ap.add_argument(
        "--buckets",
        nargs="+",
        default=["decode:8", "decode:128", "prefill:1024"],
        help="KIND:R or KIND:R:CONTEXT, KIND in decode, prefill",
    )
    ap.add_argument("--steps", type=int, default=20, help="invocations under the profiler")
    ap.add_argument("--reps", type=int, default=None, help="invocations of the timed loop (default: --steps)")
    ap.add_argument("--warmup", type=int, default=3, help="invocations before timing")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="benchmarks/results/profile_step.json")
    ap.add_argument("--trace-dir", default=None, help="keep the traces here (one folder per bucket)")
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--prefill-context", type=int, default=4096)
    ap.add_argument("--prefill-segment", type=int, default=128)
    ap.add_argument(
        "--attention",
        default="auto",
        choices=ATTENTION,
        help="the engine's attention (benchmarks.run --attention); a forced kernel compares kernels per bucket",
    )
    ap.add_argument("--scale", type=float, default=1.0, help="suite_shape's scale (sets max_model_len)")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the largest R asked for")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--compile-cache", default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--quick-ceilings", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def bucket_shape(a, buckets: Sequence[dict]) -> EngineShape:
    """The engine shape of a CLI (``parser``'s flags) that runs ``buckets`` (``parse_bucket``'s
    dicts): their row counts as the row buckets, the largest (or ``--max-num-batched-tokens``) as
    the invocation's rows."""
    rows = sorted({b["R"] for b in buckets})
    mnbt = a.max_num_batched_tokens or rows[-1]
    row_buckets = tuple(sorted(set(rows) | ({mnbt} if mnbt > rows[-1] else set())))
    # Only small buckets asked for (``--buckets decode:8``): the suite's 128 streams would not fit
    # an invocation of ``mnbt`` rows, which the scheduler refuses; fewer streams change no bucket.
    seqs = a.max_num_seqs or min(EngineShape.max_num_seqs, mnbt)
    return shape_from_args(a, max_num_batched_tokens=mnbt, buckets=row_buckets, max_num_seqs=seqs)


def main(argv: Optional[Sequence[str]] = None, harness=None) -> dict:
    a = parser().parse_args(argv)
    buckets = [parse_bucket(x, a.decode_context, a.prefill_context) for x in a.buckets]
    import jax

    from benchmarks.run import harness_from_args, save_json

    h = harness or harness_from_args(a, bucket_shape(a, buckets))
    row_buckets = h.shape.buckets
    reps = a.reps or a.steps
    out_dir = os.path.dirname(a.out)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    result = dict(
        benchmark="profile_step",
        device=h.device,
        jax_version=jax.__version__,
        backend=jax.default_backend(),
        preset=h.preset,
        dtype=h.dtype,
        attention=h.attention,
        argv=sys.argv[1:] if argv is None else list(argv),
        ceilings=h.ceilings,
        engine_shape=h.shape.to_dict(),
        steps=a.steps,
        reps=reps,
        warmup=a.warmup,
        prefill_segment=a.prefill_segment,
        categories_by_name={c: list(k) for c, k in CATEGORIES},
        buckets=[],
    )
    print(
        f"{h.device}: ceilings {h.peak / 1e12:.0f} TFLOP/s, {h.bw / 1e12:.2f} TB/s "
        f"({'measured' if h.ceilings.get('measured') else 'H200 defaults'}); attention {h.attention}; "
        f"row buckets {row_buckets}",
        flush=True,
    )
    llm, startup = h.engine("split", h.shape.ring_chunk)
    result["startup"] = startup
    result["attention_impl"] = llm.runner.attention
    try:
        for b in buckets:
            try:
                tdir = os.path.join(a.trace_dir, b["bucket"].replace(":", "_")) if a.trace_dir else None
                rec = profile_bucket(llm, b, a.steps, reps, a.warmup, a.prefill_segment, h.bw, h.peak, tdir, a.top)
            except Exception as e:  # noqa: BLE001 - next bucket
                rec = dict(b, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))
            result["buckets"].append(rec)
            print_bucket(rec, a.top)
            save_json(result, a.out)
    finally:
        del llm
        import gc

        gc.collect()
    save_json(result, a.out)
    print(f"profile_step: wrote {a.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
