"""Host cost of structured outputs per token: fill the next-token bitmask + accept the token, while
walking a valid output of each constraint kind (``ouro_jax.structured``, llguidance).

    python -m benchmarks.grammar_mask --tokenizer PATH/tokenizer.json [--vocab-size 49152]

Prints one JSON line per constraint: compile ms (first matcher of a spec), mean / p50 / max µs per
token over at least ``--tokens`` tokens (first walk excluded), and the per-row cost when ``--rows``
matchers share a step.
"""

import argparse
import json
import statistics
import time

from tokenizers import Tokenizer

from ouro_jax.structured import GrammarCompiler, GuidedDecoding, fill_bitmask_rows, new_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 120},
        "valid": {"type": "boolean"},
        "name": {"type": "string"},
    },
    "required": ["color", "count", "valid", "name"],
    "additionalProperties": False,
}
ITEMS = [
    {"id": i, "label": f"item number {i}", "tags": ["alpha", "beta"], "price": i * 1.5, "ok": i % 2 == 0, "note": None}
    for i in range(12)
]
WALKS = {
    "json_schema": (
        GuidedDecoding.json_schema(SCHEMA),
        {"color": "green", "count": 42, "valid": True, "name": "The quick brown fox jumps over the lazy dog twice"},
    ),
    "json_object": (GuidedDecoding.json_object(), {"items": ITEMS}),
    "regex": (GuidedDecoding.regex(r"[0-9]{3}-[0-9]{3}-[0-9]{4} \((home|work|cell)\)"), "415-555-0199 (work)"),
}


def measure(compiler, tokenizer, guided, text, min_tokens, rows) -> dict:
    ids = tokenizer.encode(text).ids
    t0 = time.perf_counter()
    compiler.matcher(guided)
    compile_ms = (time.perf_counter() - t0) * 1e3
    mask = new_bitmask(1, compiler.vocab_size)
    per_token = []
    for _ in range(1 + -(-min_tokens // len(ids))):
        m = compiler.matcher(guided)
        for t in ids:
            s = time.perf_counter()
            m.fill_bitmask(mask, 0)
            assert m.accept(t), (text, t)
            per_token.append(time.perf_counter() - s)
        assert m.eos_allowed(), text
    warm = per_token[len(ids) :]  # the first walk builds lexer states lazily
    matchers = [compiler.matcher(guided) for _ in range(rows)]
    masks = new_bitmask(rows, compiler.vocab_size)
    s = time.perf_counter()
    for t in ids:
        fill_bitmask_rows(masks, [(m, r) for r, m in enumerate(matchers)])
        for m in matchers:
            m.accept(t)
    per_row_us = (time.perf_counter() - s) / len(ids) / rows * 1e6
    return {
        "tokens": len(ids),
        "compile_ms": round(compile_ms, 2),
        "first_walk_mean_us": round(statistics.mean(per_token[: len(ids)]) * 1e6, 1),
        "mean_us": round(statistics.mean(warm) * 1e6, 1),
        "p50_us": round(statistics.median(warm) * 1e6, 1),
        "max_us": round(max(warm) * 1e6, 1),
        f"rows{rows}_per_row_us": round(per_row_us, 1),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=None, help="the model's vocabulary (default: the tokenizer's)")
    p.add_argument("--eos-token", default="<|endoftext|>")
    p.add_argument("--tokens", type=int, default=200, help="tokens measured per constraint, first walk excluded")
    p.add_argument("--rows", type=int, default=8, help="matchers sharing a step")
    args = p.parse_args(argv)
    tokenizer = Tokenizer.from_file(args.tokenizer)
    vocab_size = args.vocab_size or tokenizer.get_vocab_size()
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size, [tokenizer.token_to_id(args.eos_token)])
    init_ms = round((time.perf_counter() - t0) * 1e3, 1)
    for kind, (guided, output) in WALKS.items():
        text = output if isinstance(output, str) else json.dumps(output, separators=(",", ":"))
        row = measure(compiler, tokenizer, guided, text, args.tokens, args.rows)
        print(json.dumps({"kind": kind, "vocab_size": vocab_size, "tokenizer_init_ms": init_ms, **row}))


if __name__ == "__main__":
    main()
