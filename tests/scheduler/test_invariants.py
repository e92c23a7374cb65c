"""Scheduler invariants under random workloads, run against the numpy fake runner.

Every plan is checked as it is produced (budgets, readiness, ring rows, descriptor rows) and every
run is compared with the fake model's dense reference, so exit depths and tokens must be the same
whatever the prefill mode, chunk size, buckets, arrival order or aborts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from scheduler import Phase, Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from scheduler.fake_runner import FakeRunner
from scheduler.speculation import SpeculativeConfig
from tests.scheduler.conftest import VOCAB, check_against_reference, run_workload, workloads


@pytest.mark.slow  # 150 random workloads; the fixed cases below stay in the default run
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans(), st.booleans())
def test_random_workloads_keep_invariants_and_match_reference(wl, lazy, ahead):
    cfg, reqs = wl
    h, objs, aborted = run_workload(cfg, reqs, lazy=lazy, ahead=ahead)
    # every prompt position of a request that finished normally ran every depth exactly once
    for rid, (req, r) in objs.items():
        if rid in aborted or req.num_preemptions or req.num_cached_tokens:
            continue
        for p in range(len(r["prompt"])):
            for dd in range(cfg.num_loops):
                assert h.prompt_runs[(rid, p, dd)] == 1, (rid, p, dd)
    check_against_reference(cfg, objs, aborted)
    if lazy:  # results are read only when the plan said it might need them
        by_step = {p.step: p for p in h.plans}
        for step, which in h.reads:
            p = by_step[step]
            assert p.needs_gates if which == "gates" else p.needs_tokens


@pytest.mark.parametrize("mode", ["split", "mixed", "wavefront"])
@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_modes_and_chunks_give_identical_tokens_and_exit_depths(mode, chunk):
    rng = np.random.default_rng(1)
    T = 4
    reqs = []
    for i in range(6):
        sp = SamplingParams(
            max_tokens=8,
            exit_threshold=0.6 if i % 3 < 2 else 1.0,  # synthetic depths read no threshold
            exit_mode=["ouro", "delayed", "synthetic"][i % 3],
            synthetic_mean_loops=2.5 if i % 3 == 2 else None,
            temperature=0.7 * (i % 2),
            seed=i,
        )
        reqs.append(
            dict(
                rid=i,
                prompt=rng.integers(0, VOCAB, size=int(rng.integers(3, 40))).tolist(),
                sp=sp,
                arrival=i,
                abort_at=None,
                priority=0,
            )
        )
    cfg = SchedulerConfig(
        num_loops=T,
        num_blocks=400,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        prefill_chunk_size=chunk,
        max_model_len=64,
        prefill_mode=mode,
    )
    h, objs, aborted = run_workload(cfg, reqs)
    check_against_reference(cfg, objs, aborted)
    depths = [d for req, _ in objs.values() for d in req.exit_depths[1:]]
    assert len(set(depths)) > 1, "the workload should exercise early exits"
    st_ = h.s.stats()
    assert st_["invocations"] == len(h.plans)
    assert st_["real_rows"] == sum(p.num_rows for p in h.plans)
    assert st_["padded_rows"] == sum(p.descriptor.key.R - p.num_rows for p in h.plans)
    assert st_["tokens"] == sum(len(req.output_token_ids) for req, _ in objs.values())
    assert st_["host_time_s"] > 0 and st_["free_blocks"] == cfg.num_blocks - 1


def test_shared_layout_runs_prompts_position_by_position():
    T = 3
    reqs = [
        dict(
            rid=i,
            prompt=list(range(10 + i, 20 + 2 * i)),
            sp=SamplingParams(max_tokens=4, exit_threshold=0.5),
            arrival=0,
            abort_at=None,
            priority=0,
        )
        for i in range(3)
    ]
    for mode in ("split", "mixed"):
        cfg = SchedulerConfig(
            num_loops=T,
            num_blocks=64,
            block_size=4,
            max_num_seqs=3,
            max_num_batched_tokens=8,
            prefill_chunk_size=4,
            max_model_len=40,
            kv_layout="shared",
            prefill_mode=mode,
        )
        h, objs, aborted = run_workload(cfg, reqs)
        check_against_reference(cfg, objs, aborted)
        for plan in h.plans:
            for r in plan.ranges_of(Phase.RECURRENT):
                assert r.token_count == 1  # one position at a time, all its loops before the next
        assert all(len(plan.finalize) == 0 for plan in h.plans)


def test_wavefront_fills_more_rows_than_split_at_small_chunk():
    """Four long prompts, chunk 16: split runs 4 x 16 rows per invocation, wavefront keeps up to
    T chunks of every prompt in flight (engine-semantics.md; the RFC measured 64 vs 254 rows)."""
    rows = {}
    for mode in ("split", "wavefront"):
        cfg = SchedulerConfig(
            num_loops=4,
            num_blocks=4 * 4 * 40 + 1,
            block_size=16,
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            prefill_chunk_size=16,
            max_model_len=1024,
            prefill_mode=mode,
        )
        s = Scheduler(cfg)
        fr = FakeRunner(cfg.num_blocks, cfg.block_size, cfg.num_ring_rows, VOCAB, check=False)
        for i in range(4):
            s.add_request(Request(i, np.arange(512) % VOCAB, SamplingParams(max_tokens=1)))
        while s.has_unfinished():
            plan = s.schedule()
            res = fr.step(plan.descriptor)
            s.update(plan, res.gates, res.tokens)
        st_ = s.stats()
        rows[mode] = st_["prefill_rows"] / st_["invocations"]
    assert rows["split"] == 64
    assert rows["wavefront"] > 3.5 * rows["split"], rows


def test_decode_refill_and_exit_at_loop_level():
    """A row that exits frees its place: the next token starts at depth 0 in the next invocation,
    and its KV finalize pairs run in that invocation's step 1."""
    T = 4
    cfg = SchedulerConfig(
        num_loops=T,
        num_blocks=64,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        prefill_chunk_size=8,
        max_model_len=32,
        prefill_mode="mixed",
    )
    s = Scheduler(cfg)
    sp = SamplingParams(max_tokens=4, exit_mode="synthetic", synthetic_depths=[3, 1, 0, 2])
    req = Request("a", [1, 2, 3], sp)
    s.add_request(req)
    fr = FakeRunner(cfg.num_blocks, cfg.block_size, cfg.num_ring_rows, VOCAB)
    trace = []
    while s.has_unfinished():
        plan = s.schedule()
        trace.append(
            [(r.phase, r.depth) for r in plan.ranges if r.phase is not Phase.PRELUDE] + [("fin", len(plan.finalize))]
        )
        res = fr.step(plan.descriptor)
        s.update(plan, res.gates, res.tokens)
    D, R = Phase.DECODE, Phase.RECURRENT
    assert trace == [
        [(R, 0), ("fin", 0)],
        [(R, 1), ("fin", 0)],
        [(R, 2), ("fin", 0)],
        [(R, 3), ("fin", 0)],  # prompt
        [(D, 0), ("fin", 0)],
        [(D, 1), ("fin", 0)],  # token 0 runs loops 0..1: token 1 exits at depth 1
        [(D, 0), ("fin", 2)],  # token 1 starts at once; planes 2, 3 finalized first
        [(D, 0), ("fin", 3)],  # token 1 exits at depth 0: planes 1..3 finalized
        [(D, 1), ("fin", 0)],
        [(D, 2), ("fin", 0)],  # token 2 exits at depth 2, the last token
    ]
    assert req.exit_depths == [3, 1, 0, 2]
    assert s.block_manager.num_used_blocks == 0


