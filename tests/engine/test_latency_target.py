"""The decode latency target (scheduler/latency_target.py), jax-free, on the fake runner and a synthetic clock.

Invocation time is a known linear function of (row bucket, context tokens attended); the scheduler
is told the time of each run of plans between two blocking reads, as ``LLM`` tells it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from scheduler import Phase, SamplingParams, Scheduler, SchedulerConfig
from scheduler.latency_target import CostModel, LatencyTarget, plan_features
from tests.scheduler.conftest import VOCAB, Harness, check_against_reference, run_workload, workloads


def linear_cost(a, b, c):
    """Seconds of one plan under ``a + b * R + c * ctx`` per invocation."""

    def cost(plan):
        n, rows, ctx = plan_features(plan)
        return a * n + b * rows + c * ctx

    return cost


class TimedHarness(Harness):
    """A Harness on a synthetic device: each plan takes ``cost(plan)`` seconds, run in launch order;
    the host takes no time but waits where ``update`` reads a result (lazy results: a read is a
    ``needs_*`` thunk being called) until that plan is done. The pipeline's clock is the host's,
    so the scheduler is told the time between blocking reads, as ``LLM``'s pipeline tells it."""

    def __init__(self, cfg, cost, ahead=False):
        super().__init__(cfg, lazy=True, ahead=ahead, clock=lambda: self.host_now)
        self.cost, self.host_now, self.device_end = cost, 0.0, 0.0
        self.done_at: dict = {}  # plan step -> synthetic time its device work ends
        self.token_times: dict = {}  # rid -> synthetic times of its tokens (when the host read them)
        self.no_prompt_run = 0  # invocations in a row in which a prefilling request got no prompt row
        self.max_no_prompt_run = 0
        self.decode_gap: dict = {}  # rid -> invocations since its last decode row
        self.max_decode_gap = 0
        self.fitted_at = None  # synthetic time at which the cost model first had enough observations
        # synthetic time from which the streams run constrained (cycles or the cap): split mode's
        # cap from the start, staged modes' once the uncapped invocations missed the target
        self.constrained_at = 0.0 if cfg.prefill_mode == "split" else None
        self.constrained_plan = 0 if cfg.prefill_mode == "split" else None  # index into plans of the same
        self.prompt_ahead = 0  # token cycles' prompt invocations launched behind their fused step
        self.cycle_start = None  # synthetic time of the first token cycle

    def prompt_rows_per_cycle(self) -> float:
        """Mean rows of the cycles' prompt invocations."""
        st = self.s.stats()
        rows = [p.num_rows for p in self.plans if p.sub_plans is None and not p.ranges_of(Phase.DECODE)]
        return sum(rows) / max(st["latency_cycles"], 1)

    def check_launch(self, plan, ahead):
        super().check_launch(plan, ahead)
        self.prompt_ahead += ahead and plan.sub_plans is None
        lt = self.s.latency
        if self.cycle_start is None and lt is not None and lt.cycles:
            self.cycle_start = self.host_now
        self.device_end = max(self.device_end, self.host_now) + self.cost(plan)
        self.done_at[plan.step] = self.device_end

    def on_read(self, plan):
        self.host_now = max(self.host_now, self.done_at[plan.step])

    def step(self):
        s = self.s
        prefilling = any(r.is_prefilling for r in s.running)
        decoding = {r.request_id for r in s.running if r.is_decoding}
        n_plans = len(self.plans)
        deltas = super().step()
        if deltas is None:
            return None
        if self.fitted_at is None and s.latency is not None and s.latency.model.fitted:
            self.fitted_at = self.host_now
        if self.constrained_at is None and s.latency is not None and s.latency.constrained:
            self.constrained_at, self.constrained_plan = self.host_now, n_plans
        for d in deltas:
            self.token_times.setdefault(d.request_id, []).extend([self.host_now] * len(d.new_token_ids))
        for plan in self.plans[n_plans:]:
            ran_prompt = any(r.phase is Phase.RECURRENT for r in plan.ranges)
            self.no_prompt_run = 0 if (ran_prompt or not prefilling) else self.no_prompt_run + 1
            self.max_no_prompt_run = max(self.max_no_prompt_run, self.no_prompt_run)
            subs = plan.sub_plans or [plan]
            for sub in subs:
                got = {r.request_id for r in sub.ranges if r.phase is Phase.DECODE}
                self.decode_gap = {rid: g for rid, g in self.decode_gap.items() if rid in decoding}  # preempted
                for rid in decoding:
                    self.decode_gap[rid] = 0 if rid in got else self.decode_gap.get(rid, 0) + 1
                    self.max_decode_gap = max(self.max_decode_gap, self.decode_gap[rid])
        return deltas


def drive(cfg, reqs, cost, ahead=False):
    return run_workload(cfg, reqs, harness=TimedHarness(cfg, cost, ahead))


def constrained_since(h) -> float:
    """From when the target holds: the cost model fitted and the streams constrained."""
    assert h.fitted_at is not None and h.constrained_at is not None, (h.fitted_at, h.constrained_at)
    return max(h.fitted_at, h.constrained_at)


