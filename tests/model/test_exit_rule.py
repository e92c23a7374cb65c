"""The device exit rule (ouro_jax/exit_rule.py) against the host rule (scheduler/exit_policy.py):
the same exit depth for every gate sequence, threshold, min_loops, max_loops and exit mode, both
all gates at once (``exit_loops``, as ``forward`` uses it) and loop by loop (``decide_exit`` on a
running fold, as ``generate`` uses it). The host folds in float64, the device in float32, so
draws whose ``1 - remaining`` lies within 1e-5 of the threshold are too close to call."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ouro_jax import exit_rule
from scheduler.exit_policy import reference_exit_loops
from scheduler.sampling_params import SamplingParams
from tests.model.conftest import gates_near_threshold

MAX_T = 6


@st.composite
def cases(draw):
    t = draw(st.integers(1, MAX_T))
    max_loops = draw(st.integers(1, t))
    min_loops = draw(st.integers(1, max_loops))
    gate = st.one_of(st.sampled_from([-4.0, -1.0, 0.0, 1.0, 4.0]), st.floats(-8.0, 8.0, width=32))
    gates = draw(st.lists(gate, min_size=t, max_size=t))
    threshold = draw(st.one_of(st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0]), st.floats(0.0, 1.0, width=32)))
    mode = draw(st.sampled_from(exit_rule.DEVICE_EXIT_MODES))
    return t, gates, threshold, min_loops, max_loops, mode


# one compilation per mode; the numbers are traced
@functools.partial(jax.jit, static_argnames=("mode",))
def _all_at_once(gates, threshold, min_loops, max_loops, mode):
    return exit_rule.exit_loops(gates, threshold, min_loops, max_loops, mode)


@functools.partial(jax.jit, static_argnames=("mode",))
def _loop_by_loop(gates, threshold, min_loops, max_loops, mode):
    """The static ``generate``'s shape of the rule: fold after each loop, decide, stop once."""

    def body(carry, x):
        done, remaining, exited, loops = carry
        g = x
        done = done + 1
        before = remaining  # the fold of ``done - 1`` gates: what ``delayed`` reads
        remaining = exit_rule.fold_gate(remaining, g)
        rem = before if mode == "delayed" else remaining
        now = ~exited & exit_rule.decide_exit(done, rem, threshold, min_loops, max_loops, mode)
        return (done, remaining, exited | now, jnp.where(now, done, loops)), None

    init = (jnp.int32(0), jnp.float32(1.0), jnp.bool_(False), jnp.int32(gates.shape[0]))
    (_, _, _, loops), _ = jax.lax.scan(body, init, gates)
    return loops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_device_rule_equals_host_rule(case):
    t, gates, threshold, min_loops, max_loops, mode = case
    assume(not gates_near_threshold(gates, threshold, min_loops, max_loops, mode))
    # the host's params hold only what the mode reads (validate refuses the rest); the device rule is
    # handed every drawn value and must ignore the same ones
    gated = mode in ("ouro", "delayed")
    params = SamplingParams(
        exit_threshold=threshold if gated else 1.0,
        min_loops=1 if mode == "fixed" else min_loops,
        max_loops=max_loops,
        exit_mode=mode,
    )
    params.validate(t)
    want = reference_exit_loops(params, t, gates)
    # padded to MAX_T gates (one compilation per mode): the rule never reads past max_loops <= t
    g = jnp.asarray(np.asarray(gates + [0.0] * (MAX_T - t), np.float32))
    args = (jnp.float32(threshold), jnp.int32(min_loops), jnp.int32(max_loops))
    assert int(_all_at_once(g, *args, mode=mode)) == want, case
    assert int(_loop_by_loop(g, *args, mode=mode)) == want, case


def test_exit_loops_is_elementwise_over_tokens():
    """``[T, B, S]`` gates: each token's depth is its own gate sequence's."""
    rng = np.random.default_rng(0)
    gates = rng.normal(0.0, 2.0, (4, 3, 5)).astype(np.float32)
    got = np.asarray(exit_rule.exit_loops(jnp.asarray(gates), 0.6, 2, 4, "ouro"))
    params = SamplingParams(exit_threshold=0.6, min_loops=2)
    want = [[reference_exit_loops(params, 4, gates[:, b, s].tolist()) for s in range(5)] for b in range(3)]
    np.testing.assert_array_equal(got, want)
    assert set(np.unique(got)) - {2, 3, 4} == set()  # the test can fail: depths vary within [2, 4]


def test_synthetic_is_host_only():
    with pytest.raises(ValueError, match="synthetic"):
        exit_rule.exit_loops(jnp.zeros((4, 1)), 0.5, 1, 4, "synthetic")


def test_checkpoint_threshold_is_not_a_default():
    """``early_exit_threshold`` in a config.json is ignored (the threshold is per request); a value
    other than 1.0 says so, since a checkpoint author may have meant it as a default."""
    import warnings

    from weights.config import OuroConfig

    base = OuroConfig().to_dict()
    assert "early_exit_threshold" not in base
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert OuroConfig.from_dict(dict(base, early_exit_threshold=1.0)) == OuroConfig()
    with pytest.warns(UserWarning, match="early_exit_threshold=0.9 is not used"):
        assert OuroConfig.from_dict(dict(base, early_exit_threshold=0.9)) == OuroConfig()
