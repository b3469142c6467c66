"""Rendered units, slices and system files: systemd accepts them, they say what the plan says.

``systemd-analyze verify`` and ``systemd-analyze security --offline=yes``
check the real files (helpers in ``systemdunits``: installed when missing,
skipped only where that is impossible, never under CI).
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hostboards import seed_unit_text
from rendertrees import FSTAB_WITH_SWAP, GiB, MiB, make_plan
from slmguard.deploy.checks import check_numbers
from slmguard.deploy.render import (
    RenderedFile,
    RenderOptions,
    render_files,
    render_fstab,
    validate_options,
)
from slmguard.deploy.system import disable_fstab_swap, fstab_swap_lines, sysctl_conf
from slmguard.deploy.units import cpu_list, service_unit, systemd_size
from slmguard.errors import RefusedError, UsageError
from slmguard.plan.schema import Plan
from systemdunits import exposure as _exposure
from systemdunits import find_systemd_analyze
from systemdunits import materialize as _materialize
from systemdunits import values as _values
from systemdunits import verify as _verify


@pytest.fixture(scope="session")
def analyze() -> str:
    return find_systemd_analyze()


def _exec_path() -> str:
    own = Path(sys.executable).parent / "slmguard"
    return str(own) if own.exists() else sys.executable


def _opts(**kw: object) -> RenderOptions:
    return RenderOptions(exec_path=_exec_path(), **kw)  # type: ignore[arg-type]


PLANS = {
    "npu-mlock": make_plan(use_mlock=True),
    "device-dirs": make_plan(device_nodes=("/dev/dri", "/dev/dma_heap/", "/dev/rknpu")),
    "bare": make_plan(device_nodes=(), device_groups=(), cpu_affinity=(), cma_bytes=None),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_systemd_verify_accepts_every_rendered_unit(
    analyze: str, tmp_path: Path, name: str
) -> None:
    files = render_files(PLANS[name], _opts(protect=("nginx.service",)))
    units = _materialize(files, tmp_path)
    # The drop-in needs the unit it extends.
    (tmp_path / "nginx.service").write_text("[Service]\nExecStart=/bin/true\n")
    units.append(tmp_path / "nginx.service")
    assert {u.name for u in units} >= {
        "slmguard.service",
        "slmguard-watch.service",
        "slmguard-crashdump.service",
        "slmguard-recover.service",
        "slmguard.slice",
        "business.slice",
    }
    assert _verify(analyze, units) == ""


def test_verify_check_flags_the_seed_unit(analyze: str, tmp_path: Path) -> None:
    """The check above can fail: the source document's unit makes systemd complain."""
    seed = tmp_path / "slm_inference.service"
    seed.write_text(seed_unit_text())
    out = _verify(analyze, [seed])
    assert "Unknown key" in out and "StartLimitIntervalSec" in out
    assert _exposure(analyze, seed) > 9.0


@pytest.mark.parametrize("name", sorted(PLANS))
def test_exposure_at_most_2(analyze: str, tmp_path: Path, name: str) -> None:
    units = _materialize(render_files(PLANS[name], _opts()), tmp_path)
    scores = {u.name: _exposure(analyze, u) for u in units if u.suffix == ".service"}
    assert set(scores) == {
        "slmguard.service",
        "slmguard-watch.service",
        "slmguard-crashdump.service",
        "slmguard-recover.service",
    }
    assert all(score <= 2.0 for score in scores.values()), scores


def test_service_unit_carries_the_plan() -> None:
    plan = make_plan(use_mlock=True)
    text = service_unit(plan, _opts())
    assert _values(text, "Unit", "StartLimitIntervalSec") == ["60"]
    assert _values(text, "Unit", "StartLimitBurst") == ["3"]
    assert _values(text, "Service", "StartLimitIntervalSec") == []
    assert _values(text, "Unit", "OnFailure") == ["slmguard-crashdump.service"]
    assert _values(text, "Service", "Type") == ["notify"]
    assert _values(text, "Service", "MemoryMax") == ["2560M"]
    assert _values(text, "Service", "MemoryHigh") == ["2G"]
    assert _values(text, "Service", "MemorySwapMax") == ["0"]
    assert _values(text, "Service", "OOMPolicy") == ["continue"]
    assert _values(text, "Service", "CPUAffinity") == ["4-7"]
    assert _values(text, "Service", "LimitMEMLOCK") == ["2560M"]
    assert _values(text, "Service", "DeviceAllow") == ["/dev/dri/renderD128 rw", "/dev/rknpu rw"]
    assert _values(text, "Service", "SupplementaryGroups") == ["render video"]
    assert _values(text, "Service", "ExecStart") == [
        f"{_exec_path()} serve --plan /etc/slmguard/plan.json --admin-token-file %d/admin-token"
    ]
    env = " ".join(_values(text, "Service", "Environment"))
    assert "OMP_NUM_THREADS=4" in env and "OPENBLAS_NUM_THREADS=4" in env
    # The governor reads /proc/meminfo and /proc/pressure: never ProcSubset=pid.
    assert "ProcSubset" not in text
    assert _values(text, "Service", "ProtectHome") == ["yes"]


