"""Session 14: does materialising the f32 residual stream at layer boundaries help? XLA recomputes
the residual from up to two layers' outputs in every norm fusion (prefill:1024: fusions of 5-9
operands, 6-11 us each). BARRIER=entry puts an optimization_barrier on x at each layer's entry,
BARRIER=both also after the attention's residual add; then benchmarks.profile_step runs in this
process with the patched layer."""

import os
import sys

import jax
import jax.numpy as jnp

from ouro_jax import model

mode = os.environ.get("BARRIER", "")
real = model.OuroDecoderLayer.__call__


def patched(self, x, cos, sin, attention, cache, layer=None):
    layer = self.layer_index if layer is None else layer
    f32 = jnp.float32
    if mode in ("entry", "both"):
        x = jax.lax.optimization_barrier(x)
    a, cache = self.self_attn(self.input_layernorm(x), cos, sin, layer, attention, cache)
    x = x + self.input_layernorm_2(a, f32)
    if mode == "both":
        x = jax.lax.optimization_barrier(x)
    m = self.mlp(self.post_attention_layernorm(x))
    x = x + self.post_attention_layernorm_2(m, f32)
    return x, cache


if mode:
    model.OuroDecoderLayer.__call__ = patched
from benchmarks import profile_step  # noqa: E402

profile_step.main(sys.argv[1:])
