"""Checkpoint folders as a whole: detect, load, convert, write random ones (see the package docstring)."""

from __future__ import annotations

import os
import shutil

import numpy as np

from ._common import CONFIG_NAME, MARKER_NAME, CheckpointError, canonical_dtype, dtype_name, place, prepare_dst
from .config import OuroConfig, get_preset
from .hf import iter_hf_tensors, load_hf, open_hf, write_hf
from .hf_names import hf_name_to_path, hf_tensor_shapes, set_path
from .orbax_io import load_orbax, save_orbax
from .random_init import random_hf_tensors
from .tokenizer import save_preset_tokenizer

__all__ = ["load_checkpoint", "convert", "save_random", "detect_format", "CheckpointError"]

# Files of a HF folder that convert() copies next to the converted weights (tokenizer, chat template).
AUX_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def detect_format(path) -> str:
    """``"orbax"`` (converted by ouro-jax) or ``"hf"``; raises :class:`CheckpointError` otherwise."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"checkpoint folder {path} does not exist"
            if not os.path.exists(path)
            else f"checkpoint path {path} is a file, not a folder"
        )
    if os.path.isfile(os.path.join(path, MARKER_NAME)):
        return "orbax"
    if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        raise CheckpointError(f"no {CONFIG_NAME} in {path}: not a Hugging Face or ouro-jax checkpoint folder")
    return "hf"


def load_checkpoint(path, dtype=None, device=None) -> tuple[OuroConfig, dict]:
    """Load a checkpoint folder (either layout) into ``(config, params)`` on ``device`` (default: the
    first jax device), tensor by tensor."""
    dt = canonical_dtype(dtype)
    if detect_format(path) == "orbax":
        return load_orbax(path, dt, device)
    return load_hf(path, dt, device)


def convert(src, dst, dtype=None, progress: bool = True, overwrite: bool = False) -> str:
    """Convert a Hugging Face folder into the ouro-jax layout at ``dst``; returns ``dst`` (absolute).

    Tensors are read one at a time, transposed and cast on the device, then written with orbax."""
    dt = canonical_dtype(dtype)
    src = os.path.abspath(os.fspath(src))
    if detect_format(src) != "hf":
        raise CheckpointError(f"{src} is already an ouro-jax converted checkpoint; load it directly")
    config, inv = open_hf(src)  # every check happens before dst is touched
    dst_abs = os.path.abspath(os.fspath(dst))
    if dst_abs == src:
        raise CheckpointError("convert: src and dst are the same folder")
    dst = prepare_dst(dst_abs, overwrite)
    it = iter_hf_tensors(src, inv)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, total=len(inv), desc="convert", unit="tensor")
    params: dict = {}
    for name, arr in it:
        path, transpose = hf_name_to_path(name)
        set_path(params, path, place(arr, transpose, dt))
        del arr
    save_orbax(dst, config, params, extra={"source": src}, progress=progress)
    for aux in AUX_FILES:
        p = os.path.join(src, aux)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst, aux))
    return dst


def save_random(
    path,
    config: OuroConfig | str,
    seed: int = 0,
    layout: str = "hf",
    dtype="float32",
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> str:
    """Write a seeded random checkpoint; ``config`` is an :class:`OuroConfig` or a preset name.

    ``layout="hf"``: config.json + model.safetensors (or shards of at most ``max_shard_bytes`` data
    bytes + index), streamed tensor by tensor.  ``layout="orbax"``: the converted layout directly.
    The config written records ``torch_dtype=dtype``; the preset tokenizer and chat template
    (``weights/tokenizer.py``) are written with it.  ``progress``: tqdm bars (tensors drawn and
    written; orbax's bytes saved).  Returns the folder (absolute)."""
    if isinstance(config, str):
        config = get_preset(config)
    dt = canonical_dtype(dtype)
    if dt is None:
        raise ValueError("save_random needs a concrete dtype (float32, bfloat16 or float16)")
    if layout not in ("hf", "orbax"):
        raise ValueError(f"layout must be 'hf' or 'orbax', got {layout!r}")
    if layout == "orbax" and max_shard_bytes is not None:
        raise ValueError("max_shard_bytes applies to layout='hf' only")
    config = config.replace(torch_dtype=dtype_name(dt))
    path = prepare_dst(path, overwrite)
    # Drawn in float32 and then cast (float64 -> float32 -> dtype), the same values as
    # ``random_init.random_params(config, seed, dtype)``.
    bar = None
    if progress:
        from tqdm import tqdm

        what = "random + write" if layout == "hf" else "random"
        bar = tqdm(total=len(hf_tensor_shapes(config)), desc=what, unit="tensor")

    def tensors():
        for n, a in random_hf_tensors(config, seed=seed, dtype=np.float32):
            if bar is not None:
                bar.update()
            yield n, a.astype(dt)

    try:
        if layout == "hf":
            write_hf(path, config, tensors(), dt, max_shard_bytes)
        else:
            params: dict = {}
            for name, arr in tensors():
                p, transpose = hf_name_to_path(name)
                set_path(params, p, place(arr, transpose, None))
    finally:
        if bar is not None:
            bar.close()
    if layout == "orbax":
        save_orbax(path, config, params, extra={"source": f"random(seed={seed})"}, progress=progress)
    save_preset_tokenizer(path, config)  # what LLM(preset) uses, so that the folder works the same
    return path
