"""The Ansible step, on the host: ``ansible-playbook`` drives the booted guest over SSH.

Owns the host's half of the hand-over with the guest's ``ansible`` step
(``guest/scenario.py``): an ed25519 key made for the run (its public half goes
to the guest in the share's config), the guest's host key pinned in a
known-hosts file of the run, ``slmguard render --target ansible`` for the plan
the guest made (``fleet-plan.json``), an inventory with the guest as the one
host of its board group (127.0.0.1 and the port qemu forwards to the guest's
sshd), and three runs, each a host step of the report:

- ``ansible-deploy``: ``site.yml``: must succeed and change something; then
  the guest checks the unit serves the planned model (``/health``, a real
  completion through the front) and answers with ``ansible-checked.json``;
- ``ansible-idempotent``: ``site.yml`` again: the recap's ``changed`` is 0;
- ``ansible-rollback``: ``rollback.yml``: succeeds; the guest then compares
  ``/etc`` and ``/boot`` with the snapshot it took before the first run.

The recap is read from the recorder callback of ``tests/ansible_callbacks``
(ansible-core ships no JSON callback). ``slmguard_model_file`` points the role
at the model already prepared in the image (nothing to copy), and the wait
for ``/health`` is raised for software emulation (about 14x slower than a
board). Files go in through a temporary name and a rename, so the guest never
reads half of one over 9p.
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


def recap(stdout: str, host: str = HOST) -> dict[str, int]:
    """The play recap of ``host`` from the recorder callback's JSON (empty if none)."""
    try:
        data = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
    except ValueError:
        return {}
    stats = data.get("stats", {}).get(host, {}) if isinstance(data, dict) else {}
    return {k: int(v) for k, v in stats.items() if isinstance(v, int)}


def changed_tasks(stdout: str, host: str = HOST) -> list[str]:
    """The names of the tasks that reported a change (what a second run should not have)."""
    try:
        data = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return []
    names = []
    for play in data.get("plays", []):
        for task in play.get("tasks", []):
            result = task.get("hosts", {}).get(host, {})
            if result.get("changed") and not result.get("skipped"):
                names.append(str(task.get("task", {}).get("name")))
    return names


