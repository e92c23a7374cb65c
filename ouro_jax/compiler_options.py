"""XLA options of the executables this package compiles: the engine's steps and ``generate()``.

Kept apart from the runner because ``generate()`` needs the fused steps' options too: both run a
device-side ``while_loop`` over a token's loops, and on the GPU that loop must compile into CUDA
graph conditional nodes, else XLA copies its predicate to the host after every loop and the host
thread waits for it before launching the next (docs/decisions.md, "What the engine's fused step
loses against `generate()`").

Extra options for experiments on the device come from the engine config
(``EngineConfig.fused_xla_options`` / ``step_xla_options``, whose defaults are environment
variables declared in ``envs.py``): ``"name=value;name=value"``, values
``true``/``false``, integers, else strings (enum names, comma lists, or nothing, as in
``xla_gpu_enable_command_buffer=`` for no command buffers). They enter the executable store's key
through the config's hash. ``generate()`` has no engine config and takes the fused steps' extras
from the variable.
"""

from __future__ import annotations

import jax

from . import envs
from .engine_config import parse_xla_options

__all__ = ["FUSED_COMMAND_BUFFER", "step_options"]

# XLA's default command-buffer kinds as its source sets them (debug_options_flags.cc; not read back
# from jax 0.11.2's build, which accepts every name here) plus CONDITIONAL and WHILE.
FUSED_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE"


def step_options(fused: bool = False, extra: str | None = None) -> dict:
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
    "Fused steps at large buckets").

    ``extra``: the config's ``fused_xla_options`` or ``step_xla_options`` text, added on the GPU."""
    if jax.default_backend() != "gpu":
        return {}
    opts = {"xla_disable_hlo_passes": "rematerialization"}
    if fused:
        opts["xla_gpu_enable_command_buffer"] = FUSED_COMMAND_BUFFER
        opts["xla_gpu_enable_cub_radix_sort"] = False
    if extra is None:  # generate(): no engine config
        extra = envs.FUSED_XLA_OPTIONS if fused else envs.STEP_XLA_OPTIONS
    opts.update(parse_xla_options(extra, "fused_xla_options" if fused else "step_xla_options"))
    return opts
