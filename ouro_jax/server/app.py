"""The FastAPI application: OpenAI-style routes over one :class:`EngineLoop`.

Every request is validated here, its body strictly (``protocol.parse_request``), then with the engine's
own rules (``LLM`` encoding, ``SamplingParams`` and the scheduler's admission checks run on a probe
scheduler), before anything reaches the engine thread: a bad request is answered with an OpenAI error
body and cannot disturb any other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler import SamplingParams
from scheduler.sampling_params import choice_params

from . import protocol as P
from .chat_template import ChatTemplate
from .engine_loop import EngineDead, EngineLoop, TokenEvent
from .metrics import ServerMetrics
from .parsers import CALL_CLOSE, ChatOutputParser, merge
from .tool_calls import forced_call_guide, forced_call_parser

log = logging.getLogger("ouro_jax.server")

__all__ = ["ServerState", "create_app"]

_POLL_S = 0.5  # how often a waiting handler looks for a dropped client or a dead engine


@dataclasses.dataclass
class ServerState:
    llm: Any
    engine: EngineLoop
    model_name: str
    chat_template: Optional[ChatTemplate] = None
    reasoning_parser: Optional[str] = None  # parsers.REASONING_PARSERS: split out <think>...</think>
    max_n: int = 16  # the most choices a request may ask for (n, best_of: EngineConfig.max_n)
    metrics: Optional[ServerMetrics] = None
    retry_after_s: int = 1
    draining: bool = False
    startup: Optional[dict] = None  # the start-up timings (see startup.py), shown by /health

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = ServerMetrics(self.model_name)
        if hasattr(self.engine, "on_route"):  # data-parallel replicas: routing decisions are counted
            self.engine.on_route = self.metrics.request_routed

    # --------------------------------------------------------------------- validation
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise P.APIError(
                f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                status=404,
                param="model",
                code="model_not_found",
            )

    def check_accepting(self) -> None:
        if self.draining:
            self.metrics.request_rejected(503)
            raise P.APIError(
                "the server is shutting down",
                status=503,
                type="service_unavailable",
                code="shutting_down",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        if not self.engine.alive:
            raise P.APIError("the engine is not running", status=503, type="service_unavailable", code="engine_dead")

    def encode(self, prompt, param: str = "prompt") -> list[int]:
        try:
            return self.llm.encode(prompt)
        except ValueError as e:
            raise P.APIError(str(e), param=param) from None

    def encode_text(self, text: str) -> list[int]:
        """Rendered chat text: the template already holds the special tokens, as in Hugging Face."""
        if self.llm.tokenizer is None:
            raise P.APIError("chat completions need a tokenizer (tokenizer.json in the checkpoint folder)")
        return self.llm.tokenizer.encode(text, add_special_tokens=False).ids

    def admit_check(self, ids: list[int], sp: SamplingParams) -> None:
        """The scheduler's own admission rules (sampling values, empty prompt, length, pool size)."""
        try:
            self.llm.check_request(ids, sp)
        except ValueError as e:
            msg = str(e).replace("request (new): ", "").replace("request (new) ", "the request ")
            raise P.APIError(msg, param=_param_of(msg)) from None

    def sampling_params(
        self, req: P._Sampling, n_prompt: int, default_max_tokens: Optional[int], logprobs: Optional[int] = None
    ) -> SamplingParams:
        if req.stop and self.llm.tokenizer is None:
            raise P.APIError("stop strings need a tokenizer; use stop_token_ids", param="stop")
        max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
        if max_tokens is None:  # chat: as much as the context allows
            max_tokens = self.llm.scheduler_config.max_model_len - n_prompt
            if max_tokens < 1:
                raise P.APIError(
                    f"the prompt ({n_prompt} tokens) leaves no room under max_model_len "
                    f"({self.llm.scheduler_config.max_model_len})",
                    param="messages",
                    code="context_length_exceeded",
                )
        kw = dict(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            # an unseeded request must not repeat every other unseeded one
            seed=random.getrandbits(32) if req.seed is None else req.seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
        )
        for f in (
            "exit_threshold", "min_loops", "max_loops", "exit_mode", "synthetic_mean_loops",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
        ):  # fmt: skip
            if getattr(req, f) is not None:
                kw[f] = getattr(req, f)
        if req.logit_bias:
            kw["logit_bias"] = {int(k): b for k, b in req.logit_bias.items()}
        kw["guided"] = self.guided(req)
        try:
            sp = SamplingParams(**kw)
            sp.validate(self.llm.model_config.num_loops)
        except (ValueError, TypeError) as e:
            msg = str(e)
            raise P.APIError(msg, param=_param_of(msg)) from None
        return sp

    def guided(self, req: P._Sampling):
        """The request's structured-output constraint (``response_format``, vLLM's ``guided_*`` or a call
        that ``tool_choice`` forces), compiled-checked here: a bad schema, regex or grammar is a 400
        naming its field."""
        from ouro_jax.structured import GuidedDecoding

        if isinstance(req, P.ChatCompletionRequest) and req.forces_call:  # with no other guide (protocol checks)
            return forced_call_guide(req)
        rf = req.response_format
        if rf is not None and rf.type == "json_object":
            field, make = "response_format", GuidedDecoding.json_object
        elif rf is not None and rf.type == "json_schema":
            field, make = (
                "response_format.json_schema.schema",
                lambda: GuidedDecoding.json_schema(rf.json_schema.schema_ or {}),
            )
        else:
            makers = {
                "guided_json": GuidedDecoding.json_schema,
                "guided_regex": GuidedDecoding.regex,
                "guided_choice": GuidedDecoding.choice,
                "guided_grammar": GuidedDecoding.grammar,
            }
            field = next((f for f in makers if getattr(req, f) is not None), None)
            if field is None:
                return None
            make = lambda: makers[field](getattr(req, field))  # noqa: E731
        if self.llm.tokenizer is None:
            raise P.APIError("structured outputs need a tokenizer (tokenizer.json in the checkpoint)", param=field)
        try:
            return make()
        except ValueError as e:  # the grammar library's message can span lines (a caret under the error)
            raise P.APIError(f"{field}: {' '.join(str(e).split())}", param=field) from None

    def check_choices(self, n: int, field: str = "n") -> None:
        """``n`` choices per prompt (``n`` or ``best_of``) within the server's ``max_n``."""
        if n > self.max_n:
            raise P.APIError(f"{field} must be <= {self.max_n} (the server's max_n), not {n}", param=field)

    def reserve(self, n: int) -> None:
        if not self.engine.try_reserve(n):
            self.metrics.request_rejected(429)
            raise P.APIError(
                f"the server's queue is full ({self.engine.max_pending} requests); retry later",
                status=429,
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )


