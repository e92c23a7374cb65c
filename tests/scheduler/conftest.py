"""Shared by the scheduler tests and the engine tests that drive the scheduler: a fake-model harness
that checks every plan as it is produced (budgets, readiness, ring rows, descriptor rows), random
workloads, and the comparison with the fake model's dense reference.

Pure Python + numpy, as the scheduler: these tests also run where jax is not installed.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import strategies as st

from scheduler import Phase, Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from scheduler.fake_runner import FakeRunner, reference_generate
from scheduler.pipeline import StepPipeline

VOCAB = 101


class _Result:
    """A fake step's gates and tokens as callables, recording which ones ``update`` reads."""

    def __init__(self, h, plan, gates, toks):
        def reader(arr, which):
            def f():
                if h.lazy:
                    h.reads.append((plan.step, which))
                h.on_read(plan)
                return arr

            return f

        self.gates, self.tokens = reader(gates, "gates"), reader(toks, "tokens")
        self.logprobs = None  # no logprob records: the fake model has no distribution


class _CheckedRunner:
    """The runner the harness's ``StepPipeline`` launches on: checks each plan as it launches
    (the scheduler's newest plan in flight), then runs it on the fake runner."""

    def __init__(self, h):
        self.h = h

    def step(self, desc):
        h, s = self.h, self.h.s
        plan = s._ahead if s._ahead is not None else s._inflight
        assert plan is not None and plan.descriptor is desc, "launched a plan the scheduler did not hand out"
        # frontiers as the plan about to be applied left them (schedule's preemptions included)
        h.frontiers = {r.request_id: list(r.prefill_depth_frontiers) for r in s.running}
        h.check_launch(plan, ahead=plan is s._ahead)
        h.plans.append(plan)
        result = h.fr.step(desc)
        return _Result(h, plan, result.gates(), result.tokens())


