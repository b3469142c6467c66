"""The guest scenario's pure parsers (systemctl show, cgroup files, kernel log, units)."""

from __future__ import annotations

import hashlib
import http.server
import os
import signal
import stat
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the systest package

from systest import accel, base, report
from systest.guest import scenario as sc

from waiting import scaled


def test_parse_show_splits_on_the_first_equals_only() -> None:
    text = "ActiveState=active\nExecStart={ path=/x ; argv[]=/x --a=b ; }\nEmpty=\nnoise\n"
    assert sc.parse_show(text) == {
        "ActiveState": "active",
        "ExecStart": "{ path=/x ; argv[]=/x --a=b ; }",
        "Empty": "",
    }


def test_parse_exec_argv_and_flags() -> None:
    value = (
        "{ path=/usr/local/bin/slmguard ; argv[]=/usr/local/bin/slmguard serve --plan "
        "/etc/slmguard/plan.json --port=8089 --host 127.0.0.1 ; ignore_errors=no ; "
        "start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }"
    )
    argv = sc.parse_exec_argv(value)
    assert argv[:2] == ["/usr/local/bin/slmguard", "serve"]
    assert sc.flag_value(argv, "--port") == "8089"
    assert sc.flag_value(argv, "--host") == "127.0.0.1"
    assert sc.flag_value(argv, "--api-key-file") is None
    assert sc.parse_exec_argv("") == []


# memory.events captured in the recipe's guest (Debian bookworm, kernel 6.1)
EVENTS = "low 0\nhigh 17\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n"


def test_flat_keyed_and_limits() -> None:
    assert sc.parse_flat_keyed(EVENTS)["oom_kill"] == 1
    assert sc.parse_flat_keyed(EVENTS)["high"] == 17
    assert sc.parse_flat_keyed("garbage\nanon x\n") == {}
    assert sc.parse_limit("max\n") is None
    assert sc.parse_limit("2936012800\n") == 2936012800


def test_killed_processes_from_a_kernel_oom_report() -> None:
    log = (
        "[  101.5] python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, "
        "oom_score_adj=1000\n"
        "[  101.6] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
        "mems_allowed=0,oom_memcg=/system.slice/slmguard.service,task_memcg=/system.slice/"
        "slmguard.service,task=python3,pid=912,uid=0\n"
        "[  101.6] Memory cgroup out of memory: Killed process 912 (python3) total-vm:"
        "112340kB, anon-rss:98304kB, file-rss:4kB, shmem-rss:0kB, UID:0 pgtables:240kB "
        "oom_score_adj:1000\n"
        "[  140.2] Out of memory: Killed process 1001 (slmguard worker) total-vm:1kB\n"
    )
    assert sc.killed_processes(log) == [(912, "python3"), (1001, "slmguard worker")]
    assert sc.killed_processes("") == []


def test_tcp_listeners_decode_little_endian_addresses() -> None:
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0\n"
        "   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0\n"
        "   2: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0\n"
    )
    assert sc.parse_tcp_listeners(text) == [("127.0.0.1", 8080), ("0.0.0.0", 22)]


def test_connections_closed_to_a_port_are_its_time_wait_sockets() -> None:
    # Line 9: captured on this machine (a server on 33739 that closed first, after a
    # urllib request with Connection: close); 10: the client closed first; 11: the
    # listener; 12: another port's TIME_WAIT; 13: an established connection.
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        "   9: 0100007F:83CB 0100007F:9DD4 06 00000000:00000000 03:00001770 00000000     0"
        "        0 0 3 00000000c5ac47ac\n"
        "  10: 0100007F:C350 0100007F:83CB 06 00000000:00000000 03:00001770 00000000     0\n"
        "  11: 0100007F:83CB 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0\n"
        "  12: 0100007F:1F90 0100007F:C351 06 00000000:00000000 03:00001770 00000000     0\n"
        "  13: 0100007F:83CB 0100007F:C352 01 00000000:00000000 00:00000000 00000000     0\n"
    )
    assert sc.parse_tcp_closed(text, 33739) == {(33739, 40404), (50000, 33739)}
    assert sc.parse_tcp_closed(text, 22) == set()


