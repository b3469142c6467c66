"""host.files: the one small-file read, over real trees, and that every host reader uses it."""

from __future__ import annotations

import ast
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from hosttree import build_tree
from slmguard.errors import HostReadError
from slmguard.host import files
from waiting import scaled

REPO = Path(__file__).resolve().parent.parent
HOST = REPO / "src" / "slmguard" / "host"


def test_a_file_is_read_whole(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"sys/class/thermal/thermal_zone0/temp": "45250\n"})
    got = files.read(root / "sys/class/thermal/thermal_zone0/temp")
    assert (got.data, got.text, got.integer()) == (b"45250\n", "45250\n", 45250)
    assert not (got.absent or got.needs_root or got.truncated) and got.error is None
    assert got.require() == got.optional() == "45250\n"


def test_an_empty_file_is_read_not_absent(tmp_path: Path) -> None:
    got = files.read(build_tree(tmp_path, {"empty": ""}) / "empty")
    assert got.data == b"" and not got.absent and got.integer() is None


def test_missing_and_a_path_through_a_file_are_absent(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"proc/meminfo": "MemTotal: 1 kB\n"})
    for path in (root / "proc/swaps", root / "proc/meminfo/below", root / "no/such/dir"):
        got = files.read(path)
        assert got.absent and not got.needs_root, path
        assert got.data is None and got.text is None and got.integer() is None
        assert got.error is None  # absent is not an error: the kernel lacks the feature
        assert got.optional() is None
        with pytest.raises(HostReadError) as raised:
            got.require(missing="missing (kernel without CONFIG_SWAP?)")
        assert raised.value.path == path
        assert raised.value.problem == "missing (kernel without CONFIG_SWAP?)"


def test_another_errno_is_kept_with_its_text(tmp_path: Path) -> None:
    # EISDIR comes from read(), ENXIO from open() of a socket: neither is absent nor root's.
    sock_path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        for path, code in ((tmp_path, errno.EISDIR), (sock_path, errno.ENXIO)):
            text = os.strerror(code)
            got = files.read(path)
            assert not got.absent and not got.needs_root and got.data is None
            assert got.error == text, got
            with pytest.raises(HostReadError) as raised:
                got.optional()  # only an absent file is None
            assert raised.value.problem == text


def test_longer_than_the_bound_is_cut_and_said(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"exact": b"x" * 64, "long": b"y" * 65 + b"\n"})
    exact = files.read(root / "exact", max_bytes=64)
    assert exact.data == b"x" * 64 and not exact.truncated
    cut = files.read(root / "long", max_bytes=64)
    assert cut.data == b"y" * 64 and cut.truncated
    # the default bound holds a file that spans several reads
    big = build_tree(tmp_path, {"big": b"z" * (3 * files.ATTR_BYTES + 5)}) / "big"
    assert len(files.read(big).data or b"") == 3 * files.ATTR_BYTES + 5
    attr = files.read_attr(big)
    assert len(attr.data or b"") == files.ATTR_BYTES and attr.truncated


def test_a_truncated_kernel_file_reads_what_is_there(tmp_path: Path) -> None:
    # A sensor file cut mid-number (a driver that stopped): the bytes, then the parse decides.
    root = build_tree(tmp_path, {"temp": "452", "status": "VmRSS:\t  30772 kB\nRssAn"})
    assert files.read(root / "temp").integer() == 452
    assert files.read(root / "status").require().endswith("RssAn")


def test_non_utf8_bytes_are_replaced_in_text_and_kept_in_data(tmp_path: Path) -> None:
    raw = b"drm-driver:\tpan\xffthor\nname:\t\xc3\x28\n"
    got = files.read(build_tree(tmp_path, {"fdinfo": raw}) / "fdinfo")
    assert got.data == got.require_bytes() == raw
    assert got.text == raw.decode("utf-8", errors="replace") and "\ufffd" in (got.text or "")
    assert files.read(build_tree(tmp_path, {"n": b"1\xff"}) / "n").integer() is None


