"""Logit processing in the compiled sampler: presence, frequency and repetition penalties, logit
bias, min-p and min_tokens (``SamplingParams``; ``sampling.adjust_logits``). The device kernel
equals its numpy twin on awkward entries (repeated ids, bans, empty rows); the engine's greedy
tokens equal a float64 reference decode that applies the twin before each argmax."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ouro_jax import SamplingParams
from ouro_jax.reference import reference_forward
from ouro_jax.sampling import (
    adjust_inputs,
    adjust_logits,
    adjust_logits_reference,
    fixed_entries,
    sample_stochastic,
)
from scheduler import Request
from tests.engine.conftest import fused_engine, tiny_fused_parts

V = 37  # a small, odd vocabulary


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.integers(0, V - 1), max_size=12),  # prompt
            st.lists(st.integers(0, V - 1), max_size=12),  # output so far
            st.floats(0.5, 2.0),  # repetition
            st.floats(-2, 2),  # presence
            st.floats(-2, 2),  # frequency
            st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=4),
        ),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 2**16),
)
def test_adjust_logits_equals_its_twin(rows, seed):
    logits = np.random.default_rng(seed).normal(0, 3, (len(rows) + 1, V)).astype(np.float32)
    reqs = []
    for i, (prompt, out, rep, pres, freq, bias) in enumerate(rows):
        sp = SamplingParams(
            max_tokens=50, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq, logit_bias=bias
        )
        req = Request(i, prompt or [1], sp)
        req.output_token_ids = list(out)
        reqs.append((i, req, fixed_entries(sp, prompt or [1])))
    row_words, entries = adjust_inputs(len(rows) + 1, reqs, eos_token_ids=(0,))  # the last row: free
    got = np.asarray(adjust_logits(jnp.asarray(logits), jnp.asarray(row_words), jnp.asarray(entries)))
    for i, (prompt, out, rep, pres, freq, bias) in enumerate(rows):
        want = adjust_logits_reference(logits[i], pres, freq, rep, out, prompt or [1], bias)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got[-1], logits[-1])


def test_min_tokens_bans_stops_and_min_p_keeps_the_likely():
    sp = SamplingParams(max_tokens=9, min_tokens=2, stop_token_ids=(5,), min_p=0.3)
    req = Request(0, [1, 2], sp)
    row_words, entries = adjust_inputs(2, [(0, req, fixed_entries(sp, [1, 2]))], eos_token_ids=(0, 3))
    logits = np.zeros((2, 8), np.float32)
    got = np.asarray(adjust_logits(jnp.asarray(logits), jnp.asarray(row_words), jnp.asarray(entries)))
    assert np.isneginf(got[0, [0, 3, 5]]).all() and np.isfinite(np.delete(got[0], [0, 3, 5])).all()
    req.output_token_ids = [7, 7]  # min_tokens reached: nothing banned
    _, entries = adjust_inputs(2, [(0, req, fixed_entries(sp, [1, 2]))], eos_token_ids=(0, 3))
    assert entries.shape[-1] == 0
    # min-p: p >= 0.3 * p_max survives; over many draws only those come out
    x = np.log(np.array([[0.5, 0.2, 0.14, 0.16]] * 64, np.float32))
    keys = jnp.asarray(np.stack([np.zeros(64), np.arange(64)], 1).astype(np.uint32))
    one = lambda v: jnp.full((64,), v)  # noqa: E731
    toks = np.asarray(sample_stochastic(jnp.asarray(x), one(1.0), one(0), one(1.0), keys, one(0.3)))
    assert set(toks.tolist()) <= {0, 1, 3} and {0, 1} <= set(toks.tolist())


def _reference_decode(prompt, n, **sp):
    """Greedy full-depth decoding by the float64 reference, the twin applied before each argmax."""
    cfg, _, ref, _ = tiny_fused_parts()
    bias = dict(sp.get("logit_bias", {}))
    seq, out = list(prompt), []
    for _ in range(n):
        h = reference_forward(ref, cfg, seq)["hidden_states"][cfg.num_loops - 1, -1]
        x = adjust_logits_reference(
            h @ ref.lm_head.T,
            sp.get("presence_penalty", 0.0),
            sp.get("frequency_penalty", 0.0),
            sp.get("repetition_penalty", 1.0),
            out,
            prompt,
            bias,
        )
        out.append(int(np.argmax(x)))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(frequency_penalty=1.5),
        dict(presence_penalty=1.0, repetition_penalty=1.3),
        dict(logit_bias={7: 5.0, 9: -100.0}),
    ],
    ids=["frequency", "presence_repetition", "logit_bias"],
)
def test_penalised_greedy_tokens_equal_the_reference(kw):
    _, _, _, prompts = tiny_fused_parts()
    sp = SamplingParams(max_tokens=6, ignore_eos=True, exit_mode="fixed", **kw)
    free = SamplingParams(max_tokens=6, ignore_eos=True, exit_mode="fixed")
    with fused_engine() as llm:  # a penalised row beside a free one: fused steps, the coda deferred
        outs = llm.generate(prompts[:2], [sp, free], use_tqdm=False)
        assert llm.stats()["fused_launches"] > 0
        plain = llm.generate(prompts[:2], free, use_tqdm=False)
    assert outs[0].token_ids == _reference_decode(prompts[0], 6, **kw)
    assert outs[0].token_ids != plain[0].token_ids  # the penalty changed something
    assert outs[1].token_ids == plain[1].token_ids  # and nothing of its neighbour


def test_min_tokens_holds_off_eos():
    _, _, _, prompts = tiny_fused_parts()
    with fused_engine() as llm:
        eos = llm.scheduler_config.eos_token_ids[0]
        force = {eos: 100.0}  # eos would come first
        [early] = llm.generate(prompts[:1], SamplingParams(max_tokens=8, logit_bias=force), use_tqdm=False)
        [late] = llm.generate(prompts[:1], SamplingParams(max_tokens=8, logit_bias=force, min_tokens=3), use_tqdm=False)
    assert early.token_ids == [eos] and early.finish_reason == "stop"
    assert len(late.token_ids) == 4 and late.token_ids[-1] == eos and eos not in late.token_ids[:3]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(presence_penalty=2.5), r"presence_penalty must lie in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), r"frequency_penalty must lie in \[-2, 2\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (dict(min_p=1.5), r"min_p must lie in \[0, 1\]"),
        (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
        (dict(min_tokens=20, max_tokens=5), "min_tokens=20 exceeds max_tokens=5"),
        (dict(logit_bias={-1: 1.0}), "logit_bias: -1 is not a token id"),
        (dict(logit_bias={200: 1.0}), r"logit_bias: 200 is not a token id in the vocabulary \[0, 128\)"),
        (dict(logit_bias={3: 101.0}), r"logit_bias\[3\] must lie in \[-100, 100\]"),
        (dict(logit_bias=[(3, 1.0)]), "logit_bias must be a dict"),
    ],
)
def test_bad_values_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).validate(4, vocab_size=128)
