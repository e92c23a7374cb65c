"""The float64 numpy reference checked against the math docs and against itself."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ouro_jax.reference import (
    exit_decision,
    exit_distribution,
    from_param_tree,
    layer_finish,
    layer_qkv,
    load_reference_weights,
    reference_forward,
    reference_greedy_generate,
    rms_norm,
    rope_cos_sin,
    select_logits,
)
from weights.config import get_preset
from weights.hf_names import hf_name_to_path, set_path
from weights.random_init import random_hf_tensors

PRESETS = ["tiny", "tiny-gqa"]


def logit(p):
    return float(np.log(p / (1 - p)))


@pytest.fixture(scope="module", params=PRESETS)
def model(request):
    cfg = get_preset(request.param)
    return cfg, load_reference_weights(cfg, random_hf_tensors(cfg, seed=1))


def prompt(cfg, n, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n).tolist()


def test_reference_imports_neither_jax_nor_flax():
    code = "import sys, ouro_jax.reference; assert not {'jax', 'flax'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------ exit distribution
@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-30, 30), min_size=1, max_size=6))
def test_exit_distribution_sums_to_one_and_matches_closed_form(g):
    p = exit_distribution(np.array(g))
    lam = 1 / (1 + np.exp(-np.array(g)))
    T = len(g)
    expect = [lam[t] * np.prod(1 - lam[:t]) for t in range(T - 1)] + [np.prod(1 - lam[: T - 1])]
    np.testing.assert_allclose(p, expect, rtol=1e-9, atol=1e-15)  # 1 - lambda cancels
    assert abs(p.sum() - 1) < 1e-12 and (p >= 0).all()


def test_gates_example_from_semantics_doc():
    g = [logit(0.3), logit(0.3), -30.0, -30.0]
    assert exit_distribution(np.array(g))[:2].sum() == pytest.approx(0.51)
    e, margin = exit_decision(g, exit_threshold=0.5)
    assert e == 1 and margin == pytest.approx(0.01)  # 0.3 < 0.5 <= 0.51
    assert exit_decision(g, exit_threshold=0.52)[0] == 3  # never reached: the last loop
    assert exit_decision(g, exit_threshold=0.3)[0] == 0
    assert exit_decision(g, exit_threshold=0.3, min_loops=2)[0] == 1  # loop 0 still counts


# ---------------------------------------------------------------------------------- exit rule
G = [logit(0.1), logit(0.5), logit(0.5), logit(0.9), 0.0]  # 1-remaining: .1 .55 .775 .9775
CASES = [  # (kwargs, ouro, delayed, fixed)
    (dict(), 4, 4, 4),  # threshold 1.0: always max loops
    (dict(exit_threshold=0.5), 1, 2, 4),
    (dict(exit_threshold=0.05), 0, 1, 4),
    (dict(exit_threshold=0.05, min_loops=3), 2, 3, 4),
    (dict(exit_threshold=0.99), 4, 4, 4),  # last loop, delay capped
    (dict(exit_threshold=0.7, max_loops=3), 2, 2, 2),  # reached at the cap
    (dict(exit_threshold=0.8, max_loops=3), 2, 2, 2),  # cap reached first
    (dict(exit_threshold=0.5, max_loops=2), 1, 1, 1),  # delay capped by max_loops
    (dict(exit_threshold=0.95, max_loops=4), 3, 3, 3),
    (dict(exit_threshold=0.0), 0, 1, 4),
    (dict(max_loops=1), 0, 0, 0),
]


@pytest.mark.parametrize("kw,ouro,delayed,fixed", CASES)
def test_exit_rule_modes(kw, ouro, delayed, fixed):
    assert exit_decision(G, exit_mode="ouro", **kw)[0] == ouro
    assert exit_decision(G, exit_mode="delayed", **kw)[0] == delayed
    assert exit_decision(G, exit_mode="fixed", **kw)[0] == fixed


def test_exit_rule_margin_and_errors():
    assert exit_decision(G, exit_threshold=0.5)[1] == pytest.approx(0.05)  # min(.4, .05)
    assert exit_decision(G)[1] == np.inf and exit_decision(G, exit_mode="fixed")[1] == np.inf
    with pytest.raises(ValueError):
        exit_decision(G, exit_mode="sometimes")
    with pytest.raises(ValueError):
        exit_decision(G, max_loops=6)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-6, 6), min_size=4, max_size=4), st.floats(0.01, 0.99))
def test_select_logits_threshold_agrees_with_ouro_rule(g, q):
    """cumsum(p)_t >= q (the model's selection) is the engine's ouro rule with default bounds."""
    gates = np.array(g)[:, None]
    reached = np.cumsum(exit_distribution(gates), axis=0)[:, 0] >= q
    t_sel = int(reached.argmax()) if reached.any() else 3
    e, margin = exit_decision(g, exit_threshold=q)
    if margin > 1e-9:
        assert e == t_sel


# ------------------------------------------------------------------------------------ forward
def test_forward_shapes_and_select_logits(model):
    cfg, w = model
    T, S = cfg.num_loops, 7
    out = reference_forward(w, cfg, prompt(cfg, S))
    assert out["hidden_states"].shape == (T, S, cfg.hidden_size)
    assert out["gate_logits"].shape == out["exit_probs"].shape == (T, S)
    np.testing.assert_allclose(out["exit_probs"].sum(0), 1)
    hs, g = out["hidden_states"], out["gate_logits"]
    last = select_logits(w, hs, g)
    np.testing.assert_array_equal(last, hs[-1] @ w.lm_head.T)
    np.testing.assert_array_equal(select_logits(w, hs, g, exit_at_step=1), hs[1] @ w.lm_head.T)
    np.testing.assert_array_equal(select_logits(w, hs, g, exit_threshold=0.0), hs[0] @ w.lm_head.T)
    np.testing.assert_array_equal(select_logits(w, hs, g, exit_threshold=1.5), last)
    # the final norm is applied after every loop
    rms = np.sqrt(np.mean((hs / w.norm) ** 2, axis=-1))
    np.testing.assert_allclose(rms, 1, atol=1e-5)


def test_forward_is_causal(model):
    cfg, w = model
    ids = prompt(cfg, 8)
    a = reference_forward(w, cfg, ids)
    b = reference_forward(w, cfg, ids[:5] + [(t + 1) % cfg.vocab_size for t in ids[5:]])
    np.testing.assert_array_equal(a["hidden_states"][:, :5], b["hidden_states"][:, :5])
    assert not np.allclose(a["hidden_states"][:, 5], b["hidden_states"][:, 5])


def test_last_exited_full_depth_equals_plain(model):
    cfg, w = model
    ids = prompt(cfg, 9)
    plain = reference_forward(w, cfg, ids)
    full = reference_forward(w, cfg, ids, exit_depths=[cfg.num_loops - 1] * 9)
    for k in plain:
        np.testing.assert_array_equal(plain[k], full[k])


def test_last_exited_changes_only_what_reads_the_stale_kv(model):
    cfg, w = model
    T, S, j, e = cfg.num_loops, 8, 4, 0
    ids = prompt(cfg, S)
    plain = reference_forward(w, cfg, ids)["hidden_states"]
    depths = [T - 1] * S
    depths[j] = e
    early = reference_forward(w, cfg, ids, exit_depths=depths)["hidden_states"]
    np.testing.assert_array_equal(plain[:, :j], early[:, :j])  # earlier positions
    np.testing.assert_array_equal(plain[: e + 1], early[: e + 1])  # loops up to e_j
    assert not np.allclose(plain[e + 1 :, j + 1 :], early[e + 1 :, j + 1 :])
    with pytest.raises(ValueError):
        reference_forward(w, cfg, ids, exit_depths=[T] * S)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """tiny-gqa equals the same model with KVH = H and each KV head's weights repeated H/KVH times
    (query head h reads KV head h // (H/KVH), as in HF repeat_kv)."""
    cfg = get_preset("tiny-gqa")
    rep, hd = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    hf = dict(random_hf_tensors(cfg, seed=3))
    mha_cfg = cfg.replace(num_key_value_heads=cfg.num_attention_heads)
    mha = dict(hf)
    for i in range(cfg.num_hidden_layers):
        for n in ("k_proj", "v_proj"):
            name = f"model.layers.{i}.self_attn.{n}.weight"
            wk = hf[name].reshape(cfg.num_key_value_heads, hd, -1)
            mha[name] = np.repeat(wk, rep, axis=0).reshape(cfg.num_attention_heads * hd, -1)
    ids = prompt(cfg, 6)
    a = reference_forward(load_reference_weights(cfg, hf), cfg, ids)
    b = reference_forward(load_reference_weights(mha_cfg, mha), mha_cfg, ids)
    np.testing.assert_allclose(a["hidden_states"], b["hidden_states"], rtol=1e-12, atol=1e-12)


def test_from_param_tree_matches_hf_weights():
    cfg = get_preset("tiny-gqa")
    hf = dict(random_hf_tensors(cfg, seed=2))
    tree = {}
    for name, arr in hf.items():
        path, transpose = hf_name_to_path(name)
        set_path(tree, path, arr.T if transpose else arr)
    a, b = load_reference_weights(cfg, hf), from_param_tree(cfg, tree)
    ids = prompt(cfg, 5)
    np.testing.assert_array_equal(
        reference_forward(a, cfg, ids)["hidden_states"], reference_forward(b, cfg, ids)["hidden_states"]
    )
    np.testing.assert_array_equal(from_param_tree(cfg, {"params": tree}).lm_head, a.lm_head)
    del hf["lm_head.weight"]
    with pytest.raises(KeyError, match="lm_head"):
        load_reference_weights(cfg, hf)


# ----------------------------------------------------------------------------------- generation
def test_greedy_fixed_depth_equals_teacher_forced_argmax(model):
    cfg, w = model
    T, ids, n = cfg.num_loops, prompt(cfg, 5), 6
    res = reference_greedy_generate(w, cfg, ids, n, max_loops=T)
    tokens, depths = res  # unpacks like a (tokens, depths) pair
    assert len(tokens) == n and depths == [T - 1] * n and res.min_margin == np.inf
    out = reference_forward(w, cfg, ids + tokens[:-1])
    logits = select_logits(w, out["hidden_states"], out["gate_logits"], exit_at_step=T - 1)
    assert tokens == logits[len(ids) - 1 :].argmax(-1).tolist()


def test_greedy_fixed_mode_and_max_loops(model):
    cfg, w = model
    T, ids = cfg.num_loops, prompt(cfg, 4)
    res = reference_greedy_generate(w, cfg, ids, 4, exit_mode="fixed", max_loops=2, exit_threshold=0.1)
    assert res.exit_depths == [T - 1, 1, 1, 1]  # the prompt always runs T loops
    # every decode position exits at loop 1 and exposes its loop-1 K/V from then on
    out = reference_forward(w, cfg, ids + res.tokens[:-1], exit_depths=[T - 1] * 4 + [1, 1, 1])
    logits = out["hidden_states"][res.exit_depths, np.arange(3, 7)] @ w.lm_head.T
    assert res.tokens == logits.argmax(-1).tolist()


def test_greedy_eos_stops():
    cfg = get_preset("tiny")
    w = load_reference_weights(cfg, random_hf_tensors(cfg, seed=1))
    first = reference_greedy_generate(w, cfg, [1, 2, 3], 3).tokens
    assert reference_greedy_generate(w, cfg, [1, 2, 3], 3, eos_token_id=first[0]).tokens == first[:1]


def incremental_generate(w, cfg, prompt_ids, n, exit_threshold, min_loops, max_loops, exit_mode):
    """An engine-shaped twin: one position at a time, one K/V plane per loop, exit decided loop by
    loop, and LAST_EXITED finalize (copy plane e into planes e+1..T-1)."""
    T, L = cfg.num_loops, cfg.num_hidden_layers
    planes = {(d, i): ([], []) for d in range(T) for i in range(L)}

    def ouro_exit(gates, k):  # the ouro condition after k loops
        remaining = np.prod([1 - 1 / (1 + np.exp(-g)) for g in gates[:k]])
        return k >= max_loops or (exit_threshold < 1 and k >= min_loops and 1 - remaining >= exit_threshold)

    def run(tok, pos, full_depth):
        x = w.embed[[tok]]
        cos, sin = rope_cos_sin(cfg, np.array([pos]))
        hs, gates = [], []
        for d in range(T):
            for i, lw in enumerate(w.layers):
                q, k, v = layer_qkv(lw, cfg, x, cos, sin)
                ks, vs = planes[d, i]
                ks.append(k[0])
                vs.append(v[0])
                x = layer_finish(lw, cfg, x, q, np.stack(ks), np.stack(vs), np.ones((1, pos + 1), bool))
            x = rms_norm(x, w.norm, cfg.rms_norm_eps)
            hs.append(x[0])
            gates.append(float(x[0] @ w.gate_w + w.gate_b))
            done = d + 1
            if full_depth:
                stop = done == T
            elif exit_mode == "fixed":
                stop = done >= max_loops
            elif exit_mode == "ouro":
                stop = ouro_exit(gates, done)
            else:  # delayed: one loop after ouro would have stopped
                stop = done >= max_loops or (done >= 2 and ouro_exit(gates, done - 1))
            if stop:
                break
        for dd in range(d + 1, T):  # finalize
            for i in range(L):
                planes[dd, i][0].append(planes[d, i][0][-1])
                planes[dd, i][1].append(planes[d, i][1][-1])
        return hs[d], d

    for pos, tok in enumerate(prompt_ids):
        h, e = run(tok, pos, full_depth=True)
    tokens, depths = [], []
    for _ in range(n):
        tokens.append(int(np.argmax(h @ w.lm_head.T)))
        depths.append(e)
        h, e = run(tokens[-1], len(prompt_ids) + len(tokens) - 1, full_depth=False)
    return tokens, depths


@pytest.mark.parametrize("exit_mode", ["ouro", "delayed", "fixed"])
@pytest.mark.parametrize(
    "kw", [dict(exit_threshold=None, min_loops=1, max_loops=None), dict(exit_threshold=0.5, min_loops=2, max_loops=3)]
)
def test_greedy_early_exit_equals_incremental_plane_cache(model, exit_mode, kw):
    cfg, w = model
    varied = {4: 0.6, 3: 0.5}[cfg.num_loops]  # tiny / tiny-gqa: thresholds where depths vary
    kw = dict(kw, exit_threshold=kw["exit_threshold"] or varied, max_loops=kw["max_loops"] or cfg.num_loops)
    ids, n = prompt(cfg, 5, seed=7), 8
    res = reference_greedy_generate(w, cfg, ids, n, exit_mode=exit_mode, **kw)
    assert res.min_margin > 1e-9 and res.min_logit_gap > 1e-9  # float64 vs float64: no near ties
    assert (res.tokens, res.exit_depths) == incremental_generate(w, cfg, ids, n, exit_mode=exit_mode, **kw)
    assert res.exit_depths[0] == cfg.num_loops - 1
    if exit_mode == "ouro" and kw["min_loops"] == 1:
        assert len(set(res.exit_depths[1:])) > 1, "pick a threshold that makes exit depths vary"
