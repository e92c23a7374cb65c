"""What a run measured, and the floor of the schedule it actually ran.

``ScheduleRecorder`` watches every descriptor an engine executes (rows, segments, contexts, coda and
finalize counts: a few microseconds per invocation) and prices it with the model of
``benchmarks/floors.py``: a recurrent invocation reads every layer weight once whatever its rows;
each segment reads the K/V of its whole context at its plane once per layer; an invocation with coda
rows reads the lm_head once; real rows cost the matmul FLOPs, query-key pairs the attention FLOPs.
Summed over the run (padding excluded, exit depths as they were run), ``floor = max(bytes /
bandwidth, FLOPs / peak)`` with the ceilings measured in the same run, exactly the convention of
``floors.prefill_floor`` / ``decode_step_floor`` (a pure prefill schedule gives the same number).

``latency`` turns request outputs into TTFT / ITL / TPOT / E2E percentiles and CDFs.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

import numpy as np

from benchmarks.floors import shape as model_shape

__all__ = [
    "InvocationCost",
    "invocation_cost",
    "ScheduleRecorder",
    "floor_of",
    "latency",
    "percentiles",
    "exit_histogram",
    "PCTS",
]

PCTS = (50, 90, 99)


@dataclasses.dataclass
class InvocationCost:
    invocations: int = 0
    rows: int = 0
    bucket_rows: int = 0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    head_bytes: float = 0.0
    finalize_bytes: float = 0.0
    flops: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.head_bytes + self.finalize_bytes

    def add(self, o: "InvocationCost") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(o, f.name))


def invocation_cost(
    s: dict, nrows: int, ncoda: int, nfin: int, q_len: np.ndarray, ctx_len: np.ndarray, bucket_rows: int = 0
) -> InvocationCost:
    """Bytes and FLOPs one invocation cannot avoid (``s = floors.shape(config)``)."""
    q = np.asarray(q_len, np.float64)
    ctx = np.asarray(ctx_len, np.float64)
    pairs = float((q * (ctx - (q - 1) / 2)).sum())  # causal query-key pairs of every segment
    return InvocationCost(
        invocations=1,
        rows=nrows,
        bucket_rows=bucket_rows,
        weight_bytes=s["layer_bytes"] if nrows else 0.0,
        kv_bytes=float(ctx.sum()) * s["kv_bytes_per_token_plane"],
        head_bytes=s["head_bytes"] if ncoda else 0.0,
        finalize_bytes=2.0 * nfin * s["kv_bytes_per_token_plane"],  # read + write of each copied slot
        flops=nrows * s["layer_flops_per_row"]
        + pairs * s["attn_flops_per_query_key"]
        + ncoda * s["head_flops_per_row"],
    )


def floor_of(cost: InvocationCost, bandwidth: float, peak_flops: float) -> dict:
    tb, tf = cost.bytes / bandwidth, cost.flops / peak_flops
    return dict(
        floor_s=max(tb, tf),
        bound="bandwidth" if tb >= tf else "flops",
        bytes=cost.bytes,
        flops=cost.flops,
        bandwidth_s=tb,
        flops_s=tf,
        invocations=cost.invocations,
        rows=cost.rows,
        weight_bytes=cost.weight_bytes,
        kv_bytes=cost.kv_bytes,
        head_bytes=cost.head_bytes,
        finalize_bytes=cost.finalize_bytes,
        bandwidth=bandwidth,
        peak_flops=peak_flops,
        basis="schedule as run: weights once per invocation, KV of each segment's context, "
        "real rows only, exit depths as run",
    )


class ScheduleRecorder:
    """Wraps ``runner.step`` (or is fed descriptors by hand) and prices every invocation.

    ``observe`` only copies the few numbers it needs (about a microsecond, inside the timed loop);
    the pricing happens when ``costs`` is first read."""

    def __init__(self, config, dtype_bytes: int = 2):
        self.shape = model_shape(config, dtype_bytes)
        self.enabled = True
        self.reset()

    def reset(self) -> None:
        self._raw: list = []  # per launch: a tuple of numbers, or a fused step's StackedDescriptor
        self._costs: list[InvocationCost] = []
        self._priced = 0  # launches of _raw already in _costs

    def observe(self, desc) -> None:
        if not self.enabled:
            return
        if hasattr(desc, "steps"):  # a fused decode step: priced once its loops are known (``costs``)
            self._raw.append(desc)
            return
        self._raw.append(self._numbers(desc))

    @staticmethod
    def _numbers(desc, num_coda: Optional[int] = None) -> tuple:
        nseg = desc.num_segments
        return (
            desc.num_rows,
            desc.num_coda if num_coda is None else num_coda,
            desc.num_finalize,
            desc.seg_q_len[:nseg].copy(),
            desc.seg_ctx_len[:nseg].copy(),
            desc.key.R,
        )

    def _expand(self, raw) -> list[tuple]:
        """A fused step's loops that ran (``StackedDescriptor.loops_run``, set by the scheduler's
        ``update``; all of them before that), the coda priced with each token's last loop."""
        if isinstance(raw, tuple):
            return [raw]
        T, out = raw.num_loops, []
        runs = raw.loops_run or [T] * raw.num_tokens
        for j, ran in enumerate(runs):
            coda = raw.steps[j * T + T - 1].num_coda
            out.extend(self._numbers(raw.steps[j * T + d], coda if d == ran - 1 else 0) for d in range(ran))
        return out

    def attach(self, runner) -> "ScheduleRecorder":
        """Record every descriptor ``runner.step`` runs (an instance attribute shadows the method)."""
        step = runner.step

        def recorded(desc):
            self.observe(desc)
            return step(desc)

        runner.step = recorded
        return self

    @property
    def costs(self) -> list[InvocationCost]:
        """One cost per loop's invocation (a fused step gives one per loop it ran)."""
        if self._priced < len(self._raw):
            for raw in self._raw[self._priced :]:
                for nrows, ncoda, nfin, q, ctx, r in self._expand(raw):
                    self._costs.append(invocation_cost(self.shape, nrows, ncoda, nfin, q, ctx, r))
            self._priced = len(self._raw)
        return self._costs

    def total(self, upto: Optional[int] = None) -> InvocationCost:
        out = InvocationCost()
        for c in self.costs[:upto]:
            out.add(c)
        return out

    def __len__(self) -> int:
        return len(self.costs)


