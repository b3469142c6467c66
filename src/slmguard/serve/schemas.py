"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Owns validation of what clients send (strict types: ``"5"`` is not an
integer; unknown fields are ignored as OpenAI clients send many) and the
documented shapes of what the server answers, which make up ``/openapi.json``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "seed", "n")


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_In):
    type: Literal["text"]
    text: str


class ChatMessageIn(_In):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_In):
    include_usage: bool = False


class _Sampling(_In):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(default=None)
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        # JSON Schema counts 2.0 as an integer; "2" and 2.5 still fail strict validation.
        if isinstance(data, dict):
            for name in _INT_FIELDS:
                value = data.get(name)
                if isinstance(value, float) and value.is_integer():
                    data = {**data, name: int(value)}
        return data

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


SESSION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Checked in the route (400 invalid_session_id), documented here.
    session_id: str | None = Field(
        default=None,
        description="keep this conversation's history on the server (slmguard extension); "
        "the X-Session-Id header does the same",
        json_schema_extra={"pattern": SESSION_ID_PATTERN},
    )


class CompletionRequest(_Sampling):
    prompt: str
    max_tokens: int | None = Field(default=16, ge=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "slmguard"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class MemoryFigures(BaseModel):
    worker_rss_bytes: int | None
    worker_rss_anon_bytes: int | None
    worker_rss_file_bytes: int | None
    front_rss_bytes: int | None


class Health(BaseModel):
    state: Literal["loading", "ready", "degraded", "restarting", "parked", "failed", "stopped"]
    model: str
    model_path: str
    n_ctx: int
    worker_pid: int | None
    worker_restarts: int
    queue_depth: int
    busy: bool
    memory: MemoryFigures
    degraded_reasons: dict[str, str]
    extra: dict[str, object] = Field(default_factory=dict)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
