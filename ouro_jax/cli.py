"""The ``ouro-jax`` console command.

Subcommands (each a ``_cmd_*`` handler registered by an ``_add_*`` function in :func:`build_parser`):

- ``convert SRC DST [--dtype bfloat16|float32] [--overwrite] [--no-progress]``
- ``random-checkpoint DST --preset NAME [--seed N] [--layout hf|orbax] [--dtype ...]
  [--max-shard-bytes N] [--overwrite] [--no-progress]``: the weights ``LLM(NAME, seed=N)`` builds
- ``demo [--model PRESET|DIR] [--batch N] [--prompt-len N] [--max-tokens N] [--exit-threshold Q]
  [--prompt-seed N] [engine flags]``:
  the jitted ``generate()`` and the engine on a preset (random weights) or a checkpoint, with tokens,
  exit depths, tok/s (and text when the checkpoint has a tokenizer)
- ``serve MODEL [--host] [--port] [engine flags]``: the OpenAI-compatible HTTP server (``ouro_jax/server``)
- ``generate MODEL "text" [--max-tokens] [--temperature] [--exit-threshold] ...``: stream one prompt's text

Heavy imports (jax, orbax) happen inside the handlers, so ``ouro-jax --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys

DTYPE_CHOICES = ("bfloat16", "float32", "float16")


def _int_at_least(lo: int):
    """An argparse type: an integer >= ``lo`` (a bad value is a usage error before any work)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return parse


def _probability(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {v}")
    return v


# ----------------------------------------------------------------------------- convert
def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face checkpoint folder to the ouro-jax (orbax) layout")
    p.add_argument("src", help="Hugging Face folder: config.json + model.safetensors (or shards + index)")
    p.add_argument("dst", help="output folder (created; must be empty unless --overwrite)")
    p.add_argument(
        "--dtype",
        type=str.lower,
        choices=DTYPE_CHOICES,
        default=None,
        help="cast the weights (default: keep the checkpoint's dtype)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DST")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_cmd_convert)


def _cmd_convert(args) -> int:
    from weights import convert

    dst = convert(args.src, args.dst, dtype=args.dtype, progress=not args.no_progress, overwrite=args.overwrite)
    print(f"converted {args.src} -> {dst}")
    return 0


# ------------------------------------------------------------------- random-checkpoint
def _add_random_checkpoint(sub) -> None:
    from weights.config import PRESETS

    p = sub.add_parser("random-checkpoint", help="write a seeded random checkpoint of a preset size")
    p.add_argument("dst", help="output folder (created; must be empty unless --overwrite)")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model size")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument(
        "--layout",
        type=str.lower,
        choices=("hf", "orbax"),
        default="hf",
        help="hf: config.json + safetensors; orbax: the converted layout",
    )
    p.add_argument("--dtype", type=str.lower, choices=DTYPE_CHOICES, default="float32")
    p.add_argument(
        "--max-shard-bytes",
        type=_int_at_least(1),
        default=None,
        help="hf layout: split into shards of at most this many bytes (+ index.json)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DST")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_cmd_random_checkpoint)


def _cmd_random_checkpoint(args) -> int:
    from weights import save_random

    path = save_random(
        args.dst,
        args.preset,
        seed=args.seed,
        layout=args.layout,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_bytes,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(f"wrote random {args.preset} checkpoint (seed {args.seed}, {args.layout}, {args.dtype}) to {path}")
    return 0


# ---------------------------------------------------------------------------------- demo
def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo", help="generate with a preset (random weights) or a checkpoint: the jitted generate(), then the engine"
    )
    p.add_argument("--model", default="ouro-small", help="preset name or checkpoint folder (default: ouro-small)")
    p.add_argument("--batch", type=_int_at_least(1), default=4)
    p.add_argument("--prompt-len", type=_int_at_least(1), default=32)
    p.add_argument("--max-tokens", type=_int_at_least(1), default=24)
    p.add_argument(
        "--exit-threshold",
        type=_probability,
        default=0.5,
        help="early exit: stop a token's loops once this much exit probability has accumulated",
    )
    p.add_argument("--prompt-seed", type=_int_at_least(0), default=0, help="seed of the random prompts")
    from .engine_config import add_arguments
    from .server.cli_commands import ENGINE_SECTIONS

    add_arguments(p, ENGINE_SECTIONS)
    p.set_defaults(handler=_cmd_demo)


