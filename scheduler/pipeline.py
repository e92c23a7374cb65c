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

Works with any runner whose ``step(descriptor)`` returns a ``StepResult`` (``ModelRunner``,
``FakeRunner``); free of jax.
"""

from __future__ import annotations

from typing import Optional

from .scheduler import RequestDelta, Scheduler


class StepPipeline:
    """Drives ``scheduler`` and ``runner``; ``ahead=False`` is the plain synchronous loop."""

    def __init__(self, scheduler: Scheduler, runner, ahead: bool = True, sampler_inputs=None, after_launch=None):
        self.scheduler, self.runner, self.ahead = scheduler, runner, ahead
        # plan -> None, called right after a one-loop plan's launch (prompt logprobs read its ring rows)
        self.after_launch = after_launch
        # plan -> what its coda rows need of the sampler beyond the descriptor (a dict of keywords
        # of ``runner.step`` / ``runner.complete``: a grammar's bitmask, logprobs, penalties)
        self.sampler_inputs = sampler_inputs
        self._pending = None  # (plan, result): launched ahead, not yet applied

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
                return None
            result = self.launch(plan)
        else:
            (plan, result), self._pending = self._pending, None
            self._complete(plan, result)  # the tokens before it are applied: its mask is known
        if self.ahead and plan.sub_plans is not None:
            nxt = self.scheduler.schedule_ahead()
            if nxt is not None:
                self._pending = (nxt, self.launch(nxt, defer=True))
        deltas = self.scheduler.update(plan, result.gates, result.tokens, result.logprobs)
        if self._pending is not None and not self.scheduler.has_unfinished():
            deltas += self.drain()  # every row ended: nothing should stay in flight
        return deltas

    def launch(self, plan, defer: bool = False):
        """``runner.step`` of ``plan``, with the sampler inputs its coda rows need (``sampler_inputs``).
        A plan whose coda is deferred (a guided or penalised fused step) has it sampled at once, or with
        ``defer`` (launched ahead, before the tokens its mask depends on were read) by the
        ``advance`` or ``drain`` that applies it."""
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
        return self.scheduler.update(plan, result.gates, result.tokens, result.logprobs)
