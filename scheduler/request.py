"""Request: one prompt, its sampling parameters, its outputs and its progress through the loops.

The request owns its logical progress; the scheduler only snapshots it into ``ScheduledRange``s.

Prompt progress (LAST_EXITED; positions ``0..n-1``; ``F[d]`` = ``prefill_depth_frontiers[d]``)::

    positions  0 ........................................................ n
    F[T-1]     |=====|                           final depth done (num_prefilled_tokens)
    F[1]       |==============|
    F[0]       |=====================|           depth-0 KV written (= num_preluded_tokens)
    chunks     |  c0   |  c1   |  c2   |  c3   |  ...  aligned at prefill_window_origin
    ring slot     0       1       2       0      (slot = chunk_index % ring_slots)

``F[0] >= F[1] >= ... >= F[T-1]``, each a contiguous prefix. A range at depth ``d`` starts at
``F[d]`` (so every earlier position has its depth-``d`` KV), ends at or before ``F[d-1]`` (its
inputs, the depth-``d-1`` hidden states, exist), stays inside one chunk, and a new chunk may start
depth 0 only if its ring slot is free: fewer than ``ring_slots`` chunks are resident from the
oldest unfinished one (``prefill_reclaimable_tokens``). Wavefront uses ``ring_slots = T``, mixed and
split ``1``; SHARED KV uses chunks of one position (all loops of ``p`` before ``p+1``).

Decode progress: the last generated token (index ``k``, position ``n+k``) is "in flight": it runs
one loop per invocation at ``decode_depth``; the exit rule decides after each loop whether its
coda token becomes generated token ``k+1``.

Resume after preemption (recomputation): a request preempted after ``k`` generated tokens is
rebuilt as a longer "prompt" of ``prefill_len = n + k - 1`` positions (the prompt, then every
generated token but the one in flight) through the same frontiers, chunks and ring. Generated
position ``n + j - 1`` (token ``j - 1``) ran loops ``0..exit_depths[j]`` when it was first computed;
its *depth cap* (``recompute_caps``) keeps it at that: it runs no loop above its cap, the scheduler
finalizes it (plane cap -> the planes above) once it has run its cap, and the frontier of a depth
above its cap steps over it once the frontier below has passed it (``skip_capped``). So every plane
is rebuilt exactly as it was, the first token is not sampled again, and the token in flight
restarts at depth 0 once the rebuild reaches the final depth.
"""

from __future__ import annotations

import enum
import time
from typing import Optional, Sequence

import numpy as np

from .sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


_FINISH_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


