"""A numpy stand-in for the runner: executes descriptors on a hash "model", and its dense twin.

It exists so that the scheduler and the descriptor contract (docs/contracts.md) can be tested, and
the scheduler's host cost measured, without JAX. The "model" keeps the data flow of Ouro and
nothing else: a hidden state is a 64-bit hash; a loop writes ``kv = H(x, pos)`` into the row's KV
slot, "attends" by summing ``H(kv)`` over every position ``<= pos`` of the segment's plane (an
order-free reduction), outputs ``h = H(x, attn)``, a gate logit drawn from ``h`` and, for coda rows,
a token drawn from ``h`` (and from the seed / step when the temperature is positive).

``FakeRunner.step`` (the same call as ``ModelRunner.step``) follows the contract step by step
(finalize, prelude, recurrent, coda) and asserts what the contract promises about padding:
padding rows write no KV slot and only touch ring row 0, real rows never touch the trash page or
ring row 0, padded segments / prelude / coda / finalize entries are inert, and every KV slot that
is read was written before.

``reference_generate`` computes the same model the slow, obvious way (one request at a time,
position after position, KV planes as plain arrays), so that any scheduling bug (a wrong ring row,
plane, block, frontier or a missed finalize) changes tokens or exit depths.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .descriptor import StepResult
from .exit_policy import decide_exit, decide_exit_rows, fold_gate, fold_gate_rows, gates_needed_at, synthetic_exit_loops
from .sampling_params import SamplingParams
from .sizes import blocks_per_plane, kv_planes
from .speculation import VERIFY_FIELDS, SpecDescriptor

__all__ = ["FakeRunner", "reference_generate", "embed", "gate_logit", "sample_token"]

_M1, _M2, _G = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(z) -> np.ndarray:
    """splitmix64 finaliser, elementwise (uint64 wrap-around is intended)."""
    z = np.asarray(z, np.uint64)
    with np.errstate(over="ignore"):
        z = z + _G
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def embed(tokens) -> np.ndarray:
    return _mix(np.asarray(tokens, np.uint64) ^ np.uint64(0x5EED))


def kv_of(x, pos) -> np.ndarray:
    return _mix(np.asarray(x, np.uint64) ^ _mix(np.asarray(pos, np.uint64) + np.uint64(0xC0FFEE)))


def attn_term(kv) -> np.ndarray:
    return _mix(np.asarray(kv, np.uint64) ^ np.uint64(0xA77E))


def loop_out(x, attn) -> np.ndarray:
    return _mix(np.asarray(x, np.uint64) ^ _mix(np.asarray(attn, np.uint64)))


def gate_logit(h) -> np.ndarray:
    """A logit in [-4, 4] drawn from ``h`` (float32, as the device returns it)."""
    u = (np.asarray(h, np.uint64) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return (u * 8.0 - 4.0).astype(np.float32)


def sample_token(h, temperature, seed, step, vocab_size: int) -> np.ndarray:
    h = np.asarray(h, np.uint64)
    greedy = h % np.uint64(vocab_size)
    with np.errstate(over="ignore"):
        key = _mix(np.asarray(seed, np.uint64) * np.uint64(1_000_003) + np.asarray(step, np.uint64))
    drawn = _mix(h ^ key) % np.uint64(vocab_size)
    return np.where(np.asarray(temperature) > 0, drawn, greedy).astype(np.int32)


class FakeRunner:
    """Executes descriptors; ``step`` returns a ``StepResult`` like ``ModelRunner.step``."""

    def __init__(self, num_blocks: int, block_size: int, num_ring_rows: int, vocab_size: int = 101, check: bool = True):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.check = check
        self.kv = np.zeros(num_blocks * block_size, np.uint64)
        self.kv_written = np.zeros(num_blocks * block_size, bool)
        self.ring = np.zeros(num_ring_rows, np.uint64)
        self.invocations = 0
        self.last_fused_tokens = None  # the latest fused step's last samples (a step ahead feeds them)

    def step(self, desc) -> StepResult:
        """Run one ``BatchDescriptor`` (or a ``StackedDescriptor``: a fused decode step; or a
        ``SpecDescriptor``: a round of self-speculative decoding)."""
        if isinstance(desc, SpecDescriptor):
            return StepResult(np.zeros(0, np.float32), self._run_round(desc))
        if hasattr(desc, "steps"):
            return StepResult(*self._run_fused(desc))
        return StepResult(*self._run(desc))

    def _run(self, desc) -> tuple[np.ndarray, np.ndarray]:
        out, gates = self._loop(desc)
        # 4. coda
        tokens = self._coda(desc, out[desc.coda_row])
        return gates, tokens

    def _coda(self, desc, h) -> np.ndarray:
        return sample_token(h, desc.coda_temperature, desc.coda_seed, desc.coda_step, self.vocab_size)

    def _loop(self, desc, previous_tokens=None, active=None) -> tuple[np.ndarray, np.ndarray]:
        """Steps 1-3 of one descriptor: ``(h [R], gates [R])``. ``active [R]`` (fused steps): rows
        that have not exited; the others write no K/V and read nothing (their output is unused)."""
        bs = self.block_size
        nseg, npre, nfin = desc.num_segments, desc.num_prelude, desc.num_finalize
        if self.check:
            self._check_padding(desc)
        # 1. finalize
        for src, dst in zip(desc.fin_src[:nfin], desc.fin_dst[:nfin]):
            if self.check:
                assert self.kv_written[src], "finalize copies a KV slot that was never written"
            self.kv[dst] = self.kv[src]
            self.kv_written[dst] = True
        # 2. prelude (padding writes ring row 0); a fused sub-step embeds the previous token's samples
        pre_token = desc.pre_token.copy()
        if desc.feed_previous_tokens:
            assert previous_tokens is not None, "a sub-step feeds previous tokens, but no fused step sampled any"
            pre_token[:npre] = previous_tokens[:npre]
        self.ring[desc.pre_ring] = embed(pre_token)
        # 3. recurrent: write every real row's K/V, then attend per segment
        x = self.ring[desc.row_ring]
        slots = desc.row_slot
        real = slots >= 0
        if active is not None:
            real &= active
        self.kv[slots[real]] = kv_of(x[real], desc.row_pos[real])
        self.kv_written[slots[real]] = True
        out = x.copy()
        for s in range(nseg):
            q0, ql, ctx = int(desc.seg_q_start[s]), int(desc.seg_q_len[s]), int(desc.seg_ctx_len[s])
            if ql == 0 or (active is not None and not active[q0 : q0 + ql].any()):
                continue
            j = np.arange(ctx)
            ctx_slots = desc.seg_block_table[s, j // bs].astype(np.int64) * bs + j % bs
            if self.check:
                assert self.kv_written[ctx_slots].all(), f"segment {s} reads KV slots never written"
                assert (desc.seg_block_table[s, : blocks_per_plane(ctx, bs)] != 0).all(), "segment reads the trash page"
            with np.errstate(over="ignore"):
                prefix = np.cumsum(attn_term(self.kv[ctx_slots]), dtype=np.uint64)
            pos = desc.row_pos[q0 : q0 + ql]
            out[q0 : q0 + ql] = loop_out(x[q0 : q0 + ql], prefix[pos])
        out[~(desc.row_slot >= 0)] = 0  # padding rows: what they compute does not matter
        self.ring[desc.row_ring] = out
        self.invocations += 1
        return out, gate_logit(out)

    def _lockstep(self, subs, first: int, prev, active, rem, exits, on_exit=None):
        """Loops ``first, first + 1, ...`` (``subs[i]`` runs loop ``first + i``) of the ``active``
        rows in lock step until all exited, each row deciding after every loop by its exit words
        ``exits`` (float32, as the device). Returns ``(exit states, exit depths (-1: still
        running), remaining, still active, gates [len(subs), R])``; ``on_exit(t, out)`` runs after
        loop ``t`` with the rows that exited there."""
        R = len(active)
        exit_h, depth = np.zeros(R, np.uint64), np.full(R, -1, np.int64)
        gates = np.zeros((len(subs), R), np.float32)
        for i, sub in enumerate(subs):
            if not active.any():
                break
            t = first + i
            h, gates[i] = self._loop(sub, prev, active)
            nxt = fold_gate_rows(rem, gates[i])
            out = active & decide_exit_rows(t + 1, nxt, rem, *exits)
            exit_h[out], depth[out] = h[out], t
            rem = np.where(active, nxt, rem)
            active = active & ~out
            if on_exit is not None:
                on_exit(t, out)
        return exit_h, depth, rem, active, gates

    def _run_fused(self, desc) -> tuple[np.ndarray, np.ndarray]:
        """A fused decode step with its exits decided here, as the device does (``StackedDescriptor``):
        per token, loops of every row in lock step until all exited (float32 rule), an exited row
        writing no K/V; then the LAST_EXITED finalize of planes above each exit, the coda of the
        exit states, and the sampled tokens fed to the next token's prelude."""
        T, key = desc.num_loops, desc.key
        R, C = key.R, key.C
        gates = np.zeros((desc.n, R), np.float32)
        result = np.zeros((desc.num_tokens, C + R), np.int32)
        prev = self.last_fused_tokens  # read only by a step scheduled ahead (Scheduler.schedule_ahead)
        for j in range(desc.num_tokens):
            subs = desc.steps[j * T : (j + 1) * T]
            args = (desc.exit_limit[j], desc.exit_min_loops[j], desc.exit_delay[j], desc.exit_threshold[j])
            active = np.arange(R) < subs[0].num_rows  # real rows, as on the device; every one makes every token
            exit_h, depth, _, _, gates[j * T : (j + 1) * T] = self._lockstep(
                subs, 0, prev, active, np.ones(R, np.float32), args
            )
            depth = np.maximum(depth, 0)  # padding rows never run
            if key.F:  # LAST_EXITED: plane e -> planes e+1..T-1 of every real row
                for r in range(subs[0].num_rows):
                    src = subs[depth[r]].row_slot[r]
                    for p in range(depth[r] + 1, T):
                        self.kv[subs[p].row_slot[r]] = self.kv[src]
                        self.kv_written[subs[p].row_slot[r]] = True
            last = subs[T - 1]
            prev = self._coda(last, exit_h[last.coda_row])
            result[j, :C] = prev
            result[j, C:] = depth
        self.last_fused_tokens = prev
        return gates, result

    def _run_round(self, desc: SpecDescriptor) -> np.ndarray:
        """A round as ``ouro_jax/speculative.py`` runs it: per position, ``d`` draft loops of every
        row in lock step (a row whose rule fires exits for real: finalized into every plane, its
        token sampled as plain decoding's); the other rows are cut and draft a token from their
        state (another key: the fake model has no distribution to draw from). Then the verify's
        loops ``d .. T - 1`` of every cut position, each to its own exit, an exited row's plane
        copied upward at once; a draft is kept while it equals the token plain decoding samples
        there (exact-match acceptance: the fake's tokens are plain decoding's, sampled ones too).
        Returns ``[C, 2 + 2 * positions]`` (``speculation.split_spec_output``)."""
        key = desc.key
        d, k1, T = key.draft_loops, key.positions, key.num_loops
        draft, verify, n = desc.draft, desc.verify, desc.num_requests
        R, C = key.draft.R, key.draft.C
        vslot = np.stack([v.row_slot for v in verify])  # [T - d, Rv]: verify row i * k1 + j per plane
        toks = np.zeros((k1, C), np.int64)
        depth = np.full((k1, n), -1, np.int64)
        rem0 = np.ones((k1, n), np.float32)
        prev = None
        for j in range(k1):
            subs = draft.steps[j * d : (j + 1) * d]
            args = (draft.exit_limit[j], draft.exit_min_loops[j], draft.exit_delay[j], draft.exit_threshold[j])
            exit_h, dep, rem, active, _ = self._lockstep(subs, 0, prev, np.arange(R) < n, np.ones(R, np.float32), args)
            for r in np.flatnonzero(dep[:n] >= 0):  # exited within the draft: planes above, as plain decoding
                slots = [sub.row_slot[r] for sub in subs] + list(vslot[:, r * k1 + j])
                for p in range(dep[r] + 1, T):
                    self.kv[slots[p]] = self.kv[slots[dep[r]]]
                    self.kv_written[slots[p]] = True
            last = subs[-1]
            plain = self._coda(last, exit_h[last.coda_row])
            with np.errstate(over="ignore"):
                drafted = sample_token(
                    self.ring[last.row_ring[last.coda_row]],
                    last.coda_temperature,
                    last.coda_seed.astype(np.uint64) ^ np.uint64(0xD7AF7),
                    last.coda_step,
                    self.vocab_size,
                )
            cut_rows = np.isin(last.coda_row, np.flatnonzero(active))
            prev = np.where(cut_rows, drafted, plain).astype(np.int32)
            toks[j], depth[j], rem0[j] = prev, dep[:n], rem[:n]
        # the verify: row i * k1 + j is request i's position p + j
        w = dict(zip(VERIFY_FIELDS, desc.words))
        f32 = lambda x: np.asarray(x, np.int32).view(np.float32)  # noqa: E731
        exits = (w["exit_limit"], w["exit_min_loops"], w["exit_delay"], f32(w["exit_threshold"]))
        Rv = key.verify.R
        req, pos = np.arange(Rv) // k1, np.arange(Rv) % k1
        real = np.arange(Rv) < n * k1
        reqc = np.minimum(req, n - 1)
        active = real & (depth[pos, reqc] < 0)
        rem = np.where(real, rem0[pos, reqc], np.float32(1.0)).astype(np.float32)

        def copy_up(t, out):  # the positions after an exited one read its planes in the loops that follow
            for r in np.flatnonzero(out):
                self.kv[vslot[t - d + 1 :, r]] = self.kv[vslot[t - d, r]]
                self.kv_written[vslot[t - d + 1 :, r]] = True

        exit_h, vdep, _, _, _ = self._lockstep(verify, d, None, active, rem, exits, copy_up)
        vdep = np.where(vdep >= 0, vdep, depth[pos, reqc])  # positions that exited within the draft
        temp = f32(w["temperature"])
        target = sample_token(exit_h, temp, w["seed"].view(np.uint32), w["step"], self.vocab_size)
        result = np.zeros((C, 2 + 2 * k1), np.int32)
        for i in range(n):
            kept, tokens = k1, []
            for j in range(k1):
                exact = depth[j, i] >= 0
                tokens.append(int(toks[j, i]) if exact else int(target[i * k1 + j]))
                if not exact and target[i * k1 + j] != toks[j, i]:
                    kept = j + 1
                    break
            accepted = kept - 1 + (tokens[-1] == toks[kept - 1, i])
            result[i, 0], result[i, 1] = accepted, kept
            result[i, 2 : 2 + kept] = tokens
            result[i, 2 + k1 : 2 + k1 + kept] = vdep[i * k1 : i * k1 + kept]
        return result

    def _check_padding(self, desc) -> None:
        k = desc.key
        nrows, nseg, npre, ncoda, nfin = (
            desc.num_rows,
            desc.num_segments,
            desc.num_prelude,
            desc.num_coda,
            desc.num_finalize,
        )
        assert (desc.row_slot[nrows:] == -1).all() and (desc.row_ring[nrows:] == 0).all(), "padding row touches state"
        assert (desc.row_slot[:nrows] >= self.block_size).all(), "real row without a slot, or in the trash page"
        assert (desc.row_ring[:nrows] > 0).all(), "real row uses the scratch ring row"
        assert len(set(desc.row_ring[:nrows].tolist())) == nrows, "two rows of one invocation share a ring row"
        assert (desc.seg_q_len[nseg:] == 0).all() and (desc.seg_q_len[:nseg] > 0).all()
        assert desc.seg_q_len[:nseg].sum() == nrows
        q_end = desc.seg_q_start[:nseg] + desc.seg_q_len[:nseg]
        assert (desc.seg_q_start[:nseg][1:] == q_end[:-1]).all() and (nseg == 0 or desc.seg_q_start[0] == 0)
        for s in range(nseg):  # the segment's last row sits at ctx_len - 1; rows are consecutive positions
            q0, ql = int(desc.seg_q_start[s]), int(desc.seg_q_len[s])
            pos = desc.row_pos[q0 : q0 + ql]
            assert pos[-1] == desc.seg_ctx_len[s] - 1 and (np.diff(pos) == 1).all()
        assert (desc.pre_ring[npre:] == 0).all() and (desc.pre_ring[:npre] > 0).all(), "prelude padding"
        assert (desc.coda_row[ncoda:] == 0).all() and (desc.coda_row[:ncoda] < nrows).all()
        assert (desc.fin_dst[nfin:] == -1).all() and (desc.fin_src[nfin:] == -1).all()
        assert (desc.fin_src[:nfin] >= 0).all() and (desc.fin_dst[:nfin] >= 0).all()
        assert k.R >= nrows and k.C >= ncoda and k.F >= nfin and k.S >= nseg


