"""Staged rollouts over simulated fleets (``tests/fleetsim.py``): what a rollout may and may not do.

Boards are root trees of three kinds (RK3588, Jetson Orin Nano, Raspberry Pi
5), in turn, each already on its kind's plan A (applied earlier, no rollout);
the Jetsons take the model from a mirror, the others from a file on the
board; Ansible reaches each through the ``simboard`` connection (local, with
a link that can go down and a byte counter). ``site.yml`` rolls plan B out
(another context size); the gate asks one real server (the real engine and
model).

The 32-board fleet, batches 1, 2, 4, the rest; two boards of the third batch
fail their gate (their server answers nothing):

- the rollout stops after that batch: 7 boards reached, 25 never touched,
  byte for byte (apply's records and the role's staging included);
- the two failed boards are back on plan A byte for byte; the five that
  passed serve plan B, and no model moved (A and B share it: the board's own
  installed copy is linked into the staging); a second run on them changes
  nothing and reads no model byte; ``rollback.yml`` takes one back to plan A.

One fault each, on small fleets of their own:

- a Jetson whose staged model has the right size and wrong bytes: found
  (hashed once), downloaded again, the board moves to B and passes;
- a Jetson whose mirror answers 503 once, then drops the link a third of the
  way in: retried, resumed by range, every byte sent once, the board on B;
- a board in the Jetson group that is a Pi 5 now: refused (78) before the
  mirror is asked for a byte or a byte is written on it;
- a Pi whose MemTotal no longer holds plan B (apply refuses, 78) and an
  RK3588 given a model file with other bytes (65): both stay exactly as they
  were (deployment and apply's manifest), no rollback runs;
- a board whose link goes down right after apply: the rollout stops after
  its batch though no board failed (``max_fail_percentage`` does not count
  it); when it is back, ``site.yml --limit`` gates it, it fails, and it goes
  back to plan A since this rollout had moved it and it never passed;
- after a rollout stopped by a failed gate, ``rollback.yml`` over the whole
  fleet takes back only the boards the rollout moved, to plan A byte for
  byte; the others are untouched, byte for byte;
- every run writes the fleet report: a line per board reached (plans before
  and after, the gate, the bytes moved, seconds).

Runs as root (root-owned files; the gate server needs a mount namespace) with
the engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleetsim import (
    KINDS,
    Fault,
    Fleet,
    Run,
    build_fleet,
    deployed,
    kind_plans,
    model_copy,
    play,
    snapshot_root,
)
from fleetsim import start_gate_server as gate_server
from fleettrees import model_path
from serveproc import ServerProcess, free_port, scaled
from slmguard.deploy.fleet.kinds import board_plans
from slmguard.deploy.manifest import load_manifest
from slmguard.plan.planfile import dumps_plan

pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(os.geteuid() != 0, reason="the role writes root-owned files (as root)"),
]

N_BOARDS = 32
BATCHES = '{"slmguard_batches": [1, 2, 4, "100%"], "slmguard_max_fail_percentage": 0}'
#: The boards made to fail their gate: both in the third batch (boards 4-7).
FAILING = (5, 6)
#: A board of the second batch with a LAN listener.
LAN = 2
MIRROR_KIND = "jetson-orin-nano-8g"
FORKS = 4
B_CTX = 1024
MANIFEST = "var/lib/slmguard-apply/manifest.json"


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProcess]]:
    """The model (root's copy) and one real server every board's gate asks."""
    tmp = tmp_path_factory.mktemp("gate")
    model = model_copy(model_path(), tmp)
    server = gate_server(tmp, *kind_plans(model)[0])
    try:
        yield model, server
    finally:
        server.stop()


def _fleet(tmp: Path, model: Path, n: int, server: ServerProcess) -> Fleet:
    sim = build_fleet(tmp, model, n, MIRROR_KIND, server.url)
    sim.gate = server
    return sim


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, gate: tuple[Path, ServerProcess]
) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    model, server = gate
    sim = _fleet(tmp, model, N_BOARDS, server)
    try:
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        # One board serves its LAN: the unit gets the key apply makes on the board, and
        # the gate reads it there for its completion.
        sim.boards[LAN - 1].host_vars.update(
            slmguard_listen="0.0.0.0", slmguard_allow_networks=["10.20.0.0/16"]
        )
        for i in FAILING:
            sim.boards[i - 1].host_vars.update(slmguard_server_url=dead, slmguard_ready_timeout_s=6)
        sim.write_inventory()
        sim.render(tmp / "tree-b", kind_plans(model, n_ctx=B_CTX))
        yield sim
    finally:
        sim.mirror.close()


def _deployed_plan_text(fleet: Fleet, kind: str, n_ctx: int | None) -> str:
    from slmguard.deploy.modelfile import deployed_plan

    plans = kind_plans(fleet.model, n_ctx=n_ctx)
    plan, source = next(p for p in plans if p[0].board.name == kind)
    return dumps_plan(deployed_plan(plan, source))


def _on_b(fleet: Fleet, name: str) -> bool:
    board = fleet.board(name)
    text = (board.root / "etc/slmguard/plan.json").read_text()
    return text == _deployed_plan_text(fleet, board.kind.board, B_CTX)


def test_a_rollout_stops_after_the_batch_that_fails_its_gate(fleet: Fleet) -> None:
    before = {b.name: snapshot_root(b.root) for b in fleet.boards}
    on_a = {b.name: deployed(b.root) for b in fleet.boards}
    tree = fleet.tmp / "tree-b"
    run = play(
        tree,
        fleet.inventory,
        "site.yml",
        "-e",
        BATCHES,
        forks=FORKS,
        timeout_s=scaled(1800),
    )
    assert run.returncode != 0  # the rollout failed: boards failed their gate
    names = [b.name for b in fleet.boards]
    reached, untouched = names[:7], names[7:]
    failed = {names[i - 1] for i in FAILING}
    gate_log = fleet.gate.log() if fleet.gate is not None else ""
    assert set(run.stats) == set(reached), (run.failures(), gate_log)
    assert {h for h, s in run.stats.items() if s["failures"]} == failed, run.failures()
    for name in failed:
        went_back = run.task(name, "Go back to the plan before this rollout")
        assert json.loads(went_back["stdout"])["changed"] is True, went_back
        assert run.report[name]["result"] == "rolled back"
        assert run.report[name]["gate"] == "failed"
    # 25 boards never touched, byte for byte (apply's records and the staging included).
    for name in untouched:
        assert snapshot_root(fleet.board(name).root) == before[name], name
    # The failed boards are on plan A again, every byte, mode and mtime.
    for name in failed:
        board = fleet.board(name)
        assert deployed(board.root) == on_a[name], name
        manifest = load_manifest(board.root)
        assert manifest is not None and manifest.complete and manifest.previous is None
        assert manifest.rollout is None  # plan A's own (applied before any rollout)
    # The others serve plan B; no model moved (plan B's is the one installed: linked).
    passed = [n for n in reached if n not in failed]
    sent = fleet.mirror.sent()
    for name in passed:
        assert _on_b(fleet, name), name
        assert run.report[name]["gate"] == "passed" and run.report[name]["result"] == "changed"
        assert run.report[name]["bytes_moved_total"] == 0
    assert sent == {}
    lan = fleet.boards[LAN - 1]
    unit = (lan.root / "etc/systemd/system/slmguard.service").read_text()
    assert "--host 0.0.0.0" in unit and "IPAddressAllow=localhost 10.20.0.0/16" in unit
    key = lan.root / "etc/slmguard/api-key"
    assert key.stat().st_mode & 0o777 == 0o600
    asked = run.task(lan.name, "Ask the server for one completion")
    assert key.read_text().strip() not in str(run.result)  # no_log: never in the output
    assert asked.get("censored"), asked

    # Again on the boards that passed: nothing changes, nothing is downloaded or hashed.
    again = play(
        tree,
        fleet.inventory,
        "site.yml",
        "--limit",
        ",".join(passed),
        forks=FORKS,
        timeout_s=scaled(900),
    )
    assert again.returncode == 0, again.stderr
    assert all(s["changed"] == 0 for s in again.stats.values()), again.stats
    assert fleet.mirror.sent() == sent
    jetson = next(n for n in passed if fleet.board(n).kind.board == MIRROR_KIND)
    staged = json.loads(again.task(jetson, "Stage the plan and the model")["stdout"])["model"]
    assert staged["how"] == "kept" and staged["read_bytes"] == 0
    assert again.task(jetson, "Record that the deployment passed the gate").get("skipped")

    # rollback.yml on one of them: back to plan A, byte for byte.
    first = passed[0]
    back = play(
        tree,
        fleet.inventory,
        "rollback.yml",
        "--limit",
        first,
        forks=FORKS,
        timeout_s=scaled(600),
    )
    assert back.returncode == 0, back.stderr
    assert deployed(fleet.board(first).root) == on_a[first]


def test_the_fleet_has_every_kind_in_its_early_batches(fleet: Fleet) -> None:
    kinds = [b.kind.board for b in fleet.boards[:7]]
    assert len(set(kinds)) == 3
    assert len(fleet.boards) >= 30
    assert {bp.plan.board.name for bp in board_plans([*kind_plans(fleet.model)])} == set(kinds)


# ------------------------------------------------------------------- one fault each
# Small fleets of their own (the kinds in turn: RK3588, Jetson, Pi, ...), each on plan A,
# rolling plan B out from their own tree.


@pytest.fixture
def small(tmp_path: Path, gate: tuple[Path, ServerProcess]) -> Iterator[Callable[[int], Fleet]]:
    """A factory of small fleets in this test's directory, their mirror closed at the end."""
    made: list[Fleet] = []
    model, server = gate

    def make(n: int) -> Fleet:
        sim = _fleet(tmp_path, model, n, server)
        made.append(sim)
        return sim

    yield make
    for sim in made:
        sim.mirror.close()


def _render(fleet: Fleet) -> Path:
    fleet.write_inventory()
    tree = fleet.tmp / "tree-b"
    fleet.render(tree, kind_plans(fleet.model, n_ctx=B_CTX))
    return tree


def _play(fleet: Fleet, book: str, *args: str) -> Run:
    return play(
        fleet.tmp / "tree-b", fleet.inventory, book, *args, forks=FORKS, timeout_s=scaled(1800)
    )


def test_a_corrupt_staged_model_is_downloaded_again(small: Callable[[int], Fleet]) -> None:
    fleet = small(2)
    jetson = fleet.boards[1]
    assert jetson.kind.board == MIRROR_KIND
    # A staged model of the right size and other bytes (a bad copy), where the role stages
    # plan B's model; and no stamp vouches for the installed one (else it is linked).
    digest = json.loads(_deployed_plan_text(fleet, MIRROR_KIND, B_CTX))["model"]["sha256"]
    staged = jetson.root / "var/lib/slmguard-fleet/models" / digest[:16] / fleet.model.name
    staged.parent.mkdir(parents=True)
    data = bytearray(fleet.model.read_bytes())
    data[len(data) // 2] ^= 0x01
    staged.write_bytes(bytes(data))
    (jetson.root / "var/lib/slmguard-apply/digests.json").unlink()
    _render(fleet)
    run = _play(fleet, "site.yml")
    assert run.returncode == 0, run.failures()
    assert _on_b(fleet, jetson.name)
    assert staged.read_bytes() == fleet.model.read_bytes()
    size = fleet.model.stat().st_size
    assert fleet.mirror.sent() == {jetson.name: size}  # downloaded once, again
    line = run.report[jetson.name]
    assert line["gate"] == "passed" and line["bytes_moved"]["model_download"] == size, line
    staged_json = json.loads(run.task(jetson.name, "Stage the plan and the model")["stdout"])
    assert staged_json["model"]["discarded_wrong_bytes"], staged_json


def test_a_transient_download_error_is_retried_and_resumed(
    small: Callable[[int], Fleet],
) -> None:
    fleet = small(2)
    jetson = fleet.boards[1]
    assert jetson.kind.board == MIRROR_KIND
    # No stamp vouches for the installed model: the board must download plan B's.
    (jetson.root / "var/lib/slmguard-apply/digests.json").unlink()
    size = fleet.model.stat().st_size
    # The mirror answers 503 once, then its link drops a third of the way into the file.
    fleet.mirror.fail(jetson.name, Fault(status=503, drop_after=size // 3))
    _render(fleet)
    run = _play(fleet, "site.yml")
    assert run.returncode == 0, run.failures()
    assert _on_b(fleet, jetson.name)
    # Three tries: the 503, the dropped one, the rest of the file asked by range; every
    # byte sent once.
    assert fleet.mirror.requests(jetson.name) == [None, None, f"bytes={size // 3}-"]
    assert fleet.mirror.sent() == {jetson.name: size}
    staged = json.loads(run.task(jetson.name, "Stage the plan and the model")["stdout"])
    assert staged["model"]["how"] == "downloaded" and staged["model"]["attempts"] == 3, staged
    line = run.report[jetson.name]
    assert line["gate"] == "passed" and line["bytes_moved"]["model_download"] == size, line


def test_a_board_of_another_kind_downloads_and_writes_nothing(
    small: Callable[[int], Fleet],
) -> None:
    fleet = small(2)
    jetson = fleet.boards[1]
    assert jetson.kind.board == MIRROR_KIND
    # The board in the Jetson group is a Raspberry Pi 5 now (re-flashed, or listed wrong).
    pi = next(k for k in KINDS if k.board == "rpi5-8g")
    (jetson.root / "proc/device-tree/model").write_text(pi.model + "\0")
    (jetson.root / "proc/device-tree/compatible").write_text(
        "".join(c + "\0" for c in pi.compatible)
    )
    (jetson.root / "sys/devices/system/cpu/online").write_text(pi.cpus + "\n")
    (jetson.root / "var/lib/slmguard-apply/digests.json").unlink()  # nothing to link from
    _render(fleet)
    before = snapshot_root(jetson.root)
    run = _play(fleet, "site.yml", "-e", '{"slmguard_batches": ["100%"]}')
    assert run.returncode != 0
    # Not one byte asked of the mirror, not one written on the board.
    assert fleet.mirror.requests(jetson.name) == [] and fleet.mirror.sent() == {}
    assert snapshot_root(jetson.root) == before
    failed = run.task(jetson.name, "Stage the plan and the model")
    assert failed["rc"] == 78 and "is not a jetson-orin-nano-8g" in failed["stdout"], failed
    assert "this host is a rpi5 board" in failed["stdout"], failed
    line = run.report[jetson.name]
    assert line["result"] == "failed" and line["rolled_back"] is False, line
    assert line["failed_task"].endswith("Stage the plan and the model"), line
    assert line["gate"] == "not run" and line["bytes_moved_total"] == 0, line
    # Refused before it read the board's deployment: the plans are unknown, and said so.
    assert line["plan_before"] is None and line["plan_after"] is None, line


def test_a_refused_apply_leaves_the_board_exactly_where_it_was(
    small: Callable[[int], Fleet],
) -> None:
    fleet = small(3)
    rk, _, pi = fleet.boards
    # The Pi's usable RAM shrank since plan A (a firmware carve-out): MemTotal 6.2 GiB is
    # still an 8 GB Pi to doctor, but below plan B's MemoryMax plus the OS reserve (78).
    (pi.root / "proc/meminfo").write_text(
        "MemTotal:        6500000 kB\nMemFree:         3000000 kB\n"
        "MemAvailable:    5000000 kB\nHugetlb:               0 kB\n"
    )
    # The RK3588 is given a model file of other bytes, same size (65).
    other = fleet.tmp / "other.gguf"
    data = bytearray(fleet.model.read_bytes())
    data[-1] ^= 0xFF
    other.write_bytes(bytes(data))
    other.chmod(0o644)
    rk.host_vars["slmguard_model_file"] = str(other)
    tree = _render(fleet)
    on_a = {b.name: deployed(b.root) for b in (rk, pi)}
    manifests = {b.name: (b.root / MANIFEST).read_bytes() for b in (rk, pi)}
    run = _play(fleet, "site.yml", "-e", '{"slmguard_batches": ["100%"]}')
    assert run.returncode != 0
    for board in (rk, pi):
        # Every byte of the deployment and apply's manifest as it was: nothing went back.
        assert deployed(board.root) == on_a[board.name], board.name
        assert (board.root / MANIFEST).read_bytes() == manifests[board.name], board.name
    assert tree.is_dir()
    for board, code in ((rk, 65), (pi, 78)):
        applied = run.task(board.name, "Apply the plan")
        assert applied["rc"] == code and json.loads(applied["stdout"])["changed"] is False
        assert run.task(board.name, "Go back to the plan before this rollout").get("skipped")
        line = run.report[board.name]
        assert line["result"] == "failed" and not line["rolled_back"], line
        assert line["plan_after"] == line["plan_before"] and line["gate"] == "not run", line


def test_a_board_lost_after_apply_stops_the_rollout_and_is_gated_when_back(
    small: Callable[[int], Fleet],
) -> None:
    fleet = small(5)
    names = [b.name for b in fleet.boards]
    dark = names[2]  # the second batch: boards 2 and 3
    fleet.dark_after(dark, "apply")
    _render(fleet)
    before = {n: snapshot_root(fleet.board(n).root) for n in names}
    on_a = deployed(fleet.board(dark).root)
    run = _play(fleet, "site.yml", "-e", '{"slmguard_batches": [1, 2, "100%"]}')
    # No board failed, one became unreachable: the rollout stops after its batch.
    assert run.returncode != 0
    assert set(run.stats) == set(names[:3]), run.failures()
    for name in names[3:]:
        assert snapshot_root(fleet.board(name).root) == before[name], name
    assert run.stats[dark]["unreachable"] == 1 and run.stats[dark]["failures"] == 0
    stop = run.task(names[1], "Stop the rollout when a board of this batch became unreachable")
    assert stop.get("failed") and dark in stop["msg"], stop
    assert _on_b(fleet, dark)  # applied, never gated
    line = run.report[dark]
    assert line["result"] == "unreachable" and line["gate"] == "unknown", line
    assert line["plan_after"] != line["plan_before"], line

    # Back, with a server that does not serve (dead URL): site.yml --limit gates it; it
    # fails and goes back to plan A, since this rollout moved it and it never passed.
    fleet.come_back(dark)
    fleet.board(dark).host_vars.update(
        slmguard_server_url=f"http://127.0.0.1:{free_port()}", slmguard_ready_timeout_s=6
    )
    fleet.write_inventory()
    back = _play(fleet, "site.yml", "--limit", dark)
    assert back.returncode != 0 and back.stats[dark]["failures"] == 1
    assert json.loads(back.task(dark, "Apply the plan")["stdout"])["changed"] is False
    assert back.report[dark]["result"] == "rolled back"
    assert deployed(fleet.board(dark).root) == on_a


def test_rollback_undoes_only_the_boards_the_rollout_moved(
    small: Callable[[int], Fleet],
) -> None:
    fleet = small(5)
    names = [b.name for b in fleet.boards]
    # The third board fails its gate: the rollout stops after batch 2 (boards 2 and 3).
    fleet.boards[2].host_vars.update(
        slmguard_server_url=f"http://127.0.0.1:{free_port()}", slmguard_ready_timeout_s=6
    )
    _render(fleet)
    on_a = {n: deployed(fleet.board(n).root) for n in names}
    run = _play(fleet, "site.yml", "-e", '{"slmguard_batches": [1, 2, "100%"]}')
    assert run.returncode != 0 and set(run.stats) == set(names[:3]), run.failures()
    moved = names[:2]
    assert all(_on_b(fleet, n) for n in moved)
    now = {n: snapshot_root(fleet.board(n).root) for n in names}
    undo = _play(fleet, "rollback.yml")
    assert undo.returncode == 0, undo.failures()
    for name in names[2:]:  # never upgraded, or already back: every byte as it was
        assert snapshot_root(fleet.board(name).root) == now[name], name
    for name in moved:
        assert deployed(fleet.board(name).root) == on_a[name], name
    for name in names:
        assert undo.report[name]["changed"] is (name in moved), undo.report[name]
        assert undo.report[name]["gate"] == ("passed" if name in moved else "none")
