"""host.cgroup: the v1/v2 memory facade on documented trees, captured files and live."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgrouptrees import DIRS, HIGH, INACTIVE_FILE, MAX, TREES, USAGE
from hosttree import build_tree, copy_captured
from slmguard.errors import HostReadError
from slmguard.host import cgroup

THIS_MACHINE_DIR = "sys/fs/cgroup/memory/process_api/3d1dafd0279f21d78a8db9fa56d45037"


@pytest.mark.parametrize("version", [1, 2])
def test_locate_and_read_documented_tree(tmp_path: Path, version: int) -> None:
    root = build_tree(tmp_path, TREES[version])
    assert cgroup.memory_cgroup_version(root) == version
    directory = cgroup.memory_cgroup_dir(root)
    assert directory == root / DIRS[version]
    assert cgroup.memory_cgroup_dir(root, pid=1234) == directory

    mem = cgroup.read_memory(directory)
    assert mem.version == version
    assert mem.path == directory
    assert mem.usage_bytes == USAGE
    assert mem.inactive_file_bytes == INACTIVE_FILE
    assert mem.working_set_bytes == USAGE - INACTIVE_FILE
    assert mem.max_bytes == MAX
    assert mem.high_bytes == (HIGH if version == 2 else None)
    assert mem.limit_bytes == (HIGH if version == 2 else MAX)
    assert mem.oom_kill_count == 1
    assert mem.stat["inactive_file"] == INACTIVE_FILE
    if version == 1:
        assert mem.events == {"oom_kill": 1, "under_oom": 0, "failcnt": 4}
    else:
        assert mem.events["max"] == 4 and mem.events["high"] == 17


@pytest.mark.parametrize("version", [1, 2])
def test_unlimited_reads_as_none(tmp_path: Path, version: int) -> None:
    d = DIRS[version]
    extra = (
        {f"{d}/memory.high": "max\n", f"{d}/memory.max": "max\n"}
        if version == 2
        else {f"{d}/memory.limit_in_bytes": "9223372036854771712\n"}
    )
    root = build_tree(tmp_path, {**TREES[version], **extra})
    mem = cgroup.read_memory(root / d)
    assert mem.high_bytes is None and mem.max_bytes is None and mem.limit_bytes is None


def test_v1_unlimited_with_64k_pages() -> None:
    # LONG_MAX rounded down to 64 KiB pages (arm64 kernels with 64K pages).
    assert cgroup.parse_limit("9223372036854710272\n", 1) is None
    assert cgroup.parse_limit("2936012800\n", 1) == 2936012800
    assert cgroup.parse_limit("max\n", 2) is None


@pytest.mark.parametrize("version", [1, 2])
def test_working_set_never_negative(tmp_path: Path, version: int) -> None:
    d = DIRS[version]
    usage_file = "memory.current" if version == 2 else "memory.usage_in_bytes"
    root = build_tree(tmp_path, {**TREES[version], f"{d}/{usage_file}": "1000\n"})
    assert cgroup.read_memory(root / d).working_set_bytes == 0


@pytest.mark.parametrize("version", [1, 2])
def test_truncated_stat_keeps_complete_lines(tmp_path: Path, version: int) -> None:
    d = DIRS[version]
    stat = TREES[version][f"{d}/memory.stat"]
    assert stat is not None
    cut = str(stat)[:40]  # ends mid-line
    root = build_tree(tmp_path, {**TREES[version], f"{d}/memory.stat": cut})
    mem = cgroup.read_memory(root / d)
    assert mem.inactive_file_bytes is None
    assert mem.working_set_bytes == USAGE  # nothing known to subtract
    assert len(mem.stat) >= 1
    assert all(isinstance(v, int) for v in mem.stat.values())


@pytest.mark.parametrize("version", [1, 2])
def test_garbled_usage_raises_naming_the_file(tmp_path: Path, version: int) -> None:
    d = DIRS[version]
    usage_file = "memory.current" if version == 2 else "memory.usage_in_bytes"
    root = build_tree(tmp_path, {**TREES[version], f"{d}/{usage_file}": "lots\n"})
    with pytest.raises(HostReadError) as err:
        cgroup.read_memory(root / d)
    assert err.value.path == root / d / usage_file


@pytest.mark.parametrize("version", [1, 2])
def test_missing_optional_files_give_none(tmp_path: Path, version: int) -> None:
    d = DIRS[version]
    keep = "memory.current" if version == 2 else "memory.usage_in_bytes"
    tree = {k: v for k, v in TREES[version].items() if not k.startswith(d) or k.endswith(keep)}
    root = build_tree(tmp_path, tree)
    mem = cgroup.read_memory(root / d)
    assert mem.usage_bytes == USAGE
    assert mem.max_bytes is None and mem.inactive_file_bytes is None
    assert mem.oom_kill_count is None and dict(mem.stat) == {}


def test_directory_without_memory_files(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(HostReadError, match="no memory controller files"):
        cgroup.read_memory(tmp_path / "empty")
    with pytest.raises(HostReadError, match="no such cgroup directory"):
        cgroup.read_memory(tmp_path / "gone")


def test_v2_without_memory_controller_is_none(tmp_path: Path) -> None:
    tree = {**TREES[2], "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io pids\n"}
    root = build_tree(tmp_path, tree)
    assert cgroup.memory_cgroup_version(root) is None
    assert cgroup.memory_cgroup_dir(root) is None


def test_no_proc_is_none(tmp_path: Path) -> None:
    assert cgroup.memory_cgroup_dir(tmp_path) is None
    assert cgroup.memory_cgroup_version(tmp_path) is None


@pytest.mark.parametrize("version", [1, 2])
def test_unreadable_mountinfo_falls_back_to_default_mounts(tmp_path: Path, version: int) -> None:
    tree = {k: v for k, v in TREES[version].items() if not k.endswith("mountinfo")}
    root = build_tree(tmp_path, tree)
    assert cgroup.memory_cgroup_dir(root) == root / DIRS[version]


def test_container_mount_root_is_stripped() -> None:
    # A container sees its own cgroup mounted at /sys/fs/cgroup with root=/docker/abc.
    mounts = cgroup.parse_mountinfo_cgroups(
        "40 30 0:35 /docker/abc /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"
    )
    members = cgroup.parse_proc_cgroup("0::/docker/abc/inner\n")
    found = cgroup.locate_memory_cgroup(members, mounts, "cpu memory")
    assert found == (2, "/sys/fs/cgroup/inner")


def test_mountinfo_octal_escapes() -> None:
    mounts = cgroup.parse_mountinfo_cgroups(
        "35 24 0:31 / /mnt/my\\040cgroups rw - cgroup cgroup rw,memory\n"
        "garbage line\n"
        "36 24 0:31 / /x rw - ext4 /dev/sda rw\n"
    )
    assert [m.mount_point for m in mounts] == ["/mnt/my cgroups"]
    assert mounts[0].options == ("rw", "memory")


def test_parse_proc_cgroup_skips_malformed() -> None:
    members = cgroup.parse_proc_cgroup("x:memory:/a\n4:memory:/b\nbroken\n0::/\n")
    assert [(m.hierarchy_id, m.controllers, m.path) for m in members] == [
        (4, ("memory",), "/b"),
        (0, (), "/"),
    ]


def test_parse_memory_stat_skips_bad_lines() -> None:
    assert cgroup.parse_memory_stat("a 1\nb x\nc\nd 2 3\ne -4\n") == {"a": 1, "e": -4}


def test_captured_this_machine(tmp_path: Path) -> None:
    """This machine's real files (hybrid host: memory on v1, v2 mount without it)."""
    root = copy_captured("thismachine", tmp_path)
    assert cgroup.memory_cgroup_version(root) == 1
    directory = cgroup.memory_cgroup_dir(root)
    assert directory == root / THIS_MACHINE_DIR
    mem = cgroup.read_memory(directory)
    assert mem.version == 1
    assert mem.usage_bytes == 3289088
    assert mem.max_bytes is None  # 9223372036854771712 = unlimited
    assert mem.inactive_file_bytes == 86016
    assert mem.events == {"oom_kill": 0, "under_oom": 0, "failcnt": 0}


