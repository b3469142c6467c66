"""Model facts from a GGUF header: what the budget needs, without the weights.

Owns turning a GGUF header (read by ``ggufheader``, bounded and non-blocking) into a
:class:`ModelFacts`, and the one validation of those facts: each key the budget uses
type-checked and held to :data:`BOUNDS` (presets too, :func:`check_facts`), so the
budget only ever sees small positive numbers; ``general.name`` kept only sanitized (at
most :data:`MAX_NAME_CHARS`, no control characters). Errors: :class:`ModelNotFoundError`
(66), :class:`ModelError` (65, naming the file, the key and the value).

Two rules mirror llama.cpp (the one bundled with llama-cpp-python 0.3.36):
:data:`NO_MEMORY_ARCHS` have no KV cache whatever the header says, and
:data:`SWA_PATTERNS` says which layers use sliding-window attention
(``llama_hparams::set_swa_pattern``; a GGUF's ``<arch>.attention.sliding_window_pattern``
overrides it). It must not load or map the weights, nor import the engine.

Example::

    facts = read_model_facts(Path("gemma-3-270m-q4_k_m.gguf"))
    facts.n_layer, facts.swa_layers, facts.kv_bytes_per_cell("f16")
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard.errors import ModelError
from slmguard.plan.bounds import BOUNDS, MAX_NAME_CHARS, Bound, bound_problem
from slmguard.plan.ggufheader import (
    Header,
    Skipped,
    TensorFacts,
    Truncated,
    Unsupported,
    open_regular,
    parse_header,
)
from slmguard.plan.text import sanitize, shown

__all__ = [
    "BOUNDS",
    "MAX_NAME_CHARS",
    "NO_MEMORY_ARCHS",
    "SWA_PATTERNS",
    "Bound",
    "ModelFacts",
    "TensorFacts",
    "check_facts",
    "read_model_facts",
]

# Architectures whose sliding-window layers follow llama.cpp's
# ``set_swa_pattern(n)``: layer il uses SWA when il % n < n - 1 (every n-th
# layer, counting from 1, is full attention). Source: llama.cpp
# src/llama-model.cpp, load_hparams, as bundled in llama-cpp-python 0.3.36.
# phi3 carries a sliding_window key but llama.cpp disables SWA for it ("Phi
# SWA is currently disabled"), so it is deliberately absent.
SWA_PATTERNS: Mapping[str, int] = {
    "gemma2": 2,
    "gemma3": 6,
    "cohere2": 4,
}

# Architectures llama.cpp runs without a memory module, so with no KV cache at all:
# the encoders (BERT and its kin, EmbeddingGemma: non-causal attention, an embedding or
# rerank per input) and the diffusion decoders. Every input is then computed whole in
# one ubatch, its attention over the ubatch's own tokens. Source:
# ``llama_model::create_memory`` in src/llama-model.cpp (``res = nullptr``) and the
# names in src/llama-arch.cpp, llama.cpp as bundled in llama-cpp-python 0.3.36. It is
# the architecture that decides, not ``<arch>.attention.causal``.
NO_MEMORY_ARCHS = frozenset(
    {
        "bert",
        "modern-bert",
        "nomic-bert",
        "nomic-bert-moe",
        "neo-bert",
        "jina-bert-v2",
        "jina-bert-v3",
        "eurobert",
        "gemma-embedding",
        "wavtokenizer-dec",
        "dream",
        "llada",
        "llada-moe",
        "rnd1",
    }
)

# Architectures without attention or KV cache that this budget cannot model.
_NO_ATTENTION = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})


@dataclass(frozen=True)
class ModelFacts:
    """What the header says about a model, in llama.cpp's terms.

    ``n_head`` and ``n_head_kv`` are ints, or per-layer tuples when the GGUF
    stores an array. ``key_length``/``value_length`` default to
    ``n_embd // n_head`` as llama.cpp does. ``swa_layers`` lists the layer
    indices that use the sliding window (empty when there is none).
    ``tensor_bytes_by_type`` sums tensor data bytes per ggml type.
    """

    path: Path
    arch: str
    name: str
    n_layer: int
    n_head: int | tuple[int, ...]
    n_head_kv: int | tuple[int, ...]
    key_length: int
    value_length: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    sliding_window: int
    swa_layers: tuple[int, ...]
    chat_template: str | None
    file_bytes: int
    tensor_bytes_by_type: Mapping[str, int]
    n_ff: int = 0
    gguf_version: int = 3
    file_type: int | None = None
    data_offset_bytes: int = 0
    tensors: tuple[TensorFacts, ...] = field(default=(), repr=False)
    pooling_type: int | None = None  # <arch>.pooling_type: set by embedding models
    causal_attn: bool = True  # <arch>.attention.causal: False for an encoder (BERT)
    rerank_template: str | None = None  # tokenizer.chat_template.rerank: a reranker's prompt

    @property
    def has_kv_cache(self) -> bool:
        """Whether llama.cpp gives the model a KV cache (:data:`NO_MEMORY_ARCHS`: not)."""
        return self.arch not in NO_MEMORY_ARCHS

    @property
    def tensor_bytes(self) -> int:
        """All tensor data bytes (the weights as stored)."""
        return sum(self.tensor_bytes_by_type.values())

    def head_kv_at(self, il: int) -> int:
        """KV heads of layer ``il``."""
        if isinstance(self.n_head_kv, tuple):
            return self.n_head_kv[il]
        return self.n_head_kv

    def kv_elements_per_cell(self, il: int) -> tuple[int, int]:
        """(K elements, V elements) one token occupies in layer ``il``."""
        h = self.head_kv_at(il)
        return h * self.key_length, h * self.value_length

    def is_swa(self, il: int) -> bool:
        return il in self.swa_layers

    def tensor(self, name: str) -> TensorFacts | None:
        return next((t for t in self.tensors if t.name == name), None)


_ARCH_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-.")
_MAX_ARCH_CHARS = 64


def check_facts(facts: ModelFacts) -> None:
    """Every fact within :data:`BOUNDS` (also for facts built from a preset).

    Raises :class:`ModelError` naming the GGUF key and the value.
    """
    per_layer = {"n_head": facts.n_head, "n_head_kv": facts.n_head_kv}
    singles = {
        "n_layer": facts.n_layer,
        "n_embd": facts.n_embd,
        "key_length": facts.key_length,
        "value_length": facts.value_length,
        "n_ctx_train": facts.n_ctx_train,
        "n_ff": facts.n_ff,
        "sliding_window": facts.sliding_window,
        "n_vocab": facts.n_vocab,
    }
    for fact, value in singles.items():
        why = bound_problem(fact, value, facts.arch)
        if why:
            raise ModelError(facts.path, why)
    for fact, layered in per_layer.items():
        values = layered if isinstance(layered, tuple) else (layered,)
        if isinstance(layered, tuple) and len(layered) != facts.n_layer:
            key = BOUNDS[fact].key.format(arch=facts.arch)
            raise ModelError(
                facts.path, f"{key} has {len(layered)} entries for {facts.n_layer} layers"
            )
        for v in values:
            why = bound_problem(fact, v, facts.arch)
            if why:
                raise ModelError(facts.path, why)
    n = facts.n_layer
    heads = facts.n_head if isinstance(facts.n_head, tuple) else (facts.n_head,) * n
    kv = facts.n_head_kv if isinstance(facts.n_head_kv, tuple) else (facts.n_head_kv,) * n
    if max(heads) < 1:
        key = BOUNDS["n_head"].key.format(arch=facts.arch)
        raise ModelError(facts.path, f"{key} = {facts.n_head}: no layer has attention heads")
    for il, (h, k) in enumerate(zip(heads, kv, strict=True)):
        if k > h:
            key = BOUNDS["n_head_kv"].key.format(arch=facts.arch)
            raise ModelError(
                facts.path, f"{key} = {k} in layer {il}: more KV heads than the {h} heads"
            )
    if any(not 0 <= il < facts.n_layer for il in facts.swa_layers):
        raise ModelError(facts.path, "sliding-window layer index outside the model's layers")


def _described(value: Any) -> str:
    """What a metadata value is, for "expected X, got Y"."""
    if isinstance(value, Skipped):
        unit = "bytes" if value.what == "string" else "elements"
        return f"a {value.what} of {value.length:,} {unit}"
    if isinstance(value, tuple):
        return f"an array of {len(value)}"
    if isinstance(value, bool):
        return f"the boolean {value}"
    if isinstance(value, str):
        return f"the string {shown(value, 40)}"
    return shown(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Facts:
    """Typed, bounded access to the metadata of one architecture."""

    def __init__(self, kv: Mapping[str, Any], arch: str) -> None:
        self.kv = kv
        self.arch = arch

    def key(self, fact: str) -> str:
        return BOUNDS[fact].key.format(arch=self.arch)

    def bounded(self, fact: str, value: int) -> int:
        why = bound_problem(fact, value, self.arch)
        if why:
            raise _OutOfBounds(why)
        return value

    def scalar(self, fact: str, default: int | None = None) -> int:
        """A scalar integer within its bounds (``default`` when absent)."""
        key = self.key(fact)
        value = self.kv.get(key)
        if value is None:
            if default is None:
                raise Unsupported(f"missing metadata key {shown(key)}")
            return default
        if not _is_int(value):
            raise _WrongType(f"{key}: expected an integer, got {_described(value)}")
        return self.bounded(fact, value)

    def per_layer(self, fact: str, n_layer: int) -> int | tuple[int, ...] | None:
        """An integer, or one per layer (an array of ``n_layer``), each within bounds."""
        key = self.key(fact)
        value = self.kv.get(key)
        if value is None:
            return None
        if _is_int(value):
            return self.bounded(fact, value)
        if not isinstance(value, tuple) or not all(_is_int(v) for v in value):
            raise _WrongType(
                f"{key}: expected an integer or an array of integers, got {_described(value)}"
            )
        if len(value) != n_layer:
            raise _WrongType(f"{key}: {len(value)} entries for {n_layer} layers")
        ints = tuple(self.bounded(fact, v) for v in value)
        return ints[0] if len(set(ints)) == 1 else ints

    def max_per_layer(self, fact: str, n_layer: int, default: int) -> int:
        value = self.per_layer(fact, n_layer)
        if value is None:
            return default
        return max(value) if isinstance(value, tuple) else value


class _OutOfBounds(Exception):
    """A fact outside :data:`BOUNDS` (message: key, value, limit)."""


class _WrongType(Exception):
    """A metadata key slmguard reads holds the wrong kind of value (message names it)."""


def _string_key(kv: Mapping[str, Any], key: str) -> str | None:
    value = kv.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _WrongType(f"{key}: expected a string, got {_described(value)}")
    return value


def _swa_layers(kv: Mapping[str, Any], fx: _Facts, n_layer: int, window: int) -> tuple[int, ...]:
    if window <= 0:
        return ()
    key = fx.key("swa_pattern")
    pattern = kv.get(key)
    if isinstance(pattern, tuple):
        if len(pattern) != n_layer or not all(isinstance(v, bool | int) for v in pattern):
            raise _WrongType(
                f"{key}: expected {n_layer} booleans (one per layer), got {_described(pattern)}"
            )
        return tuple(il for il, on in enumerate(pattern) if on)
    if pattern is not None and not _is_int(pattern):
        raise _WrongType(f"{key}: expected an integer or an array, got {_described(pattern)}")
    n = fx.bounded("swa_pattern", pattern) if pattern is not None else SWA_PATTERNS.get(fx.arch)
    if n is None:
        return ()
    return tuple(il for il in range(n_layer) if n == 0 or il % n < n - 1)


def _arch(kv: Mapping[str, Any]) -> str:
    arch = _string_key(kv, "general.architecture")
    if not arch:
        raise Unsupported("no general.architecture")
    if len(arch) > _MAX_ARCH_CHARS or not set(arch) <= _ARCH_CHARS:
        raise _WrongType(
            f"general.architecture = {shown(arch)}: not an architecture name "
            "(lower-case letters, digits, '_', '-', '.')"
        )
    return arch


def _budgetable_arch(kv: Mapping[str, Any]) -> str:
    """The architecture, once the file is known to be a model with a KV cache."""
    general_type = _string_key(kv, "general.type") or "model"
    if general_type != "model":
        raise Unsupported(f"general.type is {shown(general_type)}, not a model (an adapter?)")
    arch = _arch(kv)
    if arch in _NO_ATTENTION:
        raise Unsupported(f"architecture {arch!r} has no attention KV cache to budget")
    return arch


def _heads(
    fx: _Facts, n_layer: int, n_embd: int
) -> tuple[int | tuple[int, ...], int | tuple[int, ...], int, int]:
    """(n_head, n_head_kv, key_length, value_length), with llama.cpp's defaults."""
    n_head = fx.per_layer("n_head", n_layer)
    if n_head is None:
        raise Unsupported(f"missing metadata key '{fx.key('n_head')}'")
    n_head_kv = fx.per_layer("n_head_kv", n_layer)
    if n_head_kv is None:  # llama.cpp: n_head_kv defaults to n_head
        n_head_kv = n_head
    head_max = max(n_head) if isinstance(n_head, tuple) else n_head
    if head_max < 1:
        raise _OutOfBounds(f"{fx.key('n_head')} = {n_head}: no layer has attention heads")
    head_size = n_embd // head_max  # llama.cpp's default n_embd_head_k / _v
    key_length = fx.scalar("key_length", max(head_size, 1) if head_size else 0)
    value_length = fx.scalar("value_length", max(head_size, 1) if head_size else 0)
    if key_length < 1 or value_length < 1:
        raise _OutOfBounds(
            f"{fx.key('n_embd')} = {n_embd} with {head_max} heads leaves no head size"
        )
    return n_head, n_head_kv, key_length, value_length


