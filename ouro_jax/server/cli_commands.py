"""``ouro-jax serve`` and ``ouro-jax generate``: argument parsers and handlers (registered in cli.py).

Engine settings are the flags of ``EngineConfig``'s fields (``ouro_jax/engine_config.py``: names,
defaults and help come from there); a flag left out keeps the field's default.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from ouro_jax.engine_config import SECTIONS, EngineConfig, add_arguments, engine_overrides, from_arguments

__all__ = ["ENGINE_SECTIONS", "add_serve", "add_generate"]

# the config's sections that configure one engine (every command that builds one has their flags)
ENGINE_SECTIONS = tuple(s for s in SECTIONS if s != "server")


# ----------------------------------------------------------------------------------- serve
def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    p.add_argument("model", help="checkpoint folder (with tokenizer.json for text) or preset name")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--no-access-log", action="store_true", help="no log line per HTTP request")
    add_arguments(p, ("server", *ENGINE_SECTIONS))
    p.set_defaults(handler=cmd_serve)


def cmd_serve(args) -> int:
    t_start = time.perf_counter()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = from_arguments(args)
    config = EngineConfig(**overrides)  # every flag checked before anything starts
    ekw = engine_overrides(overrides)
    _num_loops(args.model)  # an unknown model fails here, before anything loads
    from .replicas import build_replicas, check_data_parallel
    from .run import make_state, serve
    from .startup import build_engine

    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    mode = config.replica_mode or ("process" if dp > 1 else "thread")
    name = config.served_model_name or args.model
    if mode == "process":
        from .replica_process import start_replica_processes

        # the device count is checked by a probe process before any worker loads a weight
        front, reps, timings = start_replica_processes(
            args.model, ekw, dp, max_queue=config.max_queue, log_level=args.log_level
        )
        state = make_state(
            front, name, args.model, max_queue=config.max_queue, startup=timings, replicas=reps,
            reasoning_parser=config.reasoning_parser,
            max_n=config.max_n,
        )  # fmt: skip
    else:
        check_data_parallel(dp, tp)  # before any weight
        if dp == 1:
            llm, timings = build_engine(args.model, ekw)
        else:
            llm, timings = build_replicas(args.model, ekw, dp)
        state = make_state(
            llm, name, args.model, max_queue=config.max_queue, startup=timings,
            reasoning_parser=config.reasoning_parser,
            max_n=config.max_n,
        )  # fmt: skip
    return serve(
        state, config.host, config.port, args.log_level, t_start=t_start, access_log=not args.no_access_log,
        drain_timeout_s=config.drain_timeout_s,
    )  # fmt: skip


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
    add_arguments(p, ENGINE_SECTIONS)
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
    # one prompt: one sequence unless the flags say otherwise
    llm, _ = build_engine(args.model, from_arguments(args, max_num_seqs=1))
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
        T = llm.model_config.num_loops
        mean = sum(d + 1 for d in last.exit_depths) / len(last.exit_depths)
        print(
            f"[{len(last.token_ids)} tokens in {dt:.2f} s ({len(last.token_ids) / dt:.1f} tok/s), "
            f"finish_reason={last.finish_reason}, mean loops per token {mean:.2f} of {T}]",
            file=sys.stderr,
        )
    return 0
