"""Clear errors for bad sampling parameters, bad configs, impossible requests and API misuse."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
        (dict(stop_token_ids=[3, -1]), "stop_token_ids"),
        (dict(min_loops=0), "min_loops"),
        (dict(min_loops=3, max_loops=2), "min_loops=3 exceeds max_loops=2"),
        (dict(max_loops=5), "exceeds the model's number of loops T=4"),
        (dict(max_loops=0), "max_loops"),
        (dict(exit_threshold=-0.5), "exit_threshold"),
        (dict(exit_threshold=float("nan")), "exit_threshold"),
        (dict(exit_threshold=1.5), "exit_threshold"),
        (dict(exit_mode="early"), "exit_mode"),
        (dict(exit_mode="synthetic"), "exactly one of"),
        (dict(exit_mode="synthetic", synthetic_mean_loops=2.0, synthetic_depths=[1]), "exactly one of"),
        (dict(exit_mode="synthetic", synthetic_mean_loops=5.0), "synthetic_mean_loops"),
        (dict(exit_mode="synthetic", synthetic_mean_loops=float("nan")), "synthetic_mean_loops"),
        (dict(exit_mode="synthetic", synthetic_depths=[]), "must not be empty"),
        (dict(exit_mode="synthetic", synthetic_depths=[4]), "synthetic_depths"),
        (dict(synthetic_mean_loops=2.0), "only meaningful"),
        (dict(stop_token_ids=[True]), r"stop_token_ids must be non-negative integers \(not bools\), got True"),
        (dict(stop_token_ids=[3, 50]), r"stop_token_ids: 50 is outside the vocabulary \[0, 50\)"),
        # settings the exit mode would not read
        (dict(exit_mode="fixed", exit_threshold=0.5), "exit_threshold=0.5 is read only by exit_mode 'ouro' or"),
        (dict(exit_mode="synthetic", synthetic_mean_loops=2.0, exit_threshold=0.5), "exit_threshold=0.5"),
        (dict(exit_mode="fixed", min_loops=2), "min_loops=2 has no effect with exit_mode='fixed'"),
    ],
)
def test_sampling_params_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).validate(4, vocab_size=50)


def test_sampling_params_defaults_are_valid_and_hashable():
    p = SamplingParams(stop_token_ids=[1, 2])
    p.validate(4)
    assert p.stop_token_ids == (1, 2) and hash(p) == hash(SamplingParams(stop_token_ids=(1, 2)))
    assert p.resolved_max_loops(4) == 4
    SamplingParams(exit_mode="synthetic", synthetic_depths=[0, 3]).validate(4)


def cfg(**kw):
    base = dict(
        num_loops=4,
        num_blocks=64,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        prefill_chunk_size=8,
        max_model_len=64,
    )
    base.update(kw)
    return SchedulerConfig(**base)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_loops=0), "num_loops"),
        (dict(num_blocks=1), "num_blocks"),
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_seqs=64, max_num_batched_tokens=32), "must be >= max_num_seqs"),
        (dict(prefill_chunk_size=0), "prefill_chunk_size"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(kv_layout="paged"), "kv_layout"),
        (dict(prefill_mode="chunked"), "prefill_mode"),
        (dict(prefill_mode="wavefront", kv_layout="shared"), "LAST_EXITED"),
        (dict(prefill_mode="wavefront", kv_layout="SHARED"), "LAST_EXITED"),
        (dict(policy="lifo"), "policy"),
        (dict(eos_token_ids=[-1]), "eos_token_ids"),
        (dict(eos_token_ids=[True]), "eos_token_ids"),
        (dict(eos_token_ids=5), "eos_token_ids"),
        (dict(eos_token_ids=[3, 200], vocab_size=100), r"eos_token_ids: 200 is outside the vocabulary \[0, 100\)"),
        (dict(watermark=1.0), "watermark"),
        (dict(buckets=[16, 8, 32]), "strictly increasing"),
        (dict(buckets=[8, 16]), "smaller than max_num_batched_tokens"),
    ],
)
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        cfg(**kw)


def test_config_derived_sizes():
    c = cfg(prefill_mode="wavefront")
    assert c.num_planes == 4 and c.ring_rows_per_request == 32 and c.num_ring_rows == 1 + 4 * 32
    c = cfg(kv_layout="shared")
    assert c.num_planes == 1 and c.effective_chunk_size == 1 and c.ring_rows_per_request == 8
    assert cfg().max_blocks_per_seq == 16


def test_sizes_asked_for_by_benchmarks_cover_every_engine_of_a_sweep():
    from benchmarks.workloads import EngineShape
    from scheduler.sizes import pool_blocks

    shape = EngineShape(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, ring_chunk=8)
    rows = shape.num_ring_rows(4, chunks=(16,))
    for mode, chunk in itertools.product(("split", "mixed", "wavefront"), (8, 16)):
        c = cfg(prefill_mode=mode, prefill_chunk_size=chunk, max_num_seqs=4, max_model_len=256)
        assert c.num_ring_rows <= rows
    assert rows == cfg(prefill_mode="wavefront", prefill_chunk_size=16, max_num_seqs=4).num_ring_rows
    # every sequence at full length in every plane, plus the trash page
    assert pool_blocks(3, 33, 4, 16) == 3 * 4 * 3 + 1 and pool_blocks(1, 32, 1, 16) == 3


def test_add_request_rejects_impossible_requests_without_changing_anything():
    s = Scheduler(cfg(num_blocks=9))  # 8 usable blocks: 2 blocks in each of the 4 planes
    before = s.stats()
    bad = [
        (Request("e", [], SamplingParams()), "empty"),
        (Request("l", list(range(60)), SamplingParams(max_tokens=5)), "exceeds max_model_len"),
        (Request("f", list(range(8)), SamplingParams(max_tokens=2)), "can never fit in the KV pool"),
        (Request("p", [1, 2], SamplingParams(top_p=0)), "top_p"),
    ]
    for req, match in bad:
        with pytest.raises(ValueError, match=match):
            s.add_request(req)
    assert not s.has_unfinished() and s.stats() == before and s.schedule() is None
    ok = Request("ok", [1, 2, 3], SamplingParams(max_tokens=6))  # 8 positions x 4 planes = 8 blocks
    s.add_request(ok)
    with pytest.raises(ValueError, match="already queued"):
        s.add_request(Request("ok", [1], SamplingParams()))
    with pytest.raises(TypeError):
        s.add_request([1, 2, 3])
    with pytest.raises(ValueError, match="non-negative"):
        Request("neg", [1, -2])
    with pytest.raises(ValueError, match="flat sequence"):
        Request("2d", [[1, 2]])


def test_schedule_and_update_must_alternate():
    s = Scheduler(cfg())
    s.add_request(Request(0, [1, 2, 3], SamplingParams(max_tokens=2)))
    plan = s.schedule()
    with pytest.raises(RuntimeError, match="update"):
        s.schedule()
    s.update(plan, np.zeros(plan.descriptor.key.R, np.float32), np.zeros(plan.descriptor.key.C, np.int32))
    assert s.schedule() is not None


def test_update_refuses_a_stale_plan():
    s = Scheduler(cfg())
    s.add_request(Request(0, [1, 2, 3], SamplingParams(max_tokens=2)))
    plan = s.schedule()
    s.update(plan, np.zeros(plan.descriptor.key.R, np.float32), np.zeros(plan.descriptor.key.C, np.int32))
    with pytest.raises(RuntimeError, match="not the oldest one in flight"):
        s.update(plan, np.zeros(8, np.float32), np.zeros(8, np.int32))


def test_short_results_are_refused_when_read():
    s = Scheduler(cfg(prefill_chunk_size=8, num_loops=1))
    s.add_request(Request(0, [1, 2, 3], SamplingParams(max_tokens=2)))
    plan = s.schedule()
    assert plan.needs_tokens
    with pytest.raises(ValueError, match="tokens has 0 entries"):
        s.update(plan, np.zeros(8, np.float32), np.zeros(0, np.int32))


def test_priority_and_fcfs_admission_order():
    for policy, want in (("fcfs", ["a", "b", "c"]), ("priority", ["c", "a", "b"])):
        s = Scheduler(cfg(max_num_seqs=1, policy=policy, num_loops=1))
        order = []
        for rid, prio, t in (("a", 1, 0.0), ("b", 2, 1.0), ("c", 0, 2.0)):
            prio = prio if policy == "priority" else 0  # fcfs refuses priorities (below)
            s.add_request(Request(rid, [1, 2], SamplingParams(max_tokens=1), arrival_time=t, priority=prio))
        while s.has_unfinished():
            plan = s.schedule()
            order.extend(r.request_id for r in s.running if r.request_id not in order)
            s.update(plan, np.zeros(plan.descriptor.key.R, np.float32), np.zeros(plan.descriptor.key.C, np.int32))
        assert order == want, policy


def test_a_refused_priority_leaves_nothing_behind():
    """A priority fcfs would ignore, or one that is not an integer, is refused before the request is
    queued: no request the scheduler holds but never runs (a "ghost")."""
    for policy, prio, match in (
        ("fcfs", 1, "read only by policy='priority'"),
        ("priority", "high", "priority must be an integer"),
        ("priority", True, "priority must be an integer"),
        ("priority", 1.5, "priority must be an integer"),
    ):
        s = Scheduler(cfg(policy=policy, num_loops=1))
        with pytest.raises(ValueError, match=match):
            s.add_request(Request("x", [1, 2], SamplingParams(max_tokens=1), priority=prio))
        assert not s.has_unfinished() and len(s.waiting) == 0
        s.add_request(Request("ok", [1, 2], SamplingParams(max_tokens=1)))
        assert s.num_unfinished == 1


def test_stop_tokens_eos_and_ignore_eos():
    s = Scheduler(cfg(num_loops=1, eos_token_ids=(5, 7)))  # e.g. <|endoftext|> and <|im_end|>
    reqs = [
        Request("stop", [1], SamplingParams(max_tokens=5, stop_token_ids=[9])),
        Request("eos", [1], SamplingParams(max_tokens=5)),
        Request("ign", [1], SamplingParams(max_tokens=5, ignore_eos=True)),
        Request("eos2", [1], SamplingParams(max_tokens=5)),
    ]
    for r in reqs:
        s.add_request(r)
    script = {"stop": [3, 9], "eos": [5], "ign": [5, 5, 5, 5, 5], "eos2": [4, 7]}
    while s.has_unfinished():
        plan = s.schedule()
        toks = np.zeros(plan.descriptor.key.C, np.int32)
        for i, c in enumerate(plan.coda):
            toks[i] = script[c.request_id][c.token_index]
        s.update(plan, np.zeros(plan.descriptor.key.R, np.float32), toks)
    assert [r.output_token_ids for r in reqs] == [[3, 9], [5], [5] * 5, [4, 7]]
    assert [r.finish_reason for r in reqs] == ["stop", "stop", "length", "stop"]
    assert s.block_manager.num_used_blocks == 0


def test_scheduler_package_never_imports_jax():
    import subprocess
    import sys

    code = (
        "import sys, scheduler, scheduler.fake_runner; "
        "bad = [m for m in ('jax', 'flax') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_options_accept_any_case_and_name_the_choices():
    from scheduler.options import choice

    assert choice("kv_layout", "SHARED", ("last_exited", "shared")) == "shared"
    for bad in ("paged", None, 3, b"shared"):
        with pytest.raises(ValueError, match=r"kv_layout must be one of 'last_exited', 'shared' \(any case\)"):
            choice("kv_layout", bad, ("last_exited", "shared"))
    c = cfg(kv_layout="Last_Exited", prefill_mode="WaveFront", policy="PRIORITY")
    assert (c.kv_layout, c.prefill_mode, c.policy) == ("last_exited", "wavefront", "priority")
    assert SamplingParams(exit_mode="Delayed").exit_mode == "delayed"
    SamplingParams(exit_mode="FIXED").validate(4)


def test_sampling_params_accept_numpy_scalars_as_python_numbers():
    p = SamplingParams(
        max_tokens=np.int64(5),
        temperature=np.float32(0.5),
        top_p=np.float64(0.9),
        top_k=np.int32(3),
        seed=np.uint32(7),
        stop_token_ids=np.array([2, 3]),
        ignore_eos=np.bool_(True),
        min_loops=np.int8(1),
        max_loops=np.int16(3),
        exit_threshold=np.float16(0.5),
        exit_mode=np.str_("ouro"),
    )
    p.validate(4)
    assert type(p.max_tokens) is int and type(p.temperature) is float and type(p.ignore_eos) is bool
    assert p.stop_token_ids == (2, 3) and all(type(t) is int for t in p.stop_token_ids)
    assert p == SamplingParams(5, 0.5, float(np.float64(0.9)), 3, 7, (2, 3), True, 1, 3, 0.5, "ouro")
    hash(p)
    SamplingParams(exit_mode="synthetic", synthetic_depths=np.array([0, 2]), synthetic_mean_loops=None).validate(4)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_tokens=np.float64(5.0)), "max_tokens must be an integer"),
        (dict(max_tokens=np.array([5, 6])), "max_tokens must be an integer"),
        (dict(stop_token_ids=5), "stop_token_ids must be a sequence"),
        (dict(stop_token_ids="12"), "stop_token_ids must be a sequence"),
        (dict(stop_token_ids=[1.0]), "stop_token_ids must be non-negative integers"),
        (dict(exit_mode="synthetic", synthetic_depths=2), "synthetic_depths must be a sequence"),
    ],
)
def test_sampling_params_refuse_non_integers(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).validate(4)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([1.0, 2.0], "flat sequence of ints"),
        (["1", "2"], "flat sequence of ints"),
        ([True, False], "flat sequence of ints"),
        ([1, 2**31], "does not fit in int32"),
        (np.array([1, 2**40]), "does not fit in int32"),
    ],
)
def test_request_refuses_non_integer_or_oversized_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        Request("r", ids)
