"""Self-speculative decoding (``scheduler/speculation.py``, ``ouro_jax/speculative.py``).

A round drafts ``k + 1`` positions with ``d`` loops and verifies them at full depth, resuming from
the draft's hidden states. Greedy tokens and exit depths must be plain decoding's (float32), at
fixed depth and under the gate rule, whatever else runs beside: against the engine without
speculation and the full-recompute reference, on HF-layout tiny checkpoints the tests write (T=3
and T=4). Two weight sets: the random checkpoint (drafts mostly rejected) and a *converging* one
whose branches are scaled down so that later loops change the state little (drafts mostly
accepted), so that both the reject and the accept paths run. Sampled tokens follow plain
decoding's distribution (a statistical test over many seeds on the tiny vocabulary).
"""

import functools

import jax
import numpy as np
import pytest

from ouro_jax import LLM, SamplingParams, get_preset
from ouro_jax.reference import from_param_tree, reference_greedy_generate
from weights.checkpoint import save_random

PROMPTS = [[5, 9, 2], [7, 1, 8, 3, 3, 6, 2, 9, 4], list(range(10, 27))]
SCALE = 0.01  # of the branch norms in the converging weights
SPEC = {"method": "loops", "draft_loops": 1, "num_speculative_tokens": 3}


@functools.cache
def checkpoint(T: int) -> str:
    import tempfile

    folder = tempfile.mkdtemp(prefix=f"ouro-spec-T{T}-")
    return save_random(folder, get_preset("tiny").replace(total_ut_steps=T), seed=3, layout="hf", dtype="float32")


@functools.cache
def converging(T: int):
    """The checkpoint's weights made to converge (``weights.converging``: each layer adds SCALE of its
    update, the final norm nearly constant): later loops move the state little."""
    from weights.checkpoint import load_checkpoint
    from weights.converging import converging_params

    cfg, params = load_checkpoint(checkpoint(T))
    return converging_params(params, cfg, SCALE)


def engine(T: int = 4, weights: str = "random", **kw) -> LLM:
    args = dict(
        max_num_seqs=4,
        max_num_batched_tokens=32,
        prefill_chunk_size=8,
        block_size=4,
        max_model_len=48,
        buckets=[8, 32],
        fused_decode_max_rows=4,
        num_blocks=4 * 12 * 4 + 1,  # four 48-token requests: a fixed pool (engines of one process share a GPU)
        progress=False,
    )
    args.update(kw)
    params = converging(T) if weights == "converging" else None
    return LLM(checkpoint(T), params=params, **args)


