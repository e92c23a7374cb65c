"""Request and response bodies of the OpenAI API subset we serve, as pydantic models.

Requests are strict: a field we do not know, a value of the wrong JSON type (no coercion: ``"5"`` is
not 5, ``1`` is not ``true``), a message role outside OpenAI's or a non-text content part is refused
with a 400 whose one-line message names the field by its JSON path (``messages[1].role``) and says
what it accepts (``parse_request``, ``explain``). OpenAI fields we do not implement are listed in
``NOT_IMPLEMENTED``: their "off" values are accepted, since common clients send them explicitly; any
other value is refused by name. A ``developer`` message is a ``system`` message to the chat template.
"""

from __future__ import annotations

import difflib
import json
import re
import time
import uuid
from typing import Any, ClassVar, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from scheduler.sampling_params import MAX_LOGPROBS

# OpenAI request fields we do not implement, each with the values (besides null) that ask for
# nothing: clients send those explicitly, so they are accepted and dropped; anything else is refused.
# One table for both endpoints: a field of the other endpoint is refused the same way.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),  # without tools either value asks for nothing
    "functions": ([],),
    "function_call": ("none",),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "metadata": ({},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}

ROLES = ("system", "user", "assistant", "tool", "developer")
PROMPT_SHAPES = "a string, a list of token ids, or a list of strings or token-id lists"


def _is_off(value, offs: tuple) -> bool:
    # bool is an int in Python: false must not pass for 0, nor 1 for true
    return value is None or any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in offs)


def _refuse(message: str, at: tuple = ()) -> PydanticCustomError:
    """A validation error whose message follows the field's name; ``at``: its path below the value checked."""
    return PydanticCustomError("refused", "{message}", {"message": message, "at": at})


def _show(value) -> str:
    s = json.dumps(value, default=repr)
    return s if len(s) <= 40 else s[:37] + "..."


class _Strict(BaseModel):
    """No coercion and no unknown fields; ``not_implemented`` fields are dropped when off."""

    model_config = ConfigDict(strict=True, extra="forbid")
    not_implemented: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _drop_off_fields(cls, data):
        offs = cls.not_implemented
        if isinstance(data, dict) and offs:  # values left here are refused as extra fields
            data = {k: v for k, v in data.items() if not (k in offs and _is_off(v, offs[k]))}
        return data


