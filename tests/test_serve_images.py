"""The image reader and bounds of :mod:`slmguard.serve.images`, as pure checks (no engine).

Real pictures are written with Pillow in every format and variant the reader must
understand (PNG of each colour type and bit depth, baseline and progressive JPEG, lossy,
lossless and extended WebP) and their dimensions compared with Pillow's; hostile ones
are crafted byte by byte: truncated at every length, wrong magic, a decompression bomb
(a real PNG of 8,000 x 8,000 pixels in about 190 KB), huge and zero dimensions, JPEGs
that walk forever, and more images than a request may carry.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest

from slmguard.errors import RequestError
from slmguard.serve.images import (
    FORMATS,
    MAX_JPEG_STEPS,
    HeaderError,
    ImageLimits,
    check_image,
    check_images,
    image_header,
)

PIL = pytest.importorskip("PIL.Image")
LIMITS = ImageLimits(formats=frozenset(FORMATS), max_images=4)


def picture(fmt: str, size: tuple[int, int], mode: str = "RGB", **save: object) -> bytes:
    from PIL import Image

    img = Image.new(mode, size)
    if mode in ("RGB", "RGBA"):
        img.putpixel((0, 0), (255, 0, 0, 255)[: len(mode)])
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bytes(width: int, height: int, rows: bytes = b"", depth: int = 8, colour: int = 2) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    idat = png_chunk(b"IDAT", zlib.compress(rows)) if rows else b""
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + idat + png_chunk(b"IEND", b"")


# fmt: off
REAL = [
    ("png-rgb", "PNG", (640, 480), "RGB", {}),
    ("png-rgba", "PNG", (3, 7), "RGBA", {}),
    ("png-grey", "PNG", (1, 1), "L", {}),
    ("png-grey16", "PNG", (20, 10), "I;16", {}),
    ("png-palette", "PNG", (33, 44), "P", {}),
    ("png-1bit", "PNG", (17, 5), "1", {}),
    ("jpeg-baseline", "JPEG", (640, 480), "RGB", {}),
    ("jpeg-progressive", "JPEG", (1000, 3), "RGB", {"progressive": True}),
    ("jpeg-grey", "JPEG", (8, 8), "L", {}),
    ("jpeg-exif", "JPEG", (31, 29), "RGB", {"exif": b"Exif\x00\x00" + b"\x00" * 60000}),
    ("webp-lossy", "WEBP", (640, 480), "RGB", {}),
    ("webp-lossless", "WEBP", (301, 17), "RGB", {"lossless": True}),
    ("webp-alpha", "WEBP", (16383, 2), "RGBA", {}),
    ("webp-exif", "WEBP", (5, 6), "RGB", {"exif": b"Exif\x00\x00abc"}),
]
# fmt: on


@pytest.mark.parametrize(
    ("fmt", "size", "mode", "save"), [r[1:] for r in REAL], ids=[r[0] for r in REAL]
)
def test_real_pictures_give_their_format_and_size(
    fmt: str, size: tuple[int, int], mode: str, save: dict[str, object]
) -> None:
    data = picture(fmt, size, mode, **save)
    facts = image_header(data)
    assert (facts.format, facts.width, facts.height) == ({"PNG": "png", "JPEG": "jpeg",
                                                          "WEBP": "webp"}[fmt], *size)  # fmt: skip
    assert facts.n_bytes == len(data)
    assert facts.decode_bytes >= facts.pixels * 6  # the RGB output and the engine's copy


def test_decode_bytes_follow_the_header() -> None:
    rgb8 = image_header(png_bytes(100, 100, colour=2, depth=8))
    rgba16 = image_header(png_bytes(100, 100, colour=6, depth=16))
    base = image_header(picture("JPEG", (100, 100)))
    progressive = image_header(picture("JPEG", (100, 100), progressive=True))
    assert rgba16.decode_bytes > rgb8.decode_bytes
    assert progressive.decode_bytes > base.decode_bytes


def test_a_picture_within_the_bounds_is_accepted_in_every_format() -> None:
    for fmt, media in (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
        facts = check_image(data_url(picture(fmt, (2048, 2048)), media), "img", LIMITS)
        assert facts.pixels == LIMITS.max_pixels
    assert check_image(data_url(picture("JPEG", (9, 9)), "image/jpg"), "x", LIMITS).format == "jpeg"


def refusal(
    url: str, limits: ImageLimits = LIMITS, field: str = "messages[0].content[1]"
) -> RequestError:
    with pytest.raises(RequestError) as info:
        check_image(url, field, limits)
    assert info.value.param == field
    assert field in info.value.message
    return info.value


@pytest.mark.parametrize(
    "url",
    ["http://example.com/cat.png", "https://10.0.0.1/x.jpg", "file:///etc/passwd", "ftp://x/y",
     "iVBORw0KGgo=", "", "DATA:image/png;base64,AAAA", " data:image/png;base64,AAAA"],
)  # fmt: skip
def test_only_data_urls(url: str) -> None:
    err = refusal(url)
    assert err.code == "image_url_not_allowed"
    assert "fetches nothing" in err.message


# fmt: off
BAD_URLS = [
    ("no-base64", "data:image/png,abcd", "base64"),
    ("no-comma", "data:image/png;base64", "base64"),
    ("media-type", "data:image/gif;base64,R0lGODlh", "image/gif"),
    ("text-media", "data:text/html;base64,PGgxPg==", "text/html"),
    ("charset-param", "data:image/png;charset=utf-8;base64,AAAA", "base64"),
    ("bad-alphabet", "data:image/png;base64,AAA*", "not base64"),
    ("url-safe-alphabet", "data:image/png;base64,AA-_", "not base64"),
    ("space-inside", "data:image/png;base64,AA AA", "not base64"),
    ("unpadded", "data:image/png;base64,AAAAA", "not base64"),
    ("inner-padding", "data:image/png;base64,AA==AAAA", "not base64"),
    ("newline", "data:image/png;base64,AAAA\n", "not base64"),
]
# fmt: on


@pytest.mark.parametrize(("url", "word"), [b[1:] for b in BAD_URLS], ids=[b[0] for b in BAD_URLS])
def test_malformed_data_urls(url: str, word: str) -> None:
    assert word in refusal(url).message


def test_bytes_are_bounded_before_decoding() -> None:
    limits = ImageLimits(max_bytes=1000)
    err = refusal("data:image/png;base64," + "A" * 4000, limits)
    assert err.code == "image_too_large"
    assert "1,000" in err.message
    # just over, after decoding: 1,002 bytes in 1,336 characters
    assert refusal(data_url(png_bytes(1, 1) + b"\0" * (1002 - len(png_bytes(1, 1)))), limits)
    assert check_image(
        data_url(png_bytes(1, 1) + b"\0" * (999 - len(png_bytes(1, 1)))), "i", limits
    )


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    width = height = 8000  # 192 MB of RGB once decoded
    rows = zlib.compressobj(9)
    body = b"".join(rows.compress(b"\0" * (1 + 3 * width)) for _ in range(height)) + rows.flush()
    bomb = png_bytes(width, height) [:-12]  # fmt: skip
    bomb = bomb[:33] + png_chunk(b"IDAT", body) + png_chunk(b"IEND", b"")
    assert len(bomb) < 250_000
    assert image_header(bomb).pixels == 64_000_000
    err = refusal(data_url(bomb))
    assert err.code == "image_too_large"
    assert "8000 x 8000" in err.message


@pytest.mark.parametrize(
    ("width", "height"),
    [(4097, 1), (1, 4097), (2049, 2048), (2**31 - 1, 2**31 - 1), (2**32 - 1, 1), (65535, 65535)],
)
def test_dimensions_beyond_the_bounds(width: int, height: int) -> None:
    assert refusal(data_url(png_bytes(width, height))).code == "image_too_large"


@pytest.mark.parametrize("size", [(0, 10), (10, 0), (0, 0)])
def test_zero_dimensions(size: tuple[int, int]) -> None:
    assert "0" in refusal(data_url(png_bytes(*size))).message


def test_a_side_and_the_area_are_both_bounded() -> None:
    limits = ImageLimits(max_side=100, max_pixels=50 * 50)
    assert check_image(data_url(png_bytes(100, 25)), "i", limits)
    assert refusal(data_url(png_bytes(101, 1)), limits)
    assert refusal(data_url(png_bytes(51, 50)), limits)


@pytest.mark.parametrize(
    "data",
    [b"", b"\0", b"GIF89a\x01\x00\x01\x00", b"BM" + b"\0" * 60,
     b"RIFF\0\0\0\0WAVEfmt " + b"\0" * 30, b"ID3\x04" + b"\0" * 40,
     b"\xff\xfb\x90" + b"\0" * 40, b"fLaC" + b"\0" * 40,
     b"\x00\x00\x00\x18ftypmp42" + b"\0" * 40, b"<svg xmlns='http://www.w3.org/2000/svg'/>",
     b"%PDF-1.7"],
    ids=["empty", "nul", "gif", "bmp", "wav", "mp3-id3", "mp3-sync", "flac", "mp4", "svg", "pdf"],
)  # fmt: skip
def test_wrong_magic(data: bytes) -> None:
    """Audio and video magic included: the engine would hand those to its audio decoder
    or to ffmpeg."""
    assert "not a PNG, JPEG or WebP" in refusal(data_url(data)).message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated_at_every_length_of_the_header(fmt: str) -> None:
    data = picture(fmt, (64, 48))
    whole = image_header(data)
    accepted = 0
    for n in range(0, 120):
        try:
            facts = image_header(data[:n])
        except HeaderError:
            continue
        assert (facts.width, facts.height) == (whole.width, whole.height)
        accepted += 1
    assert accepted < 120  # a prefix too short to hold the header is refused


def test_media_type_and_data_must_agree() -> None:
    err = refusal(data_url(picture("JPEG", (4, 4)), "image/png"))
    assert "JPEG" in err.message


def test_webp_is_accepted_only_when_asked_for() -> None:
    """The engine decodes WebP with ffmpeg, outside the plan: off by default."""
    default = ImageLimits()
    webp = data_url(picture("WEBP", (4, 4)), "image/webp")
    assert "image/webp" in refusal(webp, default).message
    assert check_image(webp, "i", LIMITS).format == "webp"
    assert check_image(data_url(picture("PNG", (4, 4))), "i", default).format == "png"
    riff_webp_named_png = data_url(picture("WEBP", (4, 4)), "image/png")
    assert "WEBP" in refusal(riff_webp_named_png, default).message
    with pytest.raises(ValueError, match="gif"):
        ImageLimits(formats=frozenset({"gif"}))


def header_refusal(data: bytes) -> str:
    with pytest.raises(HeaderError) as info:
        image_header(data)
    return str(info.value)


def jpeg_segments(n: int) -> bytes:
    return b"\xff\xd8" + b"\xff\xfe\x00\x02" * n  # n empty comments, no frame


def test_a_jpeg_that_never_reaches_its_frame_is_refused_within_a_bound() -> None:
    assert "segments" in header_refusal(jpeg_segments(10**6))
    fill = b"\xff\xd8" + b"\xff" * 10**6
    assert "segments" in header_refusal(fill)
    frame = b"\xff\xc0\x00\x11\x08\x00\x10\x00\x20\x03" + b"\0" * 9
    assert image_header(jpeg_segments(MAX_JPEG_STEPS - 2) + frame).width == 32


@pytest.mark.parametrize(
    ("data", "word"),
    [(b"\xff\xd8\xff\xda\x00\x02", "frame"), (b"\xff\xd8\xff\xd9", "frame"),
     (b"\xff\xd8\x00\x00", "marker"), (b"\xff\xd8\xff\xe0\x00\x01", "length"),
     (b"\xff\xd8\xff\xc0\x00\x11\x08\x00\x00\x00\x20\x03", "DNL"),
     (b"\xff\xd8\xff\xc0\x00\x11\x08\x00\x10\x00\x20\x02", "components"),
     (b"\xff\xd8\xff\xc0\x00\x11\x08\x00", "truncated")],
)  # fmt: skip
def test_broken_jpeg_headers(data: bytes, word: str) -> None:
    assert word in header_refusal(data)


@pytest.mark.parametrize(
    ("data", "word"),
    [(b"RIFF\0\0\0\0WEBPVP8 \0\0\0\0" + b"\0" * 20, "start code"),
     (b"RIFF\0\0\0\0WEBPVP8L\0\0\0\0" + b"\0" * 20, "signature"),
     (b"RIFF\0\0\0\0WEBPALPH\0\0\0\0" + b"\0" * 20, "first chunk"),
     (b"RIFF\0\0\0\0WEBPVP8X", "truncated")],
)  # fmt: skip
def test_broken_webp_headers(data: bytes, word: str) -> None:
    assert word in header_refusal(data)


@pytest.mark.parametrize(("colour", "depth"), [(1, 8), (5, 8), (7, 8), (2, 3), (2, 32), (0, 0)])
def test_png_colour_types_and_depths_outside_the_format(colour: int, depth: int) -> None:
    assert "colour type" in header_refusal(png_bytes(4, 4, colour=colour, depth=depth))


def test_png_whose_first_chunk_is_not_ihdr() -> None:
    data = b"\x89PNG\r\n\x1a\n" + png_chunk(b"tEXt", b"a" * 13) + b"\0" * 20
    assert "IHDR" in header_refusal(data)


def test_images_per_request() -> None:
    url = data_url(picture("PNG", (2, 2)))
    fields = [(f"messages[0].content[{i}]", url) for i in range(LIMITS.max_images + 1)]
    assert len(check_images(fields[:-1], LIMITS)) == LIMITS.max_images
    with pytest.raises(RequestError) as info:
        check_images(fields, LIMITS)
    assert info.value.code == "too_many_images"
    assert info.value.param == fields[-1][0]


def test_many_images_are_refused_at_the_first_too_many_without_reading_the_rest() -> None:
    """The count is checked before a URL is read: the 5th of 1,000 broken URLs is the
    one named, for being one too many, not for being broken."""
    fields = [(f"i{i}", data_url(picture("PNG", (2, 2)))) for i in range(4)]
    fields += [(f"i{i}", "data:image/png;base64,!!!!") for i in range(4, 1000)]
    with pytest.raises(RequestError) as info:
        check_images(fields, LIMITS)
    assert (info.value.param, info.value.code) == ("i4", "too_many_images")


def test_limits_refuse_nonsense() -> None:
    for field in ("max_bytes", "max_side", "max_pixels", "max_images"):
        with pytest.raises(ValueError, match=field):
            ImageLimits(**{field: 0})  # type: ignore[arg-type]
