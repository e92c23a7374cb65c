"""The jax-free parts of self-speculative decoding (``scheduler/speculation.py``): ``RoundPolicy``
(rounds run while drafts are accepted enough to pay for them, stop when they are not, and probe
again after a doubling back-off), ``LoopRound`` (a round on the loop-by-loop path) and the
buckets' coda rows for its verify."""

import types

import pytest

from scheduler.speculation import MAX_BACKOFF, MIN_BACKOFF, ROUND_COST_FACTOR, RoundPolicy, SpeculativeConfig


def request(done: int = 0):
    return types.SimpleNamespace(spec_gain=None, output_token_ids=[0] * done)


def emit(req, n: int) -> None:
    req.output_token_ids += [0] * n


@pytest.fixture
def policy():
    return RoundPolicy(SpeculativeConfig(draft_loops=1, num_speculative_tokens=3), num_loops=4)


def test_break_even_is_the_rounds_loops_against_plain_tokens(policy):
    assert policy.break_even == pytest.approx(ROUND_COST_FACTOR * (1 * 4 + 3) / 4)
    deep = RoundPolicy(SpeculativeConfig(draft_loops=2, num_speculative_tokens=5), num_loops=4)
    assert deep.break_even == pytest.approx(ROUND_COST_FACTOR * (2 * 6 + 2) / 4)


def test_new_requests_and_accepted_drafts_keep_rounds_going(policy):
    rows = [request(1), request(1)]
    assert policy.pays(rows)
    for _ in range(20):
        for r in rows:
            emit(r, 4)
            policy.observe(r, 4)
        assert policy.pays(rows)
    assert all(r.spec_gain.tokens_per_round == 4 for r in rows)
    # drafts accepted at 80% a position: rounds of 1, 2, 3, 4 tokens; a run of single tokens
    # does not stop them (the last WINDOW rounds beside the prior decide, not the latest one)
    req = request(1)
    for n in [4, 1, 1, 4, 2, 1, 4, 4, 1, 3, 1, 4]:
        assert policy.pays([req])
        emit(req, n)
        policy.observe(req, n)


def run_rejected(policy, req, steps: int) -> list:
    """Decode ``steps`` tokens of a request whose drafts are never accepted: a round when the policy
    says so (1 token), a plain token otherwise; the output lengths at which rounds ran."""
    rounds = []
    while len(req.output_token_ids) < steps:
        if policy.pays([req]):
            rounds.append(len(req.output_token_ids))
            emit(req, 1)
            policy.observe(req, 1)
        else:
            emit(req, 1)
    return rounds


def test_rejected_drafts_stop_rounds_and_probes_back_off(policy):
    req = request(1)
    rounds = run_rejected(policy, req, 600)
    # three rounds of one token bring the estimate to (2 * 4 + 3) / 5, below break-even; then a
    # probe (one round, judged afresh) after back-offs of 16, 32, 64, ... plain tokens
    assert rounds[:3] == [1, 2, 3]
    gaps = [b - a - 1 for a, b in zip(rounds[2:], rounds[3:])]
    assert gaps == [MIN_BACKOFF * 2**i for i in range(len(gaps))]
    assert len(rounds) == 3 + len(gaps) and len(rounds) <= 9
    assert req.spec_gain.backoff == min(MIN_BACKOFF * 2 ** (len(gaps) + 1), MAX_BACKOFF)


def test_a_probe_that_succeeds_resumes_rounds(policy):
    req = request(1)
    run_rejected(policy, req, 40)
    while not policy.pays([req]):
        emit(req, 1)
    emit(req, 4)
    policy.observe(req, 4)  # the probe: every draft accepted
    assert policy.pays([req]) and req.spec_gain.backoff == MIN_BACKOFF


def test_the_batch_mean_decides(policy):
    good, bad = request(1), request(1)
    run_rejected(policy, bad, 40)  # its last probe failed: one round of one token beside break-even
    assert not policy.pays([bad])
    emit(good, 4)
    policy.observe(good, 4)
    assert policy.pays([good, bad])  # one row's accepted drafts pay for the other's round
    assert not policy.pays([bad] * 5 + [request(1)])  # (5 * 1.85 + 4) / 6 < break-even


def test_a_step_in_flight_counts_toward_the_probe(policy):
    req = request(1)
    run_rejected(policy, req, 5)
    due = req.spec_gain.probe_at - len(req.output_token_ids)
    assert not policy.pays([req], due - 1) and policy.pays([req], due)


# ------------------------------------------------------------------ LoopRound (rounds loop by loop)
def test_loop_round_verifies_runs_of_cut_positions_and_keeps_the_agreeing_prefix():
    from scheduler.speculation import LoopRound, PositionState

    rnd = LoopRound(p0=10, k0=3, positions=4, draft_loops=1)
    assert rnd.drafting and rnd.j == 0
    rnd.states = [PositionState(drafted=5), PositionState(token=6, exit_depth=0), PositionState(drafted=7)]
    rnd.states.append(PositionState(drafted=8))
    assert rnd.j == 4 and [s.fed for s in rnd.states] == [5, 6, 7, 8]
    rnd.verify_depth = 1
    assert rnd.active() == [0, 2, 3] and rnd.runs() == [(0, 1), (2, 4)]  # the exited position splits the verify
    for s, (tok, depth) in zip([rnd.states[0], rnd.states[2], rnd.states[3]], [(5, 3), (9, 2), (8, 3)]):
        s.token, s.exit_depth = tok, depth
    # position 0 agrees, 1 exited within the draft (kept), 2 differs: kept with its full-depth token, the end
    assert rnd.result() == (2, 3, [5, 6, 9], [3, 0, 2])
    for s in rnd.states:
        s.token = s.drafted if s.drafted >= 0 else s.token
    assert rnd.result() == (4, 4, [5, 6, 7, 8], [3, 0, 2, 3])


def test_buckets_hold_one_verify_beside_every_request():
    from scheduler.buckets import BucketSpec

    plain = BucketSpec(64, 16, 4, 256, 4)
    spec = BucketSpec(64, 16, 4, 256, 4, extra_coda_rows=3)
    assert plain.coda_cap == 16 and spec.coda_cap == 32  # 16 requests + 3 more positions, a power of two
    assert spec.key_for(8).C == 8 and spec.key_for(64).C == 32
