"""Images through ``slmguard serve`` on the real engine, from a plan made with ``--mmproj``.

One server for the module: the embedded Gemma 3 270M with the tiny projector of
``tests/visionmodel.py`` (random weights: what the model says about an image means
nothing by construction), the whole way a board takes it: ``plan --mmproj``, ``apply``
into a root (the model and projector installed, the plan naming them), then ``serve`` with
the arguments of the unit apply wrote (its paths under that root; the projector's sha256
checked at start). Each dialect's image shape is answered; the largest image the plan allows is
answered; one over any bound is refused with a 400 naming the field (the front refuses
it before any call to the engine: tests/test_serve_vision_dialects.py shows the order);
a hostile sweep leaves the engine as it was (same pid, 0 restarts).
"""

from __future__ import annotations

import base64
import io
import json
import struct
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from serveproc import REQUEST_TIMEOUT_S, ServerProcess, start_server
from slmguard.plan.planfile import load_plan
from visionmodel import Projector, write_projector

pytestmark = pytest.mark.engine
PIL = pytest.importorskip("PIL.Image")
MODEL = "gemma-3-270m-q4_k_m"
TOKENS = Projector().tokens_per_image  # 16


def picture(fmt: str, side: int, noise: bool = False, **save: Any) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(3)
    arr = (
        rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
        if noise
        else np.full((side, side, 3), 120, dtype=np.uint8)
    )
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, fmt, **save)
    return buf.getvalue()


def url_of(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR says ``width`` x ``height`` (a decompression bomb's header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk + b"\0" * 64


def cli(*argv: str) -> None:
    from slmguard.cli import main

    with pytest.raises(SystemExit) as done:
        main(list(argv))
    assert done.value.code == 0


def unit_serve_args(root: Path) -> list[str]:
    """The ``serve`` arguments of the unit apply wrote under ``root``, its files' paths
    taken under ``root``, the credential (``%d``, systemd's) left out, and the model."""
    unit = (root / "etc/systemd/system/slmguard.service").read_text()
    words = next(x for x in unit.splitlines() if x.startswith("ExecStart=")).split()
    args = words[words.index("serve") + 1 :]
    at = args.index("--admin-token-file")
    del args[at : at + 2]
    model = load_plan(root / "etc/slmguard/plan.json").model.path
    args += ["--model", str(model)]
    return [str(root) + a if a.startswith(("/etc/", "/var/")) else a for a in args]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("vision-serve")
    mmproj = write_projector(tmp / "mmproj.gguf", Projector())
    plan, root = tmp / "plan.json", tmp / "root"
    cli("plan", "--mmproj", str(mmproj), "--ctx", "1024", "--n-parallel", "1",
        "--json", "--out", str(plan))  # fmt: skip
    root.mkdir()
    cli("apply", "--plan", str(plan), "--root", str(root), "--exec", "/usr/bin/slmguard")
    s = start_server(tmp, [*unit_serve_args(root), "--ctx", "1024"])
    try:
        yield s
    finally:
        s.stop()


def post(srv: ServerProcess, path: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(
        srv.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def chat(srv: ServerProcess, *parts: Any, max_tokens: int = 1) -> tuple[int, Any]:
    content = [{"type": "text", "text": "Describe it."}, *parts]
    return post(srv, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    })  # fmt: skip


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def engine_of(srv: ServerProcess) -> tuple[int, int]:
    h = srv.health()
    assert h is not None
    return h["engine"]["pid"], h["engine"]["restarts"]


def test_the_engine_runs_with_the_planned_projector(srv: ServerProcess) -> None:
    """The unit's --mmproj (the projector apply installed) is the engine's."""
    cmdline = Path(f"/proc/{engine_of(srv)[0]}/cmdline").read_bytes().split(b"\0")
    assert b"--no-mmproj-offload" in cmdline
    given = srv.args[srv.args.index("--mmproj") + 1]
    assert given.endswith("/var/lib/slmguard-models/mmproj.gguf")
    assert cmdline[cmdline.index(b"--mmproj") + 1] == given.encode()
    environ = Path(f"/proc/{engine_of(srv)[0]}/environ").read_bytes().split(b"\0")
    assert b"MALLOC_MMAP_THRESHOLD_=131072" in environ


def test_each_dialect_takes_an_image(srv: ServerProcess) -> None:
    png = picture("PNG", 96)
    status, one = chat(srv, image(url_of(png)))
    assert status == 200, one
    status, two = chat(srv, image(url_of(png)), image(url_of(png)))
    assert status == 200, two
    assert two["usage"]["prompt_tokens"] - one["usage"]["prompt_tokens"] == TOKENS + 2
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}}  # fmt: skip
    msg = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What?"}, block]}],
    }
    status, answer = post(srv, "/v1/messages", msg)
    assert status == 200, answer
    status, counted = post(
        srv, "/v1/messages/count_tokens", {k: msg[k] for k in ("model", "messages")}
    )
    assert status == 200, counted
    # the front's count (text without the image, then its tokens) holds the engine's
    usage = answer["usage"]  # Anthropic's input_tokens are those not read from the cache
    used = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    assert used <= counted["input_tokens"] <= used + 2
    status, resp = post(srv, "/v1/responses", {
        "model": MODEL, "max_output_tokens": 1,
        "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What?"},
            {"type": "input_image", "image_url": url_of(png)}]}],
    })  # fmt: skip
    assert status == 200, resp


