"""ouro-jax: inference for Ouro looped language models in JAX.

Public API (lazily imported so that ``import ouro_jax`` stays light): ``OuroConfig``, ``get_preset``,
``PRESETS`` (from ``weights.config``), ``forward``, ``generate``, ``LLM``, ``EngineConfig``,
``SamplingParams``.
"""

from weights.config import PRESETS, OuroConfig, get_preset

_LAZY = {
    "forward": ("ouro_jax.full_forward", "forward"),
    "ForwardResult": ("ouro_jax.full_forward", "ForwardResult"),
    "generate": ("ouro_jax.static_generate", "generate"),
    "GenerateResult": ("ouro_jax.static_generate", "GenerateResult"),
    "OuroModel": ("ouro_jax.model", "OuroModel"),
    "init_params": ("ouro_jax.model", "init_params"),
    "LLM": ("ouro_jax.llm", "LLM"),
    "EngineConfig": ("ouro_jax.engine_config", "EngineConfig"),
    "SamplingParams": ("scheduler.sampling_params", "SamplingParams"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'ouro_jax' has no attribute {name!r}")


__all__ = ["OuroConfig", "PRESETS", "get_preset", *_LAZY]
