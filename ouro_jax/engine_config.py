"""``EngineConfig``: every option of an engine, in one frozen dataclass.

Each field is declared once with its type, default, section, a line of help and whether it shapes
compiled code; it is checked once, when the config is built, by a ``ValueError`` that names it.
Everything else derives from these declarations:

* ``LLM(model, **overrides)`` maps keywords onto the fields (a misspelt one fails naming the
  closest field), ``LLM(model, config=EngineConfig(...))`` takes a whole config, and
  ``llm.config`` is the config resolved for the model and device (``None`` defaults made concrete);
* the ``ouro-jax`` flags of ``demo``, ``serve`` and ``generate`` (:func:`add_arguments`,
  :func:`from_arguments`): the same names, defaults and help;
* :meth:`EngineConfig.compile_hash`, over every field not declared ``compile_free``: the executable
  store's key holds it, so a changed option can never reuse a stale compiled step.

The environment variables that set options are the defaults of their fields (``ouro_jax/envs.py``
declares them; the help of such a field names its variable).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import math
import os
from typing import Any, Callable, Mapping, Optional, Sequence

from pallas_kernels.choices import ATTENTION
from scheduler.options import choice
from scheduler.scheduler import KV_ALLOCATIONS, KV_LAYOUTS, POLICIES, PREFILL_MODES
from scheduler.speculation import SpeculativeConfig, speculative_option

from . import envs

__all__ = [
    "EngineConfig",
    "SECTIONS",
    "DTYPES",
    "add_arguments",
    "engine_overrides",
    "from_arguments",
    "from_overrides",
    "parse_xla_options",
    "to_argv",
]

SECTIONS = ("model", "cache", "scheduler", "compile", "kernels", "parallel", "server")
DTYPES = ("bfloat16", "float32", "float16")
REPLICA_MODES = ("process", "thread")
REASONING_PARSERS = ("think",)  # server/parsers.py implements them
DEFAULT_COMPILE_CACHE = "~/.cache/ouro_jax/xla"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ------------------------------------------------------------------------------- checks
# Each returns the value as stored (a choice lower-cased, a sequence as a tuple) or raises
# ValueError with the field's name.
def _as_int(v):
    """A numpy integer as a Python int (sizes often come out of numpy arithmetic); else ``v``."""
    if not isinstance(v, (bool, int)) and hasattr(v, "__index__") and "int" in type(v).__name__:
        return int(v)
    return v


def _positive_int(name, v, lo: int = 1):
    v = _as_int(v)
    if not (_is_int(v) and v >= lo):
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer >= {lo}")
        raise ValueError(f"{name} must be {what}, got {v!r}")
    return v


def _optional(check: Callable) -> Callable:
    return lambda name, v: None if v is None else check(name, v)


def _at_least(lo: int) -> Callable:
    return lambda name, v: _positive_int(name, v, lo)


def _bool(name, v):
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be True or False, got {v!r}")
    return v


def _choice(choices: Sequence[str]) -> Callable:
    return lambda name, v: choice(name, v, choices)


def dtype_option(name, v):
    """``None``, a dtype name in any case, or a numpy/jax dtype -> ``None`` or one of ``DTYPES``."""
    if v is None or isinstance(v, str):
        return None if v is None else choice(name, v, DTYPES)
    import numpy as np  # a numpy / jax dtype object

    try:
        return choice(name, np.dtype(v).name, DTYPES)
    except TypeError:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, DTYPES))} or None, got {v!r}") from None


def _fraction(name, v):
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < v <= 1.0):
        raise ValueError(f"{name} must lie in (0, 1], got {v!r}")
    return float(v)


def _watermark(name, v):
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v < 1.0):
        raise ValueError(f"{name} must lie in [0, 1), got {v!r}")
    return float(v)


def _positive_number(name, v):
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf):
        raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    return float(v)


def _buckets(name, v):
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise ValueError(f"{name} must be a sequence of positive integers, got {v!r}")
    out = tuple(_as_int(b) for b in v)
    if not out or not all(_is_int(b) and b >= 1 for b in out):
        raise ValueError(f"{name} must be a non-empty sequence of positive integers, got {v!r}")
    return out


def _text(name, v):
    if not isinstance(v, str):
        raise ValueError(f"{name} must be a string, got {v!r}")
    return v


def parse_xla_options(text: str, option: str) -> dict:
    """``"xla_name=value;..."`` parsed into XLA compiler options (``true``/``false``, integers, else
    strings, e.g. ``xla_gpu_enable_command_buffer=`` for none); ``ValueError`` names the ``option``
    and an entry that is not ``name=value`` with an ``xla_`` name."""
    out = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        name, sep, value = (x.strip() for x in entry.partition("="))
        if not sep or not name.startswith("xla_"):
            raise ValueError(f"{option}: {entry!r} is not 'xla_name=value' (entries split by ';')")
        low = value.lower()
        if low in ("true", "false"):
            out[name] = low == "true"
        elif value.lstrip("-").isdigit():
            out[name] = int(value)
        else:
            out[name] = value
    return out


def _xla_options(name, v):
    _text(name, v)
    parse_xla_options(v, name)  # the entries' grammar, checked now; parsed again where compiled
    return v


def _devices(name, v):
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise ValueError(f"{name} must be a sequence of jax devices, got {v!r}")
    out = tuple(v)
    if not out or not all(hasattr(d, "id") and hasattr(d, "platform") for d in out):
        raise ValueError(f"{name} must be a non-empty sequence of jax devices (from jax.devices()), got {v!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must be distinct, got {v!r}")
    return out


def _port(name, v):
    v = _as_int(v)
    if not (_is_int(v) and 0 <= v < 65536):
        raise ValueError(f"{name} must lie in [0, 65535], got {v!r}")
    return v


def _field(
    default: Any = None,
    *,
    section: str,
    help: str,
    check: Optional[Callable] = None,
    compile_free: bool = False,
    flag: bool = True,
    factory: Optional[Callable[[], Any]] = None,
    metavar: Optional[str] = None,
    choices: Optional[Sequence[str]] = None,
):
    """A field and its declaration: ``check`` (default: one of ``choices``) stores or refuses a value;
    ``compile_free`` fields stay out of :meth:`EngineConfig.compile_hash` (they change no compiled
    program); ``flag=False`` fields get no command-line flag."""
    if check is None:
        check = _choice(choices)
    meta = dict(
        section=section, help=help, check=check, compile_free=compile_free, flag=flag, metavar=metavar, choices=choices
    )
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine option (see the module docstring). ``None`` means "chosen for the model and
    device when the engine starts"; ``llm.config`` holds the choices made."""

    # ------------------------------------------------------------------ model and load
    dtype: Optional[str] = _field(
        section="model",
        help="cast the weights to bfloat16 | float32 | float16 (default: the checkpoint's or preset's dtype)",
        check=dtype_option,
        choices=DTYPES,
    )
    seed: int = _field(
        0,
        section="model",
        help="seed of a preset's random weights (the same weights `ouro-jax random-checkpoint --seed` writes)",
        check=_at_least(0),
        compile_free=True,
    )
    # ---------------------------------------------------------------------------- cache
    block_size: int = _field(16, section="cache", help="tokens per KV block", check=_positive_int)
    max_model_len: Optional[int] = _field(
        section="cache",
        help="longest prompt + output (default: the model's max_position_embeddings, at most 4096)",
        check=_optional(_positive_int),
    )
    kv_layout: str = _field(
        "last_exited",
        section="cache",
        help="KV of a token: one plane per depth, written by the loop that made it (last_exited), or one "
        "plane all loops overwrite (shared)",
        choices=KV_LAYOUTS,
    )
    num_blocks: Optional[int] = _field(
        section="cache",
        help="KV pool size in blocks (default: from kv_cache_bytes or gpu_memory_utilization)",
        check=_optional(_at_least(2)),
    )
    kv_cache_bytes: Optional[int] = _field(
        section="cache",
        help="KV pool size in bytes (default: from gpu_memory_utilization)",
        check=_optional(_positive_int),
    )
    gpu_memory_utilization: float = _field(
        0.85,
        section="cache",
        help="share of the device's memory the engine may hold (weights, KV pool, activations)",
        check=_fraction,
    )
    kv_allocation: str = _field(
        "on_demand",
        section="cache",
        help="on_demand: blocks as tokens need them, preemption when the pool runs out; reserve: prompt + "
        "max_tokens at admission",
        choices=KV_ALLOCATIONS,
        compile_free=True,
    )
    enable_prefix_caching: Optional[bool] = _field(
        section="cache",
        help="reuse the KV of shared prompt prefixes (LAST_EXITED only; default off)",
        check=_optional(_bool),
        compile_free=True,
    )
    watermark: float = _field(
        0.01,
        section="cache",
        help="on_demand: share of the pool that admission keeps free for running requests",
        check=_watermark,
        compile_free=True,
    )
    # ------------------------------------------------------------------------ scheduler
    max_num_seqs: int = _field(32, section="scheduler", help="most requests running at once", check=_positive_int)
    max_num_batched_tokens: Optional[int] = _field(
        section="scheduler",
        help="rows of one invocation (default 2048 on a GPU, 256 elsewhere, never below max_num_seqs)",
        check=_optional(_positive_int),
    )
    prefill_chunk_size: int = _field(64, section="scheduler", help="prompt tokens per chunk", check=_positive_int)
    prefill_mode: str = _field(
        "split",
        section="scheduler",
        help="how prompt chunks share invocations: split | mixed | wavefront",
        choices=PREFILL_MODES,
    )
    policy: str = _field(
        "fcfs",
        section="scheduler",
        help="waiting-queue order: fcfs | priority",
        choices=POLICIES,
        compile_free=True,
    )
    buckets: Optional[tuple] = _field(
        section="scheduler",
        help="row buckets, e.g. 8,32,128 (default: powers of two from 8 to max_num_batched_tokens)",
        check=_optional(_buckets),
        metavar="N,N,...",
    )
    fused_decode_max_rows: Optional[int] = _field(
        section="scheduler",
        help="decode batches of up to this many rows run their tokens in one executable, exits decided on the "
        "device (default 128 on a GPU, 8 elsewhere, at most max_num_seqs; 0: loop by loop)",
        check=_optional(_at_least(0)),
    )
    fused_decode_tokens: int = _field(
        1,
        section="scheduler",
        help="tokens per fused decode step (more is faster at one stream but hands tokens out in bursts)",
        check=_positive_int,
    )
    async_scheduling: bool = _field(
        True,
        section="scheduler",
        help="build and launch the next fused decode step before reading the one in flight",
        check=_bool,
        compile_free=True,
    )
    target_tpot_ms: Optional[float] = _field(
        section="scheduler",
        help="decode time per output token to hold while prompts prefill: the streams share the prompts' "
        "invocations uncapped while their measured TPOT is on time; past it, streams that run fused decode steps "
        "alternate one fused token with prompt-only invocations steered by the measured TPOT, other streams (and "
        "split mode, from the start) cap the prompt rows of each invocation by a cost model fitted online "
        "(default: off)",
        check=_optional(_positive_number),
        compile_free=True,
    )
    speculative_config: Optional[SpeculativeConfig] = _field(
        section="scheduler",
        help='self-speculative decoding, as JSON or a dict: {"method": "loops", "draft_loops": d, '
        '"num_speculative_tokens": k} drafts k + 1 tokens with d loops each and verifies them at full depth '
        "in one pass (greedy tokens unchanged; default: off)",
        check=speculative_option,
        compile_free=True,  # its rounds are executables of their own, keyed by d and k
        metavar="JSON",
    )
    # -------------------------------------------------------------- compile and runner
    compile_cache_dir: Optional[str] = _field(
        section="compile",
        help="JAX's persistent compilation cache and the executable store ('off' disables both; default "
        f"${envs.variable('COMPILE_CACHE').name} or ~/.cache/ouro_jax/xla)",
        check=_optional(_text),
        compile_free=True,
        factory=lambda: envs.COMPILE_CACHE,
    )
    executable_store: bool = _field(
        True,
        section="compile",
        help="load compiled executables saved by an earlier start (no tracing), and save new ones",
        check=_bool,
        compile_free=True,
    )
    compile_threads: Optional[int] = _field(
        section="compile",
        help="threads compiling executables at start-up (default 4 cold, all when the cache is warm)",
        check=_optional(_positive_int),
        compile_free=True,
    )
    num_ring_rows: Optional[int] = _field(
        section="compile",
        help="rows of the hidden-state ring (default: what the scheduler needs; more lets engines of other "
        "chunk sizes share executables)",
        check=_optional(_positive_int),
    )
    warmup: bool = _field(
        True, section="compile", help="compile every executable at start-up", check=_bool, compile_free=True
    )
    progress: bool = _field(
        True, section="compile", help="progress bars (start-up, generate)", check=_bool, compile_free=True
    )
    fused_xla_options: str = _field(
        section="compile",
        help="extra XLA options of fused decode steps, 'xla_name=value;...' "
        f"(default ${envs.variable('FUSED_XLA_OPTIONS').name})",
        check=_xla_options,
        factory=lambda: envs.FUSED_XLA_OPTIONS,
        metavar="OPTIONS",
    )
    step_xla_options: str = _field(
        section="compile",
        help="extra XLA options of one-loop steps, 'xla_name=value;...' "
        f"(default ${envs.variable('STEP_XLA_OPTIONS').name})",
        check=_xla_options,
        factory=lambda: envs.STEP_XLA_OPTIONS,
        metavar="OPTIONS",
    )
    # -------------------------------------------------------------------------- kernels
    attention: str = _field(
        "auto",
        section="kernels",
        help="attention kernel: auto (pallas on a GPU, reference elsewhere), pallas (chosen per bucket), a "
        "forced triton | mgpu | hybrid, or reference (jnp)",
        choices=ATTENTION,
    )
    # ------------------------------------------------------------------------- parallel
    tensor_parallel_size: int = _field(
        1,
        section="parallel",
        help="split heads, MLP, vocabulary and KV pool over this many devices",
        check=_positive_int,
    )
    devices: Optional[tuple] = _field(
        section="parallel",
        help="the devices this engine owns (default: the first tensor_parallel_size of jax.devices())",
        check=_optional(_devices),
        flag=False,
    )
    # --------------------------------------------------------------------------- server
    host: str = _field("127.0.0.1", section="server", help="address to listen on", check=_text, compile_free=True)
    port: int = _field(8000, section="server", help="port to listen on", check=_port, compile_free=True)
    served_model_name: Optional[str] = _field(
        section="server",
        help="the model name clients use (default: the model argument)",
        check=_optional(_text),
        compile_free=True,
    )
    max_queue: int = _field(
        256,
        section="server",
        help="requests waiting beyond max_num_seqs before the server answers 429",
        check=_at_least(0),
        compile_free=True,
    )
    data_parallel_size: int = _field(
        1,
        section="server",
        help="engines on disjoint device sets behind one server (each of tensor_parallel_size devices)",
        check=_positive_int,
        compile_free=True,
    )
    replica_mode: Optional[str] = _field(
        section="server",
        help="data-parallel replicas as one worker process each (default with data_parallel_size > 1) or as "
        "threads of the server's process (default for one engine)",
        check=_optional(_choice(REPLICA_MODES)),
        choices=REPLICA_MODES,
        compile_free=True,
    )
    reasoning_parser: Optional[str] = _field(
        section="server",
        help="split a chat answer's <think>...</think> block into message.reasoning_content (server/parsers.py)",
        check=_optional(_choice(REASONING_PARSERS)),
        choices=REASONING_PARSERS,
        compile_free=True,
    )
    max_n: int = _field(
        16,
        section="server",
        help="the most choices one request may ask for (OpenAI's n, and best_of); more is a 400",
        check=_positive_int,
        compile_free=True,
    )
    drain_timeout_s: float = _field(
        30.0,
        section="server",
        help="on SIGTERM / SIGINT: seconds the running requests may take to finish (new ones are answered "
        "503) before they are aborted and the server exits",
        check=_positive_number,
        compile_free=True,
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = f.metadata["check"](f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        if self.prefill_mode == "wavefront" and self.kv_layout == "shared":
            raise ValueError(
                "prefill_mode='wavefront' needs kv_layout='last_exited': with SHARED KV a position's depth 0 "
                "reads the final KV of every earlier position, so chunks cannot overlap in depth"
            )
        if self.enable_prefix_caching and self.kv_layout == "shared":
            raise ValueError("enable_prefix_caching needs kv_layout='last_exited' (docs/engine-semantics.md)")
        if self.devices is not None and len(self.devices) != self.tensor_parallel_size:
            raise ValueError(
                f"devices must hold tensor_parallel_size={self.tensor_parallel_size} devices, got {len(self.devices)}"
            )
        rows, fused = self.max_num_batched_tokens, self.fused_decode_max_rows
        if rows is not None and rows < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({rows}) must be >= max_num_seqs ({self.max_num_seqs}): every running "
                "request may need a decode row in one invocation"
            )
        if fused is not None and fused > self.max_num_seqs:
            raise ValueError(f"fused_decode_max_rows must lie in [0, max_num_seqs={self.max_num_seqs}], got {fused}")

    # --------------------------------------------------------------------------- use
    def cache_dir(self) -> str:
        """The compile cache's folder: ``compile_cache_dir``, else the home cache ('off' stays 'off')."""
        return self.compile_cache_dir or os.path.expanduser(DEFAULT_COMPILE_CACHE)

    def replace(self, **changes) -> "EngineConfig":
        """A copy with ``changes`` (checked names: a misspelt one names the closest field)."""
        check_names(changes)
        return dataclasses.replace(self, **changes)

    def section(self, name: str) -> dict:
        """The fields of one section (``SECTIONS``), by name."""
        if name not in SECTIONS:
            raise ValueError(f"section must be one of {SECTIONS}, got {name!r}")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["section"] == name}

    @classmethod
    def compile_fields(cls) -> tuple[str, ...]:
        """The fields that shape compiled code: every field not declared ``compile_free``."""
        return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata["compile_free"])

    def compile_hash(self) -> str:
        """sha256 over every field that shapes compiled code (:meth:`compile_fields`), by name and a
        process-independent repr (devices by platform and id)."""
        items = tuple((name, _stable(getattr(self, name))) for name in self.compile_fields())
        return hashlib.sha256(repr(items).encode()).hexdigest()


