"""Seeded random Ouro weights, the one source of random parameters for ``LLM(preset, seed=)``,
``ouro-jax random-checkpoint`` and the tests: each tensor's values depend only on ``(seed, name)``.

Tensors are drawn with JAX's counter-based generator on the default device: a 1.4B model is ~1.4e9
draws, which take milliseconds on a GPU and a minute or more in numpy on the host. The same seed
gives bit-identical weights on the same backend (the normal transform is float32 arithmetic, so a
CPU and a GPU draw may differ in the last bit)."""

from __future__ import annotations

import functools
import zlib
from typing import Iterator

import numpy as np

from .config import OuroConfig
from .hf_names import hf_name_to_path, hf_tensor_shapes, set_path

__all__ = ["random_hf_tensors", "random_params"]


def _kind(name: str) -> str:
    if name.endswith("layernorm.weight") or name.endswith("layernorm_2.weight") or name == "model.norm.weight":
        return "norm"  # 1 + N(0, 0.1^2)
    if name == "model.early_exit_gate.bias":
        return "gate_bias"  # N(-0.5, 0.5^2): spread so that exit depths vary
    if name == "model.embed_tokens.weight":
        return "embed"  # N(0, 1)
    return "linear"  # N(0, 1/fan_in): activations keep unit scale through the sandwich norms


@functools.cache
def _drawer(shape: tuple[int, ...], kind: str, transpose: bool, dtype):
    """A jitted draw of one tensor, compiled once per (shape, kind, layout, dtype)."""
    import jax
    import jax.numpy as jnp

    def draw(seed, tag):
        key = jax.random.fold_in(jax.random.key(seed), tag)
        x = jax.random.normal(key, shape, jnp.float32)
        if kind == "norm":
            x = 1.0 + 0.1 * x
        elif kind == "gate_bias":
            x = 0.5 * x - 0.5
        elif kind == "linear":
            x = x * (1.0 / np.sqrt(shape[-1]))
        return (x.T if transpose else x).astype(dtype)

    return jax.jit(draw)


@functools.cache
def _stored_drawer(store, shape: tuple[int, ...], kind: str, transpose: bool, dtype):
    """:func:`_drawer` compiled once and kept in ``store`` (an ``ExecutableStore``): each draw
    compiles in well under JAX's persistent-cache threshold, so without the store every start
    compiled them again (docs/decisions.md, "Start-up")."""
    import jax

    device = jax.devices()[0]
    key = store.key("weights.random_init drawer", shape, kind, transpose, str(dtype), device.id)

    def compile_():
        scalar = lambda t: jax.ShapeDtypeStruct((), t)  # noqa: E731
        return _drawer(shape, kind, transpose, dtype).lower(scalar(np.uint32), scalar(np.int32)).compile()

    return store.load_or_compile(key, [device], compile_)[0]


def _draw(name: str, shape: tuple[int, ...], seed: int, transpose: bool = False, dtype=np.float32, store=None):
    # crc32 fits uint32; the fold-in tag is its int32 bit pattern
    tag = np.uint32(zlib.crc32(name.encode())).view(np.int32)
    args = (tuple(shape), _kind(name), transpose, np.dtype(dtype))
    fn = _drawer(*args) if store is None else _stored_drawer(store, *args)
    return fn(np.uint32(seed), tag)


def random_hf_tensors(config: OuroConfig, seed: int = 0, dtype=np.float32) -> Iterator[tuple[str, np.ndarray]]:
    """Seeded random weights in Hugging Face layout as numpy arrays, one tensor at a time (never the
    whole model on the host)."""
    for name, shape in hf_tensor_shapes(config).items():
        yield name, np.asarray(_draw(name, shape, seed)).astype(dtype)


def random_params(config: OuroConfig, seed: int = 0, dtype=np.float32, *, on_device: bool = False, store=None) -> dict:
    """The param tree of :func:`random_hf_tensors` (Flax layout) - the same values a random checkpoint
    written by ``weights.save_random`` holds, without touching the disk. ``on_device=True`` keeps the
    leaves as device arrays (what the engine wants); otherwise they are numpy arrays. ``store``: an
    ``ouro_jax.executable_store.ExecutableStore`` that keeps the compiled drawers across starts."""
    tree: dict = {}
    for name, shape in hf_tensor_shapes(config).items():
        path, transpose = hf_name_to_path(name)
        arr = _draw(name, shape, seed, transpose, dtype, store)
        set_path(tree, path, arr if on_device else np.asarray(arr))
    return tree