UNIT_SERVICE = """[Unit]
Description=slmguard inference
OnFailure=slmguard-crash@%n.service
StartLimitIntervalSec=60
[Service]
Type=notify
ExecStart=/usr/local/bin/slmguard serve --plan /etc/slmguard/plan.json
"""


def test_classify_units_by_exec_start() -> None:
    units = {
        "slmguard.service": UNIT_SERVICE,
        "slmguard-watch.service": "[Service]\nExecStart=/usr/local/bin/slmguard watch\n",
        "slmguard-crash@.service": "[Service]\nExecStart=/usr/local/bin/slmguard watch --collect\n",
        "other.service": "[Service]\nExecStart=/bin/serve watch\n",
        "slmguard.slice": "[Slice]\nMemoryMax=1G\n",
    }
    assert sc.classify_units(units) == {
        "service": "slmguard.service",
        "watch": "slmguard-watch.service",
        "crash": "slmguard-crash@%n.service",  # the service's OnFailure= wins
    }
    assert sc.classify_units({"other.service": units["other.service"]}) == {}


def test_doctor_checks_found_at_any_depth() -> None:
    report = {
        "version": 1,
        "sections": [
            {"checks": [{"id": "vm.swappiness", "severity": "FAIL", "evidence": "60"}]},
            {"checks": [{"id": "overcommit.mode", "status": "warn"}, {"id": 3, "severity": "x"}]},
        ],
    }
    checks = sc.doctor_checks(report)
    assert checks == {"vm.swappiness": "fail", "overcommit.mode": "warn"}
    assert sc.checks_matching(checks, "swappiness") == {"vm.swappiness": "fail"}


def test_tree_diff() -> None:
    before = {"/etc/a": "1", "/etc/b": "2", "/etc/c": "3"}
    after = {"/etc/a": "1", "/etc/b": "9", "/etc/d": "4"}
    assert sc.tree_diff(before, after) == {
        "changed": ["/etc/b"],
        "removed": ["/etc/c"],
        "added": ["/etc/d"],
    }
    assert not any(sc.tree_diff(before, dict(before)).values())


@pytest.mark.parametrize(
    ("text", "usec"),
    [
        ("30s", 30_000_000),
        ("1min 30s", 90_000_000),
        ("500ms", 500_000),
        ("0", 0),
        ("infinity", 0),
        ("2h", 7_200_000_000),
    ],
)
def test_systemd_time_spans(text: str, usec: int) -> None:
    assert sc._usec(text) == usec


def test_cpu_list() -> None:
    assert sc._cpu_list("0-2,5") == {0, 1, 2, 5}
    assert sc._cpu_list("1") == {1}


def test_every_step_is_named_once_and_needs_only_earlier_steps() -> None:
    names = [s[0] for s in sc.STEPS]
    assert len(names) == len(set(names))
    assert tuple(names) == sc.ORDER
    for i, (_, _, needs, _) in enumerate(sc.STEPS):
        assert set(needs) <= set(names[:i])


def make_tree(tmp_path: Path, modules: list[str], kvm: bool) -> Path:
    for m in modules:
        (tmp_path / "sys" / "module" / m).mkdir(parents=True)
    (tmp_path / "dev").mkdir()
    if kvm:
        (tmp_path / "dev" / "kvm").write_text("")
    return tmp_path


@pytest.mark.parametrize(
    ("modules", "kvm", "name", "why"),
    [
        (["kvm", "kvm_intel"], True, "kvm", "hardware"),
        (["kvm", "kvm_amd"], True, "kvm", "hardware"),
        (["kvm", "kvm_pvm"], True, "tcg", "kvm_pvm"),  # what these machines have
        (["kvm", "kvm_intel", "kvm_pvm"], True, "tcg", "kvm_pvm"),
        (["kvm"], True, "tcg", "no kvm_intel"),
        (["kvm", "kvm_intel"], False, "tcg", "not writable"),
    ],
)
def test_choose_accel(tmp_path: Path, modules: list[str], kvm: bool, name: str, why: str) -> None:
    chosen = accel.choose_accel(make_tree(tmp_path, modules, kvm))
    assert chosen.name == name
    assert why in chosen.reason
    assert ("-accel" in chosen.qemu_args) and (name in " ".join(chosen.qemu_args))


