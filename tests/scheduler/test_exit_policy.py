"""The per-token exit rule on hand-built gates (engine-semantics.md, "Exit policy")."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Phase, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.exit_policy import coda_kind, gate_needed, reference_exit_loops, sigmoid, synthetic_exit_loops


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def loops(gates_p, T=4, **kw):
    return reference_exit_loops(SamplingParams(**kw), T, [logit(p) for p in gates_p])


def test_sigmoid_is_stable_at_the_extremes():
    assert sigmoid(0.0) == 0.5
    assert sigmoid(1000.0) == 1.0 and sigmoid(-1000.0) == 0.0
    assert abs(sigmoid(logit(0.3)) - 0.3) < 1e-12


def test_ouro_example_from_the_semantics():
    # sigmoid 0.3, 0.3: 1 - remaining = 0.51 after loop 2
    g = [0.3, 0.3, 0.3, 0.3]
    assert loops(g, exit_threshold=0.5) == 2
    assert loops(g, exit_threshold=0.52) == 3  # 1 - 0.7^3 = 0.657
    assert loops(g, exit_threshold=0.25) == 1
    assert loops(g, exit_threshold=0.25, min_loops=3) == 3  # loops before min_loops still count
    assert loops(g, exit_threshold=0.9) == 4  # 1 - 0.7^4 = 0.76: capped at T
    assert loops(g, exit_threshold=0.9, max_loops=2) == 2
    assert loops(g) == 4  # threshold 1.0 = fixed full depth
    assert loops([0.999999] * 4) == 4  # even when the gates saturate
    assert loops(g, exit_threshold=0.0) == 1  # threshold 0 exits at min_loops
    assert loops(g, exit_threshold=0.0, min_loops=2) == 2


def test_delayed_exits_one_loop_later_capped_at_max_loops():
    g = [0.3, 0.3, 0.3, 0.3]
    assert loops(g, exit_threshold=0.5, exit_mode="delayed") == 3
    assert loops(g, exit_threshold=0.25, exit_mode="delayed") == 2
    assert loops(g, exit_threshold=0.25, exit_mode="delayed", max_loops=1) == 1
    assert loops(g, exit_threshold=0.52, exit_mode="delayed") == 4
    assert loops(g, exit_threshold=0.9, exit_mode="delayed") == 4
    # the decision after loop t reads only g[0..t-1]: the last gate is never read
    assert (
        reference_exit_loops(
            SamplingParams(exit_threshold=0.5, exit_mode="delayed"),
            4,
            [logit(0.3), logit(0.3), float("nan"), float("nan")],
        )
        == 3
    )


def test_fixed_runs_max_loops_whatever_the_gates():
    assert loops([0.99] * 4, exit_mode="fixed", exit_threshold=0.1) == 4
    assert loops([0.99] * 4, exit_mode="fixed", max_loops=3) == 3


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.data())
def test_delayed_is_ouro_plus_one_and_coda_kind_agrees(T, data):
    max_loops = data.draw(st.integers(1, T))
    min_loops = data.draw(st.integers(1, max_loops))
    thr = data.draw(st.sampled_from([0.0, 0.2, 0.5, 0.8, 0.99, 1.0]))
    g = data.draw(st.lists(st.floats(-6, 6), min_size=T, max_size=T))
    kw = dict(min_loops=min_loops, max_loops=max_loops, exit_threshold=thr)
    o = reference_exit_loops(SamplingParams(**kw), T, g)
    dl = reference_exit_loops(SamplingParams(exit_mode="delayed", **kw), T, g)
    assert min_loops <= o <= max_loops or o == max_loops
    assert dl == min(o + 1, max_loops)
    for mode, e in (("ouro", o), ("delayed", dl)):
        p = SamplingParams(exit_mode=mode, **kw)
        # a loop that can be the exit is given a coda; loops that cannot be are not
        assert coda_kind(p, T, e) != "none"
        for L in range(1, e):
            if coda_kind(p, T, L) == "certain":
                pytest.fail("a certain coda before the exit")
        # gates that no decision reads are not needed (the needed ones form a prefix)
        needed = [gate_needed(p, T, t) for t in range(T)]
        assert needed == sorted(needed, reverse=True)
        g2 = [x if needed[t] else float("nan") for t, x in enumerate(g)]
        assert reference_exit_loops(p, T, g2) == e


def test_synthetic_draws_are_deterministic_with_the_requested_mean():
    p = SamplingParams(exit_mode="synthetic", synthetic_mean_loops=2.5, seed=7)
    draws = [synthetic_exit_loops(p, 4, "req-1", k) for k in range(1, 4001)]
    assert draws == [synthetic_exit_loops(p, 4, "req-1", k) for k in range(1, 4001)]
    assert set(draws) == {1, 2, 3, 4}
    assert abs(np.mean(draws) - 2.5) < 0.06
    other = [synthetic_exit_loops(p, 4, "req-2", k) for k in range(1, 4001)]
    assert draws != other
    p2 = SamplingParams(exit_mode="synthetic", synthetic_mean_loops=3.0, min_loops=3)
    assert {synthetic_exit_loops(p2, 4, 0, k) for k in range(1, 50)} == {3}
    p3 = SamplingParams(exit_mode="synthetic", synthetic_mean_loops=2, min_loops=2, max_loops=2)
    assert synthetic_exit_loops(p3, 4, 0, 1) == 2


def test_synthetic_replay_reproduces_recorded_depths():
    recorded = [3, 0, 2, 1, 1]
    p = SamplingParams(exit_mode="synthetic", synthetic_depths=recorded)
    assert [synthetic_exit_loops(p, 4, "x", k) - 1 for k in range(1, 5)] == recorded[1:]
    clipped = SamplingParams(exit_mode="synthetic", synthetic_depths=recorded, min_loops=2, max_loops=3)
    assert [synthetic_exit_loops(clipped, 4, "x", k) for k in range(1, 5)] == [2, 3, 2, 2]


class GateTableRunner:
    """Returns, for every decode row, the gate logit of a hand-built table by (token, depth)."""

    def __init__(self, table):
        self.table = table

    def __call__(self, plan, req):
        gates = np.zeros(plan.descriptor.key.R, np.float32)
        for r in plan.ranges_of(Phase.DECODE):
            k = len(req.output_token_ids) - 1  # token in flight
            gates[r.row_start] = self.table[k % len(self.table)][r.depth]
        tokens = np.full(plan.descriptor.key.C, 11, np.int32)
        return gates, tokens


@pytest.mark.parametrize("mode", ["ouro", "delayed"])
def test_scheduler_applies_the_rule_one_loop_at_a_time(mode):
    T = 4
    table = [
        [logit(p) for p in row]
        for row in ([0.3, 0.3, 0.3, 0.3], [0.9, 0.1, 0.1, 0.1], [0.05, 0.05, 0.9, 0.2], [0.01, 0.01, 0.01, 0.01])
    ]
    sp = SamplingParams(max_tokens=9, exit_threshold=0.5, exit_mode=mode)
    cfg = SchedulerConfig(
        num_loops=T,
        num_blocks=64,
        block_size=4,
        max_num_seqs=1,
        max_num_batched_tokens=8,
        prefill_chunk_size=8,
        max_model_len=32,
        prefill_mode="mixed",
    )
    s = Scheduler(cfg)
    req = Request(0, [1, 2, 3], sp)
    s.add_request(req)
    run = GateTableRunner(table)
    while s.has_unfinished():
        plan = s.schedule()
        s.update(plan, *run(plan, req))
    want = [T - 1] + [reference_exit_loops(sp, T, table[k % 4]) - 1 for k in range(8)]
    assert req.exit_depths == want
    assert req.output_token_ids == [11] * 9
