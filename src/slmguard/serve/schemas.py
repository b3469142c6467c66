"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Owns what clients may send and the documented shapes of what the server
answers (``/openapi.json``), the governor's admin routes included: the one
validation edge of every body. Requests are validated strictly (``"5"`` is not
an integer) and **every field must be known**: a field llama-server does not
implement is refused with 400 naming it (``unsupported_parameter``), a field
that only labels a request (:data:`LABEL_FIELDS`) accepted and dropped. The
accepted and refused fields, route by route: docs/serve.md, *HTTP API*. It does
not bound sizes (:mod:`slmguard.serve.bounds`) nor rewrite a body for the
engine (the dialects').
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveInt,
    field_validator,
    model_validator,
)

from slmguard.serve.sessions import SESSION_ID_PATTERN

MAX_STOPS = 4
MAX_KEEP_RECENT = 1 << 20


def _integral(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer; "2", 2.5 and true still fail strict validation."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integers as JSON Schema has them (2.0 included), validated strictly otherwise. The
# bounds sit inside the type, before the validator, so /openapi.json states them.
_INTEGRAL = BeforeValidator(_integral)
JsonInt = Annotated[int, _INTEGRAL]
LogprobCount = Annotated[int, Field(ge=0, le=20), _INTEGRAL]

#: The roles of a chat message, each its own model below (the union's tags).
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


#: Names pydantic puts in an error's location for the member of a union it tried.
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def error_param(
    loc: tuple[Any, ...] | list[Any], error_type: str = "", ctx: Any = None
) -> str | None:
    """The request field a validation error names, as a client wrote it.

    Drops what pydantic adds for unions: the member it tried (``prompt.list[int].1`` is
    ``prompt.1``) and a message's role tag (``messages.0.user.audio`` is
    ``messages.0.audio``); a missing or unknown role names ``messages.0.role``.
    """
    out: list[str] = []
    prev: Any = None
    for x in loc:
        member = isinstance(x, str) and ("[" in x or x in _UNION_MEMBERS)
        tag = isinstance(x, str) and isinstance(prev, int) and x in MESSAGE_ROLES
        if x not in ("body", "path") and not member and not tag:
            out.append(str(x))
        prev = x
    if error_type in ("union_tag_invalid", "union_tag_not_found") and isinstance(ctx, dict):
        out.append(str(ctx.get("discriminator", "")).strip("'"))
    return ".".join(out) or None


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


#: A message's content: text, or a non-empty list of text parts.
Content = str | Annotated[list[TextPart], Field(min_length=1)]

#: ``detail`` of an image: labels it, without effect (the projector sizes every image).
ImageDetail = Annotated[
    Literal["auto", "low", "high"] | None,
    Field(description="accepted without effect: the projector resizes every image itself"),
]


class ImageURL(_In):
    url: str = Field(min_length=1, description="a data URL (data:image/png;base64,...) only")
    detail: ImageDetail = None


class ImagePart(_In):
    type: Literal["image_url"]
    image_url: ImageURL


#: A user message's content: text, or a non-empty list of text and image parts (images
#: need a server with a vision projector: slmguard.serve.vision).
UserContent = (
    str
    | Annotated[
        list[Annotated[TextPart | ImagePart, Field(discriminator="type")]], Field(min_length=1)
    ]
)

#: Markers :mod:`slmguard.serve.app` turns into this server's ``maximum`` in
#: /openapi.json (the vocabulary's last id; the slot count); the routes check the same.
TOKEN_ID_MARK = "x-slmguard-token-id"
SLOTS_MARK = "x-slmguard-slots"
#: The context of one slot and the vocabulary's size (:mod:`slmguard.serve.bounds` checks them).
CONTEXT_MARK = "x-slmguard-context"
VOCAB_MARK = "x-slmguard-vocab"
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID_MARK: True}), _INTEGRAL]
Choices = Annotated[int, Field(ge=1, json_schema_extra={SLOTS_MARK: True}), _INTEGRAL]
Tokens = Annotated[int, Field(ge=1, json_schema_extra={CONTEXT_MARK: True}), _INTEGRAL]
TopK = Annotated[int, Field(ge=0, json_schema_extra={VOCAB_MARK: True}), _INTEGRAL]
RepeatLastN = Annotated[int, Field(ge=-1, json_schema_extra={CONTEXT_MARK: True}), _INTEGRAL]
LogitBiasKey = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]
LogitBias = Annotated[
    dict[LogitBiasKey, Annotated[float, Field(ge=-100.0, le=100.0)]],
    Field(json_schema_extra={"additionalProperties": False}),
]


class SystemMessage(_In):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = Field(default=None, max_length=256)


class UserMessage(_In):
    role: Literal["user"]
    content: UserContent
    name: str | None = Field(default=None, max_length=256)


