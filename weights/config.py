"""OuroConfig: the shape of an Ouro model, read from a Hugging Face ``config.json`` or a preset.

The model code never assumes the released sizes: grouped-query attention, other head sizes and
other loop counts ``T`` are all legal, because the tiny test presets use them.  What the code does
*not* implement (sliding windows, rope scaling, attention bias, tied embeddings, activations other
than SiLU) is rejected here with an error that names the field, before any weight is touched.

It lives in ``weights`` (below ``ouro_jax``, jax-free) because it is what a checkpoint's ``config.json``
holds; ``ouro_jax`` re-exports ``OuroConfig``, ``PRESETS`` and ``get_preset``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Any

__all__ = ["OuroConfig", "PRESETS", "get_preset"]


@dataclasses.dataclass(frozen=True)
class OuroConfig:
    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 65536
    total_ut_steps: int = 4
    # No ``early_exit_threshold``: the exit threshold is per request (``SamplingParams.exit_threshold``,
    # default 1.0 = full depth); ``from_dict`` ignores the checkpoint's and warns when it is not 1.0.
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int = 0
    eos_token_id: int = 0
    pad_token_id: int = 0
    torch_dtype: str = "bfloat16"
    rope_scaling: Any = None
    sliding_window: Any = None
    use_sliding_window: bool = False
    attention_bias: bool = False

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def num_loops(self) -> int:
        """``T``: how many times the layer stack runs per token."""
        return self.total_ut_steps

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_params(self) -> int:
        d, f, l, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        layer = d * self.q_size * 2 + d * self.kv_size * 2 + 3 * d * f + 4 * d
        return v * d * 2 + l * layer + d + d + 1

    def kv_bytes_per_token_plane(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        def need(cond, msg):
            if not cond:
                raise ValueError(f"OuroConfig: {msg}")

        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "total_ut_steps",
        ):
            v = getattr(self, name)
            need(
                isinstance(v, int) and not isinstance(v, bool) and v > 0,
                f"{name} must be a positive integer, got {v!r}",
            )
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({self.num_key_value_heads})",
        )
        need(self.head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        need(self.rope_theta > 0, f"rope_theta must be positive, got {self.rope_theta}")
        need(self.rms_norm_eps > 0, f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        need(self.rope_scaling is None, f"rope_scaling is not supported (got {self.rope_scaling!r})")
        need(not self.use_sliding_window, "use_sliding_window=true is not supported")
        need(not self.attention_bias, "attention_bias=true is not supported (Ouro has no attention bias)")
        need(not self.tie_word_embeddings, "tie_word_embeddings=true is not supported (Ouro unties them)")
        need(self.hidden_act == "silu", f"hidden_act must be 'silu', got {self.hidden_act!r}")
        need(
            self.torch_dtype in ("bfloat16", "float32", "float16"),
            f"torch_dtype must be bfloat16, float16 or float32, got {self.torch_dtype!r}",
        )
        for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, tok)
            need(v is None or 0 <= v < self.vocab_size, f"{tok}={v} is outside the vocabulary")

    # ------------------------------------------------------------------- HF I/O
    #: Fields a ``config.json`` must give: without them the dataclass defaults would silently make a
    #: 1.4B-sized model. The rest default to the values every released Ouro model shares.
    REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

    @classmethod
    def from_dict(cls, d: dict) -> "OuroConfig":
        """Build from a Hugging Face ``config.json`` dict; unknown keys are ignored, known
        unsupported features raise, and so does a missing :attr:`REQUIRED_FIELDS` entry."""
        if not isinstance(d, dict):
            raise ValueError(f"OuroConfig: a config must be a JSON object, got {type(d).__name__}")
        missing = [k for k in cls.REQUIRED_FIELDS if d.get(k) is None]
        if missing:
            raise ValueError(f"OuroConfig: config.json has no {', '.join(missing)} (required)")
        thr = d.get("early_exit_threshold")
        if thr is not None and thr != 1.0:
            warnings.warn(
                f"OuroConfig: the checkpoint's early_exit_threshold={thr} is not used; the exit threshold "
                f"is per request (SamplingParams.exit_threshold, default 1.0 = full depth)",
                stacklevel=2,
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        if "dtype" in d and "torch_dtype" not in d:
            kw["torch_dtype"] = d["dtype"]
        if kw.get("head_dim") is None:
            heads = kw.get("num_attention_heads", cls.num_attention_heads)
            hidden = kw.get("hidden_size", cls.hidden_size)
            if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, hidden)):
                raise ValueError(
                    f"OuroConfig: hidden_size and num_attention_heads must be positive integers, "
                    f"got {hidden!r} and {heads!r}"
                )
            if hidden % heads:
                raise ValueError(
                    f"OuroConfig: hidden_size {hidden} is not divisible by "
                    f"num_attention_heads {heads} and no head_dim is given"
                )
            kw["head_dim"] = hidden // heads
        if kw.get("num_key_value_heads") is None:
            kw["num_key_value_heads"] = kw.get("num_attention_heads", cls.num_attention_heads)
        for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
            # a list of ids: the first here; the engine stops at every eos id (weights/generation_config.py)
            if isinstance(kw.get(k), list):
                kw[k] = kw[k][0] if kw[k] else None
        if isinstance(kw.get("rope_theta"), int):
            kw["rope_theta"] = float(kw["rope_theta"])
        try:
            return cls(**kw)
        except TypeError as e:  # a field of the wrong type (say a string) fails a comparison
            raise ValueError(f"OuroConfig: a field has the wrong type: {e}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "OuroConfig":
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        if not os.path.exists(p):
            raise FileNotFoundError(f"no config.json at {p}")
        with open(p) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["architectures"] = ["OuroForCausalLM"]
        d["model_type"] = "ouro"
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        with open(p, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    def replace(self, **kw) -> "OuroConfig":
        return dataclasses.replace(self, **kw)

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


PRESETS: dict[str, OuroConfig] = {
    "ouro-1.4b": OuroConfig(),
    "ouro-2.6b": OuroConfig(num_hidden_layers=48),
    # A demo model: runs on a laptop CPU in seconds, real vocabulary size so text decoding works.
    "ouro-small": OuroConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        torch_dtype="float32",
    ),
    # Test presets: MHA with T=4, GQA with T=3.
    "tiny": OuroConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=512,
        torch_dtype="float32",
    ),
    "tiny-gqa": OuroConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        total_ut_steps=3,
        max_position_embeddings=512,
        torch_dtype="float32",
    ),
}


def get_preset(name: str) -> OuroConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
