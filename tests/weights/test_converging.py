"""``weights.converging``: a small ``scale`` makes depth 1's greedy tokens agree with full depth's
(measured with the float64 reference on the tiny preset), ``scale=1`` is the model itself."""

import numpy as np
import pytest

from ouro_jax.reference import from_param_tree, reference_forward, reference_greedy_generate
from weights.config import get_preset
from weights.converging import BRANCH_OUTPUT_NORMS, converging_params
from weights.hf_names import iter_paths
from weights.random_init import random_params

CFG = get_preset("tiny")


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=0)


def depth_agreement(params, prompts, new_tokens: int = 32) -> np.ndarray:
    """Per depth ``d`` (1..T): the share of full-depth greedy tokens that depth ``d``'s argmax at
    the same position, with the same (full-depth) context, gives too: a greedy draft of ``d``
    loops proposes exactly that token there."""
    w = from_param_tree(CFG, params)
    agree = []
    for prompt in prompts:
        tokens = reference_greedy_generate(w, CFG, prompt, new_tokens, exit_mode="fixed").tokens
        seq = list(prompt) + tokens
        # the position before each generated token produced it
        h = reference_forward(w, CFG, seq[:-1])["hidden_states"][:, len(prompt) - 1 :]
        by_depth = (h @ w.lm_head.T).argmax(-1)  # [T, new_tokens]
        assert (by_depth[-1] == tokens).all()
        agree.append((by_depth == by_depth[-1]).mean(axis=1))
    return np.mean(agree, axis=0)


def test_small_scale_makes_depth_one_agree_with_full_depth(params):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, CFG.vocab_size, 8) for _ in range(3)]
    plain = depth_agreement(params, prompts)
    near = depth_agreement(converging_params(params, CFG, 0.02), prompts)
    flat = depth_agreement(converging_params(params, CFG, 0.0), prompts)
    # measured (seed 0, 3 x 32 tokens): depth 1 agrees on 0% at scale 1, 88% at 0.02; 100% at 0
    assert plain[0] < 0.1
    assert near[0] > 0.75 and near[0] > plain[0] + 0.6
    assert (flat == 1.0).all()  # every loop after the first is the identity
    assert (near >= plain).all()


def test_scale_one_is_the_model_and_the_input_is_left_alone(params):
    before = {p: np.array(x) for p, x in iter_paths(params)}
    assert converging_params(params, CFG, 1.0) is params
    half = converging_params(params, CFG, 0.5)
    for p, x in iter_paths(params):  # not modified in place
        np.testing.assert_array_equal(x, before[p])
    got, orig = dict(iter_paths(half)), dict(iter_paths(params))
    for p, x in before.items():
        if p[1:2] and p[1] in BRANCH_OUTPUT_NORMS:
            np.testing.assert_allclose(got[p], 0.5 * x, rtol=1e-6)
        elif p[0] == "norm":
            m = x.mean()
            np.testing.assert_allclose(got[p], m + 0.5 * (x - m), rtol=1e-6)
            assert got[p].std() == pytest.approx(0.5 * x.std(), rel=1e-4)
        else:
            assert got[p] is orig[p]  # shared, not copied
        assert got[p].dtype == x.dtype and got[p].shape == x.shape


def test_device_leaves_keep_their_dtype():
    import jax.numpy as jnp

    tree = random_params(CFG, seed=1, dtype=jnp.bfloat16, on_device=True)
    out = converging_params({"params": tree}, CFG, 0.1)["params"]
    assert out["norm"]["scale"].dtype == jnp.bfloat16
    assert out["layers_0"]["input_layernorm_2"]["scale"].dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(out["layers_1"]["post_attention_layernorm_2"]["scale"], np.float32),
        0.1 * np.asarray(tree["layers_1"]["post_attention_layernorm_2"]["scale"], np.float32),
        rtol=1e-2,
    )


@pytest.mark.parametrize("scale", [-0.1, 1.5, float("nan")])
def test_scale_out_of_range(params, scale):
    with pytest.raises(ValueError, match="converging scale"):
        converging_params(params, CFG, scale)
