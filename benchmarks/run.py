"""One harness for every standard workload: figures next to their floors, JSON after every record.

    python -m benchmarks.run --workload long4 [--mode split mixed wavefront] [--chunk 16 32 64 128]
        [--preset ouro-1.4b] [--out benchmarks/results] [--scale S] [--time-budget SECONDS]
    python -m benchmarks.run --workload serve1k long4 mixed32 --scale 0.05 --preset tiny ...
    python -m benchmarks.run --suite h200-core [--time-budget SECONDS] ...   (benchmarks/suite.py)

For every workload variant (``benchmarks/workloads.py``) and every (mode, chunk) of the sweep, an
``LLM`` is built over the same random weights (``init_params(cfg, 0, dtype)``, created once) with the
same executable shapes: one ``EngineShape`` (max_num_seqs, max_num_batched_tokens, max_model_len,
block size, buckets) and a fixed ring (``EngineShape.num_ring_rows``: wavefront's at the largest
chunk). The first engine of a process compiles every bucket (or loads it from the persistent compilation cache that
``--compile-cache`` names); later engines of the process take the same executables (identical
shapes: the prefill mode and chunk size only change what the host schedules). Start-up is reported
(compile time, executables, XLA compiles, persistent-cache hits), never timed with the run.

Requests go in through ``add_request`` / ``step`` so that arrivals are timestamped where they happen:
all at t=0, a closed loop (serve1k: a new request when one finishes), or triggered by the progress
of background streams (decode_under_prefill). Every executed descriptor is priced by
``metrics.ScheduleRecorder``, which gives the floor of the schedule actually run.

Each record holds prompt / output tok/s, TTFT / ITL / TPOT / E2E p50 / p90 / p99 (and CDF points),
request throughput, rows per invocation, invocations per second, host scheduling time per
invocation, device wait, peak device memory, compilations during the run (must be 0), the exit-depth
histogram, and ``fraction_of_floor`` with the floor named (``bandwidth`` / ``flops``). Static-batch
``ouro_jax.generate`` baselines (mode ``"generate()"``) run on the same batch where one applies
(serve1k with exactly c requests, long4). ``--time-budget`` stops starting new configurations once
the process has used that many seconds (start-up included).

The plain-JAX one-shot prefill (``plain_jax.time_prefill``, issue 37; ``--no-plain-baseline`` skips
it) runs on the same prompts and weights after a workload's engine configurations, where the
workload has one (long4: ``Workload.plain_prefill_baseline``): a record of mode ``"plain_jax"``
(best of 3 calls after a first, compiling one), and on every engine record of the run
``baseline_prompt_tok_s``, ``baseline_wall_s`` and ``engine_over_baseline`` (the engine's prompt
tok/s until the last first token / the baseline's: above 1, the engine is faster). It runs between
engines, so no KV pool is resident beside its K/V (25 GB at 4 x 8064).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import gc
import json
import os
import sys
import time
import traceback
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import ceilings as ceilings_mod
from benchmarks import fmt
from benchmarks.floors import decode_step_floor, generate_floor, prefill_floor
from benchmarks.merge_results import merge_lists
from benchmarks.metrics import ScheduleRecorder, exit_histogram, floor_of, latency, mean_decoding_streams
from benchmarks.plain_jax import PLAIN_MODE, time_prefill
from benchmarks.profile_step import profile_engine_window
from benchmarks.workloads import (
    CHUNKS,
    EXIT_WORKLOADS,
    MODES,
    WORKLOADS,
    EngineShape,
    Workload,
    exit_mean_loops,
    make,
    shape_from_args,
    suite_shape,
)
from ouro_jax import LLM, envs, get_preset
from ouro_jax.engine_config import EngineConfig
from ouro_jax.model import init_params
from ouro_jax.runner import SamplerKey, packed_shape
from pallas_kernels.choices import ATTENTION
from scheduler import BucketKey, SamplingParams

__all__ = ["Harness", "drive", "DriveResult", "main", "save_json", "CompileEvents"]

GENERATE_MODE = "generate()"
PLAIN_PREFILL_ESTIMATE_S = 60.0  # a plain-JAX prefill baseline before one has run (time budget): its compile


# ------------------------------------------------------------------------------- settings
# variables that change what a process measures without entering the engine's config: JAX's
# allocator and memory fraction, XLA's flags (docs/decisions.md, "Processes of `generate()` b=8 fall
# into two speed states")
SETTINGS_PREFIXES = ("XLA_", "JAX_", "TF_GPU_", envs.PREFIX, "CUDA_")


def settings_environment(env=None) -> dict:
    """The set variables of ``SETTINGS_PREFIXES`` (default ``os.environ``), sorted: what a record's
    figures were measured under."""
    env = os.environ if env is None else env
    return {k: env[k] for k in sorted(env) if k.startswith(SETTINGS_PREFIXES)}


# ------------------------------------------------------------------------------- compile events
class CompileEvents:
    """Process-wide counts of compile requests (XLA compilations and persistent-cache loads: the
    backend-compile event wraps both) and persistent-cache hits (``jax.monitoring``)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            self = super().__new__(cls)
            self.compiles, self.compile_s, self.cache_hits = 0, 0.0, 0
            jax.monitoring.register_event_duration_secs_listener(self._duration)
            jax.monitoring.register_event_listener(self._event)
            cls._instance = self
        return cls._instance

    def _duration(self, event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            self.compiles += 1
            self.compile_s += secs

    def _event(self, event, **kw):
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    def snapshot(self) -> tuple:
        return self.compiles, self.compile_s, self.cache_hits


def _memory() -> dict:
    try:
        st = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        st = {}
    return dict(
        peak_bytes_in_use=st.get("peak_bytes_in_use"),
        bytes_in_use=st.get("bytes_in_use"),
        bytes_limit=st.get("bytes_limit"),
    )


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return str(o)


def save_json(obj, path: str) -> None:
    """Atomic write: a run cut short never leaves half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def _delta(a: dict, b: dict) -> dict:
    out = {}
    for k, v in b.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)) and isinstance(a.get(k, 0), (int, float)):
            out[k] = v - a.get(k, 0)
        elif isinstance(v, dict):
            prev = a.get(k) or {}
            d = {kk: vv - prev.get(kk, 0) for kk, vv in v.items() if isinstance(vv, (int, float))}
            out[k] = {kk: vv for kk, vv in d.items() if vv}
    return out


# ----------------------------------------------------------------------------------- the driver
@dataclasses.dataclass
class DriveResult:
    outputs: dict  # request id -> the last output seen
    specs: dict  # request id -> RequestSpec
    t0: float  # time.monotonic() before the first submission
    t_end: float
    steps: int
    first_token_step: dict  # request id -> invocations done when its first token came back
    submitted: list
    truncated: bool = False
    aborted: list = dataclasses.field(default_factory=list)
    step_s: float = 0.0  # time inside engine.step() (scheduling, dispatch, result handling, outputs)
    # request id -> prompt tokens' worth of loops it had run when it was aborted (see ``prompt_work``)
    prompt_progress: dict = dataclasses.field(default_factory=dict)


def prompt_work(engine, request_id) -> float:
    """Prompt tokens' worth of loops an unfinished request has run: the mean over depths of its
    prefill frontiers (a prompt half way through every loop counts half). Requests aborted before
    their first token (``decode_under_prefill`` stops with long prompts unfinished) still did this
    much prompt work, which counting only prompts that got a token would miss."""
    req = engine.scheduler.get_request(request_id)
    if req is None or req.prefill_len <= 0:
        return 0.0
    f = req.prefill_depth_frontiers
    if not f:  # waiting (or preempted): nothing resident
        return 0.0
    return float(min(sum(f) / len(f), req.prefill_len))


def drive(engine, wl: Workload, *, deadline: Optional[float] = None, bar=None, sync=None) -> DriveResult:
    """Submit ``wl``'s requests as its arrival process says, step the engine until done.

    ``engine`` has ``add_request(prompt, params, request_id=)``, ``step()`` (outputs with
    ``request_id``, ``token_ids``, ``finished``), ``has_unfinished()`` and ``abort(id)``: an ``LLM``
    or the scheduler-only ``sweep_buckets.SimEngine``. ``deadline`` (monotonic) aborts what is left.
    """
    reqs = wl.requests
    rid = [f"{r.tag}-{i}" for i, r in enumerate(reqs)]
    specs = {rid[i]: r for i, r in enumerate(reqs)}
    outputs, first, done, submitted = {}, {}, set(), []
    closed = collections.deque()
    triggered = collections.deque()
    if wl.arrival == "batch":
        initial = list(range(len(reqs)))
    elif wl.arrival == "closed_loop":
        c = wl.concurrency or len(reqs)
        initial, closed = list(range(min(c, len(reqs)))), collections.deque(range(c, len(reqs)))
    elif wl.arrival == "triggered":
        initial = [i for i, r in enumerate(reqs) if r.after_tokens is None]
        triggered = collections.deque(
            sorted((i for i, r in enumerate(reqs) if r.after_tokens is not None), key=lambda i: reqs[i].after_tokens)
        )
    else:
        raise ValueError(f"unknown arrival process {wl.arrival!r}")
    background = [rid[i] for i, r in enumerate(reqs) if wl.background_tag and r.tag == wl.background_tag]

    def submit(i):
        engine.add_request(reqs[i].prompt, reqs[i].params, request_id=rid[i])
        if reqs[i].reserve_tokens is not None:  # eos512: reserve KV as if max_tokens were this
            engine.scheduler.get_request(rid[i]).reserve_max_tokens = reqs[i].reserve_tokens
        submitted.append(rid[i])

    t0 = time.monotonic()
    for i in initial:
        submit(i)
    steps, truncated, aborted, step_s = 0, False, [], 0.0
    progress_at_abort: dict = {}
    while True:
        if not engine.has_unfinished():
            if closed:
                submit(closed.popleft())
                continue
            if triggered:
                submit(triggered.popleft())
                continue
            break
        ts = time.perf_counter()
        outs = engine.step()
        step_s += time.perf_counter() - ts
        steps += 1
        for o in outs:
            r = o.request_id
            outputs[r] = o
            if r not in first and len(o.token_ids):
                first[r] = steps
            if o.finished and r not in done:
                done.add(r)
                if bar is not None:
                    bar.update(1)
                if closed:
                    submit(closed.popleft())
        if background and (triggered or wl.stop_when_background_done):
            progress = min(len(outputs[r].token_ids) if r in outputs else 0 for r in background)
            while triggered and progress >= reqs[triggered[0]].after_tokens:
                submit(triggered.popleft())
            if wl.stop_when_background_done and all(r in done for r in background):
                aborted = [r for r in submitted if r not in done]
                progress_at_abort = {r: prompt_work(engine, r) for r in aborted}
                for r in aborted:
                    engine.abort(r)
                triggered.clear()
                break
        if deadline is not None and steps % 4 == 0 and time.monotonic() > deadline:
            aborted = [r for r in submitted if r not in done]
            progress_at_abort = {r: prompt_work(engine, r) for r in aborted}
            for r in aborted:
                engine.abort(r)
            truncated = True
            break
    if sync is not None:
        sync()
    return DriveResult(
        outputs, specs, t0, time.monotonic(), steps, first, submitted, truncated, aborted, step_s, progress_at_abort
    )


def profile_workload(llm, wl: Workload) -> dict:
    """``wl`` driven to its end once more under the profiler (prefix caching off by default: the
    same work as the timed run): the engine's kernels and device-busy time a loop, and where the
    device waits between them (``gap_sites``; run 36's ~150 us after each prompt step's descriptor
    copy was read off such a trace)."""

    def window() -> float:
        t = time.perf_counter()
        drive(llm, wl, sync=llm.runner.synchronize)
        return time.perf_counter() - t

    return profile_engine_window(llm, window)


def requests_that_fit(blocks_needed: list[int], pool_blocks: int) -> int:
    """How many requests of whole size ``blocks_needed`` (every plane) a pool of ``pool_blocks``
    holds at once, the largest first: the count a workload of mixed sizes can rely on (a few long
    prompts beside many short streams must not read as a few requests of the long size)."""
    held, used = 0, 0
    for n in sorted(blocks_needed, reverse=True):
        if used + n > pool_blocks:
            break
        held, used = held + 1, used + n
    return held


def _kv_fields(wl: Workload, res: DriveResult, s1: dict, stats: dict) -> dict:
    """KV allocation and prefix-cache figures of one run (issue 16's eos512 and shared_prefix)."""
    submitted_prompt = sum(res.specs[r].num_prompt_tokens for r in res.submitted)
    hit = stats.get("prefix_cache_hit_tokens", 0)
    return dict(
        engine_options=dict(wl.engine_kw),
        kv_allocation=s1.get("kv_allocation"),
        prefix_caching=s1.get("prefix_caching"),
        max_running=s1.get("max_running"),  # the largest number of requests running at once
        preemptions=stats.get("preemptions", 0),
        prefix_cache_hit_tokens=hit,
        prefix_cache_queried_tokens=stats.get("prefix_cache_queried_tokens", 0),
        prompt_work_skipped_share=hit / max(1, submitted_prompt),
        stop_rule=(
            "per-request max_tokens (finish 'length'), KV reserved as for max_tokens="
            f"{max(s.reserve_tokens for s in wl.requests)}"
            if any(s.reserve_tokens is not None for s in wl.requests)
            else None
        ),
    )


# ---------------------------------------------------------------------------------- the harness


def _is_fused(k) -> bool:
    """A fused decode step's executable key ``(BucketKey, n)``."""
    return isinstance(k, tuple) and len(k) == 2 and isinstance(k[0], BucketKey)


def _key_label(k) -> str:
    """An executable key as the start-up record names it: ``"128"``, ``"1024 long"`` (a long-segment
    variant), ``"fused 8x4"``, ``"sampler 8"``."""
    if isinstance(k, BucketKey):
        return f"{k.R} long" if k.M > 1 else str(k.R)
    if isinstance(k, SamplerKey):
        return f"sampler {k.C}"
    return f"fused {k[0].R}x{k[1]}" if _is_fused(k) else str(k)


class Harness:
    """Random weights, ceilings and executables shared by every engine of one process."""

    def __init__(
        self,
        preset: str = "ouro-1.4b",
        dtype: Optional[str] = None,
        shape: Optional[EngineShape] = None,
        compile_cache_dir: Optional[str] = None,
        attention: str = "auto",
        gpu_memory_utilization: float = 0.9,
        kv_cache_bytes: Optional[int] = None,
        quick_ceilings: bool = False,
        progress: bool = True,
        warmup_requests: int = 1,
        seed: int = 0,
        fused_decode_max_rows: int = 0,
        fused_decode_tokens: int = 1,
        async_scheduling: bool = True,
    ):
        self.t_start = time.monotonic()
        # fused decode steps (scheduler): records of such engines carry a label suffix, so that
        # they sit next to the loop-by-loop records of the same workload instead of replacing them
        self.fused_decode_max_rows, self.fused_decode_tokens = fused_decode_max_rows, fused_decode_tokens
        self.async_scheduling = async_scheduling
        # before anything compiles; None: the config's default (its variable, else the home cache)
        LLM.enable_compile_cache(EngineConfig(compile_cache_dir=compile_cache_dir).cache_dir())
        self.events = CompileEvents()
        self.preset = preset
        self.config = get_preset(preset)
        self.dtype = dtype or self.config.torch_dtype
        self.shape = shape or suite_shape()
        if self.shape.max_model_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.shape.max_model_len} (the longest request of the suite at this "
                f"scale) exceeds {preset}'s max_position_embeddings "
                f"{self.config.max_position_embeddings}: lower --scale or --max-model-len"
            )
        self.attention = attention
        self.gpu_memory_utilization, self.kv_cache_bytes = gpu_memory_utilization, kv_cache_bytes
        self.compile_cache_dir = compile_cache_dir
        self.progress, self.warmup_requests = progress, warmup_requests
        t = time.perf_counter()
        self.ceilings = ceilings_mod.measure(quick_ceilings)
        self.ceilings_s = time.perf_counter() - t
        t = time.perf_counter()
        self.params = init_params(self.config, seed, self.dtype)
        jax.block_until_ready(self.params)
        self.params_s = time.perf_counter() - t
        self._executables: dict[tuple, dict] = {}
        self.startups: list[dict] = []
        self.device = str(self.ceilings.get("device") or jax.devices()[0].device_kind)

    @property
    def bw(self) -> float:
        return float(self.ceilings["bandwidth"])

    @property
    def peak(self) -> float:
        return float(self.ceilings["peak_flops"])

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    @property
    def label_suffix(self) -> str:
        """Records of fused-step engines carry a suffix (``" fused<rows>x<tokens>"``, then ``" sync"``
        without asynchronous scheduling: only fused steps are launched ahead), so that they sit next
        to the loop-by-loop records of the same workload instead of replacing them."""
        if not self.fused_decode_max_rows:
            return ""
        out = f" fused{self.fused_decode_max_rows}x{self.fused_decode_tokens}"
        return out + ("" if self.async_scheduling else " sync")

    def describe(self) -> dict:
        return dict(
            preset=self.preset,
            dtype=self.dtype,
            model=self.config.to_dict(),
            engine_shape=self.shape.to_dict(),
            attention=self.attention,
            fused_decode_max_rows=self.fused_decode_max_rows,
            fused_decode_tokens=self.fused_decode_tokens,
            async_scheduling=self.async_scheduling,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_bytes=self.kv_cache_bytes,
            compile_cache_dir=self.compile_cache_dir,
            warmup_requests=self.warmup_requests,
            params_init_s=self.params_s,
            ceilings_s=self.ceilings_s,
            executables_note="engines of one process with identical shapes share executables; the first "
            "compiles them or loads them from the persistent compilation cache",
            environment=settings_environment(),
        )

    # ------------------------------------------------------------------------------ engines
    def engine(self, mode: str, chunk: int, chunks: Sequence[int] = (), **engine_kw) -> tuple[LLM, dict]:
        """``engine_kw``: options that do not change executable shapes (kv_allocation, prefix caching)."""
        sh, c = self.shape, self.config
        t = time.perf_counter()
        llm = LLM(
            c,
            params=self.params,
            max_num_seqs=sh.max_num_seqs,
            max_num_batched_tokens=sh.max_num_batched_tokens,
            prefill_chunk_size=chunk,
            block_size=sh.block_size,
            max_model_len=sh.max_model_len,
            prefill_mode=mode,
            buckets=sh.buckets,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_bytes=self.kv_cache_bytes,
            attention=self.attention,
            compile_cache_dir=self.compile_cache_dir,
            num_ring_rows=sh.num_ring_rows(c.num_loops, chunks),
            fused_decode_max_rows=self.fused_decode_max_rows,
            fused_decode_tokens=self.fused_decode_tokens,
            async_scheduling=self.async_scheduling,
            warmup=False,
            progress=False,
            **engine_kw,
        )
        construct_s = time.perf_counter() - t
        r = llm.runner
        keys = llm.executable_keys()
        sig = (
            tuple(r.k_pool.shape),
            str(r.k_pool.dtype),
            tuple(r.ring.shape),
            tuple(keys),
            r.attention,
            r.dtype_name,
            # the executables' XLA options (a profile engine's fused steps differ in these alone)
            r.engine.fused_xla_options,
            r.engine.step_xla_options,
        )
        ev0 = self.events.snapshot()
        t = time.perf_counter()
        if sig in self._executables:
            r.adopt(self._executables[sig])  # same shapes: the same executables
            source = "shared in-process"
        else:
            r.warmup(keys, self.progress)
            # a descriptor uploaded with jnp.asarray (benchmarks do) runs, in jax 0.11.2, a tiny
            # jitted `stage` computation compiled once per array size: warm it for every bucket here so
            # that the first timed run of a process does not count those compiles.
            for k in keys:
                jnp.asarray(np.zeros(packed_shape(k), np.int32)).block_until_ready()
            self._executables[sig] = r.executables()
            ev1 = self.events.snapshot()
            hits, compiles = ev1[2] - ev0[2], (ev1[0] - ev0[0]) - (ev1[2] - ev0[2])
            source = (
                "persistent cache"
                if hits and not compiles
                else "compiled"
                if not hits
                else "compiled + persistent cache"
            )
        warm_s = time.perf_counter() - t
        ev1 = self.events.snapshot()
        st = dict(
            mode=mode,
            chunk=chunk,
            source=source,
            executables=len(keys),
            construct_s=construct_s,
            warmup_s=warm_s,
            xla_compiles=(ev1[0] - ev0[0]) - (ev1[2] - ev0[2]),
            xla_compile_requests_s=ev1[1] - ev0[1],
            persistent_cache_hits=ev1[2] - ev0[2],
            runner_compile_time_s=r.compile_time,
            per_bucket_s={_key_label(k): v for k, v in r.compile_times.items()},
            kv_blocks=r.num_blocks,
            kv_cache_bytes=r.kv_bytes,
            ring_rows=r.num_ring_rows,
            buckets=[k.R for k in keys if isinstance(k, BucketKey) and k.M == 1],
            long_segment_variants=[k.R for k in keys if isinstance(k, BucketKey) and k.M > 1],
            fused_steps=[[k[0].R, k[1]] for k in keys if _is_fused(k)],
            samplers=[k.C for k in keys if isinstance(k, SamplerKey)],
            elapsed_s=self.elapsed(),
        )
        self.startups.append(st)
        return llm, st

    def _warm(self, llm: LLM, chunk: int) -> None:
        """A short request through prefill and decode: first-launch costs stay out of the timing."""
        n = max(1, min(2 * chunk, self.shape.max_model_len // 2))
        rng = np.random.default_rng(12345)
        for i in range(self.warmup_requests):
            ids = rng.integers(1, self.config.vocab_size, n)
            llm.add_request(ids, SamplingParams(max_tokens=2, ignore_eos=True), request_id=f"warmup-{i}")
        while llm.has_unfinished():
            llm.step()

    # -------------------------------------------------------------------------------- runs
    def tpot_floor_s(self, wl: Workload) -> float:
        """The decode-step floor of ``wl``'s background streams (all of them decoding, mid-output):
        what ``--target-tpot-floor-multiple`` multiplies, known before the run."""
        specs = [s for s in wl.requests if wl.background_tag is None or s.tag == wl.background_tag]
        ctx = float(np.mean([s.num_prompt_tokens + s.params.max_tokens / 2 for s in specs]))
        loops = exit_mean_loops(wl.exit, self.config.num_loops)
        if loops is None:  # main() refuses floor multiples for such exits before any work
            raise ValueError(f"{wl.label}: exit {wl.exit!r} has no decode floor before the run")
        return decode_step_floor(self.config, wl.concurrency or len(specs), ctx, loops, self.bw, self.peak)["floor_s"]

    def run(
        self,
        wl: Workload,
        mode: str,
        chunk: int,
        chunks: Sequence[int] = (),
        timeout: Optional[float] = None,
        target: Optional[tuple] = None,
        profile: bool = False,
    ) -> dict:
        """``timeout``: seconds the measured run may take; it starts after the engine's start-up
        (compilation) and warm-up request, which a configuration must not be charged for.
        ``target``: a decode TPOT target, ``("ms", x)`` or ``("floor", multiple)`` (``target_fields``).
        ``profile``: the workload driven once more under the profiler, after the timed run and
        outside its figures (``profile_step.profile_engine_window``: the record's ``profile``)."""
        tf = target_fields(self, wl, target)
        kw = dict(wl.engine_kw, **({"target_tpot_ms": tf["target_tpot_ms"]} if target else {}))
        llm, st = self.engine(mode, chunk, chunks, **kw)
        try:
            rec = ScheduleRecorder(self.config, np.dtype(llm.runner.dtype).itemsize).attach(llm.runner)
            rec.enabled = False
            self._warm(llm, chunk)
            if wl.warm_prompts:  # e.g. the shared prefix, as a server that served it before has it
                llm.generate(list(wl.warm_prompts), SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            rec.enabled = True
            s0, ev0, mem0 = llm.stats(), self.events.snapshot(), _memory()
            bar = None
            if self.progress:
                from tqdm.auto import tqdm

                bar = tqdm(
                    total=len(wl.requests),
                    desc=f"{wl.label} {mode} c{chunk}",
                    unit="req",
                    mininterval=0.5 if sys.stderr.isatty() else 10.0,
                    file=sys.stderr,
                )
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                res = drive(llm, wl, deadline=deadline, bar=bar, sync=llm.runner.synchronize)
            finally:
                if bar is not None:
                    bar.close()
            s1, ev1 = llm.stats(), self.events.snapshot()
            stats = _delta(s0, s1)
            rec_out = self._record(wl, mode, chunk, res, rec, stats, ev1[0] - ev0[0], st)
            rec_out.update(tf, label=rec_out["label"] + target_suffix(tf))
            rec_out.update(_memory())
            rec_out["bytes_in_use_before"] = mem0.get("bytes_in_use")
            rec_out["kv_blocks"], rec_out["kv_cache_bytes"] = s1["kv_blocks"], s1["kv_cache_bytes"]
            # the TPOT target's state at the end (cost model coefficients, capped / relaxed / forced counts)
            policy = {k: v for k, v in s1.items() if k.startswith("latency_")}
            if policy:
                rec_out["latency_policy"] = policy
            rec_out.update(_kv_fields(wl, res, s1, stats))
            sc, bm = llm.scheduler_config, llm.scheduler.block_manager
            need = [bm.blocks_needed(s.num_prompt_tokens + s.params.max_tokens - 1) for s in wl.requests]
            rec_out["kv_fit_requests"] = requests_that_fit(need, sc.num_blocks - 1)
            if profile:
                rec_out["profile"] = profile_workload(llm, wl)
            want = wl.concurrency or len(wl.requests)
            if rec_out["kv_fit_requests"] < min(want, sc.max_num_seqs):
                print(
                    f"note: the KV pool holds {rec_out['kv_fit_requests']} of the {want} requests "
                    f"{wl.label} wants at once (the largest first)",
                    flush=True,
                )
            return rec_out
        finally:
            llm.runner.__dict__.pop("execute", None)  # drop the recorder (it closes over the runner)
            del llm
            gc.collect()

    def _record(
        self,
        wl: Workload,
        mode: str,
        chunk: int,
        res: DriveResult,
        rec: ScheduleRecorder,
        stats: dict,
        xla_compiles: int,
        startup: dict,
    ) -> dict:
        c, T = self.config, self.config.num_loops
        outs = list(res.outputs.values())
        with_tokens = [o for o in outs if len(o.token_ids)]
        finished = [o for o in outs if o.finished and o.finish_reason != "abort"]
        wall = max(res.t_end - res.t0, 1e-9)
        n_out = sum(len(o.token_ids) for o in outs)
        n_prompt = sum(res.specs[o.request_id].num_prompt_tokens for o in with_tokens)
        inv = max(1, stats.get("invocations", 0))
        fl = floor_of(rec.total(), self.bw, self.peak)
        hist = exit_histogram(with_tokens, T)
        r = dict(
            workload=wl.name,
            variant=wl.variant,
            label=wl.label + self.label_suffix,
            mode=mode,
            chunk=chunk,
            exit=wl.exit,
            arrival=wl.arrival,
            concurrency=wl.concurrency,
            requests=len(wl.requests),
            requests_submitted=len(res.submitted),
            requests_finished=len(finished),
            truncated=res.truncated,
            aborted=len(res.aborted),
            wall_s=wall,
            prompt_tokens=n_prompt,
            output_tokens=n_out,
            prompt_tok_s=n_prompt / wall,
            output_tok_s=n_out / wall,
            request_throughput=len(finished) / wall,
        )
        r["latency"] = latency(with_tokens)
        tags = sorted({res.specs[o.request_id].tag for o in with_tokens})
        if len(tags) > 1 or wl.background_tag:
            r["latency_by_tag"] = {
                t: latency([o for o in with_tokens if res.specs[o.request_id].tag == t]) for t in tags
            }
            # prompts that got their first token, per tag, over the run (the TPOT-target trade-off plot)
            r["prompt_tok_s_by_tag"] = {
                t: sum(
                    res.specs[o.request_id].num_prompt_tokens for o in with_tokens if res.specs[o.request_id].tag == t
                )
                / wall
                for t in sorted({s.tag for s in res.specs.values()})  # a tag whose prompts got no token: 0
            }
            # prompt work done per tag, whether or not the prompt got its token before the run ended:
            # whole prompts for requests with a token, the loops run so far for aborted ones
            got = {o.request_id for o in with_tokens}
            r["prompt_work_tok_s_by_tag"] = {
                t: sum(
                    spec.num_prompt_tokens if rid in got else res.prompt_progress.get(rid, 0.0)
                    for rid, spec in res.specs.items()
                    if spec.tag == t and rid in res.submitted
                )
                / wall
                for t in sorted({s.tag for s in res.specs.values()})
            }
        real, padded = stats.get("real_rows", 0), stats.get("padded_rows", 0)
        r.update(
            invocations=stats.get("invocations", 0),
            rows_per_invocation=real / inv,
            padded_rows=padded,
            padding_fraction=padded / max(1, real + padded),
            invocations_per_s=stats.get("invocations", 0) / wall,
            time_per_invocation_s=wall / inv,
            host_time_per_invocation_s=stats.get("host_time_s", 0.0) / inv,
            # launches: executables run (a fused decode step is one launch of many invocations)
            launches=stats.get("launches", 0),
            fused_launches=stats.get("fused_launches", 0),
            host_time_per_launch_s=stats.get("host_time_s", 0.0) / max(1, stats.get("launches", 0)),
            schedule_time_per_invocation_s=stats.get("schedule_time_s", 0.0) / inv,
            update_time_per_invocation_s=stats.get("update_time_s", 0.0) / inv,
            dispatch_time_per_invocation_s=stats.get("dispatch_time_s", 0.0) / inv,
            upload_time_per_invocation_s=stats.get("upload_time_s", 0.0) / inv,
            call_time_per_invocation_s=stats.get("call_time_s", 0.0) / inv,
            device_wait_time_s=stats.get("device_wait_time_s", 0.0),
            device_wait_per_invocation_s=stats.get("device_wait_time_s", 0.0) / inv,
            step_time_per_invocation_s=res.step_s / inv,
            # inside LLM.step but neither scheduling nor dispatch: building RequestOutputs, bookkeeping
            step_other_per_invocation_s=(
                res.step_s
                - stats.get("schedule_time_s", 0.0)
                - stats.get("update_time_s", 0.0)
                - stats.get("dispatch_time_s", 0.0)
            )
            / inv,
            driver_per_invocation_s=(wall - res.step_s) / inv,  # arrivals, progress bar, this harness
            row_buckets_used=stats.get("row_buckets_used", {}),
            decode_rows=stats.get("decode_rows", 0),
            prefill_rows=stats.get("prefill_rows", 0),
            finalize_pairs=stats.get("finalize_pairs", 0),
            compilations=stats.get("compilations", 0),
            xla_compilations=xla_compiles,
            exit_histogram=hist,
            floor=fl,
            fraction_of_floor=fl["floor_s"] / wall,
            floor_bound=fl["bound"],
            floor_per_invocation_s=fl["floor_s"] / inv,
        )
        # prefill span: every request arrived at t=0; until the last first token
        span = None
        if wl.arrival == "batch" and with_tokens and len(res.first_token_step) == len(wl.requests):
            t_last = max(o.metrics.first_token_time for o in with_tokens)
            k = max(res.first_token_step.values())
            sfl = floor_of(rec.total(upto=k), self.bw, self.peak)
            span = _span(max(t_last - res.t0, 1e-9), k, n_prompt, sfl)
            if len({sp.num_prompt_tokens for sp in res.specs.values()}) == 1:
                # the closed form of floors.py at the rows per invocation this schedule achieved
                p0 = next(iter(res.specs.values())).num_prompt_tokens
                rpi = rec.total(upto=k).rows / max(1, k)
                cf = prefill_floor(c, len(wl.requests), p0, chunk, max(1, round(rpi)), self.bw, self.peak)
                span["closed_form_floor"] = dict(
                    cf, rows_per_invocation=rpi, floor_prompt_tok_s=n_prompt / cf["floor_s"]
                )
        elif wl.arrival == "batch":  # truncated: prompt-token loops run / T over the whole run
            span = _span(wall, inv, stats.get("prefill_rows", 0) / T, fl, partial=True)
        r["prefill_span"] = span
        # decode: the floor of one step of the decoding batch at its mean context and loops
        tag = wl.background_tag
        dec_outs = [o for o in with_tokens if tag is None or res.specs[o.request_id].tag == tag]
        batch = wl.concurrency or (len([s for s in res.specs.values() if s.tag == tag]) if tag else len(wl.requests))
        batch_from = "concurrency" if wl.concurrency else ("tagged streams" if tag else "requests")
        if wl.arrival == "batch" and dec_outs:
            # all requests arrive at once but reach decode one after another: price the step at the
            # streams that really decode together (time average), not at all of them
            m = mean_decoding_streams(dec_outs)
            if m:
                batch, batch_from = max(1, round(m)), f"mean decoding streams ({m:.1f})"
        if dec_outs:
            specs = [res.specs[o.request_id] for o in dec_outs]
            ctx = float(np.mean([s.num_prompt_tokens + s.params.max_tokens / 2 for s in specs]))
            loops = exit_histogram(dec_outs, T)["mean_loops"]
            dfl = decode_step_floor(c, batch, ctx, loops, self.bw, self.peak)
            tp = (r.get("latency_by_tag", {}).get(tag) or r["latency"]) if tag else r["latency"]
            tpot = (tp.get("tpot") or {}).get("p50")
            r["tpot_floor"] = dict(
                floor_s=dfl["floor_s"], bound=dfl["bound"], batch=batch, batch_from=batch_from, context=ctx, loops=loops
            )
            r["tpot_fraction_of_floor"] = dfl["floor_s"] / tpot if tpot else None
        r["headline"] = self._headline(wl, r)
        r["startup"] = startup
        return r

    @staticmethod
    def _headline(wl: Workload, r: dict) -> dict:
        span = r.get("prefill_span")
        if wl.arrival == "batch" and span:
            return dict(
                metric="prompt tok/s",
                value=span["prompt_tok_s"],
                floor=span["floor_prompt_tok_s"],
                fraction=span["fraction_of_floor"],
                bound=span["floor_bound"],
                unit="tok/s",
            )
        if wl.arrival == "triggered" and r.get("tpot_fraction_of_floor"):
            tp = r.get("latency_by_tag", {}).get(wl.background_tag) or r["latency"]
            return dict(
                metric=f"{wl.background_tag} TPOT p50",
                value=tp["tpot"]["p50"] * 1e3,
                floor=r["tpot_floor"]["floor_s"] * 1e3,
                fraction=r["tpot_fraction_of_floor"],
                bound=r["tpot_floor"]["bound"],
                unit="ms",
                lower_is_better=True,
            )
        return dict(
            metric="output tok/s",
            value=r["output_tok_s"],
            floor=r["output_tokens"] / r["floor"]["floor_s"],
            fraction=r["fraction_of_floor"],
            bound=r["floor_bound"],
            unit="tok/s",
        )

    # ---------------------------------------------------------------------- generate() baseline
    def run_generate(self, wl: Workload, reps: int = 1) -> dict:
        from ouro_jax import generate, static_generate

        c = self.config
        n = len(wl.requests) if wl.arrival != "closed_loop" else wl.concurrency
        specs = wl.requests[:n]
        p = max(s.num_prompt_tokens for s in specs)
        new = max(s.params.max_tokens for s in specs)
        ids = np.zeros((n, p), np.int32)
        for i, s in enumerate(specs):
            ids[i, : s.num_prompt_tokens] = s.prompt
        lengths = np.asarray([s.num_prompt_tokens for s in specs], np.int32)
        # generate()'s own top-level options: under this jit it cannot apply them, and without them
        # its loops wait for the host after every loop on a GPU (decisions.md, "`generate()`
        # baselines compile with generate()'s options")
        options = static_generate.xla_options() or None
        fn = jax.jit(lambda prm, i, l: generate(prm, c, i, l, new), compiler_options=options)
        ev0 = self.events.snapshot()
        t = time.perf_counter()
        exe = fn.lower(self.params, ids, lengths).compile()
        compile_s = time.perf_counter() - t
        ev1 = self.events.snapshot()
        ids_d, len_d = jax.device_put(ids), jax.device_put(lengths)
        times = []
        for _ in range(max(1, reps)):
            t = time.perf_counter()
            out = exe(self.params, ids_d, len_d)
            out.tokens.block_until_ready()
            times.append(time.perf_counter() - t)
        sec = float(np.median(times))
        depths = np.asarray(out.exit_depths)
        loops = float(np.mean(depths[:, 1:] + 1)) if new > 1 else float(c.num_loops)
        g = generate_floor(c, n, p, new, self.bw, self.peak, loops)
        pre = prefill_floor(c, n, p, p, n * p, self.bw, self.peak)
        dec = decode_step_floor(c, n, p + new / 2, loops, self.bw, self.peak)
        bound = dec["bound"] if g["decode_floor_s"] >= g["prefill_floor_s"] else pre["bound"]
        floor = dict(
            floor_s=g["floor_s"],
            bound=bound,
            prefill_floor_s=g["prefill_floor_s"],
            decode_floor_s=g["decode_floor_s"],
            bandwidth=self.bw,
            peak_flops=self.peak,
            basis="floors.generate_floor: one-shot prefill + new-1 decode steps of the static batch",
        )
        hist = dict(
            counts=np.bincount(depths[:, 1:].reshape(-1), minlength=c.num_loops).tolist(),
            tokens=int(depths[:, 1:].size),
            mean_loops=loops,
        )
        r = dict(
            _static_batch_fields(wl, GENERATE_MODE, wl.exit, n, n, sec, times),
            compile_s=compile_s,
            xla_compiles_at_compile=(ev1[0] - ev0[0]) - (ev1[2] - ev0[2]),
            persistent_cache_hits=ev1[2] - ev0[2],
            prompt=p,
            new_tokens=new,
            prompt_tokens=int(lengths.sum()),
            output_tokens=n * new,
            prompt_tok_s=None,
            output_tok_s=n * new / sec,
            request_throughput=n / sec,
            seconds_per_step=sec / new,  # a static batch has no per-token timestamps: no TTFT / ITL
            latency=dict(e2e=dict(p50=sec, p90=sec, p99=sec, mean=sec, max=sec, n=n), ttft=None, itl=None, tpot=None),
            exit_histogram=hist,
            floor=floor,
            fraction_of_floor=g["floor_s"] / sec,
            floor_bound=bound,
            compilations=0,
            # the outer jit's options (generate()'s own); records without them timed loops that waited
            # for the host (report.py marks those)
            xla_options={k: str(v) for k, v in (options or {}).items()},
        )
        r["headline"] = dict(
            metric="output tok/s",
            value=r["output_tok_s"],
            floor=n * new / g["floor_s"],
            fraction=r["fraction_of_floor"],
            bound=bound,
            unit="tok/s",
        )
        r.update(_memory())
        del out, exe
        gc.collect()
        return r

    # ------------------------------------------------------------------ plain-JAX prefill baseline
    def run_plain_prefill(self, wl: Workload, reps: int = 3) -> dict:
        """``plain_jax.time_prefill`` of ``wl``'s prompts (one length, all at t=0) on these weights: one
        jit over every loop, the first tokens and every loop's K/V out; no engine is resident."""
        c = self.config
        if len({s.num_prompt_tokens for s in wl.requests}) != 1:
            raise ValueError(f"{wl.label}: a one-shot prefill needs prompts of one length")
        ids = np.stack([s.prompt for s in wl.requests]).astype(np.int32)
        n, p = ids.shape
        t = time_prefill(c, self.params, ids, self.dtype, rounds=reps)
        fl = prefill_floor(c, n, p, p, n * p, self.bw, self.peak)
        floor = dict(
            fl,
            bandwidth=self.bw,
            peak_flops=self.peak,
            basis="floors.prefill_floor: the whole prompts in one chunk, every row of a loop in one invocation",
        )
        r = dict(
            _static_batch_fields(wl, PLAIN_MODE, "fixed", None, n, t["wall_s"], t["seconds_all"]),
            first_call_s=t["first_call_s"],
            prompt=p,
            prompt_tokens=n * p,
            output_tokens=n,  # the first tokens
            prompt_tok_s=t["tok_s"],
            output_tok_s=None,
            floor=floor,
            fraction_of_floor=fl["floor_s"] / t["wall_s"],
            floor_bound=fl["bound"],
            compilations=0,
            headline=dict(
                metric="prompt tok/s",
                value=t["tok_s"],
                floor=n * p / fl["floor_s"],
                fraction=fl["floor_s"] / t["wall_s"],
                bound=fl["bound"],
                unit="tok/s",
            ),
        )
        r.update(_memory())
        gc.collect()
        return r


def _static_batch_fields(wl: Workload, mode: str, exit: str, concurrency, n: int, wall_s: float, seconds_all) -> dict:
    """The identity and timing of a record of one static batch of ``n`` requests (``generate()``,
    the plain-JAX prefill): every request finished, none truncated."""
    return dict(
        workload=wl.name,
        variant=wl.variant,
        label=wl.label,
        mode=mode,
        chunk=None,
        exit=exit,
        arrival="static batch",
        concurrency=concurrency,
        requests=n,
        requests_finished=n,
        truncated=False,
        wall_s=wall_s,
        seconds_all=seconds_all,
    )


def attach_prefill_baseline(records: list, base: dict) -> list:
    """``baseline_prompt_tok_s``, ``baseline_wall_s`` and ``engine_over_baseline`` (the engine's
    prompt tok/s until the last first token / the baseline's) on the engine records of ``base``'s
    workload variant that have a whole prefill span; returns those records."""
    out = []
    for r in records:
        span = r.get("prefill_span") or {}
        if r.get("mode") in (GENERATE_MODE, PLAIN_MODE) or r.get("variant") != base["variant"]:
            continue
        if "error" in r or not span.get("prompt_tok_s") or span.get("partial"):
            continue
        r["baseline_prompt_tok_s"] = base["prompt_tok_s"]
        r["baseline_wall_s"] = base["wall_s"]
        r["engine_over_baseline"] = span["prompt_tok_s"] / base["prompt_tok_s"]
        out.append(r)
    return out


def _span(seconds: float, invocations: int, prompt_tokens: float, floor: dict, **extra) -> dict:
    """A prefill span's record: its prompt throughput, and the same against its floor."""
    return dict(
        seconds=seconds,
        invocations=invocations,
        prompt_tok_s=prompt_tokens / seconds,
        floor=floor,
        floor_prompt_tok_s=prompt_tokens / floor["floor_s"],
        fraction_of_floor=floor["floor_s"] / seconds,
        floor_bound=floor["bound"],
        **extra,
    )


# ------------------------------------------------------------------------------------- printing
_pct = functools.partial(fmt.pct, width=5)  # the printed tables' column width


def format_record(r: dict) -> str:
    if "error" in r:
        return f"{r.get('label', ''):24s} {r.get('mode', ''):10s} chunk {r.get('chunk')}: ERROR {r['error']}"
    h = r["headline"]
    lat = r.get("latency") or {}
    g = lambda k, p: (lat.get(k) or {}).get(p)  # noqa: E731
    chunk = "-" if r.get("chunk") is None else r["chunk"]
    s = (
        f"{r['label']:24s} {r['mode']:10s} chunk {chunk:>4}: {h['metric']} {fmt.num(h['value'])} {h['unit']} "
        f"(floor {fmt.num(h['floor'])}, {_pct(h['fraction'])} of {h['bound']} floor) | run "
        f"{_pct(r['fraction_of_floor'])} of {r['floor_bound']} floor | out {fmt.num(r['output_tok_s'])} tok/s | "
        f"TTFT p50/p99 {fmt.ms(g('ttft', 'p50'))}/{fmt.ms(g('ttft', 'p99'))} ms | TPOT p50/p99 "
        f"{fmt.ms(g('tpot', 'p50'))}/{fmt.ms(g('tpot', 'p99'))} ms"
    )
    if r["mode"] == GENERATE_MODE:
        s += f" | compile {r['compile_s']:.1f} s"
    elif r["mode"] == PLAIN_MODE:
        s += f" | first call {r['first_call_s']:.1f} s (compile included)"
    else:
        s += (
            f" | rows/inv {r['rows_per_invocation']:.1f} | inv/s {fmt.num(r['invocations_per_s'])} | host/inv "
            f"{fmt.ms(r['host_time_per_invocation_s'])} ms | compiles {r['compilations']}"
        )
        if r.get("truncated"):
            s += " | TRUNCATED"
    return s


def print_table(records: list, file=None) -> None:
    """One line per record: the headline figure next to its floor, then the run's vital signs."""
    head = (
        f"{'workload':24s} {'mode':10s} {'chunk':>5s} {'headline':>22s} {'floor':>12s} {'of floor':>9s} "
        f"{'bound':9s} {'run':>7s} {'out tok/s':>10s} {'TTFT p50':>9s} {'TPOT p50':>9s} {'rows/inv':>8s} "
        f"{'host/inv':>8s} {'compiles':>8s}"
    )
    print(head, file=file)
    for r in records:
        if "error" in r:
            print(f"{r.get('label', ''):24s} {r.get('mode', ''):10s} {str(r.get('chunk')):>5s} ERROR", file=file)
            continue
        h, lat = r["headline"], r.get("latency") or {}
        print(
            f"{r['label']:24s} {r['mode']:10s} {str(r.get('chunk') or '-'):>5s} "
            f"{fmt.num(h['value']) + ' ' + h['unit']:>22s} {fmt.num(h['floor']):>12s} {_pct(h['fraction']):>9s} "
            f"{h['bound']:9s} {_pct(r['fraction_of_floor']):>7s} {fmt.num(r['output_tok_s']):>10s} "
            f"{fmt.ms((lat.get('ttft') or {}).get('p50')):>9s} {fmt.ms((lat.get('tpot') or {}).get('p50')):>9s} "
            f"{fmt.num(r.get('rows_per_invocation')):>8s} {fmt.ms(r.get('host_time_per_invocation_s')):>8s} "
            f"{str(r.get('compilations', '-')):>8s}",
            file=file,
        )


# ------------------------------------------------------------------------------ TPOT targets
def target_fields(h: Harness, wl: Workload, target: Optional[tuple]) -> dict:
    """Record fields of a run under a decode TPOT target (``("ms", x)`` or ``("floor", multiple)``
    of the streams' own decode-step floor); empty without one."""
    if target is None:
        return {}
    kind, x = target
    if kind == "ms":
        return dict(target_tpot_ms=float(x))
    floor_ms = h.tpot_floor_s(wl) * 1e3
    return dict(target_tpot_ms=x * floor_ms, target_tpot_floor_multiple=float(x), target_tpot_floor_ms=floor_ms)


def target_suffix(tf: dict) -> str:
    """Records under a target sit next to the unconstrained one of the same mode and chunk."""
    if not tf:
        return ""
    if "target_tpot_floor_multiple" in tf:
        return f" target {tf['target_tpot_floor_multiple']:g}x floor"
    return f" target {tf['target_tpot_ms']:g} ms"


def targets_of(args, wl: Workload) -> list:
    """``None`` (unconstrained) and, for workloads with decode streams, every requested target."""
    out = [None]
    if wl.background_tag is not None:
        out += [("ms", x) for x in args.target_tpot_ms or ()]
        out += [("floor", m) for m in args.target_tpot_floor_multiple or ()]
    return out


# ----------------------------------------------------------------------------------------- main
def _result(
    h: Harness,
    name: str,
    args,
    variants: list[Workload],
    records: list,
    skipped: list,
    prev: Optional[dict],
    first_startup: int = 0,
) -> dict:
    return dict(
        benchmark="workload",
        workload=name,
        device=h.device,
        jax_version=jax.__version__,
        backend=jax.default_backend(),
        config=dict(
            h.describe(),
            scale=args.scale,
            count_scale=args.count_scale,
            seed=args.seed,
            modes=args.mode,
            chunks=args.chunk,
            plain_baseline=args.plain_baseline,
            time_budget_s=args.time_budget,
            workload_budget_s=args.workload_budget.get(name),
            config_timeout_s=args.config_timeout,
            argv=sys.argv[1:] if args.argv is None else args.argv,
            variants=[v.summary() for v in variants],
        ),
        ceilings=h.ceilings,
        startup=(prev or {}).get("startup", []) + h.startups[first_startup:],
        process_startup=(prev or {}).get("process_startup") or (h.startups[0] if h.startups else None),
        **merge_lists((prev or {}).get("records", []), (prev or {}).get("skipped", []), records, skipped),
    )


def run_workload(h: Harness, name: str, args, estimates: dict) -> dict:
    kw = {}
    if name in EXIT_WORKLOADS and args.exit is not None:
        kw["exits"] = args.exit
    if name == "serve1k":
        conc = list(dict.fromkeys(args.concurrency + (args.generate_concurrency or [])))
        kw["concurrency"] = conc
    variants = make(name, h.config.vocab_size, args.scale, args.count_scale, args.seed, **kw)
    if name == "serve1k":  # the unscaled concurrency of every variant; engine runs only for --concurrency
        kw["concurrency_of"] = [c0 for c0 in conc for _ in range(len(variants) // len(conc))]
        engine_variants = [wl for wl, c0 in zip(variants, kw["concurrency_of"]) if c0 in args.concurrency]
    else:
        engine_variants = variants
    out_json = os.path.join(args.out, f"{name}.json")
    prev = None
    if args.append and os.path.exists(out_json):
        with open(out_json) as f:
            prev = json.load(f)
    records, skipped = [], []
    first_startup = len(h.startups)
    wl_start, wl_budget = time.monotonic(), args.workload_budget.get(name)

    def save():
        res = _result(h, name, args, variants, records, skipped, prev, first_startup)
        if prev:
            res["config"]["previous"] = {k: v for k, v in prev.get("config", {}).items() if k != "previous"}
        save_json(res, out_json)
        return res

    plan = []
    for wl in [] if args.generate_only else engine_variants:
        modes = args.mode or wl.modes
        chunks = args.chunk or wl.chunks
        for chunk in chunks:
            for mode in modes:
                for tgt in targets_of(args, wl):
                    plan.append(("engine", wl, mode, chunk, tuple(args.chunk or CHUNKS), tgt))
        if args.plain_baseline and wl.plain_prefill_baseline:  # after the engines: no KV pool beside it
            plan.append((PLAIN_MODE, wl, PLAIN_MODE, None, (), None))
    if args.generate_baseline is None or name in args.generate_baseline:
        gens = [wl for wl in variants if wl.generate_baseline]
        if name == "serve1k" and args.generate_concurrency is not None:  # in the order given
            by_c = {
                c0: [wl for wl, v0 in zip(variants, kw["concurrency_of"]) if v0 == c0 and wl.generate_baseline]
                for c0 in args.generate_concurrency
            }
            gens = [wl for c0 in args.generate_concurrency for wl in by_c.get(c0, [])]
        plan += [("generate", wl, GENERATE_MODE, None, (), None) for wl in gens]
    for kind, wl, mode, chunk, all_chunks, tgt in plan:
        tf = target_fields(h, wl, tgt)
        first_estimate = {"engine": 0.0, PLAIN_MODE: PLAIN_PREFILL_ESTIMATE_S}.get(kind, args.generate_estimate)
        est = estimates.get(kind) or [first_estimate]
        expect = float(np.mean(est))
        used = time.monotonic() - wl_start
        reason = None
        if args.time_budget is not None and h.elapsed() + expect > args.time_budget:
            reason = f"time budget: {h.elapsed():.0f} s used + ~{expect:.0f} s expected > {args.time_budget:.0f} s"
        elif wl_budget is not None and used + expect > wl_budget:
            reason = f"{name} budget: {used:.0f} s used + ~{expect:.0f} s expected > {wl_budget:.0f} s"
        if reason:
            skipped.append(dict(label=wl.label + target_suffix(tf), mode=mode, chunk=chunk, reason=reason, **tf))
            print(f"skip {wl.label} {mode} chunk {chunk}: {reason}", flush=True)
            save()
            continue
        timeout = None
        limits = [
            x
            for x in (
                args.config_timeout,
                None if args.time_budget is None else max(5.0, args.time_budget - h.elapsed()),
                None if wl_budget is None else max(5.0, wl_budget - used),
            )
            if x is not None
        ]
        if limits:
            timeout = min(limits)
        t = time.monotonic()
        try:
            if kind == "engine":
                rec = h.run(wl, mode, chunk, all_chunks, timeout, tgt, profile=args.profile)
            elif kind == PLAIN_MODE:
                rec = h.run_plain_prefill(wl)
            else:
                rec = h.run_generate(wl, args.generate_reps)
        except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others
            traceback.print_exc()
            rec = dict(
                workload=name,
                variant=wl.variant,
                label=wl.label + target_suffix(tf),
                mode=mode,
                chunk=chunk,
                **tf,
                error=f"{type(e).__name__}: {e}"[:2000],
            )
            gc.collect()
        rec["config_s"] = time.monotonic() - t
        estimates.setdefault(kind, []).append(rec["config_s"])
        records.append(rec)
        print(format_record(rec), flush=True)
        if kind == PLAIN_MODE and "error" not in rec:
            for r in attach_prefill_baseline(records, rec):
                print(f"  engine / plain JAX: {r['engine_over_baseline']:.2f}x ({r['mode']} chunk {r['chunk']})")
        save()
    res = save()
    if not args.no_plot:
        try:
            from benchmarks.report import plot_workload

            plot_workload(res, os.path.join(args.out, f"{name}.png"))
        except ImportError:
            print("matplotlib missing: no plot", flush=True)
    return res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", required=True, choices=sorted(WORKLOADS))
    ap.add_argument("--mode", nargs="+", choices=MODES, default=None, help="default: the workload's sweep")
    ap.add_argument("--chunk", nargs="+", type=int, default=None, help="default: the workload's sweep")
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--dtype", default=None, help="default: the preset's torch_dtype (bfloat16 for ouro-1.4b)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies token lengths (prompts, outputs)")
    ap.add_argument("--count-scale", type=float, default=1.0, help="multiplies request counts and concurrency")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds (process start-up included) after which no new configuration starts",
    )
    ap.add_argument(
        "--workload-budget",
        nargs="+",
        default=[],
        metavar="NAME=SECONDS",
        help="per workload: no new configuration after this many seconds of that workload",
    )
    ap.add_argument(
        "--config-timeout",
        type=float,
        default=None,
        help="abort a configuration after this many seconds (its record is marked truncated)",
    )
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 32, 128], help="serve1k")
    ap.add_argument(
        "--exit",
        nargs="+",
        default=None,
        help="the streams' exits in serve1k (default: fixed early) and decode_under_prefill (default: fixed): "
        "fixed, early (synthetic, 2.5 loops), synthetic<mean loops>, ouro<q> (the model's gate rule)",
    )
    ap.add_argument(
        "--generate-concurrency",
        nargs="+",
        type=int,
        default=None,
        help="serve1k: concurrencies that get a generate() baseline, in this order (default: --concurrency)",
    )
    ap.add_argument(
        "--generate-baseline",
        nargs="*",
        default=None,
        help="workloads that get a static-batch generate() baseline (default: every one where it "
        "applies; give no names for none)",
    )
    ap.add_argument("--generate-only", action="store_true", help="only the generate() baselines (with --append)")
    ap.add_argument(
        "--no-plain-baseline",
        dest="plain_baseline",
        action="store_false",
        help="no plain-JAX one-shot prefill (benchmarks/plain_jax.py) beside the engine (long4)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="drive each engine configuration's workload once more under the profiler (not timed): "
        "kernels and device-busy time a loop, where the device waits (the record's profile)",
    )
    ap.add_argument("--generate-reps", type=int, default=1)
    ap.add_argument(
        "--generate-estimate",
        type=float,
        default=30.0,
        help="seconds a generate() baseline is expected to take before one has run (time budget)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--buckets", nargs="+", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--compile-cache", default=None, help="persistent compilation cache folder")
    ap.add_argument(
        "--attention",
        default="auto",
        choices=ATTENTION,
        help="attention of the engine: auto (pallas on GPU), pallas (kernel chosen per "
        "bucket, pallas_kernels/dispatch.py), a forced Pallas kernel (triton, "
        "mgpu, or hybrid: segments of >= 128 rows on mgpu, the rest on triton), "
        "or the jnp reference",
    )
    ap.add_argument(
        "--fused-decode-max-rows",
        type=int,
        default=0,
        help="fused decode steps (tokens of up to this many decode rows in one executable, exits "
        "decided on the device); 0 = loop by loop. Records get a ' fusedRxK' label suffix",
    )
    ap.add_argument("--fused-decode-tokens", type=int, default=1, help="tokens per fused decode step")
    ap.add_argument(
        "--target-tpot-ms",
        nargs="+",
        type=float,
        default=None,
        help="workloads with decode streams (decode_under_prefill): also run every mode and chunk "
        "under each of these decode TPOT targets (LLM(target_tpot_ms=...)); records carry target_tpot_ms",
    )
    ap.add_argument(
        "--target-tpot-floor-multiple",
        nargs="+",
        type=float,
        default=None,
        help="as --target-tpot-ms, the target given as a multiple of the streams' decode-step floor",
    )
    ap.add_argument("--quick-ceilings", action="store_true")
    ap.add_argument("--warmup-requests", type=int, default=1)
    ap.add_argument("--append", action="store_true", help="add records to an existing <workload>.json")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    return ap


def harness_from_args(a, shape: Optional[EngineShape] = None) -> Harness:
    """The harness a CLI's flags ask for (``shape``: default ``shape_from_args(a)``); flags a CLI
    does not have (``--seed``, fused decode, ...) keep ``Harness``'s defaults."""
    optional = (
        "warmup_requests",
        "seed",
        "fused_decode_max_rows",
        "fused_decode_tokens",
        "async_scheduling",
    )
    return Harness(
        a.preset,
        a.dtype,
        shape or shape_from_args(a),
        a.compile_cache,
        a.attention,
        a.gpu_memory_utilization,
        None if a.kv_cache_gb is None else int(a.kv_cache_gb * 1e9),
        a.quick_ceilings,
        not a.no_progress,
        **{k: getattr(a, k) for k in optional if hasattr(a, k)},
    )


def main(argv=None, harness: Optional[Harness] = None) -> dict:
    args = sys.argv[1:] if argv is None else list(argv)
    if any(x == "--suite" or x.startswith("--suite=") for x in args):  # a named suite of stages
        from benchmarks import suite

        suite.main(args)
        return {}
    a = parser().parse_args(argv)
    a.argv = None if argv is None else list(argv)
    try:
        a.workload_budget = {k: float(v) for k, v in (x.split("=", 1) for x in a.workload_budget)}
    except ValueError:
        raise SystemExit(f"--workload-budget takes NAME=SECONDS, got {a.workload_budget}") from None
    if a.exit is not None and not EXIT_WORKLOADS & set(a.workload):
        raise SystemExit(f"--exit applies to {' and '.join(sorted(EXIT_WORKLOADS))} only, not {a.workload}")
    for kind in a.exit or ():
        try:  # any loop count validates the kind; None marks the gate rule
            loops = exit_mean_loops(kind, num_loops=1)
        except ValueError as e:
            raise SystemExit(f"--exit: {e}") from None
        if loops is None and a.target_tpot_floor_multiple:
            raise SystemExit(
                f"--exit {kind}: the gate rule's loops a token come out of the run, so it has no floor to "
                "multiply before it: give --target-tpot-ms"
            )
    for opt in ("target_tpot_ms", "target_tpot_floor_multiple"):
        bad = [x for x in getattr(a, opt) or () if not (x > 0 and np.isfinite(x))]
        if bad:
            raise SystemExit(f"--{opt.replace('_', '-')} takes positive numbers, got {bad}")
    os.makedirs(a.out, exist_ok=True)
    h = harness or harness_from_args(a)
    print(
        f"{h.device}: ceilings {h.peak / 1e12:.0f} TFLOP/s, {h.bw / 1e12:.2f} TB/s "
        f"({'measured' if h.ceilings.get('measured') else 'H200 defaults'}); params {h.params_s:.1f} s; "
        f"shape {h.shape}",
        flush=True,
    )
    results, estimates = {}, {}
    try:
        for name in a.workload:
            results[name] = run_workload(h, name, a, estimates)
    except KeyboardInterrupt:  # a suite's time limit (SIGINT): every finished record is already saved
        print("interrupted: records so far are saved", flush=True)
    print()
    print_table([r for res in results.values() for r in res["records"]])
    return results


if __name__ == "__main__":
    main()