class AssistantMessage(_In):
    """Content, tool calls or both; with neither it is sent as empty text. An empty list
    of parts is no content (instructor sends ``[]`` beside every earlier tool call)."""

    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _no_parts_is_no_content(cls, value: Any) -> Any:
        return None if value == [] else value

    @model_validator(mode="after")
    def _some_content(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            self.content = ""
        return self


class ToolMessage(_In):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(min_length=1, max_length=256)


#: One chat message; ``role`` decides which fields it may carry (a wrong one is 400).
ChatMessageIn = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDef(_In):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_In):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_In):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_In):
    """``{"type": "function", "function": {"name": ...}}``: that tool, called. Honoured by
    sending the engine that tool alone with ``required`` (it would answer ``auto``)."""

    type: Literal["function"]
    function: FunctionName


class JSONSchemaSpec(_In):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(_In):
    type: Literal["text"]


class JSONObjectFormat(_In):
    type: Literal["json_object"]


class JSONSchemaFormat(_In):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
]

# Rules between fields, stated in /openapi.json too (a schema-valid request is accepted).
_NOT_BOTH_GRAMMARS: dict[str, Any] = {"not": {"required": ["grammar", "json_schema"]}}
_TOP_LOGPROBS_NEED_LOGPROBS: dict[str, Any] = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}


class StreamOptions(_In):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # label only: no padding is ever added


_LabelText = Annotated[str, Field(max_length=512)]


class _Labels(_In):
    """The OpenAI fields that only label a request (no effect here; see LABEL_FIELDS)."""

    user: _LabelText | None = None
    safety_identifier: _LabelText | None = None
    prompt_cache_key: _LabelText | None = None
    prompt_cache_retention: _LabelText | None = None
    prompt_cache_options: dict[str, Any] | None = None
    metadata: Annotated[dict[str, _LabelText], Field(max_length=16)] | None = None
    service_tier: _LabelText | None = None
    moderation: dict[str, Any] | bool | _LabelText | None = None
    store: bool | None = Field(
        default=None, description="false only: this server keeps no completions"
    )

    @field_validator("store")
    @classmethod
    def _no_store(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("store: true asks the server to keep the completion; this server "
                             "keeps none (send false or leave it out)")  # fmt: skip
        return value


class _Sampling(_Labels):
    model: str = Field(min_length=1)
    max_tokens: Tokens | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: Choices | None = Field(default=None, description="at most the engine's slot count")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: JsonInt | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: LogitBias | None = Field(default=None, description="token id -> bias (-100..100)")
    # llama.cpp sampling extensions
    top_k: TopK | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    typical_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, ge=0.0, le=10.0)
    repeat_last_n: RepeatLastN | None = None
    mirostat: Annotated[Literal[0, 1, 2], BeforeValidator(_integral)] | None = None
    mirostat_tau: float | None = Field(default=None, ge=0.0)
    mirostat_eta: float | None = Field(default=None, ge=0.0)
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _checks(self) -> _Sampling:
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give grammar or json_schema, not both")
        return self


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(
        json_schema_extra={"allOf": [_NOT_BOTH_GRAMMARS, _TOP_LOGPROBS_NEED_LOGPROBS]}
    )

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: Tokens | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
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


#: At most this many prompts in one completion request (each is a task of the engine).
MAX_PROMPTS = 64
_TokenList = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra=_NOT_BOTH_GRAMMARS)

    prompt: (
        str
        | _TokenList
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[_TokenList], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(description="a string, a token list, a list of strings or a list of token lists; "
              "n choices per prompt")  # fmt: skip
    max_tokens: Tokens | None = 16
    logprobs: LogprobCount | None = None
    echo: Literal[False] | None = None


class EmbeddingRequest(_In):
    model: str = Field(min_length=1)
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] | None = None


# ------------------------------------------------------------------ OpenAI Responses


class InputText(_In):
    type: Literal["input_text"]
    text: str


class InputImage(_In):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1, description="a data URL (data:image/png;base64,...) only")
    detail: ImageDetail = None


class OutputText(_In):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(_In):
    type: Literal["refusal"]
    refusal: str


