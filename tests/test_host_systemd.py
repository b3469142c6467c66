"""host.systemd: unit parser, drop-ins, misplaced keys, value parsers, systemctl show."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hostboards import HARDENED_UNIT, SEED_UNIT
from hosttree import build_tree
from slmguard.errors import HostReadError
from slmguard.host import systemd
from waiting import scaled

MIB = 1024 * 1024


def test_parse_sections_comments_continuation(tmp_path: Path) -> None:
    text = (
        "Orphan=1\n[Unit]\n# comment\n; other comment\nDescription = a \\\n"
        "  long one\nAfter=a.target\n[Service]\nExecStart=/bin/x \\\n# skipped\n  --flag\n"
        "Environment=A=1\nEnvironment=B=2\nNoEquals\n"
    )
    entries = systemd.parse_unit_text(text, tmp_path / "x.service")
    got = [(e.section, e.key, e.value, e.lineno) for e in entries]
    assert got == [
        ("Unit", "Description", "a  long one", 5),
        ("Unit", "After", "a.target", 7),
        ("Service", "ExecStart", "/bin/x  --flag", 9),
        ("Service", "Environment", "A=1", 12),
        ("Service", "Environment", "B=2", 13),
    ]


def test_empty_assignment_resets_list(tmp_path: Path) -> None:
    root = build_tree(
        tmp_path,
        {
            "lib/systemd/system/a.service": "[Service]\nExecStart=/old\nMemoryMax=1G\n",
            "etc/systemd/system/a.service.d/10-new.conf": "[Service]\nExecStart=\n"
            "ExecStart=/new --host 0.0.0.0\n",
            "lib/systemd/system/a.service.d/20-mem.conf": "[Service]\nMemoryMax=2G\n",
            "lib/systemd/system/a.service.d/10-new.conf": "[Service]\nExecStart=/vendor\n",
        },
    )
    unit = systemd.load_unit(root, "a")
    assert unit.values("Service", "ExecStart") == ("/new --host 0.0.0.0",)
    assert unit.get("Service", "MemoryMax") == "2G"
    # /etc's 10-new.conf hides /lib's file of the same name; order is by file name.
    assert [p.relative_to(root).as_posix() for p in unit.dropins] == [
        "etc/systemd/system/a.service.d/10-new.conf",
        "lib/systemd/system/a.service.d/20-mem.conf",
    ]
    entry = unit.entry("Service", "MemoryMax")
    assert entry is not None and entry.where.endswith("20-mem.conf:2")


def test_load_by_file_and_missing(tmp_path: Path) -> None:
    unit = systemd.load_unit(tmp_path, str(SEED_UNIT))
    assert unit.name == "slm_inference.service" and unit.get("Service", "User") == "root"
    with pytest.raises(HostReadError, match="unit not installed"):
        systemd.load_unit(tmp_path, "nope.service")
    with pytest.raises(HostReadError, match="missing"):
        systemd.load_unit(tmp_path, str(tmp_path / "gone.service"))


def test_seed_unit_misplaced_keys() -> None:
    unit = systemd.load_unit(Path("/"), str(SEED_UNIT))
    wrong = {
        (m.entry.key, m.entry.section, m.belongs_in, m.ignored)
        for m in systemd.misplaced_keys(unit)
    }
    assert wrong == {
        ("StartLimitIntervalSec", "Service", "Unit", True),
        ("StartLimitBurst", "Service", "Unit", False),
    }


def test_hardened_unit_has_no_misplaced_keys(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"etc/systemd/system/slmguard.service": HARDENED_UNIT})
    assert systemd.misplaced_keys(systemd.load_unit(root, "slmguard.service")) == ()


def test_service_keys_in_unit_section_are_ignored(tmp_path: Path) -> None:
    text = "[Unit]\nMemoryMax=1G\nCPUAffinity=4\n[Service]\nAfter=x\n[Slice]\nMemoryMax=2G\n"
    unit = systemd.UnitFile("x", tmp_path, systemd.parse_unit_text(text, tmp_path))
    assert {(m.entry.key, m.entry.section) for m in systemd.misplaced_keys(unit)} == {
        ("MemoryMax", "Unit"),
        ("CPUAffinity", "Unit"),
        ("After", "Service"),
    }


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_misplaced_agrees_with_systemd_analyze(tmp_path: Path) -> None:
    """Our table of ignored keys matches what systemd itself reports for the seed unit."""
    unit_file = tmp_path / "slm_inference.service"
    unit_file.write_text(SEED_UNIT.read_text())
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit_file)],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        check=False,
    )
    reported = systemd.unknown_keys(done.stderr)
    unit = systemd.load_unit(tmp_path, str(unit_file))
    ours = systemd.ignored_keys(unit)
    assert ours == reported == {"StartLimitIntervalSec"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2600M", 2600 * MIB), ("2G", 2048 * MIB), ("1048576", MIB), ("infinity", None),
     ("50%", 4 * 1024 * MIB), ("1.5K", 1536)],
)  # fmt: skip
def test_parse_size(value: str, expected: int | None) -> None:
    assert systemd.parse_size(value, ram_bytes=8 * 1024 * MIB) == expected


@pytest.mark.parametrize("value", ["lots", "2X", ""])
def test_parse_size_rejects(value: str) -> None:
    with pytest.raises(ValueError):
        systemd.parse_size(value)
    with pytest.raises(ValueError, match="RAM is unknown"):
        systemd.parse_size("10%")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("60s", 60.0), ("60", 60.0), ("1min 30s", 90.0), ("5min", 300.0), ("500ms", 0.5),
     ("1h", 3600.0)],
)  # fmt: skip
def test_parse_timespan(value: str, seconds: float) -> None:
    assert systemd.parse_timespan_s(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 fortnights", "1min!"])
def test_parse_timespan_rejects(value: str) -> None:
    with pytest.raises(ValueError):
        systemd.parse_timespan_s(value)


def test_parse_cpu_set() -> None:
    assert systemd.parse_cpu_set("4 5 6 7") == (4, 5, 6, 7)
    assert systemd.parse_cpu_set("4-7") == (4, 5, 6, 7)
    assert systemd.parse_cpu_set("0,2-3 6") == (0, 2, 3, 6)
    with pytest.raises(ValueError):
        systemd.parse_cpu_set("big")


def test_exec_argv_strips_prefixes() -> None:
    assert systemd.exec_argv("-/usr/bin/x --host '0.0.0.0' -p 1") == (
        "/usr/bin/x", "--host", "0.0.0.0", "-p", "1",
    )  # fmt: skip
    assert systemd.exec_argv('/bin/x "unclosed') == ("/bin/x", '"unclosed')


def test_parse_show_and_not_pid1(tmp_path: Path) -> None:
    props = systemd.parse_show("MemoryMax=2936012800\nMemoryHigh=infinity\nUser=\n")
    assert props == {"MemoryMax": "2936012800", "MemoryHigh": "infinity", "User": ""}
    # A fixture root is never queried through the live systemctl.
    root = build_tree(tmp_path, {"run/systemd/system": None})
    assert systemd.systemd_is_pid1(root)
    assert systemd.show_unit("slmguard.service", root) is None


def test_show_unit_live_without_systemd() -> None:
    if systemd.systemd_is_pid1(Path("/")):
        pytest.skip("systemd is PID 1 here; covered by the doctor live test")
    assert systemd.show_unit("ssh.service") is None


def test_systemd_analyze_output_parsers() -> None:
    """Lines as systemd 252's ``systemd-analyze verify`` / ``security`` print them."""
    verify = (
        "/tmp/x/slm_inference.service:17: Unknown key 'StartLimitIntervalSec' in section "
        "[Service], ignoring.\n"
        "/tmp/x/y.service:3: Unknown key 'MemoryMax' in section [Unit], ignoring.\n"
        "slm_inference.service: Command /opt/x is not executable: No such file or directory\n"
    )
    assert systemd.unknown_keys(verify) == {"StartLimitIntervalSec", "MemoryMax"}
    assert systemd.unknown_keys("") == frozenset()
    exposure = systemd.parse_exposure(
        "  ✗ PrivateNetwork=  Service has access to the host's network  0.5\n\n"
        "→ Overall exposure level for slm_inference.service: 9.6 UNSAFE 😨\n"
    )
    assert exposure == systemd.Exposure(9.6, "UNSAFE") and str(exposure) == "9.6 UNSAFE"
    assert systemd.parse_exposure("Failed to load unit\n") is None
    assert systemd.ignored_keys(systemd.load_unit(Path("/"), str(SEED_UNIT))) == {
        "StartLimitIntervalSec"
    }


def test_service_environment_quotes_and_last_wins(tmp_path: Path) -> None:
    text = (
        '[Service]\nEnvironment=A=1 "B=two words"\nEnvironment=A=3 NOEQUALS\n'
        "EnvironmentFile=/etc/default/x\n[Unit]\nEnvironment=C=ignored\n"
    )
    unit = systemd.UnitFile("x", tmp_path, systemd.parse_unit_text(text, tmp_path))
    assert systemd.service_environment(unit) == {"A": "3", "B": "two words"}
