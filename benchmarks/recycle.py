"""Benchmark leak-aware recycling: a 50 MiB-per-1,000-requests leak, beside CPU hogs.

What it measures (issue 40), ``--runs`` times (5 by default), each on a fresh server
with ``--hogs`` busy-loop CPU hogs beside it (2 by default):

- the real llama-server, started through ``tests/leakshim.c`` (LD_PRELOAD), leaks
  ``--leak-mib-per-1000`` MiB of written heap per 1,000 generation requests it reads
  (50 by default: 52,429 bytes a request);
- the governor's limit is set so that its shed watermark lies ``--room-mib`` above the
  working set after start (64 MiB: the leak would reach it after about 1,300 requests;
  a limit of the working set plus that much would leave a room that shrinks as the
  working set grows, ``tests/test_serve_recycle.py``), the governor counting
  the front's and the engine's own memory (``own_memory``: the machine's cgroup is
  shared), and knowing the plan's "use" parts for these settings (``slmguard plan
  --ctx 1024 --slots 1``), as ``serve --plan`` does;
- ``--clients`` clients send requests back to back (completions, chat, a stream, a
  session turn, in turn) until the engine was recycled and ``--after`` more answers came
  from the fresh one.

Recorded per run: the requests until the recycle, the drift and the bound it was
recycled at, the growth per 1,000 requests the governor measured, the highest pressure
seen before it (against the shed watermark), the verdict (idle or drain), the drain and
reload times, the requests that waited, and every answer's status (the goal: none but
200). Written to benchmarks/RESULTS.md, section ``## recycle``.

Usage: ``.venv/bin/python benchmarks/recycle.py [--runs 5] [--hogs 2] [--no-write]``
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from governor import Hogs, load_average  # noqa: E402
from results_md import write_section  # noqa: E402

from governorserver import MODEL_ID, GovernedServer, governed_server  # noqa: E402
from leakshim import build, engine_env  # noqa: E402

SECTION = "## recycle"
MIB = 1 << 20


def one_request(srv: GovernedServer, client: httpx.Client, i: int) -> str:
    """The i-th request of a client: completion, chat, streamed chat or a session turn."""
    h = srv.api_headers()
    kind = i % 4
    if kind == 0:
        body: dict[str, Any] = {"model": MODEL_ID, "prompt": f"Count to {i % 7}:", "max_tokens": 2}
        resp = client.post(srv.url + "/v1/completions", json=body, headers=h)
        return str(resp.status_code)
    body = {"model": MODEL_ID, "max_tokens": 2,
            "messages": [{"role": "user", "content": f"Word {i % 5}?"}]}  # fmt: skip
    if kind == 3:
        body["session_id"] = f"bench-{i % 3}"
    if kind != 2:
        return str(client.post(srv.url + "/v1/chat/completions", json=body, headers=h).status_code)
    body["stream"] = True
    with client.stream("POST", srv.url + "/v1/chat/completions", json=body, headers=h) as resp:
        text = resp.read().decode()
    ok = resp.status_code == 200 and "data: [DONE]" in text and '"error"' not in text
    return "200" if ok else f"{resp.status_code} stream"


class Load:
    """Clients sending back to back; the governor's pressure sampled between requests."""

    def __init__(self, srv: GovernedServer, clients: int) -> None:
        self.srv = srv
        self.outcomes: Counter[str] = Counter()
        self.max_pressure_pct = 0.0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        gov = self.srv.governor
        with httpx.Client(timeout=600) as client:
            i = 0
            while not self.stop.is_set():
                try:
                    self.outcomes[one_request(self.srv, client, i)] += 1
                except httpx.HTTPError as err:
                    self.outcomes[type(err).__name__] += 1
                if gov.recycling.count == 0:
                    self.max_pressure_pct = max(self.max_pressure_pct, gov.pressure_pct)
                i += 1

    @property
    def answers(self) -> int:
        return sum(self.outcomes.values())

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(600)