def _param_of(msg: str) -> Optional[str]:
    if "max_model_len" in msg or "prompt" in msg or "KV pool" in msg:
        return "prompt"
    for f in (
        "min_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
        "min_loops", "max_loops", "exit_threshold", "exit_mode", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "min_p", "prompt_logprobs", "logprobs",
    ):  # fmt: skip
        if f in msg:
            return f
    return None


# ------------------------------------------------------------------------------- choices
class _Choice:
    """One prompt's output as it arrives: tokens, text (incrementally decoded), stop strings."""

    def __init__(self, index: int, rid: str, n_prompt: int, tokenizer, stop: list[str], include_stop: bool, t0: float):
        self.index, self.rid, self.n_prompt, self.tokenizer = index, rid, n_prompt, tokenizer
        self.stop, self.include_stop = stop, include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars a stop string may still claim
        self.ids: list[int] = []
        self.depths: list[int] = []
        self.logprobs: list = []  # a TokenLogprobs per token, when the request asks for them
        self.prompt_logprobs: Optional[list] = None  # per prompt position, with the final event
        self.text = ""
        self.sent = 0  # chars of text already streamed
        self.finished = False
        self.finish_reason: Optional[str] = None
        self.t0, self.t_first, self.t_last = t0, None, None
        self.engine: Optional[EngineLoop] = None  # the loop holding it, once submitted

    def add(self, ev: TokenEvent) -> tuple[list[int], list[int], str]:
        """Apply one event; returns the new token ids, exit depths and text that may be sent now."""
        now = time.monotonic()
        if ev.token_ids:
            self.t_first = self.t_first or now
            self.t_last = now
        n0 = len(self.ids)
        self.ids += ev.token_ids
        self.depths += ev.exit_depths
        self.logprobs += ev.logprobs or ()
        if ev.finished:
            self.finished, self.finish_reason = True, ev.finish_reason
            self.prompt_logprobs = ev.prompt_logprobs
        if self.tokenizer is None:
            return self.ids[n0:], self.depths[n0:], ""
        if ev.token_ids:
            # the engine's "stop" is a stop or eos token: its text is left out (kept with include_stop)
            stop_token = ev.finished and ev.finish_reason == "stop" and not self.include_stop
            self.text = self.tokenizer.decode(self.ids[:-1] if stop_token else self.ids)
        end = len(self.text)
        if self.stop and ev.token_ids:
            hits = [(p, p + len(s)) for p, s in ((self.text.find(s), s) for s in self.stop) if p >= 0]
            if hits:
                start, stop_end = min(hits)  # the stop string that starts first
                self._keep_tokens_through(stop_end, n0)
                self.text = self.text[: stop_end if self.include_stop else start]
                self.finished, self.finish_reason = True, "stop"
                end = len(self.text)
        if not self.finished:
            end = max(self.sent, end - self.hold)
            while end > self.sent and self.text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                end -= 1
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return self.ids[n0:], self.depths[n0:], delta

    def _keep_tokens_through(self, chars: int, n0: int) -> None:
        """Drop the tokens after the one whose text reaches ``chars`` (the stop string's end): they
        came in the same event but belong to no answer, and ``usage`` must not count them."""
        lo, hi = n0 + 1, len(self.ids)  # the stop string was not complete before this event
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.tokenizer.decode(self.ids[:mid])) >= chars:
                hi = mid
            else:
                lo = mid + 1
        del self.ids[lo:], self.depths[lo:], self.logprobs[lo:]

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)

    def timings(self):
        ttft = None if self.t_first is None else self.t_first - self.t0
        tpot = None
        if self.t_first is not None and len(self.ids) > 1:
            tpot = (self.t_last - self.t_first) / (len(self.ids) - 1)
        return ttft, tpot, time.monotonic() - self.t0