# ------------------------------------------------------------------------------- unit
def test_cost_model_recovers_a_linear_cost_from_summed_runs():
    rng = np.random.default_rng(0)
    m = CostModel(window=64, min_observations=4)
    a, b, c = 1e-3, 5e-5, 2e-7
    for _ in range(40):
        n = int(rng.integers(1, 5))  # several invocations per measured run
        rows, ctx = float(rng.integers(8, 512) * n), float(rng.integers(0, 100_000))
        m.observe((n, rows, ctx), a * n + b * rows + c * ctx)
    assert m.fitted
    np.testing.assert_allclose(m.coefficients, (a, b, c), rtol=1e-6)
    assert m.predict(256, 4096) == pytest.approx(a + b * 256 + c * 4096)


def _nnls_on_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The cost model's fit done the slow way: every feature subset by lstsq on the window's rows."""
    scale = np.maximum(x.max(axis=0), 1e-12)
    xs = x / scale
    best, best_err = np.zeros(3), float(y @ y)
    for k in (1, 2, 3):
        for cols in itertools.combinations(range(3), k):
            sol = np.linalg.lstsq(xs[:, cols], y, rcond=None)[0]
            err = float(np.sum((xs[:, cols] @ sol - y) ** 2))
            if (sol >= 0).all() and err < best_err - 1e-12 * float(y @ y):
                best, best_err = np.zeros(3), err
                best[list(cols)] = sol
    return best / scale


@pytest.mark.parametrize("kind", ["noisy", "one_invocation", "rows_follow_invocations", "no_context", "noise_only"])
def test_cost_model_fits_as_lstsq_on_the_window_rows(kind):
    """The normal-equations fit predicts what lstsq on the window's rows does, collinear features
    included, over a window that has wrapped several times."""
    rng = np.random.default_rng(len(kind))
    m = CostModel(window=48, min_observations=3)
    xs, ys = [], []
    for i in range(200):
        n = 1 if kind == "one_invocation" else int(rng.integers(1, 4))
        rows = 256.0 * n if kind == "rows_follow_invocations" else float(rng.integers(8, 1024) * n)
        ctx = 0.0 if kind == "no_context" else float(rng.integers(0, 10**6))
        t = 1e-3 * n + 5e-6 * rows + 1e-8 * ctx
        t = abs(rng.normal(0.005, 0.003)) if kind == "noise_only" else max(0.0, t + rng.normal(0, 2e-4))
        m.observe((n, rows, ctx), t)
        xs.append((n, rows, ctx))
        ys.append(t)
        if i >= 2 and i % 13 == 0:
            ref = _nnls_on_rows(np.array(xs[-48:], float), np.array(ys[-48:]))
            for point in ((256, 4096), (1024, 5e5), (8, 0)):
                assert m.predict(*point) == pytest.approx(float(ref @ (1.0, *point)), rel=1e-9, abs=1e-15)


def test_cost_model_keeps_coefficients_non_negative():
    m = CostModel(window=16, min_observations=3)
    for r in (8, 16, 32, 64):  # time falls with rows: no non-negative slope explains it
        m.observe((1, r, 0), 1.0 / r)
    assert all(x >= 0 for x in m.coefficients)


@pytest.mark.parametrize(
    "kw",
    [
        dict(target_s=0),
        dict(target_s=float("nan")),
        dict(target_s=1.0, headroom=0),
        dict(target_s=1.0, starve_after=0),
    ],
)
def test_latency_target_rejects_bad_arguments(kw):
    target = kw.pop("target_s")
    with pytest.raises(ValueError):
        LatencyTarget(target, 4, [8, 16], 16, **kw)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "5"])
def test_config_rejects_bad_target(bad):
    with pytest.raises(ValueError, match="target_tpot_ms"):
        SchedulerConfig(num_loops=4, num_blocks=64, target_tpot_ms=bad)


def test_cost_model_rejects_bad_observations():
    m = CostModel()
    with pytest.raises(ValueError):
        m.observe((1, 8), 0.1)
    with pytest.raises(ValueError):
        m.observe((1, 8, 0), -1.0)


# --------------------------------------------------------------- meets the target
def streams_and_long_prompts(exit_mode="fixed", long_len=240, n_long=2):
    rng = np.random.default_rng(3)
    reqs = []
    for i in range(4):
        kw = dict(exit_mode="synthetic", synthetic_mean_loops=2.5) if exit_mode == "synthetic" else {}
        sp = SamplingParams(max_tokens=48, ignore_eos=True, seed=i, **({"exit_mode": "fixed"} if not kw else kw))
        reqs.append(dict(rid=f"d{i}", prompt=rng.integers(0, VOCAB, 8).tolist(), sp=sp, arrival=0))
    for i in range(n_long):
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        reqs.append(dict(rid=f"L{i}", prompt=rng.integers(0, VOCAB, long_len).tolist(), sp=sp, arrival=12 + 4 * i))
    for r in reqs:
        r.update(abort_at=None, priority=0)
    return reqs


def config(mode, target_ms, chunk=16, **kw):
    return SchedulerConfig(
        num_loops=4,
        num_blocks=600,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        prefill_chunk_size=chunk,
        max_model_len=320,
        prefill_mode=mode,
        target_tpot_ms=target_ms,
        **kw,
    )


COST = linear_cost(1e-3, 5e-5, 1e-7)  # 1 ms + 50 us per bucket row + 0.1 us per context token


def stream_intervals(h, since: float) -> list[float]:
    out = []
    for rid, times in h.token_times.items():
        if str(rid).startswith("d"):
            out += [b - a for a, b in zip(times, times[1:]) if a >= since]
    return out


@pytest.mark.parametrize("mode", ["split", "mixed", "wavefront"])
def test_fitted_model_keeps_decode_under_the_target(mode):
    target = 12e-3  # 3 ms per loop: a decode-only invocation takes ~1.4 ms, a full 64-row one ~4.2 ms
    reqs = streams_and_long_prompts()
    h, objs, aborted = drive(config(mode, target * 1e3), reqs, COST)
    lt = h.s.latency
    assert lt.model.fitted and lt.forced == 0 and lt.capped > 0
    np.testing.assert_allclose(lt.model.coefficients, (1e-3, 5e-5, 1e-7), rtol=1e-3, atol=1e-9)
    # once the model has its observations and the streams' measured TPOT put them under the cap
    # (split mode: from the start), every token of every stream is on time
    gaps = stream_intervals(h, constrained_since(h))
    assert gaps and max(gaps) <= target * (1 + 1e-9), max(gaps)
    # and the long prompts still got rows next to the streams (not just after them)
    end, clock, rows = max(h.token_times["d0"]), 0.0, 0
    for p in h.plans:
        clock += COST(p)
        if clock <= end:
            rows += sum(r.token_count for r in p.ranges_of(Phase.RECURRENT) if str(r.request_id).startswith("L"))
    assert rows >= 4 * 100, rows  # 100 prompt positions through T = 4 loops
    check_against_reference(h.cfg, objs, aborted)
    # without the target the same workload misses it: the test can fail
    h_off, _, _ = drive(config(mode, None), reqs, COST)
    assert max(stream_intervals(h_off, 0.0)) > target


def test_early_exit_budget_uses_mean_loops():
    """Streams of ~2.5 loops a token may spend more per invocation than fixed-depth ones, once
    both are capped (at 12 ms the early-exit streams meet the target uncapped)."""
    target = 10e-3
    fixed, _, _ = drive(config("wavefront", target * 1e3), streams_and_long_prompts("fixed"), COST)
    early, _, _ = drive(config("wavefront", target * 1e3), streams_and_long_prompts("synthetic"), COST)
    assert early.s.latency.mean_loops < 3.5 and fixed.s.latency.mean_loops == 4

    def rows(h):  # the most rows of a capped invocation
        capped = h.plans[h.constrained_plan :]
        return max(p.num_rows for p in capped if any(r.phase is Phase.DECODE for r in p.ranges))

    assert rows(early) > rows(fixed)
    gaps = stream_intervals(early, constrained_since(early))
    assert np.median(gaps) <= target * (1 + 1e-9)


def test_infeasible_target_gives_prompts_their_minimum_share():
    """A target below the decode-only invocation (1 ms): the policy falls back to giving waiting
    prompts ``min_prompt_share`` of the time instead of a chunk now and then, so the long prompts
    get rows in nearly every invocation and the streams slow by at most ``1 / (1 - share)``."""
    cfg = config("wavefront", 1.0)  # 0.25 ms per loop < the 1 ms of any invocation
    reqs = streams_and_long_prompts(long_len=240)
    h, objs, aborted = drive(cfg, reqs, COST)
    lt = h.s.latency
    assert lt.relaxed > 0 and lt.forced == 0
    assert h.max_no_prompt_run <= 1, h.max_no_prompt_run
    check_against_reference(cfg, objs, aborted)
    # decode alone: 4 streams in the 8-row bucket at < 64 context tokens each: < 1 + 0.4 + 0.03 ms a loop
    bound = 4 * (1e-3 + 8 * 5e-5 + 4 * 64 * 1e-7) / (1 - lt.min_prompt_share)
    gaps = stream_intervals(h, constrained_since(h))
    assert gaps and max(gaps) <= bound * (1 + 1e-9), (max(gaps), bound)
    # with no share at all the old trickle returns: prompts wait starve_after invocations at a time
    cfg0 = dataclasses.replace(cfg)
    h0 = TimedHarness(cfg0, COST)
    h0.s.latency.min_prompt_share = 0.0
    run_workload(cfg0, reqs, harness=h0)
    assert h0.s.latency.forced > 0 and h0.max_no_prompt_run > 1


def test_min_prompt_share_is_checked():
    for bad in (-0.1, 1.0, 2, "x"):
        with pytest.raises(ValueError, match="min_prompt_share"):
            LatencyTarget(1.0, 4, [8, 16], 16, min_prompt_share=bad)


# ------------------------------------------------------------ never starves, same tokens
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    workloads(),
    st.sampled_from([0.05, 0.5, 2.0, 20.0]),  # target, ms: infeasible to loose
    st.tuples(st.floats(0, 1e-3), st.floats(0, 1e-4), st.floats(0, 1e-6)),
    st.booleans(),  # scheduling ahead: fused steps, and token cycles' prompt invocations
)
def test_target_never_starves_prompts_nor_decode_and_keeps_tokens(wl, target_ms, coef, ahead):
    cfg, reqs = wl
    cfg = dataclasses.replace(cfg, target_tpot_ms=target_ms)
    h, objs, aborted = drive(cfg, reqs, linear_cost(*coef), ahead=ahead)
    T = cfg.num_loops
    lt = h.s.latency
    # prompts: a chunk at least every starve_after invocations (a split group in flight, or a
    # decode group of T, or finalize-only invocations may delay it a little more)
    assert h.max_no_prompt_run <= lt.starve_after + 2 * T + 2, h.max_no_prompt_run
    # decode: a decoding request gets a row every invocation (staged) or within a prefill group
    # (split); with fused decode steps, rows held at depth 0 for fusion wait up to T - 1 more
    # invocations once (Scheduler._align_for_fusion)
    hold = T - 1 if cfg.fused_decode_max_rows else 0
    assert h.max_decode_gap <= (T + 2 if cfg.prefill_mode == "split" else 2) + hold, h.max_decode_gap
    check_against_reference(cfg, objs, aborted)


# ------------------------------------------------------------------------- token cycles
def fused_cost(a, a_fused, b, c):
    """``linear_cost`` with ``a_fused`` instead of ``a`` per sub-step of a fused decode step (its
    loops launch no host work of their own: on the H200 they cost less than one-loop invocations)."""

    def cost(plan):
        n, rows, ctx = plan_features(plan)
        return (a_fused if plan.sub_plans is not None else a) * n + b * rows + c * ctx

    return cost


CYCLE_COST = fused_cost(1e-3, 3e-4, 5e-5, 1e-7)


def cycle_workload(long_len=480, n_long=4):
    rng = np.random.default_rng(5)
    reqs = [
        dict(
            rid=f"d{i}",
            prompt=rng.integers(0, VOCAB, 8).tolist(),
            arrival=0,
            sp=SamplingParams(max_tokens=120, ignore_eos=True, seed=i, exit_mode="fixed"),
        )
        for i in range(4)
    ]
    reqs += [
        dict(
            rid=f"L{i}",
            prompt=rng.integers(0, VOCAB, long_len).tolist(),
            arrival=12 + i,
            sp=SamplingParams(max_tokens=1, ignore_eos=True),
        )
        for i in range(n_long)
    ]
    for r in reqs:
        r.update(abort_at=None, priority=0)
    return reqs


def cycle_config(target_ms, **kw):
    return dataclasses.replace(
        config("wavefront", target_ms, fused_decode_max_rows=8), num_blocks=1200, max_model_len=640, **kw
    )


def cycle_gaps(h, target) -> list[float]:
    """Stream d0's token intervals while every long prompt still prefills (after 5 targets of settling)."""
    end = min(max(h.token_times[f"L{i}"]) for i in range(4))
    times = h.token_times["d0"]
    return [b - a for a, b in zip(times, times[1:]) if a >= h.cycle_start + 5 * target and b <= end]


