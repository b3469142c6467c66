"""A vision projector (``--mmproj``) from its GGUF header, and the memory its images cost.

Owns reading a projector file (through the bounded reader of ``ggufheader``: a hostile
file costs no more than a model header does) into :class:`ProjectorFacts`, each key
type-checked and held to :data:`PROJECTOR_BOUNDS`, and the arithmetic of what the engine
holds for it (:func:`vision_budget`): the weights (read into anonymous memory at load),
the image encoder's compute buffer and the CPU backend's work buffer at the projector's
image size (resident from the first image on), each slot's preprocessed images, and what
one request's images cost while they are decoded (the engine's copies of the request,
the decoded pixels, the embeddings). Pure arithmetic after the read; it never loads
weights and never imports the engine. Measured against the real engine in
``benchmarks/plan_accuracy_vision.py`` (figures in RESULTS.md).

Only Gemma 3's projector (``clip.projector_type = gemma3``: a SigLIP encoder, an average
pool, a linear map) is budgeted: every image becomes ``(image_size / patch_size /
n_merge)^2`` tokens, whatever its size (llama.cpp resizes it), so ``--image-max-tokens``
has nothing to bound. Another type is refused with a ModelError naming it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard.errors import ModelError
from slmguard.plan.ggufheader import (
    Header,
    TensorFacts,
    Truncated,
    Unsupported,
    open_regular,
    parse_header,
)
from slmguard.plan.schema import ProjectorSpec
from slmguard.plan.text import sanitize, shown

MiB = 1 << 20
BUDGETED_TYPES = ("gemma3",)

#: key -> (low, high, what real projectors have): a value outside is a broken or
#: crafted file. llama.cpp's own loader caps image_size at 8192 and patch_size
#: below 65536; SigLIP so400m (Gemma 3's encoder) has 1152 / 4304 / 27 / 16 / 896 / 14.
PROJECTOR_BOUNDS: Mapping[str, tuple[int, int, str]] = {
    "clip.vision.embedding_length": (1, 1 << 14, "SigLIP so400m: 1,152"),
    "clip.vision.feed_forward_length": (1, 1 << 16, "SigLIP so400m: 4,304"),
    "clip.vision.block_count": (1, 256, "SigLIP so400m: 27"),
    "clip.vision.attention.head_count": (1, 256, "SigLIP so400m: 16"),
    "clip.vision.image_size": (1, 8192, "Gemma 3: 896"),
    "clip.vision.patch_size": (1, 1024, "Gemma 3: 14"),
    "clip.vision.projector.scale_factor": (1, 64, "Gemma 3: 4"),
}
_GEMMA3_MERGE = 4  # llama.cpp's default pool for gemma3 when the key is absent
_OUT_WIDTH_MAX = 1 << 17  # the text model's width (Llama 3.1 405B: 16,384)


@dataclass(frozen=True)
class ProjectorFacts:
    """What the budget needs from a projector's header."""

    path: Path
    name: str
    projector_type: str
    file_bytes: int
    weights_bytes: int  # every tensor's data: what the engine reads into memory
    matmul_type: str  # the ggml type of the encoder's matrices (F16, Q8_0, ...)
    n_embd: int
    n_ff: int
    n_head: int
    n_layer: int
    image_size: int
    patch_size: int
    n_merge: int
    n_embd_out: int  # the image embeddings' width: the text model's must be the same
    projection_elem_bytes: float = 4.0  # mm.input_projection's bytes per element

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size // self.n_merge) ** 2

    @property
    def non_causal(self) -> bool:
        """Gemma 3 decodes an image's tokens attending to each other: llama.cpp aborts
        when a batch of them is larger than ``n_ubatch`` (``n_ubatch >= n_tokens``)."""
        return self.projector_type == "gemma3"


class _Refused(Exception):
    """A key is missing, of the wrong type, or outside its bound (message names it)."""


