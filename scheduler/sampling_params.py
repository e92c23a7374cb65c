"""SamplingParams: what a user asks of one request (length, sampling, stop rules, exit policy).

It is a plain frozen dataclass so that it can be shared between requests and hashed. Construction
only normalises (numpy scalars to Python numbers, sequences to tuples, ``exit_mode`` to lower case);
nothing is checked there because the number of loops ``T`` of the model is not known yet:
``validate(num_loops)`` checks everything once the engine knows ``T`` (the scheduler calls it in
``add_request``) and raises a ``ValueError`` that names the field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Sequence

import numpy as np

from .options import choice

__all__ = [
    "SamplingParams",
    "EXIT_MODES",
    "MAX_LOGPROBS",
    "LOGPROB_WORDS",
    "TokenLogprobs",
    "read_logprobs",
    "choice_params",
]

#: The most alternatives a token's logprobs list (OpenAI's top_logprobs limit); the device always
#: takes this many, a request keeps the ``logprobs`` it asked for.
MAX_LOGPROBS = 20
#: int32 words of one token's logprob record from the device: the chosen token's logprob, the top
#: ``MAX_LOGPROBS`` logprobs (float32 bits), then their token ids.
LOGPROB_WORDS = 1 + 2 * MAX_LOGPROBS


class TokenLogprobs(NamedTuple):
    """One generated token's log-probabilities under the model's distribution at the depth that
    produced it, before temperature, penalties, grammar masks and top-k / top-p (the raw model)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the ``logprobs`` most likely (token id, logprob), best first


def read_logprobs(record, token_id: int, k: int) -> TokenLogprobs:
    """A device record (``LOGPROB_WORDS`` int32 words) as the ``TokenLogprobs`` of ``token_id``, ``k`` alternatives."""
    w = np.asarray(record, np.int32)
    f = w.view(np.float32)
    ids = w[1 + MAX_LOGPROBS : 1 + MAX_LOGPROBS + k].tolist()
    return TokenLogprobs(int(token_id), float(f[0]), tuple(zip(ids, f[1 : 1 + k].tolist())))


#: ``ouro``: the model's own gate rule; ``delayed``: the same rule one loop later (lets the host
#: schedule loop t+1 before it has read loop t's gate); ``fixed``: always ``max_loops`` loops;
#: ``synthetic``: exit depths drawn or replayed deterministically (benchmarks with random weights).
EXIT_MODES = ("ouro", "delayed", "fixed", "synthetic")