@pytest.mark.parametrize("ahead", [False, True])
def test_token_cycles_hold_the_target_and_keep_tokens(ahead):
    """Fixed-depth streams with fused steps: while prompts prefill, every token is one fused step
    of all streams and prompt-only invocations (the first launched behind the fused step when
    scheduling ahead), whose rows the measured cycles steer to the target. The streams' mean token
    interval settles within 10% of the target, both where one prompt invocation a cycle holds it
    and where the prompts' ready work needs several; the prompts run every cycle; tokens are the
    reference's."""
    rows = {}
    for target in (6e-3, 12e-3):  # a fused token of 4 streams ~2.9 ms; a prompt invocation 1 ms + 50 us a row
        cfg = cycle_config(target * 1e3)
        h, objs, aborted = drive(cfg, cycle_workload(), CYCLE_COST, ahead=ahead)
        lt, st = h.s.latency, h.s.stats()
        check_against_reference(cfg, objs, aborted)
        assert lt.cycles > 20 and lt.cycles_measured > 10 and st["cycle_prompt_invocations"] >= lt.cycles - 1
        if ahead:  # the first prompt invocation of (nearly) every cycle ran behind its fused step
            assert 0.9 * lt.cycles <= h.prompt_ahead <= lt.cycles
        else:
            assert h.prompt_ahead == 0
        gaps = cycle_gaps(h, target)
        assert len(gaps) >= 10, len(gaps)
        assert abs(np.mean(gaps) / target - 1) <= 0.10, (np.mean(gaps), target)
        assert h.max_no_prompt_run <= 1, h.max_no_prompt_run
        rows[target] = (h.prompt_rows_per_cycle(), st["cycle_prompt_invocations"] / lt.cycles)
    # the looser target gives the prompts more rows a cycle, in more than one invocation
    assert rows[12e-3][0] > 1.5 * rows[6e-3][0] and rows[12e-3][1] > 1.5, rows


