"""A decode latency target (``SchedulerConfig.target_tpot_ms``): how many prompt rows an invocation may take.

A decode token runs ``L`` invocations (one per loop it runs; ``L`` = mean loops per token, ``T`` at
fixed depth), so a stream's TPOT is ``L`` times the time of the invocations it rides in.

The measured TPOT first (staged modes: mixed, wavefront). While the streams' measured TPOT stays
near the target they share the prompts' invocations uncapped, as without a target: a target they
already meet costs the prompts nothing. Once it misses by more than ``CONSTRAIN_MISS``
(``constrain``) they run constrained: token cycles where they can (below), else the
per-invocation cap; once constrained running leaves more than ``1 - RELEASE_SLACK`` of the
target unused, they share uncapped again. Split mode runs under the cap from the start: its
invocations never hold decode and prompt rows together, so no window measures the streams' TPOT
beside the prompts.

The per-invocation cap. Staged modes share invocations: the cap keeps ``t(decode + prompt rows) <=
target / L``. Split alternates prefill and decode invocations one for one per loop: ``t(prompt) +
t(decode) <= target / L``.

``CostModel`` predicts an invocation's seconds as ``a + b * R + c * kv`` (``R`` the row bucket it
runs, ``kv`` the context tokens its attention reads: a decode row reads its context, a prompt
segment reads its context once per query tile of up to ``KV_TILE_ROWS`` rows, not once per row, as
the attention kernels do), by non-negative least squares over a sliding
window of measured runs. The engine reads device results only now and then (prompt-only plans never
block), so one measurement is the time between two blocking reads and covers every plan launched
in between: the model is fitted on their summed features, which a linear model allows.

Token cycles (staged prefill modes with fused decode steps, streams that would run fused alone).
Constrained, each token of such streams is one fused step of all of them (its loops, up to ``T``,
in one launch, faster than loop by loop: docs/decisions.md, "Why cycles, and why they failed
before") followed by prompt-only invocations, the first of which
the scheduler builds and launches while the fused step runs (``Scheduler.schedule_ahead``). A
cycle is one token of every stream, so its measured time is the streams' TPOT. The prompt rows
follow a feedback loop rather than the cost model's absolute prediction (a fused step's fixed
cost is not identifiable from windows that always hold one fused step and prompt invocations):
the cycle's prompt invocations get a budget of predicted seconds (the model's ``a`` an
invocation, ``b + c * pos / tile`` a prompt row), moved each cycle by ``CYCLE_GAIN`` times the
measured cycle's error against the target, never below ``min_prompt_share`` of the cycle, never
more than one invocation beyond what the cycle could spend. At least one chunk runs every cycle;
where the prompts' ready work (one chunk a depth a prompt, in the wavefront) is less than the
budget buys, up to ``MAX_CYCLE_PROMPTS`` prompt invocations run.

Never starving: decode rows are never capped; with no decode stream running prompts are not capped
either; waiting prompts always get at least ``min_prompt_share`` of the predicted invocation time
(a target that decode alone already misses is relaxed to ``decode time / (1 - share)``, so an
unreachable target degrades into a fixed prompt share instead of a trickle); and when the cap still
leaves prompts nothing for ``starve_after`` invocations in a row, one chunk runs anyway.
"""

from __future__ import annotations

import collections
import itertools
import math
from typing import Optional, Sequence

import numpy as np

from .plan import Phase

__all__ = ["CostModel", "LatencyTarget", "plan_features", "make_latency_target", "KV_TILE_ROWS"]

# Fraction of a token cycle's measured error (target - cycle seconds) that moves its prompt
# budget each cycle: below 1, so that one slow cycle (a host hiccup) does not swing the next.
CYCLE_GAIN = 0.5

# The streams run constrained (token cycles, else the cap) when the uncapped shared invocations'
# measured TPOT misses the target by more than this factor, and uncapped again when constrained
# running leaves more than 1 - RELEASE_SLACK of it unused (where the prompts' ready work is too
# little to use it, the shared invocations give them more), each after MODE_DWELL tokens of the
# streams in the mode, so that the two do not alternate token by token.
CONSTRAIN_MISS = 1.05
RELEASE_SLACK = 0.8
MODE_DWELL = 8

