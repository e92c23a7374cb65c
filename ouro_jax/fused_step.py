"""Fused decode steps: ``tokens`` tokens of the same decode rows in one executable, every exit
decided on the device (``scheduler.descriptor.StackedDescriptor``; docs/contracts.md, "Fused
decode steps"). :func:`lockstep` runs, per token, loop ``d`` of every row at once until the
deepest row has exited, so a token costs the batch's deepest exit.

It takes ``(params, kp, vp, ring, packed [n, words + exit words], previous [C])`` and returns
``(kp, vp, ring, gates [n, R], out [tokens, C + R + C * LOGPROB_WORDS], last [C], coda_h [C, D])``.
Two other programs were measured slower and removed (docs/decisions.md, "Early exit at a few
streams pays the lock step"): rows advancing each at its own depth and token, and *elastic* steps
returning once every row made half the tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import copy_kv_slots
from scheduler.descriptor import EXIT_FIELDS, HEADER, descriptor_layout
from scheduler.sampling_params import LOGPROB_WORDS

from .exit_rule import decide_exit_rows, fold_gate
from .model import dtype_of
from .step_program import coda, packed_size, recurrent, unpack

__all__ = ["exit_loop", "lockstep"]


def exit_loop(params, kp, vp, ring, a: dict, prev, active, rem, loops_done, exits: tuple, **kw):
    """One loop of rows in lock step, each deciding its exit after it: descriptor fields ``a``
    (``recurrent``'s), the rows still ``active`` (an exited row writes no K/V: slot -1, as a
    padding row's), their remaining mass ``rem`` and exit words ``exits`` (limit, min loops, delay,
    threshold) -> ``(kp, vp, ring, h, g, remaining after this gate, rows exiting now)``."""
    a = dict(a, row_slot=jnp.where(active, a["row_slot"], -1))
    kp, vp, ring, h, g = recurrent(params, kp, vp, ring, a, prev, **kw)
    nxt = fold_gate(rem, g)
    return kp, vp, ring, h, g, nxt, active & decide_exit_rows(loops_done, nxt, rem, *exits)


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
    ``[tokens, C + R + C * LOGPROB_WORDS]`` int32 (sampled tokens, exit depths, then the tokens'
    logprob records, zeros unless the token's ``coda_extras`` asks for them), the last token's
    samples ``[C]`` (the next step's ``previous``) and its coda rows' exit states ``[C, D]``: a step
    whose coda the host defers (a grammar's mask or a penalty's counts need the token before)
    samples those with the separate sampler once they are known (``ModelRunner.complete``)."""
    key, T = kw["key"], kw["config"].num_loops
    n = packed.shape[0]
    R, C = key.R, key.C
    words = packed_size(key)
    layout = {f.name: f for f in descriptor_layout(key)}
    slot_at = layout["row_slot"].offset
    finalize = key.F > 0 and T > 1  # LAST_EXITED (SHARED buckets hold no finalize pairs)

    def token(j, carry):
        kp, vp, ring, prev, gates, out, _ = carry
        first = j * T
        ex = packed[first, words:].reshape(len(EXIT_FIELDS), R)
        limit, min_loops, delay = ex[0], ex[1], ex[2]
        thr = jax.lax.bitcast_convert_type(ex[3], jnp.float32)
        exits = (limit, min_loops, delay, thr)
        real = jnp.arange(R) < packed[first, layout["header"].offset + HEADER.index("num_rows")]
        h_dtype = dtype_of(kw["dtype_name"])

        def more(c):
            return (c[0] < T) & jnp.any(c[5])

        def loop(c):
            d, kp, vp, ring, rem, active, exit_h, depth, gates = c
            a = unpack(key, packed[first + d, :words])
            kp, vp, ring, h, g, nxt, out = exit_loop(
                params, kp, vp, ring, a, prev, active, rem, d + 1, exits, decode_only=True, **kw
            )
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
        h = exit_h[a["coda_row"]]
        # logprobs cost a top-k over the vocabulary: only when a row asks
        tok, records = jax.lax.cond(
            a["coda_extras"] == 1,
            lambda: coda(params, h, a, with_logprobs=True, **kw),
            lambda: (coda(params, h, a, **kw), jnp.zeros((C, LOGPROB_WORDS), jnp.int32)),
        )
        out = out.at[j].set(jnp.concatenate([tok, depth, records.reshape(-1)]))
        return kp, vp, ring, tok, gates, out, h

    init = (
        kp,
        vp,
        ring,
        previous.astype(jnp.int32),
        jnp.zeros((n, R), jnp.float32),
        jnp.zeros((n // T, C + R + C * LOGPROB_WORDS), jnp.int32),
        jnp.zeros((C, ring.shape[-1]), dtype_of(kw["dtype_name"])),
    )
    kp, vp, ring, last, gates, out, coda_h = jax.lax.fori_loop(0, n // T, token, init)
    return kp, vp, ring, gates, out, last, coda_h
