"""What the front costs over bare llama-server: decode speed, first token, concurrency, memory.

One invocation starts (a) ``slmguard serve`` and (b) a bare ``llama-server`` with
the served engine's own command line and environment (``/proc/PID/cmdline`` and
``environ``: the same binary, model, threads, context, batch, slots and every other
flag), on loopback TCP instead of the private socket and without an API key, in a
session of its own as serve's engine is (:func:`start_bare` says why). Both engines are
also read from outside (``serveprobe``): their own decode over each request
(``/metrics``), the sampling parameters their slots ran (``/slots``) and what differs
between their processes, all printed beside the figures. The client is the same for
both: httpx over loopback TCP, streamed ``/v1/completions``, greedy sampling,
the same prompts, rotated so no side reuses a cached prompt. The one-stream
measure is repeated on the other generation routes both sides serve
(``--routes``: ``/v1/responses`` and ``/v1/messages``, whose streams are named
events), a token being a text delta event.

Measured, in one run, alternating request by request (ratios only: the machine
is shared and noisy):

- one stream: decode tokens/s = (tokens - 1) / (last token - first token),
  medians per side and their ratio (served / bare; goal >= 0.98); time to
  first token (send -> first text event), median difference (goal <= +5 ms);
- four clients at once against ``-np 4`` on both sides, alternating phases:
  aggregate tokens/s (goal >= 0.95x bare), and the bare gain over one stream;
- resident memory after the runs: front RSS (goal <= 60 MiB) and the whole
  service's anonymous memory against bare llama-server's (goal <= +45 MiB).
- the front's CPU per relayed token (its threads' time on a CPU over its requests, from
  ``/proc/PID/task/*/schedstat``), its CPU per second at rest, and, unless
  ``--no-floor``, the same figure for ``benchmarks/floor_relay.py`` (a raw asyncio
  relay, no framework, in front of the bare engine) alternating with the front over
  the same requests: the cost of any Python relay here, the front's read against it;
  with ``--asgi-floor``, ``benchmarks/asgi_floor.py`` too (uvicorn on the front's HTTP
  stack with nothing above ASGI): what the ASGI server alone costs.

With offload (``--gpu-layers N``, and ``--llama-server`` a GPU build): serve runs a
plan for this host with its Vulkan device (``slmguard plan --board auto --gpu vulkan
--gpu-layers N [--no-kv-offload]``, the same context, threads and slots given to
serve as flags), is started first, and the bare llama-server is started with *its
engine's own command line* (``/proc/PID/cmdline``, loopback TCP instead of the socket,
no API key, no slot directory): the same binary and every flag, ``--n-gpu-layers``,
``--device`` and ``--no-kv-offload`` among them. Its section is
``## serve overhead with offload (lavapipe)`` on lavapipe (llama.cpp needs
``GGML_VK_VISIBLE_DEVICES=0`` in the environment for it; both children inherit it).

With ``--board`` (issue 39): one ``serve --plan`` of a board, the embedded Gemma pinned
and a second Gemma on demand (plus the tests' tiny embedder, on demand, idle), and for
each generative model a bare llama-server started with that model's engine command
line; each model's one-stream decode against its own bare engine, alternating
(``benchmarks/board_overhead.py``, its own section ``## serve overhead of a board``).

Usage (prints only, unless --write-results):
    .venv/bin/python benchmarks/serve_overhead.py
    .venv/bin/python benchmarks/serve_overhead.py --rounds 12 --write-results
    GGML_VK_VISIBLE_DEVICES=0 .venv/bin/python benchmarks/serve_overhead.py \
        --llama-server ~/.cache/slmguard/engine/llama-server-0.3.36-vulkan-KEY/bin/llama-server \
        --gpu-layers 19 --rounds 6 --max-tokens 8 --phases 0 --routes '' --write-results
    .venv/bin/python benchmarks/serve_overhead.py --board --rounds 12 --write-results
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from floor_relay import default_loop
from results_md import write_section
from serveprobe import (
    EngineView,
    cmdline,
    differences,
    engine_decode_tps,
    environ,
    param_differences,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
SECTION = "## serve overhead"
SLMGUARD = Path(sys.executable).parent / "slmguard"
MODEL_ID = "gemma-3-270m-q4_k_m"

PROMPTS = [
    "The history of the printing press begins",
    "A recipe for bread needs flour, water,",
    "In the middle of the ocean there is a small island where",
    "The train left the station at dawn, and the passengers",
    "Rivers carry water from the mountains to",
    "The old library had a secret room behind",
    "Every morning the baker opened the shop and",
    "The mountain road was narrow, and the bus",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status_bytes(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def wait_http(url: str, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} never became ready")


def start_bare(argv: list[str], env: dict[str, str] | None = None) -> tuple[Any, str]:
    """The bare engine on ``argv``, the served engine's own command line, on loopback TCP
    without an API key or a slot directory; with ``env``, the served engine's environment.
    In its own session, as serve's supervisor starts its engine: with the kernel's
    autogroup on, a session is a CPU scheduling group, and an engine left in this script's
    session would share one group's CPU with the client (and the front) while the served
    engine has a group of its own."""
    argv = list(argv)
    host = argv.index("--host")
    argv[host + 1] = "127.0.0.1"
    for flag in ("--api-key-file", "--slot-save-path"):
        if flag in argv:
            at = argv.index(flag)
            del argv[at : at + 2]
    port = free_port()
    argv += ["--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(url)
    return proc, url


def start_served(
    model: str, n_ctx: int, threads: int, slots: int, tmp: Path,
    binary: str | None = None, plan: Path | None = None, pythonpath: Path | None = None,
) -> tuple[Any, str]:  # fmt: skip
    port = free_port()
    argv = [str(SLMGUARD), "serve", "--model", model, "--port", str(port),
            "--n-ctx", str(n_ctx), "--n-threads", str(threads), "--n-parallel", str(slots),
            "--state-dir", str(tmp / f"state-{port}"), "--no-governor",
            "--canary-interval-s", "0", "--queue-size", "16"]  # fmt: skip
    argv += ["--llama-server", binary] if binary else []
    argv += ["--plan", str(plan)] if plan is not None else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url)
    return proc, url


def start_fallback(args: argparse.Namespace, tmp: Path) -> tuple[Any, str]:
    """``slmguard serve`` on its fallback HTTP stack, h11 on asyncio's loop (what it runs
    where uvloop and httptools have no wheel): both made unimportable for that process."""
    blocker = tmp / "no-uvloop-no-httptools"
    for name in ("uvloop", "httptools"):
        (blocker / name).mkdir(parents=True, exist_ok=True)
        (blocker / name / "__init__.py").write_text(f"raise ImportError('{name}: blocked')\n")
    return start_served(args.model, args.n_ctx, args.threads, 1, tmp, args.llama_server,
                        pythonpath=blocker)  # fmt: skip


def engine_pid_of(url: str) -> int:
    return int(httpx.get(url + "/health", timeout=10).json()["engine"]["pid"])


def engine_cmdline(url: str) -> list[str]:
    """The served engine's command line, as the kernel has it."""
    return cmdline(engine_pid_of(url))


