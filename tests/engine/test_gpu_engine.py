"""The engine compiled on a GPU with the Pallas kernel (skipped without a GPU).

On the GPU the runner's attention is the Pallas ragged paged kernel; these tests check that it gives
the same tokens and exit depths as the jnp reference attention and as the dense ``generate()``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax import LLM, SamplingParams, forward, generate, get_preset
from weights.random_init import random_params

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Pallas kernels compiled)"),
]


@pytest.fixture(scope="module")
def model():
    cfg = get_preset("ouro-small")
    return cfg, jax.tree.map(jnp.asarray, random_params(cfg, 0))


def _diff(a, b):
    """Where two lists of (tokens, depths) first differ, for the failure message."""
    out = []
    for i, ((ta, da), (tb, db)) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(zip(ta, da), zip(tb, db))):
            if x != y:
                out.append(f"prompt {i} token {j}: {x} vs {y}")
                break
    return "; ".join(out)


@pytest.mark.parametrize("mode,threshold", [("split", 1.0), ("wavefront", 1.0), ("split", 0.6), ("wavefront", 0.6)])
def test_pallas_engine_equals_reference_engine_and_generate(model, mode, threshold):
    cfg, params = model
    rng = np.random.default_rng(0)
    lengths = [5, 40, 77, 130]
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in lengths]
    sp = SamplingParams(max_tokens=8, ignore_eos=True, exit_threshold=threshold)
    got = {}
    for attention in ("pallas", "reference"):
        llm = LLM(
            cfg,
            params=params,
            max_num_seqs=4,
            max_num_batched_tokens=128,
            prefill_chunk_size=32,
            max_model_len=256,
            buckets=[8, 32, 128],
            prefill_mode=mode,
            attention=attention,
            kv_cache_bytes=1 << 30,
            progress=False,
        )
        got[attention] = [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.stats()["compilations"] == len(llm.executable_keys())
    # One right-padded batch per check (one compilation each: compiles dominate this test's time).
    width = max(lengths)
    padded = jnp.asarray([p + [0] * (width - len(p)) for p in prompts])
    g = generate(params, cfg, padded, lengths, 8, exit_threshold=threshold)
    want = [(np.asarray(g.tokens[i]).tolist(), np.asarray(g.exit_depths[i]).tolist()) for i in range(len(prompts))]
    if threshold == 1.0:  # fixed depth: greedy over the full forward is a third, independent opinion
        full = [p + toks[:-1] for (toks, _), p in zip(want, prompts)]
        fw = max(map(len, full))
        logits = forward(params, cfg, jnp.asarray([f + [0] * (fw - len(f)) for f in full])).logits
        for i, ((toks, _), p) in enumerate(zip(want, prompts)):  # right padding changes nothing causal
            assert toks == np.asarray(jnp.argmax(logits[i, len(p) - 1 : len(full[i])], -1)).tolist()
    assert got["reference"] == want, "reference attention vs generate(): " + _diff(got["reference"], want)
    assert got["pallas"] == got["reference"], "pallas vs reference attention: " + _diff(got["pallas"], got["reference"])


# bf16: two attention kernels round differently, so a greedy choice between two tokens whose
# log-probabilities lie closer than this may go either way (and the rest of that output with it).
BF16_TIE_NATS = 0.05


def _bf16_agree(a, b, what: str) -> None:
    """``a``/``b``: per prompt ``(tokens, depths, logprobs)``. Equal, or equal up to a first token
    where each engine ranks the other's choice second, within ``BF16_TIE_NATS`` of its own first
    (the rest of that output is not compared); depths that differ first fail."""
    for i, ((ta, da, la), (tb, db, lb)) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(zip(ta, da), zip(tb, db))):
            if x == y:
                continue
            assert x[0] != y[0], f"{what}: prompt {i} token {j}: exit depth {x[1]} vs {y[1]} at the same token"
            for lp, other in ((la[j], y[0]), (lb[j], x[0])):
                top = dict(lp.top)
                gap = lp.logprob - top.get(other, -float("inf"))
                assert gap <= BF16_TIE_NATS, (
                    f"{what}: prompt {i} token {j}: {x[0]} vs {y[0]}, not a near tie ({gap:.4f} nats apart; "
                    f"top {lp.top})"
                )
            break


def test_mosaic_kernel_engine_equals_triton_kernel_engine(model):
    """bf16, where the Mosaic GPU kernel applies: the engine forced onto it (every bucket, decode
    rows included) or onto the per-segment split ("hybrid": segments of >= 32 rows on Mosaic,
    the rest on Triton) gives the tokens and exit depths of the engine on the Triton kernel, and
    the automatic choice ("pallas") gives them too, up to a near tie (``_bf16_agree``). Chunks of
    up to 192 rows put long segments in play next to short ones in one invocation: a fresh
    129-row prompt (two tiles, the second of one row) with 64-, 56- and 7-row prompts, then a
    136-row chunk after 56 rows of history."""
    from pallas_kernels.dispatch import hopper_available

    if not hopper_available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    got = kernel_engines(model, seed=1, attentions=("triton", "mgpu", "hybrid", "pallas"))
    for name in ("mgpu", "hybrid", "pallas"):
        _bf16_agree(got[name], got["triton"], f"{name} vs triton kernel")


def kernel_engines(model, seed: int, attentions) -> dict:
    """Tokens, exit depths and top-2 logprobs per attention choice of the bf16 engine of
    ``test_mosaic_kernel_engine_equals_triton_kernel_engine`` (prompts drawn with ``seed``; also
    run over other seeds by a probe, ``c47db58:benchmarks/results/run25/seed_probe.py``)."""
    cfg, params = model
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in (300, 129, 64, 7)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.6, logprobs=2)
    got = {}
    for attention in attentions:
        llm = LLM(
            cfg,
            params=params,
            dtype="bfloat16",
            max_num_seqs=4,
            max_num_batched_tokens=256,
            prefill_chunk_size=192,
            max_model_len=512,
            buckets=[8, 32, 256],
            attention=attention,
            kv_cache_bytes=1 << 30,
            progress=False,
        )
        outs = llm.generate(prompts, sp, use_tqdm=False)
        got[attention] = [(o.token_ids, o.exit_depths, o.logprobs) for o in outs]
    return got


def test_silu_epilogue_engine_equals_xla_gate_up_engine(monkeypatch):
    """bf16, prompt buckets with the gate/up GEMM's SiLU x up in its epilogue (``gate_up_silu_mgpu``,
    here from 128 rows: ``SILU_EPILOGUE_MIN_ROWS`` lowered) give the tokens and exit depths of the
    engine on XLA's GEMM and SiLU fusion, up to a near tie; the kernel is traced into the 128-row
    bucket only (an MLP width it serves: 768 = 6 x 128)."""
    import dataclasses

    import ouro_jax.model as model_mod
    from pallas_kernels import dispatch

    if not dispatch.hopper_available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    cfg = dataclasses.replace(get_preset("ouro-small"), intermediate_size=768)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), random_params(cfg, 0))
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in (300, 129, 64, 7)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.6, logprobs=2)
    traced_rows = []
    real = model_mod.gate_up_silu
    monkeypatch.setattr(model_mod, "gate_up_silu", lambda x, w: traced_rows.append(x.shape[0]) or real(x, w))
    got = {}
    for name, min_rows in (("epilogue", 128), ("xla", 1 << 30)):
        monkeypatch.setattr(dispatch, "SILU_EPILOGUE_MIN_ROWS", min_rows)
        llm = LLM(
            cfg,
            params=params,
            dtype="bfloat16",
            max_num_seqs=4,
            max_num_batched_tokens=128,
            prefill_chunk_size=128,
            max_model_len=512,
            buckets=[8, 128],
            kv_cache_bytes=1 << 30,
            progress=False,
        )
        outs = llm.generate(prompts, sp, use_tqdm=False)
        got[name] = [(o.token_ids, o.exit_depths, o.logprobs) for o in outs]
        llm.close()
    assert traced_rows and set(traced_rows) == {128}
    _bf16_agree(got["epilogue"], got["xla"], "SiLU epilogue vs XLA gate/up")


def test_long_segment_variant_engine_equals_hybrid_engine(model, monkeypatch):
    """bf16, attention split per segment ("hybrid"), wavefront chunks of 64 rows: invocations
    whose every segment holds >= 32 rows run on their bucket's long-segment variant (the Mosaic
    kernel alone, ``ModelRunner.executable_key``) and give the tokens and exit depths of the engine
    that runs every invocation on the split, up to a near tie. Both kinds of invocation occur (the
    first 7 take 64-row chunks only; the prompts' 8-row tails and decode rows keep the rest on the
    split)."""
    from ouro_jax.runner import ModelRunner
    from pallas_kernels import dispatch

    if not dispatch.hopper_available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    cfg, params = model
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in (300, 256, 200)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.6, logprobs=2)
    ran = []
    pick = ModelRunner.executable_key
    monkeypatch.setattr(ModelRunner, "executable_key", lambda self, d: ran.append(pick(self, d)) or ran[-1])
    got = {}
    for name in ("variant", "split"):
        if name == "split":
            monkeypatch.setattr(ModelRunner, "long_segment_key", lambda self, key: None)
        llm = LLM(
            cfg,
            params=params,
            dtype="bfloat16",
            max_num_seqs=4,
            max_num_batched_tokens=256,
            prefill_mode="wavefront",
            prefill_chunk_size=64,
            max_model_len=512,
            buckets=[8, 32, 256],
            attention="hybrid",
            kv_cache_bytes=1 << 30,
            progress=False,
        )
        ran.clear()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        got[name] = [(o.token_ids, o.exit_depths, o.logprobs) for o in outs]
        long = [k for k in ran if getattr(k, "M", 1) > 1]
        assert bool(long) == (name == "variant"), (name, ran)
        assert len(long) < len(ran)
        llm.close()
    _bf16_agree(got["variant"], got["split"], "long-segment variant vs hybrid split")
