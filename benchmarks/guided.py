"""What structured outputs cost the engine: TPOT of streams under a JSON schema against the same
streams unconstrained, one engine, one run (``ouro_jax.structured``; issue #34).

    python -m benchmarks.guided --preset ouro-1.4b --concurrency 1 32 --output-tokens 64 \\
        --out benchmarks/results/guided.json

Three rows per concurrency: ``free`` (the engine's default path, fused decode steps included),
``free, loop by loop`` (``fused_decode_max_rows=0``: the path a guided batch takes) and ``guided``
(a schema whose string must run past ``--output-tokens``, so every stream ends by length). The
guided / loop-by-loop ratio is the mask's own cost; guided / free adds the fused steps it gives up.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ouro_jax import LLM, SamplingParams
from ouro_jax.structured import GuidedDecoding

LONG = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4000}},
    "required": ["text"],
    "additionalProperties": False,
}


def _tpot_ms(outs) -> float:
    return float(np.median([o.metrics.tpot for o in outs if o.metrics.tpot is not None]) * 1e3)


def run(llm: LLM, c: int, out_tokens: int, guided) -> dict:
    prompts = [[11 + i, 12, 13, 14] for i in range(c)]
    kw = dict(max_tokens=out_tokens, temperature=0.0)
    sp = SamplingParams(**kw, guided=guided) if guided is not None else SamplingParams(**kw, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm: every bucket and sampler of this shape
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    return dict(tpot_ms=_tpot_ms(outs), wall_s=wall, tokens=sum(len(o.token_ids) for o in outs))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax

    guided = GuidedDecoding.json_schema(LONG)
    records = []
    for fused in (None, 0):
        kw = dict(max_num_seqs=max(a.concurrency), max_model_len=a.max_model_len, progress=False)
        if fused is not None:
            kw["fused_decode_max_rows"] = fused
        with LLM(a.preset, **kw) as llm:
            for c in a.concurrency:
                paths = [("free", None)] if fused is None else [("free, loop by loop", None), ("guided", guided)]
                for name, g in paths:
                    r = dict(path=name, concurrency=c, output_tokens=a.output_tokens, **run(llm, c, a.output_tokens, g))
                    print(json.dumps(r), flush=True)
                    records.append(r)
    res = dict(
        benchmark="guided",
        device=jax.devices()[0].device_kind,
        preset=a.preset,
        argv=list(argv) if argv is not None else None,
        schema=LONG,
        records=records,
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