class ResponseMessage(_In):
    """A message item (an assistant one without ``type`` is given ``"message"``)."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: (
        str
        | Annotated[
            list[
                Annotated[
                    InputText | InputImage | OutputText | Refusal, Field(discriminator="type")
                ]
            ],
            Field(min_length=1),
        ]
    )
    id: str | None = None
    status: str | None = None


class _CallItem(_In):
    call_id: str = Field(min_length=1, max_length=256)
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_CallItem):
    type: Literal["function_call"]
    name: str = Field(min_length=1, max_length=256)
    arguments: str


class FunctionCallOutputItem(_CallItem):
    type: Literal["function_call_output"]
    output: str


class ReasoningItem(_In):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]]
    content: list[dict[str, Any]] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: str | None = None


ResponseItem = ResponseMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class ResponseFunctionTool(_In):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseJSONSchemaFormat(_In):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseText(_In):
    """``text.format``: honoured (made the engine's ``response_format``)."""

    format: (
        Annotated[
            TextFormat | JSONObjectFormat | ResponseJSONSchemaFormat, Field(discriminator="type")
        ]
        | None
    ) = None


class ReasoningOptions(_In):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class ResponsesNamedToolChoice(_In):
    """``{"type": "function", "name": ...}``: that tool, called (as chat's named choice)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class ResponseTokensRequest(_Labels):
    """``POST /v1/responses/input_tokens`` (and the prompt part of a Responses request):
    the engine counts it, no slot taken."""

    model: str = Field(min_length=1)
    input: str | Annotated[list[ResponseItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningOptions | None = None
    text: ResponseText | None = None
    truncation: Literal["disabled"] | None = Field(
        default=None, description="disabled only: the engine never truncates the input"
    )


class ResponsesRequest(ResponseTokensRequest):
    """``POST /v1/responses``. ``store`` left out is accepted (nothing is stored either way)."""

    max_output_tokens: Tokens | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    include: Annotated[list[Annotated[str, Field(max_length=128)]], Field(max_length=16)] | None = (
        Field(default=None, description="empty only: no extra output item is produced here")
    )

    @field_validator("include")
    @classmethod
    def _include_nothing(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError(
                "include asks for output items this server does not produce (none is "
                "implemented); send an empty list or leave it out"
            )
        return value


# ------------------------------------------------------------------ Anthropic Messages

_CacheControl = dict[str, Any]  # a cache marker: labels the block, no effect here


class TextBlock(_In):
    type: Literal["text"]
    text: str
    cache_control: _CacheControl | None = None
    citations: list[Any] | None = None


class ToolUseBlock(_In):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]
    cache_control: _CacheControl | None = None


class ToolResultBlock(_In):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = Field(
        default=None,
        description="true: the content is the tool's error, given to the model as "
        "'Error: <content>' (a chat template has no error flag)",
    )
    cache_control: _CacheControl | None = None


class ThinkingBlock(_In):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class Base64Source(_In):
    type: Literal["base64"]
    media_type: str = Field(min_length=1, max_length=64)
    data: str


class URLSource(_In):
    """Refused with a 400 naming it (the board fetches nothing); declared so it is named."""

    type: Literal["url"]
    url: str


class ImageBlock(_In):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: _CacheControl | None = None


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(_In):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]


class AnthropicTool(_In):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: _CacheControl | None = None


class ToolChoiceAuto(_In):
    type: Literal["auto"]
    disable_parallel_tool_use: Literal[False] | None = None


class ToolChoiceAny(_In):
    type: Literal["any"]
    disable_parallel_tool_use: Literal[False] | None = None


class ToolChoiceTool(_In):
    type: Literal["tool"]
    name: str = Field(min_length=1, max_length=64)
    disable_parallel_tool_use: Literal[False] | None = None


class ToolChoiceNone(_In):
    type: Literal["none"]


AnthropicToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingDisabled(_In):
    type: Literal["disabled"]


class ThinkingEnabled(_In):
    type: Literal["enabled"]
    budget_tokens: PositiveInt


class AnthropicMetadata(_In):
    user_id: Annotated[str, Field(max_length=512)] | None = None


class MessageTokensRequest(_In):
    """``POST /v1/messages/count_tokens`` (and the prompt part of a message request)."""

    model: str = Field(min_length=1)
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Annotated[ThinkingDisabled | ThinkingEnabled, Field(discriminator="type")] | None = (
        None
    )
    # labels only
    metadata: AnthropicMetadata | None = None
    service_tier: _LabelText | None = None
    inference_geo: _LabelText | None = None
    speed: _LabelText | None = None
    user_profile_id: _LabelText | None = None
    workspace_id: _LabelText | None = None
    cache_control: _CacheControl | None = None
    diagnostics: dict[str, Any] | None = None


class MessagesRequest(MessageTokensRequest):
    """``POST /v1/messages``: ``max_tokens`` is sized and capped like chat's."""

    max_tokens: Tokens | None = None
    stream: bool = False
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: TopK | None = None


# ------------------------------------------------------------------ rerank

MAX_DOCUMENTS = 256


class RerankRequest(_In):
    """``POST /v1/rerank`` (a reranking GGUF only): every document is scored against
    ``query`` (not empty: the engine would score the documents against nothing)."""

    model: str = Field(min_length=1)
    query: str = Field(min_length=1)
    documents: Annotated[list[str], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: PositiveInt | None = None


class TokenizeRequest(_In):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_In):
    tokens: list[TokenId]


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


class TrimRequest(BaseModel):
    """Body of ``POST /api/v1/context/trim``. Strict: ``"512"`` or ``true`` is not a count."""

    model_config = ConfigDict(extra="forbid", strict=True)

    keep_recent: int = Field(
        ge=0,
        le=MAX_KEEP_RECENT,
        description="tokens of recent conversation to keep per session "
        "(system messages are kept in addition)",
    )
    session_id: str | None = Field(
        default=None,
        pattern=SESSION_ID_PATTERN,
        max_length=128,
        description="trim only this session (default: every stored session)",
    )


class TrimResponse(BaseModel):
    keep_recent: int
    session_id: str | None
    sessions_seen: int
    sessions_trimmed: int
    messages_removed: int
    tokens_removed: int
    tokens_kept: int
    prefix_cache_dropped: bool
    n_ctx: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
