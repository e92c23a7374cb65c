"""The engine's step loop: schedule, launch, apply, one invocation per ``advance``, with fused
decode steps scheduled one ahead (asynchronous scheduling).

Without it, every fused decode step ends with the host reading its tokens, then building,
uploading and launching the next step while the device waits: on the H200 that round trip cost
1.2-1.8 ms a token at one stream against ~6.3 ms of device work (docs/decisions.md, "What the
engine's fused step loses"). With ``ahead``, once a fused step is launched the scheduler builds the
next one of the same rows (``Scheduler.schedule_ahead``: its first token is fed on the device from
the last tokens of the step before) and the runner launches it before the host reads the first;
the host then reads and applies step ``k`` while the device runs step ``k + 1``. The scheduler
decides when that is allowed; tokens and exit depths do not change (tests/scheduler/test_invariants.py).
Under a latency target's token cycles the step launched ahead of a fused step is the cycle's
prompt-only invocation instead (``Scheduler.schedule_ahead``).

With a latency target (``scheduler.latency``) the pipeline also times the device for its cost
model: results are read only now and then (prompt-only plans never block), so the wall time
between two blocking reads is charged to the plans that ran in it, together: every plan
launched up to the one whose read blocked (a plan launched ahead of it ran after it, and goes
to the next window).

Works with any runner whose ``step(descriptor)`` returns a ``StepResult`` (``ModelRunner``,
``FakeRunner``); free of jax.
"""

from __future__ import annotations

import time
from typing import Optional

from .scheduler import RequestDelta, Scheduler


class StepPipeline:
    """Drives ``scheduler`` and ``runner``; ``ahead=False`` is the plain synchronous loop."""

    def __init__(
        self, scheduler: Scheduler, runner, ahead: bool = True, sampler_inputs=None, after_launch=None, clock=None
    ):
        self.scheduler, self.runner, self.ahead = scheduler, runner, ahead
        self._clock = time.perf_counter if clock is None else clock  # seconds (tests: a synthetic device's)
        # plan -> None, called right after a one-loop plan's launch (prompt logprobs read its ring rows)
        self.after_launch = after_launch
        # plan -> what its coda rows need of the sampler beyond the descriptor (a dict of keywords
        # of ``runner.step`` / ``runner.complete``: a grammar's bitmask, logprobs, penalties)
        self.sampler_inputs = sampler_inputs
        self._pending = None  # (plan, result): launched ahead, not yet applied
        self._timed = scheduler.latency is not None
        self._uncharged: list = []  # plans launched since the window below opened
        self._window_t = 0.0  # when the current timing window opened

    @property
    def pending(self) -> bool:
        """Whether a step launched ahead is still unapplied (``drain`` applies it)."""
        return self._pending is not None

    def advance(self) -> Optional[list[RequestDelta]]:
        """Apply one invocation (launching the next fused step first where the scheduler allows);
        ``None`` if nothing could run."""
        if self._pending is None:
            plan = self.scheduler.schedule()
            if plan is None:
                self._uncharged = []  # nothing runs: the idle time until the next launch is no one's
                return None
            result = self.launch(plan)
        else:
            (plan, result), self._pending = self._pending, None
            self._complete(plan, result)  # the tokens before it are applied: its mask is known
        if self.ahead and plan.sub_plans is not None:
            nxt = self.scheduler.schedule_ahead()
            if nxt is not None:
                self._pending = (nxt, self.launch(nxt, defer=True))
        deltas = self._update(plan, result)
        if self._pending is not None and not self.scheduler.has_unfinished():
            deltas += self.drain()  # every row ended: nothing should stay in flight
        return deltas

    def _update(self, plan, result) -> list[RequestDelta]:
        """``scheduler.update`` of ``plan``; timed (module docstring) when a latency target is set."""
        if not self._timed:
            return self.scheduler.update(plan, result.gates, result.tokens, result.logprobs)
        read = []

        def reader(get):
            def f():
                out = get()
                read.append(True)
                return out

            return f

        lps = None if result.logprobs is None else reader(result.logprobs)
        deltas = self.scheduler.update(plan, reader(result.gates), reader(result.tokens), lps)
        if read:
            now = self._clock()
            i = next(k for k, p in enumerate(self._uncharged) if p is plan) + 1
            self.scheduler.observe(self._uncharged[:i], now - self._window_t)
            self._uncharged, self._window_t = self._uncharged[i:], now
        return deltas

    def launch(self, plan, defer: bool = False):
        """``runner.step`` of ``plan``, with the sampler inputs its coda rows need (``sampler_inputs``).
        A plan whose coda is deferred (a guided or penalised fused step) has it sampled at once, or with
        ``defer`` (launched ahead, before the tokens its mask depends on were read) by the
        ``advance`` or ``drain`` that applies it."""
        if self._timed:
            if not self._uncharged:  # the device is idle: a window opens now
                self._window_t = self._clock()
            self._uncharged.append(plan)
        if plan.deferred_coda:
            result = self.runner.step(plan.descriptor, defer_coda=True)
            if not defer:
                self._complete(plan, result)
            return result
        extra = None if self.sampler_inputs is None else self.sampler_inputs(plan)
        result = self.runner.step(plan.descriptor, **extra) if extra else self.runner.step(plan.descriptor)
        if self.after_launch is not None and plan.sub_plans is None:
            self.after_launch(plan)
        return result

    def _complete(self, plan, result) -> None:
        """Sample a deferred coda with what its rows' grammars and penalties give now."""
        if plan.deferred_coda and result.deferred is not None:
            self.runner.complete(result, **(self.sampler_inputs(plan) if self.sampler_inputs else {}))

    def drain(self) -> list[RequestDelta]:
        """Apply the step launched ahead, if any (waiting for it); the scheduler then has nothing in flight."""
        if self._pending is None:
            return []
        (plan, result), self._pending = self._pending, None
        self._complete(plan, result)
        return self._update(plan, result)