def test_forced_accel(tmp_path: Path) -> None:
    assert accel.choose_accel(tmp_path, force="tcg").name == "tcg"
    assert accel.choose_accel(tmp_path, force="kvm").name == "kvm"


@pytest.mark.parametrize(
    ("texts", "mirror"),
    [
        (
            [
                "Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: x\n",
                "Types: deb\n# comment\nURIs: http://deb.debian.org/debian\nSuites: bookworm\n",
            ],
            "http://deb.debian.org/debian",
        ),
        (
            ["deb [arch=amd64] http://ftp.de.debian.org/debian/ bookworm main\n"],
            "http://ftp.de.debian.org/debian/",
        ),
        (["# deb http://commented.example/debian bookworm main\n"], None),
        ([""], None),
    ],
)
def test_parse_apt_mirror(texts: list[str], mirror: str | None) -> None:
    assert base.parse_apt_mirror(texts) == mirror


def test_dev_plan_is_a_valid_plan_for_the_guest() -> None:
    from slmguard.plan.planfile import load_plan

    plan = load_plan(Path(__file__).resolve().parents[1] / "systest" / "dev-plan.json")
    assert plan.board.ram_bytes == 2048 << 20  # the VM's memory (systest.vm.MEMORY_MB)
    assert plan.limits.memory_max_bytes < plan.board.ram_bytes
    assert plan.engine.n_ctx == 512


class _Shedding(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b'{"error": {"message": "busy", "type": "overloaded", "param": null, "code": null}}'
        self.send_response(503)
        self.send_header("retry-after", "2")  # lower-case, as uvicorn sends it
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_http_client_reads_error_status_and_headers_case_insensitively() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Shedding)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
        r = sc.http("POST", url, {"messages": []}, timeout=scaled(10))
    finally:
        server.shutdown()
        server.server_close()
    assert r.status == 503
    assert r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "overloaded"
    gone = sc.http("GET", url, timeout=scaled(5))  # the server is closed now
    assert gone.status is None and gone.error


def _ok(ctx: sc.Ctx) -> tuple[str, dict[str, object]]:
    return "fine", {"n": 1}


def _broken(ctx: sc.Ctx) -> tuple[str, dict[str, object]]:
    raise sc.StepFailed("MemoryMax=max, plan 1000", seen="max")


def _bug(ctx: sc.Ctx) -> tuple[str, dict[str, object]]:
    raise KeyError("MainPID")


def test_runner_propagates_not_available_and_blocks_after_failures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(
        sc,
        "STEPS",
        [
            ("facts", (), (), _ok),
            ("plan", ("plan",), (), _ok),  # verb missing
            ("apply", ("apply",), ("plan",), _ok),  # so this is not available either
            ("start", (), ("facts",), _broken),
            ("limits", (), ("start",), _ok),  # blocked by the failure
            ("oops", (), (), _bug),  # a bug in a step is a failure, not a crash
            ("last", (), ("facts",), _ok),
        ],
    )
    monkeypatch.setattr(sc, "verb_available", lambda ctx, verb: verb != "plan")
    out = tmp_path / "results.jsonl"
    code = sc.run([], sc.Output(out, None), deadline_s=scaled(600))
    parsed = report.parse_results(out.read_text().splitlines())
    assert code == 1
    assert parsed.finished
    got = {s.step: (s.status, s.reason) for s in parsed.steps}
    assert got["facts"] == ("pass", "fine")
    assert got["plan"][0] == "not-available" and "slmguard plan --help" in got["plan"][1]
    assert got["apply"] == ("not-available", "needs step plan, which is not available")
    assert got["start"] == ("fail", "MemoryMax=max, plan 1000")
    assert got["limits"] == ("fail", "blocked: needs step start, which failed")
    assert got["oops"] == ("fail", "KeyError: 'MainPID'")
    assert got["last"] == ("pass", "fine")
    assert next(s for s in parsed.steps if s.step == "start").details == {"seen": "max"}
    assert report.expected_steps(parsed.events) == tuple(got)


def test_runner_reports_steps_past_the_deadline_as_failures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sc, "STEPS", [("a", (), (), _ok), ("b", (), (), _ok)])
    out = tmp_path / "results.jsonl"
    assert sc.run(["b"], sc.Output(out, None), deadline_s=-1) == 1
    parsed = report.parse_results(out.read_text().splitlines())
    assert [(s.step, s.status) for s in parsed.steps] == [("b", "fail")]
    assert "deadline" in parsed.steps[0].reason


