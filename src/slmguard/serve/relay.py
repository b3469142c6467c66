"""One generation through the front: prepare, admit, relay the engine's answer.

Owns :class:`Relay`, what happens to a validated generation request (chat,
completions, Responses, Anthropic Messages, rerank) between its route and
llama-server, in three steps every generation takes:

1. **prepare** (:meth:`Relay.prepare_chat`, :meth:`Relay.prepare_completion`,
   :meth:`Relay.prepare_responses`, :meth:`Relay.prepare_messages`,
   :meth:`Relay.prepare_rerank`):
   a session's stored history goes in front of the new messages; the prompt is
   tokenized by the engine itself (``/apply-template`` then ``/tokenize`` for
   chat, ``/tokenize`` for completions and a rerank's query and documents: the
   exact count the engine will see);
   then it is **sized** (:meth:`Relay.size`, the one place ``max_tokens`` is
   decided): the requested ``max_tokens``, or the default (`--default-max-tokens`,
   a quarter of the slot up to 512) within the rest of the slot, under the
   smaller of the policy's cap and ``--max-tokens-cap``; prompt + max_tokens
   must fit one slot's context, else 400 ``context_length_exceeded`` unless the
   policy's context verdict says otherwise (the governor's 503 while the
   context is shrunk). A session whose history no longer fits loses its oldest
   turns until it does, and the response says how many
   (``slmguard.session.dropped_messages`` and ``X-Slmguard-Session-Dropped``).
2. **admit** (:meth:`Relay.admit`): 429 ``client_cooldown`` for a client whose
   requests keep making the engine fail, 400 for a request an engine proved
   harmful before (``request_crashed_engine``, ``grammar_too_complex``: its digest
   is in :class:`~slmguard.serve.blame.CrashMemory`), the policy's refusal, if any
   (:class:`~slmguard.governor.request.RequestPolicy`), then a place in the slot
   queue (429 with Retry-After when it is full).
3. **relay** (:meth:`Relay.run`): the body goes to llama-server unchanged but
   for the front's rewrites; a stream is relayed event by event as the engine
   sends it (each event is progress for the liveness check; the named events
   of Responses and Messages streams with their ``event:`` lines, ending with
   the body; ``data: null`` dropped), a JSON answer as it came (a completion
   or chat completion with several choices and no stream is gathered from the
   engine's stream, whose usage counts every choice). The client going away
   closes the upstream request, which makes llama-server stop that generation
   at its next token. A server-side abort (the governor, the liveness check)
   cancels the upstream task; the client then gets the abort's error. A stream
   is relayed by :mod:`slmguard.serve.stream` (one task reads and writes).

Every refusal is an error of :mod:`slmguard.errors` (the engine not ready, in
its state; unreachable; gone; stalled; aborted with the reason; busy), turned
into the OpenAI envelope by the server's one mapping; llama-server's own 4xx
refusals are relayed with their status and message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slmguard.errors import (
    EngineError,
    EngineGoneError,
    EngineNotReadyError,
    EngineStalledError,
    EngineUnreachableError,
    GrammarLimitError,
    RequestError,
    RequestTooLargeError,
    SlmguardError,
    envelope,
)
from slmguard.governor.request import RequestPolicy, SizedRequest
from slmguard.serve.answers import (
    TurnBuilder,
    add_usage,
    completion_tokens,
    engine_refusal,
    loads,
    usage_count,
)
from slmguard.serve.blame import CrashMemory
from slmguard.serve.bounds import grammar_field
from slmguard.serve.engine import EngineProcess
from slmguard.serve.flights import Flight, Flights
from slmguard.serve.labels import ANTHROPIC_LABEL_FIELDS, LABEL_FIELDS
from slmguard.serve.metrics import ServeMetrics
from slmguard.serve.queue import SlotQueue
from slmguard.serve.sessions import SessionService
from slmguard.settings import derived_max_tokens

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

log = logging.getLogger(__name__)

Message = dict[str, Any]
# Keys of a chat body /apply-template needs to build the same prompt as the completion.
_TEMPLATE_KEYS = (
    "messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
    "reasoning_effort", "response_format",
)  # fmt: skip


@dataclass
class Turn:
    """A session's part of a chat request."""

    session_id: str
    new_messages: list[Message]
    dropped_messages: int = 0


#: The most special tokens llama-server puts around a rerank's query and document when the
#: model has no rerank template (``format_prompt_rerank``: BOS, then EOS and SEP after the
#: query, EOS after the document, as the vocabulary asks).
RERANK_SPECIAL_TOKENS = 4