# ------------------------------------------------------------------------------------- latency
def percentiles(xs: Sequence[float]) -> Optional[dict]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    a = np.asarray(xs, np.float64)
    out = {f"p{p}": float(np.percentile(a, p)) for p in PCTS}
    out.update(mean=float(a.mean()), max=float(a.max()), n=int(a.size))
    return out


def _cdf(xs: Sequence[float]) -> Optional[list]:
    xs = [x for x in xs if x is not None]
    return None if not xs else [float(v) for v in np.percentile(np.asarray(xs, np.float64), np.arange(101))]


def latency(outputs: Iterable) -> dict:
    """TTFT / ITL / TPOT / E2E percentiles (seconds) and 101-point quantile curves (for CDF plots)."""
    ttft, tpot, e2e, itl = [], [], [], []
    for o in outputs:
        m = o.metrics
        ttft.append(m.ttft)
        tpot.append(m.tpot)
        e2e.append(m.e2e)
        itl.extend(float(x) for x in m.itl)
    return dict(
        ttft=percentiles(ttft),
        itl=percentiles(itl),
        tpot=percentiles(tpot),
        e2e=percentiles(e2e),
        cdf=dict(ttft=_cdf(ttft), itl=_cdf(itl), tpot=_cdf(tpot), e2e=_cdf(e2e)),
    )


def interval_union(intervals: list) -> tuple[float, float]:
    """(union length, span) of ``[(start, end)]``: how long at least one interval is open, and
    from the first start to the last end."""
    if not intervals:
        return 0.0, 0.0
    iv = sorted(intervals)
    total, cur_s, cur_e = 0.0, iv[0][0], iv[0][1]
    for s, e in iv[1:]:
        if s > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    total += cur_e - cur_s
    return total, max(e for _, e in iv) - iv[0][0]


def mean_decoding_streams(outputs: Iterable) -> Optional[float]:
    """Time-averaged number of streams between their first and last token, over the span in which
    any stream is in that phase. When requests arrive together and finish prefill at different
    times (mixed32, mixed128), this is the batch a decode step really holds on average; pricing
    the TPOT floor at every request decoding at once instead gives a "floor" above what a stream
    measures. ``None`` when no stream produced two tokens."""
    spans = [(o.metrics.token_times[0], o.metrics.token_times[-1]) for o in outputs if len(o.metrics.token_times) > 1]
    spans = [(a, b) for a, b in spans if b > a]
    if not spans:
        return None
    # over the union of the spans, so that a gap in which no stream decodes does not dilute it
    return sum(b - a for a, b in spans) / interval_union(spans)[0]


def exit_histogram(outputs: Iterable, num_loops: int) -> dict:
    """Exit depths of generated tokens after the first (the first always comes from loop T-1)."""
    counts = np.zeros(num_loops, np.int64)
    for o in outputs:
        d = np.asarray(o.exit_depths[1:], np.int64)
        if d.size:
            counts += np.bincount(d, minlength=num_loops)[:num_loops]
    n = int(counts.sum())
    mean_loops = float((counts * np.arange(1, num_loops + 1)).sum() / n) if n else float(num_loops)
    return dict(counts=counts.tolist(), tokens=n, mean_loops=mean_loops)
