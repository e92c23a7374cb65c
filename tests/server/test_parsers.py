"""The chat output parsers (``ouro_jax/server/parsers.py``; ``tool_calls.py``'s for forced calls) on
known text: reasoning, content and tool calls, whole and streamed in every chunking (hypothesis),
without an engine."""

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ouro_jax.server.parsers import ChatOutputParser, merge, parse
from ouro_jax.server.tool_calls import NamedCallParser, RequiredCallsParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "n": [1, 2]}}\n</tool_call>'
PIECES = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", CALL, '{"name": "f", "arguments": {}}', "hello ",
    "<", "</", "<thi", "<tool", "think>", "\n", " ", "x", "{", "é",
]  # fmt: skip


def _ids():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def _streamed(text, cuts, reasoning, tools):
    p = ChatOutputParser(reasoning, tools, _ids())
    deltas, last = [], 0
    for k in sorted(set(cuts)) + [len(text)]:
        deltas += p.feed(text[last:k])
        last = k
    deltas += p.feed("", final=True)
    return deltas, p.calls


def test_think_block_is_reasoning():
    r = parse("\n<think>I should greet.</think>Hello!", reasoning="think")
    assert (r.reasoning_content, r.content, r.tool_calls) == ("I should greet.", "Hello!", [])
    assert parse("Hello <think>x</think>", reasoning="think").content == "Hello <think>x</think>"  # not at the start
    assert parse("<think>cut off", reasoning="think").reasoning_content == "cut off"
    assert parse("<think>x</think>y").content == "<think>x</think>y"  # no parser: all content


def test_tool_calls_are_extracted():
    r = parse("Let me look." + CALL + "\n" + CALL.replace("Oslo", "Rome"), tools=True, call_id=_ids())
    assert r.content == "Let me look."
    assert [c["id"] for c in r.tool_calls] == ["call_0", "call_1"]
    f = r.tool_calls[1]["function"]
    assert f["name"] == "get_weather" and json.loads(f["arguments"]) == {"city": "Rome", "n": [1, 2]}
    assert parse(CALL, tools=True).content is None
    # not JSON of a call: the block stays text; an unclosed block with complete JSON is a call
    assert parse("<tool_call>oops</tool_call>", tools=True).content == "<tool_call>oops</tool_call>"
    assert parse('<tool_call>{"name": "f", "arguments": {}}', tools=True).tool_calls[0]["function"]["name"] == "f"
    r = parse("<think>plan</think>" + CALL, reasoning="think", tools=True)
    assert r.reasoning_content == "plan" and len(r.tool_calls) == 1 and r.content is None


def test_stream_deltas_as_openai_expects():
    deltas, _ = _streamed("Hi" + CALL, range(len("Hi" + CALL)), None, True)  # char by char
    assert "".join(d.content for d in deltas) == "Hi"
    first, second = [d.tool_call for d in deltas if d.tool_call]
    name = {"name": "get_weather", "arguments": ""}
    assert first == {"index": 0, "id": "call_0", "type": "function", "function": name}
    assert second["index"] == 0 and json.loads(second["function"]["arguments"])["city"] == "Oslo"
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert all(tag not in d.content + d.reasoning_content for d in deltas)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=12),
    st.lists(st.integers(0, 400), max_size=10),
    st.sampled_from([None, "think"]),
    st.booleans(),
)
def test_any_chunking_adds_up_to_the_whole(pieces, cuts, reasoning, tools):
    text = "".join(pieces)
    deltas, calls = _streamed(text, [c for c in cuts if c <= len(text)], reasoning, tools)
    assert merge(deltas, calls) == parse(text, reasoning, tools, _ids())


# ------------------------------------------------------------------------- forced tool calls
REQUIRED = '[{"name":"f","parameters":{"s":"}]\\"{[","n":[1,2]}},{"name":"g","parameters":{}}]'


def _feed_cut(parser, text, cut):
    return parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.feed("", final=True)


def test_required_calls_parser_in_any_two_pieces():
    """Each element of the array is one call, strings holding brackets and quotes included, for every
    cut of the text; an element cut short is no call."""
    for cut in range(len(REQUIRED) + 1):
        p = RequiredCallsParser(_ids())
        deltas = _feed_cut(p, REQUIRED, cut)
        assert [c["function"] for c in p.calls] == [
            {"name": "f", "arguments": '{"s":"}]\\"{[","n":[1,2]}'},
            {"name": "g", "arguments": "{}"},
        ]
        assert [d.tool_call for d in deltas][:2] == [
            {"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": ""}},
            {"index": 0, "function": {"arguments": '{"s":"}]\\"{[","n":[1,2]}'}},
        ]
        assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"
    p = RequiredCallsParser(_ids())
    p.feed(REQUIRED[:-20], final=True)
    assert [c["function"]["name"] for c in p.calls] == ["f"]


def test_named_call_parser_streams_the_arguments():
    p = NamedCallParser("f", _ids())
    deltas = p.feed('{"a"') + p.feed("") + p.feed(":1}", final=True)
    assert [d.tool_call for d in deltas] == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a"'}},
        {"index": 0, "function": {"arguments": ":1}"}},
    ]
    assert p.calls == [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]
    assert p.finish_reason("stop") == "stop"  # OpenAI's for a named tool_choice
