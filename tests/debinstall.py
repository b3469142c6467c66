"""The Debian packages installed as the README says, in a fresh Debian 12 root (issue 38).

    python tests/debinstall.py [--dist dist] [--cache DIR] [--no-record]   (make deb-install-test)

The README's .deb install is :data:`INSTALL`, typed in the directory that holds the
packages; a ``dpkg -i`` that stopped on missing dependencies is mended with
:data:`RECOVERY`. ``tests/test_deb_install_docs.py`` (in ``make test``) checks that the
READMEs and docs/install.md say exactly these commands; this script runs them for real,
as root, in a Debian 12 amd64 root bootstrapped with mmdebstrap from Debian's archive
(minbase, sudo and python3, as a board's image has; its apt lists emptied, as a fresh
image's are; cached under ``--cache``), with the network, the amd64 packages of ``--dist``
(``make dist-amd64 dist-model``: slmguard, slmguard-deps, slmguard-engine-avx2, the model's)
copied into ``/root/debs``. The one liberty: apt's prompt is answered yes by its config,
as the reader types Y.

1. as documented: each command of :data:`INSTALL` exits 0, then every package is
   installed and configured (``ii``) and the CLI answers;
2. the frictions, in a second fresh root: the install without ``apt-get update`` fails
   naming :data:`NOT_INSTALLABLE` (the README's Troubleshooting entry), slmguard's package
   alone :data:`DEPS_MISSING`; :data:`DPKG` stops
   with :data:`UNCONFIGURED` and leaves slmguard ``iU``; :data:`RECOVERY` then installs
   what was missing and configures it (``ii``).

Each step's time and outcome go to benchmarks/RESULTS.md (its own section; --no-record:
not). Exit 0 when every step passed. Needs root, mmdebstrap and the network to Debian.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

#: The README's install of the packages, in the directory holding them (both languages
#: and docs/install.md say exactly these; tests/test_deb_install_docs.py checks it).
INSTALL = ("sudo apt-get update && sudo apt install ./slmguard*.deb", "slmguard engine")
#: What mends a ``dpkg -i`` that stopped on missing dependencies.
RECOVERY = "sudo apt-get update && sudo apt --fix-broken install"
#: The install the docs warn about (no dependency resolution).
DPKG = "sudo dpkg -i ./slmguard*.deb"
#: What apt says without fresh lists, and dpkg without the dependencies (as quoted).
NOT_INSTALLABLE = "Depends: python3-venv but it is not installable"
#: What apt says given slmguard's package without slmguard-deps (its version elided).
DEPS_MISSING = "Depends: slmguard-deps (= 1+...) but it is not installable"
UNCONFIGURED = "dependency problems - leaving unconfigured"

SUITE = "bookworm"
BOOTSTRAP = (
    "--variant=minbase", "--include=sudo,python3", "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright", "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
)  # fmt: skip
#: The packages of --dist the root gets (the newest of each, amd64 and the model's).
PATTERNS = (
    "slmguard_*_amd64.deb", "slmguard-deps_*_amd64.deb", "slmguard-engine-avx2_*_amd64.deb",
    "slmguard-model-*_all.deb",
)  # fmt: skip
DEBS = "/root/debs"
SECTION = "## The Debian packages installed as the README says (make deb-install-test)"


class StepFailed(Exception):
    pass


def log(message: str) -> None:
    print(f"deb-install-test: {message}", file=sys.stderr, flush=True)


@dataclass
class Step:
    name: str
    command: str
    seconds: float
    outcome: str


def packages(dist: Path) -> list[Path]:
    """The newest package of each :data:`PATTERNS` in ``dist``."""
    found = []
    for pattern in PATTERNS:
        matches = sorted(dist.glob(pattern), key=lambda p: p.stat().st_mtime)
        if not matches:
            raise StepFailed(f"no {pattern} in {dist}: make dist-amd64 dist-model")
        found.append(matches[-1])
    return found


def image(cache: Path, mirror: str) -> Path:
    """The cached fresh root: bootstrapped when missing, its apt lists emptied."""
    key = hashlib.sha256(f"{SUITE} {BOOTSTRAP} {mirror}".encode()).hexdigest()[:12]
    out = cache / f"root-{key}"
    if (out / "usr/bin/sudo").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    log(f"bootstrapping Debian {SUITE} amd64 in {out} (mmdebstrap, a few minutes)")
    subprocess.run(["mmdebstrap", *BOOTSTRAP, SUITE, str(tmp), mirror], check=True,
                   stdout=sys.stderr)  # fmt: skip
    for stale in (
        *(tmp / "var/lib/apt/lists").glob("*"),
        *(tmp / "var/cache/apt").glob("*.bin"),
        *(tmp / "var/cache/apt/archives").glob("*.deb"),
    ):
        if stale.is_file():
            stale.unlink()
    tmp.rename(out)
    return out


class Root:
    """A copy of the fresh root; commands run in it by chroot as root, in a private
    mount and PID namespace (proc, sys, dev bound in), with the host's network."""

    def __init__(self, path: Path, debs: list[Path]) -> None:
        self.path = path
        shutil.copyfile("/etc/resolv.conf", path / "etc/resolv.conf")
        # The reader answers apt's "Do you want to continue? [Y/n]" with Y.
        (path / "etc/apt/apt.conf.d/90reader-says-yes").write_text('APT::Get::Assume-Yes "true";\n')
        (path / DEBS.lstrip("/")).mkdir(parents=True)
        for deb in debs:
            shutil.copyfile(deb, path / DEBS.lstrip("/") / deb.name)

    def run(self, command: str, timeout: float = 3600) -> tuple[int, str]:
        wrapper = (
            "set -e; mount --make-rprivate /; "
            'mount -t proc proc "$1/proc"; mount --rbind /sys "$1/sys"; '
            'mount --rbind /dev "$1/dev"; '
            'exec chroot "$1" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 '
            'HOME=/root TERM=dumb /bin/bash -c "cd $3 && $2"'
        )
        done = subprocess.run(
            ["unshare", "--mount", "--pid", "--fork", "sh", "-c", wrapper, "sh",
             str(self.path), command, DEBS],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
            check=False,
        )  # fmt: skip
        return done.returncode, done.stdout

    def status(self, package: str) -> str:
        """dpkg's two-letter state of ``package`` (``ii``, ``iU``...), "" if unknown."""
        rc, out = self.run(f"dpkg-query -W -f '${{db:Status-Abbrev}}' {package} 2>/dev/null")
        return out.strip() if rc == 0 else ""


