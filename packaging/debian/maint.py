"""The slmguard package's maintainer logic, run by the system's python3 (stdlib only).

Installed as /usr/lib/slmguard/maint.py; ``postinst`` and ``prerm`` call it
(``python3 /usr/lib/slmguard/maint.py postinst configure OLD_VERSION``), and
each slmguard-engine-PROFILE's postinst (``maint.py restart PACKAGE``: its
binary changed, so the applied units restart, as step 3 below says).
``postrm`` cannot (the file is gone by then) and stays a shell script.

postinst configure:
  1. refuses a python3 outside the versions whose wheels the package ships
     (the Depends says the same; this names the versions when dpkg is forced);
  2. builds a new virtual environment from the shipped wheels (its own and
     slmguard-deps', ``pip install --no-index``: no network) when the stamp of
     ``/opt/slmguard`` differs from this package's, that is when slmguard,
     slmguard-deps or the interpreter changed, or when the venv is missing or
     unfinished. It is built beside the one in use, in
     ``/opt/slmguard-venvs/<stamp hash>-<n>/``, its stamp written last, and
     ``/opt/slmguard`` (a relative symbolic link to it) is switched to it by one
     rename: a power cut or a kill during the build leaves the old venv in use
     and the services start on it at boot; ``dpkg --configure -a`` builds
     again. The venv replaced is kept (a service not yet restarted runs from
     it), older ones and unfinished builds are removed after the switch. A
     ``/opt/slmguard`` directory (the layout before) is exchanged for the link
     atomically (``renameat2(RENAME_EXCHANGE)``);
  3. when the stamp changed and systemd runs, restarts each unit apply installed
     that runs slmguard (``UNITS``) and is enabled or active, unless
     ``policy-rc.d`` forbids it (exit 101) or the installer sets
     ``SLMGUARD_DEFER_RESTART=1`` (the Ansible role: it restarts once, after apply,
     when anything changed); the package itself enables nothing.

prerm remove: stops those units (their program goes away with the package) and
says that apply's deployment stays until ``slmguard rollback``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

VENV = Path("/opt/slmguard")  # a link to the venv in use, in venvs_of(VENV)
LIB = Path("/usr/lib/slmguard")
# slmguard-deps' wheels and fingerprint (a package of its own: it moves when the lock does).
DEPS = Path("/usr/lib/slmguard-deps")
STAMP_NAME = ".slmguard-package"
# The units `slmguard apply` installs that run slmguard (deploy/units.py).
UNITS = ("slmguard.service", "slmguard-watch.service")
MANIFEST = Path("/var/lib/slmguard-apply/manifest.json")
SYSTEMD_RUNNING = Path("/run/systemd/system")
# invoke-rc.d's policy hook (chroots, image builds): exit 101 forbids the action.
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
POLICY_DENIED = 101
# Set by an installer that restarts the units itself (the Ansible role's apt-get).
DEFER_RESTART = "SLMGUARD_DEFER_RESTART"

#: renameat2(2): swap two paths in one step (Linux 3.15, glibc 2.28; <linux/fs.h>).
RENAME_EXCHANGE = 2
AT_FDCWD = -100

# configure, and the calls that put the package back configured after a failed
# upgrade or removal: each makes sure the venv matches the files installed now.
CONFIGURE = ("configure", "abort-upgrade", "abort-remove", "abort-deconfigure")

Runner = Callable[[Sequence[str]], int]


def run(argv: Sequence[str]) -> int:
    """Run a command, its output on ours; its exit status."""
    return subprocess.run(list(argv), check=False).returncode


def supported_pythons(lib: Path) -> list[str]:
    """The ``X.Y`` versions the shipped wheels cover (``lib/pythons``, one a line)."""
    return (lib / "pythons").read_text(encoding="ascii").split()


def python_version(python: str) -> str:
    done = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def stamp_for(lib: Path, version: str, deps: Path | None = None) -> str:
    """What the venv is built from: the packages' fingerprints and the interpreter."""
    fingerprint = (lib / "fingerprint").read_text(encoding="ascii").strip()
    if deps is not None and (deps / "fingerprint").is_file():
        fingerprint += " " + (deps / "fingerprint").read_text(encoding="ascii").strip()
    return f"{fingerprint} python{version}\n"