class _Job:
    """The engine requests of one HTTP request, their shared event queue and their bookkeeping."""

    def __init__(
        self,
        state: ServerState,
        prefix: str,
        prompts: list[list[int]],
        sps,
        stop: list[str],
        include_stop: bool,
        n: int = 1,
    ):
        self.state = state
        self.id = P.new_id(prefix)
        self.created = P.now()
        self.queue: asyncio.Queue = asyncio.Queue()
        t0 = time.monotonic()
        tok = state.llm.tokenizer
        # n choices per prompt, choice j of prompt i at index i * n + j, seeded seed + j; the later
        # choices share the first one's prompt (computed once: LLM.add_request's prompt_from)
        self.n = n
        self.prompts = [p for p in prompts for _ in range(n)]
        self.sps = [choice_params(sp, j) for sp in sps for j in range(n)]
        self.choices = [
            _Choice(i, f"{self.id}-{i}", len(p), tok, stop, include_stop, t0) for i, p in enumerate(self.prompts)
        ]
        self.recorded = False

    def submit(self) -> None:
        st = self.state
        st.reserve(len(self.choices))
        for k, (c, ids, sp) in enumerate(zip(self.choices, self.prompts, self.sps)):
            first = self.choices[k - k % self.n]
            try:
                # the loop that took it (with data-parallel replicas: the one the router chose, for a
                # later choice of a prompt the first one's: its prompt blocks are there)
                if first is c:
                    c.engine = st.engine.submit(c.rid, ids, sp, self.queue, c.index)
                else:
                    c.engine = st.engine.submit(c.rid, ids, sp, self.queue, c.index, first.rid, first.engine)
            except EngineDead as e:
                st.engine.release(len(self.choices) - k)
                for c2 in self.choices[:k]:
                    c2.engine.abort(c2.rid)
                raise P.APIError(str(e), status=503, type="service_unavailable", code="engine_dead") from None

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    async def next_event(self) -> Optional[TokenEvent]:
        """The next event, or None after ``_POLL_S`` without one."""
        try:
            return await asyncio.wait_for(self.queue.get(), _POLL_S)
        except asyncio.TimeoutError:
            if not self.state.engine.alive:
                raise P.APIError("the engine stopped", status=503, type="service_unavailable") from None
            return None

    def apply(self, ev: TokenEvent):
        if ev.error is not None:
            if isinstance(ev.error, EngineDead):
                raise P.APIError(str(ev.error), status=503, type="service_unavailable", code="engine_dead")
            raise P.APIError(str(ev.error))
        c = self.choices[ev.index]
        if c.finished:  # a stop string ended it already; later tokens are dropped
            return c, [], [], ""
        out = c.add(ev)
        if c.finished and not ev.finished:
            c.engine.abort(c.rid)  # a stop string: the engine need not go on
        return (c, *out)

    def abort_unfinished(self) -> None:
        for c in self.choices:
            if not c.finished:
                c.engine.abort(c.rid)
                c.finished, c.finish_reason = True, "abort"

    def record(self, status: str) -> None:
        if self.recorded:
            return
        self.recorded = True
        m = self.state.metrics
        for c in self.choices:
            ttft, tpot, e2e = c.timings()
            m.request_done(status, c.n_prompt, c.depths, ttft, tpot, e2e)

    def usage(self) -> P.Usage:
        p = sum(c.n_prompt for c in self.choices[:: self.n])  # a prompt counts once, whatever its choices
        g = sum(len(c.ids) for c in self.choices)
        return P.Usage(prompt_tokens=p, completion_tokens=g, total_tokens=p + g)


