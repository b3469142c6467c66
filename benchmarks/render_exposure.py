"""Exposure and verify results of the rendered units, per board, against the seed's unit.

For each board profile: ``slmguard plan --preset PRESET --board BOARD --json``,
render the deployment, then run ``systemd-analyze verify`` (counting the lines it
prints) and ``systemd-analyze security --offline=yes`` on each service unit. The
source document's unit is scored the same way. Prints a Markdown table; with
``--write`` it replaces the ``## render`` section of ``benchmarks/RESULTS.md``.

    .venv/bin/python benchmarks/render_exposure.py --write
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from results_md import write_section

from slmguard.deploy.render import RenderOptions, render_files
from slmguard.host.systemd import parse_exposure
from slmguard.plan.planfile import plan_from_dict

BOARDS = ("rk3588-4g", "rk3588-8g", "jetson-orin-nano-8g", "rpi5-4g", "generic")
PRESET = "qwen2.5-1.5b-instruct"
UNITS = ("slmguard.service", "slmguard-watch.service", "slmguard-crashdump.service")
SECTION = "## render"

# The source document's unit (SEED_EN.md section 3), kept once with the tests' fixtures.
SEED_UNIT = Path(__file__).parents[1] / "tests" / "fixtures" / "units" / "slm_inference.service"


def _analyze(*args: str, cwd: Path) -> str:
    proc = subprocess.run(
        ["systemd-analyze", *args], capture_output=True, text=True, cwd=cwd, check=False
    )
    return proc.stdout + proc.stderr


def _exposure(unit: Path) -> str:
    out = _analyze("security", "--offline=yes", unit.name, cwd=unit.parent)
    return str(parse_exposure(out) or "?")


def _verify_lines(units: list[Path]) -> int:
    out = _analyze("verify", *[u.name for u in units], cwd=units[0].parent)
    return len([line for line in out.splitlines() if line.strip()])


def _plan_json(board: str) -> str:
    exe = Path(sys.executable).with_name("slmguard")
    proc = subprocess.run(
        [str(exe), "plan", "--preset", PRESET, "--board", board, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = ap.parse_args()
    if shutil.which("systemd-analyze") is None:
        print("systemd-analyze not found (apt-get install systemd)", file=sys.stderr)
        return 1
    version = _analyze("--version", cwd=Path.cwd()).splitlines()[0]
    rows = []
    exe = str(Path(sys.executable).with_name("slmguard"))

    with tempfile.TemporaryDirectory() as tmp:
        for board in BOARDS:
            plan = plan_from_dict(json.loads(_plan_json(board)))
            unit_dir = Path(tmp) / board
            unit_dir.mkdir()
            for f in render_files(plan, RenderOptions(exec_path=exe)):
                name = f.path.rsplit("/", 1)[1]
                if f.content is not None and f.path.startswith("/etc/systemd/system/"):
                    (unit_dir / name).write_bytes(f.content)
            units = sorted(p for p in unit_dir.iterdir() if p.suffix in (".service", ".slice"))
            scores = [_exposure(unit_dir / u) for u in UNITS]
            rows.append((board, _verify_lines(units), *scores))
        seed = Path(tmp) / "slm_inference.service"
        # A program that exists here, so verify counts only the unit's own problems.
        seed.write_text(
            re.sub(r"^ExecStart=\S+", "ExecStart=/bin/true", SEED_UNIT.read_text(), flags=re.M)
        )
        rows.append(("source document's unit", _verify_lines([seed]), _exposure(seed), "-", "-"))

    lines = [
        SECTION,
        "",
        f"`benchmarks/render_exposure.py`, {version}, plans for `{PRESET}`.",
        "`verify lines`: lines `systemd-analyze verify` printed for the rendered units and",
        "slices (0 = no warning). Exposure: `systemd-analyze security --offline=yes`",
        "(0 = locked down, 10 = fully exposed).",
        "",
        "| board | verify lines | slmguard.service | slmguard-watch.service "
        "| slmguard-crashdump.service |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {' | '.join(str(c) for c in row)} |" for row in rows]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write:
        write_section(SECTION, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
