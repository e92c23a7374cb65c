"""The parameter pytree of an Ouro model and its mapping to Hugging Face tensor names.

The tree is the one Flax linen builds for ``ouro_jax.model.OuroModel`` (a plain nested dict of
arrays, usable directly inside ``jax.jit``)::

    {"embed_tokens": {"embedding": [V, D]},
     "layers_{i}": {"self_attn": {"q_proj": {"kernel": [D, H*hd]}, "k_proj": {"kernel": [D, KVH*hd]},
                                  "v_proj": {"kernel": [D, KVH*hd]}, "o_proj": {"kernel": [H*hd, D]}},
                    "mlp": {"gate_proj": {"kernel": [D, F]}, "up_proj": {"kernel": [D, F]},
                            "down_proj": {"kernel": [F, D]}},
                    "input_layernorm": {"scale": [D]}, "input_layernorm_2": {"scale": [D]},
                    "post_attention_layernorm": {"scale": [D]},
                    "post_attention_layernorm_2": {"scale": [D]}},
     "norm": {"scale": [D]},
     "early_exit_gate": {"kernel": [D, 1], "bias": [1]},
     "lm_head": {"kernel": [D, V]}}

Linear kernels are stored ``[in, out]`` (Flax) while Hugging Face stores ``[out, in]`` (PyTorch), so
every 2-D projection is transposed on the way in and out.  The mapping lives here, in one place,
so that the loader, the converter, the random weights and the numpy reference agree.
"""

from __future__ import annotations

import re
from typing import Iterator

from .config import OuroConfig

__all__ = [
    "hf_tensor_shapes",
    "hf_name_to_path",
    "path_to_hf_name",
    "param_shapes",
    "get_path",
    "set_path",
    "iter_paths",
]

_LAYER_PROJ = {
    "self_attn.q_proj": ("self_attn", "q_proj"),
    "self_attn.k_proj": ("self_attn", "k_proj"),
    "self_attn.v_proj": ("self_attn", "v_proj"),
    "self_attn.o_proj": ("self_attn", "o_proj"),
    "mlp.gate_proj": ("mlp", "gate_proj"),
    "mlp.up_proj": ("mlp", "up_proj"),
    "mlp.down_proj": ("mlp", "down_proj"),
}
_LAYER_NORMS = ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")


def hf_tensor_shapes(config: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face Ouro checkpoint must hold, with its shape (``[out, in]``)."""
    c = config
    d, f = c.hidden_size, c.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, d)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (c.q_size, d)
        out[p + "self_attn.k_proj.weight"] = (c.kv_size, d)
        out[p + "self_attn.v_proj.weight"] = (c.kv_size, d)
        out[p + "self_attn.o_proj.weight"] = (d, c.q_size)
        out[p + "mlp.gate_proj.weight"] = (f, d)
        out[p + "mlp.up_proj.weight"] = (f, d)
        out[p + "mlp.down_proj.weight"] = (d, f)
        for n in _LAYER_NORMS:
            out[p + n + ".weight"] = (d,)
    out["model.norm.weight"] = (d,)
    out["model.early_exit_gate.weight"] = (1, d)
    out["model.early_exit_gate.bias"] = (1,)
    out["lm_head.weight"] = (c.vocab_size, d)
    return out


def hf_name_to_path(name: str) -> tuple[tuple[str, ...], bool]:
    """``(path in the param tree, transpose?)`` for a Hugging Face tensor name.

    Raises ``KeyError`` for a name that is not part of an Ouro checkpoint.
    """
    if name == "model.embed_tokens.weight":
        return ("embed_tokens", "embedding"), False
    if name == "model.norm.weight":
        return ("norm", "scale"), False
    if name == "model.early_exit_gate.weight":
        return ("early_exit_gate", "kernel"), True
    if name == "model.early_exit_gate.bias":
        return ("early_exit_gate", "bias"), False
    if name == "lm_head.weight":
        return ("lm_head", "kernel"), True
    m = _LAYER_RE.match(name)
    if m:
        i, rest = int(m.group(1)), m.group(2)
        layer = f"layers_{i}"
        if rest in _LAYER_PROJ:
            return (layer, *_LAYER_PROJ[rest], "kernel"), True
        if rest in _LAYER_NORMS:
            return (layer, rest, "scale"), False
    raise KeyError(f"{name!r} is not a tensor of an Ouro checkpoint")


def path_to_hf_name(path: tuple[str, ...]) -> str:
    """Inverse of :func:`hf_name_to_path` (the transpose flag is the same both ways)."""
    if path[0] == "embed_tokens":
        return "model.embed_tokens.weight"
    if path[0] == "norm":
        return "model.norm.weight"
    if path[0] == "early_exit_gate":
        return "model.early_exit_gate." + ("weight" if path[1] == "kernel" else "bias")
    if path[0] == "lm_head":
        return "lm_head.weight"
    if path[0].startswith("layers_"):
        i = int(path[0][len("layers_") :])
        if path[1] in _LAYER_NORMS:
            return f"model.layers.{i}.{path[1]}.weight"
        return f"model.layers.{i}.{path[1]}.{path[2]}.weight"
    raise KeyError(f"{path!r} is not a path of the Ouro param tree")


def param_shapes(config: OuroConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Param-tree path -> shape (Flax layout, kernels ``[in, out]``)."""
    out = {}
    for name, shape in hf_tensor_shapes(config).items():
        path, transpose = hf_name_to_path(name)
        out[path] = tuple(reversed(shape)) if transpose else shape
    return out


def get_path(tree: dict, path: tuple[str, ...]):
    for k in path:
        tree = tree[k]
    return tree


def set_path(tree: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def iter_paths(tree: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], object]]:
    """Leaves of a nested dict as ``(path, leaf)``, in sorted key order."""
    for k in sorted(tree):
        v = tree[k]
        if isinstance(v, dict):
            yield from iter_paths(v, prefix + (k,))
        else:
            yield prefix + (k,), v
