"""The ``decode`` workload (issue 13): c streams decoding together, TPOT next to the bandwidth floor.

    python -m benchmarks.decode [--concurrency 1 2 4 8 16 32 64 128] [--exit fixed synthetic2.5 ouro0.5]
        [--context 1024 4096] [--output-tokens 128] [--generate-batch 1 8] [--generate-context 1024]
        [--profile-steps 8] [--host-spans N] [--no-plain-baseline] [--quick] [--time-budget SECONDS]
        [--preset ouro-1.4b] [--out benchmarks/results]

Per context and concurrency ``c``: ``c`` requests at t=0 with ``context``-token prompts (4K context
means 4096-token prompts: the K/V a decode row reads is its prompt plus the tokens so far, so a 1K
prompt in a 4K engine would read 1K) and ``--output-tokens`` out, once per exit kind: ``fixed``
(full depth), ``synthetic<mean>`` (depths drawn with that mean) and ``ouro<threshold>`` (the
model's gate rule). Every ``c`` takes the first ``c`` prompts of one seeded list per context.

Decode phase only: the prompts are warmed into the prefix cache before each ``c`` (one request of
one token each, untimed), so the timed batch recomputes only each prompt's last block and its ``c``
streams reach decode within a few invocations and decode together (``--cold`` turns this off;
``first_token_spread_s`` and ``prefix_cache_hit_share`` say how together they were). TPOT is each
request's (last token - first token) / (tokens - 1), p50 over the requests.

Floor: ``floors.decode_step_floor`` of one step of ``c`` rows at the mean context of the decode
steps (prompt + out / 2) and the mean loops per token actually run: the layer weights once per loop,
each row's K/V at each loop's plane, the lm_head once; ``tpot_fraction_of_floor = floor / TPOT p50``.

Kernels per loop and device-busy share: after each timed run the same ``c`` prompts run again
(prefix cached), untimed until every request has its first token, then ``--profile-steps`` engine
steps under ``jax.profiler`` (``profile_step.trace_kernels``). Kernels per loop = kernel events /
invocations; device-busy share = union of the kernel intervals / wall time of the traced window.
Fused decode steps on a GPU run their loops as conditional CUDA-graph nodes, whose kernels the
profiler mostly misses (about an eighth of them, run 52): their configurations are profiled after
the timed plan, in an engine of their own whose fused steps keep the loops out of CUDA graphs
(``traceable_fused_options``; the same kernels, launched from the host). Their kernels per loop and
busy time per loop come from that trace, and their device-busy share is busy time per token over
the timed TPOT (the traced engine's wall carries the host's loop round trips).
``--host-spans N`` traces the host too, at PJRT's and XLA's level, and keeps the N largest host
spans per launch in the record's ``profile`` (one-loop steps; the tracer slows the host, so the
spans rank where the host's turnaround goes rather than time it).

One engine serves everything (split, chunk 128, prefix caching on, row buckets: powers of two from 8
to ``max_num_seqs`` and ``max_num_batched_tokens``), compiled once and warmed once; it is closed
while generate() runs (its KV pool takes the memory that needs) and rebuilt on the same executables. A ``c`` whose
requests the KV pool cannot hold at once at a context is skipped with the reason (4K context past
~36 streams on an H200: 3.3 GB of K/V per request over 4 planes). ``XLA_PYTHON_CLIENT_MEM_FRACTION``
defaults to 0.95 here, as in the suite (at JAX's 0.75 the pool holds ~100 1K streams, not 128).

``generate()`` (the static jitted ``ouro_jax.generate``) at ``--generate-batch`` sizes on the same
prompts: TPOT = (t(N tokens) - t(M tokens)) / (N - M), M the fewest tokens whose call has the same
K/V pools (``reference_tokens``), both executables compiled first, the median over
``--generate-reps`` interleaved pairs of calls (``paired_tpot``); fixed depth, and
``ouro<threshold>`` kinds on the same executables (the threshold is a runtime argument);
``synthetic`` has no counterpart there. ``--generate-attention`` with several kernels times each,
their calls interleaved in one process (labels `` attention=K`` where K is not ``auto``): how a
kernel choice for ``generate()`` is settled (run 53).

The plain-JAX baseline (``benchmarks/plain_jax.py``, issue 36; ``--no-plain-baseline`` skips it):
per context and ``c`` when ``fixed`` is among the exit kinds, ``time_decode`` of ``c`` streams over
dense caches (a K/V pair per layer and loop) of prompt + out - 1 positions, on the engine's weights (the harness's
``params``), ``output_tokens - 1`` steps a round (the intervals a request's TPOT spans), fixed depth;
TPOT p50 = the median of 3 rounds. It runs once the context's engine records are done, in the window
where the engine is closed (its caches are as large as the engine's KV pool: 116 GB at 128 x 1K),
and a ``c`` whose caches the free device memory cannot hold is skipped. The fixed-depth engine
records of that context and ``c`` then carry ``baseline_tpot_ms`` and ``engine_over_baseline``
(baseline TPOT / engine TPOT: above 1, the engine is faster).

Records carry ``path: "engine"``, ``"generate"`` or ``"plain_jax"``. Writes ``<out>/decode.json``
(after every record) and ``<out>/decode.png`` (TPOT and its floor per c, one line per exit kind, the
plain-JAX baseline as a black line).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import traceback
from typing import Optional, Sequence

import numpy as np

from benchmarks import fmt
from benchmarks.floors import decode_step_floor
from benchmarks.merge_results import merge_lists
from benchmarks.metrics import ScheduleRecorder, exit_histogram, percentiles
from benchmarks.plain_jax import PLAIN_MODE, PlainDecoder, time_decode
from benchmarks.profile_step import profile_engine_window
from benchmarks.workloads import (
    DECODE_CONCURRENCY,
    DECODE_CONTEXTS,
    DECODE_EXITS,
    EngineShape,
    decode_workload,
    exit_params,
    shape_from_args,
)
from pallas_kernels.choices import ATTENTION

__all__ = ["main", "parser", "decode_shape", "profile_decode", "QUICK"]

GENERATE_MODE = "generate()"  # benchmarks.run's mode name of static-batch records
MODE = "split"
# --quick: what a first look needs (flags given explicitly win)
QUICK = dict(concurrency=[1, 8, 128], context=[1024], output_tokens=32, generate_batch=[1], generate_reps=1)
# seconds a configuration of each kind takes before one has run (time budget); the plain
# baseline compiles one loop executable per c and context
ESTIMATE_S = {"engine": 6.0, "generate": 45.0, PLAIN_MODE: 45.0}


def traceable_fused_options(extra: str = "") -> str:
    """Fused-step XLA options (``EngineConfig.fused_xla_options``) whose loops the profiler sees:
    ``extra`` with the command-buffer kinds of ``compiler_options.FUSED_COMMAND_BUFFER`` less
    ``CONDITIONAL`` and ``WHILE`` (the later entry wins)."""
    from ouro_jax.compiler_options import FUSED_COMMAND_BUFFER

    kinds = ",".join(k for k in FUSED_COMMAND_BUFFER.split(",") if k not in ("CONDITIONAL", "WHILE"))
    return ";".join(filter(None, (extra, f"xla_gpu_enable_command_buffer={kinds}")))


def loops_in_graphs(llm) -> bool:
    """Whether ``llm``'s fused steps run their loops as CUDA-graph conditional nodes (on a GPU)."""
    return llm.runner.device.platform == "gpu"


