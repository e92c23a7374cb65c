"""Token sampling on the device: greedy, temperature, top-k, top-p, one key per row.

Every row carries its own parameters so that one coda call serves requests with different
sampling settings. The key of a row is derived from the request's seed and the index of the token
being sampled, never from the batch it happens to be in, so sampled tokens do not depend on
scheduling (chunk size, bucket, batch composition).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from scheduler.sampling_params import MAX_LOGPROBS

__all__ = [
    "greedy",
    "sample",
    "sample_stochastic",
    "row_keys",
    "spec_keys",
    "filtered_probs",
    "draft_sample",
    "speculative_accept",
    "SPEC_DRAFT",
    "SPEC_ACCEPT",
    "SPEC_RESIDUAL",
    "token_logprobs",
    "adjust_logits",
    "adjust_logits_reference",
    "free_adjust",
    "ADJUST_ROW_WORDS",
    "ADJUST_ENTRY_WORDS",
]

# ``adjust_logits``' inputs: per row presence, frequency, repetition, min-p; per entry id, count,
# bias, seen
ADJUST_ROW_WORDS = 4
ADJUST_ENTRY_WORDS = 4

# ``spec_keys``' purposes: the random streams of one token in speculative decoding, none equal to
# the plain ``row_keys`` one (an exact draft token uses that very key, as plain decoding would)
SPEC_DRAFT = 1
SPEC_ACCEPT = 2
SPEC_RESIDUAL = 3


def row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """``fold_in(PRNGKey(seed), step)`` per row -> ``[R, 2]`` raw uint32 keys."""

    def one(seed, step):
        return jax.random.fold_in(jax.random.PRNGKey(seed), step)

    return jax.vmap(one)(seeds.astype(jnp.uint32), steps.astype(jnp.uint32))


def spec_keys(seeds: jax.Array, steps: jax.Array, purpose: int) -> jax.Array:
    """``fold_in(row_keys(seed, step), purpose)`` per row -> ``[R, 2]`` raw uint32 keys: a stream
    of token ``step`` distinct from plain decoding's, one per ``purpose``: ``SPEC_DRAFT`` (1) the
    draft's sample, ``SPEC_ACCEPT`` (2) the acceptance uniform, ``SPEC_RESIDUAL`` (3) the residual
    sample. There is no purpose 0: where a token is sampled exactly as plain decoding samples it,
    ``row_keys`` itself is its key."""
    return _fold_purpose(row_keys(seeds, steps), purpose)


def _fold_purpose(keys, purpose: int) -> jax.Array:
    """``spec_keys`` from the rows' ``row_keys``."""
    if purpose not in (SPEC_DRAFT, SPEC_ACCEPT, SPEC_RESIDUAL):
        raise ValueError(f"spec_keys: purpose must be 1 (draft), 2 (accept) or 3 (residual), got {purpose!r}")
    return jax.vmap(lambda k: jax.random.fold_in(k, purpose))(keys)


def _filtered_logits(logits, temperature, top_k, top_p, min_p=None):
    """Scale by temperature and mask everything outside top-k / top-p / min-p (per row; min-p keeps
    the tokens at least ``min_p`` times as likely as the likeliest)."""
    v = logits.shape[-1]
    x = logits / jnp.maximum(temperature, 1e-6)[:, None]
    srt = jnp.sort(x, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(srt, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    keep_sorted = (cum - probs) < top_p[:, None]
    n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)
    thresh = jnp.maximum(kth, pth)
    if min_p is not None:  # p >= min_p * p_max  <=>  x >= x_max + log(min_p); min_p 0 keeps all
        thresh = jnp.maximum(thresh, srt[:, :1] + jnp.log(min_p)[:, None])
    return jnp.where(x >= thresh, x, -jnp.inf)


def greedy(logits) -> jax.Array:
    """Token ids ``[R]`` int32 of the largest logits (what a temperature-0 row gets)."""
    return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)


