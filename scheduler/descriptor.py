"""BatchDescriptor: one invocation in the runner's words, numpy arrays padded to a bucket.

The arrays and their meaning are those of docs/contracts.md ("One invocation"). All of them live
in ONE contiguous int32 buffer with a static layout per bucket key (float32 and uint32 fields are
bit-views of their int32 words), because every host->device upload costs ~45 us on the H200: the
runner uploads ``pack()`` once and slices it with the offsets of :func:`descriptor_layout`
(``lax.bitcast_convert_type`` for the float32 / uint32 fields).

Layout, in order (``R, S, C, F, MB`` from the key, ``P = R``)::

    header[8]              num_rows, num_segments, num_prelude, num_coda, num_finalize,
                           feed_previous_tokens, coda_extras, 0        (HEADER names them)
    row_ring[R]  row_pos[R]  row_slot[R]                      (padding: 0, 0, -1)
    seg_q_start[S]  seg_q_len[S]  seg_ctx_len[S]  seg_block_table[S*MB]   (padding: q_len 0)
    pre_ring[R]  pre_token[R]                                 (padding: ring row 0, token 0)
    coda_row[C]  coda_temperature[C] f32  coda_top_k[C]  coda_top_p[C] f32
    coda_seed[C] u32  coda_step[C]                            (padding: row 0, greedy)
    fin_src[F]  fin_dst[F]                                    (padding: -1)

``feed_previous_tokens`` (0 or 1) is set only inside a fused decode step (``StackedDescriptor``):
prelude entry ``i`` then embeds the token that the previous token's coda row ``i`` sampled on
the device, instead of ``pre_token[i]``, so several tokens run without a host round trip.
``coda_extras`` (0 or 1, on a fused step's coda sub-steps): a coda row's request asks for logprobs
or a grammar mask; the fused step pays for those only then.

Rows are laid out segment after segment (``seg_q_start`` ascending, no gaps); real rows come first,
then padding rows, which read and write the scratch ring row 0 and write no KV slot.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, NamedTuple, Optional

import numpy as np

from .buckets import BucketKey, BucketSpec
from .sampling_params import LOGPROB_WORDS
from .sizes import descriptor_rows

__all__ = [
    "BatchDescriptor",
    "StackedDescriptor",
    "EXIT_FIELDS",
    "exit_words",
    "split_fused_output",
    "StepResult",
    "FieldSpec",
    "HEADER",
    "descriptor_layout",
    "build_descriptor",
    "build_decode_loops",
]

#: The header's words, in order: the descriptor's real sizes and its flag, so that the packed
#: buffer is self-contained. The header field has ``HEADER_WORDS`` words; the rest are 0.
HEADER = (
    "num_rows",
    "num_segments",
    "num_prelude",
    "num_coda",
    "num_finalize",
    "feed_previous_tokens",
    "coda_extras",
)
HEADER_WORDS = 8


class FieldSpec(NamedTuple):
    name: str
    dtype: type
    shape: tuple
    offset: int  # in int32 words
    size: int


_FIELDS = (
    # name, dtype, shape as a function of the key, padding value
    ("header", np.int32, lambda k: (HEADER_WORDS,), 0),
    ("row_ring", np.int32, lambda k: (k.R,), 0),
    ("row_pos", np.int32, lambda k: (k.R,), 0),
    ("row_slot", np.int32, lambda k: (k.R,), -1),
    ("seg_q_start", np.int32, lambda k: (k.S,), 0),
    ("seg_q_len", np.int32, lambda k: (k.S,), 0),
    ("seg_ctx_len", np.int32, lambda k: (k.S,), 0),
    ("seg_block_table", np.int32, lambda k: (k.S, k.MB), 0),
    ("pre_ring", np.int32, lambda k: (k.R,), 0),
    ("pre_token", np.int32, lambda k: (k.R,), 0),
    ("coda_row", np.int32, lambda k: (k.C,), 0),
    ("coda_temperature", np.float32, lambda k: (k.C,), 0.0),
    ("coda_top_k", np.int32, lambda k: (k.C,), 0),
    ("coda_top_p", np.float32, lambda k: (k.C,), 1.0),
    ("coda_seed", np.uint32, lambda k: (k.C,), 0),
    ("coda_step", np.int32, lambda k: (k.C,), 0),
    ("fin_src", np.int32, lambda k: (k.F,), -1),
    ("fin_dst", np.int32, lambda k: (k.F,), -1),
)

ARRAY_NAMES = tuple(f[0] for f in _FIELDS[1:])


@functools.lru_cache(maxsize=None)
def descriptor_layout(key: BucketKey) -> tuple[FieldSpec, ...]:
    """The static layout of the packed buffer for ``key`` (offsets in int32 words)."""
    out, off = [], 0
    for name, dtype, shape_fn, _ in _FIELDS:
        shape = tuple(shape_fn(key))
        size = int(np.prod(shape))
        out.append(FieldSpec(name, dtype, shape, off, size))
        off += size
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _padding_template(key: BucketKey) -> np.ndarray:
    buf = np.zeros(sum(f.size for f in descriptor_layout(key)), np.int32)
    for spec, (_, _, _, pad) in zip(descriptor_layout(key), _FIELDS):
        buf[spec.offset : spec.offset + spec.size].view(spec.dtype)[:] = pad
    buf.flags.writeable = False
    return buf


def _header_word(name: str, cast=int) -> property:
    i = HEADER.index(name)
    return property(lambda self: cast(self.header[i]), doc=f"header word {i}")


@functools.lru_cache(maxsize=None)
def _fields_by_name(key: BucketKey) -> dict[str, FieldSpec]:
    return {f.name: f for f in descriptor_layout(key)}


class BatchDescriptor:
    """Named views into one packed int32 buffer (see the module docstring). A field's view is made
    on first access: a fused decode step builds ``T`` descriptors per token on the host's critical
    path, and most of them touch a few fields."""

    def __init__(self, key: BucketKey, packed: np.ndarray | None = None):
        self.key = key
        if packed is None:
            packed = _padding_template(key).copy()
        elif packed.dtype != np.int32 or packed.ndim != 1:
            raise ValueError("BatchDescriptor: packed buffer must be a flat int32 array")
        layout = descriptor_layout(key)
        if packed.shape[0] != layout[-1].offset + layout[-1].size:
            raise ValueError(
                f"BatchDescriptor: packed buffer has {packed.shape[0]} words, "
                f"key {tuple(key)} needs {layout[-1].offset + layout[-1].size}"
            )
        self._buf = packed
        self._fields = _fields_by_name(key)

    def __getattr__(self, name: str):
        # only reached when ``name`` is not an attribute yet: a field's first access
        fields = self.__dict__.get("_fields")
        if fields is None or name not in fields:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        spec = fields[name]
        view = self._buf[spec.offset : spec.offset + spec.size].view(spec.dtype).reshape(spec.shape)
        self.__dict__[name] = view
        return view

    num_rows = _header_word("num_rows")
    num_segments = _header_word("num_segments")
    num_prelude = _header_word("num_prelude")
    num_coda = _header_word("num_coda")
    num_finalize = _header_word("num_finalize")
    feed_previous_tokens = _header_word("feed_previous_tokens", bool)
    coda_extras = _header_word("coda_extras", bool)

    def set_header(self, **words) -> None:
        """Write header words by name (``HEADER``)."""
        for name, value in words.items():
            self.header[HEADER.index(name)] = int(value)

    def pack(self) -> np.ndarray:
        """The one int32 array to upload (no copy: the fields are views of it)."""
        return self._buf

    @classmethod
    def unpack(cls, key: BucketKey, packed: np.ndarray) -> "BatchDescriptor":
        return cls(key, np.array(packed, dtype=np.int32, copy=True))

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in ARRAY_NAMES}

    def __repr__(self) -> str:
        return (
            f"BatchDescriptor(key={tuple(self.key)}, rows={self.num_rows}, segments={self.num_segments}, "
            f"prelude={self.num_prelude}, coda={self.num_coda}, finalize={self.num_finalize})"
        )


#: Per-row exit words of every token of a fused decode step (``[R]`` each, after the sub-step's
#: descriptor words): ``scheduler.exit_policy.device_exit_params``; the threshold is float32 bits.
EXIT_FIELDS = ("exit_limit", "exit_min_loops", "exit_delay", "exit_threshold")


def exit_words(key: BucketKey) -> int:
    """Int32 words a fused step's sub-step row carries after its descriptor: the exit words."""
    return len(EXIT_FIELDS) * key.R


