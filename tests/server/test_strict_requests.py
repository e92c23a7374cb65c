"""Strict request bodies over HTTP: every malformed request is a 400 (415 for a non-JSON content type)
with one OpenAI error line naming the field, the "off" values of OpenAI fields we do not implement are
accepted and change nothing, and no refused request reaches the engine.

One server for the module (the tiny checkpoint of ``conftest.py``, one compiled executable), over
real HTTP on a loopback port."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("fastapi")

from scheduler import SamplingParams  # noqa: E402
from tests.server.conftest import CHAT, CHAT_TEXT, ENGINE, write_checkpoint  # noqa: E402

MODEL = "ouro-test"
GREEDY = dict(max_tokens=4, temperature=0, ignore_eos=True)
USER = [{"role": "user", "content": "w9 w10"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ouro_jax.server.run import BackgroundServer, make_state
    from ouro_jax.server.startup import build_engine

    folder = write_checkpoint(tmp_path_factory.mktemp("ckpt"))
    llm, timings = build_engine(folder, ENGINE)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    chat_ids = llm.tokenizer.encode(CHAT_TEXT, add_special_tokens=False).ids
    # what LLM.generate answers, before the server's engine thread owns the engine
    text, chat = (o.token_ids for o in llm.generate([[5, 6, 7], chat_ids], sp, use_tqdm=False))
    srv = BackgroundServer(make_state(llm, MODEL, folder, max_queue=8, startup=timings)).start()
    srv.expect = dict(text=text, chat=chat)
    yield srv
    srv.stop(timeout=30)


def _post(server, path, body, **kw):
    kw = dict(content=body, **kw) if isinstance(body, bytes) else dict(json=body, **kw)
    return httpx.post(server.url + path, timeout=30, **kw)


def _idle(server, timeout=10.0):
    """The engine has nothing left and every KV block is back in the pool."""
    llm, engine = server.state.llm, server.state.engine
    deadline = time.monotonic() + timeout
    while (engine.pending or llm.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.pending == 0 and not llm.has_unfinished()
    assert llm.scheduler.block_manager.num_used_blocks == 0


CMPL, CHATP = "/v1/completions", "/v1/chat/completions"
C = dict(model=MODEL, prompt=[5, 6, 7], **GREEDY)  # a good completion request
M = dict(model=MODEL, messages=USER, **GREEDY)  # a good chat request
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
NAMED_F, NAMED_G = ({"type": "function", "function": {"name": n}} for n in "fg")
BAD_TOOL = {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
    "x": {"type": "integr"}}}}}  # fmt: skip


def _defs_tool(name, x_type):
    """A tool whose parameters refer to their own $defs.X."""
    parameters = {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "$defs": {"X": {"type": x_type}}}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
# (id, path, body, status, param, a substring of the message)
BAD = [
    # unknown fields, with a suggestion when one is close
    ("chat unknown field", CHATP, dict(M, foo=1), 400, "foo", "unknown field 'foo'"),
    ("misspelt field", CMPL, dict(C, temprature=0.5), 400, "temprature", "did you mean 'temperature'?"),
    ("vllm extra", CMPL, dict(C, use_beam_search=True), 400, "use_beam_search", "unknown field"),
    # logit processing: values out of range
    ("logit_bias key", CMPL, dict(C, logit_bias={"w5": 10}), 400, "logit_bias", "keys must be token ids"),
    ("logit_bias value", CMPL, dict(C, logit_bias={"5": 200}), 400, "logit_bias", "must lie in [-100, 100]"),
    ("logit_bias id", CMPL, dict(C, logit_bias={"500": 1}), 400, "logit_bias", "is not a token id"),
    ("presence_penalty", CHATP, dict(M, presence_penalty=2.5), 400, "presence_penalty", "must lie in [-2, 2]"),
    ("frequency_penalty", CMPL, dict(C, frequency_penalty="0.5"), 400, "frequency_penalty", "must be a number"),
    ("repetition_penalty", CMPL, dict(C, repetition_penalty=0), 400, "repetition_penalty", "> 0"),
    ("min_tokens", CMPL, dict(C, min_tokens=99, max_tokens=4), 400, "min_tokens", "exceeds max_tokens"),
    # OpenAI fields we do not implement, set to something other than off
    ("n", CMPL, dict(C, n=0), 400, "n", "n must be >= 1, not 0"),
    ("logprobs", CMPL, dict(C, logprobs=21), 400, "logprobs", "logprobs must be <= 20, not 21"),
    ("chat best_of", CHATP, dict(M, best_of=2), 400, "best_of", "best_of is not supported"),
    ("echo", CMPL, dict(C, echo=True), 400, "echo", "is not supported"),
    ("completion tools", CMPL, dict(C, tools=[TOOL]), 400, "tools", "not supported"),
    # tools and tool_choice
    ("tool_choice unknown", CHATP, dict(M, tools=[TOOL], tool_choice=NAMED_G), 400, "tool_choice", "not in tools"),
    ("tool_choice without tools", CHATP, dict(M, tool_choice="auto"), 400, "tool_choice", "needs tools"),
    ("required without tools", CHATP, dict(M, tool_choice="required"), 400, "tool_choice", "needs tools"),
    ("named without tools", CHATP, dict(M, tool_choice=NAMED_F), 400, "tool_choice", "not in tools"),
    ("tool_choice mode", CHATP, dict(M, tools=[TOOL], tool_choice="any"), 400, "tool_choice", "none, auto, required"),
    ("tool_choice shape", CHATP, dict(M, tools=[TOOL], tool_choice={"type": "function", "name": "f"}), 400,
     "tool_choice", 'must be {"type": "function", "function": {"name": ...}}'),
    ("required and response_format", CHATP, dict(M, tools=[TOOL], tool_choice="required",
     response_format={"type": "json_object"}), 400, "response_format", 'combined with tool_choice "required"'),
    ("named and guided_regex", CHATP, dict(M, tools=[TOOL], tool_choice=NAMED_F, guided_regex="a+"), 400,
     "guided_regex", "cannot be combined with tool_choice"),
    ("required tool schema", CHATP, dict(M, tools=[TOOL, BAD_TOOL], tool_choice="required"), 400,
     "tools[1].function.parameters", "invalid"),
    ("named tool schema", CHATP, dict(M, tools=[TOOL, BAD_TOOL], tool_choice=NAMED_G), 400,
     "tools[1].function.parameters", "invalid"),
    ("required tools' $defs", CHATP, dict(M, tools=[_defs_tool("f", "integer"), _defs_tool("g", "string")],
     tool_choice="required"), 400, "tools[1].function.parameters", "differs from another tool's $defs.X"),
    ("tools twice", CHATP, dict(M, tools=[TOOL, TOOL]), 400, "tools", "twice"),
    ("tool parameters", CHATP, dict(M, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
     400, "tools[0].function.parameters", "JSON schema of an object"),
    ("tool name", CHATP, dict(M, tools=[{"type": "function", "function": {"name": "a b"}}]), 400,
     "tools[0].function.name", "letters, digits"),
    ("bad schema", CHATP, dict(M, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}), 400, "response_format.json_schema.schema", "invalid"),
    ("json_schema missing", CHATP, dict(M, response_format={"type": "json_schema"}), 400,
     "response_format.json_schema", "exactly when type"),
    ("two guides", CMPL, dict(C, guided_regex="a+", guided_choice=["a"]), 400, "guided_choice", "cannot be combined"),
    ("bad regex", CMPL, dict(C, guided_regex="(a"), 400, "guided_regex", "invalid"),
    ("guided ignore_eos", CMPL, dict(C, guided_choice=["a"], ignore_eos=True), 400, "ignore_eos", "guided"),
    # wrong JSON types: nothing is coerced
    ("chat stream yes", CHATP, dict(M, stream="yes"), 400, "stream", 'stream must be true or false, not "yes"'),
    ("max_tokens string", CMPL, dict(C, max_tokens="5"), 400, "max_tokens", "must be an integer"),
    ("max_tokens float", CMPL, dict(C, max_tokens=5.0), 400, "max_tokens", "must be an integer"),
    ("temperature string", CMPL, dict(C, temperature="0.5"), 400, "temperature", "must be a number"),
    ("ignore_eos 1", CMPL, dict(C, ignore_eos=1), 400, "ignore_eos", "must be true or false, not 1"),
    ("seed bool", CMPL, dict(C, seed=True), 400, "seed", "must be an integer, not true"),
    ("stop_token_ids entry", CMPL, dict(C, stop_token_ids=[1, "2"]), 400, "stop_token_ids[1]", "an integer"),
    ("model number", CMPL, dict(C, model=1), 400, "model", "must be a string"),
    # chat messages
    ("role wizard", CHATP, dict(M, messages=[{"role": "wizard", "content": "w1"}]), 400, "messages[0].role",
     "'system', 'user', 'assistant', 'tool' or 'developer'"),
    ("user without content", CHATP, dict(M, messages=[CHAT[0], {"role": "user"}]), 400, "messages[1].content",
     "is required"),
    ("null content", CHATP, dict(M, messages=[{"role": "system", "content": None}]), 400, "messages[0].content",
     "a string or a list of text parts"),
    ("assistant tool_calls", CHATP,
     dict(M, messages=USER + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]), 400,
     "messages[1].tool_calls[0].type", "is required"),
    ("image part", CHATP, dict(M, messages=[{"role": "user", "content": [{"type": "text", "text": "w1"}, IMAGE]}]),
     400, "messages[0].content[1].type", "'image_url' is not supported: this model reads text only"),
    ("audio part", CHATP, dict(M, messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), 400,
     "messages[0].content[0].type", "reads text only"),
    ("message unknown key", CHATP, dict(M, messages=[dict(USER[0], mood="x")]), 400, "messages[0].mood",
     "unknown field"),
    ("message not an object", CHATP, dict(M, messages=["w1"]), 400, "messages[0]", "must be an object"),
    ("no messages", CHATP, dict(M, messages=[]), 400, "messages", "must not be empty"),
    # stream_options
    ("stream_options without stream", CHATP, dict(M, stream_options={"include_usage": True}), 400, "stream_options",
     "only allowed when stream is true"),
    ("continuous_usage_stats", CMPL, dict(C, stream=True, stream_options={"continuous_usage_stats": True}), 400,
     "stream_options.continuous_usage_stats", "is not supported"),
    ("stream_options unknown key", CMPL, dict(C, stream=True, stream_options={"usage": True}), 400,
     "stream_options.usage", "unknown field"),
    # prompt shapes
    *[
        (f"prompt {p!r}", CMPL, dict(C, prompt=p), 400, "prompt",
         "prompt must be a string, a list of token ids, or a list of strings or token-id lists")
        for p in (5, [1, "a"], [[1, 2], [3, "x"]], [], [[]], True, [True, 2], None)
    ],
    ("no prompt", CMPL, dict(model=MODEL), 400, "prompt", "prompt is required"),
    # stop strings
    ("stop entry", CMPL, dict(C, stop=["w1", 5]), 400, "stop[1]", "must be a string"),
    ("stop empty", CMPL, dict(C, stop=["w1", ""]), 400, "stop", "empty string"),
    # bodies
    ("empty body", CMPL, b"", 400, None, "the request body must be a JSON object; it is empty"),
    ("not JSON", CHATP, b"{model", 400, None, "not valid JSON"),
    ("array body", CMPL, b"[1, 2]", 400, None, "must be a JSON object, not an array"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,status,param,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_requests_are_refused(server, path, body, status, param, text):
    r = _post(server, path, body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and text in err["message"], err
    assert "\n" not in err["message"]


def test_json_as_text_plain_is_415(server):
    r = _post(server, CMPL, dict(C), headers={"content-type": "text/plain"})
    assert r.status_code == 415, r.text
    assert "'text/plain'" in r.json()["error"]["message"]


def test_off_values_are_accepted_and_change_nothing(server):
    off = dict(presence_penalty=0, frequency_penalty=0.0, logit_bias=None, n=1, logprobs=None, echo=False, user="u7")
    for body in (C, dict(C, **off)):
        r = _post(server, CMPL, body, headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == server.expect["text"]
    chat_off = dict(off, tools=[], tool_choice="none", response_format={"type": "text"}, temperature=0)
    chat_off.pop("echo")
    # a developer message is the template's system message; text parts are joined
    dev = [{"role": "developer", "content": [{"type": "text", "text": "w7 "}, {"type": "text", "text": "w8"}]}]
    for body in (dict(M, messages=CHAT), dict(M, messages=dev + CHAT[1:], **chat_off)):
        r = _post(server, CHATP, body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == server.expect["chat"]
    _idle(server)


def test_good_request_after_the_bad_ones(server):
    """Runs last: no refused request left anything in the engine, which answers as before."""
    _idle(server)
    r = _post(server, CMPL, dict(C, stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert '"completion_tokens":4' in r.text
    r = _post(server, CMPL, C)
    assert r.json()["choices"][0]["token_ids"] == server.expect["text"]
    _idle(server)
