"""doctor checks on fixture trees: boards, cgroup versions, the seed unit, broken files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cgrouptrees import TREES
from hostboards import (
    ARMBIAN_ENV_HARDENED,
    GIB,
    HARDENED_UNIT,
    JETSON,
    MIB,
    RK3588_HARDENED,
    RK3588_STOCK,
    SEED_UNIT,
    meminfo,
    plan_for_rk3588,
)
from hosttree import Link, Tree, build_tree, copy_captured
from slmguard import doctor
from slmguard.host.snapshot import collect
from slmguard.plan.planfile import dumps_plan
from slmguard.plan.schema import EngineSettings, Plan

UNIT_PATH = "etc/systemd/system/slmguard.service"


def audit(
    tmp_path: Path, tree: Tree, plan: Plan | None = None, unit: str | None = None
) -> dict[str, doctor.Finding]:
    root = build_tree(tmp_path / "root", tree)
    report = doctor.run_checks(collect(root, unit=unit), plan)
    return {f.id: f for f in report.findings}


def severities(findings: dict[str, doctor.Finding]) -> dict[str, str]:
    return {k: f.severity for k, f in findings.items()}


def test_hardened_rk3588_passes_everything(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_HARDENED)
    report = doctor.run_checks(collect(root), plan_for_rk3588())
    bad = {f.id: f.summary for f in report.findings if f.severity != doctor.PASS}
    assert bad == {}
    assert report.exit_code() == 0


def test_stock_rk3588_fails_what_the_source_document_warns_about(tmp_path: Path) -> None:
    sev = severities(audit(tmp_path, RK3588_STOCK, plan_for_rk3588()))
    assert {k for k, v in sev.items() if v == doctor.FAIL} == {
        "swap.off",
        "swap.boot",
        "zram.off",
        "zram.boot",
        "cma.size",
    }
    assert sev["vm.swappiness"] == sev["vm.overcommit"] == doctor.WARN
    assert sev["unit.memory"] == doctor.UNKNOWN  # no unit installed


def test_stock_fixes_are_exact(tmp_path: Path) -> None:
    f = audit(tmp_path, RK3588_STOCK, plan_for_rk3588())
    assert f["swap.off"].fix == "swapoff -a"
    assert f["swap.boot"].fix == "sed -i '2s/^/# /' /etc/fstab"
    assert f["zram.off"].fix == "swapoff /dev/zram0; echo 1 > /sys/block/zram0/reset"
    assert "ENABLED=false in /etc/default/armbian-zram-config" in (f["zram.boot"].fix or "")
    assert "`cma=2048M`" in (f["cma.size"].fix or "")
    assert "/boot/armbianEnv.txt" in (f["cma.size"].fix or "")
    assert f["vm.swappiness"].fix == (
        "sysctl -w vm.swappiness=0 && echo 'vm.swappiness = 0' >> /etc/sysctl.d/99-slmguard.conf"
    )
    # Evidence names the file each value came from.
    (ev,) = [e for e in f["vm.swappiness"].evidence]
    assert ev.value == "100" and ev.source.endswith("proc/sys/vm/swappiness")
    assert {e.label for e in f["swap.off"].evidence} == {"/dev/zram0", "/swapfile"}


def test_jetson(tmp_path: Path) -> None:
    f = audit(tmp_path, JETSON)
    sev = severities(f)
    assert sev["zram.off"] == sev["zram.boot"] == sev["swap.off"] == doctor.FAIL
    assert "nvzramconfig.service" in (f["zram.boot"].fix or "")
    assert "/dev/nvmap" in f["npu.devices"].summary
    assert f["board.model"].summary == "NVIDIA Jetson Orin Nano Developer Kit"
    assert sev["dmabuf.total"] == doctor.UNKNOWN  # no debugfs in the tree
    assert sev["memory.available"] == sev["memlock.weights"] == doctor.UNKNOWN  # no plan


@pytest.mark.parametrize(("version", "severity"), [(2, doctor.PASS), (1, doctor.WARN)])
def test_cgroup_versions(tmp_path: Path, version: int, severity: str) -> None:
    tree = {**RK3588_HARDENED, **TREES[version]}
    f = audit(tmp_path, tree)["cgroup.v2-memory"]
    assert f.severity == severity
    if version == 1:
        assert "MemoryHigh=" in f.summary and "memory.pressure" in f.summary
        assert "systemd.unified_cgroup_hierarchy=1" in (f.fix or "")


def test_no_memory_controller_fails(tmp_path: Path) -> None:
    tree = {**RK3588_HARDENED, "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io pids\n"}
    f = audit(tmp_path, tree)["cgroup.v2-memory"]
    assert f.severity == doctor.FAIL and "cgroup_enable=memory" in (f.fix or "")


def test_memory_high_on_v1_warns(tmp_path: Path) -> None:
    tree = {**RK3588_HARDENED, **TREES[1]}
    f = audit(tmp_path, tree, plan_for_rk3588())["unit.memory"]
    assert f.severity == doctor.WARN and "ignored on cgroup v1" in f.summary


def test_seed_unit_is_flagged(tmp_path: Path) -> None:
    f = audit(tmp_path, RK3588_HARDENED, plan_for_rk3588(), unit=str(SEED_UNIT))
    sections = f["unit.sections"]
    assert sections.severity == doctor.FAIL
    assert "StartLimitIntervalSec in [Service]" in sections.summary
    assert any(e.source.endswith("slm_inference.service:17") for e in sections.evidence)
    assert "move `StartLimitIntervalSec=60s` from [Service] to [Unit]" in (sections.fix or "")
    assert f["unit.user"].severity == doctor.WARN and "root" in f["unit.user"].summary
    bind = f["unit.bind"]
    assert bind.severity == doctor.FAIL and "0.0.0.0" in bind.summary
    assert any("llama-cli is the interactive client" in e.value for e in bind.evidence)
    # With the interval dropped, 3 starts 5 s apart never fit in systemd's 10 s default.
    assert f["unit.start-limit"].severity == doctor.FAIL
    # MemoryMax=2800M is below this plan's 5600M for an 8 GB board.
    assert f["unit.memory"].severity == doctor.WARN
    assert f["unit.oom-score"].severity == doctor.PASS
    assert f["cpu.affinity"].severity == doctor.PASS  # 4-7 are the big cores here


def test_seed_unit_on_a_two_core_host_cannot_start(tmp_path: Path) -> None:
    tree = {**RK3588_HARDENED, "sys/devices/system/cpu/online": "0-1\n"}
    f = audit(tmp_path, tree, unit=str(SEED_UNIT))["cpu.affinity"]
    assert f.severity == doctor.FAIL and "fails to start" in f.summary


def _with_unit(text: str) -> Tree:
    return {**RK3588_HARDENED, UNIT_PATH: text}


@pytest.mark.parametrize(
    ("old", "new", "check", "severity", "phrase"),
    [
        ("MemoryMax=5600M\n", "", "unit.memory", doctor.FAIL, "no MemoryMax"),
        ("MemoryMax=5600M", "MemoryMax=7000M", "unit.memory", doctor.FAIL, "exceeds"),
        ("MemoryMax=5600M", "MemoryMax=infinity", "unit.memory", doctor.FAIL, "no MemoryMax"),
        ("MemoryHigh=5000M\n", "", "unit.memory", doctor.WARN, "no MemoryHigh"),
        ("MemoryHigh=5000M", "MemoryHigh=6000M", "unit.memory", doctor.WARN, "no throttling"),
        # slmguard serve: the front may sit low because its worker raises itself to 1000.
        ("OOMScoreAdjust=100", "OOMScoreAdjust=-500", "unit.oom-score", doctor.WARN, "OOMPolicy"),
        (
            "OOMScoreAdjust=100",
            "OOMScoreAdjust=-500\nOOMPolicy=continue",
            "unit.oom-score",
            doctor.PASS,
            "the engine is the victim",
        ),
        (
            "OOMScoreAdjust=100\nCPUAffinity=4-7\nUser=slmguard\n",
            "OOMScoreAdjust=-500\nCPUAffinity=4-7\nUser=slmguard\nExecStart=\n"
            "ExecStart=/usr/bin/llama-server -m /m.gguf\n",
            "unit.oom-score",
            doctor.WARN,
            "protects",
        ),
        (
            "OOMScoreAdjust=100\nCPUAffinity=4-7\nUser=slmguard\n",
            "CPUAffinity=4-7\nUser=slmguard\nExecStart=\nExecStart=/usr/bin/llama-server\n",
            "unit.oom-score",
            doctor.WARN,
            "not set",
        ),
        ("CPUAffinity=4-7", "CPUAffinity=0-7", "cpu.affinity", doctor.WARN, "non-big cores 0"),
        ("CPUAffinity=4-7\n", "", "cpu.affinity", doctor.WARN, "little cores"),
        ("User=slmguard\n", "", "unit.user", doctor.WARN, "root"),
        ("Restart=on-failure\n", "", "unit.start-limit", doctor.FAIL, "stays down"),
        # Without the interval systemd's 10 s applies; 3 starts 5 s apart never fit in it.
        ("StartLimitIntervalSec=60\n", "", "unit.start-limit", doctor.FAIL, "never"),
        (
            "StartLimitIntervalSec=60\nStartLimitBurst=3\n",
            "",
            "unit.start-limit",
            doctor.FAIL,
            "5 starts can never",
        ),
        ("RestartSec=5\n", "RestartSec=30\n", "unit.start-limit", doctor.FAIL, "never"),
        (
            "serve --plan",
            "serve --host 0.0.0.0 --plan",
            "unit.bind",
            doctor.FAIL,
            "no API key",
        ),
        (
            "serve --plan",
            "serve --host=0.0.0.0 --api-key-file /etc/slmguard/key --plan",
            "unit.bind",
            doctor.PASS,
            "with an API key",
        ),
        (
            "User=slmguard\n",
            "User=slmguard\nEnvironment=SLMGUARD_HOST=192.168.1.5\n"
            "EnvironmentFile=-/etc/slmguard/env\n",
            "unit.bind",
            doctor.WARN,
            "EnvironmentFile",
        ),
        ("serve --plan", "serve --host ::1 --plan", "unit.bind", doctor.PASS, "loopback"),
        (
            "[Install]",
            "[Install]\nMemoryMax=1G",
            "unit.sections",
            doctor.FAIL,
            "MemoryMax in [Install]",
        ),
    ],
)
def test_unit_variants(
    tmp_path: Path, old: str, new: str, check: str, severity: str, phrase: str
) -> None:
    assert old in HARDENED_UNIT
    f = audit(tmp_path, _with_unit(HARDENED_UNIT.replace(old, new)), plan_for_rk3588())[check]
    assert (f.severity, phrase in f.summary) == (severity, True), f.summary


def test_dropin_overrides_unit(tmp_path: Path) -> None:
    tree = {
        **RK3588_HARDENED,
        "etc/systemd/system/slmguard.service.d/override.conf": "[Service]\nMemoryMax=9G\n",
    }
    f = audit(tmp_path, tree, plan_for_rk3588())["unit.memory"]
    assert f.severity == doctor.FAIL
    assert any(e.source.endswith("override.conf:2") for e in f.evidence)


def test_overcommit_mode2_without_headroom_fails_with_a_ratio_fix(tmp_path: Path) -> None:
    # CommitLimit 6395200 kB, Committed_AS 4.5 GB: 1.6 GiB left, the plan commits 3 GiB.
    tree = {
        **RK3588_HARDENED,
        "proc/meminfo": meminfo(7_994_000, 3_000_000, 6_395_200, 4_700_000, cma_kb=2_097_152),
    }
    f = audit(tmp_path, tree, plan_for_rk3588())["vm.overcommit"]
    assert f.severity == doctor.FAIL and "cannot" not in f.summary and "ENOMEM" in f.summary
    # (4_700_000 kB + 3 GiB) / 7_994_000 kB = 98.2% -> 99
    assert f.fix is not None and "vm.overcommit_ratio=99" in f.fix


def _running_service(pids_maps: dict[int, str]) -> dict[str, str]:
    """The unit's cgroup (v2, slmguard.slice) listing ``pids``, each with its maps."""
    cg = "sys/fs/cgroup/slmguard.slice/slmguard.service"
    tree = {
        f"{cg}/cgroup.procs": "".join(f"{p}\n" for p in pids_maps),
        f"{cg}/memory.current": "1\n",
    }
    tree.update({f"proc/{pid}/maps": maps for pid, maps in pids_maps.items()})
    return tree


