"""Policies: which waiting request is admitted next, and what the running ones run next.

Admission (``WaitingQueue``): ``fcfs`` serves by arrival time, ``priority`` by ``(priority,
arrival)`` (lower value first). Both are head-of-line: if the first request does not fit in the
KV pool, later ones wait too, so that a large request is never starved by small ones.

Prefill modes (engine-semantics.md, "Prefill modes"); every invocation runs ONE loop:

- ``SplitPolicy`` (default): a *prefill group* embeds up to ``prefill_chunk_size`` prompt tokens of
  several requests and runs them through depths ``0..T-1`` in ``T`` consecutive invocations with
  nothing else in them (``loop_count = T``); a *decode group* is ``T`` invocations of decode rows
  only (one token of every decoding request at fixed depth). Groups alternate when both kinds of
  work wait, so neither starves.
- ``MixedPolicy``: one chunk of a request in flight at a time, staged one depth per invocation and
  sharing invocations with decode rows (``loop_count = 1``).
- ``WavefrontPolicy`` (LAST_EXITED only): up to ``T`` chunks of a request in flight (one per ring
  slot), every ready ``(chunk, depth)`` range may run, several of one request at different depths
  in one invocation, next to decode rows and other requests.

Mixed and wavefront differ only in how many chunks a request may keep in the ring; readiness
comes from the request's frontiers (``Request.ready_range``). Decode rows go first (they are the
latency-critical work and at most ``max_num_seqs <= max_num_batched_tokens`` of them); prompt
ranges fill the remaining row budget round-robin across requests, one range per request per pass,
deepest range first (finishing chunks frees ring slots and brings the first token closer).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Iterator, Optional

from .request import Request

__all__ = ["WaitingQueue", "Selection", "SplitPolicy", "MixedPolicy", "WavefrontPolicy", "make_policy"]


class WaitingQueue:
    """Requests not yet admitted, in admission order (``fcfs`` or ``priority``)."""

    def __init__(self, policy: str = "fcfs"):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"WaitingQueue: policy must be 'fcfs' or 'priority', got {policy!r}")
        self.policy = policy
        self._keys: list[tuple] = []
        self._reqs: list[Request] = []
        self._seq = itertools.count()

    def _key(self, req: Request) -> tuple:
        if self.policy == "priority":
            return (req.priority, req.arrival_time, next(self._seq))
        return (req.arrival_time, next(self._seq))

    def add(self, req: Request) -> None:
        key = self._key(req)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, req)

    def peek(self) -> Optional[Request]:
        return self._reqs[0] if self._reqs else None

    def pop(self) -> Request:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def remove(self, req: Request) -> bool:
        for i, r in enumerate(self._reqs):
            if r is req:
                del self._keys[i], self._reqs[i]
                return True
        return False

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)


@dataclasses.dataclass
class Selection:
    kind: str  # "prefill" | "decode" | "mixed"
    decode: list[Request]  # one row each, at its decode_depth
    prompt: list[tuple[Request, int, int, int]]  # (request, depth, start, end)
    loop_count: int


def _rotate(items: list, start: int) -> list:
    if not items:
        return items
    s = start % len(items)
    return items[s:] + items[:s]


def select_decode(running: list[Request], budget: int, rr: int) -> list[Request]:
    decoding = [r for r in running if r.is_decoding]
    if len(decoding) > budget:
        decoding = _rotate(decoding, rr)[:budget]
    return decoding


def round_robin_prompt(
    requests: list[Request], budget: int, rr: int, num_loops: int, depths: Optional[range] = None
) -> list[tuple[Request, int, int, int]]:
    """Ready prompt ranges under ``budget`` rows: one range per request per pass, deepest first."""
    depths = range(num_loops - 1, -1, -1) if depths is None else depths
    queues = []
    for req in _rotate([r for r in requests if r.is_prefilling], rr):
        ready = []
        for d in depths:
            s, e = req.ready_range(d)
            if e > s:
                ready.append((req, d, s, e))
        if ready:
            queues.append(ready)
    out = []
    level = 0
    while budget > 0 and queues:
        nxt = []
        for q in queues:
            if budget <= 0:
                break
            req, d, s, e = q[level]
            e = min(e, s + budget)
            out.append((req, d, s, e))
            budget -= e - s
            if level + 1 < len(q):
                nxt.append(q)
        queues = nxt
        level += 1
    return out


class StagedPolicy:
    """Prompt work staged one depth per invocation, sharing invocations with decode rows."""

    name = "staged"

    def __init__(self):
        self._rr = 0

    def forget(self, req: Request) -> None:
        """``req`` was preempted: nothing of it stays planned (staged selection keeps no plan)."""

    def select(
        self, running: list[Request], budget: int, num_loops: int, prompt_cap: Optional[int] = None
    ) -> Optional[Selection]:
        """``prompt_cap``: most prompt rows (a latency target's share; None = the whole budget)."""
        self._rr += 1
        decode = select_decode(running, budget, self._rr)
        room = budget - len(decode) if prompt_cap is None else min(budget - len(decode), prompt_cap)
        prompt = round_robin_prompt(running, room, self._rr, num_loops)
        if not decode and not prompt:
            return None
        kind = "mixed" if decode and prompt else ("decode" if decode else "prefill")
        return Selection(kind, decode, prompt, loop_count=1)


class MixedPolicy(StagedPolicy):
    name = "mixed"


class WavefrontPolicy(StagedPolicy):
    name = "wavefront"


class SplitPolicy:
    """Prefill groups (one chunk through all ``T`` loops) alternating with decode groups."""

    name = "split"

    def __init__(self):
        self._rr = 0
        self._group: Optional[list[tuple[Request, int, int]]] = None  # prefill group ranges
        self._group_depth = 0
        self._decode_left = 0
        self._last = None

    def forget(self, req: Request) -> None:
        """``req`` was preempted: its ranges leave the prefill group (it restarts from scratch)."""
        if self._group is not None:
            self._group = [g for g in self._group if g[0] is not req] or None

    def select(
        self, running: list[Request], budget: int, num_loops: int, prompt_cap: Optional[int] = None
    ) -> Optional[Selection]:
        """``prompt_cap``: most rows of a new prefill group (a latency target's share; None = no cap)."""
        if self._group is not None:
            sel = self._continue_prefill(num_loops)
            if sel is not None:
                return sel
        if self._decode_left > 0:
            self._decode_left -= 1
            decode = select_decode(running, budget, self._rr)
            if decode:
                return Selection("decode", decode, [], loop_count=1)
            self._decode_left = 0
        self._rr += 1
        has_decode = any(r.is_decoding for r in running)
        if not (self._last == "prefill" and has_decode):
            room = budget if prompt_cap is None else min(budget, prompt_cap)
            prompt = round_robin_prompt(running, room, self._rr, num_loops, depths=range(1))
            if prompt:
                self._group = [(r, s, e) for r, _, s, e in prompt]
                self._group_depth = 0
                self._last = "prefill"
                return self._continue_prefill(num_loops)
        if has_decode:
            self._last = "decode"
            self._decode_left = num_loops
            return self.select(running, budget, num_loops, prompt_cap)
        return None

    def _continue_prefill(self, num_loops: int) -> Optional[Selection]:
        d = self._group_depth
        # a rebuilt generated position runs no loop above its depth cap: one range per run of the rest
        prompt = [(r, d, a, b) for r, s, e in self._group if r.is_prefilling for a, b in r.capped_runs(d, s, e)]
        self._group_depth += 1
        if self._group_depth >= num_loops or not prompt:
            self._group = None
        if not prompt:
            return None
        return Selection("prefill", [], prompt, loop_count=num_loops)


def make_policy(prefill_mode: str):
    try:
        return {"split": SplitPolicy, "mixed": MixedPolicy, "wavefront": WavefrontPolicy}[prefill_mode]()
    except KeyError:
        raise ValueError(f"unknown prefill_mode {prefill_mode!r} (expected 'split', 'mixed' or 'wavefront')") from None
