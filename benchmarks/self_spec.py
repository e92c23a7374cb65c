"""Self-speculative decoding against plain decoding: c streams decoding together, greedy, fixed
full depth, one run (``scheduler/speculation.py``: ``d`` loops draft ``k`` tokens, full depth
verifies them in one pass).

    python -m benchmarks.self_spec [--preset ouro-1.4b] [--models random converging]
        [--converging-scale 0.003 ...] [--concurrency 1 2 4 8 16] [--spec 1:3 2:3 1:5]
        [--context 1024] [--output-tokens 128] [--quick] [--append] [--out benchmarks/results]

Per model variant: ``random`` (the seeded random weights ``LLM(preset)`` runs) and ``converging``
(the same weights through ``weights.converging.converging_params``, one variant per
``--converging-scale`` s: each layer adds s of its update, so depth ``d`` and full depth agree on
most tokens; at 0.003 depth 1 gives ouro-1.4b's full-depth greedy token at 85% of positions).
Per variant, one engine without ``speculative_config`` (the baseline) and one per ``d:k``
(``{"method": "loops", "draft_loops": d, "num_speculative_tokens": k}``), each built and
compiled before anything is timed, then for every ``c``: an untimed warm run of ``c`` other
prompts, the ``c`` prompts warmed into the prefix cache (one token each, untimed), then the timed
batch: ``c`` requests at t=0 with ``--context``-token prompts, ``--output-tokens`` out, greedy,
``exit_mode="fixed"`` (T loops). The streams reach decode within an invocation or two and decode
together (rounds run only when every running request decodes). TPOT: per request (last token -
first token) / (tokens - 1), p50 over the requests (as ``benchmarks/decode.py``).

Each ``d:k`` record carries the baseline's TPOT of the same variant, ``c`` and run
(``speedup = baseline / TPOT``) and ``tokens_equal``: every request's token ids equal the
baseline's (greedy speculation must not change a token). ``acceptance`` and
``mean_accepted_length`` are the engine's (``LLM.stats()``: ``spec_acceptance``,
``spec_mean_accepted_length``), over the timed batch alone: the stats are cumulative, so a ratio
over the window is ``(r1 n1 - r0 n0) / (n1 - n0)`` with its denominator counter ``n``
(``spec_proposed_tokens``, ``spec_row_rounds``). The benchmark sets no acceptance: the weights do.

Floor: ``floors.decode_step_floor`` of one plain decode step of ``c`` rows at T loops and the mean
context ``context + output / 2`` (``benchmarks/decode.py``'s floor at fixed depth), with the
ceilings measured in the run. Speculation can go below it: a round's tokens share one read of
the weights per loop.

``--arrivals N``: while the timed batch decodes, ``N`` prompts of ``--arrival-tokens`` tokens
(2 out each) join, one every ``--arrival-every`` engine steps, so that prompt chunks are in flight
and rounds run loop by loop beside them (``scheduler/speculation.py``, ``LoopRound``) instead of
fused; the records carry ``arrivals`` in their labels, and ``spec_loop_rounds``.

Writes ``<out>/self_spec.json`` after every record (``--append`` merges into an existing one by
``label``) and ``<out>/self_spec.png``: speed-up against acceptance, a marker per (variant, d, k),
a colour per c.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import os
import shlex
import sys
import time
import traceback
from typing import Optional, Sequence

import numpy as np

from benchmarks import fmt
from benchmarks.floors import decode_step_floor
from benchmarks.merge_results import merge_lists
from benchmarks.workloads import decode_prompts, exit_params

__all__ = ["main", "parser", "QUICK", "MODELS", "build_engine", "window_ratio", "has_speculative_config"]

MODELS = ("random", "converging")
DEFAULT_SPEC = ("1:3", "2:3", "1:5")
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
# what a first look on the GPU needs (flags given explicitly win)
QUICK = dict(concurrency=[1, 8], spec=["1:3"])
# the converging variant's default: on ouro-1.4b (bf16, seed 0) depth 1 / 2 / 3 then give the
# full-depth greedy token at 85% / 89% / 93% of positions (0.01: 61% / 71% / 84%; weights/converging.py)
DEFAULT_CONVERGING_SCALE = 0.003


def has_speculative_config() -> bool:
    """Whether this engine takes ``speculative_config`` (an ``EngineConfig`` field)."""
    from ouro_jax import EngineConfig

    return "speculative_config" in {f.name for f in dataclasses.fields(EngineConfig)}


def parse_spec(text: str) -> tuple[int, int]:
    """``"d:k"`` -> ``(draft_loops, num_speculative_tokens)``, both positive."""
    parts = text.split(":")
    if len(parts) == 2 and all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        return int(parts[0]), int(parts[1])
    raise ValueError(f"--spec takes d:k pairs of positive integers (draft loops:speculative tokens), got {text!r}")


def window_ratio(s0: dict, s1: dict, ratio: str, denominator: str) -> Optional[float]:
    """The engine's cumulative ratio ``ratio`` (= numerator / ``denominator`` counter) over the
    window between two ``stats()``: ``(r1 n1 - r0 n0) / (n1 - n0)``; ``None`` when the window
    added nothing to the denominator."""
    n0, n1 = s0.get(denominator) or 0, s1.get(denominator) or 0
    if n1 <= n0 or s1.get(ratio) is None:
        return None
    return ((s1[ratio] or 0.0) * n1 - (s0.get(ratio) or 0.0) * n0) / (n1 - n0)


def _delta(s0: dict, s1: dict, key: str):
    return None if key not in s1 else s1[key] - s0.get(key, 0)


# ------------------------------------------------------------------------------------ engines
def model_params(kind: str, config, seed: int, dtype: str, scale: Optional[float]) -> dict:
    """The param tree of a variant, on the device: the preset's seeded random weights (what
    ``LLM(preset, seed=)`` runs), or those through ``converging_params`` at ``scale``."""
    from ouro_jax.model import dtype_of
    from weights.converging import converging_params
    from weights.random_init import random_params

    params = random_params(config, seed, dtype_of(dtype), on_device=True)
    if kind == "converging":
        params = converging_params(params, config, scale)
    return params


def build_engine(config, params, spec: Optional[tuple[int, int]], **engine_kw):
    """An ``LLM`` over ``params``, compiled at start-up (``warmup``); ``spec`` ``(d, k)`` sets
    ``speculative_config``, ``None`` leaves the option out (plain decoding, on any engine)."""
    from ouro_jax import LLM

    if spec is not None:
        d, k = spec
        engine_kw["speculative_config"] = {"method": "loops", "draft_loops": d, "num_speculative_tokens": k}
    return LLM(config, params=params, warmup=True, progress=False, **engine_kw)


class EngineRun:
    """One engine of a model variant: warms each ``c`` and times the decode of ``c`` streams."""

    def __init__(self, llm, a, vocab_size: int):
        self.llm, self.a = llm, a
        n = max(a.concurrency)
        self.prompts = decode_prompts(vocab_size, a.context, n, seed=a.seed)
        # other prompts for the warm runs: the timed ones must not be in the cache beyond their prefix warm
        self.warm_prompts = decode_prompts(vocab_size, a.context, n, seed=a.seed + 1000)
        # --arrivals: long prompts arriving while the c streams decode (a prompt keeps rounds loop by loop)
        self._runs = itertools.count()
        self.arrival_prompts = decode_prompts(vocab_size, a.arrival_tokens, a.arrivals, seed=a.seed + 2000)

    def run(self, c: int) -> dict:
        from scheduler import SamplingParams

        llm, a = self.llm, self.a
        # first launches of this c's shapes (fused steps, rounds) stay out of the timing
        warm_tokens = min(a.output_tokens, 3 * (a.max_k + 1) + 2)
        llm.generate(self.warm_prompts[:c], exit_params("fixed", warm_tokens, a.seed), use_tqdm=False)
        prompts = self.prompts[:c]
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        s0 = llm.stats()
        t = time.perf_counter()
        outs = self._decode(prompts, exit_params("fixed", a.output_tokens, a.seed))
        wall = time.perf_counter() - t
        s1 = llm.stats()
        tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
        firsts = [o.metrics.first_token_time for o in outs if o.metrics.first_token_time is not None]
        r = dict(
            tpot_ms=float(np.median(tpots)) * 1e3 if tpots else None,
            tpot_p90_ms=float(np.percentile(tpots, 90)) * 1e3 if tpots else None,
            wall_s=wall,
            tokens=[list(map(int, o.token_ids)) for o in outs],
            output_tokens_total=sum(len(o.token_ids) for o in outs),
            first_token_spread_s=max(firsts) - min(firsts) if firsts else None,
            prefix_cache_hit_share=(_delta(s0, s1, "prefix_cache_hit_tokens") or 0)
            / max(1, _delta(s0, s1, "prefix_cache_queried_tokens") or 0),
            compilations=_delta(s0, s1, "compilations"),
            fused_launches=_delta(s0, s1, "fused_launches"),
            launches=_delta(s0, s1, "launches"),
        )
        if a.arrivals:
            r.update(arrival_tokens=a.arrival_tokens, arrival_every=a.arrival_every)
        if "spec_rounds" in s1:
            row_rounds = _delta(s0, s1, "spec_row_rounds")
            mal = window_ratio(s0, s1, "spec_mean_accepted_length", "spec_row_rounds")
            # tokens rounds emitted (not those drafted past a request's end); older engines: tokens kept
            emitted = _delta(s0, s1, "spec_emitted_tokens")
            spec_tokens = emitted if emitted is not None else (mal * row_rounds if mal is not None else 0.0)
            decode_tokens = sum(max(0, len(o.token_ids) - 1) for o in outs)
            r.update(
                acceptance=window_ratio(s0, s1, "spec_acceptance", "spec_proposed_tokens"),
                mean_accepted_length=mal,
                spec_rounds=_delta(s0, s1, "spec_rounds"),
                # rounds of one request beside prompt rows (loop by loop), not in spec_rounds
                spec_loop_rounds=_delta(s0, s1, "spec_loop_rounds"),
                spec_row_rounds=row_rounds,
                spec_proposed_tokens=_delta(s0, s1, "spec_proposed_tokens"),
                spec_accepted_tokens=_delta(s0, s1, "spec_accepted_tokens"),
                # steps decoded plainly because the rows' drafts were not accepted enough (RoundPolicy)
                spec_declined_steps=_delta(s0, s1, "spec_declined_steps"),
                # tokens after the first that rounds made (the rest came from plain steps)
                spec_token_share=spec_tokens / decode_tokens if decode_tokens else None,
                draft_time_s=_delta(s0, s1, "spec_draft_time_s"),
                verify_time_s=_delta(s0, s1, "spec_verify_time_s"),
            )
        return r

    def _decode(self, prompts, params) -> list:
        """The timed batch's outputs, in prompt order; with ``--arrivals``, one of the arrival
        prompts (2 tokens out) joins every ``--arrival-every`` engine steps while it decodes."""
        llm, a = self.llm, self.a
        if not a.arrivals:
            return llm.generate(prompts, params, use_tqdm=False)
        from scheduler import SamplingParams

        tag = next(self._runs)
        ids = [f"spec{tag}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            llm.add_request(prompt, params, request_id=rid)
        done, steps, added = {}, 0, 0
        while llm.has_unfinished():
            done.update({o.request_id: o for o in llm.step() if o.finished})
            steps += 1
            if steps % a.arrival_every == 0 and added < a.arrivals:
                side = SamplingParams(max_tokens=2, ignore_eos=True, exit_mode="fixed")
                llm.add_request(self.arrival_prompts[added], side, request_id=f"arrival{tag}-{added}")
                added += 1
        return [done[rid] for rid in ids]


# ------------------------------------------------------------------------------------ records
def variant_name(variant: tuple[str, Optional[float]]) -> str:
    """``random`` or ``converging(0.003)``."""
    model, scale = variant
    return model if scale is None else f"{model}({scale:g})"


def _label(variant, c: int, spec: Optional[tuple[int, int]], arrivals: int = 0) -> str:
    what = "plain" if spec is None else f"d={spec[0]} k={spec[1]}"
    return f"self_spec {variant_name(variant)} c={c} {what}" + (f" arrivals={arrivals}" if arrivals else "")


def _identity(variant, c: int, spec: Optional[tuple[int, int]], arrivals: int = 0) -> dict:
    # label, mode and chunk: the key merge_results merges --append runs by
    return dict(
        label=_label(variant, c, spec, arrivals),
        arrivals=arrivals,
        mode="plain" if spec is None else "spec",
        chunk=None,
        model=variant[0],
        converging_scale=variant[1],
        concurrency=c,
        draft_loops=None if spec is None else spec[0],
        num_speculative_tokens=None if spec is None else spec[1],
    )


def _first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first index where two token lists differ (a length counts), ``None`` when equal."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if i == len(a) == len(b) else i


def error_record(variant, c: int, spec, e: BaseException, arrivals: int = 0) -> dict:
    return dict(_identity(variant, c, spec, arrivals), error=f"{type(e).__name__}: {e}"[:2000])


def make_record(a, ctx: dict, variant, c: int, spec, got: dict, base: Optional[dict]) -> dict:
    """One record: the identity, the run's figures and, for ``d:k``, the baseline's beside them."""
    got = dict(got)
    tokens = got.pop("tokens")
    r = dict(_identity(variant, c, spec, a.arrivals), **got)
    if spec is None:
        r.update(baseline_tpot_ms=r["tpot_ms"], speedup=1.0, tokens_equal=True)
    else:
        r.setdefault("acceptance", None)
        r.setdefault("mean_accepted_length", None)
        bt = (base or {}).get("tpot_ms")
        r.update(
            baseline_tpot_ms=bt,
            speedup=bt / r["tpot_ms"] if bt and r.get("tpot_ms") else None,
            tokens_equal=None if base is None else tokens == base["tokens"],
        )
        if base is not None:
            # where they part, if they do: a bf16 near-tie decided the other way reads differently
            # from a bug that changes every token after the first round
            firsts = [_first_difference(x, y) for x, y in zip(tokens, base["tokens"])]
            parted = [i for i in firsts if i is not None]
            r.update(requests_equal=len(firsts) - len(parted), first_difference=min(parted, default=None))
    T = ctx["num_loops"]
    fl = decode_step_floor(ctx["config"], c, a.context + a.output_tokens / 2, T, ctx["bw"], ctx["peak"])
    r.update(
        tpot_floor_ms=fl["floor_s"] * 1e3,
        tpot_floor=dict(fl, batch=c, context=a.context + a.output_tokens / 2, loops=T, bandwidth=ctx["bw"]),
        device=ctx["device"],
        preset=a.preset,
        context=a.context,
        output_tokens=a.output_tokens,
        command=ctx["command"],
    )
    return r


def format_record(r: dict) -> str:
    if "error" in r:
        return f"{r['label']:40s} ERROR {r['error']}"
    s = f"{r['label']:40s} TPOT p50 {fmt.num(r.get('tpot_ms'))} ms (floor {fmt.num(r['tpot_floor_ms'])} ms)"
    if r["mode"] == "spec":
        s += (
            f", baseline {fmt.num(r.get('baseline_tpot_ms'))} ms, speed-up {fmt.num(r.get('speedup'))}x, "
            f"acceptance {fmt.pct(r.get('acceptance'))}, {fmt.num(r.get('mean_accepted_length'))} tokens/round, "
            f"tokens equal {r.get('tokens_equal')}"
        )
    return s + f", compiles {r.get('compilations')}"


def plot(result: dict, path: str) -> Optional[str]:
    try:
        from benchmarks.report import plot_self_spec

        return plot_self_spec(result, path)
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return None


# ---------------------------------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument(
        "--converging-scale",
        nargs="+",
        type=float,
        default=[DEFAULT_CONVERGING_SCALE],
        help="share of each layer's update the converging variant keeps; several: a variant each "
        f"(default {DEFAULT_CONVERGING_SCALE})",
    )
    ap.add_argument("--concurrency", nargs="+", type=int, default=None, help=f"default {list(DEFAULT_CONCURRENCY)}")
    ap.add_argument(
        "--spec", nargs="*", default=None, help=f"d:k pairs (draft loops:speculative tokens); default {DEFAULT_SPEC}"
    )
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--output-tokens", type=int, default=128, help="tokens out per request")
    ap.add_argument("--quick", action="store_true", help=f"c {QUICK['concurrency']}, spec {QUICK['spec']}")
    ap.add_argument("--append", action="store_true", help="merge records into an existing self_spec.json")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dtype", default=None, help="default: the preset's")
    ap.add_argument("--seed", type=int, default=0, help="weights and prompts")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: context + output + 2 (k + 1), pow2")
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="KV pool size (default: the engine's)")
    ap.add_argument(
        "--arrivals",
        type=int,
        default=0,
        help="long prompts that arrive while the c streams decode (rounds then run loop by loop beside them)",
    )
    ap.add_argument("--arrival-tokens", type=int, default=2048, help="tokens of each arriving prompt")
    ap.add_argument("--arrival-every", type=int, default=12, help="engine steps between two arrivals")
    ap.add_argument("--quick-ceilings", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    return ap


def _resolve(a) -> None:
    """Defaults (``--quick`` first), then every value checked before anything is built."""
    quick = QUICK if a.quick else {}
    if a.concurrency is None:
        a.concurrency = quick.get("concurrency", list(DEFAULT_CONCURRENCY))
    if a.spec is None:
        a.spec = quick.get("spec", list(DEFAULT_SPEC))
    if any(c < 1 for c in a.concurrency):
        raise ValueError(f"--concurrency takes positive integers, got {a.concurrency}")
    a.specs = list(dict.fromkeys(parse_spec(s) for s in a.spec))
    if a.output_tokens < 2:
        raise ValueError(f"--output-tokens must be >= 2 (TPOT needs two tokens), got {a.output_tokens}")
    if a.context < 1:
        raise ValueError(f"--context must be positive, got {a.context}")
    if a.arrivals < 0 or a.arrival_tokens < 1 or a.arrival_every < 1:
        raise ValueError("--arrivals must be >= 0, --arrival-tokens and --arrival-every >= 1")
    if not all(0.0 <= s <= 1.0 for s in a.converging_scale):
        raise ValueError(f"--converging-scale takes values in [0, 1], got {a.converging_scale}")
    from weights.config import get_preset

    cfg = get_preset(a.preset)
    bad = [f"{d}:{k}" for d, k in a.specs if d >= cfg.num_loops]
    if bad:
        raise ValueError(f"--spec: draft loops must be below {a.preset}'s {cfg.num_loops} loops, got {bad}")
    a.concurrency = sorted(dict.fromkeys(a.concurrency))
    a.models = list(dict.fromkeys(a.models))
    scales = list(dict.fromkeys(a.converging_scale))
    a.variants = [(m, None) for m in a.models if m == "random"]
    a.variants += [(m, s) for m in a.models if m == "converging" for s in scales]
    a.max_k = max((k for _, k in a.specs), default=0)
    if a.max_model_len is None:
        # one length for every engine of the run (same shapes); rounds may write past max_tokens
        need = max(a.context + a.output_tokens + 2 * (a.max_k + 1), a.arrival_tokens + 2 if a.arrivals else 0)
        a.max_model_len = 1 << (need - 1).bit_length()
    if a.context + a.output_tokens > a.max_model_len:
        raise ValueError(f"--max-model-len {a.max_model_len} < context + output tokens")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    import jax

    from benchmarks import ceilings
    from benchmarks.run import save_json
    from weights.config import get_preset

    a = parser().parse_args(argv)
    try:
        _resolve(a)
    except ValueError as e:
        raise SystemExit(f"benchmarks.self_spec: {e}") from None
    args = sys.argv[1:] if argv is None else list(argv)
    command = "python -m benchmarks.self_spec " + shlex.join(args)
    if a.specs and not has_speculative_config():
        raise SystemExit(
            "benchmarks.self_spec: this engine has no speculative_config (EngineConfig); run --spec with no "
            "pairs for the baselines alone"
        )
    os.makedirs(a.out, exist_ok=True)
    cfg = get_preset(a.preset)
    ceil = ceilings.measure(a.quick_ceilings)
    ctx = dict(
        config=cfg,
        num_loops=cfg.num_loops,
        bw=float(ceil["bandwidth"]),
        peak=float(ceil["peak_flops"]),
        device=str(ceil.get("device") or jax.devices()[0].device_kind),
        command=command,
    )
    dtype = a.dtype or cfg.torch_dtype
    engine_kw = dict(
        max_num_seqs=max(a.concurrency) + a.arrivals,
        max_model_len=a.max_model_len,
        enable_prefix_caching=True,
    )
    if a.kv_cache_gb is not None:
        engine_kw["kv_cache_bytes"] = int(a.kv_cache_gb * 2**30)
    out_json = os.path.join(a.out, "self_spec.json")
    prev = None
    if a.append and os.path.exists(out_json):
        import json

        with open(out_json) as f:
            prev = json.load(f)
    print(
        f"{ctx['device']}: {ctx['bw'] / 1e12:.2f} TB/s; {a.preset} {dtype}, models "
        f"{[variant_name(v) for v in a.variants]}, c {a.concurrency}, "
        f"d:k {[f'{d}:{k}' for d, k in a.specs]}, context {a.context}, {a.output_tokens} out",
        flush=True,
    )
    records, engines = [], []

    def save() -> dict:
        res = dict(
            benchmark="self_spec",
            device=ctx["device"],
            jax_version=jax.__version__,
            backend=jax.default_backend(),
            preset=a.preset,
            config=dict(
                argv=args,
                command=command,
                preset=a.preset,
                dtype=dtype,
                model=cfg.to_dict(),
                models=[variant_name(v) for v in a.variants],
                converging_scale=a.converging_scale,
                concurrency=a.concurrency,
                spec=[dict(draft_loops=d, num_speculative_tokens=k) for d, k in a.specs],
                context=a.context,
                output_tokens=a.output_tokens,
                seed=a.seed,
                engine=dict(engine_kw, dtype=dtype),
                exit="fixed",
                temperature=0.0,
            ),
            ceilings=ceil,
            engines=(prev or {}).get("engines", []) + engines,
            **merge_lists((prev or {}).get("records", []), (prev or {}).get("skipped", []), records, []),
        )
        save_json(res, out_json)
        return res

    def add(r: dict) -> None:
        records.append(r)
        print(format_record(r), flush=True)
        save()

    for variant in a.variants:
        params = model_params(variant[0], cfg, a.seed, dtype, variant[1])
        baselines: dict = {}
        for spec in [None, *a.specs]:
            t = time.perf_counter()
            try:
                llm = build_engine(cfg, params, spec, dtype=dtype, **engine_kw)
            except Exception as e:  # noqa: BLE001 - one engine that fails must not lose the others
                traceback.print_exc()
                for c in a.concurrency:
                    add(error_record(variant, c, spec, e, a.arrivals))
                continue
            engines.append(
                dict(
                    model=variant_name(variant),
                    spec=None if spec is None else list(spec),
                    build_s=time.perf_counter() - t,
                )
            )
            try:
                run = EngineRun(llm, a, cfg.vocab_size)
                for c in a.concurrency:
                    try:
                        got = run.run(c)
                    except Exception as e:  # noqa: BLE001 - nor one concurrency the next
                        traceback.print_exc()
                        add(error_record(variant, c, spec, e, a.arrivals))
                        continue
                    if spec is None:
                        baselines[c] = dict(tpot_ms=got["tpot_ms"], tokens=got["tokens"])
                    add(make_record(a, ctx, variant, c, spec, got, baselines.get(c)))
            finally:
                llm.close()
                del llm
                gc.collect()
        del params
        gc.collect()
    res = save()
    if not a.no_plot:
        p = plot(res, os.path.join(a.out, "self_spec.png"))
        if p:
            print(f"benchmarks.self_spec: wrote {p}", flush=True)
    print(f"benchmarks.self_spec: wrote {out_json} ({len(res['records'])} records)", flush=True)
    return res


if __name__ == "__main__":
    main()
