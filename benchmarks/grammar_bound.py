"""The engine's grammar bound (issue 37): what grammars in common use spend, what a hostile one
costs the other clients, and what the front does on a build without the bound.

Against the real engine and the embedded model:

1. **The work of grammars in common use**: the engine (``--llama-server``, default the
   venv's: slmguard's build) run bare with ``--verbosity 5`` (debug), which logs the steps of
   parse-stack work of every bounded grammar call (``llama_grammar: N of M steps``);
   for each grammar (llama.cpp's ``json.gbnf``, words, JSON schemas, a tool call, a
   JSON object) the most one call took, against the bound (``--grammar-max-work``).
2. **A hostile grammar beside a plain request** through ``slmguard serve``: the
   plain request's time alone, then beside each hostile grammar (sent from another
   address), the time the engine took to refuse the hostile one, and the engine's
   restarts and stalls (0 expected).
3. **A build without the bound** (``--foreign``, default the newest engine in the
   cache whose ``BUILD.txt`` lists no grammar patch): ``slmguard serve`` with it says
   so (``/health``); issue 37's grammar is refused by the front's simulation; with the
   simulation off (``--max-grammar-stacks 0``, as when it misses a grammar) the same
   grammar beside a plain request: what each got and when, the engine's restarts, and
   whether each request is refused when sent again (the grammar's is: it is blamed on a
   build without the bound; the plain one is not).

Usage (prints only, unless --write-results):
    .venv/bin/python benchmarks/grammar_bound.py
    .venv/bin/python benchmarks/grammar_bound.py --write-results
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from launch import bare_engine, serve, stop
from results_md import write_section
from serveprobe import health, wait_until

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))
SECTION = "## grammar bound"
MODEL_ID = "gemma-3-270m-q4_k_m"
CACHE = Path.home() / ".cache" / "slmguard" / "engine"
PROMPT = "Once upon a time there was"
NEGATED = "root ::= " + " ".join(["([^a0 x\\né一] | [^a0 x\\né一] | [^a0 x\\né一])*"] * 10)
STEPS = re.compile(r"llama_grammar: (\d+) of (\d+) steps")
_SERVED = itertools.count()  # each server's log: serve-N.log


def common_grammars() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, body) of grammars in common use, each a generation of 12 tokens."""
    from test_serve_grammarstacks import JSON_GBNF  # llama.cpp's grammars/json.gbnf

    person = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}, "kind": {"enum": ["a", "b"]}},
        "required": ["name", "age"]}  # fmt: skip
    rows = {"type": "array", "maxItems": 100, "items": {"type": "object", "properties": {
        f"f{i}": {"type": "string", "maxLength": 200} for i in range(20)}}}  # fmt: skip
    email = {"type": "string", "pattern": "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$"}
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    chat = {"messages": [{"role": "user", "content": "Weather in Paris, as JSON?"}],
            "max_tokens": 12}  # fmt: skip
    done = {"prompt": "Here it is:\n", "n_predict": 12}
    return [
        ("llama.cpp's json.gbnf", "/completion", {**done, "grammar": JSON_GBNF}),
        ('words: ([a-z]{1,20} " "?)+', "/completion",
         {**done, "grammar": 'root ::= ([a-z]{1,20} " "?)+'}),
        ("a JSON schema: an object", "/completion", {**done, "json_schema": person}),
        ("a JSON schema: 100 objects of 20 strings", "/completion", {**done, "json_schema": rows}),
        ("a JSON schema: an e-mail pattern", "/completion", {**done, "json_schema": email}),
        ("a tool call (tool_choice required)", "/v1/chat/completions",
         {**chat, "tools": tools, "tool_choice": "required"}),
        ("response_format json_object", "/v1/chat/completions",
         {**chat, "response_format": {"type": "json_object"}}),
    ]  # fmt: skip


