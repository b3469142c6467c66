"""OpenAI's completions (``/v1/completions``), made ready for the engine.

Owns :func:`prepare_completion`: every prompt form (a string or a token list is
one prompt, a list of either one prompt each), each prompt counted as the
engine will (``/tokenize``; a token list is its own count), each given ``n``
choices (one engine task, and at most one slot, per choice), sized by the
longest prompt, all of them together within what the slots hold at once;
several tasks without a stream are gathered from the engine's stream so the
usage counts them all. It must not admit, queue or send the
generation (the relay's), nor import another dialect.
"""

from __future__ import annotations

from typing import Any

from slmguard.serve.dialects.context import DialectContext
from slmguard.serve.generation import Generation, openai_generation


async def prepare_completion(ctx: DialectContext, data: dict[str, Any]) -> Generation:
    """A completion request (already validated by its schema) made ready for the engine.

    Every prompt must fit one slot with its ``max_tokens``.
    """
    body = dict(data)
    body["model"] = ctx.model.id
    n = ctx.sizing.check_n(data.get("n"))
    prompt = data["prompt"]
    one = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
    prompts = [prompt] if one else list(prompt)
    counts = [len(p) if isinstance(p, list) else await ctx.count_tokens(p) for p in prompts]
    ctx.sizing.check_total(n * sum(counts), "prompt")
    stream = bool(data.get("stream"))
    tasks = n * len(prompts)
    slots = min(tasks, ctx.sizing.slots())
    sized = ctx.sizing.size("completions", max(counts), data.get("max_tokens"), n=slots,
                            stream=stream)  # fmt: skip
    gen = openai_generation("/v1/completions", body, data, sized, None)
    gen.per_prompt = n
    gen.prompt_total = sum(counts)
    if tasks > 1 and not stream:
        gen.gather_stream()
    return gen
