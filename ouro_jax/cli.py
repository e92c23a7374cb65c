"""The ``ouro-jax`` console command.

Subcommands (each a ``_cmd_*`` handler registered by an ``_add_*`` function in :func:`build_parser`):

- ``convert SRC DST [--dtype bfloat16|float32] [--overwrite] [--no-progress]``
- ``random-checkpoint DST --preset NAME [--seed N] [--layout hf|orbax] [--dtype ...]
  [--max-shard-bytes N] [--overwrite]``

Heavy imports (jax, orbax) happen inside the handlers, so ``ouro-jax --help`` stays fast.
"""
from __future__ import annotations

import argparse
import sys

DTYPE_CHOICES = ("bfloat16", "float32", "float16")


# ----------------------------------------------------------------------------- convert
def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face checkpoint folder to the ouro-jax "
                                       "(orbax) layout")
    p.add_argument("src", help="Hugging Face folder: config.json + model.safetensors (or shards + index)")
    p.add_argument("dst", help="output folder (created; must be empty unless --overwrite)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="cast the weights (default: keep the checkpoint's dtype)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DST")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_cmd_convert)


def _cmd_convert(args) -> int:
    from weights import convert
    dst = convert(args.src, args.dst, dtype=args.dtype, progress=not args.no_progress,
                  overwrite=args.overwrite)
    print(f"converted {args.src} -> {dst}")
    return 0


# ------------------------------------------------------------------- random-checkpoint
def _add_random_checkpoint(sub) -> None:
    from .config import PRESETS
    p = sub.add_parser("random-checkpoint", help="write a seeded random checkpoint of a preset size")
    p.add_argument("dst", help="output folder (created; must be empty unless --overwrite)")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=("hf", "orbax"), default="hf",
                   help="hf: config.json + safetensors; orbax: the converted layout")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32")
    p.add_argument("--max-shard-bytes", type=int, default=None,
                   help="hf layout: split into shards of at most this many bytes (+ index.json)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DST")
    p.set_defaults(handler=_cmd_random_checkpoint)


def _cmd_random_checkpoint(args) -> int:
    from weights import save_random
    path = save_random(args.dst, args.preset, seed=args.seed, layout=args.layout, dtype=args.dtype,
                       max_shard_bytes=args.max_shard_bytes, overwrite=args.overwrite)
    print(f"wrote random {args.preset} checkpoint (seed {args.seed}, {args.layout}, {args.dtype}) to {path}")
    return 0


# --------------------------------------------------------------------------------- main
def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The parser and its subparsers object (so further subcommands can be added)."""
    parser = argparse.ArgumentParser(prog="ouro-jax", description="Inference for Ouro looped language "
                                                                  "models in JAX")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_convert(sub)
    _add_random_checkpoint(sub)
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
