"""What the bench asks the engine and what it reads back: prompts, one stream, all slots.

Owns the requests (llama-server's native ``/completion`` with the prompt as token ids
of an exact length, ``n_predict`` tokens with ``ignore_eos`` so every run decodes as
many, greedy sampling, the prompt cache off so every run prefills the whole prompt,
streamed so the first token's time is seen by the client), the parsing of the stream
(its last event's ``timings``: llama.cpp's own ``prompt_per_second`` and
``predicted_per_second``) and the figures of one stream and of every slot at once.
It speaks to a :class:`Transport`: the engine's unix-socket client
(:class:`slmguard.serve.upstream.EngineClient`) or any other with the same two calls
(the bare-llama-server benchmark's TCP one). Starts nothing and reads no file.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from slmguard.errors import EngineError

#: Text repeated to make a prompt of any length (tokenized by the engine itself).
FILLER = (
    "The river ran past the old mill, and the miller counted the sacks of grain while "
    "the children watched the water wheel turn in the evening light. "
)
#: Bound on the events of one stream (a hostile or broken engine cannot make us loop).
MAX_EVENTS = 1 << 20


class StreamAnswer(Protocol):
    status_code: int

    def aiter_lines(self) -> AsyncIterator[str]: ...

    async def aread(self) -> bytes: ...


class Transport(Protocol):
    """The two calls the bench makes (``EngineClient`` has them)."""

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]: ...

    def stream(self, path: str, body: Any) -> AbstractAsyncContextManager[StreamAnswer]: ...


@dataclass(frozen=True)
class StreamFigures:
    """One generation: the client's clock and llama.cpp's own timings."""

    prompt_tokens: int
    decode_tokens: int
    first_token_s: float  # request sent -> first generated token received
    wall_s: float  # request sent -> last event
    prefill_tokens_per_s: float | None  # timings.prompt_per_second
    decode_tokens_per_s: float | None  # timings.predicted_per_second
    prefill_ms: float | None
    decode_ms: float | None


async def tokenize(t: Transport, text: str) -> list[int]:
    status, data = await t.post_json("/tokenize", {"content": text})
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if status != 200 or not isinstance(tokens, list) or not all(isinstance(x, int) for x in tokens):
        raise EngineError(f"the engine's /tokenize answered {status}: {str(data)[:200]}")
    return tokens


async def make_prompt(t: Transport, n_tokens: int, label: str) -> list[int]:
    """Exactly ``n_tokens`` token ids: ``label`` then the filler, as the engine tokenizes
    them (a distinct label per slot: no two slots share a prompt prefix)."""
    head = await tokenize(t, f"{label}: ")
    filler = await tokenize(t, FILLER)
    if not filler:
        raise EngineError("the engine tokenized the filler text to nothing")
    tokens = list(head)
    while len(tokens) < n_tokens:
        tokens.extend(filler)
    return tokens[:n_tokens]


def completion_body(prompt: list[int], decode_tokens: int) -> dict[str, Any]:
    """The one request every measured generation sends."""
    return {
        "prompt": prompt,
        "n_predict": decode_tokens,
        "ignore_eos": True,
        "cache_prompt": False,
        "temperature": 0,
        "stream": True,
    }


def parse_event(line: str) -> dict[str, Any] | None:
    """One SSE ``data:`` line as JSON; None for anything else (comments, blank lines)."""
    if not line.startswith("data:"):
        return None
    try:
        data = json.loads(line[5:].strip())
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _number(timings: dict[str, Any], key: str) -> float | None:
    value = timings.get(key)
    return float(value) if isinstance(value, int | float) and value >= 0 else None


async def one_stream(
    t: Transport,
    prompt: list[int],
    decode_tokens: int,
    *,
    on_token: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> StreamFigures:
    """Send one generation and read it to its end (``on_token(n)`` after each token)."""
    sent = clock()
    first: float | None = None
    timings: dict[str, Any] | None = None
    seen = 0
    async with t.stream("/completion", completion_body(prompt, decode_tokens)) as answer:
        if answer.status_code != 200:
            body = (await answer.aread())[:300].decode("utf-8", "replace")
            raise EngineError(f"the engine's /completion answered {answer.status_code}: {body}")
        async for line in answer.aiter_lines():
            event = parse_event(line)
            if event is None:
                continue
            seen += 1
            if seen > MAX_EVENTS:
                raise EngineError("the engine's stream did not end")
            if first is None and (event.get("content") or event.get("tokens")):
                first = clock()
            if on_token is not None and not event.get("stop"):
                on_token(seen)
            if event.get("stop"):
                found = event.get("timings")
                timings = found if isinstance(found, dict) else {}
                break
    end = clock()
    if timings is None:
        raise EngineError("the engine's stream ended without its timings")
    return StreamFigures(
        prompt_tokens=int(_number(timings, "prompt_n") or len(prompt)),
        decode_tokens=int(_number(timings, "predicted_n") or 0),
        first_token_s=(first if first is not None else end) - sent,
        wall_s=end - sent,
        prefill_tokens_per_s=_number(timings, "prompt_per_second"),
        decode_tokens_per_s=_number(timings, "predicted_per_second"),
        prefill_ms=_number(timings, "prompt_ms"),
        decode_ms=_number(timings, "predicted_ms"),
    )


@dataclass(frozen=True)
class SlotsFigures:
    """Every slot at once: each stream, and the throughput of all of them together."""

    streams: tuple[StreamFigures, ...]
    wall_s: float  # first request sent -> last one done

    @property
    def decode_tokens(self) -> int:
        return sum(s.decode_tokens for s in self.streams)

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens of all slots over the wall time (prefill included)."""
        return self.decode_tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def decode_tokens_per_s_mean(self) -> float | None:
        rates = [s.decode_tokens_per_s for s in self.streams if s.decode_tokens_per_s]
        return sum(rates) / len(rates) if rates else None

    @property
    def prefill_tokens_per_s_mean(self) -> float | None:
        rates = [s.prefill_tokens_per_s for s in self.streams if s.prefill_tokens_per_s]
        return sum(rates) / len(rates) if rates else None

    @property
    def first_token_s_max(self) -> float:
        return max(s.first_token_s for s in self.streams)


async def all_slots(
    t: Transport,
    prompts: list[list[int]],
    decode_tokens: int,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> SlotsFigures:
    """One generation per prompt, all sent at once (the engine decodes them together)."""
    start = clock()
    streams = await asyncio.gather(*(one_stream(t, p, decode_tokens, clock=clock) for p in prompts))
    return SlotsFigures(tuple(streams), clock() - start)