def attach_fused_profile(rec: dict, prof: dict) -> dict:
    """``rec``'s ``profile``, ``kernels_per_loop`` and ``device_busy_share`` from ``prof``, a trace of
    its batch in the traceable engine (``traceable_fused_options``): busy time per token (busy per
    loop x the record's loops per token) over the timed TPOT p50, since the traced engine's wall
    holds the host's round trips between loops. The loops a token costs are those of the steps the
    window traced: a fused step's (its deepest row's, ``fused_loops_per_token``), or, in a window of
    one-loop invocations only (gated streams past ``FUSED_GATED_MAX_ROWS`` go loop by loop), the
    stream's own (``mean_loops_per_token``: each invocation runs one loop of every stream)."""
    fused_window = prof.get("fused_launches", 1) > 0
    basis = "fused_loops_per_token" if fused_window and rec.get("fused_loops_per_token") else "mean_loops_per_token"
    loops = rec.get(basis)
    busy, tpot = prof.get("busy_ms_per_loop"), rec.get("tpot_p50_ms")
    share = busy * loops / tpot if busy is not None and loops and tpot else None
    prof = dict(
        prof,
        loops_traced=True,
        traced_wall_device_busy_share=prof.get("device_busy_share"),
        device_busy_share=share,
        note="fused steps profiled with their loops out of CUDA graphs (traceable_fused_options): kernels per "
        "loop and busy ms per loop from that trace; device_busy_share = busy ms per loop x loops per token / "
        "the timed TPOT p50",
        loops_per_token_basis=basis,
    )
    rec.update(kernels_per_loop=prof["kernels_per_loop"], device_busy_share=share, profile=prof)
    return rec


def print_host_spans(prof: dict, top: int = 12) -> None:
    for k, (ms, n) in list(prof.get("host_spans_ms_per_launch", {}).items())[:top]:
        print(f"  host {ms:8.3f} ms x{n:5.1f} a launch  {k}", flush=True)


class Skip(Exception):
    """A configuration that cannot run as asked (the reason goes to ``skipped``)."""


def decode_shape(a) -> EngineShape:
    """The standard engine shape with a small bucket set: decode rows in powers of two from 8 to
    ``max_num_seqs`` (one per stream), and ``max_num_batched_tokens`` for the warm-up prefill."""
    sh = shape_from_args(a)
    if a.buckets:
        return sh
    top = sh.max_num_batched_tokens
    b, x = set(), 8
    while x < min(sh.max_num_seqs, top):
        b.add(x)
        x *= 2
    b |= {min(x, top), top}
    return dataclasses.replace(sh, buckets=tuple(sorted(b)))


