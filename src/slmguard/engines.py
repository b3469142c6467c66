"""The engine builds installed here, the one chosen for this CPU, and what a binary is.

Owns three things, below serve/ and deploy/ so that both (and doctor) may use them:
**listing** the ``llama-server`` builds installed (:func:`installed_builds`: the Debian
package's, one per CPU profile with its ``build.json``, :class:`BuildInfo`; the venv's;
the first on ``PATH``), **selecting** the best for this CPU (:func:`select`, pure: the
described build that needs the most features this CPU has, then undescribed ones, each
candidate with a verdict and its reason, as ``slmguard engine`` prints) and **probing**
a binary (:func:`probe`: ``--version``, ``--list-devices``, :func:`grammar_bound`, and
that it starts and answers a one-token completion: a build for features the CPU lacks
answers ``--version`` and then dies of SIGILL).

It must not read CPU features itself (:mod:`slmguard.host.cpufeatures`) nor run an
engine beyond the probe (``serve``). ``build.json`` and the binaries' output are read
with bounds (64 KiB each, 64 flags of 200 characters): a board's own build is not trusted.

Example::

    chosen = select_engine()
    chosen.binary          # Path("/usr/lib/slmguard/engines/dotprod/llama-server")
    chosen.reason          # "dotprod: this CPU has all 8 features it needs (...)"
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard.errors import ConfigError, EngineUnavailableError
from slmguard.host.cpufeatures import CpuFeatures, read_cpu_features

BINARY = "llama-server"
PACKAGE_DIR = Path("/usr/lib/slmguard/engines")
BUILD_JSON = "build.json"
BUILD_SCHEMA = "slmguard.engine-build/1"
PACKAGE, VENV, PATH = "package", "venv", "PATH"

_JSON_MAX_BYTES = 64 * 1024
_OUTPUT_MAX_BYTES = 64 * 1024
_MAX_ITEMS = 64
_MAX_ITEM_CHARS = 200
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-.")


@dataclass(frozen=True)
class BuildInfo:
    """A build's ``build.json``: what it is and what it needs from the CPU."""

    profile: str
    arch: str  # uname -m spelling: x86_64, aarch64
    cpu_features: tuple[str, ...]
    llama_cpp: str
    backends: tuple[str, ...]
    cmake_flags: tuple[str, ...]

    def to_json(self) -> str:
        data = {"schema": BUILD_SCHEMA, **self.__dict__}
        data = {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}
        return json.dumps(data, indent=2) + "\n"


@dataclass(frozen=True)
class EngineBuild:
    """One installed llama-server: where it is, where it came from, what it says it is."""

    binary: Path
    source: str  # PACKAGE, VENV or PATH
    info: BuildInfo | None = None  # None: no build.json (make's build, PATH)
    problem: str | None = None  # why it cannot be used at all

    @property
    def name(self) -> str:
        return self.info.profile if self.info is not None else self.source


@dataclass(frozen=True)
class Verdict:
    build: EngineBuild
    fits: bool
    reason: str


@dataclass(frozen=True)
class Selection:
    """The chosen build (None: nothing usable), why, and every candidate's verdict."""

    cpu: CpuFeatures
    chosen: EngineBuild | None
    reason: str
    verdicts: tuple[Verdict, ...]

    @property
    def binary(self) -> Path:
        """The chosen binary; :class:`EngineUnavailableError` (exit 69) with the reasons."""
        if self.chosen is None:
            raise EngineUnavailableError(
                f"an engine binary ({BINARY}) for this CPU", hint=self.reason
            )
        return self.chosen.binary


# ------------------------------------------------------------------ build.json


def _bounded_text(value: Any, where: str, *, name: bool = False) -> str:
    if not isinstance(value, str) or not value or len(value) > _MAX_ITEM_CHARS:
        raise ConfigError(f"{where}: need a string of 1-{_MAX_ITEM_CHARS} characters")
    if not value.isprintable() or (name and not set(value) <= _NAME_CHARS):
        raise ConfigError(f"{where}: {value[:40]!r} has characters a name may not have")
    return value


