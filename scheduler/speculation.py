"""Self-speculative decoding: the model's first loops draft, its full depth verifies.

Ouro's early loops are a draft model for free. A *round* of a batch of decode rows (all at depth
0, as a fused decode step's) runs on the device in two executables, with no host round trip per
drafted token (``ouro_jax/speculative.py``):

1. **draft**: ``k + 1`` draft tokens, each ``d`` loops (``draft_loops``) at positions ``p .. p + k``
   of every row, the drafted token fed to the next one's prelude on the device. A row whose exit
   rule fires within those ``d`` loops exits for real: its token, exit depth and finalize copies
   are plain decoding's. Every other row is *cut* at depth ``d - 1``; its depth-``d - 1`` hidden
   state stays in its ring row ``base + j``.
2. **verify**: the ``k + 1`` positions of every row as one segment, resumed from the draft's
   hidden states at loops ``d .. T - 1`` in lock step, each row to its own exit depth by the
   request's exit rule (an exited row's plane is copied into the planes above at once, so the
   positions after it read what plain decoding would). Loops ``0 .. d - 1`` of a drafted position
   computed exactly what plain decoding computes there (same weights, inputs and KV) as long as
   every token before it was accepted, so its K/V at those planes are kept.

Then position ``j``'s draft token is accepted by the rule of speculative sampling against the
full-depth distribution (greedy: when it equals the argmax); the first rejected position takes a
token from the residual distribution and ends the row's round. A round gives every row 1 to
``k + 1`` tokens for ``d * (k + 1) + (T - d)`` loops; greedy tokens and exit depths are plain
decoding's, sampled ones follow plain decoding's distribution (not its ids for a seed).

Rounds pay only where drafts are accepted: at none, a round costs ~2.3 plain tokens for one
(``docs/decisions.md``). ``RoundPolicy`` keeps each request's tokens per round and runs a round
only while the batch's mean pays for it; a request below that decodes plainly and probes again
after a back-off that doubles each time a probe fails.

Where a prompt in flight keeps the batch from fused steps, a request's round runs on the
loop-by-loop path instead (``LoopRound``), as rows beside the prompt's: its ``k + 1`` positions
drafted one loop per invocation (``d`` loops each, position ``p + j`` in ring row ``base + j``),
then its cut positions verified together, loop ``t`` of every one still running in one
invocation, each to its own exit. The host keeps a draft while it equals the token its position
gives at full depth (exact match, with plain decoding's key for both: its tokens are plain
decoding's, sampled ones too).

This module is the jax-free part: the option, the policy, the round's layout and its
loop-by-loop state.
"""

from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple, Optional

import numpy as np

from .buckets import BucketKey
from .descriptor import EXIT_FIELDS, BatchDescriptor, StackedDescriptor, descriptor_layout, exit_words

__all__ = [
    "METHODS",
    "LoopRound",
    "PositionState",
    "RoundGain",
    "RoundPolicy",
    "SpecDescriptor",
    "SpecKey",
    "SpeculativeConfig",
    "VERIFY_FIELDS",
    "spec_layout",
    "spec_output_width",
    "speculative_option",
    "split_spec_output",
]