def reference_generate(
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    num_loops: int,
    *,
    request_ids: Optional[Sequence] = None,
    kv_layout: str = "last_exited",
    eos_token_ids: Sequence[int] = (),
    vocab_size: int = 101,
) -> list[dict]:
    """The fake model run one request at a time, token by token; returns per request
    ``{"tokens", "exit_depths", "finish_reason"}``."""
    T = num_loops
    request_ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
    results = []
    for rid, prompt, sp in zip(request_ids, prompts, params):
        n = len(prompt)
        planes = kv_planes(T, kv_layout)
        kv = np.zeros((planes, n + sp.max_tokens), np.uint64)

        def loop(x, pos, d):
            p = min(d, planes - 1)
            kv[p, pos] = kv_of(x, pos)
            with np.errstate(over="ignore"):
                attn = attn_term(kv[p, : pos + 1]).sum(dtype=np.uint64)
            return loop_out(x, attn)

        for pos in range(n):
            h = embed(prompt[pos])
            for d in range(T):
                h = loop(h, pos, d)
        tokens = [int(sample_token(h, sp.temperature, sp.seed, 0, vocab_size))]
        depths = [T - 1]
        reason = None
        while True:
            tok = tokens[-1]
            if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in eos_token_ids):
                reason = "stop"
                break
            if len(tokens) >= sp.max_tokens:
                reason = "length"
                break
            k = len(tokens)
            pos = n + k - 1
            target = synthetic_exit_loops(sp, T, rid, k) if sp.exit_mode == "synthetic" else None
            h = embed(tok)
            gates = []
            for d in range(T):
                h = loop(h, pos, d)
                gates.append(float(gate_logit(h)))
                need = gates_needed_at(sp, T, d + 1)
                rem = 1.0
                for g in gates[:need]:
                    rem = fold_gate(rem, g)
                if decide_exit(sp, T, d + 1, rem, target):
                    break
            e = d
            if kv_layout == "last_exited":
                kv[e + 1 :, pos] = kv[e, pos]
            tokens.append(int(sample_token(h, sp.temperature, sp.seed, k, vocab_size)))
            depths.append(e)
        results.append({"tokens": tokens, "exit_depths": depths, "finish_reason": reason})
    return results