def split_fused_output(out: np.ndarray, key: BucketKey) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """A fused step's int32 result ``[..., C + R + C * LOGPROB_WORDS]`` -> ``(tokens [..., C], exit
    depths [..., R], logprob records [..., C, LOGPROB_WORDS])``; the records are None where the
    result holds none (a runner without them: ``FakeRunner``)."""
    out = np.asarray(out)
    end = key.C + key.R
    records = None
    if out.shape[-1] >= end + key.C * LOGPROB_WORDS:
        records = out[..., end : end + key.C * LOGPROB_WORDS].reshape(*out.shape[:-1], key.C, LOGPROB_WORDS)
    return out[..., : key.C], out[..., key.C : end], records


class StackedDescriptor:
    """A fused decode step: ``tokens`` tokens of the same decode rows, every row's exit decided on
    the device (``docs/decisions.md``, "Fused decode steps").

    ``steps``: ``tokens * num_loops`` descriptors of one key; sub-step ``j * T + d`` is loop ``d`` of
    token ``j``, exactly the descriptor the loop-by-loop path builds for every row at that loop
    (slots of plane ``d``; coda fields only at ``d = T - 1``; finalize copies pending from before
    only in sub-step 0; ``feed_previous_tokens`` at ``d = 0, j > 0``). ``exits``: the exit words of
    each token, 4 arrays ``[tokens, rows]`` in ``EXIT_FIELDS`` order (padded to ``R`` here).

    ``pack()`` is ``[n, words + exit_words]`` int32: each sub-step's descriptor, then its token's
    exit words (an exit limit of 0 for padding rows).

    The device runs, per token, loops ``0, 1, ...`` of every row in lock step until every row has
    exited (``exit_rule.decide_exit_rows``), a row that exited writing no K/V and keeping its exit
    hidden state; then LAST_EXITED finalize copies (exit plane -> planes above) and one coda of the
    exit states (``ouro_jax/fused_step.py``). It returns ``gates [n, R]`` (0
    for loops not run) and one int32 ``[tokens, C + R]``: sampled tokens and exit depths
    (``split_fused_output``; padding rows' entries are never read); the scheduler's
    ``update`` records the loops that ran in ``loops_run``.
    """

    def __init__(self, steps: list[BatchDescriptor], num_loops: int, exits: tuple):
        if not steps or any(d.key != steps[0].key for d in steps):
            raise ValueError("StackedDescriptor: needs one or more descriptors of one key")
        if num_loops < 1 or len(steps) % num_loops:
            raise ValueError(f"StackedDescriptor: {len(steps)} sub-steps are not whole tokens of {num_loops} loops")
        self.key = steps[0].key
        self.steps = steps
        self.n = len(steps)
        self.num_loops = num_loops
        self.num_tokens = self.n // num_loops
        if len(exits) != len(EXIT_FIELDS):
            raise ValueError(f"StackedDescriptor: exits must hold {len(EXIT_FIELDS)} arrays ({EXIT_FIELDS})")
        R = self.key.R
        buf = np.zeros((self.num_tokens, len(EXIT_FIELDS), R), np.int32)
        buf[:, 0] = num_loops  # padding rows: forced out after every loop (they start exited anyway)
        buf[:, 3].view(np.float32)[:] = 1.0
        for i, (name, arr) in enumerate(zip(EXIT_FIELDS, exits)):
            arr = np.asarray(arr, np.float32 if name == "exit_threshold" else np.int64)
            if arr.ndim != 2 or arr.shape[0] != self.num_tokens or arr.shape[1] > R:
                raise ValueError(
                    f"StackedDescriptor: {name} must be [tokens={self.num_tokens}, rows <= {R}], got {arr.shape}"
                )
            if name == "exit_threshold":
                buf[:, i, : arr.shape[1]].view(np.float32)[:] = arr
            else:
                buf[:, i, : arr.shape[1]] = arr
        self._exits = buf
        self.loops_run: Optional[list[int]] = None  # per token, set by the scheduler's update
        for i, name in enumerate(EXIT_FIELDS):
            view = buf[:, i]
            setattr(self, name, view.view(np.float32) if name == "exit_threshold" else view)

    def pack(self) -> np.ndarray:
        body = np.stack([d.pack() for d in self.steps])
        tail = np.repeat(self._exits.reshape(self.num_tokens, -1), self.num_loops, axis=0)
        return np.concatenate([body, tail], axis=1)

    def __repr__(self) -> str:
        return f"StackedDescriptor(key={tuple(self.key)}, n={self.n}, tokens={self.num_tokens})"


