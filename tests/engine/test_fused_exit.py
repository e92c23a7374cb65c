"""Fused decode steps with exits decided on the device.

A fused step runs every row's loops in lock step and decides each row's exit after each loop on the
device (``exit_rule.decide_exit_rows``; its numpy twin drives the fake runner). Whatever the exit
rule (ouro with per-row thresholds, delayed, synthetic, fixed, min_loops / max_loops), the KV layout,
the tokens per step and stop tokens that end a row mid-step, the token ids, exit depths and finish
reasons must be those of the loop-by-loop path: against the fake model's dense reference and the
loop-by-loop scheduler (numpy), and against the loop-by-loop engine (the JAX runner, tiny model).
The rule's twins are checked against the host rule first.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from benchmarks.metrics import ScheduleRecorder
from ouro_jax import SamplingParams, exit_rule, get_preset
from scheduler import Phase, Request, Scheduler, SchedulerConfig
from scheduler.exit_policy import (
    decide_exit_rows,
    device_exit_params,
    fold_gate_rows,
    reference_exit_loops,
    synthetic_exit_loops,
)
from scheduler.fake_runner import FakeRunner, reference_generate
from tests.model.conftest import gates_near_threshold  # noqa: E402
from tests.scheduler.conftest import VOCAB, Harness, check_against_reference, run_workload  # noqa: E402

T = 4


# ------------------------------------------------------------------------------ the rule's twins
@st.composite
def rule_cases(draw):
    t = draw(st.integers(1, 6))
    max_loops = draw(st.integers(1, t))
    min_loops = draw(st.integers(1, max_loops))
    gate = st.one_of(st.sampled_from([-4.0, -1.0, 0.0, 1.0, 4.0]), st.floats(-8.0, 8.0, width=32))
    gates = draw(st.lists(gate, min_size=t, max_size=t))
    threshold = draw(st.one_of(st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0]), st.floats(0.0, 1.0, width=32)))
    mode = draw(st.sampled_from(["ouro", "delayed", "fixed", "synthetic"]))
    target = draw(st.integers(min_loops, max_loops))
    return t, gates, threshold, min_loops, max_loops, mode, target


def _rows_loops(t, gates, limit, min_loops, delay, thr, jnp_rule: bool) -> int:
    """Loops run under the per-row rule, one loop at a time as the fused step folds and decides."""
    rem = np.ones(1, np.float32)
    for d in range(t):
        nxt = fold_gate_rows(rem, np.float32([gates[d]]))
        args = (d + 1, nxt, rem, np.int32([limit]), np.int32([min_loops]), np.int32([delay]), np.float32([thr]))
        out = exit_rule.decide_exit_rows(*map(jnp.asarray, args)) if jnp_rule else decide_exit_rows(*args)
        if bool(np.asarray(out)[0]):
            return d + 1
        rem = nxt
    raise AssertionError("the rule never exited: limit <= T must force it")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rule_cases())
def test_row_rule_twins_equal_host_rule(case):
    t, gates, threshold, min_loops, max_loops, mode, target = case
    kw = dict(synthetic_depths=(target - 1,)) if mode == "synthetic" else dict(exit_threshold=threshold)
    if mode == "fixed":  # fixed reads neither a threshold nor min_loops (validate refuses them)
        kw, min_loops = {}, 1
    params = SamplingParams(min_loops=min_loops, max_loops=max_loops, exit_mode=mode, **kw)
    params.validate(t)
    if mode != "synthetic":
        assume(not gates_near_threshold(gates, threshold, min_loops, max_loops, mode))
    tgt = synthetic_exit_loops(params, t, 0, 1) if mode == "synthetic" else None
    want = reference_exit_loops(params, t, gates, tgt)
    words = device_exit_params(params, t, tgt)
    assert _rows_loops(t, gates, *words, jnp_rule=False) == want
    assert _rows_loops(t, gates, *words, jnp_rule=True) == want


def test_device_exit_params_keep_a_threshold_just_below_one_on():
    p = SamplingParams(exit_threshold=1.0 - 1e-9)
    limit, _, _, thr = device_exit_params(p, 4)
    assert limit == 4 and thr < 1.0 and np.float32(thr) < 1.0
    assert device_exit_params(SamplingParams(exit_mode="fixed", exit_threshold=0.5), 4)[3] == 1.0
    assert device_exit_params(SamplingParams(exit_mode="delayed", exit_threshold=0.5, max_loops=3), 4)[:3] == (3, 1, 1)


# --------------------------------------------------------------------- scheduler + fake runner
class Recorder(Harness):
    """A harness that keeps each fused step's deltas (stop tokens mid-step)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.fused_deltas = []

    def step(self):
        out = super().step()
        if out is not None and self.plans[-1].sub_plans is not None:
            self.fused_deltas.append((self.plans[-1], out))
        return out


