"""Soak test: a bounded mixed load against a real ``ouro-jax serve`` on loopback, then its drain.

``--concurrency`` clients loop for ``--duration-s``, each picking at random: a streaming completion
or chat request (random prompt and max_tokens, ``ignore_eos``: it must end with every token,
finish_reason ``length`` and ``[DONE]``), a stream it drops after k tokens, a non-streaming request
(or one it gives up on after a moment), or a bad request (malformed JSON, a wrong type, an unknown
model, ... : a 4xx). Every ``--burst-every-s`` a burst of more requests than the server's queue
holds arrives at once (some must be answered 429 with ``Retry-After``; a client waits that long,
jittered, before its next action).
Expected 4xx / 429 are counted by kind, not as errors; an error is a 5xx, a client exception, a 2xx
to a request that must be refused, or a response that breaks its contract (a missing token, no
``[DONE]``, a 429 without ``Retry-After``).

After the load (and the requests in flight) end: ``/metrics`` must show nothing running or waiting
and no KV block in use. The server process's RSS and thread count (``/proc/<pid>/status``) are
sampled every ``--sample-every-s`` and must be flat over the load's last minute (``--flat-window-s``;
growth at most ``--rss-growth-bound-mb`` / ``--thread-growth-bound``). Last, the drain:
``--drain-streams`` streams in flight, SIGTERM, then a new request and ``/health`` must get 503 while
the streams finish whole, and the process must exit 0.

    python -m benchmarks.soak --model tiny --duration-s 20 --concurrency 16 --out /tmp/soak   # CPU
    python -m benchmarks.soak --duration-s 240 --concurrency 64                           # H200, ouro-1.4b

Writes ``<out>/soak.json`` (``benchmarks/results/`` by default; ``--append`` merges into an
existing one, a record per label) and the server's log to ``<out>/logs/soak_server.log``; exits 1
when a check failed (``problems``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional

from benchmarks.merge_results import merge_lists
from benchmarks.metrics import percentiles
from benchmarks.serve_process import ServeProcess
from ouro_jax.engine_config import SECTIONS, EngineConfig, add_arguments, from_arguments, to_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MODEL_NAME = "soak"
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in warm morning light".split()
# each client's actions, by weight (bursts come on a timer, not from a client's choice)
ACTIONS = dict(stream_completion=30, stream_chat=15, disconnect=15, drop_non_stream=5, non_stream=15, bad=20)


# ------------------------------------------------------------------------------- server
def proc_status(pid: int) -> Optional[dict]:
    """``{"rss_mb", "threads"}`` of a live process, from ``/proc/<pid>/status`` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    rss = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    threads = re.search(r"^Threads:\s+(\d+)", text, re.M)
    if rss is None or threads is None:
        return None
    return dict(rss_mb=int(rss[1]) / 1024, threads=int(threads[1]))


class Sampler(threading.Thread):
    """The server's RSS and thread count every ``every_s`` seconds: ``samples`` of ``(t, rss_mb, threads)``."""

    def __init__(self, pid: int, every_s: float, t0: float):
        super().__init__(daemon=True, name="soak-sampler")
        self.pid, self.every_s, self.t0 = pid, every_s, t0
        self.samples: list[tuple[float, float, int]] = []
        self.stopped = threading.Event()

    def sample(self) -> None:
        st = proc_status(self.pid)
        if st is not None:
            self.samples.append((time.monotonic() - self.t0, st["rss_mb"], st["threads"]))

    def run(self) -> None:
        while not self.stopped.is_set():
            self.sample()
            self.stopped.wait(self.every_s)


def requests_by_status(text: str) -> dict:
    """The server's own count of requests by final status (``ouro_requests_total`` on ``/metrics``)."""
    return {
        m[1]: float(m[2]) for m in re.finditer(r'^ouro_requests_total\{[^}]*status="([^"]+)"[^}]*\} (\S+)$', text, re.M)
    }


def engine_gauges(text: str) -> dict:
    """Running, waiting and KV usage from ``/metrics`` (summed over replicas)."""
    out = dict(running=0.0, waiting=0.0, kv_usage=0.0)
    names = dict(
        running="ouro_num_requests_running", waiting="ouro_num_requests_waiting", kv_usage="ouro_kv_cache_usage_ratio"
    )
    for key, name in names.items():
        for m in re.finditer(rf"^{name}\{{[^}}]*\}} ([0-9.eE+-]+)$", text, re.M):
            out[key] += float(m[1])
    return out