# 1 GiB private writable (charged), 256 MiB read-only private and 512 MiB shared
# writable (neither charged); the second process 512 MiB private writable.
ENGINE_MAPS = (
    "7f0000000000-7f0040000000 rw-p 00000000 00:00 0 \n"
    "7f0040000000-7f0050000000 r--p 00000000 fd:01 42 /models/m.gguf\n"
    "7f0050000000-7f0070000000 rw-s 00000000 00:01 7 /dev/shm/x\n"
    "garbage line\n"
)
FRONT_MAPS = "55d000000000-55d020000000 rw-p 00000000 00:00 0 [heap]\n"


def test_overcommit_counts_what_the_running_service_holds(tmp_path: Path) -> None:
    # 1.6 GiB left and the plan commits 3 GiB, but the running service holds 1.5 GiB
    # of Committed_AS that its restart gives back: 3.1 GiB, enough.
    tree = {
        **RK3588_HARDENED,
        "proc/meminfo": meminfo(7_994_000, 3_000_000, 6_395_200, 4_700_000, cma_kb=2_097_152),
        **_running_service({4242: ENGINE_MAPS, 4243: FRONT_MAPS}),
    }
    f = audit(tmp_path, tree, plan_for_rk3588())["vm.overcommit"]
    assert f.severity == doctor.PASS, f.summary
    held = next(e for e in f.evidence if e.label.startswith("committed by the running"))
    assert held.value == "1536 MiB" and "2 processes" in held.label
    # Without the service's processes the same board fails (the test above).
    tree = {**tree, **_running_service({4242: "", 4243: ""})}
    f = audit(tmp_path / "empty", tree, plan_for_rk3588())["vm.overcommit"]
    assert f.severity == doctor.FAIL and "running service" not in f.summary


