"""The two executables of a round of self-speculative decoding (``scheduler/speculation.py`` says
what a round is; ``SpecDescriptor`` lays it out).

:func:`draft` takes ``(params, kp, vp, ring, packed)`` and returns ``(kp, vp, ring, tokens
[positions, C], depth [positions, R], remaining [positions, R], logits [positions, C, V])``: per
position (a ``fori_loop``), loops ``0 .. d - 1`` of every row in lock step (a ``while_loop``, as
``fused_step.lockstep`` runs a token), each row deciding its exit by its request's rule after every
loop. A row that exits there exits for real: plain decoding's finalize copies (the slots of the
planes the draft does not run come from the verify's descriptors) and its token sampled with the
plain key. A row still running after ``d`` loops is cut: ``depth`` -1, its depth-``d - 1`` state
left in its ring row, a draft token sampled from its logits. The tokens feed the next position's
prelude on the device.

:func:`verify` takes the same ``packed`` and the draft's four outputs and returns ``(kp, vp, ring,
out [C, 2 + 2 * positions])``: loops ``d .. T - 1`` of every cut row (a request's positions form
one segment) in lock step, each to its own exit; a row that exits copies its plane into the
planes above at once, since the positions after it read them in the loops that follow. Then one
coda over every row and the acceptance rule (``sampling.speculative_accept``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import copy_kv_slots
from scheduler.descriptor import EXIT_FIELDS, HEADER, descriptor_layout
from scheduler.speculation import VERIFY_FIELDS, SpecKey, spec_layout

from .fused_step import exit_loop
from .model import OuroModel, dtype_of
from .parallel import local_config
from .sampling import draft_sample, greedy, speculative_accept
from .step_program import packed_size, unpack

__all__ = ["draft", "verify"]


def _blocks(packed, key: SpecKey):
    """The round's packed array as (draft sub-steps, verify sub-steps, verify words)."""
    lay = spec_layout(key)
    part = lambda off, shape: packed[off : off + shape[0] * shape[1]].reshape(shape)  # noqa: E731
    return (
        part(lay.draft_offset, lay.draft_shape),
        part(lay.verify_offset, lay.verify_shape),
        part(lay.words_offset, lay.words_shape),
    )


def _field(key, name: str) -> int:
    return next(f.offset for f in descriptor_layout(key) if f.name == name)


def _logits(params, h, kw) -> jax.Array:
    dt = dtype_of(kw["dtype_name"])
    model = OuroModel(local_config(kw["config"], 1), dt)
    return model.apply({"params": params["top"]}, h, method=OuroModel.coda).astype(jnp.float32)


def _greedy_accept(target, proposed, exact):
    """``speculative_accept`` when every row is greedy, without its sorts over the vocabulary: a
    draft is kept while it is the target's argmax; the first that is not is replaced by it."""
    k1 = proposed.shape[1]
    best = greedy(target.reshape(-1, target.shape[-1])).reshape(proposed.shape)
    kept = jnp.sum(jnp.cumprod((exact | (proposed == best)).astype(jnp.int32), axis=1), axis=1)
    tokens = jnp.where(jnp.arange(k1)[None, :] == kept[:, None], best, proposed)
    return jnp.minimum(kept + 1, k1).astype(jnp.int32), tokens


