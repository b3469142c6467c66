"""Images in the dialects, before the engine: refused or counted, and their cost carried.

The engine's side here is a recorder of the calls a dialect makes (``call_json``): what
is checked is the front's order (an image over a bound, or to a server without a
projector, is refused before any call: the engine never sees it), what the engine is
asked to count (the prompt without its images: it would decode them) and what the
sizing and the governor get (the images' tokens and transient bytes). The same requests
on the real engine: tests/test_serve_vision.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import pytest

from slmguard.errors import RequestError
from slmguard.governor.policy import MemoryModel
from slmguard.governor.request import NoPolicy, SizedRequest
from slmguard.plan.projector import image_tokens, read_projector_facts, request_bytes
from slmguard.plan.vision import spec_for
from slmguard.serve.dialects.chat import prepare_chat
from slmguard.serve.dialects.context import DialectContext
from slmguard.serve.dialects.messages import prepare_messages
from slmguard.serve.dialects.responses import prepare_responses
from slmguard.serve.served import ServedModel
from slmguard.serve.sizing import Sizing, TokenLimits
from slmguard.serve.vision import ServedVision
from slmguard.settings import UNPLANNED
from visionmodel import Projector, write_projector

PIL = pytest.importorskip("PIL.Image")


def png(side: int = 40) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (9, 9, 9)).save(buf, "PNG")
    return buf.getvalue()


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class Recorder:
    """The engine's answers to the calls a dialect makes, each call kept."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def __call__(self, path: str, body: Any) -> Any:
        self.calls.append((path, body))
        if path == "/apply-template":
            return {"prompt": "prompt"}
        if path == "/tokenize":
            return {"tokens": [1] * 10}
        return {"input_tokens": 10}


class Policy(NoPolicy):
    def __init__(self) -> None:
        self.admitted: list[SizedRequest] = []


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> ServedVision:
    path = write_projector(tmp_path_factory.mktemp("v") / "p.gguf", Projector())
    facts = read_projector_facts(path)
    return ServedVision(spec_for(facts), facts)


def context(vision: ServedVision | None) -> tuple[DialectContext, Recorder]:
    rec = Recorder()
    sizing = Sizing(Policy(), TokenLimits(), settings=lambda: UNPLANNED, slots=lambda: 1)
    return DialectContext(rec, sizing, ServedModel("m", "/m", 1), None, vision), rec


def chat_body(*parts: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "Hi"}, *parts]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def image(u: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": u}}


def test_without_a_projector_an_image_is_refused_before_the_engine() -> None:
    ctx, rec = context(None)
    with pytest.raises(RequestError) as err:
        asyncio.run(prepare_chat(ctx, chat_body(image(url(png()))), None))
    assert err.value.param == "messages.0.content.1.image_url.url"
    assert err.value.code == "images_not_supported" and rec.calls == []


@pytest.mark.parametrize(
    ("part", "code"),
    [
        (image("https://example.com/a.png"), "image_url_not_allowed"),
        (image(url(b"\x89PNG\r\n\x1a\n" + b"\0" * 8 + b"IHDR" + b"\0" * 30)), "invalid_image"),
        (image("data:image/png;base64,@@@@"), "invalid_image"),
    ],
)
def test_an_image_over_a_bound_never_reaches_the_engine(
    vision: ServedVision, part: Any, code: str
) -> None:
    ctx, rec = context(vision)
    with pytest.raises(RequestError) as err:
        asyncio.run(prepare_chat(ctx, chat_body(part), None))
    assert (err.value.param, err.value.code) == ("messages.0.content.1.image_url.url", code)
    assert rec.calls == []


def test_a_chat_image_is_counted_apart_and_carries_its_cost(vision: ServedVision) -> None:
    ctx, rec = context(vision)
    data = png()
    gen = asyncio.run(prepare_chat(ctx, chat_body(image(url(data)), image(url(data))), None))
    template = next(body for path, body in rec.calls if path == "/apply-template")
    assert template["messages"][0]["content"] == "Hi"  # the images are not sent to count
    assert "image_url" not in str([b for _, b in rec.calls])
    assert gen.sized.prompt_tokens == 10 + 2 * image_tokens(16)
    facts = vision.facts
    chars = 2 * len(url(data))
    want = request_bytes(facts, images=0, data_url_chars=chars, decode_bytes=0) + 2 * (
        request_bytes(facts, images=1, data_url_chars=0, decode_bytes=40 * 40 * 12)  # 8-bit RGB PNG
    )
    assert gen.sized.transient_bytes == want
    # the engine gets the images as they came
    assert gen.body["messages"][0]["content"][1]["image_url"]["url"] == url(data)


def test_a_session_turn_takes_no_image(vision: ServedVision) -> None:
    class Sessions:
        async def session_prompt(self, session_id: str, new: list[Any]) -> list[Any]:
            return new

    ctx, rec = context(vision)
    ctx.sessions = Sessions()  # type: ignore[assignment]
    with pytest.raises(RequestError, match="not kept in a session"):
        asyncio.run(prepare_chat(ctx, chat_body(image(url(png()))), "s1"))
    assert rec.calls == []


def test_messages_and_responses_images(vision: ServedVision) -> None:
    ctx, rec = context(vision)
    b64 = base64.b64encode(png()).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, block]}],
    }
    gen = asyncio.run(prepare_messages(ctx, body))
    counted = next(b for p, b in rec.calls if p == "/v1/messages/count_tokens")
    assert counted["messages"][0]["content"] == [{"type": "text", "text": "Hi"}]
    assert gen.sized.prompt_tokens == 10 + image_tokens(16) and gen.sized.transient_bytes > 0
    wrong = {**block, "source": {**block["source"], "media_type": "image/jpeg"}}
    with pytest.raises(RequestError) as err:
        asyncio.run(
            prepare_messages(ctx, {**body, "messages": [{"role": "user", "content": [wrong]}]})
        )
    assert err.value.param == "messages.0.content.0.source.data"
    assistant = [{"role": "assistant", "content": [block]}]
    with pytest.raises(RequestError, match="images go in the user's messages"):
        asyncio.run(prepare_messages(ctx, {**body, "messages": assistant}))
    rec.calls.clear()
    item = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "Hi"},
            {"type": "input_image", "image_url": url(png())},
        ],
    }
    gen = asyncio.run(prepare_responses(ctx, {"model": "m", "input": [item]}))
    counted = next(b for p, b in rec.calls if p == "/v1/responses/input_tokens")
    assert counted["input"][0]["content"] == [{"type": "input_text", "text": "Hi"}]
    assert gen.sized.prompt_tokens == 10 + image_tokens(16)


