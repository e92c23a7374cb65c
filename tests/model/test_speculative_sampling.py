"""The acceptance rule of self-speculative decoding (``sampling.speculative_accept``): greedy rows
against a numpy rule, sampled rows against the target distribution by counting many seeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax.sampling import (
    draft_sample,
    filtered_probs,
    row_keys,
    sample_stochastic,
    spec_keys,
    speculative_accept,
)

accept = jax.jit(speculative_accept)
draft = jax.jit(draft_sample)
plain_sample = jax.jit(sample_stochastic)
probs_of = jax.jit(filtered_probs)
uniforms = jax.jit(jax.vmap(lambda key: jax.random.uniform(key, ())))

# a frequency more than this many standard errors from its probability fails (5 tokens, fixed
# seeds: the correct rule's largest is ~2.5, the draft's own tokens' > 100)
Z_MAX = 4.5
ROWS = 20000
V = 5
# the shape of the small cases: one compilation each of ``accept`` and ``draft`` serves them all
N, K1, VOCAB = 7, 4, 11


def greedy_reference(target_logits, draft_tokens, exact):
    """Greedy rows in numpy: accept while the draft is the target's argmax (or exact), the first
    mismatch takes the argmax and ends the row."""
    n, k1, _ = target_logits.shape
    counts, tokens = np.zeros(n, np.int64), np.array(draft_tokens)
    for i in range(n):
        for j in range(k1):
            best = int(np.argmax(target_logits[i, j]))
            if not exact[i, j] and draft_tokens[i, j] != best:
                tokens[i, j] = best
                counts[i] = j + 1
                break
        else:
            counts[i] = k1
    return counts, tokens


def filtered_reference(logits, temperature, top_k, top_p):
    """``filtered_probs`` of one row in numpy (temperature > 0): top-k intersected with the
    smallest prefix whose unfiltered mass reaches top-p, renormalised."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x)
    full = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    mass_before = np.cumsum(full[order]) - full[order]
    keep = np.zeros(len(x), bool)
    n_keep = max(int(np.sum(mass_before < top_p)), 1)
    keep[order[: min(n_keep, top_k if top_k > 0 else len(x))]] = True
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    return p / p.sum()


def max_z(samples, probs) -> float:
    """The largest |frequency - probability| over the vocabulary in standard errors (inf when a
    token of probability 0 occurs)."""
    n = len(samples)
    freq = np.bincount(samples, minlength=len(probs)) / n
    if np.any((probs == 0) & (freq > 0)):
        return np.inf
    se = np.sqrt(np.maximum(probs * (1 - probs), 1e-12) / n)
    return float(np.max(np.abs(freq - probs) / se))


def rows_params(n, temperature, top_k=0, top_p=1.0):
    """``temperature, top_k, top_p`` of ``n`` rows alike."""
    return (
        jnp.full((n,), temperature, jnp.float32),
        jnp.full((n,), top_k, jnp.int32),
        jnp.full((n,), top_p, jnp.float32),
    )


# each shape is one compilation (~1.5 s on one core): K1 1 and 4 for every N would take two more;
# (N, K1, VOCAB) is the small cases' shape
@pytest.mark.parametrize("n, k1", [(1, 1), (1, 4), (3, 4), (N, 1), (N, K1)])
def test_greedy_rows_match_numpy_rule(n, k1):
    rng = np.random.default_rng(100 * n + k1)
    # n = 3 in bfloat16 (any float goes in; no extra compilation): the rule sees the rounded values
    dtype = jnp.bfloat16 if n == 3 else jnp.float32
    target = np.asarray(jnp.asarray(rng.standard_normal((n, k1, VOCAB)), dtype).astype(jnp.float32))
    draft_logits = rng.standard_normal((n, k1, VOCAB)).astype(np.float32)
    # mostly the target's argmax so that rows run past position 0, sometimes another token
    right = rng.random((n, k1)) < 0.7
    tokens_in = np.where(right, target.argmax(-1), rng.integers(0, VOCAB, (n, k1))).astype(np.int32)
    exact = rng.random((n, k1)) < 0.2
    seeds = rng.integers(0, 2**31, n).astype(np.uint32)
    steps = np.arange(k1, dtype=np.int32)[None, :] + rng.integers(0, 100, (n, 1)).astype(np.int32)
    logits_in = (jnp.asarray(target, dtype), jnp.asarray(draft_logits, dtype))
    count, tokens = accept(*logits_in, tokens_in, exact, *rows_params(n, 0.0), seeds, steps)
    want_count, want_tokens = greedy_reference(target, tokens_in, exact)
    np.testing.assert_array_equal(np.asarray(count), want_count)
    for i in range(n):
        np.testing.assert_array_equal(np.asarray(tokens)[i, : want_count[i]], want_tokens[i, : want_count[i]])