def draft(params, kp, vp, ring, packed, *, key: SpecKey, **kw):
    """The draft of a round (the module docstring)."""
    bd, bv = key.draft, key.verify
    d, k1, T = key.draft_loops, key.positions, key.num_loops
    R, C = bd.R, bd.C
    words = packed_size(bd)
    dblock, vblock, _ = _blocks(packed, key)
    slot_d, slot_v = _field(bd, "row_slot"), _field(bv, "row_slot")
    num_rows = dblock[0, _field(bd, "header") + HEADER.index("num_rows")]
    real = jnp.arange(R) < num_rows
    h_dtype = dtype_of(kw["dtype_name"])
    V = kw["config"].vocab_size
    kw_d = dict(kw, key=bd)
    # the slots of planes d .. T-1 of request i's position j: verify row i * k1 + j
    vslots = vblock[:, slot_v : slot_v + bv.R]  # [T - d, Rv]

    def position(j, carry):
        kp, vp, ring, prev, toks, depth_out, rem_out, logits_out = carry
        first = j * d
        ex = dblock[first, words:].reshape(len(EXIT_FIELDS), R)
        limit, min_loops, delay = ex[0], ex[1], ex[2]
        exits = (limit, min_loops, delay, jax.lax.bitcast_convert_type(ex[3], jnp.float32))

        def more(c):
            return (c[0] < d) & jnp.any(c[5])

        def loop(c):
            i, kp, vp, ring, rem, active, state, depth = c
            a = unpack(bd, dblock[first + i, :words])
            kp, vp, ring, h, _, nxt, out = exit_loop(
                params, kp, vp, ring, a, prev, active, rem, i + 1, exits, decode_only=True, **kw_d
            )
            # an exiting row keeps its exit state; a row still running keeps its latest one
            state = jnp.where(active[:, None], h.astype(h_dtype), state)
            depth = jnp.where(out, i, depth)
            rem = jnp.where(active, nxt, rem)
            return i + 1, kp, vp, ring, rem, active & ~out, state, depth

        init = (
            jnp.int32(0),
            kp,
            vp,
            ring,
            jnp.ones((R,), jnp.float32),
            real,
            jnp.zeros((R, ring.shape[-1]), h_dtype),
            jnp.full((R,), -1, jnp.int32),
        )
        _, kp, vp, ring, rem, cut, state, depth = jax.lax.while_loop(more, loop, init)
        exact = real & ~cut
        # finalize the rows that exited: plane depth -> planes depth + 1 .. T - 1 (a row's slot per plane)
        dslots = jax.lax.dynamic_slice(dblock, (first, slot_d), (d, R))  # planes 0 .. d-1
        above = vslots[:, jnp.minimum(jnp.arange(R) * k1 + j, bv.R - 1)]  # planes d .. T-1 of position j
        slots = jnp.concatenate([dslots, above], axis=0)  # [T, R]
        src = jnp.take_along_axis(slots, jnp.maximum(depth, 0)[None, :], axis=0)[0]
        mask = (jnp.arange(1, T)[:, None] > depth[None, :]) & exact[None, :]
        dst = jnp.where(mask, slots[1:], -1)
        kp, vp = copy_kv_slots(kp, vp, jnp.broadcast_to(src, dst.shape).reshape(-1), dst.reshape(-1))
        a = unpack(bd, dblock[first + d - 1, :words])  # the coda fields ride on the position's last loop
        logits = _logits(params, state[a["coda_row"]], kw)
        args = (a["coda_top_k"], a["coda_top_p"], a["coda_seed"], a["coda_step"], exact[a["coda_row"]])
        # sampling sorts the vocabulary: only when a row samples (a conditional node on the GPU)
        tok = jax.lax.cond(
            jnp.any(a["coda_temperature"] > 0),
            lambda: draft_sample(logits, a["coda_temperature"], *args),
            lambda: greedy(logits),
        )
        return (
            kp,
            vp,
            ring,
            tok,
            toks.at[j].set(tok),
            depth_out.at[j].set(jnp.where(exact, depth, -1)),
            rem_out.at[j].set(rem),
            logits_out.at[j].set(logits),
        )

    init = (
        kp,
        vp,
        ring,
        jnp.zeros((C,), jnp.int32),
        jnp.zeros((k1, C), jnp.int32),
        jnp.zeros((k1, R), jnp.int32),
        jnp.ones((k1, R), jnp.float32),
        jnp.zeros((k1, C, V), jnp.float32),
    )
    kp, vp, ring, _, toks, depth, rem, logits = jax.lax.fori_loop(0, k1, position, init)
    return kp, vp, ring, toks, depth, rem, logits