def sample_stochastic(logits, temperature, top_k, top_p, keys, min_p=None):
    """``sample`` with the sort over the vocabulary always paid: for programs that only run when
    some row samples (the runner's separate sampler); ``min_p [R]`` (0 = off) optional."""
    logits = logits.astype(jnp.float32)
    masked = _filtered_logits(logits, temperature, top_k, top_p, min_p)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, masked).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy(logits))


def filtered_probs(logits, temperature, top_k, top_p, min_p=None) -> jax.Array:
    """The distribution ``[R, V]`` float32 a row samples its token from (``sample_stochastic``'s):
    the softmax of the temperature-scaled, top-k / top-p (/ min-p) masked logits, or for a
    temperature-0 row the one-hot of its ``greedy`` token."""
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(_filtered_logits(logits, temperature, top_k, top_p, min_p), axis=-1)
    one_hot = jax.nn.one_hot(greedy(logits), logits.shape[-1], dtype=jnp.float32)
    return jnp.where((temperature > 0)[:, None], probs, one_hot)


def draft_sample(logits, temperature, top_k, top_p, seeds, steps, exact, min_p=None) -> jax.Array:
    """The draft's tokens ``[R]`` int32 of token index ``steps [R]``: a row whose token is final
    (``exact [R]``: its exit rule fired within the draft) draws it exactly as plain decoding does
    (``sample_stochastic`` with ``row_keys(seed, step)``); the others draw from the same filtered
    distribution with the ``spec_keys(seed, step, SPEC_DRAFT)`` stream. Temperature 0: argmax."""
    plain_keys = row_keys(seeds, steps)
    keys = jnp.where(exact[:, None], plain_keys, _fold_purpose(plain_keys, SPEC_DRAFT))
    return sample_stochastic(logits, temperature, top_k, top_p, keys, min_p)


def speculative_accept(
    target_logits, draft_logits, draft_tokens, exact, temperature, top_k, top_p, seeds, steps, min_p=None
):
    """The rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023), per row over its
    ``K1`` drafted positions -> ``(count [R] int32 in 1..K1, tokens [R, K1] int32)``.

    ``target_logits`` and ``draft_logits`` ``[R, K1, V]`` (any float) give, with the row's own
    temperature / top-k / top-p (/ min-p), the target ``p`` and draft ``q`` (``filtered_probs``) at
    each position; ``draft_tokens [R, K1]`` were drawn from ``q``; ``steps [R, K1]`` are their token
    indices. In order of ``j``, ``x = draft_tokens[:, j]`` is accepted when ``exact[:, j]`` (drawn
    from the target itself), else for a temperature-0 row when it is the target's argmax, else when
    ``u < p(x) / q(x)``, ``u ~ U[0, 1)`` from ``spec_keys(seed, step, SPEC_ACCEPT)``. At the first
    rejected position the token is drawn from ``normalize(max(p - q, 0))`` (from ``p`` where that
    has no mass; temperature 0: the target's argmax) with ``spec_keys(seed, step, SPEC_RESIDUAL)``,
    ``count = j + 1`` and the row stops; no rejection: ``count = K1``. ``tokens[:, :count]`` are the
    row's tokens, distributed as plain sampling from ``p`` at every position; the rest repeat the
    draft's tokens."""
    r, k1, v = target_logits.shape
    flat = lambda a: a.reshape(r * k1, *a.shape[2:])
    per_pos = lambda a: None if a is None else jnp.repeat(a, k1)
    # target and draft rows filtered in one call: one sort in the program, not two
    both = lambda a: None if a is None else jnp.tile(per_pos(a), 2)
    target = flat(target_logits.astype(jnp.float32))
    stacked = jnp.concatenate([target, flat(draft_logits.astype(jnp.float32))])
    probs = filtered_probs(stacked, both(temperature), both(top_k), both(top_p), both(min_p))
    p, q = probs.reshape(2, r, k1, v)
    drafts = draft_tokens.astype(jnp.int32)
    px = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    # one ``row_keys`` per position, both streams folded from it: each threefry hash costs compile
    # time (most of this function's on the CPU) and device time
    plain_keys = row_keys(per_pos(seeds), flat(steps))
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(_fold_purpose(plain_keys, SPEC_ACCEPT))
    # u * q(x) < p(x) is u < p(x) / q(x) without the division: q(x) = 0 accepts iff p(x) > 0
    by_ratio = u.reshape(r, k1) * qx < px
    target_argmax = greedy(target).reshape(r, k1)
    is_greedy = (temperature <= 0)[:, None]
    accepted = exact | jnp.where(is_greedy, drafts == target_argmax, by_ratio)
    n_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)
    # the residual is drawn only at the first rejected position (clipped: unused when none is)
    rows, at = jnp.arange(r), jnp.minimum(n_accepted, k1 - 1)
    pick = lambda a: a[rows, at]
    p_at, q_at = pick(p), pick(q)
    residual = jnp.maximum(p_at - q_at, 0.0)
    has_mass = jnp.sum(residual, axis=-1, keepdims=True) > 0
    residual_logits = jnp.log(jnp.where(has_mass, residual, p_at))
    residual_keys = _fold_purpose(pick(plain_keys.reshape(r, k1, 2)), SPEC_RESIDUAL)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(residual_keys, residual_logits).astype(jnp.int32)
    replacement = jnp.where(temperature > 0, drawn, pick(target_argmax))
    rejected_here = jnp.arange(k1)[None, :] == n_accepted[:, None]
    tokens = jnp.where(rejected_here, replacement[:, None], drafts)
    return jnp.minimum(n_accepted + 1, k1).astype(jnp.int32), tokens


