"""``python -m systest``: build or reuse the guest image, boot it, run the scenario.

The only module of the systest that prints or exits. Each host stage and each
guest step becomes one line of the final report, with its time; the exit code
is 0 only when nothing failed (and, with ``--strict``, nothing was
not-available). Where the host cannot build or boot a VM it says so: with
``CI=true`` that is a failure (exit 1), elsewhere a skip (exit 0).

Example:
  python -m systest                 # from the repository root, as root
  python -m systest --strict        # CI: a missing verb fails too
  python -m systest --steps service-start,worker-kill
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from systest import accel as accel_mod
from systest import base as base_mod
from systest import cachekey, fleet, hostdeps, image, packages, report, vm, wheels

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
BUDGET_S = 60 * 60  # the Ansible step needs the last 25-35 min on CI's slow TCG guest


def project_version() -> str:
    """slmguard's version (the package this tree builds)."""
    from slmguard import __version__

    return __version__


def install_source(
    run: Run, args: argparse.Namespace, work: Path
) -> tuple[image.Install, dict[str, bytes | Path], dict[str, object]] | None:
    """How slmguard gets into the image, the share's files and config for it (this
    tree's package for the package-upgrade step); None when it cannot (reported)."""
    t0 = time.monotonic()
    if args.dist is not None:
        try:
            current, previous = run.host(
                "packages",
                lambda: packages.find_packages(args.dist, project_version()),
                lambda pair: f"image: {pair[1].path.name}, upgrade to {pair[0].path.name}",
            )
        except packages.PackageError as err:
            run.host_fail("packages", err.message, t0)
            return None
        return (
            image.DebPackage(previous.path, previous.sha256, companions=previous.companions),
            {current.path.name: current.path},
            {"package": current.path.name},
        )
    engine_dir = args.engine_dir or wheels.default_engine_dir(Path.home())
    if engine_dir is None or not wheels.engine_binary(engine_dir).is_file():
        run.host_fail(
            "wheels",
            "no llama-server build in ~/.cache/slmguard/engine/: run "
            "`make engine` first (or pass --engine-dir DIR)",
            t0,
        )
        return None
    engine = wheels.engine_binary(engine_dir)
    try:
        built = run.host(
            "wheels",
            lambda: wheels.build_wheels(REPO, work / "wheels"),
            lambda ws: f"{len(ws)} wheels for cp311 x86_64, engine {engine}",
        )
    except wheels.WheelError as err:
        run.host_fail("wheels", err.message, t0)
        return None
    project = next(w for w in built if w.name.startswith("slmguard-"))
    return image.Wheels(built, engine, project.name.split("-")[1]), {}, {}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m systest",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    home = Path.home()
    p.add_argument("--strict", action="store_true", help="not-available steps fail too (CI)")
    p.add_argument(
        "--cache",
        type=Path,
        default=home / ".cache" / "slmguard" / "systest",
        help="image cache directory (default: %(default)s)",
    )
    p.add_argument(
        "--engine-dir",
        type=Path,
        default=None,
        help="the Makefile's llama-server build, with bin/llama-server (default: newest in "
        "~/.cache/slmguard/engine/)",
    )
    p.add_argument(
        "--dist",
        type=Path,
        default=None,
        help="install slmguard from Debian packages instead of wheels: where `make "
        "dist-amd64 dist-previous-amd64` put them (the image gets the older one in "
        "previous/, the package-upgrade step this tree's; `make systest-deb`)",
    )
    p.add_argument(
        "--accel",
        choices=["auto", "kvm", "tcg"],
        default="auto",
        help="qemu accelerator (default: KVM only where real KVM works)",
    )
    p.add_argument(
        "--budget-min",
        type=float,
        default=BUDGET_S / 60,
        help="whole run's time budget in minutes; the boot gets what is left "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--steps", default="", help="comma-separated scenario steps to run (default: all)"
    )
    p.add_argument(
        "--plan-file",
        type=Path,
        default=None,
        help="a plan for the later steps when `slmguard plan` is not available (the plan "
        "step still reports not-available); e.g. systest/dev-plan.json",
    )
    p.add_argument("--rebuild", action="store_true", help="ignore the cached image")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


class Run:
    """Collects host-step results with their times and prints each as it ends."""

    def __init__(self) -> None:
        self.results: list[report.StepResult] = []
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def add(self, result: report.StepResult) -> None:
        self.results.append(result)
        print(
            f"systest: [{result.where}] {result.step}: {result.status} "
            f"({result.duration_s:.1f}s) {result.reason}".rstrip(),
            flush=True,
        )

    def host(self, step: str, fn: Callable[[], T], describe: Callable[[T], str]) -> T:
        t0 = time.monotonic()
        value = fn()
        self.add(
            report.StepResult(
                step, report.PASS, describe(value), time.monotonic() - t0, where="host"
            )
        )
        return value

    def host_fail(self, step: str, reason: str, t0: float) -> None:
        self.add(report.StepResult(step, report.FAIL, reason, time.monotonic() - t0, where="host"))


