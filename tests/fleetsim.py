"""A simulated fleet for the rollout tests and benchmark: board roots, a mirror, a gate server.

A simulated board is a root tree of its board kind, as the role's
``slmguard_root`` (the role runs with a local connection and writes only under
it): the kind's device tree (``model``, ``compatible``), ``/proc/meminfo`` and
the online CPUs that ``doctor``'s ``board.hardware`` reads, its boot file,
an fstab with a swap line and the vendor's zram unit. Three kinds, as the
boards ship them: an Armbian RK3588 (``armbianEnv.txt``), a Jetson Orin Nano
(L4T's ``extlinux.conf`` and ``nvzramconfig``), a Raspberry Pi 5 (Raspberry Pi
OS's one-line ``cmdline.txt`` and ``dphys-swapfile``).

What a simulated board cannot have, and what stands in:

- **No systemd**: ``slmguard_service_manager: none``, nothing is started; the
  gate (``/health`` names the installed plan's model path and sha256, one
  real completion, doctor) asks :class:`GateServer`, one real ``slmguard
  serve`` with the real engine and the real model, started in a private mount
  namespace where ``/var/lib/slmguard-models/NAME`` is the model, so its
  ``/health`` names exactly the path every board's installed plan names. A
  board made to fail its gate is pointed at a port where nothing answers (its
  server did not start). The gate against each board's own server is the
  system test's (a real board, over SSH).
- **No dpkg database**: ``slmguard_install_package: false`` (the package's
  postinst builds a venv with the board's Python, which a staging root has
  not); the role's install is run in the system test's VM.

:class:`Mirror` is a model mirror on a loopback port (``http.server`` in a
thread) that counts the bytes it sends to each board (the board's name is in
the URL's path), which is how the tests see that a run that changes nothing
downloads nothing.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rendertrees import make_board_root, snapshot, write
from serveproc import SLMGUARD, ServerProcess, engine_available, start_server
from slmguard.deploy.apply import apply_plan
from slmguard.deploy.digests import load_digests
from slmguard.deploy.fleet.kinds import BoardPlan, board_plans
from slmguard.deploy.modelfile import MODEL_DIR, ModelSource, deployed_plan, planned_model
from slmguard.deploy.render import RenderOptions
from slmguard.plan.inputs import plan_for
from slmguard.plan.planfile import dumps_plan
from slmguard.plan.schema import Plan

BIN = Path(sys.executable).parent
CALLBACKS = str(Path(__file__).parent / "ansible_callbacks")
#: The simulated boards' connection (``simboard``): local, with a link that can go down.
CONNECTIONS = str(Path(__file__).parent / "ansible_connections")
KiB = 1024


@dataclass(frozen=True)
class Kind:
    """A board kind as the simulation builds it."""

    board: str  # the plan.boards profile
    tree: str  # a rendertrees board tree, or "rpi"
    model: str  # /proc/device-tree/model
    compatible: tuple[str, ...]
    mem_total_kb: int
    cpus: str  # sys/devices/system/cpu/online


KINDS = (
    Kind(
        "rk3588-8g",
        "armbian",
        "Orange Pi 5 Plus",
        ("xunlong,orangepi-5-plus", "rockchip,rk3588"),
        7_862_000,
        "0-7",
    ),
    Kind(
        "jetson-orin-nano-8g",
        "extlinux",
        "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super",
        ("nvidia,p3768-0000+p3767-0005-super", "nvidia,p3767-0005", "nvidia,tegra234"),
        7_620_000,
        "0-5",
    ),
    Kind(
        "rpi5-8g",
        "rpi",
        "Raspberry Pi 5 Model B Rev 1.0",
        ("raspberrypi,5-model-b", "brcm,bcm2712"),
        8_245_000,
        "0-3",
    ),
)

RPI_CMDLINE = (
    "console=serial0,115200 console=tty1 root=PARTUUID=5e0ad9f2-02 rootfstype=ext4 "
    "fsck.repair=yes rootwait quiet splash plymouth.ignore-serial-consoles\n"
)
RPI_FSTAB = (
    "proc            /proc           proc    defaults          0       0\n"
    "PARTUUID=5e0ad9f2-01  /boot/firmware  vfat    defaults          0       2\n"
    "PARTUUID=5e0ad9f2-02  /               ext4    defaults,noatime  0       1\n"
)
DPHYS_UNIT = (
    "[Unit]\nDescription=dphys-swapfile - set up, mount/unmount, and delete a swap file\n\n"
    "[Service]\nType=oneshot\nExecStart=/sbin/dphys-swapfile setup\n"
    "ExecStart=/sbin/dphys-swapfile swapon\nRemainAfterExit=yes\n\n"
    "[Install]\nWantedBy=multi-user.target\n"
)


def make_root(root: Path, kind: Kind) -> Path:
    """One simulated board of ``kind`` (see the module docstring)."""
    if kind.tree == "rpi":
        write(root, "boot/firmware/cmdline.txt", RPI_CMDLINE, 0o755)
        write(root, "boot/firmware/config.txt", "arm_64bit=1\ndtoverlay=vc4-kms-v3d\n", 0o755)
        write(root, "etc/fstab", RPI_FSTAB)
        write(root, "lib/systemd/system/dphys-swapfile.service", DPHYS_UNIT)
        wants = root / "etc/systemd/system/multi-user.target.wants"
        wants.mkdir(parents=True)
        (wants / "dphys-swapfile.service").symlink_to("/lib/systemd/system/dphys-swapfile.service")
    else:
        make_board_root(root, kind.tree)
    write(root, "proc/device-tree/model", kind.model + "\0")
    write(root, "proc/device-tree/compatible", "".join(c + "\0" for c in kind.compatible))
    write(
        root,
        "proc/meminfo",
        f"MemTotal:       {kind.mem_total_kb} kB\nMemFree:        {kind.mem_total_kb // 2} kB\n"
        f"MemAvailable:   {kind.mem_total_kb * 3 // 4} kB\nHugetlb:               0 kB\n",
    )
    write(root, "sys/devices/system/cpu/online", kind.cpus + "\n")
    (root / "var/lib").mkdir(parents=True, exist_ok=True)
    return root


def snapshot_root(root: Path) -> dict[str, tuple[object, ...]]:
    """Every path under ``root`` (``rendertrees.snapshot``: large files by sha256)."""
    return snapshot(root)


def deployed(root: Path) -> dict[str, tuple[object, ...]]:
    """What apply deployed under ``root`` (without its own records and the role's staging)."""
    own = ("var/lib/slmguard-apply", "var/lib/slmguard-fleet")
    return {k: v for k, v in snapshot_root(root).items() if not k.startswith(own)}


def model_copy(source: Path, tmp: Path) -> Path:
    """The model, copied once into ``tmp`` as root's 0644 file (apply hard-links it then)."""
    dest = tmp / "model" / source.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():
        shutil.copyfile(source, dest)
        dest.chmod(0o644)
    return dest


def kind_plans(model: Path, n_ctx: int | None = None) -> tuple[tuple[Plan, ModelSource], ...]:
    """Each kind's plan for ``model`` (``plan --model FILE --board KIND``), checked once."""
    out = []
    for kind in KINDS:
        plan, _ = plan_for(Path("/"), model=model, board=kind.board)
        if n_ctx is not None:
            from dataclasses import replace

            plan = replace(plan, engine=replace(plan.engine, n_ctx=n_ctx))
        out.append((plan, planned_model(plan, None)))
    return tuple(out)


def apply_in_process(root: Path, plan: Plan, source: ModelSource) -> None:
    """The board's earlier deployment: what ``slmguard apply`` did there, in this process.

    ``source``: the model checked once for its kind (``kind_plans``), not hashed per board.
    """
    apply_plan(
        plan,
        RenderOptions(exec_path=SLMGUARD),
        root,
        model=source,
        run_tools=False,
        digests=load_digests(root),
    )


# --------------------------------------------------------------------------- the mirror


@dataclass
class Fault:
    """What the mirror does wrong for one board, for real, on the socket: ``drop_after`` bytes
    of a response it closes the connection (the next ``drops`` responses), ``ignore_range``
    (a 200 with the whole file to a range request), ``status`` (answers this for the next
    ``statuses`` requests)."""

    drop_after: int | None = None
    drops: int = 1
    ignore_range: bool = False
    status: int | None = None
    statuses: int = 1


_RANGE = re.compile(r"bytes=([0-9]+)-")


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _MirrorServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        # /<board>/<file name>: the board names itself, so bytes are counted per board.
        parts = urllib.parse.unquote(self.path).strip("/").split("/")
        files = self.server.files
        if len(parts) != 2 or parts[1] not in files:
            self.send_error(404)
            return
        board = parts[0]
        with self.server.lock:
            self.server.requests.setdefault(board, []).append(self.headers.get("Range"))
            fault = self.server.faults.get(board)
            status = None
            if fault is not None and fault.status is not None and fault.statuses > 0:
                fault.statuses -= 1
                status = fault.status
        if status is not None:
            self.send_error(status)
            return
        path = files[parts[1]]
        size = path.stat().st_size
        match = _RANGE.fullmatch(self.headers.get("Range") or "")
        start = int(match[1]) if match and not (fault and fault.ignore_range) else 0
        if start:
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(size - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        self._send(board, path, start, fault)

    def _send(self, board: str, path: Path, start: int, fault: Fault | None) -> None:
        limit = None
        with self.server.lock:
            if fault is not None and fault.drop_after is not None and fault.drops > 0:
                fault.drops -= 1
                limit = fault.drop_after
        sent = 0
        with path.open("rb") as f:
            f.seek(start)
            while block := f.read(1 << 16):
                if limit is not None and sent + len(block) > limit:
                    block = block[: limit - sent]
                try:
                    self.wfile.write(block)
                except OSError:
                    break
                sent += len(block)
                if limit is not None and sent >= limit:
                    break
        with self.server.lock:
            self.server.sent[board] = self.server.sent.get(board, 0) + sent
        if limit is not None:
            # The link goes down mid-file: the socket closes under the board.
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, format: str, *args: Any) -> None:
        return


class _MirrorServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    files: dict[str, Path]
    sent: dict[str, int]
    requests: dict[str, list[str | None]]
    faults: dict[str, Fault]
    lock: threading.Lock


@dataclass
class Mirror:
    """A model mirror on a loopback port that counts the bytes it sends to each board,
    answers range requests, and fails for a board as told (:class:`Fault`)."""

    files: dict[str, Path]
    server: _MirrorServer = field(init=False)
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.server = _MirrorServer(("127.0.0.1", 0), _Handler)
        self.server.files = dict(self.files)
        self.server.sent = {}
        self.server.requests = {}
        self.server.faults = {}
        self.server.lock = threading.Lock()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, board: str, name: str) -> str:
        port = self.server.server_address[1]
        return f"http://127.0.0.1:{port}/{board}/{urllib.parse.quote(name)}"

    def sent(self) -> dict[str, int]:
        with self.server.lock:
            return dict(self.server.sent)

    def requests(self, board: str) -> list[str | None]:
        """The Range header of each request the board made (None: the whole file)."""
        with self.server.lock:
            return list(self.server.requests.get(board, []))

    def fail(self, board: str, fault: Fault) -> None:
        with self.server.lock:
            self.server.faults[board] = fault

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --------------------------------------------------------------------------- the gate server


