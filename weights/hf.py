"""Hugging Face checkpoint folders: ``config.json`` + ``model.safetensors``, or shards listed in
``model.safetensors.index.json``.  Reading checks the whole inventory (names, shapes, dtypes) from
the headers before a single tensor is read; writing streams tensor by tensor."""

from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np

from ._common import CONFIG_NAME, INDEX_FILE, SINGLE_FILE, CheckpointError, check_inventory, place, read_config
from .config import OuroConfig
from .hf_names import hf_name_to_path, hf_tensor_shapes, set_path
from .safetensors_io import read_header, read_tensors, write_safetensors


def tensor_files(folder: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file (absolute path) that should hold it, from the index or
    the single file.  Like transformers, ``model.safetensors`` wins over an index."""
    single = os.path.join(folder, SINGLE_FILE)
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(single):
        return {name: single for name in read_header(single)}
    if os.path.isfile(index):
        try:
            with open(index) as f:
                idx = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index} is not readable JSON: {e}") from None
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index} has no weight_map object (tensor name -> shard file)")
        out = {}
        for name, shard in wm.items():
            p = os.path.join(folder, shard)
            if not os.path.isfile(p):
                raise CheckpointError(f"{index} puts tensor {name} in shard {shard}, which does not exist in {folder}")
            out[name] = p
        return out
    others = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if others:
        raise CheckpointError(
            f"{folder} has safetensors shards ({', '.join(others[:4])}) but no "
            f"{INDEX_FILE} to say which tensor is where"
        )
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}")


def inventory(folder: str) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (dtype tag, shape, file) for the tensors the folder's file list names, each checked to
    be present in its file."""
    files = tensor_files(folder)
    headers = {p: read_header(p) for p in sorted(set(files.values()))}
    out = {}
    for name, p in files.items():
        h = headers[p]
        if name not in h:
            raise CheckpointError(
                f"tensor {name} is listed in {INDEX_FILE} under "
                f"{os.path.basename(p)} but that shard does not contain it"
            )
        out[name] = (h[name][0], h[name][1], os.path.basename(p))
    return out


def open_hf(folder: str) -> tuple[OuroConfig, dict[str, tuple[str, tuple[int, ...], str]]]:
    """Config and a fully checked inventory of a HF folder (nothing but headers is read)."""
    folder = os.path.abspath(os.fspath(folder))
    config = read_config(folder)
    inv = inventory(folder)
    check_inventory(config, inv, folder)
    return config, inv


def iter_hf_tensors(folder: str, inv: dict) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, host array in HF layout)`` file by file, one tensor in memory at a time."""
    folder = os.path.abspath(os.fspath(folder))
    order = list(inv)
    by_file: dict[str, list[str]] = {}
    for name in order:
        by_file.setdefault(inv[name][2], []).append(name)
    for fname in sorted(by_file):
        yield from read_tensors(os.path.join(folder, fname), by_file[fname])


def load_hf(folder: str, dtype=None, device=None, progress=None) -> tuple[OuroConfig, dict]:
    config, inv = open_hf(folder)
    params: dict = {}
    it = iter_hf_tensors(folder, inv)
    if progress is not None:
        it = progress(it, total=len(inv))
    for name, arr in it:
        path, transpose = hf_name_to_path(name)
        set_path(params, path, place(arr, transpose, dtype, device))
        del arr
    return config, params


# ---------------------------------------------------------------------------------- writing
def shard_plan(specs: list[tuple[str, np.dtype, tuple[int, ...]]], max_shard_bytes: int | None):
    """Greedy split of ``specs`` (in order) into shards of at most ``max_shard_bytes`` data bytes
    (a larger tensor gets a shard to itself)."""
    if max_shard_bytes is None:
        return [specs]
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards, cur, size = [], [], 0
    for s in specs:
        n = int(np.prod(s[2], dtype=np.int64)) * np.dtype(s[1]).itemsize
        if cur and size + n > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += n
    if cur:
        shards.append(cur)
    return shards


def write_hf(
    folder: str,
    config: OuroConfig,
    tensors: Iterator[tuple[str, np.ndarray]],
    dtype: np.dtype,
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write ``config.json`` and the tensors (HF names/layout, all of dtype ``dtype``, in
    ``hf_tensor_shapes`` order) as one file or as shards + index.  Returns the files written."""
    specs = [(n, np.dtype(dtype), s) for n, s in hf_tensor_shapes(config).items()]
    shards = shard_plan(specs, max_shard_bytes)
    config.to_json(os.path.join(folder, CONFIG_NAME))
    if len(shards) == 1 and max_shard_bytes is None:
        write_safetensors(os.path.join(folder, SINGLE_FILE), specs, tensors)
        return [SINGLE_FILE]
    names, weight_map, total = [], {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(os.path.join(folder, fname), shard, tensors)
        weight_map.update({n: fname for n, _, _ in shard})
        names.append(fname)
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names + [INDEX_FILE]