def _int(kv: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = kv.get(key, default)
    if value is None:
        raise _Refused(f"missing metadata key {shown(key)}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Refused(f"{key}: expected an integer, got {shown(value)}")
    lo, hi, note = PROJECTOR_BOUNDS[key]
    if not lo <= value <= hi:
        side = f"below {lo:,}" if value < lo else f"above {hi:,}"
        raise _Refused(f"{key} = {value}: {side}, not a real projector ({note})")
    return value


def _tensor(tensors: Mapping[str, TensorFacts], name: str, dims: int) -> TensorFacts:
    t = tensors.get(name)
    if t is None:
        raise _Refused(f"no tensor {name}: not a gemma3 projector")
    if len(t.shape) != dims:
        raise _Refused(f"tensor {name} has {len(t.shape)} dimensions, expected {dims}")
    return t


def _projector_type(kv: Mapping[str, Any]) -> str:
    if kv.get("general.architecture") != "clip":
        raise _Refused(
            f"general.architecture is {shown(kv.get('general.architecture'))}, not 'clip': "
            "not a projector (pass the model with --model, its projector with --mmproj)"
        )
    if kv.get("clip.has_vision_encoder") is not True:
        raise _Refused("clip.has_vision_encoder is not true: not a vision projector")
    kind = kv.get("clip.projector_type", kv.get("clip.vision.projector_type"))
    if not isinstance(kind, str):
        raise _Refused(f"clip.projector_type: expected a string, got {shown(kind)}")
    if kind not in BUDGETED_TYPES:
        raise Unsupported(
            f"projector type {shown(kind)}: slmguard budgets {', '.join(BUDGETED_TYPES)} "
            "projectors (Gemma 3) only"
        )
    return kind


def _facts(path: Path, file_bytes: int, h: Header) -> ProjectorFacts:
    kv = h.kv
    kind = _projector_type(kv)
    tensors = {t.name: t for t in h.tensors}
    n_embd = _int(kv, "clip.vision.embedding_length")
    n_head = _int(kv, "clip.vision.attention.head_count")
    image_size = _int(kv, "clip.vision.image_size")
    patch_size = _int(kv, "clip.vision.patch_size")
    n_merge = _int(kv, "clip.vision.projector.scale_factor", _GEMMA3_MERGE)
    side = image_size // patch_size
    if side < 1 or side % n_merge:
        raise _Refused(
            f"{image_size // patch_size} patches a side ({image_size} / {patch_size}) is not a "
            f"multiple of the pool {n_merge}: the engine's token count would not match its graph"
        )
    if n_embd % n_head:
        raise _Refused(f"{n_embd} channels do not split into {n_head} heads")
    proj = _tensor(tensors, "mm.input_projection.weight", 2)
    if proj.shape[1] != n_embd or not 1 <= proj.shape[0] <= _OUT_WIDTH_MAX:
        raise _Refused(f"mm.input_projection.weight has shape {proj.shape}, not (width, {n_embd})")
    _tensor(tensors, "mm.soft_emb_norm.weight", 1)
    matrix = tensors.get("v.blk.0.ffn_up.weight") or _tensor(tensors, "v.patch_embd.weight", 4)
    name = kv.get("general.name")
    return ProjectorFacts(
        path=path,
        name=sanitize(name if isinstance(name, str) else path.stem, 128) or "projector",
        projector_type=kind,
        file_bytes=file_bytes,
        weights_bytes=sum(t.n_bytes for t in h.tensors),
        matmul_type=matrix.type_name,
        n_embd=n_embd,
        n_ff=_int(kv, "clip.vision.feed_forward_length"),
        n_head=n_head,
        n_layer=_int(kv, "clip.vision.block_count"),
        image_size=image_size,
        patch_size=patch_size,
        n_merge=n_merge,
        n_embd_out=proj.shape[0],
        projection_elem_bytes=proj.n_bytes / (proj.shape[0] * proj.shape[1]),
    )


def _data_end(h: Header) -> int:
    return max((h.data_offset + t.offset_bytes + t.n_bytes for t in h.tensors), default=0)


def read_projector_facts(path: Path) -> ProjectorFacts:
    """Read ``path``'s GGUF header as a projector. Raises ModelNotFoundError (66) or
    ModelError (65: not GGUF, truncated, not a projector, a type not budgeted, a key
    outside its bound), naming the file and the key."""
    path = Path(path)
    with open_regular(path) as f:
        try:
            file_bytes = os.fstat(f.fileno()).st_size
            if file_bytes == 0:
                raise ModelError(path, "empty file (0 bytes), not a GGUF projector")
            header = parse_header(f, file_bytes)
        except ModelError as err:
            raise ModelError(path, err.problem, hint=err.hint) from err
        except Truncated as err:
            raise ModelError(
                path, f"truncated: the header ends early (file is {file_bytes} bytes) {err}"
            ) from err
        except Unsupported as err:
            raise ModelError(path, f"unsupported: {err}") from err
        except (ValueError, UnicodeDecodeError, struct.error, OverflowError) as err:
            raise ModelError(path, f"corrupt GGUF header: {err}") from err
        except OSError as err:
            raise ModelError(path, f"cannot read: {err.strerror or err}") from err
    try:
        facts = _facts(path, file_bytes, header)
    except Unsupported as err:
        raise ModelError(path, f"unsupported: {err}") from err
    except _Refused as err:
        raise ModelError(path, str(err)) from err
    end = _data_end(header)
    if end > file_bytes:
        raise ModelError(
            path,
            f"truncated: tensor data runs to byte {end} but the file has {file_bytes} bytes",
            hint="the download or copy is incomplete; fetch the file again",
        )
    return facts


def check_text_model(facts: ProjectorFacts, n_embd_text: int) -> str | None:
    """Why the projector cannot serve a text model of width ``n_embd_text`` (None: it
    can). The engine refuses to start on a mismatch."""
    if facts.n_embd_out == n_embd_text:
        return None
    return (
        f"the projector makes embeddings of width {facts.n_embd_out}, the model takes "
        f"{n_embd_text}: it belongs to another model"
    )


# ---------------------------------------------------------------- what its images cost
# The rules below mirror llama.cpp's tools/mtmd as bundled with llama-cpp-python 0.3.36
# (clip.cpp, models/siglip.cpp; the CPU backend of ggml) and are checked against the
# engine's own report ("reserve_compute_meta: CPU compute buffer size") and the measured
# RSS in benchmarks/plan_accuracy_vision.py.

#: Bytes per element a CPU matrix multiplication converts its activations into, by the
#: weights' type (ggml's vec_dot_type: F16 for F16, Q8_K for the k-quants, Q8_0 or Q8_1
#: for the others; F32 weights take F32 activations as they are).
_VEC_DOT_BYTES = {"F32": 0.0, "F16": 2.0, "BF16": 2.0}
_QUANT_VEC_DOT_BYTES = 292 / 256  # Q8_K, the largest of the quantized vec_dot types
#: What ggml's allocator places beyond the largest phase (alignment, a tensor that does
#: not fit a hole): up to 0.75 MiB over 54 projector shapes (fitted; benchmarks/
#: plan_accuracy_vision.py), most at 256 patches where the phases are near one another.
ALLOCATOR_SLACK_BYTES = 3 * MiB // 4


def encoder_compute_bytes(f: ProjectorFacts, flash_attn: bool) -> int:
    """The image encoder's compute buffer, reserved at load for one image of
    ``image_size`` squared and resident from the first image on: the largest of three
    phases of the graph (ggml's allocator reuses the rest). ``u`` is one activation,
    ``patches x n_embd`` f32.

    * input: the image as f32 planes and its patches unrolled as f16 (im2col);
    * attention: without flash attention the scores of all heads,
      ``patches^2 x n_head x 4`` bytes, beside six activations (1 GiB for Gemma 3's
      4,096 patches and 16 heads); with it, five activations, seven when the matrices
      are not F32 (fitted on the engine's reports: F16 shapes at 1,024 and 4,096 patches);
    * FFN: the widened activation ``patches x n_ff`` f32 beside two, and the projection
      matrix the graph transposes into a copy of its own type;

    plus :data:`ALLOCATOR_SLACK_BYTES`.
    """
    p, d = f.patches, f.n_embd
    u = p * d * 4
    image = f.image_size**2 * 3 * 4 + p * f.patch_size**2 * 3 * 2
    attention = (
        (5 if f.matmul_type == "F32" else 7) * u if flash_attn else p * p * f.n_head * 4 + 6 * u
    )
    ffn = p * f.n_ff * 4 + 2 * u + int(d * f.n_embd_out * f.projection_elem_bytes)
    return max(image, attention, ffn) + ALLOCATOR_SLACK_BYTES


def encoder_work_bytes(f: ProjectorFacts) -> int:
    """The CPU backend's work buffer for the encoder (its own backend, kept once grown):
    the largest activation converted for a matrix multiplication, ``patches x
    max(n_embd, n_ff)`` elements of the weights' vec_dot type."""
    per = _VEC_DOT_BYTES.get(f.matmul_type, _QUANT_VEC_DOT_BYTES)
    return int(f.patches * max(f.n_embd, f.n_ff) * per)


#: clip's graph metadata (``clip_ctx::buf_compute_meta``: 8,192 nodes x
#: ``ggml_tensor_overhead()``, 368 bytes on 64-bit, plus the graph's own), zero-filled at
#: load, and the mtmd context around it: 3.1 MiB measured beside the weights.
MTMD_CONTEXT_BYTES = 8192 * 368 + 256 * 1024

#: Copies of a request's data URL the engine holds at once while it parses it (the HTTP
#: body, the JSON value, the chat parser's copies, the decoded file): fitted on the cells
#: with 64, 640 and 1,600-pixel pictures (16 KB to 10 MB data URLs).
BODY_COPIES = 6.0

#: The engine's environment with a projector, which the rules above assume: glibc's mmap
#: threshold fixed (which also stops it adapting), so a large request's buffers go back
#: on free. Without it each HTTP thread's arena keeps about ten times the largest image
#: request it handled (measured: +16 MiB a request for a 1.6 MB data URL, up to the
#: engine's 5 HTTP threads, never returned).
ENGINE_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


@dataclass(frozen=True)
class VisionBudget:
    """What a projector adds to the engine's anonymous memory (bytes), and the tokens an
    image takes. Resident from load: ``weights + context``; from the first image on:
    ``compute + work`` and each slot's last images (``retained_per_image``); while a
    request's images are read and encoded: ``request``."""

    tokens_per_image: int
    weights: int
    context: int
    compute: int
    work: int
    retained_per_image: int
    request: int
    n_slots: int
    images_per_request: int

    @property
    def at_load_bytes(self) -> int:
        return self.weights + self.context

    @property
    def peak_bytes(self) -> int:
        """Every slot holding its last request's images while each reads a new one."""
        held = self.n_slots * self.images_per_request * self.retained_per_image
        return self.at_load_bytes + self.compute + self.work + held + self.n_slots * self.request


#: Tokens the engine puts around each image in a prompt (Gemma 3: ``<start_of_image>``
#: and ``<end_of_image>``; the media marker in the text itself is no token): measured,
#: ``tests/test_vision_engine.py``.
IMAGE_WRAP_TOKENS = 2
#: The text on either side of an image is tokenized apart (mtmd splits the prompt at each
#: marker), which can take a token more than the text joined: counted per image (measured
#: +1 for one image, 0 for two, through serve: ``tests/test_serve_vision.py``).
IMAGE_SPLIT_TOKENS = 2
#: The most one image's decoding holds per pixel, by
#: :attr:`slmguard.serve.images.ImageFacts.decode_bytes`: a 16-bit RGBA PNG (8 bytes a
#: pixel inflated, 8 expanded) beside the RGB output and the engine's copy (3 + 3).
DECODE_BYTES_PER_PIXEL_MAX = 22
#: ``data:image/jpeg;base64,``: the longest prefix of an accepted data URL.
DATA_URL_PREFIX_CHARS = 23


def image_tokens(tokens_per_image: int) -> int:
    """What one image takes of a slot at most: its tokens, :data:`IMAGE_WRAP_TOKENS` and
    :data:`IMAGE_SPLIT_TOKENS`."""
    return tokens_per_image + IMAGE_WRAP_TOKENS + IMAGE_SPLIT_TOKENS


def data_url_chars(n_bytes: int) -> int:
    """The length of the data URL of an image file of ``n_bytes`` (base64, padded)."""
    return DATA_URL_PREFIX_CHARS + -(-n_bytes // 3) * 4


@dataclass(frozen=True)
class VisionInput:
    """What a projector adds to a budget: its header's facts and the plan's section (the
    image bounds, where the encoder runs)."""

    facts: ProjectorFacts
    spec: ProjectorSpec

    @property
    def image_tokens(self) -> int:
        """One image's tokens in a slot, at most: its own, the engine's around it and the
        text split at it."""
        return image_tokens(self.spec.tokens_per_image)

    @property
    def slot_image_tokens(self) -> int:
        """The tokens a slot must hold for the most images a request may carry."""
        return self.spec.max_images * self.image_tokens

    def request_bytes_max(self) -> int:
        """The most one request's images may hold while they are read, decoded and encoded
        (:func:`request_bytes` at the bounds)."""
        s = self.spec
        return request_bytes(
            self.facts,
            images=s.max_images,
            data_url_chars=s.max_images * data_url_chars(s.max_image_bytes),
            decode_bytes=s.max_image_pixels * DECODE_BYTES_PER_PIXEL_MAX,
        )


def retained_image_bytes(f: ProjectorFacts) -> int:
    """What a slot keeps per image with its prompt: the image resized to ``image_size``
    squared, as RGB bytes and as the encoder's f32 input (``mtmd_image_tokens``)."""
    return f.image_size**2 * 3 * (1 + 4)


def request_bytes(f: ProjectorFacts, *, images: int, data_url_chars: int, decode_bytes: int) -> int:
    """One request's transient: :data:`BODY_COPIES` of its data URLs, each image decoded
    (``decode_bytes``: :attr:`slmguard.serve.images.ImageFacts.decode_bytes` at the
    largest image allowed) and preprocessed (:func:`retained_image_bytes`), the encoder's
    planar copy of its input and the embeddings it makes (f32, the text model's width)."""
    per_image = (
        decode_bytes
        + retained_image_bytes(f)
        + f.image_size**2 * 3 * 4
        + f.tokens_per_image * f.n_embd_out * 4
    )
    return int(BODY_COPIES * data_url_chars) + images * per_image


def vision_budget(
    f: ProjectorFacts,
    *,
    flash_attn: bool,
    n_slots: int,
    images_per_request: int,
    data_url_chars: int,
    decode_bytes: int,
) -> VisionBudget:
    """The projector's memory for these engine settings and image bounds (see
    :class:`VisionBudget`). ``data_url_chars`` and ``decode_bytes`` are one request's
    largest allowed images: the data URLs' total length and one image's decoding."""
    return VisionBudget(
        tokens_per_image=f.tokens_per_image,
        weights=f.weights_bytes,
        context=MTMD_CONTEXT_BYTES,
        compute=encoder_compute_bytes(f, flash_attn),
        work=encoder_work_bytes(f),
        retained_per_image=retained_image_bytes(f),
        request=request_bytes(
            f, images=images_per_request, data_url_chars=data_url_chars, decode_bytes=decode_bytes
        ),
        n_slots=n_slots,
        images_per_request=images_per_request,
    )
