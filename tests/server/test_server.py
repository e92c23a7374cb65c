"""The HTTP server end to end, over real HTTP on a loopback port, with the official ``openai`` client.

One server for the module, started from a checkpoint folder written here (HF layout of the ``tiny``
preset, a WordLevel ``tokenizer.json``, a ``tokenizer_config.json`` with a chat template), with one
compiled executable. Every answer is compared with ``LLM.generate`` on the same engine for the same
settings, computed before the server takes the engine over.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from scheduler import SamplingParams  # noqa: E402
from tests.server.conftest import CHAT, CHAT_TEXT, ENGINE, TEXT_PROMPT, write_checkpoint  # noqa: E402

MODEL = "ouro-test"
RNG = np.random.default_rng(1)
# token 0 is EOS: keep it out of the prompts
STREAM_PROMPTS = [list(map(int, RNG.integers(5, 128, int(RNG.integers(1, 13))))) for _ in range(64)]
STREAM_SP = [
    dict(max_tokens=int(RNG.integers(3, 8)), exit_threshold=float(RNG.choice([0.3, 0.6, 1.0])), ignore_eos=True)
    for _ in range(64)
]


def _gen(llm, prompt, **sp):
    o = llm.generate([prompt], SamplingParams(**sp), use_tqdm=False)[0]
    return dict(token_ids=o.token_ids, exit_depths=o.exit_depths, text=o.text, finish_reason=o.finish_reason)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ouro_jax.server.run import BackgroundServer, make_state
    from ouro_jax.server.startup import build_engine

    folder = write_checkpoint(tmp_path_factory.mktemp("ckpt"))
    llm, timings = build_engine(folder, ENGINE)
    # one bucket and its separate sampler
    assert len(timings["executables"]) == len(llm.executable_keys()) == 2 and timings["load_s"] > 0
    # what LLM.generate answers, before the server's engine thread owns the engine
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    expect = dict(
        text=_gen(llm, TEXT_PROMPT, **greedy),
        ids=_gen(llm, [5, 6, 7], exit_threshold=0.5, **greedy),
        sampled=_gen(llm, [9, 10, 11, 12], temperature=0.9, top_p=0.9, top_k=20, seed=7, max_tokens=6),
        chat=_gen(llm, llm.tokenizer.encode(CHAT_TEXT, add_special_tokens=False).ids, **greedy),
        streams=[_gen(llm, p, temperature=0.0, **sp) for p, sp in zip(STREAM_PROMPTS, STREAM_SP)],
        long=_gen(llm, [5, 6], temperature=0.0, max_tokens=40, ignore_eos=True),
    )
    state = make_state(llm, MODEL, folder, max_queue=128, startup=timings)
    srv = BackgroundServer(state).start()
    srv.expect, srv.folder = expect, folder
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)
    yield srv
    srv.stop(timeout=30)
    assert not srv._thread.is_alive()


def _idle(srv, timeout=20.0):
    """The engine has nothing left and every KV block is back in the pool."""
    llm = srv.state.llm
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.state.engine.pending == 0 and not llm.has_unfinished():
            break
        time.sleep(0.02)
    assert srv.state.engine.pending == 0
    assert not llm.has_unfinished()
    assert llm.scheduler.block_manager.num_used_blocks == 0


def _extra(obj, name):
    return obj.model_extra[name] if obj.model_extra and name in obj.model_extra else getattr(obj, name)


# ----------------------------------------------------------------------------- basics
def test_models_health_metrics(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    server.client.completions.create(
        model=MODEL, prompt=[5, 6], max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "ouro_requests_total",
        "ouro_prompt_tokens_total",
        "ouro_generation_tokens_total",
        "ouro_time_to_first_token_seconds_bucket",
        "ouro_time_per_output_token_seconds_bucket",
        "ouro_e2e_request_latency_seconds_bucket",
        "ouro_num_requests_running",
        "ouro_num_requests_waiting",
        "ouro_kv_cache_usage_ratio",
        "ouro_mean_loops_per_token",
    ):
        assert name in text, name
    assert 'ouro_requests_total{model_name="ouro-test",status="success"}' in text


# ------------------------------------------------------------------------ completions
def _check(choice, want):
    assert _extra(choice, "token_ids") == want["token_ids"]
    assert _extra(choice, "exit_depths") == want["exit_depths"]
    assert len(want["exit_depths"]) == len(want["token_ids"]) > 0
    assert choice.finish_reason == want["finish_reason"]


def test_completions_equal_llm_generate(server):
    e, c = server.expect, server.client
    r = c.completions.create(
        model=MODEL, prompt=TEXT_PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == e["text"]["text"]
    _check(r.choices[0], e["text"])
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6 and r.usage.total_tokens == 11
    # token ids with an early exit, and a list of prompts (one choice each, in order)
    body = {"ignore_eos": True, "exit_threshold": 0.5}
    r = c.completions.create(model=MODEL, prompt=[[5, 6, 7], TEXT_PROMPT], max_tokens=6, temperature=0, extra_body=body)
    assert [ch.index for ch in r.choices] == [0, 1]
    _check(r.choices[0], e["ids"])
    # seeded sampling is the engine's: same seed, same tokens
    r = c.completions.create(
        model=MODEL, prompt=[9, 10, 11, 12], max_tokens=6, temperature=0.9, top_p=0.9, seed=7, extra_body={"top_k": 20}
    )
    assert _extra(r.choices[0], "token_ids") == e["sampled"]["token_ids"]
    assert _extra(r.choices[0], "exit_depths") == e["sampled"]["exit_depths"]
    _idle(server)


def test_completions_stream_equal_llm_generate(server):
    want = server.expect["text"]
    stream = server.client.completions.create(
        model=MODEL,
        prompt=TEXT_PROMPT,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, ids, depths, finish, usage = "", [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.text
            ids += _extra(ch, "token_ids")
            depths += _extra(ch, "exit_depths")
            finish = ch.finish_reason or finish
    assert (text, ids, depths, finish) == (want["text"], want["token_ids"], want["exit_depths"], "length")
    assert usage.completion_tokens == 6
    # the raw SSE stream ends with [DONE]
    body = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0, stream=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_stop_strings_cut_the_text(server):
    want = server.expect["text"]
    words = want["text"].split()
    assert len(words) >= 3, want
    stop = " " + words[2]
    r = server.client.completions.create(
        model=MODEL, prompt=TEXT_PROMPT, max_tokens=6, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    ch = r.choices[0]
    assert ch.finish_reason == "stop"
    assert ch.text == want["text"][: want["text"].find(stop)]
    # streamed, the stop string never reaches the client either
    s = server.client.completions.create(
        model=MODEL,
        prompt=TEXT_PROMPT,
        max_tokens=6,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in s if c.choices) == ch.text
    # the answer's tokens end with the one that completed the stop string (usage counts no more)
    tok, ids, end = server.state.llm.tokenizer, want["token_ids"], want["text"].find(stop) + len(stop)
    k = next(k for k in range(1, len(ids) + 1) if len(tok.decode(ids[:k])) >= end)
    assert ch.model_extra["token_ids"] == ids[:k] and r.usage.completion_tokens == k
    # include_stop_str_in_output keeps the stop string
    r2 = server.client.completions.create(
        model=MODEL,
        prompt=TEXT_PROMPT,
        max_tokens=6,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert r2.choices[0].text == want["text"][:end] and r2.usage.completion_tokens == k
    _idle(server)
    # a fused step hands several tokens over at once: those after the stop string are dropped
    from ouro_jax.server.app import _Choice
    from ouro_jax.server.engine_loop import TokenEvent

    for include in (False, True):
        c = _Choice(0, "x", 3, tok, [stop], include, 0.0)
        _, _, delta = c.add(TokenEvent(0, list(ids), list(want["exit_depths"])))
        assert c.ids == ids[:k] and len(c.depths) == k and c.finish_reason == "stop"
        assert delta == want["text"][: end if include else end - len(stop)]


# ------------------------------------------------------------------------------- chat
def test_chat_completions_use_the_checkpoint_template(server):
    want = server.expect["chat"]
    r = server.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    m = r.choices[0]
    assert m.message.role == "assistant" and m.message.content == want["text"]
    _check(m, want)
    assert r.usage.prompt_tokens == len(CHAT_TEXT.split()) + 4  # words + the special tokens
    s = server.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(s)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want["text"]
    assert sum((_extra(c.choices[0], "token_ids") for c in chunks), []) == want["token_ids"]
    assert chunks[-1].choices[0].finish_reason == "length"
    _idle(server)


# ------------------------------------------------------------------------ concurrency
def test_64_concurrent_streams_each_as_alone(server):
    async def one(client, prompt, sp):
        s = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=sp["max_tokens"],
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "exit_threshold": sp["exit_threshold"]},
        )
        ids, depths, finish = [], [], None
        async for chunk in s:
            for ch in chunk.choices:
                ids += _extra(ch, "token_ids")
                depths += _extra(ch, "exit_depths")
                finish = ch.finish_reason or finish
        return ids, depths, finish

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)
        try:
            coros = [one(client, p, sp) for p, sp in zip(STREAM_PROMPTS, STREAM_SP)]
            return await asyncio.wait_for(asyncio.gather(*coros), 180)
        finally:
            await client.close()

    got = asyncio.run(main())
    for (ids, depths, finish), want in zip(got, server.expect["streams"]):
        assert (ids, depths, finish) == (want["token_ids"], want["exit_depths"], "length")
    _idle(server)


@pytest.fixture
def slow_engine(server):
    """Steps of at least 10 ms, so that a request of 40 tokens (160 steps) outlasts a client's patience."""
    llm = server.state.llm
    step = llm.step

    def slow_step():
        time.sleep(0.01)
        return step()

    llm.step = slow_step
    yield server
    del llm.step