# ------------------------------------------------------------------------------- the profile
def profile_decode(llm, specs: Sequence, steps: int, tag: str, loops_traced: bool = False, host_top: int = 0) -> dict:
    """Kernels per loop and device-busy share of ``steps`` engine steps of ``specs`` decoding
    together (see the module doc); every request is aborted afterwards. ``loops_traced``: the
    engine's fused steps keep their loops out of CUDA graphs, so the trace is whole. ``host_top``:
    the host's largest spans too (``profile_engine_window``)."""
    ids = [f"profile-{tag}-{i}" for i in range(len(specs))]
    for rid, s in zip(ids, specs):
        llm.add_request(s.prompt, s.params, request_id=rid)
    started: set = set()
    while len(started) < len(ids) and llm.has_unfinished():
        for o in llm.step():
            if len(o.token_ids):
                started.add(o.request_id)
    llm.runner.synchronize()
    done = [0]

    def window() -> float:
        t = time.perf_counter()
        for _ in range(steps):
            if not llm.scheduler.has_unfinished():
                break
            llm.step()
            done[0] += 1
        llm.runner.synchronize()
        return time.perf_counter() - t

    try:
        prof = profile_engine_window(llm, window, loops_traced=loops_traced, host_top=host_top)
    finally:
        for rid in ids:
            llm.abort(rid)
        while llm.has_unfinished():
            llm.step()
    return dict(steps=done[0], **prof)


# ---------------------------------------------------------------------------- engine configs
def _floor_fields(h, c: int, context: float, loops: float, tpot: Optional[float]) -> dict:
    fl = decode_step_floor(h.config, c, context, loops, h.bw, h.peak)
    return dict(
        tpot_floor_ms=fl["floor_s"] * 1e3,
        tpot_floor=dict(
            fl,
            batch=c,
            batch_from="concurrency",
            context=context,
            loops=loops,
            bandwidth=h.bw,
            peak_flops=h.peak,
            basis="floors.decode_step_floor: weights once per loop, each row's K/V at its context per "
            "loop, lm_head once; mean loops per token as run",
        ),
        tpot_fraction_of_floor=fl["floor_s"] / tpot if tpot else None,
    )


def _headline(r: dict) -> dict:
    return dict(
        metric="TPOT p50",
        value=r["tpot_p50_ms"],
        floor=r["tpot_floor_ms"],
        fraction=r["tpot_fraction_of_floor"],
        bound=r["tpot_floor"]["bound"],
        unit="ms",
        lower_is_better=True,
    )