def test_token_cycles_keep_tokens_against_no_target():
    cfg = cycle_config(6.0)
    h, objs, _ = drive(cfg, cycle_workload(long_len=200), CYCLE_COST, ahead=True)
    h_off, objs_off, _ = drive(cycle_config(None), cycle_workload(long_len=200), CYCLE_COST, ahead=True)
    assert h.s.latency.cycles > 0
    same = lambda o: {rid: (r.output_token_ids, r.exit_depths) for rid, (r, _) in o.items()}  # noqa: E731
    assert same(objs) == same(objs_off)


def test_a_target_the_shared_invocations_meet_runs_no_cycles():
    """A loose target (the shared invocations' ~17 ms a token is within it): the streams never
    leave them, and nothing is capped: every invocation is the one the engine runs without a target."""
    h, objs, aborted = drive(cycle_config(30.0), cycle_workload(long_len=200), CYCLE_COST, ahead=True)
    h_off, _, _ = drive(cycle_config(None), cycle_workload(long_len=200), CYCLE_COST, ahead=True)
    lt = h.s.latency
    assert lt.cycles == 0 and lt.mode_switches == 0 and lt.constrained is False
    assert [(p.kind, p.num_rows) for p in h.plans] == [(p.kind, p.num_rows) for p in h_off.plans]
    check_against_reference(h.cfg, objs, aborted)


