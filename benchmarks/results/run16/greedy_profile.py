"""profile_step with sampling patched to greedy-only (no lax.cond): does the cond cost the idle gap?"""

import sys

import jax.numpy as jnp

import ouro_jax.runner as R
import ouro_jax.sampling as S


def greedy_only(logits, temperature, top_k, top_p, keys):
    return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)


S.sample = greedy_only
if hasattr(R, "sample"):
    R.sample = greedy_only
from benchmarks import profile_step  # noqa: E402 (after the patch)

profile_step.main(sys.argv[1:])
