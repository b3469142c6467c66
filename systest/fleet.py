"""The Ansible step, on the host: ``ansible-playbook`` drives the booted guest over SSH.

Owns the host's half of the hand-over with the guest's ``ansible`` step
(``guest/scenario.py``): an ed25519 key made for the run (its public half goes
to the guest in the share's config), the guest's host key pinned in a
known-hosts file of the run, ``slmguard render --target ansible`` for the two
plans the guest made (``fleet-plan.json``: A, ``fleet-plan-b.json``: B, another
context size), an inventory with the guest as the one host of its board group
(127.0.0.1 and the port qemu forwards to the guest's sshd), and five runs, each
a host step of the report and a stage the guest then checks
(``scenario.ANSIBLE_STAGES``):

- ``ansible-deploy``: ``site.yml`` with plan A (a staged rollout whose canary
  batch is the one board, gated on ``/health`` and a real completion): it must
  succeed and change something; the guest checks the unit serves plan A;
- ``ansible-idempotent``: ``site.yml`` again: the recap's ``changed`` is 0;
- ``ansible-rollout``: ``site.yml`` with plan B's tree: it changes the plan,
  restarts the server and gates it; the guest checks it serves plan B;
- ``ansible-rollback``: ``rollback.yml``: one plan back; the guest compares
  ``/etc`` and ``/boot`` with what plan A left and checks it serves plan A;
- ``ansible-uninstall``: ``uninstall.yml``: the guest compares ``/etc`` and
  ``/boot`` with the snapshot it took before the first run.

**The packages**: when ``dist/`` holds ``slmguard_<version>-1_amd64.deb``
(``make dist-amd64``), it is rendered in (``--package``) with the split
packages beside it (``slmguard-deps``, ``slmguard-engine-avx2``: the newest of
each), and the role installs them on the guest, each pinned by its sha256, and
runs ``/usr/bin/slmguard``; ``uninstall.yml`` removes slmguard. Without one the
guest's own slmguard (the image's venv) is used and the step says so in its
details.

Each step records the bytes the guest's NIC moved during it (the guest's only
network; SSH is all of it). The recap is read from the recorder callback of
``tests/ansible_callbacks`` (ansible-core ships no JSON callback).
``slmguard_model_file`` points the role at the model already prepared in the
image (the guest has no network to a mirror), and the wait for ``/health`` is
raised for software emulation (about 14x slower than a board). Files go in
through a temporary name and a rename, so the guest never reads half of one
over 9p.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from systest import report
from systest.guest import scenario

REPO = Path(__file__).resolve().parent.parent
CALLBACKS = REPO / "tests" / "ansible_callbacks"
BIN = Path(sys.executable).parent
HOST = "systest-vm"
#: The role waits this long for /health: a model load under emulation on a shared host.
READY_TIMEOUT_S = 900
PLAYBOOK_TIMEOUT_S = 1500.0
#: The guest's check is waited for this long even past the deadline (qemu is stopped 120 s
#: after it): CI's run 35 gave it the old 30 s after a slow rollback.yml, on a guest whose
#: checks take 30-60 s there (7 s on a quiet host).
CHECK_MIN_S = 100.0
#: The guest image's own slmguard (its venv), used when there is no .deb to install.
IMAGE_SLMGUARD = "/usr/local/bin/slmguard"
DIST = REPO / "dist"
#: (host step, playbook, tree, the recap's changed must be: >0, 0, or anything (None)).
RUNS = (
    ("ansible-deploy", "site.yml", "fleet", "more"),
    ("ansible-idempotent", "site.yml", "fleet", "none"),
    ("ansible-rollout", "site.yml", "fleet-b", "more"),
    ("ansible-rollback", "rollback.yml", "fleet-b", "more"),
    ("ansible-uninstall", "uninstall.yml", "fleet-b", "more"),
)


class FleetError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def make_key(directory: Path) -> tuple[Path, str]:
    """A fresh ed25519 key pair for this run: (private key path, public key line)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = directory / "id_ed25519"
    for p in (key, key.with_suffix(".pub")):
        p.unlink(missing_ok=True)
    done = subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "slmguard-systest", "-f", str(key)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise FleetError(f"ssh-keygen exited {done.returncode}: {done.stderr.strip()[-200:]}")
    return key, key.with_suffix(".pub").read_text().strip()


