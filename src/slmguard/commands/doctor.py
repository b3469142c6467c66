"""``slmguard doctor``: audit a host before deployment; print findings, exit by severity.

Exit status: 0 every check passed, 1 at least one warning, 2 at least one
failure, 3 doctor could not run (root, plan, planner or unit argument unusable).
``unknown`` findings do not change the status unless ``--strict``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

ORDER = 20
COULD_NOT_RUN = 3

_COLOURS = {"pass": "32", "warn": "33", "fail": "31", "unknown": "36"}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor",
        help="audit the host: swap, zram, overcommit, cgroups, CMA, the unit, the board's tuning",
        description="Check a board before deploying: swap and zram off (and not coming back "
        "at boot), sysctl as planned, cgroup v2 memory controller, CMA for the NPU, memlock, "
        "free memory, the systemd unit's limits, sections, user, affinity and listen "
        "address, and the board's tuning (CPU governor and clocks of the service's cores, "
        "the DDR controller's and the NPU/GPU devfreq, the Jetson power mode, the Pi "
        "firmware's throttle flags, thermal zones and their trip points). Each finding has "
        "evidence (value and file) and a fix.\n\n"
        "Exit status: 0 all pass, 1 warnings, 2 failures, 3 could not run.\n\n"
        "Example:\n"
        "  slmguard doctor\n"
        "  slmguard doctor --plan plan.json --unit slmguard.service\n"
        "  slmguard doctor --json --unit /etc/systemd/system/slm_inference.service\n"
        "  slmguard doctor --root /mnt/board-image --plan plan.json\n"
        "  slmguard doctor --plan /etc/slmguard/plan.json --verify-model   # reads the model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plan", type=Path, help="plan file from `slmguard plan --json`")
    p.add_argument("--model", type=Path, help="plan on the fly for this GGUF (needs the planner)")
    p.add_argument("--preset", help="plan on the fly for this model preset (needs the planner)")
    p.add_argument("--board", help="board for an on-the-fly plan (needs the planner)")
    p.add_argument("--root", type=Path, default=Path("/"), help="host root to audit (default /)")
    p.add_argument(
        "--unit",
        help="systemd unit name (searched under the root, with drop-ins) or unit file "
        "(default: slmguard.service when installed)",
    )
    p.add_argument("--boot-file", help="boot file holding cma= (default: the first found)")
    p.add_argument("--strict", action="store_true", help="count unknown findings as warnings")
    p.add_argument(
        "--verify-model",
        action="store_true",
        help="also hash the plan's model file, every byte (model.sha256: fails when it is not "
        "the plan's any more, e.g. a bit flipped on the card; apply trusts its stamp), and "
        "each of a board plan's other models (model.sha256.models[I]) and its vision "
        "projector (model.sha256.projector), one finding each naming its file. Slow: "
        "about a minute per GB on an SD card; run it on demand or from a timer",
    )
    p.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour the table (auto: on a terminal, unless NO_COLOR is set)",
    )
    p.set_defaults(run=run)


def _plan(args: argparse.Namespace) -> Any:
    from slmguard.plan.planfile import load_plan

    if args.plan is not None:
        if args.model or args.preset or args.board:
            from slmguard.errors import UsageError

            raise UsageError("give either --plan or --model/--preset/--board, not both")
        return load_plan(args.plan)
    if not (args.model or args.preset or args.board):
        return None
    from slmguard.plan.inputs import plan_for

    plan, inputs = plan_for(
        args.root,
        model=args.model,
        preset=args.preset,
        board=args.board or "auto",
        digest=False,  # the audit needs the numbers, not the file's hash
    )
    for note in inputs.notes:
        print(f"slmguard doctor: {note}", file=sys.stderr)
    return plan


def _fail(message: str, hint: str | None = None) -> int:
    print(f"slmguard doctor: error: {message}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)
    return COULD_NOT_RUN


def run(args: argparse.Namespace) -> int:
    from slmguard.doctor import run_checks
    from slmguard.doctor.model import planned_files
    from slmguard.errors import SlmguardError
    from slmguard.host.snapshot import Unread, collect

    root: Path = args.root
    if not root.is_dir():
        return _fail(f"--root {root}: not a directory")
    try:
        plan = _plan(args)
    except SlmguardError as err:
        return _fail(err.message, err.hint)
    model_file: str | None = None
    others: tuple[str, ...] = ()
    if args.verify_model:
        if plan is None or plan.model.path is None:
            return _fail("--verify-model needs a plan that names its model file (--plan FILE)")
        model_file = plan.model.path
        others = tuple(path for _, path, _, _ in planned_files(plan))
    neighbour_units = tuple(n.unit for n in plan.neighbours if n.unit) if plan else ()
    snapshot = collect(
        root,
        unit=args.unit,
        boot_file=args.boot_file,
        model_file=model_file,
        neighbour_units=neighbour_units,
        other_files=others,
    )
    if isinstance(snapshot.meminfo, Unread):
        return _fail(
            f"cannot read {snapshot.meminfo}: {root} does not look like a Linux root",
            "point --root at a directory holding proc/ and sys/",
        )
    if args.unit is not None and isinstance(snapshot.unit, Unread):
        return _fail(f"--unit {args.unit}: {snapshot.unit.reason} ({snapshot.unit.path})")
    report = run_checks(snapshot, plan)
    code = report.exit_code(strict=args.strict)
    if args.json:
        out = {
            "root": report.root,
            "euid": report.euid,
            "exit_code": code,
            "counts": {s: report.count(s) for s in ("pass", "warn", "fail", "unknown")},
            "checks": [asdict(f) for f in report.findings],
            "not_seen": list(report.not_seen),
        }
        print(json.dumps(out, indent=2))
    else:
        colour = args.color == "always" or (
            args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        )
        _print_table(report, code, colour, sys.stdout, verbose=args.verbose > 0)
    return code


def _print_table(report: Any, code: int, colour: bool, out: TextIO, verbose: bool) -> None:
    def tag(sev: str) -> str:
        text = f"{sev.upper():<7}"
        return f"\x1b[{_COLOURS[sev]}m{text}\x1b[0m" if colour else text

    width = max(len(f.id) for f in report.findings)
    for f in report.findings:
        print(f"{tag(f.severity)} {f.id:<{width}}  {f.summary}", file=out)
        if f.severity != "pass" or verbose:
            for e in f.evidence:
                print(f"{'':8} {'':<{width}}  · {e.label}: {e.value}  [{e.source}]", file=out)
            if f.fix and f.severity != "pass":
                print(f"{'':8} {'':<{width}}  fix: {f.fix}", file=out)
    counts = ", ".join(f"{report.count(s)} {s}" for s in ("pass", "warn", "fail", "unknown"))
    print(f"\n{counts} (exit {code})", file=out)
    if report.not_seen:
        print("could not see:", file=out)
        for line in report.not_seen:
            print(f"  - {line}", file=out)