@dataclass
class Generation:
    """A prepared request, ready to be admitted and sent."""

    endpoint: str  # "chat" | "completions" | "responses" | "messages" | "rerank"
    path: str  # the engine's route
    body: dict[str, Any]
    stream: bool
    include_usage: bool  # the client asked for the usage chunk
    sized: SizedRequest
    turn: Turn | None = None
    arrived_s: float = field(default_factory=time.monotonic)
    per_prompt: int = 1  # choices per prompt (n): usage counts a prompt once per n choices
    prompt_total: int | None = None  # the prompt tokens of every prompt (several prompts)
    gathered: bool = False  # a non-stream answer the front gathers from the engine's stream
    prompt_from_answer: bool = False  # the prompt tokens are counted from the answer's usage


def _gather_stream(gen: Generation) -> None:
    """A non-stream request with several choices asked of the engine as a stream: its
    non-stream answer counts the usage of choice 0 only, its stream every choice's, so
    the front gathers the stream into the answer (:meth:`Relay._gather`)."""
    gen.gathered = True
    gen.body["stream"] = True
    gen.body["stream_options"] = {"include_usage": True}


def outcome(err: SlmguardError) -> str:
    """The metrics outcome of a refused request (by its HTTP status)."""
    status = envelope(err).status
    return {429: "rejected_queue_full", 503: "unavailable", 413: "too_large"}.get(
        status, "client_error" if status < 500 else "error"
    )


