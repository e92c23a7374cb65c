"""``LLM``: the engine users drive, vLLM-style.

    llm = LLM("ouro-small")                         # a preset (random weights) or a checkpoint folder
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))
    outs[0].token_ids, outs[0].exit_depths, outs[0].text, outs[0].metrics.ttft

One loop of the engine (``step``): the scheduler picks the next invocation and builds its bucketed
descriptor; the runner launches the bucket's precompiled executable; the scheduler applies the
results, reading the device's gates/tokens only when a decision needs them, so prompt-only steps
never wait for the device and the host builds the next descriptor while the device computes.

``add_request`` / ``step`` / ``abort`` / ``has_unfinished`` let callers drive the loop themselves;
``stream`` yields outputs as tokens arrive. ``LLM``'s docstring states the one rule by which every
path hands outputs out.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import os
import threading
import time
import warnings
import weakref
from typing import Iterator, Optional, Sequence, Union

import jax
import numpy as np

from pallas_kernels.dispatch import resolve_attention
from scheduler import DEFAULT_ENABLE_PREFIX_CACHING, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.pipeline import StepPipeline
from scheduler.plan import Phase
from scheduler.sampling_params import TokenLogprobs, choice_params, read_logprobs
from scheduler.sizes import pool_blocks
from weights.config import PRESETS, OuroConfig

from . import envs
from .device_memory import device_memory
from .engine_config import FIELD_NAMES, EngineConfig, from_overrides
from .executable_store import ExecutableStore
from .parallel import check_devices, check_tensor_parallel
from .runner import ModelRunner
from .sampling import adjust_inputs, fixed_entries

__all__ = [
    "LLM",
    "RequestOutput",
    "RequestMetrics",
    "check_request",
    "encode_prompt",
    "load_tokenizer",
    "resolve_model",
]

# EngineConfig fields that SchedulerConfig takes as they are (the model gives num_loops and eos; the
# pool's size, num_blocks, is passed once it is known), derived so that a new field cannot be missed
_SCHEDULER_FIELDS = tuple(
    f.name for f in dataclasses.fields(SchedulerConfig) if f.name in FIELD_NAMES and f.name != "num_blocks"
)


class _NewRequest:
    """The id of the request ``check_request`` builds: equal to no caller's id."""

    def __repr__(self) -> str:
        return "(new)"


_PROBE_ID = _NewRequest()

Prompt = Union[str, Sequence[int]]


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: Optional[float]
    token_times: list[float]
    finish_time: Optional[float]

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token (seconds since the request was added)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies (seconds between consecutive tokens)."""
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token after the first."""
        n = len(self.token_times)
        return None if n < 2 else (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: object
    prompt_token_ids: Sequence[int]  # the request's read-only array (not copied per step)
    token_ids: list[int]
    exit_depths: list[int]
    text: Optional[str]
    finished: bool
    finish_reason: Optional[str]
    metrics: RequestMetrics
    # SamplingParams.logprobs: each token's TokenLogprobs and their sum (None when not asked for)
    logprobs: Optional[list[TokenLogprobs]] = None
    cumulative_logprob: Optional[float] = None
    # SamplingParams.prompt_logprobs: per prompt position (None at 0), from the full-depth state before
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None


_PROMPT_FORMS = "a string or a flat sequence (list, tuple, 1-D array) of integer token ids"


def _is_token_id(v) -> bool:
    """A Python or numpy integer; bools are not token ids (``True`` would read as id 1)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_array(v) -> bool:
    return hasattr(v, "ndim") and hasattr(v, "dtype") and hasattr(v, "shape")  # numpy / jax


def prompt_list(prompts) -> list:
    """The prompts of one ``generate`` / ``stream`` call as a list of single prompts: one prompt
    (text, or a flat sequence of ids), a list or tuple of them, or a 2-D array (one row each).
    Anything else is a ``TypeError`` / ``ValueError`` saying what is accepted."""
    if isinstance(prompts, str):
        return [prompts]
    if _is_array(prompts):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            return list(prompts)
        raise ValueError(f"prompts: an array holds one prompt (1-D) or a batch (2-D), got shape {tuple(prompts.shape)}")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be {_PROMPT_FORMS}, or a list of those; got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    if all(_is_token_id(x) or isinstance(x, (bool, np.bool_)) for x in prompts):
        return [prompts]  # one prompt of ids (a bool among them is refused by encode_prompt)
    return list(prompts)


def sampling_list(sampling_params, n: int) -> list:
    """One ``SamplingParams`` per prompt: ``None`` (the defaults), one for all, or a list of ``n``."""
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling params for {n} prompts")
        for i, sp in enumerate(sampling_params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
        return list(sampling_params)
    hint = " (build one with SamplingParams(**fields))" if isinstance(sampling_params, dict) else ""
    raise TypeError(
        f"sampling_params must be a SamplingParams, a list of them (one per prompt) or None; "
        f"got {type(sampling_params).__name__}{hint}"
    )


def load_tokenizer(folder: Optional[str], config: OuroConfig):
    """The folder's ``tokenizer.json`` (None without one); warns when it can produce ids the model has
    no embedding for. Without a folder (random weights): the preset tokenizer (``weights/tokenizer.py``)."""
    if folder is None:
        from weights.tokenizer import preset_tokenizer

        return preset_tokenizer(config)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        raise ValueError(f"cannot read the tokenizer {path}: {e}") from None
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > config.vocab_size:
        warnings.warn(
            f"the tokenizer {path} has {n} tokens but the model's vocab_size is {config.vocab_size}: "
            f"prompts holding ids >= {config.vocab_size} will be refused",
            stacklevel=3,
        )
    return tok


def eos_token_ids(config: OuroConfig, folder: Optional[str], tokenizer) -> tuple[int, ...]:
    """The ids that end a request: every ``eos_token_id`` of a checkpoint folder's ``config.json``
    and ``generation_config.json`` (``weights/generation_config.py``), or a preset's, and the
    tokenizer's ``eos_token`` (a preset's is ``<|im_end|>``: ``weights/tokenizer.py``), so that a
    preset and the checkpoint ``save_random`` writes of it stop alike."""
    from weights.generation_config import read_eos_token_ids, read_tokenizer_eos_text

    if folder is None:
        from weights.tokenizer import PRESET_TOKENIZER_CONFIG

        ids = set() if config.eos_token_id is None else {config.eos_token_id}
        text = PRESET_TOKENIZER_CONFIG["eos_token"]
    else:
        ids = set(read_eos_token_ids(folder, config.vocab_size))
        text = read_tokenizer_eos_text(folder)
    if text is not None and tokenizer is not None:
        t = tokenizer.token_to_id(text)
        if t is not None and t < config.vocab_size:
            ids.add(t)
    return tuple(sorted(ids))


def resolve_model(model) -> tuple[OuroConfig, Optional[str]]:
    """``(config, checkpoint folder or None)``, reading no weights: the folder's config.json only."""
    if isinstance(model, OuroConfig):
        return model, None
    if isinstance(model, str) and model in PRESETS:
        return PRESETS[model], None
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(
            f"model must be a preset ({', '.join(sorted(PRESETS))}), an OuroConfig or a checkpoint folder; "
            f"got {model!r}"
        )
    folder = os.path.expanduser(os.fspath(model))
    if not os.path.exists(folder):
        raise ValueError(
            f"model {os.fspath(model)!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an existing "
            f"path: no checkpoint folder {os.path.abspath(folder)}"
        )
    from weights import detect_format
    from weights._common import read_config

    detect_format(folder)  # a folder with config.json (Hugging Face) or an ouro-jax marker
    return read_config(folder), folder