def offload_plan(args: argparse.Namespace, tmp: Path) -> Path:
    """This host's plan with its Vulkan device and ``--gpu-layers``, as ``serve`` reads it."""
    out = tmp / "offload-plan.json"
    kv = "--kv-offload" if args.kv_offload else "--no-kv-offload"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")}
    subprocess.run(
        [str(SLMGUARD), "plan", "--model", args.model, "--board", "auto", "--gpu", "vulkan",
         "--gpu-layers", str(args.gpu_layers), kv, "--ctx", str(args.n_ctx),
         "--out", str(out)],
        check=True, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    return out


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def offload_words(args: argparse.Namespace, argv: list[str]) -> tuple[str, str]:
    """(the section title, the sentence on the engine and its offload flags)."""
    from slmguard.engines import engine_version, list_devices

    binary = Path(argv[0])
    device = flag_value(argv, "--device")
    listed = {d.name: d.description for d in list_devices(binary)}
    what = listed.get(device or "", "not listed")
    lavapipe = "llvmpipe" in what
    title = SECTION + " with offload" + (" (lavapipe)" if lavapipe else "")
    flags = (f"`--n-gpu-layers {flag_value(argv, '--n-gpu-layers')} --device {device}"
             + (" --no-kv-offload" if "--no-kv-offload" in argv else "") + "`")  # fmt: skip
    words = (
        f" Engine: {binary.name} `{engine_version(binary)}` at `{binary}`; device {device}: "
        f"{what}"
        + (", Mesa's CPU Vulkan driver (`GGML_VK_VISIBLE_DEVICES=0`)" if lavapipe else "")
        + f". Both sides run the same binary with the same flags, {flags} among them: serve "
        f"with `slmguard plan --board auto --gpu vulkan --gpu-layers {args.gpu_layers} "
        f"{'--kv-offload' if args.kv_offload else '--no-kv-offload'}`, the bare engine with the "
        "served "
        "engine's own command line (loopback TCP instead of the socket, no API key)."
    )
    return title, words


def _completion_token(chunk: dict[str, Any]) -> bool:
    return bool(chunk.get("choices") and chunk["choices"][0].get("text"))


def _delta_event(kind: str) -> Any:
    return lambda chunk: (
        chunk.get("type") == kind
        and bool(
            chunk.get("delta") if kind != "content_block_delta" else chunk["delta"].get("text")
        )
    )


#: route name -> (path, request body for a prompt and a token count, "is a token event").
ROUTES: dict[str, tuple[str, Any, Any]] = {
    "completions": ("/v1/completions",
                    lambda p, n: {"prompt": p, "max_tokens": n}, _completion_token),
    "responses": ("/v1/responses",
                  lambda p, n: {"input": p, "max_output_tokens": n},
                  _delta_event("response.output_text.delta")),
    "messages": ("/v1/messages",
                 lambda p, n: {"messages": [{"role": "user", "content": p}], "max_tokens": n},
                 _delta_event("content_block_delta")),
}  # fmt: skip


def stream_once(
    client: httpx.Client, url: str, prompt: str, max_tokens: int, route: str = "completions",
    model: str = MODEL_ID,
) -> dict[str, float]:  # fmt: skip
    try:
        return _stream_once(client, url, prompt, max_tokens, route, model)
    except httpx.RemoteProtocolError:
        # A kept-alive connection the server closed as this request went out
        # (llama-server's HTTP library ends idle connections after a few seconds):
        # nothing was processed, send it again on a new connection.
        return _stream_once(client, url, prompt, max_tokens, route, model)


def _stream_once(
    client: httpx.Client, url: str, prompt: str, max_tokens: int, route: str, model: str
) -> dict[str, float]:
    path, make_body, is_token = ROUTES[route]
    body = {"model": model, **make_body(prompt, max_tokens), "temperature": 0, "stream": True}
    sent = time.perf_counter()
    times: list[float] = []
    with client.stream("POST", url + path, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: {resp.status_code} {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            if is_token(json.loads(line[6:])):
                times.append(time.perf_counter())
    if len(times) < 3:
        raise RuntimeError(f"only {len(times)} tokens streamed from {url}")
    return {
        "ttft_s": times[0] - sent,
        "decode_tps": (len(times) - 1) / (times[-1] - times[0]),
        "tokens": len(times),
    }


def cpu_s(pid: int) -> float:
    """Time on a CPU of every thread of ``pid`` (/proc/PID/task/*/schedstat, ns), in s."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):  # a thread that ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def alternate(
    sides: dict[str, tuple[str, int | None]], rounds: int, max_tokens: int,
    route: str = "completions", label: str = "", model: str = MODEL_ID,
    views: dict[str, EngineView] | None = None,
) -> tuple[dict[str, list[dict[str, float]]], dict[str, float]]:  # fmt: skip
    """The same streamed requests to each side, alternating request by request (the order
    reversed every other round): each request's figures, and each side's CPU over its own
    requests (for a side given a pid). ``model``: the name every request sends. ``views``:
    a side's engine, whose own decode speed over each request is added (``engine_tps``)."""
    got: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    cpu = {side: 0.0 for side in sides}
    views = views or {}
    with httpx.Client(timeout=600) as client:
        for url, _ in sides.values():  # warm each up
            stream_once(client, url, "Warm up", 8, route, model)
        for i in range(rounds):
            prompt = PROMPTS[i % len(PROMPTS)] + f" ({label or route} round {i})"
            order = list(sides)
            if i % 2:
                order.reverse()
            for side in order:
                url, pid = sides[side]
                view = views.get(side)
                counters = view.decode_counters() if view else None
                before = cpu_s(pid) if pid else 0.0
                one = stream_once(client, url, prompt, max_tokens, route, model)
                if pid:
                    cpu[side] += cpu_s(pid) - before
                if view and counters:
                    one["engine_tps"] = engine_decode_tps(counters, view.decode_counters()) or 0.0
                got[side].append(one)
    return got, cpu


def per_token_us(cpu: float, runs: list[dict[str, float]]) -> float:
    return cpu * 1e6 / max(1.0, sum(r["tokens"] for r in runs))


def single_stream(
    bare: str, served: str, front_pid: int, rounds: int, max_tokens: int,
    route: str = "completions", model: str = MODEL_ID,
    views: dict[str, EngineView] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One stream at a time, alternating; with ``views`` (``bare`` and ``served``: the two
    engines) also each engine's own decode speed and the sampling parameters each engine's
    slot ran the last request with, compared (what the front passed on)."""
    got, cpu = alternate({"bare": (bare, None), "served": (served, front_pid)}, rounds,
                         max_tokens, route, model=model, views=views)  # fmt: skip
    keys = ("ttft_s", "decode_tps") + (("engine_tps",) if views else ())
    med = {side: {k: statistics.median(r[k] for r in runs) for k in keys}
           for side, runs in got.items()}  # fmt: skip
    out = {
        "rounds": rounds,
        "max_tokens": max_tokens,
        "each": got,  # every request, in order (--json)
        "bare": med["bare"],
        "served": med["served"],
        "decode_ratio": med["served"]["decode_tps"] / med["bare"]["decode_tps"],
        # Each round's served / bare: a drift of the machine's load over the run moves
        # both of a round's requests, not the ratio of their medians alone.
        "pair_ratio": statistics.median(
            s["decode_tps"] / b["decode_tps"]
            for b, s in zip(got["bare"], got["served"], strict=True)
        ),
        "ttft_delta_ms": (med["served"]["ttft_s"] - med["bare"]["ttft_s"]) * 1000,
        # The front's CPU per token it relayed: time the engine's threads lose when
        # the cores are all the engine's.
        "front_us_per_token": per_token_us(cpu["served"], got["served"]),
    }
    if views:
        out["engine_ratio"] = med["served"]["engine_tps"] / max(1e-9, med["bare"]["engine_tps"])
        out["param_diffs"] = param_differences(views["bare"].slot_params(),
                                               views["served"].slot_params())  # fmt: skip
    return out


def fairness_words(unlike: list[str], runs: list[dict[str, Any]]) -> str:
    """The sentence on what differed between the two engines besides the front: their
    processes (:func:`serveprobe.differences`) and the sampling parameters their slots ran
    with (``/slots``), or that nothing did."""
    params = sorted({d for r in runs for d in r.get("param_diffs", [])})
    words = ("Both engines: the same binary, flags, environment, nice, scheduling policy and "
             "CPUs, each in its own session (serve's supervisor starts its engine in one; the "
             "bare one is started so too: with the kernel's autogroup a session is a CPU "
             "scheduling group)")  # fmt: skip
    if unlike:
        words = "The two engines' processes differ: " + "; ".join(unlike)
    words += ("; their slots ran the same sampling parameters (`/slots`)." if not params
              else "; their slots' sampling parameters differ (`/slots`): " + "; ".join(params)
              + ".")  # fmt: skip
    return words


def start_floor(bare: str, loop: str) -> tuple[Any, str]:
    """``benchmarks/floor_relay.py`` in front of the bare engine, on ``loop``: the CPU
    any Python relay spends per token, for the front's figure to be read against."""
    port = free_port()
    upstream = bare.rsplit(":", 1)[1]
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("floor_relay.py")),
                             str(port), upstream, "--loop", loop])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(url)
    return proc, url


def start_asgi_floor(bare: str) -> tuple[Any, str]:
    """``benchmarks/asgi_floor.py`` in front of the bare engine: what uvicorn on the
    front's HTTP stack costs per token with no framework or guard above ASGI."""
    port = free_port()
    upstream = bare.rsplit(":", 1)[1]
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("asgi_floor.py")),
                             str(port), upstream])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(url)
    return proc, url