def work_of_common_grammars(binary: Path, tmp: Path) -> list[tuple[str, int, int, int]]:
    """(name, status, the most steps one call took, the bound)."""
    log = tmp / "bare.log"
    proc, url = bare_engine(binary, "--ctx-size", "2048", "--parallel", "1", "--jinja",
                            "--verbosity", "5", log=log)  # fmt: skip
    out = []
    try:
        for name, path, body in common_grammars():
            before = log.stat().st_size
            resp = httpx.post(url + path, json=body, timeout=1800)
            with log.open("rb") as f:
                f.seek(before)
                found = STEPS.findall(f.read().decode(errors="replace"))
            most = max((int(n) for n, _ in found), default=0)
            bound = int(found[0][1]) if found else 0
            out.append((name, resp.status_code, most, bound))
            print(
                f"{name}: {resp.status_code}, at most {most:,} of {bound:,} steps", file=sys.stderr
            )
    finally:
        stop(proc)
    return out


def start_server(tmp: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    log = tmp / f"serve-{next(_SERVED)}.log"
    proc, url = serve(tmp, "--ctx", "512", "--n-parallel", "2", *extra, log=log,
                             timeout_s=600)  # fmt: skip
    return proc, url, log


def post(url: str, body: dict[str, Any], host: int) -> tuple[int, str, float]:
    """(status, error code, seconds) of a completion sent from 127.0.0.``host``."""
    transport = httpx.HTTPTransport(local_address=f"127.0.0.{host}")
    started = time.monotonic()
    with httpx.Client(transport=transport, timeout=1800) as client:
        resp = client.post(url + "/v1/completions", json=body)
    took = time.monotonic() - started
    code = "" if resp.status_code == 200 else str((resp.json().get("error") or {}).get("code"))
    return resp.status_code, code, took


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}


PLAIN = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
HOSTILE = [
    ("issue 37's negated class", completion(grammar=NEGATED)),
    ('("a" | "a" | [a-z])* 10 times', completion(
        grammar="root ::= " + " ".join(['("a" | "a" | [a-z])*'] * 10))),
    ('(("a" | "b")?){0,500}', completion(grammar='root ::= (("a" | "b")?){0,500}')),
    ("pattern ^((a|b)?){0,600}$", completion(
        json_schema={"type": "string", "pattern": "^((a|b)?){0,600}$"})),
]  # fmt: skip


def beside(url: str, body: dict[str, Any], host: int) -> tuple[Any, Any]:
    """(the hostile answer, the plain one sent beside it from another address)."""
    plain: list[Any] = []
    other = threading.Thread(target=lambda: plain.append(post(url, PLAIN, 200)))
    other.start()
    hostile = post(url, body, host)
    other.join()
    return hostile, plain[0]


def bounded_engine(tmp: Path) -> tuple[list[Any], float, dict[str, Any]]:
    proc, url, _ = start_server(tmp)
    try:
        alone = min(post(url, PLAIN, 201)[2] for _ in range(3))
        rows = []
        for i, (name, body) in enumerate(HOSTILE):
            hostile, plain = beside(url, body, 10 + i)
            rows.append((name, hostile, plain))
            print(f"{name}: {hostile} beside {plain}", file=sys.stderr)
        engine = (health(url) or {}).get("engine") or {}
    finally:
        stop(proc)
    return rows, alone, engine


def foreign_binary() -> Path | None:
    """The newest engine in the cache built without the grammar patch."""
    found = []
    for build in CACHE.glob("llama-server-*"):
        info = build / "BUILD.txt"
        if (build / ".ok").exists() and info.exists() and "grammar" not in info.read_text():
            found.append((build.stat().st_mtime, build / "bin" / "llama-server"))
    return max(found)[1] if found else None