async def _collect(job: _Job, raw: Request) -> None:
    """Wait for every choice to finish; a client that goes away aborts its requests."""
    try:
        checked = time.monotonic()
        while not job.done:
            ev = await job.next_event()
            if ev is not None:
                job.apply(ev)
            if ev is None or time.monotonic() - checked >= _POLL_S:  # tokens may keep coming: look anyway
                checked = time.monotonic()
                if await raw.is_disconnected():
                    job.abort_unfinished()
                    job.record("abort")
                    return
    except BaseException:
        job.abort_unfinished()
        job.record("error")
        raise
    job.record("success")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(job: _Job, chunk, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks as tokens arrive; cancellation (a dropped client) aborts the unfinished requests."""
    status = "success"
    try:
        for c in job.choices:
            for frame in _frames(chunk(c, None, [], [], "", first=True)):
                yield _sse(frame)
        while not job.done:
            ev = await job.next_event()
            if ev is None:
                continue
            try:
                c, ids, depths, delta = job.apply(ev)
            except P.APIError as e:
                status = "error"
                yield _sse(e.body())
                break
            if ids or delta or c.finished:
                for frame in _frames(chunk(c, c.finish_reason if c.finished else None, ids, depths, delta)):
                    yield _sse(frame)
        if include_usage:
            yield _sse(
                {"id": job.id, "object": chunk.object, "created": job.created, "model": job.state.model_name,
                 "choices": [], "usage": job.usage().model_dump()}
            )  # fmt: skip
        yield "data: [DONE]\n\n"
    except BaseException:
        status = "abort"
        raise
    finally:
        if not job.done:
            job.abort_unfinished()
            status = "abort"
        job.record(status)


def _frames(out) -> list:
    """A chunk function's answer (None, one chunk or a list of them) as a list."""
    return [] if out is None else out if isinstance(out, list) else [out]


def _error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ouro-jax", version="0.1.0")
    app.state.server = state

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        typ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(P.APIError(str(e.detail), status=e.status_code, type=typ))

    @app.get("/health")
    async def health():
        if state.draining or not state.engine.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        for i, loop in enumerate(getattr(state.engine, "replicas", [state.engine])):
            state.metrics.engine_state(loop.state, replica=i)
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = P.ModelCard(id=state.model_name, created=P.now(), max_model_len=state.llm.scheduler_config.max_model_len)
        return P.ModelList(data=[card])

    def _prompts(prompt) -> list:
        if isinstance(prompt, str) or isinstance(prompt[0], int):  # one prompt (the shapes are checked)
            return [prompt]
        return list(prompt)

    async def _body(raw: Request, model):
        return P.parse_request(model, await raw.body(), raw.headers.get("content-type"))

    # the bodies are read here, not by FastAPI, so that every refusal is one OpenAI error line
    @app.post("/v1/completions")
    async def completions(raw: Request):
        req = await _body(raw, P.CompletionRequest)
        state.check_model(req.model)
        state.check_accepting()
        made = req.best_of or req.n  # choices made per prompt; the n likeliest are returned
        state.check_choices(req.n)
        state.check_choices(made, "best_of")
        # ranking best_of choices needs their logprobs, returned only when asked for
        logprobs = req.logprobs if req.logprobs is not None or made == req.n else 0
        prompts = [state.encode(p) for p in _prompts(req.prompt)]
        sps = [state.sampling_params(req, len(ids), 16, logprobs) for ids in prompts]
        for ids, sp in zip(prompts, sps):
            state.admit_check(ids, sp)
        job = _Job(state, "cmpl", prompts, sps, req.stop or [], req.include_stop_str_in_output, made)
        job.submit()
        tok = state.llm.tokenizer

        if req.stream:

            def chunk(c, finish, ids, depths, delta, first=False):
                if first:
                    return None
                lps = None if req.logprobs is None else _completion_logprobs(tok, c.logprobs[len(c.ids) - len(ids) :])
                return {
                    "id": job.id, "object": "text_completion", "created": job.created, "model": state.model_name,
                    "choices": [{"index": c.index, "text": delta, "token_ids": ids, "exit_depths": depths,
                                 "logprobs": lps, "finish_reason": finish}],
                }  # fmt: skip

            chunk.object = "text_completion"
            return StreamingResponse(_stream(job, chunk, _include_usage(req)), media_type="text/event-stream")

        await _collect(job, raw)
        kept = job.choices
        if made > req.n:  # best_of: each prompt's n likeliest choices, likeliest first
            kept = [
                c
                for i in range(0, len(job.choices), made)
                for c in sorted(job.choices[i : i + made], key=lambda c: -c.cumulative_logprob)[: req.n]
            ]
        choices = [
            P.CompletionChoice(
                index=k, text=c.text, token_ids=c.ids, exit_depths=c.depths, finish_reason=c.finish_reason,
                logprobs=None if req.logprobs is None else _completion_logprobs(tok, c.logprobs),
                prompt_logprobs=_prompt_logprobs(tok, c.prompt_logprobs),
            )
            for k, c in enumerate(kept)
        ]  # fmt: skip
        return P.CompletionResponse(
            id=job.id, created=job.created, model=state.model_name, choices=choices, usage=job.usage()
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        req = await _body(raw, P.ChatCompletionRequest)
        state.check_model(req.model)
        state.check_accepting()
        if state.chat_template is None:
            raise P.APIError("this checkpoint has no chat template (tokenizer_config.json: chat_template)")
        messages = [_message(m) for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        if req.render_tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        try:
            text = state.chat_template.render(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
        except (ValueError, TypeError) as e:
            raise P.APIError(str(e), param="messages") from None
        ids = state.encode_text(text)
        state.check_choices(req.n)
        # the turn's end (<|im_end|>) is an engine eos id
        sp = state.sampling_params(req, len(ids), None, req.engine_logprobs)
        state.admit_check(ids, sp)
        stop = list(req.stop or [])
        if req.parse_tools and req.one_call:
            stop.append(CALL_CLOSE)  # parallel_tool_calls false: the answer ends with its first call
        job = _Job(state, "chatcmpl", [ids], [sp], stop, req.include_stop_str_in_output, req.n)
        job.submit()
        tok = state.llm.tokenizer

        # one parser per choice: each reads its own answer
        parsers = {c.index: _output_parser(state, req) for c in job.choices}
        if req.stream:

            def chunk(c, finish, ids, depths, delta, first=False):
                parser = parsers[c.index]
                if first:
                    deltas = [{"role": "assistant", "content": ""}]
                elif parser is None:
                    deltas = [{"content": delta} if delta else {}]
                else:
                    deltas = [_delta(d) for d in parser.feed(delta, final=finish is not None)] or [{}]
                    finish = parser.finish_reason(finish)
                lps = None
                if req.logprobs and not first:
                    lps = _chat_logprobs(tok, c.logprobs[len(c.logprobs) - len(ids) :], req.top_logprobs or 0)
                # the token ids and logprobs go with the first of the frames, the finish reason with the last
                return [
                    {
                        "id": job.id, "object": "chat.completion.chunk", "created": job.created,
                        "model": state.model_name,
                        "choices": [{"index": c.index, "delta": d, "token_ids": ids if k == 0 else [],
                                     "exit_depths": depths if k == 0 else [], "logprobs": lps if k == 0 else None,
                                     "finish_reason": finish if k == len(deltas) - 1 else None}],
                    }
                    for k, d in enumerate(deltas)
                ]  # fmt: skip

            chunk.object = "chat.completion.chunk"
            return StreamingResponse(_stream(job, chunk, _include_usage(req)), media_type="text/event-stream")

        await _collect(job, raw)
        choices = []
        for c in job.choices:
            parser = parsers[c.index]
            message, finish = P.ChatResponseMessage(content=c.text), c.finish_reason
            if parser is not None:
                out = merge(parser.feed(c.text, final=True), parser.calls)
                message = P.ChatResponseMessage(
                    content=out.content, reasoning_content=out.reasoning_content, tool_calls=out.tool_calls or None
                )
                finish = parser.finish_reason(finish)
            lps = _chat_logprobs(tok, c.logprobs, req.top_logprobs or 0) if req.logprobs else None
            choices.append(
                P.ChatChoice(
                    index=c.index, message=message, token_ids=c.ids, exit_depths=c.depths, finish_reason=finish,
                    logprobs=lps, prompt_logprobs=_prompt_logprobs(tok, c.prompt_logprobs),
                )
            )  # fmt: skip
        return P.ChatCompletionResponse(
            id=job.id, created=job.created, model=state.model_name, choices=choices, usage=job.usage()
        )

    return app


def _token_text(tokenizer, token_id: int) -> str:
    """One token's text as logprobs show it (special tokens included); its id without a tokenizer."""
    return str(token_id) if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(tokenizer, lps: list) -> dict:
    """The completions API's ``logprobs`` of tokens ``lps`` (``TokenLogprobs``): each token's text and
    logprob, its alternatives keyed by text (the chosen token among them, as OpenAI's), text offsets."""
    text = lambda t: _token_text(tokenizer, t)  # noqa: E731
    tokens = [text(lp.token_id) for lp in lps]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{**{text(i): v for i, v in lp.top}, text(lp.token_id): lp.logprob} for lp in lps],
        "text_offset": offsets,
    }


def _prompt_logprobs(tokenizer, lps: Optional[list]) -> Optional[list]:
    """vLLM's ``prompt_logprobs``: None for the first position, then the prompt token and its
    alternatives, each ``{token id: {"logprob", "decoded_token"}}``."""
    if lps is None:
        return None

    def position(lp) -> dict:
        pairs = [(lp.token_id, lp.logprob), *lp.top]
        return {str(t): {"logprob": v, "decoded_token": _token_text(tokenizer, t)} for t, v in pairs}

    return [None if lp is None else position(lp) for lp in lps]


def _chat_logprobs(tokenizer, lps: list, top: int) -> dict:
    """The chat API's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def entry(token_id: int, logprob: float) -> dict:
        t = _token_text(tokenizer, token_id)
        return {"token": t, "logprob": logprob, "bytes": list(t.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top[:top]]} for lp in lps
        ]
    }


def _output_parser(state: ServerState, req: P.ChatCompletionRequest):
    """What reads the answer's text into reasoning, content and tool calls; None: the text is the content.
    A forced call's answer is constrained from its first token, so it has no reasoning to split out."""
    forced = forced_call_parser(req)
    if forced is not None:
        return forced
    if state.reasoning_parser is not None or req.parse_tools:
        return ChatOutputParser(state.reasoning_parser, req.parse_tools)
    return None


def _include_usage(req) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _delta(d) -> dict:
    """A parser's event as a chat chunk's delta."""
    out = {}
    if d.reasoning_content:
        out["reasoning_content"] = d.reasoning_content
    if d.content:
        out["content"] = d.content
    if d.tool_call is not None:
        out["tool_calls"] = [d.tool_call]
    return out


def _message(m: P.ChatMessage) -> dict:
    """A message as templates expect it: its text parts joined (a null content is empty); OpenAI's
    developer role is the system's."""
    d = m.model_dump(exclude_none=True)
    d["content"] = "".join(p.text for p in m.content or ())
    if d["role"] == "developer":
        d["role"] = "system"
    return d
