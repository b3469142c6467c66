"""Raw GGUF bytes for hostile-input tests: any count, any type, any nesting.

``gguf.GGUFWriter`` writes only valid files; the tests need what an attacker
writes: negative values, counts larger than the file, arrays where a scalar
belongs, nested arrays, strings with NULs and newlines. The layout follows
the GGUF spec (ggml's ``docs/gguf.md``): magic, version, tensor count, key
count (u64), then key/value pairs (key string, u32 value type, value), then
the tensor table (name, u32 n_dims, u64 dims, u32 ggml type, u64 offset).

Values are given as ``(type, value)`` with the type names below; arrays as
``("array", (element_type, [values]))`` where the element type may itself be
``"array"`` (its values then ``(element_type, [values])`` pairs).

Example::

    data = gguf_bytes(
        minimal_kv(block_count=("u64", 10**12)),
        tensors=[tensor("token_embd.weight", (64, 8))],
    )
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCALARS = {
    "u8": (0, "B"),
    "i8": (1, "b"),
    "u16": (2, "H"),
    "i16": (3, "h"),
    "u32": (4, "I"),
    "i32": (5, "i"),
    "f32": (6, "f"),
    "bool": (7, "?"),
    "u64": (10, "Q"),
    "i64": (11, "q"),
    "f64": (12, "d"),
}
STRING, ARRAY = 8, 9
TYPE_CODES = {**{k: v[0] for k, v in SCALARS.items()}, "str": STRING, "array": ARRAY}
F32 = 0  # ggml type code of F32 tensors


def _string(s: str | bytes, length: int | None = None) -> bytes:
    raw = s.encode("utf-8", errors="surrogatepass") if isinstance(s, str) else s
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def value_bytes(vtype: str, value: Any) -> bytes:
    """The encoding of one value (without its type code)."""
    if vtype in SCALARS:
        return struct.pack("<" + SCALARS[vtype][1], value)
    if vtype == "str":
        return _string(value)
    if vtype == "array" and isinstance(value, bytes):  # from nested_array()
        return value
    if vtype == "array":
        etype, items = value
        out = struct.pack("<IQ", TYPE_CODES[etype], len(items))
        if etype in SCALARS:
            return out + struct.pack(f"<{len(items)}{SCALARS[etype][1]}", *items)
        return out + b"".join(value_bytes(etype, v) for v in items)
    raise ValueError(vtype)


def nested_array(depth: int) -> bytes:
    """An array of one array of ... (``depth`` levels) of one u8, as raw value bytes
    (use as ``(key, "array", nested_array(n))``); built without recursion."""
    inner = struct.pack("<IQB", SCALARS["u8"][0], 1, 1)
    return struct.pack("<IQ", ARRAY, 1) * (depth - 1) + inner


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    ggml_type: int = F32
    offset: int = 0


def tensor(name: str, shape: tuple[int, ...], offset: int = 0) -> Tensor:
    return Tensor(name, shape, F32, offset)


def gguf_bytes(
    kv: Iterable[tuple[str, str, Any]],
    tensors: Sequence[Tensor] = (),
    *,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    version: int = 3,
    data: bool = True,
    alignment: int = 32,
) -> bytes:
    """A GGUF file. ``n_kv``/``n_tensors`` override the counts in the header;
    ``data`` appends zeroed tensor data (F32) so the table fits the file."""
    items = list(kv)
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                len(items) if n_kv is None else n_kv)  # fmt: skip
    for key, vtype, value in items:
        out += _string(key) + struct.pack("<I", TYPE_CODES[vtype]) + value_bytes(vtype, value)
    end = 0
    for t in tensors:
        out += _string(t.name) + struct.pack("<I", len(t.shape))
        out += b"".join(struct.pack("<Q", d) for d in t.shape)
        out += struct.pack("<IQ", t.ggml_type, t.offset)
        n = 4
        for d in t.shape:
            n *= d
        end = max(end, t.offset + n)
    if data and tensors:
        out += b"\0" * (-len(out) % alignment) + b"\0" * end
    return out


def minimal_kv(
    arch: str = "llama", **overrides: tuple[str, Any] | None
) -> list[tuple[str, str, Any]]:
    """The keys a budgetable model needs; ``overrides`` replace (or with None drop)
    ``<arch>.<name>`` keys, dots written as ``__`` (``attention__head_count``)."""
    base: dict[str, tuple[str, Any]] = {
        "block_count": ("u32", 2),
        "embedding_length": ("u32", 64),
        "context_length": ("u32", 4096),
        "feed_forward_length": ("u32", 128),
        "attention__head_count": ("u32", 4),
        "attention__head_count_kv": ("u32", 2),
    }
    general: list[tuple[str, str, Any]] = [
        ("general.architecture", "str", arch),
        ("general.name", "str", "tiny"),
    ]
    for name, v in overrides.items():
        if v is None:
            base.pop(name, None)
        else:
            base[name] = v
    arch_kv = [(f"{arch}.{k.replace('__', '.')}", t, v) for k, (t, v) in base.items()]
    vocab = [("tokenizer.ggml.tokens", "array", ("str", [f"t{i}" for i in range(8)]))]
    return general + arch_kv + vocab


def minimal_tensors() -> list[Tensor]:
    return [tensor("token_embd.weight", (64, 8)), tensor("output_norm.weight", (64,), 2048)]


def write_gguf(path: Path, kv: Iterable[tuple[str, str, Any]] | None = None, **kw: Any) -> Path:
    """Write :func:`gguf_bytes` (default: a minimal valid model) to ``path``."""
    tensors = kw.pop("tensors", minimal_tensors())
    path.write_bytes(gguf_bytes(minimal_kv() if kv is None else kv, tensors, **kw))
    return path