class Relay:
    """The generations of one server (see the module docstring).

    ``max_tokens_cap`` is ``--max-tokens-cap``; the policy's cap comes on top.
    ``default_max_tokens`` bounds a request that gives none (None: the rest of the slot).
    ``one_batch``: the model is an encoder (attention not causal, BERT): the engine
    computes each of its tasks in one batch, so a rerank pair must fit ``n_ubatch`` too.
    ``rerank_template``: the model's rerank prompt template, if it has one.
    """

    def __init__(
        self,
        engine: EngineProcess,
        queue: SlotQueue,
        flights: Flights,
        metrics: ServeMetrics,
        policy: RequestPolicy,
        *,
        sessions: SessionService | None,
        model_id: str,
        max_tokens_cap: int | None = None,
        crashes: CrashMemory | None = None,
        default_max_tokens: int | None = None,
        one_batch: bool = False,
        rerank_template: str | None = None,
    ) -> None:
        self.engine = engine
        self.queue = queue
        self.flights = flights
        self.metrics = metrics
        self.policy = policy
        self.sessions = sessions
        self.model_id = model_id
        self.max_tokens_cap = max_tokens_cap
        self.crashes = crashes if crashes is not None else CrashMemory()
        self.default_max_tokens = default_max_tokens
        self.one_batch = one_batch
        self.rerank_template = rerank_template

    # ------------------------------------------------------------------ the engine's answers

    def unavailable(self, err: Exception | None = None) -> SlmguardError:
        """503 for a request the engine cannot take now: its state, or why it did not answer."""
        state = self.engine.state
        if state == "ready" and err is not None:
            # Running, yet the request failed on its way: say so (and log it: it is a bug
            # or a resource limit of the engine, not a restart the client can wait out).
            log.warning("the engine did not answer (%s) although it is ready", err)
            return EngineUnreachableError(f"the engine did not answer ({err}); retry shortly")
        return EngineNotReadyError(state)

    def gone(self, flight: Flight) -> SlmguardError:
        """The error when the engine stopped answering during ``flight``: the server's
        abort, a stall, or the engine's death."""
        if flight.aborted is not None:
            return flight.aborted
        return EngineStalledError() if self.engine.state == "stalled" else EngineGoneError()

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes, str]:
        """One engine request outside a generation (tokenize, apply-template), watched.

        It is pending work like a generation: registered in ``flights`` (no slot),
        so the liveness check sees a wedged engine that never answers it and aborts it
        (503 ``engine_stalled``) instead of leaving the client hanging.
        """
        flight = self.flights.open(path, stream=False, slots=0)
        task = asyncio.ensure_future(self.engine.client.request(method, path, body))
        flight.task = task
        try:
            return await task
        except asyncio.CancelledError:
            task.cancel()
            if flight.aborted is None:
                raise  # the client went away
            raise self.gone(flight) from None
        except EngineUnreachableError as err:
            raise self.unavailable(err) from err
        finally:
            self.flights.close(flight)

    async def call_json(self, path: str, body: Any) -> Any:
        """POST ``body`` (watched); the engine's JSON answer, or its refusal raised."""
        status, raw, _ = await self.call("POST", path, body)
        data = loads(raw)
        if status != 200:
            raise engine_refusal(status, data)
        return data

    # ------------------------------------------------------------------ prepare

    async def count_tokens(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> int:
        """``text``'s tokens as the engine counts a prompt's (the vocabulary's BOS and
        EOS added, special tokens parsed), or as asked."""
        body = {"content": text, "add_special": add_special, "parse_special": parse_special}
        data = await self.call_json("/tokenize", body)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list):
            raise EngineError("the engine's /tokenize answer has no tokens")
        return len(tokens)

    async def count_chat_tokens(self, body: dict[str, Any]) -> int:
        data = await self.call_json(
            "/apply-template", {k: body[k] for k in _TEMPLATE_KEYS if k in body}
        )
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if not isinstance(prompt, str):
            raise EngineError("the engine's /apply-template answer has no prompt")
        return await self.count_tokens(prompt)

    async def refuse_control_tokens(self, messages: list[Message]) -> None:
        """400 when message text holds one of the model's control tokens.

        llama-server renders the chat template to text and tokenizes it with special
        tokens parsed, so a message holding ``<end_of_turn>`` (Gemma) or ``<|im_end|>``
        (ChatML models) would end its turn and forge the next one. Text without
        ``<`` or ``[`` (the shape of every common control token) is not checked; the
        rest is tokenized twice, with and without special parsing: a control token
        makes the counts differ.
        """
        texts = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts += [str(p.get("text", "")) for p in content if isinstance(p, dict)]
        joined = "\n".join(t for t in texts if "<" in t or "[" in t)
        if await self.holds_control_token(joined):
            raise RequestError(
                "a message contains text that is one of this model's control tokens (such as a "
                "turn marker); it would forge a turn of the conversation, so it is refused",
                code="control_token_in_message",
                param="messages",
            )

    async def holds_control_token(self, text: str) -> bool:
        """Whether ``text`` holds one of the model's control tokens: not when it has no
        ``<`` or ``[`` (the shape of every common control token); else it is tokenized
        twice, with and without special parsing, and a control token makes the counts
        differ."""
        if "<" not in text and "[" not in text:
            return False
        counts = [
            await self.count_tokens(text, add_special=False, parse_special=parse)
            for parse in (True, False)
        ]
        return counts[0] != counts[1]

    def size(
        self, endpoint: str, prompt_tokens: int, requested: int | None, *, n: int, stream: bool
    ) -> SizedRequest:
        """The request as the engine will run it: ``max_tokens`` is the requested one (or
        the default, within the rest of the slot) under the smaller cap, and prompt +
        max_tokens fit one slot."""
        room = self.engine.config.n_ctx_slot - prompt_tokens
        caps = [c for c in (self.policy.max_tokens_cap(), self.max_tokens_cap) if c is not None]
        wanted = requested if requested is not None else room
        if requested is None and self.default_max_tokens is not None:
            wanted = min(room, self.default_max_tokens)
        if caps:
            wanted = min(wanted, max(1, min(caps)))
        sized = SizedRequest(endpoint, prompt_tokens, wanted, n=n, stream=stream)
        if prompt_tokens == 0 or not self._fits(prompt_tokens, wanted):
            raise self.context_error(sized)
        return sized

    def context_error(self, sized: SizedRequest) -> SlmguardError:
        """A request that does not fit one slot: the policy's verdict, else a plain 400."""
        verdict = self.policy.context_verdict(sized)
        if verdict is not None:
            return verdict
        more = max(0, sized.max_tokens)
        return RequestTooLargeError(
            f"this model's context is {self.engine.config.n_ctx_slot} tokens per request; the "
            f"prompt has {sized.prompt_tokens} tokens and {more} more were requested for the "
            "completion",
            param="messages" if sized.endpoint == "chat" else "prompt",
        )

    def _fits(self, prompt_tokens: int, wanted: int) -> bool:
        return wanted > 0 and prompt_tokens + wanted <= self.engine.config.n_ctx_slot

    def _check_n(self, n: int | None) -> int:
        n = n or 1
        if n > self.queue.slots:
            raise RequestError(
                f"n={n}: this server runs {self.queue.slots} slot(s), so at most "
                f"{self.queue.slots} completions per request", code="invalid_value", param="n",
            )  # fmt: skip
        return n

    async def prepare_chat(self, data: dict[str, Any], session_id: str | None) -> Generation:
        """A chat request (already validated by its schema) made ready for the engine."""
        body = {k: v for k, v in data.items() if k not in ("session_id", "max_completion_tokens")}
        body["model"] = self.model_id
        requested = data.get("max_completion_tokens") or data.get("max_tokens")
        new_messages: list[Message] = list(data["messages"])
        turn = None
        if session_id is not None:
            if self.sessions is None:
                raise RequestError("this server keeps no sessions (started with --no-sessions)",
                                   code="sessions_unavailable", param="session_id")  # fmt: skip
            if (data.get("n") or 1) != 1:
                raise RequestError("a session turn has one answer: n must be 1", param="n",
                                   code="invalid_value")  # fmt: skip
            turn = Turn(session_id, new_messages)
            body["messages"] = await self.sessions.session_prompt(session_id, new_messages)
        n = self._check_n(data.get("n"))
        await self.refuse_control_tokens(new_messages)
        prompt_tokens = await self.count_chat_tokens(body)
        if turn is not None and not self._fits(prompt_tokens, self._answer_room(requested)):
            prompt_tokens = await self._fit_session(body, turn, prompt_tokens, requested)
        stream = bool(data.get("stream"))
        sized = self.size("chat", prompt_tokens, requested, n=n, stream=stream)
        gen = self._generation("/v1/chat/completions", body, data, sized, turn)
        if n > 1 and not stream:
            _gather_stream(gen)  # never a session turn: a session takes n=1
        return gen

    async def prepare_completion(self, data: dict[str, Any]) -> Generation:
        """A completion request (already validated by its schema) made ready for the engine.

        Every prompt form: a string or a token list is one prompt, a list of either one
        prompt each; each prompt gets ``n`` choices (the engine runs one task per choice).
        Every prompt must fit one slot with its ``max_tokens``.
        """
        body = dict(data)
        body["model"] = self.model_id
        n = self._check_n(data.get("n"))
        prompt = data["prompt"]
        one = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
        prompts = [prompt] if one else list(prompt)
        counts = [len(p) if isinstance(p, list) else await self.count_tokens(p) for p in prompts]
        stream = bool(data.get("stream"))
        tasks = n * len(prompts)
        slots = min(tasks, self.queue.slots)
        sized = self.size("completions", max(counts), data.get("max_tokens"), n=slots,
                          stream=stream)  # fmt: skip
        gen = self._generation("/v1/completions", body, data, sized, None)
        gen.per_prompt = n
        gen.prompt_total = sum(counts)
        if tasks > 1 and not stream:
            _gather_stream(gen)
        return gen

    async def prepare_responses(self, data: dict[str, Any]) -> Generation:
        """A Responses request made ready: labels dropped, ``text.format`` made the engine's
        ``response_format``, an assistant item given its ``type``, sized like chat."""
        body = {k: v for k, v in data.items() if k not in _RESPONSES_NOT_SENT}
        body["model"] = self.model_id
        items = body["input"] if isinstance(body["input"], list) else []
        body["input"] = [
            {"type": "message", **i} if "role" in i and "type" not in i else i for i in items
        ] or body["input"]
        fmt = (data.get("text") or {}).get("format")
        if fmt is not None and fmt["type"] == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt["type"] == "json_schema":
            spec = {k: v for k, v in fmt.items() if k != "type"}
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        await self.refuse_control_tokens(_texts(body.get("instructions"), body["input"]))
        counted = await self.call_json(
            "/v1/responses/input_tokens", {k: v for k, v in body.items() if k != "stream"}
        )
        prompt_tokens = _count(counted, "input_tokens", "/v1/responses/input_tokens")
        stream = bool(data.get("stream"))
        sized = self.size("responses", prompt_tokens, data.get("max_output_tokens"), n=1,
                          stream=stream)  # fmt: skip
        body["max_output_tokens"] = sized.max_tokens
        return Generation("responses", "/v1/responses", body, stream, False, sized)

    async def prepare_messages(self, data: dict[str, Any]) -> Generation:
        """An Anthropic Messages request made ready: labels dropped, its ``tool_choice``
        honoured (see :func:`anthropic_tools`), sized like chat."""
        body = await self.messages_body(data)
        counted = await self.call_json(
            "/v1/messages/count_tokens",
            {k: v for k, v in body.items() if k not in ("stream", "max_tokens")},
        )
        prompt_tokens = _count(counted, "input_tokens", "/v1/messages/count_tokens")
        stream = bool(data.get("stream"))
        sized = self.size("messages", prompt_tokens, data.get("max_tokens"), n=1, stream=stream)
        body["max_tokens"] = sized.max_tokens
        return Generation("messages", "/v1/messages", body, stream, False, sized)

    async def messages_body(self, data: dict[str, Any]) -> dict[str, Any]:
        """The engine's body of a Messages (or count_tokens) request, its text checked."""
        body = anthropic_tools({k: v for k, v in data.items() if k not in ANTHROPIC_LABEL_FIELDS})
        body["model"] = self.model_id
        await self.refuse_control_tokens(_texts(body.get("system"), body["messages"]))
        return body

    async def prepare_rerank(self, data: dict[str, Any]) -> Generation:
        """A rerank request: one engine task (and slot) per document, nothing generated.

        Each (query, document) pair is one engine task in one slot, counted as the engine
        will see it (:meth:`rerank_pairs`). The longest must fit one slot's context and,
        on an encoder (``one_batch``), one batch, else 400 ``context_length_exceeded``
        naming the document (``documents.<i>``; ``query`` when the query alone leaves no
        room), or the policy's verdict (the governor's 503 while the context is shrunk):
        the engine would answer 500 (``input is too large to process``). The prompt
        tokens counted are the engine's own, from its answer (``usage.prompt_tokens``).
        """
        body = {**data, "model": self.model_id}
        pairs = await self.rerank_pairs(data["query"], data["documents"])
        longest = max(range(len(pairs)), key=pairs.__getitem__)
        sized = SizedRequest("rerank", pairs[longest], 0, n=min(len(pairs), self.queue.slots))
        await self._check_rerank_pair(sized, data["query"], longest)
        return Generation("rerank", "/v1/rerank", body, False, False, sized,
                          prompt_from_answer=True)  # fmt: skip

    async def rerank_pairs(self, query: str, documents: list[str]) -> list[int]:
        """Each (query, document) pair's tokens as the engine will see them.

        With the model's rerank template (``tokenizer.chat_template.rerank``) the engine
        puts the two into it and tokenizes the prompt with special tokens parsed: the
        same prompt is counted exactly, and a query or document holding one of the
        model's control tokens is refused (400 ``control_token_in_message``): it would
        forge the prompt's structure, such as the separator between the two. Without
        one the engine tokenizes each as plain text (no special token parsed) and puts
        up to :data:`RERANK_SPECIAL_TOKENS` around them.
        """
        template = self.rerank_template
        if template is not None:
            texts = {"query": query, **{f"documents.{i}": d for i, d in enumerate(documents)}}
            for param, text in texts.items():
                if await self.holds_control_token(text):
                    raise RequestError(
                        f"{param} contains text that is one of this model's control tokens; "
                        "the engine parses them in its rerank template, so it would forge "
                        "the prompt's structure: it is refused",
                        code="control_token_in_message",
                        param=param,
                    )
            prompts = [template.replace("{query}", query).replace("{document}", d)
                       for d in documents]  # fmt: skip
            return [await self.count_tokens(p, add_special=False) for p in prompts]
        plain = {"add_special": False, "parse_special": False}
        q = await self.count_tokens(query, **plain)
        return [q + RERANK_SPECIAL_TOKENS + await self.count_tokens(d, **plain)
                for d in documents]  # fmt: skip

    def _batch(self) -> int:
        """The tokens the engine computes in one batch (with ``--reranking`` llama-server
        makes n_batch n_ubatch when it is larger)."""
        return min(self.engine.config.n_batch, self.engine.config.n_ubatch)

    async def _check_rerank_pair(self, sized: SizedRequest, query: str, index: int) -> None:
        """The longest pair (``sized``, document ``index``) within one batch (an
        encoder's) and one slot's context."""
        slot = self.engine.config.n_ctx_slot
        if self.one_batch and sized.prompt_tokens > self._batch():
            where, limit = f"one batch of {self._batch()} tokens (an encoder's)", self._batch()
        elif not self._fits(sized.prompt_tokens, 1):
            verdict = self.policy.context_verdict(sized)
            if verdict is not None:
                raise verdict
            where, limit = f"one slot's context of {slot} tokens", slot - 1
        else:
            return
        alone = (await self.rerank_pairs(query, [""]))[0]  # the pair with an empty document
        raise RequestTooLargeError(
            f"each (query, document) pair is one engine task computed in {where}; with "
            f"document {index} it has {sized.prompt_tokens} tokens, the query alone {alone} "
            "(with the special tokens the engine adds)",
            param="query" if alone >= limit else f"documents.{index}",
        )

    def _generation(
        self, path: str, body: dict[str, Any], data: dict[str, Any], sized: SizedRequest,
        turn: Turn | None,
    ) -> Generation:  # fmt: skip
        body["max_tokens"] = sized.max_tokens
        opts = data.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage"))
        if sized.stream:
            # The front needs the usage for its metrics and the session store.
            body["stream_options"] = {**opts, "include_usage": True}
        return Generation(sized.endpoint, path, body, sized.stream, include_usage, sized, turn)

    def _answer_room(self, requested: int | None) -> int:
        if requested is not None:
            return requested
        # A session too long for the slot keeps room for the default answer.
        return self.default_max_tokens or derived_max_tokens(self.engine.config.n_ctx_slot)

    async def _fit_session(
        self, body: dict[str, Any], turn: Turn, prompt_tokens: int, requested: int | None
    ) -> int:
        """Drop the session's oldest turns until prompt + answer fit one slot (and store that)."""
        messages: list[Message] = body["messages"]
        systems = [m for m in messages if m.get("role") == "system"]
        n_new = len(turn.new_messages)
        stored = [m for m in messages[: len(messages) - n_new] if m.get("role") != "system"]
        room = self._answer_room(requested)
        dropped = 0
        while stored and not self._fits(prompt_tokens, room):
            # Drop a whole exchange: the oldest message and what follows up to the next user
            # turn.
            cut = 1
            while cut < len(stored) and stored[cut].get("role") != "user":
                cut += 1
            stored = stored[cut:]
            dropped += cut
            body["messages"] = [*systems, *stored, *turn.new_messages]
            prompt_tokens = await self.count_chat_tokens(body)
        if dropped:
            assert self.sessions is not None
            await self.sessions.drop_oldest(turn.session_id, dropped)
            turn.dropped_messages = dropped
            log.info("session %s: dropped its %d oldest messages to fit the context",
                     turn.session_id, dropped)  # fmt: skip
        return prompt_tokens

    # ------------------------------------------------------------------ admit

    async def admit(self, gen: Generation) -> int:
        """The policy's verdict, then slots in the queue; returns the slots taken."""
        refusal = self.policy.admit(gen.sized)
        if refusal is not None:
            raise refusal
        if self.engine.state != "ready":
            raise self.unavailable()
        return await self.queue.acquire(gen.sized.n)  # QueueFullError: 429

    # ------------------------------------------------------------------ relay

    def engine_died(self, gen: Generation, flight: Flight) -> None:
        """The engine went away under ``flight``: it stays a suspect of the crash memory
        (blamed if it was the last one that engine got and the engine crashed), unless the
        server stopped that engine itself (a park or a reconfigure by the governor)."""
        if self.engine.exited_on_purpose(flight.engine_pid):
            self.answered(flight)

    def answered(self, flight: Flight) -> None:
        """The engine answered ``flight`` (or dropped it: its client left, the server
        aborted it): not running there any more, no suspect of a crash."""
        self.crashes.finished(flight.engine_pid, flight.id)

    def refusal(self, gen: Generation, flight: Flight, err: SlmguardError) -> SlmguardError:
        """The engine refused ``gen``: a grammar past its work bound is a strike."""
        if isinstance(err, GrammarLimitError):
            self.crashes.grammar_refused(gen.body, flight.client, err.param)
        return err

    async def run(self, request: Request, gen: Generation) -> Response:
        """Admit and relay one generation; every outcome is counted."""
        client = request.client.host if request.client is not None else None
        try:
            self.crashes.check(gen.body, client)
            taken = await self.admit(gen)
        except SlmguardError as err:
            self.metrics.requests.labels(gen.endpoint, outcome(err)).inc()
            raise
        flight = self.flights.open(gen.endpoint, stream=gen.stream, slots=taken)
        flight.engine_pid = self.engine.pid
        flight.body = gen.body  # blamed for a stall on a build without the grammar bound
        flight.client = client
        flight.grammar = grammar_field(gen.endpoint, gen.body)
        self.crashes.sent(flight.engine_pid, flight.id, gen.body, client, flight.grammar)
        if not gen.prompt_from_answer:
            self.metrics.prompt_tokens.inc(gen.prompt_total or gen.sized.prompt_tokens)
        done = _Done(self.flights, self.queue, flight, taken)
        try:
            if gen.stream:
                return await self._stream(gen, flight, done)
            return await self._collect(request, gen, flight, done)
        except BaseException:
            done()
            raise

    async def _collect(
        self, request: Request, gen: Generation, flight: Flight, done: _Done
    ) -> Response:
        from fastapi.responses import JSONResponse, Response

        upstream = asyncio.create_task(
            self._gather(gen, flight)
            if gen.gathered
            else self.engine.client.request("POST", gen.path, gen.body)
        )
        flight.task = upstream
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            finished, _ = await asyncio.wait(
                {upstream, watcher}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            watcher.cancel()
        if upstream not in finished:
            upstream.cancel()
            self.answered(flight)
            self.metrics.requests.labels(gen.endpoint, "client_disconnected").inc()
            self.metrics.cancelled.labels("client").inc()
            log.info("client went away; %s generation %d cancelled", gen.endpoint, flight.id)
            done()
            return JSONResponse({}, status_code=499)
        done()
        if upstream.cancelled() or isinstance(upstream.exception(), EngineUnreachableError):
            aborted = flight.aborted is not None  # by the server, else the engine went away
            ended = "aborted" if aborted else "engine_died"
            self.metrics.requests.labels(gen.endpoint, ended).inc()
            if aborted:
                self.answered(flight)
                self.metrics.cancelled.labels(flight.abort_code).inc()
            else:
                self.engine_died(gen, flight)
            raise self.gone(flight)
        status, raw, _ = upstream.result()
        self.answered(flight)
        data = loads(raw)
        if status != 200:
            refused = self.refusal(gen, flight, self._refusal(gen, status, data))
            self.metrics.requests.labels(gen.endpoint, outcome(refused)).inc()
            raise refused
        if not isinstance(data, dict):
            self.metrics.requests.labels(gen.endpoint, "error").inc()
            raise EngineError("the engine's answer is not JSON")
        self.account(completion_tokens(gen.endpoint, data.get("usage")), data.get("timings"))
        if gen.prompt_from_answer:
            self.metrics.prompt_tokens.inc(usage_count(data.get("usage"), "prompt_tokens"))
        choices = data.get("choices") or [{}]
        message = choices[0].get("message") if isinstance(choices[0], dict) else None
        await self.record(gen, message if isinstance(message, dict) else None, data.get("usage"))
        self.metrics.requests.labels(gen.endpoint, "ok").inc()
        headers = _session_header(gen)
        if headers:
            data["slmguard"] = {"session": {"dropped_messages": gen.turn.dropped_messages}}  # type: ignore[union-attr]
            return JSONResponse(data, headers=headers)
        return Response(raw, media_type="application/json")

    def _refusal(self, gen: Generation, status: int, data: Any) -> SlmguardError:
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and err.get("type") == "exceed_context_size_error":
            n_prompt = err.get("n_prompt_tokens")
            if isinstance(n_prompt, int):
                # The context shrank between sizing and the engine (a governor resize).
                sized = SizedRequest(gen.endpoint, n_prompt, gen.body.get("max_tokens") or 0,
                                     n=gen.sized.n, stream=gen.stream)  # fmt: skip
                return self.context_error(sized)
        return engine_refusal(status, data, grammar_param=grammar_field(gen.endpoint, gen.body))

    def account(self, generated: int | None, timings: Any) -> None:
        """Count an answer's generated tokens and the engine's timings of it."""
        if generated:
            self.metrics.completion_tokens.inc(generated)
        self.metrics.observe_timings(timings)

    async def _gather(self, gen: Generation, flight: Flight) -> tuple[int, bytes, str]:
        """A completion or chat completion with several choices, streamed by the engine
        and answered whole: every choice's text (or message), finish reason and logprobs,
        the usage summed over them."""
        gathered: _Gathered | _GatheredChat = (
            _GatheredChat() if gen.endpoint == "chat" else _Gathered(gen.per_prompt)
        )
        async with self.engine.client.stream(gen.path, gen.body) as resp:
            if resp.status_code != 200:
                return resp.status_code, await resp.aread(), "application/json"
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line in ("data: [DONE]", "data: null"):
                    continue
                obj = loads(line[6:])
                if isinstance(obj, dict) and "error" in obj:
                    return 500, json.dumps(obj).encode(), "application/json"
                if isinstance(obj, dict):
                    self.flights.progressed(flight, time.monotonic())
                    gathered.feed(obj)
        return 200, json.dumps(gathered.answer(), ensure_ascii=False).encode(), "application/json"

    async def record(self, gen: Generation, answer: Message | None, usage: Any) -> None:
        """Store a finished session turn; a store failure is logged, not sent."""
        if gen.turn is None or self.sessions is None or answer is None:
            return
        out: Message = {"role": "assistant", "content": answer.get("content")}
        for key in ("tool_calls", "reasoning_content"):
            if answer.get(key):
                out[key] = answer[key]
        usage = usage if isinstance(usage, dict) else {}
        try:
            await self.sessions.record_turn(
                gen.turn.session_id, gen.turn.new_messages, out,
                prompt_tokens=int(usage.get("prompt_tokens") or gen.sized.prompt_tokens),
                completion_tokens=int(usage.get("completion_tokens") or 1),
            )  # fmt: skip
        except (SlmguardError, OSError) as err:
            log.error("session %s: the turn was not stored: %s", gen.turn.session_id, err)

    async def _stream(self, gen: Generation, flight: Flight, done: _Done) -> Response:
        """A stream: the engine's status decides the answer (its refusal relayed, or the
        stream's head); then :class:`~slmguard.serve.stream.StreamTask` relays each line."""
        from slmguard.serve.stream import SSEResponse, StreamTask

        stream = StreamTask(self, gen, flight)
        try:
            head = await stream.head
        except BaseException:
            stream.task.cancel()
            raise
        if head is None:
            done()
            if flight.aborted is None:
                self.engine_died(gen, flight)
            else:
                self.answered(flight)
            self.metrics.requests.labels(gen.endpoint, "engine_died").inc()
            raise self.gone(flight)
        status, raw = head
        if status != 200:
            done()
            self.answered(flight)
            err = self.refusal(gen, flight, self._refusal(gen, status, loads(raw)))
            self.metrics.requests.labels(gen.endpoint, outcome(err)).inc()
            raise err

        def finish(ended: str) -> None:
            if ended != "engine_died":
                self.answered(flight)
            if ended == "client_disconnected":
                self.metrics.cancelled.labels("client").inc()
            self.metrics.requests.labels(gen.endpoint, ended).inc()
            done()

        return SSEResponse(stream, _session_header(gen), finish)


class _Done:
    """Closes a generation's flight and gives its slots back, once."""

    def __init__(self, flights: Flights, queue: SlotQueue, flight: Flight, taken: int) -> None:
        self.flights, self.queue, self.flight, self.taken = flights, queue, flight, taken

    def __call__(self) -> None:
        self.flights.close(self.flight)
        if self.taken:
            self.queue.release(self.taken)
            self.taken = 0


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _session_header(gen: Generation) -> dict[str, str]:
    if gen.turn is None or not gen.turn.dropped_messages:
        return {}
    return {"X-Slmguard-Session-Dropped": str(gen.turn.dropped_messages)}


# ------------------------------------------------------------------ the APIs' shapes

#: Fields of a Responses request the engine does not get: labels, and what the front
#: turns into the engine's own (``text.format``; ``max_output_tokens`` once sized).
_RESPONSES_NOT_SENT = LABEL_FIELDS | {"text", "stream_options", "truncation"}


def _count(data: Any, key: str, route: str) -> int:
    value = data.get(key) if isinstance(data, dict) else None
    if not isinstance(value, int):
        raise EngineError(f"the engine's {route} answer has no {key}")
    return value


def _texts(head: Any, items: list[Any]) -> list[Message]:
    """The text of a request's instructions or system prompt and its items or messages,
    as messages for :meth:`Relay.refuse_control_tokens` (which reads ``content``)."""
    out: list[Message] = []

    def add(value: Any) -> None:
        if isinstance(value, str):
            out.append({"content": value})
        elif isinstance(value, list):
            for part in value:
                if isinstance(part, dict):
                    for key in ("text", "content", "output", "thinking", "refusal", "arguments"):
                        add(part.get(key))
                    if isinstance(part.get("input"), dict):  # a tool_use block's arguments
                        add(json.dumps(part["input"], ensure_ascii=False))

    add(head)
    add(items)
    return out


class _Gathered:
    """A completion's stream made the non-stream answer (see :meth:`Relay._gather`)."""

    def __init__(self, per_prompt: int) -> None:
        self.per_prompt = per_prompt
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: Any = None

    def feed(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            keys = ("id", "created", "model", "system_fingerprint")
            self.head = {k: chunk[k] for k in keys if k in chunk}
        usage = chunk.get("usage")
        indices = []
        for c in chunk.get("choices") or ():
            if not isinstance(c, dict):
                continue
            i = int(c.get("index", 0))
            indices.append(i)
            slot = self.choices.setdefault(
                i, {"text": "", "index": i, "logprobs": None, "finish_reason": None}
            )
            slot["text"] += c.get("text") or ""
            if c.get("finish_reason"):
                slot["finish_reason"] = c["finish_reason"]
            logprobs = c.get("logprobs")
            if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
                kept = slot["logprobs"] or {"content": []}
                kept["content"] += logprobs["content"]
                slot["logprobs"] = kept
        first = all(i % self.per_prompt == 0 for i in indices)
        self.usage = add_usage(self.usage, usage, prompt=first)

    def answer(self) -> dict[str, Any]:
        return {
            **self.head, "object": "text_completion",
            "choices": [self.choices[i] for i in sorted(self.choices)],
            "usage": self.usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }  # fmt: skip


class _GatheredChat:
    """A chat completion's stream made the engine's non-stream answer with every choice
    (see :meth:`Relay._gather`): each choice's message assembled from its deltas, its
    finish reason and logprobs; the usage summed (one chunk with no choices per choice,
    the prompt counted with the first); the timings of the first choice that finished."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.messages: dict[int, TurnBuilder] = {}
        self.finish: dict[int, Any] = {}
        self.logprobs: dict[int, list[Any]] = {}
        self.usage: Any = None
        self.timings: Any = None

    def feed(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            keys = ("id", "created", "model", "system_fingerprint")
            self.head = {k: chunk[k] for k in keys if k in chunk}
        for c in chunk.get("choices") or ():
            if not isinstance(c, dict):
                continue
            i = int(c.get("index", 0))
            self.messages.setdefault(i, TurnBuilder()).add(c.get("delta") or {})
            self.finish.setdefault(i, None)
            if c.get("finish_reason"):
                self.finish[i] = c["finish_reason"]
            logprobs = c.get("logprobs")
            if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
                self.logprobs.setdefault(i, []).extend(logprobs["content"])
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = add_usage(self.usage, usage, prompt=self.usage is None)
            if self.timings is None and isinstance(chunk.get("timings"), dict):
                self.timings = chunk["timings"]

    def choice(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "finish_reason": self.finish[i], "index": i,
            "message": self.messages[i].engine_message(),
        }  # fmt: skip
        if i in self.logprobs:
            out["logprobs"] = {"content": self.logprobs[i]}
        return out

    def answer(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            **self.head, "object": "chat.completion",
            "choices": [self.choice(i) for i in sorted(self.messages)],
            "usage": self.usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }  # fmt: skip
        if self.timings is not None:
            out["timings"] = self.timings
        return out


def anthropic_tools(body: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's ``tool_choice`` as the engine honours it: ``none`` sends no tools,
    ``tool`` sends only the named one with ``any`` (the engine's ``required``); a name
    that is not among the tools is a 400."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return body
    if choice["type"] == "none":
        return {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
    if choice["type"] == "tool":
        named = [t for t in body.get("tools") or () if t.get("name") == choice["name"]]
        if not named:
            raise RequestError(f"tool_choice names {choice['name']!r}, which is not in tools",
                               code="invalid_value", param="tool_choice")  # fmt: skip
        return {**body, "tools": named, "tool_choice": {"type": "any"}}
    return body
