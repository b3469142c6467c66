"""The GGUF header on disk: a bounded, non-blocking read of its key/values and tensor table.

Owns the byte layout (magic, version, counts, typed key/values, the tensor
table; ggml's ``docs/gguf.md``) and the limits that keep a hostile file from
costing more than a few MB or a few seconds, whatever it claims: every count
and length is checked against the file's size and the bounds below before it
sizes a loop or an allocation; long strings and large arrays are stepped over
(only their length is kept); arrays nest at most :data:`MAX_ARRAY_DEPTH` deep.
:func:`open_regular` opens without ever blocking and refuses anything but a
regular file (a FIFO, a device, a directory). What the values mean is
``modelfacts``'.

The value-type codes, the magic, the default alignment and the per-type block
sizes come from the ``gguf`` package (``gguf.constants``), so new quantization
types are understood as soon as that package knows them. We do not use
``gguf.GGUFReader`` itself: it memory-maps the whole file and builds a numpy
view per array element, which takes about 20 s for a 262,144-entry vocabulary
on a small CPU; this reader skips large arrays and needs a fraction of a second.

Errors: :class:`Truncated` (the file ends before what the header announced),
:class:`Corrupt` (the header breaks the format or a bound), :class:`Unsupported`
(an unknown tensor type), and :class:`~slmguard.errors.ModelError` /
:class:`~slmguard.errors.ModelNotFoundError` from :func:`open_regular`;
``modelfacts.read_model_facts`` turns them all into one-line ModelErrors.

Example::

    with open_regular(path) as f:
        header = parse_header(f, os.fstat(f.fileno()).st_size)
    header.kv["general.architecture"], len(header.tensors)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from slmguard import regularfile
from slmguard.errors import ModelError, ModelNotFoundError
from slmguard.plan.text import shown

# Arrays with more elements than this are skipped (only their length is kept):
# tokenizer vocabularies, merges, scores. Per-layer arrays are far smaller.
_KEEP_ARRAY_MAX = 4096
_READ_CHUNK = 1 << 20
_ABSURD_BYTES = 1 << 40

# What a header may claim. Real files are far inside these (the default model:
# 36 keys, 236 tensors, a 262,144-entry vocabulary; a 405B model: about 1,100
# tensors); a TensorFacts costs about 340 bytes, so the tensor table stays
# under 6 MB and the kept metadata under MAX_KEPT_BYTES.
MAX_KEYS = 8192  # metadata key/value pairs
MAX_KEY_BYTES = 256  # a key name ("gemma3.attention.head_count_kv" is 30)
MAX_STRING_KEPT_BYTES = 1 << 20  # longer string values are skipped, not kept
MAX_ARRAY_LENGTH = 1 << 22  # elements of one array (vocabularies, merges)
MAX_ARRAY_DEPTH = 3  # arrays of arrays of scalars at most
MAX_WALKED_ITEMS = 1 << 23  # string and array elements stepped over in the whole header
MAX_KEPT_BYTES = 8 << 20  # metadata kept in memory (strings, small arrays)
MAX_TENSORS = 16384
MAX_TENSOR_NAME_BYTES = 63  # ggml's GGML_MAX_NAME (64) with its terminating NUL
MAX_TENSOR_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_TENSOR_ELEMENTS = (1 << 63) - 1  # ggml counts elements in int64_t
MAX_ALIGNMENT = 1 << 20


@dataclass(frozen=True, slots=True)
class TensorFacts:
    """One entry of the GGUF tensor table (no data)."""

    name: str
    type_name: str  # ggml type, e.g. "Q4_K", "F32"
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous row length
    offset_bytes: int  # from the start of the data section
    n_bytes: int


class Truncated(Exception):
    """The header ended before a field it announced (message: which one, if known)."""


class Corrupt(ValueError):
    """The header contradicts itself or the GGUF format (message: where and how)."""


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
            raise Truncated

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
        """Step over ``n`` bytes: within the buffer, or by seeking past it."""
        if self._pos + n <= len(self._buf):
            self._pos += n
            return
        target = self.offset + n
        self._f.seek(target)
        self._base, self._buf, self._pos = target, b"", 0

    def skip_strings(self, count: int, limit: int) -> None:
        """Step over ``count`` length-prefixed strings (a vocabulary) without keeping them."""
        fmt = self.endian + "Q"
        for _ in range(count):
            self._need(8)
            (n,) = struct.unpack_from(fmt, self._buf, self._pos)
            self._pos += 8
            if self.offset + n > limit:
                raise Truncated(
                    f"a string of {n:,} bytes at offset {self.offset} runs past the end of the file"
                )
            self.skip(n)


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
class Skipped:
    """A value that was stepped over, not kept: a large array or a long string."""

    length: int  # elements of an array, bytes of a string
    what: str  # "array" or "string"


def _ggml_sizes() -> dict[int, tuple[str, int, int]]:
    """ggml type code -> (name, block size, bytes per block)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {
        int(t): (t.name, *GGML_QUANT_SIZES[t])
        for t in GGMLQuantizationType
        if t in GGML_QUANT_SIZES
    }