MIXED = [
    dict(exit_mode="ouro", exit_threshold=0.3),
    dict(exit_mode="ouro", exit_threshold=0.5, temperature=0.8),
    dict(exit_mode="ouro", exit_threshold=0.9),
    dict(exit_mode="delayed", exit_threshold=0.5),
    dict(exit_mode="synthetic", synthetic_mean_loops=2.5),
    dict(exit_mode="fixed"),
    dict(exit_mode="ouro", exit_threshold=0.5, min_loops=2, max_loops=3),
]


def _mixed_requests(max_tokens=9, stops=None):
    rng = np.random.default_rng(11)
    stops = stops or {}
    return [
        dict(
            rid=i,
            prompt=rng.integers(0, VOCAB, size=int(rng.integers(2, 12))).tolist(),
            sp=SamplingParams(max_tokens=max_tokens, seed=i, stop_token_ids=stops.get(i, ()), **kw),
            arrival=0,
            abort_at=None,
            priority=0,
        )
        for i, kw in enumerate(MIXED)
    ]


def _cfg(layout="last_exited", tokens=1, rows=7, mode="split", chunk=16, **kw):
    return SchedulerConfig(
        num_loops=T,
        num_blocks=600,
        block_size=4,
        max_num_seqs=len(MIXED),
        max_num_batched_tokens=128,
        prefill_chunk_size=chunk,
        max_model_len=64,
        kv_layout=layout,
        prefill_mode=mode,
        fused_decode_max_rows=rows,
        fused_decode_tokens=tokens,
        **kw,
    )


def _outputs(objs):
    return {rid: (req.output_token_ids, req.exit_depths, req.finish_reason) for rid, (req, _) in objs.items()}


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_fused_exit_equals_loop_by_loop_and_reference(layout, tokens):
    """Every exit rule in one batch, stop tokens that end rows mid-step: identical to the dense
    reference and to the loop-by-loop scheduler, and the early exits really ran fused."""
    ref = reference_generate(
        [r["prompt"] for r in _mixed_requests()], [r["sp"] for r in _mixed_requests()], T, kv_layout=layout
    )
    # a stop token met mid-run by two rows (the first occurrence of their 5th token)
    stops = {i: (ref[i]["tokens"][5],) for i in (0, 4)}
    reqs = _mixed_requests(stops=stops)
    h = Recorder(_cfg(layout, tokens))
    h, objs, aborted = run_workload(h.cfg, reqs, harness=h)
    check_against_reference(h.cfg, objs, aborted)
    _, plain, _ = run_workload(_cfg(layout, tokens, rows=0), _mixed_requests(stops=stops))
    assert _outputs(objs) == _outputs(plain)
    assert {objs[i][0].finish_reason for i in stops} == {"stop"}

    st_ = h.s.stats()
    fused = [p for p in h.plans if p.sub_plans]
    assert fused and st_["fused_launches"] == len(fused)
    fused_ids = {r.request_id for p in fused for r in p.ranges}
    # early-exit rows ran fused (SHARED prefills position by position, so not every row overlaps)
    assert len(fused_ids) >= 4 and fused_ids & {0, 1, 2, 6} and fused_ids & {3, 4}
    if layout == "last_exited":
        assert fused_ids == set(range(len(MIXED)))
    runs = [x for p in fused for x in p.descriptor.loops_run]
    assert st_["fused_loops"] == sum(runs) and st_["fused_tokens"] == len(runs)
    assert st_["invocations"] == st_["launches"] - len(fused) + st_["fused_loops"]
    fused_depths = {
        d for p, deltas in h.fused_deltas for dl in deltas if dl.request_id != 5 for d in dl.new_exit_depths
    }
    assert len(fused_depths) > 1, "early-exit rows all exited at one depth inside fused steps"
    if tokens > 1:  # a row ended by a stop token before the step's last token
        assert any(
            dl.finish_reason == "stop" and len(dl.new_token_ids) < p.descriptor.num_tokens
            for p, deltas in h.fused_deltas
            for dl in deltas
        )