def floor_cpu(
    sides: dict[str, tuple[str, int]], rounds: int, max_tokens: int
) -> dict[str, Any]:  # fmt: skip
    """CPU per relayed token of the floor relay, the front (and the front on its fallback
    stack, when a side), the same streamed completions alternating request by request."""
    got, cpu = alternate(sides, rounds, max_tokens, label="floor")
    us = {side: per_token_us(cpu[side], got[side]) for side in got}
    return {"rounds": rounds, "floor_us": us["floor"], "served_us": us["served"],
            "fallback_us": us.get("fallback"), "asgi_us": us.get("asgi"),
            "ratio": us["served"] / max(1e-9, us["floor"])}  # fmt: skip


def idle_cpu_us_per_s(pid: int, seconds: float = 5.0) -> float:
    """A process's CPU per second at rest (nothing in flight): its timers and polls."""
    before = cpu_s(pid)
    time.sleep(seconds)
    return (cpu_s(pid) - before) * 1e6 / seconds


def concurrent_phase(url: str, clients: int, per_client: int, max_tokens: int) -> float:
    """Aggregate generated tokens per second with ``clients`` streams at once."""
    tokens = [0] * clients
    errors: list[BaseException] = []
    barrier = threading.Barrier(clients)

    def run(k: int) -> None:
        try:
            with httpx.Client(timeout=600) as client:
                barrier.wait(60)
                for j in range(per_client):
                    prompt = PROMPTS[(k + j) % len(PROMPTS)] + f" (client {k}, {j})"
                    tokens[k] += int(stream_once(client, url, prompt, max_tokens)["tokens"])
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]}")
    return sum(tokens) / (time.perf_counter() - started)


