"""Tensor parallelism over a 1-D device mesh (axis ``"tp"``), Megatron layout (docs/multi-gpu.md).

Each shard holds ``H/N`` query heads, ``KVH/N`` KV heads (and that slice of the KV pool's head
axis), ``F/N`` of the MLP and ``V/N`` of the embedding table and the LM head. q/k/v and gate/up
are column-parallel, o and down row-parallel: one ``psum`` after attention and one after the MLP
per layer (``OuroDecoderLayer.tp_axis``). Everything after the final norm (exit gate, sampling)
sees the all-reduced hidden state, so every shard takes the same decision. The scheduler knows
nothing of this: the runner wraps its step in ``jax.shard_map`` and places the state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from weights.config import OuroConfig

__all__ = [
    "TP_AXIS",
    "check_devices",
    "check_tensor_parallel",
    "local_config",
    "make_mesh",
    "param_specs",
    "place_params",
    "kv_spec",
    "vocab_parallel_embed",
    "vocab_parallel_logits",
]

TP_AXIS = "tp"

# Flax kernels are [in, out]: column-parallel splits `out` (last axis), row-parallel splits `in`.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def check_tensor_parallel(config: OuroConfig | None, n, num_devices: int | None = None) -> int:
    """``n`` as an int, or a ``ValueError`` naming what it must divide / how many devices exist."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
    n = int(n)
    if n == 1:
        return n
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        v = getattr(config, name, 0) if config is not None else 0  # no config: the loader raises
        if v % n:
            raise ValueError(f"tensor_parallel_size={n} must divide the model's {name} ({v})")
    have = len(jax.devices()) if num_devices is None else num_devices
    if have < n:
        raise ValueError(f"tensor_parallel_size={n} needs {n} devices, but jax sees {have}")
    return n


def check_devices(devices, n: int):
    """``devices`` as a list of ``n`` distinct jax devices (None stays None: the first ``n`` of
    ``jax.devices()``), or a ``ValueError`` saying what is wrong."""
    if devices is None:
        return None
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise ValueError(f"devices must be a sequence of jax devices, got {devices!r}")
    devices = list(devices)
    if not all(isinstance(d, jax.Device) for d in devices):
        raise ValueError(f"devices must be jax devices (from jax.devices()), got {devices!r}")
    if len(devices) != n:
        raise ValueError(f"devices must hold tensor_parallel_size={n} devices, got {len(devices)}")
    if len(set(devices)) != n:
        raise ValueError(f"devices must be distinct, got {devices!r}")
    return devices


def local_config(config: OuroConfig, n: int) -> OuroConfig:
    """The shape one shard computes: heads and MLP width divided by ``n`` (vocabulary handled apart)."""
    if n == 1:
        return config
    return config.replace(
        num_attention_heads=config.num_attention_heads // n,
        num_key_value_heads=config.num_key_value_heads // n,
        intermediate_size=config.intermediate_size // n,
    )


def make_mesh(n: int, devices=None) -> Mesh:
    """A 1-D ``"tp"`` mesh over the first ``n`` of ``devices`` (default ``jax.devices()``: local
    devices in one process, every process's devices after ``jax.distributed.initialize``)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < n:
        raise ValueError(f"a mesh of {n} devices needs {n}, got {len(devices)}")
    return Mesh(np.array(devices[:n]), (TP_AXIS,))


def kv_spec() -> P:
    """The KV pools ``[L, KVH, NB, BS, hd]`` split along the KV-head axis."""
    return P(None, TP_AXIS)


def _leaf_spec(path: tuple[str, ...]) -> P:
    """Spec of one leaf from its names."""
    names = [getattr(k, "key", str(k)) for k in path]
    if "embed_tokens" in names:
        return P(TP_AXIS, None)  # [V, D] by vocabulary rows
    if "lm_head" in names:
        return P(None, TP_AXIS)  # [D, V] by vocabulary columns
    if names[-1] == "kernel" and "qkv_proj" in names:  # [D, G, g + 2, hd]: by KV-head group
        return P(None, TP_AXIS, None, None)
    if names[-1] == "kernel" and "gate_up_proj" in names:  # [D, 2, I]: by intermediate column
        return P(None, None, TP_AXIS)
    if names[-1] == "kernel" and any(n in names for n in _COLUMN):
        return P(None, TP_AXIS)
    if names[-1] == "kernel" and any(n in names for n in _ROW):
        return P(TP_AXIS, None)
    return P()  # norms, exit gate: replicated


def param_specs(params) -> Any:
    """A ``PartitionSpec`` per leaf of a param tree (any nesting)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: _leaf_spec(p), params)


def place_params(params, mesh: Mesh) -> Any:
    """Every leaf ``device_put`` straight into its shards (host arrays in: each device receives only
    its slice; nothing is assembled on one device first)."""
    specs = param_specs(params)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def vocab_parallel_embed(table, ids, axis: str = TP_AXIS):
    """Embedding lookup with the table split by rows: each shard looks up the ids it owns (zeros
    elsewhere) and a ``psum`` adds the one non-zero contribution, exactly the unsplit lookup."""
    rows = table.shape[0]
    local = ids - jax.lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    emb = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)
    return jax.lax.psum(jnp.where(mine[..., None], emb, jnp.zeros_like(emb)), axis)


def vocab_parallel_logits(h, kernel, dtype, axis: str = TP_AXIS):
    """``LMHead`` on a vocabulary slice, the slices gathered so that every shard samples from the
    same full float32 logits with the same keys (one decision, not ``N``)."""
    local = jnp.dot(h.astype(dtype), kernel, preferred_element_type=jnp.float32)
    return jax.lax.all_gather(local, axis, axis=local.ndim - 1, tiled=True)