class _Reader:
    """One header read: the cursor, the file's end and the budgets of what is kept."""

    def __init__(self, cur: _Cursor, limit: int) -> None:
        from gguf.constants import GGUFValueType as T

        self.cur = cur
        self.limit = limit
        self.fmts = _scalar_formats()
        self.string_type = int(T.STRING)
        self.array_type = int(T.ARRAY)
        self.kept_bytes = 0
        self.walked = 0

    def fits(self, n_bytes: int, what: str) -> None:
        """``n_bytes`` more (what ``what`` announces) must still be inside the file."""
        if n_bytes > _ABSURD_BYTES:
            raise Corrupt(f"{what} at offset {self.cur.offset} is impossible")
        if self.cur.offset + n_bytes > self.limit:
            raise Truncated(f"{what} at offset {self.cur.offset} runs past the end of the file")

    def keep(self, n_bytes: int, key: str) -> None:
        self.kept_bytes += n_bytes
        if self.kept_bytes > MAX_KEPT_BYTES:
            raise Corrupt(
                f"{shown(key)}: the header's metadata exceeds {MAX_KEPT_BYTES >> 20} MiB "
                "(strings and small arrays), not a real model"
            )

    def walk(self, n: int, key: str) -> None:
        self.walked += n
        if self.walked > MAX_WALKED_ITEMS:
            raise Corrupt(
                f"{shown(key)}: the header has more than {MAX_WALKED_ITEMS:,} array elements"
            )

    def string(self, key: str, *, max_kept: int = MAX_STRING_KEPT_BYTES) -> str | Skipped:
        n = self.cur.unpack("Q")
        self.fits(n, f"a string of {n:,} bytes")
        if n > max_kept:
            self.cur.skip(n)
            return Skipped(n, "string")
        self.keep(n, key)
        return self.cur.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, depth: int = 0, *, keep: bool = True) -> Any:
        """One metadata value; with ``keep`` False it is stepped over (None)."""
        fmts = self.fmts
        if vtype in fmts:
            return self.cur.unpack(fmts[vtype])
        if vtype == self.string_type:
            if keep:
                return self.string(key)
            n = self.cur.unpack("Q")
            self.fits(n, f"a string of {n:,} bytes")
            self.cur.skip(n)
            return None
        if vtype != self.array_type:
            raise Corrupt(f"{shown(key)}: unknown metadata value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise Corrupt(f"{shown(key)}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
        itype = self.cur.unpack("I")
        length = self.cur.unpack("Q")
        if length > MAX_ARRAY_LENGTH:
            raise Corrupt(
                f"{shown(key)}: array of {length:,} elements (at most {MAX_ARRAY_LENGTH:,})"
            )
        keep = keep and length <= _KEEP_ARRAY_MAX
        if itype in fmts:
            size = struct.calcsize(fmts[itype])
            self.fits(size * length, f"an array of {length:,} elements")
            if not keep:
                self.cur.skip(size * length)
                return Skipped(length, "array")
            self.keep(16 * length, key)
            raw = self.cur.take(size * length)
            return tuple(struct.unpack(f"{self.cur.endian}{length}{fmts[itype]}", raw))
        if itype == self.string_type:
            # every element has an 8-byte length at least
            self.fits(8 * length, f"an array of {length:,} strings")
            self.walk(length, key)
            if not keep:
                self.cur.skip_strings(length, self.limit)
                return Skipped(length, "array")
            self.keep(16 * length, key)
            return tuple(self.string(key) for _ in range(length))
        if itype == self.array_type:
            # every element has a type and a length
            self.fits(12 * length, f"an array of {length:,} arrays")
            self.walk(length, key)
            if keep:
                self.keep(16 * length, key)
            items = [self.value(self.array_type, key, depth + 1, keep=keep) for _ in range(length)]
            return tuple(items) if keep else Skipped(length, "array")
        raise Corrupt(f"{shown(key)}: unknown array element type {itype}")


@dataclass(frozen=True)
class Header:
    version: int
    kv: dict[str, Any]
    tensors: tuple[TensorFacts, ...]
    data_offset: int


def _preamble(f: IO[bytes]) -> tuple[int, str]:
    """The magic and the version: (version, byte order of the rest of the header)."""
    from gguf.constants import GGUF_MAGIC

    magic = f.read(4)
    if len(magic) < 4:
        raise Truncated
    if struct.unpack("<I", magic)[0] != GGUF_MAGIC:
        raise ModelError(
            str(getattr(f, "name", "?")),
            f"not a GGUF file (magic {magic!r}, expected b'GGUF')",
            hint="pass a .gguf model file (llama.cpp format)",
        )
    raw_version = f.read(4)
    if len(raw_version) < 4:
        raise Truncated
    endian = "<"
    version = struct.unpack("<I", raw_version)[0]
    if version & 0xFFFF == 0:  # written on a big-endian host
        endian = ">"
        version = struct.unpack(">I", raw_version)[0]
    if version not in (2, 3):
        raise ModelError(
            str(getattr(f, "name", "?")),
            f"unsupported GGUF version {version} (supported: 2, 3)",
        )
    return version, endian


def _counts(r: _Reader) -> tuple[int, int]:
    """(tensors, metadata keys) the header announces, each within the file and its bound."""
    n_tensors = r.cur.unpack("Q")
    n_kv = r.cur.unpack("Q")
    # Every tensor-table entry and key/value takes at least 8 bytes, so counts
    # larger than the file are corruption, not a huge model.
    r.fits(n_tensors, f"a tensor count of {n_tensors:,}")
    r.fits(n_kv, f"a key count of {n_kv:,}")
    if n_kv > MAX_KEYS:
        raise Corrupt(f"{n_kv:,} metadata keys (at most {MAX_KEYS:,})")
    if n_tensors > MAX_TENSORS:
        raise Corrupt(f"{n_tensors:,} tensors (at most {MAX_TENSORS:,})")
    return n_tensors, n_kv


def _metadata(r: _Reader, n_kv: int) -> dict[str, Any]:
    """The ``n_kv`` key/value pairs: unique keys of bounded length."""
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string("a key name", max_kept=MAX_KEY_BYTES)
        if isinstance(key, Skipped):
            raise Corrupt(f"a key name of {key.length:,} bytes (at most {MAX_KEY_BYTES})")
        if key in kv:
            raise Corrupt(f"duplicate metadata key {shown(key)}")
        vtype = r.cur.unpack("I")
        kv[key] = r.value(vtype, key)
    return kv


def _tensor_entry(
    r: _Reader, sizes: dict[int, tuple[str, int, int]], names: set[str]
) -> TensorFacts:
    """One entry of the tensor table; its name is added to ``names`` (which must not hold it)."""
    cur = r.cur
    name = r.string("a tensor name", max_kept=MAX_TENSOR_NAME_BYTES)
    if isinstance(name, Skipped):
        raise Corrupt(
            f"a tensor name of {name.length:,} bytes (ggml allows {MAX_TENSOR_NAME_BYTES})"
        )
    if name in names:
        raise Corrupt(f"duplicate tensor {shown(name)}")
    names.add(name)
    n_dims = cur.unpack("I")
    if n_dims > MAX_TENSOR_DIMS:
        raise Corrupt(f"tensor {shown(name)} has {n_dims} dimensions (ggml allows 4)")
    shape = tuple(cur.unpack("Q") for _ in range(n_dims))
    type_code = cur.unpack("I")
    offset = cur.unpack("Q")
    if type_code not in sizes:
        raise Unsupported(f"tensor {shown(name)} has ggml type {type_code}, unknown to gguf")
    type_name, block, per_block = sizes[type_code]
    n_elems = 1
    for d in shape:
        n_elems *= d
        if n_elems > MAX_TENSOR_ELEMENTS:
            raise Corrupt(f"tensor {shown(name)}: shape {shape} has more than 2^63 elements")
    if shape and shape[0] % block:
        raise Corrupt(f"tensor {shown(name)}: row of {shape[0]} is not a multiple of {block}")
    return TensorFacts(name, type_name, shape, offset, n_elems // block * per_block)


def _alignment(kv: dict[str, Any], tensors: list[TensorFacts]) -> int:
    """``general.alignment`` (a power of two up to 1 MiB), which every tensor offset honours."""
    from gguf.constants import GGUF_DEFAULT_ALIGNMENT

    alignment = kv.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or not 0 < alignment <= MAX_ALIGNMENT
        or alignment & (alignment - 1)
    ):
        raise Corrupt(f"general.alignment = {shown(alignment)}: not a power of two up to 1 MiB")
    for t in tensors:
        if t.offset_bytes % alignment:
            raise Corrupt(
                f"tensor {shown(t.name)}: offset {t.offset_bytes} is not a multiple of the "
                f"alignment {alignment}"
            )
    return alignment


def parse_header(f: IO[bytes], file_bytes: int) -> Header:
    version, endian = _preamble(f)
    cur = _Cursor(f, endian)
    r = _Reader(cur, file_bytes)
    n_tensors, n_kv = _counts(r)
    kv = _metadata(r, n_kv)
    sizes = _ggml_sizes()
    names: set[str] = set()
    tensors = [_tensor_entry(r, sizes, names) for _ in range(n_tensors)]
    alignment = _alignment(kv, tensors)
    header_end = cur.offset
    data_offset = (header_end + alignment - 1) // alignment * alignment
    return Header(version, kv, tuple(tensors), data_offset)


class Unsupported(Exception):
    """The file is valid GGUF but describes something we cannot budget."""


def open_regular(path: Path) -> IO[bytes]:
    """Open a model file for reading without ever blocking (:mod:`slmguard.regularfile`).

    Raises ModelNotFoundError (66) or ModelError (65).
    """
    try:
        return regularfile.open_regular(path)
    except FileNotFoundError as err:
        raise ModelNotFoundError(path, hint="check the path, or use --preset") from err
    except NotADirectoryError as err:
        raise ModelNotFoundError(path, hint="a parent of the path is not a directory") from err
    except regularfile.NotRegularFileError as err:
        what = (
            "is a directory, not a GGUF file"
            if err.kind == "a directory"
            else f"is {err.kind}, not a regular file"
        )
        raise ModelError(path, what, hint="pass the .gguf file itself") from err
    except OSError as err:
        raise ModelError(path, f"cannot open: {err.strerror or err}") from err