class Request:
    def __init__(
        self,
        request_id,
        prompt_token_ids: Sequence[int],
        sampling_params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        prompt_from=None,
    ):
        self.request_id = request_id
        # another choice of the same prompt (``n``): admitted once that request computed the
        # prompt, whose full blocks it then shares; the prompt's owner publishes them for it
        self.prompt_from = prompt_from
        self.shares_prompt = False
        ids = np.asarray(prompt_token_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"Request {request_id!r}: prompt_token_ids must be a flat sequence of ints")
        if ids.size and int(ids.min()) < 0:
            raise ValueError(f"Request {request_id!r}: prompt_token_ids must be non-negative")
        if ids.size and int(ids.max()) > np.iinfo(np.int32).max:
            raise ValueError(f"Request {request_id!r}: token id {int(ids.max())} does not fit in int32")
        if not (isinstance(priority, int) and not isinstance(priority, bool)):
            raise ValueError(
                f"Request {request_id!r}: priority must be an integer (lower runs first), got {priority!r}"
            )
        self.prompt_token_ids = ids.astype(np.int32)
        self.prompt_token_ids.flags.writeable = False
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.arrival_time = time.monotonic() if arrival_time is None else float(arrival_time)
        self.priority = priority

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        # one per generated token: the 0-based loop whose hidden state produced it
        self.exit_depths: list[int] = []
        self.token_times: list[float] = []
        # SamplingParams.logprobs: one TokenLogprobs per generated token, and their running sum
        self.output_logprobs: list = []
        self.cumulative_logprob = 0.0
        # SamplingParams.prompt_logprobs: per prompt position, None or its TokenLogprobs (the engine
        # fills them from the position before's full-depth state; position 0 has none)
        self.prompt_logprobs: Optional[list] = None
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        self.finish_reason: Optional[str] = None
        self.finish_time: Optional[float] = None

        # resources, set at admission
        self.batch_slot: Optional[int] = None  # its row of the block manager's tables and its ring region
        self.ring_base: Optional[int] = None  # first ring row of the request's region
        self.reserve_max_tokens: Optional[int] = None  # see max_kv_tokens
        self.arrival_seq = 0  # tie-break of equal arrival times (set by the scheduler)
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt positions of the current admission taken from the prefix cache
        self.num_published_blocks = 0  # leading prompt blocks known to the prefix cache
        self.block_hashes: Optional[list] = None  # hash chain of the full prompt blocks (prefix cache)

        # prompt progress (set up by start_prefill)
        self.prefill_chunk_size = 0
        self.prefill_ring_slots = 0
        self.prefill_window_origin = 0  # > 0 once a cached prefix is reused
        self.num_preluded_tokens = 0
        self.prefill_depth_frontiers: list[int] = []
        self.prefill_len = 0  # positions to (re)build before decoding: the prompt, after a preemption more
        self.prefill_token_ids = self.prompt_token_ids  # their token ids
        self.recompute_caps: Optional[np.ndarray] = None  # depth cap of positions n.. (see the module doc)

        # decode progress of the token in flight
        self.decode_depth = 0
        self.exit_remaining = 1.0
        self.decode_target_loops: Optional[int] = None
        self.gates_folded = 0
        self.pending_gates: list = []  # lazily read gates of this token, in loop order
        self.pending_finalize: list[int] = []  # flat (src, dst) KV slot copies for the next invocation
        self.spec_gain = None  # speculation.RoundGain once the request has taken part in a round
        self.loop_round = None  # speculation.LoopRound while a round runs on the loop-by-loop path

    # ---------------------------------------------------------------- sizes
    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_token_ids.shape[0])

    @property
    def max_kv_tokens(self) -> int:
        """Positions that ever get KV: the prompt and every generated token but the last (with
        ``reserve_max_tokens``, as many as if ``max_tokens`` were that: what ``reserve`` allocation
        holds for a request that a stop token ends early; benchmarks' eos512)."""
        return self.num_prompt_tokens + max(self.sampling_params.max_tokens, self.reserve_max_tokens or 0) - 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def first_token_time(self) -> Optional[float]:
        return self.token_times[0] if self.token_times else None

    # -------------------------------------------------------- prompt progress
    @property
    def num_rebuild_tokens(self) -> int:
        """Positions an admission must (re)build before decoding: the prompt, and after a
        preemption every generated token but the one in flight."""
        return self.num_prompt_tokens + max(0, len(self.output_token_ids) - 1)

    def start_prefill(self, num_loops: int, chunk_size: int, ring_slots: int, origin: int = 0) -> None:
        """Set up prompt progress at admission; ``origin`` positions come from the prefix cache."""
        k = len(self.output_token_ids)
        self.prefill_len = self.num_rebuild_tokens
        self.recompute_caps = None
        self.prefill_token_ids = self.prompt_token_ids
        if k > 1:
            self.prefill_token_ids = np.concatenate([self.prompt_token_ids, np.asarray(self.output_token_ids[:-1])])
            caps = np.asarray(self.exit_depths[1:k], np.int32)
            if (caps < num_loops - 1).any():
                self.recompute_caps = caps
        self.prefill_chunk_size = chunk_size
        self.prefill_ring_slots = ring_slots
        self.prefill_window_origin = origin
        self.prefill_depth_frontiers = [origin] * num_loops
        self.num_preluded_tokens = origin
        self.num_cached_tokens = origin

    def preempt(self) -> None:
        """Back to WAITING with no resources and no progress but its outputs (resumed by
        recomputation, see the module doc)."""
        self.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.batch_slot = self.ring_base = None
        self.prefill_depth_frontiers = []
        self.num_preluded_tokens = 0
        self.pending_gates = []
        self.pending_finalize = []
        self.decode_depth = 0
        self.loop_round = None  # its drafts are dropped: the rebuild recomputes only its outputs

    @property
    def num_prefilled_tokens(self) -> int:
        """Final-depth frontier: prompt positions that have run every loop."""
        return self.prefill_depth_frontiers[-1]

    @property
    def decode_started(self) -> bool:
        """Its token in flight has run a loop, or a loop-by-loop round is under way: it is not
        at the start of a token (what fused steps and rounds of every row need)."""
        return bool(self.decode_depth) or self.loop_round is not None

    @property
    def is_prefilling(self) -> bool:
        return self.status is RequestStatus.RUNNING and self.prefill_depth_frontiers[-1] < self.prefill_len

    @property
    def is_decoding(self) -> bool:
        return (
            self.status is RequestStatus.RUNNING
            and bool(self.output_token_ids)
            and self.prefill_depth_frontiers[-1] >= self.prefill_len
        )

    def depth_cap(self, pos: int) -> int:
        """The deepest loop position ``pos`` runs while it is (re)built."""
        n = self.num_prompt_tokens
        if self.recompute_caps is None or pos < n:
            return len(self.prefill_depth_frontiers) - 1
        return int(self.recompute_caps[pos - n])

    def capped_runs(self, depth: int, start: int, end: int) -> list[tuple[int, int]]:
        """The maximal runs of ``[start, end)`` whose positions run loop ``depth``."""
        if self.recompute_caps is None or end <= self.num_prompt_tokens or depth == 0:
            return [(start, end)] if end > start else []
        n = self.num_prompt_tokens
        ok = np.ones(end - start, bool)
        lo = max(start, n)
        ok[lo - start :] = self.recompute_caps[lo - n : end - n] >= depth
        edges = np.flatnonzero(np.diff(np.concatenate([[0], ok.astype(np.int8), [0]])))
        return [(start + int(a), start + int(b)) for a, b in zip(edges[::2], edges[1::2])]

    def skip_capped(self) -> None:
        """Step each depth's frontier over positions capped below that depth whose loop at their
        cap has run (the frontier below has passed them): their planes there are finalize copies."""
        caps, f, n = self.recompute_caps, self.prefill_depth_frontiers, self.num_prompt_tokens
        if caps is None:
            return
        for d in range(1, len(f)):
            while f[d] < f[d - 1] and f[d] >= n and caps[f[d] - n] < d:
                f[d] += 1

    def chunk_start(self, pos: int) -> int:
        o, c = self.prefill_window_origin, self.prefill_chunk_size
        return o + ((pos - o) // c) * c

    def chunk_end(self, pos: int) -> int:
        return min(self.chunk_start(pos) + self.prefill_chunk_size, self.prefill_len)

    @property
    def prefill_reclaimable_tokens(self) -> int:
        """Start of the oldest resident chunk: every chunk before it finished the final depth, so
        their ring slots may be reused."""
        f = self.num_prefilled_tokens
        return f if f >= self.prefill_len else self.chunk_start(f)

    def ring_row(self, pos: int) -> int:
        o, c = self.prefill_window_origin, self.prefill_chunk_size
        return self.ring_base + (((pos - o) // c) % self.prefill_ring_slots) * c + (pos - o) % c

    def ready_range(self, depth: int) -> tuple[int, int]:
        """The prompt positions ``[start, end)`` that may run loop ``depth`` now (may be empty)."""
        f = self.prefill_depth_frontiers
        start = f[depth]
        if depth == 0:
            ring_limit = self.prefill_reclaimable_tokens + self.prefill_ring_slots * self.prefill_chunk_size
            end = min(self.prefill_len, ring_limit)
        else:
            end = f[depth - 1]
        if start >= end:
            return start, start
        end = min(end, self.chunk_end(start))
        if depth and self.recompute_caps is not None and end > self.num_prompt_tokens:
            return self.capped_runs(depth, start, end)[0] if self.depth_cap(start) >= depth else (start, start)
        return start, end

    # -------------------------------------------------------- decode progress
    @property
    def position_in_flight(self) -> int:
        """Position of the generated token whose loops run now (``n + k`` for token ``k``)."""
        return self.num_prompt_tokens + len(self.output_token_ids) - 1

    def start_token(self, target_loops: Optional[int]) -> None:
        """Reset the per-token exit state for the token that now enters the loops."""
        self.decode_depth = 0
        self.exit_remaining = 1.0
        self.gates_folded = 0
        self.pending_gates = []
        self.decode_target_loops = target_loops

    # ----------------------------------------------------------------- output
    def append_token(self, token_id: int, exit_depth: int, now: float) -> None:
        self.output_token_ids.append(int(token_id))
        self.exit_depths.append(int(exit_depth))
        self.token_times.append(now)

    def finish(self, reason: str, now: Optional[float] = None) -> None:
        self.status = _FINISH_STATUS[reason]
        self.finish_reason = reason
        self.finish_time = time.monotonic() if now is None else now
        self.pending_gates = []
        self.pending_finalize = []

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, status={self.status.name}, "
            f"out={len(self.output_token_ids)})"
        )
