"""Model facts from a GGUF header: what the budget needs, without the weights.

Owns reading a GGUF file's header (metadata key/values and the tensor table)
and turning it into a :class:`ModelFacts`. It never loads weights, never maps
the file and never imports the engine: it reads the header bytes sequentially
and checks the tensor table against the file size.

The value-type codes, the magic, the default alignment and the per-type block
sizes come from the ``gguf`` package (``gguf.constants``), so new quantization
types are understood as soon as that package knows them. We do not use
``gguf.GGUFReader`` itself: it memory-maps the whole file and builds a numpy
view per array element, which takes about 20 s for a 262,144-entry vocabulary
on a small CPU; this reader skips large arrays and needs a fraction of a second.

Errors: :class:`ModelNotFoundError` when the path does not exist,
:class:`ModelError` (naming the file and the problem) when it is empty, not
GGUF, truncated (header or tensor data running past the end of the file) or
describes something the planner cannot budget (no attention heads, unknown
tensor type, an adapter rather than a model).

Sliding-window attention: which layers use it is a per-architecture rule in
llama.cpp (``llama_hparams::set_swa_pattern`` in ``src/llama-hparams.cpp``,
called from ``llama_model::load_hparams``); :data:`SWA_PATTERNS` mirrors the
rules of the llama.cpp bundled with llama-cpp-python 0.3.36. A GGUF that
carries ``<arch>.attention.sliding_window_pattern`` overrides the rule.

Example::

    facts = read_model_facts(Path("gemma-3-270m-q4_k_m.gguf"))
    facts.n_layer, facts.swa_layers, facts.kv_bytes_per_cell("f16")
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from slmguard.errors import ModelError, ModelNotFoundError

# Arrays with more elements than this are skipped (only their length is kept):
# tokenizer vocabularies, merges, scores. Per-layer arrays are far smaller.
_KEEP_ARRAY_MAX = 4096
_READ_CHUNK = 1 << 20
_ABSURD_BYTES = 1 << 40

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

# Architectures without attention or KV cache that this budget cannot model.
_NO_ATTENTION = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})


@dataclass(frozen=True)
class TensorFacts:
    """One entry of the GGUF tensor table (no data)."""

    name: str
    type_name: str  # ggml type, e.g. "Q4_K", "F32"
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous row length
    offset_bytes: int  # from the start of the data section
    n_bytes: int


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


class _Truncated(Exception):
    """The header ended before a field it announced (message: which one, if known)."""


class _Cursor:
    """Sequential little/big-endian reader over a file, buffered in chunks."""

    def __init__(self, f: IO[bytes], endian: str) -> None:
        self._f = f
        self._buf = b""
        self._pos = 0
        self._base = f.tell()  # file offset of _buf[0]
        self.endian = endian

    @property
    def offset(self) -> int:
        return self._base + self._pos

    def _need(self, n: int) -> None:
        if self._pos + n <= len(self._buf):
            return
        rest = self._buf[self._pos :]
        more = self._f.read(max(_READ_CHUNK, n - len(rest)))
        self._base += self._pos
        self._buf = rest + more
        self._pos = 0
        if len(self._buf) < n:
            raise _Truncated

    def take(self, n: int) -> bytes:
        self._need(n)
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(self.endian + fmt, self._buf, self._pos)
        self._pos += size
        return value

    def skip(self, n: int) -> None:
        while n > 0:
            step = min(n, _READ_CHUNK)
            self._need(step)
            self._pos += step
            n -= step


def _scalar_formats() -> dict[int, str]:
    from gguf.constants import GGUFValueType as T

    return {
        int(T.UINT8): "B",
        int(T.INT8): "b",
        int(T.UINT16): "H",
        int(T.INT16): "h",
        int(T.UINT32): "I",
        int(T.INT32): "i",
        int(T.FLOAT32): "f",
        int(T.BOOL): "?",
        int(T.UINT64): "Q",
        int(T.INT64): "q",
        int(T.FLOAT64): "d",
    }


@dataclass(frozen=True)
class _SkippedArray:
    """A large array whose elements were not kept."""

    length: int


def _check_length(cur: _Cursor, n: int, what: str, limit: int) -> None:
    """A length prefix that points past the end of the file.

    Lengths beyond any real file (1 TiB) are corruption; others mean the file
    was cut short.
    """
    if n > _ABSURD_BYTES:
        raise ValueError(f"{what} of {n} at offset {cur.offset} is impossible")
    if cur.offset + n > limit:
        raise _Truncated(f"{what} of {n} at offset {cur.offset} runs past the end of the file")


def _read_string(cur: _Cursor, limit: int) -> str:
    n = cur.unpack("Q")
    _check_length(cur, n, "string length", limit)
    return cur.take(n).decode("utf-8", errors="replace")


def _read_value(cur: _Cursor, vtype: int, fmts: dict[int, str], limit: int) -> Any:
    from gguf.constants import GGUFValueType as T

    if vtype in fmts:
        return cur.unpack(fmts[vtype])
    if vtype == int(T.STRING):
        return _read_string(cur, limit)
    if vtype == int(T.ARRAY):
        itype = cur.unpack("I")
        length = cur.unpack("Q")
        _check_length(cur, length, "array length", limit)
        if itype in fmts:
            size = struct.calcsize(fmts[itype])
            if length > _KEEP_ARRAY_MAX:
                cur.skip(size * length)
                return _SkippedArray(length)
            raw = cur.take(size * length)
            return tuple(struct.unpack(f"{cur.endian}{length}{fmts[itype]}", raw))
        if itype == int(T.STRING):
            if length > _KEEP_ARRAY_MAX:
                for _ in range(length):
                    n = cur.unpack("Q")
                    _check_length(cur, n, "string length", limit)
                    cur.skip(n)
                return _SkippedArray(length)
            return tuple(_read_string(cur, limit) for _ in range(length))
        if itype == int(T.ARRAY):
            return tuple(_read_value(cur, int(T.ARRAY), fmts, limit) for _ in range(length))
        raise ValueError(f"unknown array element type {itype}")
    raise ValueError(f"unknown metadata value type {vtype}")


def _ggml_sizes() -> dict[int, tuple[str, int, int]]:
    """ggml type code -> (name, block size, bytes per block)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {
        int(t): (t.name, *GGML_QUANT_SIZES[t])
        for t in GGMLQuantizationType
        if t in GGML_QUANT_SIZES
    }