def test_rows_at_different_depths_are_aligned_for_fusion():
    """Staggered arrivals leave rows mid-token at different depths; the scheduler holds the rows
    at depth 0 until the others finish their tokens, then every step fuses."""
    reqs = _mixed_requests(max_tokens=12)
    for i, r in enumerate(reqs):
        r["arrival"] = 2 * i
    cfg = _cfg("last_exited", 2, mode="mixed", chunk=4)
    h, objs, aborted = run_workload(cfg, reqs)
    check_against_reference(cfg, objs, aborted)
    st_ = h.s.stats()
    assert st_["fusion_align_invocations"] > 0 and st_["fused_launches"] > 0
    last_prompt = max(i for i, p in enumerate(h.plans) if p.ranges_of(Phase.RECURRENT))
    after = h.plans[last_prompt + 1 :]
    # once the prompts are done, at most T - 1 aligning loops, then fused until a row runs out of tokens
    first_fused = next(i for i, p in enumerate(after) if p.sub_plans)
    assert first_fused <= T - 1


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_one_row_runs_only_its_loops(layout):
    """At one stream the device runs exactly the loops the row needs: ``fused_loops`` is the sum
    of its exit depths + 1, and the loop-by-loop counters (invocations, rows) agree with that."""
    reqs = [
        dict(r, sp=SamplingParams(max_tokens=13, exit_mode="ouro", exit_threshold=0.5)) for r in _mixed_requests()[:1]
    ]
    cfg = _cfg(layout, 3)
    h, objs, aborted = run_workload(cfg, reqs)
    check_against_reference(cfg, objs, aborted)
    req = objs[0][0]
    fused = [p for p in h.plans if p.sub_plans]
    n = sum(len(p.descriptor.loops_run) for p in fused)
    st_ = h.s.stats()
    assert n == len(req.exit_depths) - 1, "every decode token ran fused"
    assert st_["fused_loops"] == sum(d + 1 for d in req.exit_depths[1:]) < T * n
    assert st_["decode_rows"] == st_["fused_loops"]
    # the benchmarks' floor prices the loops that ran, not all T of every fused token
    rec = ScheduleRecorder(get_preset("tiny"))
    for p in h.plans:
        rec.observe(p.descriptor)
    assert len(rec) == rec.total().invocations == st_["invocations"]


