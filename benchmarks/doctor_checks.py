"""doctor: key-placement table vs systemd-analyze, and the cost of one audit.

1. For every unit key doctor knows, put it in each section where it does not
   belong (one probe unit per section), run ``systemd-analyze verify`` and
   compare the keys systemd reports as unknown (and ignores) with the keys
   ``host.systemd.misplaced_keys`` marks as ignored.
2. Time ``collect()`` + ``run_checks()`` on this host (the live root), as a
   median over repeated runs; a ratio-free absolute number on a shared
   2-core machine, so it is indicative only.

Run: ``.venv/bin/python benchmarks/doctor_checks.py`` (prints a Markdown section).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slmguard import doctor
from slmguard.host import systemd as sd
from slmguard.host.snapshot import collect

RUNS = 20


def probe(section: str, keys: list[str], folder: Path) -> tuple[set[str], set[str]]:
    """(keys systemd ignores, keys doctor marks ignored) with ``keys`` put in ``section``."""
    head = ["[Unit]", "Description=probe"]
    service = ["[Service]", "ExecStart=/bin/true"]
    body = [f"{k}=x" for k in keys]
    if section == "Unit":
        lines = ["[Unit]", *body, *service]
    elif section == "Service":
        lines = [*head, *service, *body]
    else:
        lines = [*head, *service, "[Install]", *body]
    path = folder / f"probe-{section.lower()}.service"
    path.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        ["systemd-analyze", "verify", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return set(sd.unknown_keys(done.stderr)), set(sd.ignored_keys(sd.load_unit(folder, str(path))))


def main() -> int:
    if shutil.which("systemd-analyze") is None:
        print("systemd-analyze not installed", file=sys.stderr)
        return 1
    version = subprocess.run(
        ["systemctl", "--version"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[0]
    known = sorted(sd.UNIT_SECTION_KEYS | sd.SERVICE_SECTION_KEYS | sd.INSTALL_SECTION_KEYS)
    home = {
        **dict.fromkeys(sd.UNIT_SECTION_KEYS, "Unit"),
        **dict.fromkeys(sd.SERVICE_SECTION_KEYS, "Service"),
        **dict.fromkeys(sd.INSTALL_SECTION_KEYS, "Install"),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for section in ("Unit", "Service", "Install"):
            keys = [k for k in known if home[k] != section]
            theirs, ours = probe(section, keys, Path(tmp))
            rows.append(
                f"| [{section}] | {len(keys)} | {len(theirs)} | {len(ours & theirs)} "
                f"| {len(ours - theirs)} | {len(theirs - ours)} |"
            )
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        report = doctor.run_checks(collect(Path("/")), None)
        times.append(time.perf_counter() - start)
    print("## doctor\n")
    print(f"`benchmarks/doctor_checks.py`, {version}.\n")
    print(
        "Key placement: every key doctor knows, put in each section where it does not "
        "belong; `systemd-analyze verify` reports the ones it ignores (`Unknown key`). "
        "The rest are accepted there (e.g. `StartLimitBurst=` in [Service], for "
        "compatibility).\n"
    )
    print("| keys put in | probed | ignored by systemd | flagged by doctor and systemd "
          "| flagged only by doctor | missed by doctor |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(
        f"\nOne audit of this host (`collect` + {len(report.findings)} checks, no plan, "
        f"no unit): median {statistics.median(times) * 1000:.1f} ms over {RUNS} runs "
        f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}); shared 2-core VM, "
        "indicative only."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
