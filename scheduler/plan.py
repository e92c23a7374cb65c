"""BatchPlan: what one invocation runs, in the scheduler's words (requests, depths, positions).

A plan is a snapshot: the ranges it holds are copies of request progress at scheduling time, so
the scheduler can apply results to it later (``Scheduler.update``) and tests can check invariants
on it without touching requests. Its ``descriptor`` is the same plan in the runner's words (numpy
arrays padded to a bucket, docs/contracts.md).

Phases of a range:

- ``PRELUDE``: embed prompt tokens ``[token_start, token_start + token_count)`` into their ring
  rows (step 2 of an invocation). Wavefront, mixed and split all embed a range in the same
  invocation that runs its depth 0 (step 3), because the runner embeds before the loop runs; a
  ``PRELUDE`` range is therefore always accompanied by the ``RECURRENT`` depth-0 range of the
  same tokens.
- ``RECURRENT``: one loop (``depth``) of prompt positions, one contiguous segment of rows.
- ``DECODE``: one loop of the generated token in flight (one row at position ``token_start``);
  at ``depth == 0`` the row's token is embedded first (its prelude).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple, Optional

import numpy as np

__all__ = ["Phase", "ScheduledRange", "CodaRow", "BatchPlan"]


class Phase(enum.Enum):
    PRELUDE = "prelude"
    RECURRENT = "recurrent"
    DECODE = "decode"


class ScheduledRange(NamedTuple):
    """A snapshot (a tuple: cheap to build for every decode row of every invocation)."""

    request_id: object
    phase: Phase
    depth: int  # loop index (PRELUDE: 0, the depth whose input it prepares)
    token_start: int  # first position
    token_count: int
    chunk_start: int  # start of the prompt chunk the range lies in (DECODE: its position)
    ring_row_offset: int  # ring row of token_start (rows of a range are contiguous in the ring)
    row_start: int = -1  # first row of the invocation (RECURRENT / DECODE); -1 for PRELUDE

    @property
    def token_end(self) -> int:
        return self.token_start + self.token_count


class CodaRow(NamedTuple):
    request_id: object
    row: int  # row of the invocation whose output is sampled
    token_index: int  # index of the generated token it would become
    speculative: bool  # kept only if the host decides, after reading the gate, to exit


@dataclasses.dataclass
class BatchPlan:
    step: int  # invocation index
    kind: str  # "prefill" | "decode" | "mixed"
    ranges: list[ScheduledRange]
    coda: list[CodaRow]
    finalize: np.ndarray  # [n, 2] (src slot, dst slot) KV copies, step 1
    needs_gates: bool  # some gate of this plan may decide an exit
    needs_tokens: bool  # coda rows present
    loop_count: int  # loops a prompt range of this plan's group runs
    num_rows: int
    descriptor: Optional[object] = None  # BatchDescriptor (StackedDescriptor when fused)
    sub_plans: Optional[list] = None  # fused decode: one plan per sub-step, in order
    # fused decode of guided rows: its coda is sampled after launch, once the host knows the mask
    deferred_coda: bool = False
    # a round of self-speculative decoding (scheduler/speculation.py): draft and verify of its rows
    speculative: bool = False

    def ranges_of(self, phase: Phase) -> list[ScheduledRange]:
        return [r for r in self.ranges if r.phase is phase]
