"""``n`` choices of one prompt (``generate(n=...)``, ``add_request(prompt_from=...)``): the later
choices wait for the first to compute the prompt and share its full KV blocks, so the prompt is
computed once; every choice's tokens are those it gets alone with its seed."""

import pytest

from ouro_jax import SamplingParams
from tests.engine.conftest import make_llm

PROMPT = list(range(3, 30))  # 27 tokens: 6 full blocks of 4 shared, the last 3 positions each computed
SP = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=11, logprobs=0)


def _alone(llm, j):
    return llm.generate([PROMPT], SamplingParams(**{**SP.__dict__, "seed": SP.seed + j}), use_tqdm=False)[0]


@pytest.mark.parametrize("caching", [False, True], ids=["cache_off", "cache_on"])
def test_choices_share_the_prompt_and_keep_their_tokens(caching):
    with make_llm() as llm:
        alone = [_alone(llm, j) for j in range(3)]
    with make_llm(enable_prefix_caching=caching) as llm:  # a cold cache
        before = llm.stats()
        outs = llm.generate([PROMPT], SP, n=3, use_tqdm=False)
        after = llm.stats()
        assert llm.scheduler.block_manager.num_used_blocks == 0  # every block given back
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert [o.exit_depths for o in outs] == [o.exit_depths for o in alone]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # different seeds, different choices
    full = (len(PROMPT) - 1) // 4 * 4
    shared = after["shared_prompt_tokens"] - before["shared_prompt_tokens"]
    assert shared == 2 * full  # the two later choices took every full block from the first
    # the prompt positions computed: once, plus each later choice's last partial block
    prelude = after["prelude_tokens"] - before["prelude_tokens"]
    assert prelude == len(PROMPT) + 2 * (len(PROMPT) - full) + sum(len(o.token_ids) - 1 for o in outs)
    for o, a in zip(outs, alone):
        assert o.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-5)


@pytest.mark.slow
def test_greedy_choices_are_equal_and_shared_layout_computes_each():
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    with make_llm() as llm:
        a, b = llm.generate([PROMPT], sp, n=2, use_tqdm=False)
    with make_llm(kv_layout="shared") as llm:  # no shared prompt blocks in SHARED: each choice computes
        c, d = llm.generate([PROMPT], sp, n=2, use_tqdm=False)
        assert llm.stats()["shared_prompt_tokens"] == 0
    assert a.token_ids == b.token_ids and c.token_ids == d.token_ids  # the layouts differ in meaning


def test_a_choice_whose_sibling_is_aborted_runs_on():
    with make_llm() as llm:
        first = llm.add_request(PROMPT, SP)
        later = llm.add_request(PROMPT, SP, prompt_from=first)
        other = llm.add_request(PROMPT[:9], SP, prompt_from=first)  # another prompt: not tied to it
        llm.step()
        assert llm.abort(first)
        done = {}
        while llm.has_unfinished():
            for o in llm.step():
                if o.finished:
                    done[o.request_id] = o
        assert done[first].finish_reason == "abort"
        assert len(done[later].token_ids) == len(done[other].token_ids) == 6
        assert llm.scheduler.block_manager.num_used_blocks == 0
        assert done[later].token_ids == _alone(llm, 0).token_ids


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_n_is_refused(bad):
    with make_llm() as llm:
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            llm.generate([PROMPT], SP, n=bad, use_tqdm=False)
        assert not llm.has_unfinished()