class StreamOptions(_Strict):
    not_implemented: ClassVar[dict[str, tuple]] = {"continuous_usage_stats": (False,)}  # vLLM's

    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` or not, it is enforced)."""

    name: str
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise _refuse('json_schema is given exactly when type is "json_schema"', at=("json_schema",))
        return self


# vLLM's spellings of structured outputs, besides response_format
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class _Sampling(_Strict):
    """Fields shared by completions and chat completions: OpenAI's, the engine's and Ouro's."""

    not_implemented: ClassVar[dict[str, tuple]] = NOT_IMPLEMENTED

    model: str
    n: int = Field(default=1, ge=1)  # choices per prompt (the server's max_n bounds it)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[list[str]] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # an opaque end-user id
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    # logit processing (OpenAI's, then vLLM's extras), on the device: SamplingParams
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None  # token id (a JSON key: a string) -> bias
    repetition_penalty: Optional[float] = None
    min_p: Optional[float] = None
    min_tokens: int = 0
    # engine extras
    ignore_eos: bool = False
    top_k: int = 0
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False  # vLLM's: keep the stop string that ended the text
    # structured outputs (ouro_jax/structured.py): at most one of these
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # Ouro's exit policy
    exit_threshold: Optional[float] = None
    min_loops: Optional[int] = None
    max_loops: Optional[int] = None
    exit_mode: Optional[str] = None
    synthetic_mean_loops: Optional[float] = None  # exit_mode="synthetic" (benchmarks on random weights)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, str):
            return [v]  # one stop string is a list of one
        if v is not None and not isinstance(v, list):
            raise _refuse(f"must be a string or a list of strings, not {_show(v)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        for k in v or ():
            if not k.isdigit():
                raise _refuse(f"keys must be token ids, not {_show(k)}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        if v is not None and not all(v):
            raise _refuse("must not hold an empty string")
        return v

    @property
    def guide_fields(self) -> list[str]:
        """The structured-output fields the request sets (``response_format`` "text" asks for nothing)."""
        given = [f for f in GUIDED_FIELDS if getattr(self, f) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        return given

    @model_validator(mode="after")
    def _one_guide(self):
        given = self.guide_fields
        if len(given) > 1:
            raise _refuse(f"cannot be combined with {given[0]}: give one structured-output constraint", at=(given[1],))
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise _refuse("is only allowed when stream is true", at=("stream_options",))
        return self


def _token_ids(v) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(type(t) is int for t in v)  # bools are not token ids


class CompletionRequest(_Sampling):
    not_implemented: ClassVar[dict[str, tuple]] = {
        k: v for k, v in NOT_IMPLEMENTED.items() if k not in ("logprobs", "best_of")
    }

    prompt: Union[str, list[int], list[Union[str, list[int]]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    best_of: Optional[int] = Field(default=None, ge=1)  # choices made, the n likeliest returned

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of < self.n:
            raise _refuse(f"must be at least n ({self.n}), not {self.best_of}", at=("best_of",))
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise _refuse("larger than n cannot be streamed (the choices are ranked at the end)", at=("best_of",))
        return self

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt_shape(cls, v):
        # checked by hand: a union's validation errors would list every branch
        if isinstance(v, str) or _token_ids(v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, str) or _token_ids(p) for p in v):
            return v
        raise _refuse(f"must be {PROMPT_SHAPES}, not {_show(v)}")


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        t = data.get("type") if isinstance(data, dict) else None
        if isinstance(t, str) and t != "text":
            raise _refuse(f"'{t}' is not supported: this model reads text only", at=("type",))
        return data


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    not_implemented: ClassVar[dict[str, tuple]] = {"function_call": ()}

    role: Literal[ROLES]
    content: Optional[list[TextPart]]  # required; null only in an assistant message with tool_calls
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant message's
    tool_call_id: Optional[str] = None  # a tool message's

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise _refuse(
                "must be a string or a list of text parts (null only in an assistant message with tool_calls)",
                at=("content",),
            )
        if self.tool_calls and self.role != "assistant":
            raise _refuse("belongs to assistant messages only", at=("tool_calls",))
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _content_parts(cls, v):
        if v is None:
            return v
        if isinstance(v, str):
            return [{"type": "text", "text": v}]  # one shape inside: a string is one text part
        if not isinstance(v, list):
            raise _refuse(f"must be a string or a list of text parts, not {_show(v)}")
        return v


_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule


class FunctionDef(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not _FUNCTION_NAME.match(v):
            raise _refuse(f"must be 1 to 64 letters, digits, '_' or '-', not {_show(v)}")
        return v

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v):
        if v is not None and v.get("type") != "object":
            raise _refuse(f'must be a JSON schema of an object ("type": "object"), not {_show(v)}')
        return v


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


TOOL_CHOICE_MODES = ("none", "auto", "required")


class ChatCompletionRequest(_Sampling):
    # tools and tool_choice are implemented here; the completions endpoint refuses them
    not_implemented: ClassVar[dict[str, tuple]] = {
        k: v
        for k, v in NOT_IMPLEMENTED.items()
        if k not in ("tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs")
    }

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)  # needs logprobs
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None  # false: one call at most (default: any number)

    @property
    def one_call(self) -> bool:
        """``parallel_tool_calls`` false: the answer makes at most one tool call."""
        return self.parallel_tool_calls is False

    @model_validator(mode="after")
    def _tools(self):
        names = [t.function.name for t in self.tools or ()]
        dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if dup is not None:
            raise _refuse(f"name the function {_show(dup)} twice", at=("tools",))
        c = self.tool_choice
        if isinstance(c, str) and c not in TOOL_CHOICE_MODES:
            raise _refuse(f"must be one of {', '.join(TOOL_CHOICE_MODES)} or a named function", at=("tool_choice",))
        if isinstance(c, dict):
            f = c.get("function")
            named = c.get("type") == "function" and isinstance(f, dict) and isinstance(f.get("name"), str)
            if not named or set(c) != {"type", "function"} or set(f) != {"name"}:
                raise _refuse('must be {"type": "function", "function": {"name": ...}}', at=("tool_choice",))
            if f["name"] not in names:
                raise _refuse(f"names {_show(f['name'])}, which is not in tools", at=("tool_choice",))
        if c not in (None, "none") and not names:
            raise _refuse(f"{_show(c)} needs tools", at=("tool_choice",))
        if self.forces_call and self.guide_fields:
            raise _refuse(
                f"cannot be combined with tool_choice {_show(c)}: the forced call is the output's one constraint",
                at=(self.guide_fields[0],),
            )
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise _refuse("needs logprobs to be true", at=("top_logprobs",))
        return self

    @property
    def engine_logprobs(self) -> Optional[int]:
        """``SamplingParams.logprobs`` of the request: None when not asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def render_tools(self) -> bool:
        """The tools go into the prompt: the model sees them unless tool_choice is "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def parse_tools(self) -> bool:
        """Tool calls are parsed from free text (tool_choice "auto", the default)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @property
    def named_tool(self) -> Optional[str]:
        """The function a named tool_choice forces the answer to call."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    @property
    def forces_call(self) -> bool:
        """tool_choice "required" or a named function: the answer is constrained to tool calls."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)


# ------------------------------------------------------------------------- request errors
# what a value of each pydantic type error should have been
_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _path(loc) -> str:
    """``("messages", 1, "role")`` as ``messages[1].role``."""
    s = ""
    for k in loc:
        s += f"[{k}]" if isinstance(k, int) else (f".{k}" if s else str(k))
    return s


def _model_at(model: type[BaseModel], loc) -> type[BaseModel]:
    """The model whose fields the object at ``loc`` holds."""
    for k in loc:
        if isinstance(k, int):
            continue
        field = model.model_fields.get(k)
        sub = _submodel(field.annotation) if field is not None else None
        if sub is None:
            break
        model = sub
    return model


def _submodel(annotation) -> Optional[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_submodel, get_args(annotation)) if m is not None), None)


def explain(errors: list[dict], model: type[BaseModel]) -> tuple[str, Optional[str]]:
    """Pydantic's ``errors()`` for a ``model`` as one line naming the field and what it accepts, and
    that field's JSON path (OpenAI's ``param``). One error, one fix at a time: a field we do not take
    first (``tool_calls`` explains a null ``content``), else the first."""
    e = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    typ, loc, ctx = e["type"], list(e["loc"]), e.get("ctx") or {}
    if typ == "refused":
        loc += ctx["at"]
    param = _path(loc) or None
    name = param or "the request body"
    if typ == "refused":
        return f"{name} {ctx['message']}", param
    if typ == "missing":
        return f"{name} is required", param
    if typ == "extra_forbidden":
        owner, key = _model_at(model, loc[:-1]), loc[-1]
        if key in owner.not_implemented:
            offs = " or ".join(_show(o) for o in (None, *owner.not_implemented[key]))
            return f"{name} is not supported (only {offs} is accepted)", param
        close = difflib.get_close_matches(str(key), list(owner.model_fields), n=1)
        return f"unknown field '{name}'" + (f"; did you mean '{close[0]}'?" if close else ""), param
    if typ in _EXPECTED:
        return f"{name} must be {_EXPECTED[typ]}, not {_show(e['input'])}", param
    if typ == "literal_error":
        return f"{name} must be {ctx['expected']}, not {_show(e['input'])}", param
    if typ in ("greater_than_equal", "less_than_equal"):
        op, bound = (">=", ctx.get("ge")) if typ == "greater_than_equal" else ("<=", ctx.get("le"))
        return f"{name} must be {op} {bound}, not {_show(e['input'])}", param
    if typ == "too_short" and ctx.get("min_length") == 1:
        return f"{name} must not be empty", param
    return f"{name}: {e['msg']}", param


_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_request(model: type[_Strict], body: bytes, content_type: Optional[str]) -> _Strict:
    """An HTTP request body as ``model``, or an :class:`APIError` saying in one line what is wrong."""
    media = (content_type or "application/json").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(
            f"the request body must be JSON (Content-Type: application/json), not {media!r}",
            status=415,
            code="unsupported_media_type",
        )
    if not body.strip():
        raise APIError("the request body must be a JSON object; it is empty")
    try:
        obj = json.loads(body, parse_constant=_not_json)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body must be a JSON object; it is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise APIError(f"the request body must be a JSON object, not {_JSON_TYPES[type(obj)]}")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        message, param = explain(e.errors(include_url=False), model)
        raise APIError(message, param=param) from None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Optional[Literal["stop", "length", "abort", "tool_calls"]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    exit_depths: list[int]
    logprobs: Optional[dict] = None  # {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    prompt_logprobs: Optional[list] = None  # vLLM's: None, then {token id: {logprob, decoded_token}}
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict]] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    token_ids: list[int]
    exit_depths: list[int]
    logprobs: Optional[dict] = None  # {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}
    prompt_logprobs: Optional[list] = None  # vLLM's: None, then {token id: {logprob, decoded_token}}
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ouro-jax"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` body with ``status``."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
