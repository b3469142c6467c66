"""apply and rollback on temporary board roots: idempotent, refusing, byte-exact undo."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rendertrees import (
    ARMBIAN_ENV,
    BOARDS,
    GiB,
    MiB,
    make_board_root,
    make_plan,
    snapshot,
    write,
)
from slmguard import atomicio
from slmguard.deploy import hosttools, writer
from slmguard.deploy.apply import apply_plan
from slmguard.deploy.hosttools import post_commands
from slmguard.deploy.manifest import apply_dir
from slmguard.deploy.render import RenderOptions, render_files, secret_file_bytes
from slmguard.deploy.review import write_tree
from slmguard.deploy.rollback import rollback
from slmguard.deploy.target import current_state
from slmguard.errors import HostReadError, HostWriteError, RefusedError
from slmguard.host.procfs import parse_meminfo
from slmguard.plan.planfile import load_plan
from slmguard.plan.schema import Plan

OPTS = RenderOptions(exec_path="/usr/bin/slmguard", protect=("nginx.service",))
ALL_BOARDS = sorted(BOARDS)


def _boot(root: Path, board: str) -> str:
    return (root / BOARDS[board][0]).read_text()


@pytest.mark.parametrize("board", ALL_BOARDS)
def test_apply_is_idempotent_and_rollback_is_byte_exact(tmp_path: Path, board: str) -> None:
    root = make_board_root(tmp_path / "root", board)
    before = snapshot(root)

    first = apply_plan(make_plan(), OPTS, root)
    assert first.changes and first.manifest is not None and first.manifest.is_file()
    assert "cma=512M" in _boot(root, board)
    assert "#slmguard-disabled# /swapfile" in (root / "etc/fstab").read_text()
    assert (root / "etc/systemd/system/nvzramconfig.service").readlink() == Path("/dev/null")
    assert load_plan(root / "etc/slmguard/plan.json") == make_plan()
    dropin = root / "etc/systemd/system/nginx.service.d/50-slmguard-protect.conf"
    assert "Slice=business.slice" in dropin.read_text()
    # The boot partition's file keeps its mode.
    assert (root / BOARDS[board][0]).stat().st_mode & 0o777 == 0o755
    applied = snapshot(root)

    second = apply_plan(make_plan(), OPTS, root)
    assert second.changes == () and second.manifest is None
    assert snapshot(root) == applied

    undone = rollback(root)
    assert undone.restored and undone.removed and not undone.nothing
    assert snapshot(root) == before
    assert rollback(root).nothing


def test_changed_plan_then_rollback_returns_to_the_state_before_the_first_apply(
    tmp_path: Path,
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    before = snapshot(root)
    apply_plan(make_plan(), OPTS, root)
    other = make_plan(memory_max_bytes=2 * GiB, memory_high_bytes=1536 * MiB, cma_bytes=1 * GiB)
    second = apply_plan(
        other, RenderOptions(exec_path="/usr/bin/slmguard", protect=("redis.service",)), root
    )
    changed = {c.path for c in second.changes}
    assert "/etc/systemd/system/slmguard.service" in changed
    assert "/etc/systemd/system/redis.service.d/50-slmguard-protect.conf" in changed
    assert "extraargs=cma=1G\n" in _boot(root, "armbian")
    manifest = json.loads((apply_dir(root) / "manifest.json").read_text())
    boot = [e for e in manifest["entries"] if e["path"] == "/boot/armbianEnv.txt"]
    assert len(boot) == 1  # the first record (the original file) is kept
    rollback(root)
    assert snapshot(root) == before
    assert _boot(root, "armbian") == ARMBIAN_ENV


def test_dry_run_writes_nothing_and_shows_the_diff(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    before = snapshot(root)
    result = apply_plan(make_plan(), OPTS, root, dry_run=True)
    assert snapshot(root) == before
    assert result.dry_run and result.manifest is None
    diff = result.diff
    assert "+++ b/etc/systemd/system/slmguard.service" in diff
    assert "-extraargs=cma=256M\n+extraargs=cma=512M\n" in diff
    assert "+#slmguard-disabled# /swapfile" in diff
    assert "+symlink -> /dev/null" in diff


def _refusal_cases() -> list[tuple[str, str, Plan, str | None, str]]:
    cases: list[tuple[str, str, Plan, str | None, str]] = [
        ("armbian", "not a key=value line", make_plan(), "rootdev=/dev/a\ngarbage\n", ""),
        ("armbian", "no root=", make_plan(), "verbosity=1\nextraargs=quiet\n", ""),
        ("uenv", "no bootargs=", make_plan(), "fdtfile=a.dtb\n", ""),
        ("uenv", "no root=", make_plan(), "bootargs=console=ttyFIQ0 rw\n", ""),
        ("extlinux", "names no LABEL", make_plan(), "DEFAULT x\nLABEL y\n APPEND root=/a\n", ""),
        ("extlinux", "no APPEND", make_plan(), "LABEL primary\n  LINUX /boot/Image\n", ""),
        (
            "armbian",
            "MemoryMax",
            make_plan(memory_max_bytes=3900 * MiB, memory_high_bytes=3 * GiB),
            None,
            "",
        ),
        ("armbian", "half of RAM", make_plan(cma_bytes=3 * GiB), None, ""),
        ("armbian", "does not exist", make_plan(boot_file="/boot/uEnv.txt"), None, ""),
        ("armbian", "is a directory", make_plan(), None, "etc/sysctl.d/99-slmguard.conf/"),
        ("armbian", "in the way", make_plan(), None, "etc/systemd/system/nginx.service.d"),
        ("armbian", "not UTF-8", make_plan(), None, "etc/fstab"),
    ]
    return cases


@pytest.mark.parametrize(
    ("board", "needle", "plan", "boot_text", "obstacle"),
    _refusal_cases(),
    ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(_refusal_cases())],
)
def test_refused_apply_touches_no_file(
    tmp_path: Path, board: str, needle: str, plan: Plan, boot_text: str | None, obstacle: str
) -> None:
    root = make_board_root(tmp_path / "root", board, boot_text)
    if obstacle.endswith("/"):  # a directory where a file must go
        (root / obstacle).mkdir(parents=True)
    elif obstacle == "etc/fstab":
        write(root, obstacle, b"/dev/sda2 none swap sw 0 0 \xff\n")
    elif obstacle:  # a file where a directory must go
        write(root, obstacle, "not a directory\n")
    before = snapshot(root)
    with pytest.raises(RefusedError, match=needle) as err:
        apply_plan(plan, OPTS, root)
    assert err.value.exit_code == 78
    assert snapshot(root) == before


def test_no_boot_file_and_no_cma(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    (root / "boot/armbianEnv.txt").unlink()
    result = apply_plan(make_plan(), OPTS, root)
    assert any("no boot file" in n for n in result.notes)
    rollback(root)
    root2 = make_board_root(tmp_path / "root2", "uenv")
    result = apply_plan(make_plan(cma_bytes=None), OPTS, root2)
    assert "/boot/uEnv.txt" not in {c.path for c in result.changes}


def test_interrupted_apply_can_be_rolled_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is written before the first target: a failure halfway is undoable."""
    root = make_board_root(tmp_path / "root", "extlinux")
    before = snapshot(root)

    def fail(path: Path, target: str) -> None:
        raise HostWriteError(path, "No space left on device")

    monkeypatch.setattr(atomicio, "symlink_atomic", fail)
    with pytest.raises(HostWriteError):
        apply_plan(make_plan(), OPTS, root)
    # Written before the failure: the boot-time recovery comes first.
    assert (root / "etc/systemd/system/slmguard-recover.service").exists()
    monkeypatch.undo()
    rollback(root)
    assert snapshot(root) == before


