"""Host time of one fused decode step's schedule: ``Scheduler.fused_plan`` and the
descriptor's ``pack()``, best of N, at c decoding rows (the scheduler and the fake runner only: no
device, so it runs anywhere and isolates the scheduler's share of a fused launch's host time).

    python -m benchmarks.host_schedule                          # c = 1 / 8 / 64, best of 300
    python -m benchmarks.host_schedule --concurrency 1 8 --reps 1000 --out /tmp/host_schedule.json

Each of c requests (``--prompt-len`` random token ids, the gate rule at ``--exit-threshold``) is
admitted and prefilled through the asynchronous pipeline, then the fused step of one token for all
running rows is built ``--reps`` times. Compare two trees by running it in each (e.g. around a
``git stash``) on the same machine: best-of times on a shared machine still move by ~10-30%.

    python -m benchmarks.host_schedule --staged [--concurrency 64] [--reps 300]

``--staged``: the loop-by-loop invocations of ``decode_under_prefill``'s gated case instead: c
streams of the gate rule (128-token prompts) beside 12 prompts of 8064 tokens, wavefront chunk 64,
more than ``FUSED_GATED_MAX_ROWS`` so no step fuses; the median host seconds of ``schedule`` and of
``update`` an invocation over ``--reps`` invocations. Each such invocation reads its gates before
the next is scheduled, so on a GPU both sit between two invocations' device work.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.fake_runner import FakeRunner
from scheduler.pipeline import StepPipeline

__all__ = ["measure", "main"]


def _decoding(cfg: SchedulerConfig, concurrency: int, prompt_len: int, max_tokens: int, exit_threshold: float):
    """A scheduler on the fake runner (asynchronous pipeline) with ``concurrency`` requests of the
    gate rule admitted and prefilled until every one has its first token: ``(scheduler, pipeline,
    the rng that drew the prompts)``."""
    s = Scheduler(cfg)
    pipe = StepPipeline(s, FakeRunner(cfg.num_blocks, cfg.block_size, cfg.num_ring_rows, 1000, check=False), ahead=True)
    rng = np.random.default_rng(0)
    for i in range(concurrency):
        ids = list(map(int, rng.integers(1, 1000, prompt_len)))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, exit_threshold=exit_threshold)
        s.add_request(Request(f"r{i}", ids, params))
    for _ in range(10_000):  # until every row has its first token: all decode from here
        if len(s.running) == concurrency and all(r.output_token_ids for r in s.running):
            break
        pipe.advance()
    if len(s.running) != concurrency or not all(r.output_token_ids for r in s.running):
        raise RuntimeError(f"{len(s.running)} of {concurrency} rows decoding: raise num_blocks or shorten the prompts")
    return s, pipe, rng


def measure(concurrency: int, reps: int = 300, prompt_len: int = 1024, exit_threshold: float = 0.5) -> dict:
    """Best-of-``reps`` host seconds of ``fused_plan`` (one token) and of ``pack()`` at
    ``concurrency`` decoding rows."""
    cfg = SchedulerConfig(
        num_loops=4,
        num_blocks=20000,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        prefill_chunk_size=2048,
        max_model_len=4096,
        fused_decode_max_rows=128,
    )
    # no row finishes before the last one decodes
    s, pipe, rng = _decoding(cfg, concurrency, prompt_len, cfg.max_model_len - prompt_len, exit_threshold)
    rows = list(s.running)
    best_schedule = best_pack = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        plan = s.fused_plan(rows, [], 1, 1)
        best_schedule = min(best_schedule, time.perf_counter() - t)
        t = time.perf_counter()
        plan.descriptor.pack()
        best_pack = min(best_pack, time.perf_counter() - t)
    return dict(concurrency=concurrency, rows=len(rows), schedule_fused_s=best_schedule, pack_s=best_pack)


# long prompts beside the streams: enough prompt work for ~400 invocations of 1024 rows
LONG_PROMPTS = 12


def measure_staged(concurrency: int, reps: int = 300, exit_threshold: float = 0.5) -> dict:
    """Median host seconds of ``Scheduler.schedule`` and ``Scheduler.update`` an invocation while
    ``concurrency`` gated streams decode loop by loop beside ``LONG_PROMPTS`` prompts of 8064 tokens
    (wavefront, chunk 64)."""
    cfg = SchedulerConfig(
        num_loops=4,
        num_blocks=40000,
        block_size=16,
        max_num_seqs=concurrency + LONG_PROMPTS,
        max_num_batched_tokens=1024,
        prefill_chunk_size=64,
        prefill_mode="wavefront",
        max_model_len=8192,
        fused_decode_max_rows=min(128, concurrency + LONG_PROMPTS),
    )
    s, pipe, rng = _decoding(cfg, concurrency, 128, 4096, exit_threshold)
    for i in range(LONG_PROMPTS):
        s.add_request(Request(f"L{i}", list(map(int, rng.integers(1, 1000, 8064))), SamplingParams(max_tokens=1)))
    sched, upd = [], []
    schedule, update = s.schedule, s.update

    def timed_schedule():
        t = time.perf_counter()
        plan = schedule()
        sched.append(time.perf_counter() - t)
        return plan

    def timed_update(*args, **kw):
        t = time.perf_counter()
        out = update(*args, **kw)
        upd.append(time.perf_counter() - t)
        return out

    s.schedule, s.update = timed_schedule, timed_update
    fused = s.stats()["fused_launches"]
    for _ in range(reps):
        pipe.advance()
    if s.stats()["fused_launches"] != fused or not any(r.is_prefilling for r in s.running):
        raise RuntimeError("a step fused or the long prompts finished: not the staged case; lower --reps (<= 300)")
    return dict(
        concurrency=concurrency,
        invocations=len(sched),
        schedule_s=float(np.median(sched)),
        update_s=float(np.median(upd)),
    )


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="decoding rows (<= 128)")
    ap.add_argument("--reps", type=int, default=300, help="schedules built per c; the best counts")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--exit-threshold", type=float, default=0.5, help="the gate rule of every request")
    ap.add_argument("--staged", action="store_true", help="loop-by-loop invocations beside long prompts (above)")
    ap.add_argument("--out", default=None, help="also write the records as JSON here")
    a = ap.parse_args(argv)
    if a.staged:
        if not 1 <= a.reps <= 300 or not all(33 <= c <= 128 for c in a.concurrency):
            ap.error("--staged: 1 <= --reps <= 300 and 33 <= --concurrency <= 128 (more streams than fuse gated)")
        records = [measure_staged(c, a.reps, a.exit_threshold) for c in a.concurrency]
        for r in records:
            print(
                f"c={r['concurrency']}: schedule {r['schedule_s'] * 1e6:.0f} us, update {r['update_s'] * 1e6:.0f} us "
                f"an invocation (median of {r['invocations']})"
            )
        _write(a.out, argv, records)
        return records
    if a.reps < 1 or not all(1 <= c <= 128 for c in a.concurrency) or not 1 <= a.prompt_len < 4096:
        ap.error("--reps >= 1, 1 <= --concurrency <= 128 (the largest fused bucket), 1 <= --prompt-len < 4096")
    records = []
    for c in a.concurrency:
        r = measure(c, a.reps, a.prompt_len, a.exit_threshold)
        records.append(r)
        us = {k: f"{r[k] * 1e6:.0f} us" for k in ("schedule_fused_s", "pack_s")}
        print(f"c={c}: fused_plan {us['schedule_fused_s']}, pack {us['pack_s']} (best of {a.reps})")
    _write(a.out, argv, records)
    return records


def _write(path, argv, records) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(dict(benchmark="host_schedule", argv=list(argv or []), records=records), f, indent=1)


if __name__ == "__main__":
    main()
