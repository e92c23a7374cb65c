"""Shared pieces of the weights package: the error type, dtypes, the check of a tensor inventory
against an :class:`OuroConfig`, on-device placement, and destination-folder handling."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import OuroConfig
from .hf_names import hf_tensor_shapes

CONFIG_NAME = "config.json"
MARKER_NAME = "ouro_jax_checkpoint.json"  # present only in a converted (orbax) folder
PARAMS_DIR = "params"  # the orbax checkpoint inside a converted folder
FORMAT_NAME = "ouro-jax-orbax"
FORMAT_VERSION = 1
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as an Ouro model: the message names the file and tensor."""


# ----------------------------------------------------------------------------------- dtypes
# safetensors dtype tag <-> numpy dtype, for the dtypes the model can hold.
ST_TO_NP = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}
NP_TO_ST = {v: k for k, v in ST_TO_NP.items()}
DTYPE_NAMES = {
    np.dtype(np.float32): "float32",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.float16): "float16",
}


def canonical_dtype(dtype) -> np.dtype | None:
    """``None`` stays ``None``; ``jnp.bfloat16``, ``"bfloat16"``, ``np.float32``... -> numpy dtype.
    Anything other than float32 / bfloat16 / float16 is refused."""
    if dtype is None:
        return None
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d not in DTYPE_NAMES:
        raise CheckpointError(
            f"unsupported dtype {dtype!r}: use bfloat16, float32 or float16 (or None to keep the checkpoint's dtype)"
        )
    return d


def dtype_name(dtype) -> str:
    return DTYPE_NAMES[np.dtype(dtype)]


# ------------------------------------------------------------------------- config handling
def read_config(folder: str) -> OuroConfig:
    p = os.path.join(folder, CONFIG_NAME)
    if not os.path.isfile(p):
        raise CheckpointError(
            f"no {CONFIG_NAME} in {folder}: a checkpoint folder needs the model's config.json next to its weights"
        )
    try:
        with open(p) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p} is not readable JSON: {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{p} must hold a JSON object, got {type(d).__name__}")
    try:
        return OuroConfig.from_dict(d)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"invalid config {p}: {e}") from None


# ------------------------------------------------------------------ inventory vs config
_SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def _dim_fields(config: OuroConfig, name: str) -> list[list[str]]:
    """For each dim of tensor ``name``, the config fields it is computed from.

    Found by perturbing each size field (on an unvalidated copy) and seeing which dims move, so the
    tensor-shape formula stays in ``params.hf_tensor_shapes`` alone."""
    base = hf_tensor_shapes(config)[name]
    deps: list[list[str]] = [[] for _ in base]
    for field in _SIZE_FIELDS:
        c2 = copy.copy(config)
        object.__setattr__(c2, field, getattr(config, field) + 1)
        for i, (a, b) in enumerate(zip(base, hf_tensor_shapes(c2)[name])):
            if a != b:
                deps[i].append(field)
    return deps


def explain_shape(config: OuroConfig, name: str, got: tuple[int, ...]) -> str:
    want = hf_tensor_shapes(config)[name]
    if len(got) != len(want):
        return f"it has {len(got)} dims, the config implies {len(want)}"
    parts = []
    for i, (g, w, fields) in enumerate(zip(got, want, _dim_fields(config, name))):
        if g == w:
            continue
        if not fields:
            parts.append(f"dim {i} is {g}, it must be {w}")
        else:
            expr = "*".join(fields)
            vals = "*".join(str(getattr(config, f)) for f in fields)
            eq = f"{expr} = {vals} = {w}" if len(fields) > 1 else f"{expr} = {w}"
            parts.append(f"dim {i} is {g} but config.json gives {eq}")
    return "; ".join(parts)