def test_the_package_upgrade_runs_only_when_the_host_gave_a_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """From wheels (make systest) there is nothing to upgrade to: the step is not announced;
    asked for by name without a package it says why it cannot run."""
    upgrade = next(s for s in sc.STEPS if s[0] == "package-upgrade")
    monkeypatch.setattr(sc, "STEPS", [("facts", (), (), _ok), (upgrade[0], (), (), upgrade[3])])
    monkeypatch.setattr(sc, "verb_available", lambda ctx, verb: True)
    out = tmp_path / "results.jsonl"
    assert sc.run([], sc.Output(out, None), deadline_s=scaled(600)) == 0
    parsed = report.parse_results(out.read_text().splitlines())
    assert report.expected_steps(parsed.events) == ("facts",)
    out.unlink()
    sc.run(["package-upgrade"], sc.Output(out, None), deadline_s=scaled(600))
    parsed = report.parse_results(out.read_text().splitlines())
    (only,) = parsed.steps
    assert (only.step, only.status) == ("package-upgrade", "not-available")
    assert "no package" in only.reason


def test_a_check_past_its_bound_names_the_phase_it_was_in() -> None:
    """The Ansible step's check answers the host with where it hung, never silence."""
    phases = sc._Phases(0.2)
    with pytest.raises(sc.StepFailed, match=r"did not finish in 0s \(in: served\)"), phases:
        with phases.phase("snapshot"):
            pass
        with phases.phase("served"):
            threading.Event().wait(scaled(30))
    assert set(phases.took) == {"snapshot", "served"}
    # The timer is off again: a later wait is not cut.
    with phases.phase("later"):
        threading.Event().wait(0.4)
    assert phases.took["later"] >= 0.4