def test_live_this_process() -> None:
    """Read this process's real memory cgroup (v1 here, v2 on most boards)."""
    live = Path("/")
    version = cgroup.memory_cgroup_version(live)
    if version is None:
        pytest.skip("this host has no memory cgroup controller")
    directory = cgroup.memory_cgroup_dir(live)
    assert directory is not None and directory.is_dir()
    mem = cgroup.read_memory(directory)
    assert mem.version == version
    assert mem.usage_bytes is not None and mem.usage_bytes > 0
    assert mem.working_set_bytes is not None and mem.working_set_bytes <= mem.usage_bytes
    usage_file = cgroup.V2_CURRENT if version == 2 else cgroup.V1_USAGE
    assert (directory / usage_file).is_file()
    assert mem.oom_kill_count is not None
    if version == 1:
        text = (directory / cgroup.V1_STAT).read_text()
        assert "total_inactive_file" in text


# ---------------------------------------------------------------- paths


@pytest.mark.parametrize("version", [1, 2])
def test_controller_dirs_of_a_documented_tree(tmp_path: Path, version: int) -> None:
    root = build_tree(tmp_path, TREES[version])
    dirs = cgroup.controller_dirs(root, 1234)
    service = "system.slice/slm_inference.service"
    if version == 2:
        assert dirs == {"unified": root / "sys/fs/cgroup" / service}
    else:
        assert dirs["memory"] == root / "sys/fs/cgroup/memory" / service
        # one v1 hierarchy holds cpu and cpuacct: both name the same directory
        assert dirs["cpu"] == dirs["cpuacct"] == root / "sys/fs/cgroup/cpu,cpuacct" / service
        assert dirs["unified"] == root / "sys/fs/cgroup/unified" / service
        assert dirs["pids"] == root / "sys/fs/cgroup/pids" / service  # not mounted: the default


