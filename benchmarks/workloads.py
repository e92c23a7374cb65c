"""The standard workloads of docs/performance.md: seeded, random token ids, ``ignore_eos``.

    long4                 4 requests at t=0, 8064-token prompts, 16 out; swept over modes x chunks
    mixed32 / mixed128    32 / 128 requests at t=0, prompts uniform in 256..8064, 64 out; same sweep
    serve1k               closed loop at concurrency c in {1, 32, 128}: 2c requests of 1024 / 128;
                          a new request is submitted whenever one finishes; fixed depth and
                          synthetic early exit (mean 2.5 loops)
    burst128              128 requests at t=0, 1024-token prompts, 16 out: the time to the last first
                          token (``prefill_span.seconds``) is what a burst of users waits
    decode_under_prefill  64 decoding streams (128 prompt, 256 out); 8064-token prompts arrive while
                          they decode (triggered by the streams' progress, so every configuration
                          sees the same interference); the run stops when the streams finish;
                          streams at fixed depth, synthetic early exit (variant "early") or the
                          model's gate rule (variant "ouro0.5")
    eos512                512 requests at t=0, 1024-token prompts, max_tokens=1024 as far as KV
                          reservation knows, stopping after 64-256 tokens (see ``eos512``);
                          variants: KV reserved at admission against allocated on demand
    shared_prefix         64 requests at t=0: a 2048-token common prefix + 64 unique tokens, 128 out;
                          variants: prefix cache off / on (the prefix warmed before the timed run)
    decode                c requests at t=0 (c in 1..128), 1024- or 4096-token prompts, 128 out, fixed
                          depth or early exit (``decode_workload``; run by ``benchmarks/decode.py``,
                          which warms the prompts into the prefix cache so that the c streams decode
                          together: not in ``WORKLOADS``, the generic harness cannot run it that way)

Every generator returns a list of ``Workload`` variants (serve1k: one per concurrency and exit mode).
``scale`` multiplies token lengths (prompts, outputs) and ``count_scale`` request counts and
concurrencies, so that the whole harness runs on a tiny model on a CPU in seconds.

All workloads share one ``EngineShape`` (max_num_seqs, max_num_batched_tokens, max_model_len,
block size, buckets, ring rows): every engine of a sweep then has the same executables, compiled
once (``benchmarks/run.py``).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Callable, Optional, Sequence

import numpy as np

from scheduler import SamplingParams
from scheduler.buckets import next_power_of_two
from scheduler.sizes import ring_rows, ring_slots

__all__ = [
    "RequestSpec",
    "Workload",
    "EngineShape",
    "WORKLOADS",
    "make",
    "suite_shape",
    "shape_from_args",
    "MODES",
    "CHUNKS",
    "SWEEP_MODES",
    "SWEEP_CHUNKS",
    "EARLY_EXIT_MEAN_LOOPS",
    "EXIT_WORKLOADS",
    "DECODE_CONCURRENCY",
    "DECODE_CONTEXTS",
    "DECODE_EXITS",
    "decode_prompts",
    "decode_workload",
    "exit_params",
    "exit_mean_loops",
]

MODES = ("split", "mixed", "wavefront")
CHUNKS = (16, 32, 64, 128)
# the default sweeps run in priority order (the targets of docs/performance.md first), so that a
# time budget that cuts a sweep short cuts the least informative configurations
SWEEP_MODES = ("wavefront", "split", "mixed")
SWEEP_CHUNKS = (16, 128, 64, 32)
EARLY_EXIT_MEAN_LOOPS = 2.5
DECODE_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_CONTEXTS = (1024, 4096)  # prompt tokens: the context each decode row reads is prompt + tokens so far
DECODE_EXITS = ("fixed", f"synthetic{EARLY_EXIT_MEAN_LOOPS:g}", "ouro0.5")


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    prompt: np.ndarray  # int32 token ids
    params: SamplingParams
    tag: str = "main"  # groups requests for per-tag latency figures
    after_tokens: Optional[int] = None  # triggered arrival: submit once the background streams
    # have produced this many tokens each (None: at t=0)
    reserve_tokens: Optional[int] = None  # KV reservation as if max_tokens were this (eos512)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt.shape[0])


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """Engine settings that fix executable shapes; identical across a sweep so shapes repeat."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int = 8192
    block_size: int = 16
    buckets: Optional[tuple] = None  # None: powers of two from 8 (the engine's default)
    ring_chunk: int = 128  # the ring holds T chunks of this size per sequence

    def num_ring_rows(self, num_loops: int, chunks: Sequence[int] = ()) -> int:
        """Rows for the largest chunk of the sweep in the mode that keeps most chunks resident
        (wavefront): enough for every mode and chunk."""
        return ring_rows(self.max_num_seqs, max((self.ring_chunk, *chunks)) * ring_slots(num_loops, "wavefront"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Workload:
    name: str
    variant: str  # e.g. "c=32 fixed"; "" when there is one variant
    requests: list[RequestSpec]
    arrival: str  # "batch" | "closed_loop" | "triggered"
    concurrency: Optional[int] = None  # closed loop
    background_tag: Optional[str] = None  # triggered: the streams whose progress triggers arrivals
    stop_when_background_done: bool = False
    modes: tuple = SWEEP_MODES  # default sweep, in priority order
    chunks: tuple = SWEEP_CHUNKS
    generate_baseline: bool = False  # a static-batch generate() of the same batch applies
    # a plain-JAX one-shot prefill of the same prompts applies (all at t=0, of one length)
    plain_prefill_baseline: bool = False
    exit: str = "fixed"  # "fixed", "early" (synthetic) or a kind of exit_params ("ouro0.5")
    description: str = ""
    engine_kw: dict = dataclasses.field(default_factory=dict)  # LLM options of this variant
    warm_prompts: tuple = ()  # run (1 token each) before the timed run, e.g. to fill a prefix cache

    @property
    def label(self) -> str:
        return f"{self.name} {self.variant}".strip()

    def summary(self) -> dict:
        p = [r.num_prompt_tokens for r in self.requests]
        o = [r.params.max_tokens for r in self.requests]
        tags = sorted({r.tag for r in self.requests})
        return dict(
            name=self.name,
            variant=self.variant,
            requests=len(self.requests),
            arrival=self.arrival,
            concurrency=self.concurrency,
            prompt_tokens=int(sum(p)),
            prompt_min=int(min(p)),
            prompt_max=int(max(p)),
            output_tokens=int(sum(o)),
            max_tokens=sorted(set(o)),
            tags=tags,
            exit=self.exit,
            stop_when_background_done=self.stop_when_background_done,
            description=self.description,
        )


# --------------------------------------------------------------------------------------- helpers
class _Scaler:
    def __init__(self, scale: float, count_scale: float):
        if not (0 < scale <= 1 and 0 < count_scale <= 1):
            raise ValueError(f"scale and count_scale must lie in (0, 1], got {scale}, {count_scale}")
        self.scale, self.count_scale = scale, count_scale

    def prompt(self, n: int) -> int:
        return max(1, round(n * self.scale))

    def out(self, n: int) -> int:
        return max(2, round(n * self.scale))  # two tokens at least: one inter-token latency

    def count(self, n: int, least: int = 1) -> int:
        return max(least, round(n * self.count_scale))


def _rng(name: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _ids(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    # token 0 is EOS in the presets; ignore_eos makes it harmless, keeping it out makes logs readable
    return rng.integers(1, vocab_size, n, dtype=np.int64).astype(np.int32)


def _params(max_tokens: int, exit: str = "fixed", seed: int = 0) -> SamplingParams:
    """A workload stream's parameters: ``exit`` is "early" (synthetic, ``EARLY_EXIT_MEAN_LOOPS``)
    or any kind of ``exit_params`` ("fixed", "synthetic2.5", "ouro0.5")."""
    return exit_params(f"synthetic{EARLY_EXIT_MEAN_LOOPS:g}" if exit == "early" else exit, max_tokens, seed)


def _exit_words(exit: str) -> str:
    p = _params(1, exit)
    if p.exit_mode == "synthetic":
        return f"synthetic early exit (mean {p.synthetic_mean_loops:g} loops)"
    if exit_mean_loops(exit, 1) is None:
        return f"the model's gate rule at q = {p.exit_threshold:g}"
    return "fixed full depth"


def exit_mean_loops(exit: str, num_loops: int) -> Optional[float]:
    """Loops a token of a workload stream runs on average, known before the run: ``None`` for the
    model's gate rule (its depths come out of the run)."""
    p = _params(1, exit)
    if p.exit_mode == "synthetic":
        return p.synthetic_mean_loops
    return None if p.exit_mode in ("ouro", "delayed") and p.exit_threshold < 1 else float(num_loops)


# ------------------------------------------------------------------------------------- workloads
def long4(vocab_size: int, scale: float = 1.0, count_scale: float = 1.0, seed: int = 0) -> list[Workload]:
    s = _Scaler(scale, count_scale)
    rng = _rng("long4", seed)
    n, prompt, out = s.count(4), s.prompt(8064), s.out(16)
    reqs = [RequestSpec(_ids(rng, prompt, vocab_size), _params(out)) for _ in range(n)]
    return [
        Workload(
            "long4",
            "",
            reqs,
            "batch",
            generate_baseline=True,
            plain_prefill_baseline=True,
            description=f"{n} x {prompt}-token prompts at t=0, {out} out",
        )
    ]


def _mixed(name: str, count: int, vocab_size: int, scale: float, count_scale: float, seed: int) -> list[Workload]:
    s = _Scaler(scale, count_scale)
    rng = _rng(name, seed)
    n, lo, hi, out = s.count(count, least=2), s.prompt(256), s.prompt(8064), s.out(64)
    lengths = rng.integers(lo, hi + 1, n)
    reqs = [RequestSpec(_ids(rng, int(m), vocab_size), _params(out)) for m in lengths]
    # chunk 128 first: the three modes compared at the cheap end before the expensive small chunks
    return [
        Workload(
            name,
            "",
            reqs,
            "batch",
            chunks=(128, 16, 64, 32),
            description=f"{n} requests at t=0, prompts uniform in {lo}..{hi}, {out} out",
        )
    ]


def mixed32(vocab_size: int, scale: float = 1.0, count_scale: float = 1.0, seed: int = 0) -> list[Workload]:
    return _mixed("mixed32", 32, vocab_size, scale, count_scale, seed)


def mixed128(vocab_size: int, scale: float = 1.0, count_scale: float = 1.0, seed: int = 0) -> list[Workload]:
    return _mixed("mixed128", 128, vocab_size, scale, count_scale, seed)


def burst128(vocab_size: int, scale: float = 1.0, count_scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """A burst of short prompts: every request arrives at once and the last one waits for its
    first token until the whole batch is prefilled (the records' ``prefill_span.seconds``)."""
    s = _Scaler(scale, count_scale)
    rng = _rng("burst128", seed)
    n, prompt, out = s.count(128), s.prompt(1024), s.out(16)
    reqs = [RequestSpec(_ids(rng, prompt, vocab_size), _params(out)) for _ in range(n)]
    return [
        Workload(
            "burst128",
            "",
            reqs,
            "batch",
            chunks=(128, 64),
            description=f"{n} x {prompt}-token prompts at t=0, {out} out: time to the last first token",
        )
    ]


def serve1k(
    vocab_size: int,
    scale: float = 1.0,
    count_scale: float = 1.0,
    seed: int = 0,
    concurrency: Sequence[int] = (1, 32, 128),
    exits: Sequence[str] = ("fixed", "early"),
) -> list[Workload]:
    s = _Scaler(scale, count_scale)
    prompt, out = s.prompt(1024), s.out(128)
    variants = []
    for c0 in concurrency:
        c = s.count(c0)
        for exit in exits:
            rng = _rng(f"serve1k-{c0}", seed)  # the same prompts for both exit modes
            reqs = [RequestSpec(_ids(rng, prompt, vocab_size), _params(out, exit)) for _ in range(2 * c)]
            variants.append(
                Workload(
                    "serve1k",
                    f"c={c} {exit}",
                    reqs,
                    "closed_loop",
                    concurrency=c,
                    modes=("split",),
                    chunks=(64,),
                    generate_baseline=exit == "fixed",
                    exit=exit,
                    description=f"closed loop at concurrency {c}: {2 * c} requests of {prompt} prompt / {out} out, "
                    + _exit_words(exit),
                )
            )
    return variants


def decode_under_prefill(
    vocab_size: int,
    scale: float = 1.0,
    count_scale: float = 1.0,
    seed: int = 0,
    exits: Sequence[str] = ("fixed",),
) -> list[Workload]:
    """One variant per exit mode of the streams (the long prompts' own 16 tokens run at fixed
    depth): "fixed" keeps the variant name "" of the records before streams had a choice."""
    s = _Scaler(scale, count_scale)
    streams, sp, so = s.count(64), s.prompt(128), s.out(256)
    n_long, lp, lo = s.count(4), s.prompt(8064), s.out(16)
    # long prompts arrive spread over the streams' lifetime (by their progress, not by wall clock)
    after = [max(1, round(so * (i + 1) / (n_long + 2))) for i in range(n_long)]
    variants = []
    for exit in exits:
        rng = _rng("decode_under_prefill", seed)  # the same prompts for every exit mode
        reqs = [RequestSpec(_ids(rng, sp, vocab_size), _params(so, exit), tag="decode") for _ in range(streams)]
        reqs += [RequestSpec(_ids(rng, lp, vocab_size), _params(lo), tag="long", after_tokens=a) for a in after]
        depth = _exit_words(exit)
        variants.append(
            Workload(
                "decode_under_prefill",
                "" if exit == "fixed" else exit,
                reqs,
                "triggered",
                background_tag="decode",
                stop_when_background_done=True,
                chunks=(16, 128),
                exit=exit,
                description=f"{streams} decoding streams ({sp} prompt, {so} out, {depth}); {n_long} prompts "
                f"of {lp} tokens arrive after the streams produced {after} tokens; stops (aborting "
                f"the long prompts) once the streams finish",
            )
        )
    return variants


def eos512(vocab_size: int, scale: float = 1.0, count_scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Outputs that stop well before ``max_tokens``, as EOS stops them in service. Random weights
    put no EOS where we want it and ``SamplingParams`` has no ``min_tokens``, so every request
    gets ``ignore_eos`` and its own ``max_tokens`` drawn in 64..256 (finish reason "length"), while
    KV reservation is told ``max_tokens=1024`` (``RequestSpec.reserve_tokens``): the reserve variant
    holds what a server that trusts ``max_tokens`` would hold, on-demand allocation what is used."""
    s = _Scaler(scale, count_scale)
    rng = _rng("eos512", seed)
    n, prompt = s.count(512), s.prompt(1024)
    lo, hi, cap = s.out(64), s.out(256), s.out(1024)
    lengths = rng.integers(lo, hi + 1, n)
    reqs = [
        RequestSpec(_ids(rng, prompt, vocab_size), _params(int(k), seed=i), reserve_tokens=cap)
        for i, k in enumerate(lengths)
    ]
    return [
        Workload(
            "eos512",
            alloc,
            reqs,
            "batch",
            modes=("split",),
            chunks=(128,),
            engine_kw=dict(kv_allocation=alloc),
            description=f"{n} requests at t=0, {prompt}-token prompts, outputs of {lo}..{hi} tokens "
            f"(per-request max_tokens, ignore_eos) reserved as max_tokens={cap}; kv_allocation={alloc}",
        )
        for alloc in ("reserve", "on_demand")
    ]


def shared_prefix(vocab_size: int, scale: float = 1.0, count_scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """A system prompt shared by every request. The prefix is run once before the timed run (as
    a server that has served it before would have it cached); with the cache off that warm-up
    changes nothing. Records carry the hit tokens and the prompt rows run, so the cut in prompt
    work can be compared with the share of prompt tokens hit."""
    s = _Scaler(scale, count_scale)
    rng = _rng("shared_prefix", seed)
    n, plen, ulen, out = s.count(64), s.prompt(2048), s.prompt(64), s.out(128)
    prefix = _ids(rng, plen, vocab_size)
    reqs = [RequestSpec(np.concatenate([prefix, _ids(rng, ulen, vocab_size)]), _params(out)) for _ in range(n)]
    return [
        Workload(
            "shared_prefix",
            f"cache {'on' if on else 'off'}",
            reqs,
            "batch",
            modes=("split", "wavefront"),
            chunks=(128,),
            engine_kw=dict(enable_prefix_caching=on),
            warm_prompts=(np.concatenate([prefix, _ids(_rng("shared_prefix-warm", seed), ulen, vocab_size)]),),
            description=f"{n} requests at t=0: a {plen}-token common prefix (warmed before the run) + "
            f"{ulen} unique tokens, {out} out; prefix cache {'on' if on else 'off'}",
        )
        for on in (False, True)
    ]


def exit_params(kind: str, max_tokens: int, seed: int = 0) -> SamplingParams:
    """The sampling parameters of an exit kind: ``fixed`` (full depth), ``synthetic<mean loops>``
    (depths drawn with that mean, e.g. ``synthetic2.5``) or ``ouro<threshold>`` (the model's gate
    rule, e.g. ``ouro0.5``)."""
    base = dict(max_tokens=max_tokens, ignore_eos=True, seed=seed)
    if kind == "fixed":
        return SamplingParams(exit_mode="fixed", **base)
    for prefix in ("synthetic", "ouro"):
        if isinstance(kind, str) and kind.startswith(prefix):
            try:
                x = float(kind[len(prefix) :])
            except ValueError:
                break
            if prefix == "synthetic" and x >= 1:
                return SamplingParams(exit_mode="synthetic", synthetic_mean_loops=x, **base)
            if prefix == "ouro" and 0 <= x <= 1:
                return SamplingParams(exit_mode="ouro", exit_threshold=x, **base)
    raise ValueError(
        f"exit kind must be 'fixed', 'synthetic<mean loops >= 1>' or 'ouro<threshold in [0, 1]>' "
        f"(e.g. synthetic2.5, ouro0.5), got {kind!r}"
    )


def decode_prompts(vocab_size: int, context: int, n: int, scale: float = 1.0, seed: int = 0) -> list[np.ndarray]:
    """The first ``n`` prompts of one seeded list per context: every concurrency takes a prefix of
    the same list, so that a prefix cache warmed for one run also serves the smaller ones."""
    s = _Scaler(scale, 1.0)
    rng = _rng(f"decode-{context}", seed)
    return [_ids(rng, s.prompt(context), vocab_size) for _ in range(n)]


def decode_workload(
    vocab_size: int,
    concurrency: int,
    exit: str,
    context: int,
    scale: float = 1.0,
    seed: int = 0,
    output_tokens: int = 128,
) -> Workload:
    """``concurrency`` requests at t=0 of ``context``-token prompts (scaled), ``output_tokens`` out."""
    if not (isinstance(concurrency, int) and concurrency >= 1):
        raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
    if not (isinstance(context, int) and context >= 1):
        raise ValueError(f"context must be a positive integer, got {context!r}")
    s = _Scaler(scale, 1.0)
    out = s.out(output_tokens)
    params = exit_params(exit, out, seed)
    tag = f"decode-c{concurrency}-{exit}-{context}"
    reqs = [RequestSpec(p, params, tag=tag) for p in decode_prompts(vocab_size, context, concurrency, scale, seed)]
    return Workload(
        "decode",
        f"c={concurrency} {exit} ctx={context}",
        reqs,
        "batch",
        concurrency=concurrency,
        modes=("split",),
        chunks=(128,),
        exit=exit,
        engine_kw=dict(enable_prefix_caching=True),
        description=f"{concurrency} requests at t=0, {s.prompt(context)}-token prompts (context {context}), "
        f"{out} out, exit {exit}",
    )


WORKLOADS: dict[str, Callable[..., list[Workload]]] = {
    "long4": long4,
    "mixed32": mixed32,
    "mixed128": mixed128,
    "serve1k": serve1k,
    "burst128": burst128,
    "decode_under_prefill": decode_under_prefill,
    "eos512": eos512,
    "shared_prefix": shared_prefix,
}
# workloads whose streams take an exit choice (``exits=``: "fixed", "early" or a kind of ``exit_params``)
EXIT_WORKLOADS = frozenset({"serve1k", "decode_under_prefill"})


def make(
    name: str, vocab_size: int, scale: float = 1.0, count_scale: float = 1.0, seed: int = 0, **kw
) -> list[Workload]:
    try:
        fn = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
    return fn(vocab_size, scale, count_scale, seed, **kw)


def suite_shape(scale: float = 1.0, count_scale: float = 1.0, **overrides) -> EngineShape:
    """One engine shape for every standard workload at this scale (8192 tokens at full scale)."""
    s = _Scaler(scale, count_scale)
    longest = max(
        s.prompt(8064) + s.out(64),
        s.prompt(1024) + s.out(128),
        s.prompt(128) + s.out(256),
        s.prompt(1024) + s.out(1024),  # eos512's reservation
        s.prompt(2048) + s.prompt(64) + s.out(128),  # shared_prefix
        s.prompt(max(DECODE_CONTEXTS)) + s.out(128),  # decode at 4K
    )
    shape = EngineShape(max_model_len=next_power_of_two(longest))
    return dataclasses.replace(shape, **{k: v for k, v in overrides.items() if v is not None})


def shape_from_args(a, **overrides) -> EngineShape:
    """``suite_shape`` at the CLI's ``--scale`` / ``--count-scale`` and shape flags (a flag left
    out keeps the suite's value); ``overrides`` replace flags a CLI reads its own way."""
    kw = dict(
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        block_size=a.block_size,
        buckets=tuple(a.buckets) if a.buckets else None,
    )
    kw.update(overrides)
    return suite_shape(a.scale, getattr(a, "count_scale", 1.0), **kw)
