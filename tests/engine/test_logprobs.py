"""``SamplingParams.logprobs``: each generated token's log-probability and the top alternatives,
from the raw distribution of the depth that produced the token (before temperature and masks),
taken on the device. They equal the float64 reference's log-softmax, the same whether the token
came from a fused decode step or loop by loop, greedy or sampled."""

import numpy as np
import pytest

from ouro_jax import SamplingParams
from ouro_jax.reference import reference_forward, reference_greedy_generate
from scheduler.sampling_params import MAX_LOGPROBS, TokenLogprobs, read_logprobs
from tests.engine.conftest import fused_engine, tiny_fused_parts

TOL = 2e-3  # float32 engine against the float64 reference


def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _reference_logprobs(prompt, tokens, depths):
    """The reference's log-softmax of every generated token's position at its exit depth."""
    cfg, _, ref, _ = tiny_fused_parts()
    seq, out = list(prompt), []
    positions = [cfg.num_loops - 1] * len(prompt)
    for tok, d in zip(tokens, depths):
        h = reference_forward(ref, cfg, seq, positions)["hidden_states"]
        out.append(_log_softmax(h[d if len(seq) > len(prompt) else cfg.num_loops - 1, -1] @ ref.lm_head.T))
        positions[-1] = d if len(seq) > len(prompt) else positions[-1]
        seq.append(tok)
        positions.append(cfg.num_loops - 1)
    return out


def _check(out, k):
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for lp, tok in zip(out.logprobs, out.token_ids):
        assert isinstance(lp, TokenLogprobs) and lp.token_id == tok and len(lp.top) == k
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


@pytest.mark.parametrize("fused", [0, 4], ids=["loop_by_loop", "fused"])
def test_greedy_logprobs_equal_the_reference(fused):
    _, _, _, prompts = tiny_fused_parts()
    with fused_engine(fused_decode_max_rows=fused) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=5, exit_mode="fixed"), use_tqdm=False
        )
        stats = llm.stats()
    assert (stats["fused_launches"] > 0) == bool(fused)
    for p, out in zip(prompts, outs):
        _check(out, 5)
        ref = _reference_logprobs(p, out.token_ids, out.exit_depths)
        for lp, want in zip(out.logprobs, ref):
            assert lp.logprob == pytest.approx(want[lp.token_id], abs=TOL)
            top = np.argsort(-want)[:5]
            assert [t for t, _ in lp.top] == top.tolist()  # greedy: the token is the first of them
            np.testing.assert_allclose([v for _, v in lp.top], want[top], atol=TOL)


@pytest.mark.slow
def test_logprobs_under_the_gate_rule_come_from_the_exit_depth():
    cfg, _, ref, prompts = tiny_fused_parts()
    sp = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2, exit_threshold=0.3)
    with fused_engine() as llm:
        out = llm.generate(prompts[1:2], sp, use_tqdm=False)[0]
    r = reference_greedy_generate(ref, cfg, prompts[1], 5, exit_threshold=0.3)
    assert (out.token_ids, out.exit_depths) == (list(r.tokens), list(r.exit_depths))
    assert len(set(out.exit_depths)) > 1  # the exits differ, so the depth matters
    for lp, want in zip(out.logprobs, _reference_logprobs(prompts[1], out.token_ids, out.exit_depths)):
        assert lp.logprob == pytest.approx(want[lp.token_id], abs=TOL)


def test_sampled_tokens_get_the_raw_logprobs_and_the_same_tokens():
    """Temperature changes which token is drawn, not the reported distribution; asking for
    logprobs changes no token (fused or loop by loop)."""
    _, _, _, prompts = tiny_fused_parts()
    sp = dict(max_tokens=6, ignore_eos=True, temperature=1.5, seed=7, exit_mode="fixed")
    with fused_engine() as llm:
        plain = llm.generate(prompts, SamplingParams(**sp), use_tqdm=False)
        outs = llm.generate(prompts, SamplingParams(**sp, logprobs=MAX_LOGPROBS), use_tqdm=False)
    with fused_engine(fused_decode_max_rows=0) as llm:
        loop = llm.generate(prompts, SamplingParams(**sp, logprobs=0), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain] == [o.token_ids for o in loop]
    assert plain[0].logprobs is None and plain[0].cumulative_logprob is None
    for p, out, lo in zip(prompts, outs, loop):
        _check(out, MAX_LOGPROBS)
        _check(lo, 0)
        ref = _reference_logprobs(p, out.token_ids, out.exit_depths)
        assert any(lp.top[0][0] != lp.token_id for lp in out.logprobs)  # sampled, not the argmax
        for lp, lp0, want in zip(out.logprobs, lo.logprobs, ref):
            assert lp.logprob == pytest.approx(want[lp.token_id], abs=TOL)
            assert lp0.logprob == pytest.approx(lp.logprob, abs=1e-5)


@pytest.mark.parametrize("mode", ["split", pytest.param("wavefront", marks=pytest.mark.slow)])
def test_prompt_logprobs_equal_the_reference(mode):
    """Every prompt token after the first, under the full-depth state of the position before it,
    whatever the chunking; the prefix cache is not used for such a request (it computes them all)."""
    cfg, _, ref, prompts = tiny_fused_parts()
    prompt = prompts[2]  # 17 tokens: three chunks of 8
    with fused_engine(prefill_mode=mode, enable_prefix_caching=True) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # its blocks in the cache
        sp = SamplingParams(max_tokens=2, prompt_logprobs=3, ignore_eos=True)
        [out] = llm.generate([prompt], sp, use_tqdm=False)
    h = reference_forward(ref, cfg, prompt)["hidden_states"][cfg.num_loops - 1]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        want = _log_softmax(h[pos - 1] @ ref.lm_head.T)
        lp = out.prompt_logprobs[pos]
        assert lp.token_id == prompt[pos] and lp.logprob == pytest.approx(want[prompt[pos]], abs=TOL)
        top = np.argsort(-want)[:3]
        assert [t for t, _ in lp.top] == top.tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0, "5"])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match=r"logprobs must be None or an integer in \[0, 20\]"):
        SamplingParams(logprobs=bad).validate(4)


def test_a_record_reads_back():
    rec = np.zeros(1 + 2 * MAX_LOGPROBS, np.int32)
    rec[: 1 + MAX_LOGPROBS].view(np.float32)[:] = -np.arange(1 + MAX_LOGPROBS, dtype=np.float32)
    rec[1 + MAX_LOGPROBS :] = np.arange(100, 100 + MAX_LOGPROBS)
    lp = read_logprobs(rec, 7, 3)
    assert lp == TokenLogprobs(7, 0.0, ((100, -1.0), (101, -2.0), (102, -3.0)))
