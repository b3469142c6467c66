"""Plain text and JSON for ``slmguard top --once``: no terminal library needed.

Owns drawing a :class:`~slmguard.top.view.Screen` as lines of text (the
memory bar as characters, tables with aligned columns, a flag word where
colour would be) and the JSON form of a snapshot. Also :func:`bar_text`,
the one drawing of a bar, which the terminal UI colours but does not redraw
differently. Stdlib only: this is what runs for scripts, bug reports and on
a board where ``textual`` is not installed.
"""

from __future__ import annotations

import json

from slmguard.top.snapshot import TopSnapshot, snapshot_to_dict
from slmguard.top.view import CRIT, WARN, Bar, Cell, Field, Line, Note, Screen, Table

FLAG_WORDS = {WARN: "[!]", CRIT: "[!!]"}
BAR_WIDTH = 40


def bar_text(bar: Bar, width: int = BAR_WIDTH) -> str:
    """``[#########.....s..d.c.H...M]``: the fill, then each mark at its place."""
    cells = ["."] * width
    if bar.fill is not None:
        for i in range(min(width, round(bar.fill * width))):
            cells[i] = "#"
    for mark in bar.marks:
        pos = min(width - 1, max(0, round(mark.at * width) - 1))
        cells[pos] = mark.label
    body = "".join(cells) if bar.fill is not None else "?" * width
    return f"[{body}]"


def _cell(c: Cell) -> str:
    word = FLAG_WORDS.get(c.flag or "")
    return f"{c.text} {word}" if word and c.text else c.text


def _table(t: Table, indent: str) -> list[str]:
    rows = [list(t.headers)] + [[_cell(c) for c in r] for r in t.rows]
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(t.headers))]
    out = [f"{indent}{t.title}:"] if t.title else []
    for r in rows:
        out.append(indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)).rstrip())
    return out


def _line(line: Line, label_width: int) -> list[str]:
    if isinstance(line, Field):
        return [f"  {line.label.ljust(label_width)}  {_cell(line.value)}".rstrip()]
    if isinstance(line, Table):
        return _table(line, "  ")
    if isinstance(line, Bar):
        word = FLAG_WORDS.get(line.flag or "", "")
        pad = " " * (label_width + 4)
        return [
            f"  {line.label.ljust(label_width)}  {bar_text(line)}",
            f"{pad}{line.text} {word}".rstrip(),
        ]
    assert isinstance(line, Note)
    return [f"  {_cell(Cell(line.text, line.flag))}"]


def render_screen(screen: Screen) -> str:
    out = [_cell(screen.title), ""]
    for pane in screen.panes:
        flag = FLAG_WORDS.get(pane.flag or "", "")
        out.append(f"{pane.title} {flag}".rstrip())
        labels = [ln.label for ln in pane.lines if isinstance(ln, Field | Bar)]
        width = max((len(x) for x in labels), default=0)
        for line in pane.lines:
            out.extend(_line(line, width))
        out.append("")
    out.append(
        "marks: s shed, d degrade, c critical (governor watermarks), H MemoryHigh, "
        "M MemoryMax; [!] warning, [!!] critical"
    )
    return "\n".join(out) + "\n"


def render_json(snap: TopSnapshot) -> str:
    return json.dumps(snapshot_to_dict(snap), indent=1, sort_keys=False) + "\n"
