"""The command blocks the README and docs/index.md mark runnable, and a walker for them.

A fenced ``sh`` block is runnable when the line before its fence is an HTML comment
``<!-- runnable -->``, which a reader does not see. Its lines are the commands, a line
ending in ``\\`` joined with the next; each runs as typed, with ``bash -c`` in the
directory of a clone (``make`` and ``.venv/bin/slmguard`` as a newcomer types them there),
and must exit 0 without answering an error (a JSON ``{"error": ...}`` on stdout is one,
as curl exits 0 on an HTTP 503). ``<!-- runnable: background="CMD" until="TEXT" -->``
marks a server in the block: the command ``CMD`` (the text before its comment) is the one
a reader leaves running in one terminal; the walk starts it in the background, waits for
``TEXT`` in its output (the line the reader waits for) before the next command, and ends
it with Ctrl+C (SIGINT to its process group) after the last.

The one liberty the walk takes: ``PORT`` in the environment and ``:8080`` in the commands
become a free port, since the machine running the tests may already serve on 8080.

``python tests/docblocks.py --clone`` (``make quickstart``) walks the README's
Quickstart in a fresh ``git clone`` of this tree, the way a newcomer does (the engine
comes from the machine's cache, built once by this tree's ``make``): minutes, so it is
run on purpose; ``tests/test_docs_runnable.py`` walks it in this tree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from waiting import scaled, wait_for  # tests/ is on the path: pytest's, or the script's

ROOT = Path(__file__).resolve().parent.parent
#: The documents whose runnable blocks are run (issue 38).
DOCUMENTS = ("README.md", "docs/index.md")
MARKER = re.compile(r"^<!-- runnable(?::(?P<opts>.*?))? -->$")
OPTION = re.compile(r'(\w+)="([^"]*)"')
FENCE = re.compile(r"^```(\w*)\s*$")
#: What may stay in the environment of a walk: a newcomer's shell has no make
#: recursion, no notify socket and none of slmguard's settings but a private state
#: directory (the tests' own, so that no walk writes the machine's /var/lib/slmguard).
DROP = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "NOTIFY_SOCKET", "VIRTUAL_ENV")
KEEP_SLMGUARD = ("SLMGUARD_STATE_DIR", "SLMGUARD_TEST_TIME_FACTOR")
DEFAULT_PORT = "8080"


@dataclass(frozen=True)
class Block:
    """One runnable block: where it is, its commands, the server among them if any."""

    path: str
    line: int
    commands: tuple[str, ...]
    background: str | None = None
    until: str | None = None

    def command_text(self, command: str) -> str:
        """The command without its trailing comment (what ``background`` names)."""
        return re.sub(r"\s+#.*$", "", command).strip()


@dataclass
class Step:
    command: str
    returncode: int
    output: str


@dataclass
class Walk:
    steps: list[Step] = field(default_factory=list)
    server_log: str = ""


class WalkFailed(AssertionError):
    """A command of a runnable block failed as typed; the message holds its output."""


def blocks(path: Path) -> list[Block]:
    """The runnable blocks of one Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        if marker is None:
            i += 1
            continue
        opts = dict(OPTION.findall(marker.group("opts") or ""))
        if i + 1 >= len(lines) or not FENCE.match(lines[i + 1]):
            raise ValueError(f"{path}:{i + 1}: a runnable marker not followed by a fence")
        start, i = i + 2, i + 2
        while i < len(lines) and not FENCE.match(lines[i]):
            i += 1
        found.append(
            Block(
                str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
                start,
                _commands(lines[start:i]),
                opts.get("background"),
                opts.get("until"),
            )
        )
        i += 1
    return found


def _commands(lines: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    pending = ""
    for line in lines:
        if pending:
            line = pending + " " + line.strip()
            pending = ""
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1].rstrip()
            continue
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    if pending:
        out.append(pending)
    return tuple(out)