def greedy(max_tokens=9, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def outputs(llm, prompts, params):
    return [(o.token_ids, o.exit_depths, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]


def check_spec_equals_plain(T, weights, params, spec=SPEC, **kw):
    plain = engine(T, weights, **kw)
    want = outputs(plain, PROMPTS, params)
    llm = engine(T, weights, speculative_config=spec, **kw)
    got = outputs(llm, PROMPTS, params)
    assert got == want
    st = llm.stats()
    assert st["spec_rounds"] > 0
    assert st["free_blocks"] == llm.scheduler_config.num_blocks - 1
    return llm, want


@pytest.mark.parametrize("weights", [pytest.param("random", marks=pytest.mark.slow), "converging"])
def test_greedy_rounds_give_plain_decodings_tokens_and_the_reference(weights):
    params = [greedy(9, exit_mode="fixed"), greedy(7, exit_mode="fixed"), greedy(8, exit_mode="fixed")]
    llm, want = check_spec_equals_plain(4, weights, params)
    st = llm.stats()
    assert 0.0 <= st["spec_acceptance"] <= 1.0
    assert 1.0 <= st["spec_mean_accepted_length"] <= SPEC["num_speculative_tokens"] + 1
    if weights == "converging":  # drafts agree: rounds give several tokens
        assert st["spec_acceptance"] > 0.5 and st["spec_mean_accepted_length"] > 2
    assert st["spec_draft_time_s"] > 0 and st["spec_verify_time_s"] > 0
    if weights == "random":
        ref = from_param_tree(get_preset("tiny"), jax.tree.map(np.asarray, llm.params))
        for prompt, p, (toks, _, _) in zip(PROMPTS, params, want):
            r = reference_greedy_generate(ref, llm.model_config, prompt, p.max_tokens)
            if r.min_logit_gap > 1e-4:
                assert toks == list(r.tokens)


@pytest.mark.slow  # 21 s on 2 cores: the README command's 5 minutes; greedy rounds stay in the default suite
@pytest.mark.parametrize("weights", ["random", "converging"])
def test_gate_rule_exits_match_plain_decoding(weights):
    """Rows that exit within the draft's loops exit for real; the others exit in the verify, each
    at its own depth, and the positions after an exited one read its finalized planes."""
    params = [
        greedy(9, exit_threshold=0.4),
        greedy(8, exit_threshold=0.7, min_loops=2),
        greedy(9, exit_threshold=0.55, exit_mode="delayed"),
    ]
    _, want = check_spec_equals_plain(4, weights, params, spec={**SPEC, "draft_loops": 2})
    depths = {d for _, ds, _ in want for d in ds}
    assert len(depths) > 1, "the gate rule should give several exit depths on these weights"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["split", "mixed", "wavefront"])
def test_rounds_beside_chunked_prefill_in_every_mode(mode):
    """Requests arriving while others decode: rounds run loop by loop beside their prompt chunks
    (and fused once every request decodes), with plain steps where drafts do not pay."""
    T = 3
    for weights in ("random", "converging"):
        plain = engine(T, weights, prefill_mode=mode)
        llm = engine(T, weights, prefill_mode=mode, speculative_config={**SPEC, "num_speculative_tokens": 2})
        results = []
        for e in (plain, llm):
            done = {}
            e.add_request(PROMPTS[0], greedy(12, exit_threshold=0.5), request_id="a")
            steps = 0
            while e.has_unfinished():
                for o in e.step():
                    if o.finished:
                        done[o.request_id] = (o.token_ids, o.exit_depths)
                steps += 1
                if steps == 3:
                    e.add_request(PROMPTS[2], greedy(10, exit_mode="fixed"), request_id="b")
                if steps == 6:
                    e.add_request(PROMPTS[1], greedy(11, exit_threshold=0.6), request_id="c")
            results.append(done)
        assert results[0] == results[1]
        st = llm.stats()
        assert st["spec_rounds"] > 0 and st["spec_loop_rounds"] > 0  # fused, and beside prompt chunks


@pytest.mark.slow
def test_three_loops_and_synthetic_depths():
    params = [greedy(9, exit_mode="synthetic", synthetic_mean_loops=2.2), greedy(7), greedy(8, exit_threshold=0.5)]
    for weights in ("random", "converging"):
        check_spec_equals_plain(3, weights, params, spec={**SPEC, "draft_loops": 2, "num_speculative_tokens": 4})


@pytest.mark.slow
def test_preemption_and_abort_between_rounds_lose_nothing():
    """A pool too small for every request at once preempts between rounds; an abort while a round
    is in flight drops the request and frees its blocks."""
    params = [greedy(14), greedy(12), greedy(13)]
    kw = dict(num_blocks=56, watermark=0.0)  # one request's 48-token table needs 49; the three need 76
    _, want = check_spec_equals_plain(4, "converging", params, **kw)
    llm = engine(4, "converging", speculative_config=SPEC, **kw)
    assert outputs(llm, PROMPTS, params) == want
    assert llm.stats()["preemptions"] > 0
    for rid, prompt, p in zip("xyz", PROMPTS, params):
        llm.add_request(prompt, p, request_id=rid)
    finished = {}
    while llm.stats()["spec_row_rounds"] < 3:  # rounds fused or loop by loop
        finished.update({o.request_id: o for o in llm.step() if o.finished})
    assert "y" not in finished
    llm.abort("y")
    while llm.has_unfinished():
        for o in llm.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished["y"].finish_reason == "abort"
    assert finished["x"].token_ids == want[0][0] and finished["z"].token_ids == want[2][0]
    assert llm.stats()["free_blocks"] == llm.scheduler_config.num_blocks - 1


@pytest.mark.slow
def test_sampled_tokens_follow_plain_decodings_distribution():
    """Over many seeds the 2nd and 3rd sampled tokens of one prompt have the same distribution with
    and without speculation (two-sample chi-square on the tokens both see often)."""
    n = 160
    prompt = PROMPTS[1]
    params = [
        SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=s, exit_mode="fixed") for s in range(n)
    ]
    got = []
    for spec in (None, SPEC):
        llm = engine(4, "converging", speculative_config=spec, max_num_seqs=4)
        got.append(np.array([o.token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)]))
    assert llm.stats()["spec_rounds"] > 0
    for pos in (1, 2):
        a, b = got[0][:, pos], got[1][:, pos]
        vocab = np.union1d(a, b)
        ca = np.array([(a == v).sum() for v in vocab], float)
        cb = np.array([(b == v).sum() for v in vocab], float)
        keep = (ca + cb) >= 10  # pool the rare tokens into one cell
        ca = np.append(ca[keep], ca[~keep].sum())
        cb = np.append(cb[keep], cb[~keep].sum())
        tot = ca + cb
        ok = tot > 0
        ea, eb = tot[ok] * ca.sum() / tot.sum(), tot[ok] * cb.sum() / tot.sum()
        chi2 = (((ca[ok] - ea) ** 2) / ea + ((cb[ok] - eb) ** 2) / eb).sum()
        dof = ok.sum() - 1
        assert chi2 < dof + 5 * np.sqrt(2 * dof) + 5, (pos, chi2, dof)


