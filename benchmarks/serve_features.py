"""What the API features agents use cost the engine, each side by side with the same streams
without it, one engine, one run (issue #34):

    python -m benchmarks.serve_features --preset ouro-1.4b --concurrency 1 32 --output-tokens 64 \\
        --out benchmarks/results/serve_features.json

Per concurrency ``c`` (``kind: "tpot"``), TPOT p50 of ``c`` streams that run to ``--output-tokens``:
``free``; ``json_schema`` (a schema whose string must run past the length, so every stream ends by
length; guided rows decode in fused steps of one token, the host filling the mask in between);
``top_logprobs=5``; ``penalties`` (presence and frequency penalties: fused steps of one token with
the coda deferred, as guided rows). ``ratio`` is the path's TPOT over ``free``'s, measured in turn
on the same engine.

``kind: "n"``: ``n=4`` choices of one ``--prompt-tokens`` prompt against 4 separate requests of
it (prefix caching off, the engine's default): wall time, time to the last first token and the
prompt positions computed (prefill rows over the loops; the choices share the prompt's blocks).
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


def _paths(out_tokens: int) -> dict:
    base = dict(max_tokens=out_tokens, temperature=0.0)
    return {
        "free": SamplingParams(**base, ignore_eos=True),
        "json_schema": SamplingParams(**base, guided=GuidedDecoding.json_schema(LONG)),
        "top_logprobs=5": SamplingParams(**base, ignore_eos=True, logprobs=5),
        "penalties": SamplingParams(**base, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.5),
    }


def tpot_records(llm: LLM, c: int, out_tokens: int, rounds: int) -> list[dict]:
    """Every path at ``c`` streams, interleaved over ``rounds`` (drift hits each path alike)."""
    prompts = [[11 + i, 12, 13, 14] for i in range(c)]
    paths = _paths(out_tokens)
    for sp in paths.values():  # warm: every bucket and sampler of this shape
        llm.generate(prompts, sp, use_tqdm=False)
    got: dict = {name: [] for name in paths}
    for _ in range(rounds):
        for name, sp in paths.items():
            before = llm.stats()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            after = llm.stats()
            got[name].append(
                dict(
                    tpot_ms=_tpot_ms(outs),
                    tokens=sum(len(o.token_ids) for o in outs),
                    fused_launches=after["fused_launches"] - before["fused_launches"],
                    launches=after["launches"] - before["launches"],
                )
            )
    free = float(np.median([g["tpot_ms"] for g in got["free"]]))
    out = []
    for name, runs in got.items():
        tpot = float(np.median([g["tpot_ms"] for g in runs]))
        out.append(
            dict(
                kind="tpot",
                path=name,
                concurrency=c,
                output_tokens=out_tokens,
                tpot_ms=tpot,
                tpot_ms_runs=[g["tpot_ms"] for g in runs],
                ratio=tpot / free,
                tokens=runs[-1]["tokens"],
                fused_share=runs[-1]["fused_launches"] / max(1, runs[-1]["launches"]),
            )
        )
    return out


def choices_records(llm: LLM, prompt_tokens: int, out_tokens: int, n: int = 4) -> list[dict]:
    """``n`` choices of one prompt against ``n`` separate requests of it."""
    rng = np.random.default_rng(0)
    # a fresh prompt per call: a group's shared blocks stay in the pool, idle, until evicted
    prompts = [list(rng.integers(5, llm.model_config.vocab_size, prompt_tokens)) for _ in range(2)]
    sp = SamplingParams(max_tokens=out_tokens, temperature=1.0, seed=1, ignore_eos=True)
    seeds = [SamplingParams(max_tokens=out_tokens, temperature=1.0, seed=1 + j, ignore_eos=True) for j in range(n)]
    runs = {
        f"n={n}": lambda p: llm.generate([p], sp, n=n, use_tqdm=False),
        f"{n} requests": lambda p: llm.generate([p] * n, seeds, use_tqdm=False),
    }
    for call in runs.values():
        call(prompts[0])  # warm
    out = []
    tokens = {}
    for name, call in runs.items():
        before = llm.stats()
        t0 = time.perf_counter()
        outs = call(prompts[1])  # the same prompt for both: their tokens are compared
        wall = time.perf_counter() - t0
        after = llm.stats()
        tokens[name] = [o.token_ids for o in outs]
        out.append(
            dict(
                kind="n",
                path=name,
                prompt_tokens=prompt_tokens,
                output_tokens=out_tokens,
                wall_s=wall,
                last_ttft_s=max(o.metrics.ttft for o in outs),
                # a prompt position runs every loop as a prefill row
                prompt_positions_computed=(after["prefill_rows"] - before["prefill_rows"])
                // llm.model_config.num_loops,
                shared_prompt_tokens=after["shared_prompt_tokens"] - before["shared_prompt_tokens"],
            )
        )
    same = len({json.dumps(t) for t in tokens.values()}) == 1
    for r in out:
        r["tokens_equal"] = same  # choice j is the request seeded seed + j
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax

    records = []
    with LLM(a.preset, max_num_seqs=max(a.concurrency), max_model_len=a.max_model_len, progress=False) as llm:
        for c in a.concurrency:
            for r in tpot_records(llm, c, a.output_tokens, a.rounds):
                print(json.dumps(r), flush=True)
                records.append(r)
        for r in choices_records(llm, a.prompt_tokens, a.output_tokens):
            print(json.dumps(r), flush=True)
            records.append(r)
    res = dict(
        benchmark="serve_features",
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