@pytest.mark.parametrize("mode", ["mixed", "wavefront"])
def test_a_target_the_uncapped_invocations_meet_caps_nothing(mode):
    """Streams that cannot cycle (no fused steps) and a loose target: the invocations are the ones
    the engine runs without a target, and the prompts lose nothing to it; a tight one caps."""
    reqs = streams_and_long_prompts("synthetic")
    h, objs, aborted = drive(config(mode, 30.0), reqs, COST)
    h_off, _, _ = drive(config(mode, None), reqs, COST)
    lt = h.s.latency
    assert lt.capped == 0 and lt.mode_switches == 0 and lt.constrained is False
    assert [(p.kind, p.num_rows) for p in h.plans] == [(p.kind, p.num_rows) for p in h_off.plans]
    check_against_reference(h.cfg, objs, aborted)
    tight, _, _ = drive(config(mode, 8.0), reqs, COST)
    assert tight.s.latency.capped > 0 and tight.constrained_at is not None


def test_split_mode_caps_from_the_start():
    """Split mode has no window that measures the streams beside the prompts: capped at once."""
    h, _, _ = drive(config("split", 30.0), streams_and_long_prompts(), COST)
    assert h.s.latency.capped > 0 and h.s.latency.mode_switches == 0


def test_cycle_mode_switches_after_a_dwell():
    """Shared invocations missing the target by more than CONSTRAIN_MISS start cycles, cycles
    leaving more than 1 - RELEASE_SLACK of it unused stop them, each after MODE_DWELL tokens."""
    from scheduler.latency_target import CONSTRAIN_MISS, MODE_DWELL, RELEASE_SLACK

    lt = LatencyTarget(0.010, 4, [8, 16], 16)
    for _ in range(MODE_DWELL - 1):
        lt._mode_sample(0.010 * (CONSTRAIN_MISS + 0.05), 1.0)
        assert not lt.constrain(False, True)
    lt._mode_sample(0.010 * (CONSTRAIN_MISS + 0.05), 1.0)
    assert lt.constrain(False, True) and lt.mode_switches == 1
    for _ in range(MODE_DWELL):  # on time: cycles stay
        lt._mode_sample(0.0098, 1.0)
        assert lt.constrain(False, True)
    for _ in range(2 * MODE_DWELL):
        lt._mode_sample(0.010 * (RELEASE_SLACK - 0.1), 1.0)
    assert not lt.constrain(False, True) and lt.mode_switches == 2


def test_streams_of_any_exit_run_token_cycles():
    """Streams that would run fused alone cycle whatever their exits: a gated stream and one of
    synthetic early exit beside two at fixed depth (a fused step runs each row to its own exit,
    in lock step to the deepest)."""
    reqs = cycle_workload(long_len=200)
    reqs[0]["sp"] = SamplingParams(max_tokens=120, ignore_eos=True, seed=0, exit_threshold=0.6)
    reqs[1]["sp"] = SamplingParams(
        max_tokens=120, ignore_eos=True, seed=1, exit_mode="synthetic", synthetic_mean_loops=2.0
    )
    cfg = cycle_config(6.0)
    h, objs, aborted = drive(cfg, reqs, CYCLE_COST)
    assert h.cycle_start is not None and h.cycle_start < max(h.token_times["d0"])
    assert h.s.stats()["cycle_fused_steps"] > 0
    for rid in ("d0", "d1"):  # their tokens exit at several depths
        assert len(set(objs[rid][0].exit_depths[1:])) > 1
    check_against_reference(cfg, objs, aborted)


def test_gated_streams_past_the_fused_gated_rows_use_the_shared_invocations(monkeypatch):
    """More gated streams than ``FUSED_GATED_MAX_ROWS`` would pay the lock step to the deepest gated
    exit every token: they keep the per-invocation cap until the gated stream has finished."""
    import scheduler.scheduler as sched_mod

    monkeypatch.setattr(sched_mod, "FUSED_GATED_MAX_ROWS", 2)
    reqs = cycle_workload(long_len=200)
    reqs[0]["sp"] = SamplingParams(max_tokens=60, ignore_eos=True, seed=0, exit_threshold=0.6)
    cfg = cycle_config(6.0)
    h, objs, aborted = drive(cfg, reqs, CYCLE_COST)
    assert h.s.latency.capped > 0 and h.cycle_start is not None
    assert h.cycle_start >= max(h.token_times["d0"])
    check_against_reference(cfg, objs, aborted)


