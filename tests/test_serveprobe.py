"""benchmarks/serveprobe.py names what differs between two engines besides the front.

The overhead benchmarks (``make bench-overhead``) compare a served engine with a bare one
and print :func:`serveprobe.differences` beside their figures: a bare engine left in the
benchmark's session (one CPU scheduling group with the client, under the kernel's
autogroup) or given another environment must be named, and two processes started alike
must give nothing. Real processes (``sleep``), no engine; no timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from serveprobe import differences, flags, param_differences


@contextmanager
def sleeper(*, own_session: bool, env: dict[str, str] | None = None) -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "600"], start_new_session=own_session,
                            env={**os.environ, **(env or {})})  # fmt: skip
    try:
        # Popen returns once the exec has begun (vfork); the kernel shows the new command
        # line only when it has finished, and on a busy host that can come later.
        deadline = time.monotonic() + 60
        while Path(f"/proc/{proc.pid}/cmdline").read_bytes() != b"sleep\x00600\x00":
            assert time.monotonic() < deadline, "sleep never started"
            time.sleep(0.01)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_two_processes_started_alike_differ_in_nothing() -> None:
    with sleeper(own_session=True) as a, sleeper(own_session=True) as b:
        assert differences(a, b) == []


def test_a_process_left_in_this_session_is_named() -> None:
    with sleeper(own_session=False) as bare, sleeper(own_session=True) as served:
        found = differences(bare, served)
    assert found == ["own session (own autogroup): bare False, served True"]


def test_an_environment_variable_only_one_side_has_is_named() -> None:
    extra = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    with sleeper(own_session=True) as bare, sleeper(own_session=True, env=extra) as served:
        found = differences(bare, served)
    assert found == ["environment MALLOC_MMAP_THRESHOLD_: bare None, served '131072'"]


def test_the_run_s_own_values_are_not_differences_but_flags_are() -> None:
    served = ["--model", "m.gguf", "--host", "/run/e.sock", "--api-key-file", "/run/k",
              "--flash-attn", "on", "--slot-save-path", "/run/slots"]  # fmt: skip
    bare = ["--model", "m.gguf", "--host", "127.0.0.1", "--flash-attn", "off", "--port", "1"]
    assert flags(served) == ["--model", "m.gguf", "--flash-attn", "on"]
    assert flags(bare) == ["--model", "m.gguf", "--flash-attn", "off"]


def test_sampling_parameters_that_differ_are_named() -> None:
    bare = {"temperature": 0.0, "top_k": 40, "samplers": ["top_k", "temperature"]}
    served = {"temperature": 0.0, "top_k": 1, "samplers": ["top_k", "temperature"]}
    assert param_differences(bare, served) == ["top_k: bare 40, served 1"]
    assert param_differences(bare, dict(bare)) == []
