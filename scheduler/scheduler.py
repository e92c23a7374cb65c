"""Scheduler: admits requests, picks what the next invocation runs, applies what it returned.

The loop an engine runs::

    plan = scheduler.schedule()            # BatchPlan with .descriptor (None: nothing to run)
    result = runner.step(plan.descriptor)  # a StepResult: device arrays, possibly not ready
    deltas = scheduler.update(plan, result.gates, result.tokens)

``update`` reads a result only when the plan needs it: gates only when an exit depends on them
(``plan.needs_gates``), tokens only when a coda row's token is kept. A prefill-only plan therefore
never blocks the host, and the device can run ahead while the next plan is built. One plan is
in flight: ``schedule`` refuses to run again before ``update`` has seen the previous plan. The
exception is asynchronous scheduling of fused decode steps: ``schedule_ahead`` builds the next
fused step of the same rows while the one in flight is still unread (its tokens are fed on the
device), so the host reads one step while the device runs the next (``pipeline.StepPipeline``);
under a latency target's token cycles it builds the cycle's prompt-only invocation instead.

What ``update`` applies: prompt frontiers advance (``Request.prefill_depth_frontiers``); the
prompt's first token comes from the coda of its last position at depth ``T-1``, once every
position has finished that depth; a decode row's exit rule reads its gate; an exiting row keeps
the token its (speculative) coda sampled, queues its KV finalize copies (LAST_EXITED, exit at
``e < T-1``: plane ``e`` -> planes ``e+1..T-1``) for step 1 of the next invocation and refills:
the next token starts at depth 0 next invocation. Finished and aborted requests give back every
block and their ring region at once.

KV allocation (``SchedulerConfig.kv_allocation``, docs/decisions.md): ``on_demand`` (default) gives
a request the blocks of the positions it (re)builds at admission (its prompt; after a preemption
also its generated tokens) and one more column of blocks whenever its token in flight crosses into
a new block; admission keeps ``watermark`` of the pool free for that growth. When a running request
cannot grow, the lowest-priority, latest-arriving running request is preempted (its blocks and
ring region freed, back to the waiting queue) and later resumed by recomputation
(``Request.start_prefill``). ``reserve`` takes ``prompt + max_tokens - 1`` positions at admission
and never preempts. Prefix caching (``enable_prefix_caching``, LAST_EXITED) reuses the published
full prompt blocks of earlier requests (``KVBlockManager``).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from typing import Callable, Optional, Sequence, Union

import numpy as np

from .block_manager import DEFAULT_ENABLE_PREFIX_CACHING, KVBlockManager, prefix_block_hashes
from .buckets import BucketKey, BucketSpec
from .descriptor import (
    StackedDescriptor,
    build_decode_loops,
    build_descriptor,
    split_fused_output,
)
from .exit_policy import (
    coda_kind,
    decide_exit,
    device_exit_params,
    fold_gate,
    gate_needed,
    gates_needed_at,
    synthetic_exit_loops,
)
from .latency_target import make_latency_target
from .options import choice
from .plan import BatchPlan, CodaRow, Phase, ScheduledRange
from .policies import Selection, WaitingQueue, make_policy
from .request import Request, RequestStatus
from .sampling_params import LOGPROB_WORDS, read_logprobs
from .sizes import blocks_per_plane, descriptor_rows, kv_planes, ring_rows, ring_slots
from .speculation import (
    VERIFY_FIELDS,
    LoopRound,
    PositionState,
    RoundPolicy,
    SpecDescriptor,
    SpecKey,
    SpeculativeConfig,
    speculative_option,
    split_spec_output,
)

__all__ = ["SchedulerConfig", "Scheduler", "RequestDelta"]

ArrayOrThunk = Union[np.ndarray, Callable[[], np.ndarray]]

KV_LAYOUTS = ("last_exited", "shared")
PREFILL_MODES = ("split", "mixed", "wavefront")
KV_ALLOCATIONS = ("on_demand", "reserve")
POLICIES = ("fcfs", "priority")


# Fused decode steps of more rows than this run only when no row's exit depends on its gates. A
# fused step runs every row in lock step to the deepest row's exit, where loop by loop the later
# loops shrink to the rows still running: on the H200 (docs/decisions.md, "Fused steps at large
# buckets") the gate rule at 0.5 decoded 32 streams faster fused (7.50 against 8.59 ms a token)
# and 128 streams much slower (28.0 against 18.6 ms); fixed and synthetic depths gained at both.
FUSED_GATED_MAX_ROWS = 32


def _tokens_left(req: Request, done: int = 0) -> int:
    """Tokens ``req`` may still make by ``max_tokens``, ``done`` tokens after its token in flight."""
    return req.sampling_params.max_tokens - len(req.output_token_ids) - done


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    num_loops: int  # T
    num_blocks: int  # KV pool pages (block 0 is the trash page)
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024  # rows per invocation
    prefill_chunk_size: int = 128
    max_model_len: int = 8192
    kv_layout: str = "last_exited"  # "last_exited" | "shared"
    prefill_mode: str = "split"  # "split" | "mixed" | "wavefront"
    policy: str = "fcfs"  # "fcfs" | "priority"
    # ids that end a request (unless ignore_eos): the model's, generation_config.json's, the tokenizer's
    eos_token_ids: Sequence[int] = ()
    vocab_size: Optional[int] = None  # bounds prompt and stop token ids when known
    buckets: Optional[Sequence[int]] = None  # row buckets; None = powers of two from 8
    watermark: float = 0.01  # on_demand: share of the pool admission keeps free for running requests' growth
    kv_allocation: str = "on_demand"  # "on_demand" | "reserve" (prompt + max_tokens at admission)
    enable_prefix_caching: Optional[bool] = None  # None: DEFAULT_ENABLE_PREFIX_CACHING under LAST_EXITED
    fused_decode_max_rows: int = 0  # fused decode steps for up to this many rows; 0 = off
    fused_decode_tokens: int = 1  # tokens per fused decode step (each T loops)
    target_tpot_ms: Optional[float] = None  # decode TPOT the prompt share is sized for (latency_target.py); None = off
    # self-speculative decoding (speculation.py): a dict, its JSON text or a SpeculativeConfig; None = off
    speculative_config: Optional[SpeculativeConfig] = None

    def __post_init__(self):
        try:
            object.__setattr__(
                self, "speculative_config", speculative_option("speculative_config", self.speculative_config)
            )
        except ValueError as e:
            raise ValueError(f"SchedulerConfig: {e}") from None
        for name, choices in (
            ("kv_layout", KV_LAYOUTS),
            ("prefill_mode", PREFILL_MODES),
            ("policy", POLICIES),
            ("kv_allocation", KV_ALLOCATIONS),
        ):
            try:
                object.__setattr__(self, name, choice(name, getattr(self, name), choices))
            except ValueError as e:
                raise ValueError(f"SchedulerConfig: {e}") from None
        if self.buckets is not None:
            object.__setattr__(self, "buckets", tuple(self.buckets))
        if not isinstance(self.eos_token_ids, (str, bytes)):
            try:
                object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
            except TypeError:
                pass  # not a sequence: validate() says so
        if self.enable_prefix_caching is None:
            default = DEFAULT_ENABLE_PREFIX_CACHING and self.kv_layout == "last_exited"
            object.__setattr__(self, "enable_prefix_caching", default)
        self.validate()

    def validate(self) -> None:
        def need(cond, msg):
            if not cond:
                raise ValueError(f"SchedulerConfig: {msg}")

        for name in (
            "num_loops",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_chunk_size",
            "max_model_len",
        ):
            v = getattr(self, name)
            need(_is_int(v) and v >= 1, f"{name} must be a positive integer, got {v!r}")
        need(
            _is_int(self.num_blocks) and self.num_blocks >= 2,
            f"num_blocks must be an integer >= 2 (block 0 is the trash page), got {self.num_blocks!r}",
        )
        need(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
            f"({self.max_num_seqs}): every running request may need a decode row in one invocation",
        )
        need(
            not (self.prefill_mode == "wavefront" and self.kv_layout == "shared"),
            "prefill_mode='wavefront' needs kv_layout LAST_EXITED: with SHARED KV a position's "
            "depth 0 reads the final KV of every earlier position, so chunks cannot overlap in depth",
        )
        need(
            isinstance(self.enable_prefix_caching, bool),
            f"enable_prefix_caching must be a bool or None, got {self.enable_prefix_caching!r}",
        )
        need(
            not (self.enable_prefix_caching and self.kv_layout == "shared"),
            "enable_prefix_caching needs kv_layout LAST_EXITED: engine-semantics.md reserves prefix "
            "caching to LAST_EXITED (docs/decisions.md says why SHARED is rejected)",
        )
        need(
            isinstance(self.eos_token_ids, tuple) and all(_is_int(t) and t >= 0 for t in self.eos_token_ids),
            f"eos_token_ids must be a sequence of non-negative integers, got {self.eos_token_ids!r}",
        )
        need(
            self.vocab_size is None or (_is_int(self.vocab_size) and self.vocab_size >= 1),
            f"vocab_size must be None or a positive integer, got {self.vocab_size!r}",
        )
        for t in self.eos_token_ids if self.vocab_size is not None else ():
            need(t < self.vocab_size, f"eos_token_ids: {t} is outside the vocabulary [0, {self.vocab_size})")
        need(
            isinstance(self.watermark, (int, float)) and 0.0 <= self.watermark < 1.0,
            f"watermark must lie in [0, 1), got {self.watermark!r}",
        )
        need(
            _is_int(self.fused_decode_max_rows) and 0 <= self.fused_decode_max_rows <= self.max_num_seqs,
            f"fused_decode_max_rows must be an integer in [0, max_num_seqs={self.max_num_seqs}], "
            f"got {self.fused_decode_max_rows!r}",
        )
        need(
            _is_int(self.fused_decode_tokens) and self.fused_decode_tokens >= 1,
            f"fused_decode_tokens must be a positive integer, got {self.fused_decode_tokens!r}",
        )
        need(
            self.target_tpot_ms is None
            or (
                isinstance(self.target_tpot_ms, (int, float))
                and not isinstance(self.target_tpot_ms, bool)
                and 0 < self.target_tpot_ms < float("inf")
            ),
            f"target_tpot_ms must be None or a positive finite number, got {self.target_tpot_ms!r}",
        )
        try:
            self.bucket_spec()
        except ValueError as e:
            raise ValueError(f"SchedulerConfig: buckets: {e}") from None
        spec = self.speculative_config
        if spec is not None:
            try:
                spec.check(self.num_loops)
            except ValueError as e:
                raise ValueError(f"SchedulerConfig: {e}") from None
            need(
                self.kv_layout == "last_exited",
                "speculative_config needs kv_layout LAST_EXITED: with SHARED KV a position's loop 0 reads the "
                "final KV of every earlier position, so the positions of a round cannot be verified together",
            )
            need(
                self.fused_decode_max_rows >= 1,
                "speculative_config needs fused decode steps (fused_decode_max_rows >= 1): a round runs on their path",
            )
            need(
                self.ring_rows_per_request >= spec.positions,
                f"speculative_config: a round keeps {spec.positions} hidden states per request in its ring region "
                f"of {self.ring_rows_per_request} rows: raise prefill_chunk_size or lower num_speculative_tokens",
            )
            need(
                self.max_num_batched_tokens >= spec.positions,
                f"speculative_config: a round verifies {spec.positions} positions of a request in one invocation: "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must hold them",
            )
            need(
                self.target_tpot_ms is None,
                "speculative_config does not take a target_tpot_ms yet: the latency target's cost model "
                "knows loops, not rounds",
            )

    # ----------------------------------------------------------------- derived
    @property
    def num_planes(self) -> int:
        return kv_planes(self.num_loops, self.kv_layout)

    @property
    def ring_slots(self) -> int:
        """Chunks of one request resident in its ring region at once."""
        return ring_slots(self.num_loops, self.prefill_mode)

    @property
    def effective_chunk_size(self) -> int:
        """SHARED KV runs prompts position by position (all loops of ``p`` before ``p+1``)."""
        return 1 if self.kv_layout == "shared" else self.prefill_chunk_size

    @property
    def ring_rows_per_request(self) -> int:
        return self.prefill_chunk_size * self.ring_slots

    @property
    def num_ring_rows(self) -> int:
        """Rows of the runner's hidden-state ring: scratch row 0 plus one region per sequence."""
        return ring_rows(self.max_num_seqs, self.ring_rows_per_request)

    @property
    def max_blocks_per_seq(self) -> int:
        return blocks_per_plane(self.max_model_len, self.block_size)

    def fused_steps(self) -> list[tuple[BucketKey, int]]:
        """Every ``(key, n)`` a fused decode step can use (the runner compiles them at start):
        the row buckets up to the one holding ``fused_decode_max_rows``, ``n = T`` (one token) and
        ``n = T * fused_decode_tokens``. One executable serves every exit rule (exits are decided
        on the device), so early exit adds none."""
        if not self.fused_decode_max_rows:
            return []
        spec = self.bucket_spec()
        top = spec.key_for(self.fused_decode_max_rows).R
        ns = sorted({self.num_loops, self.num_loops * self.fused_decode_tokens})
        return [(spec.key_for_bucket(r), n) for r in spec.row_buckets if r <= top for n in ns]

    def spec_rounds(self) -> list[SpecKey]:
        """Both executables (``stage`` draft and verify) of every round a run can launch: ``n``
        requests (up to ``fused_decode_max_rows``, and as many as the largest bucket verifies) draft
        in the bucket of ``n`` rows and verify in the bucket of ``n * positions``."""
        spec = self.speculative_config
        if spec is None:
            return []
        bs = self.bucket_spec()
        top = min(self.fused_decode_max_rows, bs.row_buckets[-1] // spec.positions)
        pairs = dict.fromkeys((bs.key_for(n), bs.key_for(n * spec.positions)) for n in range(1, top + 1))
        keys = [SpecKey(bd, bv, spec.draft_loops, spec.positions, self.num_loops) for bd, bv in pairs]
        return [k.at(stage) for k in keys for stage in ("draft", "verify")]

    def bucket_spec(self) -> BucketSpec:
        return BucketSpec(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            num_loops=self.num_loops,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            has_finalize=self.kv_layout == "last_exited",
            row_buckets=self.buckets,
            extra_coda_rows=0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens,
        )


@dataclasses.dataclass
class RequestDelta:
    """What one ``update`` (or ``abort``) added to a request's output."""

    request_id: object
    new_token_ids: list[int]
    new_exit_depths: list[int]
    finished: bool
    finish_reason: Optional[str]


class _Lazy:
    """A device result read at most once, and only if some decision needs it."""

    __slots__ = ("_src", "_val", "_what", "_min_len", "_row")

    def __init__(self, src: ArrayOrThunk, what: str, min_len: int, row: int = 0):
        self._src, self._val, self._what, self._min_len = src, None, what, min_len
        self._row = row  # > 0: rows of this many words, kept as a numpy array (logprob records)

    def get(self) -> list:
        if self._val is None:
            v = np.asarray(self._src() if callable(self._src) else self._src).reshape(-1)
            if v.shape[0] < self._min_len:
                raise ValueError(
                    f"Scheduler.update: {self._what} has {v.shape[0]} entries, the plan needs {self._min_len}"
                )
            # a Python list: the host reads it element by element, numpy scalars are slow there
            self._val, self._src = (v.reshape(-1, self._row) if self._row else v.tolist()), None
        return self._val


def _host_coda(sp) -> bool:
    """Whether the coda of a request's token needs the host's word on the token before it (a
    grammar's mask, a penalty's counts): its fused steps defer their coda (``BatchPlan.deferred_coda``)."""
    return sp.guided is not None or sp.adjusts_logits


def _logprob_record(req: Request, lps: Optional[_Lazy], i: int):
    """Coda row ``i``'s logprob record when ``req`` asks for logprobs (read only then)."""
    if req.sampling_params.logprobs is None or lps is None:
        return None
    return lps.get()[i]


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.num_loops = config.num_loops
        # the one owner of every block table; its slots are the batch slots (ring regions)
        self.block_manager = KVBlockManager(
            config.num_blocks,
            config.block_size,
            config.num_planes,
            max_seqs=config.max_num_seqs,
            max_blocks_per_seq=config.max_blocks_per_seq,
            watermark=config.watermark,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        # prefix hashes name the layout too: a block is only reusable by an engine that lays KV out alike
        self._hash_salt = f"{config.kv_layout}/{config.num_planes}/{config.block_size}".encode()
        self._arrivals = itertools.count()
        self.bucket_spec = config.bucket_spec()
        self._max_finalize_pairs = self.bucket_spec.key_for_bucket(self.bucket_spec.row_buckets[-1]).F
        self.policy = make_policy(config.prefill_mode)
        self.latency = make_latency_target(config, self.bucket_spec.row_buckets)  # None: no TPOT target
        spec = config.speculative_config
        self.round_policy = None if spec is None else RoundPolicy(spec, config.num_loops)  # None: no rounds
        self._verify_rows: dict = {}  # rows of the loop-by-loop verifies the next invocation takes
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []  # admission order
        self._requests: dict[object, Request] = {}  # every unfinished request, by id
        self._inflight: Optional[BatchPlan] = None
        self._ahead: Optional[BatchPlan] = None  # launched by schedule_ahead, updated after _inflight
        self._cycle_prompt_due = False  # a token cycle's fused step ran: its prompt invocations are next
        self._step = 0
        self._stats = Counter()
        self._keys_used = Counter()

    # ---------------------------------------------------------------- requests
    def check_request(self, request: Request) -> None:
        """``ValueError`` if ``request`` can never run here (its sampling values, an empty prompt,
        its length, the pool's size, a duplicate id); changes nothing. ``add_request`` runs it, and
        front ends run it to refuse a request before it reaches the engine."""
        cfg = self.config
        if not isinstance(request, Request):
            raise TypeError(f"add_request expects a Request, got {type(request).__name__}")
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r}: a request with this id is already queued or running")
        if request.status is not RequestStatus.WAITING or request.output_token_ids:
            raise ValueError(
                f"request {rid!r}: only a fresh WAITING request can be added (status {request.status.name})"
            )
        if request.priority != 0 and cfg.policy != "priority":
            raise ValueError(
                f"request {rid!r}: priority={request.priority!r} is read only by policy='priority' "
                f"(this engine's policy is {cfg.policy!r})"
            )
        request.sampling_params.validate(cfg.num_loops, cfg.vocab_size)
        n = request.num_prompt_tokens
        if cfg.vocab_size is not None and n and int(request.prompt_token_ids.max()) >= cfg.vocab_size:
            raise ValueError(
                f"request {rid!r}: token id {int(request.prompt_token_ids.max())} is outside the vocabulary "
                f"[0, {cfg.vocab_size})"
            )
        if n == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        max_tokens = request.sampling_params.max_tokens
        if n + max_tokens > cfg.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({cfg.max_model_len})"
            )
        if not self.block_manager.can_ever_fit(request.max_kv_tokens):
            raise ValueError(
                f"request {rid!r} can never fit in the KV pool: it needs "
                f"{self.block_manager.blocks_needed(request.max_kv_tokens)} blocks "
                f"({request.max_kv_tokens} tokens x {cfg.num_planes} planes), the pool "
                f"can give {cfg.num_blocks - 1}"
            )

    def add_request(self, request: Request) -> None:
        """Queue ``request``; raises ``ValueError`` (changing nothing) if it can never run. A
        request naming ``prompt_from`` (a queued or running request of the same prompt) waits for
        it to compute the prompt and then shares its full blocks; an unknown or finished one, or
        another prompt, is not waited for."""
        self.check_request(request)
        owner = self._requests.get(request.prompt_from) if request.prompt_from is not None else None
        if owner is not None and (
            self.config.kv_layout != "last_exited"  # no shared prompt blocks in SHARED (engine-semantics.md)
            or owner.output_token_ids  # its prompt is computed: nothing to wait for
            or not np.array_equal(owner.prompt_token_ids, request.prompt_token_ids)
        ):
            owner = None
        request.arrival_seq = next(self._arrivals)
        self.waiting.add(request)  # first: were it to raise, no request would be left half-added
        self._requests[request.request_id] = request
        if owner is None:
            request.prompt_from = None
        else:
            owner.shares_prompt = True

    def abort(self, request_id) -> Optional[RequestDelta]:
        """Stop a request now, freeing its blocks and ring region; ``None`` if it is unknown or
        already finished. A plan in flight that holds it simply skips it in ``update``."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self._release(req)
        req.finish("abort")
        self._stats["aborted"] += 1
        return RequestDelta(request_id, [], [], True, "abort")

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id) -> Optional[Request]:
        return self._requests.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def prefix_hashes(self, token_ids) -> list[bytes]:
        """The hash chain of the prompt blocks the prefix cache could serve to ``token_ids`` (its full
        blocks before the last prompt position), keyed as the block manager keys them: what a
        data-parallel router compares between replicas. Empty when prefix caching is off."""
        cfg = self.config
        if not cfg.enable_prefix_caching:
            return []
        n = (len(token_ids) - 1) // cfg.block_size if len(token_ids) else 0
        return prefix_block_hashes(np.asarray(token_ids), cfg.block_size, self._hash_salt, max(0, n))

    def cached_prefix_blocks(self, hashes) -> int:
        """How many leading blocks of ``hashes`` this engine's prefix cache holds now (a read only:
        safe to call from another thread, the answer possibly a step old)."""
        return self.block_manager.num_cached_prefix(hashes)

    def _admit(self) -> None:
        cfg = self.config
        while len(self.waiting) and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            if self._prompt_in_progress(req) or not self._allocate(req):
                break  # head-of-line: admission order is the policy's order
            self.waiting.pop()
            self.running.append(req)

    def _prompt_in_progress(self, req: Request) -> bool:
        """Whether ``req`` waits for the request it shares its prompt with (``prompt_from``) to
        finish computing it: its sibling runs ahead of it in the policy's order, so this ends."""
        owner = self._requests.get(req.prompt_from) if req.prompt_from is not None else None
        return owner is not None and owner.shares_prompt and not owner.output_token_ids

    def _shares_prompts(self, req: Request) -> bool:
        """Whether ``req``'s full prompt blocks go through the prefix cache: caching is on, or it
        is a choice of a group sharing one prompt (LAST_EXITED only: engine-semantics.md)."""
        cfg = self.config
        if cfg.enable_prefix_caching:
            return True
        return cfg.kv_layout == "last_exited" and (req.shares_prompt or req.prompt_from is not None)

    def _allocate(self, req: Request) -> bool:
        """Blocks, batch slot and ring region for ``req``, and its prompt progress; False (nothing
        changed) if the pool cannot give the blocks now."""
        cfg, bm = self.config, self.block_manager
        n = req.num_prompt_tokens
        tokens = req.max_kv_tokens if cfg.kv_allocation == "reserve" else req.num_rebuild_tokens
        hashes: list = []
        if self._shares_prompts(req):
            if req.block_hashes is None:
                req.block_hashes = prefix_block_hashes(
                    req.prompt_token_ids, cfg.block_size, self._hash_salt, n // cfg.block_size
                )
            # at least one prompt position is computed: its last one samples the first token; a
            # request that asks for prompt logprobs computes every position (they come from them)
            if req.sampling_params.prompt_logprobs is None:
                hashes = req.block_hashes[: (n - 1) // cfg.block_size]
        # the watermark keeps room for running requests to grow; with none running it has nothing to protect
        keep = bm.watermark_blocks if cfg.kv_allocation == "on_demand" and self.running else 0
        got = bm.allocate(req.request_id, tokens, hashes, keep)
        if got is None:
            return False
        _, hit_blocks = got
        slot = req.batch_slot = bm.slot(req.request_id)
        req.ring_base = 1 + slot * cfg.ring_rows_per_request
        origin = hit_blocks * cfg.block_size
        req.start_prefill(cfg.num_loops, cfg.effective_chunk_size, cfg.ring_slots, origin)
        req.num_published_blocks = hit_blocks
        if req.output_token_ids:  # resumed: its token in flight starts again at depth 0
            req.start_token(self._target(req, len(req.output_token_ids)))
        req.status = RequestStatus.RUNNING
        st = self._stats
        if cfg.enable_prefix_caching:
            st["prefix_cache_queried_tokens"] += n
            st["prefix_cache_hit_tokens"] += origin
        if req.prompt_from is not None:
            st["shared_prompt_tokens"] += origin  # prompt positions a choice took from its sibling
        st["admissions"] += 1
        return True

    def _target(self, req: Request, k: int) -> Optional[int]:
        p = req.sampling_params
        return synthetic_exit_loops(p, self.num_loops, req.request_id, k) if p.exit_mode == "synthetic" else None

    def _release(self, req: Request) -> None:
        if req.batch_slot is None:
            return
        self.block_manager.free(req.request_id)
        req.batch_slot = None
        self.running.remove(req)

    def _victim_key(self, req: Request) -> tuple:
        """Larger = preempted first: lowest priority (the largest value), then the latest arrival."""
        pri = req.priority if self.config.policy == "priority" else 0
        return (pri, req.arrival_time, req.arrival_seq)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.preempt()
        self.policy.forget(req)
        self.waiting.add(req)
        self._stats["preemptions"] += 1

    def _grow_to(self, req: Request, num_tokens: int) -> bool:
        """Blocks for positions ``0..num_tokens-1`` of ``req`` (no preemption); False if the pool is short."""
        bm = self.block_manager
        return bm.num_held_tokens(req.request_id) >= num_tokens or bm.grow(req.request_id, num_tokens) is not None

    def _grow(self) -> None:
        """Give every decoding request the block of its token in flight, preempting when the pool
        is short (the best-placed requests grow first and are preempted last)."""
        bm = self.block_manager
        needy = [r for r in self.running if r.is_decoding and bm.num_held_tokens(r.request_id) <= r.position_in_flight]
        for req in sorted(needy, key=self._victim_key):
            while req.batch_slot is not None and not self._grow_to(req, req.position_in_flight + 1):
                victim = max(self.running, key=self._victim_key)
                self._preempt(victim)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> Optional[BatchPlan]:
        """The next invocation, or ``None`` if nothing can run."""
        if self._inflight is not None:
            raise RuntimeError("Scheduler.schedule: the previous plan has not been passed to update() yet")
        t0 = time.perf_counter()
        cfg, T = self.config, self.num_loops
        finalize: list[int] = []  # flat (src, dst) pairs: numpy converts flat int lists fastest
        if sum(len(r.pending_finalize) for r in self.running) > 2 * self._max_finalize_pairs:
            # more copies than one invocation holds (a rebuild finalizing a whole chunk at once):
            # copy-only invocations first, so that every copy still lands before anything reads it
            room = 2 * self._max_finalize_pairs
            for req in self.running:
                take = req.pending_finalize[:room]
                finalize.extend(take)
                req.pending_finalize = req.pending_finalize[len(take) :]
                room -= len(take)
            sel = None
        else:
            if cfg.kv_allocation == "on_demand":
                self._grow()
            self._admit()
            self._stats["max_running"] = max(self._stats["max_running"], len(self.running))
            cycle = self._cycle_streams() if self.latency is not None else None
            # the streams share the prompts' invocations, uncapped, while their measured TPOT is on time
            constrained = self.latency is not None and self.latency.constrain(
                cfg.prefill_mode == "split", cycle is not None
            )
            if not constrained:
                cycle = None
            if cycle is not None and cycle[1]:  # a token cycle (LatencyTarget, "Token cycles")
                for req in self.running:
                    if req.pending_finalize:
                        finalize.extend(req.pending_finalize)
                        req.pending_finalize = []
                plan = self._cycle_prompt_plan(finalize) if self._cycle_prompt_due else None
                if plan is None and self._cycle_fused_fits(cycle[0], finalize):
                    plan = self.fused_plan(cycle[0], finalize, 1)
                    self.latency.cycle_step(plan)
                    self._cycle_prompt_due = True
                    self._stats["cycle_fused_steps"] += 1
                if plan is not None:
                    self._inflight = plan
                    self._stats["schedule_time_s"] += time.perf_counter() - t0
                    return plan
            self._cycle_prompt_due = False
            cap = None
            if constrained:
                cap = self.latency.prompt_cap(self.running, cfg.max_num_batched_tokens, cfg.prefill_mode == "split")
            self._verify_rows = self._reserve_verify_rows()
            budget = cfg.max_num_batched_tokens - sum(self._verify_rows.values())
            running = self.running
            if cycle is not None and not cycle[1]:  # streams mid-token finish it; those at depth 0 wait
                running = [r for r in running if not (r.is_decoding and r.decode_depth == 0)]
            sel = self.policy.select(running, budget, T, cap)
            if self.latency is not None:
                waiting = any(r.is_prefilling for r in self.running)
                self.latency.note_selection(waiting, sel is not None and bool(sel.prompt))
            for req in self.running:
                if req.pending_finalize:
                    finalize.extend(req.pending_finalize)
                    req.pending_finalize = []
        if sel is None and not finalize:
            self._stats["schedule_time_s"] += time.perf_counter() - t0
            return None
        sel = self._align_for_fusion(sel)
        if self._speculates(sel, finalize):
            plan = self._inflight = self.spec_plan(sel.decode, finalize)
            self._stats["schedule_time_s"] += time.perf_counter() - t0
            return plan
        fused = self._fused_tokens(sel, finalize)
        if fused:
            plan = self._inflight = self.fused_plan(sel.decode, finalize, fused)
            self._stats["schedule_time_s"] += time.perf_counter() - t0
            return plan
        plan = self._inflight = self._loop_plan(sel, finalize)
        self._stats["schedule_time_s"] += time.perf_counter() - t0
        return plan

    def _loop_plan(self, sel: Optional[Selection], finalize: list) -> BatchPlan:
        """The one-loop invocation of ``sel`` (decode rows, prompt ranges) and ``finalize`` copies."""
        cfg, T = self.config, self.num_loops
        last_exited = cfg.kv_layout == "last_exited"

        ranges: list[ScheduledRange] = []
        coda: list[CodaRow] = []
        coda_params: list = []  # flat (temperature, top_k, top_p, seed, step) per coda row
        segs: list[int] = []  # flat (batch slot, plane, first position, rows, first ring row)
        pre_ring_dec, pre_tok_dec = [], []
        pre_ring_pr, pre_tok_pr = [], []
        needs_gates = False
        row = 0
        decode = sel.decode if sel else []
        prompt = sel.prompt if sel else []

        for req in decode:
            p = req.sampling_params
            rnd = req.loop_round if req.loop_round is not None else self._start_loop_round(req)
            if rnd is not None and not rnd.drafting:  # the verify: loop t of every cut position still running
                if req.request_id not in self._verify_rows:
                    continue  # its rows did not fit beside the others': it waits an invocation
                t = rnd.verify_depth
                for a, b in rnd.runs():
                    pos, base = rnd.p0 + a, req.ring_base + a
                    ranges.append(ScheduledRange(req.request_id, Phase.DECODE, t, pos, b - a, pos, base, row))
                    segs.extend((req.batch_slot, t, pos, b - a, base))
                    for j in range(a, b):
                        kind = coda_kind(p, T, t + 1, rnd.states[j].decode_target_loops)
                        if kind != "none":
                            coda.append(CodaRow(req.request_id, row, rnd.k0 + j, kind == "speculative"))
                            coda_params.extend((p.temperature, p.top_k, p.top_p, p.seed, rnd.k0 + j))
                        row += 1
                needs_gates = needs_gates or gate_needed(p, T, t)
                continue
            j = 0 if rnd is None else rnd.j  # the position a round drafts: p + j in ring row base + j
            d, pos, base = req.decode_depth, req.position_in_flight + j, req.ring_base + j
            ranges.append(ScheduledRange(req.request_id, Phase.DECODE, d, pos, 1, pos, base, row))
            segs.extend((req.batch_slot, d if last_exited else 0, pos, 1, base))
            if d == 0:
                pre_ring_dec.append(base)
                pre_tok_dec.append(req.output_token_ids[-1] if j == 0 else rnd.states[j - 1].fed)
            kind = coda_kind(p, T, d + 1, req.decode_target_loops)
            if rnd is not None and d == rnd.draft_loops - 1:
                kind = "certain"  # the draft's last loop: a token either way (exact or drafted)
            if kind != "none":
                k = len(req.output_token_ids) + j
                coda.append(CodaRow(req.request_id, row, k, kind == "speculative"))
                coda_params.extend((p.temperature, p.top_k, p.top_p, p.seed, k))
            if not needs_gates:
                needs_gates = gate_needed(p, T, d)
            row += 1
        decode_rows = row
        for req, d, s, e in prompt:
            cnt, ring, cs = e - s, req.ring_row(s), req.chunk_start(s)
            if d == 0:
                ranges.append(ScheduledRange(req.request_id, Phase.PRELUDE, 0, s, cnt, cs, ring))
                pre_ring_pr.append(np.arange(ring, ring + cnt))
                pre_tok_pr.append(req.prefill_token_ids[s:e])
            ranges.append(ScheduledRange(req.request_id, Phase.RECURRENT, d, s, cnt, cs, ring, row))
            segs.extend((req.batch_slot, d if last_exited else 0, s, cnt, ring))
            if d == T - 1 and e == req.prefill_len and not req.output_token_ids:
                p = req.sampling_params
                coda.append(CodaRow(req.request_id, row + cnt - 1, 0, False))
                coda_params.extend((p.temperature, p.top_k, p.top_p, p.seed, 0))
            row += cnt

        pre_ring = np.concatenate([np.asarray(pre_ring_dec, np.int64), *pre_ring_pr])
        pre_tok = np.concatenate([np.asarray(pre_tok_dec, np.int64), *pre_tok_pr])
        cp = np.fromiter(coda_params, np.float64, len(coda_params)).reshape(-1, 5)
        fin = np.fromiter(finalize, np.int64, len(finalize)).reshape(-1, 2)
        sg = np.fromiter(segs, np.int64, len(segs)).reshape(-1, 5)
        desc = build_descriptor(
            self.bucket_spec,
            self.block_manager.tables,
            seg_slot=sg[:, 0],
            seg_plane=sg[:, 1],
            seg_pos=sg[:, 2],
            seg_len=sg[:, 3],
            seg_ring=sg[:, 4],
            pre_ring=pre_ring,
            pre_token=pre_tok,
            coda_row=[c.row for c in coda],
            coda_temperature=cp[:, 0],
            coda_top_k=cp[:, 1],
            coda_top_p=cp[:, 2],
            coda_seed=cp[:, 3].astype(np.uint32),
            coda_step=cp[:, 4],
            fin_src=fin[:, 0],
            fin_dst=fin[:, 1],
        )
        plan = BatchPlan(
            step=self._step,
            kind=sel.kind if sel else "finalize",
            ranges=ranges,
            coda=coda,
            finalize=fin,
            needs_gates=needs_gates,
            needs_tokens=bool(coda),
            loop_count=sel.loop_count if sel else 0,
            num_rows=row,
            descriptor=desc,
        )
        self._step += 1
        self._count_loop(plan, decode_rows)
        self._stats["launches"] += 1
        return plan

    def _count_loop(self, plan: BatchPlan, decode_rows: int) -> None:
        """Counters of one loop's invocation (a fused step counts each of its sub-steps)."""
        st, desc = self._stats, plan.descriptor
        st["invocations"] += 1
        st["real_rows"] += plan.num_rows
        st["padded_rows"] += desc.key.R - plan.num_rows
        st["decode_rows"] += decode_rows
        st["prefill_rows"] += plan.num_rows - decode_rows
        st["prelude_tokens"] += desc.num_prelude
        st["coda_rows"] += len(plan.coda)
        st["speculative_coda_rows"] += sum(c.speculative for c in plan.coda)
        st["finalize_pairs"] += len(plan.finalize)
        st[f"{plan.kind}_invocations"] += 1
        self._keys_used[desc.key.R] += 1

    # ------------------------------------------------------------ fused decode
    def _fusion_candidates(self, sel) -> bool:
        """Could ``sel`` run fused but for the rows' depths: decode rows only, every running
        request among them, within ``fused_decode_max_rows``, no row whose exit depends on its
        gates beyond ``FUSED_GATED_MAX_ROWS`` rows, and nothing to admit (a fused step would keep
        it waiting ``T`` loops or more)."""
        cfg = self.config
        if not cfg.fused_decode_max_rows or sel is None or sel.prompt or not sel.decode:
            return False
        rows = sel.decode
        if len(rows) > cfg.fused_decode_max_rows or len(rows) != len(self.running):
            return False
        if self._lockstep_too_costly(rows):
            return False
        return not (len(self.waiting) and len(self.running) < cfg.max_num_seqs)

    def _lockstep_too_costly(self, rows: list[Request]) -> bool:
        """More than ``FUSED_GATED_MAX_ROWS`` rows, one of whose exits reads its gates: lock step
        to the deepest gated exit costs more than the launches a fused step saves."""
        return len(rows) > FUSED_GATED_MAX_ROWS and any(gate_needed(r.sampling_params, self.num_loops, 0) for r in rows)

    def _align_for_fusion(self, sel):
        """Hold the rows at depth 0 while others finish their tokens, when that is all that keeps
        the batch from fusing: rows whose exits differ never meet at depth 0 again by themselves.
        The held rows lose at most ``T - 1`` loops once; from then on every step is fused."""
        if not self._fusion_candidates(sel):
            return sel
        deeper = [r for r in sel.decode if r.decode_started]
        if not deeper or len(deeper) == len(sel.decode):
            return sel
        if self.block_manager.num_free_blocks < len(sel.decode) * self.config.num_planes:
            return sel  # the fused step might not get its blocks: no point holding rows for it
        self._stats["fusion_align_invocations"] += 1
        return Selection("decode", deeper, [], sel.loop_count)

    def _fused_tokens(self, sel, finalize: list) -> int:
        """How many tokens the next step may run fused (0: run one loop, the usual way).

        A fused step runs the tokens of every row in lock step, each token from depth 0, deciding
        exits on the device, and hands the device's sampled token of one token to the next one's
        prelude, so it needs: ``_fusion_candidates``, every row at depth 0, every row with that
        many tokens left, and the blocks of every token. Tokens and exit depths are the same as
        loop by loop (tests/engine/test_fused_decode.py, tests/engine/test_fused_exit.py): the sub-steps are the
        descriptors the loop-by-loop path would build, and the device applies the same rule.
        """
        if not self._fusion_candidates(sel):
            return 0
        rows = sel.decode
        if not self._fits_fused_bucket(len(rows), finalize):
            return 0
        if any(req.decode_started for req in rows):
            return 0
        return self._tokens_that_fit(rows)

    def _tokens_that_fit(self, rows: list[Request], done: int = 0) -> int:
        """``fused_decode_tokens``, or else 1, or else 0: the most tokens every row has left by
        ``max_tokens`` and gets the blocks of, ``done`` tokens after its token in flight. A guided
        or penalised row takes one token at a time: its grammar's next mask, or its counts, need
        the host to read the token before."""
        k = 1 if any(_host_coda(r.sampling_params) for r in rows) else self.config.fused_decode_tokens
        for want in sorted({k, 1}, reverse=True):
            if all(
                _tokens_left(req, done) >= want
                and self._grow_to(req, req.position_in_flight + done + want)  # blocks for every token
                for req in rows
            ):
                return want
        return 0

    # ------------------------------------------------------------ latency target: token cycles
    def _cycle_streams(self) -> Optional[tuple[list[Request], bool]]:
        """``(decoding requests, all at the start of a token)`` when a latency target's token
        cycles apply (``scheduler/latency_target.py``), else ``None``: a staged prefill mode with
        fused decode steps and no speculation, prompts prefilling beside the streams, and streams
        that would run fused on their own: within ``fused_decode_max_rows``, and no stream whose
        exit reads its gates beyond ``FUSED_GATED_MAX_ROWS`` streams (a fused step runs every row to
        the deepest row's exit). Depths may differ: lock step still beats loop by loop for such
        streams (docs/decisions.md, "Token cycles for streams of any exit")."""
        cfg = self.config
        if not cfg.fused_decode_max_rows or cfg.prefill_mode == "split" or self.round_policy is not None:
            return None
        decoding = [r for r in self.running if r.is_decoding]
        if not decoding or len(decoding) > cfg.fused_decode_max_rows:
            return None
        if not any(r.is_prefilling for r in self.running):
            return None
        if self._lockstep_too_costly(decoding):
            return None
        return decoding, not any(r.decode_started for r in decoding)

    def _fits_fused_bucket(self, n: int, finalize: list) -> bool:
        """``n`` decode rows and the ``finalize`` copies (a flat (src, dst) list) fit a bucket up to
        the one holding ``fused_decode_max_rows`` (the rows ``build_descriptor`` needs)."""
        need = descriptor_rows(n, n, n, len(finalize) // 2, self.num_loops)
        return self.bucket_spec.key_for(need).R <= self.bucket_spec.key_for(self.config.fused_decode_max_rows).R

    def _cycle_fused_fits(self, rows: list[Request], finalize: list) -> bool:
        """One fused token of ``rows`` fits the fused buckets (with ``finalize``) and gets its blocks."""
        if not self._fits_fused_bucket(len(rows), finalize):
            return False
        return all(_tokens_left(r) >= 1 and self._grow_to(r, r.position_in_flight + 1) for r in rows)

    def _cycle_prompt_ahead(self) -> Optional[BatchPlan]:
        """A token cycle's prompt-only invocation, built while the cycle's fused step is in flight
        (``schedule_ahead``): it needs nothing of that step's tokens, so the runner launches it
        right behind, and the host reads the step's tokens while the device runs the prompts."""
        if not self._cycle_prompt_due:
            return None
        t0 = time.perf_counter()
        plan = self._ahead = self._cycle_prompt_plan([])
        self._stats["schedule_time_s"] += time.perf_counter() - t0
        return plan

    def _cycle_prompt_plan(self, finalize: list) -> Optional[BatchPlan]:
        """The token cycle's next prompt-only invocation (``LatencyTarget.cycle_prompt_rows``
        rows), or ``None`` when the cycle's prompt budget is spent or no prompt range can run:
        then the cycle's next step is its fused one."""
        prefilling = [r for r in self.running if r.is_prefilling]
        budget = self.config.max_num_batched_tokens
        cap = self.latency.cycle_prompt_rows(prefilling, budget) if prefilling else 0
        sel = self.policy.select(prefilling, budget, self.num_loops, cap) if cap else None
        if sel is None or not sel.prompt:
            self._cycle_prompt_due = False
            return None
        self.latency.cycle_prompt_ran(sum(e - s for _, _, s, e in sel.prompt), prefilling)
        self._stats["cycle_prompt_invocations"] += 1
        return self._loop_plan(sel, finalize)

    def schedule_ahead(self) -> Optional[BatchPlan]:
        """The next fused decode step of the rows of the fused step in flight, built before that
        step's tokens are read, or ``None``. Asynchronous scheduling: the runner launches it right
        behind the one in flight, which the host then reads while the device runs this one.

        It continues every row from where the step in flight leaves it (positions and token
        counts advanced by that step's tokens; its first sub-step embeds the tokens that step
        samples last, on the device), so its tokens and exit depths are those the loop-by-loop
        path would give. Only when nothing else could run instead: every running request is one of
        its rows, none is waiting to be admitted, every row has the tokens left by ``max_tokens``
        and gets its blocks without preemption. A row that the step in flight ends (a stop token)
        still rides along: ``update`` drops its tokens, as it does for an aborted request, and
        the K/V it writes lands in freed blocks before any later invocation can use them (one
        device stream). ``update`` takes the two plans in launch order. Behind a latency target's
        token-cycle step it is the cycle's prompt-only invocation instead (``_cycle_prompt_ahead``)."""
        plan = self._inflight
        if plan is None or plan.sub_plans is None or self._ahead is not None:
            return None
        if self.latency is not None and self.latency.cycle_plan is plan:
            return self._cycle_prompt_ahead()
        t0 = time.perf_counter()
        rows = [self._requests.get(r.request_id) for r in plan.sub_plans[0].ranges]
        if any(r is None or r.status is not RequestStatus.RUNNING or r.pending_finalize for r in rows):
            return None  # aborted since
        if not self._fusion_candidates(Selection("decode", rows, [], 1)):
            return None
        done = len(plan.sub_plans) // self.num_loops  # tokens the step in flight gives every row
        if self._rounds_pay(rows, done):
            return None  # its next step is a round, whose positions depend on what this one gives
        want = self._tokens_that_fit(rows, done)
        if not want:
            return None
        ahead = self._ahead = self.fused_plan(rows, [], want, done)
        self._stats["ahead_launches"] += 1
        self._stats["schedule_time_s"] += time.perf_counter() - t0
        return ahead

    def fused_plan(self, rows: list[Request], finalize: list, tokens: int, done: int = 0) -> BatchPlan:
        """``tokens * T`` sub-steps (loop ``d`` of token ``j`` is sub-step ``j * T + d``), each
        the descriptor the loop-by-loop path builds for these rows at that loop, in one bucket;
        finalize copies go with sub-step 0, token ``j > 0`` embeds the token its row sampled on
        the device, and each token carries every row's exit rule (``device_exit_params``). Which
        sub-steps run is decided on the device; ``update`` counts them.

        ``done > 0`` (``schedule_ahead``): the rows' state as the fused step in flight leaves it,
        ``done`` tokens on; token 0 embeds that step's last tokens on the device too."""
        cfg, T = self.config, self.num_loops
        plane = (lambda d: d) if cfg.kv_layout == "last_exited" else (lambda d: 0)
        fin = np.fromiter(finalize, np.int64, len(finalize)).reshape(-1, 2)
        n = len(rows)
        slots = np.array([r.batch_slot for r in rows], np.int64)
        bases = np.array([r.ring_base for r in rows], np.int64)
        pos0 = np.array([r.position_in_flight + done for r in rows], np.int64)
        k0 = [len(r.output_token_ids) + done for r in rows]
        p = [r.sampling_params for r in rows]
        temp = np.array([x.temperature for x in p], np.float64)
        top_k = np.array([x.top_k for x in p], np.float64)
        top_p = np.array([x.top_p for x in p], np.float64)
        seed = np.array([x.seed for x in p], np.uint32)
        empty = np.zeros(0, np.int64)
        exits = self._exit_words(rows, tokens, done)  # every row makes every token (_tokens_that_fit)
        subs, descs, key = [], [], None
        # the device takes logprobs only for a batch that asks; a grammar's mask or a penalty's
        # counts need the token before, so such a batch's coda is sampled after launch (StepPipeline)
        extras = any(r.sampling_params.logprobs is not None for r in rows)
        deferred = any(_host_coda(r.sampling_params) for r in rows)
        last = np.array([r.output_token_ids[-1] for r in rows]) if not done else None
        planes = [plane(d) for d in range(T)]
        for j in range(tokens):
            pos = pos0 + j
            fed = j > 0 or done > 0  # loop 0 embeds the token sampled on the device
            token_descs = build_decode_loops(
                self.bucket_spec,
                self.block_manager.tables,
                seg_slot=slots,
                planes=planes,
                seg_pos=pos,
                seg_ring=bases,
                pre_token=np.zeros(n, np.int64) if fed else last,
                coda=dict(
                    row=np.arange(n),
                    temperature=temp,
                    top_k=top_k,
                    top_p=top_p,
                    seed=seed,
                    step=np.array(k0) + j,
                ),
                fin_src=fin[:, 0] if j == 0 else empty,
                fin_dst=fin[:, 1] if j == 0 else empty,
                feed_previous_tokens=fed,
                coda_extras=extras,
                key=key,
            )
            key = token_descs[0].key
            for d, desc in enumerate(token_descs):
                ranges = [
                    ScheduledRange(rows[i].request_id, Phase.DECODE, d, int(pos[i]), 1, int(pos[i]), int(bases[i]), i)
                    for i in range(n)
                ]
                coda = [CodaRow(rows[i].request_id, i, k0[i] + j, False) for i in range(n)] if d == T - 1 else []
                first = j == 0 and d == 0
                descs.append(desc)
                subs.append(
                    BatchPlan(
                        step=self._step,
                        kind="decode",
                        ranges=ranges,
                        coda=coda,
                        finalize=fin if first else fin[:0],
                        needs_gates=False,
                        needs_tokens=bool(coda),
                        loop_count=1,
                        num_rows=n,
                        descriptor=desc,
                    )
                )
        plan = BatchPlan(
            step=self._step,
            kind="fused_decode",
            ranges=[r for s in subs for r in s.ranges],
            coda=[c for s in subs for c in s.coda],
            finalize=fin,
            needs_gates=False,
            needs_tokens=True,
            loop_count=1,
            num_rows=n,
            descriptor=StackedDescriptor(descs, T, tuple(exits)),
            sub_plans=subs,
            deferred_coda=deferred,
        )
        self._step += 1
        st = self._stats
        st["launches"] += 1
        st["fused_launches"] += 1
        st["fused_tokens"] += tokens
        return plan

    def _exit_words(self, rows: list[Request], tokens: int, done: int = 0) -> np.ndarray:
        """``[4, tokens, rows]``: ``device_exit_params`` of each row's next ``tokens`` tokens, ``done``
        tokens after its token in flight (a synthetic row's draw of each token index)."""
        T = self.num_loops
        exits = np.zeros((4, tokens, len(rows)), np.float64)
        for i, r in enumerate(rows):
            p, k0 = r.sampling_params, len(r.output_token_ids) + done
            for j in range(tokens):
                target = None
                if p.exit_mode == "synthetic":
                    fresh = j == 0 and not done  # the token in flight's draw, made when it started
                    target = r.decode_target_loops if fresh else synthetic_exit_loops(p, T, r.request_id, k0 + j)
                exits[:, j, i] = device_exit_params(p, T, target)
        return exits

    def _apply_fused(self, plan: BatchPlan, out: np.ndarray, deltas: dict) -> None:
        """Apply a fused step token after token, as the loop-by-loop path would have: each row's
        token and exit depth as the device decided them (its finalize copies already made there),
        stop tokens and ``max_tokens`` ending a row mid-step (its later tokens are dropped), and
        the counters of the loops that ran (every row rides along until the last one exits): per
        token (``loops_run``), the token's deepest exit."""
        T, n, key = self.num_loops, plan.num_rows, plan.descriptor.key
        subs = plan.sub_plans
        tokens = len(subs) // T
        if out.ndim != 2 or out.shape[0] < tokens or out.shape[1] < key.C + key.R:
            raise ValueError(
                f"Scheduler.update: a fused step returns [tokens={tokens}, C + R={key.C + key.R}] tokens and "
                f"exit depths, got shape {out.shape}"
            )
        depths_all = out[:tokens, key.C : key.C + n]
        if depths_all.size and (depths_all.min() < 0 or depths_all.max() >= T):
            raise ValueError(f"Scheduler.update: fused step exit depths outside [0, {T - 1}]")
        st = self._stats
        runs = (depths_all.max(axis=1, initial=0) + 1).tolist()
        plan.descriptor.loops_run = runs
        # tokens each row made, counted when applied like fused_loops (fused_tokens counts them when
        # scheduled, a step ahead included): the loops per token of a stream are
        # fused_loops / fused_row_tokens
        st["fused_row_tokens"] += tokens
        for j in range(tokens):
            toks, depths, records = split_fused_output(out[j], key)
            toks, depths = toks.tolist(), depths.tolist()
            ran = runs[j] if j < len(runs) else 0
            for d in range(ran):
                self._count_loop(subs[j * T + d], n)
            if 0 < ran < T:  # the coda ran once, on the exit states
                st["coda_rows"] += len(subs[j * T + T - 1].coda)
            st["fused_loops"] += ran
            for r in subs[j * T].ranges:
                req = self._requests.get(r.request_id)
                if req is None or req.status is not RequestStatus.RUNNING:
                    continue  # aborted while in flight, or ended by an earlier token of this step
                i = r.row_start
                if self.latency is not None:
                    self.latency.observe_loops(depths[i] + 1)
                self._emit(req, int(toks[i]), depths[i], deltas, None if records is None else records[i])

    # ------------------------------------------------------------- speculation
    def _speculable(self, req: Request) -> bool:
        """Whether ``req``'s tokens may come from rounds: its coda needs nothing of the host per
        token (a grammar's mask, penalties' counts) and it asks for no logprobs."""
        sp = req.sampling_params
        return not _host_coda(sp) and sp.logprobs is None

    def _rounds_pay(self, rows: list[Request], in_flight: int = 0) -> bool:
        """Whether ``rows`` (each with ``in_flight`` more tokens than it has now) would take a round
        next: every one speculable and ``RoundPolicy`` finds that the round pays."""
        policy = self.round_policy
        if policy is None or not all(self._speculable(r) for r in rows):
            return False
        if policy.pays(rows, in_flight):
            return True
        self._stats["spec_declined_steps"] += 1  # drafts not accepted enough: a plain step
        return False

    def _speculates(self, sel, finalize: list) -> bool:
        """Whether the next step is a round of self-speculative decoding (``speculation.py``): the
        rows could run a fused step (``_fusion_candidates``), all at depth 0, every one speculable
        with the blocks of ``positions`` positions (no preemption, within ``max_model_len``),
        and the buckets hold the draft (within ``fused_decode_max_rows``) and the verify."""
        if self.round_policy is None or not self._fusion_candidates(sel):
            return False
        rows, k1, bs = sel.decode, self.round_policy.positions, self.bucket_spec
        if any(r.decode_started for r in rows) or not self._rounds_pay(rows):
            return False
        n, pairs = len(rows), len(finalize) // 2
        if (
            bs.key_for(descriptor_rows(n, n, n, pairs, self.num_loops)).R
            > bs.key_for(self.config.fused_decode_max_rows).R
        ):
            return False
        if n * k1 > bs.row_buckets[-1]:
            return False
        # a row with fewer tokens left still drafts every position (``update`` keeps what it may)
        end = self.config.max_model_len
        return all(r.position_in_flight + k1 <= end and self._grow_to(r, r.position_in_flight + k1) for r in rows)

    def spec_plan(self, rows: list[Request], finalize: list) -> BatchPlan:
        """A round for ``rows`` (``SpecDescriptor``): ``positions`` draft tokens of ``d`` loops, each
        the descriptors the loop-by-loop path builds for those loops, position ``p + j`` in ring row
        ``base + j``; then ``T - d`` verify loops of every row's positions as one segment. Every
        position carries its token's sampling and exit words (``device_exit_params``, the synthetic
        draw of its token index); pending finalize copies go with the first draft sub-step."""
        cfg, T = self.config, self.num_loops
        spec = cfg.speculative_config
        d, k1 = spec.draft_loops, spec.positions
        fin = np.fromiter(finalize, np.int64, len(finalize)).reshape(-1, 2)
        n = len(rows)
        slots = np.array([r.batch_slot for r in rows], np.int64)
        bases = np.array([r.ring_base for r in rows], np.int64)
        pos0 = np.array([r.position_in_flight for r in rows], np.int64)
        k0 = np.array([len(r.output_token_ids) for r in rows], np.int64)
        p = [r.sampling_params for r in rows]
        samp = dict(
            temperature=np.array([x.temperature for x in p], np.float64),
            top_k=np.array([x.top_k for x in p], np.float64),
            top_p=np.array([x.top_p for x in p], np.float64),
            seed=np.array([x.seed for x in p], np.uint32),
        )
        exits = self._exit_words(rows, k1)
        last = np.array([r.output_token_ids[-1] for r in rows], np.int64)
        empty = np.zeros(0, np.int64)
        draft, key = [], None
        for j in range(k1):
            descs = build_decode_loops(
                self.bucket_spec,
                self.block_manager.tables,
                seg_slot=slots,
                planes=list(range(d)),
                seg_pos=pos0 + j,
                seg_ring=bases + j,
                pre_token=last if j == 0 else np.zeros(n, np.int64),
                coda=dict(row=np.arange(n), step=k0 + j, **samp),
                fin_src=fin[:, 0] if j == 0 else empty,
                fin_dst=fin[:, 1] if j == 0 else empty,
                feed_previous_tokens=j > 0,  # the token the draft sampled at position p + j - 1
                key=key,
            )
            key = descs[0].key
            draft += descs
        verify, vkey = [], None
        for i in range(T - d):
            desc = build_descriptor(
                self.bucket_spec,
                self.block_manager.tables,
                seg_slot=slots,
                seg_plane=np.full(n, d + i),
                seg_pos=pos0,
                seg_len=np.full(n, k1),
                seg_ring=bases,
                pre_ring=empty,
                pre_token=empty,
                coda_row=empty,
                coda_temperature=empty,
                coda_top_k=empty,
                coda_top_p=empty,
                coda_seed=empty.astype(np.uint32),
                coda_step=empty,
                fin_src=empty,
                fin_dst=empty,
                key=vkey,
            )
            vkey = desc.key
            verify.append(desc)
        words = np.zeros((len(VERIFY_FIELDS), vkey.R), np.int32)
        w = {name: words[i] for i, name in enumerate(VERIFY_FIELDS)}
        w["exit_threshold"].view(np.float32)[:] = 1.0  # padding rows: the gate off
        rows_of = slice(0, n * k1)  # verify row i * k1 + j
        w["temperature"].view(np.float32)[rows_of] = np.repeat(samp["temperature"], k1)
        w["top_k"][rows_of] = np.repeat(samp["top_k"], k1)
        w["top_p"].view(np.float32)[rows_of] = np.repeat(samp["top_p"], k1)
        w["seed"].view(np.uint32)[rows_of] = np.repeat(samp["seed"], k1)
        w["step"][rows_of] = (k0[:, None] + np.arange(k1)[None, :]).ravel()
        for f, name in enumerate(("exit_limit", "exit_min_loops", "exit_delay")):
            w[name][rows_of] = exits[f].T.ravel()
        w["exit_threshold"].view(np.float32)[rows_of] = exits[3].T.ravel()
        ranges = [
            ScheduledRange(r.request_id, Phase.DECODE, 0, int(pos0[i]), k1, int(pos0[i]), int(bases[i]), i)
            for i, r in enumerate(rows)
        ]
        plan = BatchPlan(
            step=self._step,
            kind="spec_decode",
            ranges=ranges,
            coda=[],
            finalize=fin,
            needs_gates=False,
            needs_tokens=True,
            loop_count=1,
            num_rows=n,
            descriptor=SpecDescriptor(StackedDescriptor(draft, d, tuple(exits)), verify, words, k1),
            speculative=True,
        )
        self._step += 1
        st = self._stats
        st["launches"] += 1
        st["spec_rounds"] += 1
        return plan

    def _apply_spec(self, plan: BatchPlan, out: np.ndarray, deltas: dict) -> None:
        """Apply a round: each row's kept tokens and exit depths in order, as plain decoding would
        emit them (a stop token or ``max_tokens`` ends a row there; its later tokens are dropped),
        and the counters of acceptance (a row's drafts accepted in a row, of ``positions``)."""
        k1 = plan.descriptor.key.positions
        if out.ndim != 2 or out.shape[0] < plan.num_rows or out.shape[1] < 2 + 2 * k1:
            raise ValueError(
                f"Scheduler.update: a round returns [>= {plan.num_rows}, {2 + 2 * k1}] int32, got shape {out.shape}"
            )
        accepted, count, toks, depths = split_spec_output(out, k1)
        if plan.num_rows and (count[: plan.num_rows].min() < 1 or count[: plan.num_rows].max() > k1):
            raise ValueError(f"Scheduler.update: a round kept a token count outside [1, {k1}]")
        for r in plan.ranges:
            i, n = r.row_start, int(count[r.row_start])
            req = self._requests.get(r.request_id)  # None: aborted while in flight
            self._end_round(req, k1, int(accepted[i]), toks[i, :n].tolist(), depths[i, :n].tolist(), deltas)

    def _end_round(self, req: Optional[Request], positions: int, accepted: int, tokens, depths, deltas) -> None:
        """A row's round ended, fused or loop by loop: its kept tokens emitted in order, as plain
        decoding would emit them (a stop token or ``max_tokens`` ends the request there; the
        round's later tokens are dropped), the counters of acceptance, the policy's estimate."""
        st = self._stats
        st["spec_row_rounds"] += 1
        st["spec_proposed_tokens"] += positions
        st["spec_accepted_tokens"] += accepted
        st["spec_round_tokens"] += len(tokens)
        for t, e in zip(tokens, depths):
            if req is None or req.status is not RequestStatus.RUNNING:
                break
            self._emit(req, t, e, deltas)
            st["spec_emitted_tokens"] += 1
        if req is not None and req.status is RequestStatus.RUNNING:
            self.round_policy.observe(req, len(tokens))

    # -------------------------------------------------------- rounds loop by loop
    def _start_loop_round(self, req: Request) -> Optional[LoopRound]:
        """A round of ``req`` on the loop-by-loop path (``speculation.LoopRound``), where a prompt
        in flight keeps the batch from fused steps and their rounds: when its token in flight is
        at depth 0, its drafts pay (``RoundPolicy``) and it gets the blocks of every position."""
        policy = self.round_policy
        if policy is None or req.decode_depth or not self._rounds_pay([req]):
            return None
        k1, p0 = policy.positions, req.position_in_flight
        if p0 + k1 > self.config.max_model_len or not self._grow_to(req, p0 + k1):
            return None
        req.loop_round = LoopRound(p0, len(req.output_token_ids), k1, self.config.speculative_config.draft_loops)
        self._stats["spec_loop_rounds"] += 1
        return req.loop_round

    def _reserve_verify_rows(self) -> dict:
        """Rows (and coda rows) each loop-by-loop verify under way takes beyond the one the policy
        counts per decoding request, in admission order while they fit beside one row of every
        decoding request; the first always (the policy's budget shrinks by it, and the bucket's
        coda rows hold one verify beside every request: ``extra_coda_rows``). One that does not
        fit waits an invocation."""
        if self.round_policy is None:
            return {}
        cfg = self.config
        rows = cfg.max_num_batched_tokens - sum(r.is_decoding for r in self.running)
        codas = self.bucket_spec.coda_cap - len(self.running)
        out = {}
        for r in self.running:
            rnd = r.loop_round
            if rnd is not None and not rnd.drafting:
                need = len(rnd.active()) - 1
                if (need <= rows and need <= codas) or not out:
                    out[r.request_id] = need
                    rows, codas = rows - need, codas - need
        return out

    def _apply_round_rows(self, req: Request, r: ScheduledRange, gates, toks, coda_index) -> None:
        """A loop of a round's rows: the position being drafted (its exit for real, or cut after
        the draft's last loop with its drafted token), or the verify's positions (each to its own
        exit, finalized upward at once: the positions after it read those planes next)."""
        T, p, rnd = self.num_loops, req.sampling_params, req.loop_round  # LAST_EXITED: rounds need it
        if rnd.drafting:
            d = r.depth
            out = self._exits(req, p, d, gates, r.row_start)
            if not out and d < rnd.draft_loops - 1:
                req.decode_depth += 1
                return
            tok = int(toks.get()[coda_index[r.row_start]])
            s = PositionState(req.exit_remaining, req.gates_folded, req.pending_gates, req.decode_target_loops)
            if out:
                s.token, s.exit_depth = tok, d
                if d < T - 1:
                    self._queue_finalize(req, r.token_start, d)
            else:
                s.drafted = tok
            rnd.states.append(s)
            if rnd.j < rnd.positions:
                req.start_token(self._target(req, rnd.k0 + rnd.j))
            else:
                rnd.verify_depth = rnd.draft_loops
            return
        t = r.depth
        rnd.verified = t
        for i in range(r.token_count):
            s = rnd.states[r.token_start - rnd.p0 + i]
            if self._exits(s, p, t, gates, r.row_start + i):
                s.token, s.exit_depth = int(toks.get()[coda_index[r.row_start + i]]), t
                if t < T - 1:
                    self._queue_finalize(req, r.token_start + i, t)

    def _end_loop_round(self, req: Request, deltas: dict) -> None:
        """Every position of ``req``'s round exited: its kept tokens in order, as plain decoding
        would emit them (``LoopRound.result``), and the counters of acceptance."""
        rnd, req.loop_round = req.loop_round, None
        accepted, _, tokens, depths = rnd.result()
        self._end_round(req, rnd.positions, accepted, tokens, depths, deltas)

    # ------------------------------------------------------------------ update
    def update(
        self,
        plan: BatchPlan,
        gate_logits: ArrayOrThunk,
        tokens: ArrayOrThunk,
        logprobs: Optional[ArrayOrThunk] = None,
    ) -> list[RequestDelta]:
        """Apply the results of ``plan``: ``gate_logits [>= num_rows]`` float, ``tokens [>= coda
        rows]`` int, each an array or a zero-argument callable returning one (read lazily). With a
        step scheduled ahead, ``plan`` is the older of the two; the other is in flight next.
        ``logprobs [C, LOGPROB_WORDS]`` int32: the coda rows' logprob records, needed by a one-loop
        plan with a coda row of a request that asks for logprobs (a fused step returns them with
        its tokens)."""
        if plan is not self._inflight:
            raise RuntimeError("Scheduler.update: this plan is not the oldest one in flight")
        t0 = time.perf_counter()
        deltas: dict[object, RequestDelta] = {}
        if plan.speculative:
            self._apply_spec(plan, np.asarray(tokens() if callable(tokens) else tokens), deltas)
        elif plan.sub_plans is None:
            lps = None
            if logprobs is not None:
                lps = _Lazy(logprobs, "logprobs", len(plan.coda) * LOGPROB_WORDS, LOGPROB_WORDS)
            self._apply(
                plan,
                _Lazy(gate_logits, "gate_logits", plan.num_rows),
                _Lazy(tokens, "tokens", len(plan.coda)),
                deltas,
                lps,
            )
        else:  # a fused step: [tokens, C + R (+ C * LOGPROB_WORDS)] tokens, exit depths, logprob records
            self._apply_fused(plan, np.asarray(tokens() if callable(tokens) else tokens), deltas)
        self._inflight, self._ahead = self._ahead, None
        self._stats["update_time_s"] += time.perf_counter() - t0
        return list(deltas.values())

    def _apply(self, plan: BatchPlan, gates: "_Lazy", toks: "_Lazy", deltas: dict, lps: Optional["_Lazy"]) -> None:
        T = self.num_loops
        coda_index = {c.row: i for i, c in enumerate(plan.coda)}
        for r in plan.ranges:
            req = self._requests.get(r.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the plan was in flight
            if r.phase is Phase.PRELUDE:
                req.num_preluded_tokens = max(req.num_preluded_tokens, r.token_end)
            elif r.phase is Phase.RECURRENT:
                f = req.prefill_depth_frontiers
                assert f[r.depth] == r.token_start, "a prompt range must start at its depth's frontier"
                f[r.depth] = r.token_end
                if req.recompute_caps is not None:
                    self._finalize_rebuilt(req, r)
                    req.skip_capped()
                if r.depth == T - 1:
                    if self._shares_prompts(req):
                        self._publish(req)
                    if r.token_end == req.prefill_len and not req.output_token_ids:
                        i = coda_index[r.row_start + r.token_count - 1]
                        self._emit(req, int(toks.get()[i]), T - 1, deltas, _logprob_record(req, lps, i))
            else:
                self._apply_decode(req, r, gates, toks, coda_index, deltas, lps)
        if self.round_policy is not None:
            self._advance_loop_rounds(plan, deltas)

    def _advance_loop_rounds(self, plan: BatchPlan, deltas: dict) -> None:
        """After a plan's rows are applied: each loop-by-loop verify that ran moves one loop
        deeper, and a round whose positions have all exited ends (``_end_loop_round``)."""
        for rid in {r.request_id for r in plan.ranges if r.phase is Phase.DECODE}:
            req = self._requests.get(rid)
            rnd = None if req is None else req.loop_round
            if rnd is not None and rnd.verified is not None:  # a loop of its verify ran
                rnd.verify_depth, rnd.verified = rnd.verified + 1, None
            if rnd is not None and not rnd.drafting and not rnd.active():
                self._end_loop_round(req, deltas)

    def _exits(self, state, params, d: int, gates, row: int) -> bool:
        """Does the token of ``state`` (a ``Request``'s token in flight, or a round's
        ``PositionState``) exit after loop ``d``, whose gate is row ``row`` of ``gates``: fold
        the gates its rule reads by then, and decide."""
        T = self.num_loops
        if gate_needed(params, T, d):
            state.pending_gates.append((gates, row))
        need = gates_needed_at(params, T, d + 1)
        while state.gates_folded < need:
            lazy, i = state.pending_gates[state.gates_folded]
            state.exit_remaining = fold_gate(state.exit_remaining, lazy.get()[i])
            state.gates_folded += 1
        return decide_exit(params, T, d + 1, state.exit_remaining, state.decode_target_loops)

    def _apply_decode(self, req, r, gates, toks, coda_index, deltas, lps) -> None:
        T, params, d = self.num_loops, req.sampling_params, r.depth
        if req.loop_round is not None:
            self._apply_round_rows(req, r, gates, toks, coda_index)
            return
        if not self._exits(req, params, d, gates, r.row_start):
            req.decode_depth += 1
            return
        if self.latency is not None:
            self.latency.observe_loops(d + 1)
        i = coda_index[r.row_start]
        self._emit(req, int(toks.get()[i]), d, deltas, _logprob_record(req, lps, i))
        if req.status is RequestStatus.RUNNING and self.config.kv_layout == "last_exited" and d < T - 1:
            self._queue_finalize(req, r.token_start, d)

    def _queue_finalize(self, req: Request, pos: int, d: int) -> None:
        """Copy position ``pos``'s plane-``d`` K/V into planes ``d+1..T-1`` in the next invocation."""
        bs = self.config.block_size
        off = pos % bs
        col = self.block_manager.tables[req.batch_slot, :, pos // bs].tolist()  # the position's block, per plane
        src = col[d] * bs + off
        for p in range(d + 1, self.num_loops):
            req.pending_finalize += (src, col[p] * bs + off)

    def _finalize_rebuilt(self, req: Request, r: ScheduledRange) -> None:
        """Rebuilt generated positions of ``r`` whose cap is its depth are finalized as they were."""
        if self.config.kv_layout != "last_exited" or r.depth == self.num_loops - 1:
            return
        n = req.num_prompt_tokens
        lo = max(r.token_start, n)
        if lo >= r.token_end:
            return
        for i in np.flatnonzero(req.recompute_caps[lo - n : r.token_end - n] == r.depth).tolist():
            self._queue_finalize(req, lo + i, r.depth)

    def _publish(self, req: Request) -> None:
        """Offer the prefix cache every full prompt block whose positions are final in every plane."""
        bm, bs = self.block_manager, self.config.block_size
        full = min(req.num_prefilled_tokens, req.num_prompt_tokens) // bs
        while req.num_published_blocks < full:
            i = req.num_published_blocks
            bm.publish(req.request_id, i, req.block_hashes[i], shared=req.shares_prompt)
            req.num_published_blocks += 1

    def _emit(self, req: Request, tok: int, depth: int, deltas, record=None) -> None:
        """Record generated token ``tok`` (exit depth ``depth``, logprob ``record`` when the request
        asks for logprobs); finish or start the next token. Stamped now: the host holds the token
        only once the device result has been read (metrics)."""
        now = time.monotonic()
        req.append_token(tok, depth, now)
        k = req.sampling_params.logprobs
        if k is not None:
            if record is None:
                raise RuntimeError(f"request {req.request_id!r} asks for logprobs but its step returned none")
            lp = read_logprobs(record, tok, k)
            req.output_logprobs.append(lp)
            req.cumulative_logprob += lp.logprob
        delta = deltas.get(req.request_id)
        if delta is None:
            delta = deltas[req.request_id] = RequestDelta(req.request_id, [], [], False, None)
        delta.new_token_ids.append(tok)
        delta.new_exit_depths.append(depth)
        self._stats["tokens"] += 1
        params = req.sampling_params
        reason = None
        if tok in params.stop_token_ids or (not params.ignore_eos and tok in self.config.eos_token_ids):
            reason = "stop"
        elif len(req.output_token_ids) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            self._release(req)
            req.finish(reason, now)
            del self._requests[req.request_id]
            delta.finished, delta.finish_reason = True, reason
            return
        req.start_token(self._target(req, len(req.output_token_ids)))  # the token the next loops produce

    def observe(self, plans, seconds: float) -> None:
        """``plans`` (a plan or a list, launched in order) took ``seconds`` of wall time together:
        the latency target's cost model learns from it (a no-op without ``target_tpot_ms``)."""
        if self.latency is not None:
            self.latency.observe(plans, seconds)

    # ------------------------------------------------------------------- stats
    def stats(self) -> dict:
        st = dict(self._stats)
        if self.latency is not None:
            st.update(self.latency.stats())
        for k in (
            "invocations",
            "real_rows",
            "padded_rows",
            "decode_rows",
            "prefill_rows",
            "prelude_tokens",
            "coda_rows",
            "speculative_coda_rows",
            "finalize_pairs",
            "tokens",
            "aborted",
            "launches",
            "fused_launches",
            "ahead_launches",
            "fused_loops",
            "fused_tokens",
            "fused_row_tokens",
            "fusion_align_invocations",
            "preemptions",
            "admissions",
            "max_running",
            "prefix_cache_hit_tokens",
            "prefix_cache_queried_tokens",
            "shared_prompt_tokens",
            "spec_rounds",
            "spec_row_rounds",
            "spec_proposed_tokens",
            "spec_accepted_tokens",
            "spec_round_tokens",
            "spec_declined_steps",
            "spec_loop_rounds",
            "spec_emitted_tokens",
        ):
            st.setdefault(k, 0)
        # accepted drafts of those proposed, and tokens a row got per round (1 .. positions)
        st["spec_acceptance"] = st["spec_accepted_tokens"] / max(1, st["spec_proposed_tokens"])
        st["spec_mean_accepted_length"] = st["spec_round_tokens"] / max(1, st["spec_row_rounds"])
        st["prefix_cache_hit_rate"] = st["prefix_cache_hit_tokens"] / max(1, st["prefix_cache_queried_tokens"])
        st.setdefault("schedule_time_s", 0.0)
        st.setdefault("update_time_s", 0.0)
        st["host_time_s"] = st["schedule_time_s"] + st["update_time_s"]
        inv = max(1, st["invocations"])
        st["rows_per_invocation"] = st["real_rows"] / inv
        st["host_time_per_invocation_s"] = st["host_time_s"] / inv
        st["row_buckets_used"] = dict(sorted(self._keys_used.items()))
        st["waiting"], st["running"] = len(self.waiting), len(self.running)
        bm = self.block_manager
        st["free_blocks"] = bm.num_free_blocks  # idle prefix-cache blocks count: they are evicted on demand
        st["used_blocks"] = bm.num_used_blocks
        st["cached_blocks"] = bm.num_cached_blocks
        st["kv_allocation"] = self.config.kv_allocation
        st["prefix_caching"] = self.config.enable_prefix_caching
        return st
