"""Forced tool calls: tool_choice "required" or a named function, as vLLM builds them. The answer is
decoded under a JSON schema (``ouro_jax/structured.py``) and read back as OpenAI tool calls:

- named (``{"type": "function", "function": {"name": "f"}}``): the answer is f's arguments, a JSON
  object valid under its ``parameters``; it streams as it is generated (the text is the arguments);
- ``"required"``: the answer is a JSON array of one or more ``{"name": ..., "parameters": {...}}``
  objects, each a call of one of the tools; a call is streamed once its element is complete.

The parsers take text as ``parsers.ChatOutputParser`` does (``feed(delta)``, then ``feed("",
final=True)``, the same events for any chunking) and give the answer's ``finish_reason``.
"""

from __future__ import annotations

import json
from typing import Callable, Optional, Union

from . import protocol as P
from .parsers import Delta, new_call_id

__all__ = ["NamedCallParser", "RequiredCallsParser", "forced_call_guide", "forced_call_parser"]

# OpenAI: a function without parameters takes none, so its arguments are {}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _parameters(tool: P.Tool) -> dict:
    return tool.function.parameters or NO_PARAMETERS


def _forced_tools(req: P.ChatCompletionRequest) -> list[tuple[int, P.Tool]]:
    """The tools the answer may call, with their index in ``tools``."""
    return [(i, t) for i, t in enumerate(req.tools) if req.named_tool in (None, t.function.name)]


def _call_schema(req: P.ChatCompletionRequest) -> dict:
    """The JSON schema of the answer that the request's tool_choice forces."""
    if req.named_tool is not None:
        ((_, tool),) = _forced_tools(req)
        return _parameters(tool)
    defs: dict[str, dict] = {}
    calls = []
    for i, tool in enumerate(req.tools):
        parameters = dict(_parameters(tool))
        # "#/$defs/..." references resolve from the root: each tool's definitions move there
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                field = f"tools[{i}].function.parameters"
                raise P.APIError(f"{field}.$defs.{name} differs from another tool's $defs.{name}", param=field)
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [tool.function.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if req.one_call:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def forced_call_guide(req: P.ChatCompletionRequest):
    """The ``GuidedDecoding`` of a forced call; a schema the grammar engine refuses is a 400 naming the
    tool's ``parameters``."""
    from ouro_jax.structured import GuidedDecoding

    def compile_schema(schema: dict, field: str):
        try:
            return GuidedDecoding.json_schema(schema)
        except ValueError as e:  # the grammar library's message can span lines
            raise P.APIError(f"{field}: {' '.join(str(e).split())}", param=field) from None

    for i, tool in _forced_tools(req):  # each tool alone first, so that an error names its tool
        compile_schema(_parameters(tool), f"tools[{i}].function.parameters")
    return compile_schema(_call_schema(req), "tools")


class NamedCallParser:
    """The answer is the named function's arguments: a first event with the call's index, id, type and
    name, then each piece of text as an argument fragment."""

    def __init__(self, name: str, call_id: Callable[[], str] = new_call_id):
        self.name, self.id = name, call_id()
        self.arguments = ""
        self.calls: list[dict] = []  # the call, once announced

    def feed(self, text: str, final: bool = False) -> list[Delta]:
        out = []
        if not self.calls:
            call = {"index": 0, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}}
            out.append(Delta(tool_call=call))
        self.arguments += text
        self.calls = [{"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}]
        if text:
            out.append(Delta(tool_call={"index": 0, "function": {"arguments": text}}))
        return out

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return reason  # OpenAI answers a named tool_choice with "stop", not "tool_calls"


class RequiredCallsParser:
    """The answer is a JSON array of ``{"name", "parameters"}`` objects: each element, once its closing
    brace arrives, is a call (two events, as ``ChatOutputParser`` gives them); an element cut short (by
    ``max_tokens`` or a stop string) is dropped."""

    def __init__(self, call_id: Callable[[], str] = new_call_id):
        self.call_id = call_id
        self.calls: list[dict] = []
        self.element = ""  # the text of the array element being generated
        self.depth = 0  # brackets and braces open, outside strings
        self.in_string = self.escaped = False

    def feed(self, text: str, final: bool = False) -> list[Delta]:
        out = []
        for ch in text:
            structural = not self.in_string and ch in "[]{}"
            self._track_string(ch)
            if structural and ch in "[{":
                self.depth += 1
            if self.depth >= 2:  # inside an element (the array is depth 1), its braces included
                self.element += ch
            if structural and ch in "]}":
                self.depth -= 1
                if self.depth == 1:
                    out += self._call(self.element)
                    self.element = ""
        return out

    def _track_string(self, ch: str) -> None:
        if self.escaped:
            self.escaped = False
        elif self.in_string and ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = not self.in_string

    def _call(self, element: str) -> list[Delta]:
        obj = json.loads(element)
        name, args = obj["name"], json.dumps(obj["parameters"], ensure_ascii=False, separators=(",", ":"))
        k, cid = len(self.calls), self.call_id()
        self.calls.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
        return [
            Delta(tool_call={"index": k, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}),
            Delta(tool_call={"index": k, "function": {"arguments": args}}),
        ]

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if reason == "stop" and self.calls else reason


def forced_call_parser(req: P.ChatCompletionRequest) -> Union[NamedCallParser, RequiredCallsParser, None]:
    """The parser of a forced call's answer; None when tool_choice forces no call."""
    if req.named_tool is not None:
        return NamedCallParser(req.named_tool)
    return RequiredCallsParser() if req.tool_choice == "required" else None