def _step(steps: list[Step], root: Root, name: str, command: str, *, ok: bool = True) -> str:
    """Run ``command``; it must exit 0 (``ok``) or not; the step recorded either way."""
    log(f"{name}: {command}")
    began = time.monotonic()
    rc, out = root.run(command)
    passed = (rc == 0) == ok
    steps.append(Step(name, command, time.monotonic() - began, f"exit {rc}" + ("" if passed
                      else " (FAILED)")))  # fmt: skip
    if not passed:
        tail = "\n  ".join(out.strip().splitlines()[-15:])
        raise StepFailed(f"{command!r} exited {rc}, expected {'0' if ok else 'not 0'}:\n  {tail}")
    return out


def _names(debs: list[Path]) -> list[str]:
    return [d.name.split("_", 1)[0] for d in debs]


def _all_installed(root: Root, debs: list[Path], steps: list[Step], name: str) -> None:
    states = {n: root.status(n) for n in _names(debs)}
    ok = all(s == "ii" for s in states.values())
    steps.append(Step(name, "dpkg-query", 0.0, " ".join(f"{n} {s}" for n, s in states.items())))
    if not ok:
        raise StepFailed(f"not every package is installed and configured: {states}")


def as_documented(root: Root, debs: list[Path], steps: list[Step]) -> None:
    for i, command in enumerate(INSTALL, 1):
        _step(steps, root, f"as documented {i}", command)
    _all_installed(root, debs, steps, "as documented: every package ii")
    _step(steps, root, "as documented: the CLI", "slmguard --version")