def encode_prompt(prompt: Prompt, tokenizer, vocab_size: int) -> np.ndarray:
    """Token ids of one prompt: text through ``tokenizer``, or a flat sequence/array of integer ids
    (lists, tuples, numpy and jax arrays), each inside ``[0, vocab_size)``. Floats, strings, bools
    and nested sequences are refused, not truncated, parsed or cast; the message names what was given."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "text prompts need a tokenizer (tokenizer.json in the checkpoint folder); pass token ids instead"
            )
        prompt = tokenizer.encode(prompt).ids
    if _is_array(prompt):
        ids = np.asarray(prompt)
        if ids.ndim != 1:
            raise ValueError(f"a prompt must be {_PROMPT_FORMS}, got an array of shape {ids.shape}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):  # bool arrays too
            raise ValueError(f"token ids must be integers, got an array of {ids.dtype}")
    elif isinstance(prompt, (list, tuple)):
        bad = [x for x in prompt if not _is_token_id(x)][:3]
        if bad:  # checked before numpy sees them: it would cast bools and floats, or fail on nesting
            raise ValueError(f"token ids must be integers, got {', '.join(_describe(x) for x in bad)}")
        try:
            ids = np.asarray(prompt, dtype=np.int64)
        except OverflowError:
            raise ValueError(f"token ids must lie in [0, {vocab_size}), got {max(prompt)}") from None
    else:
        raise TypeError(f"a prompt must be {_PROMPT_FORMS}, got {_describe(prompt)}")
    if ids.size == 0:
        return ids.astype(np.int32)  # the scheduler refuses it with its own message
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"token ids {bad[:5].tolist()} are outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int32)


def _describe(v) -> str:
    """A value for an error message: its type, and the value when short."""
    r = repr(v)
    return f"{type(v).__name__} {r}" if len(r) <= 40 else type(v).__name__


def check_request(
    scheduler: Scheduler, ids: np.ndarray, sampling_params: Optional[SamplingParams], priority: int = 0
) -> np.ndarray:
    """``ids`` if ``scheduler`` would queue them with ``sampling_params`` and ``priority``, else its
    ``ValueError`` (naming the request ``(new)``) or a ``TypeError``; queues nothing."""
    [sp] = sampling_list(sampling_params, 1)
    scheduler.check_request(Request(_PROBE_ID, ids, sp, priority=priority))
    return ids


# engines not yet closed: closed at interpreter exit, while the interpreter is whole (a device copy
# still in flight then would take the GIL in a finalizing interpreter: std::terminate, exit 134)
_OPEN_ENGINES: "weakref.WeakSet[LLM]" = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    for llm in list(_OPEN_ENGINES):
        try:
            llm.close()
        except Exception as e:  # noqa: BLE001 - the others must still close
            warnings.warn(f"closing an LLM at exit failed: {e!r}", stacklevel=1)


# Rows per invocation when the caller names none. On a GPU 2048 rows read the weights once for
# twice the prompt rows of 1024 and were measured the better pick (docs/decisions.md, "2048 rows
# per invocation by default on a GPU"). On a CPU every bucket compiles and runs slowly, so the
# default stays small.
GPU_MAX_NUM_BATCHED_TOKENS = 2048
CPU_MAX_NUM_BATCHED_TOKENS = 256
# Largest row bucket that gets fused decode steps when the caller names no fused_decode_max_rows: on
# a GPU 32 to 128 streams decoded 15-30% faster fused (docs/decisions.md, "Fused steps at large
# buckets"); elsewhere the smallest bucket, as nothing beyond it was measured off the GPU.
GPU_FUSED_DECODE_MAX_ROWS = 128
CPU_FUSED_DECODE_MAX_ROWS = 8


def default_max_num_batched_tokens(backend: str, max_num_seqs: int) -> int:
    """The default row budget of one invocation for ``backend``, never below ``max_num_seqs``."""
    return max(GPU_MAX_NUM_BATCHED_TOKENS if backend == "gpu" else CPU_MAX_NUM_BATCHED_TOKENS, max_num_seqs)


def default_fused_decode_max_rows(backend: str, max_num_seqs: int) -> int:
    """The default ``fused_decode_max_rows`` for ``backend``, never above ``max_num_seqs``."""
    return min(GPU_FUSED_DECODE_MAX_ROWS if backend == "gpu" else CPU_FUSED_DECODE_MAX_ROWS, max_num_seqs)


class LLM:
    """The Ouro engine: loop-level batching, paged depth-plane KV, bucketed compiled steps.

    Request lifecycle, one rule for every path (``generate``, ``stream``, ``add_request`` +
    ``step``, ``abort``): every output is handed out exactly once, to whoever drives the loop, and
    the engine forgets a request once its final output has been handed out.

    - ``step()`` returns one ``RequestOutput`` (cumulative: all tokens so far) for every request
      that got tokens or finished since its output was last handed out, including requests that
      ``generate``/``stream`` ran but did not own and requests aborted since the last step.
    - ``generate()`` and ``stream()`` drive the loop until *their* prompts finish and hand out only
      their prompts' outputs; outputs of other requests produced meanwhile are kept (the latest
      one per request) and returned by the next ``step()``.
    - ``abort(id)`` finishes a queued or running request at once (its KV blocks and ring rows are
      free on return); its final output (``finish_reason="abort"``) comes from the next ``step()``
      (or from the ``generate``/``stream`` that owns it). ``has_unfinished()`` stays true until
      every final output has been handed out.
    """

    def __init__(
        self,
        model: Union[str, OuroConfig] = "ouro-small",
        *,
        config: Optional[EngineConfig] = None,
        params: Optional[dict] = None,
        **overrides,
    ):
        """``model``: a preset name (random weights), an ``OuroConfig`` or a checkpoint folder.
        ``config`` (default ``EngineConfig()``) with ``overrides`` (any ``EngineConfig`` field by
        name) says how to run it; ``params`` replaces the weights. Every option is checked before
        any weight is read or built: a typo fails in milliseconds."""
        cfg = from_overrides(config, **overrides)
        unknown = envs.unknown_variables()
        if unknown:  # a retired or misspelt option would otherwise do nothing, silently
            warnings.warn(
                f"{', '.join(unknown)}: not an ouro-jax variable, ignored (ouro_jax/envs.py lists them)", stacklevel=2
            )
        if cfg.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={cfg.data_parallel_size}: LLM runs one engine; `ouro-jax serve "
                "--data-parallel-size N` runs N of them behind one server"
            )
        c, folder = resolve_model(model)
        # tensor parallel: checked against the model before any weight is read, and the weights
        # then read to the host, so that the runner places each leaf straight into its shards
        tp = check_tensor_parallel(c, cfg.tensor_parallel_size)
        # the devices this engine owns (a data-parallel replica): weights are read to the host and
        # placed there by the runner, never staged on the process's default device
        devices = check_devices(cfg.devices, tp)
        cfg = self._resolve(cfg, c, tp)
        # the tokenizer before the weights: its eos token is one of the stop ids, and a broken one fails fast
        tokenizer = load_tokenizer(folder, c)
        sched = dict(
            num_loops=c.num_loops,
            vocab_size=c.vocab_size,
            eos_token_ids=eos_token_ids(c, folder, tokenizer),
            **{f: getattr(cfg, f) for f in _SCHEDULER_FIELDS},
        )
        # validated with the pool's smallest legal size when the pool is sized from memory later
        self.scheduler_config = SchedulerConfig(num_blocks=cfg.num_blocks or 2, **sched)
        sc = self.scheduler_config
        need = pool_blocks(1, sc.max_model_len, sc.num_planes, sc.block_size)
        if cfg.num_blocks is not None:
            self._check_pool(cfg.num_blocks, need)
        # A larger ring than the scheduler needs is allowed: engines of different chunk sizes and
        # modes then share executables (same shapes), which benchmark sweeps use to compile once.
        if cfg.num_ring_rows is not None and cfg.num_ring_rows < sc.num_ring_rows:
            raise ValueError(
                f"num_ring_rows={cfg.num_ring_rows} is too small: this configuration needs {sc.num_ring_rows}"
            )

        t_start = time.perf_counter()
        cache = self.enable_compile_cache(cfg.compile_cache_dir)
        # our own store of compiled executables, inside JAX's cache folder (docs/decisions.md, "Start-up")
        self.executable_store = (
            ExecutableStore(os.path.join(cache, "ouro_executables")) if cfg.executable_store and cache else None
        )
        self.model_config = c
        self.tensor_parallel_size, self.devices = tp, devices
        host = tp > 1 or devices is not None
        self.tokenizer = tokenizer
        self.params = self._load(c, folder, params, cfg.dtype, cfg.seed, host=host, store=self.executable_store)
        # seconds of each start-up phase (benchmarks/startup.py reports them)
        self.startup_times = {"weights": time.perf_counter() - t_start}
        if cfg.num_blocks is None:
            itemsize = np.dtype(jax.tree.leaves(self.params)[0].dtype).itemsize
            block_bytes = c.kv_bytes_per_token_plane(itemsize) * sc.block_size
            num_blocks = self._size_pool(block_bytes, cfg.kv_cache_bytes, cfg.gpu_memory_utilization, sc, tp)
            self._check_pool(num_blocks, need)
            cfg = dataclasses.replace(cfg, num_blocks=num_blocks)
            self.scheduler_config = SchedulerConfig(num_blocks=num_blocks, **sched)
        cfg = dataclasses.replace(cfg, num_ring_rows=cfg.num_ring_rows or sc.num_ring_rows)
        #: the resolved engine configuration: every ``None`` default made concrete for this model and device
        self.config: EngineConfig = cfg
        self.scheduler = Scheduler(self.scheduler_config)
        self.runner = ModelRunner(
            c,
            self.params,
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            num_ring_rows=cfg.num_ring_rows,
            engine=cfg,
            executable_store=self.executable_store,
        )
        self.startup_times["runner"] = time.perf_counter() - t_start - self.startup_times["weights"]
        self._ids = itertools.count()
        self._live: dict[object, Request] = {}  # queued or running, by id
        # outputs produced but not yet handed out (the latest per request; see the class docstring)
        self._unreported: dict[object, RequestOutput] = {}
        # fused decode steps scheduled one ahead of the host's reads (scheduler/pipeline.py), which
        # also times the device for a latency target's cost model
        self._pipeline = StepPipeline(
            self.scheduler,
            self.runner,
            ahead=cfg.async_scheduling,
            sampler_inputs=self._sampler_inputs,
            after_launch=self._queue_prompt_logprobs,
        )
        # structured outputs: a matcher per guided request, fed every token it gets (structured.py)
        self._matchers: dict = {}
        self._logprob_ids: set = set()  # requests that ask for logprobs: their one-loop steps take them
        # requests whose logits the sampler biases or penalises: their fixed entries (prompt, bias)
        self._adjusting: dict = {}
        # prompt logprobs: the requests that ask, and the records launched but not yet read
        self._prompt_lp_ids: set = set()
        self._prompt_lp_pending: list = []
        self._grammar = None  # GrammarCompiler of this tokenizer, built at the first guided request
        self.warmup_time = (
            self.runner.warmup(self.executable_keys(), cfg.progress, cfg.compile_threads) if cfg.warmup else 0.0
        )
        self.startup_times["compile"] = self.warmup_time
        self._lock = threading.RLock()  # close() may come from another thread (at exit, a server's)
        _OPEN_ENGINES.add(self)

    @staticmethod
    def _resolve(cfg: EngineConfig, c: OuroConfig, tp: int) -> EngineConfig:
        """``cfg`` with the defaults that depend on the model and device made concrete (all but
        the pool size, which needs the weights' memory)."""
        backend = jax.default_backend()
        changes: dict = {"attention": resolve_attention(cfg.attention)}
        if cfg.max_model_len is None:
            changes["max_model_len"] = min(c.max_position_embeddings, 4096)
        elif cfg.max_model_len > c.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({cfg.max_model_len}) exceeds the model's max_position_embeddings "
                f"({c.max_position_embeddings})"
            )
        if cfg.max_num_batched_tokens is None:
            changes["max_num_batched_tokens"] = default_max_num_batched_tokens(backend, cfg.max_num_seqs)
        # XLA (jax 0.11.2) segfaults compiling the fused decode step's while_loop under shard_map on
        # the GPU; on the CPU it compiles and matches one device (docs/decisions.md)
        fused_tp_broken = tp > 1 and backend == "gpu"
        if fused_tp_broken and cfg.fused_decode_max_rows:
            raise ValueError(
                "fused_decode_max_rows must be 0 with tensor_parallel_size > 1 on the GPU: XLA crashes "
                "compiling the fused decode step under shard_map (docs/decisions.md, 'Fused decode steps')"
            )
        if cfg.speculative_config is not None and tp > 1:
            raise ValueError("speculative_config runs on one device: tensor_parallel_size must be 1")
        if cfg.fused_decode_max_rows is None:
            # one executable per row bucket up to the default; several tokens per step hand tokens
            # out in bursts, so that stays opt-in (docs/decisions.md, "Fused decode steps")
            changes["fused_decode_max_rows"] = (
                0 if fused_tp_broken else default_fused_decode_max_rows(backend, cfg.max_num_seqs)
            )
        changes["compile_cache_dir"] = cfg.cache_dir()
        if cfg.enable_prefix_caching is None:
            changes["enable_prefix_caching"] = DEFAULT_ENABLE_PREFIX_CACHING and cfg.kv_layout == "last_exited"
        return dataclasses.replace(cfg, **changes)

    def executable_keys(self) -> list:
        """Every executable a run can launch: one per row bucket, one per fused decode step shape
        (``(key, n)``) when ``fused_decode_max_rows`` is set, the long-segment variants of the
        buckets that split attention per segment (``ModelRunner.long_segment_key``), and the
        separate samplers of the buckets' coda sizes (``SamplerKey``: small, launched only when a
        coda row samples)."""
        buckets = list(self.scheduler.bucket_spec.keys())
        sc = self.scheduler_config
        long = self.runner.long_segment_keys(buckets)
        return buckets + long + sc.fused_steps() + self.runner.sampler_keys(buckets) + sc.spec_rounds()

    # ------------------------------------------------------------------------------ setup
    @staticmethod
    def enable_compile_cache(path: str) -> Optional[str]:
        """Persistent XLA compilation cache (and autotune results with it): a restart compiles nothing.
        Returns its folder, None when it is off."""
        if path.lower() in ("", "off", "none"):
            return None
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        # every executable, small samplers too: one under a threshold would compile again at each start
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        return path

    @staticmethod
    def _load(config: OuroConfig, folder: Optional[str], params, dtype, seed, host: bool = False, store=None):
        """The folder's weights, or random weights for a config.
        ``host=True`` (tensor parallel) keeps the leaves on the host (numpy, or the CPU device)
        instead of the first accelerator."""
        from .model import dtype_of

        if folder is not None and params is None:
            from weights import load_checkpoint

            device = jax.devices("cpu")[0] if host else None
            _, params = load_checkpoint(folder, dtype=dtype, device=device)  # the config read_config gave
            dtype = None
        if params is None:  # the same weights as `ouro-jax random-checkpoint --seed` writes
            from weights.random_init import random_params

            params = random_params(
                config, seed, dtype_of(dtype or config.torch_dtype), on_device=not host, store=None if host else store
            )
        elif host:
            cast = (lambda x: np.asarray(x)) if dtype is None else (lambda x: np.asarray(x, dtype_of(dtype)))
            params = jax.tree.map(cast, params)
        elif dtype is not None:
            params = jax.tree.map(lambda x: jax.numpy.asarray(x, dtype_of(dtype)), params)
        else:
            params = jax.tree.map(jax.numpy.asarray, params)
        return params

    def _size_pool(self, block_bytes: int, kv_cache_bytes, util: float, sc: SchedulerConfig, tp: int = 1) -> int:
        """KV blocks for the budget: ``kv_cache_bytes``, else what is still free of the device's
        ``util`` share (on a CPU: every sequence at full length, capped at 1 GiB)."""
        if kv_cache_bytes is None:
            mem = device_memory(self.devices[0] if self.devices else None)
            if mem is None:
                want = pool_blocks(sc.max_num_seqs, sc.max_model_len, sc.num_planes, sc.block_size)
                return int(min(want, max(2, (1 << 30) // block_bytes)))
            limit, in_use = mem
            # what is still free of our share (another engine in this process keeps its own pool),
            # less the runner's copy of the layer weights and room for activations
            param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))
            # tensor parallel: every device holds 1/tp of the weights and of each block
            kv_cache_bytes = tp * (int(limit * util) - in_use - param_bytes // tp - (2 << 30))
        if kv_cache_bytes < 2 * block_bytes:
            raise ValueError(
                f"the KV cache budget ({kv_cache_bytes} bytes) holds fewer than 2 blocks of {block_bytes} bytes"
            )
        return int(kv_cache_bytes // block_bytes)

    def _check_pool(self, num_blocks: int, need: int) -> None:
        sc = self.scheduler_config
        if num_blocks < need:
            raise ValueError(
                f"the KV pool ({num_blocks} blocks of {sc.block_size} tokens) cannot hold one request of "
                f"max_model_len={sc.max_model_len} at {sc.num_planes} plane(s) (needs {need} blocks): lower "
                f"max_model_len or give the cache more memory (kv_cache_bytes / num_blocks)"
            )

    # ------------------------------------------------------------------- request API
    def encode(self, prompt: Prompt) -> np.ndarray:
        """Token ids of one prompt (:func:`encode_prompt` with this engine's tokenizer and vocabulary)."""
        return encode_prompt(prompt, self.tokenizer, self.model_config.vocab_size)

    def check_request(
        self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None, priority: int = 0
    ) -> np.ndarray:
        """The prompt's token ids if ``add_request`` would take it with ``sampling_params`` and
        ``priority``, else the ``ValueError`` / ``TypeError`` it would raise; queues nothing (front
        ends refuse bad requests with it). It reads only the scheduler's fixed limits, so the server
        calls it from its event loop while the engine thread steps."""
        self._check_open()
        ids = check_request(self.scheduler, self.encode(prompt), sampling_params, priority)
        if sampling_params is not None:
            self._check_sampler_features(sampling_params)
        return ids

    def _check_sampler_features(self, sp: SamplingParams) -> None:
        """What the separate sampler serves (a grammar, logprobs) is there for ``sp``."""
        if not self.runner.separate_sampler:
            if sp.logprobs is not None or sp.prompt_logprobs is not None:
                raise ValueError("logprobs are not supported with tensor_parallel_size > 1 yet")
            if sp.adjusts_logits:
                raise ValueError(
                    "penalties, logit_bias, min_p and min_tokens are not supported with tensor_parallel_size > 1 yet"
                )
        if sp.guided is not None:
            self._check_guided(sp.guided)

    def _check_guided(self, guided) -> None:
        from .structured import GuidedDecoding

        if not isinstance(guided, GuidedDecoding):
            raise TypeError(f"SamplingParams.guided must be a GuidedDecoding, got {_describe(guided)}")
        if self.tokenizer is None:
            raise ValueError("guided decoding needs a tokenizer (tokenizer.json in the checkpoint folder)")
        if not self.runner.separate_sampler:
            raise ValueError("guided decoding is not supported with tensor_parallel_size > 1 yet")

    def _grammar_compiler(self):
        if self._grammar is None:
            from .structured import GrammarCompiler

            sc = self.scheduler_config
            self._grammar = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, sc.eos_token_ids)
        return self._grammar

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: Optional[SamplingParams] = None,
        request_id=None,
        priority: int = 0,
        prompt_from=None,
    ) -> object:
        """Validate and queue one request (an error before anything changes); returns its id.
        ``priority`` (lower runs first) needs ``policy="priority"``. ``prompt_from``: the id of a
        queued or running request of the same prompt (another choice of it, OpenAI's ``n``): this
        one waits until that one has computed the prompt, then shares its full KV blocks (each
        writes its own from there), so the prompt is computed once; otherwise it has no effect."""
        self._check_open()
        [sp] = sampling_list(sampling_params, 1)
        self._check_sampler_features(sp)
        return self._add(self.encode(prompt), sp, request_id, priority, prompt_from)

    def _add(self, ids: np.ndarray, sp: SamplingParams, request_id=None, priority: int = 0, prompt_from=None) -> object:
        """Queue encoded ``ids``: the scheduler checks the request before it changes anything."""
        with self._lock:
            if request_id is None:
                rid = next(self._ids)
            else:
                try:
                    hash(request_id)
                except TypeError:
                    raise TypeError(
                        f"request_id must be hashable (a string or an int), got {type(request_id).__name__}"
                    ) from None
                rid = request_id
            if rid in self._unreported:
                raise ValueError(
                    f"request {rid!r}: a request with this id has an output not handed out yet (call step())"
                )
            req = Request(rid, ids, sp, priority=priority, prompt_from=prompt_from)
            matcher = None if sp.guided is None else self._grammar_compiler().matcher(sp.guided)
            self.scheduler.add_request(req)
            self._live[rid] = req
            if matcher is not None:
                self._matchers[rid] = matcher
            if sp.logprobs is not None:
                self._logprob_ids.add(rid)
            if sp.adjusts_logits:
                self._adjusting[rid] = fixed_entries(sp, ids)
            if sp.prompt_logprobs is not None:
                self._prompt_lp_ids.add(rid)
            return rid

    def abort(self, request_id) -> bool:
        """Cancel a queued or running request now; every KV block and ring row it held is free on
        return. Its final output (``finish_reason="abort"``) is handed out by the next ``step()``.
        False if the id is unknown or the request already finished."""
        self._check_open()
        with self._lock:
            try:
                if self.scheduler.abort(request_id) is None:
                    return False
            except TypeError:  # an unhashable id names no request
                return False
            req = self._live.pop(request_id)
            self._forget(request_id)
            self._unreported[request_id] = self._output(req)
            if not self.scheduler.has_unfinished():
                self._pipeline.drain()  # a step launched ahead held only ended requests: nothing to hand out
            return True

    def has_unfinished(self) -> bool:
        """True while a request is queued or running, or a final output has not been handed out."""
        self._check_open()
        return self.scheduler.has_unfinished() or bool(self._unreported)

    def step(self) -> list[RequestOutput]:
        """Run one invocation; returns an output for every request that got tokens or finished
        since its output was last handed out (see the class docstring)."""
        return self._collect(None)

    # ---------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Abort every unfinished request, wait for every launch and copy still on the device,
        and free the KV pool, the ring and the runner's weight layout (weights passed in as
        ``params`` stay the caller's; ``llm.params`` stays readable). The engine starts no thread
        that outlives a call, so none is left. Idempotent; run at interpreter exit for engines not
        closed by then. Afterwards every request method raises ``RuntimeError``; ``stats()`` still
        answers."""
        with self._lock:
            if self.runner.closed:
                return
            _OPEN_ENGINES.discard(self)
            try:
                for rid in list(self._live):
                    self.scheduler.abort(rid)
                self._pipeline.drain()
            finally:
                for rid in self._live:  # every request the sampler keeps anything of is live
                    self._forget(rid)
                self._live.clear()
                self._unreported.clear()
                self._prompt_lp_pending.clear()
                self.runner.close()

    @property
    def closed(self) -> bool:
        return self.runner.closed

    def __enter__(self) -> "LLM":
        self._check_open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.runner.closed:
            raise RuntimeError("this LLM is closed (LLM.close() ran): build a new one")

    # ------------------------------------------------------------------------- the loop
    def _advance(self) -> list[RequestOutput]:
        """One invocation; the outputs of the requests it gave tokens or finished."""
        deltas = self._pipeline.advance()
        if deltas is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler has unfinished requests but nothing it can run")
            return []
        self._read_prompt_logprobs()
        outs = []
        for d in deltas:
            req = self._live.get(d.request_id)
            if req is None:
                continue
            if d.request_id in self._matchers:
                self._feed_matcher(d)
            if d.finished:
                del self._live[d.request_id]
                self._forget(d.request_id)
            outs.append(self._output(req, with_text=d.finished))
        return outs

    def _forget(self, rid) -> None:
        """Drop what the sampler kept for a request that finished or was aborted (its grammar
        matcher, its logprob and penalty bookkeeping)."""
        self._matchers.pop(rid, None)
        self._logprob_ids.discard(rid)
        self._adjusting.pop(rid, None)
        self._prompt_lp_ids.discard(rid)

    def _feed_matcher(self, d) -> None:
        """A guided request's new tokens into its grammar matcher (the next mask depends on them)."""
        m = self._matchers[d.request_id]
        for t in d.new_token_ids:
            if m.is_terminated() and t in self.scheduler_config.eos_token_ids:
                break  # the eos the complete grammar allowed: the request ends with it
            if not m.accept(t):  # the mask allowed it: only an engine bug lands here
                raise RuntimeError(f"request {d.request_id!r}: token {t} is outside its grammar")

    def _queue_prompt_logprobs(self, plan) -> None:
        """Right after ``plan``'s launch: the logprobs of the next prompt token at every prompt
        position it ran at full depth, for the requests that ask (read in ``_read_prompt_logprobs``)."""
        if not self._prompt_lp_ids:
            return
        last, rows, ids, where = self.model_config.num_loops - 1, [], [], []
        for r in plan.ranges:
            if r.phase is not Phase.RECURRENT or r.depth != last or r.request_id not in self._prompt_lp_ids:
                continue
            prompt = self._live[r.request_id].prompt_token_ids
            count = min(r.token_end, len(prompt) - 1) - r.token_start  # the last position predicts no prompt token
            if count > 0:
                rows += plan.descriptor.row_ring[r.row_start : r.row_start + count].tolist()
                ids += prompt[r.token_start + 1 : r.token_start + 1 + count].tolist()
                where += [(r.request_id, r.token_start + 1 + i) for i in range(count)]
        if rows:
            size = max(8, 1 << (len(rows) - 1).bit_length())  # a few shapes compile (powers of two)
            pad = size - len(rows)
            records = self.runner.prompt_logprobs(
                np.array(rows + [0] * pad, np.int32), np.array(ids + [0] * pad, np.int32)
            )
            self._prompt_lp_pending.append((records, where))

    def _read_prompt_logprobs(self) -> None:
        """The prompt logprobs launched so far into their requests (a recomputed position overwrites)."""
        for records, where in self._prompt_lp_pending:
            host = np.asarray(records)
            for rec, (rid, pos) in zip(host, where):
                req = self._live.get(rid)
                if req is not None:
                    k = req.sampling_params.prompt_logprobs
                    req.prompt_logprobs[pos] = read_logprobs(rec, int(req.prompt_token_ids[pos]), k)
        self._prompt_lp_pending.clear()

    def _sampler_inputs(self, plan) -> dict:
        """What ``plan``'s coda rows need of the sampler (``ModelRunner.step``'s keywords, or
        ``complete``'s for a fused step's deferred coda): the allowed tokens ``bitmask [C,
        ceil(V/32)]`` of guided rows; for a one-loop plan also ``logprobs`` where a row's request
        asks for them and the ``adjust`` inputs of penalised rows. Empty for most plans."""
        out: dict = {}
        fused = plan.sub_plans is not None  # its coda rows ride on its last sub-step
        coda = plan.sub_plans[-1].coda if fused else plan.coda
        if not fused and self._logprob_ids and any(c.request_id in self._logprob_ids for c in coda):
            out["logprobs"] = True
        if self._adjusting:
            rows = [(i, self._live[c.request_id]) for i, c in enumerate(coda) if c.request_id in self._adjusting]
            if rows:
                out["adjust"] = adjust_inputs(
                    plan.descriptor.key.C,
                    [(i, r, self._adjusting[r.request_id]) for i, r in rows],
                    self.scheduler_config.eos_token_ids,
                )
        if not self._matchers:
            return out
        rows = [(self._matchers[c.request_id], i) for i, c in enumerate(coda) if c.request_id in self._matchers]
        if rows:
            from .structured import fill_bitmask_rows, new_bitmask

            out["bitmask"] = new_bitmask(plan.descriptor.key.C, self.model_config.vocab_size)
            fill_bitmask_rows(out["bitmask"], rows)
        return out

    def _collect(self, mine: Optional[set]) -> list[RequestOutput]:
        """Outputs for the caller that drives the loop: every request's (``mine=None``) or only
        those of ``mine``, the others kept for the next ``step()``. Unreported outputs come first;
        a newer output of the same request replaces an older one (outputs are cumulative)."""
        self._check_open()
        with self._lock:
            outs: dict[object, RequestOutput] = {}
            for rid in [r for r in self._unreported if mine is None or r in mine]:
                outs[rid] = self._unreported.pop(rid)
            if self.scheduler.has_unfinished():
                for o in self._advance():
                    if mine is None or o.request_id in mine:
                        outs[o.request_id] = o
                    else:
                        self._unreported[o.request_id] = o
            return list(outs.values())

    def _abandon(self, ids) -> None:
        """The caller that owned ``ids`` (a closed ``stream``, a ``generate`` that raised) is gone:
        abort those still running and drop every output of them that nobody will read."""
        with self._lock:
            if self.runner.closed:
                return
            for rid in ids:
                if rid in self._live:
                    self.scheduler.abort(rid)
                    del self._live[rid]
                self._unreported.pop(rid, None)
                self._forget(rid)
            if not self.scheduler.has_unfinished():
                self._pipeline.drain()

    def _text(self, token_ids, finish_reason) -> str:
        """The text of a request's tokens, without the stop or eos token that ended it (as vLLM)."""
        return self.tokenizer.decode(token_ids[:-1] if finish_reason == "stop" else token_ids)

    def _output(self, req: Request, with_text: bool = True) -> RequestOutput:
        """Per-step outputs are cheap (O(new tokens)): text is decoded only when asked for."""
        text = None
        if self.tokenizer is not None and with_text:
            text = self._text(req.output_token_ids, req.finish_reason)
        lp = req.sampling_params.logprobs is not None
        return RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            list(req.output_token_ids),
            list(req.exit_depths),
            text,
            req.is_finished,
            req.finish_reason,
            RequestMetrics(req.arrival_time, req.first_token_time, list(req.token_times), req.finish_time),
            list(req.output_logprobs) if lp else None,
            req.cumulative_logprob if lp else None,
            list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        )

    def stream(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
    ) -> Iterator[RequestOutput]:
        """Yield a ``RequestOutput`` each time one of the prompts gets tokens or finishes; ends once
        every one of them has finished. The prompts are checked now (an error here queues nothing)
        and queued when iteration starts; closing the iterator (``close()``, ``break`` out of a
        ``with contextlib.closing(...)``, or dropping it) aborts those still unfinished."""
        checked = self._check_all(prompts, sampling_params)
        return self._stream(checked)

    def _stream(self, checked) -> Iterator[RequestOutput]:
        with contextlib.closing(self._run(self._add_checked(checked))) as outs:
            for out in outs:
                if self.tokenizer is not None and out.text is None:
                    out.text = self._text(out.token_ids, out.finish_reason)
                yield out

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: Optional[bool] = None,
        n: int = 1,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``. Requests added
        with ``add_request`` keep running alongside; their outputs wait for the next ``step()``.
        Every prompt is checked before any is queued; an exception while running (``Ctrl-C``)
        aborts the prompts still unfinished.

        ``n``: choices per prompt, ``n`` outputs each in a row, choice ``j`` seeded ``seed + j``;
        they share the prompt's KV blocks (computed once: ``add_request``'s ``prompt_from``)."""
        if use_tqdm is not None and not isinstance(use_tqdm, bool):
            raise TypeError(f"use_tqdm must be a bool or None, got {_describe(use_tqdm)}")
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        ids = self._add_checked(self._check_all(prompts, sampling_params), n)
        final = {}
        bar = None
        if self.config.progress if use_tqdm is None else use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            with contextlib.closing(self._run(ids)) as outs:
                for out in outs:
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        for out in final.values():
            if self.tokenizer is not None and out.text is None:
                out.text = self._text(out.token_ids, out.finish_reason)
        return [final[i] for i in ids]

    def _run(self, ids: Sequence) -> Iterator[RequestOutput]:
        """The one loop of ``generate`` and ``stream``: step until every request of ``ids`` has
        finished, yielding their outputs as they come (others' wait for ``step()``). Left early
        (closed, or an exception), it abandons those of ``ids`` still unfinished."""
        left = set(ids)
        try:
            while left:
                outs = self._collect(left)
                if not outs and not self.scheduler.has_unfinished():
                    raise RuntimeError(f"requests {sorted(map(str, left))} were lost")  # the lifecycle rule broke
                for out in outs:
                    if out.finished:
                        left.discard(out.request_id)
                    yield out
        finally:
            if left:
                self._abandon(left)

    def _check_all(self, prompts, sampling_params) -> list:
        """``[(ids, params)]`` of every prompt of a ``generate`` / ``stream`` call, each checked as
        ``add_request`` would; the first bad one raises, naming its index among several."""
        self._check_open()
        prompts = prompt_list(prompts)
        sps = sampling_list(sampling_params, len(prompts))
        checked = []
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            try:
                checked.append((self.check_request(p, sp), sp))
            except (TypeError, ValueError) as e:
                if len(prompts) == 1:
                    raise
                raise type(e)(f"prompts[{i}]: {e}") from None
        return checked

    def _add_checked(self, checked, n: int = 1) -> list:
        """Queue checked ``(ids, params)``, ``n`` choices of each (``generate``)."""
        out = []
        for ids, sp in checked:
            first = self._add(ids, sp)
            out.append(first)
            for j in range(1, n):
                out.append(self._add(ids, choice_params(sp, j), prompt_from=first))
        return out

    # ---------------------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Counters of the run so far.

        ``host_time_s`` is the host's own scheduling work: ``schedule`` (which builds the descriptor)
        plus ``update``, less the time ``update`` spent waiting for device results
        (``device_wait_time_s``). ``dispatch_time_s`` is the time spent handing executables to the
        device; once the device is the bottleneck it includes waiting for the launch queue, so it is
        reported apart rather than counted as host work. Of it, ``upload_time_s`` went to the
        descriptors' transfers and ``call_time_s`` to the executables' calls.
        """
        s = self.scheduler.stats()
        r = self.runner
        host = s["host_time_s"] - r.wait_time
        inv = max(1, s["invocations"])
        return dict(
            s,
            recurrent_invocations=s["invocations"],
            recurrent_rows=s["real_rows"],
            host_time_per_launch_s=host / max(1, s["launches"]),
            compilations=r.compilations,
            sampler_launches=r.sampler_launches,
            spec_draft_time_s=r.spec_draft_time,
            spec_verify_time_s=r.spec_verify_time,
            store_loads=r.store_loads,
            compile_time_s=r.compile_time,
            warmup_time_s=self.warmup_time,
            host_time_s=host,
            host_time_per_invocation_s=host / inv,
            device_wait_time_s=r.wait_time,
            dispatch_time_s=r.dispatch_time,
            dispatch_time_per_invocation_s=r.dispatch_time / inv,
            upload_time_s=r.upload_time,
            call_time_s=r.call_time,
            kv_blocks=self.scheduler_config.num_blocks,
            kv_cache_bytes=r.kv_bytes,
            num_buckets=len(self.scheduler.bucket_spec.keys()),
        )
