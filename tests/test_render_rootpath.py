"""Every path apply and rollback write, create or delete stays inside --root.

Each case plants something that leads out of the root (a ``..`` in the plan or
the manifest, a symlink inside the root pointing outside) and checks that the
verb refuses with 78 before anything is written, inside or outside the root.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rendertrees import ARMBIAN_ENV, make_board_root, make_plan, snapshot, write
from slmguard.cli import main
from slmguard.deploy.apply import apply_plan
from slmguard.deploy.manifest import apply_dir
from slmguard.deploy.render import RenderOptions
from slmguard.deploy.rollback import rollback
from slmguard.deploy.rootpath import confine, dest_path
from slmguard.errors import RefusedError, UsageError, exit_code
from slmguard.plan.planfile import dumps_plan

OPTS = RenderOptions(exec_path="/usr/bin/slmguard")


def _trees(tmp_path: Path) -> tuple[Path, Path]:
    """A board root and, beside it, a directory standing for the host outside the root."""
    root = make_board_root(tmp_path / "root", "armbian")
    outside = tmp_path / "outside"
    write(outside, "armbianEnv.txt", ARMBIAN_ENV)
    write(outside, "victim", "keep me\n")
    return root, outside


@pytest.mark.parametrize(
    "boot_file",
    ["/boot/../../outside/armbianEnv.txt", "../outside/armbianEnv.txt", "/boot/./armbianEnv.txt"],
)
def test_a_plan_boot_file_with_dots_is_refused(tmp_path: Path, boot_file: str) -> None:
    root, outside = _trees(tmp_path)
    before, outside_before = snapshot(root), snapshot(outside)
    with pytest.raises(RefusedError, match=r"plan\.board\.boot_file") as err:
        apply_plan(make_plan(boot_file=boot_file), OPTS, root)
    assert err.value.exit_code == 78
    assert snapshot(root) == before and snapshot(outside) == outside_before


def test_a_boot_directory_linking_out_of_the_root_is_refused(tmp_path: Path) -> None:
    root, outside = _trees(tmp_path)
    (root / "boot/armbianEnv.txt").unlink()
    (root / "boot").rmdir()
    (root / "boot").symlink_to(outside)  # an image's absolute boot -> /boot/firmware
    before, outside_before = snapshot(root), snapshot(outside)
    with pytest.raises(RefusedError, match="outside"):
        apply_plan(make_plan(boot_file="/boot/armbianEnv.txt"), OPTS, root)
    assert snapshot(root) == before and snapshot(outside) == outside_before


def test_apply_refuses_when_its_own_state_directory_leads_out(tmp_path: Path) -> None:
    """The manifest and backups are written under the root too: var/lib -> outside."""
    root, outside = _trees(tmp_path)
    (root / "var").mkdir()
    (root / "var/lib").symlink_to(outside)
    before, outside_before = snapshot(root), snapshot(outside)
    with pytest.raises(RefusedError, match="outside"):
        apply_plan(make_plan(), OPTS, root)
    assert snapshot(root) == before and snapshot(outside) == outside_before


def _manifest(root: Path, **changes: object) -> Path:
    """A valid manifest from a real apply, then edited by hand."""
    apply_plan(make_plan(), OPTS, root)
    path = apply_dir(root) / "manifest.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        data[key] = value(data) if callable(value) else value
    path.write_text(json.dumps(data))
    return path


MANIFEST_CASES = {
    "entry with ..": {
        "entries": lambda d: [*d["entries"], {"path": "/../outside/victim", "existed": False}]
    },
    "relative entry": {
        "entries": lambda d: [*d["entries"], {"path": "outside/victim", "existed": False}]
    },
    "created dir with ..": {"created_dirs": lambda d: [*d["created_dirs"], "/etc/../../outside"]},
    "backup elsewhere": {
        "entries": lambda d: [
            {**e, "backup": "backup/../../../../outside/victim"} if e.get("kind") == "file" else e
            for e in d["entries"]
        ]
    },
    "sysctl key with ..": {"sysctl_before": {"vm/../../../../outside/victim": "1"}},
    "sysctl not a number": {"sysctl_before": {"vm.swappiness": "60\nvm.x=1"}},
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_a_manifest_naming_paths_outside_the_root_is_refused(tmp_path: Path, case: str) -> None:
    root, outside = _trees(tmp_path)
    _manifest(root, **MANIFEST_CASES[case])
    before, outside_before = snapshot(root), snapshot(outside)
    with pytest.raises(RefusedError) as err:
        rollback(root)
    assert err.value.exit_code == 78
    assert snapshot(root) == before and snapshot(outside) == outside_before


def test_rollback_refuses_a_symlink_planted_in_the_root_after_apply(tmp_path: Path) -> None:
    """A directory apply wrote into, replaced by a link out: nothing is deleted through it."""
    root, outside = _trees(tmp_path)
    apply_plan(make_plan(), OPTS, root)
    sysctl_d = root / "etc/sysctl.d"
    (sysctl_d / "99-slmguard.conf").unlink()
    sysctl_d.rmdir()
    write(outside, "99-slmguard.conf", "the host's own file\n")
    sysctl_d.symlink_to(outside)
    before, outside_before = snapshot(root), snapshot(outside)
    with pytest.raises(RefusedError, match="outside"):
        rollback(root)
    assert snapshot(root) == before and snapshot(outside) == outside_before


def test_destinations_are_plain_absolute_paths(tmp_path: Path) -> None:
    for bad in ("etc/x", "/etc/../x", "/etc//x", "/etc/./x", "/etc/x\n", "/etc/\x00", ""):
        with pytest.raises(RefusedError):
            dest_path(bad)
    assert dest_path("/etc/fstab") == "/etc/fstab"
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside/link").symlink_to("/")
    assert confine(tmp_path, "/inside/link") == tmp_path / "inside/link"  # not followed
    with pytest.raises(RefusedError):
        confine(tmp_path, "/inside/link", follow=True)
    with pytest.raises(RefusedError):
        confine(tmp_path, "/inside/link/etc/passwd")


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out + err


@pytest.mark.parametrize("verb", ["apply", "rollback", "render"])
def test_a_root_that_does_not_exist_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: str
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(dumps_plan(make_plan(model_path=None)))  # a preset plan, no --model
    missing = tmp_path / "nonexistent"
    argv = {
        "apply": ["apply", "--plan", str(plan), "--root", str(missing), "--exec", "/usr/bin/x"],
        "rollback": ["rollback", "--root", str(missing)],
        "render": [
            *("render", "--plan", str(plan), "--out", str(tmp_path / "out")),
            *("--root", str(missing), "--exec", "/usr/bin/x"),
        ],
    }[verb]
    code, out = _cli(argv, capsys)
    assert code == exit_code(UsageError) == 64, out
    assert f"--root {missing}: does not exist" in out
    assert not missing.exists() and not (tmp_path / "out").exists()