def test_overcommit_impossible_suggests_freeing(tmp_path: Path) -> None:
    tree = {
        **RK3588_HARDENED,
        "proc/meminfo": meminfo(7_994_000, 1_000_000, 6_395_200, 6_300_000, cma_kb=2_097_152),
    }
    f = audit(tmp_path, tree, plan_for_rk3588())["vm.overcommit"]
    assert f.severity == doctor.FAIL and "free committed memory" in (f.fix or "")


def test_overcommit_ratio_mismatch_warns(tmp_path: Path) -> None:
    tree = {**RK3588_HARDENED, "proc/sys/vm/overcommit_ratio": "50\n"}
    f = audit(tmp_path, tree)["vm.overcommit"]
    assert f.severity == doctor.WARN and "overcommit_ratio is 50" in f.summary


def test_memlock(tmp_path: Path) -> None:
    locked = plan_for_rk3588(
        engine=EngineSettings(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=4, use_mlock=True)
    )
    f = audit(tmp_path / "a", RK3588_HARDENED, locked)["memlock.weights"]
    assert f.severity == doctor.FAIL and "LimitMEMLOCK" in f.summary
    assert f.fix == "set LimitMEMLOCK=555M in the [Service] section"
    ok = _with_unit(HARDENED_UNIT.replace("User=slmguard", "User=slmguard\nLimitMEMLOCK=6G"))
    assert audit(tmp_path / "b", ok, locked)["memlock.weights"].severity == doctor.PASS
    as_root = _with_unit(HARDENED_UNIT.replace("User=slmguard\n", ""))
    assert "root" in audit(tmp_path / "c", as_root, locked)["memlock.weights"].summary
    no_unit = {k: v for k, v in RK3588_HARDENED.items() if "slmguard.service" not in k}
    f = audit(tmp_path / "d", no_unit, locked)["memlock.weights"]
    assert f.severity == doctor.FAIL and "memlock limit 8 MiB" in f.summary
    assert audit(tmp_path / "e", RK3588_HARDENED)["memlock.weights"].severity == doctor.UNKNOWN


