"""The innocent neighbour in the VM, ``--runs`` times beside CPU hogs (issue 39).

Each run is one ``python -m systest`` (as root) with the steps guest-facts, plan and
``neighbour-lives`` (systest/guest/scenario.py; it applies its plan and starts the
service itself): a real service declared with ``plan --neighbour``, put in the
business slice by ``apply`` (``MemoryMin=``), holds its memory while a hog in the LLM
service's cgroup grows until the governor is critical; the kernel and systemd must
show the neighbour untouched and the LLM shedding, then serving again. ``--hogs``
busy-loop CPU hogs (2 by default, ``benchmarks/governor.py``'s) run beside the VM for
the whole run.

Recorded per run: the systest's exit code and the step's verdict, when the first 503
came, when the governor reached critical, when a 200 came again after the hog left,
the ladder's rungs, the neighbour's lowest memory.current and the hog's peak. Written
to benchmarks/RESULTS.md, section ``## systest neighbour``; the console logs are kept
in ``<cache>/neighbour-runs/``.

Usage (root): ``.venv/bin/python benchmarks/systest_neighbour.py [--runs 5] [--hogs 2]
[--no-write] [python -m systest's own arguments: --engine-dir DIR --cache DIR ...]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from governor import Hogs, load_average  # noqa: E402
from results_md import write_section  # noqa: E402

SECTION = "## systest neighbour"
STEPS = "guest-facts,plan,neighbour-lives"
STEP = "neighbour-lives"
MIB = 1 << 20


def step_record(lines: Iterable[str], name: str = STEP) -> dict[str, Any] | None:
    """The result line of step ``name`` in a results.jsonl (None: the guest never got there)."""
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("step") == name:
            return obj
    return None


def _first_503(responses: Sequence[Sequence[Any]]) -> float | None:
    return next((float(r[0]) for r in responses if r[1] == 503 and r[2]), None)


def run_row(record: Mapping[str, Any] | None, exit_code: int, wall_s: float) -> dict[str, Any]:
    """One run's row from the step's record (its details as the scenario wrote them)."""
    if record is None:
        return {"exit": exit_code, "status": "missing", "wall_s": round(wall_s),
                "reason": "the step reported nothing (see the console log)"}  # fmt: skip
    details = record.get("details") or {}
    load = details.get("load") or {}
    ladder = details.get("ladder") or {}
    responses = details.get("responses") or []
    statuses: dict[str, int] = {}
    for r in responses:
        key = str(r[1]) + (f" {r[3]}" if r[1] not in (200, None) and r[3] else "")
        statuses[key] = statuses.get(key, 0) + 1
    low = details.get("neighbour_min_current")
    return {
        "exit": exit_code,
        "status": record.get("status"),
        "wall_s": round(wall_s),
        "step_s": record.get("duration_s"),
        "first_503_s": _first_503(responses),
        "critical_s": load.get("critical_after_s"),
        "hog_gone_s": load.get("hog_gone_s"),
        "recovered_s": load.get("recovered_after_s"),
        "highest": ladder.get("highest"),
        "actions": sorted(set(ladder.get("actions") or [])),
        "neighbour_min_mib": round(low / MIB, 1) if isinstance(low, int) else None,
        "hog_peak_mib": round(int((load.get("peak") or {}).get("hog_bytes") or 0) / MIB),
        "statuses": statuses,
        "reason": str(record.get("reason") or "")[:300],
    }


def section(rows: Sequence[Mapping[str, Any]], state: str, command: str) -> str:
    """The RESULTS.md section: one line per run, then each run's verdict."""
    passed = sum(r.get("status") == "pass" for r in rows)
    out = [
        SECTION,
        "",
        f"`{command}` ({len(rows)} runs, each a fresh boot of the TCG guest beside two CPU "
        f"busy loops; host load {state}). Step `neighbour-lives` (systest/guest/scenario.py): a "
        "192 MiB neighbour (`plan --neighbour innocent=192M,unit=...,min`, MemoryMin= in "
        "the business slice) beside the LLM service while a hog in the service's cgroup "
        "grows 8 MiB every 0.5 s until the governor is critical, then leaves. Times are "
        f"seconds from the load's start. **{passed} of {len(rows)} passed.**",
        "",
        "| run | exit | step | first 503 | critical | hog gone | 200 again | highest | "
        "rungs | neighbour min MiB | hog MiB | answers | step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        answers = ", ".join(f"{k}: {v}" for k, v in sorted((r.get("statuses") or {}).items()))
        out.append(
            f"| {i} | {r.get('exit')} | {r.get('status')} | {r.get('first_503_s')} | "
            f"{r.get('critical_s')} | {r.get('hog_gone_s')} | {r.get('recovered_s')} | "
            f"{r.get('highest')} | {', '.join(r.get('actions') or [])} | "
            f"{r.get('neighbour_min_mib')} | {r.get('hog_peak_mib')} | {answers} | "
            f"{r.get('step_s')} |"
        )
    out.append("")
    out += [f"- run {i}: {r.get('reason')}" for i, r in enumerate(rows, 1)]
    return "\n".join(out) + "\n"


def cache_dir(systest_args: Sequence[str]) -> Path:
    """The ``--cache`` the systest runs use (its default otherwise)."""
    for i, a in enumerate(systest_args):
        if a == "--cache" and i + 1 < len(systest_args):
            return Path(systest_args[i + 1])
        if a.startswith("--cache="):
            return Path(a.split("=", 1)[1])
    return Path.home() / ".cache" / "slmguard" / "systest"


def one_run(i: int, systest_args: Sequence[str], hogs: int, keep: Path) -> dict[str, Any]:
    cache = cache_dir(systest_args)
    cmd = [sys.executable, "-m", "systest", "--steps", STEPS, *systest_args]
    print(f"systest-neighbour: run {i}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    with Hogs(hogs):
        done = subprocess.run(cmd, cwd=REPO, check=False)
    wall = time.monotonic() - t0
    results = cache / "run" / "share" / "results.jsonl"
    lines = results.read_text().splitlines() if results.exists() else []
    console = cache / "run" / "console.log"
    if console.exists():
        shutil.copyfile(console, keep / f"run{i}-console.log")
    (keep / f"run{i}-results.jsonl").write_text("\n".join(lines) + "\n")
    row = run_row(step_record(lines), done.returncode, wall)
    print(f"systest-neighbour: run {i}: {json.dumps(row)}", flush=True)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--hogs", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    args, systest_args = p.parse_known_args(argv)
    if not 1 <= args.runs <= 20 or not 0 <= args.hogs <= 8:
        p.error("--runs is 1-20, --hogs 0-8")
    keep = cache_dir(systest_args) / "neighbour-runs"
    keep.mkdir(parents=True, exist_ok=True)
    state = f"{load_average()} at the start"
    rows: list[dict[str, Any]] = []
    for i in range(1, args.runs + 1):  # the section after each run: a stop loses none
        rows.append(one_run(i, systest_args, args.hogs, keep))
        text = section(rows, state, f"make systest-neighbour ({i} of {args.runs} runs done)")
        print(text, flush=True)
        if not args.no_write:
            write_section(SECTION, text)
    return 0 if all(r.get("status") == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
