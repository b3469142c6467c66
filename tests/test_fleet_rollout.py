"""A staged rollout over a fleet of 32 simulated boards: two fail their gate, the rollout stops.

The fleet (``tests/fleetsim.py``): 32 board roots of three kinds (RK3588,
Jetson Orin Nano, Raspberry Pi 5), in turn, each already on its kind's plan A
(applied earlier); the Jetsons take the model from a mirror, the others from
a file on the board. ``site.yml`` rolls plan B out (another context size) in
batches of 1, 2, 4, then the rest, and the gate asks one real server (the
real engine and model). Two boards of the third batch are made to fail their
gate (their server answers nothing), so:

- the rollout stops after that third batch: 7 boards reached, 25 never
  touched, byte for byte (apply's records and the role's staging included);
- the two failed boards are back on plan A byte for byte (the deployment:
  plan, units, slices, sysctl, boot file, model), and their manifests name
  plan A as the deployment in place;
- the five that passed serve plan B, and the mirror sent each Jetson among
  them the model once; a second run on them changes nothing and downloads
  nothing (the model is looked at by stat, and apply trusts its stamp);
- ``rollback.yml`` takes one of them back to plan A byte for byte.

Runs as root (the role writes root-owned files and the gate server needs a
mount namespace) with the engine; about a minute and a half of Ansible on a
quiet 2-core machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from fleetsim import Fleet, build_fleet, deployed, kind_plans, model_copy, play, snapshot_root
from fleetsim import start_gate_server as gate_server
from fleettrees import model_path
from serveproc import free_port, scaled
from slmguard.deploy.fleet.kinds import board_plans
from slmguard.deploy.manifest import load_manifest
from slmguard.plan.schema import dumps_plan

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


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    model = model_copy(model_path(), tmp)
    plans_a = kind_plans(model)
    server = gate_server(tmp, *plans_a[0])
    try:
        sim = build_fleet(tmp, model, N_BOARDS, MIRROR_KIND, server.url)
        sim.gate = server
        try:
            dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            # One board serves its LAN: the unit gets the key apply makes on the board, and
            # the gate reads it there for its completion.
            sim.boards[LAN - 1].host_vars.update(
                slmguard_listen="0.0.0.0", slmguard_allow_networks=["10.20.0.0/16"]
            )
            for i in FAILING:
                sim.boards[i - 1].host_vars.update(
                    slmguard_server_url=dead, slmguard_ready_timeout_s=6
                )
            sim.write_inventory()
            sim.render(tmp / "tree-b", kind_plans(model, n_ctx=B_CTX))
            yield sim
        finally:
            sim.mirror.close()
    finally:
        server.stop()


def _deployed_plan_text(fleet: Fleet, kind: str, n_ctx: int | None) -> str:
    from slmguard.deploy.modelfile import deployed_plan

    plans = kind_plans(fleet.model, n_ctx=n_ctx)
    plan, source = next(p for p in plans if p[0].board.name == kind)
    return dumps_plan(deployed_plan(plan, source))


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
        assert run.stats[name]["rescued"] == 1
        went_back = run.task(name, "Go back to the previous plan")
        assert "back on the previous plan" in went_back["stdout"], went_back
    # 25 boards never touched, byte for byte (apply's records and the staging included).
    for name in untouched:
        assert snapshot_root(fleet.board(name).root) == before[name], name
    # The failed boards are on plan A again, every byte, mode and mtime.
    for name in failed:
        board = fleet.board(name)
        assert deployed(board.root) == on_a[name], name
        manifest = load_manifest(board.root)
        assert manifest is not None and manifest.complete and manifest.previous is None
    # The others serve plan B; the mirror sent each Jetson among them the model once.
    passed = [n for n in reached if n not in failed]
    size = fleet.model.stat().st_size
    sent = fleet.mirror.sent()
    for name in passed:
        board = fleet.board(name)
        text = (board.root / "etc/slmguard/plan.json").read_text()
        assert text == _deployed_plan_text(fleet, board.kind.board, B_CTX), name
        want = size if board.kind.board == MIRROR_KIND else 0
        assert sent.get(name, 0) == want, (name, sent)
    assert set(sent) <= set(reached)
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
    skipped = again.task(jetson, "Download the model from the mirror")
    assert skipped.get("skipped") is True

    # rollback.yml: one plan back, byte for byte.
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