def _bounded_list(value: Any, where: str, *, names: bool) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > _MAX_ITEMS:
        raise ConfigError(f"{where}: need a list of at most {_MAX_ITEMS} strings")
    return tuple(_bounded_text(v, f"{where}[{i}]", name=names) for i, v in enumerate(value))


def parse_build_info(text: str, where: str) -> BuildInfo:
    """A ``build.json`` text as :class:`BuildInfo`; :class:`ConfigError` naming the field."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{where}: not JSON ({err})") from err
    if not isinstance(data, dict) or data.get("schema") != BUILD_SCHEMA:
        raise ConfigError(f"{where}: not a {BUILD_SCHEMA} file")
    return BuildInfo(
        profile=_bounded_text(data.get("profile"), f"{where}: profile", name=True),
        arch=_bounded_text(data.get("arch"), f"{where}: arch", name=True),
        cpu_features=_bounded_list(data.get("cpu_features"), f"{where}: cpu_features", names=True),
        llama_cpp=_bounded_text(data.get("llama_cpp"), f"{where}: llama_cpp"),
        backends=_bounded_list(data.get("backends"), f"{where}: backends", names=True),
        cmake_flags=_bounded_list(data.get("cmake_flags"), f"{where}: cmake_flags", names=False),
    )


def read_build_info(path: Path) -> BuildInfo:
    try:
        with path.open("rb") as f:
            raw = f.read(_JSON_MAX_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{path}: {err.strerror or err}") from err
    if len(raw) > _JSON_MAX_BYTES:
        raise ConfigError(f"{path}: larger than {_JSON_MAX_BYTES} bytes")
    return parse_build_info(raw.decode("utf-8", errors="replace"), str(path))


# ------------------------------------------------------------------ listing


def _executable(path: Path) -> str | None:
    """Why ``path`` cannot be run, or None."""
    if not path.is_file():
        return "no such file" if not path.exists() else "not a regular file"
    return None if os.access(path, os.X_OK) else "not executable"


def _package_build(directory: Path) -> EngineBuild:
    binary = directory / BINARY
    try:
        info = read_build_info(directory / BUILD_JSON)
    except ConfigError as err:
        return EngineBuild(binary, PACKAGE, problem=err.message)
    if info.profile != directory.name:
        problem = f"build.json says profile {info.profile!r}, the directory is {directory.name!r}"
        return EngineBuild(binary, PACKAGE, info, problem=problem)
    return EngineBuild(binary, PACKAGE, info, problem=_executable(binary))


def installed_builds(
    package_dir: Path = PACKAGE_DIR,
    *,
    beside: Path | None = None,
    search_path: str | None = None,
) -> list[EngineBuild]:
    """Every llama-server found: the package's (by profile name), the venv's, PATH's.

    ``beside`` is the venv's bin directory (default: this Python's); ``search_path``
    the PATH (default: the environment's). A file found twice is listed once.
    """
    found: list[EngineBuild] = []
    if package_dir.is_dir():
        found += [_package_build(d) for d in sorted(package_dir.iterdir()) if d.is_dir()]
    venv = (beside if beside is not None else Path(sys.executable).parent) / BINARY
    if venv.exists():
        found.append(EngineBuild(venv, VENV, problem=_executable(venv)))
    on_path = shutil.which(BINARY, path=search_path)
    if on_path is not None:
        found.append(EngineBuild(Path(on_path), PATH))
    seen: set[Path] = set()
    unique = []
    for build in found:
        real = build.binary.resolve()
        if real not in seen:
            seen.add(real)
            unique.append(build)
    return unique


# ------------------------------------------------------------------ selection


def _verdict(build: EngineBuild, cpu: CpuFeatures, backend: str) -> Verdict:
    if build.problem is not None:
        return Verdict(build, False, build.problem)
    info = build.info
    if info is None:
        kind = "make's build beside this Python" if build.source == VENV else "found on PATH"
        return Verdict(build, True, f"{kind}; it records no CPU needs, so none were checked")
    if info.arch != cpu.arch:
        return Verdict(build, False, f"built for {info.arch}, this CPU is {cpu.arch}")
    if backend not in info.backends:
        have = ", ".join(info.backends)
        return Verdict(build, False, f"has the {have} backend(s), not {backend}")
    missing = cpu.missing(info.cpu_features)
    if missing:
        return Verdict(build, False, f"needs {', '.join(missing)}, which this CPU lacks")
    needed = " ".join(info.cpu_features) or "none"
    return Verdict(
        build, True, f"this CPU has all {len(info.cpu_features)} features it needs ({needed})"
    )


def _rank(verdict: Verdict) -> tuple[int, int, str]:
    """Described builds first, the most specific (most features needed) first."""
    info = verdict.build.info
    if info is None:
        return (1, 0 if verdict.build.source == VENV else 1, "")
    return (0, -len(info.cpu_features), info.profile)


def select(builds: Sequence[EngineBuild], cpu: CpuFeatures, backend: str = "cpu") -> Selection:
    """The best build of ``builds`` for ``cpu`` and the backend the plan needs (pure)."""
    verdicts = tuple(_verdict(b, cpu, backend) for b in builds)
    fitting = sorted((v for v in verdicts if v.fits), key=_rank)
    if not fitting:
        why = "; ".join(f"{v.build.name} ({v.build.binary}): {v.reason}" for v in verdicts)
        return Selection(
            cpu,
            None,
            (f"no installed build fits: {why}" if why else f"no {BINARY} is installed")
            + f"; install the slmguard package, run `make` (it builds {BINARY}), or pass "
            "--llama-server PATH to a build for this board",
            verdicts,
        )
    best = fitting[0]
    others = [v.build.name for v in fitting[1:]]
    more = f"; preferred over {', '.join(others)}" if others else ""
    return Selection(cpu, best.build, f"{best.build.name}: {best.reason}{more}", verdicts)


def select_engine(
    package_dir: Path = PACKAGE_DIR, *, backend: str = "cpu", cpu: CpuFeatures | None = None
) -> Selection:
    """The selection for this host: its CPU's features and the builds installed."""
    return select(installed_builds(package_dir), cpu or read_cpu_features(), backend)


# ------------------------------------------------------------------ probing


@dataclass(frozen=True)
class Device:
    name: str  # llama.cpp's device name: Vulkan0, CUDA0
    description: str

    @property
    def backend(self) -> str:
        """The backend the device belongs to: its name without the index, lower case."""
        return self.name.rstrip("0123456789").lower() or self.name.lower()


@dataclass(frozen=True)
class StartCheck:
    ok: bool
    seconds: float
    detail: str


@dataclass(frozen=True)
class Probe:
    binary: Path
    version: str
    devices: tuple[Device, ...]
    start: StartCheck | None  # None: not started (no model given)
    grammar_bound: bool = False  # it stops a request whose grammar passes --grammar-max-work

    @property
    def backends(self) -> tuple[str, ...]:
        """``cpu`` (every build has it) and the backend of each device found."""
        return ("cpu", *dict.fromkeys(d.backend for d in self.devices if d.backend != "cpu"))


def _run(
    argv: Sequence[str], timeout_s: float, max_bytes: int = _OUTPUT_MAX_BYTES
) -> tuple[int | None, str]:
    """Exit status and stdout+stderr, read to at most ``max_bytes`` (64 KiB): a child
    that says more is killed there (status None: stopped at the bound), one that outlives
    ``timeout_s`` too (TimeoutExpired)."""
    deadline = time.monotonic() + timeout_s
    out = bytearray()
    with subprocess.Popen(
        list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as child:
        assert child.stdout is not None
        fd = child.stdout.fileno()
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                while len(out) < max_bytes:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise subprocess.TimeoutExpired(list(argv), timeout_s)
                    if not sel.select(left):
                        continue
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        break
                    out += chunk
            if len(out) >= max_bytes:
                child.kill()
                child.wait()
                return None, out[:max_bytes].decode("utf-8", errors="replace")
            code = child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
    return code, out.decode("utf-8", errors="replace")


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def engine_version(binary: Path, timeout_s: float = 30.0) -> str:
    """The first line of ``llama-server --version`` (e.g. ``version: 0.5.0-dev (build 1,
    commit 0c1e570)``); raises :class:`EngineUnavailableError` when it does not answer."""
    try:
        code, text = _run([str(binary), "--version"], timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise EngineUnavailableError(
            f"a working engine binary at {binary}", hint=f"`--version` failed: {err}"
        ) from err
    lines = _lines(text)
    version = next((ln for ln in lines if ln.startswith("version:")), None)
    if code not in (0, None) or version is None:  # None: it went on talking after it
        raise EngineUnavailableError(
            f"a working engine binary at {binary}",
            hint=f"`--version` exited {code}: {(lines or ['no output'])[-1][:200]}",
        )
    return version[:_MAX_ITEM_CHARS]


#: The option of slmguard's engine patch (engine/grammar-max-work.patch): the build stops a
#: request alone (400 ``grammar_limit_error``) whose grammar needs more parse-stack work for
#: one token than the bound, instead of stalling every slot's decoding.
GRAMMAR_BOUND_OPTION = "--grammar-max-work"
#: ``--help`` is long (59 KB for the CPU build; a build with more backends says more).
_HELP_MAX_BYTES = 1 << 20


def has_grammar_bound(help_text: str) -> bool:
    """Whether ``llama-server --help`` output lists :data:`GRAMMAR_BOUND_OPTION` as an
    option (a line starting with it, or with its short names then it), not in a
    description (pure)."""
    option = re.compile(rf"^\s*(?:-[\w-]+,\s*)*{re.escape(GRAMMAR_BOUND_OPTION)}(?:[\s,=]|$)")
    return any(option.match(line) for line in help_text.splitlines())


def grammar_bound(binary: Path, timeout_s: float = 30.0) -> bool:
    """Whether the build bounds a grammar's work per token, from its ``--help`` (not its
    name or version: a board's own build of the same llama.cpp has no such option).
    :class:`EngineUnavailableError` when it does not answer."""
    try:
        code, text = _run([str(binary), "--help"], timeout_s, _HELP_MAX_BYTES)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise EngineUnavailableError(
            f"a working engine binary at {binary}", hint=f"`--help` failed: {err}"
        ) from err
    if code != 0:
        tail = (_lines(text) or ["no output"])[-1][:200]
        raise EngineUnavailableError(
            f"a working engine binary at {binary}", hint=f"`--help` exited {code}: {tail}"
        )
    return has_grammar_bound(text)


def parse_devices(text: str) -> tuple[Device, ...]:
    """The devices of ``--list-devices`` output (pure): the lines after ``Available
    devices:`` shaped ``  NAME: DESCRIPTION``; ``(none)`` or nothing is no device."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "Available devices:"), None)
    if start is None:
        return ()
    out: list[Device] = []
    for line in lines[start + 1 :]:
        if not line.startswith("  ") or len(out) >= _MAX_ITEMS:
            break
        name, sep, description = line.strip().partition(": ")
        if sep and name and set(name.lower()) <= _NAME_CHARS:
            out.append(Device(name[:_MAX_ITEM_CHARS], description[:_MAX_ITEM_CHARS]))
    return tuple(out)


def list_devices(binary: Path, timeout_s: float = 60.0) -> tuple[Device, ...]:
    """The devices the binary's backends find here (``--list-devices``)."""
    try:
        code, text = _run([str(binary), "--list-devices"], timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise EngineUnavailableError(
            f"a working engine binary at {binary}", hint=f"`--list-devices` failed: {err}"
        ) from err
    if code is None:
        raise EngineUnavailableError(
            f"a working engine binary at {binary}",
            hint=f"`--list-devices` printed more than {_OUTPUT_MAX_BYTES >> 10} KiB (stopped)",
        )
    if code != 0 or "Available devices:" not in text:
        tail = (_lines(text) or ["no output"])[-1][:200]
        raise EngineUnavailableError(
            f"a working engine binary at {binary}", hint=f"`--list-devices` exited {code}: {tail}"
        )
    return parse_devices(text)


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 to a server on a unix socket (llama-server's ``--host PATH.sock``)."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def _request(sock: Path, method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = UnixHTTPConnection(sock, 30.0)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, url, body=body, headers=headers)
        answer = conn.getresponse()
        return answer.status, answer.read(_OUTPUT_MAX_BYTES)
    finally:
        conn.close()


def _start_argv(binary: Path, model: Path, sock: Path, threads: int) -> list[str]:
    return [
        str(binary), "--model", str(model), "--host", str(sock), "--ctx-size", "256",
        "--threads", str(threads), "--parallel", "1", "--no-webui", "--n-gpu-layers", "0",
    ]  # fmt: skip


def _wait_healthy(proc: subprocess.Popen[bytes], sock: Path, deadline: float) -> str | None:
    """None once ``/health`` answers 200; else why not (exited, timed out)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with status {proc.returncode} before it was ready"
        if sock.exists():
            with contextlib.suppress(OSError, http.client.HTTPException):
                if _request(sock, "GET", "/health")[0] == 200:
                    return None
        time.sleep(0.25)
    return "not ready before the time limit"


def check_start(binary: Path, model: Path, *, threads: int, timeout_s: float = 300.0) -> StartCheck:
    """Start ``binary`` with ``model`` on a private socket: ready, and one token decoded."""
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="slmguard-engine-") as tmp:
        sock, log = Path(tmp) / "engine.sock", Path(tmp) / "engine.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                _start_argv(binary, model, sock, threads),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        try:
            problem = _wait_healthy(proc, sock, began + timeout_s)
            if problem is None:
                body = json.dumps({"prompt": "The", "max_tokens": 1}).encode()
                try:
                    status, _ = _request(sock, "POST", "/v1/completions", body)
                    problem = None if status == 200 else f"a completion answered {status}"
                except (OSError, http.client.HTTPException) as err:
                    problem = f"a completion failed: {err} (exit status {proc.poll()})"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        seconds = time.monotonic() - began
        if problem is None:
            return StartCheck(True, seconds, f"loaded {model.name}, ready, decoded one token")
        with log.open("rb") as f:
            tail = _lines(f.read(_OUTPUT_MAX_BYTES).decode("utf-8", errors="replace"))[-3:]
        return StartCheck(False, seconds, problem + (": " + " / ".join(tail) if tail else ""))


def probe(
    binary: Path, model: Path | None = None, *, threads: int = 1, timeout_s: float = 300.0
) -> Probe:
    """What ``binary`` is (version, devices) and, given a model, that it starts."""
    problem = _executable(binary)
    if problem is not None:
        raise EngineUnavailableError(f"the engine binary {binary}", hint=f"{binary}: {problem}")
    version = engine_version(binary)
    devices = list_devices(binary)
    try:
        bounded = grammar_bound(binary)
    except EngineUnavailableError:
        bounded = False  # its --help failed: the start check below says how it fails
    start = check_start(binary, model, threads=threads, timeout_s=timeout_s) if model else None
    return Probe(binary, version, devices, start, grammar_bound=bounded)


def describe(builds: Iterable[EngineBuild]) -> list[dict[str, Any]]:
    """The builds as JSON-ready dicts (``slmguard engine --json``)."""
    out = []
    for b in builds:
        info = json.loads(b.info.to_json()) if b.info is not None else None
        if info is not None:
            info.pop("schema")
        out.append(
            {"binary": str(b.binary), "source": b.source, "build": info, "problem": b.problem}
        )
    return out