def _n_vocab(kv: Mapping[str, Any], fx: _Facts, tensors: tuple[TensorFacts, ...]) -> int:
    """The vocabulary size: the token list's length, else ``<arch>.vocab_size``, else
    the token embedding's row count."""
    tokens = kv.get("tokenizer.ggml.tokens")
    vocab_key = f"{fx.arch}.vocab_size"
    if isinstance(tokens, Skipped) and tokens.what == "array":
        n_vocab = tokens.length
    elif isinstance(tokens, tuple):
        n_vocab = len(tokens)
    elif tokens is not None:
        raise _WrongType(
            f"tokenizer.ggml.tokens: expected an array of strings, got {_described(tokens)}"
        )
    elif kv.get(vocab_key) is not None:
        if not _is_int(kv[vocab_key]):
            raise _WrongType(f"{vocab_key}: expected an integer, got {_described(kv[vocab_key])}")
        n_vocab = kv[vocab_key]
    else:
        embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
        if embd is None or len(embd.shape) < 2:
            raise Unsupported("no vocabulary (tokenizer.ggml.tokens) and no token_embd.weight")
        n_vocab = embd.shape[1]
    return fx.bounded("n_vocab", n_vocab)


def _facts(path: Path, file_bytes: int, h: Header) -> ModelFacts:
    kv = h.kv
    arch = _budgetable_arch(kv)
    fx = _Facts(kv, arch)
    n_layer = fx.scalar("n_layer")
    n_embd = fx.scalar("n_embd")
    n_head, n_head_kv, key_length, value_length = _heads(fx, n_layer, n_embd)
    window = fx.scalar("sliding_window", 0)
    swa = _swa_layers(kv, fx, n_layer, window)
    if not swa:  # e.g. phi3: the key is present but llama.cpp ignores it
        window = 0
    n_vocab = _n_vocab(kv, fx, h.tensors)
    template = kv.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise _WrongType(f"tokenizer.chat_template: expected a string, got {_described(template)}")
    by_type: dict[str, int] = {}
    for t in h.tensors:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
    raw_name = _string_key(kv, "general.name")
    name = sanitize(raw_name or "", MAX_NAME_CHARS) or sanitize(path.stem, MAX_NAME_CHARS)
    ftype = kv.get("general.file_type")
    return ModelFacts(
        path=path,
        arch=arch,
        name=name or "model",
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        key_length=key_length,
        value_length=value_length,
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_ctx_train=fx.scalar("n_ctx_train"),
        sliding_window=window,
        swa_layers=swa,
        chat_template=template,
        file_bytes=file_bytes,
        tensor_bytes_by_type=dict(sorted(by_type.items())),
        n_ff=fx.max_per_layer("n_ff", n_layer, 0),
        gguf_version=h.version,
        file_type=ftype if isinstance(ftype, int) and 0 <= ftype < (1 << 16) else None,
        data_offset_bytes=h.data_offset,
        tensors=h.tensors,
        pooling_type=_pooling(kv.get(f"{arch}.pooling_type")),
        causal_attn=kv.get(f"{arch}.attention.causal") is not False,
        rerank_template=_string_key(kv, "tokenizer.chat_template.rerank"),
    )


