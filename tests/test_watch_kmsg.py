"""/dev/kmsg records and OOM reports: captured and per-kernel-version fixtures, the reader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slmguard.errors import HostReadError
from slmguard.host.kmsg import (
    KmsgReader,
    OomAssembler,
    find_oom_kills,
    parse_oom_kill_line,
    parse_record,
    parse_records,
    read_boot_id,
)

FIXTURES = Path(__file__).parent / "fixtures" / "kmsg"
KIB = 1024


def _kills(name: str) -> list[tuple[int, str, str, str | None]]:
    records = parse_records((FIXTURES / name).read_text())
    return [(k.pid, k.comm, k.scope, k.task_memcg) for k in find_oom_kills(records)]


def test_parse_record_prefix_message_and_dictionary() -> None:
    r = parse_record(
        "6,2015,881000000,-;usb 1-1: new\\x0aline \\x5c\n SUBSYSTEM=usb\n DEVICE=c189:2"
    )
    assert (r.seq, r.ts_usec, r.level, r.facility, r.flags) == (2015, 881000000, 6, 0, "-")
    assert r.message == "usb 1-1: new\nline \\"
    assert r.fields == {"SUBSYSTEM": "usb", "DEVICE": "c189:2"}


def test_parse_record_user_facility_and_extra_prefix_fields() -> None:
    r = parse_record("14,7,100,c,extra;hello")
    assert (r.level, r.facility, r.flags, r.message) == (6, 1, "c", "hello")


@pytest.mark.parametrize("text", ["no semicolon here", "6,1;too few", "a,b,c,-;not numbers", ""])
def test_parse_record_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError):
        parse_record(text)


def test_parse_records_skips_garbage_and_truncation() -> None:
    text = "garbage line\n6,1,10,-;one\n SUBSYSTEM=x\n6,2,20,-;two\n6,3,3"
    records = parse_records(text)
    assert [r.seq for r in records] == [1, 2]
    assert records[0].fields == {"SUBSYSTEM": "x"}


def test_captured_report_from_this_machine() -> None:
    records = parse_records((FIXTURES / "oom-6.18-memcg-v1-captured.kmsg").read_text())
    (kill,) = find_oom_kills(records)
    assert (kill.pid, kill.comm, kill.uid) == (8957, "python3", 0)
    assert kill.constraint == "CONSTRAINT_MEMCG" and kill.scope == "memcg"
    path = "/process_api/2fb1aa7c16be69a197b5952ad06ef1ab/probe1"
    assert kill.oom_memcg == path and kill.task_memcg == path
    assert kill.total_vm_bytes == 118984 * KIB
    assert kill.anon_rss_bytes == 32512 * KIB
    assert kill.file_rss_bytes == 6632 * KIB
    assert kill.shmem_rss_bytes == 0
    assert kill.rss_bytes == (32512 + 6632) * KIB
    assert kill.oom_score_adj == 0
    assert kill.invoked_by == "python3"
    assert (kill.first_seq, kill.seq) == (349, 426)
    assert kill.lines[0].startswith("python3 invoked oom-killer")
    assert kill.lines[-1].startswith("Memory cgroup out of memory: Killed process 8957")
    assert len(kill.lines) == 78
    assert kill.in_cgroup("/process_api/2fb1aa7c16be69a197b5952ad06ef1ab")
    assert kill.in_cgroup("/")
    assert not kill.in_cgroup("/process_api/2fb1aa7c16be69a197b5952ad06ef1ab/probe")


def test_5_10_report_and_reaper_is_not_a_second_kill() -> None:
    svc = "/system.slice/slm_inference.service"
    assert _kills("oom-5.10-memcg-v2.kmsg") == [(4242, "llama-server", "memcg", svc)]
    (kill,) = find_oom_kills(parse_records((FIXTURES / "oom-5.10-memcg-v2.kmsg").read_text()))
    assert kill.oom_score_adj == 500 and kill.anon_rss_bytes == 2840000 * KIB


def test_4_19_sacrifice_child_victim_has_another_pid() -> None:
    records = parse_records((FIXTURES / "oom-4.19-sacrifice.kmsg").read_text())
    (kill,) = find_oom_kills(records)
    assert (kill.pid, kill.comm, kill.scope) == (1500, "llama-worker", "memcg")
    assert kill.oom_memcg == "/slm"
    assert kill.task_memcg is None  # the oom-kill: line describes the parent, pid 1499
    assert kill.uid is None
    assert kill.in_cgroup("/slm")
    assert kill.anon_rss_bytes == 510000 * KIB


def test_4_14_task_in_line_and_global_oom() -> None:
    assert _kills("oom-4.14-task-in.kmsg") == [
        (900, "llama", "memcg", "/slm"),
        (812, "java", "system", None),
    ]


def test_6_x_oom_group_kills_each_member_once_and_global_kill() -> None:
    records = parse_records((FIXTURES / "oom-6.1-v2-oom-group.kmsg").read_text())
    kills = find_oom_kills(records)
    assert [(k.pid, k.comm, k.scope) for k in kills] == [
        (3101, "llama-worker", "memcg"),
        (3100, "slmguard", "memcg"),
        (5005, "chromium", "system"),
    ]
    assert kills[1].task_memcg == "/system.slice/slmguard.service"
    assert kills[2].constraint == "CONSTRAINT_NONE"
    assert kills[2].uid == 1000
    assert not kills[2].in_cgroup("/system.slice/slmguard.service")


def test_report_whose_header_was_overwritten_still_counts() -> None:
    (kill,) = find_oom_kills(parse_records((FIXTURES / "oom-wrapped-header.kmsg").read_text()))
    assert (kill.pid, kill.comm, kill.invoked_by) == (8957, "python3", None)
    assert kill.constraint == "CONSTRAINT_MEMCG"
    assert kill.first_seq == 425


def test_oom_kill_line_fields() -> None:
    kv = parse_oom_kill_line(
        "constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0-3,"
        "oom_memcg=/a,task_memcg=/a/b,task=x,y,pid=7,uid=0"
    )
    assert kv["mems_allowed"] == "0-3"
    assert kv["task"] == "x,y"  # a comm with a comma stays whole
    assert (kv["pid"], kv["task_memcg"]) == ("7", "/a/b")


def test_open_report_holds_the_safe_cursor_until_the_kill() -> None:
    records = parse_records((FIXTURES / "oom-5.10-memcg-v2.kmsg").read_text())
    asm = OomAssembler()
    kills = []
    for r in records:
        kills += asm.feed(r)
        if r.seq == 1210:
            assert asm.pending_since_seq == 1201
            assert asm.safe_cursor(1210) == 1200
    assert len(kills) == 1
    assert asm.safe_cursor(1223) == 1223


def test_report_without_kill_expires() -> None:
    asm = OomAssembler(max_age_s=30)
    asm.feed(parse_record("4,10,1000000,-;x invoked oom-killer: gfp_mask=0x0, order=0"))
    asm.expire(20_000_000)
    assert asm.pending_since_seq == 10
    asm.expire(40_000_000)
    assert asm.pending_since_seq is None
    assert asm.safe_cursor(12) == 12


def _kmsg_root(tmp_path: Path, *names: str) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    (dev / "kmsg").write_text("".join((FIXTURES / n).read_text() for n in names))
    return tmp_path


def test_reader_resumes_after_cursor_and_counts_lost(tmp_path: Path) -> None:
    root = _kmsg_root(tmp_path, "oom-5.10-memcg-v2.kmsg")
    with KmsgReader(root) as reader:
        batch = reader.read()
        assert [r.seq for r in batch.records][:2] == [1180, 1201]
        assert batch.last_seq == 1223
        # 1181..1200 are absent between two records read: overwritten, so lost.
        assert batch.lost == 20
        assert reader.read().records == ()
    with KmsgReader(root, cursor=1221) as reader:
        assert [r.seq for r in reader.read().records] == [1222, 1223]
    with KmsgReader(root, cursor=1100) as reader:
        batch = reader.read()
        assert batch.lost == (1180 - 1101) + (1201 - 1181)


def test_reader_sees_appended_records_only(tmp_path: Path) -> None:
    root = _kmsg_root(tmp_path, "oom-4.19-sacrifice.kmsg")
    with KmsgReader(root) as reader:
        assert len(reader.read().records) == 19
        with (root / "dev" / "kmsg").open("a") as fh:
            fh.write("6,819,91300000000,-;later\n6,820,913")  # second record incomplete
        assert [r.message for r in reader.read().records] == ["later"]


def test_reader_missing_device(tmp_path: Path) -> None:
    with pytest.raises(HostReadError, match="missing"):
        KmsgReader(tmp_path).open()


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg not readable here")
def test_reader_on_the_real_device() -> None:
    with KmsgReader() as reader:
        assert reader.is_device
        first = reader.read()
        assert first.records, "the kernel log is never empty after boot"
        seqs = [r.seq for r in first.records]
        assert seqs == sorted(seqs)
        newest = first.last_seq
    assert newest is not None
    with KmsgReader(cursor=newest) as reader:
        assert all(r.seq > newest for r in reader.read().records)


def test_boot_id(tmp_path: Path) -> None:
    assert read_boot_id(tmp_path) is None
    (tmp_path / "proc/sys/kernel/random").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/random/boot_id").write_text("abc\n")
    assert read_boot_id(tmp_path) == "abc"
