"""Pallas kernels of ouro-jax (Triton lowering), each with a pure-jnp ``*_reference`` twin.

The kernels are imported lazily, so that ``pallas_kernels.choices`` (the attention option's names,
listed by the CLIs) imports no jax.
"""

_LAZY = {
    "copy_kv_slots": "pallas_kernels.kv_cache",
    "copy_kv_slots_reference": "pallas_kernels.kv_cache",
    "write_kv": "pallas_kernels.kv_cache",
    "write_kv_reference": "pallas_kernels.kv_cache",
    "rope_write_kv": "pallas_kernels.rope_write_kv",
    "rope_write_kv_reference": "pallas_kernels.rope_write_kv",
    "Plan": "pallas_kernels.ragged_paged_attention",
    "Tuning": "pallas_kernels.ragged_paged_attention",
    "default_tuning": "pallas_kernels.ragged_paged_attention",
    "make_plan": "pallas_kernels.ragged_paged_attention",
    "ragged_paged_attention": "pallas_kernels.ragged_paged_attention",
    "ragged_paged_attention_reference": "pallas_kernels.ragged_paged_attention",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")


__all__ = sorted(_LAZY)