def test_free_memory(tmp_path: Path) -> None:
    low = {
        **RK3588_HARDENED,
        "proc/meminfo": meminfo(7_994_000, 5_300_000, 6_395_200, 1_500_000, cma_kb=2_097_152),
    }
    assert audit(tmp_path / "a", low, plan_for_rk3588())["memory.available"].severity == "warn"
    lower = {
        **RK3588_HARDENED,
        "proc/meminfo": meminfo(7_994_000, 2_000_000, 6_395_200, 1_500_000, cma_kb=2_097_152),
    }
    assert audit(tmp_path / "b", lower, plan_for_rk3588())["memory.available"].severity == "fail"
    small = {
        **RK3588_HARDENED,
        "proc/meminfo": meminfo(3_900_000, 3_500_000, 3_100_000, 500_000, cma_kb=2_097_152),
    }
    f = audit(tmp_path / "c", small, plan_for_rk3588())["memory.available"]
    assert f.severity == "fail" and "the plan is for rk3588-8g" in f.summary


def test_dphys_swapfile_comes_back_at_boot(tmp_path: Path) -> None:
    unit = "dphys-swapfile.service"
    tree = {
        **RK3588_HARDENED,
        f"lib/systemd/system/{unit}": "[Unit]\nDescription=dphys-swapfile\n",
        f"etc/systemd/system/multi-user.target.wants/{unit}": Link(f"/lib/systemd/system/{unit}"),
    }
    f = audit(tmp_path / "a", tree)["swap.boot"]
    assert f.severity == doctor.FAIL and "dphys-swapfile creates a swap file" in f.summary
    assert f.fix == f"systemctl disable --now {unit} && systemctl mask {unit}"
    masked = {**tree, f"etc/systemd/system/{unit}": Link("/dev/null")}
    assert audit(tmp_path / "b", masked)["swap.boot"].severity == doctor.PASS