def current_stamp(venv: Path) -> str | None:
    try:
        return (venv / STAMP_NAME).read_text(encoding="ascii")
    except OSError:
        return None


def venvs_of(venv: Path) -> Path:
    """Where the venvs that ``venv`` links to are built: ``/opt/slmguard-venvs``."""
    return venv.with_name(venv.name + "-venvs")


def new_venv_dir(venvs: Path, stamp: str) -> Path:
    """A directory for a venv of ``stamp`` that no earlier build used."""
    key = hashlib.sha256(stamp.encode("ascii")).hexdigest()[:12]
    n = 1
    while (venvs / f"{key}-{n}").is_symlink() or (venvs / f"{key}-{n}").exists():
        n += 1
    return venvs / f"{key}-{n}"


def build_venv(
    venv: Path, lib: Path, python: str, stamp: str, runner: Runner = run, deps: Path | None = None
) -> Path:
    """A new venv with slmguard and its pinned dependencies, offline, beside the one
    ``venv`` links to (not touched); its directory. The stamp is its last file."""
    target = new_venv_dir(venvs_of(venv), stamp)
    target.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [python, "-m", "venv", str(target)],
        [
            str(target / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index",
            "--no-cache-dir", "--disable-pip-version-check", "--only-binary=:all:",
            "--find-links", str(lib / "wheels"),
            *(["--find-links", str(deps / "wheels")] if deps is not None else []),
            "--requirement", str(lib / "requirements.lock"),
        ],
    ]  # fmt: skip
    for argv in steps:
        if runner(argv) != 0:
            raise SystemExit(f"slmguard: `{' '.join(argv)}` failed; see above")
    (target / STAMP_NAME).write_text(stamp, encoding="ascii")
    return target