def test_bad_speculative_configs_fail_before_any_work():
    with pytest.raises(ValueError, match="below the model's 4 loops"):
        engine(speculative_config={**SPEC, "draft_loops": 4})
    with pytest.raises(ValueError, match="LAST_EXITED"):
        engine(speculative_config=SPEC, kv_layout="shared")
    with pytest.raises(ValueError, match="unknown key"):
        engine(speculative_config={**SPEC, "tokens": 2})
    with pytest.raises(ValueError, match="not JSON"):
        engine(speculative_config="{draft_loops: 1}")
    with pytest.raises(ValueError, match="positive integer"):
        engine(speculative_config={**SPEC, "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="ring region"):
        engine(speculative_config={**SPEC, "num_speculative_tokens": 8})
    with pytest.raises(ValueError, match="fused decode"):
        engine(speculative_config=SPEC, fused_decode_max_rows=0)


def test_the_option_as_flag_dict_and_json():
    """``--speculative-config`` takes JSON, ``LLM`` a dict or the config; ``to_argv`` gives the flag back."""
    import argparse

    from ouro_jax.engine_config import EngineConfig, add_arguments, from_arguments, to_argv
    from scheduler.speculation import SpeculativeConfig

    p = argparse.ArgumentParser()
    add_arguments(p, ["scheduler"])
    got = from_arguments(p.parse_args(["--speculative-config", '{"draft_loops": 2, "num_speculative_tokens": 4}']))
    cfg = EngineConfig(**got)
    assert cfg.speculative_config == SpeculativeConfig(draft_loops=2, num_speculative_tokens=4)
    assert EngineConfig(speculative_config=dict(SPEC)).speculative_config == SpeculativeConfig(1, 3)
    again = from_arguments(p.parse_args(to_argv({"speculative_config": cfg.speculative_config})))
    assert EngineConfig(**again) == cfg
    with pytest.raises(ValueError, match="method must be one of"):
        EngineConfig(speculative_config={"method": "ngram"})


def test_metrics_show_the_engines_acceptance():
    from ouro_jax.server.engine_loop import SPEC_STATE
    from ouro_jax.server.metrics import ServerMetrics

    m = ServerMetrics("m")
    state = dict(running=1, waiting=0, kv_usage=0.5, spec_acceptance=0.75, spec_mean_accepted_length=2.5)
    state.update(spec_row_rounds=8, spec_draft_time_s=0.25, spec_verify_time_s=0.5)
    assert set(SPEC_STATE) <= set(state)
    m.engine_state(state, replica=0)
    text = m.render().decode()
    assert 'ouro_spec_acceptance_ratio{model_name="m",replica="0"} 0.75' in text
    assert 'ouro_spec_mean_accepted_length{model_name="m",replica="0"} 2.5' in text
    assert 'ouro_spec_verify_seconds{model_name="m",replica="0"} 0.5' in text


def test_rounds_stop_where_drafts_are_rejected_and_tokens_do_not_change():
    """On random weights drafts are rejected: after the first rounds the request decodes plainly and
    probes again after a back-off (``RoundPolicy``); on converging weights rounds keep going."""
    prompt, params = PROMPTS[0], greedy(40, exit_mode="fixed")
    want = outputs(engine(4, "random"), [prompt], params)
    llm = engine(4, "random", speculative_config=SPEC)
    assert outputs(llm, [prompt], params) == want
    st = llm.stats()
    assert st["spec_declined_steps"] > 0
    assert 3 <= st["spec_rounds"] <= 5, st["spec_rounds"]  # 3 rounds, then probes after 16, 32 tokens
    llm = engine(4, "converging", speculative_config=SPEC)
    outputs(llm, [prompt], params)
    assert llm.stats()["spec_declined_steps"] == 0


@pytest.mark.slow
def test_loop_by_loop_rounds_keep_sampled_ids_of_plain_decoding():
    """With more requests decoding than a fused step takes, rounds run loop by loop, where a draft
    is kept only when it equals the token plain decoding samples (exact match, with plain
    decoding's key): sampled ids, not just their distribution, are plain decoding's. Once one
    request is left it fuses, and fused rounds follow the rule of speculative sampling: the
    tokens are compared up to there."""
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=s, exit_mode="fixed") for s in (1, 2, 3)
    ]
    kw = dict(fused_decode_max_rows=1)
    want = [toks for toks, _, _ in outputs(engine(4, "converging", **kw), PROMPTS, params)]
    llm = engine(4, "converging", speculative_config=SPEC, **kw)
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        llm.add_request(prompt, p, request_id=i)
    got = {i: [] for i in range(len(PROMPTS))}
    while llm.has_unfinished():
        outs = llm.step()
        if llm.stats()["spec_rounds"]:
            break  # a fused round: its sampled tokens follow plain decoding's distribution only
        got.update({o.request_id: list(o.token_ids) for o in outs})
    assert all(toks == want[i][: len(toks)] for i, toks in got.items())
    st = llm.stats()
    assert sum(map(len, got.values())) >= 20 and st["spec_loop_rounds"] > 0 and st["spec_accepted_tokens"] > 0
