"""GGUF header facts: the real default model, small written GGUFs, broken files."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter

from ggufcraft import minimal_kv, nested_array, tensor, write_gguf
from slmguard.errors import ModelError, ModelNotFoundError
from slmguard.plan.modelfacts import ModelFacts, read_model_facts


@pytest.fixture(scope="module")
def real_model() -> Path:
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    return ensure_default_model(paths.model_dir())


def _write_gguf(
    path: Path,
    arch: str = "llama",
    *,
    n_layer: int = 2,
    extra: Callable[[GGUFWriter], None] | None = None,
    head_count: Any = 4,
    head_count_kv: Any = 2,
    general_type: str | None = None,
) -> Path:
    w = GGUFWriter(path, arch)
    if general_type is not None:
        w.add_type(general_type)
    w.add_name("tiny")
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.embedding_length", 64)
    w.add_uint32(f"{arch}.context_length", 4096)
    w.add_uint32(f"{arch}.feed_forward_length", 128)
    if isinstance(head_count, list):
        w.add_array(f"{arch}.attention.head_count", head_count)
    else:
        w.add_uint32(f"{arch}.attention.head_count", head_count)
    if isinstance(head_count_kv, list):
        w.add_array(f"{arch}.attention.head_count_kv", head_count_kv)
    elif head_count_kv is not None:
        w.add_uint32(f"{arch}.attention.head_count_kv", head_count_kv)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(5000)])
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    if extra is not None:
        extra(w)
    w.add_tensor("token_embd.weight", np.ones((5000, 64), dtype=np.float16))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_real_default_model(real_model: Path) -> None:
    f = read_model_facts(real_model)
    assert isinstance(f, ModelFacts)
    assert f.arch == "gemma3"
    assert (f.n_layer, f.n_head, f.n_head_kv) == (18, 4, 1)
    assert (f.key_length, f.value_length, f.n_embd) == (256, 256, 640)
    assert f.n_vocab == 262_144
    assert f.n_ctx_train == 32_768
    assert f.sliding_window == 512
    # gemma3: every 6th layer is full attention (llama.cpp set_swa_pattern(6)).
    assert f.swa_layers == tuple(il for il in range(18) if il % 6 != 5)
    assert f.chat_template is None
    assert f.file_bytes == real_model.stat().st_size
    # The tensor data ends exactly at the end of the file.
    assert f.data_offset_bytes + f.tensor_bytes == f.file_bytes
    assert set(f.tensor_bytes_by_type) >= {"Q8_0", "Q4_K", "F32"}
    assert f.kv_elements_per_cell(0) == (256, 256)
    assert f.tensor("token_embd.weight") is not None


def test_written_model_with_template_and_default_heads(tmp_path: Path) -> None:
    p = _write_gguf(tmp_path / "tiny.gguf", head_count_kv=None)
    f = read_model_facts(p)
    assert (f.arch, f.name, f.n_layer) == ("llama", "tiny", 2)
    assert f.n_head_kv == 4  # defaults to n_head, as in llama.cpp
    assert f.key_length == f.value_length == 64 // 4
    assert f.n_vocab == 5000
    assert f.chat_template == "{{ messages }}"
    assert f.swa_layers == () and f.sliding_window == 0
    assert f.tensor_bytes_by_type == {"F16": 5000 * 64 * 2, "F32": 64 * 4}


def test_per_layer_kv_heads(tmp_path: Path) -> None:
    p = _write_gguf(tmp_path / "pl.gguf", n_layer=3, head_count_kv=[1, 2, 4])
    f = read_model_facts(p)
    assert f.n_head_kv == (1, 2, 4)
    assert [f.head_kv_at(il) for il in range(3)] == [1, 2, 4]


def test_phi3_sliding_window_is_ignored_like_llama_cpp(tmp_path: Path) -> None:
    p = _write_gguf(
        tmp_path / "phi.gguf",
        arch="phi3",
        extra=lambda w: w.add_uint32("phi3.attention.sliding_window", 2047),
    )
    f = read_model_facts(p)
    assert f.swa_layers == () and f.sliding_window == 0


def test_explicit_swa_pattern_array_wins(tmp_path: Path) -> None:
    def extra(w: GGUFWriter) -> None:
        w.add_uint32("gemma3.attention.sliding_window", 128)
        w.add_array("gemma3.attention.sliding_window_pattern", [True, False, True, True])

    f = read_model_facts(_write_gguf(tmp_path / "g.gguf", arch="gemma3", n_layer=4, extra=extra))
    assert f.swa_layers == (0, 2, 3)
    assert f.sliding_window == 128


def _copy_prefix(src: Path, dst: Path, n: int) -> Path:
    with src.open("rb") as f:
        dst.write_bytes(f.read(n))
    return dst


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        read_model_facts(tmp_path / "nope.gguf")
    assert str(tmp_path / "nope.gguf") in str(info.value)
    assert info.value.exit_code == 66


def _file(name: str, data: bytes) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        (d / name).write_bytes(data)
        return d / name

    return make


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (_file("empty.gguf", b""), "empty file"),
        (_file("magic.gguf", b"PK\x03\x04" + b"\0" * 64), "not a GGUF file"),
        (_file("v9.gguf", b"GGUF\x09\0\0\0" + b"\0" * 16), "unsupported GGUF version 9"),
        (_file("short.gguf", b"GGU"), "truncated"),
        (_file("counts.gguf", b"GGUF\x03\0\0\0" + b"\0" * 4), "truncated"),
        (lambda d: d, "is a directory"),
    ],
)
def test_broken_files(tmp_path: Path, make: Callable[[Path], Path], needle: str) -> None:
    path = make(tmp_path)
    with pytest.raises(ModelError) as info:
        read_model_facts(path)
    assert needle in info.value.problem
    assert str(path) in str(info.value)
    assert info.value.exit_code == 65


def test_truncated_header_of_real_model(real_model: Path, tmp_path: Path) -> None:
    p = _copy_prefix(real_model, tmp_path / "cut.gguf", 100_000)
    with pytest.raises(ModelError, match="truncated: the header ends early"):
        read_model_facts(p)


def test_truncated_tensor_data_of_real_model(real_model: Path, tmp_path: Path) -> None:
    # Header complete, weights cut: the tensor table points past the end.
    p = _copy_prefix(real_model, tmp_path / "cut.gguf", 8_000_000)
    with pytest.raises(ModelError) as info:
        read_model_facts(p)
    assert "tensor data runs to byte 253113024" in info.value.problem
    assert info.value.hint is not None


def test_truncated_written_model(tmp_path: Path) -> None:
    full = _write_gguf(tmp_path / "full.gguf")
    p = _copy_prefix(full, tmp_path / "cut.gguf", full.stat().st_size - 1)
    with pytest.raises(ModelError, match="1 missing"):
        read_model_facts(p)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"general_type": "adapter"}, "not a model"),
        ({"arch": "mamba"}, "no attention KV cache"),
        ({"head_count": None}, "head_count"),
    ],
)
def test_unsupported_models(tmp_path: Path, kwargs: dict[str, Any], needle: str) -> None:
    if kwargs.get("head_count", 0) is None:
        # A GGUF without attention.head_count: write it by hand through extra=.
        p = tmp_path / "nohead.gguf"
        w = GGUFWriter(p, "llama")
        w.add_uint32("llama.block_count", 2)
        w.add_uint32("llama.embedding_length", 64)
        w.add_tensor("x", np.ones(64, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    else:
        p = _write_gguf(tmp_path / "u.gguf", **kwargs)
    with pytest.raises(ModelError) as info:
        read_model_facts(p)
    assert info.value.problem.startswith("unsupported")
    assert needle in info.value.problem


def test_corrupt_string_length(tmp_path: Path) -> None:
    p = _write_gguf(tmp_path / "ok.gguf")
    raw = bytearray(p.read_bytes())
    # The first key's length field starts at byte 24: make it absurd.
    raw[24:32] = (1 << 60).to_bytes(8, "little")
    p.write_bytes(bytes(raw))
    with pytest.raises(ModelError, match="corrupt GGUF header"):
        read_model_facts(p)


# -- Bounded facts and hostile headers (tests/ggufcraft.py writes the raw bytes) ------


def _crafted(tmp_path: Path, kv: list[tuple[str, str, Any]] | None = None, **kw: Any) -> Path:
    return write_gguf(tmp_path / "crafted.gguf", kv, **kw)


def _problem(path: Path) -> str:
    with pytest.raises(ModelError) as info:
        read_model_facts(path)
    assert info.value.exit_code == 65
    assert "\n" not in str(info.value)
    return info.value.problem


def test_crafted_minimal_model_is_read(tmp_path: Path) -> None:
    f = read_model_facts(_crafted(tmp_path))
    assert (f.arch, f.n_layer, f.n_head, f.n_head_kv, f.n_vocab) == ("llama", 2, 4, 2, 8)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"block_count": ("u64", 10**9)}, "llama.block_count = 1000000000: above 1,024"),
        ({"block_count": ("u64", 10**12)}, "llama.block_count = 1000000000000: above 1,024"),
        ({"block_count": ("u32", 0)}, "llama.block_count = 0: below 1"),
        ({"context_length": ("u32", 0)}, "llama.context_length = 0: below 1"),
        ({"context_length": ("i32", -5)}, "llama.context_length = -5: below 1"),
        ({"context_length": None}, "missing metadata key 'llama.context_length'"),
        ({"attention__head_count": ("i32", -4)}, "llama.attention.head_count = -4: below 0"),
        ({"attention__head_count": ("u32", 0)}, "no layer has attention heads"),
        ({"attention__head_count_kv": ("i64", -1)}, "head_count_kv = -1: below 0"),
        ({"attention__head_count_kv": ("u32", 8)}, "more KV heads than the 4 heads"),
        ({"embedding_length": ("u64", 1 << 40)}, "llama.embedding_length = 1099511627776"),
        ({"feed_forward_length": ("i32", -1)}, "llama.feed_forward_length = -1: below 0"),
        ({"attention__key_length": ("u32", 0)}, "llama.attention.key_length = 0: below 1"),
        ({"attention__value_length": ("u32", 1 << 20)}, "value_length = 1048576: above"),
        ({"attention__sliding_window": ("i32", -512)}, "sliding_window = -512: below 0"),
    ],
)
def test_facts_outside_real_model_limits_are_65_naming_key_and_value(
    tmp_path: Path, override: dict[str, Any], needle: str
) -> None:
    assert needle in _problem(_crafted(tmp_path, minimal_kv(**override)))


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            {"block_count": ("array", ("u32", [2, 2]))},
            "llama.block_count: expected an integer, got an array of 2",
        ),
        ({"block_count": ("str", "2")}, "llama.block_count: expected an integer, got the string"),
        ({"block_count": ("f32", 2.0)}, "llama.block_count: expected an integer, got 2.0"),
        ({"block_count": ("bool", True)}, "expected an integer, got the boolean True"),
        (
            {"attention__head_count": ("array", ("array", [("u32", [4]), ("u32", [4])]))},
            "llama.attention.head_count: expected an integer or an array of integers",
        ),
        ({"attention__head_count": ("array", ("u32", [4, 4, 4]))}, "3 entries for 2 layers"),
        ({"context_length": ("array", ("str", ["4096"]))}, "llama.context_length: expected"),
    ],
)
def test_wrong_types_where_a_scalar_belongs_are_65_naming_the_key(
    tmp_path: Path, override: dict[str, Any], needle: str
) -> None:
    assert needle in _problem(_crafted(tmp_path, minimal_kv(**override)))


def _with(extra: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    return [*minimal_kv(), *extra]


@pytest.mark.parametrize(
    ("kv", "kw", "needle"),
    [
        (_with([("deep", "array", nested_array(4))]), {}, "'deep': arrays nested more than 3"),
        (_with([("deep", "array", nested_array(100_000))]), {}, "nested more than 3 deep"),
        (_with([("x" * 300, "u8", 1)]), {}, "a key name of 300 bytes (at most 256)"),
        (_with([("general.name", "str", "again")]), {}, "duplicate metadata key 'general.name'"),
        (minimal_kv(), {"n_kv": 1 << 40}, "truncated"),
        (minimal_kv(), {"n_tensors": 1 << 62}, "a tensor count of 4,611,686,018,427,387,904"),
        (
            _with([("padding", "str", "p" * 40_000)]),
            {"n_tensors": 20_000, "data": False},
            "20,000 tensors (at most 16,384)",
        ),
        (
            [("general.architecture", "str", "llama\n[Service]")],
            {},
            "general.architecture = 'llama\\n[Service]': not an architecture name",
        ),
        (
            [minimal_kv()[0], ("general.name", "array", ("str", ["a", "b"])), *minimal_kv()[2:]],
            {},
            "general.name: expected a string, got an array of 2",
        ),
        (_with([("tokenizer.chat_template", "u32", 7)]), {}, "chat_template: expected a string"),
        (
            [
                *minimal_kv()[:-1],
                ("tokenizer.ggml.tokens", "array", ("u8", [0] * 5)),
                ("big", "array", struct.pack("<IQ", 0, 1 << 23)),  # claims 8M u8, holds none
            ],
            {},
            "'big': array of 8,388,608 elements (at most 4,194,304)",
        ),
    ],
)
def test_hostile_header_structure_is_65(
    tmp_path: Path, kv: list[tuple[str, str, Any]], kw: dict[str, Any], needle: str
) -> None:
    assert needle in _problem(_crafted(tmp_path, kv, **kw))


def test_tensor_table_bounds(tmp_path: Path) -> None:
    long_name = [tensor("t" * 64, (8,))]
    assert "a tensor name of 64 bytes (ggml allows 63)" in _problem(
        _crafted(tmp_path, tensors=long_name)
    )
    twice = [tensor("a", (8,)), tensor("a", (8,), 32)]
    assert "duplicate tensor 'a'" in _problem(_crafted(tmp_path, tensors=twice))
    five_dims = [tensor("a", (1, 1, 1, 1, 1))]
    assert "has 5 dimensions" in _problem(_crafted(tmp_path, tensors=five_dims))
    misaligned = [tensor("a", (8,)), tensor("b", (8,), 33)]
    assert "offset 33 is not a multiple of the alignment 32" in _problem(
        _crafted(tmp_path, tensors=misaligned)
    )
    huge = [tensor("a", (1 << 40, 1 << 40))]
    assert "more than 2^63 elements" in _problem(_crafted(tmp_path, tensors=huge, data=False))


def test_kept_metadata_is_bounded(tmp_path: Path) -> None:
    # 16 strings of 900 KiB are each short enough to keep, but not all together.
    big = [(f"blob.{i}", "str", "x" * (900 << 10)) for i in range(16)]
    assert "metadata exceeds 8 MiB" in _problem(_crafted(tmp_path, _with(big)))
    # A string longer than 1 MiB is stepped over, not kept: the model still reads.
    f = read_model_facts(_crafted(tmp_path, _with([("blob", "str", "y" * (2 << 20))])))
    assert f.n_layer == 2


def test_large_vocabulary_is_counted_not_kept(tmp_path: Path) -> None:
    kv = [*minimal_kv()[:-1], ("tokenizer.ggml.tokens", "array", ("str", ["t"] * 100_000))]
    assert read_model_facts(_crafted(tmp_path, kv)).n_vocab == 100_000


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            "tiny\n[Service]\nExecStartPre=+/bin/touch /x\n",
            "tiny [Service] ExecStartPre=+/bin/touch /x",
        ),
        ("a\x00b\x1b[31mc\u202ed", "a b [31mc d"),
        ("x" * 1000, "x" * 128),
        ("\n\t ", "crafted"),  # nothing printable left: the file's stem
    ],
)
def test_general_name_is_kept_only_sanitized(tmp_path: Path, raw: str, expected: str) -> None:
    kv = [minimal_kv()[0], ("general.name", "str", raw), *minimal_kv()[2:]]
    assert read_model_facts(_crafted(tmp_path, kv)).name == expected


@pytest.mark.parametrize("kind", ["fifo", "chardev", "socket"])
def test_non_regular_files_are_refused_without_blocking(tmp_path: Path, kind: str) -> None:
    import socket

    if kind == "fifo":
        path = tmp_path / "m.gguf"
        os.mkfifo(path)  # a plain open() would wait for a writer forever
        needle = "is a FIFO (named pipe), not a regular file"
    elif kind == "chardev":
        path, needle = Path("/dev/zero"), "is a character device, not a regular file"
    else:
        path = tmp_path / "s.sock"
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        needle = "not a regular file"
    if kind == "socket":
        # Opening a socket file fails (ENXIO) before fstat can say what it is.
        with pytest.raises(ModelError) as info:
            read_model_facts(path)
        assert info.value.exit_code == 65
        sock.close()
        return
    assert needle in _problem(path)


def test_every_preset_is_within_the_bounds() -> None:
    from slmguard.plan.modelfacts import check_facts
    from slmguard.plan.presets import PRESETS, preset_facts

    for name in PRESETS:
        check_facts(preset_facts(name)[0])


def test_an_encoder_reranker_is_rank_pooled_and_not_causal(tmp_path: Path) -> None:
    """The tiny BERT reranker of the rerank tests: its pooling type, attention and rerank
    template, read."""
    from rerankmodel import N_CTX_TRAIN, write_reranker

    facts = read_model_facts(write_reranker(tmp_path / "rr.gguf"))
    assert (facts.arch, facts.pooling_type, facts.causal_attn) == ("bert", 4, False)
    assert facts.n_ctx_train == N_CTX_TRAIN and facts.file_bytes < 4 << 20
    assert facts.rerank_template is None
    templated = write_reranker(tmp_path / "t.gguf", template="{query} [SEP] {document}")
    assert read_model_facts(templated).rerank_template == "{query} [SEP] {document}"
    plain = read_model_facts(_write_gguf(tmp_path / "llama.gguf"))
    assert plain.pooling_type is None and plain.causal_attn  # llama.cpp's default: causal
