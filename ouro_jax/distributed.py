"""Several processes (hosts) as one JAX runtime: ``jax.distributed.initialize`` from the environment.

Opt-in with ``OURO_JAX_DISTRIBUTED=1``; then, like ``torchrun``/SLURM launchers, each process reads
``OURO_JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0; ``JAX_COORDINATOR_ADDRESS`` also
accepted), ``OURO_JAX_NUM_PROCESSES`` and ``OURO_JAX_PROCESS_ID``. Unset values are left to JAX's
own cluster detection (SLURM, Open MPI, Kubernetes). Must run before anything touches a device;
after it ``jax.devices()`` lists every process's devices and ``parallel.make_mesh`` spans them.
What else changes across hosts is written down in docs/multi-gpu.md.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["DistributedConfig", "distributed_config", "initialize_from_env"]

ENABLE = "OURO_JAX_DISTRIBUTED"


class DistributedConfig(dict):
    """The keyword arguments for ``jax.distributed.initialize`` (only the ones that were set)."""


def _int(env: Mapping[str, str], names: tuple[str, ...]) -> Optional[int]:
    for name in names:
        raw = env.get(name)
        if raw is not None and raw.strip() != "":
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {raw!r}") from None
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
            return value
    return None


def distributed_config(env: Optional[Mapping[str, str]] = None) -> Optional[DistributedConfig]:
    """The ``initialize`` arguments the environment asks for, or None when ``OURO_JAX_DISTRIBUTED``
    is off (unset, ``0``, ``false``). ``ValueError`` for malformed or inconsistent values."""
    env = os.environ if env is None else env
    flag = env.get(ENABLE, "").strip().lower()
    if flag in ("", "0", "false", "no", "off"):
        return None
    if flag not in ("1", "true", "yes", "on"):
        raise ValueError(f"{ENABLE} must be 1/0 (or true/false), got {env.get(ENABLE)!r}")
    cfg = DistributedConfig()
    addr = env.get("OURO_JAX_COORDINATOR_ADDRESS") or env.get("JAX_COORDINATOR_ADDRESS")
    if addr:
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"the coordinator address must be host:port, got {addr!r}")
        cfg["coordinator_address"] = addr
    n = _int(env, ("OURO_JAX_NUM_PROCESSES", "JAX_NUM_PROCESSES"))
    pid = _int(env, ("OURO_JAX_PROCESS_ID", "JAX_PROCESS_ID"))
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
