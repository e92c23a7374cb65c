"""The request lifecycle (LLM docstring): every output is handed out exactly once, to whoever drives
the loop, and nothing is kept once it has been handed out, whichever path ran the request."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax import LLM, SamplingParams, get_preset
from scheduler import Request, Scheduler, SchedulerConfig
from scheduler.fake_runner import FakeRunner
from weights.random_init import random_params

CFG = get_preset("tiny")
RNG = np.random.default_rng(3)
PROMPTS = [list(map(int, RNG.integers(1, CFG.vocab_size, n))) for n in (3, 9, 17, 5)]


@pytest.fixture(scope="module")
def llm():
    params = jax.tree.map(jnp.asarray, random_params(CFG, 0))
    return LLM(
        CFG,
        params=params,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        prefill_chunk_size=8,
        block_size=4,
        max_model_len=48,
        buckets=[8, 32],
        progress=False,
    )


def sp(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def drained(llm):
    return not llm.has_unfinished() and not llm._live and not llm._unreported and not llm.scheduler.num_unfinished


def drive(llm):
    """Step until nothing is left; every final output seen, counted per request."""
    finals, seen = {}, []
    while llm.has_unfinished():
        for o in llm.step():
            seen.append(o.request_id)
            if o.finished:
                assert o.request_id not in finals, "a final output was handed out twice"
                finals[o.request_id] = o
    return finals, seen


def test_step_hands_every_final_output_out_once_and_forgets_it(llm):
    ids = [llm.add_request(p, sp(3 + i)) for i, p in enumerate(PROMPTS)]
    finals, _ = drive(llm)
    assert sorted(finals) == sorted(ids)
    assert [len(finals[i].token_ids) for i in ids] == [3, 4, 5, 6]
    assert drained(llm)
    assert llm.step() == []  # nothing left to hand out


def test_request_added_with_add_request_that_finishes_during_generate(llm):
    other = llm.add_request(PROMPTS[0], sp(2))  # finishes long before generate's prompts
    outs = llm.generate(PROMPTS[1:3], sp(6), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [6, 6] and all(o.finished for o in outs)
    assert other not in {o.request_id for o in outs}
    assert llm.has_unfinished()  # other's final output still waits for its driver
    finals, _ = drive(llm)
    assert list(finals) == [other] and len(finals[other].token_ids) == 2
    assert drained(llm)


def test_request_still_running_when_generate_returns(llm):
    other = llm.add_request(PROMPTS[2], sp(20))
    [out] = llm.generate([PROMPTS[0]], sp(1), use_tqdm=False)
    assert len(out.token_ids) == 1
    finals, _ = drive(llm)
    assert list(finals) == [other] and len(finals[other].token_ids) == 20
    assert drained(llm)


@pytest.mark.parametrize("when", [0, 3])
def test_abort_gives_a_final_output_from_the_next_step(llm, when):
    a = llm.add_request(PROMPTS[2], sp(20))
    b = llm.add_request(PROMPTS[1], sp(3))
    waiting = llm.add_request(PROMPTS[3], sp(3))
    early = []
    for _ in range(when):
        early += llm.step()
    assert llm.abort(a) and llm.abort(waiting)
    assert not llm.abort(a) and not llm.abort("no-such-id")
    # blocks and ring rows are free at once
    assert llm.scheduler.get_request(a) is None
    finals, _ = drive(llm)
    assert finals[a].finish_reason == "abort" and finals[waiting].finish_reason == "abort"
    assert finals[b].finish_reason == "length" and len(finals[b].token_ids) == 3
    assert not any(o.finished for o in early)
    assert drained(llm)
    assert llm.stats()["free_blocks"] == llm.scheduler_config.num_blocks - 1


def test_abort_with_nothing_else_running_still_returns_the_output(llm):
    a = llm.add_request(PROMPTS[0], sp(5))
    llm.step()
    assert llm.abort(a)
    assert llm.has_unfinished()
    [o] = llm.step()
    assert o.request_id == a and o.finished and o.finish_reason == "abort"
    assert drained(llm)


def test_stream_yields_its_own_outputs_and_leaves_the_others_to_step(llm):
    other = llm.add_request(PROMPTS[3], sp(2))
    got = {}
    for o in llm.stream(PROMPTS[:2], sp(4)):
        assert o.request_id != other
        got.setdefault(o.request_id, []).append(len(o.token_ids))
    assert all(v == sorted(v) and v[-1] == 4 for v in got.values()) and len(got) == 2
    finals, _ = drive(llm)
    assert list(finals) == [other]
    assert drained(llm)


def test_abort_during_stream_ends_that_stream_entry(llm):
    seen = {}
    gen = llm.stream(PROMPTS[:2], sp(10))
    first = next(gen)
    assert llm.abort(first.request_id)
    for o in gen:
        seen[o.request_id] = o
    assert seen[first.request_id].finish_reason == "abort"
    assert len(seen) == 2 and all(o.finished for o in seen.values())
    assert drained(llm)


def test_an_id_whose_output_was_not_handed_out_cannot_be_reused(llm):
    a = llm.add_request(PROMPTS[0], sp(2), request_id="dup")
    llm.abort(a)
    with pytest.raises(ValueError, match="not handed out"):
        llm.add_request(PROMPTS[0], sp(2), request_id="dup")
    drive(llm)
    assert llm.add_request(PROMPTS[0], sp(2), request_id="dup") == "dup"
    drive(llm)
    assert drained(llm)


def _live_requests() -> int:
    gc.collect()
    return sum(isinstance(o, Request) for o in gc.get_objects())


@pytest.mark.slow
def test_long_step_loop_keeps_memory_flat(llm):
    """Hundreds of requests through add_request/step/abort: the engine holds no more requests or
    outputs at the end than at the start."""
    base = _live_requests()
    peak = 0
    for wave in range(8):
        ids = [llm.add_request(PROMPTS[i % 4], sp(1 + (i + wave) % 3)) for i in range(12)]
        steps = 0
        while llm.has_unfinished():
            llm.step()
            steps += 1
            if steps == 2:
                llm.abort(ids[wave])
            peak = max(peak, len(llm._live) + len(llm._unreported))
        assert drained(llm)
    assert _live_requests() <= base, "finished requests are still referenced"
    assert peak <= 13


@pytest.mark.slow
def test_scheduler_loop_keeps_memory_flat():
    """The same at the scheduler level (FakeRunner): no finished request is referenced."""
    cfg = SchedulerConfig(
        num_loops=3, num_blocks=60, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=4
    )
    s = Scheduler(cfg)
    fr = FakeRunner(cfg.num_blocks, cfg.block_size, cfg.num_ring_rows, 101)
    base = _live_requests()
    for wave in range(20):
        for i in range(6):
            s.add_request(Request((wave, i), list(range(1 + i, 9 + i)), sp(1 + i % 3)))
        while s.has_unfinished():
            plan = s.schedule()
            res = fr.step(plan.descriptor)
            s.update(plan, res.gates, res.tokens)
    assert _live_requests() <= base
    assert s.block_manager.num_used_blocks == 0
