"""Fused decode steps whose rows advance independently (``fused_decode_rows="independent"``).

Each row runs its own tokens' depths inside the step instead of every token waiting for its
deepest row (``ouro_jax/fused_step.py``). Nothing a user sees may change: token ids, exit
depths and finish reasons equal the loop-by-loop engine's and the lock-step engine's, and so does
every K/V value written (the same slots, finalize copies included). What changes is the loops the device
runs: the scheduler counts, per step, the loops of the row with the most of them (``loops_run``),
never more than lock step, and fewer when rows exit at different depths.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.metrics import ScheduleRecorder
from ouro_jax import LLM, SamplingParams, get_preset
from scheduler import SchedulerConfig
from scheduler.descriptor import FUSED_DECODE_ROWS, BatchDescriptor, StackedDescriptor
from tests.engine.test_fused_decode import CFG, _engine  # noqa: E402
from tests.engine.test_fused_exit import MIXED, PROMPTS, Recorder, _cfg, _mixed_requests, _outputs, _run  # noqa: E402
from tests.scheduler.test_invariants import check_against_reference, run_workload  # noqa: E402

T = 4
# test_fused_exit's early-exit rules without the fixed-depth row and the 0.9 threshold (on the tiny
# model nearly always the deepest loop), and synthetic depths, drawn per token on the host, for
# rows whose deepest tokens fall at different places: a row that is deepest at every token makes
# lock step and independent rows run the same loops
EARLY = [kw for kw in MIXED if kw.get("exit_mode") != "fixed" and kw.get("exit_threshold") != 0.9]
EARLY += [dict(exit_mode="synthetic", synthetic_mean_loops=m, temperature=0.7) for m in (1.5, 3.0)]
assert len(EARLY) <= len(PROMPTS)


def _fused_plans(plans):
    return [p for p in plans if p.sub_plans]


def _slowest_loops(deltas) -> int:
    """Loops of the row with the most of them over the step's tokens, from the exit depths handed
    out (a row ended mid-step by a stop token still ran its later tokens: only counted when the
    step's every token was handed out for it)."""
    return max(sum(d + 1 for d in dl.new_exit_depths) for dl in deltas)


# ------------------------------------------------------------------ scheduler + fake runner
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_independent_rows_change_no_token_and_count_fewer_loops(layout, tokens):
    reqs = [
        dict(r, sp=SamplingParams(max_tokens=13, seed=r["rid"], **EARLY[r["rid"] % len(EARLY)]))
        for r in _mixed_requests()
    ]
    runs = {}
    for rows in ("lockstep", "independent"):
        h = Recorder(_cfg(layout, tokens, fused_decode_rows=rows))
        h, objs, aborted = run_workload(h.cfg, reqs, harness=h)
        check_against_reference(h.cfg, objs, aborted)
        runs[rows] = (h, objs)
    (hl, lock), (hi, ind) = runs["lockstep"], runs["independent"]
    assert _outputs(lock) == _outputs(ind)
    fl, fi = _fused_plans(hl.plans), _fused_plans(hi.plans)
    assert len(fl) == len(fi) > 0  # the same steps are fused: only their loop counts differ
    sl, si = hl.s.stats(), hi.s.stats()
    for p, deltas in hi.fused_deltas:
        runs_ = p.descriptor.loops_run
        assert len(runs_) == p.descriptor.num_tokens and all(1 <= r <= T for r in runs_)
        if all(len(dl.new_exit_depths) == p.descriptor.num_tokens for dl in deltas):
            assert sum(runs_) == _slowest_loops(deltas)
    for p, deltas in hl.fused_deltas:  # lock step: each token its deepest row
        if all(len(dl.new_exit_depths) == p.descriptor.num_tokens for dl in deltas):
            assert p.descriptor.loops_run == [
                max(dl.new_exit_depths[j] for dl in deltas) + 1 for j in range(len(p.descriptor.loops_run))
            ]
    assert si["fused_loops"] == sum(x for p in fi for x in p.descriptor.loops_run)
    assert si["invocations"] == si["launches"] - len(fi) + si["fused_loops"]
    if tokens == 1:
        assert si["fused_loops"] == sl["fused_loops"]  # one token a step: the slowest row is the deepest
    else:
        assert si["fused_loops"] < sl["fused_loops"]
    # the benchmarks' floors price the loops that ran
    rec = ScheduleRecorder(get_preset("tiny"))
    for p in hi.plans:
        rec.observe(p.descriptor)
    assert rec.total().invocations == si["invocations"]


def test_option_is_checked():
    with pytest.raises(ValueError, match="fused_decode_rows"):
        SchedulerConfig(
            num_loops=T, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=8, fused_decode_rows="ragged"
        )
    assert (
        SchedulerConfig(num_loops=T, num_blocks=16, fused_decode_rows="Independent").fused_decode_rows == "independent"
    )
    with pytest.raises(ValueError, match="fused_decode_rows"):
        LLM("tiny", fused_decode_rows="per_row", warmup=False, progress=False)
    # elastic steps were removed (slower on the H200 in every configuration measured)
    with pytest.raises(ValueError, match="fused_decode_rows"):
        SchedulerConfig(num_loops=T, num_blocks=16, fused_decode_rows="elastic")


# ------------------------------------------------------------------------ the JAX engine
def _early_params(stops=None):
    stops = stops or {}
    return [
        SamplingParams(max_tokens=9, ignore_eos=True, seed=i, stop_token_ids=stops.get(i, ()), **kw)
        for i, kw in enumerate(EARLY)
    ]


@pytest.mark.parametrize("layout", ["last_exited", pytest.param("shared", marks=pytest.mark.slow)])
def test_engine_independent_equals_lockstep_and_loop_by_loop(layout):
    """The JAX program: tokens, exit depths and finish reasons of the loop-by-loop engine with a
    stop token met mid-step; the KV pools bit for bit those of the lock-step program after the same
    requests (same slots written with the same values, finalize copies included); fewer loops run;
    nothing compiled after start-up."""
    plain = _engine(kv_layout=layout, fused_decode_max_rows=0)
    first = _run(plain, _early_params())
    sp = _early_params({1: (first[1][0][4],)})
    want = _run(plain, sp)
    assert want[1][2] == "stop"
    assert len({d for t in want for d in t[1][1:]}) > 1, "the gates give one depth: a weak test"
    engines = {}
    for rows in FUSED_DECODE_ROWS:
        llm = _engine(kv_layout=layout, fused_decode_max_rows=4, fused_decode_tokens=4, fused_decode_rows=rows)
        assert _run(llm, sp) == want, rows
        engines[rows] = llm
    lock, ind = engines["lockstep"], engines["independent"]
    assert ind.runner.fused_decode_rows == "independent"
    for pool in ("k_pool", "v_pool"):
        assert np.array_equal(np.asarray(getattr(lock.runner, pool)), np.asarray(getattr(ind.runner, pool)))
    sl, si = lock.stats(), ind.stats()
    assert si["fused_launches"] == sl["fused_launches"] > 0
    assert si["fused_loops"] <= sl["fused_loops"]
    if layout == "last_exited":  # (SHARED's fused steps here happen to have one deepest row each)
        assert si["fused_loops"] < sl["fused_loops"]
    assert si["compilations"] == len(ind.executable_keys())  # all at start-up, nothing since
    assert si["free_blocks"] == ind.scheduler_config.num_blocks - 1
    # a different program: the executable store keeps the two apart
    assert lock.runner._program_description() != ind.runner._program_description()
    # a runner refuses a step built for another program, before anything runs
    bucket, n = next(k for k in lock.executable_keys() if isinstance(k, tuple) and len(k) == 2)
    steps = [BatchDescriptor(bucket) for _ in range(n)]
    wrong = StackedDescriptor(steps, T, tuple(np.zeros((n // T, 0)) for _ in range(4)), rows="independent")
    with pytest.raises(ValueError, match="fused_decode_rows='independent' on a runner compiled for 'lockstep'"):
        lock.runner.step(wrong)


# ------------------------------------------------------------------ random batches, one pair of engines
_PAIR: dict = {}
_IDS = iter(range(10**9))


def _pair():
    """A lock-step and an independent engine of the same shapes, built once for every example:
    they see the same requests in the same order and run the same steps, so their pools must stay
    equal throughout (no stop tokens here: nothing runs past a request's end)."""
    if not _PAIR:
        for rows in FUSED_DECODE_ROWS:
            _PAIR[rows] = _engine(fused_decode_max_rows=4, fused_decode_tokens=3, fused_decode_rows=rows)
    return tuple(_PAIR[rows] for rows in FUSED_DECODE_ROWS)


@st.composite
def _batches(draw):
    n = draw(st.integers(1, 3))  # and the companion every batch gets (_COMPANION): 4 streams at most
    rule = st.sampled_from(
        [
            dict(exit_mode="ouro", exit_threshold=0.3),
            dict(exit_mode="ouro", exit_threshold=0.6),
            dict(exit_mode="delayed", exit_threshold=0.5),
            dict(exit_mode="synthetic", synthetic_mean_loops=1.8),
            dict(exit_mode="synthetic", synthetic_mean_loops=3.2),
            dict(exit_mode="fixed"),
            dict(exit_mode="ouro", exit_threshold=0.5, min_loops=2, max_loops=3),
        ]
    )
    prompts = [draw(st.lists(st.integers(1, CFG.vocab_size - 1), min_size=1, max_size=20)) for _ in range(n)]
    sps = [
        SamplingParams(
            max_tokens=draw(st.integers(1, 10)),
            ignore_eos=True,
            temperature=draw(st.sampled_from([0.0, 0.9])),
            seed=draw(st.integers(0, 5)),
            **draw(rule),
        )
        for _ in range(n)
    ]
    return prompts, sps


# A request in every random batch, so that each example decodes fused: no example is vacuous. It
# must still have tokens once no prompt is waiting (then every step may be fused), whatever the
# synthetic depths its request id draws. The batch's prompts are at most 3 x 20 tokens, 9 chunks
# of at most 8, so 36 chunk-loops of prefill; every invocation while a prompt waits runs one of
# them at least, and at most one decode invocation comes between two of them (split), so the
# companion gets at most 36 loops, hence 36 tokens, before the last prompt is in, and 44 leave it
# 8 (3 + 44 <= max_model_len 48). With 7 it could finish first: CI drew two 1-token requests
# behind long prompts, and the example had no fused step.
_COMPANION = (
    [5, 9, 2],
    SamplingParams(max_tokens=44, ignore_eos=True, exit_mode="synthetic", synthetic_mean_loops=2.0),
)


def _serve(llm, prompts, sps, ids):
    for i, p, sp in zip(ids, prompts, sps):
        llm.add_request(p, sp, request_id=i)
    final = {}
    while len(final) < len(ids):
        final.update((o.request_id, o) for o in llm.step() if o.finished)
    return [(final[i].token_ids, final[i].exit_depths) for i in ids]


@pytest.mark.slow  # one pair of engines, then a few seconds an example on a CPU
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_random_batches_equal_lockstep_token_for_token_and_in_the_pools(case):
    """Independent rows against lock step on random batches."""
    prompts, sps = case
    prompts, sps = prompts + [_COMPANION[0]], sps + [_COMPANION[1]]
    lock, ind = _pair()
    ids = [next(_IDS) for _ in prompts]  # synthetic depths follow the request id: the same in all
    before = (lock.stats()["fused_loops"], ind.stats()["fused_loops"])
    launches = [e.stats()["fused_launches"] for e in (lock, ind)]
    want = _serve(lock, prompts, sps, ids)
    assert _serve(ind, prompts, sps, ids) == want
    for pool in ("k_pool", "v_pool"):
        ref = np.asarray(getattr(lock.runner, pool))
        assert np.array_equal(ref, np.asarray(getattr(ind.runner, pool)))
    assert ind.stats()["fused_loops"] - before[1] <= lock.stats()["fused_loops"] - before[0]
    assert ind.stats()["compilations"] == len(ind.executable_keys())
    # every engine ran fused steps in this example (the companion's tokens at least)
    assert all(e.stats()["fused_launches"] > n for e, n in zip((lock, ind), launches))


@pytest.mark.slow  # three engines on a CPU, ~20 s
def test_async_arrivals_aborts_and_stops_with_independent_rows():
    """Steps of two tokens launched ahead of the host's reads, with a request arriving mid-run, one
    aborted and a stop token met mid-step: the tokens, exit depths and finish reasons of the
    synchronous lock-step engine; nothing in flight and every block free at the end."""
    from tests.engine.test_fused_decode import _drive

    sp = [
        SamplingParams(max_tokens=9, ignore_eos=True, exit_mode="synthetic", synthetic_mean_loops=2.0),
        SamplingParams(max_tokens=7, ignore_eos=True, exit_threshold=0.5, temperature=0.8, seed=3),
        SamplingParams(max_tokens=8, ignore_eos=True, exit_mode="synthetic", synthetic_mean_loops=3.0),
        SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.3),
        SamplingParams(max_tokens=12, ignore_eos=True, exit_mode="fixed"),
    ]
    plan = {0: [("add", 0), ("add", 1), ("add", 2)], 9: [("add", 3)], 11: [("add", 4)], 14: [("abort", 4)]}
    sync = _engine(fused_decode_max_rows=4, fused_decode_tokens=2, async_scheduling=False)
    first = _drive(sync, plan, sp)
    sp[0] = dataclasses.replace(sp[0], stop_token_ids=(first[0].token_ids[3],))
    want = _drive(sync, plan, sp)
    assert want[0].finish_reason == "stop"
    llm = _engine(fused_decode_max_rows=4, fused_decode_tokens=2, fused_decode_rows="independent")
    got = _drive(llm, plan, sp)
    final = lambda o: (o.token_ids, o.exit_depths, o.finish_reason)  # noqa: E731
    assert [final(got[i]) for i in range(4)] == [final(want[i]) for i in range(4)]
    assert got[4].finish_reason == "abort"
    st = llm.stats()
    assert st["ahead_launches"] > 0 and st["fused_launches"] > st["ahead_launches"]
    assert st["free_blocks"] == llm.scheduler_config.num_blocks - 1
    assert not llm._pipeline.pending and llm.scheduler._inflight is None