def finish(run: Run, strict: bool) -> int:
    print("\nsystest report:")
    print(report.format_table(run.results))
    code = report.exit_code(run.results, strict)
    print(
        f"systest: total {run.elapsed():.1f}s, exit {code}"
        + (" (strict: not-available counts as failure)" if strict else "")
    )
    return code


def unfit(reason: str) -> int:
    if os.environ.get("CI", "").lower() == "true":
        print(
            f"systest: FAILED: cannot run the VM system test here: {reason} "
            "(CI=true: this is a failure, not a skip)",
            file=sys.stderr,
        )
        return 1
    print(f"systest: SKIPPED: cannot run the VM system test here: {reason}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    budget_s = args.budget_min * 60
    if os.geteuid() != 0:
        return unfit("needs root (mmdebstrap, chroot, mount)")
    run = Run()
    cache: Path = args.cache
    work = cache / "run"
    logs = work / "logs"
    shutil.rmtree(work, ignore_errors=True)
    logs.mkdir(parents=True)

    t0 = time.monotonic()
    try:
        run.host(
            "host-tools",
            hostdeps.ensure_host_tools,
            lambda pk: f"installed {', '.join(pk)}" if pk else "already installed",
        )
    except hostdeps.HostUnfit as err:
        return unfit(err.reason)
    acc = accel_mod.choose_accel(force=args.accel)
    print(f"systest: accelerator {acc.name} ({acc.reason})", flush=True)

    what = install_source(run, args, work)
    if what is None:
        return finish(run, args.strict)
    installed, extra, config = what

    cache.mkdir(parents=True, exist_ok=True)
    base_key = cachekey.base_key(base_mod.base_inputs())
    key = cachekey.image_key(base_key, image.recipe(), installed.digests())
    if args.rebuild:
        shutil.rmtree(cache / key, ignore_errors=True)
    t0 = time.monotonic()
    try:
        base_cached = (cache / f"base-{base_key}" / "rootfs" / "usr" / "bin" / "python3").exists()
        base = run.host(
            "image-base",
            lambda: base_mod.build_base(cache, base_key, base_mod.host_mirror(), logs),
            lambda b: f"{'cached' if base_cached else 'bootstrapped'} {b}",
        )
        t0 = time.monotonic()
        img = run.host(
            "image",
            lambda: image.build_image(cache, base, key, installed, logs),
            lambda i: f"{'cached' if i.cached else 'built'} {i.directory}",
        )
    except base_mod.ImageError as err:
        run.host_fail("image", err.message, t0)
        return finish(run, args.strict)
    pruned = image.prune(cache)
    if pruned:
        print(f"systest: pruned old cache entries: {', '.join(pruned)}", flush=True)

    left = budget_s - run.elapsed() - 15
    config.update(steps=[s for s in args.steps.split(",") if s], deadline_s=left - 60)
    if args.plan_file:
        extra["plan.json"] = args.plan_file.read_bytes()
        config["plan_file"] = "plan.json"
    ssh_port = vm.free_loopback_port()
    driver: fleet.Fleet | None = None
    try:
        driver = fleet.Fleet(
            work / "share", work, ssh_port, time.monotonic() + left - 120, on_step=run.add
        )
        config["ssh_pubkey"] = driver.pubkey
    except fleet.FleetError as err:
        print(f"systest: no Ansible step: {err.reason}", flush=True)
    t0 = time.monotonic()
    outcome = vm.boot(
        img,
        acc,
        work,
        config,
        extra,
        timeout_s=left,
        on_step=run.add,
        ssh_port=ssh_port,
        on_event=driver.handle if driver is not None else None,
    )
    res = outcome.results
    boot_s = outcome.first_result_s if outcome.first_result_s is not None else outcome.elapsed_s
    if outcome.first_result_s is None:
        run.add(
            report.StepResult(
                "boot",
                report.FAIL,
                f"no result from the guest (see {outcome.console})",
                boot_s,
                where="host",
            )
        )
    else:
        run.add(
            report.StepResult(
                "boot",
                report.PASS,
                f"{acc.name}: boot to the scenario's first line",
                boot_s,
                where="host",
            )
        )
    for missing in report.missing_steps(res, "the guest stopped or timed out first"):
        run.add(missing)
    for bad in res.bad_lines:
        print(f"systest: unusable result line: {bad}", file=sys.stderr)
    end_s = outcome.elapsed_s - boot_s
    if outcome.timed_out:
        run.add(
            report.StepResult(
                "poweroff",
                report.FAIL,
                f"killed qemu at the {left:.0f}s timeout",
                end_s,
                where="host",
            )
        )
    elif not res.finished:
        run.add(
            report.StepResult(
                "poweroff",
                report.FAIL,
                f"qemu exited {outcome.qemu_rc} before the scenario ended "
                f"(results via {outcome.source}; see {outcome.console})",
                end_s,
                where="host",
            )
        )
    else:
        run.add(
            report.StepResult(
                "poweroff",
                report.PASS,
                f"scenario ended, qemu exited {outcome.qemu_rc} (results via {outcome.source})",
                end_s,
                where="host",
            )
        )
    print(f"systest: console log {outcome.console}")
    return finish(run, args.strict)


if __name__ == "__main__":
    sys.exit(main())