def test_bad_fused_results_are_refused_before_anything_changes():
    s = Scheduler(_cfg(tokens=2))
    s.add_request(Request(0, [1, 2, 3], SamplingParams(max_tokens=5, exit_threshold=0.5)))
    runner = FakeRunner(s.config.num_blocks, s.config.block_size, s.config.num_ring_rows, VOCAB)
    plan = s.schedule()
    while plan.sub_plans is None:
        s.update(plan, *(lambda r: (r.gates, r.tokens))(runner.step(plan.descriptor)))
        plan = s.schedule()
    key, req = plan.descriptor.key, s.get_request(0)
    before = list(req.output_token_ids)
    with pytest.raises(ValueError, match="fused step returns"):
        s.update(plan, np.zeros((2, key.R), np.float32), np.zeros((1, key.C + key.R), np.int32))
    bad = np.zeros((2, key.C + key.R), np.int32)
    bad[1, key.C] = T
    with pytest.raises(ValueError, match="exit depths outside"):
        s.update(plan, np.zeros((8, key.R), np.float32), bad)
    assert req.output_token_ids == before
    good = runner.step(plan.descriptor)
    s.update(plan, good.gates, good.tokens)
    assert len(req.output_token_ids) == len(before) + 2


@st.composite
def exit_batches(draw):
    n = draw(st.integers(1, 5))
    sps = []
    for i in range(n):
        mode = draw(st.sampled_from(["ouro", "delayed", "fixed", "synthetic"]))
        max_loops = draw(st.one_of(st.none(), st.integers(1, T)))
        hi = T if max_loops is None else max_loops
        min_loops = 1 if mode == "fixed" else draw(st.integers(1, hi))  # fixed reads no min_loops
        kw = dict(synthetic_mean_loops=draw(st.floats(min_loops, hi))) if mode == "synthetic" else {}
        if mode in ("ouro", "delayed"):  # the others refuse a threshold
            kw["exit_threshold"] = draw(st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]))
        sps.append(
            SamplingParams(
                max_tokens=draw(st.integers(1, 8)),
                temperature=draw(st.sampled_from([0.0, 0.8])),
                seed=i,
                stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))),
                min_loops=min_loops,
                max_loops=max_loops,
                exit_mode=mode,
                **kw,
            )
        )
    prompts = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10)) for _ in range(n)]
    arrivals = [draw(st.integers(0, 6)) for _ in range(n)]
    layout = draw(st.sampled_from(["last_exited", "shared"]))
    tokens = draw(st.integers(1, 3))
    return sps, prompts, arrivals, layout, tokens


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exit_batches())
def test_random_exit_batches_match_reference(case):
    sps, prompts, arrivals, layout, tokens = case
    reqs = [
        dict(rid=i, prompt=p, sp=sp, arrival=a, abort_at=None, priority=0)
        for i, (sp, p, a) in enumerate(zip(sps, prompts, arrivals))
    ]
    cfg = SchedulerConfig(
        num_loops=T,
        num_blocks=400,
        block_size=4,
        max_num_seqs=5,
        max_num_batched_tokens=16,
        prefill_chunk_size=4,
        max_model_len=32,
        kv_layout=layout,
        fused_decode_max_rows=5,
        fused_decode_tokens=tokens,
    )
    h, objs, aborted = run_workload(cfg, reqs)
    check_against_reference(cfg, objs, aborted)


# ------------------------------------------------------------------------------ the JAX engine
# the engines of test_fused_decode (same shapes: the session's compilation cache serves both)
from tests.engine.conftest import fused_engine as _engine  # noqa: E402
from tests.engine.conftest import tiny_fused_parts  # noqa: E402

CFG = tiny_fused_parts()[0]

PROMPTS = [list(map(int, np.random.default_rng(2).integers(1, CFG.vocab_size, n))) for n in (3, 9, 17, 5, 12, 2, 7)]


def _run(llm, sp):
    """``(tokens, exit depths, finish reason)`` per prompt, under request ids 0.. (synthetic draws
    depend on the id, so every run must use the same ones)."""
    for i, (p, s) in enumerate(zip(PROMPTS, sp)):
        llm.add_request(p, s, request_id=i)
    final = {}
    while len(final) < len(sp):
        final.update((o.request_id, o) for o in llm.step() if o.finished)
    return [(final[i].token_ids, final[i].exit_depths, final[i].finish_reason) for i in range(len(sp))]


def _engine_params(stops=None):
    stops = stops or {}
    return [
        SamplingParams(max_tokens=8, ignore_eos=True, seed=i, stop_token_ids=stops.get(i, ()), **kw)
        for i, kw in enumerate(MIXED)
    ]