def exchange(a: Path, b: Path) -> None:
    """Swap the paths ``a`` and ``b`` in one step (renameat2's RENAME_EXCHANGE); where the
    kernel or the C library cannot, ``b`` is moved to ``a`` through a third name (an
    instant in which neither exists)."""
    libc = ctypes.CDLL(None, use_errno=True)
    swap = getattr(libc, "renameat2", None)
    if swap is not None:
        swap.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]  # fmt: skip
        if swap(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
            return
    aside = a.with_name(a.name + ".old")
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


def switch_venv(venv: Path, target: Path) -> Path | None:
    """Make ``venv`` a link to ``target`` by one rename, once ``target``'s files are on
    the disk; the directory ``venv`` was before (None: nothing)."""
    os.sync()  # pip wrote thousands of files: on the disk before anything points at them
    before: Path | None = None
    if venv.is_symlink():
        before = venv.parent / os.readlink(venv)
    link = venv.with_name(f".{venv.name}.switch-{os.getpid()}")
    if link.is_symlink() or link.is_file():
        link.unlink()
    link.symlink_to(os.path.relpath(target, venv.parent))
    if venv.is_dir() and not venv.is_symlink():  # the layout before: the venv in place
        exchange(link, venv)
        before = link  # the old directory, under the link's name now
    else:
        os.replace(link, venv)
    fd = os.open(venv.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the switch itself on the disk before the services restart on it
    finally:
        os.close(fd)
    return before


def prune_venvs(venv: Path, built: Path, replaced: Path | None) -> None:
    """Remove every venv but ``built`` and ``replaced`` (a service whose restart is
    deferred runs from it), with the unfinished builds a cut or a failure left; a
    ``replaced`` of the layout before (the directory ``switch_venv`` moved aside) too."""
    venvs = venvs_of(venv)
    keep = {built.name}
    if replaced is not None and replaced.parent == venvs:
        keep.add(replaced.name)
    elif replaced is not None and replaced.is_dir() and not replaced.is_symlink():
        shutil.rmtree(replaced, ignore_errors=True)
    for old in venvs.iterdir():
        if old.name in keep:
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def applied_units(runner: Runner = run, systemd: Path = SYSTEMD_RUNNING) -> list[str]:
    """The units of ``UNITS`` that are enabled or active (none when systemd is not PID 1)."""
    if not systemd.is_dir():
        return []
    quiet = ["systemctl", "--quiet"]
    return [
        u
        for u in UNITS
        if runner([*quiet, "is-enabled", u]) == 0 or runner([*quiet, "is-active", u]) == 0
    ]


def restart_units(
    why: str,
    *,
    runner: Runner = run,
    systemd: Path = SYSTEMD_RUNNING,
    policy: Path = POLICY_RC_D,
    environ: Mapping[str, str] = os.environ,
) -> list[str]:
    """Restart the applied units (not under ``DEFER_RESTART=1`` or a denying policy-rc.d);
    the units restarted."""
    restarted = []
    for unit in applied_units(runner, systemd):
        if environ.get(DEFER_RESTART) == "1":
            print(f"slmguard: not restarting {unit}: {DEFER_RESTART}=1 (the installer restarts it)")
            continue
        if policy.exists() and runner([str(policy), unit, "restart"]) == POLICY_DENIED:
            print(f"slmguard: not restarting {unit}: {policy} forbids it")
            continue
        print(f"slmguard: restarting {unit} ({why})")
        if runner(["systemctl", "restart", unit]) != 0:
            print(f"slmguard: warning: {unit} did not restart; see `journalctl -u {unit}`")
        restarted.append(unit)
    return restarted


def postinst(
    args: Sequence[str],
    *,
    venv: Path = VENV,
    lib: Path = LIB,
    deps: Path | None = DEPS,
    python: str = "python3",
    runner: Runner = run,
    systemd: Path = SYSTEMD_RUNNING,
    policy: Path = POLICY_RC_D,
    environ: Mapping[str, str] = os.environ,
) -> list[str]:
    """postinst's work for ``args`` (``configure OLD``); returns the units restarted."""
    if not args or args[0] not in CONFIGURE:
        return []
    version = python_version(python)
    supported = supported_pythons(lib)
    if version not in supported:
        raise SystemExit(
            f"slmguard: python3 is {version}; this package ships wheels for Python "
            f"{', '.join(supported)} (install one of them as python3, or install slmguard "
            "with pip)"
        )
    stamp = stamp_for(lib, version, deps)
    ready = (venv / "bin" / "slmguard").is_file()
    if current_stamp(venv) == stamp and ready:
        return []
    print(f"slmguard: building a venv for Python {version} from {lib / 'wheels'}")
    built = build_venv(venv, lib, python, stamp, runner, deps)
    replaced = switch_venv(venv, built)
    print(f"slmguard: {venv} is now {built}")
    restarted = restart_units(
        "slmguard or its wheels changed",
        runner=runner,
        systemd=systemd,
        policy=policy,
        environ=environ,
    )
    prune_venvs(venv, built, replaced)
    return restarted


def prerm(
    args: Sequence[str],
    *,
    runner: Runner = run,
    systemd: Path = SYSTEMD_RUNNING,
    manifest: Path = MANIFEST,
) -> list[str]:
    """prerm's work: on ``remove``, stop the applied units; returns the units stopped."""
    if not args or args[0] != "remove":
        return []
    stopped = []
    for unit in applied_units(runner, systemd):
        print(f"slmguard: stopping {unit} (its program is being removed)")
        runner(["systemctl", "stop", unit])
        stopped.append(unit)
    if manifest.exists():
        print(
            f"slmguard: apply's deployment stays ({manifest} lists what it wrote); "
            "reinstall slmguard and run `slmguard rollback` to undo it"
        )
    return stopped


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("postinst", "prerm", "restart"):
        print("usage: maint.py postinst|prerm|restart ARGS...", file=sys.stderr)
        return 2
    os.umask(0o022)
    if argv[1] == "postinst":
        postinst(argv[2:])
    elif argv[1] == "restart":  # an engine package's postinst: its binary changed
        restart_units(f"{' '.join(argv[2:3]) or 'an engine'} changed")
    else:
        prerm(argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