def start_gate_server(tmp: Path, plan: Plan, model: ModelSource) -> ServerProcess:
    """A real ``slmguard serve`` of ``plan`` as a board installs it (see the module docstring).

    ``/var/lib/slmguard-models`` is, in the server's own mount namespace only, a
    directory holding the model, so the server serves the very path the
    installed plans name. Needs root (``unshare``) and the engine.
    """
    import pytest

    if not engine_available():
        pytest.skip("the llama-server binary is not there (run `make`): the gate needs it")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("the gate server needs root and unshare (a private mount namespace)")
    models = tmp / "gate-models"
    models.mkdir(exist_ok=True)
    linked = models / Path(model.dest).name
    if not linked.exists():
        os.link(model.source, linked)
    plan_file = tmp / "gate-plan.json"
    plan_file.write_text(dumps_plan(deployed_plan(plan, model)))
    script = (
        'mount -t tmpfs -o mode=0755 tmpfs /var/lib && mkdir "$1" && mount --bind "$2" "$1" '
        '&& shift 2 && exec "$@"'
    )
    wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
    # No governor: it would judge this shared test machine's memory, not a board's.
    return start_server(
        tmp, ["--plan", str(plan_file), "--no-governor"], wrapper=[*wrapper, MODEL_DIR, str(models)]
    )