def foreign_engine(tmp: Path, binary: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"binary": str(binary)}
    proc, url, log = start_server(tmp, "--llama-server", str(binary))
    try:
        out["grammar_bound"] = ((health(url) or {}).get("engine") or {}).get("grammar_bound")
        out["warned"] = "has no grammar bound" in log.read_text()
        out["simulated"] = post(url, completion(grammar=NEGATED), 30)
    finally:
        stop(proc)
    proc, url, _ = start_server(tmp, "--llama-server", str(binary), "--max-grammar-stacks", "0",
                         "--restart-backoff-initial-s", "0.2")  # fmt: skip
    try:
        stall = (health(url) or {}).get("liveness", {}).get("stall_after_s")
        hostile, plain = beside(url, completion(grammar=NEGATED), 31)
        wait_until(lambda: (health(url) or {}).get("state") == "ready", 600, 0.1)
        engine = (health(url) or {}).get("engine") or {}
        out.update(stall_after_s=stall, hostile=hostile, plain=plain,
                   restarts=engine.get("restarts"), stalls=engine.get("stalls"),
                   hostile_again=post(url, completion(grammar=NEGATED), 32),
                   plain_again=post(url, PLAIN, 202))  # fmt: skip
    finally:
        stop(proc)
    print(json.dumps(out), file=sys.stderr)
    return out


def _cell(text: str) -> str:
    """A table cell: a grammar's ``|`` escaped."""
    return text.replace("|", "\\|")


def _answer(a: tuple[int, str, float]) -> str:
    return f"{a[0]}{' ' + a[1] if a[1] else ''} in {a[2]:.1f} s"


def report(common: list[Any], bounded: tuple[list[Any], float, dict[str, Any]],
           foreign: dict[str, Any] | None, elapsed: float) -> str:  # fmt: skip
    rows, alone, engine = bounded
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        SECTION, "",
        f"`benchmarks/grammar_bound.py`, {datetime.date.today()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs shared with other work (load average {load} at the end), "
        f"embedded model (a vocabulary of 262,144 tokens); took {elapsed:.0f} s.", "",
        "The most parse-stack work one grammar call took, 12 tokens each, bare engine "
        "(`--verbosity 5`):", "",
        "| grammar | status | most steps in one call | of the bound |",
        "|---|---|---|---|",
        *(f"| {_cell(n)} | {s} | {m:,} | {m / b:.0%} of {b:,} |" if b
          else f"| {_cell(n)} | {s} | - | - |" for n, s, m, b in common),
        "",
        f"Beside a hostile grammar (4 tokens asked, greedy), a plain completion of 8 tokens "
        f"from another client; alone it took {alone:.1f} s:", "",
        "| hostile grammar | its answer | the plain one beside it |",
        "|---|---|---|",
        *(f"| {_cell(n)} | {_answer(h)} | {_answer(p)} |" for n, h, p in rows),
        "",
        f"The engine after them: restarts {engine.get('restarts')}, stalls "
        f"{engine.get('stalls')}, grammar bound {engine.get('grammar_bound')}.",
    ]  # fmt: skip
    if foreign is not None:
        lines += [
            "",
            f"A build without the bound (`{foreign['binary']}`): `/health` says "
            f"`grammar_bound: {foreign['grammar_bound']}`, the start log warns: "
            f"{foreign['warned']}; issue 37's grammar is refused by the front's simulation "
            f"({_answer(foreign['simulated'])}). With the simulation off "
            f"(`--max-grammar-stacks 0`), stall time {foreign['stall_after_s']} s: the "
            f"grammar got {_answer(foreign['hostile'])}, the plain request beside it "
            f"{_answer(foreign['plain'])}; the engine restarted {foreign['restarts']} time(s) "
            f"({foreign['stalls']} stall(s)); sent again, the grammar got "
            f"{_answer(foreign['hostile_again'])} and the plain request "
            f"{_answer(foreign['plain_again'])}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--llama-server", type=Path, default=Path(sys.executable).parent / "llama-server"
    )
    ap.add_argument("--foreign", type=Path, default=None)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="slmguard-grammar-bound-"))
    t0 = time.monotonic()
    common = work_of_common_grammars(args.llama_server, tmp)
    bounded = bounded_engine(tmp)
    other = args.foreign or foreign_binary()
    foreign = foreign_engine(tmp, other) if other is not None else None
    text = report(common, bounded, foreign, time.monotonic() - t0)
    print(text)
    if args.write_results:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