def _stable(value):
    if isinstance(value, tuple):
        return tuple(_stable(v) for v in value)
    if hasattr(value, "platform") and hasattr(value, "id"):  # a jax device
        return f"{value.platform}:{value.id}"
    return value


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineConfig))


def check_names(names: Mapping | Sequence[str]) -> None:
    """``ValueError`` for the first name that is not a field, naming the closest field."""
    for name in names:
        if name not in FIELD_NAMES:
            close = difflib.get_close_matches(name, FIELD_NAMES, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown engine option {name!r}{hint} (EngineConfig has no such field)")


def from_overrides(config: Optional[EngineConfig] = None, **overrides) -> EngineConfig:
    """``config`` (default: ``EngineConfig()``) with ``overrides``, every name checked."""
    check_names(overrides)
    if config is not None and not isinstance(config, EngineConfig):
        raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
    if config is None:
        return EngineConfig(**overrides)
    return dataclasses.replace(config, **overrides) if overrides else config


# --------------------------------------------------------------------------------- flags
def _flag_type(f: dataclasses.Field):
    """The argparse type of a field's flag, from its declared type (None: an on/off switch)."""
    base = f.type.replace("Optional[", "").rstrip("]")
    return {"tuple": _comma_ints, "bool": None, "int": int, "float": float}.get(base, str)


def _comma_ints(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma separated integers, got {text!r}") from None


def _default_text(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        return ""  # from the environment: the help says which variable
    if f.default is None:
        return ""  # the help says what None chooses
    if isinstance(f.default, bool):
        return f" (default: {'on' if f.default else 'off'})"
    return f" (default: {f.default})"


def add_arguments(parser: argparse.ArgumentParser, sections: Sequence[str]) -> None:
    """One flag per field of ``sections`` (``--max-num-seqs`` for ``max_num_seqs``; booleans as
    ``--x`` / ``--no-x``), in an argument group per section. A flag left out keeps the field's
    default: every flag's parsed default is None and :func:`from_arguments` skips those."""
    for section in sections:
        group = parser.add_argument_group(f"engine: {section}" if section != "server" else "server")
        for f in dataclasses.fields(EngineConfig):
            if f.metadata["section"] != section or not f.metadata["flag"]:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata["help"] + _default_text(f)
            typ = _flag_type(f)
            if typ is None:
                group.add_argument(
                    flag, dest=f"cfg_{f.name}", action=argparse.BooleanOptionalAction, default=None, help=help_
                )
                continue
            choices = f.metadata["choices"]
            group.add_argument(
                flag,
                dest=f"cfg_{f.name}",
                type=str.lower if choices else typ,
                choices=choices,
                default=None,
                metavar=None if choices else (f.metadata["metavar"] or f.name.upper()),
                help=help_,
            )


def from_arguments(args: argparse.Namespace, **defaults) -> dict:
    """The overrides that parsed flags give (fields whose flag was given), over ``defaults``
    (a command's own defaults for fields whose flag was left out)."""
    out = dict(defaults)
    for name in FIELD_NAMES:
        value = getattr(args, f"cfg_{name}", None)
        if value is not None:
            out[name] = value
    check_names(out)
    return out


def engine_overrides(overrides: Mapping) -> dict:
    """``overrides`` less the server section: what one engine (``LLM``) of a server takes."""
    server = {f.name for f in dataclasses.fields(EngineConfig) if f.metadata["section"] == "server"}
    return {k: v for k, v in overrides.items() if k not in server}


def to_argv(overrides: Mapping) -> list[str]:
    """The flags that give ``overrides`` (the inverse of :func:`from_arguments`), for a child
    process such as ``ouro-jax serve``."""
    check_names(overrides)
    out = []
    for name, value in overrides.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            out.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, tuple):
            out += [f"--{flag}", ",".join(map(str, value))]
        elif value is not None:
            out += [f"--{flag}", str(value)]
    return out
