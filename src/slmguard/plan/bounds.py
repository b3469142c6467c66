"""The limits of real models: what a GGUF header may say before it is refused.

One table (:data:`BOUNDS`) used twice: by :mod:`slmguard.plan.modelfacts` on a
model file's facts (and a preset's), and by :mod:`slmguard.plan.schema` on a
plan's numbers, so a plan edited by hand is held to what a real model allows.
Pure data: importing it pulls in no GGUF reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MAX_NAME_CHARS = 128  # general.name as slmguard keeps it (sanitized)


@dataclass(frozen=True)
class Bound:
    """The range of one model fact in real models, and the GGUF key it comes from."""

    key: str  # "{arch}." is replaced by the architecture
    lo: int
    hi: int
    note: str


# The limits real models have, with room to spare; a value outside is a broken or
# crafted file, never a model to budget. After these, the budget's arithmetic sees
# only small positive numbers (no negative KV cache, no loop over 10^12 layers).
BOUNDS: Mapping[str, Bound] = {
    "n_layer": Bound("{arch}.block_count", 1, 1024, "Llama 3.1 405B has 126 layers"),
    "n_embd": Bound("{arch}.embedding_length", 1, 1 << 17, "Llama 3.1 405B: 16,384"),
    "n_head": Bound("{arch}.attention.head_count", 0, 1024, "per layer; 0: no attention"),
    "n_head_kv": Bound("{arch}.attention.head_count_kv", 0, 1024, "per layer"),
    "key_length": Bound("{arch}.attention.key_length", 1, 4096, "head size: 64-256, MLA 576"),
    "value_length": Bound("{arch}.attention.value_length", 1, 4096, "head size"),
    "n_ctx_train": Bound("{arch}.context_length", 1, 1 << 24, "Llama 4 Scout: 10,485,760"),
    "n_ff": Bound("{arch}.feed_forward_length", 0, 1 << 20, "Llama 3.1 405B: 53,248"),
    "sliding_window": Bound("{arch}.attention.sliding_window", 0, 1 << 24, "Gemma 3: 512"),
    "n_vocab": Bound("tokenizer.ggml.tokens", 1, 1 << 22, "Gemma 3: 262,144 entries"),
    "swa_pattern": Bound("{arch}.attention.sliding_window_pattern", 0, 1024, "Gemma 3: 6"),
}


def bound_problem(fact: str, value: int, arch: str) -> str | None:
    """``"<key> = <value>: ..."`` when ``value`` is outside :data:`BOUNDS`, else None."""
    b = BOUNDS[fact]
    if b.lo <= value <= b.hi:
        return None
    side = f"below {b.lo:,}" if value < b.lo else f"above {b.hi:,}"
    return f"{b.key.format(arch=arch)} = {value}: {side}, not a real model ({b.note})"