def test_a_fifo_in_a_fixture_root_does_not_hang_the_read(tmp_path: Path) -> None:
    fifo = tmp_path / "etc/fstab"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    result: list[files.FileRead] = []
    reader = threading.Thread(target=lambda: result.append(files.read(fifo)), daemon=True)
    reader.start()
    reader.join(scaled(10))
    if reader.is_alive():  # a blocking open waits for a writer: give it one, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(scaled(10))
        pytest.fail("reading a FIFO blocked until a writer came")
    assert result[0].data == b""  # no writer: end of file at once


# ---------------------------------------------------------------- needs root, for real

# The tests run as root here, and root reads a mode-000 file: the read is done in a
# child that drops to nobody (setuid) on a tree it can traverse down to the locked parts.

CHILD = """
import json, os, sys
from pathlib import Path
from slmguard.errors import HostReadError
from slmguard.host import files
if os.geteuid() == 0:
    os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter may live under /root
root = Path(sys.argv[1])
out = {}
for name in ("locked", "closed/inside", "open"):
    got = files.read(root / name)
    try:
        got.require()
        problem = None
    except HostReadError as err:
        problem = err.problem
    out[name] = {"absent": got.absent, "needs_root": got.needs_root, "error": got.error,
                 "text": got.text, "problem": problem, "probe": files.probe(root / name)}
print(json.dumps(out))
"""


def test_unreadable_is_needs_root_not_absent() -> None:
    base = Path(tempfile.mkdtemp(prefix="slmguard-files-noroot-"))
    try:
        base.chmod(0o755)
        root = build_tree(base, {"locked": "1\n", "closed/inside": "2\n", "open": "3\n"})
        (root / "closed").chmod(0o755)
        (root / "open").chmod(0o644)
        (root / "locked").chmod(0o000)  # the file itself: open() says EACCES
        (root / "closed").chmod(0o000)  # a directory on the way: EACCES too
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(root)],
            capture_output=True, text=True, timeout=scaled(60), env=env, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
    finally:
        (base / "closed").chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)
    for name in ("locked", "closed/inside"):
        assert seen[name] == {
            "absent": False, "needs_root": True, "error": files.NEEDS_ROOT, "text": None,
            "problem": "permission denied", "probe": "yes" if name == "locked" else "needs root",
        }, name  # fmt: skip
    assert seen["open"]["text"] == "3\n" and seen["open"]["problem"] is None


# ---------------------------------------------------------------- every reader uses it

# What host/ may open without files.read: /dev/kmsg (a device read record by record), a
# process's fd directory (listed with one readlink per fd) and a model file of GBs hashed
# block by block (filedigest: a small-file read's bound would cut it).
ALLOWED_OPENS = {("kmsg.py", "os.open"), ("process.py", "os.open"), ("filedigest.py", "os.open")}
READ_CALLS = {"open", "os.open", "io.open", "read_text", "read_bytes"}


def direct_reads(host: Path) -> list[str]:
    """Every call under ``host`` that opens or reads a file outside ``files.py``."""
    found: list[tuple[str, int, str]] = []
    for path in sorted(host.glob("*.py")):
        if path.name == "files.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name):
                name = func.id
            elif isinstance(func, ast.Attribute):
                owner = func.value.id if isinstance(func.value, ast.Name) else ""
                if owner == "self":
                    continue  # a method of the module's own class (KmsgReader.open)
                name = f"{owner}.{func.attr}" if owner in ("os", "io") else func.attr
            else:
                continue
            if name in READ_CALLS and (path.name, name) not in ALLOWED_OPENS:
                found.append((path.name, node.lineno, name))
    return [f"{file}:{line} {name}" for file, line, name in sorted(found)]


def test_every_host_reader_reads_through_files() -> None:
    assert direct_reads(HOST) == []


def test_the_scan_finds_a_direct_read(tmp_path: Path) -> None:
    (tmp_path / "thermal.py").write_text(
        "from pathlib import Path\n"
        "def temp(p: Path) -> str:\n"
        "    return p.read_text()\n"
        "def raw(p: Path) -> bytes:\n"
        "    with p.open('rb') as f:\n"
        "        return f.read()\n"
        "def kmsg() -> object:\n"
        "    import os\n"
        "    return os.open('/dev/kmsg', 0)\n"
    )
    assert direct_reads(tmp_path) == [
        "thermal.py:3 read_text", "thermal.py:5 open", "thermal.py:9 os.open",
    ]  # fmt: skip