def test_rollback_refuses_a_damaged_backup_and_changes_nothing(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    apply_plan(make_plan(), OPTS, root)
    backup = apply_dir(root) / "backup/etc/fstab"
    backup.write_text("tampered\n")
    applied = snapshot(root)
    with pytest.raises(RefusedError, match="missing or damaged"):
        rollback(root)
    assert snapshot(root) == applied


def test_rollback_refuses_a_manifest_it_cannot_read(tmp_path: Path) -> None:
    write(tmp_path, "var/lib/slmguard-apply/manifest.json", "{not json")
    with pytest.raises(RefusedError, match="not valid JSON"):
        rollback(tmp_path)
    write(tmp_path, "var/lib/slmguard-apply/manifest.json", '{"schema": "other"}')
    with pytest.raises(RefusedError, match="not an slmguard apply manifest"):
        rollback(tmp_path)


def test_post_commands_only_on_the_real_root_and_only_installed_tools(tmp_path: Path) -> None:
    changed = [
        "/etc/sysctl.d/99-slmguard.conf",
        "/etc/systemd/system/slmguard.service",
    ]
    everything = {"sysctl", "systemctl"}

    def which(name: str) -> str | None:
        return f"/usr/bin/{name}" if name in everything else None

    assert post_commands(Path("/"), changed, which) == [
        ("sysctl", "--system"),
        ("systemctl", "daemon-reload"),
    ]
    assert post_commands(tmp_path, changed, which) == []
    assert post_commands(Path("/"), ["/boot/armbianEnv.txt"], which) == []
    assert post_commands(Path("/"), changed, lambda name: None) == []
    everything.discard("sysctl")
    assert ("sysctl", "--system") not in post_commands(Path("/"), changed, which)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("MemTotal: 4000 kB\nHugetlb:  2048 kB\nHugePages_Total: 9\n", 2048 * 1024),
        ("MemTotal: 4000 kB\nHugePages_Total:       4\nHugepagesize:       2048 kB\n", 4 * 2 * MiB),
        ("MemTotal: 4000 kB\n", 0),
    ],
)
def test_parse_hugetlb_bytes(text: str, expected: int) -> None:
    """Huge pages come from host.procfs's one meminfo parser (MemTotal is required there)."""
    assert parse_meminfo(text).hugetlb_bytes == expected


