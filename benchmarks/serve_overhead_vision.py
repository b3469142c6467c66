"""Decode with an image in the prompt: ``slmguard serve`` against bare llama-server.

Issue 42's goal: decode with an image in the prompt through serve >= 0.98x bare
llama-server with the same projector. One invocation plans the embedded model with the
tiny projector of ``tests/visionmodel.py`` (``plan --mmproj``; random weights: the
answers mean nothing, the work the engine does for an image is real), starts
``slmguard serve --plan`` on it, and then a bare ``llama-server`` with *the served
engine's own command line* (``/proc/PID/cmdline``: ``--mmproj``, ``--no-mmproj-offload``
and every other flag; loopback TCP instead of the socket, no API key), the same
environment (its ``/proc/PID/environ``: ``MALLOC_MMAP_THRESHOLD_`` among it) and a session
of its own, as serve's engine has (``serve_overhead.start_bare``). The client streams
the same chat request to each side, alternating request by request
(``serve_overhead.single_stream``): a text part and one PNG as a data URL, a different
colour each round so no side reuses a cached image. Decode tokens/s = (tokens - 1) /
(last token - first token), medians per side and their ratio; time to first token holds
the image's encoding on both sides. Each engine's own decode over the same requests
(llama.cpp's ``/metrics``) and the sampling parameters its slot ran (``/slots``) are
compared too: what differed between the two sides besides the front.

Usage (prints only, unless --write-results):
    .venv/bin/python benchmarks/serve_overhead_vision.py --rounds 6 --max-tokens 24
"""

from __future__ import annotations

import argparse
import base64
import datetime
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import serve_overhead as so
from results_md import write_section
from serveprobe import EngineView, cmdline, differences, environ

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))
SECTION = "## serve overhead with an image"


def png_url(i: int, side: int = 128) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), ((40 * i) % 256, (90 * i) % 256, 200)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    """A chat request with one image, its colour from the round in the prompt."""
    i = sum(map(ord, prompt))
    content = [{"type": "text", "text": prompt}, {"type": "image_url",
                                                  "image_url": {"url": png_url(i)}}]  # fmt: skip
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def chat_token(chunk: dict[str, Any]) -> bool:
    return bool(chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"))


def start_pair(args: argparse.Namespace, tmp: Path) -> tuple[list[Any], str, str, int, Any]:
    """serve from a plan with the projector, then the bare engine on its command line:
    (processes, bare url, served url, the front's pid, the two engines' views and what
    differs between their processes)."""
    from visionmodel import Projector, write_projector

    mmproj = write_projector(tmp / "mmproj.gguf", Projector())
    plan = tmp / "plan.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")}
    subprocess.run([str(so.SLMGUARD), "plan", "--mmproj", str(mmproj), "--ctx",
                    str(args.n_ctx), "--n-parallel", "1", "--json", "--out", str(plan)],
                   check=True, capture_output=True, env=env, timeout=300)  # fmt: skip
    port = so.free_port()
    served = subprocess.Popen(
        [str(so.SLMGUARD), "serve", "--plan", str(plan), "--port", str(port), "--state-dir",
         str(tmp / "state"), "--no-governor", "--canary-interval-s", "0",
         "--n-threads", str(args.threads)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    procs = [served]
    served_url = f"http://127.0.0.1:{port}"
    so.wait_http(served_url)
    engine = so.engine_pid_of(served_url)
    argv = cmdline(engine)
    bare, bare_url = so.start_bare(argv, environ(engine))
    procs.append(bare)
    views = {"bare": EngineView(url=bare_url), "served": EngineView(argv=argv)}
    return procs, bare_url, served_url, served.pid, (views, differences(bare.pid, engine))


def report(r: dict[str, Any], args: argparse.Namespace, started: str, load0: str) -> str:
    b, s = r["bare"], r["served"]
    return "\n".join([
        SECTION, "",
        f"Measured {started} on this machine ({os.cpu_count()} CPUs, shared: load average "
        f"{load0} at the start, {so.load_average()} at the end, 1/5/15 min), the embedded "
        "Gemma 3 270M with the tiny projector of `tests/visionmodel.py` (16 tokens an image), "
        "one slot, "
        f"`-c {args.n_ctx}`, {args.threads} threads; the bare engine on the served engine's "
        "command line. Each request: streamed `/v1/chat/completions`, a text part and one "
        f"128 x 128 PNG data URL (a new colour each round), {args.max_tokens} tokens, "
        f"{args.rounds} rounds alternating.",
        "Command: `.venv/bin/python benchmarks/serve_overhead_vision.py "
        f"--rounds {args.rounds} --max-tokens {args.max_tokens} --write-results`.", "",
        "| side | decode tok/s (median) | first token, image encoded (median) "
        "| the engine's own decode (median tok/s, `/metrics`) |",
        "|---|---:|---:|---:|",
        f"| bare llama-server | {b['decode_tps']:.2f} | {b['ttft_s'] * 1000:.0f} ms "
        f"| {b['engine_tps']:.2f} |",
        f"| slmguard serve | {s['decode_tps']:.2f} | {s['ttft_s'] * 1000:.0f} ms "
        f"| {s['engine_tps']:.2f} |", "",
        f"Decode served / bare: {r['decode_ratio']:.3f} (medians), {r['pair_ratio']:.3f} "
        f"(median of each round's pair; goal >= 0.98); first token "
        f"{r['ttft_delta_ms']:+.0f} ms; the engines' own decode, served / bare: "
        f"{r['engine_ratio']:.3f}. " + so.fairness_words(r["unlike"], [r]),
    ])  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    so.ROUTES["chat_image"] = ("/v1/chat/completions", chat_body, chat_token)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load0 = so.load_average()
    procs: list[Any] = []
    with tempfile.TemporaryDirectory() as d:
        try:
            procs, bare, served, front, (views, unlike) = start_pair(args, Path(d))
            r = so.single_stream(bare, served, front, args.rounds, args.max_tokens,
                                 route="chat_image", views=views)  # fmt: skip
            r["unlike"] = unlike
        finally:
            for p in reversed(procs):
                p.terminate()
                p.wait(timeout=60)
    r.pop("each")
    print(json.dumps(r, indent=1))
    text = report(r, args, started, load0)
    print(text)
    if args.write_results:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
