"""The model one engine serves, as the routes and the dialects describe it.

Owns :class:`ServedModel`: its names (id and aliases), file, what its GGUF
declares (an embedding model, a reranker, an encoder, a rerank template, a chat
template) and the note said about it. Plain data, built once by
:func:`slmguard.serve.server.build_server`; nothing here reads the file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServedModel:
    """The model the engine serves, as the routes describe it."""

    id: str
    path: str
    file_bytes: int
    sha256: str | None = None
    arch: str = ""
    n_ctx_train: int = 0
    n_vocab: int = 0  # token ids are 0..n_vocab-1 (0: unknown, not checked)
    embeddings: bool = False  # the GGUF declares a pooling type (an embedding model)
    rerank: bool = False  # its pooling type is rank (a reranker: /v1/rerank)
    causal: bool = True  # False: an encoder (BERT), each engine task computed in one batch
    rerank_template: str | None = None  # the GGUF's rerank prompt ({query}, {document})
    aliases: tuple[str, ...] = ()  # more names clients may use (--model-alias)
    chat_template: bool = False  # the GGUF carries a chat template
    note: str | None = None  # e.g. BASE_MODEL_NOTE for the embedded base model
    role: str | None = None  # a board's: chat, completion, embedding, rerank (None: not said)
    created_s: int = field(default_factory=lambda: int(time.time()))

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the model answers to: its id, then its aliases."""
        return (self.id, *(a for a in self.aliases if a != self.id))