def _recorded(stdout: str) -> dict[str, Any]:
    """The recorder callback's JSON line (the fleet report's callback prints after it)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith('{"plays"'):
            try:
                data = json.loads(line)
            except ValueError:
                return {}
            return data if isinstance(data, dict) else {}
    return {}


def recap(stdout: str, host: str = HOST) -> dict[str, int]:
    """The play recap of ``host`` from the recorder callback's JSON (empty if none)."""
    data = _recorded(stdout)
    stats = data.get("stats", {}).get(host, {}) if isinstance(data, dict) else {}
    return {k: int(v) for k, v in stats.items() if isinstance(v, int)}


def _task_results(stdout: str, host: str) -> list[tuple[str, dict[str, Any]]]:
    """(task name, result) of every task ``host`` ran, skipped ones left out, from the
    recorder callback's JSON (empty if none)."""
    data = _recorded(stdout)
    results = []
    for play in data.get("plays", []):
        for task in play.get("tasks", []):
            result = task.get("hosts", {}).get(host, {})
            if result and not result.get("skipped"):
                results.append((str(task.get("task", {}).get("name")), result))
    return results


def changed_tasks(stdout: str, host: str = HOST) -> list[str]:
    """The names of the tasks that reported a change (what a second run should not have)."""
    return [name for name, result in _task_results(stdout, host) if result.get("changed")]


def slowest_tasks(stdout: str, host: str = HOST, count: int = 5) -> list[tuple[str, float]]:
    """The ``count`` tasks that took ``host`` longest, with their seconds (the recorder's
    ``took_s``): where a slow run spent its time, in the report."""
    took = [
        (name, float(result["took_s"]))
        for name, result in _task_results(stdout, host)
        if isinstance(result.get("took_s"), (int, float))
    ]
    return sorted(took, key=lambda t: -t[1])[:count]


#: What the host asks the guest over SSH when a check does not come: its load, memory and
#: pressure, the busiest processes with where they wait, and where the scenario waits.
LOOK = (
    "cat /proc/loadavg; grep -E '^(MemAvailable|Committed_AS|CommitLimit):' /proc/meminfo; "
    "head -1 /proc/pressure/memory; head -1 /proc/pressure/io; "
    "ps -eo pid,pcpu,stat,wchan:24,args --sort=-pcpu | head -6 | cut -c1-110; "
    "for p in $(pgrep -f '^/usr/bin/python3 /run/systest/scenario.py'); do "
    "echo scenario $p $(cat /proc/$p/wchan); "
    "head -4 /proc/$p/stack; done; dmesg | tail -4 | cut -c1-110"
)


def inventory(
    group: str, port: int, key: Path, known_hosts: Path, model: str, package: bool = False
) -> dict[str, Any]:
    host: dict[str, Any] = {
        "ansible_host": "127.0.0.1",
        "ansible_port": port,
        "ansible_user": "root",
        "ansible_become": False,
        "ansible_python_interpreter": "/usr/bin/python3",
        "ansible_ssh_private_key_file": str(key),
        "ansible_ssh_common_args": f"-o UserKnownHostsFile={known_hosts} "
        "-o StrictHostKeyChecking=yes -o IdentitiesOnly=yes",
        "slmguard_model_file": model,
        "slmguard_ready_timeout_s": READY_TIMEOUT_S,
        "slmguard_gate_timeout_s": READY_TIMEOUT_S,
        # the guest's doctor counts the running service's commit twice (systest/README.md)
        "slmguard_doctor_max_exit": 2,
    }
    if not package:  # no .deb: the image's own slmguard
        host.update(slmguard_install_package=False, slmguard_exec=IMAGE_SLMGUARD)
    return {"all": {"children": {"slmguard": {"children": {group: {"hosts": {HOST: host}}}}}}}


#: The packages the role installs beside slmguard's (the newest of each in dist/).
SPLIT = ("slmguard-deps_*_amd64.deb", "slmguard-engine-avx2_*_amd64.deb")


