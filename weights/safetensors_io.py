"""Safetensors files: headers and tensors through ``safe_open`` (numpy), and a streaming writer.

safetensors 0.8.0 returns ``BF16`` tensors as ``ml_dtypes.bfloat16`` numpy arrays; older versions
hand back raw 16-bit words or refuse, so a ``BF16`` tensor that does not come back as bfloat16 is
reinterpreted from its bytes (``view``), which is exact.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Iterator

import numpy as np
from safetensors import safe_open

from ._common import NP_TO_ST, ST_TO_NP, CheckpointError


def read_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype tag, shape) for every tensor in one file; a corrupt file raises, naming it."""
    try:
        with safe_open(path, framework="numpy") as f:
            out = {}
            for k in f.keys():
                s = f.get_slice(k)
                out[k] = (s.get_dtype(), tuple(int(d) for d in s.get_shape()))
            return out
    except FileNotFoundError:
        raise CheckpointError(f"safetensors file {path} does not exist") from None
    except Exception as e:  # SafetensorError is not importable under a stable name
        raise CheckpointError(f"corrupt safetensors file {path}: {e}") from None


def read_tensors(path: str, names: Iterable[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, array)`` for ``names`` from one file, one tensor in host memory at a time."""
    try:
        f = safe_open(path, framework="numpy")
    except Exception as e:
        raise CheckpointError(f"corrupt safetensors file {path}: {e}") from None
    with f:
        for name in names:
            tag = f.get_slice(name).get_dtype()
            try:
                arr = f.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"cannot read tensor {name} from {path}: {e}") from None
            want = ST_TO_NP.get(tag)
            if want is None:
                raise CheckpointError(f"tensor {name} in {path} has unsupported dtype {tag}")
            if arr.dtype != want:
                if arr.dtype.itemsize != want.itemsize:
                    raise CheckpointError(f"tensor {name} in {path}: safetensors returned {arr.dtype} for dtype {tag}")
                arr = arr.view(want)
            yield name, arr


def write_safetensors(
    path: str,
    specs: list[tuple[str, np.dtype, tuple[int, ...]]],
    tensors: Iterator[tuple[str, np.ndarray]],
    metadata: dict | None = None,
) -> int:
    """Stream ``tensors`` (in the order of ``specs``) into one safetensors file; returns data bytes.

    The header is computed from ``specs`` first, so no more than one tensor is ever in memory."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    off = 0
    for name, dtype, shape in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NP_TO_ST[np.dtype(dtype)], "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, dtype, shape in specs:
            got_name, arr = next(tensors)
            if got_name != name or tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
                raise AssertionError(
                    f"writer got {got_name} {arr.shape} {arr.dtype}, expected {name} {shape} {np.dtype(dtype)}"
                )
            arr = np.ascontiguousarray(arr)
            if arr.dtype.byteorder == ">":
                arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
            f.write(arr.reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)
    return off
