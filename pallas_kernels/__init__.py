"""Pallas kernels of ouro-jax (Triton lowering), each with a pure-jnp ``*_reference`` twin."""

from pallas_kernels.kv_cache import copy_kv_slots, copy_kv_slots_reference, write_kv, write_kv_reference
from pallas_kernels.ragged_paged_attention import (
    Plan,
    Tuning,
    default_tuning,
    make_plan,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "Plan",
    "Tuning",
    "copy_kv_slots",
    "copy_kv_slots_reference",
    "default_tuning",
    "make_plan",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv",
    "write_kv_reference",
]
