"""The ids that end a generation, as a Hugging Face checkpoint folder states them.

``config.json`` and ``generation_config.json`` each give ``eos_token_id`` as an int or a list (real
Ouro checkpoints end a chat turn with ``<|im_end|>`` while their tokenizer's bos / eos / pad is
``<|endoftext|>``); ``tokenizer_config.json`` names the tokenizer's ``eos_token`` as text. Every one
of them stops a request, as in ``transformers``' ``generate``. Free of jax.
"""

from __future__ import annotations

import json
import os
from typing import Optional

__all__ = ["read_eos_token_ids", "read_tokenizer_eos_text"]


def _read_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


def _ids(value, where: str) -> list[int]:
    """``eos_token_id`` as a file gives it: None, an int or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{where}: eos_token_id must be a non-negative integer or a list of them, got {value!r}")
    return values


def read_eos_token_ids(folder: str, vocab_size: int) -> tuple[int, ...]:
    """Every ``eos_token_id`` of the folder's ``config.json`` and ``generation_config.json``,
    sorted; an id outside ``[0, vocab_size)`` is a ``ValueError`` naming its file."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(folder, name)
        d = _read_json(path)
        if d is None:
            continue
        for t in _ids(d.get("eos_token_id"), path):
            if t >= vocab_size:
                raise ValueError(f"{path}: eos_token_id {t} is outside the vocabulary [0, {vocab_size})")
            ids.add(t)
    return tuple(sorted(ids))


def read_tokenizer_eos_text(folder: str) -> Optional[str]:
    """The ``eos_token`` of the folder's ``tokenizer_config.json`` (a string or a serialized
    ``AddedToken``), None without one."""
    d = _read_json(os.path.join(folder, "tokenizer_config.json"))
    v = None if d is None else d.get("eos_token")
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None
