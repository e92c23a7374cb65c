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


def test_host_schedule_staged_times_loop_by_loop_invocations():
    (rec,) = host_schedule.main(["--staged", "--concurrency", "40", "--reps", "5"])
    assert rec["invocations"] == 5 and rec["schedule_s"] > 0 and rec["update_s"] > 0
    with pytest.raises(SystemExit):  # 32 gated streams would fuse: not the staged case
        host_schedule.main(["--staged", "--concurrency", "32"])


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


def test_kernels_us_sums_a_name_launched_twice_and_takes_medians(monkeypatch):
    """CUPTI's per-launch list becomes per-kernel device time (us) of one call: a name launched
    twice in a call sums, the median is over calls, launch order is kept."""
    from jax.experimental.mosaic.gpu import profiler

    from benchmarks.timing import kernel_us, kernels_us

    calls = [
        [("attn", 0.007), ("combine", 0.002), ("attn", 0.001)],
        [("attn", 0.009), ("combine", 0.003), ("attn", 0.001)],
        [("attn", 0.008), ("combine", 0.010), ("attn", 0.001)],
    ]

    def fake_measure(fn, *, aggregate=True, iterations=1):
        def run(*args):
            if aggregate:
                return None, [sum(ms for _, ms in c) for c in calls]
            return None, calls

        return run

    monkeypatch.setattr(profiler, "measure", fake_measure)
    got = kernels_us(lambda: None, iters=3)
    assert list(got) == ["attn", "combine"]
    assert got["attn"] == pytest.approx(9.0) and got["combine"] == pytest.approx(3.0)
    assert kernel_us(lambda: None, iters=3) == pytest.approx(13.0)  # totals 10, 13, 19 us
