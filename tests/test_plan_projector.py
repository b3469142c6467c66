"""The projector reader of :mod:`slmguard.plan.projector`: real projectors written by
``tests/visionmodel.py`` (the same files the engine tests load) and hostile headers
crafted with ``tests/ggufcraft.py``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ggufcraft import gguf_bytes, tensor
from slmguard.errors import ModelError, ModelNotFoundError
from slmguard.plan.projector import ProjectorFacts, check_text_model, read_projector_facts
from visionmodel import Projector, write_projector


def test_the_tiny_projector_reads_as_the_engine_sees_it(tmp_path: Path) -> None:
    p = Projector()
    facts = read_projector_facts(write_projector(tmp_path / "p.gguf", p))
    assert facts.projector_type == "gemma3"
    assert (facts.image_size, facts.patch_size, facts.n_merge) == (224, 14, 4)
    assert facts.patches == 256
    assert facts.tokens_per_image == p.tokens_per_image == 16  # the engine's n_tokens_batch
    assert (facts.n_embd, facts.n_ff, facts.n_head, facts.n_layer) == (64, 128, 4, 1)
    assert facts.n_embd_out == 640
    assert facts.matmul_type == "F32"
    assert facts.non_causal
    assert facts.name == "tiny-gemma3-projector"
    # the engine's "model size: 0.49 MiB" (load_hparams) is the tensors' data
    assert round(facts.weights_bytes / (1 << 20), 2) == 0.49
    assert facts.file_bytes > facts.weights_bytes


def test_shapes_follow_the_file(tmp_path: Path) -> None:
    p = Projector(image_size=896, patch_size=14, n_merge=4, n_embd=256, n_ff=1024, n_head=8,
                  n_layer=3, weight_type="F16")  # fmt: skip
    facts = read_projector_facts(write_projector(tmp_path / "p.gguf", p))
    assert (facts.patches, facts.tokens_per_image) == (4096, 256)
    assert facts.matmul_type == "F16"
    assert (facts.n_embd, facts.n_ff, facts.n_head, facts.n_layer) == (256, 1024, 8, 3)


def test_width_must_match_the_text_model(tmp_path: Path) -> None:
    facts = read_projector_facts(write_projector(tmp_path / "p.gguf", Projector()))
    assert check_text_model(facts, 640) is None
    why = check_text_model(facts, 2560)
    assert why is not None and "640" in why and "2560" in why


def gemma3_kv(**over: tuple[str, Any] | None) -> list[tuple[str, str, Any]]:
    base: dict[str, tuple[str, Any] | None] = {
        "general.architecture": ("str", "clip"),
        "general.name": ("str", "crafted"),
        "clip.projector_type": ("str", "gemma3"),
        "clip.has_vision_encoder": ("bool", True),
        "clip.vision.embedding_length": ("u32", 64),
        "clip.vision.feed_forward_length": ("u32", 128),
        "clip.vision.block_count": ("u32", 1),
        "clip.vision.attention.head_count": ("u32", 4),
        "clip.vision.image_size": ("u32", 224),
        "clip.vision.patch_size": ("u32", 14),
    }
    base.update(over)
    return [(k, v[0], v[1]) for k, v in base.items() if v is not None]


def gemma3_tensors(width: int = 640, n_embd: int = 64) -> list[Any]:
    return [
        tensor("v.patch_embd.weight", (14, 14, 3, n_embd)),
        tensor("mm.soft_emb_norm.weight", (n_embd,), 200_000),
        tensor("mm.input_projection.weight", (width, n_embd), 300_000),
    ]


def crafted(tmp_path: Path, kv: Any = None, tensors: Any = None, **kw: Any) -> Path:
    path = tmp_path / "crafted.gguf"
    path.write_bytes(gguf_bytes(kv or gemma3_kv(), gemma3_tensors() if tensors is None else tensors,
                                **kw))  # fmt: skip
    return path


def test_a_crafted_minimal_projector_reads(tmp_path: Path) -> None:
    facts = read_projector_facts(crafted(tmp_path))
    assert isinstance(facts, ProjectorFacts)
    assert facts.n_merge == 4  # llama.cpp's default for gemma3
    assert facts.n_embd_out == 640


# fmt: off
REFUSED = [
    ("a-model-not-a-projector", gemma3_kv(**{"general.architecture": ("str", "gemma3")}), None,
     "not a projector"),
    ("no-vision-encoder", gemma3_kv(**{"clip.has_vision_encoder": ("bool", False)}), None,
     "not a vision projector"),
    ("audio-only", gemma3_kv(**{"clip.has_vision_encoder": None}), None, "not a vision"),
    ("qwen2vl", gemma3_kv(**{"clip.projector_type": ("str", "qwen2vl_merger")}), None,
     "budgets gemma3"),
    ("type-not-a-string", gemma3_kv(**{"clip.projector_type": ("u32", 3)}), None,
     "expected a string"),
    ("missing-embedding", gemma3_kv(**{"clip.vision.embedding_length": None}), None,
     "clip.vision.embedding_length"),
    ("embedding-a-string", gemma3_kv(**{"clip.vision.embedding_length": ("str", "64")}), None,
     "expected an integer"),
    ("embedding-a-bool", gemma3_kv(**{"clip.vision.embedding_length": ("bool", True)}), None,
     "expected an integer"),
    ("embedding-huge", gemma3_kv(**{"clip.vision.embedding_length": ("u64", 10**15)}), None,
     "above"),
    ("heads-zero", gemma3_kv(**{"clip.vision.attention.head_count": ("u32", 0)}), None, "below"),
    ("layers-huge", gemma3_kv(**{"clip.vision.block_count": ("u32", 10**6)}), None, "above"),
    ("image-size-negative", gemma3_kv(**{"clip.vision.image_size": ("i32", -896)}), None, "below"),
    ("image-size-beyond-llama-cpp", gemma3_kv(**{"clip.vision.image_size": ("u32", 8193)}), None,
     "above"),
    ("patch-zero", gemma3_kv(**{"clip.vision.patch_size": ("u32", 0)}), None, "below"),
    ("patch-larger-than-image", gemma3_kv(**{"clip.vision.patch_size": ("u32", 500)}), None,
     "patches a side"),
    ("pool-does-not-divide", gemma3_kv(**{"clip.vision.image_size": ("u32", 210)}), None,
     "multiple of the pool"),
    ("pool-zero", gemma3_kv(**{"clip.vision.projector.scale_factor": ("u32", 0)}), None, "below"),
    ("heads-do-not-divide", gemma3_kv(**{"clip.vision.attention.head_count": ("u32", 5)}), None,
     "heads"),
    ("no-projection", None, gemma3_tensors()[:2], "mm.input_projection.weight"),
    ("no-norm", None, [gemma3_tensors()[0], gemma3_tensors()[2]], "mm.soft_emb_norm"),
    ("projection-wrong-width", None, gemma3_tensors(n_embd=32)[1:] + gemma3_tensors()[:1],
     "shape"),
    ("projection-1d", None,
     [*gemma3_tensors()[:2], tensor("mm.input_projection.weight", (640,), 400_000)], "dimensions"),
]
# fmt: on


@pytest.mark.parametrize(
    ("kv", "tensors", "word"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_hostile_headers_are_refused_naming_the_key(
    tmp_path: Path, kv: Any, tensors: Any, word: str
) -> None:
    path = crafted(tmp_path, kv, tensors)
    with pytest.raises(ModelError) as info:
        read_projector_facts(path)
    assert word in info.value.message
    assert str(path) in info.value.message
    assert info.value.exit_code == 65


def test_truncated_tensor_data(tmp_path: Path) -> None:
    path = crafted(tmp_path)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelError, match="truncated: tensor data"):
        read_projector_facts(path)


def test_truncated_everywhere_in_the_header(tmp_path: Path) -> None:
    whole = write_projector(tmp_path / "p.gguf", Projector()).read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in list(range(0, 64)) + list(range(64, 2000, 37)):
        cut.write_bytes(whole[:n])
        with pytest.raises(ModelError):
            read_projector_facts(cut)


def test_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        read_projector_facts(tmp_path / "missing.gguf")
    with pytest.raises(ModelError, match="directory"):
        read_projector_facts(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match=r"FIFO|fifo|not a regular"):
        read_projector_facts(fifo)  # returns at once: never opened for a blocking read
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelError, match="empty"):
        read_projector_facts(tmp_path / "empty.gguf")
    (tmp_path / "png.gguf").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
    with pytest.raises(ModelError, match="not a GGUF"):
        read_projector_facts(tmp_path / "png.gguf")


def test_counts_larger_than_the_file(tmp_path: Path) -> None:
    for over in ({"n_kv": 10**12}, {"n_tensors": 10**12}, {"n_kv": 2**64 - 1}):
        with pytest.raises(ModelError):
            read_projector_facts(crafted(tmp_path, **over))


def test_the_name_is_kept_sanitized(tmp_path: Path) -> None:
    kv = gemma3_kv(**{"general.name": ("str", "evil\n[Service]\nExecStart=/bin/sh\x1b[2J" * 20)})
    name = read_projector_facts(crafted(tmp_path, kv)).name
    assert "\n" not in name and "\x1b" not in name and len(name) <= 128


def test_the_benchmark_measures_with_the_planned_engine_environment() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import plan_accuracy_vision

    from slmguard.plan.projector import ENGINE_ENV

    assert plan_accuracy_vision.ENGINE_MALLOC_ENV == ENGINE_ENV