def test_the_governor_counts_a_request_s_images_not_the_plan_s_every_slot(
    tmp_path: Path,
) -> None:
    """The plan's ``image_requests`` (every slot's worst request) is not memory still to
    become resident: each request brings its own (``transient_bytes``)."""
    from slmguard import paths
    from slmguard.default_model import ensure_default_model
    from slmguard.plan.boards import get_profile
    from slmguard.plan.configs import PlanRequest
    from slmguard.plan.modelfacts import read_model_facts
    from slmguard.plan.planner import make_plan
    from slmguard.plan.projector import VisionInput

    gemma = read_model_facts(ensure_default_model(paths.model_dir()))
    facts = read_projector_facts(write_projector(tmp_path / "p.gguf", Projector()))
    plan = make_plan(PlanRequest(gemma, get_profile("rk3588-8g"), ctx=2048, model_path="/m",
                                 vision=VisionInput(facts, spec_for(facts))))  # fmt: skip
    use = sum(p.bytes for p in plan.budget if p.when == "use" and p.kind == "anon")
    requests = next(p.bytes for p in plan.budget if p.name == "image_requests")
    assert MemoryModel.from_plan(plan).use_bytes == use - requests


def test_the_governor_refuses_a_request_whose_images_cross_the_shed_line(
    tmp_path: Path,
) -> None:
    """Admission projects the memory now plus a request's images (``transient_bytes``):
    the same request is admitted without them, 503 ``memory_projection`` with them
    (a real cgroup tree's files, the memory at 80% of a 1,000 MiB limit), and 400 when
    its images alone would reach the shed line."""
    from hosttree import build_tree
    from slmguard.errors import envelope
    from slmguard.governor.runtime import Governor, GovernorConfig
    from slmguard.governor.signal import MemorySignal

    mib, cg = 1 << 20, "sys/fs/cgroup/svc"
    root = build_tree(tmp_path, {
        "proc/self/cgroup": "0::/svc\n",
        "proc/self/mountinfo": "25 1 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        "proc/meminfo": "MemTotal: 8000000 kB\nMemAvailable: 7000000 kB\n",
        "sys/fs/cgroup/cgroup.controllers": "cpu memory pids\n",
        f"{cg}/memory.current": f"{800 * mib}\n", f"{cg}/memory.high": "max\n",
        f"{cg}/memory.max": f"{1000 * mib}\n", f"{cg}/memory.stat": "anon 0\ninactive_file 0\n",
        f"{cg}/memory.events": "oom_kill 0\n",
    })  # fmt: skip
    gov = Governor(MemorySignal(root), GovernorConfig(model=MemoryModel()), 2048, root=root)
    gov.tick()
    text = SizedRequest("chat", 10, 16)
    assert gov.admit(text) is None
    images = SizedRequest("chat", 10 + image_tokens(16), 16, transient_bytes=100 * mib)
    refused = gov.admit(images)
    assert refused is not None
    assert (envelope(refused).status, getattr(refused, "code", None)) == (
        503, "memory_projection"
    )  # fmt: skip
    alone = gov.admit(SizedRequest("chat", 10, 16, transient_bytes=900 * mib))
    assert alone is not None and envelope(alone).status == 400