# ---------------------------------------------------------------------------------- load
def _is_error_body(r) -> bool:
    try:
        return isinstance(r.json().get("error"), dict)
    except ValueError:
        return False


class Tally:
    """Outcomes by kind: HTTP status (or exception class) counts, errors with a few examples, latencies."""

    def __init__(self):
        self.outcomes: dict = collections.defaultdict(collections.Counter)
        self.errors: dict = collections.defaultdict(collections.Counter)
        self.examples: list[str] = []
        self.ttft: dict = collections.defaultdict(list)
        self.e2e: dict = collections.defaultdict(list)
        self.tokens = 0

    def outcome(self, kind: str, what) -> None:
        self.outcomes[kind][str(what)] += 1

    def error(self, kind: str, what: str, detail: str = "") -> None:
        self.errors[kind][what] += 1
        if len(self.examples) < 20:
            self.examples.append(f"{kind}: {what} {detail[:300]}")

    def summary(self) -> dict:
        kinds = sorted(self.outcomes)
        ttft = [x for k in kinds for x in self.ttft[k]]
        e2e = [x for k in kinds for x in self.e2e[k]]
        return dict(
            requests={k: sum(self.outcomes[k].values()) for k in kinds},
            outcomes={k: dict(self.outcomes[k]) for k in kinds},
            errors={k: dict(v) for k, v in self.errors.items() if v},
            unexpected=sum(sum(v.values()) for v in self.errors.values()),
            error_examples=self.examples,
            output_tokens=self.tokens,
            latency=dict(ttft=percentiles(ttft), e2e=percentiles(e2e)),
            latency_by_kind={k: dict(ttft=percentiles(self.ttft[k]), e2e=percentiles(self.e2e[k])) for k in kinds},
        )


