"""A simulated fleet rolled out by the rendered Ansible role: time per board, bytes per board.

Builds the simulated fleet of ``tests/fleetsim.py`` (board roots of three
kinds, a local connection, one real gate server, a counting model mirror),
all boards on plan A, then measures, for plan B (another context size) rolled
out in the default batches of ``rollout.yml`` (1, 5, 20 %, the rest):

- the wall time of the rollout, and per board (rollout time / boards);
- a second run (nothing to change): its wall time per board;
- the bytes each board moved: what the mirror sent it (the model, once, for
  the boards that download it; the others have it on the board), and the
  bytes apply and the role wrote under its root (new or changed files).

The machine runs both the controller and every simulated board's work
(``slmguard apply``, ``doctor``, the gate's completion on the one server), so
the time per board is an upper bound for the controller's share on a real
fleet. Prints a Markdown table; ``--write`` replaces the ``## fleet rollout``
section of ``benchmarks/RESULTS.md``. Needs root and the engine.

    .venv/bin/python benchmarks/fleet_rollout.py --boards 32 --forks 4 --write
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from results_md import write_section  # noqa: E402

from fleetsim import (  # noqa: E402
    build_fleet,
    kind_plans,
    model_copy,
    play,
    snapshot_root,
    start_gate_server,
)
from serveproc import default_model_path  # noqa: E402

SECTION = "## fleet rollout"
MIRROR_KIND = "jetson-orin-nano-8g"


def _written(before: dict[str, tuple[object, ...]], after: dict[str, tuple[object, ...]]) -> int:
    """Bytes of the files that are new or changed from ``before`` to ``after``."""
    total = 0
    for path, now in after.items():
        if now[0] == "file" and before.get(path) != now:
            total += int(now[4])  # type: ignore[call-overload]
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--boards", type=int, default=32)
    ap.add_argument("--forks", type=int, default=4)
    ap.add_argument("--state", default="", help="the machine's state, for the record")
    ap.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (the role writes root-owned files)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = model_copy(default_model_path(), tmp)
        plans_a = kind_plans(model)
        server = start_gate_server(tmp, *plans_a[0])
        try:
            sim = build_fleet(tmp, model, args.boards, MIRROR_KIND, server.url)
            try:
                sim.write_inventory()
                sim.render(tmp / "tree-b", kind_plans(model, n_ctx=1024))
                before = {b.name: snapshot_root(b.root) for b in sim.boards}
                run = play(tmp / "tree-b", sim.inventory, "site.yml", forks=args.forks,
                           timeout_s=7200)  # fmt: skip
                if run.returncode != 0:
                    print("\n".join(run.failures()), file=sys.stderr)
                    return 1
                sent = sim.mirror.sent()
                after = {b.name: snapshot_root(b.root) for b in sim.boards}
                again = play(tmp / "tree-b", sim.inventory, "site.yml", forks=args.forks,
                             timeout_s=7200)  # fmt: skip
                sent_again = sum(sim.mirror.sent().values()) - sum(sent.values())
            finally:
                sim.mirror.close()
        finally:
            server.stop()
        rollout_s = run.seconds
        changed_again = sum(s["changed"] for s in again.stats.values())
        n = len(sim.boards)
        written = [_written(before[b.name], after[b.name]) for b in sim.boards]
        mirrored = [sent.get(b.name, 0) for b in sim.boards if b.kind.board == MIRROR_KIND]
        model_bytes = model.stat().st_size
    per, per_again = rollout_s / n, again.seconds / n
    rows = [
        ("boards (kinds in turn: RK3588, Orin Nano, Pi 5)", str(n)),
        ("forks", str(args.forks)),
        ("rollout, batches 1, 5, 20 %, the rest", f"{rollout_s:.0f} s, {per:.1f} s a board"),
        (
            "second run (changes nothing)",
            f"{again.seconds:.0f} s, {per_again:.1f} s a board, changed={changed_again}",
        ),
        (
            "model downloaded by each mirror board (first run)",
            f"{min(mirrored)} bytes (the model is {model_bytes})",
        ),
        ("model downloaded on the second run", f"{sent_again} bytes"),
        (
            "written under each root by apply and the role",
            f"{min(written)}-{max(written)} bytes, staged model included",
        ),
    ]
    stamp = time.strftime("%Y-%m-%d")
    state = f" Machine: {args.state}." if args.state else ""
    lines = [
        SECTION,
        "",
        f"`benchmarks/fleet_rollout.py --boards {n} --forks {args.forks}` ({stamp}; this "
        f"2-core x86 host runs the controller and every simulated board's work).{state}",
        "",
        "| measure | value |",
        "|---|---|",
        *(f"| {a} | {b} |" for a, b in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
