"""The terminal UI with Textual's pilot: what is on the screen, and the keys q, p, t, ?.

The app runs headless (``App.run_test``) against a board tree and a loopback
stand-in answering with the recorded bodies; the screen is read back from
Textual's own SVG export (the text a person would see), not from the widgets'
state. The same against the real server is in test_top_live.py.
"""

from __future__ import annotations

import asyncio
import html
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("textual", reason="the top extra (textual) is not installed")

from hosttree import build_tree
from slmguard.top.app import ConfirmTrim, HelpScreen, TopApp
from slmguard.top.client import ServerClient
from slmguard.top.sources import Collector
from toptrees import RK3588_TOP, SERVICE, contract_routes, json_answer, recorded_json, stand_in
from waiting import scaled

SIZE = (170, 58)
WAIT_S = scaled(30.0)


def screen_text(app: TopApp) -> str:
    """The characters on the screen, line by line, from the SVG screenshot.

    The export writes one ``<text>`` per run of same-styled characters at its
    x (columns of ``textLength / len`` pixels) and leaves blank runs out.
    """
    svg = app.export_screenshot()
    runs = [
        (float(m.group(1)), float(m.group(2)), float(m.group(3)), html.unescape(m.group(4)))
        for m in re.finditer(
            r'<text[^>]*x="([\d.]+)" y="([\d.]+)" textLength="([\d.]+)"[^>]*>(.*?)</text>',
            svg,
            re.S,
        )
    ]
    widths = [length / len(text) for _, _, length, text in runs if text.strip()]
    cw = min(widths) if widths else 1.0
    lines: dict[float, dict[int, str]] = {}
    for x, y, _, text in runs:
        row = lines.setdefault(y, {})
        for i, ch in enumerate(text.replace("\xa0", " ").rstrip("\n")):
            row[round(x / cw) + i] = ch
    out = []
    for _, row in sorted(lines.items()):
        width = max(row, default=-1) + 1
        out.append("".join(row.get(i, " ") for i in range(width)).rstrip())
    return "\n".join(out)


async def until(pilot: Any, cond: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while loop.time() < deadline:
        if cond():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def until_shown(pilot: Any, app: TopApp, needles: tuple[str, ...]) -> None:
    """Wait until every needle is on the screen; on timeout name the missing ones.

    A busy machine paints the panes and the footer over several frames: what is
    asserted is the screen once drawn, not the screen at a given moment."""
    try:
        await until(pilot, lambda: all(n in screen_text(app) for n in needles), "the screen")
    except AssertionError:
        text = screen_text(app)
        missing = [n for n in needles if n not in text]
        raise AssertionError(f"not on the screen after {WAIT_S:.0f} s: {missing}\n{text}") from None


def run(app: TopApp, script: Callable[[Any], Awaitable[None]]) -> None:
    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.refreshes >= 1, "the first refresh")
            await pilot.pause(0.2)  # the layout settles on the next frames
            await script(pilot)

    asyncio.run(main())


def _app(url: str, root: Path, *, token: str | None = "adm", interval_s: float = 0.2) -> TopApp:
    collector = Collector(
        ServerClient(url, admin_token=token), root=root, local=True, cgroup_dir=root / SERVICE,
        state_dir=root / "state",
    )  # fmt: skip
    return TopApp(collector, interval_s=interval_s, can_trim=token is not None)


def test_screen_shows_every_pane(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_TOP)
    with stand_in(contract_routes()) as srv:
        app = _app(srv.url, root)

        async def script(pilot: Any) -> None:
            await until_shown(pilot, app, (
                "Memory", "Governor", "Engine", "Board", "Events", "DEGRADE for 12s",
                "shed -> degrade", "THROTTLED", "bigcore0-thermal", "37% 0% 12%",
                "157 / 512", "429 5", "503 15", "version: 0.5.0-dev",
                "s#d#cH.M", "q quit", "p pause", "t trim", "? help",
            ))  # fmt: skip
            # The engine restarts: the events pane says so on a later refresh.
            health = recorded_json("contract-health.json")
            health["engine"].update(restarts=3, pid=7000)
            srv.routes[("GET", "/health")] = json_answer(health)
            await until(pilot, lambda: "engine restarted" in screen_text(app), "the restart")
            assert "restarts 2 -> 3, pid 5151 -> 7000" in screen_text(app)
            saved = app.save_screenshot("screen.svg", path=str(tmp_path))
            assert "Governor" in Path(saved).read_text()

        run(app, script)