def verify(params, kp, vp, ring, packed, draft_tokens, draft_depth, draft_rem, draft_logits, *, key: SpecKey, **kw):
    """The verify of a round and its acceptance (the module docstring)."""
    bd, bv = key.draft, key.verify
    d, k1, T = key.draft_loops, key.positions, key.num_loops
    R, C = bv.R, bd.C
    words = packed_size(bv)
    _, vblock, vw = _blocks(packed, key)
    slot_v = _field(bv, "row_slot")
    num_rows = vblock[0, _field(bv, "header") + HEADER.index("num_rows")]
    real = jnp.arange(R) < num_rows
    h_dtype = dtype_of(kw["dtype_name"])
    w = {name: vw[i] for i, name in enumerate(VERIFY_FIELDS)}
    f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)  # noqa: E731
    exits = (w["exit_limit"], w["exit_min_loops"], w["exit_delay"], f32(w["exit_threshold"]))
    kw_v = dict(kw, key=bv)
    req, pos = jnp.arange(R) // k1, jnp.arange(R) % k1
    req_d = jnp.minimum(req, draft_depth.shape[1] - 1)
    cut = real & (draft_depth[pos, req_d] < 0)
    vslots = vblock[:, slot_v : slot_v + R]  # [T - d, R]: row r's slot at planes d .. T-1

    def more(c):
        return (c[0] < T) & jnp.any(c[5])

    def loop(c):
        i, kp, vp, ring, rem, active, state, depth = c
        a = unpack(bv, vblock[i - d, :words])
        kp, vp, ring, h, _, nxt, out = exit_loop(params, kp, vp, ring, a, None, active, rem, i + 1, exits, **kw_v)
        state = jnp.where(out[:, None], h.astype(h_dtype), state)
        depth = jnp.where(out, i, depth)
        # an exiting row's K/V into the planes above now: later positions read them in later loops
        planes = jnp.arange(d, T)[:, None]
        dst = jnp.where((planes > i) & out[None, :], vslots, -1)
        src = jnp.broadcast_to(vslots[i - d], dst.shape)
        kp, vp = copy_kv_slots(kp, vp, src.reshape(-1), dst.reshape(-1))
        return i + 1, kp, vp, ring, jnp.where(active, nxt, rem), active & ~out, state, depth

    init = (
        jnp.int32(d),
        kp,
        vp,
        ring,
        draft_rem[pos, req_d],
        cut,
        jnp.zeros((R, ring.shape[-1]), h_dtype),
        jnp.where(cut, 0, draft_depth[pos, req_d]),
    )
    _, kp, vp, ring, _, _, state, depth = jax.lax.while_loop(more, loop, init)
    # request i's positions as [C, positions] (rows past the real ones repeat the last row)
    idx = jnp.minimum(jnp.arange(C)[:, None] * k1 + jnp.arange(k1)[None, :], R - 1)
    target = _logits(params, state[idx.reshape(-1)], kw).reshape(C, k1, -1)
    proposed = draft_tokens.T  # [C, positions]
    exact = (draft_depth[:, :C] >= 0).T
    first = idx[:, 0]
    temperature = f32(w["temperature"][first])
    count, tokens = jax.lax.cond(
        jnp.any(temperature > 0),
        lambda: speculative_accept(
            target,
            jnp.swapaxes(draft_logits, 0, 1),
            proposed,
            exact,
            temperature,
            w["top_k"][first],
            f32(w["top_p"][first]),
            jax.lax.bitcast_convert_type(w["seed"][first], jnp.uint32),
            w["step"][idx],
        ),
        lambda: _greedy_accept(target, proposed, exact),
    )
    last = jnp.take_along_axis(tokens, (count - 1)[:, None], axis=1)[:, 0]
    last_draft = jnp.take_along_axis(proposed, (count - 1)[:, None], axis=1)[:, 0]
    # the kept position's token is the draft's exactly when the draft was accepted there
    accepted = count - 1 + (last == last_draft).astype(jnp.int32)
    out = jnp.concatenate([accepted[:, None], count[:, None], tokens, depth[idx]], axis=1).astype(jnp.int32)
    return kp, vp, ring, out