def check_inventory(config: OuroConfig, found: dict[str, tuple[str, tuple[int, ...], str]], where: str) -> None:
    """``found``: HF tensor name -> (safetensors dtype tag, HF-layout shape, file it lives in).

    Raises :class:`CheckpointError` for missing tensors, unexpected extra tensors, shape mismatches
    and unsupported dtypes, naming the tensor (and file)."""
    expected = hf_tensor_shapes(config)
    missing = [n for n in expected if n not in found]
    extra = sorted(n for n in found if n not in expected)
    if missing or extra:
        msg = []
        if missing:
            msg.append(
                f"{len(missing)} tensor(s) missing from {where}: "
                + ", ".join(missing[:8])
                + (" ..." if len(missing) > 8 else "")
            )
        if extra:
            files = {found[n][2] for n in extra}
            where_extra = f"{where}/{next(iter(files))}" if len(files) == 1 else where
            msg.append(
                f"{len(extra)} unexpected extra tensor(s) in {where_extra}: "
                + ", ".join(n if len(files) == 1 else f"{n} (in {found[n][2]})" for n in extra[:8])
                + (" ..." if len(extra) > 8 else "")
            )
        if any(n.startswith("model.layers.") for n in extra + missing):
            msg.append(f"config.json has num_hidden_layers={config.num_hidden_layers}")
        raise CheckpointError("; ".join(msg))
    bad_shape = [n for n in expected if tuple(found[n][1]) != expected[n]]
    if bad_shape:
        n = bad_shape[0]
        got = tuple(found[n][1])
        more = f" (and {len(bad_shape) - 1} other tensor(s) disagree)" if len(bad_shape) > 1 else ""
        raise CheckpointError(
            f"shape mismatch for tensor {n} in {found[n][2]}: checkpoint has {list(got)}, config "
            f"expects {list(expected[n])}: {explain_shape(config, n, got)}{more}"
        )
    for n in expected:
        if found[n][0] not in ST_TO_NP:
            raise CheckpointError(
                f"tensor {n} in {found[n][2]} has unsupported dtype {found[n][0]}; supported: {', '.join(ST_TO_NP)}"
            )


# ---------------------------------------------------------------------------- placement
@functools.partial(jax.jit, static_argnames=("transpose", "dtype"))
def _to_flax(x, transpose: bool, dtype):
    if transpose:
        x = x.T
    return x.astype(dtype)


def place(arr: np.ndarray, transpose: bool, dtype: np.dtype | None, device=None) -> jax.Array:
    """Host tensor (HF layout) -> device array in the Flax layout and ``dtype`` (None = its own).

    The transpose and cast run on the device, so the host holds only the one tensor it just read."""
    target = np.dtype(arr.dtype) if dtype is None else np.dtype(dtype)
    x = jax.device_put(arr, device if device is not None else jax.devices()[0])
    if transpose or target != x.dtype:
        x = _to_flax(x, transpose=bool(transpose and x.ndim == 2), dtype=jnp.dtype(target))
    return x


# --------------------------------------------------------------------- destination folders
OUR_FILES = (CONFIG_NAME, MARKER_NAME, SINGLE_FILE, INDEX_FILE)


def prepare_dst(dst: str, overwrite: bool) -> str:
    """Absolute path of an empty (or emptied of our files) destination folder, created if needed."""
    dst = os.path.abspath(os.fspath(dst))
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise FileExistsError(f"destination {dst} exists and is not a folder")
    if os.path.isdir(dst) and os.listdir(dst):
        if not overwrite:
            raise FileExistsError(
                f"destination {dst} is not empty; pass overwrite=True (--overwrite) to replace the checkpoint in it"
            )
        # Remove only what a checkpoint of ours consists of; anything else is left in place.
        for name in os.listdir(dst):
            p = os.path.join(dst, name)
            if name == PARAMS_DIR and os.path.isdir(p):
                shutil.rmtree(p)
            elif name in OUR_FILES or (name.startswith("model-") and name.endswith(".safetensors")):
                os.remove(p)
    os.makedirs(dst, exist_ok=True)
    return dst
