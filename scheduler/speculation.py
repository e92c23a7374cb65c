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

This module is the jax-free part: the option, and which rows a round may take.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

__all__ = ["SpeculativeConfig", "speculative_option", "METHODS"]

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