# --------------------------------------------------------------------------- running Ansible


def ansible_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment ansible-playbook runs in for the tests: this venv's, no one else's
    ANSIBLE_ or SLMGUARD_ settings, its home and temporary files under ``tmp``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "SLMGUARD_"))}
    env.update(
        PATH=f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}",
        ANSIBLE_HOME=str(tmp / "ansible-home"),
        ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-tmp"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        NO_COLOR="1",
    )
    env.update(extra)
    return env


@dataclass
class Run:
    """One ansible-playbook run: exit status, the recorder's JSON, wall time, and the fleet
    report the tree's callback wrote (its lines by board)."""

    returncode: int
    result: dict[str, Any]
    seconds: float
    stderr: str
    report: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        return dict(self.result.get("stats", {}))

    def failures(self) -> list[str]:
        """Each failed task as ``host: task: message`` (for assertion messages)."""
        out = []
        for play in self.result.get("plays", []):
            for task in play["tasks"]:
                for host, r in task["hosts"].items():
                    if r.get("failed"):
                        msg = str(r.get("msg") or r.get("stderr") or "")[:300]
                        out.append(f"{host}: {task['task']['name']}: {msg}")
        return out

    def task(self, host: str, name: str) -> dict[str, Any]:
        for play in self.result.get("plays", []):
            for task in play["tasks"]:
                if task["task"]["name"].split(" : ", 1)[-1] == name and host in task["hosts"]:
                    return dict(task["hosts"][host])
        raise AssertionError(f"no task {name!r} ran on {host}")