def _plain(v):
    """A zero-dimensional numpy/jax value as the Python number it holds; anything else unchanged."""
    if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):
        return v.item()
    return v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_loops: int = 1
    max_loops: Optional[int] = None  # None = T
    exit_threshold: float = 1.0  # 1.0 = fixed full depth in "ouro"/"delayed"
    exit_mode: str = "ouro"
    synthetic_mean_loops: Optional[float] = None
    synthetic_depths: Optional[Sequence[int]] = None
    # structured outputs: an ``ouro_jax.structured.GuidedDecoding`` (opaque here: the engine compiles
    # it); the request's tokens are masked to what it allows and it ends when the grammar completes
    guided: Optional[object] = None
    # log-probabilities of each generated token (None: off) with this many alternatives (0..20)
    logprobs: Optional[int] = None
    # and of each prompt token after the first, from the full-depth state of the position before
    prompt_logprobs: Optional[int] = None
    # OpenAI's and vLLM's logit processing, applied on the device by the separate sampler:
    # presence / frequency penalties on the output's tokens, the repetition penalty on the
    # prompt's and the output's, a bias per token id ({id: bias}, -100..100), min-p, and no
    # stop or eos token before min_tokens tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[object] = None
    min_p: float = 0.0
    min_tokens: int = 0

    def __post_init__(self):
        # numpy (or jax) scalars become Python numbers, arrays and lists tuples (hashable), the exit
        # mode lower case: validate() then sees one canonical form
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("stop_token_ids", "synthetic_depths") and v is not None and not isinstance(v, str):
                try:
                    v = tuple(_plain(x) for x in v)
                except TypeError:
                    pass  # not a sequence: validate() says so
            object.__setattr__(self, f.name, _plain(v))
        if isinstance(self.exit_mode, str):
            object.__setattr__(self, "exit_mode", self.exit_mode.lower())
        if isinstance(self.logit_bias, dict):  # hashable, one order: sorted (id, bias) pairs
            try:
                pairs = tuple(sorted((_plain(k), _plain(v)) for k, v in self.logit_bias.items()))
            except TypeError:
                pairs = tuple((_plain(k), _plain(v)) for k, v in self.logit_bias.items())  # validate() says why
            object.__setattr__(self, "logit_bias", pairs)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must bias or penalise this request's logits (``adjust_logits``)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_p
            or self.min_tokens
        )

    def resolved_max_loops(self, num_loops: int) -> int:
        return num_loops if self.max_loops is None else self.max_loops

    def validate(self, num_loops: int, vocab_size: Optional[int] = None) -> None:
        """Raise ``ValueError`` naming the first bad field; ``num_loops`` is the model's ``T``,
        ``vocab_size`` (when known) bounds the stop token ids."""

        def need(cond, msg):
            if not cond:
                raise ValueError(f"SamplingParams: {msg}")

        need(_is_int(num_loops) and num_loops >= 1, f"num_loops must be a positive int, got {num_loops!r}")
        need(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        need(
            _is_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number >= 0, got {self.temperature!r}",
        )
        need(
            _is_real(self.top_p) and not math.isnan(self.top_p) and 0.0 < self.top_p <= 1.0,
            f"top_p must lie in (0, 1], got {self.top_p!r}",
        )
        need(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        need(_is_int(self.seed) and 0 <= self.seed < 2**32, f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        need(
            isinstance(self.stop_token_ids, tuple),
            f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}",
        )
        for t in self.stop_token_ids:
            need(_is_int(t) and t >= 0, f"stop_token_ids must be non-negative integers (not bools), got {t!r}")
            # an id the model can never sample would never stop anything: a silent no-op
            need(
                vocab_size is None or t < vocab_size,
                f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})",
            )
        need(isinstance(self.ignore_eos, bool), f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        need(
            _is_int(self.min_loops) and self.min_loops >= 1,
            f"min_loops must be an integer >= 1, got {self.min_loops!r}",
        )
        max_loops = self.resolved_max_loops(num_loops)
        need(_is_int(max_loops) and max_loops >= 1, f"max_loops must be an integer >= 1 or None, got {max_loops!r}")
        need(max_loops <= num_loops, f"max_loops={max_loops} exceeds the model's number of loops T={num_loops}")
        need(self.min_loops <= max_loops, f"min_loops={self.min_loops} exceeds max_loops={max_loops}")
        need(
            _is_real(self.exit_threshold) and not math.isnan(self.exit_threshold) and 0.0 <= self.exit_threshold <= 1.0,
            f"exit_threshold must lie in [0, 1], got {self.exit_threshold!r}",
        )
        try:
            choice("exit_mode", self.exit_mode, EXIT_MODES)
        except ValueError as e:
            need(False, str(e))
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(
                v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
                f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(_is_real(v) and -2.0 <= v <= 2.0, f"{name} must lie in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        need(_is_real(r) and math.isfinite(r) and r > 0, f"repetition_penalty must be a finite number > 0, got {r!r}")
        need(_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must lie in [0, 1], got {self.min_p!r}")
        need(
            _is_int(self.min_tokens) and 0 <= self.min_tokens,
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
        )
        need(
            not _is_int(self.max_tokens) or self.min_tokens <= self.max_tokens,
            f"min_tokens={self.min_tokens!r} exceeds max_tokens={self.max_tokens!r}",
        )
        need(
            self.logit_bias is None or isinstance(self.logit_bias, tuple),
            f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}",
        )
        for t, b in self.logit_bias or ():
            need(
                _is_int(t) and 0 <= t and (vocab_size is None or t < vocab_size),
                f"logit_bias: {t!r} is not a token id"
                + ("" if vocab_size is None else f" in the vocabulary [0, {vocab_size})"),
            )
            need(_is_real(b) and -100.0 <= b <= 100.0, f"logit_bias[{t}] must lie in [-100, 100], got {b!r}")
        need(
            self.guided is None or not self.ignore_eos,
            "ignore_eos does not apply to a guided request: it ends when its grammar completes",
        )
        # settings the chosen exit mode never reads are refused, not ignored
        if self.exit_mode in ("fixed", "synthetic"):
            need(
                self.exit_threshold == 1.0,
                f"exit_threshold={self.exit_threshold!r} is read only by exit_mode 'ouro' or 'delayed'; "
                f"exit_mode={self.exit_mode!r} "
                + ("runs max_loops loops for every token" if self.exit_mode == "fixed" else "draws the depths"),
            )
        if self.exit_mode == "fixed":
            need(
                self.min_loops == 1,
                f"min_loops={self.min_loops!r} has no effect with exit_mode='fixed', which runs max_loops "
                f"loops for every token: set max_loops instead",
            )
        if self.exit_mode == "synthetic":
            need(
                (self.synthetic_mean_loops is None) != (self.synthetic_depths is None),
                "exit_mode='synthetic' needs exactly one of synthetic_mean_loops or synthetic_depths",
            )
            if self.synthetic_mean_loops is not None:
                m = self.synthetic_mean_loops
                need(
                    _is_real(m) and math.isfinite(m) and self.min_loops <= m <= max_loops,
                    f"synthetic_mean_loops must lie in [min_loops, max_loops] = "
                    f"[{self.min_loops}, {max_loops}], got {m!r}",
                )
            else:
                need(
                    isinstance(self.synthetic_depths, tuple),
                    f"synthetic_depths must be a sequence of loop indices, got {self.synthetic_depths!r}",
                )
                need(len(self.synthetic_depths) > 0, "synthetic_depths must not be empty")
                for d in self.synthetic_depths:
                    need(
                        _is_int(d) and 0 <= d < num_loops,
                        f"synthetic_depths entries must be loop indices in [0, {num_loops - 1}], got {d!r}",
                    )
        else:
            need(
                self.synthetic_mean_loops is None and self.synthetic_depths is None,
                f"synthetic_mean_loops / synthetic_depths are only meaningful with exit_mode='synthetic' "
                f"(exit_mode={self.exit_mode!r})",
            )


def choice_params(sp: SamplingParams, j: int) -> SamplingParams:
    """Choice ``j`` of a group of ``n`` (OpenAI's ``n``): the same request seeded ``seed + j``."""
    return sp if j == 0 else dataclasses.replace(sp, seed=(sp.seed + j) % 2**32)
