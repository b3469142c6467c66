"""Several choices of one non-stream request, gathered from the engine's stream.

Owns :class:`Gathered` (a completion's) and :class:`GatheredChat` (a chat
completion's): the engine's non-stream answer counts the usage of choice 0
only, its stream every choice's, so the relay asks for the stream and these
assemble the answer the client asked for (each choice's text or message,
finish reason and logprobs, the usage summed with each prompt counted once).
Pure: fed parsed chunks, no I/O; reading the stream is the relay's.
"""

from __future__ import annotations

from typing import Any

from slmguard.serve.answers import TurnBuilder, add_usage

_HEAD = ("id", "created", "model", "system_fingerprint")
_NO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


class Gathered:
    """A completion's stream made the non-stream answer."""

    def __init__(self, per_prompt: int) -> None:
        self.per_prompt = per_prompt
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: Any = None

    def feed(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {k: chunk[k] for k in _HEAD if k in chunk}
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
            "usage": self.usage or dict(_NO_USAGE),
        }  # fmt: skip


class GatheredChat:
    """A chat completion's stream made the engine's non-stream answer with every choice:
    each choice's message assembled from its deltas, its finish reason and logprobs; the
    usage summed (one chunk with no choices per choice, the prompt counted with the
    first); the timings of the first choice that finished."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.messages: dict[int, TurnBuilder] = {}
        self.finish: dict[int, Any] = {}
        self.logprobs: dict[int, list[Any]] = {}
        self.usage: Any = None
        self.timings: Any = None

    def feed(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {k: chunk[k] for k in _HEAD if k in chunk}
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
            "usage": self.usage or dict(_NO_USAGE),
        }  # fmt: skip
        if self.timings is not None:
            out["timings"] = self.timings
        return out


def gathering(endpoint: str, per_prompt: int) -> Gathered | GatheredChat:
    """The gatherer of an endpoint's answer (``chat``'s messages, else a completion's text)."""
    return GatheredChat() if endpoint == "chat" else Gathered(per_prompt)