def package_files(dist: Path) -> list[Path]:
    """The .debs ``make dist-amd64`` built for the guest: slmguard's and, beside it, its
    wheels' and the avx2 engine's (the newest of each); [] without slmguard's."""
    from slmguard import __version__

    path = dist / f"slmguard_{__version__}-1_amd64.deb"
    if not path.is_file():
        return []
    out = [path]
    for pattern in SPLIT:
        found = sorted(dist.glob(pattern), key=lambda p: p.stat().st_mtime)
        if found:
            out.append(found[-1])
    return out


def _put(share: Path, name: str, data: dict[str, Any]) -> None:
    tmp = share / (name + ".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    tmp.rename(share / name)


@dataclass
class Fleet:
    """The host's side of one run's Ansible step (see the module docstring)."""

    share: Path
    work: Path
    port: int
    deadline: float  # time.monotonic() past which nothing new is started
    on_step: Callable[[report.StepResult], None]
    key: Path = field(init=False)
    pubkey: str = field(init=False)

    def __post_init__(self) -> None:
        self.key, self.pubkey = make_key(self.work / "ssh")

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def _host_step(self, name: str, ok: bool, reason: str, t0: float, **details: Any) -> None:
        status = report.PASS if ok else report.FAIL
        self.on_step(
            report.StepResult(
                name, status, reason, time.monotonic() - t0, where="host", details=details
            )
        )

    def _env(self, tree: str = "fleet") -> dict[str, str]:
        home = self.work / "ansible-home"
        return {
            **os.environ,
            "ANSIBLE_CONFIG": str(self.work / tree / "ansible.cfg"),
            "ANSIBLE_HOME": str(home),
            "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
            "ANSIBLE_STDOUT_CALLBACK": "recorder",
            "ANSIBLE_CALLBACK_PLUGINS": str(CALLBACKS),
            "ANSIBLE_TIMEOUT": "60",  # sshd under emulation answers slowly
            "ANSIBLE_SSH_ARGS": "-o ControlMaster=auto -o ControlPersist=20s",
            "ANSIBLE_NOCOLOR": "1",
        }

    def _play(self, book: str, tree: str = "fleet") -> tuple[int, str, str]:
        timeout = min(PLAYBOOK_TIMEOUT_S, max(60.0, self._left()))
        cmd = [str(BIN / "ansible-playbook"), "-i", "inventory/systest.yml", book]
        try:
            done = subprocess.run(
                cmd,
                cwd=self.work / tree,
                env=self._env(tree),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as err:
            out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else ""
            return -1, out, f"ansible-playbook {book} did not finish in {timeout:.0f}s"
        (self.work / "logs").mkdir(exist_ok=True)
        (self.work / "logs" / f"ansible-{tree}-{book}-{time.time():.0f}.log").write_text(
            done.stdout + "\n--- stderr\n" + done.stderr
        )
        return done.returncode, done.stdout, done.stderr

    def _render(self, plan_name: str, tree: str, packages: list[Path]) -> str:
        """Render ``tree`` for the guest's plan ``plan_name``; the board group's name."""
        from slmguard.deploy.fleet.kinds import GROUP_PREFIX, board_slug

        plan_file = self.share / plan_name
        plan = json.loads(plan_file.read_text())
        prepared = subprocess.run(
            [str(BIN / "slmguard"), "model", "prepare"], capture_output=True, text=True, check=False
        )
        if prepared.returncode != 0:
            raise FleetError(f"host `slmguard model prepare` exited {prepared.returncode}")
        host_model = prepared.stdout.strip().splitlines()[-1]
        extra = [arg for p in packages for arg in ("--package", str(p))]
        done = subprocess.run(
            [
                str(BIN / "slmguard"),
                "render",
                "--target",
                "ansible",
                "--plan",
                str(plan_file),
                "--model",
                host_model,
                *extra,
                "--out",
                str(self.work / tree),
                "--force",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            tail = done.stderr.strip()[-300:]
            raise FleetError(f"render --target ansible exited {done.returncode}: {tail}")
        return GROUP_PREFIX + board_slug(str(plan["board"]["name"])).replace("-", "_")

    def handle(self, event: dict[str, Any]) -> None:
        """The guest's events; acts on the Ansible step's hand-over only."""
        if event.get("event") != scenario.ANSIBLE_READY:
            return
        t0 = time.monotonic()
        try:
            self._drive(event)
        except (FleetError, OSError, ValueError, KeyError) as err:
            # The guest waits for every stage's file: it must get them, with the reason.
            reason = err.reason if isinstance(err, FleetError) else f"{type(err).__name__}: {err}"
            self._host_step("ansible-deploy", False, reason, t0)
            for stage in scenario.ANSIBLE_STAGES:
                if not (self.share / scenario.host_file(stage)).exists():
                    _put(self.share, scenario.host_file(stage), {"ok": False, "reason": reason})

    def _drive(self, event: dict[str, Any]) -> None:
        packages = package_files(DIST)
        group = self._render(scenario.ANSIBLE_PLAN, "fleet", packages)
        self._render(scenario.ANSIBLE_PLAN_B, "fleet-b", packages)
        known = self.work / "ssh" / "known_hosts"
        known.write_text(f"[127.0.0.1]:{self.port} {event.get('host_key', '')}\n")
        inv = inventory(
            group, self.port, self.key, known, str(event.get("model", "")), bool(packages)
        )
        for tree in ("fleet", "fleet-b"):
            (self.work / tree / "inventory" / "systest.yml").write_text(json.dumps(inv))
        nic = event.get("nic")
        for (name, book, tree, changed), stage in zip(RUNS, scenario.ANSIBLE_STAGES, strict=True):
            t0 = time.monotonic()
            rc, out, err = self._play(book, tree)
            stats = recap(out)
            ok = rc == 0 and stats.get("failures", 1) == 0
            if changed == "more":
                ok = ok and stats.get("changed", 0) > 0
            elif changed == "none":
                ok = ok and stats.get("changed", -1) == 0
            moved = changed_tasks(out)
            reason = (
                f"{book} ({tree}): ok={stats.get('ok')} changed={stats.get('changed')} "
                f"failed={stats.get('failures')}"
                + (f" (changed: {', '.join(moved)})" if changed == "none" and moved else "")
                if stats
                else f"{book} exited {rc}: {(err or out).strip()[-300:]}"
            )
            _put(
                self.share, scenario.host_file(stage), {"ok": ok, "reason": reason, "recap": stats}
            )
            checked = self._await_guest(scenario.checked_file(stage))
            now = checked.get("nic")
            moved_bytes = _nic_delta(nic, now)
            nic = now if isinstance(now, dict) else nic
            self._host_step(
                name,
                ok and bool(checked.get("ok")),
                f"{reason}; guest: {checked.get('reason')}",
                t0,
                recap=stats,
                slowest_tasks=slowest_tasks(out),
                guest_took=checked.get("took"),
                nic_bytes=moved_bytes,
                packages=[f"{p.name} ({p.stat().st_size} bytes)" for p in packages],
            )
            if not stats:
                break

    def _await_guest(self, name: str) -> dict[str, Any]:
        path = self.share / name
        end = time.monotonic() + min(scenario.ANSIBLE_WAIT_S, max(CHECK_MIN_S, self._left()))
        while time.monotonic() < end:
            if path.exists():
                data = json.loads(path.read_text() or "{}")
                return data if isinstance(data, dict) else {}
            time.sleep(1.0)
        seen = self._look()
        return {
            "ok": False,
            "reason": f"no {path.name} from the guest in time; over SSH the guest says: {seen}",
            "look": seen,
        }

    def _look(self) -> str:
        """What the guest says over SSH (:data:`LOOK`), on one line, or why it said nothing."""
        known = self.work / "ssh" / "known_hosts"
        cmd = [
            "ssh", "-p", str(self.port), "-i", str(self.key), "-o", f"UserKnownHostsFile={known}",
            "-o", "StrictHostKeyChecking=yes", "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=30", "root@127.0.0.1", LOOK,
        ]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
        except subprocess.TimeoutExpired:
            return "nothing: ssh did not finish in 90s"
        text = done.stdout.strip() or f"nothing (ssh {done.returncode}: {done.stderr[-200:]})"
        return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def _nic_delta(before: object, after: object) -> dict[str, int] | None:
    """Bytes the guest's NIC received and sent between two of its counts."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    return {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in ("rx", "tx")}