def test_device_directories_become_device_classes() -> None:
    text = service_unit(PLANS["device-dirs"], _opts())
    assert _values(text, "Service", "DeviceAllow") == [
        "char-drm rw",
        "char-dma_heap rw",
        "/dev/rknpu rw",
    ]


@pytest.mark.parametrize(
    ("plan", "needle"),
    [
        (make_plan(device_nodes=("dri/card0",)), "not a path under /dev"),
        (make_plan(device_nodes=("/dev/a b",)), "not a path under /dev"),
        (make_plan(device_groups=("render video",)), "not a group name"),
    ],
)
def test_bad_device_specs_are_refused(plan: Plan, needle: str) -> None:
    with pytest.raises(RefusedError, match=needle):
        render_files(plan, _opts())


def test_service_unit_variants() -> None:
    bare = service_unit(PLANS["bare"], _opts())
    assert "LimitMEMLOCK" not in bare and "CPUAffinity" not in bare
    assert _values(bare, "Service", "PrivateDevices") == ["yes"]
    assert "SupplementaryGroups" not in bare
    home = service_unit(make_plan(model_path="/home/pi/models/m.gguf"), _opts())
    assert _values(home, "Service", "ProtectHome") == ["read-only"]


def _file(files: tuple[RenderedFile, ...], path: str) -> RenderedFile:
    return next(f for f in files if f.path == path)


def test_slices_dropins_masks_and_system_files() -> None:
    plan = make_plan()
    files = render_files(plan, _opts(protect=("mosquitto.service",), business_slice="edge.slice"))
    business = (_file(files, "/etc/systemd/system/edge.slice").content or b"").decode()
    # RAM 4G - MemoryMax 2.5G - OS 512M = 1G of best-effort protection, 512M guaranteed.
    assert _values(business, "Slice", "MemoryMin") == ["512M"]
    assert _values(business, "Slice", "MemoryLow") == ["1G"]
    assert _values(business, "Slice", "AllowedCPUs") == ["0-3"]
    inference = (_file(files, "/etc/systemd/system/slmguard.slice").content or b"").decode()
    assert _values(inference, "Slice", "MemoryMax") == ["2560M"]
    assert _values(inference, "Slice", "AllowedCPUs") == ["4-7"]
    dropin = _file(files, "/etc/systemd/system/mosquitto.service.d/50-slmguard-protect.conf")
    assert _values((dropin.content or b"").decode(), "Service", "Slice") == ["edge.slice"]
    masks = [f for f in files if f.link == "/dev/null"]
    assert "/etc/systemd/system/nvzramconfig.service" in {f.path for f in masks}
    assert "/etc/systemd/system/armbian-zram-config.service" in {f.path for f in masks}
    sysctl = (_file(files, "/etc/sysctl.d/99-slmguard.conf").content or b"").decode()
    assert "vm.swappiness = 0\n" in sysctl and "vm.overcommit_ratio = 80\n" in sysctl
    plan_json = _file(files, "/etc/slmguard/plan.json")
    assert b'"memory_max_bytes": 2684354560' in (plan_json.content or b"")
    wants = _file(files, "/etc/systemd/system/multi-user.target.wants/slmguard.service")
    assert wants.link == "/etc/systemd/system/slmguard.service"


def test_sysctl_without_mode_2_has_no_ratio() -> None:
    text = sysctl_conf(make_plan(overcommit_memory=0))
    assert "vm.overcommit_memory = 0\n" in text and "overcommit_ratio" not in text


def test_fstab_swap_lines_commented_out_once() -> None:
    assert fstab_swap_lines(FSTAB_WITH_SWAP) == [
        "/swapfile                                  none          swap   sw"
        "                 0      0"
    ]
    new = disable_fstab_swap(FSTAB_WITH_SWAP)
    assert fstab_swap_lines(new) == []
    assert new.count("\n") == FSTAB_WITH_SWAP.count("\n")
    assert disable_fstab_swap(new) == new
    assert render_fstab(new) is None
    edited = render_fstab(FSTAB_WITH_SWAP)
    assert edited is not None and edited.content == new.encode()


@pytest.mark.parametrize(
    ("plan", "hugetlb", "needles"),
    [
        (
            make_plan(memory_max_bytes=3 * GiB + 768 * MiB, memory_high_bytes=3 * GiB),
            0,
            ["MemoryMax 3840 MiB", "RAM 4096 MiB", "3584 MiB"],
        ),
        (
            make_plan(business_reserve_bytes=1 * GiB + 1 * MiB),
            0,
            ["2560 MiB", "business guarantee 1025 MiB", "4097 MiB is above RAM"],
        ),
        (make_plan(cma_bytes=2 * GiB + 1 * MiB), 0, ["cma= 2049 MiB", "half of RAM (2048 MiB)"]),
        (
            make_plan(commit_charge_bytes=3 * GiB + 300 * MiB),
            0,
            ["CommitLimit", "= 3277 MiB", "commit charge 3372 MiB"],
        ),
        (
            make_plan(commit_charge_bytes=2 * GiB + 1 * MiB),
            1536 * MiB,
            ["1536 MiB huge pages", "= 2048 MiB", "commit charge 2049 MiB"],
        ),
    ],
)
def test_refusals_name_the_numbers(plan: Plan, hugetlb: int, needles: list[str]) -> None:
    with pytest.raises(RefusedError) as err:
        check_numbers(plan, hugetlb_bytes=hugetlb)
    for needle in needles:
        assert needle in err.value.message
    assert err.value.facts
    assert err.value.exit_code == 78


