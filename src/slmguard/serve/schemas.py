"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Owns what clients may send and the documented shapes of what the server
answers (``/openapi.json``). Requests are validated strictly (``"5"`` is not
an integer) and **every field must be known**: a field llama-server does not
implement is refused with 400 naming it (code ``unsupported_parameter``)
instead of being accepted and silently ignored. What is accepted is passed to
the engine unchanged, apart from the rewrites the front owns (``max_tokens``
capped, a session's history prepended, ``model`` set to the engine's alias).

The accepted set is the OpenAI fields llama-server implements plus a few
llama.cpp sampling extensions (``top_k``, ``min_p``, ``typical_p``,
``repeat_penalty``, ``repeat_last_n``, ``mirostat*``, ``grammar``,
``json_schema``, ``chat_template_kwargs``), and slmguard's ``session_id``.
Refused on purpose (llama-server ignores or lacks them): ``user``, ``store``,
``metadata``, ``service_tier``, ``modalities``, ``audio``, ``prediction``,
``functions``/``function_call``, a named ``tool_choice`` object, non-text
message parts, ``best_of``, ``suffix``, ``echo: true``, embeddings'
``dimensions``, and llama.cpp's own ``n_predict``/``id_slot``/``lora`` (they
would bypass the front's limits).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "seed", "n", "top_logprobs", "top_k")
SESSION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
MAX_STOPS = 4


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_In):
    type: Literal["text"]
    text: str


class ToolCallFunction(_In):
    name: str = Field(min_length=1, max_length=256)
    arguments: str


class ToolCall(_In):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessageIn(_In):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessageIn:
        if self.role == "tool" and (self.tool_call_id is None or self.content is None):
            raise ValueError("a tool message needs tool_call_id and content")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("tool_call_id belongs to tool messages only")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages only")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        if self.role in ("system", "developer", "user") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(_In):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_In):
    type: Literal["function"]
    function: FunctionDef


class JSONSchemaSpec(_In):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_In):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs its json_schema object")
        return self


class StreamOptions(_In):
    include_usage: bool = False


class _Sampling(_In):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, description="at most the engine's slot count")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None)
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # llama.cpp sampling extensions
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    typical_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, ge=0.0, le=10.0)
    repeat_last_n: int | None = Field(default=None, ge=-1)
    mirostat: Literal[0, 1, 2] | None = None
    mirostat_tau: float | None = Field(default=None, ge=0.0)
    mirostat_eta: float | None = Field(default=None, ge=0.0)
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None

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

    @model_validator(mode="after")
    def _checks(self) -> _Sampling:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOPS:
            raise ValueError(f"stop: at most {MAX_STOPS} sequences")
        if self.logit_bias is not None:
            for key, bias in self.logit_bias.items():
                if not key.isdigit() or not -100.0 <= bias <= 100.0:
                    raise ValueError(
                        f"logit_bias: keys are token ids, values -100..100 (got {key!r}: {bias})"
                    )
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give grammar or json_schema, not both")
        return self


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Checked in the route (400 invalid_session_id), documented here.
    session_id: str | None = Field(
        default=None,
        description="keep this conversation's history on the server (slmguard extension); "
        "the X-Session-Id header does the same",
        json_schema_extra={"pattern": SESSION_ID_PATTERN},
    )

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] | None = None


class EmbeddingRequest(_In):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None


class TokenizeRequest(_In):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_In):
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessageOut(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Out):
    index: int
    message: ChatMessageOut
    finish_reason: str | None = None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Out):
    index: int
    text: str
    finish_reason: str | None = None


class Completion(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "slmguard"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(_Out):
    state: Literal[
        "loading", "ready", "degraded", "restarting", "stalled", "parked", "failed", "stopped"
    ]
    model: str
    model_path: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