class Harness:
    """Drives a Scheduler with a FakeRunner through ``StepPipeline`` and checks every plan.
    ``ahead``: fused decode steps scheduled one ahead of the reads (asynchronous scheduling)."""

    def __init__(self, cfg: SchedulerConfig, lazy: bool = False, ahead: bool = False, vocab: int = VOCAB, clock=None):
        self.cfg = cfg
        self.s = Scheduler(cfg)
        self.fr = FakeRunner(cfg.num_blocks, cfg.block_size, cfg.num_ring_rows, vocab)
        self.rounds = 0  # rounds of self-speculative decoding run
        kw = {} if clock is None else dict(clock=clock)  # the pipeline's clock (a latency target's timing)
        self.pipeline = StepPipeline(self.s, _CheckedRunner(self), ahead=ahead, **kw)
        self.ring_tag: dict[int, tuple] = {}
        self.prompt_runs = Counter()  # (rid, pos, depth) -> times run
        self.lazy = lazy
        self.reads = []  # (plan, which) read by update
        self.plans = []
        self.max_rows = 0
        self.max_running = 0
        self.fused = 0  # fused decode steps run
        self.ahead = 0  # of which scheduled ahead
        self.frontiers: dict = {}  # prompt frontiers by request when the latest plan launched

    def step(self):
        s = self.s
        deltas = self.pipeline.advance()
        if deltas is None:
            return None
        # frontiers only move forward (against the latest launch's snapshot: a step launched ahead
        # changes none, so it is also the one from before the plan just applied) and stay ordered
        for r in s.running:
            f = r.prefill_depth_frontiers
            assert all(a >= b for a, b in zip(f, f[1:])), f
            if r.request_id in self.frontiers:
                assert all(a >= b for a, b in zip(f, self.frontiers[r.request_id]))
        return deltas

    def on_read(self, plan) -> None:
        """``update`` reads a result of ``plan`` (the timed harness waits for it there)."""

    def check_launch(self, plan, ahead: bool):
        T = self.cfg.num_loops
        if plan.speculative:
            assert not ahead, "a round is never scheduled ahead"
            self.check_round(plan)
            return
        if plan.sub_plans is None:
            if ahead:  # only a latency target's token cycle launches a one-loop plan ahead: its prompts
                assert self.s.latency is not None and self.s.latency.cycle_plan is self.s._inflight
                assert plan.ranges and not plan.ranges_of(Phase.DECODE)
            self.check_plan(plan)
            return
        # a fused decode step: sub-step i is loop i % T of the rows' token i // T, counted from
        # the token in flight (a step scheduled ahead: after the tokens of the step in flight)
        assert plan.kind == "fused_decode" and len(plan.sub_plans) % T == 0
        assert plan.descriptor.n == len(plan.sub_plans)
        done = len(self.s._inflight.sub_plans) // T if ahead else 0
        stacked = plan.descriptor
        for i, sub in enumerate(plan.sub_plans):
            assert sub.descriptor is stacked.steps[i] and sub.descriptor.key == stacked.key
            assert sub.descriptor.feed_previous_tokens == (i % T == 0 and (i > 0 or ahead))
            # every row makes every token of the step (exit limit 0 only for padding rows)
            makes = stacked.exit_limit[i // T][: plan.num_rows] > 0
            assert makes.all()
            assert (sub.descriptor.row_slot[: plan.num_rows][~makes] == -1).all()
            assert sorted(r.row_start for r in sub.ranges) == list(np.flatnonzero(makes))
            self.check_plan(sub, decode_at=(done + i // T, i % T), rows_making=int(makes.sum()))
        self.fused += 1
        self.ahead += ahead

    def check_plan(self, plan, decode_at=(0, None), rows_making=None):
        """``decode_at``: (tokens ahead of the one in flight, depth) of a fused sub-step's rows;
        ``rows_making``: how many of them make its token (the others are not in its plan)."""
        s, cfg, T = self.s, self.cfg, self.cfg.num_loops
        d = plan.descriptor
        assert plan.num_rows <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        self.max_rows = max(self.max_rows, plan.num_rows)
        self.max_running = max(self.max_running, len(s.running))
        assert d.num_rows == plan.num_rows
        assert len(plan.coda) == (d.num_coda if rows_making is None or not d.num_coda else rows_making)
        assert plan.needs_tokens == bool(plan.coda)
        # the K/V scatters assume unique indices (docs/contracts.md): no slot is written twice
        slots = d.row_slot[d.row_slot >= 0]
        assert len(np.unique(slots)) == len(slots), "two rows write one K/V slot"
        dst = d.fin_dst[d.fin_dst >= 0]
        assert len(np.unique(dst)) == len(dst), "two finalize copies write one slot"
        seen = set()
        prelude = {(r.request_id, r.token_start, r.token_count) for r in plan.ranges_of(Phase.PRELUDE)}
        # prelude first (step 2), then the loop (step 3)
        for r in plan.ranges:
            if r.phase is Phase.PRELUDE:
                for i in range(r.token_count):
                    self.ring_tag[r.ring_row_offset + i] = ("embed", r.request_id, r.token_start + i)
            elif r.phase is Phase.DECODE and r.depth == 0:
                self.ring_tag[r.ring_row_offset] = ("embed", r.request_id, r.token_start)
        new_tags, run_end = {}, {}
        for r in plan.ranges:
            if r.phase is Phase.PRELUDE:
                continue
            req = s.get_request(r.request_id)
            assert req is not None and req.status is RequestStatus.RUNNING
            # one range per request and depth, except runs of a rebuilt request split by depth caps
            # and a round's verify split around the positions that exited
            split = req.recompute_caps is not None or req.loop_round is not None
            key = (r.request_id, r.depth, r.phase) + ((r.token_start,) if split else ())
            assert key not in seen, "two ranges of one request at one depth"
            seen.add(key)
            rows = slice(r.row_start, r.row_start + r.token_count)
            pos = np.arange(r.token_start, r.token_end)
            assert (d.row_pos[rows] == pos).all()
            assert (d.row_ring[rows] == r.ring_row_offset + np.arange(r.token_count)).all()
            plane = r.depth if cfg.kv_layout == "last_exited" else 0
            table = s.block_manager.block_table(r.request_id)[plane]
            bs = cfg.block_size
            assert (d.row_slot[rows] == table[pos // bs] * bs + pos % bs).all()
            if r.phase is Phase.RECURRENT:
                f = req.prefill_depth_frontiers
                # depth-d work starts exactly at the depth-d KV prefix: every earlier position
                # has its depth-d KV, none of these positions has it yet (positions in between, if
                # any, are rebuilt generated tokens capped below d: finalize copies, not loops)
                f_d = run_end.get((r.request_id, r.depth), f[r.depth])  # after this plan's earlier runs
                assert r.token_start >= f_d
                assert all(req.depth_cap(p) < r.depth for p in range(f_d, r.token_start))
                run_end[(r.request_id, r.depth)] = r.token_end
                assert all(req.depth_cap(p) >= r.depth for p in range(r.token_start, r.token_end))
                # its inputs exist: depth d-1 finished in an EARLIER invocation (or, at depth 0,
                # the prelude of the same tokens runs first in this one)
                if r.depth == 0:
                    assert (r.request_id, r.token_start, r.token_count) in prelude
                else:
                    assert r.token_end <= f[r.depth - 1]
                assert r.token_end <= req.chunk_start(r.token_start) + req.prefill_chunk_size
                assert req.chunk_start(r.token_start) == r.chunk_start
                # the ring holds at most ring_slots chunks from the oldest unfinished one
                assert r.token_end <= req.prefill_reclaimable_tokens + cfg.ring_slots * req.prefill_chunk_size
                if cfg.kv_layout == "shared":
                    assert r.token_count == 1 and r.token_start == req.num_prefilled_tokens
                for p in range(r.token_start, r.token_end):
                    self.prompt_runs[(r.request_id, p, r.depth)] += 1
            elif req.loop_round is not None:  # a round on the loop-by-loop path
                rnd = req.loop_round
                if rnd.drafting:  # position p + j, in ring row base + j
                    assert r.token_count == 1 and r.token_start == rnd.p0 + rnd.j and r.depth == req.decode_depth
                    assert r.depth < rnd.draft_loops
                else:  # the verify: positions still running, at the verify's loop
                    assert r.depth == rnd.verify_depth
                    assert all(p - rnd.p0 in rnd.active() for p in range(r.token_start, r.token_end))
                assert r.ring_row_offset == req.ring_base + r.token_start - rnd.p0
            else:
                assert r.token_count == 1 and r.token_start == req.position_in_flight + decode_at[0]
                assert r.depth == (req.decode_depth if decode_at[1] is None else decode_at[1])
            for i, p in enumerate(range(r.token_start, r.token_end)):
                want = ("embed", r.request_id, p) if r.depth == 0 else (r.request_id, p, r.depth - 1)
                assert self.ring_tag.get(r.ring_row_offset + i) == want, (
                    f"ring row {r.ring_row_offset + i} holds {self.ring_tag.get(r.ring_row_offset + i)}, "
                    f"expected {want}"
                )
                new_tags[r.ring_row_offset + i] = (r.request_id, p, r.depth)
        self.ring_tag.update(new_tags)
        if cfg.prefill_mode == "split":
            kinds = {r.phase for r in plan.ranges}
            assert not (Phase.DECODE in kinds and Phase.RECURRENT in kinds), "split mixes prefill and decode"
            if Phase.RECURRENT in kinds:
                assert plan.loop_count == T
        if cfg.prefill_mode in ("split", "mixed"):
            for rid in {r.request_id for r in plan.ranges_of(Phase.RECURRENT)}:
                req = s.get_request(rid)
                chunks = {r.chunk_start for r in plan.ranges_of(Phase.RECURRENT) if r.request_id == rid}
                assert len(chunks) == 1, "mixed/split: one chunk of a request in flight"

    def check_round(self, plan):
        """A round (``SpecDescriptor``): request ``i``'s position ``p + j`` in ring row ``base + j``,
        at its plane's slot in every draft sub-step and verify descriptor, every row at depth 0."""
        s, cfg = self.s, self.cfg
        desc = plan.descriptor
        k = desc.key
        d, k1, T, bs = k.draft_loops, k.positions, k.num_loops, cfg.block_size
        assert len(desc.draft.steps) == d * k1 and len(desc.verify) == T - d
        for r in plan.ranges:
            req = s.get_request(r.request_id)
            assert req is not None and req.status is RequestStatus.RUNNING and req.decode_depth == 0
            assert (
                r.token_start == req.position_in_flight and r.token_count == k1 and r.ring_row_offset == req.ring_base
            )
            table = s.block_manager.block_table(r.request_id)
            i = r.row_start
            for j in range(k1):
                p = r.token_start + j
                for t in range(T):
                    sub = desc.draft.steps[j * d + t] if t < d else desc.verify[t - d]
                    row = i if t < d else i * k1 + j
                    assert sub.row_slot[row] == table[t][p // bs] * bs + p % bs
                    assert sub.row_ring[row] == r.ring_row_offset + j
                    assert sub.row_pos[row] == p
        for sub in [*desc.draft.steps, *desc.verify]:
            slots = sub.row_slot[sub.row_slot >= 0]
            assert len(np.unique(slots)) == len(slots), "two rows write one K/V slot"
        # ring rows other than the embeds are overwritten: a later decode token re-embeds at depth 0
        for r in plan.ranges:
            for j in range(k1):
                self.ring_tag[r.ring_row_offset + j] = ("round", r.request_id, r.token_start + j)
        self.rounds += 1

    def check_drained(self):
        s, cfg = self.s, self.cfg
        assert not s.has_unfinished() and not s.running and len(s.waiting) == 0
        assert not self.pipeline.pending and s._inflight is None and s._ahead is None, "a plan left in flight"
        assert s.block_manager.num_free_blocks == cfg.num_blocks - 1, "KV blocks leaked"
        assert s.block_manager.num_used_blocks == 0
        assert (s.block_manager.ref_counts()[1:] == 0).all(), "reference counts not back to zero"
        assert not s.block_manager._slot_of, "block tables leaked"
        assert sorted(s.block_manager._free_slots) == list(range(cfg.max_num_seqs)), "ring regions leaked"
        assert (s.block_manager.tables == 0).all()


# ----------------------------------------------------------------------------- workloads
@st.composite
def workloads(draw):
    T = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(["last_exited", "last_exited", "last_exited", "shared"]))
    modes = ["split", "mixed", "wavefront"] if layout == "last_exited" else ["split", "mixed"]
    mode = draw(st.sampled_from(modes))
    max_seqs = draw(st.integers(1, 4))
    budget = max_seqs + draw(st.integers(0, 24))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    chunk = draw(st.integers(1, 8))
    nreq = draw(st.integers(1, 5))
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    eos = draw(st.sampled_from([None, None, 7]))
    # a common prefix some prompts start with (prefix-cache hits), or whole repeated prompts
    common = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=20))
    reqs = []
    for i in range(nreq):
        n = draw(st.integers(1, 24))
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
        share = draw(st.sampled_from(["none", "prefix", "repeat"]))
        if share == "prefix":
            prompt = (common + prompt)[:32]
        elif share == "repeat" and reqs:
            prompt = list(reqs[draw(st.integers(0, len(reqs) - 1))]["prompt"])
        exit_mode = draw(st.sampled_from(["ouro", "delayed", "fixed", "synthetic"]))
        max_loops = draw(st.one_of(st.none(), st.integers(1, T)))
        hi = T if max_loops is None else max_loops
        min_loops = 1 if exit_mode == "fixed" else draw(st.integers(1, hi))  # fixed reads no min_loops
        kw = {}
        if exit_mode == "synthetic":
            if draw(st.booleans()):
                kw["synthetic_mean_loops"] = draw(st.floats(min_loops, hi))
            else:
                kw["synthetic_depths"] = draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=5))
        sp = SamplingParams(
            max_tokens=draw(st.integers(1, 12)),
            temperature=draw(st.sampled_from([0.0, 0.0, 0.8])),
            seed=draw(st.integers(0, 2**32 - 1)),
            stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))),
            ignore_eos=draw(st.booleans()),
            min_loops=min_loops,
            max_loops=max_loops,
            # the gate rule's threshold: the other modes refuse one
            exit_threshold=draw(st.sampled_from([1.0, 0.3, 0.6, 0.9])) if exit_mode in ("ouro", "delayed") else 1.0,
            exit_mode=exit_mode,
            **kw,
        )
        arrival = draw(st.integers(0, 12))
        abort_at = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 40)))
        reqs.append(
            dict(
                rid=f"r{i}",
                prompt=prompt,
                sp=sp,
                arrival=arrival,
                abort_at=abort_at,
                priority=draw(st.integers(0, 2)) if policy == "priority" else 0,  # fcfs refuses priorities
            )
        )
    planes = T if layout == "last_exited" else 1
    need = max(-(-(len(r["prompt"]) + r["sp"].max_tokens - 1) // block_size) * planes for r in reqs)
    # a tight pool (one request's worth and a few blocks) forces on-demand allocation to preempt
    tight = draw(st.booleans())
    num_blocks = 1 + need + draw(st.integers(0, planes if tight else 3 * need))
    max_len = max(len(r["prompt"]) + r["sp"].max_tokens for r in reqs) + draw(st.integers(0, 5))
    buckets = draw(st.sampled_from([None, "fine"]))
    cfg = SchedulerConfig(
        num_loops=T,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        prefill_chunk_size=chunk,
        max_model_len=max_len,
        kv_layout=layout,
        prefill_mode=mode,
        policy=policy,
        eos_token_ids=() if eos is None else (eos,),
        buckets=None if buckets is None else tuple(range(1, budget + 1)),
        fused_decode_max_rows=draw(st.sampled_from([0, 0, max_seqs])),
        fused_decode_tokens=draw(st.integers(1, 3)),
        kv_allocation=draw(st.sampled_from(["on_demand", "on_demand", "reserve"])),
        enable_prefix_caching=layout == "last_exited" and draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.01, 0.1])),
    )
    return cfg, reqs