@pytest.mark.parametrize(
    "layout,tokens",
    [
        ("last_exited", 1),  # test_fused_decode's shapes: compiled once per session
        pytest.param("last_exited", 2, marks=pytest.mark.slow),
        pytest.param("shared", 3, marks=pytest.mark.slow),
    ],
)
def test_engine_fused_exit_equals_loop_by_loop(layout, tokens):
    """The JAX runner's on-device exits: tokens, exit depths and finish reasons of the loop-by-loop
    engine, with stop tokens met mid-step; fused steps ran and stopped early; nothing compiled
    after start-up."""
    plain = _engine(kv_layout=layout, fused_decode_max_rows=0)
    first = _run(plain, _engine_params())
    stops = {i: (first[i][0][4],) for i in (0, 3)}
    sp = _engine_params(stops)
    want = _run(plain, sp)
    llm = _engine(kv_layout=layout, fused_decode_max_rows=4, fused_decode_tokens=tokens)
    got = _run(llm, sp)
    assert got == want
    assert {want[i][2] for i in stops} == {"stop"}
    assert len({d for i in (0, 1, 2, 3, 6) for d in want[i][1][1:]}) > 1, "the gates give one depth: a weak test"
    st_ = llm.stats()
    assert st_["fused_launches"] > 0
    # one stream: the device runs only the loops its tokens need (the batch above holds a fixed row)
    one = [SamplingParams(max_tokens=8, ignore_eos=True, exit_threshold=0.5)]
    want1 = _run(plain, one)
    assert _run(llm, one) == want1
    st1 = llm.stats()
    assert st1["fused_loops"] - st_["fused_loops"] == sum(d + 1 for d in want1[0][1][1:]) < T * 7
    assert st1["compilations"] == len(llm.executable_keys())  # all at start-up, nothing since
    assert st1["free_blocks"] == llm.scheduler_config.num_blocks - 1


@pytest.mark.parametrize("n,gated", [(40, False), (40, True), (32, True)])
def test_large_fused_steps_only_without_gated_rows(n, gated):
    """Beyond ``FUSED_GATED_MAX_ROWS`` rows a batch fuses only when no row's exit depends on its
    gates (lock step to the deepest exit costs more than it saves there): no fused step of more
    than 32 rows holds the gated row (request 3); a batch of 40 fixed-depth rows or of 32 rows
    with the gated one fuses whole. Outputs are the reference's either way."""
    from scheduler.scheduler import FUSED_GATED_MAX_ROWS

    assert FUSED_GATED_MAX_ROWS == 32
    rng = np.random.default_rng(5)
    reqs = [
        dict(
            rid=i,
            prompt=rng.integers(0, VOCAB, size=int(rng.integers(2, 9))).tolist(),
            sp=SamplingParams(max_tokens=6, seed=i, **(dict(exit_threshold=0.5) if gated and i == 3 else {})),
            arrival=0,
            abort_at=None,
            priority=0,
        )
        for i in range(n)
    ]
    cfg = SchedulerConfig(
        num_loops=T,
        num_blocks=1600,
        block_size=4,
        max_num_seqs=n,
        max_num_batched_tokens=256,
        prefill_chunk_size=16,
        max_model_len=32,
        fused_decode_max_rows=n,
    )
    h, objs, aborted = run_workload(cfg, reqs)
    check_against_reference(cfg, objs, aborted)
    fused = [{r.request_id for r in p.sub_plans[0].ranges} for p in h.plans if p.sub_plans]
    assert not gated or all(3 not in ids for ids in fused if len(ids) > FUSED_GATED_MAX_ROWS)
    if n == 40 and gated:  # fused only after the gated row finished (its early exits run fewer loops)
        assert fused and all(3 not in ids for ids in fused)
    else:
        assert any(len(ids) == n for ids in fused)
