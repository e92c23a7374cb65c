"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (several servers, e.g. in tests,
can live in one process without clashing in the global registry).

With data-parallel replicas there is still one ``/metrics``: request counters and latency histograms
are the HTTP front's (what clients saw, over every replica, no replica label); the engine-state
gauges (running, waiting, KV usage) carry a ``replica`` label, one series per replica (``"0"`` with
one engine; ``sum without (replica)`` for the server's total); ``ouro_routed_requests_total``
counts routing decisions per ``replica`` and ``reason`` (``prefix`` / ``least_loaded``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lbl = dict(labelnames=("model_name",), registry=r)
        self.requests = Counter(
            "ouro_requests", "Requests answered, by final status", labelnames=("model_name", "status"), registry=r
        )
        self.prompt_tokens = Counter("ouro_prompt_tokens", "Prompt tokens of admitted requests", **lbl)
        self.generation_tokens = Counter("ouro_generation_tokens", "Tokens generated", **lbl)
        self.generation_loops = Counter("ouro_generation_loops", "Recurrent loops run for generated tokens", **lbl)
        self.ttft = Histogram(
            "ouro_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, **lbl
        )
        self.tpot = Histogram(
            "ouro_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=_TPOT_BUCKETS,
            **lbl,
        )
        self.e2e = Histogram("ouro_e2e_request_latency_seconds", "Request latency", buckets=_LATENCY_BUCKETS, **lbl)
        rep = dict(labelnames=("model_name", "replica"), registry=r)
        self.running = Gauge("ouro_num_requests_running", "Requests the engine is running", **rep)
        self.waiting = Gauge("ouro_num_requests_waiting", "Requests queued in the engine or the server", **rep)
        self.kv_usage = Gauge("ouro_kv_cache_usage_ratio", "Share of KV blocks in use (0..1)", **rep)
        self.routed = Counter(
            "ouro_routed_requests",
            "Engine requests routed to a data-parallel replica, by reason (prefix / least_loaded)",
            labelnames=("model_name", "replica", "reason"),
            registry=r,
        )
        # self-speculative decoding (engine stats, totals since start; zero when it is off)
        self.spec_acceptance = Gauge(
            "ouro_spec_acceptance_ratio", "Self-speculative drafts accepted, of those proposed (0..1)", **rep
        )
        self.spec_length = Gauge(
            "ouro_spec_mean_accepted_length", "Tokens a request got per self-speculative round (1..k+1)", **rep
        )
        self.spec_rounds = Gauge("ouro_spec_request_rounds", "Self-speculative rounds, counted once per request", **rep)
        self.spec_draft_s = Gauge("ouro_spec_draft_seconds", "Device seconds of the rounds' drafts", **rep)
        self.spec_verify_s = Gauge("ouro_spec_verify_seconds", "Device seconds of the rounds' verifies", **rep)
        self.mean_loops = Gauge("ouro_mean_loops_per_token", "Mean loops per generated token so far", **lbl)
        self.model_name = model_name
        self._loops = 0
        self._tokens = 0

    def request_done(self, status: str, prompt_tokens: int, exit_depths, ttft, tpot, e2e) -> None:
        m = self.model_name
        self.requests.labels(m, status).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        n, loops = len(exit_depths), sum(d + 1 for d in exit_depths)
        self.generation_tokens.labels(m).inc(n)
        self.generation_loops.labels(m).inc(loops)
        self._tokens += n
        self._loops += loops
        if self._tokens:
            self.mean_loops.labels(m).set(self._loops / self._tokens)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        if tpot is not None:
            self.tpot.labels(m).observe(tpot)
        if e2e is not None:
            self.e2e.labels(m).observe(e2e)

    def request_rejected(self, status: int) -> None:
        self.requests.labels(self.model_name, str(status)).inc()

    def engine_state(self, state: dict, replica: int = 0) -> None:
        """An engine loop's published ``state`` (``EngineLoop._publish_state``)."""
        m, r = self.model_name, str(replica)
        self.running.labels(m, r).set(state["running"])
        self.waiting.labels(m, r).set(state["waiting"])
        self.kv_usage.labels(m, r).set(state["kv_usage"])
        if "spec_row_rounds" in state:
            self.spec_acceptance.labels(m, r).set(state["spec_acceptance"])
            self.spec_length.labels(m, r).set(state["spec_mean_accepted_length"])
            self.spec_rounds.labels(m, r).set(state["spec_row_rounds"])
            self.spec_draft_s.labels(m, r).set(state["spec_draft_time_s"])
            self.spec_verify_s.labels(m, r).set(state["spec_verify_time_s"])

    def request_routed(self, replica: int, reason: str) -> None:
        self.routed.labels(self.model_name, str(replica), reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