def planned_use_bytes() -> int:
    """The plan's "use" parts for this server's settings (what ``serve --plan`` gives the
    governor): growth of the compute buffer as prompts lengthen is expected, not a leak."""
    out = subprocess.run(
        [str(Path(sys.executable).with_name("slmguard")), "plan", "--ctx", "1024", "--slots",
         "1", "--flash-attn", "off", "--json"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    plan = json.loads(out)
    return sum(p["bytes"] for p in plan["budget"] if p["when"] == "use" and p["kind"] == "anon")


def one_run(state: Path, shim: Path, args: argparse.Namespace, use: int) -> dict[str, Any]:
    leak = round(args.leak_mib_per_1000 * MIB / 1000)
    started = time.monotonic()
    with governed_server(state, n_ctx=1024, own_memory=True, queue_size=16,
                         engine_env=engine_env(shim, leak)) as srv:  # fmt: skip
        gov = srv.governor
        model = replace(gov.config.model, use_bytes=use)
        srv.call(lambda: setattr(gov, "config", replace(gov.config, model=model)))
        working_set = gov.signal.sample().working_set_bytes
        shed = gov.config.thresholds.shed_pct / 100
        budget = math.ceil((working_set + args.room_mib * MIB) / shed)
        srv.call(lambda: setattr(gov.signal, "budget_bytes", budget))
        with Load(srv, args.clients) as load:
            while gov.recycling.count == 0 and time.monotonic() - started < args.max_run_s:
                time.sleep(0.5)
            at_recycle = load.answers
            while load.answers < at_recycle + args.after and gov.recycling.count:
                time.sleep(0.5)
        status = srv.call(gov.status)
    record = (status["leaks"]["recycles"] or [None])[0]
    return {
        "record": record,
        "answers_at_recycle": at_recycle,
        "outcomes": dict(load.outcomes),
        "max_pressure_pct": round(load.max_pressure_pct, 1),
        "shed_pct": status["thresholds"]["shed_pct"],
        "transitions": status["transitions"],
        "wall_s": round(time.monotonic() - started, 1),
    }


def render(runs: list[dict[str, Any]], args: argparse.Namespace, load_before: str) -> str:
    recycled = [r for r in runs if r["record"] is not None]
    clean = [r for r in recycled if set(r["outcomes"]) == {"200"} and not r["transitions"]]
    lines = [
        SECTION, "",
        f"`benchmarks/recycle.py --runs {args.runs} --hogs {args.hogs}` (issue 40): the real "
        f"llama-server through `tests/leakshim.c`, leaking {args.leak_mib_per_1000} MiB per "
        f"1,000 generation requests; the governor's limit set so that its shed watermark "
        f"lies {args.room_mib} MiB above the working set after start; {args.clients} "
        f"clients back to back (completion, chat, stream, session turn in turn); "
        f"{args.hogs} busy-loop CPU hogs beside every run. "
        f"Load average at the start: {load_before}; at the end: {load_average()}. The "
        "machine's 2 cores are shared with other sessions' builds and tests.", "",
        f"**{len(clean)} of {len(runs)} runs**: the engine recycled before the shed "
        "watermark (the level never left normal) with every answer a 200.", "",
        "| run | answers to the recycle | drift at recycle | bound | measured growth per "
        "1,000 requests | highest pressure before (shed) | verdict | drain | reload | "
        "waited | answers |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for i, r in enumerate(runs, 1):
        rec = r["record"]
        if rec is None:
            lines.append(f"| {i} | no recycle in {r['wall_s']} s | | | | | | | | | "
                         f"`{r['outcomes']}` |")  # fmt: skip
            continue
        lines.append(
            f"| {i} | {r['answers_at_recycle']} | {rec['drift_bytes'] / MIB:.1f} MiB | "
            f"{rec['bound_bytes'] / MIB:.1f} MiB | {rec['per_1000_requests_bytes'] / MIB:.1f} MiB "
            f"| {r['max_pressure_pct']}% ({r['shed_pct']:.0f}%) | {rec['verdict']} | "
            f"{rec['drained_s']:.2f} s | {rec['reload_s']:.2f} s | {rec['waiting']} | "
            f"`{r['outcomes']}` |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--leak-mib-per-1000", type=float, default=50.0)
    ap.add_argument("--room-mib", type=int, default=64, help="working set to shed watermark")
    ap.add_argument("--after", type=int, default=20, help="answers from the fresh engine")
    ap.add_argument("--max-run-s", type=float, default=3600.0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    load_before = load_average()
    runs = []
    with tempfile.TemporaryDirectory(prefix="slmguard-recycle-") as tmp:
        shim = build(Path(tmp))
        if shim is None:
            print("no C compiler (cc) to build tests/leakshim.c", file=sys.stderr)
            return 69
        use = planned_use_bytes()
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the hogs are stopped too
        with Hogs(args.hogs):
            for i in range(args.runs):
                run = one_run(Path(tmp) / f"run{i}", shim, args, use)
                print(f"run {i + 1}: {run}", flush=True)
                runs.append(run)
    text = render(runs, args, load_before)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