def test_cma(tmp_path: Path) -> None:
    big = {
        **RK3588_HARDENED,
        "proc/meminfo": meminfo(7_994_000, 7_100_000, 6_395_200, 1_500_000, cma_kb=5_000_000),
    }
    assert audit(tmp_path / "a", big)["cma.size"].severity == doctor.WARN
    pending = {
        **RK3588_HARDENED,
        "boot/armbianEnv.txt": ARMBIAN_ENV_HARDENED.replace("cma=2048M", "cma=3072M"),
    }
    f = audit(tmp_path / "b", pending)["cma.size"]
    assert f.severity == doctor.WARN and "reboot pending" in f.summary
    no_cma = {
        **RK3588_HARDENED,
        "proc/meminfo": meminfo(7_994_000, 7_100_000, 6_395_200, 1_500_000),
    }
    f = audit(tmp_path / "c", no_cma, plan_for_rk3588())["cma.size"]
    assert f.severity == doctor.FAIL and "no CMA" in f.summary


def test_npu_node_missing_fails(tmp_path: Path) -> None:
    tree = {k: v for k, v in RK3588_HARDENED.items() if k != "dev/dri/renderD129"}
    f = audit(tmp_path, tree, plan_for_rk3588())["npu.devices"]
    assert f.severity == doctor.FAIL and "/dev/dri/renderD129" in f.summary
    assert "reserves 1024 MiB" in f.summary


def test_dmabuf_over_reserve_warns(tmp_path: Path) -> None:
    plan = plan_for_rk3588()
    small = dataclasses.replace(plan, board=dataclasses.replace(plan.board, npu_reserve_bytes=MIB))
    assert audit(tmp_path, RK3588_HARDENED, small)["dmabuf.total"].severity == doctor.WARN


def test_psi_missing_warns(tmp_path: Path) -> None:
    tree = {k: v for k, v in RK3588_HARDENED.items() if "pressure" not in k}
    f = audit(tmp_path, tree)["psi.memory"]
    assert f.severity == doctor.WARN and f.fix is not None and "psi=1" in f.fix


# ------------------------------------------------------------- never crash