def test_pause_help_and_quit(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_TOP)
    with stand_in(contract_routes()) as srv:
        app = _app(srv.url, root, interval_s=0.1)

        async def script(pilot: Any) -> None:
            await pilot.press("p")
            await until(pilot, lambda: "PAUSED" in screen_text(app), "PAUSED")
            await pilot.pause(0.3)  # let an in-flight refresh land
            before = app.refreshes
            requests = srv.counts.get("/health", 0)
            await pilot.pause(0.6)
            assert app.refreshes == before and srv.counts.get("/health", 0) == requests
            await pilot.press("p")
            await until(pilot, lambda: app.refreshes > before, "a refresh after resuming")
            assert "PAUSED" not in screen_text(app)
            await pilot.press("question_mark")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")
            await until_shown(pilot, app, ("POST /api/v1/context/trim",))
            await pilot.press("x")
            await until(pilot, lambda: not isinstance(app.screen, HelpScreen), "help closed")
            await pilot.press("q")

        run(app, script)
        assert app.return_code in (0, None) and not app.is_running


def test_ctrl_c_quits(tmp_path: Path) -> None:
    """In a terminal Ctrl+C is a key (raw mode), not SIGINT: it must quit like q."""
    root = build_tree(tmp_path, RK3588_TOP)
    with stand_in(contract_routes()) as srv:
        app = _app(srv.url, root, interval_s=0.1)

        async def script(pilot: Any) -> None:
            await pilot.press("ctrl+c")
            await until(pilot, lambda: not app.is_running, "the app to quit on Ctrl+C")

        run(app, script)
        assert app.return_code in (0, None)


def test_trim_asks_then_posts_with_the_admin_token(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_TOP)
    with stand_in(contract_routes()) as srv:
        app = _app(srv.url, root)

        async def script(pilot: Any) -> None:
            await pilot.press("t")
            await until(pilot, lambda: isinstance(app.screen, ConfirmTrim), "the question")
            await until(pilot, lambda: "Trim every stored" in screen_text(app), "its text")
            assert "last 512 tokens" in screen_text(app)  # wrapped inside the dialog, not cut
            await pilot.press("n")
            await until(pilot, lambda: not isinstance(app.screen, ConfirmTrim), "cancel")
            await pilot.pause(0.2)
            assert "/api/v1/context/trim" not in srv.counts
            await pilot.press("t")
            await until(pilot, lambda: isinstance(app.screen, ConfirmTrim), "the question again")
            await pilot.press("y")
            await until(pilot, lambda: srv.counts.get("/api/v1/context/trim") == 1, "the POST")
            await until(pilot, lambda: "trimmed contexts to 512" in screen_text(app), "the event")

        run(app, script)
        assert srv.auth["/api/v1/context/trim"] == ["Bearer adm"]


def test_trim_without_a_token_says_so(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_TOP)
    with stand_in(contract_routes()) as srv:
        app = _app(srv.url, root, token=None)

        async def script(pilot: Any) -> None:
            await pilot.press("t")
            await until(pilot, lambda: "needs the admin token" in screen_text(app), "the note")
            assert not isinstance(app.screen, ConfirmTrim)

        run(app, script)
        assert "/api/v1/context/trim" not in srv.counts


def test_unreachable_server_on_screen(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_TOP)
    with stand_in() as gone:
        url = gone.url
    app = _app(url, root)

    async def script(pilot: Any) -> None:
        # The board is still shown.
        await until_shown(pilot, app, ("UNREACHABLE", "server unreachable", "cpu4"))

    run(app, script)
