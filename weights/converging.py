"""A "converging" variant of any Ouro param tree: later loops change the hidden state little, so
the first loops' greedy tokens agree with full depth's on most positions (self-speculative
decoding's draft, ``scheduler/speculation.py``, then gets accepted often).

``converging_params(params, config, scale)`` makes each layer add ``scale`` times its usual update
to the residual stream, and pulls the final norm's weight towards its mean by the same factor:

- **residual branches**: Ouro's layers are "sandwich" layers, ``x + norm_2(branch(norm(x)))``, so
  the size of what a branch adds is its *output* norm's weight (``input_layernorm_2`` after the
  attention, ``post_attention_layernorm_2`` after the MLP). Those weights are scaled by ``scale``.
  Scaling ``o_proj`` / ``down_proj`` instead would change next to nothing: ``norm_2`` divides it
  out again (all but its epsilon).
- **final norm**: it runs after every loop and feeds the next, so with a weight ``w`` that is not
  constant an unchanged state would still be multiplied by ``w`` elementwise once per loop
  (``norm(w * x) = w * w * x / rms(w * x)``); with a constant weight ``c``, ``c * x`` (``rms(x) =
  1``) is its own image. The weight becomes ``mean(w) + scale * (w - mean(w))``.

``scale = 1`` returns the model unchanged; ``scale = 0`` makes every loop after the first the
identity (every depth gives the same tokens); in between the change per loop shrinks with
``scale``. How much depth ``d`` and depth ``T`` agree for a given ``scale`` depends on the model's
width, depth and vocabulary, and is measured, never assumed. The share of full-depth greedy tokens
that depth d's argmax gives too at the same position and context (seed-0 random weights; for
``ouro-1.4b`` in bfloat16 on an H200, 4 x 128 tokens after 1024-token prompts,
``python -m benchmarks.converging_agreement``; for ``tiny``, 3 x 32 tokens after 8, the float64
reference of ``tests/weights/test_converging.py``):

    scale                1      0.1    0.03   0.02   0.01   0.003  0.001  0
    ouro-1.4b  d=1       0%     0.6%   21%    -      61%    85%    96%    100%
               d=2       0%     11%    40%    -      71%    89%    97%    100%
               d=3       0.8%   28%    68%    -      84%    93%    98%    100%
    tiny       d=1       0%     31%    -      88%    -      -      -      100%

``benchmarks/self_spec.py`` reports the acceptance the engine measures on such weights.

Array-library agnostic: numpy and jax leaves both work, each keeps its dtype; the tree passed in
is not modified (leaves that do not change are shared).
"""

from __future__ import annotations

from .config import OuroConfig

__all__ = ["converging_params", "BRANCH_OUTPUT_NORMS"]

#: the norms on each layer's branch outputs: their weights set how much a layer adds
BRANCH_OUTPUT_NORMS = ("input_layernorm_2", "post_attention_layernorm_2")


def converging_params(params: dict, config: OuroConfig, scale: float) -> dict:
    """``params`` (the Flax layout of ``weights/hf_names.py``) with every layer's residual update
    scaled by ``scale`` and the final norm's weight pulled towards its mean (the module doc)."""
    scale = float(scale)
    if not 0.0 <= scale <= 1.0:
        raise ValueError(f"converging scale must lie in [0, 1] (1: the model unchanged), got {scale}")
    if scale == 1.0:  # mean + (w - mean) need not round back to w
        return params
    if "params" in params and "embed_tokens" not in params:  # a {"params": ...} variables dict
        return {**params, "params": converging_params(params["params"], config, scale)}
    out = dict(params)
    for i in range(config.num_hidden_layers):
        layer = dict(params[f"layers_{i}"])
        for name in BRANCH_OUTPUT_NORMS:
            w = layer[name]["scale"]
            layer[name] = {**layer[name], "scale": (w * scale).astype(w.dtype)}
        out[f"layers_{i}"] = layer
    w = params["norm"]["scale"]
    mean = w.astype("float32").mean()
    out["norm"] = {**params["norm"], "scale": (mean + scale * (w.astype("float32") - mean)).astype(w.dtype)}
    return out