class EngineRunner:
    """The one engine of a sweep, its schedule recorder, and the prompts warmed into its cache."""

    def __init__(self, h, a, fused_xla_options: Optional[str] = None):
        """``fused_xla_options``: the engine's (``traceable_fused_options`` for the profile pass)."""
        self.h, self.a = h, a
        self.chunk = min(a.chunk, h.shape.max_num_batched_tokens)
        kw = {} if fused_xla_options is None else dict(fused_xla_options=fused_xla_options)
        self.llm, self.startup = h.engine(MODE, self.chunk, (), enable_prefix_caching=not a.cold, **kw)
        # fused steps on a GPU: this engine's trace would miss most kernels (the module doc)
        self.defers_profile = fused_xla_options is None and h.fused_decode_max_rows > 0 and loops_in_graphs(self.llm)
        self.rec = ScheduleRecorder(h.config, np.dtype(self.llm.runner.dtype).itemsize).attach(self.llm.runner)
        self.rec.enabled = False
        h._warm(self.llm, self.chunk)
        self.warm_s: dict = {}

    def close(self) -> None:
        """Give the KV pool back (generate() needs the memory); the executables stay with the harness."""
        self.llm.runner.__dict__.pop("step", None)  # drop the recorder (it closes over the runner)
        del self.llm, self.rec
        gc.collect()

    def fit(self, wl) -> int:
        sc, bm = self.llm.scheduler_config, self.llm.scheduler.block_manager
        per_req = max(bm.blocks_needed(s.num_prompt_tokens + s.params.max_tokens - 1) for s in wl.requests)
        return min(sc.max_num_seqs, (sc.num_blocks - 1) // per_req)

    def warm_prefix(self, wl) -> float:
        """The prompts of ``wl`` into the prefix cache (a no-op beyond their last block when they are
        there already); seconds taken."""
        from scheduler import SamplingParams

        if self.a.cold:
            return 0.0
        t = time.perf_counter()
        self.llm.generate(
            [s.prompt for s in wl.requests], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False
        )
        return time.perf_counter() - t

    def run(self, wl, context: int) -> dict:
        from benchmarks.run import _delta, _memory, drive

        h, a, llm = self.h, self.a, self.llm
        c = wl.concurrency
        fit = self.fit(wl)
        if c > fit:
            raise Skip(
                f"the engine holds {fit} such requests at once (KV pool {llm.stats()['kv_cache_bytes'] / 1e9:.1f} GB, "
                f"max_num_seqs {llm.scheduler_config.max_num_seqs}), not {c}"
            )
        warm_s = self.warm_prefix(wl)
        self.rec.reset()
        self.rec.enabled = True
        s0, ev0 = llm.stats(), h.events.snapshot()
        try:
            res = drive(llm, wl, sync=llm.runner.synchronize)
        finally:
            self.rec.enabled = False
        s1, ev1 = llm.stats(), h.events.snapshot()
        stats = _delta(s0, s1)
        r = h._record(wl, MODE, self.chunk, res, self.rec, stats, ev1[0] - ev0[0], self.startup)
        outs = [o for o in res.outputs.values() if len(o.token_ids)]
        T = h.config.num_loops
        tp = percentiles([o.metrics.tpot for o in outs]) or {}
        loops = exit_histogram(outs, T)["mean_loops"]
        p = wl.requests[0].num_prompt_tokens
        out = wl.requests[0].params.max_tokens
        firsts = [o.metrics.first_token_time for o in outs]
        r.update(
            workload="decode",
            path="engine",
            concurrency=c,
            exit=wl.exit,
            context=context,
            prompt_len=p,
            output_tokens_per_request=out,
            tpot_p50_ms=tp["p50"] * 1e3 if tp else None,
            tpot_p90_ms=tp["p90"] * 1e3 if tp else None,
            mean_loops_per_token=loops,
            # loops the device ran per token a fused step made for a row (each token's deepest
            # row: lock step), next to the tokens' own mean
            fused_loops_per_token=(
                stats["fused_loops"] / stats["fused_row_tokens"] if stats.get("fused_row_tokens") else None
            ),
            first_token_spread_s=max(firsts) - min(firsts) if firsts else None,
            prefix_cache_hit_share=stats.get("prefix_cache_hit_tokens", 0)
            / max(1, stats.get("prefix_cache_queried_tokens", 0)),
            prefix_warm_s=warm_s,
            kv_fit_requests=fit,
            **_floor_fields(h, c, p + out / 2, loops, tp.get("p50")),
        )
        r.update(_memory())
        if r["tpot_p50_ms"] is not None:
            r["headline"] = _headline(r)
        if a.profile_steps and not self.defers_profile:
            try:
                prof = profile_decode(
                    llm, wl.requests, a.profile_steps, f"{c}-{wl.exit}-{context}", host_top=a.host_spans
                )
                # the profiler's own cost: wall per loop traced vs untraced (TPOT / loops per token)
                if r["tpot_p50_ms"] and loops:
                    prof["traced_over_untraced_wall"] = prof["wall_ms_per_loop"] / (r["tpot_p50_ms"] / loops)
                r.update(
                    kernels_per_loop=prof["kernels_per_loop"],
                    device_busy_share=prof["device_busy_share"],
                    profile=prof,
                )
                print_host_spans(prof)
            except Exception as e:  # noqa: BLE001 - the timed figures stand without the profile
                traceback.print_exc()
                r["profile"] = dict(error=f"{type(e).__name__}: {e}"[:2000])
        return r


# ----------------------------------------------------------------------------- generate()
def reference_tokens(prompt_len: int, new_tokens: int) -> int:
    """The fewest tokens ``m`` (1 <= m < ``new_tokens``) whose ``generate()`` call sizes its K/V pools
    as the ``new_tokens`` call does (``static_generate.pages_per_row``), else 1. Two calls whose
    pools differ compile to programs whose prefill can differ: one H100, b=8 at 1K, the 17-token
    program's prefill spent 5.5 ms more in K/V layout fusions than the 1-token one (run 53), which
    (t(N) - t(1)) / (N - 1) books to every token."""
    from ouro_jax.static_generate import BLOCK_SIZE, pages_per_row

    pages = pages_per_row(prompt_len + new_tokens)
    m = max(1, (pages - 1) * BLOCK_SIZE - prompt_len + 1)
    return m if m < new_tokens else 1


def paired_tpot(long_s: Sequence[float], short_s: Sequence[float], tokens_apart: int) -> tuple[float, list]:
    """TPOT from interleaved calls: each long call against the short call right after it, the
    median of those pairs (and the pairs). Adjacent calls cancel the drift over a run (run 53,
    b=1: t(64) 499 / 464 / 452 ms), and the median drops a lone fast call (run 54: the first call
    after a buffer moves runs ~4% faster; the fastest-of-each rule booked its 30 ms as 2 ms a token
    at b=8)."""
    paired = [(x - y) / tokens_apart for x, y in zip(long_s, short_s, strict=True)]
    return float(np.median(paired)), paired


class GenerateRunner:
    """``ouro_jax.generate`` on the decode prompts: TPOT from the N-token call and a shorter one whose
    K/V pools have the same shape (``reference_tokens``), for each ``--generate-attention`` kernel,
    every call of every kernel interleaved in this one process (processes of the same code spread by
    up to 6% at b=8, run 53: a kernel choice is settled side by side in one process)."""

    def __init__(self, h, a):
        self.h, self.a = h, a

    def run(self, context: int, batch: int, exits: Sequence[str]) -> list[dict]:
        import jax

        from benchmarks.run import _memory
        from ouro_jax import generate

        h, a = self.h, self.a
        cfg = h.config
        wl = decode_workload(cfg.vocab_size, batch, "fixed", context, a.scale, a.seed, a.output_tokens)
        n = wl.requests[0].params.max_tokens
        ids = jax.device_put(np.stack([s.prompt for s in wl.requests]).astype(np.int32))
        p = int(ids.shape[1])
        lengths = jax.device_put(np.full((batch,), p, np.int32))
        kernels = a.generate_attention

        def call(new: int, thr: float, attention: str):
            out = generate(h.params, cfg, ids, lengths, new, exit_threshold=thr, attention=attention)
            out.tokens.block_until_ready()
            return out

        def timed(thr: float) -> tuple[dict, dict]:
            """Seconds of each kernel's N-token and reference calls, all interleaved; each kernel's
            N-token output."""
            ts, outs = {(k, m): [] for k in kernels for m in (n, ref)}, {}
            for _ in range(max(1, a.generate_reps)):
                for k in kernels:
                    for m in (n, ref):
                        t = time.perf_counter()
                        got = call(m, thr, k)
                        ts[(k, m)].append(time.perf_counter() - t)
                        if m == n:
                            outs[k] = got
            return ts, outs

        ref = reference_tokens(p, n)
        first = {}
        for k in kernels:
            for m in (n, ref):  # compile (the first call of each length and kernel)
                t = time.perf_counter()
                call(m, 1.0, k)
                first[(k, m)] = time.perf_counter() - t
        recs = []
        for kind in exits:
            params = exit_params(kind, n)
            if params.exit_mode == "synthetic":
                continue
            thr = 1.0 if params.exit_mode == "fixed" else params.exit_threshold
            ts, outs = timed(thr)  # the reference's tokens under the same exit rule
            for k in kernels:
                tpot, paired = paired_tpot(ts[(k, n)], ts[(k, ref)], n - ref)
                (tn, tn_all), (tr, tr_all) = ((float(np.median(ts[(k, m)])), ts[(k, m)]) for m in (n, ref))
                depths = np.asarray(outs[k].exit_depths)[:, 1:]
                loops = float(np.mean(depths + 1)) if depths.size else float(cfg.num_loops)
                suffix = "" if k == "auto" else f" attention={k}"
                r = dict(
                    workload="decode",
                    path="generate",
                    variant=f"b={batch} {kind} ctx={context}{suffix}",
                    label=f"decode generate() b={batch} {kind} ctx={context}{suffix}",
                    mode=GENERATE_MODE,
                    chunk=None,
                    exit=kind,
                    attention=k,
                    concurrency=batch,
                    context=context,
                    prompt_len=p,
                    output_tokens_per_request=n,
                    output_tokens=batch * n,
                    wall_s=tn,
                    seconds_all=tn_all,
                    reference_tokens=ref,
                    reference_s=tr,
                    reference_seconds_all=tr_all,
                    compile_s=dict(n_tokens=first[(k, n)] - tn, reference=first[(k, ref)] - tr),
                    output_tok_s=batch * n / tn,
                    tpot_p50_ms=tpot * 1e3,
                    paired_tpot_ms=[x * 1e3 for x in paired],
                    tpot_note="static batch: median over interleaved pairs of (t(N tokens) - t(M tokens)) / (N - M); "
                    "M = reference_tokens, the fewest tokens whose K/V pools have the N-token call's shape",
                    mean_loops_per_token=loops,
                    exit_histogram=dict(
                        counts=np.bincount(depths.reshape(-1), minlength=cfg.num_loops).tolist(),
                        tokens=int(depths.size),
                        mean_loops=loops,
                    ),
                    compilations=0,
                    **_floor_fields(h, batch, p + n / 2, loops, tpot if tpot > 0 else None),
                )
                r.update(_memory())
                if r["tpot_fraction_of_floor"] is not None:
                    r["headline"] = _headline(r)
                recs.append(r)
        return recs


# --------------------------------------------------------------------------- plain-JAX baseline
class PlainDecodeRunner:
    """``plain_jax.time_decode`` at the sweep's shapes (see the module doc), on the harness's weights."""

    def __init__(self, h, a):
        self.h, self.a = h, a

    def run(self, context: int, c: int) -> dict:
        from benchmarks.run import _memory

        h, a, cfg = self.h, self.a, self.h.config
        wl = decode_workload(cfg.vocab_size, c, "fixed", context, a.scale, a.seed, a.output_tokens)
        p, n = wl.requests[0].num_prompt_tokens, wl.requests[0].params.max_tokens
        need = PlainDecoder.cache_bytes(cfg, c, p + n - 1, h.dtype)
        mem = _memory()
        if mem["bytes_limit"] is not None and mem["bytes_in_use"] is not None:
            free = mem["bytes_limit"] - mem["bytes_in_use"]
            if need > 0.95 * free:  # the rest: the step's own buffers
                raise Skip(f"its dense caches need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB of device memory free")
        t = time_decode(cfg, h.params, c, p, n - 1, h.dtype)
        tpot = float(np.median(t["round_ms"]))
        T = cfg.num_loops
        r = dict(
            workload="decode",
            path=PLAIN_MODE,
            variant=f"b={c} ctx={context}",
            label=f"decode plain_jax b={c} ctx={context}",
            mode=PLAIN_MODE,
            chunk=None,
            exit="fixed",
            concurrency=c,
            context=context,
            prompt_len=p,
            output_tokens_per_request=n,
            tpot_p50_ms=tpot,
            tpot_best_ms=t["tpot_ms"],
            round_ms=t["round_ms"],
            dispatch_ms=t["dispatch_ms"],
            tpot_note="median of rounds of n - 1 steps from the prompt length; caches of prompt + n - 1 "
            "positions, not prefilled (a step's time depends on the shapes alone)",
            first_call_s=t["first_call_s"],
            dense_cache_bytes=t["cache_bytes"],
            mean_loops_per_token=float(T),
            compilations=0,
            **_floor_fields(h, c, p + n / 2, T, tpot / 1e3),
        )
        r.update(_memory())
        r["headline"] = _headline(r)
        return r


def attach_baseline(records: list, base: dict) -> list:
    """``baseline_tpot_ms`` and ``engine_over_baseline`` (baseline TPOT / engine TPOT) on the
    fixed-depth engine records of ``base``'s context and c; returns those records."""
    out = []
    for r in records:
        if (
            r.get("path") == "engine"
            and r.get("exit") == "fixed"
            and (r.get("context"), r.get("concurrency")) == (base["context"], base["concurrency"])
            and r.get("tpot_p50_ms")
        ):
            r["baseline_tpot_ms"] = base["tpot_p50_ms"]
            r["engine_over_baseline"] = base["tpot_p50_ms"] / r["tpot_p50_ms"]
            out.append(r)
    return out


# ----------------------------------------------------------------------------------- output
def format_record(r: dict) -> str:
    if "error" in r:
        return f"{r.get('label', ''):40s} ERROR {r['error']}"
    s = (
        f"{r['label']:40s} TPOT p50 {fmt.ms((r.get('tpot_p50_ms') or 0) / 1e3)} ms, floor "
        f"{fmt.ms(r['tpot_floor_ms'] / 1e3)} ms ({fmt.pct(r.get('tpot_fraction_of_floor'))} of floor), "
        f"{r['mean_loops_per_token']:.2f} loops/token"
    )
    if r.get("path") == "engine":
        s += (
            f" | kernels/loop {fmt.num(r.get('kernels_per_loop'))}, device busy {fmt.pct(r.get('device_busy_share'))}"
            f" | first-token spread {fmt.ms(r.get('first_token_spread_s'))} ms | compiles "
            f"{r.get('compilations', 0) + r.get('xla_compilations', 0)}"
        )
    elif r.get("path") == PLAIN_MODE:
        s += f" | first call {r['first_call_s']:.1f} s (compile included)"
    return s


def plot(result: dict, path: str) -> Optional[str]:
    try:
        from benchmarks.report import plot_decode
    except ImportError:
        return None
    try:
        return plot_decode(result, path)
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return None


# ------------------------------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", nargs="+", type=int, default=None, help=f"default {list(DECODE_CONCURRENCY)}")
    ap.add_argument("--exit", nargs="+", default=None, help=f"default {list(DECODE_EXITS)}")
    ap.add_argument(
        "--context", nargs="+", type=int, default=None, help=f"prompt tokens; default {list(DECODE_CONTEXTS)}"
    )
    ap.add_argument("--output-tokens", type=int, default=None, help="tokens out per request (default 128)")
    ap.add_argument("--generate-batch", nargs="*", type=int, default=None, help="default 1 8; none: no generate()")
    ap.add_argument("--generate-context", nargs="*", type=int, default=[1024], help="contexts of the generate() runs")
    ap.add_argument("--generate-reps", type=int, default=None, help="pairs of calls (median; default 5)")
    ap.add_argument(
        "--generate-attention",
        nargs="+",
        default=["auto"],
        choices=ATTENTION,
        help="generate()'s attention kernels (default auto); several: each timed, their calls interleaved in this "
        "process",
    )
    ap.add_argument("--profile-steps", type=int, default=8, help="engine steps under the profiler per config; 0: none")
    ap.add_argument(
        "--host-spans",
        type=int,
        default=0,
        help="the profile also traces the host (PJRT's and XLA's spans) and keeps its N largest spans per launch",
    )
    ap.add_argument(
        "--no-plain-baseline",
        dest="plain_baseline",
        action="store_false",
        help="no plain-JAX decode baseline (benchmarks/plain_jax.py) beside the engine",
    )
    ap.add_argument("--cold", action="store_true", help="no prefix-cache warm-up: prefill runs in the timed batch")
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk of the engine (the warm-up prefill)")
    ap.add_argument("--quick", action="store_true", help="c 1 8 128, 1K context, 32 out, generate() at batch 1")
    ap.add_argument("--time-budget", type=float, default=None, help="no new configuration after this many seconds")
    ap.add_argument("--append", action="store_true", help="add records to an existing decode.json")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies prompt and output lengths")
    ap.add_argument("--count-scale", type=float, default=1.0, help="ignored (suite flag): use --concurrency")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--buckets", nargs="+", type=int, default=None, help="default: see decode_shape")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--compile-cache", default=None)
    ap.add_argument("--attention", default="auto", choices=ATTENTION)
    ap.add_argument("--fused-decode-max-rows", type=int, default=0, help="LLM(fused_decode_max_rows=...)")
    ap.add_argument(
        "--fused-decode-tokens",
        type=int,
        nargs="+",
        default=[1],
        help="tokens per fused decode step; several values: an engine each",
    )
    ap.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="LLM(async_scheduling=False): read every fused step before launching the next",
    )
    ap.add_argument("--quick-ceilings", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    return ap


def _resolve(a) -> None:
    """Defaults (``--quick`` first), then every value checked before anything is built."""
    quick = QUICK if a.quick else {}
    full = dict(
        concurrency=list(DECODE_CONCURRENCY),
        exit=list(DECODE_EXITS),
        context=list(DECODE_CONTEXTS),
        output_tokens=128,
        generate_batch=[1, 8],
        generate_reps=5,
    )
    for k, v in full.items():
        if getattr(a, k) is None:
            setattr(a, k, quick.get(k, v))
    for name in ("concurrency", "context", "generate_batch", "generate_context"):
        bad = [x for x in getattr(a, name) if x < 1]
        if bad:
            raise ValueError(f"--{name.replace('_', '-')} takes positive integers, got {bad}")
    for kind in a.exit:
        exit_params(kind, 2)  # ValueError naming the kind
    if a.output_tokens < 2:
        raise ValueError(f"--output-tokens must be >= 2 (TPOT needs two tokens), got {a.output_tokens}")
    if a.profile_steps < 0 or a.generate_reps < 1 or a.chunk < 1:
        raise ValueError("--profile-steps must be >= 0, --generate-reps and --chunk >= 1")
    if a.time_budget is not None and a.time_budget <= 0:
        raise ValueError(f"--time-budget must be positive, got {a.time_budget}")
    if any(t < 1 for t in a.fused_decode_tokens):
        raise ValueError(f"--fused-decode-tokens takes positive integers, got {a.fused_decode_tokens}")
    # one engine per tokens per step; the harness starts with the first
    a.fused_variants = list(dict.fromkeys(a.fused_decode_tokens))
    a.fused_decode_tokens = a.fused_variants[0]
    a.concurrency = sorted(dict.fromkeys(a.concurrency))
    a.exit = list(dict.fromkeys(a.exit))
    a.context = list(dict.fromkeys(a.context))
    a.generate_attention = list(dict.fromkeys(a.generate_attention))


def profile_fused(h, a, deferred: Sequence) -> None:
    """The profile pass of fused-step records (module doc): per fused-step variant, an engine whose
    fused steps keep their loops out of CUDA graphs runs each record's batch again under the
    profiler (``attach_fused_profile``); past ``--time-budget`` a record's profile says so."""
    from ouro_jax import envs

    for variant in dict.fromkeys(v for _, _, v in deferred):
        if a.time_budget is not None and h.elapsed() + 60.0 > a.time_budget:
            for rec, _, v in deferred:
                if v == variant:
                    rec["profile"] = dict(skipped=f"time budget: {h.elapsed():.0f} s used of {a.time_budget:.0f} s")
            continue
        h.fused_decode_tokens = variant
        runner = EngineRunner(h, a, fused_xla_options=traceable_fused_options(envs.FUSED_XLA_OPTIONS))
        try:
            for rec, wl, v in deferred:
                if v != variant:
                    continue
                tag = f"{wl.concurrency}-{wl.exit}-{rec['context']}"
                try:
                    prof = profile_decode(runner.llm, wl.requests, a.profile_steps, tag, True, a.host_spans)
                    attach_fused_profile(rec, prof)
                    print_host_spans(prof)
                except Exception as e:  # noqa: BLE001 - the timed figures stand without the profile
                    traceback.print_exc()
                    rec["profile"] = dict(error=f"{type(e).__name__}: {e}"[:2000])
                print(
                    f"  profile {rec['label']}: {fmt.num(rec.get('kernels_per_loop'))} kernels/loop, "
                    f"device busy {fmt.pct(rec.get('device_busy_share'))} of the timed TPOT",
                    flush=True,
                )
        finally:
            runner.close()


def main(argv: Optional[Sequence[str]] = None, harness=None) -> dict:
    import jax

    from benchmarks.run import harness_from_args, save_json

    a = parser().parse_args(argv)
    try:
        _resolve(a)
    except ValueError as e:
        raise SystemExit(f"benchmarks.decode: {e}") from None
    os.makedirs(a.out, exist_ok=True)
    # as the suite does: the KV pool of 128 streams at 1K (and of 32 at 4K) needs more than JAX's
    # default 75% of the device memory; only read when the backend starts, so before the harness
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    h = harness or harness_from_args(a, decode_shape(a))
    out_json = os.path.join(a.out, "decode.json")
    prev = None
    if a.append and os.path.exists(out_json):
        with open(out_json) as f:
            prev = json.load(f)
    print(
        f"{h.device}: ceilings {h.peak / 1e12:.0f} TFLOP/s, {h.bw / 1e12:.2f} TB/s; shape {h.shape}; "
        f"c {a.concurrency}, exits {a.exit}, contexts {a.context}, {a.output_tokens} out",
        flush=True,
    )
    records, skipped, startups = [], [], []
    gen_batches = a.generate_batch or []

    def save() -> dict:
        res = dict(
            benchmark="decode",
            workload="decode",
            device=h.device,
            jax_version=jax.__version__,
            backend=jax.default_backend(),
            config=dict(
                h.describe(),
                argv=sys.argv[1:] if argv is None else list(argv),
                concurrency=a.concurrency,
                exits=a.exit,
                contexts=a.context,
                output_tokens=a.output_tokens,
                scale=a.scale,
                seed=a.seed,
                chunk=min(a.chunk, h.shape.max_num_batched_tokens),
                prefix_warm=not a.cold,
                profile_steps=a.profile_steps,
                generate_batch=gen_batches,
                plain_baseline=a.plain_baseline,
                fused_variants=list(a.fused_variants) if a.fused_decode_max_rows else [],
                generate_context=a.generate_context,
                generate_attention=a.generate_attention,
                generate_reps=a.generate_reps,
                time_budget_s=a.time_budget,
                context_note="context = prompt tokens (4K: 4096-token prompts); the floor is priced at the "
                "mean context of the decode steps, prompt + output / 2",
            ),
            ceilings=h.ceilings,
            startup=(prev or {}).get("startup", []) + startups,
            **merge_lists((prev or {}).get("records", []), (prev or {}).get("skipped", []), records, skipped),
        )
        save_json(res, out_json)
        return res

    plan = []
    variants = a.fused_variants if a.fused_decode_max_rows else a.fused_variants[:1]
    for ctx in a.context:
        plan += [("engine", ctx, c, kind, v) for v in variants for c in a.concurrency for kind in a.exit]
        if a.plain_baseline and "fixed" in a.exit:  # beside the fixed-depth records, the engine closed
            plan += [(PLAIN_MODE, ctx, c, "fixed", None) for c in a.concurrency]
        if ctx in a.generate_context:
            plan += [("generate", ctx, b, None, None) for b in gen_batches]
    estimates: dict = {}
    deferred: list = []  # (record, workload, fused-step variant) of fused steps profiled at the end
    engine: Optional[EngineRunner] = None
    gen, plain = GenerateRunner(h, a), PlainDecodeRunner(h, a)
    try:
        for kind, ctx, c, exit_kind, variant in plan:
            if variant is not None and variant != h.fused_decode_tokens:
                if engine is not None:  # the next fused-step variant: an engine of its own
                    engine.close()
                    engine = None
                h.fused_decode_tokens = variant
            label = dict(
                engine=f"decode c={c} {exit_kind} ctx={ctx}{h.label_suffix}",
                generate=f"decode generate() b={c} ctx={ctx}",
            ).get(kind, f"decode plain_jax b={c} ctx={ctx}")
            mode = dict(engine=MODE, generate=GENERATE_MODE).get(kind, PLAIN_MODE)
            expect = float(np.mean(estimates.get(kind) or [ESTIMATE_S[kind]]))
            if kind == "engine" and engine is None and not h._executables:
                expect += 60.0  # start-up (compilation) of the engine
            if a.time_budget is not None and h.elapsed() + expect > a.time_budget:
                reason = f"time budget: {h.elapsed():.0f} s used + ~{expect:.0f} s expected > {a.time_budget:.0f} s"
                skipped.append(dict(label=label, mode=mode, chunk=None, reason=reason))
                print(f"skip {label}: {reason}", flush=True)
                continue
            if kind != "engine" and engine is not None:  # the engine's KV pool would leave the others no room
                engine.close()
                engine = None
            t = time.monotonic()
            try:
                if kind == "engine":
                    if engine is None:
                        engine = EngineRunner(h, a)
                        startups.append(engine.startup)
                    wl = decode_workload(h.config.vocab_size, c, exit_kind, ctx, a.scale, a.seed, a.output_tokens)
                    recs = [engine.run(wl, ctx)]
                    if a.profile_steps and engine.defers_profile:
                        deferred.append((recs[0], wl, h.fused_decode_tokens))
                elif kind == PLAIN_MODE:
                    recs = [plain.run(ctx, c)]
                else:
                    recs = gen.run(ctx, c, a.exit)
            except Skip as e:
                skipped.append(dict(label=label, mode=mode, chunk=engine.chunk if engine else None, reason=str(e)))
                print(f"skip {label}: {e}", flush=True)
                save()
                continue
            except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others
                traceback.print_exc()
                recs = [
                    dict(
                        workload="decode",
                        path=kind,
                        label=label,
                        mode=mode,
                        chunk=None,
                        concurrency=c,
                        exit=exit_kind,
                        context=ctx,
                        error=f"{type(e).__name__}: {e}"[:2000],
                    )
                ]
            dt = time.monotonic() - t
            estimates.setdefault(kind, []).append(dt / max(1, len(recs)) if kind == "engine" else dt)
            for r in recs:
                r["config_s"] = dt / len(recs)
                records.append(r)
                print(format_record(r), flush=True)
                if r.get("path") == PLAIN_MODE and "error" not in r:
                    for e in attach_baseline(records, r):
                        print(f"  engine / plain JAX: {e['engine_over_baseline']:.2f}x ({e['label']})", flush=True)
            save()
        if deferred:
            if engine is not None:  # one KV pool at a time
                engine.close()
                engine = None
            profile_fused(h, a, deferred)
            save()
    except KeyboardInterrupt:  # a suite's time limit: every finished record is already saved
        print("interrupted: records so far are saved", flush=True)
    finally:
        if engine is not None:
            engine.close()
    res = save()
    if not a.no_plot:
        p = plot(res, os.path.join(a.out, "decode.png"))
        if p:
            print(f"benchmarks.decode: wrote {p}", flush=True)
    print(f"benchmarks.decode: wrote {out_json} ({len(res['records'])} records, {len(res['skipped'])} skipped)")
    return res


if __name__ == "__main__":
    main()
