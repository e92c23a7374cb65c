"""Every ``OURO_JAX_*`` environment variable, declared once: its default and what it does.

No other module reads ``os.environ`` for an engine option (``tests/engine/test_config.py`` checks).
Values are read when asked for (``envs.COMPILE_CACHE`` reads the variable now), so a test or a
launcher may set them after import. Engine options that a variable sets reach the engine as the
defaults of ``EngineConfig`` fields (``ouro_jax/engine_config.py``), so they enter the config, its
hash and the executable store's key like any other option.

    OURO_JAX_COMPILE_CACHE=/path   # or "off"
    python -m benchmarks.decode ...
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

__all__ = ["PREFIX", "VARIABLES", "Variable", "describe", "unknown_variables", "variable"]

PREFIX = "OURO_JAX_"


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    default: Optional[str]
    help: str
    # JAX's own spelling of the same setting, read when ours is unset (e.g. ``JAX_PROCESS_ID``)
    fallback: Optional[str] = None

    def read(self, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """The value in ``env`` (default ``os.environ``), else the fallback's, else the default."""
        env = os.environ if env is None else env
        value = env.get(self.name)
        if value is None and self.fallback is not None:
            value = env.get(self.fallback)
        return self.default if value is None else value

    @property
    def source(self) -> str:
        """The names to quote in an error: ours, and JAX's where it reads one."""
        return self.name if self.fallback is None else f"{self.name} (or {self.fallback})"


_DECLARED = (
    Variable(
        "OURO_JAX_COMPILE_CACHE",
        None,
        "folder of JAX's persistent compilation cache and the executable store ('off' disables both); "
        "default ~/.cache/ouro_jax/xla. The default of EngineConfig.compile_cache_dir.",
    ),
    Variable(
        "OURO_JAX_FUSED_XLA_OPTIONS",
        "",
        "extra XLA options of fused decode steps and generate(), 'xla_name=value;...'. "
        "The default of EngineConfig.fused_xla_options.",
    ),
    Variable(
        "OURO_JAX_STEP_XLA_OPTIONS",
        "",
        "extra XLA options of one-loop steps (prefill, mixed, loop-by-loop decode), 'xla_name=value;...'. "
        "The default of EngineConfig.step_xla_options.",
    ),
    Variable(
        "OURO_JAX_DISTRIBUTED",
        "0",
        "1: call jax.distributed.initialize from the variables below before the engine starts (multi-host)",
    ),
    Variable(
        "OURO_JAX_COORDINATOR_ADDRESS",
        None,
        "host:port of process 0 (with OURO_JAX_DISTRIBUTED=1)",
        fallback="JAX_COORDINATOR_ADDRESS",
    ),
    Variable(
        "OURO_JAX_NUM_PROCESSES",
        None,
        "number of processes (with OURO_JAX_DISTRIBUTED=1)",
        fallback="JAX_NUM_PROCESSES",
    ),
    Variable(
        "OURO_JAX_PROCESS_ID",
        None,
        "this process's index (with OURO_JAX_DISTRIBUTED=1)",
        fallback="JAX_PROCESS_ID",
    ),
)

#: The declared variables by short name (the name less ``OURO_JAX_``).
VARIABLES: dict[str, Variable] = {v.name.removeprefix(PREFIX): v for v in _DECLARED}


def variable(short: str) -> Variable:
    """The declared variable ``OURO_JAX_<short>``."""
    return VARIABLES[short]


def __getattr__(name: str):
    """``envs.COMPILE_CACHE`` and the like: the variable's value now, or its default."""
    if name in VARIABLES:
        return VARIABLES[name].read()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(VARIABLES))


def unknown_variables(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """``OURO_JAX_*`` names set in ``env`` (default ``os.environ``) that are not declared: a
    misspelt or retired option would otherwise do nothing, silently (``LLM`` warns of them)."""
    env = os.environ if env is None else env
    known = {v.name for v in _DECLARED}
    return sorted(k for k in env if k.startswith(PREFIX) and k not in known)


def describe() -> str:
    """One line per variable: name, default and help (``ouro-jax env``)."""
    return "\n".join(f"{v.name} (default {v.default!r}): {v.help}" for v in _DECLARED)