def read_report(directory: Path) -> dict[str, dict[str, Any]]:
    """The fleet report a run wrote into ``directory`` (one file), by board."""
    files = sorted(directory.glob("*.jsonl")) if directory.is_dir() else []
    if len(files) != 1:
        raise AssertionError(f"{directory}: {len(files)} fleet reports, one expected")
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    return {line["board"]: line for line in lines}


def play(tree: Path, inventory: Path, book: str, *args: str, forks: int, timeout_s: float) -> Run:
    """``ansible-playbook BOOK`` in ``tree`` with the fleet's inventory (boards reached by the
    ``simboard`` connection; its link files and byte counts in ``tree/../simboard``)."""
    t0 = time.monotonic()
    reports = tree.parent / "reports"
    n = 1
    while (reports / str(n)).exists():
        n += 1
    report_dir = reports / str(n)
    report_dir.mkdir(parents=True)
    (tree.parent / "simboard").mkdir(exist_ok=True)
    done = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "inventory/hosts.yml",
            "-i",
            str(inventory),
            book,
            *args,
        ],
        cwd=tree,
        env=ansible_env(
            tree.parent,
            ANSIBLE_FORKS=str(forks),
            ANSIBLE_STDOUT_CALLBACK="recorder",
            ANSIBLE_CALLBACK_PLUGINS=CALLBACKS,
            ANSIBLE_CONNECTION_PLUGINS=CONNECTIONS,
            SIMBOARD_DIR=str(tree.parent / "simboard"),
            SLMGUARD_FLEET_REPORT_DIR=str(report_dir),
        ),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    seconds = time.monotonic() - t0
    result: dict[str, Any] = {}
    for line in reversed(done.stdout.strip().splitlines()):  # the recorder's, last but the report's
        if line.startswith('{"plays"'):
            result = json.loads(line)
            break
    if not result:
        raise AssertionError(
            f"ansible-playbook {book}: no recap\n{done.stdout[-3000:]}{done.stderr}"
        )
    report = read_report(report_dir) if any(report_dir.iterdir()) else {}
    return Run(done.returncode, result, seconds, done.stderr, report)


@dataclass
class Board:
    name: str
    kind: Kind
    root: Path
    host_vars: dict[str, Any]


