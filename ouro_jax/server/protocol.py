"""Request and response bodies of the OpenAI API subset we serve, as pydantic models.

Unknown fields are ignored (clients send many we do not use); fields we cannot honour (``n > 1``,
``logprobs``, ``best_of``...) are rejected with a clear message instead of being silently dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

# a prompt: text, token ids, or a list of either
PromptField = Union[str, list[int], list[Union[str, list[int]]]]


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions: OpenAI's, the engine's and Ouro's."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    logprobs: Optional[Any] = None
    # engine extras
    ignore_eos: bool = False
    top_k: int = 0
    stop_token_ids: Optional[list[int]] = None
    # Ouro's exit policy
    exit_threshold: Optional[float] = None
    min_loops: Optional[int] = None
    max_loops: Optional[int] = None
    exit_mode: Optional[str] = None
    synthetic_mean_loops: Optional[float] = None  # exit_mode="synthetic" (benchmarks on random weights)


class CompletionRequest(_Sampling):
    prompt: PromptField
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Optional[Literal["stop", "length", "abort"]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    exit_depths: list[int]
    logprobs: None = None
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
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    token_ids: list[int]
    exit_depths: list[int]
    logprobs: None = None
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