def test_dropped_client_aborts_and_frees_blocks(slow_engine):
    server = slow_engine
    llm = server.state.llm
    aborted = llm.stats()["aborted"]
    body = dict(model=MODEL, prompt=[5, 6], max_tokens=40, temperature=0, stream=True, ignore_eos=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token, then hang up mid-stream
    _idle(server)
    assert llm.stats()["aborted"] == aborted + 1
    assert 'status="abort"' in httpx.get(server.url + "/metrics").text
    # a non-streaming client that gives up is aborted too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=dict(body, stream=False), timeout=0.3)
    _idle(server)
    assert llm.stats()["aborted"] == aborted + 2
    # and the engine still answers as before
    r = server.client.completions.create(
        model=MODEL, prompt=[5, 6], max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert _extra(r.choices[0], "token_ids") == server.expect["long"]["token_ids"]


def test_full_queue_answers_429(slow_engine):
    server = slow_engine
    engine = server.state.engine
    old = engine.max_pending
    engine.max_pending = 1
    try:
        body = dict(model=MODEL, prompt=[5, 6], max_tokens=40, temperature=0, stream=True, ignore_eos=True)
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            it = r.iter_lines()
            next(ln for ln in it if ln.startswith("data: {"))
            t = time.monotonic()
            full = httpx.post(server.url + "/v1/completions", json=dict(body, stream=False), timeout=10)
            assert time.monotonic() - t < 5  # answered at once, never queued
            rest = [ln for ln in it if ln]
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["type"] == "rate_limit_error"
        assert rest[-1] == "data: [DONE]"
    finally:
        engine.max_pending = old
    _idle(server)


# ----------------------------------------------------------------------- bad requests
BAD = [
    ("invalid json", b"{not json", 400, None),
    ("unknown model", dict(model="gpt-4", prompt="w1"), 404, "model"),
    ("missing prompt", dict(model=MODEL), 400, "prompt"),
    ("temperature", dict(model=MODEL, prompt="w1", temperature=-1), 400, "temperature"),
    ("top_p", dict(model=MODEL, prompt="w1", top_p=0), 400, "top_p"),
    ("max_tokens", dict(model=MODEL, prompt="w1", max_tokens=0), 400, "max_tokens"),
    ("exit_threshold", dict(model=MODEL, prompt="w1", exit_threshold=1.5), 400, "exit_threshold"),
    ("max_loops", dict(model=MODEL, prompt="w1", max_loops=9), 400, "max_loops"),
    ("exit_mode", dict(model=MODEL, prompt="w1", exit_mode="never"), 400, "exit_mode"),
    ("seed", dict(model=MODEL, prompt="w1", seed=-3), 400, "seed"),
    ("token ids outside the vocabulary", dict(model=MODEL, prompt=[5, 128]), 400, "prompt"),
    ("prompt too long", dict(model=MODEL, prompt=[5] * 60, max_tokens=8), 400, "prompt"),
    ("empty prompt", dict(model=MODEL, prompt=[]), 400, "prompt"),
    ("n", dict(model=MODEL, prompt="w1", n=0), 400, "n"),
    ("wrong type", dict(model=MODEL, prompt="w1", max_tokens="many"), 400, "max_tokens"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(server, name, body, status, param):
    kw = (
        dict(content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) else dict(json=body)
    )
    r = httpx.post(server.url + "/v1/completions", timeout=10, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert not server.state.llm.has_unfinished()


def test_bad_requests_leave_others_alone(server):
    """Bad requests sent while a good stream runs: the stream ends exactly as when alone."""
    want = server.expect["long"]
    body = dict(model=MODEL, prompt=[5, 6], max_tokens=40, temperature=0, stream=True, ignore_eos=True)
    ids = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for k, line in enumerate(ln for ln in r.iter_lines() if ln.startswith("data: {")):
            ids += json.loads(line[6:])["choices"][0]["token_ids"]
            if k < len(BAD):
                _, bad, status, _ = BAD[k]
                kw = dict(content=bad) if isinstance(bad, bytes) else dict(json=bad)
                assert httpx.post(server.url + "/v1/completions", timeout=10, **kw).status_code == status
    assert ids == want["token_ids"]
    # chat: a template error and a missing message list
    r = httpx.post(server.url + "/v1/chat/completions", json=dict(model=MODEL, messages=[]), timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    bad_kwargs = dict(model=MODEL, messages=CHAT, chat_template_kwargs={"messages": 1})
    r = httpx.post(server.url + "/v1/chat/completions", json=bad_kwargs, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/v1/chat/completions", json=dict(model="other", messages=CHAT), timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    _idle(server)
