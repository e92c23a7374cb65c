"""A random preset chats out of the box: ``LLM("tiny")`` and ``ouro-jax serve tiny`` use the preset
tokenizer and chat template (``weights/tokenizer.py``); tools are accepted, rendered into the prompt
and refused when invalid. One in-process server of the ``tiny`` preset (no checkpoint folder). The
random model's free output cannot be steered, so the reasoning and tool-call parsers are tested on
known text in ``test_parsers.py``; here how the server takes tools and answers, and what constrained
output (structured outputs, forced tool calls) must satisfy whatever the weights."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from scheduler import SamplingParams  # noqa: E402
from tests.server.conftest import ENGINE  # noqa: E402

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def server():
    from ouro_jax.server.run import BackgroundServer, make_state
    from ouro_jax.server.startup import build_engine

    llm, _ = build_engine(MODEL, dict(ENGINE, max_model_len=512))  # a token per character: long prompts
    # a text prompt through LLM, before the server's engine thread owns the engine
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and isinstance(out.text, str)
    assert out.text == llm.tokenizer.decode(out.token_ids)
    state = make_state(llm, MODEL, MODEL, max_queue=16)
    srv = BackgroundServer(state).start()
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)
    yield srv
    srv.stop(timeout=30)


def _post(srv, **body):
    return httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)


def test_preset_chats(server):
    r = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=5, temperature=0
    )
    ch = r.choices[0]
    assert isinstance(ch.message.content, str) and ch.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 5
    ids = ch.model_extra["token_ids"]
    assert ch.message.content == server.state.llm.tokenizer.decode(ids)
    # the turn ends at <|im_end|>: the chat request stops there
    assert server.state.llm.tokenizer.token_to_id("<|im_end|>") in server.state.llm.scheduler_config.eos_token_ids
    # a text completion decodes too
    r = server.client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0)
    assert isinstance(r.choices[0].text, str)


def test_tools_are_rendered_into_the_prompt(server, monkeypatch):
    seen = []
    encode = server.state.encode_text
    monkeypatch.setattr(server.state, "encode_text", lambda text: seen.append(text) or encode(text))
    messages = [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    r = server.client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=3, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert "<tools>" in seen[-1] and '"name": "get_weather"' in seen[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in seen[-1]
    assert seen[-1].endswith("<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n")
    # tool_choice "none": the tools are not shown to the model
    r = _post(server, messages=messages[:1], tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert r.status_code == 200 and "<tools>" not in seen[-1]
    # a forced call: the model sees the tools too
    r = _post(server, messages=messages[:1], tools=[WEATHER], tool_choice="required", max_tokens=2)
    assert r.status_code == 200 and '"name": "get_weather"' in seen[-1]
    # refused: parameters that are not an object schema
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    r = _post(server, messages=messages[:1], tools=[bad], max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters"


ANSWER = "<think>The user wants weather.</think>Checking." + (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def test_answer_assembly_on_known_text(server, monkeypatch):
    """The model's text replaced by a known answer (the decode of whatever it generates): the response
    splits it into reasoning, content and tool calls, whole and streamed."""
    tok = server.state.llm.tokenizer

    class Known:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids):  # the known answer, revealed one char per token generated
            return ANSWER[: len(ids) * 12] if len(ids) < 12 else ANSWER

    monkeypatch.setattr(server.state, "reasoning_parser", "think")
    monkeypatch.setattr(server.state.llm, "tokenizer", Known())
    body = dict(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], max_tokens=12, temperature=0)
    body.update(ignore_eos=True, stop=["</tool_call>"])  # the answer stops (not at length) after the call
    m = _post(server, **body).json()["choices"][0]
    assert m["finish_reason"] == "tool_calls"
    msg = m["message"]
    assert msg["reasoning_content"] == "The user wants weather." and msg["content"] == "Checking."
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    # streamed through the openai client: the same pieces
    stream = server.client.chat.completions.create(
        model=MODEL, stream=True, messages=body["messages"], tools=[WEATHER], max_tokens=12, temperature=0,
        stop=["</tool_call>"], extra_body={"ignore_eos": True},
    )  # fmt: skip
    reasoning, content, args, names, finish = "", "", "", [], None
    for ch in stream:
        d = ch.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or ():
            names += [tc.function.name] if tc.function.name else []
            args += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert (reasoning, content, names, args) == (
        "The user wants weather.",
        "Checking.",
        ["get_weather"],
        '{"city": "Oslo"}',
    )
    assert finish == "tool_calls"


def test_parallel_tool_calls_false_keeps_one_call(server, monkeypatch):
    """An answer of two calls: both by default, the first only with parallel_tool_calls false (the
    answer ends at its first </tool_call>)."""
    tok = server.state.llm.tokenizer
    two = ANSWER + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'

    class Known:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids):
            return two[: len(ids) * 12] if len(ids) < 16 else two

    monkeypatch.setattr(server.state.llm, "tokenizer", Known())
    body = dict(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], max_tokens=16, temperature=0)
    body.update(ignore_eos=True)
    calls = _post(server, **body).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Oslo", "Rome"]
    m = _post(server, **body, parallel_tool_calls=False).json()["choices"][0]
    assert [json.loads(c["function"]["arguments"])["city"] for c in m["message"]["tool_calls"]] == ["Oslo"]
    assert m["finish_reason"] == "tool_calls" and len(m["token_ids"]) < 16


# ------------------------------------------------------------------------- structured outputs
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "n"],
    "additionalProperties": False,
}


def test_response_format_json_schema_and_vllm_guides(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    for seed in (None, 1, 2):
        kw = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
        r = server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "pick"}], max_tokens=60, response_format=fmt, **kw
        )
        ch = r.choices[0]
        d = json.loads(ch.message.content)
        assert ch.finish_reason == "stop" and d["color"] in ("red", "blue") and 0 <= d["n"] <= 9, ch
    r = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=60, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = server.client.completions.create(
        model=MODEL, prompt="a", max_tokens=10, temperature=0, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    # streamed, the same text arrives in pieces
    s = server.client.completions.create(
        model=MODEL, prompt="b", max_tokens=20, temperature=0, stream=True, extra_body={"guided_regex": "[a-c]{4}"}
    )
    text = "".join(c.choices[0].text for c in s if c.choices)
    assert len(text) == 4 and set(text) <= set("abc"), text


# ------------------------------------------------------------------------- forced tool calls
FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "alerts": {"type": "boolean"},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["utc", "cet"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Oslo?"}]
SAMPLINGS = [dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=2)]


def _forecast_arguments(args: str) -> None:
    """FORECAST's parameters schema, checked by hand."""
    d = json.loads(args)
    assert {"city", "unit", "days"} <= set(d) <= {"city", "unit", "days", "alerts"}, args
    assert isinstance(d["city"], str) and len(d["city"]) <= 6 and d["unit"] in ("c", "f"), args
    assert type(d["days"]) is int and 1 <= d["days"] <= 7 and type(d.get("alerts", True)) is bool, args


