"""Vision on the real engine: the tiny projector of ``tests/visionmodel.py`` loaded by
llama-server beside the embedded Gemma 3 270M, real images sent as data URLs.

What the model says about an image means nothing (the projector's weights are random);
what is checked is that the engine runs the vision path end to end, and that what
:mod:`slmguard.plan.projector` reads from the header is what the engine reports (its
weights, its tokens per image, its encoder compute buffer). One engine for the module,
started as ``serve`` starts it (``engine_argv``) with ``--mmproj`` added; a second,
short-lived one shows the rule the plan keeps (a Gemma 3 image batch larger than
``n_ubatch`` aborts the engine).
"""

from __future__ import annotations

import base64
import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slmguard.plan.projector import encoder_compute_bytes, read_projector_facts
from slmguard.serve.images import ImageLimits, check_image
from visionmodel import Projector, write_projector

pytestmark = pytest.mark.engine
BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
MiB = 1 << 20


def _start(tmp: Path, projector: Projector, **cfg: Any) -> Any:
    from slmguard import paths
    from slmguard.default_model import ensure_default_model
    from slmguard.errors import EngineUnavailableError
    from slmguard.serve.llamaserver import EngineConfig, find_llama_server

    try:
        binary = find_llama_server()
    except EngineUnavailableError as err:
        pytest.skip(f"no llama-server: {err.message}")
    sys.path.insert(0, str(BENCH))
    import engine_probe

    model = ensure_default_model(paths.model_dir())
    path = write_projector(tmp / "mmproj.gguf", projector)
    settings = {"n_ctx": 1024, "n_batch": 64, "n_ubatch": 64, "n_parallel": 1, "n_threads": 2,
                "flash_attn": True, **cfg}  # fmt: skip
    base = engine_probe.engine_argv
    engine_probe.engine_argv = lambda *a, **k: [*base(*a, **k), "--mmproj", str(path)]
    try:
        return engine_probe.start_engine(
            binary, EngineConfig(model_path=str(model), **settings), tmp
        )
    finally:
        engine_probe.engine_argv = base


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    eng = _start(tmp_path_factory.mktemp("vision"), Projector())
    yield eng
    eng.close()


def picture(fmt: str, size: int, noise: bool = False) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(7)
    arr = (
        rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
        if noise
        else np.full((size, size, 3), 90, dtype=np.uint8)
    )
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, fmt, quality=95)
    return buf.getvalue()


def url_of(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def chat(eng: Any, content: Any) -> tuple[int, Any]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0.0}  # fmt: skip
    return eng.request("POST", "/v1/chat/completions", body, timeout=600)  # type: ignore[no-any-return]


def with_image(url: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip


def test_an_image_is_answered_and_takes_the_planned_tokens(engine: Any) -> None:
    url = url_of(picture("PNG", 320))
    status, one = chat(engine, with_image(url))
    assert status == 200, one
    assert isinstance(one["choices"][0]["message"]["content"], str)  # meaningless text
    status, two = chat(engine, [*with_image(url), {"type": "image_url", "image_url": {"url": url}}])
    assert status == 200, two
    # each image: its tokens and <start_of_image> ... <end_of_image>
    tokens = Projector().tokens_per_image
    assert two["usage"]["prompt_tokens"] - one["usage"]["prompt_tokens"] == tokens + 2


def test_the_engine_reports_what_the_header_says(engine: Any, tmp_path: Path) -> None:
    facts = read_projector_facts(write_projector(tmp_path / "p.gguf", Projector()))
    log = engine.log()
    weights = re.search(r"load_hparams: model size:\s+([\d.]+) MiB", log)
    assert weights is not None and float(weights.group(1)) == round(facts.weights_bytes / MiB, 2)
    batches = re.findall(r"n_tokens_batch = (\d+)", log)
    assert batches and {int(b) for b in batches} == {facts.tokens_per_image}
    computes = re.findall(r"reserve_compute_meta:\s+CPU compute buffer size =\s+([\d.]+) MiB", log)
    assert computes
    reported = float(computes[-1]) * MiB
    planned = encoder_compute_bytes(facts, flash_attn=True)
    assert reported - 0.01 * MiB <= planned <= reported + 0.76 * MiB


def test_the_largest_allowed_image_is_answered(engine: Any) -> None:
    limits = ImageLimits()
    side = int(limits.max_pixels**0.5)
    url = url_of(picture("JPEG", side, noise=True), "image/jpeg")
    assert check_image(url, "image", limits).pixels == limits.max_pixels
    status, data = chat(engine, with_image(url))
    assert status == 200, data


def test_what_passes_the_header_check_but_is_broken_does_not_kill_the_engine(
    engine: Any,
) -> None:
    """A header the bounds accept with nothing decodable behind it: the engine answers
    400 and keeps running (same process, healthy)."""
    png = picture("PNG", 300, noise=True)
    jpeg = picture("JPEG", 300, noise=True)
    limits = ImageLimits()
    pid = engine.proc.pid
    for data, media in ((png[:60], "image/png"), (png[: len(png) // 2], "image/png"),
                        (jpeg[:400], "image/jpeg"),
                        (png[:33] + b"\0" * 5000, "image/png")):  # fmt: skip
        url = url_of(data, media)
        check_image(url, "image", limits)  # passes the bounds: only the header is read
        status, _ = chat(engine, with_image(url))
        assert status in (200, 400)  # stb_image decodes a truncated JPEG's top rows
        assert engine.proc.poll() is None and engine.proc.pid == pid
        assert engine.request("GET", "/health")[0] == 200


def test_an_image_batch_larger_than_the_ubatch_aborts_the_engine(tmp_path: Path) -> None:
    """Why the plan keeps ``n_batch <= n_ubatch`` (and asks ``n_ubatch >= tokens per
    image``) with a Gemma 3 projector: its image tokens are decoded non-causally, and
    llama.cpp asserts ``n_ubatch >= n_tokens`` for that (SIGABRT, llama-context.cpp)."""
    projector = Projector(image_size=448)  # 64 tokens an image
    eng = _start(tmp_path, projector, n_batch=512, n_ubatch=32)
    try:
        with pytest.raises(OSError):
            chat(eng, with_image(url_of(picture("PNG", 64))))
        eng.proc.wait(timeout=60)
        assert eng.proc.returncode == -6  # SIGABRT
        assert "non-causal attention requires n_ubatch >= n_tokens" in eng.log()
    finally:
        eng.close()
