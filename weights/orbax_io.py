"""The converted layout: a folder with our ``config.json``, a ``ouro_jax_checkpoint.json`` marker and
an orbax checkpoint of the Flax param tree in ``params/`` (already transposed, already cast)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp

from ._common import (
    CONFIG_NAME,
    FORMAT_NAME,
    FORMAT_VERSION,
    MARKER_NAME,
    NP_TO_ST,
    PARAMS_DIR,
    CheckpointError,
    check_inventory,
    dtype_name,
    read_config,
)
from .config import OuroConfig
from .hf_names import iter_paths, path_to_hf_name


def save_orbax(
    folder: str, config: OuroConfig, params: dict, extra: dict | None = None, progress: bool = False
) -> None:
    """Write ``params`` (a tree of jax arrays, Flax layout) + config + marker into ``folder``, which
    must already exist and hold none of these.  The marker is written last: a folder without it is
    not mistaken for a finished conversion.  ``progress``: a bar of the bytes orbax has written."""
    folder = os.path.abspath(folder)  # orbax wants absolute paths
    dtypes = sorted({dtype_name(x.dtype) for _, x in iter_paths(params)})
    dtype = dtypes[0] if len(dtypes) == 1 else "mixed"
    if dtype != "mixed":
        config = config.replace(torch_dtype=dtype)
    pdir = os.path.join(folder, PARAMS_DIR)
    total = sum(int(x.nbytes) for _, x in iter_paths(params))
    with ocp.StandardCheckpointer() as ckptr, _BytesWritten(folder, total, "save", progress):
        ckptr.save(pdir, params)
        ckptr.wait_until_finished()
    config.to_json(os.path.join(folder, CONFIG_NAME))
    marker = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "params": PARAMS_DIR,
        **(extra or {}),
    }
    with open(os.path.join(folder, MARKER_NAME), "w") as f:
        json.dump(marker, f, indent=2)


class _BytesWritten:
    """A tqdm bar of the bytes under ``folder`` while orbax saves (its save is one opaque call; the
    bytes on disk are the only progress it shows).  A no-op when ``enabled`` is false."""

    def __init__(self, folder: str, total: int, desc: str, enabled: bool, interval: float = 0.25):
        self.folder, self.total, self.desc, self.enabled, self.interval = folder, total, desc, enabled, interval
        self._stop = threading.Event()

    def _bytes(self) -> int:
        n = 0
        for root, _, files in os.walk(self.folder):
            for f in files:
                try:
                    n += os.path.getsize(os.path.join(root, f))
                except OSError:  # orbax renames its temporary folders while we walk
                    pass
        return n

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self.bar.n = min(self._bytes(), self.total)
            self.bar.refresh()

    def __enter__(self):
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024)
            self.thread = threading.Thread(target=self._poll, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, exc_type, *exc):
        if self.enabled:
            self._stop.set()
            self.thread.join()
            if exc_type is None:
                self.bar.n = self.total
            self.bar.close()
        return False


def read_marker(folder: str) -> dict:
    p = os.path.join(folder, MARKER_NAME)
    try:
        with open(p) as f:
            m = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p} is not readable JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{p} is not an ouro-jax checkpoint marker")
    if m.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{p}: checkpoint format version {m.get('format_version')!r} is not "
            f"supported by this ouro-jax (it reads version {FORMAT_VERSION})"
        )
    return m


def load_orbax(folder: str, dtype=None, device=None) -> tuple[OuroConfig, dict]:
    folder = os.path.abspath(os.fspath(folder))
    marker = read_marker(folder)
    config = read_config(folder)
    pdir = os.path.join(folder, marker.get("params", PARAMS_DIR))
    if not os.path.isdir(pdir):
        raise CheckpointError(f"converted checkpoint {folder} has no orbax folder {pdir}")
    device = device if device is not None else jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    with _quiet_orbax(), ocp.StandardCheckpointer() as ckptr:
        try:
            meta = ckptr.metadata(pdir).item_metadata
        except Exception as e:
            raise CheckpointError(f"corrupt orbax checkpoint {pdir}: {_short(e)}") from None
        tree = getattr(meta, "tree", None)
        if not isinstance(tree, dict):
            raise CheckpointError(
                f"corrupt orbax checkpoint {pdir}: its tree metadata (_METADATA) is missing or unreadable"
            )
        # Check the stored tree against the config in HF terms (same messages as a HF folder).
        found, paths = {}, {}
        for path, meta in iter_paths(tree):
            try:
                name = path_to_hf_name(path)
            except (KeyError, ValueError, IndexError):
                name = "/".join(path)
            shape = tuple(meta.shape)
            if path[-1] == "kernel":
                shape = tuple(reversed(shape))
            tag = NP_TO_ST.get(np.dtype(meta.dtype), str(np.dtype(meta.dtype)))
            found[name] = (tag, shape, PARAMS_DIR)
            paths[name] = path
        check_inventory(config, found, pdir)
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(
                tuple(m.shape), np.dtype(dtype if dtype is not None else m.dtype), sharding=sharding
            ),
            tree,
        )
        try:
            params = ckptr.restore(pdir, target)
        except Exception as e:
            raise CheckpointError(f"cannot restore orbax checkpoint {pdir}: {_short(e)}") from None
    return config, _plain_dicts(params)


@contextlib.contextmanager
def _quiet_orbax():
    """Silence orbax's loggers (asyncio, absl) while reading: a broken checkpoint makes every failed
    read task log its trace (thousands of lines); the one ``CheckpointError`` raised says it all."""
    loggers = [logging.getLogger(name) for name in ("asyncio", "absl")]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, before):
            lg.disabled = was


def _short(e: Exception, limit: int = 300) -> str:
    """One line: the error's first line without TensorStore's spec dump, naming the array if known."""
    text = str(e)
    array = re.search(r"'path': '([^'/][^']*?)/?',", text)  # the array's key inside the checkpoint
    text = text.split("See full TensorStore details")[0].splitlines()[0].strip() if text else type(e).__name__
    if array:
        text = f"array {array.group(1)}: {text}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _plain_dicts(tree):
    if isinstance(tree, dict):
        return {k: _plain_dicts(v) for k, v in tree.items()}
    return tree