def _clock_arguments(args: str) -> None:
    assert json.loads(args) in ({"tz": "utc"}, {"tz": "cet"}), args


CHECK_ARGUMENTS = {"forecast": _forecast_arguments, "clock": _clock_arguments}


def _accumulated(stream):
    """A stream as the openai client puts it together (``client.chat.completions.stream``'s state), its
    usage, and how many chunks carried tool-call deltas."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    acc, chunks = ChatCompletionStreamState(), list(stream)
    for ch in chunks:
        acc.handle_chunk(ch)
    n_call_chunks = sum(bool(ch.choices and ch.choices[0].delta.tool_calls) for ch in chunks)
    return acc.get_final_completion(), chunks[-1].usage, n_call_chunks


@pytest.fixture
def short_prompts(server, monkeypatch):
    """The chat template without the tools: two tools' schemas would not fit in the preset's 512
    positions beside an answer (that they are rendered is test_tools_are_rendered_into_the_prompt's)."""
    template = server.state.chat_template

    class WithoutTools:
        def render(self, messages, add_generation_prompt=True, **kwargs):
            return template.render(messages, add_generation_prompt=add_generation_prompt)

    monkeypatch.setattr(server.state, "chat_template", WithoutTools())


def test_named_tool_choice_forces_a_valid_call(server, short_prompts):
    named = {"type": "function", "function": {"name": "forecast"}}
    body = dict(model=MODEL, messages=ASK, tools=[FORECAST, CLOCK], tool_choice=named, max_tokens=100)
    for kw in SAMPLINGS:
        r = server.client.chat.completions.create(**body, **kw)
        ch = r.choices[0]
        assert ch.finish_reason == "stop" and ch.message.content is None, ch
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "forecast"
        _forecast_arguments(call.function.arguments)
        assert call.function.arguments == server.state.llm.tokenizer.decode(ch.model_extra["token_ids"])
    # streamed (greedy, as the first answer): the same arguments, in pieces
    greedy = server.client.chat.completions.create(**body, **SAMPLINGS[0])
    stream = server.client.chat.completions.create(
        **body, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    final, usage, n_call_chunks = _accumulated(stream)
    ch = final.choices[0]
    (call,) = ch.message.tool_calls
    assert ch.finish_reason == "stop" and call.id.startswith("call_") and call.function.name == "forecast"
    assert call.function.arguments == greedy.choices[0].message.tool_calls[0].function.arguments
    assert usage == greedy.usage and n_call_chunks > 2


@pytest.mark.slow
def test_required_tool_choice_forces_calls(server, short_prompts):
    body = dict(model=MODEL, messages=ASK, tools=[FORECAST, CLOCK], tool_choice="required", max_tokens=200)
    for kw in SAMPLINGS:
        ch = server.client.chat.completions.create(**body, **kw).choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls, ch
        for call in ch.message.tool_calls:
            assert call.id.startswith("call_")
            CHECK_ARGUMENTS[call.function.name](call.function.arguments)
    greedy = server.client.chat.completions.create(**body, **SAMPLINGS[0])
    stream = server.client.chat.completions.create(
        **body, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    final, usage, _ = _accumulated(stream)
    calls = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
    assert calls == [(c.function.name, c.function.arguments) for c in greedy.choices[0].message.tool_calls]
    assert final.choices[0].finish_reason == "tool_calls" and usage == greedy.usage
    # parallel_tool_calls false: one call, whatever the sampling
    for kw in SAMPLINGS:
        ch = server.client.chat.completions.create(**body, **kw, parallel_tool_calls=False).choices[0]
        assert len(ch.message.tool_calls) == 1 and ch.finish_reason == "tool_calls", ch
    # and a plain request afterwards is answered as before
    r = server.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0)
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.tool_calls is None