def test_abort_frees_everything_at_once_even_with_a_plan_in_flight():
    cfg = SchedulerConfig(
        num_loops=2,
        num_blocks=40,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        prefill_chunk_size=4,
        max_model_len=40,
        prefill_mode="wavefront",
    )
    s = Scheduler(cfg)
    fr = FakeRunner(cfg.num_blocks, cfg.block_size, cfg.num_ring_rows, VOCAB)
    a, b = (
        Request("a", list(range(20)), SamplingParams(max_tokens=3)),
        Request("b", [5, 6], SamplingParams(max_tokens=3)),
    )
    s.add_request(a)
    s.add_request(b)
    plan = s.schedule()
    used = s.block_manager.num_used_blocks
    delta = s.abort("a")
    assert delta.finished and delta.finish_reason == "abort" and a.status is RequestStatus.FINISHED_ABORTED
    assert s.block_manager.num_used_blocks < used and a.batch_slot is None
    res = fr.step(plan.descriptor)
    s.update(plan, res.gates, res.tokens)  # the in-flight plan skips "a"
    assert s.abort("a") is None and s.abort("nope") is None
    while s.has_unfinished():
        plan = s.schedule()
        res = fr.step(plan.descriptor)
        s.update(plan, res.gates, res.tokens)
    assert b.finish_reason == "length" and len(b.output_token_ids) == 3
    assert s.block_manager.num_free_blocks == cfg.num_blocks - 1


