"""CPU probe (session 13): best-of-300 host time of Scheduler._schedule_fused (one token of a fused
decode step) with the fake runner, c = 1 / 8 / 64 rows. Run from the repo root:
``python benchmarks/results/run22/host_schedule_probe.py`` (before/after: git stash)."""

import time

import numpy as np

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.fake_runner import FakeRunner
from scheduler.pipeline import StepPipeline

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
for c in (1, 8, 64):
    s = Scheduler(cfg)
    fr = FakeRunner(cfg.num_blocks, cfg.block_size, 8192, 1000, check=False)
    p = StepPipeline(s, fr, ahead=True)
    rng = np.random.default_rng(0)
    for i in range(c):
        s.add_request(
            Request(
                f"r{i}",
                list(map(int, rng.integers(1, 1000, 1024))),
                SamplingParams(max_tokens=64, ignore_eos=True, exit_threshold=0.5),
            )
        )
    for _ in range(6):
        p.advance()
    rows = list(s.running)
    best = 1e9
    best_pack = 1e9
    for _ in range(300):
        t = time.perf_counter()
        plan = s._schedule_fused(rows, [], 1, 1)
        dt = time.perf_counter() - t
        best = min(best, dt)
        t = time.perf_counter()
        plan.descriptor.pack()
        best_pack = min(best_pack, time.perf_counter() - t)
    print(f"c={c}: _schedule_fused min {best * 1e6:.0f} us, pack {best_pack * 1e6:.0f} us")
