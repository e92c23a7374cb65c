"""Loops the device would run per token made, for each fused_decode_rows program, on the
scheduler's fake model (numpy; a schedule count, not a timing). Run from the repo root:

    python benchmarks/results/run24/fused_rows_schedule_probe.py

Seven decode rows with tests/test_fused_independent.py's mix of exit rules (gate rules and
synthetic depths), 33 tokens each, fused steps of 2 / 4 / 8 tokens."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_fused_independent import EARLY, Recorder, _cfg, _mixed_requests, run_workload  # noqa: E402

from ouro_jax import SamplingParams  # noqa: E402
from scheduler.descriptor import FUSED_DECODE_ROWS  # noqa: E402

for tokens in (2, 4, 8):
    reqs = [
        dict(r, sp=SamplingParams(max_tokens=33, seed=r["rid"], **EARLY[r["rid"] % len(EARLY)]))
        for r in _mixed_requests()
    ]
    res = []
    for rows in FUSED_DECODE_ROWS:
        h = Recorder(_cfg("last_exited", tokens, fused_decode_rows=rows))
        h, objs, _ = run_workload(h.cfg, reqs, harness=h)
        s = h.s.stats()
        res.append(f"{rows} {s['fused_loops'] / s['fused_row_tokens']:.2f}")
    mean = np.mean([d for o in objs.values() for d in o[0].exit_depths[1:]]) + 1
    print(f"tokens a step {tokens}: loops per token made: {', '.join(res)}; tokens' own mean {mean:.2f}")
