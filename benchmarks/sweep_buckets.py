"""Bucket shapes: what every compiled bucket costs, and which bucket sets minimise padding.

    python -m benchmarks.sweep_buckets [--part device padding] [--preset ouro-1.4b] [--out DIR]

Device part (one engine of the standard shape, ``benchmarks/workloads.suite_shape``): for each
bucket key ``(R rows = S segments, C coda, F finalize, MB block-table columns)`` of
``llm.scheduler.bucket_spec.keys()``: its compile time (``llm.runner.compile_times``; a
persistent-cache load when the cache already holds it), the executable's memory
(``compiled.memory_analysis()``), and the device time of one invocation of a synthetic *full*
descriptor of that bucket, run back to back with the descriptor already on the device:

* ``decode``: R decode rows (one segment each) at ``--decode-context``, every row sampled;
* ``prefill``: R prompt rows in segments of ``--prefill-segment`` rows ending at
  ``--prefill-context``, no coda.

Each is priced like a run (``metrics.invocation_cost``): achieved TFLOP/s and GB/s, the floor and
its fraction, and the host time to build the descriptor (``build_descriptor``) and to upload it.

Padding part (no device: the scheduler alone, ``SimEngine``): every workload's sweep is scheduled
exactly as the engine would schedule it (same arrival processes, ``run.drive``), recording what each
invocation needs (``max(rows, prelude, coda, ceil(finalize / (T-1)))``). Any bucket set is then
priced offline: padded rows, and the floor overhead if padding rows cost their matmul FLOPs
(``max(bytes / bw, (flops + pad * flops_per_row) / peak)`` per invocation). Candidate sets: the
default powers of two and variants, and the best ``k``-bucket sets (multiples of 8) per workload
and over all of them, found by dynamic programming. Writes ``bucket_sweep.json`` and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from typing import Optional, Sequence

import numpy as np

from benchmarks.floors import shape as model_shape
from benchmarks.metrics import ScheduleRecorder, floor_of, invocation_cost
from benchmarks.workloads import WORKLOADS, EngineShape, make, shape_from_args
from scheduler import Request, Scheduler, SchedulerConfig
from scheduler.buckets import BucketSpec, next_power_of_two
from scheduler.descriptor import build_descriptor
from scheduler.fake_runner import FakeRunner
from scheduler.sizes import blocks_per_plane, descriptor_rows, kv_planes, pool_blocks
from weights.config import get_preset

__all__ = [
    "SimEngine",
    "synthetic_descriptor",
    "candidate_sets",
    "optimal_buckets",
    "padding_analysis",
    "device_sweep",
    "main",
]

H200_DEFAULTS = dict(peak_flops=785e12, bandwidth=4.0e12)


# ------------------------------------------------------------------------------- the simulator
class _SimOutput:
    __slots__ = ("request_id", "token_ids", "finished")

    def __init__(self, request_id, token_ids, finished):
        self.request_id, self.token_ids, self.finished = request_id, token_ids, finished


class SimEngine:
    """The scheduler without a device: the engine interface of ``run.drive``.

    Results come from ``runner`` (``scheduler.fake_runner.FakeRunner``, which also checks the
    descriptor contract but costs O(context) per segment) or, by default, are zeros: fixed and
    synthetic exits never read gates and ``ignore_eos`` keeps token 0 harmless, so the schedule,
    hence every row count, is the same (a test checks it)."""

    def __init__(self, config: SchedulerConfig, recorder: Optional[ScheduleRecorder] = None, runner=None):
        self.scheduler = Scheduler(config)
        self.T = config.num_loops
        self.recorder = recorder
        self.runner = runner
        self._reqs: dict = {}
        self.needs: list[int] = []
        self.rows: list[int] = []

    def add_request(self, prompt, params, request_id=None, priority: int = 0):
        req = Request(request_id, prompt, params, priority=priority)
        self.scheduler.add_request(req)
        self._reqs[request_id] = req
        return request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id) -> bool:
        return self.scheduler.abort(request_id) is not None

    def step(self) -> list:
        plan = self.scheduler.schedule()
        if plan is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler has unfinished requests but nothing it can run")
            return []
        d = plan.descriptor
        self.needs.append(descriptor_rows(d.num_rows, d.num_prelude, d.num_coda, d.num_finalize, self.T))
        self.rows.append(d.num_rows)
        if self.recorder is not None:
            self.recorder.observe(d)
        if self.runner is not None:
            result = self.runner.step(d)
            gates, tokens = result.gates, result.tokens
        else:
            gates, tokens = np.zeros(d.key.R, np.float32), np.zeros(d.key.C, np.int32)
        deltas = self.scheduler.update(plan, gates, tokens)
        return [_SimOutput(x.request_id, self._reqs[x.request_id].output_token_ids, x.finished) for x in deltas]


def default_num_blocks(cfg, shape: EngineShape, kv_cache_bytes: Optional[float] = None) -> int:
    """The KV pool the H200 run gets (``LLM._size_pool`` with 0.95 of ~149 GB given to XLA and
    ``gpu_memory_utilization=0.9``), or every sequence at full length for small models."""
    block_bytes = cfg.kv_bytes_per_token_plane(2) * shape.block_size
    planes = kv_planes(cfg.num_loops, "last_exited")
    full = pool_blocks(shape.max_num_seqs, shape.max_model_len, planes, shape.block_size)
    if kv_cache_bytes is None:
        if cfg.num_params < 1e8:
            return full
        kv_cache_bytes = 0.9 * 0.95 * 149e9 - 2 * 2 * cfg.num_params - (2 << 30)
    return int(min(full, kv_cache_bytes // block_bytes))


# ------------------------------------------------------------------------------ bucket sets
def candidate_sets(top: int, smallest: int = 8) -> dict[str, list[int]]:
    top = int(top)

    def pow2(start):
        out, b = [], start
        while b < top:
            out.append(b)
            b *= 2
        return out + [top]

    mid, b = [], smallest
    while b < top:
        mid += [b, b * 3 // 2] if b * 3 // 2 < top else [b]
        b *= 2
    sets = {
        "pow2 from 8 (default)": pow2(8),
        "pow2 from 16": pow2(16),
        "pow2 from 32": pow2(32),
        "pow2 and 1.5x from 8": sorted(set(mid + [top])),
        "8,16,32 then multiples of 64": sorted({8, 16, 32, *range(64, top, 64), top}),
        "sparse 8,64,256,max": sorted({8, 64, 256, top} & set(range(1, top + 1)) | {top}),
    }
    return {k: [x for x in v if x >= 1] for k, v in sets.items()}


def _bucket_of(needs: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    b = np.asarray(sorted(buckets), np.int64)
    i = np.searchsorted(b, needs, side="left")
    if (i >= len(b)).any():
        raise ValueError(f"a need of {int(needs.max())} rows exceeds the largest bucket {b[-1]}")
    return b[i]


def price(inv: dict, buckets: Sequence[int], s: dict, bw: float, peak: float) -> dict:
    """Padded rows and floor overhead of ``buckets`` over the invocations ``inv`` (arrays)."""
    if inv["need"].size == 0:
        return dict(padded_rows=0, padding_fraction=0.0, floor_overhead=0.0, executables=len(buckets))
    b = _bucket_of(inv["need"], buckets)
    pad = b - inv["rows"]
    base = np.maximum(inv["bytes"] / bw, inv["flops"] / peak)
    padded = np.maximum(inv["bytes"] / bw, (inv["flops"] + pad * s["layer_flops_per_row"]) / peak)
    return dict(
        padded_rows=int(pad.sum()),
        padding_fraction=float(pad.sum() / max(1, b.sum())),
        floor_overhead=float(padded.sum() / max(base.sum(), 1e-30) - 1.0),
        executables=len(buckets),
    )


def optimal_buckets(
    inv: dict, ks: Sequence[int], top: int, s: dict, bw: float, peak: float, step: int = 8, objective: str = "floor"
) -> dict[int, list[int]]:
    """For each ``k`` in ``ks``: the set of at most ``k`` buckets (multiples of ``step``, the largest
    = ``top``) that minimises the padded floor time (``objective="floor"``) or the padded rows
    (``"rows"``) over the invocations ``inv``. Dynamic programming over candidate sizes with a
    (need group x bucket) cost matrix; a need group is served by the bucket just above it."""
    cands = np.arange(step, top + 1, step, dtype=np.int64)
    if cands.size == 0 or cands[-1] != top:
        cands = np.append(cands, top)
    n = len(cands)
    group = np.searchsorted(cands, inv["need"], side="left")  # the smallest candidate that fits
    cost = np.zeros((n, n))  # [need group g, bucket j >= g]
    for g in np.unique(group):
        sel = group == g
        rows, by, fl = inv["rows"][sel], inv["bytes"][sel], inv["flops"][sel]
        for j in range(g, n):
            pad = cands[j] - rows
            cost[g, j] = (
                pad.sum()
                if objective == "rows"
                else np.maximum(by / bw, (fl + pad * s["layer_flops_per_row"]) / peak).sum()
            )
    pref = np.vstack([np.zeros((1, n)), np.cumsum(cost, axis=0)])  # pref[i, j] = sum_{g < i} cost[g, j]
    kmax = max(1, min(max(ks), n))
    big = np.inf
    dp = np.full((kmax + 1, n), big)  # dp[m, j]: groups <= j served by m buckets, the largest cands[j]
    arg = np.zeros((kmax + 1, n), np.int64)
    dp[1] = pref[np.arange(1, n + 1), np.arange(n)]
    for m in range(2, kmax + 1):
        for j in range(1, n):
            prev = dp[m - 1, :j] + (pref[j + 1, j] - pref[1 : j + 1, j])  # previous bucket at i < j
            i = int(np.argmin(prev))
            dp[m, j], arg[m, j] = prev[i], i
    out = {}
    for k in ks:
        kk = max(1, min(k, kmax))
        m = int(np.argmin(dp[1 : kk + 1, n - 1])) + 1  # fewer buckets may already be optimal
        chosen, j = [], n - 1
        while m >= 1:
            chosen.append(int(cands[j]))
            j = int(arg[m, j])
            m -= 1
        out[k] = sorted(set(chosen))
    return out


def _inv_arrays(costs, needs) -> dict:
    return dict(
        need=np.asarray(needs, np.int64),
        rows=np.asarray([c.rows for c in costs], np.int64),
        bytes=np.asarray([c.bytes for c in costs], np.float64),
        flops=np.asarray([c.flops for c in costs], np.float64),
    )


def _concat(invs: list[dict]) -> dict:
    return {
        k: np.concatenate([x[k] for x in invs]) if invs else np.zeros(0) for k in ("need", "rows", "bytes", "flops")
    }


def padding_analysis(
    preset: str,
    workloads: Sequence[str],
    shape: EngineShape,
    scale: float = 1.0,
    count_scale: float = 1.0,
    seed: int = 0,
    modes=None,
    chunks=None,
    num_blocks=None,
    ks=(4, 6, 8, 12),
    ceilings: Optional[dict] = None,
    time_budget: Optional[float] = None,
    progress: bool = True,
    fake_runner: bool = False,
) -> dict:
    from benchmarks.run import drive

    cfg = get_preset(preset)
    ceil = ceilings or H200_DEFAULTS
    bw, peak = float(ceil["bandwidth"]), float(ceil["peak_flops"])
    s = model_shape(cfg)
    nb = num_blocks or default_num_blocks(cfg, shape)
    top = shape.buckets[-1] if shape.buckets else next_power_of_two(max(8, shape.max_num_batched_tokens))
    sets = candidate_sets(top)
    if shape.buckets:
        sets = {"configured": list(shape.buckets), **sets}
    t0 = time.monotonic()
    configs, per_wl, skipped, every = [], {}, [], []
    for name in workloads:
        invs = []
        for wl in make(name, cfg.vocab_size, scale, count_scale, seed):
            for chunk in chunks or wl.chunks:
                for mode in modes or wl.modes:
                    if time_budget is not None and time.monotonic() - t0 > time_budget:
                        skipped.append(dict(label=wl.label, mode=mode, chunk=chunk, reason="time budget"))
                        continue
                    sc = SchedulerConfig(
                        num_loops=cfg.num_loops,
                        num_blocks=nb,
                        block_size=shape.block_size,
                        max_num_seqs=shape.max_num_seqs,
                        max_num_batched_tokens=shape.max_num_batched_tokens,
                        prefill_chunk_size=chunk,
                        max_model_len=shape.max_model_len,
                        prefill_mode=mode,
                        eos_token_ids=(cfg.eos_token_id,),
                        buckets=shape.buckets,
                    )
                    rec = ScheduleRecorder(cfg)
                    fake = (
                        FakeRunner(nb, shape.block_size, sc.num_ring_rows, cfg.vocab_size, check=True)
                        if fake_runner
                        else None
                    )
                    eng = SimEngine(sc, rec, fake)
                    t = time.perf_counter()
                    drive(eng, wl)
                    sim_s = time.perf_counter() - t
                    inv = _inv_arrays(rec.costs, eng.needs)
                    invs.append(inv)
                    fl = floor_of(rec.total(), bw, peak)
                    hist = Counter(eng.needs)
                    configs.append(
                        dict(
                            workload=name,
                            variant=wl.variant,
                            label=wl.label,
                            mode=mode,
                            chunk=chunk,
                            invocations=len(eng.needs),
                            real_rows=int(inv["rows"].sum()),
                            rows_per_invocation=float(inv["rows"].mean()) if len(eng.needs) else 0.0,
                            need_hist={str(k): v for k, v in sorted(hist.items())},
                            floor=fl,
                            host_schedule_s=sim_s,
                            host_per_invocation_s=sim_s / max(1, len(eng.needs)),
                            by_set={k: price(inv, v, s, bw, peak) for k, v in sets.items()},
                        )
                    )
                    if progress:
                        c = configs[-1]
                        print(
                            f"padding {wl.label:20s} {mode:9s} chunk {chunk:4d}: {c['invocations']:6d} inv, "
                            f"{c['rows_per_invocation']:7.1f} rows/inv, default buckets pad "
                            f"{100 * c['by_set']['pow2 from 8 (default)']['padding_fraction']:5.1f}% rows, "
                            f"+{100 * c['by_set']['pow2 from 8 (default)']['floor_overhead']:.1f}% floor "
                            f"({sim_s:.1f} s)",
                            flush=True,
                        )
        if invs:
            inv = _concat(invs)
            every.append(inv)
            per_wl[name] = _summarise(inv, sets, top, ks, s, bw, peak)
    overall = _summarise(_concat(every), sets, top, ks, s, bw, peak) if every else None
    return dict(
        preset=preset,
        scale=scale,
        count_scale=count_scale,
        seed=seed,
        engine_shape=shape.to_dict(),
        num_blocks=nb,
        ceilings=dict(ceil),
        top_bucket=top,
        sets=sets,
        configs=configs,
        per_workload=per_wl,
        all_workloads=overall,
        skipped=skipped,
        seconds=time.monotonic() - t0,
    )


def _summarise(inv: dict, sets: dict, top: int, ks, s, bw, peak) -> dict:
    by_set = {k: price(inv, v, s, bw, peak) for k, v in sets.items()}
    optimal = {}
    for obj in ("floor", "rows"):
        for k, b in optimal_buckets(inv, ks, top, s, bw, peak, objective=obj).items():
            optimal[f"k={k} {obj}"] = dict(buckets=b, objective=obj, **price(inv, b, s, bw, peak))
    return dict(invocations=int(inv["need"].size), by_set=by_set, optimal=optimal)


# ------------------------------------------------------------------------------ device part
def synthetic_descriptor(
    spec: BucketSpec,
    R: int,
    kind: str,
    context: int,
    segment_rows: int,
    num_blocks: int,
    num_coda: Optional[int] = None,
):
    """A full descriptor of bucket ``R``: ``decode`` rows (one segment each, every row sampled) or
    ``prefill`` segments of ``segment_rows`` rows ending at ``context``. Every segment reads its own
    blocks (wrapping around the pool), so nothing is served from L2 that a real batch would not."""
    context = int(min(context, spec.max_model_len))
    if kind == "decode":
        seg_len = np.ones(R, np.int64)
    else:
        q = max(1, min(segment_rows, R, context))
        seg_len = np.full(R // q, q, np.int64)
        if R % q:
            seg_len = np.append(seg_len, R % q)
    nseg = len(seg_len)
    bs, mb = spec.block_size, spec.max_blocks_per_seq
    nb = blocks_per_plane(context, bs)
    tables = np.zeros((nseg, 1, mb), np.int32)
    blocks = 1 + (np.arange(nseg)[:, None] * nb + np.arange(nb)[None, :]) % max(1, num_blocks - 1)
    tables[:, 0, :nb] = blocks
    starts = np.concatenate([[0], np.cumsum(seg_len)[:-1]])
    ncoda = (min(R, spec.coda_cap) if num_coda is None else num_coda) if kind == "decode" else 0
    return build_descriptor(
        spec,
        tables,
        seg_slot=np.arange(nseg),
        seg_plane=np.zeros(nseg, np.int64),
        seg_pos=context - seg_len,
        seg_len=seg_len,
        seg_ring=1 + starts,
        pre_ring=1 + np.arange(R),
        pre_token=np.ones(R, np.int64),
        coda_row=np.arange(ncoda),
        coda_temperature=np.zeros(ncoda),
        coda_top_k=np.zeros(ncoda, np.int64),
        coda_top_p=np.ones(ncoda),
        coda_seed=np.zeros(ncoda, np.uint32),
        coda_step=np.zeros(ncoda, np.int64),
        fin_src=np.zeros(0, np.int64),
        fin_dst=np.zeros(0, np.int64),
    )


def _memory_analysis(exe) -> Optional[dict]:
    try:
        m = exe.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if m is None:
        return None
    names = (
        "generated_code_size_in_bytes",
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
    )
    return {n.replace("_size_in_bytes", "_bytes"): int(getattr(m, n, 0) or 0) for n in names}


def device_sweep(
    harness,
    decode_context: int = 1024,
    prefill_context: int = 4096,
    prefill_segment: int = 128,
    reps: int = 10,
    build_reps: int = 20,
    progress: bool = True,
) -> dict:
    import jax
    import jax.numpy as jnp

    llm, startup = harness.engine("split", harness.shape.ring_chunk)  # the ring of run.py: shapes repeat
    try:
        r = llm.runner
        spec = llm.scheduler.bucket_spec
        s = model_shape(harness.config, np.dtype(r.dtype).itemsize)
        bw, peak = harness.bw, harness.peak
        out = []
        for key in spec.keys():
            row = dict(
                R=key.R,
                S=key.S,
                C=key.C,
                F=key.F,
                MB=key.MB,
                compile_s=r.compile_times.get(key),
                compile_source=startup["source"],
                memory=_memory_analysis(r.executable(key)),
            )
            for kind, ctx in (("decode", decode_context), ("prefill", prefill_context)):
                t = time.perf_counter()
                for _ in range(build_reps):
                    desc = synthetic_descriptor(spec, key.R, kind, ctx, prefill_segment, r.num_blocks)
                build_s = (time.perf_counter() - t) / build_reps
                assert desc.key == key, (desc.key, key)
                t = time.perf_counter()
                for _ in range(build_reps):
                    packed = jnp.asarray(desc.pack())
                    packed.block_until_ready()
                upload_s = (time.perf_counter() - t) / build_reps
                for _ in range(2):
                    g, tok, _ = r.launch(key, packed)
                jax.block_until_ready((r.ring, g, tok))
                t = time.perf_counter()
                for _ in range(reps):
                    g, tok, _ = r.launch(key, packed)
                jax.block_until_ready((r.ring, g, tok))
                dt = (time.perf_counter() - t) / reps
                nseg = desc.num_segments
                cost = invocation_cost(
                    s,
                    desc.num_rows,
                    desc.num_coda,
                    desc.num_finalize,
                    desc.seg_q_len[:nseg],
                    desc.seg_ctx_len[:nseg],
                    key.R,
                )
                fl = floor_of(cost, bw, peak)
                row[kind] = dict(
                    context=int(desc.seg_ctx_len[0]),
                    rows=desc.num_rows,
                    segments=nseg,
                    coda=desc.num_coda,
                    device_s=dt,
                    host_build_s=build_s,
                    upload_s=upload_s,
                    packed_bytes=int(desc.pack().nbytes),
                    tflops=cost.flops / dt / 1e12,
                    gbs=cost.bytes / dt / 1e9,
                    intensity=cost.flops / max(cost.bytes, 1.0),
                    floor_s=fl["floor_s"],
                    bound=fl["bound"],
                    fraction_of_floor=fl["floor_s"] / dt,
                    bytes=cost.bytes,
                    flops=cost.flops,
                )
            out.append(row)
            if progress:
                d, p = row["decode"], row["prefill"]
                print(
                    f"bucket R={key.R:5d}: compile {row['compile_s'] or 0:6.2f} s ({startup['source']}) | decode "
                    f"{d['device_s'] * 1e3:7.3f} ms ({100 * d['fraction_of_floor']:5.1f}% of {d['bound']} floor, "
                    f"{d['gbs']:7.0f} GB/s) | prefill {p['device_s'] * 1e3:7.3f} ms "
                    f"({100 * p['fraction_of_floor']:5.1f}% of {p['bound']} floor, {p['tflops']:6.1f} TFLOP/s) | "
                    f"build {d['host_build_s'] * 1e6:6.0f}/{p['host_build_s'] * 1e6:6.0f} us",
                    flush=True,
                )
        return dict(
            startup=startup,
            decode_context=decode_context,
            prefill_context=prefill_context,
            prefill_segment=prefill_segment,
            reps=reps,
            buckets=out,
        )
    finally:
        del llm
        import gc

        gc.collect()


# -------------------------------------------------------------------------------------- main
def main(argv=None, harness=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--part",
        nargs="*",
        choices=["device", "padding"],
        default=["device", "padding"],
        help="what to run (none: only fold --merge into the output)",
    )
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--json", default=None, help="output file (default: <out>/bucket_sweep.json)")
    ap.add_argument("--merge", default=None, help="a padding-part JSON to fold into this one (suite)")
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=sorted(WORKLOADS))
    ap.add_argument("--mode", nargs="+", default=None)
    ap.add_argument("--chunk", nargs="+", type=int, default=None)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--count-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--buckets", nargs="+", type=int, default=None)
    ap.add_argument("--num-blocks", type=int, default=None, help="padding part: KV pool (default: the H200's)")
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--prefill-context", type=int, default=4096)
    ap.add_argument("--prefill-segment", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--time-budget", type=float, default=None, help="padding part: stop simulating after this")
    ap.add_argument(
        "--fake-runner",
        action="store_true",
        help="padding part: run descriptors on scheduler.fake_runner.FakeRunner (checks the contract; "
        "slow at full scale) instead of zero results",
    )
    ap.add_argument("--compile-cache", default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--quick-ceilings", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    path = a.json or os.path.join(a.out, "bucket_sweep.json")
    shape = shape_from_args(a)
    result = dict(benchmark="bucket_sweep", preset=a.preset, argv=sys.argv[1:] if argv is None else list(argv))
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        result.update({k: old[k] for k in ("device_part", "padding", "device", "jax_version", "ceilings") if k in old})
    from benchmarks.run import save_json

    if "device" in a.part:
        import jax

        from benchmarks.run import Harness

        h = harness or Harness(
            a.preset,
            a.dtype,
            shape,
            a.compile_cache,
            gpu_memory_utilization=a.gpu_memory_utilization,
            quick_ceilings=a.quick_ceilings,
            progress=not a.no_progress,
        )
        result.update(
            device=h.device,
            jax_version=jax.__version__,
            backend=jax.default_backend(),
            ceilings=h.ceilings,
            engine_shape=h.shape.to_dict(),
        )
        result["device_part"] = device_sweep(
            h, a.decode_context, a.prefill_context, a.prefill_segment, a.reps, progress=not a.no_progress
        )
        save_json(result, path)
        ceil = h.ceilings
    else:
        ceil = result.get("ceilings") or H200_DEFAULTS
    if "padding" in a.part:
        result["padding"] = padding_analysis(
            a.preset,
            a.workload,
            shape,
            a.scale,
            a.count_scale,
            a.seed,
            a.mode,
            a.chunk,
            a.num_blocks,
            ceilings=ceil,
            time_budget=a.time_budget,
            progress=not a.no_progress,
            fake_runner=a.fake_runner,
        )
        save_json(result, path)
    if a.merge and os.path.exists(a.merge):
        with open(a.merge) as f:
            other = json.load(f)
        if "padding" in other and "padding" not in a.part:
            result["padding"] = other["padding"]
        save_json(result, path)
    print(f"bucket sweep: wrote {path} ({', '.join(k for k in ('device_part', 'padding') if k in result)})", flush=True)
    if not a.no_plot:
        try:
            from benchmarks.report import plot_bucket_sweep

            plot_bucket_sweep(result, os.path.splitext(path)[0] + ".png")
        except ImportError:
            print("matplotlib missing: no plot", flush=True)
    return result


if __name__ == "__main__":
    main()