METHODS = ("loops",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``{"method": "loops", "draft_loops": d, "num_speculative_tokens": k}``: draft ``k`` tokens
    (and the bonus position) with ``d`` loops, verify at full depth (the module docstring)."""

    draft_loops: int = 1
    num_speculative_tokens: int = 3
    method: str = "loops"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        for name in ("draft_loops", "num_speculative_tokens"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}")

    @property
    def positions(self) -> int:
        """Positions a round drafts and verifies per row: ``k + 1``."""
        return self.num_speculative_tokens + 1

    def check(self, num_loops: int) -> None:
        """``ValueError`` unless the draft is shallower than the model (``1 <= d < T``)."""
        if self.draft_loops >= num_loops:
            raise ValueError(
                f"speculative_config: draft_loops={self.draft_loops} must be below the model's {num_loops} loops "
                "(the verify runs the loops the draft did not)"
            )

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "draft_loops": self.draft_loops,
            "num_speculative_tokens": self.num_speculative_tokens,
        }

    def __str__(self) -> str:  # the flag's text (engine_config.to_argv)
        return json.dumps(self.to_dict())


def speculative_option(name: str, value) -> Optional[SpeculativeConfig]:
    """``None``, a ``SpeculativeConfig``, a dict or its JSON text -> ``SpeculativeConfig`` or
    ``None``; ``ValueError`` naming ``name`` for anything else (an unknown key included)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not JSON ({e.msg}): {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict like {{'method': 'loops', 'draft_loops': 1, ...}}, got {value!r}")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; known: {sorted(known)}")
    return SpeculativeConfig(**value)


# ------------------------------------------------------------------------------------ policy
#: A round's time over its loop count, against plain tokens': its drafted positions each pay a
#: token's coda and sampling, and its host work cannot overlap the device (measured on the H200:
#: docs/decisions.md, "Self-speculative decoding").
ROUND_COST_FACTOR = 1.3
#: Plain tokens a request decodes after a failed probe before it probes again (doubling, capped).
MIN_BACKOFF, MAX_BACKOFF = 16, 1024
#: A request's estimate: its last ``WINDOW`` rounds' tokens, beside ``PRIOR_WEIGHT`` rounds of a
#: prior (every position for a new request, break-even for a probe). A round's tokens vary widely
#: (at 80% per draft: 1 token 20% of the time, 4 tokens 51%), so a short memory would pause
#: requests whose drafts pay (a halving average did: docs/decisions.md).
WINDOW, PRIOR_WEIGHT = 8, 2


@dataclasses.dataclass
class RoundGain:
    """A request's record in rounds: the tokens of its last rounds and the prior beside them, and
    while below break-even, the output length of its next probe and the back-off after it."""

    prior: float
    counts: list = dataclasses.field(default_factory=list)
    probe_at: int = 0
    backoff: int = MIN_BACKOFF

    @property
    def tokens_per_round(self) -> float:
        return (PRIOR_WEIGHT * self.prior + sum(self.counts)) / (PRIOR_WEIGHT + len(self.counts))


class RoundPolicy:
    """Whether a round pays for a batch of rows: a round gives every row its tokens per round for
    ``break_even`` plain steps' time, so it runs while the rows' mean expected tokens per round is
    at least that. A request that never took part expects every position accepted; one below
    break-even expects exactly break-even once its probe is due, and the probe starts its record
    afresh. Decisions depend on token counts only, so a seeded run takes the same rounds every
    time."""

    def __init__(self, spec: SpeculativeConfig, num_loops: int):
        d, k1, T = spec.draft_loops, spec.positions, num_loops
        self.positions = k1
        self.break_even = ROUND_COST_FACTOR * (d * k1 + T - d) / T

    def _probing(self, g: RoundGain, done: int) -> bool:
        return g.tokens_per_round < self.break_even and done >= g.probe_at

    def _expected(self, req, in_flight: int = 0) -> float:
        g = req.spec_gain
        if g is None:
            return float(self.positions)
        if self._probing(g, len(req.output_token_ids) + in_flight):
            return self.break_even
        return g.tokens_per_round

    def pays(self, rows, in_flight: int = 0) -> bool:
        """Whether a round of ``rows`` pays; ``in_flight``: tokens each row gets from a step still
        running (a step scheduled ahead decides as the step after it would)."""
        return sum(self._expected(r, in_flight) for r in rows) >= self.break_even * len(rows)

    def observe(self, req, tokens: int) -> None:
        """``req`` got ``tokens`` from a round (call after they are emitted)."""
        g = req.spec_gain
        done = len(req.output_token_ids)
        if g is None:
            g = req.spec_gain = RoundGain(float(self.positions))
        elif self._probing(g, done - tokens):
            g.prior, g.counts = self.break_even, []
        g.counts = (g.counts + [tokens])[-WINDOW:]
        if g.tokens_per_round >= self.break_even:
            g.probe_at, g.backoff = 0, MIN_BACKOFF
        elif done >= g.probe_at:  # fell below, or a probe failed: plain decoding for a while
            g.probe_at, g.backoff = done + g.backoff, min(2 * g.backoff, MAX_BACKOFF)


# ------------------------------------------------------------------ rounds loop by loop
@dataclasses.dataclass
class PositionState:
    """One position of a loop-by-loop round: its exit state (the fields ``Request`` keeps for its
    token in flight), its token (drafted, or final once it exits) and its exit depth (-1: cut)."""

    exit_remaining: float = 1.0
    gates_folded: int = 0
    pending_gates: list = dataclasses.field(default_factory=list)
    decode_target_loops: Optional[int] = None
    token: int = -1
    drafted: int = -1  # the token its draft gave (a cut position)
    exit_depth: int = -1

    @property
    def fed(self) -> int:
        """The token the next position's prelude embeds: the drafted one, or the exit's own."""
        return self.drafted if self.drafted >= 0 else self.token


class LoopRound:
    """A request's round on the loop-by-loop path, beside prompt rows (``Scheduler``): its token
    in flight and the ``positions - 1`` after it drafted one loop per invocation, position ``p0 +
    j`` in ring row ``base + j`` (the request's own decode state runs the position being
    drafted); then the cut positions verified together, loop ``t`` of every one still running in
    one invocation. A draft is kept while it equals the token its position gives at full depth
    (exact match: the round's tokens are plain decoding's, sampled ones too)."""

    def __init__(self, p0: int, k0: int, positions: int, draft_loops: int):
        self.p0, self.k0, self.positions, self.draft_loops = p0, k0, positions, draft_loops
        self.states: list[PositionState] = []  # one per position drafted so far
        self.verify_depth: Optional[int] = None  # the loop the verify runs next (None: drafting)
        self.verified: Optional[int] = None  # the verify's loop applied in the current update

    @property
    def drafting(self) -> bool:
        return self.verify_depth is None

    @property
    def j(self) -> int:
        """The position being drafted."""
        return len(self.states)

    def active(self) -> list[int]:
        """The verify's positions still running (cut and not exited yet)."""
        return [j for j, s in enumerate(self.states) if s.exit_depth < 0]

    def runs(self) -> list[tuple[int, int]]:
        """The active positions as ``[start, end)`` runs of consecutive ones."""
        out: list[tuple[int, int]] = []
        for j in self.active():
            if out and out[-1][1] == j:
                out[-1] = (out[-1][0], j + 1)
            else:
                out.append((j, j + 1))
        return out

    def result(self) -> tuple[int, int, list[int], list[int]]:
        """``(accepted drafts, tokens kept, tokens, exit depths)`` once every position exited:
        positions are kept in order while each drafted token equals its final one (an exit
        within the draft counts as agreeing); the first that differs is kept with its final
        token and ends the round."""
        tokens, depths, accepted = [], [], 0
        for s in self.states:
            tokens.append(s.token)
            depths.append(s.exit_depth)
            if s.drafted >= 0 and s.drafted != s.token:
                break
            accepted += 1
        return accepted, len(tokens), tokens, depths


# ------------------------------------------------------------------------------- descriptors
#: Per verify row ``r = i * positions + j`` (request ``i``, position ``p + j``): the sampling words
#: of its token (float32 / uint32 as bits) and its exit words (``descriptor.EXIT_FIELDS``).
VERIFY_FIELDS = ("temperature", "top_k", "top_p", "seed", "step") + EXIT_FIELDS


class SpecKey(NamedTuple):
    """The executables of a round: the draft's bucket (a row per request), the verify's bucket (a
    row per request and position), the draft's loops, the positions per request, the model's
    loops; ``stage`` names one of the two executables (``"draft"`` or ``"verify"``)."""

    draft: BucketKey
    verify: BucketKey
    draft_loops: int
    positions: int
    num_loops: int
    stage: str = "draft"

    def at(self, stage: str) -> "SpecKey":
        return self._replace(stage=stage)


class SpecLayout(NamedTuple):
    """Where a round's parts lie in its packed int32 array (offsets and shapes in words)."""

    draft_offset: int
    draft_shape: tuple  # [positions * d, draft words + exit words]
    verify_offset: int
    verify_shape: tuple  # [T - d, verify words]
    words_offset: int
    words_shape: tuple  # [len(VERIFY_FIELDS), verify R]
    size: int


def _words(key: BucketKey) -> int:
    last = descriptor_layout(key)[-1]
    return last.offset + last.size


def spec_layout(key: SpecKey) -> SpecLayout:
    draft_shape = (key.positions * key.draft_loops, _words(key.draft) + exit_words(key.draft))
    verify_shape = (key.num_loops - key.draft_loops, _words(key.verify))
    words_shape = (len(VERIFY_FIELDS), key.verify.R)
    sizes = [int(np.prod(s)) for s in (draft_shape, verify_shape, words_shape)]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return SpecLayout(offsets[0], draft_shape, offsets[1], verify_shape, offsets[2], words_shape, offsets[3])


class SpecDescriptor:
    """A round in the runner's words: ``draft``, a ``StackedDescriptor`` of ``positions`` tokens of
    ``d`` loops each (the descriptors the loop-by-loop path builds for those loops, ring row
    ``base + j`` for position ``p + j``; finalize pairs pending from before on its first
    sub-step); ``verify``, ``T - d`` descriptors of one bucket, loop ``d + i`` of every request's
    ``positions`` rows as one segment (no prelude, no coda); ``words [len(VERIFY_FIELDS), R]``, each
    verify row's sampling and exit words. ``pack()`` is one flat int32 array (``spec_layout``)."""

    def __init__(self, draft: StackedDescriptor, verify: list[BatchDescriptor], words: np.ndarray, positions: int):
        if not verify or any(v.key != verify[0].key for v in verify):
            raise ValueError("SpecDescriptor: the verify needs one or more descriptors of one key")
        T = draft.num_loops + len(verify)
        self.key = SpecKey(draft.key, verify[0].key, draft.num_loops, positions, T)
        if draft.num_tokens != positions:
            raise ValueError(f"SpecDescriptor: the draft holds {draft.num_tokens} tokens, the round {positions}")
        self.draft, self.verify, self.words = draft, verify, words
        if words.shape != spec_layout(self.key).words_shape:
            raise ValueError(f"SpecDescriptor: words must be {spec_layout(self.key).words_shape}, got {words.shape}")

    @property
    def num_requests(self) -> int:
        return self.draft.steps[0].num_rows

    def pack(self) -> np.ndarray:
        return np.concatenate(
            [self.draft.pack().ravel(), np.stack([v.pack() for v in self.verify]).ravel(), self.words.ravel()]
        )

    def __repr__(self) -> str:
        k = self.key
        return f"SpecDescriptor(requests={self.num_requests}, d={k.draft_loops}, positions={k.positions})"


def spec_output_width(positions: int) -> int:
    """Int32 words a round returns per request: accepted drafts, tokens kept, then the tokens and
    their exit depths of every position (``split_spec_output``)."""
    return 2 + 2 * positions


def split_spec_output(out: np.ndarray, positions: int):
    """A round's ``[C, 2 + 2 * positions]`` -> ``(accepted [C], count [C], tokens [C, positions],
    depths [C, positions])``; a request's first ``count`` tokens are its output."""
    out = np.asarray(out)
    return out[:, 0], out[:, 1], out[:, 2 : 2 + positions], out[:, 2 + positions : 2 + 2 * positions]