def sample(logits, temperature, top_k, top_p, keys):
    """``logits [R, V]`` (any float), per-row ``temperature [R]``, ``top_k [R]`` (0 = off),
    ``top_p [R]``, ``keys [R, 2]`` -> token ids ``[R]`` int32. Rows with temperature 0 are greedy.

    The sort over the vocabulary is only paid for when some row really samples, through a
    ``lax.cond``; on the GPU its predicate may be read by the host (a wait for the device), so
    the engine's one-loop steps decide on the host instead (``ModelRunner``)."""
    return jax.lax.cond(
        jnp.any(temperature > 0),
        lambda _: sample_stochastic(logits, temperature, top_k, top_p, keys),
        lambda _: greedy(logits),
        None,
    )


def token_logprobs(logits, tokens) -> jax.Array:
    """The logprob records of ``tokens [R]`` under raw ``logits [R, V]`` (before temperature and
    masks): ``[R, LOGPROB_WORDS]`` int32, the token's logprob, the top ``MAX_LOGPROBS`` logprobs
    (float32 bits) and their ids (``scheduler.sampling_params.read_logprobs`` reads them). Top-k
    on the device: only ``R x LOGPROB_WORDS`` words come back to the host, never the vocabulary."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens.astype(jnp.int32)[:, None], axis=-1)
    top, ids = jax.lax.top_k(logp, MAX_LOGPROBS)
    bits = jax.lax.bitcast_convert_type(jnp.concatenate([chosen, top], axis=-1), jnp.int32)
    return jnp.concatenate([bits, ids.astype(jnp.int32)], axis=-1)


def adjust_logits(logits, row_words, entries):
    """Logit bias and the repetition, frequency and presence penalties, per row (OpenAI's and
    vLLM's rules, in vLLM's order: bias first), on float32 ``logits [R, V]``.

    ``row_words [4, R]`` int32: the bits of float32 presence, frequency and repetition penalties
    and min-p (read by the sampler, not here). ``entries [4, R, H]`` int32: each row's sparse list
    of token ids (-1: none), their count in its output, a float32 bias (bits; ``-inf`` bans a
    token: ``min_tokens``) and whether the token was seen (prompt or output: the repetition
    penalty's set). Ids may repeat: counts and biases add up."""
    r, v = logits.shape
    f32 = lambda w: jax.lax.bitcast_convert_type(w, jnp.float32)  # noqa: E731
    presence, frequency, repetition = f32(row_words[0]), f32(row_words[1]), f32(row_words[2])
    ids, count, bias, seen = entries[0], entries[1], f32(entries[2]), entries[3]
    idx = jnp.where(ids >= 0, ids, v)  # out of range: dropped by the scatters
    rows = jnp.broadcast_to(jnp.arange(r)[:, None], ids.shape)
    zeros = jnp.zeros((r, v), jnp.float32)
    counts = zeros.at[rows, idx].add(count.astype(jnp.float32), mode="drop")
    seen_any = zeros.at[rows, idx].max(seen.astype(jnp.float32), mode="drop") > 0
    x = logits + zeros.at[rows, idx].add(bias, mode="drop")
    rep = repetition[:, None]
    x = jnp.where(seen_any, jnp.where(x > 0, x / rep, x * rep), x)
    return x - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def free_adjust(rows: int, entries: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``adjust_logits``' inputs that change nothing: no penalty (repetition 1), no min-p, no entries."""
    row_words = np.zeros((ADJUST_ROW_WORDS, rows), np.int32)
    row_words[2] = np.float32(1.0).view(np.int32)
    ent = np.zeros((ADJUST_ENTRY_WORDS, rows, entries), np.int32)
    ent[0] = -1
    return row_words, ent


def adjust_logits_reference(logits, presence, frequency, repetition, output_ids, prompt_ids, bias):
    """``adjust_logits`` of one row in numpy, from the request's own lists (tests): ``bias`` a
    dict of token id -> bias."""
    x = np.asarray(logits, np.float64).copy()
    for t, b in bias.items():
        x[t] += b
    seen = set(output_ids) | set(prompt_ids)
    for t in seen:
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(output_ids):
        c = list(output_ids).count(t)
        x[t] -= frequency * c + presence
    return x


def fixed_entries(sp, prompt_ids) -> np.ndarray:
    """The ``adjust_logits`` entries ``[4, n]`` of a request that never change: its prompt's
    distinct tokens (seen, for the repetition penalty) and its logit bias."""
    ent = []
    if sp.repetition_penalty != 1.0:
        ids = np.unique(np.asarray(prompt_ids, np.int32))
        ent.append(np.stack([ids, np.zeros_like(ids), np.zeros_like(ids), np.ones_like(ids)]))
    if sp.logit_bias:
        ids = np.asarray([t for t, _ in sp.logit_bias], np.int32)
        bias = np.asarray([b for _, b in sp.logit_bias], np.float32).view(np.int32)
        ent.append(np.stack([ids, np.zeros_like(ids), bias, np.zeros_like(ids)]))
    return np.concatenate(ent, axis=1) if ent else np.zeros((ADJUST_ENTRY_WORDS, 0), np.int32)


_BAN = np.float32(-np.inf).view(np.int32)


def adjust_inputs(rows: int, requests, eos_token_ids) -> tuple[np.ndarray, np.ndarray]:
    """``adjust_logits``' inputs ``(row_words [4, rows], entries [4, rows, H])`` for the coda rows
    ``requests``: ``(row, Request, fixed_entries)`` each; the others change nothing. ``H``, the
    widest row's entries, is rounded up to a power of two (>= 16): each ``H`` is one sampler
    executable. Before ``min_tokens`` tokens the stop and eos ids are banned."""
    row_words, _ = free_adjust(rows)
    f = row_words.view(np.float32)
    lists = []
    for i, req, fixed in requests:
        sp = req.sampling_params
        f[:, i] = (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p)
        ent = [fixed]
        out = req.output_token_ids
        if out and (sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0):
            ids, counts = np.unique(np.asarray(out, np.int32), return_counts=True)
            ent.append(np.stack([ids, counts.astype(np.int32), np.zeros_like(ids), np.ones_like(ids)]))
        if len(out) < sp.min_tokens:
            ban = np.asarray(sorted({*sp.stop_token_ids, *eos_token_ids}), np.int32)
            ent.append(np.stack([ban, np.zeros_like(ban), np.full_like(ban, _BAN), np.zeros_like(ban)]))
        lists.append((i, np.concatenate(ent, axis=1)))
    widest = max(e.shape[1] for _, e in lists)
    h = 0 if widest == 0 else max(16, 1 << (widest - 1).bit_length())
    _, entries = free_adjust(rows, h)
    for i, e in lists:
        entries[:, i, : e.shape[1]] = e
    return row_words, entries
