"""How often depth ``d``'s greedy token equals full depth's, per ``converging_params`` scale: the
table of ``weights/converging.py``'s docstring (no engine, no speculation).

    python -m benchmarks.converging_agreement [--preset ouro-1.4b] [--scale 1 0.1 0.03 0.01 0.003 0.001 0]
        [--batch 4] [--context 1024] [--new-tokens 128] [--seed 0]

Per scale: the static ``ouro_jax.generate`` makes ``--new-tokens`` greedy full-depth tokens after
``--batch`` seeded random ``--context``-token prompts (``benchmarks.workloads.decode_prompts``);
``ouro_jax.forward`` then runs prompt + tokens once, and at every generated position each depth's
argmax is compared with full depth's, with the same (full-depth) context: what a greedy draft of
``d`` loops would propose there. ``forward == generate`` is the share where the dense forward's
full-depth argmax gives the generated token (bfloat16 near-ties aside, 1).
"""

from __future__ import annotations

import argparse
import time
from typing import Optional, Sequence

import numpy as np

__all__ = ["agreement", "main"]


def agreement(params, config, prompts: np.ndarray, new_tokens: int) -> dict:
    """``by_depth[d - 1]``: the share of generated positions where depth ``d``'s argmax is the
    full-depth greedy token; ``forward_equals_generate``; ``distinct_tokens`` per request."""
    import jax
    import jax.numpy as jnp

    from ouro_jax import forward, generate

    b, p = prompts.shape
    tokens = np.asarray(generate(params, config, prompts, np.full((b,), p, np.int32), new_tokens).tokens)
    # the position before each generated token produced it
    seq = np.concatenate([prompts, tokens[:, :-1]], axis=1)
    hidden = forward(params, config, seq).hidden_states[:, :, p - 1 :]  # [T, B, new, D]
    argmax = jax.jit(lambda h, w: jnp.argmax(jnp.einsum("tbsd,dv->tbsv", h, w, preferred_element_type=jnp.float32), -1))
    by_depth = np.asarray(argmax(hidden, params["lm_head"]["kernel"]))
    return dict(
        by_depth=[float((by_depth[d] == by_depth[-1]).mean()) for d in range(config.num_loops)],
        forward_equals_generate=float((by_depth[-1] == tokens).mean()),
        distinct_tokens=float(np.mean([len(set(t)) for t in tokens])),
    )


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    from benchmarks.workloads import decode_prompts
    from ouro_jax.model import dtype_of
    from weights.config import get_preset
    from weights.converging import converging_params
    from weights.random_init import random_params

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--scale", nargs="+", type=float, default=[1.0, 0.1, 0.03, 0.01, 0.003, 0.001, 0.0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="weights and prompts")
    ap.add_argument("--dtype", default=None, help="default: the preset's")
    a = ap.parse_args(argv)
    cfg = get_preset(a.preset)
    params = random_params(cfg, a.seed, dtype_of(a.dtype or cfg.torch_dtype), on_device=True)
    prompts = np.stack(decode_prompts(cfg.vocab_size, a.context, a.batch, seed=a.seed)).astype(np.int32)
    out = []
    for s in a.scale:
        t = time.perf_counter()
        r = dict(scale=s, **agreement(converging_params(params, cfg, s), cfg, prompts, a.new_tokens))
        depths = " / ".join(f"{100 * x:.1f}%" for x in r["by_depth"])
        print(
            f"scale {s:g}: depth 1..{cfg.num_loops} agree with full depth {depths}; forward == generate "
            f"{100 * r['forward_equals_generate']:.1f}%, {r['distinct_tokens']:.0f} distinct tokens a request "
            f"({time.perf_counter() - t:.1f} s)",
            flush=True,
        )
        out.append(r)
    return out


if __name__ == "__main__":
    main()