CYCLES_SEEN = []  # cycles of each example of the test below (some examples must have run them)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(workloads(), st.sampled_from([0.05, 2.0]), st.booleans())
def test_token_cycles_keep_tokens_on_random_workloads(wl, target_ms, ahead):
    """Random workloads (preemption, prefix hits, aborts, stop tokens, priorities, every exit
    rule) with fused steps and no dwell: token cycles start at the first miss, and tokens, exit
    depths and the pool's bookkeeping stay the reference's."""
    import scheduler.latency_target as lt_mod

    cfg, reqs = wl
    assume(cfg.prefill_mode != "split")
    cfg = dataclasses.replace(cfg, target_tpot_ms=target_ms, fused_decode_max_rows=cfg.max_num_seqs)
    dwell, lt_mod.MODE_DWELL = lt_mod.MODE_DWELL, 0
    try:
        h, objs, aborted = drive(cfg, reqs, CYCLE_COST, ahead=ahead)
    finally:
        lt_mod.MODE_DWELL = dwell
    check_against_reference(cfg, objs, aborted)
    CYCLES_SEEN.append(h.s.latency.cycles)


def test_random_workloads_ran_token_cycles():
    """The test above is not vacuous: some of its examples ran token cycles (its examples are
    derandomized, so the count is the same on every run)."""
    CYCLES_SEEN.clear()
    test_token_cycles_keep_tokens_on_random_workloads()
    assert sum(c > 0 for c in CYCLES_SEEN) >= 3, CYCLES_SEEN


def test_split_starvation_counts_invocations_not_decisions():
    """Found by hypothesis: in split mode a lifted cap can arrive while a decode group is in flight
    and the policy cannot start prompt rows; the starvation count must run on until prompt rows
    actually run (it used to restart at the lift, and prompts waited 15 invocations against 14)."""
    cfg = SchedulerConfig(
        num_loops=3,
        num_blocks=43,
        block_size=1,
        max_num_seqs=2,
        max_num_batched_tokens=2,
        prefill_chunk_size=1,
        max_model_len=15,
        prefill_mode="split",
        target_tpot_ms=0.05,
    )
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, exit_threshold=1.0)  # noqa: E731
    reqs = [
        dict(rid=f"r{i}", prompt=[0] * m, sp=sp(n), arrival=0, abort_at=None, priority=0)
        for i, (m, n) in enumerate([(9, 6), (6, 1), (1, 1), (1, 8)])
    ]
    h, objs, aborted = drive(cfg, reqs, linear_cost(0.0009511672726343177, 0.0, 0.0))
    T = cfg.num_loops
    assert h.max_no_prompt_run <= h.s.latency.starve_after + 2 * T + 2, h.max_no_prompt_run
    check_against_reference(cfg, objs, aborted)


@pytest.mark.parametrize("mode", ["split", "mixed", "wavefront"])
@pytest.mark.parametrize("exit_mode", ["fixed", "early"])
def test_target_on_and_off_give_identical_tokens_and_exit_depths(mode, exit_mode, monkeypatch):
    """Capped from the first miss on (no dwell), tokens and exit depths are those of no target."""
    import scheduler.latency_target as lt_mod

    monkeypatch.setattr(lt_mod, "MODE_DWELL", 0)
    rng = np.random.default_rng(7)
    reqs = []
    for i in range(6):
        kw = (
            dict(exit_mode="fixed")
            if exit_mode == "fixed"
            else (dict(exit_mode="synthetic", synthetic_mean_loops=2.0) if i % 2 else dict(exit_threshold=0.6))
        )
        sp = SamplingParams(max_tokens=10, temperature=0.7 * (i % 2), seed=i, **kw)
        n = int(rng.integers(3, 60))
        reqs.append(
            dict(rid=i, prompt=rng.integers(0, VOCAB, n).tolist(), sp=sp, arrival=2 * i, abort_at=None, priority=0)
        )
    out = {}
    for target in (None, 2.0):
        cfg = config(mode, target, chunk=8)
        h, objs, aborted = drive(cfg, reqs, COST)
        check_against_reference(cfg, objs, aborted)
        out[target] = {rid: (req.output_token_ids, req.exit_depths) for rid, (req, _) in objs.items()}
        if target:
            assert h.s.latency.capped > 0, "the target should have limited some invocation"
    assert out[None] == out[2.0]
    if exit_mode == "early":
        assert len({d for toks, depths in out[None].values() for d in depths[1:]}) > 1


def test_target_off_builds_no_latency_state():
    s = Scheduler(config("wavefront", None))
    assert s.latency is None and "target_tpot_ms" not in s.stats()
    s.observe([], 1.0)  # a no-op


