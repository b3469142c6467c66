"""The systest's Ansible step, the parts that need no VM: the NIC, the recap, the inventory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the systest package

from systest import fleet, vm
from systest.guest import scenario

from waiting import scaled

BIN = Path(sys.executable).parent


def test_the_guest_network_is_isolated_but_for_the_ssh_forward() -> None:
    assert vm.nic_args(None) == ["-nic", "none"]
    (flag, nic) = vm.nic_args(2222)
    assert flag == "-nic" and "restrict=on" in nic.split(",")
    forwards = [o for o in nic.split(",") if o.startswith("hostfwd=")]
    assert forwards == ["hostfwd=tcp:127.0.0.1:2222-:22"]  # loopback only, sshd only
    port = vm.free_loopback_port()
    assert 1024 <= port <= 65535


def _recorded(changed: int, tasks: list[dict[str, Any]]) -> str:
    stats = {"ok": 20, "changed": changed, "failures": 0, "unreachable": 0, "skipped": 3}
    return "noise before\n" + json.dumps(
        {"plays": [{"play": {"name": "p"}, "tasks": tasks}], "stats": {fleet.HOST: stats}}
    )


def test_recap_and_changed_tasks_from_the_recorder() -> None:
    tasks = [
        {"task": {"name": "slmguard : Apply the plan"}, "hosts": {fleet.HOST: {"changed": True}}},
        {"task": {"name": "slmguard : Stage"}, "hosts": {fleet.HOST: {"changed": False}}},
        {
            "task": {"name": "slmguard : Skipped"},
            "hosts": {fleet.HOST: {"changed": True, "skipped": True}},
        },
    ]
    out = _recorded(1, tasks)
    assert fleet.recap(out)["changed"] == 1
    assert fleet.changed_tasks(out) == ["slmguard : Apply the plan"]
    assert fleet.recap(_recorded(0, []))["changed"] == 0
    assert fleet.recap("") == {} and fleet.recap("not json") == {}
    assert fleet.recap(out, host="another") == {}


def test_the_slowest_tasks_from_the_recorder() -> None:
    tasks = [
        {"task": {"name": "slmguard : Install"}, "hosts": {fleet.HOST: {"took_s": 3.5}}},
        {"task": {"name": "slmguard : Wait"}, "hosts": {fleet.HOST: {"took_s": 120.0}}},
        {"task": {"name": "Gone"}, "hosts": {fleet.HOST: {"skipped": True, "took_s": 900}}},
        {"task": {"name": "slmguard : Doctor"}, "hosts": {fleet.HOST: {"took_s": 30}}},
        {"task": {"name": "slmguard : Elsewhere"}, "hosts": {"another": {"took_s": 500.0}}},
    ]
    out = _recorded(1, tasks)
    slowest = [("slmguard : Wait", 120.0), ("slmguard : Doctor", 30.0)]
    assert fleet.slowest_tasks(out, count=2) == slowest
    assert fleet.slowest_tasks("not json") == []


def test_the_inventory_puts_the_guest_in_its_board_group(tmp_path: Path) -> None:
    """ansible-inventory reads it: the VM is a host of the rendered group, over SSH."""
    inv = fleet.inventory(
        "slmguard_generic", 2222, tmp_path / "id", tmp_path / "known", "/var/lib/m.gguf"
    )
    path = tmp_path / "systest.yml"
    path.write_text(json.dumps(inv))
    done = subprocess.run(
        [str(BIN / "ansible-inventory"), "-i", str(path), "--list"],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        check=False,
        env={"ANSIBLE_HOME": str(tmp_path / "home"), "PATH": str(BIN) + ":/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert listed["slmguard_generic"]["hosts"] == [fleet.HOST]
    host = listed["_meta"]["hostvars"][fleet.HOST]
    assert (host["ansible_host"], host["ansible_port"], host["ansible_user"]) == (
        "127.0.0.1",
        2222,
        "root",
    )
    assert "StrictHostKeyChecking=yes" in host["ansible_ssh_common_args"]
    assert host["slmguard_model_file"] == "/var/lib/m.gguf"
    # no .deb to install: the image's own slmguard
    assert host["slmguard_install_package"] is False
    assert host["slmguard_exec"] == fleet.IMAGE_SLMGUARD
    with_package = fleet.inventory("g", 2222, tmp_path / "id", tmp_path / "k", "/m", True)
    (vars_,) = with_package["all"]["children"]["slmguard"]["children"]["g"]["hosts"].values()
    assert "slmguard_install_package" not in vars_  # the role's default: install it


def test_a_key_is_made_for_the_run(tmp_path: Path) -> None:
    key, pub = fleet.make_key(tmp_path / "ssh")
    assert pub.startswith("ssh-ed25519 ") and key.stat().st_mode & 0o077 == 0
    again, pub2 = fleet.make_key(tmp_path / "ssh")
    assert again == key and pub2 != pub  # a new key each run, never reused


def test_a_failed_hand_over_still_answers_the_guest(tmp_path: Path) -> None:
    """The guest waits for both files: a host-side failure must write them, with the reason."""
    share = tmp_path / "share"
    share.mkdir()
    steps: list[Any] = []
    f = fleet.Fleet(share, tmp_path, 2222, deadline=1e12, on_step=steps.append)
    f.handle({"event": "begin"})  # not the hand-over: nothing happens
    assert not list(share.iterdir())
    f.handle({"event": "ansible-ready", "host_key": "ssh-ed25519 AAAA", "model": "/m"})
    deployed = json.loads((share / "ansible-deployed.json").read_text())
    assert deployed["ok"] is False and "fleet-plan.json" in deployed["reason"]
    for stage in scenario.ANSIBLE_STAGES:  # every stage the guest waits for is answered
        assert json.loads((share / scenario.host_file(stage)).read_text())["ok"] is False
    assert [(s.step, s.status) for s in steps] == [("ansible-deploy", "fail")]


def test_the_look_into_a_silent_guest_runs_as_a_shell_line() -> None:
    """What the host asks the guest when a check does not come (fleet.LOOK), run here:
    one shell line that prints the load and the memory even where parts find nothing."""
    done = subprocess.run(
        ["sh", "-c", fleet.LOOK], capture_output=True, text=True, timeout=scaled(60), check=False
    )
    lines = done.stdout.splitlines()
    assert len(lines[0].split()) == 5  # /proc/loadavg
    assert any(line.startswith("MemAvailable:") for line in lines), done.stdout
    assert any("COMMAND" in line for line in lines), done.stdout