def shell_blocks(path: Path) -> list[Block]:
    """Every fenced ``sh`` block of a Markdown file, runnable or not (its commands)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    opened: int | None = None
    for i, line in enumerate(lines):
        fence = FENCE.match(line)
        if fence is None:
            continue
        if opened is None:
            opened = i + 1 if fence.group(1) == "sh" else -1
        else:
            if opened > 0:
                found.append(Block(str(path.relative_to(ROOT)), opened, _commands(lines[opened:i])))
            opened = None
    return found


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for doc in DOCUMENTS for b in blocks(root / doc)]


def walk_env(port: int | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in DROP and (not k.startswith("SLMGUARD_") or k in KEEP_SLMGUARD)
    }
    if port is not None:
        env["PORT"] = str(port)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _typed(command: str, port: int | None) -> str:
    return command if port is None else command.replace(f":{DEFAULT_PORT}", f":{port}")


def _check_answer(command: str, output: str) -> None:
    text = output.strip()
    if not text.startswith("{"):
        return
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        return
    if isinstance(answer, dict) and "error" in answer:
        raise WalkFailed(f"{command}\nanswered an error:\n{text}")


def _run(command: str, cwd: Path, env: dict[str, str], timeout_s: float) -> Step:
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=scaled(timeout_s),
        check=False,
    )
    step = Step(command, done.returncode, done.stdout)
    if done.returncode != 0:
        raise WalkFailed(f"{command}\nexited {done.returncode}:\n{done.stdout[-6000:]}")
    _check_answer(command, done.stdout)
    return step


class _Server:
    """The block's long-running command, in its own process group, its output in a file."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str], log: Path) -> None:
        self.command = command
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", command],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def wait_for_text(self, text: str, timeout_s: float) -> None:
        def there() -> bool:
            if self.proc.poll() is not None:
                raise WalkFailed(
                    f"{self.command} exited {self.proc.returncode} before {text!r}:\n"
                    f"{self.output()[-6000:]}"
                )
            return text in self.output()

        wait_for(there, timeout_s, f"{text!r} from {self.command}")

    def interrupt(self, timeout_s: float = 60.0) -> int:
        """Ctrl+C, as the reader ends it; the whole group must be gone in time."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout=scaled(timeout_s))
        except subprocess.TimeoutExpired as err:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise WalkFailed(
                f"{self.command} did not stop on Ctrl+C:\n{self.output()[-6000:]}"
            ) from err

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def walk(
    block: Block,
    cwd: Path,
    *,
    port: int | None = None,
    step_timeout_s: float = 1800.0,
    ready_timeout_s: float = 300.0,
) -> Walk:
    """Run the block's commands in ``cwd`` (see the module docstring); WalkFailed if one
    fails. ``port``: the free port that stands for 8080 (None: as written)."""
    env = walk_env(port)
    result = Walk()
    server: _Server | None = None
    try:
        for command in block.commands:
            typed = _typed(command, port)
            if block.background and block.command_text(command) == block.background:
                if server is not None:
                    raise WalkFailed(f"{block.path}:{block.line}: two background commands")
                log = Path(tempfile.mkstemp(prefix="walk-", suffix=".log")[1])
                server = _Server(typed, cwd, env, log)
                server.wait_for_text(block.until or "", ready_timeout_s)
                continue
            result.steps.append(_run(typed, cwd, env, step_timeout_s))
        if server is not None:
            server.interrupt()
            result.server_log = server.output()
            if "Traceback" in result.server_log:
                raise WalkFailed(f"{server.command} logged a traceback:\n{result.server_log}")
    finally:
        if server is not None:
            server.kill()
            server.log.unlink(missing_ok=True)
    if block.background and server is None:
        raise WalkFailed(f"{block.path}:{block.line}: no command {block.background!r}")
    return result


def quickstart(root: Path = ROOT) -> Block:
    """The README's Quickstart: its one block with a server in it."""
    (block,) = [b for b in blocks(root / "README.md") if b.background]
    return block


def _clone_walk(keep: bool) -> int:
    """``make quickstart``: the Quickstart in a fresh clone of this tree's HEAD."""
    tmp = Path(tempfile.mkdtemp(prefix="slmguard-quickstart-"))
    clone = tmp / "slmguard"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    block = quickstart(clone)
    print(f"walking {block.path}:{block.line} in {clone} (a fresh clone of {ROOT}'s HEAD)")
    started = time.monotonic()
    try:
        result = walk(block, clone, port=free_port())
    finally:
        if not keep:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    for step in result.steps:
        print(f"$ {step.command}\n{step.output.rstrip()[-2000:]}")
    print(f"the Quickstart walked in {time.monotonic() - started:.0f} s, every command as typed")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clone", action="store_true", help="walk the Quickstart in a fresh clone")
    p.add_argument("--keep", action="store_true", help="keep the clone (with --clone)")
    args = p.parse_args(argv)
    if args.clone:
        return _clone_walk(args.keep)
    for block in all_blocks():
        print(f"{block.path}:{block.line}: {' ; '.join(shlex.quote(c) for c in block.commands)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