def frictions(root: Root, debs: list[Path], steps: list[Step]) -> None:
    out = _step(steps, root, "no apt-get update", INSTALL[0].split("&& ", 1)[1], ok=False)
    if NOT_INSTALLABLE not in out:
        raise StepFailed(f"apt without lists did not say {NOT_INSTALLABLE!r}:\n{out[-2000:]}")
    steps[-1].outcome += f", said `{NOT_INSTALLABLE}`"
    alone = "sudo apt-get update && sudo apt install ./slmguard_*.deb"
    out = _step(steps, root, "slmguard's package alone", alone, ok=False)
    if not re.search(re.escape(DEPS_MISSING).replace(r"\.\.\.", r"[^)]+"), out):
        raise StepFailed(f"apt did not say {DEPS_MISSING!r}:\n{out[-2000:]}")
    steps[-1].outcome += f", said `{DEPS_MISSING}`"
    root.run("rm -rf /var/lib/apt/lists/*")  # a fresh image's lists again: dpkg -i first
    out = _step(steps, root, "dpkg -i alone", DPKG, ok=False)
    state = root.status("slmguard")
    if UNCONFIGURED not in out or state != "iU":
        raise StepFailed(f"dpkg -i did not stop with {UNCONFIGURED!r} ({state}):\n{out[-2000:]}")
    steps[-1].outcome += f", said `{UNCONFIGURED}`, slmguard {state}"
    _step(steps, root, "the recovery", RECOVERY)
    _all_installed(root, debs, steps, "after the recovery: every package ii")


def record(steps: list[Step], debs: list[Path], passed: bool, seconds: float) -> None:
    import results_md

    load = os.getloadavg()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION, "",
        f"`make deb-install-test` ({'passed' if passed else 'FAILED'}, {seconds:.0f} s), {when}; "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} (1/5/15 min) at the end. A fresh Debian {SUITE} root (mmdebstrap "
        "minbase with sudo and python3, apt lists empty), the packages "
        + ", ".join(f"`{d.name}`" for d in debs) + f" in `{DEBS}`.",
        "", "| step | command | time | outcome |", "|---|---|---|---|",
    ]  # fmt: skip
    for s in steps:
        lines.append(f"| {s.name} | `{s.command}` | {s.seconds:.0f} s | {s.outcome} |")
    results_md.write_section(SECTION, "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    from systest.base import host_mirror

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--dist", type=Path, default=ROOT / "dist")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache/slmguard/debinstall")
    p.add_argument("--mirror", default=None, help="default: the host's apt mirror")
    p.add_argument("--no-record", action="store_true", help="do not write RESULTS.md")
    args = p.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("mmdebstrap") is None:
        log("needs root and mmdebstrap (apt-get install mmdebstrap)")
        return 2
    steps: list[Step] = []
    began = time.monotonic()
    passed = False
    debs: list[Path] = []
    try:
        debs = packages(args.dist)
        fresh = image(args.cache, args.mirror or host_mirror())
        for scenario in (as_documented, frictions):
            with tempfile.TemporaryDirectory(dir=args.cache, prefix="run-") as tmp:
                path = Path(tmp) / "root"
                subprocess.run(["cp", "-a", str(fresh), str(path)], check=True)
                scenario(Root(path, debs), debs, steps)
        passed = True
    except StepFailed as err:
        log(f"FAILED: {err}")
    seconds = time.monotonic() - began
    log(f"{'passed' if passed else 'FAILED'} in {seconds:.0f} s")
    for s in steps:
        log(f"  {s.name}: {s.seconds:.0f} s, {s.outcome}")
    if not args.no_record and steps:
        record(steps, debs, passed, seconds)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