BROKEN: dict[str, Tree] = {
    "empty": {},
    "garbled": {
        "proc/meminfo": "MemTotal: 100 kB\n",
        "proc/swaps": "\x00\x01 garbage",
        "proc/sys/vm/swappiness": "sixty\n",
        "proc/sys/vm/overcommit_memory": "\n",
        "proc/cmdline": "cma=lots",
        "proc/self/cgroup": "::::\n",
        "proc/self/mountinfo": "- - -\n",
        "proc/self/limits": "nonsense",
        "proc/pressure/memory": "some avg10=x\n",
        "sys/block/zram0/disksize": "",
        "sys/devices/system/cpu/online": "0-x",
        "sys/kernel/debug/dma_buf/bufinfo": "??",
        "boot/armbianEnv.txt": "this is not key value\n",
        "etc/fstab": "\x00",
        UNIT_PATH: "[Service\nMemoryMax=lots\nOOMScoreAdjust=high\n[Service]\nCPUAffinity=x\n"
        "MemoryMax=lots\nOOMScoreAdjust=high\nExecStart='\nStartLimitBurst=z\nRestartSec=soon\n",
    },
    "truncated": {
        k: (v[: len(v) // 2] if isinstance(v, str) else v) for k, v in RK3588_HARDENED.items()
    },
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_trees_never_crash(tmp_path: Path, name: str) -> None:
    root = build_tree(tmp_path, BROKEN[name])
    report = doctor.run_checks(collect(root), plan_for_rk3588())
    assert len(report.findings) == len(doctor.CHECKS)
    for f in report.findings:
        assert f.severity in doctor.SEVERITIES
        if f.severity == doctor.UNKNOWN:
            assert f.summary  # says why
    if name == "empty":
        assert "could not read" in {f.id: f for f in report.findings}["swap.off"].summary
        assert len(report.not_seen) >= 5


def test_garbled_values_are_unknown_with_the_reason(tmp_path: Path) -> None:
    f = audit(tmp_path, BROKEN["garbled"])
    assert f["vm.swappiness"].severity == doctor.UNKNOWN
    assert "not an integer" in f["vm.swappiness"].summary
    assert f["zram.off"].severity == doctor.UNKNOWN
    assert f["cma.size"].severity == doctor.PASS  # MemTotal read; cma= garbage shown as evidence
    assert any("unparsable" in e.value for e in f["cma.size"].evidence)


def test_captured_this_machine(tmp_path: Path) -> None:
    root = copy_captured("thismachine", tmp_path)
    report = doctor.run_checks(collect(root), None)
    f = {x.id: x for x in report.findings}
    assert f["swap.off"].severity == doctor.PASS
    assert f["zram.off"].severity == doctor.PASS  # zram0 exists with disksize 0
    assert f["vm.swappiness"].severity == doctor.WARN  # 60 here
    assert f["cgroup.v2-memory"].severity == doctor.WARN  # hybrid: memory on v1
    assert report.exit_code() == 1
    assert report.exit_code(strict=True) == 1


def test_no_start_limit_and_fast_restart_warns(tmp_path: Path) -> None:
    text = HARDENED_UNIT.replace("StartLimitIntervalSec=60\nStartLimitBurst=3\n", "")
    text = text.replace("RestartSec=5\n", "")
    f = audit(tmp_path, _with_unit(text), plan_for_rk3588())["unit.start-limit"]
    assert f.severity == doctor.WARN and "defaults" in f.summary


def test_exit_codes() -> None:
    def rep(*sev: str) -> doctor.Report:
        return doctor.Report("/", 0, tuple(doctor.Finding(s, s, s, s) for s in sev))

    assert rep("pass", "pass").exit_code() == 0
    assert rep("pass", "unknown").exit_code() == 0
    assert rep("pass", "unknown").exit_code(strict=True) == 1
    assert rep("warn", "unknown").exit_code() == 1
    assert rep("warn", "fail").exit_code() == 2


def test_big_cores_from_cpu_capacity_without_plan(tmp_path: Path) -> None:
    capacity = {
        f"sys/devices/system/cpu/cpu{i}/cpu_capacity": ("1024\n" if i >= 4 else "414\n")
        for i in range(8)
    }
    tree = {**_with_unit(HARDENED_UNIT.replace("CPUAffinity=4-7", "CPUAffinity=2-7")), **capacity}
    f = audit(tmp_path / "a", tree)["cpu.affinity"]
    assert f.severity == doctor.WARN and "non-big cores 2 3" in f.summary
    assert any(e.label == "big cores" and e.value == "4 5 6 7" for e in f.evidence)
    good = {**RK3588_HARDENED, **capacity}
    assert audit(tmp_path / "b", good)["cpu.affinity"].severity == doctor.PASS


def test_planned_device_directories_match_nodes(tmp_path: Path) -> None:
    plan = plan_for_rk3588()
    wants = dataclasses.replace(
        plan, board=dataclasses.replace(plan.board, device_nodes=("/dev/dri", "/dev/dma_heap"))
    )
    f = audit(tmp_path / "a", RK3588_HARDENED, wants)["npu.devices"]
    # Planned nodes are what DeviceAllow= grants; one absent of several is harmless.
    assert f.severity == doctor.PASS
    assert any(e.label == "planned but absent" and e.value == "/dev/dma_heap" for e in f.evidence)
    rknpu_only = dataclasses.replace(
        plan, board=dataclasses.replace(plan.board, device_nodes=("/dev/rknpu",))
    )
    f = audit(tmp_path / "b", RK3588_HARDENED, rknpu_only)["npu.devices"]
    assert f.severity == doctor.FAIL and "none of the planned device nodes" in f.summary
    tree = {**RK3588_HARDENED, "dev/rknpu": ""}
    assert audit(tmp_path / "c", tree, rknpu_only)["npu.devices"].severity == doctor.PASS


def test_effective_values_from_systemd_win(tmp_path: Path) -> None:
    """On a live host, `systemctl show` values (drop-ins, defaults applied) are used."""
    root = build_tree(tmp_path, _with_unit(HARDENED_UNIT))
    snap = collect(root)
    live = dataclasses.replace(
        snap,
        unit_effective={
            "StartLimitIntervalUSec": "10s",
            "StartLimitBurst": "3",
            "MemoryMax": str(9 * GIB),
            "MemoryCurrent": str(500 * MIB),
        },
    )
    f = {x.id: x for x in doctor.run_checks(live, plan_for_rk3588()).findings}
    assert f["unit.start-limit"].severity == doctor.FAIL  # 2 x 5 s >= 10 s
    assert any(e.source == "systemctl show" for e in f["unit.start-limit"].evidence)
    assert f["unit.memory"].severity == doctor.WARN and "daemon-reload" in f["unit.memory"].summary
    labels = {e.label for e in f["memory.available"].evidence}
    assert "service MemoryCurrent" in labels


# -- unit.model: the unit serves the plan's model --------------------------------------

_SERVE = "ExecStart=/usr/local/bin/slmguard serve --plan /etc/slmguard/plan.json"
_PLANNED = "/var/lib/slmguard/models/qwen2.5-0.5b-instruct-q4_k_m.gguf"


def _qwen3b_plan() -> Plan:
    """Another model's plan (the preset render used to deploy with the default model)."""
    p = plan_for_rk3588()
    other = dataclasses.replace(
        p.model, name="qwen2.5-3b", path="/var/lib/slmguard/models/q3b.gguf", sha256="1" * 64
    )
    return dataclasses.replace(p, model=other)


def _preset(p: Plan) -> Plan:
    return dataclasses.replace(
        p, model=dataclasses.replace(p.model, path=None, sha256=None, preset="qwen2.5-3b-instruct")
    )


@pytest.mark.parametrize(
    ("exec_start", "installed", "severity", "phrase"),
    [
        (
            _SERVE,
            plan_for_rk3588(),
            doctor.PASS,
            "the planned model (from /etc/slmguard/plan.json)",
        ),
        (_SERVE, _qwen3b_plan(), doctor.FAIL, "the unit serves /var/lib/slmguard/models/q3b.gguf"),
        (_SERVE, _preset(_qwen3b_plan()), doctor.FAIL, "serve refuses to start (exit 78)"),
        (_SERVE, None, doctor.UNKNOWN, "cannot read the unit's plan"),
        (f"{_SERVE} --model {_PLANNED}", None, doctor.PASS, "serves the planned file"),
        (
            f"{_SERVE} --model=/srv/other.gguf",
            None,
            doctor.FAIL,
            "serves /srv/other.gguf (--model)",
        ),
        ("ExecStart=/usr/local/bin/slmguard serve --port 8080", None, doctor.FAIL, "neither"),
        (
            "Environment=SLMGUARD_MODEL=/srv/env.gguf\n"
            "ExecStart=/usr/local/bin/slmguard serve --port 8080",
            None,
            doctor.FAIL,
            "serves /srv/env.gguf (--model)",
        ),
        (
            "ExecStart=/usr/bin/llama-server -m /m.gguf",
            None,
            doctor.UNKNOWN,
            "not `slmguard serve`",
        ),
    ],
)
def test_unit_model_fails_when_the_unit_serves_another_model(
    tmp_path: Path, exec_start: str, installed: Plan | None, severity: str, phrase: str
) -> None:
    tree = _with_unit(HARDENED_UNIT.replace(_SERVE, exec_start))
    tree.pop("etc/slmguard/plan.json")
    if installed is not None:
        tree["etc/slmguard/plan.json"] = dumps_plan(installed)
    f = audit(tmp_path, tree, plan_for_rk3588())["unit.model"]
    assert (f.severity, phrase in f.summary) == (severity, True), f.summary


def test_unit_model_copy_with_the_same_sha256_is_the_same_model(tmp_path: Path) -> None:
    plan = plan_for_rk3588()
    copy = dataclasses.replace(plan, model=dataclasses.replace(plan.model, path="/srv/copy.gguf"))
    tree = {**_with_unit(HARDENED_UNIT), "etc/slmguard/plan.json": dumps_plan(copy)}
    f = audit(tmp_path, tree, plan)["unit.model"]
    assert f.severity == doctor.PASS


def test_unit_model_for_a_preset_plan(tmp_path: Path) -> None:
    plan = _preset(plan_for_rk3588())
    with_model = HARDENED_UNIT.replace(_SERVE, f"{_SERVE} --model /srv/q.gguf")
    f = audit(tmp_path, _with_unit(with_model), plan)["unit.model"]
    assert f.severity == doctor.PASS and "checks it against preset" in f.summary
    bare = HARDENED_UNIT.replace(_SERVE, "ExecStart=/usr/local/bin/slmguard serve")
    assert audit(tmp_path / "b", _with_unit(bare), plan)["unit.model"].severity == doctor.FAIL


def test_unit_model_needs_a_plan(tmp_path: Path) -> None:
    f = audit(tmp_path, RK3588_HARDENED, None)["unit.model"]
    assert f.severity == doctor.UNKNOWN and "no plan" in f.summary


def _board(plan: Plan, name: str, ram_bytes: int | None = None) -> Plan:
    board = dataclasses.replace(
        plan.board, name=name, ram_bytes=plan.board.ram_bytes if ram_bytes is None else ram_bytes
    )
    return dataclasses.replace(plan, board=board)


@pytest.mark.parametrize(
    ("tree_changes", "plan_board", "severity", "needle"),
    [
        ({}, ("rk3588-8g", None), "pass", "a rk3588-8g"),
        ({}, ("jetson-orin-nano-8g", None), "fail", "this host is a rk3588 board"),
        ({}, ("rk3588-4g", 4 * GIB), "fail", "makes this a rk3588-8g; the plan is for rk3588-4g"),
        ({}, ("rk3588-16g", 16 * GIB), "fail", "the plan is for rk3588-16g"),
        ({"sys/devices/system/cpu/online": "0-3\n"}, ("rk3588-8g", None), "fail", "4 CPUs online"),
        (
            {"proc/device-tree/model": None, "proc/device-tree/compatible": None},
            ("rk3588-8g", None),
            "fail",
            "no board the device tree names",
        ),
        # a plan made with --board auto on the host itself: RAM within 5 %
        ({}, ("generic", 7_994_000 * 1024), "pass", "a generic"),
        ({}, ("generic", 4 * GIB), "fail", "more than 5% apart"),
        ({"proc/meminfo": None}, ("rk3588-8g", None), "unknown", "could not read"),
    ],
)
def test_board_hardware_is_the_plans_board(
    tmp_path: Path,
    tree_changes: dict[str, str | None],
    plan_board: tuple[str, int | None],
    severity: str,
    needle: str,
) -> None:
    tree = {k: v for k, v in {**RK3588_HARDENED, **tree_changes}.items() if v is not None}
    found = audit(tmp_path, tree, _board(plan_for_rk3588(), *plan_board))["board.hardware"]
    assert (found.severity, needle in found.summary) == (severity, True), found.summary
    if severity == "fail":
        assert found.fix is not None and "--board auto" in found.fix


def test_board_hardware_needs_a_plan(tmp_path: Path) -> None:
    assert audit(tmp_path, RK3588_HARDENED)["board.hardware"].severity == "unknown"