# ------------------------------------------------------------------------------ LLM
@pytest.mark.slow
@pytest.mark.parametrize("fused_rows", [0, 4])
def test_llm_plumbs_target_and_measures_invocations(fused_rows, monkeypatch):
    """With fused decode steps the streams run token cycles while a prompt prefills (the pipeline
    launching each cycle's prompt invocation behind its fused step); tokens do not change."""
    import scheduler.latency_target

    monkeypatch.setattr(scheduler.latency_target, "MODE_DWELL", 0)  # a few tokens: cycles at the first miss
    from ouro_jax.llm import LLM
    from weights.config import get_preset
    from weights.random_init import random_params

    cfg = get_preset("tiny")
    params = random_params(cfg, 0)
    kw = dict(
        params=params,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        prefill_chunk_size=8,
        block_size=4,
        max_model_len=64,
        buckets=[32],
        fused_decode_max_rows=fused_rows,
        prefill_mode="wavefront",
        progress=False,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (5, 56, 12)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True, exit_mode="fixed")
    # the third request's penalty defers its fused steps' coda (sampled after launch): timed too
    sps = [sp, sp, dataclasses.replace(sp, presence_penalty=0.5)]
    outs, exes = {}, None
    for target in (None, 0.5):
        llm = LLM(cfg, target_tpot_ms=target, warmup=exes is None, **kw)
        if exes is None:
            exes = llm.runner.executables()
        else:
            llm.runner.adopt(exes)  # same shapes: compile once
        assert llm.scheduler_config.target_tpot_ms == target
        outs[target] = [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, sps, use_tqdm=False)]
        st_ = llm.stats()
        if target is None:
            assert "latency_observations" not in st_
        else:
            assert st_["target_tpot_ms"] == target and st_["latency_observations"] > 0
            assert llm.scheduler.latency.model.num_observations <= st_["invocations"]
            assert (st_["latency_cycles"] > 0) == bool(fused_rows)
            assert st_.get("cycle_prompt_invocations", 0) <= st_["latency_cycles"]
    assert outs[None] == outs[0.5]
    with pytest.raises(ValueError, match="target_tpot_ms"):
        LLM(cfg, target_tpot_ms=-1, **kw)


# ------------------------------------------------------------------------ benchmarks
def _record(mode, chunk, tpot_ms, prompt_tok_s, **kw):
    return dict(
        workload="decode_under_prefill",
        label="decode_under_prefill" + (f" target {kw['target_tpot_ms']:g} ms" if "target_tpot_ms" in kw else ""),
        mode=mode,
        chunk=chunk,
        headline=dict(metric="decode TPOT p50", value=tpot_ms, floor=5.5, fraction=0.5, bound="bandwidth", unit="ms"),
        latency=dict(tpot=dict(p50=1.0)),
        latency_by_tag=dict(decode=dict(tpot=dict(p50=tpot_ms / 1e3)), long=dict(tpot=None)),
        prompt_tok_s=prompt_tok_s + 100.0,
        prompt_tok_s_by_tag=dict(decode=100.0, long=prompt_tok_s),
        tpot_floor=dict(floor_s=5.5e-3, bound="bandwidth", batch_from="tagged streams"),
        **kw,
    )


def synthetic_result():
    recs = [
        _record(m, c, tpot, tput)
        for m, base in (("split", 20.0), ("mixed", 12.0), ("wavefront", 9.0))
        for c, tpot, tput in ((16, base, 4e3), (32, base * 1.3, 6e3), (64, base * 1.8, 9e3), (128, base * 2.5, 12e3))
    ]
    recs += [
        _record("wavefront", 64, 1.05 * 5.5 * k, 3e3 * k, target_tpot_ms=5.5 * k, target_tpot_floor_multiple=float(k))
        for k in (2, 3, 4)
    ]
    recs.append(dict(workload="decode_under_prefill", label="x", mode="mixed", chunk=16, error="boom"))
    return dict(workload="decode_under_prefill", device="cpu", records=recs)


def test_tradeoff_points_from_records():
    from benchmarks.report import tradeoff_points

    pts = tradeoff_points(synthetic_result())
    assert len(pts) == 15  # the failed record is left out
    free = [p for p in pts if p["target_tpot_ms"] is None]
    assert {(p["mode"], p["chunk"]) for p in free} == {(m, c) for m in ("split", "mixed", "wavefront") for c in CH}
    w64 = next(p for p in free if p["mode"] == "wavefront" and p["chunk"] == 64)
    assert w64["tpot_ms"] == pytest.approx(9.0 * 1.8) and w64["prompt_tok_s"] == 9e3  # the long prompts' share
    tgt = sorted((p for p in pts if p["target_tpot_ms"] is not None), key=lambda p: p["target_tpot_ms"])
    assert [p["floor_multiple"] for p in tgt] == [2, 3, 4]
    assert [p["tpot_ms"] for p in tgt] == pytest.approx([1.05 * 5.5 * k for k in (2, 3, 4)])
    assert tgt[0]["tpot_floor_ms"] == pytest.approx(5.5)


CH = (16, 32, 64, 128)


def test_tradeoff_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.report import plot_tradeoff

    path = plot_tradeoff(synthetic_result(), str(tmp_path / "t.png"))
    assert path and os.path.getsize(path) > 1000
    # a workload without decode streams has no such plot
    res = synthetic_result()
    for r in res["records"]:
        r.pop("latency_by_tag", None)
    assert plot_tradeoff(res, str(tmp_path / "none.png")) is None