def inventory(group: str, port: int, key: Path, known_hosts: Path, model: str) -> dict[str, Any]:
    host = {
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
    }
    return {"all": {"children": {"slmguard": {"children": {group: {"hosts": {HOST: host}}}}}}}


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

    def _env(self) -> dict[str, str]:
        home = self.work / "ansible-home"
        return {
            **os.environ,
            "ANSIBLE_CONFIG": str(self.work / "fleet" / "ansible.cfg"),
            "ANSIBLE_HOME": str(home),
            "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
            "ANSIBLE_STDOUT_CALLBACK": "recorder",
            "ANSIBLE_CALLBACK_PLUGINS": str(CALLBACKS),
            "ANSIBLE_TIMEOUT": "60",  # sshd under emulation answers slowly
            "ANSIBLE_SSH_ARGS": "-o ControlMaster=auto -o ControlPersist=20s",
            "ANSIBLE_NOCOLOR": "1",
        }

    def _play(self, book: str) -> tuple[int, str, str]:
        timeout = min(PLAYBOOK_TIMEOUT_S, max(60.0, self._left()))
        cmd = [str(BIN / "ansible-playbook"), "-i", "inventory/systest.yml", book]
        try:
            done = subprocess.run(
                cmd,
                cwd=self.work / "fleet",
                env=self._env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as err:
            out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else ""
            return -1, out, f"ansible-playbook {book} did not finish in {timeout:.0f}s"
        (self.work / "logs").mkdir(exist_ok=True)
        (self.work / "logs" / f"ansible-{book}-{time.time():.0f}.log").write_text(
            done.stdout + "\n--- stderr\n" + done.stderr
        )
        return done.returncode, done.stdout, done.stderr

    def _render(self) -> tuple[str, Path]:
        """Render the role for the guest's plan: the board group's name, the known-hosts file."""
        from slmguard.deploy.fleet.kinds import GROUP_PREFIX, board_slug

        plan_file = self.share / scenario.ANSIBLE_PLAN
        plan = json.loads(plan_file.read_text())
        out = self.work / "fleet"
        prepared = subprocess.run(
            [str(BIN / "slmguard"), "model", "prepare"], capture_output=True, text=True, check=False
        )
        if prepared.returncode != 0:
            raise FleetError(f"host `slmguard model prepare` exited {prepared.returncode}")
        host_model = prepared.stdout.strip().splitlines()[-1]
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
                "--out",
                str(out),
                "--force",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            tail = done.stderr.strip()[-300:]
            raise FleetError(f"render --target ansible exited {done.returncode}: {tail}")
        group = GROUP_PREFIX + board_slug(str(plan["board"]["name"])).replace("-", "_")
        known = self.work / "ssh" / "known_hosts"
        return group, known

    def handle(self, event: dict[str, Any]) -> None:
        """The guest's events; acts on the Ansible step's hand-over only."""
        if event.get("event") != scenario.ANSIBLE_READY:
            return
        t0 = time.monotonic()
        try:
            self._drive(event, t0)
        except (FleetError, OSError, ValueError, KeyError) as err:
            # The guest waits for both files: it must get them, with the reason.
            reason = err.reason if isinstance(err, FleetError) else f"{type(err).__name__}: {err}"
            self._host_step("ansible-deploy", False, reason, t0)
            for name in (scenario.ANSIBLE_DEPLOYED, scenario.ANSIBLE_DONE):
                if not (self.share / name).exists():
                    _put(self.share, name, {"ok": False, "reason": reason})

    def _drive(self, event: dict[str, Any], t0: float) -> None:
        group, known = self._render()
        known.write_text(f"[127.0.0.1]:{self.port} {event.get('host_key', '')}\n")
        inv = inventory(group, self.port, self.key, known, str(event.get("model", "")))
        (self.work / "fleet" / "inventory" / "systest.yml").write_text(json.dumps(inv))

        rc, out, err = self._play("site.yml")
        stats = recap(out)
        ok = rc == 0 and stats.get("failures", 1) == 0 and stats.get("changed", 0) > 0
        reason = (
            f"site.yml: ok={stats.get('ok')} changed={stats.get('changed')} "
            f"failed={stats.get('failures')} unreachable={stats.get('unreachable')}"
            if stats
            else f"site.yml exited {rc}: {(err or out).strip()[-300:]}"
        )
        _put(self.share, scenario.ANSIBLE_DEPLOYED, {"ok": ok, "reason": reason, "recap": stats})
        t1 = time.monotonic()
        checked = self._await_guest()
        self._host_step(
            "ansible-deploy",
            ok and bool(checked.get("ok")),
            f"{reason}; guest: {checked.get('reason')}",
            t0,
            recap=stats,
            guest_check_s=round(time.monotonic() - t1, 1),
        )

        t0 = time.monotonic()
        rc, out, err = self._play("site.yml")
        again = recap(out)
        changed = changed_tasks(out)
        ok = rc == 0 and again.get("failures", 1) == 0 and again.get("changed", -1) == 0
        again_reason = (
            f"second site.yml: changed={again.get('changed')} ok={again.get('ok')}"
            + (f" (changed: {', '.join(changed)})" if changed else "")
            if again
            else f"second site.yml exited {rc}: {(err or out).strip()[-300:]}"
        )
        self._host_step("ansible-idempotent", ok, again_reason, t0, recap=again)
        result = {"again": {"ok": ok, "reason": again_reason, "recap": again}}

        t0 = time.monotonic()
        rc, out, err = self._play("rollback.yml")
        back = recap(out)
        ok = rc == 0 and back.get("failures", 1) == 0 and back.get("changed", 0) > 0
        back_reason = (
            f"rollback.yml: changed={back.get('changed')} ok={back.get('ok')}"
            if back
            else f"rollback.yml exited {rc}: {(err or out).strip()[-300:]}"
        )
        self._host_step("ansible-rollback", ok, back_reason, t0, recap=back)
        result["rollback"] = {"ok": ok, "reason": back_reason, "recap": back}
        _put(self.share, scenario.ANSIBLE_DONE, result)

    def _await_guest(self) -> dict[str, Any]:
        path = self.share / scenario.ANSIBLE_CHECKED
        end = time.monotonic() + min(scenario.ANSIBLE_WAIT_S, max(30.0, self._left()))
        while time.monotonic() < end:
            if path.exists():
                data = json.loads(path.read_text() or "{}")
                return data if isinstance(data, dict) else {}
            time.sleep(1.0)
        return {"ok": False, "reason": f"no {path.name} from the guest in time"}
