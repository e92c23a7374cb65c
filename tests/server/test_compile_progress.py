"""The start-up's compile progress: ``ouro-jax generate`` on an empty compile cache draws a bar of
executables done / total on stderr as each one finishes (read here as it comes: ``1/N`` arrives
before ``N/N``, not all at the end), and ``--no-progress`` draws none."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.server.test_server_cli import ROOT

# two executables (one row bucket and its sampler): compiled one after the other on a cold cache
ARGV = ["generate", "tiny", "1 2 3", "--max-tokens", "2", "--max-num-seqs", "1", "--max-num-batched-tokens", "16"]
ARGV += ["--buckets", "16", "--fused-decode-max-rows", "0", "--max-model-len", "64"]


def _run(cache_dir, *flags) -> list[tuple[float, str]]:
    """The command's stderr as ``(seconds since start, text)`` pieces, read as they were written."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", OURO_JAX_COMPILE_CACHE=str(cache_dir))
    cmd = [sys.executable, "-m", "ouro_jax.cli", *ARGV, *flags]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pieces = []
    while chunk := os.read(proc.stderr.fileno(), 65536):
        pieces.append((time.monotonic() - t0, chunk.decode(errors="replace")))
    assert proc.wait(120) == 0, "".join(p for _, p in pieces)
    return pieces


def _first_time(pieces, pattern: str) -> float:
    """When ``pattern`` was first on stderr (the text so far searched after each piece)."""
    text = ""
    for t, piece in pieces:
        text += piece
        if re.search(pattern, text):
            return t
    raise AssertionError(f"{pattern!r} never shown:\n{text}")


@pytest.mark.slow
def test_generate_streams_the_compile_bar_and_no_progress_turns_it_off(tmp_path):
    pieces = _run(tmp_path / "cache")
    text = "".join(p for _, p in pieces)
    n = int(re.findall(r"compiling executables: .*?\d+/(\d+) \[", text)[-1])
    assert n >= 2, text
    t_first, t_all = _first_time(pieces, rf"\b1/{n} \["), _first_time(pieces, rf"\b{n}/{n} \[")
    assert t_all - t_first > 0.1, text  # the first executable was shown while the last still compiled
    assert "tokens in" in text  # the run went on to generate
    quiet = "".join(p for _, p in _run(tmp_path / "cache", "--no-progress"))
    assert "compiling executables" not in quiet and "tokens in" in quiet, quiet