def test_commit_limit_uses_the_hosts_mem_total_when_known() -> None:
    plan = make_plan(commit_charge_bytes=3200 * MiB)  # fits 4096 MiB * 80% = 3277 MiB
    check_numbers(plan)
    with pytest.raises(RefusedError, match=r"\(3902 MiB MemTotal - 0 MiB huge pages\)"):
        check_numbers(plan, host_mem_total_bytes=3995420 * 1024)


def test_numbers_that_fit_pass() -> None:
    check_numbers(make_plan())
    # Mode 0 (heuristic overcommit) has no CommitLimit to respect.
    check_numbers(make_plan(overcommit_memory=0, commit_charge_bytes=64 * GiB))
    # The refusal is also what render_files does first.
    with pytest.raises(RefusedError):
        render_files(make_plan(cma_bytes=3 * GiB), _opts())


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        (RenderOptions(exec_path="slmguard"), "absolute path"),
        (RenderOptions(exec_path="/opt/my tools/slmguard"), "absolute path"),
        (RenderOptions(business_slice="business"), "NAME.slice"),
        (RenderOptions(business_slice="slmguard-business.slice"), "nest"),
        (RenderOptions(business_slice="slmguard.slice"), "NAME.slice"),
        (RenderOptions(protect=("nginx",)), "service unit name"),
        (RenderOptions(protect=("slmguard.service",)), "slmguard's own"),
    ],
)
def test_bad_options_are_usage_errors(opts: RenderOptions, needle: str) -> None:
    with pytest.raises(UsageError, match=re.escape(needle)):
        validate_options(opts)


def test_sizes_and_cpu_lists() -> None:
    assert systemd_size(2 * GiB) == "2G"
    assert systemd_size(1536 * MiB) == "1536M"
    assert systemd_size(1000) == "1000"
    assert cpu_list((0, 1, 2, 3, 6)) == "0-3 6"
    assert cpu_list((7, 4, 5, 6)) == "4-7"
    assert replace(make_plan(), cpu_affinity=()).cpu_affinity == ()


def test_exec_lines_parse_with_slmguards_own_cli() -> None:
    """Every ExecStart= is a command line the serve/watch verbs accept."""
    from slmguard.cli import build_parser

    parser = build_parser()
    files = render_files(make_plan(), _opts())
    lines = [
        v
        for f in files
        if f.content is not None and f.path.endswith(".service")
        for v in _values(f.content.decode(), "Service", "ExecStart")
    ]
    assert len(lines) == 4
    token_flags = {}
    for line in lines:
        exe, *argv = line.split()
        assert exe == _exec_path()
        args = parser.parse_args(argv)
        if args.verb == "rollback":  # the boot-time recovery of a cut-off apply
            assert args.if_unfinished and args.root == Path("/")
            continue
        assert args.verb in ("serve", "watch")
        assert str(args.plan) == "/etc/slmguard/plan.json"
        # Which parser attribute took the token path (watch prefixes its config fields).
        dests = [k for k, v in vars(args).items() if v == Path("%d/admin-token")]
        assert all(k.endswith("admin_token_file") for k in dests), dests
        mode = "collect" if getattr(args, "collect", False) else args.verb
        token_flags[mode] = bool(dests)
    # The server checks the token, the watcher sends it; the crash collector needs none.
    assert token_flags == {"serve": True, "watch": True, "collect": False}


def test_server_and_watcher_get_the_admin_token_as_a_credential() -> None:
    files = render_files(make_plan(), _opts())
    for name in ("slmguard.service", "slmguard-watch.service"):
        text = (_file(files, f"/etc/systemd/system/{name}").content or b"").decode()
        assert _values(text, "Service", "LoadCredential") == [
            "admin-token:/etc/slmguard/admin-token"
        ], name
        # The credential name is the file under %d the flag points at.
        (exec_start,) = _values(text, "Service", "ExecStart")
        argv = exec_start.split()
        assert argv[argv.index("--admin-token-file") + 1] == "%d/admin-token"
        assert _values(text, "Service", "DynamicUser") == ["yes"]
    crash = _file(files, "/etc/systemd/system/slmguard-crashdump.service").content or b""
    assert b"LoadCredential" not in crash and b"admin-token" not in crash
    # The token itself is a secret the renderer does not make: no content, no randomness.
    token = _file(files, "/etc/slmguard/admin-token")
    assert token.is_secret and token.content is None and token.mode == 0o600
    assert render_files(make_plan(), _opts()) == files
