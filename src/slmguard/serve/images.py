"""Images in a request: each one read from its header and held to the bounds, before the engine.

Owns what an image must be before llama-server sees it, and the one reader of image
headers. An image arrives as a data URL (``data:image/png;base64,...``): anything else
(``http:``, ``https:``, ``file:``, a bare base64 string) is refused, since the engine
would fetch a remote URL itself and the board fetches nothing. Then, in this order, each
refusal a :class:`~slmguard.errors.RequestError` (400) naming the field:

- **bytes**: the base64 text is measured before it is decoded (at most
  :attr:`ImageLimits.max_bytes` once decoded), and its alphabet checked strictly
  (llama-server's decoder stops at the first character outside it and would encode a
  truncated image without a word);
- **format**: the magic bytes must be PNG, JPEG or WebP, among
  :attr:`ImageLimits.formats`, and agree with the URL's media type;
- **pixel dimensions**: read from the header without decoding a pixel (PNG's IHDR,
  JPEG's frame header SOFn, WebP's VP8/VP8L/VP8X chunk), each side at most
  :attr:`ImageLimits.max_side` and their product at most
  :attr:`ImageLimits.max_pixels`: a decompression bomb (a 40 KB PNG that says 20,000 x
  20,000, 1.2 GB once decoded) is refused before any decoder runs;
- **images per request**: at most :attr:`ImageLimits.max_images`.

:attr:`ImageFacts.decode_bytes` is what the engine's decoder (stb_image, then the
bitmap it copies into) holds at most for one image, from the header's own numbers.
Pure: bytes and strings in, facts or errors out; no I/O, no image library.
:mod:`slmguard.serve.vision` holds a request's images to a served projector's bounds.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from slmguard.errors import RequestError
from slmguard.plan.schema import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, MAX_IMAGES

FORMATS = ("png", "jpeg", "webp")
#: What the engine decodes itself (stb_image). It hands WebP to ffmpeg and ffprobe, run as
#: children of the engine when they are on its PATH (llama.cpp's MTMD_VIDEO build, the
#: default): without them the engine answers 400, with them the decode runs in a process
#: the plan does not budget. So WebP is accepted only where it is asked for.
DEFAULT_FORMATS = frozenset({"png", "jpeg"})
#: media types a data URL may name, by format
MEDIA_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg", "image/webp": "webp"}
#: JPEG segments (and fill bytes) walked before the frame header at most: real files
#: have a few dozen; a file of tiny segments would otherwise cost a step per 2 bytes.
MAX_JPEG_STEPS = 4096
_B64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (baseline, extended, progressive, lossless, arithmetic);
# C4 (DHT), C8 (JPG) and CC (DAC) are not frames.
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RSTn: no length follows
# PNG colour type -> channels (greyscale, RGB, palette, grey+alpha, RGBA)
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be. The defaults are a plan's (:class:`~slmguard.plan.
    schema.ProjectorSpec`, which a server takes them from): a 2048 x 2048 picture is 12 MiB
    once decoded to RGB, and the engine holds two copies of it; WebP is off by default
    (:data:`DEFAULT_FORMATS`)."""

    max_bytes: int = MAX_IMAGE_BYTES
    max_side: int = MAX_IMAGE_SIDE
    max_pixels: int = MAX_IMAGE_PIXELS
    max_images: int = MAX_IMAGES
    formats: frozenset[str] = DEFAULT_FORMATS

    def __post_init__(self) -> None:
        unknown = set(self.formats) - set(FORMATS)
        if unknown:
            raise ValueError(f"unknown image formats {sorted(unknown)} (known: {FORMATS})")
        for name in ("max_bytes", "max_side", "max_pixels", "max_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


@dataclass(frozen=True)
class ImageFacts:
    """One image as its header describes it."""

    format: str  # "png", "jpeg" or "webp"
    width: int
    height: int
    n_bytes: int  # the encoded file
    #: bytes per pixel the format's decoder holds beside its RGB output (PNG: the
    #: inflated rows and their expansion at the header's bit depth and channels; JPEG:
    #: a plane per component, and 2-byte coefficients per component when progressive)
    work_bytes_per_pixel: int = 0

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def decode_bytes(self) -> int:
        """What decoding holds at most: the decoder's work, its RGB output, the engine's copy."""
        return self.pixels * (self.work_bytes_per_pixel + 3 + 3)


class HeaderError(ValueError):
    """The bytes are not an image this reader accepts (message: why, in a few words)."""


def _png(data: bytes) -> ImageFacts:
    if len(data) < 33:
        raise HeaderError("truncated PNG: no complete IHDR chunk")
    length, kind = struct.unpack(">I4s", data[8:16])
    if kind != b"IHDR" or length != 13:
        raise HeaderError("PNG without an IHDR chunk first")
    width, height, depth, colour = struct.unpack(">IIBB", data[16:26])
    if colour not in _PNG_CHANNELS or depth not in (1, 2, 4, 8, 16):
        raise HeaderError(f"PNG with colour type {colour} and bit depth {depth}")
    channels = _PNG_CHANNELS[colour]
    per_pixel = -(-channels * depth // 8)
    # inflated rows (filter byte and samples) plus the rows expanded to 8 or 16 bits
    return ImageFacts("png", width, height, len(data), per_pixel + channels * max(1, depth // 8))


def _jpeg_frame(data: bytes) -> tuple[int, int, int, bool]:
    """(width, height, components, progressive) from the first SOFn segment."""
    i, steps, n = 2, 0, len(data)
    while True:
        steps += 1
        if steps > MAX_JPEG_STEPS:
            raise HeaderError(f"JPEG with more than {MAX_JPEG_STEPS} segments before its frame")
        if i + 2 > n:
            raise HeaderError("truncated JPEG: no frame header")
        if data[i] != 0xFF:
            raise HeaderError(f"JPEG segment without a marker at byte {i}")
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker in (0xD8, 0xD9, 0xDA):  # SOI again, EOI or a scan before any frame
            raise HeaderError("JPEG without a frame header before its image data")
        if i + 4 > n:
            raise HeaderError("truncated JPEG: a segment without its length")
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if length < 2:
            raise HeaderError(f"JPEG segment of length {length}")
        if marker in _SOF:
            if length < 8 or i + 10 > n:
                raise HeaderError("truncated JPEG frame header")
            height, width, components = struct.unpack(">HHB", data[i + 5 : i + 10])
            return width, height, components, marker in (0xC2, 0xC6, 0xCA, 0xCE)
        i += 2 + length


def _jpeg(data: bytes) -> ImageFacts:
    width, height, components, progressive = _jpeg_frame(data)
    if height == 0:
        raise HeaderError("JPEG whose height is set later (DNL): not accepted")
    if components not in (1, 3, 4):
        raise HeaderError(f"JPEG with {components} components")
    work = components * (3 if progressive else 1)
    return ImageFacts("jpeg", width, height, len(data), work)


def _webp(data: bytes) -> ImageFacts:
    if len(data) < 30:
        raise HeaderError("truncated WebP: no complete first chunk")
    kind = data[12:16]
    body = data[20:]
    if kind == b"VP8 ":
        if body[3:6] != b"\x9d\x01\x2a":
            raise HeaderError("WebP VP8 frame without its start code")
        w, h = struct.unpack("<HH", body[6:10])
        width, height = w & 0x3FFF, h & 0x3FFF
    elif kind == b"VP8L":
        if body[0] != 0x2F:
            raise HeaderError("WebP VP8L bitstream without its signature")
        (bits,) = struct.unpack("<I", body[1:5])
        width, height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    elif kind == b"VP8X":
        width = int.from_bytes(body[4:7], "little") + 1
        height = int.from_bytes(body[7:10], "little") + 1
    else:
        raise HeaderError(f"WebP with a first chunk {kind!r}")
    return ImageFacts("webp", width, height, len(data), 4)  # RGBA frames (ffmpeg's rawvideo)


def image_header(data: bytes) -> ImageFacts:
    """The format and pixel dimensions ``data`` announces; :class:`HeaderError` when it is
    not a PNG, JPEG or WebP this reader understands."""
    if data.startswith(_PNG_MAGIC):
        facts = _png(data)
    elif data.startswith(b"\xff\xd8"):
        facts = _jpeg(data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        facts = _webp(data)
    else:
        raise HeaderError("not a PNG, JPEG or WebP file (by its first bytes)")
    if facts.width < 1 or facts.height < 1:
        raise HeaderError(f"{facts.format.upper()} of {facts.width} x {facts.height} pixels")
    return facts


def _refuse(field: str, message: str, code: str = "invalid_image") -> RequestError:
    return RequestError(f"{field}: {message}", code=code, param=field)


def _shown_scheme(url: str) -> str:
    head = url[:24].split(",", 1)[0]
    return "".join(c if c.isprintable() else "?" for c in head)


def data_url_bytes(url: str, field: str, limits: ImageLimits) -> tuple[str, bytes]:
    """(format named by the media type, the decoded bytes) of a ``data:image/...;base64,``
    URL within ``limits.max_bytes``; a RequestError naming ``field`` otherwise."""
    if not url.startswith("data:"):
        raise _refuse(
            field,
            f"only data URLs are accepted (data:image/png;base64,...), not {_shown_scheme(url)!r}"
            ": this server fetches nothing",
            "image_url_not_allowed",
        )
    head, sep, text = url.partition(",")
    media, _, encoding = head[5:].partition(";")
    if not sep or encoding != "base64":
        raise _refuse(field, "a data URL must be data:<image type>;base64,<data>")
    named = MEDIA_TYPES.get(media.lower())
    if named is None or named not in limits.formats:
        allowed = ", ".join(sorted(f"image/{f}" for f in limits.formats))
        raise _refuse(field, f"media type {media[:40]!r} is not accepted (accepted: {allowed})")
    max_text = -(-limits.max_bytes // 3) * 4
    if len(text) > max_text:
        raise _refuse(
            field,
            f"image of about {len(text) // 4 * 3:,} bytes; at most {limits.max_bytes:,}",
            "image_too_large",
        )
    if len(text) % 4 or not _B64.fullmatch(text):
        raise _refuse(field, "the data is not base64 (A-Z a-z 0-9 + /, padded with =)")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise _refuse(field, f"the data is not base64: {err}") from err
    if len(data) > limits.max_bytes:
        raise _refuse(
            field, f"image of {len(data):,} bytes; at most {limits.max_bytes:,}", "image_too_large"
        )
    return named, data


def check_image(url: str, field: str, limits: ImageLimits) -> ImageFacts:
    """One image URL held to ``limits``: its facts, or a RequestError naming ``field``."""
    named, data = data_url_bytes(url, field, limits)
    try:
        facts = image_header(data)
    except HeaderError as err:
        raise _refuse(field, str(err)) from err
    if facts.format not in limits.formats:
        raise _refuse(field, f"{facts.format.upper()} images are not accepted here")
    if facts.format != named:
        raise _refuse(field, f"the data is {facts.format.upper()} but the URL says {named}")
    side = max(facts.width, facts.height)
    if side > limits.max_side or facts.pixels > limits.max_pixels:
        raise _refuse(
            field,
            f"{facts.width} x {facts.height} pixels; at most {limits.max_side} a side and "
            f"{limits.max_pixels:,} in all (a picture is refused before it is decoded)",
            "image_too_large",
        )
    return facts


def check_images(images: Iterable[tuple[str, str]], limits: ImageLimits) -> list[ImageFacts]:
    """Every ``(field, url)`` of one request, counted against ``limits.max_images``."""
    out: list[ImageFacts] = []
    for field, url in images:
        if len(out) >= limits.max_images:
            raise _refuse(
                field,
                f"more than {limits.max_images} images in one request",
                "too_many_images",
            )
        out.append(check_image(url, field, limits))
    return out