def test_a_bounded_check_gives_back_an_alarm_that_was_set() -> None:
    """pytest-timeout (or anything) may hold SIGALRM: the check restores its handler and
    what is left of its timer."""
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, scaled(60))
        with sc._Phases(30):
            pass
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 0 < left <= scaled(60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not fired


def test_snapshot_tree_hashes_files_and_never_opens_a_fifo(tmp_path: Path) -> None:
    (tmp_path / "a.conf").write_text("x")
    os.mkfifo(tmp_path / "pipe")  # open() on it would block the guest's check forever
    (tmp_path / "link").symlink_to("a.conf")
    snap = sc.snapshot_tree(str(tmp_path))
    assert snap[str(tmp_path / "a.conf")].endswith(hashlib.sha256(b"x").hexdigest())
    assert snap[str(tmp_path / "link")] == "link:a.conf"
    mode = snap[str(tmp_path / "pipe")].split(":")[0]
    assert stat.S_ISFIFO(int(mode, 8))  # recorded by its mode, not read


#: A writer as apply is one: each file through slmguard.atomicio, one after another.
_ATOMIC_WRITER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from slmguard.atomicio import write_atomic
for name in sys.argv[3:]:
    write_atomic(Path(sys.argv[2]) / name, b"new")
"""


def test_the_open_gate_stops_a_writer_between_two_atomic_writes(tmp_path: Path) -> None:
    """The power-cut-apply step's stop: fanotify holds the writer inside the open of its
    second file's temporary, where SIGSTOP catches it; the first file is whole and new,
    the second still old. A real fanotify gate, a real writer process."""
    import subprocess

    for name in ("a.conf", "b.conf"):
        (tmp_path / name).write_bytes(b"old")
    try:
        gate = sc.OpenGate([tmp_path])
    except OSError as err:  # fanotify's permission events need CAP_SYS_ADMIN
        pytest.skip(f"no fanotify permission events here: {err}")
    src = Path(__file__).resolve().parents[1] / "src"
    child = subprocess.Popen([sys.executable, "-c", _ATOMIC_WRITER, str(src), str(tmp_path),
                              "a.conf", "b.conf"])  # fmt: skip
    seen: list[str] = []

    def second(pid: int, path: str) -> bool:
        target = sc.atomic_target(path)
        if pid != child.pid or target is None:
            return False
        seen.append(target)
        if len(set(seen)) < 2:
            return False
        os.kill(child.pid, signal.SIGSTOP)
        return True

    try:
        stopped = gate.pass_until(second, scaled(60), lambda: child.poll() is None)
    finally:
        gate.close()
    try:
        assert stopped, f"the writer finished first (opens seen: {seen})"
        assert (tmp_path / "a.conf").read_bytes() == b"new"
        assert (tmp_path / "b.conf").read_bytes() == b"old"
        state = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state == "T" and child.poll() is None
    finally:
        os.kill(child.pid, signal.SIGCONT)
        assert child.wait(timeout=scaled(60)) == 0
    assert (tmp_path / "b.conf").read_bytes() == b"new"
    assert seen == [str(tmp_path / "a.conf"), str(tmp_path / "b.conf")]


def test_fanotify_events_and_atomic_temporaries_are_parsed() -> None:
    one = sc.FAN_EVENT.pack(24, 3, 0, 24, sc.FAN_OPEN_PERM, 7, 1234)
    two = sc.FAN_EVENT.pack(24, 3, 0, 24, sc.FAN_OPEN_PERM, 8, 99)
    assert sc.parse_fanotify_events(one + two) == [(7, 1234), (8, 99)]
    assert sc.parse_fanotify_events(b"") == []
    assert sc.atomic_target("/etc/slmguard/.plan.json.slmguard-tmp-42") == "/etc/slmguard/plan.json"
    assert sc.atomic_target("/etc/slmguard/plan.json") is None
    assert sc.atomic_target("/etc/.hidden") is None


#: A scenario with a step that cuts the power, as a child process (the guest before the cut).
_CUTTER = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from systest.guest import scenario as sc

def cutter(ctx):
    data = sc.resumed(ctx, "cutter")
    if data is None:
        ctx.model = "kept across the boot"
        sc.cut_power(ctx, "cutter", {"written": 3}, 0.0)
    return f"after the boot: {data['written']} written, model {ctx.model}", data

def ok(ctx):
    return "fine", {}

sc.STEPS[:] = [("first", (), (), ok), ("cutter", (), ("first",), cutter),
               ("last", (), ("cutter",), ok)]
share = Path(sys.argv[2])
sys.exit(sc.run([], sc.Output(share / "results.jsonl", None), 600.0, share=share))
"""


def test_a_step_that_cuts_the_power_goes_on_after_the_boot(tmp_path: Path) -> None:
    """The scenario process is killed where the power cut comes (it waits for it); the
    next run (the boot after) resumes: the steps before are not run again, the cutting
    step gets its data and the context back, the rest runs, each step reported once."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    results = tmp_path / "results.jsonl"
    child = subprocess.Popen([sys.executable, "-c", _CUTTER, str(repo), str(tmp_path)])
    try:
        from waiting import wait_for

        def cut_asked() -> bool:
            events = report.parse_results(sc.read(results).splitlines()).events
            return any(e.get("event") == sc.POWER_CUT for e in events)

        wait_for(cut_asked, scaled(60), "the power-cut event", interval_s=0.1)
        assert child.poll() is None  # it waits for the cut
    finally:
        child.kill()  # the power cut, as the scenario sees it
        child.wait(timeout=scaled(30))
    assert (tmp_path / sc.RESUME_FILE).exists()
    monkey_steps = []

    def cutter(ctx: sc.Ctx) -> tuple[str, dict[str, object]]:
        data = sc.resumed(ctx, "cutter")
        assert data is not None, "the step was not resumed"
        return f"after the boot: {data['written']} written, model {ctx.model}", dict(data)

    def ok(ctx: sc.Ctx) -> tuple[str, dict[str, object]]:
        monkey_steps.append(ctx.status.copy())
        return "fine", {}

    steps = [("first", (), (), ok), ("cutter", (), ("first",), cutter),
             ("last", (), ("cutter",), ok)]  # fmt: skip
    saved = list(sc.STEPS)
    sc.STEPS[:] = steps
    try:
        code = sc.run([], sc.Output(results, None), scaled(600), share=tmp_path)
    finally:
        sc.STEPS[:] = saved
    assert code == 0
    parsed = report.parse_results(results.read_text().splitlines())
    got = {s.step: (s.status, s.reason) for s in parsed.steps}
    assert got == {
        "first": ("pass", "fine"),
        "cutter": ("pass", "after the boot: 3 written, model kept across the boot"),
        "last": ("pass", "fine"),
    }
    assert monkey_steps == [{"first": "pass", "cutter": "pass"}]  # "first" ran once, before
    assert [e["event"] for e in parsed.events] == ["begin", sc.POWER_CUT, "resume", "end"]
    assert parsed.finished and not (tmp_path / sc.RESUME_FILE).exists()


#: apply of plan B over plan A (the deploy tests' plans), in a process of its own (its
#: models made elsewhere: plan A's installed model is a hard link of the file it was made in).
_APPLY_B = """
import sys
from pathlib import Path
sys.path[:0] = sys.argv[1:3]
from test_render_previous import OTHER_OPTS, _apply, _plans
_, b = _plans(Path(sys.argv[3]))
_apply(Path(sys.argv[4]), b, OTHER_OPTS)
"""


def test_apply_stopped_by_the_gate_and_cut_is_undone_by_the_recovery(tmp_path: Path) -> None:
    """power-cut-apply on the host: a real apply of plan B over plan A, held by the gate
    inside its second write and killed there (what the process sees of a power cut);
    ``rollback --if-unfinished`` (the boot's recovery) brings back plan A's files, and
    no temporary of the cut write is left (it was, before the recovery removed them)."""
    import subprocess

    from rendertrees import make_board_root
    from slmguard.deploy.manifest import load_manifest
    from slmguard.deploy.rollback import rollback_unfinished
    from test_render_previous import OPTS, _apply, _plans, deployment

    root = make_board_root(tmp_path / "root", "armbian")
    a, _ = _plans(tmp_path)
    _apply(root, a, OPTS)
    on_a = deployment(root)
    dirs = [Path(d) for d, _, _ in os.walk(root / "etc")]
    try:
        gate = sc.OpenGate(dirs)
    except OSError as err:
        pytest.skip(f"no fanotify permission events here: {err}")
    tests = Path(__file__).resolve().parent
    child = subprocess.Popen([sys.executable, "-c", _APPLY_B, str(tests.parent / "src"),
                              str(tests), str(tmp_path / "b"), str(root)])  # fmt: skip
    seen: list[str] = []

    def second(pid: int, path: str) -> bool:
        target = sc.atomic_target(path)
        if pid != child.pid or target is None:
            return False
        seen.append(target)
        if len(set(seen)) < 2:
            return False
        os.kill(child.pid, signal.SIGSTOP)
        return True

    try:
        stopped = gate.pass_until(second, scaled(120), lambda: child.poll() is None)
    finally:
        gate.close()
    child.kill()  # the cut
    child.wait(timeout=scaled(60))
    assert stopped, f"apply finished first (its writes: {seen})"
    manifest = load_manifest(root)
    assert manifest is not None and not manifest.complete
    half = deployment(root)
    assert half != on_a and any(sc.TMP_MARK in p for p in half)  # B begun, its debris
    back = rollback_unfinished(root)
    assert back.unfinished and deployment(root) == on_a


# ------------------------------------------------ power-cut-upgrade (issue 40)

#: A reader of two files in turn, as pip reads the wheels; it says which it has read.
_READER = """
import sys
for name in sys.argv[2:]:
    with open(sys.argv[1] + "/" + name, "rb") as f:
        f.read()
    print(name, flush=True)
"""


def test_the_holding_gate_keeps_the_opener_inside_open_until_it_closes(tmp_path: Path) -> None:
    """power-cut-upgrade's hold: the matching open is never answered, so the opener (the
    postinst's pip) waits inside open(2) until the power is cut; every other is let
    through. A real fanotify gate, a real reader process."""
    import subprocess

    for name in ("deps.whl", "slmguard.whl"):
        (tmp_path / name).write_bytes(b"PK")
    try:
        gate = sc.HoldingGate([tmp_path])
    except OSError as err:  # fanotify's permission events need CAP_SYS_ADMIN
        pytest.skip(f"no fanotify permission events here: {err}")
    child = subprocess.Popen([sys.executable, "-c", _READER, str(tmp_path), "deps.whl",
                              "slmguard.whl"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        held = gate.hold(lambda pid, path: path.endswith("/slmguard.whl"), scaled(60),
                         lambda: child.poll() is None)  # fmt: skip
        assert held == (child.pid, str(tmp_path / "slmguard.whl"))
        assert child.stdout is not None and child.stdout.readline() == "deps.whl\n"
        state = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state in ("S", "D") and child.poll() is None  # waiting for the answer
    finally:
        gate.close()  # the held open is allowed
    out, _ = child.communicate(timeout=scaled(60))
    assert child.returncode == 0 and out == "slmguard.whl\n"


def test_the_gate_holds_the_venv_build_opening_the_new_wheel_only() -> None:
    wheel = "slmguard-0.1.0-py3-none-any.whl"
    final = f"/usr/lib/slmguard/wheels/{wheel}"
    assert sc.pip_opens_wheel(final, "python", wheel)
    assert not sc.pip_opens_wheel(final + ".dpkg-new", "dpkg", wheel)  # the unpack
    assert not sc.pip_opens_wheel(final, "dpkg", wheel)
    assert not sc.pip_opens_wheel("/usr/lib/slmguard/wheels/slmguard-0.0.99-py3-none-any.whl",
                                  "python", wheel)  # fmt: skip


def test_the_new_wheel_is_found_in_the_packages_listing() -> None:
    listing = (
        "drwxr-xr-x root/root         0 2026-01-01 00:00 ./usr/lib/slmguard/\n"
        "-rw-r--r-- root/root      4512 2026-01-01 00:00 ./usr/lib/slmguard/maint.py\n"
        "drwxr-xr-x root/root         0 2026-01-01 00:00 ./usr/lib/slmguard/wheels/\n"
        "-rw-r--r-- root/root    812345 2026-01-01 00:00 "
        "./usr/lib/slmguard/wheels/slmguard-0.1.0-py3-none-any.whl\n"
        "lrwxrwxrwx root/root         0 2026-01-01 00:00 ./usr/bin/slmguard -> "
        "/opt/slmguard/bin/slmguard\n"
    )
    assert sc.wheel_in_listing(listing) == "slmguard-0.1.0-py3-none-any.whl"
    assert sc.wheel_in_listing(listing.replace("slmguard/wheels/slmguard-", "x/wheels/s-")) is None
    assert sc.wheel_in_listing("") is None


@pytest.mark.parametrize(
    ("status", "state"),
    [
        ("install ok half-configured", "half-configured"),
        ("install ok installed", "installed"),
        ("install reinstreq half-installed", "half-installed"),
        ("", "not-installed"),
    ],
)
def test_dpkg_state_word(status: str, state: str) -> None:
    assert sc.dpkg_state(status) == state


def test_the_upgrade_cut_runs_only_when_named() -> None:
    assert "power-cut-upgrade" in sc.FAULT_STEPS
    names = [s[0] for s in sc.STEPS]
    assert names.index("power-cut-upgrade") > names.index("service-start")


def test_a_failed_neighbour_step_keeps_the_journal_lines_that_say_what_went_wrong() -> None:
    journal = "\n".join([
        "2026-12-06 19:08:01,100 INFO slmguard.serve.engine: engine started: pid 506",
        "2026-12-06 19:08:20,200 ERROR slmguard.serve.engine: engine exited (killed by SIGABRT)",
        "2026-12-06 19:08:21,300 INFO slmguard.engine: 0.00.1 I load: model",
        "Traceback (most recent call last):",
        "slmguard.service: Main process exited, code=exited, status=70/SOFTWARE",
        "slmguard.service: Scheduled restart job, restart counter is at 1.",
        "2026-12-06 19:09:00,000 WARNING slmguard.governor: governor.transition {}",
    ])  # fmt: skip
    kept = sc._journal_problems(journal).splitlines()
    assert kept == [
        "2026-12-06 19:08:20,200 ERROR slmguard.serve.engine: engine exited (killed by SIGABRT)",
        "Traceback (most recent call last):",
        "slmguard.service: Main process exited, code=exited, status=70/SOFTWARE",
        "slmguard.service: Scheduled restart job, restart counter is at 1.",
        "2026-12-06 19:09:00,000 WARNING slmguard.governor: governor.transition {}",
    ]
    assert len(sc._journal_problems(journal, limit=40)) == 40