class Load:
    """The clients' requests against one server (``max_model_len``: its context, from ``/v1/models``)."""

    def __init__(self, url: str, args, max_model_len: int, vocab_size: int, chat: bool, tally: Tally):
        self.url, self.args, self.chat, self.tally = url, args, chat, tally
        self.L, self.vocab = max_model_len, vocab_size

    # ----------------------------------------------------------------- request bodies
    def _sizes(self, rng: random.Random, min_tokens: int = 1) -> tuple[int, int]:
        """``(prompt_len, max_tokens)`` that fit the context."""
        mt = rng.randint(min_tokens, max(min_tokens, min(self.args.max_tokens, self.L // 2)))
        return rng.randint(1, max(1, min(self.args.max_prompt_len, self.L - mt))), mt

    def completion(self, rng: random.Random, min_tokens: int = 1, **extra) -> dict:
        n, mt = self._sizes(rng, min_tokens)
        prompt = [rng.randrange(1, self.vocab) for _ in range(n)]  # token 0 is EOS in the presets
        return dict(model=MODEL_NAME, prompt=prompt, max_tokens=mt, temperature=0, ignore_eos=True, **extra)

    def chat_body(self, rng: random.Random, **extra) -> dict:
        # a short conversation: the template's own tokens stay well inside the context's other half
        mt = rng.randint(1, max(1, min(self.args.max_tokens, self.L // 4)))
        words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
        messages = [{"role": "system", "content": words(2)}, {"role": "user", "content": words(rng.randint(1, 6))}]
        return dict(model=MODEL_NAME, messages=messages, max_tokens=mt, temperature=0, ignore_eos=True, **extra)

    def bad_request(self, rng: random.Random) -> tuple[str, str, str, object, bool]:
        """``(variant, method, path, json or raw bytes, must be refused)``."""
        good = self.completion(rng)
        variants = [
            ("malformed_json", "POST", "/v1/completions", b'{"model": "soak", "prompt": [1, 2', True),
            ("wrong_type", "POST", "/v1/completions", dict(good, max_tokens="ten"), True),
            ("negative_max_tokens", "POST", "/v1/completions", dict(good, max_tokens=-1), True),
            ("unknown_model", "POST", "/v1/completions", dict(good, model="no-such-model"), True),
            ("n_0", "POST", "/v1/completions", dict(good, n=0), True),
            ("too_long", "POST", "/v1/completions", dict(good, prompt=[1] * self.L, max_tokens=8), True),
            ("empty_messages", "POST", "/v1/chat/completions", dict(model=MODEL_NAME, messages=[]), True),
            ("unknown_route", "GET", "/v1/no-such-route", None, True),
            ("unknown_field", "POST", "/v1/completions", dict(good, frobnicate=1, max_tokens=2), True),
            ("bad_role", "POST", "/v1/chat/completions", dict(self.chat_body(rng), messages=[
                {"role": "wizard", "content": "w1"}], max_tokens=2), True),
            ("penalty_out_of_range", "POST", "/v1/completions", dict(good, presence_penalty=2.5), True),
        ]  # fmt: skip
        return rng.choice(variants)

    # -------------------------------------------------------------------------- checks
    def _refused(self, kind: str, r, body: str = "") -> Optional[float]:
        """A non-200 answer to a valid request: 429 (with Retry-After) is expected, anything else an
        error. Returns the seconds a 429 asks the client to wait."""
        self.tally.outcome(kind, r.status_code)
        if r.status_code != 429:
            self.tally.error(kind, f"HTTP {r.status_code}", body)
            return None
        if "retry-after" not in r.headers:
            self.tally.error(kind, "429 without Retry-After")
        return float(r.headers.get("retry-after", 1))

    async def stream(
        self, client, kind: str, path: str, body: dict, drop_after: Optional[int] = None
    ) -> Optional[float]:
        """One streaming request; ``drop_after``: close the connection after that many tokens. Returns
        a 429's Retry-After (as every request method here does)."""
        t0 = time.monotonic()
        ids, finish, done, ttft = [], None, False, None
        async with client.stream("POST", self.url + path, json=body) as r:
            if r.status_code != 200:
                return self._refused(kind, r, (await r.aread()).decode(errors="replace"))
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        self.tally.error(kind, "error event", line)
                        continue
                    for ch in ev["choices"]:
                        ids += ch.get("token_ids") or []
                        finish = ch.get("finish_reason") or finish
                    if ids and ttft is None:
                        ttft = time.monotonic() - t0
                    if drop_after is not None and len(ids) >= drop_after:
                        break  # leaving the block closes the connection mid-stream
        self.tally.outcome(kind, 200)
        self.tally.tokens += len(ids)
        if drop_after is None:
            want = body["max_tokens"]
            if not done or finish != "length" or len(ids) != want:
                self.tally.error(kind, "broken stream", f"{len(ids)}/{want} tokens, finish {finish}, [DONE] {done}")
            else:
                self.tally.ttft[kind].append(ttft)
                self.tally.e2e[kind].append(time.monotonic() - t0)
        return None

    async def non_stream(self, client, kind: str, body: dict) -> Optional[float]:
        t0 = time.monotonic()
        r = await client.post(self.url + "/v1/completions", json=body)
        if r.status_code != 200:
            return self._refused(kind, r, r.text)
        self.tally.outcome(kind, 200)
        ch = r.json()["choices"][0]
        self.tally.tokens += len(ch["token_ids"])
        if ch["finish_reason"] != "length" or len(ch["token_ids"]) != body["max_tokens"]:
            self.tally.error(kind, "broken response", f"{len(ch['token_ids'])}/{body['max_tokens']} tokens")
        else:
            self.tally.e2e[kind].append(time.monotonic() - t0)
        return None

    async def drop_non_stream(self, client, kind: str, body: dict, rng: random.Random) -> Optional[float]:
        """A non-streaming request given up after a moment (the connection closed while the server works)."""
        try:
            return await asyncio.wait_for(self.non_stream(client, kind, body), rng.uniform(0.02, 0.3))
        except asyncio.TimeoutError:
            self.tally.outcome(kind, "dropped")
            return None

    async def bad(self, client, rng: random.Random) -> Optional[float]:
        variant, method, path, payload, must = self.bad_request(rng)
        kind = "bad"
        if isinstance(payload, bytes):
            json_type = {"content-type": "application/json"}
            r = await client.request(method, self.url + path, content=payload, headers=json_type)
        else:
            r = await client.request(method, self.url + path, json=payload)
        code = r.status_code
        if code == 429 and not must:  # a valid request after all, and the queue was full
            return self._refused(kind, r)
        self.tally.outcome(kind, code)
        if code >= 500 or code == 429 or (must and code < 400):
            self.tally.error(kind, f"{variant}: HTTP {code}", r.text)
        elif code >= 400 and not _is_error_body(r):
            self.tally.error(kind, f"{variant}: not an OpenAI error body", r.text)
        return None

    # --------------------------------------------------------------------------- actors
    async def act(self, client, rng: random.Random) -> Optional[float]:
        """One random action; a 429's Retry-After."""
        kinds = [k for k in ACTIONS if self.chat or k != "stream_chat"]
        kind = rng.choices(kinds, [ACTIONS[k] for k in kinds])[0]
        try:
            if kind == "stream_completion":
                return await self.stream(client, kind, "/v1/completions", self.completion(rng, stream=True))
            if kind == "stream_chat":
                return await self.stream(client, kind, "/v1/chat/completions", self.chat_body(rng, stream=True))
            if kind == "disconnect":
                body = self.completion(rng, min_tokens=4, stream=True)
                drop_after = rng.randint(1, body["max_tokens"] - 1)
                return await self.stream(client, kind, "/v1/completions", body, drop_after=drop_after)
            if kind == "drop_non_stream":
                return await self.drop_non_stream(client, kind, self.completion(rng, min_tokens=4), rng)
            if kind == "non_stream":
                return await self.non_stream(client, kind, self.completion(rng))
            return await self.bad(client, rng)
        except Exception as e:  # noqa: BLE001 - every exception is counted, none ends the soak
            self.tally.outcome(kind, type(e).__name__)
            self.tally.error(kind, type(e).__name__, str(e))
            return None

    async def client(self, client, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            wait = await self.act(client, rng)
            if wait:  # a client that honours Retry-After (jittered, so that they do not return together)
                await asyncio.sleep(wait * rng.uniform(0.5, 1.0))

    async def burst(self, client, size: int, rng: random.Random) -> None:
        """``size`` short non-streaming requests at once (more than the queue holds: some get 429)."""

        async def one():
            try:
                await self.non_stream(client, "burst", dict(self.completion(rng), max_tokens=rng.randint(1, 4)))
            except Exception as e:  # noqa: BLE001
                self.tally.outcome("burst", type(e).__name__)
                self.tally.error("burst", type(e).__name__, str(e))

        await asyncio.gather(*(one() for _ in range(size)))

    async def bursts(self, client, size: int, every_s: float, deadline: float, seed: int) -> int:
        rng, n = random.Random(seed), 0
        while time.monotonic() + every_s < deadline:
            await asyncio.sleep(every_s)
            await self.burst(client, size, rng)
            n += 1
        return n


async def run_load(load: Load, args, burst_size: int) -> dict:
    import httpx

    # idle connections expire before the server's 5 s keep-alive closes them: reusing one as the server
    # closes it is a client-side ReadError, not the server's
    limits = httpx.Limits(
        max_connections=args.concurrency + burst_size + 16, max_keepalive_connections=64, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s), limits=limits) as client:
        t0 = time.monotonic()
        deadline = t0 + args.duration_s
        clients = [load.client(client, args.request_seed * 1000 + i, deadline) for i in range(args.concurrency)]
        if args.burst_every_s:
            clients.append(load.bursts(client, burst_size, args.burst_every_s, deadline, args.request_seed))
        results = await asyncio.gather(*clients)
        return dict(load_s=time.monotonic() - t0, bursts=results[-1] if args.burst_every_s else 0)


# --------------------------------------------------------------------------------- drain
async def drain_check(server: ServeProcess, load: Load, args, drain_timeout_s: float) -> dict:
    """``--drain-streams`` streams in flight, SIGTERM, 503 probes until they end, the exit status."""
    import httpx

    rng = random.Random(args.request_seed + 7)
    mt = min(args.drain_max_tokens, load.L - 8)
    bodies = [dict(load.completion(rng), prompt=[rng.randrange(1, load.vocab)] * 4, max_tokens=mt, stream=True)]
    bodies *= args.drain_streams
    started = [asyncio.Event() for _ in bodies]
    out: dict = dict(streams=len(bodies), max_tokens=mt, probes=collections.Counter(), health=collections.Counter())

    async def stream(client, i: int) -> dict:
        ids, finish, done = [], None, False
        async with client.stream("POST", server.url + "/v1/completions", json=bodies[i]) as r:
            if r.status_code != 200:
                started[i].set()
                return dict(status=r.status_code)
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    for ch in json.loads(line[6:]).get("choices", []):
                        ids += ch.get("token_ids") or []
                        finish = ch.get("finish_reason") or finish
                    if ids:
                        started[i].set()
        started[i].set()
        return dict(status=200, tokens=len(ids), finish=finish, done=done)

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s)) as client:
        tasks = [asyncio.create_task(stream(client, i)) for i in range(len(bodies))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), args.request_timeout_s)
        t_sig = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        probe = dict(load.completion(rng), max_tokens=1)
        while not all(t.done() for t in tasks):
            try:
                r = await client.post(server.url + "/v1/completions", json=probe, timeout=10)
                out["probes"][str(r.status_code)] += 1
                if r.status_code == 503:
                    out["retry_after"] = r.headers.get("retry-after")
                h = await client.get(server.url + "/health", timeout=10)
                out["health"][str(h.status_code)] += 1
            except httpx.TransportError as e:
                out["probes"][type(e).__name__] += 1
            await asyncio.sleep(0.2)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    loop = asyncio.get_running_loop()
    try:
        code = await loop.run_in_executor(None, server.proc.wait, drain_timeout_s + 60)
    except subprocess.TimeoutExpired:
        code = None
    out.update(
        exit_code=code,
        seconds=time.monotonic() - t_sig,
        finished=sum(1 for x in results if isinstance(x, dict) and x.get("done") and x.get("tokens") == mt),
        aborted=sum(1 for x in results if isinstance(x, dict) and x.get("finish") == "abort"),
        failed=[repr(x) if isinstance(x, BaseException) else x for x in results if not isinstance(x, dict)
                or not (x.get("done") and x.get("tokens") == mt)],
        saw_503=out["probes"].get("503", 0) > 0,
        health_503=out["health"].get("503", 0) > 0,
    )  # fmt: skip
    out["probes"], out["health"] = dict(out["probes"]), dict(out["health"])
    return out


# --------------------------------------------------------------------------------- report
def flatness(samples: list, t_from: float, t_to: float, index: int) -> Optional[float]:
    """Growth of sample field ``index`` over the samples between ``t_from`` and ``t_to``: the median of
    their last quarter minus that of their first (single allocation spikes are not growth)."""
    win = [s[index] for s in samples if t_from <= s[0] <= t_to]
    if len(win) < 2:
        return None
    k = max(1, len(win) // 4)
    return statistics.median(win[-k:]) - statistics.median(win[:k])


def problems(rec: dict) -> list[str]:
    """The checks the soak makes, failed: an empty list is a pass."""
    out = []
    if rec["unexpected"]:
        out.append(f"{rec['unexpected']} unexpected errors: {rec['errors']}")
    left = rec["leftovers"]
    if left["running"] or left["waiting"] or left["kv_usage"]:
        out.append(f"left over after the load: {left}")
    d = rec["drain"]
    if d["exit_code"] != 0:
        out.append(f"the server exited {d['exit_code']} after SIGTERM")
    if not d["saw_503"] or not d["health_503"]:
        out.append(f"no 503 during the drain (probes {d['probes']}, health {d['health']})")
    if d["finished"] != d["streams"]:
        out.append(f"{d['streams'] - d['finished']} streams in flight at SIGTERM did not finish: {d['failed']}")
    if rec["rss"]["flat"] is False:
        out.append(f"RSS grew {rec['rss']['growth_mb']:.1f} MB over the last {rec['rss']['window_s']:.0f} s")
    if rec["threads"]["flat"] is False:
        out.append(f"threads grew by {rec['threads']['growth']} over the last {rec['rss']['window_s']:.0f} s")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ouro-1.4b", help="preset or checkpoint folder (chat needs a chat template)")
    p.add_argument("--duration-s", type=float, default=180.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=64, help="clients looping at once")
    p.add_argument("--max-prompt-len", type=int, default=512, help="random prompts of 1..this many tokens")
    p.add_argument("--max-tokens", type=int, default=128, help="random max_tokens of 1..this (within the context)")
    p.add_argument("--burst-every-s", type=float, default=15.0, help="seconds between bursts past the queue (0: none)")
    p.add_argument("--burst-extra", type=int, default=16, help="requests a burst sends beyond what the server holds")
    p.add_argument("--drain-streams", type=int, default=8, help="streams in flight at SIGTERM")
    p.add_argument("--drain-max-tokens", type=int, default=256, help="max_tokens of those streams")
    p.add_argument("--sample-every-s", type=float, default=2.0, help="RSS / thread samples of the server")
    p.add_argument("--flat-window-s", type=float, default=60.0, help="the load's last seconds that must be flat")
    p.add_argument("--rss-growth-bound-mb", type=float, default=64.0, help="'flat' RSS: growth in the window at most")
    p.add_argument("--thread-growth-bound", type=int, default=8, help="'flat' threads: growth in the window at most")
    p.add_argument("--settle-s", type=float, default=15.0, help="after the load: how long /metrics may take to empty")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--request-seed", type=int, default=0, help="seed of the clients' random choices")
    p.add_argument("--label", default=None, help="the record's label (default: device, model, concurrency, duration)")
    p.add_argument("--out", default=RESULTS, help="folder of soak.json and logs/soak_server.log")
    p.add_argument("--append", action="store_true", help="merge into an existing soak.json (a record per label)")
    add_arguments(p, SECTIONS)  # the server's own flags (host / port / name are the soak's)
    return p


def _server_flags(args) -> tuple[list[str], EngineConfig]:
    overrides = from_arguments(args, max_queue=64, drain_timeout_s=30.0)
    for name in ("host", "port", "served_model_name"):
        overrides.pop(name, None)
    return to_argv(overrides), EngineConfig(**overrides)


def _model_info(model) -> int:
    from weights.config import PRESETS, OuroConfig

    return (PRESETS[model] if model in PRESETS else OuroConfig.from_json(model)).vocab_size


def main(argv: Optional[list[str]] = None) -> dict:
    args = parser().parse_args(argv)
    if args.concurrency < 1 or args.duration_s <= 0 or args.drain_streams < 1:
        raise SystemExit("benchmarks.soak: --concurrency, --duration-s and --drain-streams must be positive")
    import httpx

    flags, cfg = _server_flags(args)
    vocab = _model_info(args.model)
    os.makedirs(args.out, exist_ok=True)
    server = ServeProcess(args.model, flags, MODEL_NAME, os.path.join(args.out, "logs", "soak_server.log"))
    tally = Tally()
    try:
        t_start = time.monotonic()
        server.wait_ready(args.ready_timeout_s)
        ready_s = time.monotonic() - t_start
        card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
        chat_probe = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=1)
        chat = httpx.post(server.url + "/v1/chat/completions", json=chat_probe, timeout=60).status_code == 200
        load = Load(server.url, args, card["max_model_len"], vocab, chat, tally)
        # one more request than the server holds (running + queued, over every replica), and then some
        burst_size = (cfg.max_num_seqs + cfg.max_queue) * cfg.data_parallel_size + args.burst_extra
        sampler = Sampler(server.proc.pid, args.sample_every_s, time.monotonic())
        sampler.start()
        print(
            f"soak: {args.model} ready in {ready_s:.1f} s (context {load.L}, chat {chat}); {args.concurrency} clients "
            f"for {args.duration_s:g} s, bursts of {burst_size}",
            flush=True,
        )
        ran = asyncio.run(run_load(load, args, burst_size))
        t_load_end = time.monotonic() - sampler.t0
        gauges, metrics, deadline = {}, "", time.monotonic() + args.settle_s
        while time.monotonic() < deadline:  # the engine publishes its idle state within a moment
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
            gauges = engine_gauges(metrics)
            if not any(gauges.values()):
                break
            time.sleep(0.25)
        sampler.stopped.set()
        sampler.join()
        sampler.sample()  # after the load, idle
        drain = asyncio.run(drain_check(server, load, args, cfg.drain_timeout_s))
    finally:
        server.kill()
    import jax  # only now: the server process held the device until here

    samples = sampler.samples
    window = min(args.flat_window_s, args.duration_s / 3)
    rss_growth = flatness(samples, t_load_end - window, t_load_end, 1)
    thread_growth = flatness(samples, t_load_end - window, t_load_end, 2)
    device = jax.devices()[0].device_kind
    summary = tally.summary()
    model = os.path.basename(os.path.normpath(args.model))
    rec = dict(
        label=args.label or f"{device} {model} c={args.concurrency} {args.duration_s:g}s",
        mode="soak",
        chunk=None,
        device=device,
        backend=jax.default_backend(),
        jax_version=jax.__version__,
        model=args.model,
        duration_s=args.duration_s,
        load_s=ran["load_s"],
        concurrency=args.concurrency,
        ready_s=ready_s,
        chat=chat,
        bursts=ran["bursts"],
        burst_size=burst_size,
        server=dict(flags=flags, max_num_seqs=cfg.max_num_seqs, max_queue=cfg.max_queue, max_model_len=load.L),
        **summary,
        requests_per_s=sum(summary["requests"].values()) / ran["load_s"],
        output_tok_per_s=summary["output_tokens"] / ran["load_s"],
        leftovers=gauges,
        server_requests=requests_by_status(metrics),
        rss=dict(
            samples=len(samples),
            first_mb=samples[0][1] if samples else None,
            last_mb=samples[-1][1] if samples else None,
            max_mb=max((s[1] for s in samples), default=None),
            window_s=window,
            growth_mb=rss_growth,
            bound_mb=args.rss_growth_bound_mb,
            flat=None if rss_growth is None else rss_growth <= args.rss_growth_bound_mb,
            every_s=args.sample_every_s,
            load_end_s=t_load_end,
            series=[[round(t, 1), round(mb, 1), n] for t, mb, n in samples],  # seconds, MB, threads
        ),
        threads=dict(
            start=samples[0][2] if samples else None,
            end=samples[-1][2] if samples else None,
            max=max((s[2] for s in samples), default=None),
            growth=thread_growth,
            bound=args.thread_growth_bound,
            flat=None if thread_growth is None else thread_growth <= args.thread_growth_bound,
        ),
        drain=drain,
        argv=sys.argv[1:] if argv is None else list(argv),
    )
    rec["problems"] = problems(rec)
    from benchmarks.run import save_json

    path = os.path.join(args.out, "soak.json")
    prev: dict = {}
    if args.append and os.path.exists(path):
        with open(path) as f:
            prev = json.load(f)
    merged = merge_lists(prev.get("records", []), prev.get("skipped", []), [rec], [])
    save_json(dict(benchmark="soak", **merged), path)
    _print(rec)
    print(f"wrote {path}")
    return rec


def _print(rec: dict) -> None:
    lat = rec["latency"]
    f = lambda d, k: "-" if not d else f"{1e3 * d[k]:.0f}"  # noqa: E731
    print(f"soak {rec['label']}: {sum(rec['requests'].values())} requests {rec['requests']}")
    print(f"  outcomes {rec['outcomes']}")
    print(
        f"  TTFT p50 {f(lat['ttft'], 'p50')} p99 {f(lat['ttft'], 'p99')} ms, E2E p50 {f(lat['e2e'], 'p50')} "
        f"p99 {f(lat['e2e'], 'p99')} ms; {rec['output_tok_per_s']:.1f} tok/s"
    )
    r, t = rec["rss"], rec["threads"]
    print(
        f"  RSS first {r['first_mb']:.0f} last {r['last_mb']:.0f} max {r['max_mb']:.0f} MB, growth over the last "
        f"{r['window_s']:.0f} s {r['growth_mb']} MB; threads {t['start']} -> {t['end']} (max {t['max']})"
    )
    d = rec["drain"]
    print(
        f"  leftovers {rec['leftovers']}; drain: exit {d['exit_code']} after {d['seconds']:.1f} s, "
        f"{d['finished']}/{d['streams']} streams whole, probes {d['probes']}, health {d['health']}"
    )
    print("  PASS" if not rec["problems"] else "  PROBLEMS:\n    " + "\n    ".join(rec["problems"]), flush=True)


if __name__ == "__main__":
    sys.exit(1 if main()["problems"] else 0)