def _pooling(value: Any) -> int | None:
    """llama.cpp's pooling type (1 mean, 2 cls, 3 last, 4 rank); 0 or absent: none."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def read_model_facts(path: Path) -> ModelFacts:
    """Read ``path``'s GGUF header; see the module docstring for the errors."""
    path = Path(path)
    f = open_regular(path)
    with f:
        try:
            file_bytes = os.fstat(f.fileno()).st_size
        except OSError as err:
            raise ModelError(path, f"cannot stat: {err.strerror or err}") from err
        if file_bytes == 0:
            raise ModelError(path, "empty file (0 bytes), not a GGUF model")
        try:
            header = parse_header(f, file_bytes)
            facts = _facts(path, file_bytes, header)
        except ModelError as err:
            raise ModelError(path, err.problem, hint=err.hint) from err
        except Truncated as err:
            detail = f": {err}" if str(err) else ""
            raise ModelError(
                path,
                f"truncated: the header ends early (file is {file_bytes} bytes){detail}",
                hint="the download or copy is incomplete; fetch the file again",
            ) from err
        except Unsupported as err:
            raise ModelError(path, f"unsupported: {err}") from err
        except (_OutOfBounds, _WrongType) as err:
            raise ModelError(path, str(err)) from err
        except (ValueError, UnicodeDecodeError, struct.error, OverflowError) as err:
            raise ModelError(path, f"corrupt GGUF header: {err}") from err
        except OSError as err:
            raise ModelError(path, f"cannot read: {err.strerror or err}") from err
    end = max(
        (facts.data_offset_bytes + t.offset_bytes + t.n_bytes for t in facts.tensors),
        default=facts.data_offset_bytes,
    )
    if end > file_bytes:
        raise ModelError(
            path,
            f"truncated: tensor data runs to byte {end} but the file has {file_bytes} bytes "
            f"({end - file_bytes} missing)",
            hint="the download or copy is incomplete; fetch the file again",
        )
    check_facts(facts)
    return facts
