"""A simulated fleet rolled out by the rendered Ansible role: what a rollout may touch, and bytes.

Builds the simulated fleet of ``tests/fleetsim.py`` (board roots of three
kinds, the ``simboard`` connection with its byte counter, one real gate
server, a counting model mirror), every board on plan A, and runs, in order:

1. a refused rollout: plan B, whose apply the canary refuses (its MemTotal is
   below plan B's MemoryMax, 78): the boards whose deployment changed;
2. a failed rollout: plan B, whose canary fails its gate: the same count;
3. plan B with a board of the second batch going dark right after apply: the
   boards reached (the rollout must stop after that batch); the board comes
   back and ``site.yml --limit`` gates it;
4. ``rollback.yml`` over the whole fleet: the boards outside the rollout it
   touched (byte for byte, apply's records and the staging included);
5. plan B to the whole fleet in the default batches (a plan-only change: the
   model is the same): time per board, model bytes each board took, bytes
   over its link (``simboard``: the Ansible modules, the plan, the outputs);
6. the same again (a no-op run): changed, and the same bytes.

The package figures come from ``dist/`` (``make dist-amd64``) and, when there,
``dist/previous`` (``make dist-previous-amd64``: this tree as an older
version): the packages an slmguard-only upgrade moves are those whose version
differs between the two sets (the role copies a package only when its pinned
version is not the board's), and their bytes.

Prints a Markdown table; ``--write`` replaces the ``## fleet rollout`` section
of ``benchmarks/RESULTS.md``. Needs root and the engine.

    .venv/bin/python benchmarks/fleet_rollout.py --boards 32 --forks 4 --write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from results_md import write_section  # noqa: E402

from fleetsim import (  # noqa: E402
    Fleet,
    build_fleet,
    deployed,
    kind_plans,
    model_copy,
    play,
    snapshot_root,
    start_gate_server,
)
from serveproc import default_model_path, free_port  # noqa: E402

SECTION = "## fleet rollout"
MIRROR_KIND = "jetson-orin-nano-8g"
DEFAULT = '{"slmguard_batches": [1, 5, "20%", "100%"]}'
LOW_MEMINFO = "MemTotal:        6500000 kB\nMemFree:         3000000 kB\nHugetlb:    0 kB\n"


def _deployment(root: Path) -> dict[str, Any]:
    """What apply deployed under ``root``, without the simulated board's /proc (the refused
    step writes a lower MemTotal there, then puts it back)."""
    return {k: v for k, v in deployed(root).items() if not k.startswith("proc")}


def _changed(fleet: Fleet, before: dict[str, Any]) -> list[str]:
    return [b.name for b in fleet.boards if _deployment(b.root) != before[b.name]]


def _run(fleet: Fleet, book: str, *args: str, forks: int) -> Any:
    run = play(fleet.tmp / "tree-b", fleet.inventory, book, *args, forks=forks, timeout_s=7200)
    print(f"{book} {' '.join(args)}: exit {run.returncode}, {run.seconds:.0f} s", flush=True)
    return run


def _link_bytes(fleet: Fleet) -> dict[str, tuple[int, int]]:
    return {b.name: fleet.bytes_moved(b.name) for b in fleet.boards}


def _delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[int]:
    return [sum(after[n]) - sum(before[n]) for n in after]


def faults(fleet: Fleet, forks: int, out: dict[str, Any]) -> None:
    """Steps 1-4 (see the module docstring)."""
    canary = fleet.boards[0]
    on_a = {b.name: _deployment(b.root) for b in fleet.boards}
    meminfo = (canary.root / "proc/meminfo").read_text()
    (canary.root / "proc/meminfo").write_text(LOW_MEMINFO)
    _run(fleet, "site.yml", "-e", DEFAULT, forks=forks)
    out["refused"] = _changed(fleet, on_a)
    (canary.root / "proc/meminfo").write_text(meminfo)
    dead = f"http://127.0.0.1:{free_port()}"
    url = canary.host_vars["slmguard_server_url"]
    canary.host_vars.update(slmguard_server_url=dead, slmguard_ready_timeout_s=6)
    fleet.write_inventory()
    _run(fleet, "site.yml", "-e", DEFAULT, forks=forks)
    out["failed"] = _changed(fleet, on_a)
    canary.host_vars.update(slmguard_server_url=url)
    del canary.host_vars["slmguard_ready_timeout_s"]
    dark = fleet.boards[3]  # in the second batch (boards 2-6)
    fleet.dark_after(dark.name, "apply")
    fleet.write_inventory()
    before = {b.name: snapshot_root(b.root) for b in fleet.boards}
    run = _run(fleet, "site.yml", "-e", DEFAULT, forks=forks)
    out["dark_reached"] = sorted(run.stats)
    out["dark_untouched"] = sum(
        snapshot_root(b.root) == before[b.name] for b in fleet.boards if b.name not in run.stats
    )
    out["dark_halted"] = run.returncode != 0 and len(run.stats) < len(fleet.boards)
    fleet.come_back(dark.name)
    fleet.write_inventory()
    back = _run(fleet, "site.yml", "--limit", dark.name, forks=forks)
    out["dark_back"] = back.report.get(dark.name, {}).get("gate")
    moved = [n for n in out["dark_reached"]]
    now = {b.name: snapshot_root(b.root) for b in fleet.boards}
    undo = _run(fleet, "rollback.yml", forks=forks)
    out["rollback_outside"] = [
        b.name for b in fleet.boards if b.name not in moved and snapshot_root(b.root) != now[b.name]
    ]
    out["rollback_back_on_a"] = sum(_deployment(fleet.board(n).root) == on_a[n] for n in moved)
    out["rollback_moved"] = len(moved)
    out["rollback_seconds"] = undo.seconds


def full(fleet: Fleet, forks: int, out: dict[str, Any]) -> None:
    """Steps 5 and 6."""
    sent0, link0 = fleet.mirror.sent(), _link_bytes(fleet)
    run = _run(fleet, "site.yml", "-e", DEFAULT, forks=forks)
    sent1, link1 = fleet.mirror.sent(), _link_bytes(fleet)
    again = _run(fleet, "site.yml", "-e", DEFAULT, forks=forks)
    sent2, link2 = fleet.mirror.sent(), _link_bytes(fleet)
    out["rollout"] = {
        "rc": run.returncode,
        "seconds": run.seconds,
        "model_bytes": sum(sent1.values()) - sum(sent0.values()),
        "link": _delta(link0, link1),
        "report": len(run.report),
    }
    out["noop"] = {
        "rc": again.returncode,
        "seconds": again.seconds,
        "changed": sum(s["changed"] for s in again.stats.values()),
        "model_bytes": sum(sent2.values()) - sum(sent1.values()),
        "link": _delta(link1, link2),
        "packages": sum(r.get("bytes_moved_total", 0) for r in again.report.values()),
    }


def kubernetes(tmp: Path, fleet: Fleet, nodes: int, out: dict[str, Any]) -> None:
    """The model's bytes per node for two k8s rollouts: plan A's (the model into each
    node's cache), then plan B's (a plan-only change): each DaemonSet's own init command
    (``podinit model``), run for every node against the counting mirror."""
    import yaml

    from slmguard.deploy.fleet.k8s import K8sOptions, render_manifests
    from slmguard.deploy.fleet.kinds import board_plans

    opts = K8sOptions(
        image="registry.example/slmguard:0.1.0@sha256:" + "0" * 64,
        model_mirror=fleet.mirror.url("NODE", "").rstrip("/"),
    )
    moved = []
    for n_ctx in (None, 1024):
        bps = board_plans(list(kind_plans(fleet.model, n_ctx=n_ctx)))[:1]
        (ds,) = [
            doc
            for f in render_manifests(bps, opts)
            if f.path.endswith("/daemonset.yaml")
            for doc in yaml.safe_load_all(f.content or b"")
        ]
        init = next(
            c for c in ds["spec"]["template"]["spec"]["initContainers"] if c["name"] == "model"
        )
        cmd = init["command"]
        before = sum(fleet.mirror.sent().values())
        for i in range(nodes):
            cache = tmp / f"node-{i}" / "by-sha256"
            cache.mkdir(parents=True, exist_ok=True)
            argv = [a.replace("/NODE/", f"/node-{i}/") for a in cmd[1:]]
            argv[argv.index("--cache") + 1] = str(cache)
            subprocess.run([sys.executable, *argv], check=True, capture_output=True)
        moved.append((sum(fleet.mirror.sent().values()) - before) // nodes)
    out["k8s"] = {"nodes": nodes, "first_per_node": moved[0], "plan_only_per_node": moved[1]}


def _deb_fields(path: Path) -> tuple[str, str]:
    done = subprocess.run(
        ["dpkg-deb", "--showformat=${Package} ${Version}", "--show", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    name, version = done.stdout.split()
    return name, version


def packages(dist: Path) -> dict[str, Any]:
    """Sizes of the split packages in ``dist`` and what an slmguard-only upgrade moves."""
    sets = {}
    for where in (dist, dist / "previous"):
        found = {}
        for deb in sorted(where.glob("slmguard*_amd64.deb"), key=lambda p: p.stat().st_mtime):
            name, version = _deb_fields(deb)
            found[name] = (version, deb.stat().st_size)
        sets[where.name] = found
    current, previous = sets[dist.name], sets.get("previous", {})
    moved = {n: v[1] for n, v in current.items() if previous.get(n, (None,))[0] != v[0]}
    return {"current": current, "previous": bool(previous), "upgrade": moved}


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def table(out: dict[str, Any], n: int, forks: int) -> list[tuple[str, str]]:
    r, z = out["rollout"], out["noop"]
    pk = out["packages"]
    rows = [
        ("boards (kinds in turn: RK3588, Orin Nano, Pi 5); forks", f"{n}; {forks}"),
        ("healthy boards changed by a refused rollout (canary: 78)", str(len(out["refused"]))),
        ("healthy boards changed by a failed rollout (canary's gate)", str(len(out["failed"]))),
        (
            "a board lost after apply (second batch): boards reached",
            f"{len(out['dark_reached'])} (batches 1 and 2; halted: {out['dark_halted']}; "
            f"{out['dark_untouched']} others untouched byte for byte); back, gated: "
            f"{out['dark_back']}",
        ),
        (
            "rollback.yml over the whole fleet: boards outside the rollout touched",
            f"{len(out['rollback_outside'])} ({out['rollback_back_on_a']} of the "
            f"{out['rollback_moved']} it moved back on plan A byte for byte, "
            f"{out['rollback_seconds']:.0f} s)",
        ),
        (
            "plan-only rollout, default batches",
            f"{r['seconds']:.0f} s, {r['seconds'] / n:.1f} s a board; model bytes "
            f"{r['model_bytes']}; over each link {_mb(min(r['link']))}-{_mb(max(r['link']))}",
        ),
        (
            "no-op run",
            f"{z['seconds']:.0f} s, changed={z['changed']}; model bytes {z['model_bytes']}, "
            f"package bytes {z['packages']}; over each link {_mb(min(z['link']))}-"
            f"{_mb(max(z['link']))}",
        ),
    ]
    k = out["k8s"]
    rows.append(
        (
            f"Kubernetes, --model-mirror, {k['nodes']} nodes: model bytes per node",
            f"{k['first_per_node']} for the first rollout (into the node's cache), "
            f"{k['plan_only_per_node']} for a plan-only one",
        )
    )
    sizes = ", ".join(f"{k} {_mb(v[1])}" for k, v in sorted(pk["current"].items()))
    rows.append(("the amd64 packages (make dist-amd64)", sizes or "not built"))
    if pk["previous"]:
        moved = ", ".join(f"{k} {_mb(v)}" for k, v in pk["upgrade"].items())
        rows.append(
            (
                "slmguard-only upgrade (dist/previous to dist): packages moved per board",
                f"{moved}: {_mb(sum(pk['upgrade'].values()))} (goal < 25 MB)",
            )
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--boards", type=int, default=32)
    ap.add_argument("--forks", type=int, default=4)
    ap.add_argument("--k8s-nodes", type=int, default=4, help="nodes of the k8s part")
    ap.add_argument("--state", default="", help="the machine's state, for the record")
    ap.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (the role writes root-owned files)", file=sys.stderr)
        return 1
    out: dict[str, Any] = {"packages": packages(REPO / "dist")}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = model_copy(default_model_path(), tmp)
        server = start_gate_server(tmp, *kind_plans(model)[0])
        try:
            sim = build_fleet(tmp, model, args.boards, MIRROR_KIND, server.url)
            try:
                sim.write_inventory()
                sim.render(tmp / "tree-b", kind_plans(model, n_ctx=1024))
                faults(sim, args.forks, out)
                full(sim, args.forks, out)
                kubernetes(tmp, sim, args.k8s_nodes, out)
            finally:
                sim.mirror.close()
        finally:
            server.stop()
    print(json.dumps(out, indent=1, default=str), file=sys.stderr)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    state = f" Machine: {args.state}." if args.state else ""
    lines = [
        SECTION,
        "",
        f"`benchmarks/fleet_rollout.py --boards {args.boards} --forks {args.forks}` ({stamp}; "
        f"this 2-core x86 host runs the controller and every simulated board's work; load "
        f"average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end).{state} "
        "Over each link: what the `simboard` connection counted to and from the board (the "
        "Ansible modules, the plan on stdin, the outputs); a real SSH link adds its framing.",
        "",
        "| measure | value |",
        "|---|---|",
        *(f"| {a} | {b} |" for a, b in table(out, args.boards, args.forks)),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