class StepResult:
    """What a runner's ``step(descriptor)`` returns (``ModelRunner`` and ``FakeRunner`` alike).

    ``gates()``: ``[R]`` float32 gate logits (``[n, R]`` for a fused step); ``tokens()``: ``[C]``
    int32 sampled tokens (a fused step: ``[tokens, C + R + C * LOGPROB_WORDS]``, tokens, exit
    depths and logprob records, ``split_fused_output``); ``logprobs``: None, or a callable giving
    a one-loop step's ``[C, LOGPROB_WORDS]`` records when it computed them. Each is converted (and,
    on a device, waited for) only when first called, so the scheduler reads only what a decision
    needs; ``on_wait(seconds)`` is told how long each conversion took.
    """

    __slots__ = ("_src", "_host", "_on_wait", "logprobs", "deferred")

    def __init__(self, gates, tokens, on_wait: Optional[Callable[[float], None]] = None, logprobs=None):
        self._src = {"gates": gates}
        if tokens is not None:  # None: a deferred coda's, given later (set_tokens)
            self._src["tokens"] = tokens
        self._host: dict[str, np.ndarray] = {}
        self._on_wait = on_wait
        self.logprobs = None
        self.deferred = None  # the runner's state of a coda it has not sampled yet
        if logprobs is not None:
            self._src["logprobs"] = logprobs
            self.logprobs = lambda: self._read("logprobs")

    def set_tokens(self, tokens) -> None:
        """The tokens of a step whose coda was sampled after its launch (anything ``np.asarray`` reads)."""
        self._src["tokens"] = tokens

    def _read(self, name: str) -> np.ndarray:
        if name not in self._host:
            t = time.perf_counter()
            self._host[name] = np.asarray(self._src.pop(name))
            if self._on_wait is not None:
                self._on_wait(time.perf_counter() - t)
        return self._host[name]

    def gates(self) -> np.ndarray:
        return self._read("gates")

    def tokens(self) -> np.ndarray:
        return self._read("tokens")

    def wait(self) -> None:
        """Read whatever is still unread: a device copy to the host must not still be in flight
        when the interpreter exits (its completion takes the GIL: ``LLM.close``)."""
        for name in list(self._src):
            self._read(name)