def test_controller_dirs_without_proc_and_under_a_namespace(tmp_path: Path) -> None:
    assert cgroup.controller_dirs(tmp_path) == {}
    # Under a cgroup namespace the path starts with "/..": nothing below the mount is ours.
    root = build_tree(tmp_path / "ns", {"proc/self/cgroup": "0::/../../user.slice\n"})
    assert cgroup.controller_dirs(root) == {"unified": root / "sys/fs/cgroup"}


@pytest.mark.parametrize("version", [1, 2])
def test_procs_kernel_path_and_unit_dir(tmp_path: Path, version: int) -> None:
    base = "sys/fs/cgroup/memory" if version == 1 else "sys/fs/cgroup"
    service = f"{DIRS[version]}"
    root = build_tree(
        tmp_path,
        {
            **TREES[version],
            f"{base}/cgroup.procs": "1\n",
            f"{base}/system.slice/cgroup.procs": "",
            f"{service}/cgroup.procs": "1234\n1240\n",
        },
    )
    assert cgroup.read_procs(root / service) == [1234, 1240]
    assert cgroup.read_procs(root / "gone") == []
    assert cgroup.kernel_path(root / service) == "/system.slice/slm_inference.service"
    assert cgroup.kernel_path(root / base) == "/"
    assert cgroup.kernel_path(tmp_path / "nowhere") is None
    assert cgroup.unit_cgroup_dir(root, "slm_inference.service") == root / service
    assert cgroup.unit_cgroup_dir(root, "other.service") is None


def test_limit_candidates_v2_and_v1_with_an_ancestor_limit(tmp_path: Path) -> None:
    v2 = cgroup.read_memory(build_tree(tmp_path / "v2", TREES[2]) / DIRS[2])
    assert v2.limit_candidates == ((HIGH, "memory.high"), (MAX, "memory.max"))
    assert v2.limit_bytes == HIGH
    # v1 reports the smallest limit of the cgroup and its ancestors in memory.stat.
    tree = dict(TREES[1])
    stat_path = f"{DIRS[1]}/memory.stat"
    tree[stat_path] = str(tree[stat_path]).replace(
        f"hierarchical_memory_limit {MAX}", f"hierarchical_memory_limit {2000 * 1024 * 1024}"
    )
    v1 = cgroup.read_memory(build_tree(tmp_path / "v1", tree) / DIRS[1])
    assert v1.limit_candidates == (
        (MAX, "memory.limit_in_bytes"),
        (2000 * 1024 * 1024, "hierarchical_memory_limit"),
    )
    assert v1.limit_bytes == MAX  # the cgroup's own limit
    # An unlimited ancestor chain prints the page-aligned LONG_MAX: not a limit.
    tree[stat_path] = str(TREES[1][stat_path]).replace(
        f"hierarchical_memory_limit {MAX}", "hierarchical_memory_limit 9223372036854771712"
    )
    unlimited = cgroup.read_memory(build_tree(tmp_path / "v1u", tree) / DIRS[1])
    assert unlimited.limit_candidates[1] == (None, "hierarchical_memory_limit")
