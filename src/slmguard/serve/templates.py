"""Chat templates: turn OpenAI chat messages into one prompt string.

Owns the choice and rendering of the prompt format; pure (no I/O, no engine).
When the GGUF carries ``tokenizer.chat_template`` it is rendered with a
sandboxed Jinja2 environment, as the model's authors intended. Otherwise a
built-in format is chosen from the architecture:

- Gemma (``gemma``, ``gemma2``, ``gemma3``, ``gemma3n``): Gemma's turn format,
  ``<start_of_turn>user\\n...<end_of_turn>\\n`` with ``assistant`` written as
  ``model``. Gemma has no system role: system (and developer) messages are folded
  into the first user turn, separated by a blank line, as Gemma's own template
  does.
- anything else: ChatML (``<|im_start|>role\\n...<|im_end|>\\n``).

The rendered prompt contains the special tokens as text, so the worker
tokenizes it with ``special=True``. BOS: the built-in Gemma format writes
``<bos>`` itself (tokenized with ``add_bos=False``); a GGUF template is rendered
with an empty ``bos_token`` and the tokenizer adds BOS when the model asks for
it (``add_bos=True``), so a template that writes ``{{ bos_token }}`` never
produces two. ``eos_token`` is the model's own (the worker reports it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | developer | user | assistant
    content: str


@dataclass(frozen=True)
class Template:
    """How to render chat for one model. ``jinja`` is the GGUF template, if any."""

    arch: str
    jinja: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    @property
    def kind(self) -> str:
        if self.jinja:
            return "gguf"
        return "gemma" if self.arch in GEMMA_ARCHS else "chatml"

    @property
    def add_bos(self) -> bool:
        """Whether the tokenizer should add BOS to the rendered prompt."""
        return self.kind == "gguf"

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """End-of-turn markers, in case the engine does not treat them as EOG."""
        return {"gemma": ("<end_of_turn>",), "chatml": ("<|im_end|>",)}.get(self.kind, ())


Segment = tuple[str, bool]
"""A piece of prompt text and whether it may contain special tokens."""


class TemplateError(ValueError):
    """The GGUF's template rejected the conversation (it called raise_exception)."""


def render_chat(template: Template, messages: Sequence[ChatMessage]) -> str:
    if template.kind == "gguf":
        return _render_jinja(template, messages)
    if template.kind == "gemma":
        return render_gemma(messages, bos_token=template.bos_token or "<bos>")
    return render_chatml(messages)


def render_segments(template: Template, messages: Sequence[ChatMessage]) -> list[Segment]:
    """The prompt as segments: template text (special tokens allowed) and message
    contents (never parsed as special tokens, so a user cannot forge a turn marker).

    Each non-empty content is replaced by a unique marker before rendering and
    the rendered text is split at the markers. A template that changes the
    content it is given (a marker missing or repeated, or the pieces not adding
    up to the normally rendered prompt) falls back to one segment of the whole
    rendered prompt.
    """
    if template.kind == "gemma":
        messages = [ChatMessage(m.role, m.content.strip()) for m in messages]
    markers = {f"\x00{i}\x00": m.content for i, m in enumerate(messages) if m.content}
    masked = [
        ChatMessage(m.role, f"\x00{i}\x00" if m.content else "") for i, m in enumerate(messages)
    ]
    whole = render_chat(template, messages)
    parts = re.split("(\x00[0-9]+\x00)", render_chat(template, masked))
    found = [p for p in parts if p in markers]
    segments = [(markers[p], False) if p in markers else (p, True) for p in parts if p]
    if sorted(found) != sorted(markers) or "".join(t for t, _ in segments) != whole:
        return [(whole, True)]
    return segments


def render_gemma(messages: Sequence[ChatMessage], *, bos_token: str = "<bos>") -> str:
    system = [m.content for m in messages if m.role in ("system", "developer")]
    turns = [m for m in messages if m.role not in ("system", "developer")]
    parts = [bos_token]
    prefix = "\n\n".join(system)
    if prefix and (not turns or turns[0].role != "user"):
        turns.insert(0, ChatMessage("user", ""))
    for i, m in enumerate(turns):
        role = "model" if m.role == "assistant" else "user"
        content = m.content.strip()
        if i == 0 and prefix:
            content = f"{prefix}\n\n{content}" if content else prefix
        parts.append(f"<start_of_turn>{role}\n{content}<end_of_turn>\n")
    parts.append("<start_of_turn>model\n")
    return "".join(parts)


def render_chatml(messages: Sequence[ChatMessage]) -> str:
    parts = [f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages]
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _render_jinja(template: Template, messages: Sequence[ChatMessage]) -> str:
    from jinja2 import TemplateError as JinjaError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> Any:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template.jinja or "").render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            bos_token="",  # the tokenizer adds BOS (see module docstring)
            eos_token=template.eos_token,
        )
    except JinjaError as err:
        raise TemplateError(f"chat template failed: {err}") from err