def test_greedy_rule_runs_past_every_position_and_stops_at_each():
    # row i < K1's first mismatch at position i, the other rows' none, so every count 1..K1 is seen
    rng = np.random.default_rng(3)
    target = rng.standard_normal((N, K1, VOCAB)).astype(np.float32)
    tokens_in = target.argmax(-1).astype(np.int32)
    for i in range(K1):
        tokens_in[i, i] = (tokens_in[i, i] + 1) % VOCAB
    exact = np.zeros((N, K1), bool)
    seeds, steps = np.arange(N, dtype=np.uint32), np.zeros((N, K1), np.int32)
    count, tokens = accept(target, target, tokens_in, exact, *rows_params(N, 0.0), seeds, steps)
    np.testing.assert_array_equal(np.asarray(count), [1, 2, 3, 4, 4, 4, 4])
    for i in range(K1):
        assert int(tokens[i, i]) == int(target[i, i].argmax())


def test_filtered_probs_are_distributions_and_one_hot_at_temperature_0():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 9)).astype(np.float32) * 3
    temperature = jnp.asarray([0.0, 1.0, 0.7, 0.0, 1.3, 0.5], jnp.float32)
    top_k = jnp.asarray([0, 0, 3, 2, 0, 1], jnp.int32)
    top_p = jnp.asarray([1.0, 1.0, 0.8, 0.5, 0.6, 1.0], jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(logits, dtype)
        probs = np.asarray(probs_of(x, temperature, top_k, top_p))
        assert probs.dtype == np.float32
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
        xf = np.asarray(x.astype(jnp.float32))
        for i in (0, 3):
            np.testing.assert_array_equal(probs[i], np.eye(9)[xf[i].argmax()])
        for i in (1, 2, 4, 5):
            want = filtered_reference(xf[i], float(temperature[i]), int(top_k[i]), float(top_p[i]))
            np.testing.assert_allclose(probs[i], want, atol=1e-6)


def test_keys_are_distinct_streams_and_purpose_0_does_not_exist():
    seeds, steps = np.asarray([7, 7, 8], np.uint32), np.asarray([0, 1, 0], np.int32)
    streams = [np.asarray(row_keys(seeds, steps))] + [np.asarray(spec_keys(seeds, steps, p)) for p in (1, 2, 3)]
    flat = {tuple(k) for s in streams for k in s}
    assert len(flat) == 12
    np.testing.assert_array_equal(streams[2], np.asarray(jax.vmap(lambda k: jax.random.fold_in(k, 2))(streams[0])))
    for bad in (0, 4):
        with pytest.raises(ValueError):
            spec_keys(seeds, steps, bad)


def test_draft_sample_exact_rows_draw_as_plain_decoding():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((N, VOCAB)).astype(np.float32)
    params = rows_params(N, 1.0, 8, 0.95)
    seeds, steps = np.arange(N, dtype=np.uint32) + 11, np.full(N, 5, np.int32)
    exact = np.arange(N) % 2 == 0
    got = np.asarray(draft(logits, *params, seeds, steps, exact))
    plain = np.asarray(plain_sample(logits, *params, row_keys(seeds, steps)))
    other = np.asarray(plain_sample(logits, *params, spec_keys(seeds, steps, 1)))
    np.testing.assert_array_equal(got[exact], plain[exact])
    np.testing.assert_array_equal(got[~exact], other[~exact])
    assert np.any(plain != other)  # the draft's stream is not plain decoding's
    greedy_rows = np.asarray(draft(logits, *rows_params(N, 0.0), seeds, steps, exact))
    np.testing.assert_array_equal(greedy_rows, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_exact_positions_are_accepted_whatever_the_target_says(temperature):
    target = np.zeros((N, K1, VOCAB), np.float32)
    target[:, :, 0] = 5.0
    target[:, :, 4] = -1e9  # p(4) = 0 (and not the argmax)
    tokens_in = np.full((N, K1), 4, np.int32)
    exact = np.zeros((N, K1), bool)
    exact[:, :2] = True
    seeds, steps = np.arange(N, dtype=np.uint32), np.tile(np.arange(K1, dtype=np.int32), (N, 1))
    count, tokens = accept(target, target, tokens_in, exact, *rows_params(N, temperature), seeds, steps)
    np.testing.assert_array_equal(np.asarray(count), 3)
    np.testing.assert_array_equal(np.asarray(tokens)[:, :2], 4)
    assert np.all(np.asarray(tokens)[:, 2] != 4)  # the non-exact position is rejected
    count, tokens = accept(target, target, tokens_in, np.ones_like(exact), *rows_params(N, temperature), seeds, steps)
    np.testing.assert_array_equal(np.asarray(count), K1)
    np.testing.assert_array_equal(np.asarray(tokens), tokens_in)


def test_same_draft_and_target_accept_everything_and_an_empty_residual_falls_back_on_p():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((N, K1, VOCAB)).astype(np.float32)
    seeds, steps = np.arange(N, dtype=np.uint32), np.tile(np.arange(K1, dtype=np.int32), (N, 1))
    params, not_exact = rows_params(N, 1.0), np.zeros((N, K1), bool)
    drafted = np.stack([draft(logits[:, j], *params, seeds, steps[:, j], not_exact[:, j]) for j in range(K1)], 1)
    count, tokens = accept(logits, logits, drafted, not_exact, *params, seeds, steps)
    np.testing.assert_array_equal(np.asarray(count), K1)
    np.testing.assert_array_equal(np.asarray(tokens), drafted)
    # top-k 1 on both: a draft token off the argmax has p = q = 0, is rejected, and the residual
    # max(p - q, 0) is empty: the token comes from p, the argmax
    off = ((logits.argmax(-1) + 1) % VOCAB).astype(np.int32)
    count, tokens = accept(logits, logits, off, not_exact, *rows_params(N, 1.0, 1), seeds, steps)
    np.testing.assert_array_equal(np.asarray(count), 1)
    np.testing.assert_array_equal(np.asarray(tokens)[:, 0], logits[:, 0].argmax(-1))


TARGET = np.log(np.asarray([[0.40, 0.25, 0.15, 0.12, 0.08], [0.05, 0.10, 0.15, 0.30, 0.40]], np.float32))
DRAFT = np.log(np.asarray([[0.10, 0.15, 0.45, 0.20, 0.10], [0.35, 0.30, 0.15, 0.10, 0.10]], np.float32))


def run_rows(temperature, top_k, top_p):
    """``ROWS`` rows of distinct seeds on the fixed ``TARGET`` and ``DRAFT`` logits of two
    positions: the draft tokens (drawn from q by ``draft_sample``), count and tokens."""
    params = rows_params(ROWS, temperature, top_k, top_p)
    seeds = np.arange(ROWS, dtype=np.uint32) * 7919 + 1  # the same in test_position_0_...
    steps = np.tile(np.asarray([40, 41], np.int32), (ROWS, 1))
    target = jnp.asarray(np.broadcast_to(TARGET, (ROWS, 2, V)))
    draft_logits = jnp.asarray(np.broadcast_to(DRAFT, (ROWS, 2, V)))
    not_exact = np.zeros(ROWS, bool)
    drafted = jnp.stack([draft(draft_logits[:, j], *params, seeds, steps[:, j], not_exact) for j in range(2)], 1)
    count, tokens = accept(target, draft_logits, drafted, np.zeros((ROWS, 2), bool), *params, seeds, steps)
    return np.asarray(drafted), np.asarray(count), np.asarray(tokens)


FILTERS = {"plain": (1.0, 0, 1.0), "filtered": (0.7, 3, 0.8)}


@pytest.fixture(scope="module", params=list(FILTERS))
def sampled(request):
    temperature, top_k, top_p = FILTERS[request.param]
    p = [filtered_reference(TARGET[j], temperature, top_k, top_p) for j in range(2)]
    q = [filtered_reference(DRAFT[j], temperature, top_k, top_p) for j in range(2)]
    return p, q, run_rows(temperature, top_k, top_p)


def test_sampled_tokens_follow_the_target_and_the_draft_alone_would_not(sampled):
    p, q, (drafted, count, tokens) = sampled
    # the draft is far from the target (total variation 0.3-0.4 unfiltered, ~0.7 filtered)
    assert 0.5 * np.abs(p[0] - q[0]).sum() > 0.25
    assert 0.5 * np.abs(p[1] - q[1]).sum() > 0.25
    assert max_z(tokens[:, 0], p[0]) < Z_MAX
    second = count >= 2
    assert max_z(tokens[second, 1], p[1]) < Z_MAX
    # power: the draft's own tokens (always accepting) fail the same check
    assert max_z(drafted[:, 0], q[0]) < Z_MAX
    assert max_z(drafted[:, 0], p[0]) > Z_MAX
    assert max_z(drafted[second, 1], p[1]) > Z_MAX


def test_acceptance_rate_is_the_overlap_of_target_and_draft(sampled):
    p, q, (drafted, count, tokens) = sampled
    rate = np.minimum(p[0], q[0]).sum()
    se = np.sqrt(rate * (1 - rate) / ROWS)
    assert abs(np.mean(count >= 2) - rate) < Z_MAX * se
    # given position 0 accepted, position 1's draft is accepted at its own overlap; with K1 = 2
    # count is 2 either way, but a rejected x has p(x) < q(x), so the residual never redraws it
    rate1 = np.minimum(p[1], q[1]).sum()
    second = count >= 2
    kept = tokens[second, 1] == drafted[second, 1]
    assert abs(np.mean(kept) - rate1) < Z_MAX * np.sqrt(rate1 * (1 - rate1) / len(kept))


def test_position_0_is_accepted_by_the_uniform_of_its_accept_stream(sampled):
    p, q, (drafted, count, _) = sampled
    seeds, step = np.arange(ROWS, dtype=np.uint32) * 7919 + 1, np.full(ROWS, 40, np.int32)
    u = np.asarray(uniforms(spec_keys(seeds, step, 2)))
    x = drafted[:, 0]
    np.testing.assert_array_equal(count >= 2, u * q[0][x] < p[0][x])


def test_same_seeds_and_steps_give_the_same_tokens():
    a = run_rows(1.0, 0, 1.0)
    b = run_rows(1.0, 0, 1.0)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
