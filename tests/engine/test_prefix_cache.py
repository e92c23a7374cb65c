"""Prefix caching: full prompt blocks published by hash chain, reused by reference across requests
(every plane), kept after their requests end and evicted LRU. A hit skips the prompt work of those
positions at every depth and changes no token or exit depth (engine-semantics.md, equivalence)."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import DEFAULT_ENABLE_PREFIX_CACHING, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.fake_runner import FakeRunner
from tests.engine.conftest import T, config, engine_parts, make_llm, tokens
from tests.scheduler.conftest import VOCAB, check_against_reference, run_workload

RNG = np.random.default_rng(7)
PREFIX = RNG.integers(0, VOCAB, 22).tolist()


def sp(i, exit="ouro", max_tokens=6):
    kw = dict(exit_threshold=0.6) if exit == "ouro" else {}
    return SamplingParams(max_tokens=max_tokens, seed=i, temperature=0.5 * (i % 2), **kw)


def shared_prefix_workload(exit="ouro", n=6, gap=4):
    return [
        dict(
            rid=f"p{i}",
            prompt=PREFIX + RNG.integers(0, VOCAB, 1 + i).tolist(),
            sp=sp(i, exit),
            arrival=gap * i,  # later requests arrive after earlier ones published their prefix
            abort_at=None,
            priority=0,
        )
        for i in range(n)
    ]


def repeated_workload(exit="ouro"):
    prompt = RNG.integers(0, VOCAB, 16).tolist()  # exactly 4 blocks: the last one must stay uncached
    return [
        dict(rid=f"r{i}", prompt=prompt, sp=sp(i, exit), arrival=24 * i, abort_at=None, priority=0) for i in range(4)
    ]


MODES = ["split", "mixed", "wavefront"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("exit", ["fixed", "ouro"])
@pytest.mark.parametrize("make", [shared_prefix_workload, repeated_workload])
def test_hits_change_no_token_and_skip_the_prompt_work(mode, exit, make):
    reqs = make(exit)
    runs = {}
    for caching in (False, True):
        cfg = config(400, mode, enable_prefix_caching=caching, max_num_seqs=2)
        h, objs, aborted = run_workload(cfg, reqs)
        check_against_reference(cfg, objs, aborted)
        runs[caching] = (h, objs)
    (h0, o0), (h1, o1) = runs[False], runs[True]
    assert tokens(o1) == tokens(o0)
    s0, s1 = h0.s.stats(), h1.s.stats()
    hit = s1["prefix_cache_hit_tokens"]
    assert s0["prefix_cache_hit_tokens"] == 0 and hit > 0
    assert s1["prefix_cache_queried_tokens"] == sum(len(r["prompt"]) for r in reqs)
    assert s1["prefix_cache_hit_rate"] == hit / s1["prefix_cache_queried_tokens"]
    # prompt work skipped: exactly the hit positions, at every depth
    assert s0["prefill_rows"] - s1["prefill_rows"] == hit * T
    for req, r in o1.values():
        assert req.num_cached_tokens % 4 == 0 and req.num_cached_tokens < len(r["prompt"])
    if make is repeated_workload:
        # 16 tokens = 4 blocks; the last block stays uncached so that the last position runs
        assert [req.num_cached_tokens for req, _ in o1.values()] == [0, 12, 12, 12]


def test_published_blocks_outlive_their_request_and_are_evicted_lru():
    cfg = config(1 + T * 12, "mixed", enable_prefix_caching=True)
    s = Scheduler(cfg)
    fr = FakeRunner(cfg.num_blocks, cfg.block_size, cfg.num_ring_rows, VOCAB)

    def run(rid, prompt, max_tokens=1):
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens))
        s.add_request(req)
        while s.has_unfinished():
            plan = s.schedule()
            res = fr.step(plan.descriptor)
            s.update(plan, res.gates, res.tokens)
        return req

    a = list(range(1, 14))  # 13 tokens: 3 full blocks, all three may hit (one position stays)
    run("a", a)
    bm = s.block_manager
    assert bm.num_cached_blocks == 3 * T and bm.num_used_blocks == 0  # kept, idle
    assert bm.num_free_blocks == cfg.num_blocks - 1  # idle cached blocks count as free (evictable)
    assert run("a2", a).num_cached_tokens == 12
    # 10 blocks when 9 are free: one idle column is evicted, the end of a's prefix (released first)
    run("big", list(range(50, 90)))
    assert bm.num_cached_blocks == (2 + 10) * T
    assert run("a3", a).num_cached_tokens == 8
    # a full pool's worth evicts everything else
    run("huge", list(range(20, 68)))
    assert run("a4", a).num_cached_tokens == 0
    assert (bm.ref_counts()[1:] == 0).all() and bm.num_used_blocks == 0


def test_prefix_published_by_a_preempted_or_aborted_request_is_reused():
    prompt = PREFIX[:20]
    sp_long = SamplingParams(max_tokens=20)
    reqs = [
        # "a" publishes its prompt, then is preempted when "b" (earlier arrival) grows
        dict(rid="b", prompt=RNG.integers(0, VOCAB, 11).tolist(), sp=sp_long, arrival=0, abort_at=None, priority=0),
        dict(rid="a", prompt=prompt, sp=sp_long, arrival=1, abort_at=None, priority=0),
        # "c" is aborted right after its prompt is published
        dict(rid="c", prompt=prompt[:16] + [1, 2, 3, 4], sp=sp_long, arrival=2, abort_at=14, priority=0),
        dict(rid="d", prompt=prompt + [5], sp=SamplingParams(max_tokens=4), arrival=40, abort_at=None, priority=0),
    ]
    cfg = config(1 + T * 10, "wavefront", enable_prefix_caching=True, watermark=0.0)
    h, objs, aborted = run_workload(cfg, reqs)
    assert objs["a"][0].num_preemptions > 0
    assert "c" in aborted
    check_against_reference(cfg, objs, aborted)
    assert objs["d"][0].num_cached_tokens == 20  # all of a's five blocks
    assert objs["a"][0].num_cached_tokens > 0  # a resumed on its own published blocks
    st_ = h.s.stats()
    assert st_["preemptions"] > 0 and st_["prefix_cache_hit_tokens"] >= 20


def test_shared_layout_rejects_prefix_caching_and_the_default_is_one_constant():
    with pytest.raises(ValueError, match="LAST_EXITED"):
        config(100, "split", layout="shared", enable_prefix_caching=True)
    assert config(100, "split").enable_prefix_caching is DEFAULT_ENABLE_PREFIX_CACHING
    assert config(100, "split", layout="shared").enable_prefix_caching is False
    with pytest.raises(ValueError, match="kv_allocation"):
        SchedulerConfig(num_loops=2, num_blocks=10, kv_allocation="lazy")


# ------------------------------------------------------------------------------- the JAX engine
@pytest.mark.slow
def test_engine_prefix_hits_keep_tokens():
    cfg, _, prompts = engine_parts()
    rng = np.random.default_rng(11)
    prefix = list(map(int, rng.integers(1, cfg.vocab_size, 24)))
    first, second = [prefix + [7], prompts[0]], [prefix + [9, 3], prompts[0]]
    sp_ = SamplingParams(max_tokens=5, ignore_eos=True, exit_threshold=0.6)
    got = {}
    for caching in (False, True):
        llm = make_llm(prefill_mode="wavefront", enable_prefix_caching=caching)
        outs = llm.generate(first, sp_, use_tqdm=False) + llm.generate(second, sp_, use_tqdm=False)
        got[caching] = [(o.token_ids, o.exit_depths) for o in outs]
        st_ = llm.stats()
    assert got[True] == got[False]
    # the second call hits the 24-token prefix and 32 of the repeated 33-token prompt (a request
    # preempted in this small pool hits its own published blocks again when it is readmitted)
    if st_["preemptions"]:
        assert st_["prefix_cache_hit_tokens"] >= 24 + 32
    else:
        assert st_["prefix_cache_hit_tokens"] == 24 + 32
    assert st_["used_blocks"] == 0
