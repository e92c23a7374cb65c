"""Structured outputs through the engine: the coda rows of a guided request sample from the tokens
its grammar allows (the separate sampler applies the bitmask), and the request ends when the
grammar completes. The ``tiny`` preset's character tokenizer makes any JSON expressible."""

import json

import numpy as np
import pytest

from ouro_jax import LLM, SamplingParams
from ouro_jax.structured import GuidedDecoding

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 1, "maximum": 20},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny", max_num_seqs=4, max_model_len=96, buckets=[8, 32], max_num_batched_tokens=32) as e:
        yield e


def _valid(text: str) -> dict:
    d = json.loads(text)
    assert set(d) == {"color", "n", "ok"} and d["color"] in ("red", "green", "blue"), text
    assert isinstance(d["n"], int) and not isinstance(d["n"], bool) and 1 <= d["n"] <= 20, text
    assert isinstance(d["ok"], bool), text
    return d


def test_json_schema_gives_valid_json_greedy_and_sampled(llm):
    g = GuidedDecoding.json_schema(SCHEMA)
    sps = [SamplingParams(max_tokens=80, guided=g)] + [
        SamplingParams(max_tokens=80, guided=g, temperature=1.0, seed=s) for s in (1, 2, 3)
    ]
    free = SamplingParams(max_tokens=12, ignore_eos=True)  # an unguided request in the same batches
    outs = llm.generate([[40, 41, 42]] * 4 + [[43, 44]], sps + [free], use_tqdm=False)
    for o in outs[:4]:
        assert o.finish_reason == "stop", o
        _valid(o.text)
        assert " " not in o.text  # compact JSON: no free whitespace
    assert len(outs[4].token_ids) == 12  # the free request is untouched by the others' masks
    assert not llm._matchers and not llm.has_unfinished()


def test_choice_and_regex(llm):
    [a, b] = llm.generate(
        [[50, 51], [52]],
        [
            SamplingParams(max_tokens=20, guided=GuidedDecoding.choice(["yes", "no", "maybe"])),
            SamplingParams(max_tokens=20, guided=GuidedDecoding.regex(r"[0-9]{3}-[a-z]{2}"), temperature=0.8, seed=4),
        ],
        use_tqdm=False,
    )
    assert a.text in ("yes", "no", "maybe") and a.finish_reason == "stop"
    assert len(b.text) == 6 and b.text[:3].isdigit() and b.text[3] == "-" and b.text[4:].isalpha(), b.text


@pytest.mark.slow
def test_guided_rows_fuse_one_token_at_a_time():
    """Guided rows run in fused steps of one token, scheduled ahead, whose coda the separate
    sampler runs once the host has the mask (it needs the token before it), with the tokens and
    logprobs the loop-by-loop path gives, greedy and sampled, beside a free row."""
    g = GuidedDecoding.json_schema(SCHEMA)
    sps = [
        SamplingParams(max_tokens=80, guided=g, logprobs=2),
        SamplingParams(max_tokens=80, guided=g, temperature=0.9, seed=5),
        SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.7, seed=2),
    ]
    prompts = [[40, 41, 42], [43, 44], [45]]
    outs, texts = {}, {}
    for fused in (0, 4):
        # a fixed pool: on a GPU the module's engine holds the memory a sized pool would take
        with LLM("tiny", max_num_seqs=4, max_model_len=96, buckets=[8, 32], max_num_batched_tokens=32,
                 fused_decode_max_rows=fused, num_blocks=64, progress=False) as e:  # fmt: skip
            got = e.generate(prompts, sps, use_tqdm=False)
            st = e.stats()
        outs[fused] = [(o.token_ids, o.exit_depths, [lp.top for lp in o.logprobs or ()]) for o in got]
        texts[fused] = [o.text for o in got]
        assert (st["fused_launches"] > 0) == bool(fused)
        if fused:
            assert st["fused_tokens"] == st["fused_launches"] and st["ahead_launches"] > 0  # one token each
    assert [o[:2] for o in outs[0]] == [o[:2] for o in outs[4]]
    for (_, _, a), (_, _, b) in zip(outs[0], outs[4]):
        np.testing.assert_allclose([[v for _, v in t] for t in a], [[v for _, v in t] for t in b], atol=1e-5)
    for text in texts[4][:2]:
        _valid(text)


def test_guided_requests_get_logprobs_of_the_unmasked_distribution(llm):
    """The grammar masks the draw, not the reported distribution (the raw model's)."""
    sp = SamplingParams(max_tokens=8, logprobs=3, guided=GuidedDecoding.regex("[a-c]{4}"))
    [out] = llm.generate([[40, 41]], sp, use_tqdm=False)
    assert len(out.text) == 4 and set(out.text) <= set("abc"), out.text
    assert len(out.logprobs) == len(out.token_ids)
    abc = {llm.tokenizer.token_to_id(ch) for ch in "abc"}
    # the random model's favourites are outside the grammar: the top alternatives are not a-c
    assert any(t not in abc for lp in out.logprobs for t, _ in lp.top)
    for lp in out.logprobs:
        values = [v for _, v in lp.top]
        assert lp.logprob <= values[0] + 1e-6 and values == sorted(values, reverse=True)


def test_guided_requests_are_checked_first(llm):
    with pytest.raises(TypeError, match="SamplingParams.guided must be a GuidedDecoding"):
        llm.add_request([1, 2], SamplingParams(guided={"type": "object"}))
    with pytest.raises(ValueError, match="ignore_eos does not apply to a guided request"):
        llm.add_request([1, 2], SamplingParams(guided=GuidedDecoding.json_object(), ignore_eos=True))
    assert not llm.has_unfinished() and not llm._matchers


def test_an_aborted_guided_request_leaves_no_matcher(llm):
    rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=40, guided=GuidedDecoding.json_schema(SCHEMA)))
    llm.step()
    assert llm.abort(rid) and not llm._matchers
    while llm.has_unfinished():
        llm.step()
