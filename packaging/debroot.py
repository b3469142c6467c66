"""The arm64 package exercised in an emulated Debian 12 arm64 root (``make dist-test``).

    python packaging/debroot.py CACHE_DIR dist/slmguard_0.1.0-1_arm64.deb \\
        --with dist/slmguard-deps_..._arm64.deb --with dist/slmguard-engine-..._arm64.deb \\
        --with dist/slmguard-model-..._all.deb [--previous OLD.deb --previous-with ...]

A board image is Debian 12 arm64 with what the package's Depends names from the OS
(``python3-venv``, ``libgomp1``; docs/install.md's "The Debian package" installs them). This
bootstraps one with mmdebstrap from the host's Debian mirror (cached as
``CACHE_DIR/board-KEY``, KEY hashing the suite, the packages and the options;
qemu-user runs its arm64 binaries through binfmt_misc, CPU ``max``), copies it for
the run, and in it, with no network (a private network namespace holding only
loopback):

1. the three commands from a bare root to a served plan: ``dpkg -i`` the packages
   (slmguard, slmguard-deps, the engines, the model's), ``slmguard plan --board auto
   --model <the model package's file> --json --out plan.json``, ``slmguard serve --plan``;
   then a completion through the front, ``slmguard doctor --plan`` and ``slmguard
   engine``, with the engine the selection chose (its path in the engine's command
   line, under ``/usr/lib/slmguard/engines/``);
2. ``dpkg -r``: the venv is gone, the state (``/var/lib/slmguard``) stays;
3. ``dpkg -P``: nothing the package or slmguard created is left: the root's file
   list equals the one before the install, but for dpkg's own records;
4. with ``--previous``: the previous package installed, state written, then the
   package installed over it: the venv is rebuilt for the new version, the state
   kept; then purged again.

Each step prints its time; the exit status is 0 when all passed. Needs root.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from systest.base import host_mirror

SUITE = "bookworm"
# What a board's Debian image has for the package's Depends (the rest is minbase).
PACKAGES = ("python3", "python3-venv", "libgomp1", "procps", "iproute2")
BOOTSTRAP_OPTS = (
    "--arch=arm64", "--variant=minbase", "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright", "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
)  # fmt: skip
PORT = 8080
# Mount points, scratch space and the packages' own directory, not part of the root.
SCRATCH = ("proc", "sys", "dev", "tmp", "run", "work")
# dpkg's and apt's own records change with every install; nothing else may.
DPKG_RECORDS = ("var/lib/dpkg/", "var/log/dpkg.log", "var/log/apt/", "var/cache/debconf/")


class StepFailed(Exception):
    pass


def log(message: str) -> None:
    print(f"dist-test: {message}", file=sys.stderr, flush=True)


def board_image(cache: Path, mirror: str) -> Path:
    """The cached Debian 12 arm64 board root (bootstrapped when missing)."""
    key = hashlib.sha256(f"{SUITE} {' '.join(PACKAGES)} {BOOTSTRAP_OPTS}".encode()).hexdigest()[:12]
    out = cache / f"board-{key}"
    if (out / "usr/bin/python3").exists():
        return out
    if not Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists():
        raise StepFailed(
            "aarch64 binaries do not run here (no binfmt_misc qemu-aarch64): make arm-tools"
        )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    log(f"bootstrapping Debian {SUITE} arm64 in {out} (a few minutes, emulated)")
    subprocess.run(
        ["mmdebstrap", *BOOTSTRAP_OPTS, f"--include={','.join(PACKAGES)}", SUITE, str(tmp), mirror],
        check=True, stdout=sys.stderr,
    )  # fmt: skip
    for deb in (tmp / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()
    tmp.rename(out)
    return out


class Root:
    """A copy of the board root, commands run in it by chroot in a private mount, PID and
    network namespace (only loopback; proc, sys, dev bound in): what a command leaves
    running dies with it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def run(self, script: str, *, timeout: float = 3600, check: bool = True) -> str:
        wrapper = (
            "set -e; mount --make-rprivate /; ip link set lo up; "
            'mount -t proc proc "$1/proc"; mount --rbind /sys "$1/sys"; '
            'mount --rbind /dev "$1/dev"; '
            'exec chroot "$1" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 '
            'HOME=/root /bin/sh -c "$2"'
        )
        done = subprocess.run(
            ["unshare", "--mount", "--net", "--pid", "--fork", "sh", "-c", wrapper, "sh",
             str(self.path), script],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if check and done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
            raise StepFailed(f"`{script[:120]}` exited {done.returncode}:\n  " + "\n  ".join(tail))
        return done.stdout

    def files(self) -> set[str]:
        out = set()
        for dirpath, dirnames, filenames in os.walk(self.path):
            rel = os.path.relpath(dirpath, self.path)
            if rel.split(os.sep)[0] in SCRATCH:
                dirnames[:] = []
                continue
            for name in [*dirnames, *filenames]:
                path = os.path.normpath(os.path.join(rel, name))
                if not path.startswith(DPKG_RECORDS) and path.split(os.sep)[0] not in SCRATCH:
                    out.add(path)
        return out


@contextmanager
def timed(name: str, results: list[dict[str, object]]) -> Iterator[None]:
    began = time.monotonic()
    record: dict[str, object] = {"step": name}
    results.append(record)
    try:
        yield
        record["status"] = "pass"
    except StepFailed as err:
        record["status"] = "fail"
        record["detail"] = str(err)
        raise
    finally:
        record["seconds"] = round(time.monotonic() - began, 1)
        log(f"{name}: {record.get('status', 'fail')} in {record['seconds']} s")


SERVE_AND_ASK = f"""
set -e
cd /root
slmguard serve --plan /root/plan.json --port {PORT} >/root/serve.log 2>&1 &
pid=$!
trap 'tail -5 /root/serve.log >&2' EXIT
for i in $(seq 1 900); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:{PORT}/health', timeout=5)" \
    2>/dev/null && break
  kill -0 $pid 2>/dev/null || {{ tail -20 /root/serve.log; exit 1; }}
  sleep 1
done
python3 - <<'PY'
import json, urllib.request
body = json.dumps({{"model": "gemma-3-270m-q4_k_m", "prompt": "The capital of France is",
                   "max_tokens": 2}}).encode()
req = urllib.request.Request("http://127.0.0.1:{PORT}/v1/completions", body,
                             {{"content-type": "application/json"}})
answer = json.load(urllib.request.urlopen(req, timeout=600))
print(json.dumps({{"completion": answer["choices"][0]["text"]}}))
health = json.load(urllib.request.urlopen("http://127.0.0.1:{PORT}/health", timeout=30))
print(json.dumps({{"health": health}}))
PY
for p in /proc/[0-9]*; do
  tr '\\0' ' ' <"$p/cmdline" 2>/dev/null \
    | grep -o '/usr/lib/slmguard/engines/[a-z0-9]*/llama-server' && break
done | head -1 | sed 's/^/engine-process: /'
kill $pid; wait $pid || true
trap - EXIT
"""


#: The packages a purge removes: slmguard and the ones that move apart from it.
SLMGUARD_PACKAGES = (
    "slmguard slmguard-deps "
    "$(dpkg-query -W -f '${Package} ' 'slmguard-engine-*' 'slmguard-model-*')"
)


def _debs(names: Sequence[str]) -> str:
    return " ".join(f"/work/{n}" for n in names)


def fresh_install(root: Root, debs: Sequence[str], results: list[dict[str, object]]) -> None:
    with timed("1 dpkg -i (the venv built offline)", results):
        root.run(f"dpkg -i {_debs(debs)}")
        root.run("test -x /opt/slmguard/bin/slmguard && slmguard --version")
    with timed("2 slmguard plan --board auto", results):
        # the model from its own package (slmguard-model-NAME): the venv holds none
        root.run(
            "m=$(ls /usr/share/slmguard/models/*.gguf 2>/dev/null | head -1); "
            'slmguard plan --board auto ${m:+--model "$m"} --json --out /root/plan.json'
        )
        plan = json.loads((root.path / "root/plan.json").read_text())
        log(f"plan: board {plan['board']['name']}, ctx {plan['engine']['n_ctx']}")
    with timed("3 slmguard serve --plan, a completion", results):
        out = root.run(SERVE_AND_ASK)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        completion = next(json.loads(ln) for ln in lines if ln.startswith('{"completion"'))
        engine = next(
            (ln.split(": ", 1)[1] for ln in lines if ln.startswith("engine-process")), None
        )
        log(f"completion {completion['completion']!r}; engine {engine}")
        chosen = json.loads(root.run("slmguard engine --json"))["chosen"]
        if engine != chosen:
            raise StepFailed(f"serve ran {engine}, the selection is {chosen}")
    with timed("doctor --plan", results):
        out = root.run("slmguard doctor --plan /root/plan.json --json; echo exit=$?", check=False)
        status = out.strip().splitlines()[-1]
        log(f"doctor: {status} (1/2: warnings/failures of a chroot's stock settings)")
        if status not in ("exit=0", "exit=1", "exit=2"):
            raise StepFailed(f"doctor could not run: {out[-500:]}")


def remove_and_purge(root: Root, before: set[str], results: list[dict[str, object]]) -> None:
    with timed("dpkg -r: venv gone, state kept", results):
        root.run(f"dpkg -r {SLMGUARD_PACKAGES}")
        if (root.path / "opt/slmguard").exists() or (root.path / "usr/bin/slmguard").is_symlink():
            raise StepFailed("dpkg -r left /opt/slmguard or /usr/bin/slmguard")
        if not (root.path / "var/lib/slmguard/models").is_dir():
            raise StepFailed("dpkg -r removed the state /var/lib/slmguard")
    with timed("dpkg -P: only what was there before", results):
        root.run(f"dpkg -P {SLMGUARD_PACKAGES}; rm -f /root/plan.json /root/serve.log")
        left = root.files() - before
        if left:
            raise StepFailed(f"dpkg -P left {sorted(left)[:20]}")


def upgrade(
    root: Root, previous: Sequence[str], debs: Sequence[str], results: list[dict[str, object]]
) -> None:
    with timed("upgrade: previous packages, then this slmguard over them", results):
        root.run(f"dpkg -i {_debs(previous)}")
        old = root.run("slmguard --version").strip()
        root.run("mkdir -p /var/lib/slmguard && echo kept >/var/lib/slmguard/upgrade-probe")
        stamp_before = (root.path / "opt/slmguard/.slmguard-package").read_text()
        root.run(f"dpkg -i {_debs(debs)}")
        new = root.run("slmguard --version").strip()
        stamp_after = (root.path / "opt/slmguard/.slmguard-package").read_text()
        kept = (root.path / "var/lib/slmguard/upgrade-probe").read_text().strip()
        log(f"{old} -> {new}; venv stamp changed: {stamp_before != stamp_after}; state {kept}")
        if old == new or stamp_before == stamp_after or kept != "kept":
            raise StepFailed("the upgrade did not rebuild the venv or lost the state")
        root.run(f"dpkg -P {SLMGUARD_PACKAGES}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("cache", type=Path)
    p.add_argument("deb", type=Path)
    p.add_argument(
        "--with", dest="companions", type=Path, action="append", default=[],
        help="slmguard-deps, an engine: installed with it (repeatable)",
    )  # fmt: skip
    p.add_argument("--previous", type=Path, help="an older slmguard package to upgrade from")
    p.add_argument(
        "--previous-with", type=Path, action="append", default=[],
        help="the previous one's slmguard-deps and engines (repeatable)",
    )  # fmt: skip
    p.add_argument("--mirror", default=None, help="default: the host's (systest.base)")
    p.add_argument("--json", type=Path, help="write the step records here")
    args = p.parse_args(argv)
    results: list[dict[str, object]] = []
    began = time.monotonic()
    try:
        with timed("board image (mmdebstrap, cached)", results):
            image = board_image(args.cache, args.mirror or host_mirror())
        with tempfile.TemporaryDirectory(dir=args.cache, prefix="run-") as tmp:
            path = Path(tmp) / "root"
            subprocess.run(["cp", "-a", str(image), str(path)], check=True)
            root = Root(path)
            before = root.files()
            work = path / "work"
            work.mkdir()
            debs = [args.deb, *args.companions]
            previous = [args.previous, *args.previous_with] if args.previous else []
            for deb in {*debs, *previous}:
                shutil.copyfile(deb, work / deb.name)
            fresh_install(root, [d.name for d in debs], results)
            remove_and_purge(root, before, results)
            if previous:
                upgrade(root, [d.name for d in previous], [args.deb.name], results)
                with timed("after the upgrade's purge: only what was there before", results):
                    left = root.files() - before
                    if left:
                        raise StepFailed(f"left {sorted(left)[:20]}")
    except StepFailed as err:
        log(f"FAILED: {err}")
        return 1
    finally:
        log(f"total {time.monotonic() - began:.0f} s")
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
