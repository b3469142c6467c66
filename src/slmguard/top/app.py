"""The terminal UI of ``slmguard top``: Textual widgets drawing the view model.

Owns the screen layout, the keys and the refresh loop; the only module that
imports ``textual`` (and, through it, ``rich``), and only ``slmguard top``
without ``--once`` imports it. It judges nothing: every word, number and
flag comes from :func:`slmguard.top.view.build_screen`; flags become colours
here (``warn`` yellow, ``crit`` red, ``ok`` green, ``dim`` grey).

Layout (the five panes of the view model)::

    title line: server, state, model, time (PAUSED while paused)
    Memory   | Governor
             | Engine
    Board    |
    Events (newest first)
    key line: q quit (Ctrl+C too)  p pause  t trim  ? help

Refreshes run :meth:`Collector.poll` in a worker thread every
``--interval`` seconds (one at a time: a slow server delays the next
refresh, it never stacks them), and a pane is redrawn only when its content
changed. ``t`` asks for confirmation, then calls the trim API with the admin
token; without one it says so instead.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

from rich.console import Group, RenderableType
from rich.table import Table as RichTable
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Label, Static

from slmguard.top.snapshot import TopSnapshot
from slmguard.top.sources import Collector
from slmguard.top.text import bar_text
from slmguard.top.view import (
    CRIT,
    DIM,
    OK,
    WARN,
    Bar,
    Cell,
    Field,
    Line,
    Note,
    Pane,
    Screen,
    Table,
    build_screen,
)

STYLES = {OK: "green", WARN: "bold yellow", CRIT: "bold red", DIM: "grey50"}
BORDERS = {WARN: "yellow", CRIT: "red"}

HELP = """\
slmguard top: the live view of a served model.

  q   quit (also Ctrl+C)
  p   pause / resume the refresh
  t   trim stored conversations to the last {keep_recent} tokens
      (POST /api/v1/context/trim with the admin token; asks first)
  ?   this help

Memory bar: # the working set; s d c the governor's shed, degrade and
critical watermarks; H MemoryHigh; M MemoryMax.
Colours: yellow warning, red critical, grey not known or not readable.
"n/a": the server or the kernel did not say.

Press any key to close."""


def _text(cell: Cell) -> Text:
    return Text(cell.text, style=STYLES.get(cell.flag or "", ""))


def _bar(bar: Bar, width: int) -> Text:
    out = Text(bar.label.ljust(width) + "  ", style="bold")
    drawn = bar_text(bar, 40)
    for ch in drawn:
        if ch == "#":
            out.append(ch, style=STYLES.get(bar.flag or "", "green"))
        elif ch in "sdcHM":
            out.append(ch, style="bold magenta")
        else:
            out.append(ch, style="grey50")
    out.append("\n" + " " * (width + 2) + bar.text, style=STYLES.get(bar.flag or "", ""))
    return out


def _table(table: Table) -> RichTable:
    t = RichTable(
        *table.headers,
        title=table.title,
        title_justify="left",
        box=None,
        padding=(0, 1),
        show_edge=False,
        header_style="bold",
        expand=False,
    )
    for row in table.rows:
        t.add_row(*(_text(c) for c in row))
    return t


def _line(line: Line, width: int) -> RenderableType:
    if isinstance(line, Field):
        out = Text(line.label.ljust(width) + "  ", style="bold")
        out.append_text(_text(line.value))
        return out
    if isinstance(line, Bar):
        return _bar(line, width)
    if isinstance(line, Table):
        return _table(line)
    assert isinstance(line, Note)
    return Text(line.text, style=STYLES.get(line.flag or "", ""))


def render_pane(pane: Pane) -> RenderableType:
    labels = [ln.label for ln in pane.lines if isinstance(ln, Field | Bar)]
    width = max((len(x) for x in labels), default=0)
    return Group(*(_line(ln, width) for ln in pane.lines))


class PaneWidget(Static):
    """One pane: redrawn only when the view model's pane changed."""

    DEFAULT_CSS = """
    PaneWidget { border: round $primary; padding: 0 1; height: auto; }
    """

    def __init__(self, key: str, title: str) -> None:
        super().__init__(id=key)
        self.border_title = title
        self.pane: Pane | None = None

    def show(self, pane: Pane) -> None:
        if pane == self.pane:
            return
        self.pane = pane
        self.border_title = pane.title + ({WARN: " (!)", CRIT: " (!!)"}.get(pane.flag or "", ""))
        self.styles.border = ("round", BORDERS.get(pane.flag or "", "steelblue"))
        self.update(render_pane(pane))