def concurrency(bare: str, served: str, phases: int, max_tokens: int) -> dict[str, Any]:
    got: dict[str, list[float]] = {"bare": [], "served": []}
    for i in range(phases):
        order = [("bare", bare), ("served", served)] if i % 2 == 0 else [
            ("served", served), ("bare", bare)]  # fmt: skip
        for side, url in order:
            got[side].append(concurrent_phase(url, 4, 2, max_tokens))
    med = {side: statistics.median(v) for side, v in got.items()}
    return {"phases": phases, "bare_tps": med["bare"], "served_tps": med["served"],
            "ratio": med["served"] / med["bare"]}  # fmt: skip


def start_pair(
    args: argparse.Namespace, n_ctx: int, slots: int, tmp: Path, procs: list[Any]
) -> tuple[str, str, Any, Any, list[str]]:  # fmt: skip
    """(bare url, served url, bare process, served process, the served engine's argv).
    Serve starts first; the bare engine takes its engine's command line and environment
    (with offload, serve runs this host's plan with the Vulkan device)."""
    plan = offload_plan(args, tmp) if args.gpu_layers is not None else None
    served_p, served = start_served(args.model, n_ctx, args.threads, slots, tmp,
                                    args.llama_server, plan)  # fmt: skip
    procs.append(served_p)
    argv = engine_cmdline(served)
    bare_p, bare = start_bare(argv, environ(engine_pid_of(served)))
    procs.append(bare_p)
    return bare, served, bare_p, served_p, argv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded model)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--phases", type=int, default=4, help="4-client phases (0: none)")
    ap.add_argument(
        "--routes",
        default="responses,messages",
        help="other routes measured one stream at a time (comma-separated; '' none)",
    )
    ap.add_argument("--llama-server", default=None, help="the engine binary of both sides")
    ap.add_argument("--gpu-layers", type=int, default=None,
                    help="offload: serve a plan with this many layers on the Vulkan device; "
                    "the bare engine gets the served engine's command line")  # fmt: skip
    ap.add_argument("--kv-offload", choices=("on", "off"), default="on")
    ap.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the floor relay's CPU per token (benchmarks/floor_relay.py)",
    )
    ap.add_argument(
        "--floor-loop",
        choices=("uvloop", "asyncio"),
        default=default_loop(),
        help="the floor relay's event loop (default: the front's, %(default)s)",
    )
    ap.add_argument(
        "--fallback-stack",
        action="store_true",
        help="with the floor, also a front on its fallback HTTP stack (h11 on asyncio)",
    )
    ap.add_argument(
        "--asgi-floor",
        action="store_true",
        help="with the floor, also benchmarks/asgi_floor.py (uvicorn on the front's stack, "
        "nothing above ASGI)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write every request's figures")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--board", action="store_true",
                    help="a board of two models under one serve --plan: each model's decode "
                    "against its own bare llama-server (benchmarks/board_overhead.py)")  # fmt: skip
    args = ap.parse_args()
    if args.board:
        from board_overhead import run_board

        return run_board(args)
    args.kv_offload = args.kv_offload == "on"
    if args.model is None:
        from slmguard import paths
        from slmguard.default_model import ensure_default_model

        args.model = str(ensure_default_model(paths.model_dir()))
    tmp = Path(tempfile.mkdtemp(prefix="slmguard-bench-"))
    t0, load0 = time.monotonic(), load_average()
    procs: list[Any] = []
    conc: dict[str, Any] | None = None
    floor: dict[str, Any] | None = None
    try:
        bare, served, bare_p, served_p, argv = start_pair(args, args.n_ctx, 1, tmp, procs)
        idle_us = idle_cpu_us_per_s(served_p.pid)
        unlike = differences(bare_p.pid, engine_pid_of(served))
        views = {"bare": EngineView(url=bare), "served": EngineView(argv=argv)}
        single = single_stream(bare, served, served_p.pid, args.rounds, args.max_tokens,
                               views=views)  # fmt: skip
        others = {
            route: single_stream(
                bare, served, served_p.pid, args.rounds, args.max_tokens, route, views=views
            )
            for route in filter(None, args.routes.split(","))
        }
        if not args.no_floor:
            floor_p, floor_url = start_floor(bare, args.floor_loop)
            procs.append(floor_p)
            sides = {"floor": (floor_url, floor_p.pid), "served": (served, served_p.pid)}
            if args.fallback_stack:
                fallback_p, fallback_url = start_fallback(args, tmp)
                procs.append(fallback_p)
                sides["fallback"] = (fallback_url, fallback_p.pid)
            if args.asgi_floor:
                asgi_p, asgi_url = start_asgi_floor(bare)
                procs.append(asgi_p)
                sides["asgi"] = (asgi_url, asgi_p.pid)
            floor = floor_cpu(sides, args.rounds, args.max_tokens)
        engine = engine_pid_of(served)
        memory = {
            "bare": status_bytes(bare_p.pid),
            "front": status_bytes(served_p.pid),
            "engine": status_bytes(engine),
        }
        for p in procs:
            p.terminate()
            p.wait(30)
        procs.clear()
        if args.phases > 0:
            # Four slots each, n_ctx x 4 so every slot keeps the same context.
            bare, served, _, _, _ = start_pair(args, args.n_ctx * 4, 4, tmp, procs)
            conc = concurrency(bare, served, args.phases, args.max_tokens)
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
    from slmguard.serve.runner import stack_name

    elapsed = time.monotonic() - t0
    mib = 1 << 20
    anon_service = memory["front"]["RssAnon"] + memory["engine"]["RssAnon"]
    section, offload = SECTION, ""
    if args.gpu_layers is not None:
        section, offload = offload_words(args, argv)
    lines = [
        section,
        "",
        f"`benchmarks/serve_overhead.py`, {datetime.date.today()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, {args.threads} engine threads, model {Path(args.model).name}, "
        f"n_ctx {args.n_ctx} per slot, {args.max_tokens} tokens a request, greedy; "
        f"took {elapsed:.0f} s (load average {load0} at the start, {load_average()} at the end, "
        "1/5/15 min); "
        f"the front's HTTP: {stack_name()}." + offload,
        "",
        "| | bare llama-server | slmguard serve | served / bare |",
        "|---|---|---|---|",
        f"| decode, one stream (median tok/s, {single['rounds']} requests a side, alternating) "
        f"| {single['bare']['decode_tps']:.1f} | {single['served']['decode_tps']:.1f} | "
        f"{single['decode_ratio']:.3f} (goal >= 0.98) |",
        f"| decode, each round's served / bare (median of {single['rounds']}) | | | "
        f"{single['pair_ratio']:.3f} |",
        f"| the engines' own decode over the same requests (median tok/s, llama.cpp's "
        f"`/metrics`) | {single['bare']['engine_tps']:.1f} | "
        f"{single['served']['engine_tps']:.1f} | {single['engine_ratio']:.3f} |",
        f"| time to first token (median ms) | {single['bare']['ttft_s'] * 1000:.1f} | "
        f"{single['served']['ttft_s'] * 1000:.1f} | "
        f"{single['ttft_delta_ms']:+.1f} ms (goal <= +5) |",
        *(
            [f"| 4 clients at once, -np 4 (aggregate tok/s, median of {conc['phases']} phases) | "
             f"{conc['bare_tps']:.1f} | {conc['served_tps']:.1f} | {conc['ratio']:.3f} "
             "(goal >= 0.95) |"]
            if conc is not None else []
        ),
        f"| resident anonymous memory after the runs (MiB) | {memory['bare']['RssAnon'] / mib:.1f} "
        f"| front {memory['front']['RssAnon'] / mib:.1f} + engine "
        f"{memory['engine']['RssAnon'] / mib:.1f} = {anon_service / mib:.1f} | "
        f"{(anon_service - memory['bare']['RssAnon']) / mib:+.1f} MiB (goal <= +45) |",
        *(
            f"| `{ROUTES[r][0]}`, one stream: decode (median tok/s) / first token (median ms) | "
            f"{o['bare']['decode_tps']:.1f} / {o['bare']['ttft_s'] * 1000:.1f} | "
            f"{o['served']['decode_tps']:.1f} / {o['served']['ttft_s'] * 1000:.1f} | "
            f"{o['decode_ratio']:.3f} / {o['ttft_delta_ms']:+.1f} ms (goals >= 0.98, <= +5) |"
            for r, o in others.items()
        ),
        f"| front process RSS (MiB) | | {memory['front']['VmRSS'] / mib:.1f} | (goal <= 60) |",
        f"| front CPU per relayed token (us, its threads' time on a CPU over the served "
        f"requests, /proc/PID/task/*/schedstat) | | {single['front_us_per_token']:.0f} | "
        "(goal <= 300) |",
        f"| front CPU at rest (us per second, nothing in flight) | | {idle_us:.0f} | |",
        *(
            ["| CPU per relayed token (us), the same requests alternating: "
             f"`benchmarks/floor_relay.py` (a raw relay on {args.floor_loop} before the bare "
             "engine) / "
             f"the front ({floor['rounds']} requests a side) | {floor['floor_us']:.0f} | "
             f"{floor['served_us']:.0f} | {floor['ratio']:.2f}x the floor |"]
            if floor is not None else []
        ),
        *(
            ["| the same requests, the front on its fallback stack (h11 on asyncio's loop, "
             "uvloop and httptools unimportable) / the front | "
             f"{floor['fallback_us']:.0f} | {floor['served_us']:.0f} | "
             f"{floor['served_us'] / max(1e-9, floor['fallback_us']):.2f}x |"]
            if floor is not None and floor["fallback_us"] is not None else []
        ),
        *(
            ["| the same requests, `benchmarks/asgi_floor.py` (uvicorn on the front's stack, "
             "nothing above ASGI) / the front | "
             f"{floor['asgi_us']:.0f} | {floor['served_us']:.0f} | "
             f"{floor['served_us'] / max(1e-9, floor['asgi_us']):.2f}x |"]
            if floor is not None and floor["asgi_us"] is not None else []
        ),
        "",
        fairness_words(unlike, [single, *others.values()]),
        *(
            ["", "Four clients on `-np 4` give bare llama-server "
             f"{conc['bare_tps'] / single['bare']['decode_tps']:.2f}x its one-stream decode "
             "speed."]
            if conc is not None else []
        ),
    ]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"one_stream": single, "routes": others,
                                         "concurrency": conc, "floor": floor, "memory": memory,
                                         "idle_us_per_s": idle_us,
                                         "engine_argv": argv}, indent=1))  # fmt: skip
    if args.write_results:
        write_section(section, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