def test_run_targets_and_their_fields():
    from types import SimpleNamespace

    from benchmarks import run
    from benchmarks.floors import decode_step_floor
    from benchmarks.workloads import make
    from weights.config import get_preset

    a = run.parser().parse_args(
        ["--workload", "decode_under_prefill", "--target-tpot-ms", "20", "--target-tpot-floor-multiple", "2", "3"]
    )
    cfg = get_preset("tiny")
    (wl,) = make("decode_under_prefill", cfg.vocab_size, 0.02, 0.05, 0)
    assert run.targets_of(a, wl) == [None, ("ms", 20.0), ("floor", 2.0), ("floor", 3.0)]
    (long4,) = make("long4", cfg.vocab_size, 0.02, 0.05, 0)[:1]
    assert run.targets_of(a, long4) == [None]  # no decode streams: no target runs
    h = SimpleNamespace(config=cfg, bw=4.8e12, peak=9.9e14)
    floor = run.Harness.tpot_floor_s(h, wl)
    streams = [s for s in wl.requests if s.tag == "decode"]
    ctx = float(np.mean([s.num_prompt_tokens + s.params.max_tokens / 2 for s in streams]))
    assert floor == decode_step_floor(cfg, len(streams), ctx, cfg.num_loops, h.bw, h.peak)["floor_s"]
    h.tpot_floor_s = lambda w: floor
    tf = run.target_fields(h, wl, ("floor", 3.0))
    assert tf == dict(target_tpot_ms=3 * floor * 1e3, target_tpot_floor_multiple=3.0, target_tpot_floor_ms=floor * 1e3)
    assert run.target_suffix(tf) == " target 3x floor"
    assert run.target_fields(h, wl, ("ms", 20.0)) == dict(target_tpot_ms=20.0)
    assert run.target_fields(h, wl, None) == {} and run.target_suffix({}) == ""
    with pytest.raises(SystemExit, match="positive"):
        run.main(["--workload", "decode_under_prefill", "--target-tpot-ms", "-1"])


@pytest.mark.slow
def test_run_records_carry_the_target(tmp_path):
    from benchmarks import run

    out = str(tmp_path)
    argv = ["--workload", "decode_under_prefill", "--preset", "tiny", "--scale", "0.02", "--count-scale", "0.05"]
    argv += ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--buckets", "8", "64", "--no-progress"]
    argv += ["--mode", "wavefront", "--chunk", "16", "--target-tpot-floor-multiple", "3", "--out", out, "--no-plot"]
    argv += ["--quick-ceilings"]
    res = run.main(argv)["decode_under_prefill"]
    recs = {r["label"]: r for r in res["records"]}
    assert set(recs) == {"decode_under_prefill", "decode_under_prefill target 3x floor"}, list(recs)
    r = recs["decode_under_prefill target 3x floor"]
    assert "error" not in r, r.get("error")
    assert r["target_tpot_ms"] == pytest.approx(3 * r["target_tpot_floor_ms"])
    assert "target_tpot_ms" not in recs["decode_under_prefill"]
    assert set(r["prompt_tok_s_by_tag"]) == {"decode", "long"}
    for t in ("decode", "long"):  # work done includes whatever prompts got their token
        assert r["prompt_work_tok_s_by_tag"][t] >= r["prompt_tok_s_by_tag"][t] - 1e-9
    # the policy's end state travels with the record (only where a target ran)
    assert r["latency_policy"]["latency_observations"] > 0
    assert {"latency_capped", "latency_relaxed", "latency_coefficients"} <= set(r["latency_policy"])
    assert "latency_policy" not in recs["decode_under_prefill"]


def test_kv_tokens_counts_one_pass_per_query_tile():
    """The cost model's context feature is what attention reads: a decode row its context, a
    prompt segment its context once per tile of ``KV_TILE_ROWS`` rows (not once per row)."""
    from scheduler.latency_target import KV_TILE_ROWS, kv_tokens

    assert kv_tokens(999, 1) == 1000  # a decode row at position 999
    assert kv_tokens(1000, 16) == 1016  # a 16-row chunk reads through its last row once
    assert kv_tokens(0, KV_TILE_ROWS + 44) == KV_TILE_ROWS + (KV_TILE_ROWS + 44)
    assert kv_tokens(5, 0) == 0


def test_tradeoff_prefers_prompt_work_over_finished_prompts():
    """Long prompts aborted when the decode streams end did prompt work that no first token shows:
    the trade-off counts that work where the record has it."""
    from benchmarks.report import tradeoff_points

    res = synthetic_result()
    rec = next(r for r in res["records"] if "error" not in r)
    rec["prompt_tok_s_by_tag"] = dict(rec["prompt_tok_s_by_tag"], long=0.0)
    rec["prompt_work_tok_s_by_tag"] = {"decode": 10.0, "long": 1234.0}
    pts = tradeoff_points(res)
    assert any(p["prompt_tok_s"] == 1234.0 for p in pts)


def test_prompt_work_counts_the_loops_an_unfinished_prompt_ran():
    """``prompt_work``: the mean of the prefill frontiers over depths, 0 for a waiting request."""
    from benchmarks.run import prompt_work
    from benchmarks.sweep_buckets import SimEngine

    cfg = SchedulerConfig(
        num_loops=4, block_size=4, num_blocks=256, max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8,
        max_model_len=256, prefill_mode="wavefront",
    )  # fmt: skip
    eng = SimEngine(cfg)
    eng.add_request(np.arange(1, 101, dtype=np.int32), SamplingParams(max_tokens=2, ignore_eos=True), request_id="a")
    assert prompt_work(eng, "a") == 0.0  # not admitted yet
    assert prompt_work(eng, "nobody") == 0.0
    for _ in range(3):
        eng.step()
    req = eng.scheduler.get_request("a")
    f = req.prefill_depth_frontiers
    work = prompt_work(eng, "a")
    assert work == pytest.approx(sum(f) / len(f)) and 0 < work < 100
