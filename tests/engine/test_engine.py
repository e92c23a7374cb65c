"""The engine end to end on tiny models: the equivalence contract of docs/engine-semantics.md.

Token ids and exit depths must not depend on chunk size, prefill mode, buckets, batch composition
or arrival order, and (fixed full depth, LAST_EXITED) must equal the reference's greedy generation.
Engines share one persistent compilation cache (see ``conftest.compile_cache``) so that the many
engine configurations below do not each pay for compiling their buckets.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax import LLM, SamplingParams, get_preset
from ouro_jax.reference import from_param_tree, reference_greedy_generate, reference_shared_greedy_generate
from weights.random_init import random_params

CFG = get_preset("tiny")
PARAMS = jax.tree.map(jnp.asarray, random_params(CFG, 0))
REF = from_param_tree(CFG, random_params(CFG, 0))
RNG = np.random.default_rng(0)
LENGTHS = [1, 3, 7, 16, 17, 33]
# token 0 is EOS in the presets: keep it out of prompts so that every stream is easy to read
PROMPTS = [list(map(int, RNG.integers(1, CFG.vocab_size, n))) for n in LENGTHS]


def make_llm(**kw):
    args = dict(
        params=PARAMS,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_chunk_size=8,
        block_size=4,
        max_model_len=64,
        buckets=[8, 16, 64],
        progress=False,
    )
    args.update(kw)
    return LLM(CFG, **args)


def run(llm, prompts=PROMPTS, **sp):
    outs = llm.generate(prompts, SamplingParams(**{"max_tokens": 6, "ignore_eos": True, **sp}), use_tqdm=False)
    return [(o.token_ids, o.exit_depths) for o in outs]


def oracle(prompts=PROMPTS, **kw):
    out, ok = [], []
    for p in prompts:
        r = reference_greedy_generate(REF, CFG, p, 6, **kw)
        out.append((list(r.tokens), list(r.exit_depths)))
        ok.append(r.min_margin > 1e-4 and r.min_logit_gap > 1e-4)
    return out, ok


@pytest.fixture(scope="module")
def fixed_oracle():
    return oracle()


@pytest.fixture(scope="module")
def early_oracle():
    return oracle(exit_threshold=0.6)


def assert_matches(got, want, ok):
    assert sum(ok) >= len(ok) - 1, "too many near-ties in the oracle: pick another seed"
    for g, w, good in zip(got, want, ok):
        if good:
            assert g == w


@pytest.mark.parametrize(
    "chunk,buckets",
    [
        (4, [8, 16, 64]),
        pytest.param(16, [16, 64], marks=pytest.mark.slow),
        pytest.param(32, [8, 16, 32, 64], marks=pytest.mark.slow),
    ],
)
def test_fixed_depth_equals_reference(chunk, buckets, fixed_oracle):
    llm = make_llm(prefill_chunk_size=chunk, buckets=buckets)
    assert_matches(run(llm), *fixed_oracle)
    st = llm.stats()
    # everything was compiled at start-up (buckets, the default fused decode step, one separate
    # sampler per coda size), nothing since
    codas = {k.C for k in llm.scheduler.bucket_spec.keys()}
    assert st["compilations"] == len(llm.executable_keys()) == len(buckets) + 1 + len(codas)
    assert st["fused_launches"] > 0  # fixed depth: decode ran T loops per launch by default
    assert st["free_blocks"] == llm.scheduler_config.num_blocks - 1  # every block back (block 0 is trash)


@pytest.mark.parametrize("mode", ["split", "mixed", "wavefront"])
@pytest.mark.parametrize("chunk", [4, *(pytest.param(c, marks=pytest.mark.slow) for c in (8, 16, 32))])
def test_modes_and_chunks_agree_with_early_exit(mode, chunk, early_oracle):
    llm = make_llm(prefill_mode=mode, prefill_chunk_size=chunk)
    got = run(llm, exit_threshold=0.6)
    assert_matches(got, *early_oracle)
    assert len({d for _, depths in got for d in depths[1:]}) >= 2, "exit depths should vary"
    assert llm.stats()["free_blocks"] == llm.scheduler_config.num_blocks - 1


@pytest.mark.slow
def test_arrival_order_and_decode_traffic(early_oracle):
    """Requests arrive while others decode, in a shuffled order, with a small budget."""
    llm = make_llm(prefill_mode="wavefront", max_num_seqs=3, max_num_batched_tokens=16, buckets=[8, 16])
    sp = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.6)
    order = [4, 0, 5, 2, 1, 3]
    ids, final = {}, {}
    pending = list(order)
    steps = 0
    while pending or llm.has_unfinished():
        if pending and steps % 3 == 0:
            i = pending.pop(0)
            ids[llm.add_request(PROMPTS[i], sp)] = i
        final.update((o.request_id, o) for o in llm.step() if o.finished)
        steps += 1
    got = [None] * len(PROMPTS)
    for rid, i in ids.items():
        got[i] = (final[rid].token_ids, final[rid].exit_depths)
    assert_matches(got, *early_oracle)


@pytest.mark.slow
def test_delayed_and_fixed_exit_modes_match_reference():
    for kw in (
        dict(exit_threshold=0.6, exit_mode="delayed"),
        dict(exit_mode="fixed", max_loops=2),
        dict(exit_threshold=0.5, min_loops=2, max_loops=3),
    ):
        want, ok = oracle(PROMPTS[:4], **kw)
        for mode in ("split", "wavefront"):
            assert_matches(run(make_llm(prefill_mode=mode), PROMPTS[:4], **kw), want, ok)


@pytest.mark.slow
def test_seeded_sampling_is_schedule_independent():
    sp = dict(temperature=0.9, top_k=30, top_p=0.9, seed=11)
    a = run(make_llm(prefill_mode="split", prefill_chunk_size=4), **sp)
    b = run(make_llm(prefill_mode="wavefront", prefill_chunk_size=16, buckets=[16, 64]), **sp)
    assert a == b
    c = run(make_llm(), **{**sp, "seed": 12})
    assert a != c


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, dict(exit_threshold=0.6)])
def test_shared_layout_equals_shared_oracle(kw):
    """SHARED: one plane, prompts position by position; checked against an independent numpy oracle."""
    prompts = PROMPTS[:4]
    want, ok = [], []
    for p in prompts:
        r = reference_shared_greedy_generate(REF, CFG, p, 6, **kw)
        want.append((list(r.tokens), list(r.exit_depths)))
        ok.append(r.min_margin > 1e-4 and r.min_logit_gap > 1e-4)
    a = run(make_llm(kv_layout="shared", prefill_chunk_size=4), prompts, **kw)
    b = run(make_llm(kv_layout="shared", prefill_mode="mixed", buckets=[16, 64]), prompts, **kw)
    assert a == b
    assert_matches(a, want, ok)
    # SHARED is not a lossless LAST_EXITED: with the same weights the streams differ somewhere
    assert a != run(make_llm(), prompts, **kw)


def test_shared_layout_rejects_wavefront():
    with pytest.raises(ValueError, match="(?i)last_exited"):
        make_llm(kv_layout="shared", prefill_mode="wavefront")


@pytest.mark.slow
def test_wavefront_fills_more_rows_than_split_at_small_chunk():
    long = [list(map(int, RNG.integers(1, CFG.vocab_size, 60))) for _ in range(2)]
    rows = {}
    for mode in ("split", "wavefront"):
        llm = make_llm(prefill_mode=mode, prefill_chunk_size=4, max_model_len=72)
        run(llm, long)
        rows[mode] = llm.stats()["rows_per_invocation"]
    assert rows["wavefront"] > 1.5 * rows["split"], rows


def test_streaming_abort_and_step_api():
    llm = make_llm()
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    seen = {}
    for out in llm.stream(PROMPTS[:3], sp):
        seen.setdefault(out.request_id, []).append(len(out.token_ids))
    assert all(v == sorted(v) and v[-1] == 5 for v in seen.values())
    a = llm.add_request(PROMPTS[5], SamplingParams(max_tokens=20, ignore_eos=True))
    b = llm.add_request(PROMPTS[4], SamplingParams(max_tokens=3, ignore_eos=True))
    final = {}
    for _ in range(6):
        final.update((o.request_id, o) for o in llm.step() if o.finished)
    assert llm.abort(a)
    assert not llm.abort(a)
    while llm.has_unfinished():
        final.update((o.request_id, o) for o in llm.step() if o.finished)
    assert final[a].finish_reason == "abort"
    assert len(final[b].token_ids) == 3
    assert llm.stats()["free_blocks"] == llm.scheduler_config.num_blocks - 1


@pytest.mark.parametrize(
    "prompt,sp,msg",
    [
        ([], {}, "empty"),
        ([1] * 70, {}, "max_model_len"),
        ([1, 2], dict(temperature=float("nan")), "temperature"),
        ([1, 2], dict(top_p=1.5), "top_p"),
        ([1, 2], dict(exit_mode="sometimes"), "exit_mode"),
        ([1, 2], dict(max_tokens=0), "max_tokens"),
        ([1, 2], dict(min_loops=3, max_loops=2), "min_loops"),
        ([1, 999], {}, "vocabulary"),
    ],
)
def test_bad_requests_are_rejected_before_anything_runs(prompt, sp, msg):
    llm = make_llm(warmup=False)
    with pytest.raises(ValueError, match=msg):
        llm.generate([PROMPTS[0], prompt], SamplingParams(**sp), use_tqdm=False)
    assert not llm.has_unfinished()  # the good prompt was not queued either
    assert llm.stats()["invocations"] == 0


def test_bad_engine_configs():
    with pytest.raises(ValueError, match="cannot hold one request"):
        make_llm(num_blocks=10)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_llm(buckets=[8, 16])
    with pytest.raises(ValueError, match="prefill_mode"):
        make_llm(prefill_mode="eager")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_llm(gpu_memory_utilization=0.0)
    with pytest.raises(ValueError, match="preset"):
        LLM("no-such-model")


@pytest.mark.slow
def test_kv_exhaustion_waits_instead_of_failing():
    """A pool that holds one long request at a time: the others wait for blocks, none is dropped
    (reserve allocation; on-demand allocation preempts instead: tests/engine/test_preemption.py)."""
    llm = make_llm(num_blocks=4 * 17 + 1, max_model_len=64, kv_allocation="reserve")
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    outs = llm.generate([PROMPTS[5], PROMPTS[4], PROMPTS[3]], sp, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [30, 30, 30]
    # the first request holds 64 of the 68 usable blocks until it finishes: the others waited
    assert outs[1].metrics.first_token_time > outs[0].metrics.finish_time - 1e-9
    assert llm.stats()["free_blocks"] == 68


@pytest.mark.slow
def test_checkpoint_folder_with_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from weights import save_random

    save_random(tmp_path, "tiny", seed=0)
    vocab = {f"w{i}": i for i in range(CFG.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(
        str(tmp_path),
        max_num_seqs=2,
        max_num_batched_tokens=16,
        prefill_chunk_size=8,
        block_size=4,
        max_model_len=32,
        buckets=[8, 16],
        progress=False,
    )
    [out] = llm.generate(["w5 w6 w7"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert list(out.prompt_token_ids) == [5, 6, 7]
    assert out.text == " ".join(f"w{t}" for t in out.token_ids)
    # the same weights through params= give the same tokens
    assert run(make_llm(), [[5, 6, 7]], max_tokens=4) == [(out.token_ids, out.exit_depths)]
    assert out.metrics.ttft is not None and out.metrics.ttft >= 0 and len(out.metrics.itl) == 3


LONG = [list(map(int, RNG.integers(1, CFG.vocab_size, n))) for n in (3, 70, 150, 200)]


@pytest.fixture(scope="module")
def long_oracles():
    return {thr: oracle(LONG, exit_threshold=thr) for thr in (1.0, 0.6)}


def _staggered(llm, sp):
    """Two short requests start decoding first; the long prompts arrive while they decode."""
    order, ids, steps, final = [0, 1, 2, 3], {}, 0, {}
    arrivals = {0: [0, 1], 3: [2], 6: [3]}
    while order or llm.has_unfinished():
        for i in arrivals.get(steps, []):
            ids[llm.add_request(LONG[i], sp)] = i
            order.remove(i)
        final.update((o.request_id, o) for o in llm.step() if o.finished)
        steps += 1
    got = [None] * len(LONG)
    for rid, i in ids.items():
        got[i] = (final[rid].token_ids, final[rid].exit_depths)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 32, 64, 128])
@pytest.mark.parametrize("budget", [128, 256])
def test_all_modes_identical_with_long_prompts_and_decode_traffic(chunk, budget, long_oracles):
    """engine-semantics' equivalence at chunk 16..128 and two token budgets, fixed depth and early
    exit, with decode rows sharing invocations with the prompts (mixed, wavefront)."""
    for thr in (1.0, 0.6):
        results = {}
        for mode in ("split", "mixed", "wavefront"):
            llm = make_llm(
                prefill_mode=mode,
                prefill_chunk_size=chunk,
                max_num_batched_tokens=budget,
                max_model_len=256,
                buckets=[8, 32, budget],
            )
            results[mode] = _staggered(llm, SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=thr))
            assert llm.stats()["free_blocks"] == llm.scheduler_config.num_blocks - 1
        assert results["split"] == results["mixed"] == results["wavefront"]
        assert_matches(results["split"], *long_oracles[thr])