def run_workload(cfg, reqs, lazy=False, harness=None, ahead=False, vocab=VOCAB):
    """Drive ``reqs`` (arrivals, aborts) through ``harness`` (default: a plain ``Harness``) to the end."""
    h = harness or Harness(cfg, lazy=lazy, ahead=ahead, vocab=vocab)
    objs = {}
    pending = sorted(reqs, key=lambda r: r["arrival"])
    step = 0
    aborted = set()
    while pending or h.s.has_unfinished():
        while pending and pending[0]["arrival"] <= step:
            r = pending.pop(0)
            req = Request(r["rid"], r["prompt"], r["sp"], arrival_time=float(step), priority=r["priority"])
            objs[r["rid"]] = (req, r)
            h.s.add_request(req)
        for rid, (req, r) in objs.items():
            if r["abort_at"] == step and not req.is_finished:
                delta = h.s.abort(rid)
                assert delta.finished and delta.finish_reason == "abort"
                aborted.add(rid)
                if not h.s.has_unfinished():
                    assert h.pipeline.drain() == []  # as LLM.abort: a step ahead of only ended rows

        out = h.step()
        if out is None:
            assert not h.s.has_unfinished() or pending, "scheduler stalled with unfinished requests"
        step += 1
        assert step < 5000
    h.check_drained()
    return h, objs, aborted


def check_against_reference(cfg, objs, aborted, vocab=VOCAB):
    rids = [rid for rid in objs if rid not in aborted]
    ref = reference_generate(
        [objs[r][1]["prompt"] for r in rids],
        [objs[r][1]["sp"] for r in rids],
        cfg.num_loops,
        request_ids=rids,
        kv_layout=cfg.kv_layout,
        eos_token_ids=cfg.eos_token_ids,
        vocab_size=vocab,
    )
    for rid, want in zip(rids, ref):
        req = objs[rid][0]
        assert req.output_token_ids == want["tokens"], rid
        assert req.exit_depths == want["exit_depths"], rid
        assert req.finish_reason == want["finish_reason"], rid
        assert len(req.token_times) == len(req.output_token_ids)
    for rid in aborted:
        assert objs[rid][0].finish_reason == "abort"
