"""A chat answer's text split into reasoning, content and tool calls, streamed or whole (pure text).

``ChatOutputParser(reasoning="think", tools=True)`` is fed the answer's text as it is decoded
(``feed(delta)``, then ``feed("", final=True)``) and returns :class:`Delta` events:

- reasoning (``REASONING_PARSERS``: ``"think"``): a ``<think>...</think>`` block at the start of the
  answer (after any whitespace) is ``reasoning_content``; the rest goes on;
- tools (Hermes style, as Qwen's templates ask for): each ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` block is an OpenAI tool call (a first event with its index, id, type and name,
  then one with its arguments as a JSON string); a block that is not such JSON stays content, and so
  does one left open at the end unless its JSON is complete;
- everything else is ``content``.

The tags never appear in what is returned. A partial tag at the end of what was fed (``"</thi"``) is
held back until the next delta says whether it is one, so that any chunking of the same text gives
the same events, concatenated, as ``parse(text)`` does at once.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Callable, Optional

from ..engine_config import REASONING_PARSERS

__all__ = ["REASONING_PARSERS", "ChatOutputParser", "Delta", "ParsedOutput", "parse"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass
class Delta:
    reasoning_content: str = ""
    content: str = ""
    tool_call: Optional[dict] = None  # one OpenAI stream entry: {"index", "id", "type", "function": {...}}


@dataclasses.dataclass
class ParsedOutput:
    reasoning_content: Optional[str]
    content: Optional[str]
    tool_calls: list[dict]  # OpenAI message entries: {"id", "type": "function", "function": {"name", "arguments"}}


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (a tag that may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _tool_call(body: str) -> Optional[tuple[str, str]]:
    """``(name, arguments as a JSON string)`` of a tool-call block's text, or None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutputParser:
    def __init__(self, reasoning: Optional[str] = None, tools: bool = False, call_id: Callable[[], str] = new_call_id):
        if reasoning not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {reasoning!r}")
        self.tools, self.call_id = tools, call_id
        self.phase = "start" if reasoning else "content"  # start -> think -> content; content <-> call
        self.buf = ""
        self.calls: list[dict] = []  # the calls found so far, as message entries

    def feed(self, text: str, final: bool = False) -> list[Delta]:
        self.buf += text
        out: list[Delta] = []
        while True:
            before = (self.buf, self.phase)
            out += getattr(self, "_" + self.phase)(final)
            if (self.buf, self.phase) == before or not self.buf:  # nothing more until more text comes
                break
        return [d for d in out if d.reasoning_content or d.content or d.tool_call]

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """The engine's finish reason as the answer's: an answer that stops after calling tools ends in "tool_calls"."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    # ----------------------------------------------------------------------------- phases
    def _start(self, final: bool) -> list[Delta]:
        s = self.buf.lstrip()
        if s.startswith(THINK_OPEN):
            self.buf, self.phase = s[len(THINK_OPEN) :], "think"
        elif final or not THINK_OPEN.startswith(s):  # no think block: all of it is the answer
            self.phase = "content"
        return []

    def _think(self, final: bool) -> list[Delta]:
        i = self.buf.find(THINK_CLOSE)
        if i >= 0:
            d = Delta(reasoning_content=self.buf[:i])
            self.buf, self.phase = self.buf[i + len(THINK_CLOSE) :], "content"
            return [d]
        keep = 0 if final else _partial_suffix(self.buf, THINK_CLOSE)
        d = Delta(reasoning_content=self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return [d]

    def _content(self, final: bool) -> list[Delta]:
        if not self.tools:
            d, self.buf = Delta(content=self.buf), ""
            return [d]
        i = self.buf.find(CALL_OPEN)
        if i >= 0:
            d = Delta(content=self.buf[:i])
            self.buf, self.phase = self.buf[i:], "call"  # the tag stays until the block is complete
            return [d]
        keep = 0 if final else _partial_suffix(self.buf, CALL_OPEN)
        d = Delta(content=self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return [d]

    def _call(self, final: bool) -> list[Delta]:
        i = self.buf.find(CALL_CLOSE)
        if i < 0 and not final:
            return []
        body = self.buf[len(CALL_OPEN) : i if i >= 0 else len(self.buf)]
        end = i + len(CALL_CLOSE) if i >= 0 else len(self.buf)
        call = _tool_call(body.strip())
        block, self.buf, self.phase = self.buf[:end], self.buf[end:], "content"
        if call is None:  # not a tool call: the block is text
            return [Delta(content=block)]
        name, args = call
        k, cid = len(self.calls), self.call_id()
        self.calls.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
        return [
            Delta(tool_call={"index": k, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}),
            Delta(tool_call={"index": k, "function": {"arguments": args}}),
        ]


def merge(deltas: list[Delta], calls: list[dict]) -> ParsedOutput:
    """The whole answer from its events: with tool calls, content is stripped; empty content is None."""
    reasoning = "".join(d.reasoning_content for d in deltas)
    content = "".join(d.content for d in deltas)
    if calls:  # the whitespace around the calls' blocks is not an answer
        content = content.strip()
    content = content or None
    return ParsedOutput(reasoning or None, content, list(calls))


def parse(text: str, reasoning: Optional[str] = None, tools: bool = False, call_id=new_call_id) -> ParsedOutput:
    """A whole answer at once: what the events of ``ChatOutputParser`` add up to."""
    p = ChatOutputParser(reasoning, tools, call_id)
    return merge(p.feed(text, final=True), p.calls)