# ------------------------------------------------------------------ self-speculative decoding
@st.composite
def speculative_workloads(draw):
    """``workloads()`` with rounds on (LAST_EXITED, fused decode steps, ``d`` and ``k`` drawn), and
    the fake model's vocabulary: a small one makes drafts agree by chance, so rounds keep tokens."""
    cfg, reqs = draw(workloads())
    T = cfg.num_loops
    assume(T >= 2 and cfg.kv_layout == "last_exited")
    spec = SpeculativeConfig(draw(st.integers(1, T - 1)), draw(st.integers(1, 3)))
    try:
        cfg = dataclasses.replace(cfg, fused_decode_max_rows=cfg.max_num_seqs, speculative_config=spec)
    except ValueError:  # a ring region smaller than a round's positions
        assume(False)
    return cfg, reqs, draw(st.sampled_from([2, 3, VOCAB]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(speculative_workloads(), st.booleans())
def test_rounds_under_random_workloads_keep_invariants_and_match_reference(wl, ahead):
    """Rounds beside prompts, plain and fused steps, preemption, aborts and the prefix cache:
    tokens and exit depths are the reference's, every block and ring region comes back."""
    cfg, reqs, vocab = wl
    h, objs, aborted = run_workload(cfg, reqs, ahead=ahead, vocab=vocab)
    check_against_reference(cfg, objs, aborted, vocab)
    st_ = h.s.stats()
    assert st_["spec_rounds"] == h.rounds
    assert st_["spec_accepted_tokens"] <= st_["spec_proposed_tokens"]
    # tokens rounds emitted: no more than they kept (those past a request's end are dropped)
    assert st_["spec_emitted_tokens"] <= st_["spec_round_tokens"]
    assert st_["spec_emitted_tokens"] <= st_["tokens"]


@pytest.mark.parametrize("exit_mode", ["fixed", "ouro"])
def test_rounds_keep_tokens_where_drafts_agree_and_where_they_do_not(exit_mode):
    """Three requests, two arriving while the first decodes: rounds run on the loop-by-loop path
    beside their prompt chunks, then fused once all decode. On a vocabulary of 2 drafts agree half
    the time (rounds give several tokens each); on 101 they rarely do (RoundPolicy stops most)."""
    T = 4
    params = [
        SamplingParams(
            max_tokens=40,
            ignore_eos=True,
            exit_mode=exit_mode,
            exit_threshold=0.6 if exit_mode == "ouro" else 1.0,
            temperature=t,
        )
        for t in (0.0, 0.0, 0.8)
    ]
    # the later two arrive while the first decodes: their prompt chunks run beside its rounds
    reqs = [
        dict(rid=f"r{i}", prompt=list(range(3 + i, 3 + i + 4 + 6 * i)), sp=p, arrival=6 * i, abort_at=None, priority=0)
        for i, p in enumerate(params)
    ]
    stats = {}
    for vocab in (2, VOCAB):
        cfg = SchedulerConfig(
            num_loops=T,
            num_blocks=1 + 3 * T * 14,
            block_size=4,
            max_num_seqs=3,
            max_num_batched_tokens=16,
            prefill_chunk_size=8,
            max_model_len=56,
            fused_decode_max_rows=3,
            speculative_config=SpeculativeConfig(draft_loops=1, num_speculative_tokens=3),
        )
        h, objs, aborted = run_workload(cfg, reqs, vocab=vocab)
        check_against_reference(cfg, objs, aborted, vocab)
        stats[vocab] = st_ = h.s.stats()
        assert h.rounds == st_["spec_rounds"] > 0
    agree, differ = stats[2], stats[VOCAB]
    assert agree["spec_loop_rounds"] > 0 and agree["spec_rounds"] > 0
    # (positions that exit within the draft's loops count as accepted: the gate rule's are many)
    assert agree["spec_acceptance"] > differ["spec_acceptance"] and agree["spec_mean_accepted_length"] > 1.5
    assert differ["spec_declined_steps"] > agree["spec_declined_steps"]
    assert differ["spec_rounds"] < agree["spec_rounds"]
