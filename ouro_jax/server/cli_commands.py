"""``ouro-jax serve`` and ``ouro-jax generate``: argument parsers and handlers (registered in cli.py).

Engine settings are flags shared by both (``add_engine_args`` / ``engine_kwargs``); a flag left out
keeps the ``LLM`` default.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from pallas_kernels.choices import ATTENTION
from scheduler.descriptor import FUSED_DECODE_ROWS

__all__ = ["ENGINE_FLAGS", "add_engine_args", "engine_kwargs", "add_serve", "add_generate"]

_DTYPES = ("bfloat16", "float32", "float16")

# flag -> (LLM keyword, type, choices, help)
ENGINE_FLAGS = {
    "--dtype": ("dtype", str, _DTYPES, "cast the weights (default: the checkpoint's / preset's dtype)"),
    "--seed": ("seed", int, None, "seed of a preset's random weights"),
    "--max-num-seqs": ("max_num_seqs", int, None, "most requests running at once"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, None, "token budget of one invocation"),
    "--prefill-chunk-size": ("prefill_chunk_size", int, None, "prompt chunk size"),
    "--prefill-mode": ("prefill_mode", str, ("split", "mixed", "wavefront"), "how prompts share invocations"),
    "--kv-layout": ("kv_layout", str, ("last_exited", "shared"), "KV cache layout"),
    "--block-size": ("block_size", int, None, "tokens per KV block"),
    "--max-model-len": ("max_model_len", int, None, "longest prompt + output"),
    "--num-blocks": ("num_blocks", int, None, "KV pool size in blocks (overrides the memory share)"),
    "--kv-cache-bytes": ("kv_cache_bytes", int, None, "KV pool size in bytes"),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float, None, "share of device memory to use"),
    "--attention": ("attention", str, ATTENTION, "attention"),
    "--layer-loop": ("layer_loop", str, ("unrolled", "scan"), "how the layer stack is compiled"),
    "--policy": ("policy", str, ("fcfs", "priority"), "waiting-queue admission order"),
    "--compile-cache-dir": ("compile_cache_dir", str, None, "persistent XLA cache ('off' disables)"),
    "--fused-decode-max-rows": ("fused_decode_max_rows", int, None, "fuse decode steps up to this many rows"),
    "--fused-decode-tokens": ("fused_decode_tokens", int, None, "decode tokens per fused step"),
    "--fused-decode-rows": (
        "fused_decode_rows",
        str,
        FUSED_DECODE_ROWS,
        "fused step rows: lock step per token, or each at its own depth",
    ),
    "--tensor-parallel-size": ("tensor_parallel_size", int, None, "split the model over this many local devices"),
}

# on/off flags (``--x`` / ``--no-x``) -> (LLM keyword, help); left out: the LLM default
_ENGINE_SWITCHES = {
    "--enable-prefix-caching": (
        "enable_prefix_caching",
        "reuse the KV of shared prompt prefixes (with --data-parallel-size: prefix-aware routing too)",
    ),
    "--async-scheduling": (
        "async_scheduling",
        "launch the next fused decode step before reading the one in flight (default: on)",
    ),
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    for flag, (dest, typ, choices, help_) in ENGINE_FLAGS.items():
        g.add_argument(
            flag,
            dest=f"engine_{dest}",
            metavar=None if choices else dest.upper(),
            type=typ,
            choices=choices,
            default=None,
            help=help_,
        )
    g.add_argument("--buckets", type=str, default=None, help="row buckets, comma separated (e.g. 8,32,128)")
    for flag, (dest, help_) in _ENGINE_SWITCHES.items():
        g.add_argument(flag, dest=f"engine_{dest}", action=argparse.BooleanOptionalAction, default=None, help=help_)


def engine_kwargs(args) -> dict:
    kw = {d: getattr(args, f"engine_{d}") for d, *_ in ENGINE_FLAGS.values()}
    kw.update({d: getattr(args, f"engine_{d}", None) for d, _ in _ENGINE_SWITCHES.values()})
    kw = {k: v for k, v in kw.items() if v is not None}
    if args.buckets:
        try:
            kw["buckets"] = [int(x) for x in args.buckets.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--buckets must be comma separated integers, got {args.buckets!r}") from None
    return kw


# ----------------------------------------------------------------------------------- serve
def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    p.add_argument("model", help="checkpoint folder (with tokenizer.json for text) or preset name")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    p.add_argument(
        "--max-queue", type=int, default=256, help="requests waiting beyond max-num-seqs before answering 429"
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engines on disjoint device sets behind this one server (each of --tensor-parallel-size devices)",
    )
    p.add_argument(
        "--replica-mode",
        choices=("process", "thread"),
        default=None,
        help="data-parallel replicas as one worker process each (default when --data-parallel-size > 1: one "
        "GIL per engine's scheduler) or as threads of this process (default for one engine; debugging)",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--no-access-log", action="store_true", help="no log line per HTTP request")
    add_engine_args(p)
    p.set_defaults(handler=cmd_serve)


def cmd_serve(args) -> int:
    t_start = time.perf_counter()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must lie in [0, 65535], got {args.port}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    ekw = engine_kwargs(args)
    _num_loops(args.model)  # an unknown model fails here, before anything loads
    from .replicas import build_replicas, check_data_parallel
    from .run import make_state, serve
    from .startup import build_engine

    tp = ekw.get("tensor_parallel_size", 1)
    check_data_parallel(args.data_parallel_size, tp, num_devices=1 << 30)  # the types, before anything starts
    mode = args.replica_mode or ("process" if args.data_parallel_size > 1 else "thread")
    name = args.served_model_name or args.model
    if mode == "process":
        from .replica_process import start_replica_processes

        # the device count is checked by a probe process before any worker loads a weight
        front, reps, timings = start_replica_processes(
            args.model, ekw, args.data_parallel_size, max_queue=args.max_queue, log_level=args.log_level
        )
        state = make_state(front, name, args.model, max_queue=args.max_queue, startup=timings, replicas=reps)
        return serve(state, args.host, args.port, args.log_level, t_start=t_start, access_log=not args.no_access_log)
    dp = check_data_parallel(args.data_parallel_size, tp)  # before any weight
    if dp == 1:
        llm, timings = build_engine(args.model, ekw)
    else:
        llm, timings = build_replicas(args.model, ekw, dp)
    state = make_state(llm, name, args.model, max_queue=args.max_queue, startup=timings)
    return serve(state, args.host, args.port, args.log_level, t_start=t_start, access_log=not args.no_access_log)


# -------------------------------------------------------------------------------- generate
def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate from one prompt, streaming the text to the terminal")
    p.add_argument("model", help="checkpoint folder or preset name")
    p.add_argument("prompt", help="the prompt text (token ids '1 2 3' when the checkpoint has no tokenizer)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=0, help="seed of the sampler")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--exit-threshold", type=float, default=None, help="Ouro early exit (1.0 = every loop)")
    p.add_argument("--min-loops", type=int, default=None)
    p.add_argument("--max-loops", type=int, default=None)
    p.add_argument("--exit-mode", default=None, choices=("ouro", "delayed", "fixed"))
    add_engine_args(p)
    p.set_defaults(handler=cmd_generate)


def _num_loops(model) -> int:
    from weights.config import PRESETS, OuroConfig

    if model in PRESETS:
        return PRESETS[model].num_loops
    if os.path.isfile(os.path.join(os.fspath(model), "config.json")):
        return OuroConfig.from_json(model).num_loops
    raise ValueError(f"model must be a preset ({', '.join(sorted(PRESETS))}) or a checkpoint folder, got {model!r}")


def _prompt_of(model, text: str):
    """The prompt as the engine takes it; checked before the engine is built (a bad one costs nothing)."""
    if os.path.isfile(os.path.join(os.fspath(model), "tokenizer.json")):
        return text
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(
            "this checkpoint has no tokenizer (tokenizer.json): give the prompt as token ids, e.g. '1 2 3'"
        ) from None


def cmd_generate(args) -> int:
    from scheduler import SamplingParams

    from .startup import build_engine

    kw = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    for f in ("exit_threshold", "min_loops", "max_loops", "exit_mode"):
        if getattr(args, f) is not None:
            kw[f] = getattr(args, f)
    sp = SamplingParams(**kw)
    sp.validate(_num_loops(args.model))
    prompt = _prompt_of(args.model, args.prompt)
    ekw = engine_kwargs(args)
    ekw.setdefault("max_num_seqs", 1)
    llm, _ = build_engine(args.model, ekw)
    tok = llm.tokenizer
    out = sys.stdout
    sent, n_sent, last = "", 0, None
    t0 = time.perf_counter()
    for o in llm.stream(prompt, sp):
        last = o
        if tok is None:
            new = o.token_ids[n_sent:]
            n_sent += len(new)
            if new:
                out.write(" ".join(map(str, new)) + " ")
        else:
            text = o.text or ""
            hold = 0 if o.finished else (1 if text.endswith("\ufffd") else 0)
            piece = text[len(sent) : len(text) - hold]
            if piece:
                out.write(piece)
                sent += piece
        out.flush()
    dt = time.perf_counter() - t0
    out.write("\n")
    if last is not None and last.token_ids:
        T = llm.config.num_loops
        mean = sum(d + 1 for d in last.exit_depths) / len(last.exit_depths)
        print(
            f"[{len(last.token_ids)} tokens in {dt:.2f} s ({len(last.token_ids) / dt:.1f} tok/s), "
            f"finish_reason={last.finish_reason}, mean loops per token {mean:.2f} of {T}]",
            file=sys.stderr,
        )
    return 0