@dataclass(frozen=True)
class _Header:
    version: int
    kv: dict[str, Any]
    tensors: tuple[TensorFacts, ...]
    data_offset: int


def _parse_header(f: IO[bytes], file_bytes: int) -> _Header:
    from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC

    magic = f.read(4)
    if len(magic) < 4:
        raise _Truncated
    if struct.unpack("<I", magic)[0] != GGUF_MAGIC:
        raise ModelError(
            getattr(f, "name", "?"),
            f"not a GGUF file (magic {magic!r}, expected b'GGUF')",
            hint="pass a .gguf model file (llama.cpp format)",
        )
    raw_version = f.read(4)
    if len(raw_version) < 4:
        raise _Truncated
    endian = "<"
    version = struct.unpack("<I", raw_version)[0]
    if version & 0xFFFF == 0:  # written on a big-endian host
        endian = ">"
        version = struct.unpack(">I", raw_version)[0]
    if version not in (2, 3):
        raise ModelError(
            getattr(f, "name", "?"),
            f"unsupported GGUF version {version} (supported: 2, 3)",
        )
    cur = _Cursor(f, endian)
    n_tensors = cur.unpack("Q")
    n_kv = cur.unpack("Q")
    # Every tensor-table entry and key/value takes at least 8 bytes, so counts
    # larger than the file are corruption, not a huge model.
    _check_length(cur, n_tensors, "tensor count", file_bytes)
    _check_length(cur, n_kv, "key count", file_bytes)
    fmts = _scalar_formats()
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = _read_string(cur, file_bytes)
        vtype = cur.unpack("I")
        kv[key] = _read_value(cur, vtype, fmts, file_bytes)
    sizes = _ggml_sizes()
    tensors = []
    for _ in range(n_tensors):
        name = _read_string(cur, file_bytes)
        n_dims = cur.unpack("I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        shape = tuple(cur.unpack("Q") for _ in range(n_dims))
        type_code = cur.unpack("I")
        offset = cur.unpack("Q")
        if type_code not in sizes:
            raise _Unsupported(f"tensor {name!r} has ggml type {type_code}, unknown to gguf")
        type_name, block, per_block = sizes[type_code]
        n_elems = 1
        for d in shape:
            n_elems *= d
        if shape and shape[0] % block:
            raise ValueError(f"tensor {name!r}: row of {shape[0]} is not a multiple of {block}")
        tensors.append(TensorFacts(name, type_name, shape, offset, n_elems // block * per_block))
    alignment = kv.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    header_end = cur.offset
    data_offset = (header_end + alignment - 1) // alignment * alignment
    return _Header(version, kv, tuple(tensors), data_offset)


class _Unsupported(Exception):
    """The file is valid GGUF but describes something we cannot budget."""


def _arch_int(kv: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = kv.get(key, default)
    if value is None:
        raise _Unsupported(f"missing metadata key {key!r}")
    if isinstance(value, tuple):
        if not value:
            raise _Unsupported(f"metadata key {key!r} is an empty array")
        return int(max(value))
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"metadata key {key!r} is {value!r}, expected an integer")
    return value


def _per_layer(kv: Mapping[str, Any], key: str, n_layer: int) -> int | tuple[int, ...] | None:
    value = kv.get(key)
    if value is None:
        return None
    if isinstance(value, tuple):
        if len(value) != n_layer:
            raise ValueError(f"{key!r} has {len(value)} entries for {n_layer} layers")
        ints = tuple(int(v) for v in value)
        return ints[0] if len(set(ints)) == 1 else ints
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"metadata key {key!r} is {value!r}, expected an integer")
    return value


def _swa_layers(kv: Mapping[str, Any], arch: str, n_layer: int, window: int) -> tuple[int, ...]:
    if window <= 0:
        return ()
    pattern = kv.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, tuple) and len(pattern) == n_layer:
        return tuple(il for il, on in enumerate(pattern) if on)
    n = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else None
    n = n if n is not None else SWA_PATTERNS.get(arch)
    if n is None:
        return ()
    return tuple(il for il in range(n_layer) if n == 0 or il % n < n - 1)


def _facts(path: Path, file_bytes: int, h: _Header) -> ModelFacts:
    kv = h.kv
    general_type = kv.get("general.type", "model")
    if general_type != "model":
        raise _Unsupported(f"general.type is {general_type!r}, not a model (an adapter?)")
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise _Unsupported("no general.architecture")
    if arch in _NO_ATTENTION:
        raise _Unsupported(f"architecture {arch!r} has no attention KV cache to budget")
    n_layer = _arch_int(kv, f"{arch}.block_count")
    n_embd = _arch_int(kv, f"{arch}.embedding_length")
    n_head = _per_layer(kv, f"{arch}.attention.head_count", n_layer)
    if n_head is None:
        raise _Unsupported(f"missing metadata key '{arch}.attention.head_count'")
    n_head_kv = _per_layer(kv, f"{arch}.attention.head_count_kv", n_layer)
    if n_head_kv is None:  # llama.cpp: n_head_kv defaults to n_head
        n_head_kv = n_head
    head_max = max(n_head) if isinstance(n_head, tuple) else n_head
    if head_max <= 0 or n_layer <= 0 or n_embd <= 0:
        raise ValueError(f"n_layer {n_layer}, n_embd {n_embd}, n_head {head_max} must be > 0")
    key_length = _arch_int(kv, f"{arch}.attention.key_length", n_embd // head_max)
    value_length = _arch_int(kv, f"{arch}.attention.value_length", n_embd // head_max)
    window = int(kv.get(f"{arch}.attention.sliding_window", 0) or 0)
    swa = _swa_layers(kv, arch, n_layer, window)
    if not swa:  # e.g. phi3: the key is present but llama.cpp ignores it
        window = 0
    tokens = kv.get("tokenizer.ggml.tokens")
    if isinstance(tokens, _SkippedArray):
        n_vocab = tokens.length
    elif isinstance(tokens, tuple):
        n_vocab = len(tokens)
    elif isinstance(kv.get(f"{arch}.vocab_size"), int):
        n_vocab = int(kv[f"{arch}.vocab_size"])
    else:
        embd = next((t for t in h.tensors if t.name == "token_embd.weight"), None)
        if embd is None or len(embd.shape) < 2:
            raise _Unsupported("no vocabulary (tokenizer.ggml.tokens) and no token_embd.weight")
        n_vocab = embd.shape[1]
    template = kv.get("tokenizer.chat_template")
    by_type: dict[str, int] = {}
    for t in h.tensors:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
    name = kv.get("general.name")
    ftype = kv.get("general.file_type")
    return ModelFacts(
        path=path,
        arch=arch,
        name=name if isinstance(name, str) and name else path.stem,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        key_length=key_length,
        value_length=value_length,
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_ctx_train=_arch_int(kv, f"{arch}.context_length", 0),
        sliding_window=window,
        swa_layers=swa,
        chat_template=template if isinstance(template, str) else None,
        file_bytes=file_bytes,
        tensor_bytes_by_type=dict(sorted(by_type.items())),
        n_ff=_arch_int(kv, f"{arch}.feed_forward_length", 0),
        gguf_version=h.version,
        file_type=ftype if isinstance(ftype, int) else None,
        data_offset_bytes=h.data_offset,
        tensors=h.tensors,
        pooling_type=_pooling(kv.get(f"{arch}.pooling_type")),
    )


def _pooling(value: Any) -> int | None:
    """llama.cpp's pooling type (1 mean, 2 cls, 3 last, 4 rank); 0 or absent: none."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def read_model_facts(path: Path) -> ModelFacts:
    """Read ``path``'s GGUF header; see the module docstring for the errors."""
    path = Path(path)
    try:
        f = path.open("rb")
    except FileNotFoundError as err:
        raise ModelNotFoundError(path, hint="check the path, or use --preset") from err
    except IsADirectoryError as err:
        raise ModelError(path, "is a directory, not a GGUF file") from err
    except OSError as err:
        raise ModelError(path, f"cannot open: {err.strerror or err}") from err
    with f:
        try:
            file_bytes = path.stat().st_size
        except OSError as err:
            raise ModelError(path, f"cannot stat: {err.strerror or err}") from err
        if file_bytes == 0:
            raise ModelError(path, "empty file (0 bytes), not a GGUF model")
        try:
            header = _parse_header(f, file_bytes)
            facts = _facts(path, file_bytes, header)
        except ModelError as err:
            raise ModelError(path, err.problem, hint=err.hint) from err
        except _Truncated as err:
            detail = f": {err}" if str(err) else ""
            raise ModelError(
                path,
                f"truncated: the header ends early (file is {file_bytes} bytes){detail}",
                hint="the download or copy is incomplete; fetch the file again",
            ) from err
        except _Unsupported as err:
            raise ModelError(path, f"unsupported: {err}") from err
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
    return facts