def _cmd_demo(args) -> int:
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from . import LLM, SamplingParams, generate
    from .engine_config import from_arguments

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    # the engine's own defaults, sized to the demo's requests: the whole batch at once, and contexts
    # of its length (the CPU's reference attention reads a request's whole block table)
    sized = dict(max_num_seqs=args.batch, max_model_len=max(256, args.prompt_len + args.max_tokens))
    llm = LLM(args.model, **from_arguments(args, **sized))
    cfg = llm.model_config
    print(
        f"model {args.model}: {cfg.num_hidden_layers} layers x T={cfg.num_loops} loops, "
        f"hidden {cfg.hidden_size}, {cfg.num_params / 1e6:.1f}M params"
    )
    print(f"weights: {_demo_weights(args.model, llm.config.seed)}")
    rng = np.random.default_rng(args.prompt_seed)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, args.prompt_len))) for _ in range(args.batch)]

    # 1. the jitted static-batch generate()
    ids = jnp.asarray(prompts, jnp.int32)
    lengths = jnp.full((args.batch,), args.prompt_len, jnp.int32)
    kw = dict(exit_threshold=args.exit_threshold)
    generate(llm.params, cfg, ids, lengths, args.max_tokens, **kw).tokens.block_until_ready()  # compile
    t = time.perf_counter()
    out = generate(llm.params, cfg, ids, lengths, args.max_tokens, **kw)
    out.tokens.block_until_ready()
    dt = time.perf_counter() - t
    print(
        f"\ngenerate(): {args.batch} x {args.max_tokens} tokens in {dt * 1e3:.1f} ms = "
        f"{args.batch * args.max_tokens / dt:.1f} tok/s"
    )
    for b in range(min(args.batch, 2)):
        print(f"  tokens      {np.asarray(out.tokens[b]).tolist()}")
        print(f"  exit depths {np.asarray(out.exit_depths[b]).tolist()}")

    # 2. the engine: loop-level batching over the paged depth-plane KV cache
    sp = SamplingParams(max_tokens=args.max_tokens, exit_threshold=args.exit_threshold, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    print(
        f"\nLLM.generate ({llm.config.prefill_mode} prefill): {args.batch} x {args.max_tokens} tokens in "
        f"{dt * 1e3:.1f} ms = {args.batch * args.max_tokens / dt:.1f} tok/s"
    )
    for o in outs[:2]:
        print(f"  tokens      {o.token_ids}")
        if o.text is not None:
            print(f"  text        {o.text!r}")
        print(
            f"  exit depths {o.exit_depths}   (same as generate(): "
            f"{o.token_ids == np.asarray(out.tokens[o.request_id]).tolist()})"
        )
    st = llm.stats()
    print(
        f"  {st['recurrent_invocations']} recurrent invocations, {st['rows_per_invocation']:.1f} rows each, "
        f"{st['compilations']} executables ready at start-up in {st['warmup_time_s']:.1f} s "
        f"({st['compile_time_s']:.1f} s of compiles over threads), "
        f"host time {1e3 * st['host_time_per_invocation_s']:.2f} ms/invocation"
    )
    mean_loops = np.mean([d + 1 for o in outs for d in o.exit_depths[1:]])
    print(f"  mean loops per generated token: {mean_loops:.2f} of {cfg.num_loops}")
    return 0


def _demo_weights(model: str, seed: int) -> str:
    """Which weights ``LLM(model, seed=seed)`` ran, in words (a checkpoint folder or a preset + seed)."""
    import os

    from weights.config import PRESETS

    if model in PRESETS:
        same = f"`ouro-jax random-checkpoint --preset {model} --seed {seed}`"
        return f"random, preset {model} seed {seed} (the same as {same})"
    return f"checkpoint {os.path.abspath(model)}"


# --------------------------------------------------------------------------------- main
def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The parser and its subparsers object (so further subcommands can be added)."""
    parser = argparse.ArgumentParser(prog="ouro-jax", description="Inference for Ouro looped language models in JAX")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_convert(sub)
    _add_random_checkpoint(sub)
    _add_demo(sub)
    from .server.cli_commands import add_generate, add_serve

    add_serve(sub)
    add_generate(sub)
    return parser, sub


def main(argv: list[str] | None = None) -> int:
    parser, _ = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"ouro-jax {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