class ConfirmTrim(ModalScreen[bool]):
    DEFAULT_CSS = """
    ConfirmTrim { align: center middle; }
    #dialog { width: 64; height: auto; border: thick $warning; padding: 1 2; background: $surface; }
    #dialog Label { width: 100%; }
    #buttons { height: auto; margin-top: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "yes"),
        Binding("n,escape", "answer(False)", "no"),
    ]

    def __init__(self, keep_recent: int, url: str) -> None:
        super().__init__()
        self.keep_recent = keep_recent
        self.url = url

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(
                f"Trim every stored conversation on {self.url} to its last "
                f"{self.keep_recent} tokens and drop the engine's prompt cache?\n\n"
                "y: trim    n / Esc: cancel"
            )
            with Horizontal(id="buttons"):
                yield Button("Trim", id="yes", variant="warning")
                yield Button("Cancel", id="no")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    #help { width: 76; height: auto; border: thick $primary; padding: 1 2; background: $surface; }
    """

    def __init__(self, keep_recent: int) -> None:
        super().__init__()
        self.keep_recent = keep_recent

    def compose(self) -> ComposeResult:
        yield Static(HELP.format(keep_recent=self.keep_recent), id="help")

    def on_key(self) -> None:
        self.dismiss(None)


class TopApp(App[int]):
    """``slmguard top``. ``collector`` does the reading; this draws and takes keys."""

    TITLE = "slmguard top"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #title { height: 1; padding: 0 1; background: $panel; }
    #columns { height: auto; }
    #left, #right { width: 1fr; height: auto; }
    #events { height: auto; min-height: 6; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        # textual binds Ctrl+C to a "press Ctrl+Q" notice; a top quits on it.
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
        Binding("p", "pause", "pause"),
        Binding("t", "trim", "trim"),
        Binding("question_mark", "help", "help", key_display="?"),
    ]

    def __init__(
        self,
        collector: Collector,
        *,
        interval_s: float = 1.0,
        keep_recent: int = 512,
        can_trim: bool = False,
        events_limit: int = 12,
    ) -> None:
        super().__init__()
        self.collector = collector
        self.interval_s = interval_s
        self.keep_recent = keep_recent
        self.can_trim = can_trim
        self.events_limit = events_limit
        self.paused = False
        self.snapshot: TopSnapshot | None = None
        self.screen_model: Screen | None = None
        self.refreshes = 0
        self._busy = False

    def compose(self) -> ComposeResult:
        yield Static("slmguard top: connecting...", id="title")
        with Horizontal(id="columns"):
            with Vertical(id="left"):
                yield PaneWidget("memory", "Memory")
                yield PaneWidget("board", "Board")
            with Vertical(id="right"):
                yield PaneWidget("governor", "Governor")
                yield PaneWidget("engine", "Engine")
        yield PaneWidget("events", "Events")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_now()
        self.set_interval(self.interval_s, self.refresh_now)

    # ------------------------------------------------------------ refresh

    def refresh_now(self) -> None:
        if self.paused or self._busy:
            return
        self._busy = True
        self._poll()

    @work(thread=True, exclusive=True, group="poll")
    def _poll(self) -> None:
        try:
            snap = self.collector.poll()
        except Exception as err:  # a bug must show, not kill the screen
            self._deliver(self._failed, err)
            return
        self._deliver(self.show, snap)

    def _deliver(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Hand a result to the UI thread; after ``q`` there is nobody to hand it to."""
        if not self.is_running:
            return
        # The loop may close while this refresh is in flight.
        with contextlib.suppress(RuntimeError):
            self.call_from_thread(fn, *args, **kwargs)

    def _failed(self, err: Exception) -> None:
        self._busy = False
        self.notify(f"refresh failed: {type(err).__name__}: {err}", severity="error")

    def show(self, snap: TopSnapshot) -> None:
        self._busy = False
        self.snapshot = snap
        screen = build_screen(snap, self.events_limit)
        self.screen_model = screen
        self.refreshes += 1
        self._title(screen)
        for pane in screen.panes:
            self.query_one(f"#{pane.key}", PaneWidget).show(pane)

    def _title(self, screen: Screen) -> None:
        text = _text(screen.title)
        if self.paused:
            text.append("  PAUSED (p resumes)", style="bold reverse")
        self.query_one("#title", Static).update(text)

    # ------------------------------------------------------------ keys

    def action_pause(self) -> None:
        self.paused = not self.paused
        if self.screen_model is not None:
            self._title(self.screen_model)
        if not self.paused:
            self.refresh_now()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.keep_recent))

    def action_trim(self) -> None:
        if not self.can_trim:
            message = (
                "t needs the admin token: give --admin-token-file (or run under the unit "
                "with the admin-token credential)"
            )
            self.collector.note("warning", "trim", message)  # shown on the next refresh
            self.notify(message, severity="warning")
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self._trim()

        self.push_screen(ConfirmTrim(self.keep_recent, self.collector.client.url), answered)

    @work(thread=True, group="trim")
    def _trim(self) -> None:
        result = self.collector.trim(self.keep_recent)
        problem = result.problem()
        message = "trim done" if problem is None else f"trim failed: {problem}"
        self._deliver(self.notify, message, severity="information" if problem is None else "error")


def run(collector: Collector, **kwargs: Any) -> int:
    """Run the UI until ``q`` or Ctrl+C; returns the exit code (0)."""
    TopApp(collector, **kwargs).run()
    return 0
