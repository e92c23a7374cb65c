"""Fused decode steps: ``T`` loops (times several tokens) of the same decode rows in one executable.

They must change nothing a user can see: token ids, exit depths and finish reasons are the same as
loop by loop, against the fake model's dense reference (scheduler alone, numpy) and against the
reference's greedy generation and the loop-by-loop engine (the JAX runner on a tiny model). The
fused path must also really run (stats), compile nothing after start-up, and step aside whenever
prompt work is pending or a request waits for admission. Rows that may exit early:
tests/engine/test_fused_exit.py.
"""

import numpy as np
import pytest

from ouro_jax import SamplingParams
from ouro_jax.reference import reference_greedy_generate
from scheduler import SchedulerConfig
from scheduler.descriptor import StackedDescriptor, build_descriptor
from tests.engine.conftest import fused_engine, tiny_fused_parts
from tests.scheduler.conftest import VOCAB, check_against_reference, run_workload  # noqa: E402


# ------------------------------------------------------------------ scheduler + fake runner
def _reqs(rng, n, **sp):
    return [
        dict(
            rid=i,
            prompt=rng.integers(0, VOCAB, size=int(rng.integers(3, 20))).tolist(),
            sp=SamplingParams(**{"max_tokens": int(rng.integers(1, 9)), "temperature": 0.7 * (i % 2), "seed": i, **sp}),
            arrival=0,
            abort_at=None,
            priority=0,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("ahead", [False, True])
def test_fused_steps_match_reference_with_stops_and_odd_lengths(layout, tokens, ahead):
    """Fixed depth, sampled and greedy rows, stop tokens that end a row mid-step, max_tokens not
    a multiple of the tokens per step: identical to the dense reference, and fused steps ran.
    ``ahead``: each fused step launched before the previous one was read (asynchronous
    scheduling), which must not change a token either."""
    rng = np.random.default_rng(3)
    reqs = _reqs(rng, 3, exit_mode="fixed", stop_token_ids=(5, 17))
    cfg = SchedulerConfig(
        num_loops=4,
        num_blocks=200,
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=12,
        prefill_chunk_size=4,
        max_model_len=40,
        kv_layout=layout,
        fused_decode_max_rows=3,
        fused_decode_tokens=tokens,
    )
    h, objs, aborted = run_workload(cfg, reqs, ahead=ahead)
    check_against_reference(cfg, objs, aborted)
    st = h.s.stats()
    assert h.fused > 0 and st["fused_launches"] == h.fused
    assert st["ahead_launches"] == h.ahead and (h.ahead > 0) == ahead
    assert st["launches"] == len(h.plans) and st["invocations"] == st["launches"] - h.fused + st["fused_loops"]
    assert st["fused_loops"] % cfg.num_loops == 0
    if tokens > 1:  # steps of `tokens` tokens ran, not only single-token ones
        assert any(p.descriptor.n == tokens * cfg.num_loops for p in h.plans if p.sub_plans)


def test_no_fusion_while_prompts_wait_or_prefill():
    """A request that waits for admission, or one still prefilling, keeps every step loop-sized."""
    rng = np.random.default_rng(7)
    reqs = _reqs(rng, 4, exit_mode="fixed")
    for i, r in enumerate(reqs):
        r["arrival"] = 3 * i
    cfg = SchedulerConfig(
        num_loops=4,
        num_blocks=400,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        prefill_chunk_size=4,
        max_model_len=40,
        fused_decode_max_rows=4,
    )
    h, objs, aborted = run_workload(cfg, reqs)
    check_against_reference(cfg, objs, aborted)
    for p in h.plans:
        if p.sub_plans:
            assert all(r.phase.name == "DECODE" for r in p.ranges)


def test_stacked_descriptor_contract():
    cfg = SchedulerConfig(
        num_loops=2,
        num_blocks=16,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        max_model_len=16,
        fused_decode_max_rows=2,
        fused_decode_tokens=3,
    )
    spec = cfg.bucket_spec()
    tables = np.zeros((2, 2, 4), np.int32)
    kw = dict(
        seg_slot=[0],
        seg_plane=[0],
        seg_pos=[0],
        seg_len=[1],
        seg_ring=[1],
        pre_ring=[1],
        pre_token=[3],
        coda_row=[],
        coda_temperature=[],
        coda_top_k=[],
        coda_top_p=[],
        coda_seed=[],
        coda_step=[],
        fin_src=[],
        fin_dst=[],
    )
    a = build_descriptor(spec, tables, **kw)
    b = build_descriptor(spec, tables, **kw, key=a.key, feed_previous_tokens=True)
    assert b.feed_previous_tokens and not a.feed_previous_tokens
    exits = ([[2]], [[1]], [[0]], [[0.5]])
    s = StackedDescriptor([a, b], 2, exits)
    assert s.pack().shape == (2, a.pack().shape[0] + 4 * a.key.R) and s.key == a.key and s.num_tokens == 1
    tail = s.pack()[:, a.pack().shape[0] :].reshape(2, 4, a.key.R)
    assert (tail[0] == tail[1]).all() and tail[0, 0, 0] == 2 and tail[0, 3, :1].view(np.float32)[0] == 0.5
    assert tail[0, 0, 1] == 2 and tail[0, 3, 1:].view(np.float32)[0] == 1.0  # padding rows: forced out, gate off
    with pytest.raises(ValueError):
        StackedDescriptor([], 2, exits)
    with pytest.raises(ValueError, match="whole tokens"):
        StackedDescriptor([a, b, a], 2, exits)
    with pytest.raises(ValueError, match="exit_limit"):
        StackedDescriptor([a, b], 2, ([[2], [2]], [[1]], [[0]], [[0.5]]))
    with pytest.raises(ValueError, match="exceed"):
        build_descriptor(spec, tables, **{**kw, "seg_len": [9], "seg_slot": [0]}, key=a.key)
    assert cfg.fused_steps() == [(spec.key_for_bucket(8), 2), (spec.key_for_bucket(8), 6)]
    with pytest.raises(ValueError, match="fused_decode_max_rows"):
        SchedulerConfig(num_loops=2, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=8, fused_decode_max_rows=3)
    with pytest.raises(ValueError, match="fused_decode_tokens"):
        SchedulerConfig(num_loops=2, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=8, fused_decode_tokens=0)


# ------------------------------------------------------------------------ the JAX engine
CFG, PARAMS, REF, PROMPTS = tiny_fused_parts()
_engine = fused_engine


@pytest.mark.parametrize(
    "layout,tokens",
    [
        ("last_exited", 1),
        pytest.param("last_exited", 3, marks=pytest.mark.slow),
        pytest.param("shared", 2, marks=pytest.mark.slow),
    ],
)
def test_engine_fused_equals_loop_by_loop_and_reference(layout, tokens):
    sp = [
        SamplingParams(max_tokens=7, ignore_eos=True, exit_mode="fixed"),
        SamplingParams(max_tokens=5, ignore_eos=True, exit_mode="fixed", temperature=0.8, top_k=20, seed=4),
        SamplingParams(max_tokens=6, ignore_eos=True, exit_mode="fixed"),
    ]
    loop_by_loop = _engine(kv_layout=layout, fused_decode_max_rows=0)
    plain = loop_by_loop.generate(PROMPTS, sp, use_tqdm=False)
    # one-loop steps sample through the separate sampler (fused steps sample in their program), and
    # only for the codas of the sampled request: one token each
    assert loop_by_loop.stats()["sampler_launches"] == sp[1].max_tokens
    llm = _engine(kv_layout=layout, fused_decode_max_rows=4, fused_decode_tokens=tokens)
    fused = llm.generate(PROMPTS, sp, use_tqdm=False)
    for a, b in zip(plain, fused):
        assert (a.token_ids, a.exit_depths, a.finish_reason) == (b.token_ids, b.exit_depths, b.finish_reason)
        assert len(b.metrics.token_times) == len(b.token_ids)
    if layout == "last_exited":  # greedy rows against the full-recompute reference
        for i in (0, 2):
            r = reference_greedy_generate(REF, CFG, PROMPTS[i], sp[i].max_tokens)
            if r.min_logit_gap > 1e-4:
                assert fused[i].token_ids == list(r.tokens)
    st = llm.stats()
    assert st["fused_launches"] > 0 and st["launches"] < st["recurrent_invocations"]
    assert st["compilations"] == len(llm.executable_keys())  # all at start-up, nothing since
    assert st["free_blocks"] == llm.scheduler_config.num_blocks - 1


def test_fused_step_updates_the_pool_in_place():
    """The fused step carries the KV pools through a ``fori_loop``: no copy of the pool in the
    compiled step, and the donated buffers come back at the same address (a copy of a 120 GB pool
    would not even fit on the H200)."""
    from ouro_jax.runner import ModelRunner
    from tests.kernels.conftest import pool_copies

    llm = _engine(fused_decode_max_rows=4, fused_decode_tokens=2, warmup=False)
    r = llm.runner
    key = next(k for k in llm.executable_keys() if not hasattr(k, "R"))
    assert isinstance(r, ModelRunner) and len(key) == 2
    exe = r._compile(key)
    assert not pool_copies(exe.as_text(), r.k_pool.shape)
    ptr = r.k_pool.unsafe_buffer_pointer()
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=5, ignore_eos=True, exit_mode="fixed"), use_tqdm=False)
    assert llm.stats()["fused_launches"] > 0
    assert r.k_pool.unsafe_buffer_pointer() == ptr