# Most prompt-only invocations of one token cycle (where the prompts' ready work, one chunk a
# depth a prompt in the wavefront, leaves the target room for more than one).
MAX_CYCLE_PROMPTS = 4

# the feature subsets NNLS tries (every non-empty one of invocations, rows, context tokens)
_FEATURE_SUBSETS = [c for k in (1, 2, 3) for c in itertools.combinations(range(3), k)]

# a normal-equations system whose determinant is below this share of its diagonal's product has
# collinear columns (exactly collinear columns leave ~1e-16 of rounding)
_SINGULAR = 1e-10


def _dot(a, b) -> float:
    return sum(u * v for u, v in zip(a, b))


def _solve_small(g: list, r: list) -> Optional[list]:
    """``g c = r`` for a symmetric positive semi-definite ``g`` of 1 x 1 to 3 x 3 (Cramer's rule),
    ``None`` where ``g`` is singular."""
    k = len(r)
    diag = math.prod(g[i][i] for i in range(k))
    if k == 1:
        return [r[0] / g[0][0]] if g[0][0] > 0 else None
    if k == 2:
        det = g[0][0] * g[1][1] - g[0][1] * g[1][0]
        if det <= _SINGULAR * diag:
            return None
        return [(r[0] * g[1][1] - g[0][1] * r[1]) / det, (g[0][0] * r[1] - r[0] * g[1][0]) / det]
    (a, b, c), (d, e, f), (h, i, j) = g
    co = [e * j - f * i, f * h - d * j, d * i - e * h]  # cofactors of the first row
    det = a * co[0] + b * co[1] + c * co[2]
    if det <= _SINGULAR * diag:
        return None
    inv = [
        [co[0], c * i - b * j, b * f - c * e],
        [co[1], a * j - c * h, c * d - a * f],
        [co[2], b * h - a * i, a * e - b * d],
    ]
    return [_dot(row, r) / det for row in inv]


# Query rows that share one pass over their segment's K/V in the attention kernels (the Mosaic
# kernel's 128-row tiles; the Triton kernel's tiles are 16-128 rows, one per short segment).
KV_TILE_ROWS = 128


def kv_tokens(token_start: int, token_count: int) -> float:
    """Context tokens the attention reads for rows ``token_start .. token_start + token_count - 1``
    of one segment: each query tile reads positions up to its last row's."""
    total, s = 0.0, token_start
    end = token_start + token_count
    while s < end:
        e = min(end, s + KV_TILE_ROWS)
        total += e  # positions 0 .. e-1
        s = e
    return total


def _shared_with_streams(plan) -> bool:
    """A one-loop invocation with decode rows (in staged modes: a loop of every stream)."""
    return plan.sub_plans is None and any(r.phase is Phase.DECODE for r in plan.ranges)


def _has_prompt(plan) -> bool:
    return plan.sub_plans is None and any(r.phase is Phase.RECURRENT for r in plan.ranges)


