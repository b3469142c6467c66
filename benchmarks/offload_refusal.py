"""How fast ``serve`` refuses an offload plan on a CPU-only llama-server (issue 25's goal:
under a second, exit 78, the backend named).

One plan for a GPU board (``slmguard plan --board rpi5-8g --gpu vulkan``: Vulkan,
every layer offloaded), then ``slmguard serve --plan`` with a CPU build of
llama-server (the one ``make`` builds, or ``--llama-server``), ``--runs`` times.
Each run is timed end to end: from just before ``subprocess.Popen`` of the console
script to the process's exit (``time.perf_counter`` around ``Popen`` and ``wait``):
Python's start, the imports, the settings, ``llama-server --version`` and
``llama-server --list-devices`` (what ``serve.llamaserver.check_backend`` asks), the
error line. Each run must exit 78 with one ``slmguard: error:`` line naming the vulkan
backend, else the script fails. For where the time goes, the two engine calls are
then timed alone the same way.

Usage (prints only, unless --write-results):
    .venv/bin/python benchmarks/offload_refusal.py
    .venv/bin/python benchmarks/offload_refusal.py --runs 5 --write-results
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import write_section

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
SECTION = "## offload refusal on a CPU-only engine"
SLMGUARD = Path(sys.executable).parent / "slmguard"
BOARD = "rpi5-8g"


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Seconds from the spawn to the exit, and what the process said."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    out, err = proc.communicate(timeout=120)
    elapsed = time.perf_counter() - t0
    return elapsed, subprocess.CompletedProcess(argv, proc.returncode, out, err)


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a refusal (fails the benchmark if it is not one)."""
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("slmguard: error:")]
    if result.returncode != 78 or len(errors) != 1 or "vulkan backend" not in errors[0]:
        raise SystemExit(f"not the refusal (exit {result.returncode}):\n{result.stderr}")
    return errors[0]


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--llama-server", default=None, help="a CPU build (default: make's)")
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded model)")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    from slmguard import paths
    from slmguard.default_model import ensure_default_model
    from slmguard.engines import engine_version
    from slmguard.serve.llamaserver import find_llama_server

    binary = find_llama_server(args.llama_server)
    model = Path(args.model) if args.model else ensure_default_model(paths.model_dir())
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLMGUARD_", "GGML_VK"))}  # fmt: skip
    load_before = load()
    with tempfile.TemporaryDirectory(prefix="slmguard-refusal-") as tmp:
        plan = Path(tmp) / "plan.json"
        subprocess.run(
            [str(SLMGUARD), "plan", "--model", str(model), "--board", BOARD, "--gpu", "vulkan",
             "--out", str(plan)],
            check=True, capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        serve = [str(SLMGUARD), "serve", "--plan", str(plan), "--llama-server", str(binary),
                 "--port", "1"]  # fmt: skip
        runs: list[float] = []
        line = ""
        for i in range(args.runs):
            state = ["--state-dir", str(Path(tmp) / f"state-{i}")]
            elapsed, result = timed(serve + state, env)
            line = error_line(result)
            runs.append(elapsed)
        version_s = [timed([str(binary), "--version"], env)[0] for _ in range(args.runs)]
        devices_s = [timed([str(binary), "--list-devices"], env)[0] for _ in range(args.runs)]
    load_after = load()
    now = datetime.datetime.now(datetime.timezone.utc)
    ms = ", ".join(f"{s * 1000:.0f}" for s in runs)
    text = "\n".join([
        SECTION,
        "",
        f"`benchmarks/offload_refusal.py --runs {args.runs}`, {now:%Y-%m-%d %H:%M} UTC, "
        f"{platform.machine()}, {os.cpu_count()} CPUs shared with other work (load average "
        f"{load_before} before, {load_after} after; 1/5/15 min). Plan: `slmguard plan --board "
        f"{BOARD} --gpu vulkan` ({model.name}); engine: {binary.name} "
        f"`{engine_version(binary)}`, a CPU build. Each run: `slmguard serve --plan` from "
        "spawn to exit (Python's start and imports, the settings, the engine's `--version` "
        "and `--list-devices`, the error line). Goal: under 1 s, exit 78, the backend named.",
        "",
        "| | runs (ms) | median ms | max ms |",
        "|---|---|---:|---:|",
        f"| `serve --plan` refused, exit 78 | {ms} | {statistics.median(runs) * 1000:.0f} | "
        f"{max(runs) * 1000:.0f} |",
        f"| `llama-server --version` alone (one step of each run) | "
        f"{', '.join(f'{s * 1000:.0f}' for s in version_s)} | "
        f"{statistics.median(version_s) * 1000:.0f} | {max(version_s) * 1000:.0f} |",
        f"| `llama-server --list-devices` alone (another) | "
        f"{', '.join(f'{s * 1000:.0f}' for s in devices_s)} | "
        f"{statistics.median(devices_s) * 1000:.0f} | {max(devices_s) * 1000:.0f} |",
        "",
        f"Every run exited 78 with one error line: `{line.replace(str(binary), '<binary>')}`",
    ]) + "\n"  # fmt: skip
    print(text)
    if args.write_results:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