def _drive(llm, plan, sp):
    """Run ``plan`` (step index -> ("add", i) or ("abort", i)) with prompts ``PROMPTS[i % 3]`` and
    ``sp[i]`` to the end; the final output of every request by id."""
    final, step = {}, 0
    while step <= max(plan) or llm.has_unfinished():
        for kind, i in plan.get(step, []):
            if kind == "add":
                llm.add_request(PROMPTS[i % len(PROMPTS)], sp[i], request_id=i)
            else:
                llm.abort(i)
        final.update((o.request_id, o) for o in llm.step() if o.finished)
        step += 1
    return final


def test_async_scheduling_changes_no_token_and_leaves_nothing_in_flight():
    """Fused steps launched before the previous one was read: the same tokens, exit depths and
    finish reasons as the synchronous engine, with stop tokens, early exits, sampling, a request
    arriving and one aborted mid-run; nothing in flight and every block free at the end."""
    sp = [
        SamplingParams(max_tokens=9, ignore_eos=True, exit_mode="fixed"),
        SamplingParams(max_tokens=7, ignore_eos=True, exit_threshold=0.5, temperature=0.8, seed=3),
        SamplingParams(max_tokens=8, ignore_eos=True, exit_mode="synthetic", synthetic_mean_loops=2.5),
        SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.3),
        SamplingParams(max_tokens=12, ignore_eos=True, exit_mode="fixed"),
    ]
    plan = {0: [("add", 0), ("add", 1), ("add", 2)], 9: [("add", 3)], 14: [("abort", 4)], 11: [("add", 4)]}
    sync = _engine(fused_decode_max_rows=4, async_scheduling=False)
    want = _drive(sync, plan, sp)
    stop = want[0].token_ids[3]  # a stop token met mid-run (where it first occurs)
    sp[0] = SamplingParams(max_tokens=9, ignore_eos=True, exit_mode="fixed", stop_token_ids=(stop,))
    want = _drive(sync, plan, sp)
    assert want[0].finish_reason == "stop" and sync.stats()["ahead_launches"] == 0
    llm = _engine(fused_decode_max_rows=4)
    got = _drive(llm, plan, sp)
    for i in range(4):
        assert (got[i].token_ids, got[i].exit_depths, got[i].finish_reason) == (
            want[i].token_ids,
            want[i].exit_depths,
            want[i].finish_reason,
        ), i
    assert got[4].finish_reason == "abort"
    full = _drive(_engine(fused_decode_max_rows=4, async_scheduling=False), {0: [("add", 4)]}, sp)[4]
    assert got[4].token_ids == full.token_ids[: len(got[4].token_ids)]
    st = llm.stats()
    assert st["ahead_launches"] > 0 and st["fused_launches"] > st["ahead_launches"]
    assert st["free_blocks"] == llm.scheduler_config.num_blocks - 1
    assert not llm._pipeline.pending and llm.scheduler._inflight is None


def test_abort_of_the_last_request_drains_the_step_launched_ahead():
    llm = _engine(fused_decode_max_rows=4)
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True, exit_mode="fixed"), request_id="a")
    while not llm._pipeline.pending:
        llm.step()
    assert llm.abort("a")
    assert not llm._pipeline.pending and llm.scheduler._inflight is None
    assert llm.stats()["free_blocks"] == llm.scheduler_config.num_blocks - 1
    (out,) = llm.step()
    assert out.finished and out.finish_reason == "abort" and not llm.has_unfinished()
    # the engine runs on: a new request after the drained one
    again = llm.generate(PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True, exit_mode="fixed"), use_tqdm=False)
    assert len(again[0].token_ids) == 5