def plan_features(plan) -> tuple[float, float, float]:
    """``(invocations, bucket rows, context tokens read by attention)`` of one plan (a fused plan:
    of the sub-steps that ran, once ``update`` has seen them)."""
    subs = plan.sub_plans if plan.sub_plans is not None else [plan]
    runs = getattr(plan.descriptor, "loops_run", None)
    if plan.sub_plans is not None and runs is not None:
        T = len(subs) // len(runs)
        subs = [s for i, s in enumerate(subs) if i % T < runs[i // T]]
    n = rows = ctx = 0.0
    for sub in subs:
        n += 1.0
        rows += sub.descriptor.key.R if sub.descriptor is not None else sub.num_rows
        for r in sub.ranges:
            if r.phase is not Phase.PRELUDE:
                ctx += kv_tokens(r.token_start, r.token_count)
    return n, rows, ctx


class CostModel:
    """``seconds = a * invocations + b * rows + c * ctx``, all coefficients >= 0, over the last ``window`` runs."""

    def __init__(self, window: int = 256, min_observations: int = 8):
        if not (isinstance(window, int) and window >= 3):
            raise ValueError(f"CostModel: window must be an integer >= 3, got {window!r}")
        if not (isinstance(min_observations, int) and 1 <= min_observations <= window):
            raise ValueError(f"CostModel: min_observations must lie in [1, window], got {min_observations!r}")
        self.window, self.min_observations = window, min_observations
        # the last ``window`` runs in a ring: features, seconds (``_fit`` reads them without copies)
        self._x = np.zeros((window, 3))
        self._y = np.zeros(window)
        self._held = 0  # rows of the ring in use
        self._coef: Optional[np.ndarray] = None
        self._dirty = False
        self.num_observations = 0

    def observe(self, features: Sequence[float], seconds: float) -> None:
        if len(features) != 3 or not all(math.isfinite(f) and f >= 0 for f in features):
            raise ValueError(f"CostModel.observe: features must be 3 finite values >= 0, got {features!r}")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"CostModel.observe: seconds must be finite and >= 0, got {seconds!r}")
        if features[0] <= 0:
            return  # nothing ran
        i = self.num_observations % self.window
        self._x[i], self._y[i] = features, seconds
        self._held = min(self._held + 1, self.window)
        self.num_observations += 1
        self._dirty = True

    @property
    def fitted(self) -> bool:
        return self._held >= self.min_observations

    @property
    def coefficients(self) -> Optional[tuple[float, float, float]]:
        if not self.fitted:
            return None
        if self._dirty:
            self._coef = self._fit()
            self._dirty = False
        return tuple(float(x) for x in self._coef)

    def _fit(self) -> np.ndarray:
        """Non-negative least squares by trying every subset of the 3 features (the best feasible
        one, the smaller subset where two fit alike), each on the window's normal equations, a
        system of at most 3 x 3 solved in closed form: the fit runs before every capped
        invocation, on the host (docs/decisions.md, "The cost model fits on its normal
        equations"). A subset
        whose columns are collinear (every run one invocation of one bucket, say) is skipped: a
        smaller one spans the same fits."""
        x, y = self._x[: self._held], self._y[: self._held]
        scale = np.maximum(x.max(axis=0), 1e-12)  # columns of very different sizes: solve on [0, 1] columns
        xs = x / scale
        gram, xty, yy = (xs.T @ xs).tolist(), (xs.T @ y).tolist(), float(y @ y)
        best, best_err = [0.0, 0.0, 0.0], yy
        for cols in _FEATURE_SUBSETS:
            g = [[gram[i][j] for j in cols] for i in cols]
            r = [xty[i] for i in cols]
            sol = _solve_small(g, r)
            if sol is None or min(sol) < 0:
                continue
            # |xs c - y|^2 = y.y - 2 c.(xs^T y) + c^T (xs^T xs) c
            err = yy - 2.0 * _dot(sol, r) + _dot(sol, [_dot(row, sol) for row in g])
            if err < best_err - 1e-12 * yy:
                best = [0.0, 0.0, 0.0]
                for i, v in zip(cols, sol):
                    best[i] = v
                best_err = err
        return np.asarray(best) / scale

    def predict(self, rows: float, ctx: float, invocations: float = 1.0) -> float:
        a, b, c = self.coefficients
        return a * invocations + b * rows + c * ctx


class LatencyTarget:
    """A TPOT target's decisions: token cycles and their prompt rows, or the prompt-row cap of each
    shared invocation (see the module docstring)."""

    def __init__(
        self,
        target_s: float,
        num_loops: int,
        row_buckets: Sequence[int],
        prompt_chunk: int,
        *,
        headroom: float = 0.95,
        min_prompt_share: float = 0.25,
        starve_after: Optional[int] = None,
        window: int = 256,
        min_observations: int = 8,
        loops_window: int = 512,
    ):
        if not (isinstance(target_s, (int, float)) and math.isfinite(target_s) and target_s > 0):
            raise ValueError(f"LatencyTarget: target_s must be a positive number, got {target_s!r}")
        if not 0 < headroom <= 1:
            raise ValueError(f"LatencyTarget: headroom must lie in (0, 1], got {headroom!r}")
        if not (isinstance(min_prompt_share, (int, float)) and 0 <= min_prompt_share < 1):
            raise ValueError(f"LatencyTarget: min_prompt_share must lie in [0, 1), got {min_prompt_share!r}")
        self.target_s, self.num_loops, self.headroom = float(target_s), num_loops, headroom
        self.min_prompt_share = float(min_prompt_share)
        self.row_buckets = sorted(row_buckets)
        self.prompt_chunk = prompt_chunk
        self.starve_after = 2 * num_loops if starve_after is None else starve_after
        if not (isinstance(self.starve_after, int) and self.starve_after >= 1):
            raise ValueError(f"LatencyTarget: starve_after must be a positive integer, got {starve_after!r}")
        self.model = CostModel(window, min_observations)
        self._loops: collections.deque = collections.deque(maxlen=loops_window)
        self._loops_sum = 0
        self._starved = 0  # invocations in a row in which ready prompt work got no row
        self.forced = 0  # invocations given a chunk by the starvation rule
        self.capped = 0  # invocations whose prompt rows the target limited
        # invocations (or cycles) whose target decode alone would miss: prompts got the minimum share
        self.relaxed = 0
        # token cycles (module docstring)
        self.cycle_plan = None  # the latest cycle's fused step
        self.cycles = 0  # fused steps that opened a cycle
        self.cycles_measured = 0  # cycles whose time moved the prompt budget
        self.cycle_prompt_s: Optional[float] = None  # the prompt invocation's budget of predicted seconds
        self.cycle_s: Optional[float] = None  # the latest measured cycle
        self._cycle_spent = 0.0  # predicted seconds of the open cycle's prompt invocations
        self._closed_spent = 0.0  # the same of the cycle that the latest fused step closed
        self._cycle_prompts = 0  # prompt invocations of the open cycle
        self._cycle_row_s = 0.0  # the latest predicted seconds of a prompt row
        self._row_budget = max(self.row_buckets)  # the most rows an invocation takes
        self.constrained = False  # the streams run token cycles or the cap (constrain)
        self._capping = False  # constrained streams that cannot cycle: capped shared invocations
        self.mode_switches = 0
        self._mode_tpot: Optional[float] = None  # smoothed measured TPOT in the current mode
        self._mode_tokens = 0.0  # tokens of the streams measured in the current mode
        self._window_closed_cycle = False  # the previous timing window ended at a cycle's fused step

    # ------------------------------------------------------------------ measure
    def observe(self, plans, seconds: float) -> None:
        """``plans`` (one plan or a list) ran in ``seconds`` together."""
        plans = plans if isinstance(plans, (list, tuple)) else [plans]
        feats = [plan_features(p) for p in plans]
        self.model.observe(tuple(sum(f[i] for f in feats) for i in range(3)), seconds)
        closes_cycle = self.cycle_plan is not None and any(p is self.cycle_plan for p in plans)
        if closes_cycle and self._window_closed_cycle:  # the window is one whole cycle
            self._control_cycle(seconds)
            self._mode_sample(seconds, 1.0)
        self._window_closed_cycle = closes_cycle
        shared = all(_shared_with_streams(p) for p in plans) and any(map(_has_prompt, plans))
        if shared and (not self.constrained or self._capping):
            # every stream rode every invocation of the window, a loop each: a token is L of them
            n = sum(f[0] for f in feats)
            self._mode_sample(self.mean_loops * seconds / n, n / self.mean_loops)

    def observe_loops(self, loops: int) -> None:
        """A decode token left after ``loops`` loops."""
        if len(self._loops) == self._loops.maxlen:
            self._loops_sum -= self._loops[0]
        self._loops.append(loops)
        self._loops_sum += loops

    @property
    def mean_loops(self) -> float:
        """Loops per decode token; ``T`` (the most) until a token was seen."""
        return self._loops_sum / len(self._loops) if self._loops else float(self.num_loops)

    def _bucket(self, rows: int) -> int:
        for r in self.row_buckets:
            if r >= rows:
                return r
        return self.row_buckets[-1]

    # ------------------------------------------------------------------ decide
    def prompt_cap(self, running: list, budget: int, split: bool) -> Optional[int]:
        """Prompt rows the next invocation may take (``None``: no cap: no decode stream runs)."""
        decoding = [r for r in running if r.is_decoding]
        prefilling = [r for r in running if r.is_prefilling]
        if not decoding or not prefilling:
            return None
        n_d = min(len(decoding), budget)
        ctx_d = float(sum(r.position_in_flight + 1 for r in decoding[:n_d]))
        # a prompt row attends to at most its position + 1: bound by the furthest row that may run
        pos = max(min(r.prefill_len, r.prefill_depth_frontiers[0] + r.prefill_chunk_size) for r in prefilling)
        cap = self._cap(n_d, ctx_d, float(pos), budget, split)
        if cap < budget - (0 if split else n_d):
            self.capped += 1
        if cap == 0 and self._starved >= self.starve_after:
            # lifted until prompt rows actually run (the policy may not be able to start them at once:
            # a split decode group in flight)
            self.forced += 1
            return max(1, min(self.prompt_chunk, budget - (0 if split else n_d)))
        return cap

    # ------------------------------------------------------------------ the streams' mode
    def constrain(self, split: bool, can_cycle: bool) -> bool:
        """Whether the streams run constrained now (``CONSTRAIN_MISS``, ``RELEASE_SLACK``): token
        cycles where they ``can_cycle``, else the per-invocation cap; uncapped shared invocations
        first while those keep the measured TPOT near the target. Split mode is always constrained
        (the module docstring)."""
        if split:
            return True
        if self._mode_tpot is not None and self._mode_tokens >= MODE_DWELL:
            if not self.constrained and self._mode_tpot > CONSTRAIN_MISS * self.target_s:
                self._switch_mode(True)
            elif self.constrained and self._mode_tpot < RELEASE_SLACK * self.target_s:
                self._switch_mode(False)
        self._capping = self.constrained and not can_cycle
        return self.constrained

    def _switch_mode(self, constrained: bool) -> None:
        self.constrained = constrained
        self.mode_switches += 1
        self._mode_tpot, self._mode_tokens = None, 0.0
        self._window_closed_cycle = False

    def _mode_sample(self, tpot: float, tokens: float) -> None:
        """A measured TPOT over ``tokens`` tokens of the streams, in the current mode."""
        w = min(1.0, 0.25 * tokens)
        self._mode_tpot = tpot if self._mode_tpot is None else self._mode_tpot + w * (tpot - self._mode_tpot)
        self._mode_tokens += tokens

    # ------------------------------------------------------------------ token cycles
    def cycle_step(self, plan) -> None:
        """A cycle's fused step was scheduled (``plan``): the window that reads it closes a cycle."""
        self.cycle_plan = plan
        self.cycles += 1
        # the cycle that ends here ran its prompt invocations between the two fused steps: the
        # window that reads this one measures them
        self._closed_spent = self._cycle_spent
        self._cycle_spent, self._cycle_prompts = 0.0, 0

    def cycle_prompt_rows(self, prefilling: list, budget: int) -> int:
        """Prompt rows of the cycle's next prompt-only invocation, 0 for none (the fused step is
        next): as many as the rest of the cycle's prompt budget buys at the model's cost (a fixed
        cost an invocation, ``_prompt_row_s`` a row). The first one takes at least one chunk
        (only one chunk until the model is fitted); later ones run while a chunk still fits."""
        chunk = min(budget, self.prompt_chunk)
        per_row = self._prompt_row_s(prefilling)
        if per_row is None:
            return 0 if self._cycle_prompts else chunk
        if self.cycle_prompt_s is None:
            self.cycle_prompt_s = self.min_prompt_share * self.target_s
        left = self.cycle_prompt_s - self._cycle_spent - self.model.coefficients[0]
        if self._cycle_prompts:
            if self._cycle_prompts >= MAX_CYCLE_PROMPTS or left < per_row * chunk:
                return 0
        rows = budget if per_row <= 0 else int(max(left, 0.0) // per_row)
        return max(chunk, min(budget, rows))

    def cycle_prompt_ran(self, rows: int, prefilling: list) -> None:
        """A prompt invocation of ``rows`` rows was scheduled: its predicted time is spent."""
        self._cycle_prompts += 1
        per_row = self._prompt_row_s(prefilling)
        if per_row is not None:
            self._cycle_spent += self.model.coefficients[0] + per_row * rows

    def _prompt_row_s(self, prefilling: list) -> Optional[float]:
        """The model's seconds a prompt row adds (its row, its share of its segment's K/V pass at
        the furthest position that may run), ``None`` before the model is fitted."""
        if not self.model.fitted or not prefilling:
            return None
        _, b, c = self.model.coefficients
        pos = max(min(r.prefill_len, r.prefill_depth_frontiers[0] + r.prefill_chunk_size) for r in prefilling)
        self._cycle_row_s = b + c * pos / min(self.prompt_chunk, KV_TILE_ROWS)
        return self._cycle_row_s

    def _control_cycle(self, seconds: float) -> None:
        """One whole cycle took ``seconds``: move the prompt budget by the error against the target."""
        self.cycle_s = seconds
        self.cycles_measured += 1
        if self.cycle_prompt_s is None:
            return
        budget = self.cycle_prompt_s + CYCLE_GAIN * (self.target_s - seconds)
        least = self.min_prompt_share * seconds
        if budget < least:
            budget = least
            self.relaxed += 1
        # no more than one more invocation beyond what the cycle could spend (when the prompts had
        # no more ready work, a budget growing further would only have to unwind once they have)
        most = self._closed_spent + self.model.coefficients[0] + self._cycle_row_s * self._row_budget
        self.cycle_prompt_s = min(budget, max(least, most))

    def note_selection(self, prompt_waiting: bool, ran_prompt: bool) -> None:
        """What the invocation just scheduled did: the starvation count is of invocations in which
        prompt work waited and got no row, whatever the reason (cap, policy, a group in flight)."""
        self._starved = 0 if (ran_prompt or not prompt_waiting) else self._starved + 1

    def _cap(self, n_d: int, ctx_d: float, pos: float, budget: int, split: bool) -> int:
        room = budget if split else budget - n_d
        if room <= 0:
            return 0
        if not self.model.fitted:  # explore: one chunk until the model has data
            return min(room, self.prompt_chunk)
        a, b, c = self.model.coefficients
        limit = self.headroom * self.target_s / self.mean_loops
        decode_alone = a + b * self._bucket(n_d) + c * ctx_d
        # the least time prompts get: share s of (decode + prompt) time, i.e. decode / (1 - s) in all
        least = decode_alone / (1.0 - self.min_prompt_share)
        if limit < least:
            limit = least
            self.relaxed += 1
        if split:  # a prefill invocation per decode invocation, per loop
            limit -= decode_alone
            base_rows, base_ctx = 0, 0.0
        else:
            base_rows, base_ctx = n_d, ctx_d
        best, prev = 0, 0
        for r_bucket in self.row_buckets:
            lo, hi = max(prev, base_rows) - base_rows, min(r_bucket - base_rows, room)
            prev = r_bucket
            if hi <= 0 or hi <= lo:
                continue
            slack = limit - a - b * r_bucket - c * base_ctx
            if slack < 0:
                continue
            # a prompt row's share of its segment's K/V pass: one pass per tile of its chunk
            per_row = c * pos / min(self.prompt_chunk, KV_TILE_ROWS)
            p = hi if per_row <= 0 else min(hi, int(slack // per_row))
            if p > lo:
                best = max(best, p)
        return best

    def stats(self) -> dict:
        coef = self.model.coefficients
        return dict(
            target_tpot_ms=self.target_s * 1e3,
            latency_mean_loops=self.mean_loops,
            latency_observations=self.model.num_observations,
            latency_coefficients=None if coef is None else list(coef),
            latency_capped=self.capped,
            latency_forced=self.forced,
            latency_relaxed=self.relaxed,
            latency_cycles=self.cycles,
            latency_mode_switches=self.mode_switches,
            latency_cycles_measured=self.cycles_measured,
            latency_cycle_ms=None if self.cycle_s is None else self.cycle_s * 1e3,
            latency_cycle_prompt_ms=None if self.cycle_prompt_s is None else self.cycle_prompt_s * 1e3,
        )


def make_latency_target(config, row_buckets: Sequence[int]) -> Optional[LatencyTarget]:
    """The config's target, or ``None`` when ``target_tpot_ms`` is off."""
    if config.target_tpot_ms is None:
        return None
    return LatencyTarget(config.target_tpot_ms / 1e3, config.num_loops, row_buckets, config.effective_chunk_size)
