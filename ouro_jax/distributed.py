"""Several processes (hosts) as one JAX runtime: ``jax.distributed.initialize`` from the environment.

Opt-in with the ``DISTRIBUTED`` variable (``ouro_jax/envs.py`` declares it and the others); then,
like ``torchrun``/SLURM launchers, each process reads the coordinator's ``host:port`` (JAX's own
``JAX_COORDINATOR_ADDRESS`` also accepted), the number of processes and its own id. Unset values are left to JAX's
own cluster detection (SLURM, Open MPI, Kubernetes). Must run before anything touches a device;
after it ``jax.devices()`` lists every process's devices and ``parallel.make_mesh`` spans them.
What else changes across hosts is written down in docs/multi-gpu.md.
"""

from __future__ import annotations

from typing import Mapping, Optional

from . import envs

__all__ = ["DistributedConfig", "distributed_config", "initialize_from_env"]


class DistributedConfig(dict):
    """The keyword arguments for ``jax.distributed.initialize`` (only the ones that were set)."""


def _int(env: Optional[Mapping[str, str]], short: str) -> Optional[int]:
    var = envs.variable(short)
    raw = var.read(env)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{var.source} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{var.source} must be >= 0, got {value}")
    return value


def distributed_config(env: Optional[Mapping[str, str]] = None) -> Optional[DistributedConfig]:
    """The ``initialize`` arguments the environment (``env``, default ``os.environ``) asks for, or
    None when distributed start-up is off (unset, ``0``, ``false``). ``ValueError`` for malformed or
    inconsistent values."""
    enable = envs.variable("DISTRIBUTED")
    raw = enable.read(env)
    flag = raw.strip().lower()
    if flag in ("", "0", "false", "no", "off"):
        return None
    if flag not in ("1", "true", "yes", "on"):
        raise ValueError(f"{enable.name} must be 1/0 (or true/false), got {raw!r}")
    cfg = DistributedConfig()
    addr = envs.variable("COORDINATOR_ADDRESS").read(env)
    if addr:
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"the coordinator address must be host:port, got {addr!r}")
        cfg["coordinator_address"] = addr
    n = _int(env, "NUM_PROCESSES")
    pid = _int(env, "PROCESS_ID")
    if n is not None:
        if n < 1:
            raise ValueError(f"the number of processes must be >= 1, got {n}")
        cfg["num_processes"] = n
    if pid is not None:
        if n is not None and pid >= n:
            raise ValueError(f"process id {pid} is not below the number of processes {n}")
        cfg["process_id"] = pid
    return cfg


def initialize_from_env(env: Optional[Mapping[str, str]] = None) -> bool:
    """``jax.distributed.initialize(**distributed_config(env))`` when enabled; True if it ran."""
    cfg = distributed_config(env)
    if cfg is None:
        return False
    import jax

    jax.distributed.initialize(**cfg)
    return True