def _fitting_key(spec: BucketSpec, key: BucketKey | None, need: int, ncoda: int, nfin: int) -> BucketKey:
    """``key``, or the smallest bucket of ``need`` rows when None; ``ValueError`` if it cannot hold
    ``need`` rows / prelude / coda entries, ``ncoda`` coda rows or ``nfin`` finalize pairs."""
    if key is None:
        key = spec.key_for(need)
    elif need > key.R:
        raise ValueError(f"build_descriptor: {need} rows / prelude / coda entries exceed key {tuple(key)}")
    if ncoda > key.C or nfin > key.F:
        raise ValueError(f"build_descriptor: {ncoda} coda rows / {nfin} finalize pairs exceed key {tuple(key)}")
    return key


def build_descriptor(
    spec: BucketSpec,
    tables: np.ndarray,
    *,
    seg_slot,
    seg_plane,
    seg_pos,
    seg_len,
    seg_ring,
    pre_ring,
    pre_token,
    coda_row,
    coda_temperature,
    coda_top_k,
    coda_top_p,
    coda_seed,
    coda_step,
    fin_src,
    fin_dst,
    key: BucketKey | None = None,
    feed_previous_tokens: bool = False,
) -> BatchDescriptor:
    """Lay out segments row after row and pad everything to the smallest fitting bucket.

    ``tables[batch_slot, plane, :MB]`` holds every request's block tables (``KVBlockManager.tables``,
    read in place). Segment ``s`` covers
    positions ``seg_pos[s] .. seg_pos[s] + seg_len[s] - 1`` of the request in ``seg_slot[s]`` at
    plane ``seg_plane[s]``; its rows read/write ring rows ``seg_ring[s] + i`` (contiguous).
    ``key`` forces a bucket (the sub-steps of a fused decode step share one); it must fit.
    """
    seg_slot = np.asarray(seg_slot, np.int64)
    seg_plane = np.asarray(seg_plane, np.int64)
    seg_pos = np.asarray(seg_pos, np.int64)
    seg_len = np.asarray(seg_len, np.int64)
    seg_ring = np.asarray(seg_ring, np.int64)
    nseg = seg_len.shape[0]
    nrows = int(seg_len.sum())
    npre, ncoda, nfin = len(pre_ring), len(coda_row), len(fin_src)
    key = _fitting_key(spec, key, descriptor_rows(nrows, npre, ncoda, nfin, spec.num_loops), ncoda, nfin)
    d = BatchDescriptor(key)
    d.set_header(
        num_rows=nrows,
        num_segments=nseg,
        num_prelude=npre,
        num_coda=ncoda,
        num_finalize=nfin,
        feed_previous_tokens=bool(feed_previous_tokens),
    )
    if nseg:
        q_start = np.zeros(nseg, np.int64)
        np.cumsum(seg_len[:-1], out=q_start[1:])
        within = np.arange(nrows, dtype=np.int64) - np.repeat(q_start, seg_len)
        pos = np.repeat(seg_pos, seg_len) + within
        bs = spec.block_size
        blocks = tables[np.repeat(seg_slot, seg_len), np.repeat(seg_plane, seg_len), pos // bs]
        d.row_pos[:nrows] = pos
        d.row_ring[:nrows] = np.repeat(seg_ring, seg_len) + within
        d.row_slot[:nrows] = blocks.astype(np.int64) * bs + pos % bs
        d.seg_q_start[:nseg] = q_start
        d.seg_q_len[:nseg] = seg_len
        d.seg_ctx_len[:nseg] = seg_pos + seg_len
        d.seg_block_table[:nseg] = tables[seg_slot, seg_plane]
    if npre:
        d.pre_ring[:npre] = pre_ring
        d.pre_token[:npre] = pre_token
    if ncoda:
        d.coda_row[:ncoda] = coda_row
        d.coda_temperature[:ncoda] = coda_temperature
        d.coda_top_k[:ncoda] = coda_top_k
        d.coda_top_p[:ncoda] = coda_top_p
        d.coda_seed[:ncoda] = coda_seed
        d.coda_step[:ncoda] = coda_step
    if nfin:
        d.fin_src[:nfin] = fin_src
        d.fin_dst[:nfin] = fin_dst
    return d


def build_decode_loops(
    spec: BucketSpec,
    tables: np.ndarray,
    *,
    seg_slot,
    planes,
    seg_pos,
    seg_ring,
    pre_token,
    coda: Optional[dict],
    fin_src,
    fin_dst,
    feed_previous_tokens: bool = False,
    coda_extras: bool = False,
    key: BucketKey | None = None,
) -> list[BatchDescriptor]:
    """The descriptors of one decode token of ``n`` rows at loops ``0 .. len(planes) - 1``: each
    exactly what ``build_descriptor`` gives for that loop (tests/scheduler/test_descriptor.py checks), built
    from one shared layout instead of one general call a loop (the host builds them on a fused
    decode step's critical path).

    Row ``i`` is request slot ``seg_slot[i]`` at position ``seg_pos[i]``, ring row ``seg_ring[i]``;
    loop ``d`` reads plane ``planes[d]``. Loop 0 embeds ``pre_token`` (and carries the finalize
    pairs and ``feed_previous_tokens``); the last loop carries the coda (``coda``: the six
    ``coda_*`` arrays of ``build_descriptor`` by name, without the prefix, for rows ``0 .. n-1``;
    None: no coda) and ``coda_extras``. ``key``: as ``build_descriptor`` (None: the smallest
    bucket fitting loop 0)."""
    seg_slot = np.asarray(seg_slot, np.int64)
    seg_pos = np.asarray(seg_pos, np.int64)
    seg_ring = np.asarray(seg_ring, np.int64)
    n, nfin, T = seg_slot.shape[0], len(fin_src), len(planes)
    ncoda = n if coda is not None else 0
    # loop 0 holds the prelude and the finalize pairs, the last loop the coda: the key fits both
    key = _fitting_key(spec, key, descriptor_rows(n, n, ncoda if T == 1 else 0, nfin, spec.num_loops), 0, nfin)
    key = _fitting_key(spec, key, descriptor_rows(n, 0, ncoda, 0, spec.num_loops), ncoda, 0)
    base = BatchDescriptor(key)
    base.set_header(num_rows=n, num_segments=n)
    base.row_pos[:n] = seg_pos
    base.row_ring[:n] = seg_ring
    base.seg_q_start[:n] = np.arange(n)
    base.seg_q_len[:n] = 1
    base.seg_ctx_len[:n] = seg_pos + 1
    bs = spec.block_size
    page, offset = seg_pos // bs, seg_pos % bs
    out = []
    for d, plane in enumerate(planes):
        desc = BatchDescriptor(key, base.pack().copy())
        desc.row_slot[:n] = tables[seg_slot, plane, page].astype(np.int64) * bs + offset
        desc.seg_block_table[:n] = tables[seg_slot, plane]
        if d == 0:
            desc.set_header(num_prelude=n, num_finalize=nfin, feed_previous_tokens=bool(feed_previous_tokens))
            desc.pre_ring[:n] = seg_ring
            desc.pre_token[:n] = pre_token
            if nfin:
                desc.fin_src[:nfin] = fin_src
                desc.fin_dst[:nfin] = fin_dst
        if d == T - 1 and ncoda:
            desc.set_header(num_coda=ncoda, coda_extras=bool(coda_extras))
            for name, values in coda.items():
                getattr(desc, f"coda_{name}")[:ncoda] = values
        out.append(desc)
    return out
