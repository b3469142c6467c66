"""The power cut during a package upgrade in the VM (issue 40), recorded run by run.

Each run is ``make systest-faults-deb``'s ``python -m systest`` (as root; the packages
``make dist-amd64 dist-previous-amd64 dist-model`` built first): the image holds the
previous slmguard, the guest applies and serves plan A, then ``power-cut-upgrade``
(systest/guest/scenario.py) upgrades to this tree's with ``apt install``, cuts the power
inside slmguard's configure, checks the boot and runs ``dpkg --configure -a``.

``--runs N`` runs it N times in a row; ``--add-last`` instead records the run the make
target just did (its ``<cache>/run/share/results.jsonl``; ``--started`` and ``--load``
say when it began and the load then). Each run's results, console log and its start,
end and load are kept in ``<cache>/upgrade-cut-runs/``; the section, ``## systest power
cut during an upgrade`` of benchmarks/RESULTS.md, is written from every kept run.

Usage (root): ``.venv/bin/python benchmarks/systest_upgrade_cut.py [--runs 2 | --add-last
--started ISO --load 'L1 L5 L15'] [--no-write] [python -m systest's own arguments]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from results_md import write_section  # noqa: E402
from systest_neighbour import cache_dir, step_record  # noqa: E402

SECTION = "## systest power cut during an upgrade"
STEPS = "guest-facts,plan,apply,service-start,power-cut-upgrade"  # the Makefile's
STEP = "power-cut-upgrade"


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _status(text: object) -> str | None:
    """dpkg's ``Status|Version`` without the bar (a table's column separator)."""
    return str(text).replace("|", " ") if text else None


def run_row(record: Mapping[str, Any] | None, meta: Mapping[str, Any]) -> dict[str, Any]:
    """One run's row: when, the load, and what the step saw at the cut and after the boot."""
    row: dict[str, Any] = {"status": "missing", "reason": "the step reported nothing", **meta}
    if record is None:
        return row
    d = record.get("details") or {}
    cut, booted, repair = d.get("at_cut") or {}, d.get("booted") or {}, d.get("repair") or {}
    serving = d.get("serving") or {}
    row.update(
        status=record.get("status"),
        step_s=record.get("duration_s"),
        cut_status=_status(cut.get("status")),
        cut_opener=str(cut.get("opener") or "")[:120],
        booted_status=_status(booted.get("status")),
        booted_cli=booted.get("cli"),
        recover=(booted.get("recover") or {}).get("Result"),
        chat_after_boot=serving.get("chat"),
        engine_ctx=serving.get("engine_ctx"),
        session=len((d.get("session") or {}).get("roles") or []),
        repair_exit=repair.get("exit"),
        repair_status=_status(repair.get("status")),
        repair_s=repair.get("took_s"),
        repair_cli=repair.get("cli"),
        chat_after_repair=(repair.get("serving") or {}).get("chat"),
        removed=d.get("messages_removed"),
        reason=str(record.get("reason") or "")[:600],
    )
    return row


def section(rows: Sequence[Mapping[str, Any]]) -> str:
    passed = sum(r.get("status") == "pass" for r in rows)
    out = [
        SECTION,
        "",
        f"`make systest-faults-deb` (TCG guest, this host shared with other VMs and builds; "
        f"each run a fresh image boot). **{passed} of {len(rows)} runs passed.** Where dpkg "
        "was when the power was cut (`dpkg-query` Status|Version, the process the gate held), "
        "what the boot found, then `dpkg --configure -a`.",
        "",
        "| run | started | load at start / end | exit | step | step s | cut at | after the "
        "boot: dpkg | recover | version | chat | engine ctx | session msgs | repair: exit, "
        "dpkg, s | version | chat | msgs deleted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        out.append(
            f"| {i} | {r.get('started')} | {r.get('load_start')} / {r.get('load_end')} | "
            f"{r.get('exit')} | {r.get('status')} | {r.get('step_s')} | "
            f"`{r.get('cut_status')}` | `{r.get('booted_status')}` | {r.get('recover')} | "
            f"{r.get('booted_cli')} | {r.get('chat_after_boot')} | {r.get('engine_ctx')} | "
            f"{r.get('session')} | {r.get('repair_exit')}, `{r.get('repair_status')}`, "
            f"{r.get('repair_s')} | {r.get('repair_cli')} | {r.get('chat_after_repair')} | "
            f"{r.get('removed')} |"
        )
    out.append("")
    out += [f"- run {i}: held `{r.get('cut_opener')}`; {r.get('reason')}"
            for i, r in enumerate(rows, 1)]  # fmt: skip
    return "\n".join(out) + "\n"


def keep_run(cache: Path, keep: Path, meta: dict[str, Any]) -> None:
    """Copy the last run's results and console log into ``keep`` with ``meta``."""
    n = len(list(keep.glob("run*-meta.json"))) + 1
    results = cache / "run" / "share" / "results.jsonl"
    lines = results.read_text().splitlines() if results.exists() else []
    (keep / f"run{n}-results.jsonl").write_text("\n".join(lines) + "\n")
    console = cache / "run" / "console.log"
    if console.exists():
        shutil.copyfile(console, keep / f"run{n}-console.log")
    (keep / f"run{n}-meta.json").write_text(json.dumps(meta))


def kept_rows(keep: Path) -> list[dict[str, Any]]:
    rows = []
    for meta_file in sorted(keep.glob("run*-meta.json"), key=lambda p: int(p.name[3:-10])):
        results = meta_file.with_name(meta_file.name.replace("-meta.json", "-results.jsonl"))
        lines = results.read_text().splitlines() if results.exists() else []
        results_only = [ln for ln in lines if '"status"' in ln]  # not the power-cut event
        rows.append(run_row(step_record(results_only, STEP), json.loads(meta_file.read_text())))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=0)
    p.add_argument("--add-last", action="store_true", help="record the make target's last run")
    p.add_argument("--started", default="", help="with --add-last: when it started (UTC)")
    p.add_argument("--load", default="", help="with --add-last: the load average then")
    p.add_argument("--exit", type=int, default=None, help="with --add-last: its exit status")
    p.add_argument("--note", default="", help="with --add-last: why the step has no record")
    p.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    args, systest_args = p.parse_known_args(argv)
    if not 0 <= args.runs <= 10:
        p.error("--runs is 0-10")
    meta: dict[str, Any]
    cache = cache_dir(systest_args)
    keep = cache / "upgrade-cut-runs"
    keep.mkdir(parents=True, exist_ok=True)
    if args.add_last:
        meta = {
            "started": args.started,
            "load_start": args.load,
            "load_end": _load(),
            "exit": args.exit,
            **({"reason": args.note} if args.note else {}),
        }
        keep_run(cache, keep, meta)
    for _ in range(args.runs):
        cmd = [sys.executable, "-m", "systest", "--dist", "dist", "--steps", STEPS,
               "--budget-min", "120", *systest_args]  # fmt: skip
        meta = {"started": _now(), "load_start": _load()}
        t0 = time.monotonic()
        done = subprocess.run(cmd, cwd=REPO, check=False)
        meta.update(exit=done.returncode, load_end=_load(), wall_s=round(time.monotonic() - t0))
        keep_run(cache, keep, meta)
    rows = kept_rows(keep)
    text = section(rows)
    print(text, flush=True)
    if not args.no_write:
        write_section(SECTION, text)
    return 0 if rows and rows[-1].get("status") == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
