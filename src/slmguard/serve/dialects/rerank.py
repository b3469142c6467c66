"""Reranking (``/v1/rerank``), made ready for the engine: one task per document.

Owns :func:`prepare_rerank`: each (query, document) pair counted as the engine
will see it (:func:`rerank_pairs`: the model's rerank template rendered and
counted exactly, its control tokens refused; else each text counted plain with
up to :data:`RERANK_SPECIAL_TOKENS` around them), the longest pair within one
slot's context and, on an encoder, one batch (else 400
``context_length_exceeded`` naming the document or the query, or the policy's
verdict); one slot per document, nothing generated, the prompt tokens counted
from the engine's answer. It must not admit, queue or send the request (the
relay's), nor import another dialect.
"""

from __future__ import annotations

from typing import Any

from slmguard.errors import RequestError, RequestTooLargeError
from slmguard.governor.request import SizedRequest
from slmguard.serve.dialects.context import DialectContext
from slmguard.serve.generation import Generation

#: The most special tokens llama-server puts around a rerank's query and document when the
#: model has no rerank template (``format_prompt_rerank``: BOS, then EOS and SEP after the
#: query, EOS after the document, as the vocabulary asks).
RERANK_SPECIAL_TOKENS = 4


async def prepare_rerank(ctx: DialectContext, data: dict[str, Any]) -> Generation:
    """A rerank request: one engine task (and slot) per document, nothing generated.

    Each (query, document) pair is one engine task in one slot, counted as the engine
    will see it (:func:`rerank_pairs`). The longest must fit one slot's context and,
    on an encoder (not causal), one batch, else 400 ``context_length_exceeded``
    naming the document (``documents.<i>``; ``query`` when the query alone leaves no
    room), or the policy's verdict (the governor's 503 while the context is shrunk):
    the engine would answer 500 (``input is too large to process``). The prompt
    tokens counted are the engine's own, from its answer (``usage.prompt_tokens``).
    """
    body = {**data, "model": ctx.model.id}
    pairs = await rerank_pairs(ctx, data["query"], data["documents"])
    longest = max(range(len(pairs)), key=pairs.__getitem__)
    sized = SizedRequest("rerank", pairs[longest], 0, n=min(len(pairs), ctx.sizing.slots()))
    await _check_pair(ctx, sized, data["query"], longest)
    return Generation("rerank", "/v1/rerank", body, False, False, sized,
                      prompt_from_answer=True)  # fmt: skip


async def rerank_pairs(ctx: DialectContext, query: str, documents: list[str]) -> list[int]:
    """Each (query, document) pair's tokens as the engine will see them.

    With the model's rerank template (``tokenizer.chat_template.rerank``) the engine
    puts the two into it and tokenizes the prompt with special tokens parsed: the
    same prompt is counted exactly, and a query or document holding one of the
    model's control tokens is refused (400 ``control_token_in_message``): it would
    forge the prompt's structure, such as the separator between the two. Without
    one the engine tokenizes each as plain text (no special token parsed) and puts
    up to :data:`RERANK_SPECIAL_TOKENS` around them.
    """
    template = ctx.model.rerank_template
    if template is not None:
        texts = {"query": query, **{f"documents.{i}": d for i, d in enumerate(documents)}}
        for param, text in texts.items():
            if await ctx.holds_control_token(text):
                raise RequestError(
                    f"{param} contains text that is one of this model's control tokens; "
                    "the engine parses them in its rerank template, so it would forge "
                    "the prompt's structure: it is refused",
                    code="control_token_in_message",
                    param=param,
                )
        prompts = [template.replace("{query}", query).replace("{document}", d)
                   for d in documents]  # fmt: skip
        return [await ctx.count_tokens(p, add_special=False) for p in prompts]
    plain = {"add_special": False, "parse_special": False}
    q = await ctx.count_tokens(query, **plain)
    return [q + RERANK_SPECIAL_TOKENS + await ctx.count_tokens(d, **plain)
            for d in documents]  # fmt: skip


def _batch(ctx: DialectContext) -> int:
    """The tokens the engine computes in one batch (with ``--reranking`` llama-server
    makes n_batch n_ubatch when it is larger)."""
    settings = ctx.sizing.settings()
    return min(settings.n_batch, settings.n_ubatch)


async def _check_pair(ctx: DialectContext, sized: SizedRequest, query: str, index: int) -> None:
    """The longest pair (``sized``, document ``index``) within one batch (an
    encoder's) and one slot's context."""
    slot = ctx.sizing.slot_tokens
    if not ctx.model.causal and sized.prompt_tokens > _batch(ctx):
        where, limit = f"one batch of {_batch(ctx)} tokens (an encoder's)", _batch(ctx)
    elif not ctx.sizing.fits(sized.prompt_tokens, 1):
        verdict = ctx.sizing.policy.context_verdict(sized)
        if verdict is not None:
            raise verdict
        where, limit = f"one slot's context of {slot} tokens", slot - 1
    else:
        return
    alone = (await rerank_pairs(ctx, query, [""]))[0]  # the pair with an empty document
    raise RequestTooLargeError(
        f"each (query, document) pair is one engine task computed in {where}; with "
        f"document {index} it has {sized.prompt_tokens} tokens, the query alone {alone} "
        "(with the special tokens the engine adds)",
        param="query" if alone >= limit else f"documents.{index}",
    )
