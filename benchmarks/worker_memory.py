"""Benchmark the engine worker's memory over many requests, against a bare engine process.

llama-cpp-python leaves reference cycles behind every generation (about 3 MiB
with Gemma 3's 262,144-token vocabulary) that only Python's full collection
frees. The slmguard worker freezes the engine's objects after a load and
collects after each request; a bare ``llama_cpp.Llama`` process does not. This
script runs the same short chat requests through both and reads each
process's RssAnon after 3, 30 and 80 requests, at n_ctx 512 and 4096. In the
bare process it then times the full collection after a request (median of
15), without and with the engine's objects frozen, which is the worker's
per-request cost.

Both sides use the same engine settings (n_batch = n_ubatch = 512, 2
threads, greedy, 16 tokens per request) and the embedded default model. The
served side is the real worker under the real supervisor (socketpair
protocol), without HTTP. Results are written to benchmarks/RESULTS.md,
section ``## worker memory``.

Usage: ``.venv/bin/python benchmarks/worker_memory.py [--no-write]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from results_md import write_section

REPO = Path(__file__).resolve().parent.parent
SECTION = "## worker memory"
CHECKPOINTS = (3, 30, 80)
CONTEXTS = (512, 4096)
PROMPT = "<start_of_turn>user\nSay hi.<end_of_turn>\n<start_of_turn>model\n"
MAX_TOKENS = 16

# The bare side: a plain llama_cpp.Llama with the same settings, in its own process.
BARE = r"""
import gc, json, statistics, sys, time
import llama_cpp
model, n_ctx, prompt, max_tokens, checkpoints = sys.argv[1], int(sys.argv[2]), sys.argv[3], \
    int(sys.argv[4]), [int(c) for c in sys.argv[5].split(",")]
llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=2,
                      n_threads_batch=2, n_gpu_layers=0, verbose=False)
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
out = {"load": anon()}
tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
for i in range(1, max(checkpoints) + 1):
    gen = llm.generate(tokens, temp=0.0, top_k=1)
    for k, _ in enumerate(gen):
        if k + 1 >= max_tokens:
            break
    gen.close()
    if i in checkpoints:
        out[str(i)] = anon()


def collect_ms(rounds=15):
    # One request, then time the full collection the worker runs after it.
    times = []
    for _ in range(rounds):
        gen = llm.generate(tokens, temp=0.0, top_k=1)
        for k, _ in enumerate(gen):
            if k + 1 >= max_tokens:
                break
        gen.close()
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


out["collect_ms"] = collect_ms()
gc.collect()
gc.freeze()  # what the worker does after a load
out["collect_frozen_ms"] = collect_ms()
print(json.dumps(out))
"""


def anon_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


async def served(model: str, n_ctx: int) -> dict[str, int]:
    sys.path.insert(0, str(REPO / "src"))
    from slmguard.serve.protocol import EngineConfig
    from slmguard.serve.supervisor import RestartPolicy, Supervisor

    cfg = EngineConfig(model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=2)
    sup = Supervisor(cfg, RestartPolicy(), fault_log=None)
    await sup.start()
    try:
        if not await sup.wait_ready(180):
            raise RuntimeError("worker did not load")
        assert sup.worker_pid is not None
        out = {"load": anon_bytes(sup.worker_pid)}
        params = {"prompt": PROMPT, "add_bos": True, "special": True, "max_tokens": MAX_TOKENS,
                  "temperature": 0.0}  # fmt: skip
        for i in range(1, max(CHECKPOINTS) + 1):
            gen = sup.open_generation(params)
            while (await gen.next_event())["op"] not in ("done", "error"):
                pass
            gen.close()
            if i in CHECKPOINTS:
                await asyncio.sleep(0.05)  # the worker collects after its last frame
                out[str(i)] = anon_bytes(sup.worker_pid)
        return out
    finally:
        await sup.stop()


def bare(model: str, n_ctx: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", BARE, model, str(n_ctx), PROMPT, str(MAX_TOKENS),
         ",".join(map(str, CHECKPOINTS))],
        capture_output=True, text=True, timeout=900, check=True,
    )  # fmt: skip
    data: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return data


def render(rows: list[dict[str, object]]) -> str:
    mib = 1 << 20
    lines = [SECTION, ""]
    lines.append(
        "`benchmarks/worker_memory.py`, "
        + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        + ": RssAnon of the engine process after N short chat requests (16 tokens each, "
        "greedy, n_batch 512, 2 threads), the slmguard worker (collects each request's "
        "garbage, engine objects frozen after load) against a bare `llama_cpp.Llama` "
        "process with the same settings. MiB."
    )
    lines.append("")
    head = " | ".join(f"after {c}" for c in CHECKPOINTS)
    lines.append(f"| n_ctx | process | after load | {head} | growth load -> {CHECKPOINTS[-1]} |")
    lines.append("|---:|---|---:|" + "---:|" * len(CHECKPOINTS) + "---:|")
    for r in rows:
        for side in ("worker", "bare"):
            v = r[side]
            assert isinstance(v, dict)
            cells = " | ".join(f"{v[str(c)] / mib:.1f}" for c in CHECKPOINTS)
            growth = (v[str(CHECKPOINTS[-1])] - v["load"]) / mib
            name = "slmguard worker" if side == "worker" else "bare llama-cpp-python"
            lines.append(
                f"| {r['n_ctx']} | {name} | {v['load'] / mib:.1f} | {cells} | {growth:+.1f} |"
            )
    lines.append("")
    timings = []
    for r in rows:
        b = r["bare"]
        assert isinstance(b, dict)
        timings.append(
            f"n_ctx {r['n_ctx']}: {b['collect_ms']:.2f} ms, {b['collect_frozen_ms']:.2f} ms "
            "with the engine's objects frozen as the worker does"
        )
    lines.append(
        "A full collection after one request (median of 15, in the bare process): "
        + "; ".join(timings)
        + "."
    )
    lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print, do not edit RESULTS.md")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    model = str(ensure_default_model(paths.model_dir()))
    rows: list[dict[str, object]] = []
    for n_ctx in CONTEXTS:
        print(f"n_ctx {n_ctx}: served worker ...", file=sys.stderr, flush=True)
        worker = asyncio.run(served(model, n_ctx))
        print(f"n_ctx {n_ctx}: bare engine ...", file=sys.stderr, flush=True)
        rows.append({"n_ctx": n_ctx, "worker": worker, "bare": bare(model, n_ctx)})
    section = render(rows)
    print(section)
    if not args.no_write:
        write_section(SECTION, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