def test_the_largest_allowed_image_is_answered(srv: ServerProcess) -> None:
    from slmguard.serve.images import ImageLimits, check_image

    limits = ImageLimits()
    side = int(limits.max_pixels**0.5)
    url = url_of(picture("JPEG", side, noise=True, quality=90), "image/jpeg")
    assert check_image(url, "i", limits).pixels == limits.max_pixels
    assert len(url) > 1 << 20  # beyond --max-body-bytes alone: the images' room holds it
    status, data = chat(srv, image(url))
    assert status == 200, data


OVER: list[tuple[str, Any, str, str]] = [
    # (what, the parts after the text, the field named, the code)
    ("a remote URL", [image("https://example.com/cat.png")],
     "messages.0.content.1.image_url.url", "image_url_not_allowed"),
    ("a file URL", [image("file:///etc/passwd")],
     "messages.0.content.1.image_url.url", "image_url_not_allowed"),
    ("huge dimensions", [image(url_of(png_header(20_000, 20_000)))],
     "messages.0.content.1.image_url.url", "image_too_large"),
    ("one side too long", [image(url_of(png_header(5000, 10)))],
     "messages.0.content.1.image_url.url", "image_too_large"),
    ("wrong magic", [image(url_of(b"GIF89a" + b"\0" * 100))],
     "messages.0.content.1.image_url.url", "invalid_image"),
    ("a JPEG said to be a PNG", [image(url_of(b"\xff\xd8\xff\xdb" + b"\0" * 100))],
     "messages.0.content.1.image_url.url", "invalid_image"),
    ("bad base64", [image("data:image/png;base64,iVBOR!w0KGgo=")],
     "messages.0.content.1.image_url.url", "invalid_image"),
    ("too many bytes", [image(url_of(b"\x89PNG" + b"\0" * ((8 << 20) + 8)))],
     "messages.0.content.1.image_url.url", "image_too_large"),
    ("too many images", [image(url_of(b"x"))] * 0 + [image("data:image/png;base64,AAAA")] * 3,
     "messages.0.content.3.image_url.url", "too_many_images"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "parts", "field", "code"), OVER, ids=[o[0] for o in OVER])
def test_over_a_bound_is_refused_naming_the_field(
    srv: ServerProcess, what: str, parts: Any, field: str, code: str
) -> None:
    before = engine_of(srv)
    if code == "too_many_images":  # the first two are valid: the count is what is refused
        parts = [image(url_of(picture("PNG", 8)))] * 2 + parts[:1]
        field = "messages.0.content.3.image_url.url"
    status, data = chat(srv, *parts)
    assert status == 400, (what, data)
    assert (data["error"]["param"], data["error"]["code"]) == (field, code), data
    assert engine_of(srv) == before


def test_other_dialects_are_bounded_the_same_way(srv: ServerProcess) -> None:
    url_source = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    status, data = post(
        srv,
        "/v1/messages",
        {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": [url_source]}]},
    )
    assert status == 400 and data["error"]["type"] == "invalid_request_error", data
    assert "messages.0.content.0.source" in data["error"]["message"]
    bomb = base64.b64encode(png_header(30_000, 30_000)).decode()
    status, data = post(srv, "/v1/messages", {
        "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": bomb}}]}]})  # fmt: skip
    assert status == 400 and "messages.0.content.0.source.data" in data["error"]["message"]
    status, data = post(srv, "/v1/responses", {
        "model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://10.0.0.1/a.png"}]}]})  # fmt: skip
    assert status == 400 and data["error"]["param"] == "input.0.content.0.image_url", data


def test_a_hostile_sweep_leaves_the_engine_as_it_was(srv: ServerProcess) -> None:
    """Images that pass the header check with nothing decodable behind them go to the
    engine, which answers 400 (or decodes what is there); the rest are refused by the
    front. Either way the engine keeps running: same pid, 0 restarts."""
    before = engine_of(srv)
    png = picture("PNG", 200, noise=True)
    jpeg = picture("JPEG", 200, noise=True)
    sweep = [
        url_of(png[:40]),                                  # IHDR only
        url_of(png[: len(png) // 2]),                      # truncated IDAT
        url_of(png[:33] + b"\0" * 4000),                   # garbage after the header
        url_of(jpeg[:300], "image/jpeg"),                  # truncated before the scan
        url_of(jpeg[: len(jpeg) // 2], "image/jpeg"),      # truncated scan
        url_of(png_header(4096, 1024)),                    # a large header, no data
        url_of(png_header(1, 1)),                          # a pixel with no data
        url_of(b"\x89PNG\r\n\x1a\n"),                      # magic only
        url_of(b""),                                       # empty
        "data:image/png;base64," + "A" * 4096,             # zeros
    ]  # fmt: skip
    statuses = []
    for url in sweep:
        status, data = chat(srv, image(url), max_tokens=1)
        statuses.append(status)
        assert status in (200, 400), (url[:60], data)
        assert engine_of(srv) == before
    assert statuses.count(400) >= 6
    status, data = chat(srv, image(url_of(picture("PNG", 32))))  # and it still answers
    assert status == 200, data
    assert engine_of(srv) == before and before[1] == 0
