"""``benchmarks/host_schedule.py`` and ``benchmarks/tp_collectives.py``: each runs on the CPU and
reports what it promises (timings are not asserted, only that every row decodes when measured)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import host_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_host_schedule_measures_every_row_decoding():
    recs = host_schedule.main(["--concurrency", "1", "8", "--reps", "3", "--prompt-len", "64"])
    assert [r["rows"] for r in recs] == [1, 8]
    assert all(r["schedule_fused_s"] > 0 and r["pack_s"] > 0 for r in recs)


@pytest.mark.slow  # compiles the tiny model's step twice (~10 s)
def test_tp_collectives_counts_the_step_collectives():
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.tp_collectives", "--tp", "1", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "tp 1: 0 collectives" in p.stdout
    assert "x all-reduce" in p.stdout.split("tp 2:")[1]
