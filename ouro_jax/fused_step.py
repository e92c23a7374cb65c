"""Fused decode steps: ``tokens`` tokens of the same decode rows in one executable, every exit
decided on the device (``scheduler.descriptor.StackedDescriptor``; docs/contracts.md, "Fused
decode steps"). Two programs read the same descriptor and give the same tokens and exit depths:

* :func:`lockstep` runs, per token, loop ``d`` of every row at once until the deepest row has
  exited, so a token costs the batch's deepest exit;
* :func:`independent` lets every row run one loop per iteration at its own depth and token: a row
  that exits samples at once and its next token's first loop joins the next iteration, so the
  step costs the slowest row's loops over all its tokens, not the sum of each token's deepest exit
  (docs/decisions.md, "Early exit at a few streams pays the lock step").

Both take ``(params, kp, vp, ring, packed [n, words + exit words], previous [C])`` and return
``(kp, vp, ring, gates [n, R], out [tokens, C + R], last [C])``; the scheduler is told which one
runs (``SchedulerConfig.fused_decode_rows``) because the loops that ran are counted differently.
Lock step is the default: independent rows run fewer loops with early exit, but their
iterations with exits are dearer (docs/decisions.md, "Early exit at a few streams pays the lock
step"). A third program, *elastic* steps (returning once every row made half the tokens), was
measured slower in every configuration and removed (docs/decisions.md, same entry).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import copy_kv_slots
from scheduler.buckets import BucketKey
from scheduler.descriptor import EXIT_FIELDS, FUSED_DECODE_ROWS, HEADER, descriptor_layout

from .exit_rule import decide_exit_rows, fold_gate
from .model import dtype_of
from .step_program import coda, packed_size, recurrent, unpack

__all__ = ["FUSED_DECODE_ROWS", "lockstep", "independent", "program"]


def program(rows: str):
    """The fused step of ``fused_decode_rows=rows`` (one of ``FUSED_DECODE_ROWS``)."""
    return {"lockstep": lockstep, "independent": independent}[rows]


def lockstep(params, kp, vp, ring, packed, previous, **kw):
    """A fused decode step (``scheduler.descriptor.StackedDescriptor``): ``packed [n, words + exit
    words]`` holds ``tokens * T`` sub-descriptors of one key and each token's exit words.
    ``previous [C]``: the last tokens the previous fused step sampled, which its first sub-step
    embeds when it feeds previous tokens (a step scheduled before the previous one's tokens were
    read: ``Scheduler.schedule_ahead``).

    Per token (a ``fori_loop``): a ``while_loop`` over depths runs the loop of every row in lock
    step while a row is left (the body is one loop, so it compiles like one bucket); after each
    loop the rows decide their exits (``exit_rule.decide_exit_rows``), an exited row keeps its exit
    hidden state and writes no more K/V (slot -1, as padding rows). Then LAST_EXITED rows copy
    their exit plane into the planes above (the slots are the later sub-steps'), one coda samples
    the exit states, and the tokens feed the next token's prelude. The KV pools and the ring are
    loop carries updated in place. Returns ``gates [n, R]`` (0 where a loop did not run),
    ``[tokens, C + R]`` int32 (sampled tokens, then exit depths) and the last token's samples
    ``[C]`` (the next step's ``previous``)."""
    key, T = kw["key"], kw["config"].num_loops
    n = packed.shape[0]
    R, C = key.R, key.C
    words = packed_size(key)
    layout = {f.name: f for f in descriptor_layout(key)}
    slot_at = layout["row_slot"].offset
    finalize = key.F > 0 and T > 1  # LAST_EXITED (SHARED buckets hold no finalize pairs)

    def token(j, carry):
        kp, vp, ring, prev, gates, out = carry
        first = j * T
        ex = packed[first, words:].reshape(len(EXIT_FIELDS), R)
        limit, min_loops, delay = ex[0], ex[1], ex[2]
        thr = jax.lax.bitcast_convert_type(ex[3], jnp.float32)
        real = jnp.arange(R) < packed[first, layout["header"].offset + HEADER.index("num_rows")]
        h_dtype = dtype_of(kw["dtype_name"])

        def more(c):
            return (c[0] < T) & jnp.any(c[5])

        def loop(c):
            d, kp, vp, ring, rem, active, exit_h, depth, gates = c
            a = unpack(key, packed[first + d, :words])
            a["row_slot"] = jnp.where(active, a["row_slot"], -1)  # an exited row writes no K/V
            kp, vp, ring, h, g = recurrent(params, kp, vp, ring, a, prev, **kw)
            nxt = fold_gate(rem, g)
            out = active & decide_exit_rows(d + 1, nxt, rem, limit, min_loops, delay, thr)
            exit_h = jnp.where(out[:, None], h.astype(h_dtype), exit_h)
            depth = jnp.where(out, d, depth)
            return d + 1, kp, vp, ring, nxt, active & ~out, exit_h, depth, gates.at[first + d].set(g)

        init = (
            jnp.int32(0),
            kp,
            vp,
            ring,
            jnp.ones((R,), jnp.float32),
            real,
            jnp.zeros((R, ring.shape[-1]), h_dtype),
            jnp.zeros((R,), jnp.int32),
            gates,
        )
        _, kp, vp, ring, _, _, exit_h, depth, gates = jax.lax.while_loop(more, loop, init)
        if finalize:  # plane depth[r] -> planes depth[r]+1..T-1 of every real row
            slots = jax.lax.dynamic_slice(packed, (first, slot_at), (T, R))  # [T, R]: row r's slot per plane
            src = jnp.take_along_axis(slots, depth[None, :], axis=0)[0]
            above = (jnp.arange(1, T)[:, None] > depth[None, :]) & real[None, :]
            dst = jnp.where(above, slots[1:], -1)
            kp, vp = copy_kv_slots(kp, vp, jnp.broadcast_to(src, dst.shape).reshape(-1), dst.reshape(-1))
        a = unpack(key, packed[first + T - 1, :words])  # the coda fields ride on the token's last loop
        tok = coda(params, exit_h[a["coda_row"]], a, **kw)
        out = out.at[j].set(jnp.concatenate([tok, depth]))
        return kp, vp, ring, tok, gates, out

    init = (
        kp,
        vp,
        ring,
        previous.astype(jnp.int32),
        jnp.zeros((n, R), jnp.float32),
        jnp.zeros((n // T, C + R), jnp.int32),
    )
    kp, vp, ring, last, gates, out = jax.lax.fori_loop(0, n // T, token, init)
    return kp, vp, ring, gates, out, last


# Which sub-step supplies each field of the descriptor an ``independent`` iteration runs on
_ROW, _CODA, _FIRST = 0, 1, 2  # the row's current loop, its token's last loop, sub-step 0


@functools.lru_cache(maxsize=None)
def _field_sources(key: BucketKey) -> tuple[tuple[int, int, int], ...]:
    """Per field of the layout, in order, ``(kind, entries, words per entry)``: an iteration's field
    is that of the sub-step row ``i`` is on for entry ``i`` (``_ROW``: the row fields, segments,
    prelude entries), of that row's token's last loop (``_CODA``: the coda fields ride there) or of
    sub-step 0 (``_FIRST``: the header, the finalize pairs). A decode step's row ``i`` is segment
    ``i``, prelude entry ``i`` and coda entry ``i`` (``scheduler.descriptor.build_decode_loops``);
    entries beyond ``R`` follow row ``R - 1`` (they are padding in every sub-step)."""
    out = []
    for f in descriptor_layout(key):
        entries = f.shape[0] if f.shape else 1
        per = f.size // entries if entries else 0
        if f.name in ("row_ring", "row_pos", "row_slot", "pre_ring", "pre_token") or f.name.startswith("seg_"):
            out.append((_ROW, entries, per))
        elif f.name.startswith("coda_"):
            out.append((_CODA, entries, per))
        else:
            out.append((_FIRST, entries, per))
    return tuple(out)


def _word_sources(key: BucketKey, row_sub, coda_sub):
    """``[words]``: the sub-step each word of the iteration's descriptor is read from
    (``_field_sources``), traced from iotas: no word-sized index array becomes a constant of the
    program (under tensor parallelism, a constant becomes an input of the ``shard_map``)."""
    last = key.R - 1
    parts = []
    for kind, entries, per in _field_sources(key):
        size = entries * per
        if kind == _FIRST or not size:
            parts.append(jnp.zeros((size,), jnp.int32))
            continue
        entry = jnp.minimum(jax.lax.iota(jnp.int32, size) // per, last)
        parts.append((row_sub if kind == _ROW else coda_sub)[entry])
    return jnp.concatenate(parts)


def _fit(x, n: int):
    """``x``'s first ``n`` entries, zero-padded to ``n``. A pad, not ``zeros.at[:k].set(x)``: that
    lowers to a scatter with an empty index array, a constant which the tensor-parallel
    ``shard_map`` takes as an input, and XLA's Shardy canonicalizer segfaulted on it (CPU, jax
    0.11.2, ``ManualComputationUnusedInputsPattern``)."""
    x = x[:n]
    return jnp.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def independent(params, kp, vp, ring, packed, previous, **kw):
    """A fused decode step whose rows advance independently (the module docstring).

    Each iteration of one ``while_loop`` runs one loop of the stack for the bucket: row ``r`` at
    its token ``t[r]`` and depth ``d[r]`` reads the fields of sub-step ``t[r] * T + d[r]`` (one
    gather builds the iteration's descriptor, ``_field_sources``); a row at depth 0 embeds its
    token first (the one it sampled last, or the descriptor's). After the loop every row decides
    its exit with its token's exit words; an exiting row copies (LAST_EXITED) its exit plane's slot
    into the planes above, samples from this loop's hidden state (one coda of every row, run only
    when some row exits) and moves to its next token at depth 0. A row done with its ``tokens``
    tokens writes no K/V (slot -1) and rides along until the last row is done. Rows run exactly
    the loops they run loop by loop, so tokens and exit depths are those of ``lockstep``."""
    key, T = kw["key"], kw["config"].num_loops
    n = packed.shape[0]
    R, C = key.R, key.C
    ntok = n // T
    words = packed_size(key)
    layout = {f.name: f for f in descriptor_layout(key)}
    slot_at = layout["row_slot"].offset
    feed_at = layout["header"].offset + HEADER.index("feed_previous_tokens")
    finalize = key.F > 0 and T > 1  # LAST_EXITED (SHARED buckets hold no finalize pairs)
    h_dtype = dtype_of(kw["dtype_name"])
    rows, cols = jnp.arange(R), jnp.arange(words)

    first = unpack(key, packed[0, :words])
    real = rows < first["num_rows"]
    # finalize copies pending from before the step ride on sub-step 0: made once, before any loop
    kp, vp = copy_kv_slots(kp, vp, first["fin_src"], first["fin_dst"])
    no_pairs = jnp.full((key.F,), -1, jnp.int32)

    def more(c):
        i, tok = c[0], c[4]
        return (i < n) & jnp.any(real & (tok < ntok))

    def loop(c):
        i, kp, vp, ring, tok, d, rem, prev, gates, out = c
        active = real & (tok < ntok)  # rows still making tokens
        t = jnp.minimum(tok, ntok - 1)
        sub = t * T + jnp.where(active, d, T - 1)
        a = unpack(key, packed[_word_sources(key, sub, t * T + T - 1), cols])
        feed = packed[t * T, feed_at] == 1
        a["pre_token"] = jnp.where(feed, prev, a["pre_token"])
        a["pre_ring"] = jnp.where(active & (d == 0), a["pre_ring"], 0)  # others embed into scratch row 0
        slot = a["row_slot"]
        a["row_slot"] = jnp.where(active, slot, -1)
        a["fin_src"] = a["fin_dst"] = no_pairs
        kp, vp, ring, h, g = recurrent(params, kp, vp, ring, a, None, **kw)

        ex = packed[t[None, :] * T, words + jnp.arange(len(EXIT_FIELDS))[:, None] * R + rows[None, :]]
        thr = jax.lax.bitcast_convert_type(ex[3], jnp.float32)
        nxt = fold_gate(rem, g)
        exits = active & decide_exit_rows(d + 1, nxt, rem, ex[0], ex[1], ex[2], thr)
        gates = gates.at[jnp.where(active, sub, n), rows].set(g, mode="drop")
        if finalize:  # plane d[r] -> planes d[r]+1..T-1 of the rows that exit now
            plane = jnp.arange(1, T)[:, None]
            dst = packed[t[None, :] * T + plane, slot_at + rows[None, :]]  # [T - 1, R]
            dst = jnp.where(exits[None, :] & (plane > d[None, :]), dst, -1)
            kp, vp = copy_kv_slots(kp, vp, jnp.broadcast_to(slot, dst.shape).reshape(-1), dst.reshape(-1))

        def sample_exits(h):
            hc = _fit(h.astype(h_dtype), C)  # coda entry i is row i
            return coda(params, hc[a["coda_row"]], a, **kw)

        # the lm_head only in iterations where some row exits (running it in every iteration was
        # no faster on the H200: docs/decisions.md, "Early exit at a few streams pays the lock step")
        toks = jax.lax.cond(jnp.any(exits), sample_exits, lambda h: jnp.zeros((C,), jnp.int32), h)
        row_tok = _fit(toks, R)
        # rows that do not exit write nowhere (a row that exits is real, so r < n <= C)
        at = jnp.where(exits, t, ntok)
        out = out.at[at, rows].set(row_tok, mode="drop").at[at, C + rows].set(d, mode="drop")
        prev = jnp.where(exits, row_tok, prev)
        tok = tok + exits
        d = jnp.where(exits, 0, jnp.where(active, d + 1, d))
        rem = jnp.where(exits, 1.0, nxt)
        return i + 1, kp, vp, ring, tok, d, rem, prev, gates, out

    zeros = jnp.zeros((R,), jnp.int32)
    init = (
        jnp.int32(0),
        kp,
        vp,
        ring,
        zeros,
        zeros,
        jnp.ones((R,), jnp.float32),
        _fit(previous.astype(jnp.int32), R),  # each row's last sample: the previous step's at first
        jnp.zeros((n, R), jnp.float32),
        # exit depths -1 until made (padding rows keep it)
        jnp.concatenate([jnp.zeros((ntok, C), jnp.int32), jnp.full((ntok, R), -1, jnp.int32)], axis=1),
    )
    _, kp, vp, ring, _, _, _, prev, gates, out = jax.lax.while_loop(more, loop, init)
    last = _fit(prev, C)
    return kp, vp, ring, gates, out, last