@dataclass
class Fleet:
    """The simulated fleet: its boards in inventory order, and where its files are."""

    tmp: Path
    boards: list[Board]
    model: Path
    plans: tuple[BoardPlan, ...]
    mirror: Mirror
    gate: ServerProcess | None = None  # the gate server, when the fleet has one
    inventory: Path = field(init=False)

    def __post_init__(self) -> None:
        self.inventory = self.tmp / "fleet-hosts.json"

    def write_inventory(self) -> None:
        """Every board directly under ``slmguard``, in fleet order (so batches mix kinds),
        and in its kind's group (for the kind's group vars)."""
        kinds: dict[str, dict[str, Any]] = {}
        for b in self.boards:
            group = next(bp.group for bp in self.plans if bp.plan.board.name == b.kind.board)
            kinds.setdefault(group, {"hosts": {}})["hosts"][b.name] = None
        doc = {
            "all": {
                "children": {
                    "slmguard": {
                        "hosts": {b.name: b.host_vars for b in self.boards},
                        "children": kinds,
                    }
                }
            }
        }
        self.inventory.write_text(json.dumps(doc))

    def render(self, tree: Path, plans: Sequence[tuple[Plan, ModelSource]]) -> None:
        from slmguard.deploy.fleet.ansible import render_tree
        from slmguard.deploy.review import write_tree

        write_tree(render_tree(board_plans(list(plans))), tree, force=True)

    def board(self, name: str) -> Board:
        return next(b for b in self.boards if b.name == name)

    @property
    def links(self) -> Path:
        """Where the ``simboard`` connection keeps each board's link state and byte counts."""
        path = self.tmp / "simboard"
        path.mkdir(exist_ok=True)
        return path

    def go_dark(self, name: str) -> None:
        """The board's link goes down: Ansible finds it unreachable from the next task on."""
        (self.links / f"{name}.unreachable").touch()

    def come_back(self, name: str) -> None:
        """The link is up again (and stays up: no exec wrapper takes it down any more)."""
        (self.links / f"{name}.unreachable").unlink()
        self.board(name).host_vars["slmguard_exec"] = SLMGUARD

    def dark_after(self, name: str, verb: str) -> None:
        """The board's link goes down right after its ``slmguard VERB`` ends (an exec wrapper)."""
        board = self.board(name)
        wrapper = self.tmp / f"slmguard-{name}"
        marker = self.links / f"{name}.unreachable"
        wrapper.write_text(
            "#!/bin/sh\n"
            f'"{SLMGUARD}" "$@"\nrc=$?\n'
            f'if [ "$1" = "{verb}" ]; then touch "{marker}"; fi\nexit $rc\n'
        )
        wrapper.chmod(0o755)
        board.host_vars["slmguard_exec"] = str(wrapper)

    def bytes_moved(self, name: str) -> tuple[int, int]:
        """(sent to, received from) the board over its link, counted by ``simboard``."""
        path = self.links / f"{name}.bytes"
        sent = received = 0
        for line in path.read_text().splitlines() if path.exists() else []:
            what, n = line.split()
            if what == "sent":
                sent += int(n)
            else:
                received += int(n)
        return sent, received


def build_fleet(tmp: Path, model: Path, n: int, mirror_kind: str, gate_url: str) -> Fleet:
    """``n`` boards, the kinds in turn, all on each kind's plan ``A`` already.

    The boards of ``mirror_kind`` take the model from the mirror (their staging is
    empty: they download it on their first rollout), the others from a file on
    the board. Every board's gate asks ``gate_url``.
    """
    plans = kind_plans(model)
    bps = board_plans(list(plans))
    mirror = Mirror({model.name: model})
    boards = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        name = f"{kind.board.split('-')[0]}-{i + 1:02d}"
        root = make_root(tmp / "boards" / name, kind)
        plan, source = next(p for p in plans if p[0].board.name == kind.board)
        apply_in_process(root, plan, source)
        host: dict[str, Any] = {
            "ansible_connection": "simboard",
            "ansible_become": False,
            "ansible_python_interpreter": sys.executable,
            "slmguard_root": str(root),
            "slmguard_exec": SLMGUARD,
            "slmguard_install_package": False,
            "slmguard_service_manager": "none",
            "slmguard_gate": ["health", "completion", "doctor"],
            "slmguard_server_url": gate_url,
            "slmguard_doctor_max_exit": 2,  # a staging root: cma= and swap only after a reboot
        }
        if kind.board == mirror_kind:
            host["slmguard_model_url"] = mirror.url(name, model.name)
        else:
            host["slmguard_model_file"] = str(model)
        boards.append(Board(name, kind, root, host))
    return Fleet(tmp, boards, model, bps, mirror)
