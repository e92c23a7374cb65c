"""Seeded random Ouro weights, the one source of random parameters for ``LLM(preset, seed=)``,
``ouro-jax random-checkpoint`` and the tests: each tensor's values depend only on ``(seed, name)``."""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np

from ouro_jax.config import OuroConfig

from .hf_names import hf_name_to_path, hf_tensor_shapes, set_path

__all__ = ["random_hf_tensors", "random_params"]


def _tensor(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """One tensor in float64, from its own stream ``(seed, crc32(name))``."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("layernorm.weight") or name.endswith("layernorm_2.weight") or name == "model.norm.weight":
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name == "model.early_exit_gate.bias":
        return rng.normal(-0.5, 0.5, shape)
    if name == "model.embed_tokens.weight":
        return rng.standard_normal(shape)
    return rng.standard_normal(shape) / np.sqrt(shape[-1])  # fan_in


def random_hf_tensors(config: OuroConfig, seed: int = 0, dtype=np.float32) -> Iterator[tuple[str, np.ndarray]]:
    """Seeded random weights in Hugging Face layout, one tensor at a time (never the whole model).

    Linear weights ~ N(0, 1/fan_in) so activations keep unit scale through the sandwich norms;
    norm scales ~ 1 + N(0, 0.1^2); the exit-gate bias is spread so that exit depths vary.
    Each tensor's stream is derived from ``(seed, tensor name)`` so any subset is reproducible.
    """
    for name, shape in hf_tensor_shapes(config).items():
        yield name, _tensor(name, shape, seed).astype(dtype)


def random_params(config: OuroConfig, seed: int = 0, dtype=np.float32) -> dict:
    """The param tree of :func:`random_hf_tensors` (numpy leaves, Flax layout) - the same values a
    random checkpoint written by ``weights.save_random`` holds, without touching the disk.

    Tensors are drawn on several threads (numpy's generators release the GIL; each tensor has its
    own), so that a 1.4B model's weights do not take a single core's minute."""

    def one(item):
        name, shape = item
        arr = _tensor(name, shape, seed).astype(np.float32)
        path, transpose = hf_name_to_path(name)
        return path, np.ascontiguousarray(arr.T if transpose else arr).astype(dtype)

    tree: dict = {}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for path, arr in pool.map(one, hf_tensor_shapes(config).items()):
            set_path(tree, path, arr)
    return tree
