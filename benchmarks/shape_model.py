"""A zero-weight GGUF with a preset's exact shapes, to ask the real engine about it.

The budget's rules for a model we cannot download here (Qwen2.5 0.5B/1.5B/3B)
are checked by building a GGUF file with that model's architecture, tensor
table (the preset's synthesized Q4_K_M mix, biases included,
``slmguard.plan.presets``) and a
byte-level BPE vocabulary of the same size (256 byte tokens, then every
two-byte pair, then three-byte strings, each with its merge), and zeros for
weights. The file is sparse: its tensor data is a hole, so it costs no disk.
llama-server loads it like any model; its buffer reports (KV, compute, output,
repack) and its runtime memory per vocabulary entry then come from the real
engine for the real shapes. Its text output is meaningless (all weights are 0).

Only ``qwen2`` and ``llama`` presets are supported (what the seed's case needs).

Usage:
    .venv/bin/python benchmarks/shape_model.py qwen2.5-0.5b-instruct /tmp/qwen05.gguf
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

ALIGN = 32
_T_UINT32, _T_INT32, _T_FLOAT32, _T_BOOL, _T_STRING, _T_ARRAY = 4, 5, 6, 7, 8, 9


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v: Any) -> tuple[int, bytes]:
    if isinstance(v, bool):
        return _T_BOOL, struct.pack("<?", v)
    if isinstance(v, int):
        return _T_UINT32, struct.pack("<I", v)
    if isinstance(v, float):
        return _T_FLOAT32, struct.pack("<f", v)
    if isinstance(v, str):
        return _T_STRING, _str(v)
    raise TypeError(v)


def _array(kind: int, items: list[Any]) -> bytes:
    head = struct.pack("<IQ", kind, len(items))
    if kind == _T_STRING:
        return head + b"".join(_str(s) for s in items)
    fmt = {_T_INT32: "<i", _T_FLOAT32: "<f"}[kind]
    return head + b"".join(struct.pack(fmt, x) for x in items)


def byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 byte-level token strings, by byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out: dict[int, str] = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def bpe_vocab(n_vocab: int) -> tuple[list[str], list[str]]:
    """``n_vocab`` distinct byte-level tokens and a merge for each non-byte token."""
    chars = byte_chars()
    tokens = list(chars)
    merges: list[str] = []
    for a in chars:
        for b in chars:
            if len(tokens) >= n_vocab:
                return tokens, merges
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    pairs = tokens[256:]
    for p in pairs:
        for c in chars:
            if len(tokens) >= n_vocab:
                return tokens, merges
            tokens.append(p + c)
            merges.append(f"{p} {c}")
    raise ValueError(f"vocabulary of {n_vocab} tokens is too large for this scheme")


def _nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def write_shape_gguf(spec: str, dest: Path) -> Path:
    """Write the zero-weight GGUF for preset ``spec`` (e.g. ``qwen2.5-0.5b-instruct``)."""
    from slmguard.plan.presets import _synth_tensors, parse_preset

    p, quant = parse_preset(spec)
    if p.arch not in ("qwen2", "llama"):
        raise ValueError(f"{p.arch}: only qwen2 and llama presets are supported")
    tensors = [(t.name, t.type_name, t.shape) for t in _synth_tensors(p, quant)]
    a = p.arch
    kv: list[tuple[str, Any]] = [
        ("general.architecture", a),
        ("general.name", f"{p.title} (zero weights, shapes only)"),
        ("general.alignment", ALIGN),
        (f"{a}.context_length", p.n_ctx_train),
        (f"{a}.embedding_length", p.n_embd),
        (f"{a}.block_count", p.n_layer),
        (f"{a}.feed_forward_length", p.n_ff),
        (f"{a}.attention.head_count", p.n_head),
        (f"{a}.attention.head_count_kv", p.n_head_kv),
        (f"{a}.attention.key_length", p.head_dim),
        (f"{a}.attention.value_length", p.head_dim),
        (f"{a}.rope.freq_base", 1_000_000.0),
        (f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        ("tokenizer.ggml.model", "gpt2"),
        ("tokenizer.ggml.pre", "qwen2" if a == "qwen2" else "llama-bpe"),
        ("tokenizer.ggml.bos_token_id", 256),
        ("tokenizer.ggml.eos_token_id", 257),
        ("tokenizer.ggml.add_bos_token", True),
    ]
    tokens, merges = bpe_vocab(p.n_vocab)
    body = bytearray()
    for key, value in kv:
        kind, raw = _value(value)
        body += _str(key) + struct.pack("<I", kind) + raw
    body += _str("tokenizer.ggml.tokens") + struct.pack("<I", _T_ARRAY)
    body += _array(_T_STRING, tokens)
    body += _str("tokenizer.ggml.token_type") + struct.pack("<I", _T_ARRAY)
    body += _array(_T_INT32, [1] * len(tokens))
    body += _str("tokenizer.ggml.merges") + struct.pack("<I", _T_ARRAY)
    body += _array(_T_STRING, merges)
    n_kv = len(kv) + 3
    offset = 0
    for name, type_name, shape in tensors:
        body += _str(name) + struct.pack("<I", len(shape))
        body += b"".join(struct.pack("<Q", d) for d in shape)
        body += struct.pack("<IQ", GGMLQuantizationType[type_name].value, offset)
        offset += (_nbytes(type_name, shape) + ALIGN - 1) // ALIGN * ALIGN
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), n_kv) + bytes(body)
    head += b"\0" * (-len(head) % ALIGN)
    with dest.open("wb") as f:
        f.write(head)
        f.truncate(len(head) + offset)  # the tensor data: a hole of zeros
    return dest


if __name__ == "__main__":
    print(write_shape_gguf(sys.argv[1], Path(sys.argv[2])))