def test_huge_pages_of_the_root_count_against_commit_limit(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    write(root, "proc/meminfo", "MemTotal: 3995420 kB\nHugetlb: 2097152 kB\n")
    before = snapshot(root)
    with pytest.raises(RefusedError, match="2048 MiB huge pages"):
        apply_plan(make_plan(commit_charge_bytes=2 * GiB), OPTS, root)
    assert snapshot(root) == before


def test_write_tree_mirrors_destinations(tmp_path: Path) -> None:
    files = render_files(make_plan(), OPTS)
    written = write_tree(files, tmp_path / "out")
    assert len(written) == len(files) - 1  # everything but the admin token
    assert not (tmp_path / "out/etc/slmguard/admin-token").exists()
    assert (tmp_path / "out/etc/systemd/system/slmguard.service").is_file()
    assert (tmp_path / "out/etc/systemd/system/zramswap.service").readlink() == Path("/dev/null")
    # Writing again over the same tree works (review directories are re-rendered).
    again = write_tree(files, tmp_path / "out")
    assert again == written


def test_backups_live_outside_the_services_state_directory(tmp_path: Path) -> None:
    """systemd chowns StateDirectory= to the service user: backups must not be in it."""
    root = make_board_root(tmp_path / "root", "armbian")
    result = apply_plan(make_plan(), OPTS, root)
    assert result.manifest is not None
    assert not result.manifest.is_relative_to(root / "var/lib/slmguard")
    assert apply_dir(root).stat().st_mode & 0o777 == 0o700
    assert (apply_dir(root) / "backup/etc/fstab").stat().st_mode & 0o777 == 0o600


def test_plan_for_a_bigger_board_is_refused_on_this_root(tmp_path: Path) -> None:
    """The root's MemTotal (3.8 GiB here) bounds MemoryMax, whatever the plan's RAM says."""
    root = make_board_root(tmp_path / "root", "armbian")
    before = snapshot(root)
    eight = make_plan(
        ram_bytes=8 * GiB, memory_max_bytes=6 * GiB, memory_high_bytes=5 * GiB, cma_bytes=None
    )
    with pytest.raises(RefusedError, match="above this host's MemTotal 3902 MiB") as err:
        apply_plan(eight, OPTS, root)
    assert err.value.facts["host_mem_total_bytes"] == 3995420 * 1024
    assert snapshot(root) == before
    # Without /proc under the root (an SD card image), the plan's own RAM is the bound.
    (root / "proc/meminfo").unlink()
    assert apply_plan(eight, OPTS, root, dry_run=True).changes


def test_symlinked_directories_inside_the_root_are_followed(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    (root / "etc/sysctl.d").symlink_to("../usr/lib/sysctl.d")  # relative, stays inside
    (root / "usr/lib/sysctl.d").mkdir(parents=True)
    before = snapshot(root)
    apply_plan(make_plan(), OPTS, root)
    assert (root / "usr/lib/sysctl.d/99-slmguard.conf").is_file()
    rollback(root)
    assert snapshot(root) == before


def test_symlinked_directory_leaving_the_root_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "host-etc-sysctl.d"
    outside.mkdir()
    root = make_board_root(tmp_path / "root", "armbian")
    (root / "etc/sysctl.d").symlink_to(outside)  # absolute: would escape --root
    before = snapshot(root)
    with pytest.raises(RefusedError, match="outside"):
        apply_plan(make_plan(), OPTS, root)
    assert snapshot(root) == before and not any(outside.iterdir())


def test_post_command_failures_are_reported_not_raised() -> None:
    failed = hosttools.run_commands([("false",), ("/nonexistent/tool", "--x")])
    assert failed[0].startswith("false exited 1")
    assert failed[1].startswith("/nonexistent/tool --x:")


def test_boot_file_linking_outside_the_root_is_refused(tmp_path: Path) -> None:
    host_file = write(tmp_path, "host/armbianEnv.txt", ARMBIAN_ENV)
    root = make_board_root(tmp_path / "root", "armbian")
    (root / "boot/armbianEnv.txt").unlink()
    (root / "boot/armbianEnv.txt").symlink_to(host_file)
    before = snapshot(root)
    with pytest.raises(RefusedError, match="outside"):
        apply_plan(make_plan(), OPTS, root)
    assert snapshot(root) == before and host_file.read_text() == ARMBIAN_ENV


def test_atomic_writes_replace_whole_or_fail_cleanly(tmp_path: Path) -> None:
    w = writer.RootWriter(tmp_path)
    target = tmp_path / "etc/x.conf"
    target.parent.mkdir()
    w.write("/etc/x.conf", b"old\n")
    w.write("/etc/x.conf", b"new\n", mode=0o600)
    assert target.read_bytes() == b"new\n" and target.stat().st_mode & 0o777 == 0o600
    w.link("/link", "/etc/x.conf")
    w.link("/link", "/etc/y.conf")
    assert str((tmp_path / "link").readlink()) == "/etc/y.conf"
    # A directory in the way: the rename fails, nothing is left behind.
    busy = tmp_path / "busy"
    (busy / "inside").mkdir(parents=True)
    for attempt in (
        lambda: w.write("/busy", b"data"),
        lambda: w.link("/busy", "/etc/x.conf"),
    ):
        with pytest.raises(HostWriteError) as err:
            attempt()
        assert err.value.path == busy
        assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "etc", "link"]


def test_unreadable_destination_is_a_host_read_error(tmp_path: Path) -> None:
    # /proc/self/mem is a regular file whose read at offset 0 fails (EIO), even for root.
    with pytest.raises(HostReadError) as err:
        current_state(Path("/proc/self/mem"))
    assert err.value.path == Path("/proc/self/mem")
    absent = current_state(tmp_path / "absent")
    assert (absent.kind, absent.data, absent.link) == ("missing", None, None)


TOKEN = "etc/slmguard/admin-token"


def test_apply_creates_the_admin_token_once_and_rollback_removes_it(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    before = snapshot(root)

    dry = apply_plan(make_plan(), OPTS, root, dry_run=True)
    assert snapshot(root) == before
    assert "+++ b/etc/slmguard/admin-token" in dry.diff
    assert f"+<secret, {secret_file_bytes(32)} bytes>\n" in dry.diff

    first = apply_plan(make_plan(), OPTS, root)
    token_path = root / TOKEN
    token = token_path.read_bytes()
    assert token_path.stat().st_mode & 0o777 == 0o600
    assert len(token) == secret_file_bytes(32) == 44 and token.endswith(b"\n")
    assert re.fullmatch(rb"[A-Za-z0-9_-]{43}\n", token)
    assert "/etc/slmguard/admin-token" in {c.path for c in first.changes}
    # Nowhere in what apply shows or keeps: the diff, the manifest, the backups.
    secret = token.strip()
    assert secret.decode() not in first.diff
    assert f"<secret, {len(token)} bytes>" in first.diff
    for path in apply_dir(root).rglob("*"):
        assert path.is_dir() or secret not in path.read_bytes(), path

    applied = snapshot(root)
    second = apply_plan(make_plan(), OPTS, root)
    assert second.changes == () and snapshot(root) == applied
    assert token_path.read_bytes() == token
    # A changed plan rewrites the units but keeps the token.
    third = apply_plan(
        make_plan(memory_max_bytes=2 * GiB, memory_high_bytes=1536 * MiB), OPTS, root
    )
    assert "/etc/slmguard/admin-token" not in {c.path for c in third.changes}
    assert token_path.read_bytes() == token

    undone = rollback(root)
    assert "/etc/slmguard/admin-token" in undone.removed
    assert snapshot(root) == before and not token_path.exists()


def test_each_apply_makes_its_own_token(tmp_path: Path) -> None:
    roots = [make_board_root(tmp_path / f"root{i}", "armbian") for i in range(2)]
    for root in roots:
        apply_plan(make_plan(), OPTS, root)
    assert (roots[0] / TOKEN).read_bytes() != (roots[1] / TOKEN).read_bytes()


def test_an_existing_token_is_kept_and_survives_rollback(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    mine = write(root, TOKEN, "operator-chosen-token\n")
    mine.chmod(0o600)
    before = snapshot(root)
    result = apply_plan(make_plan(), OPTS, root)
    assert "/etc/slmguard/admin-token" not in {c.path for c in result.changes}
    assert "operator-chosen-token" not in result.diff
    assert not any("admin-token" in n for n in result.notes)
    assert mine.read_bytes() == b"operator-chosen-token\n"
    rollback(root)
    assert snapshot(root) == before


@pytest.mark.parametrize(
    ("content", "mode", "needle"),
    [
        ("", 0o600, "exists but is empty"),
        ("  \n", 0o600, "exists but is empty"),
        ("tok\n", 0o644, "readable by others (mode 0644): chmod 600"),
    ],
)
def test_a_token_that_will_not_work_or_leaks_is_kept_with_a_note(
    tmp_path: Path, content: str, mode: int, needle: str
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    token = write(root, TOKEN, content)
    token.chmod(mode)
    result = apply_plan(make_plan(), OPTS, root, dry_run=True)
    assert any(needle in n for n in result.notes), result.notes
    assert "/etc/slmguard/admin-token" not in {c.path for c in result.changes}


def test_a_directory_where_the_token_goes_is_refused(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    (root / TOKEN).mkdir(parents=True)
    before = snapshot(root)
    with pytest.raises(RefusedError, match="is a directory"):
        apply_plan(make_plan(), OPTS, root)
    assert snapshot(root) == before


def test_rollback_puts_the_running_sysctls_back(tmp_path: Path) -> None:
    """Deleting the sysctl file does not reset the kernel: rollback writes the old values."""
    root = make_board_root(tmp_path / "root", ALL_BOARDS[0])
    running = {"vm/swappiness": "60", "vm/overcommit_memory": "0", "vm/overcommit_ratio": "50"}
    for rel, value in running.items():
        write(root, f"proc/sys/{rel}", value + "\n")
    apply_plan(make_plan(), OPTS, root)
    manifest = json.loads((apply_dir(root) / "manifest.json").read_text())
    assert manifest["sysctl_before"] == {
        "vm.swappiness": "60",
        "vm.overcommit_memory": "0",
        "vm.overcommit_ratio": "50",
    }
    # What `sysctl --system` does on a real root after apply:
    for rel, value in {"vm/swappiness": "0", "vm/overcommit_memory": "2"}.items():
        write(root, f"proc/sys/{rel}", value + "\n")
    # A second apply keeps the first record.
    apply_plan(make_plan(), OPTS, root)
    undone = rollback(root)
    assert set(undone.sysctls_restored) == {
        "vm.swappiness",
        "vm.overcommit_memory",
        "vm.overcommit_ratio",
    }
    for rel, value in running.items():
        assert (root / "proc/sys" / rel).read_text() == value + "\n"


READ_ONLY_SYSFS = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")


@pytest.mark.skipif(not READ_ONLY_SYSFS.is_file(), reason="needs a read-only sysfs file")
def test_rollback_reports_a_sysctl_it_cannot_write_back(tmp_path: Path) -> None:
    """A kernel that refuses the old value is reported; the other values still go back."""
    root = make_board_root(tmp_path / "root", ALL_BOARDS[0])
    write(root, "proc/sys/vm/swappiness", "60\n")
    write(root, "proc/sys/vm/overcommit_memory", "0\n")
    apply_plan(make_plan(), OPTS, root)
    # Now the running swappiness cannot be written (even root gets EACCES there).
    target = root / "proc/sys/vm/swappiness"
    target.unlink()
    target.symlink_to(READ_ONLY_SYSFS)
    undone = rollback(root)
    assert undone.sysctls_restored == ("vm.overcommit_memory",)
    (failure,) = [f for f in undone.failed_commands if "swappiness" in f]
    assert failure.startswith("vm.swappiness=60: ")
    assert (root / "proc/sys/vm/overcommit_memory").read_text() == "0\n"


def test_rollback_leaves_a_root_without_proc_sys_alone(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", ALL_BOARDS[0])
    before = snapshot(root)
    apply_plan(make_plan(), OPTS, root)
    undone = rollback(root)
    assert undone.sysctls_restored == ()
    assert snapshot(root) == before  # no /proc/sys files were made up


def test_sysctl_keys_of_a_conf_file() -> None:
    from slmguard.deploy.system import sysctl_keys

    text = "# c\n; c\nvm.swappiness = 0\n-kernel.x=1\nnot a setting\n\nvm.a.b=2\n"
    assert sysctl_keys(text) == ["vm.swappiness", "kernel.x", "vm.a.b"]


def test_a_dropped_protect_drop_in_is_removed_and_rollback_still_restores(
    tmp_path: Path,
) -> None:
    """`apply --protect nginx.service`, then `apply` without it: the drop-in goes."""
    root = make_board_root(tmp_path / "root", "armbian")
    before = snapshot(root)
    apply_plan(make_plan(), OPTS, root)
    dropin = "/etc/systemd/system/nginx.service.d/50-slmguard-protect.conf"
    assert (root / dropin.lstrip("/")).is_file()
    unprotected = RenderOptions(exec_path="/usr/bin/slmguard")
    dry = apply_plan(make_plan(), unprotected, root, dry_run=True)
    assert [r.path for r in dry.removals] == [dropin] and dry.changes == ()
    assert f"--- a{dropin}\n+++ /dev/null\n" in dry.diff and "-Slice=business.slice\n" in dry.diff
    result = apply_plan(make_plan(), unprotected, root)
    assert [r.path for r in result.removals] == [dropin] and result.changed
    assert not (root / dropin.lstrip("/")).exists()
    assert not apply_plan(make_plan(), unprotected, root).changed
    rollback(root)
    assert snapshot(root) == before


def test_a_file_that_existed_before_apply_is_not_removed_as_stale(tmp_path: Path) -> None:
    """Only what apply created goes when it is dropped; the rest waits for rollback."""
    root = make_board_root(tmp_path / "root", "armbian")
    mine = write(root, "etc/systemd/system/redis.service.d/50-slmguard-protect.conf", "[Service]\n")
    before = snapshot(root)
    apply_plan(make_plan(), RenderOptions(exec_path="/usr/bin/x", protect=("redis.service",)), root)
    result = apply_plan(make_plan(), RenderOptions(exec_path="/usr/bin/x"), root)
    assert result.removals == () and "Slice=business.slice" in mine.read_text()
    rollback(root)
    assert snapshot(root) == before
