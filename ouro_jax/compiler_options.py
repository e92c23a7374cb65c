"""XLA options of the executables this package compiles: the engine's steps and ``generate()``.

Kept apart from the runner because ``generate()`` needs the fused steps' options too: both run a
device-side ``while_loop`` over a token's loops, and on the GPU that loop must compile into CUDA
graph conditional nodes, else XLA copies its predicate to the host after every loop and the host
thread waits for it before launching the next (docs/decisions.md, "What the engine's fused step
loses against `generate()`").

Two environment variables add options for experiments on the device (``"name=value;name=value"``;
values ``true``/``false``, integers, else strings: enum names, comma lists, or nothing, as in
``xla_gpu_enable_command_buffer=`` for no command buffers); both are part of the
executable store's key through the options they produce:

* ``OURO_JAX_FUSED_XLA_OPTIONS``: fused decode steps and ``generate()``, e.g.
  ``xla_gpu_command_buffer_update_mode=SKIP_TEMP``;
* ``OURO_JAX_STEP_XLA_OPTIONS``: one-loop steps (prefill, mixed and loop-by-loop decode
  invocations), e.g. ``xla_gpu_enable_triton_gemm=false``.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

__all__ = [
    "FUSED_COMMAND_BUFFER",
    "FUSED_XLA_OPTIONS_ENV",
    "STEP_XLA_OPTIONS_ENV",
    "option_overrides",
    "step_options",
]

# XLA's default command-buffer kinds as its source sets them (debug_options_flags.cc; not read back
# from jax 0.11.2's build, which accepts every name here) plus CONDITIONAL and WHILE.
FUSED_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE"

FUSED_XLA_OPTIONS_ENV = "OURO_JAX_FUSED_XLA_OPTIONS"
STEP_XLA_OPTIONS_ENV = "OURO_JAX_STEP_XLA_OPTIONS"


def option_overrides(text: Optional[str] = None, env: str = FUSED_XLA_OPTIONS_ENV) -> dict:
    """``env``'s value (or ``text``) parsed into compiler options; ``ValueError`` names the
    variable and an entry that is not ``name=value`` with an ``xla_`` name."""
    text = os.environ.get(env, "") if text is None else text
    out = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        name, sep, value = (x.strip() for x in entry.partition("="))
        if not sep or not name.startswith("xla_"):
            raise ValueError(f"{env}: {entry!r} is not 'xla_name=value' (entries split by ';')")
        low = value.lower()
        if low in ("true", "false"):
            out[name] = low == "true"
        elif value.lstrip("-").isdigit():
            out[name] = int(value)
        else:
            out[name] = value
    return out


def step_options(fused: bool = False) -> dict:
    """XLA options of a step executable (none off the GPU). On the GPU the rematerialization pass
    is off: it models each in-place K/V update of the donated pool as a new pool-sized buffer,
    estimates more than twice the device's memory, warns that it cannot get under it, and can
    only slow compiles (buffer assignment aliases the whole pool in place: docs/decisions.md,
    "Start-up").

    ``fused``: a fused decode step's depth ``while_loop`` also goes into CUDA graphs (conditional
    nodes). Without that, XLA copies the loop predicate to the host after every loop and the host
    thread waits for it before launching the next: on the H200 a 1-row step of Ouro-1.4B lost
    ~0.7 ms a token to it (docs/decisions.md, "What the engine's fused step loses").

    Fused steps also keep XLA's own sort kernel instead of CUB's radix sort: from ~128 coda rows XLA
    sorts the sampler's ``[C, vocab]`` logits with CUB, which does not go into a CUDA graph, so the
    sampling ``lax.cond`` around it ran on the host: the launch copied the branch predicate back
    and waited for the whole step (a 128-row step returned after 16.4 ms instead of 1.7 ms on the
    H200) and asynchronous scheduling could not overlap the host's work with it (docs/decisions.md,
    "Fused steps at large buckets")."""
    if jax.default_backend() != "gpu":
        return {}
    opts = {"xla_disable_hlo_passes": "rematerialization"}
    if fused:
        opts["xla_gpu_enable_command_buffer"] = FUSED_COMMAND_BUFFER
        opts["xla_gpu_enable_cub_radix_sort"] = False
        opts.update(option_overrides(env=FUSED_XLA_OPTIONS_ENV))
    else:
        opts.update(option_overrides(env=STEP_XLA_OPTIONS_ENV))
    return opts
