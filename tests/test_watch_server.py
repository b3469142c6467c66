"""The watcher against a real running server (real engine, real model).

* the trim call: the governor's real ``POST /api/v1/context/trim`` behind its
  real admin-token check, and ``GET /api/v1/governor`` into a crash bundle;
* unexpected exits of the real ``slmguard serve``: the engine killed (the
  server restarts it, /health counts it) and then the service itself;
* the progress view of an engine not started by slmguard: a bare llama-server.

The memory signal comes from a fixture cgroup tree with a low warning line,
so the trim is decided by the watcher's own rule, not forced.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cgrouptrees import DIRS, TREES
from hosttree import build_tree
from slmguard.watch.config import WatchConfig
from slmguard.watch.daemon import PollResult, Watcher

pytestmark = [pytest.mark.engine, pytest.mark.slow]

from serveproc import ServeFactory, engine_available, free_port  # noqa: E402

if not engine_available():  # pragma: no cover - depends on the machine
    pytest.skip("the llama-server binary is not there (run `make`)", allow_module_level=True)

import realcgroup  # noqa: E402
from governorserver import governed_server  # noqa: E402  (imports the web stack)

SLMGUARD = str(Path(sys.executable).parent / "slmguard")


def _root(tmp_path: Path) -> Path:
    tree: dict[str, str | bytes | None] = dict(TREES[2])
    tree.update(
        {
            f"{DIRS[2]}/cgroup.procs": "",
            "sys/fs/cgroup/cgroup.procs": "",
            "sys/fs/cgroup/system.slice/cgroup.procs": "",
            "proc/meminfo": "MemTotal: 4018000 kB\nMemAvailable: 2000000 kB\n",
            "proc/pressure/memory": "some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n",
            "dev/kmsg": "",
        }
    )
    return build_tree(tmp_path / "root", tree)


def _poll_until(
    w: Watcher, kind: str, tries: int = 100, seen: list[str] | None = None
) -> PollResult:
    """Poll until an alert of ``kind``; ``seen`` collects every alert kind on the way."""
    for _ in range(tries):
        result = w.poll()
        kinds = [a.kind for a in result.decision.alerts]
        if seen is not None:
            seen.extend(kinds)
        if kind in kinds:
            return result
        time.sleep(0.2)
    raise AssertionError(f"no {kind} alert")


def test_trim_against_the_real_governor(tmp_path: Path) -> None:
    state = tmp_path / "srv"
    with governed_server(state, n_ctx=512) as srv:
        assert srv.admin_token is not None
        token = tmp_path / "admin.token"
        token.write_text(srv.admin_token + "\n")
        root = _root(tmp_path)
        cfg = WatchConfig(
            root=root, state_dir=state, cgroup=root / DIRS[2], server_url=srv.url,
            admin_token_file=token, warn_pct=5.0, sustain_s=0.0, keep_recent=64,
        )  # fmt: skip
        with Watcher(cfg) as w:
            result = w.poll()
            assert result.trim is not None
            assert result.trim.status == 200, result.trim.body
            assert result.trim.body["keep_recent"] == 64
            assert result.snapshot.health is not None and result.snapshot.health.ok
            assert result.snapshot.governor is not None and result.snapshot.governor.ok
            bundle = w.collect("on-demand")
        governor = json.loads((bundle / "governor.json").read_text())
        assert isinstance(governor, dict) and governor
        wrong = tmp_path / "wrong.token"
        wrong.write_text("not-the-token\n")
        cfg2 = WatchConfig(
            root=root, state_dir=tmp_path / "s2", cgroup=root / DIRS[2], server_url=srv.url,
            admin_token_file=wrong, warn_pct=5.0, sustain_s=0.0,
        )  # fmt: skip
        with Watcher(cfg2) as w:
            refused = w.poll().trim
        assert refused is not None and refused.status == 401


def test_trim_engine_kill_and_service_death_on_slmguard_serve(tmp_path: Path) -> None:
    """The real `slmguard serve` (governor on, admin token): the watcher's trim call is
    accepted; a killed engine is one critical event with a bundle holding the server's
    fault traces; a killed front is a crash."""
    token = tmp_path / "admin.token"
    token.write_text("watch-test-admin-token\n")
    factory = ServeFactory(tmp_path)
    try:
        server = factory("--admin-token-file", str(token))
        front = server.proc.pid
        # Host mode (no cgroup): MemTotal - MemAvailable against a 1 MiB line is
        # far above it, so the first poll decides to trim (sustain 0).
        cfg = WatchConfig(
            state_dir=server.state_dir, pids=(front,), server_url=server.url,
            interval_s=0.5, http_timeout_s=5.0, exit_settle_s=0.0, limit_bytes=1 << 20,
            sustain_s=0.0, keep_recent=32, admin_token_file=token,
        )  # fmt: skip
        with Watcher(cfg) as w:
            first = w.poll()
            assert first.trim is not None and first.trim.status == 200, first.trim
            assert first.trim.body["keep_recent"] == 32
            assert first.snapshot.governor is not None and first.snapshot.governor.ok
            health = first.snapshot.health
            assert health is not None and health.ok
            engine = health.body["engine"]["pid"]
            pids = {p.pid for p in first.snapshot.processes}
            assert {front, engine} <= pids  # the engine comes from /health
            progress = first.snapshot.progress
            assert progress is not None and not progress.busy
            assert all(p.fd_count > 0 for p in first.snapshot.processes)
            w.poll()

            os.kill(engine, signal.SIGKILL)
            restarted = _poll_until(w, "engine-restart")
            assert restarted.decision.level == 2
            assert restarted.bundle is not None
            assert "process-exit" not in [a.kind for a in restarted.decision.alerts]
            files = json.loads((restarted.bundle / "summary.json").read_text())["files"]
            traces = sorted(f"faults/{p.name}" for p in (server.state_dir / "faults").glob("*.log"))
            assert traces and set(traces) <= set(files)
            assert "governor.json" in files or "health.json" in files
            server.wait_state("ready")
            w.poll()
            w.poll()

            os.kill(front, signal.SIGKILL)
            kinds: list[str] = []
            died = _poll_until(w, "process-exit", seen=kinds)
            # The port may close a poll before the process is gone: either order is fine.
            assert "server-down" in kinds
            assert died.decision.level == 2 and died.bundle is not None
            summary = json.loads((died.bundle / "summary.json").read_text())
            assert summary["reason"] == "process-exit"
    finally:
        factory.stop_all()


@pytest.mark.cgroup
def test_real_oom_kill_of_the_engine(tmp_path: Path) -> None:
    """The real server in a real memory cgroup whose limit leaves no room for a prompt:
    the kernel kills the engine, the watcher reports that kill once (pid, comm,
    bundle), and the server's restart of the engine adds an alert but no second bundle."""
    reason = realcgroup.unavailable_reason()
    if reason:
        pytest.skip(reason)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state = tmp_path / "state"
    with realcgroup.memory_cgroup(1 << 30, prefix="slmguard-watch-serve") as cg:
        argv = [SLMGUARD, "serve", "--port", str(port), "--state-dir", str(state)]
        argv += ["--n-ctx", "2048", "--no-governor", "--restart-backoff-initial-s", "0.5"]
        with (tmp_path / "serve.log").open("wb") as log:
            proc = subprocess.Popen(cg.command(argv), stdout=log, stderr=subprocess.STDOUT)
        try:
            cfg = WatchConfig(state_dir=state, cgroup=cg.path, server_url=url, http_timeout_s=5)
            with Watcher(cfg) as w:
                engine = None
                for _ in range(600):
                    result = w.poll()
                    h = result.snapshot.health
                    if h is not None and h.ok and h.body.get("state") == "ready":
                        engine = h.body["engine"]["pid"]
                        break
                    time.sleep(0.2)
                assert engine is not None, (tmp_path / "serve.log").read_text()[-2000:]
                comm = Path(f"/proc/{engine}/comm").read_text().strip()
                w.poll()  # the engine is now a settled, watched process

                # No room for the prompt's compute buffer: the next request is fatal.
                usage = int(cg.read("memory.usage_in_bytes"))
                (cg.path / "memory.limit_in_bytes").write_text(str(usage + (4 << 20)))
                body = json.dumps(
                    {"model": "gemma-3-270m-q4_k_m", "prompt": "hello " * 1500, "max_tokens": 2}
                ).encode()
                request = urllib.request.Request(
                    url + "/v1/completions", data=body, headers={"content-type": "application/json"}
                )
                with pytest.raises(urllib.error.HTTPError):
                    urllib.request.urlopen(request, timeout=120)

                polls = [_poll_until(w, "oom-kill")]
                (cg.path / "memory.limit_in_bytes").write_text(str(1 << 30))
                (kill,) = polls[0].decision.service_kills
                assert (kill.pid, kill.comm) == (engine, comm)
                assert kill.task_memcg == cg.kernel_path
                bundle = polls[0].bundle
                assert bundle is not None
                assert f"Killed process {engine}" in (bundle / "oom-report.txt").read_text()

                # The server restarts the engine: that may be seen in the same poll.
                def alerts() -> list[str]:
                    return [a.kind for p in polls for a in p.decision.alerts]

                while "engine-restart" not in alerts() and len(polls) < 100:
                    time.sleep(0.2)
                    polls.append(w.poll())
                restart = next(
                    a for p in polls for a in p.decision.alerts if a.kind == "engine-restart"
                )
                assert restart.facts["oom_killed"] is True
                assert alerts().count("oom-kill") == 1
                assert [p.bundle for p in polls if p.bundle] == [bundle]  # no second bundle
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_the_progress_of_a_bare_llama_server(tmp_path: Path) -> None:
    """An engine slmguard did not start: busy and its decode counter from /slots and
    /metrics while a request runs; idle after it."""
    import threading

    from slmguard import paths
    from slmguard.default_model import ensure_default_model
    from slmguard.serve.llamaserver import EngineConfig, engine_argv, find_llama_server
    from slmguard.watch.sources import HttpStatus, read_engine_progress

    model = str(ensure_default_model(paths.model_dir()))
    argv = engine_argv(find_llama_server(), EngineConfig(model_path=model, n_ctx=1024, n_batch=512,
                                                    n_ubatch=512, n_threads=2),
                       socket_path=tmp_path / "x.sock", api_key_file=tmp_path / "k",
                       alias="m")  # fmt: skip
    argv[argv.index("--host") + 1] = "127.0.0.1"
    del argv[argv.index("--api-key-file") : argv.index("--api-key-file") + 2]
    port = free_port()
    proc = subprocess.Popen([*argv, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        health = HttpStatus(base + "/health", 200, {"status": "ok"})
        idle = read_engine_progress(base, health, 5.0)
        assert idle is not None and not idle.busy
        body = json.dumps({"prompt": "Once upon a time", "n_predict": 200}).encode()
        request = urllib.request.Request(
            base + "/completion", data=body, headers={"content-type": "application/json"}
        )
        worker = threading.Thread(target=lambda: urllib.request.urlopen(request, timeout=300))
        worker.start()
        seen = []
        for _ in range(300):
            prog = read_engine_progress(base, health, 5.0)
            if prog is not None and prog.busy:
                seen.append(prog.counter)
                if len(seen) >= 3 and seen[-1] > seen[0]:
                    break
            time.sleep(0.1)
        assert len(seen) >= 3 and seen[-1] > seen[0] > idle.counter - 1, seen
        worker.join(300)
        done = read_engine_progress(base, health, 5.0)
        assert done is not None and not done.busy and done.counter >= seen[-1]
    finally:
        proc.kill()
        proc.wait(30)
