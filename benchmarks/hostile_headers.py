"""What a crafted GGUF header costs the verbs that read it: peak RSS, time, exit code.

Writes small GGUF files whose headers lie (``tests/ggufcraft.py``): a block
count of 10^9 and 10^12, negative head counts, a zero context, arrays nested
deep, a key count and a string length far beyond the file, a vocabulary of
16 million empty strings; plus a FIFO. Runs ``slmguard plan --model FILE
--board rpi5-8g --json`` on each as a child process with a wall-clock cap
(``--cap-s``, default 20 s) and reports the child's peak RSS
(``ru_maxrss`` from ``wait4``), its run time, its exit code and the line of
its stderr that says why. ``--before-src DIR`` also runs another checkout's
code (``PYTHONPATH=DIR``), to measure the code before a change.

Usage (writes nothing unless --write-results):
    .venv/bin/python benchmarks/hostile_headers.py
    .venv/bin/python benchmarks/hostile_headers.py --before-src /work/main/src --write-results
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from results_md import write_section

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from ggufcraft import gguf_bytes, minimal_kv, minimal_tensors, nested_array  # noqa: E402

SECTION = "## hostile headers"


def big_vocab(path: Path, n: int) -> Path:
    """A model whose vocabulary is ``n`` empty strings, written in pieces so this
    process stays small (a child's ru_maxrss starts from its parent's at fork)."""
    t = minimal_tensors()
    kv = [*minimal_kv()[:-1], ("tokenizer.ggml.tokens", "array", ("str", []))]
    head = bytearray(gguf_bytes(kv, (), n_tensors=len(t), data=False))
    head[-8:] = struct.pack("<Q", n)  # the array's length, written last
    table = gguf_bytes(kv, t)[len(gguf_bytes(kv, (), n_tensors=len(t), data=False)) :]
    with path.open("wb") as f:
        f.write(head)
        zeros = b"\0" * (8 << 20)
        left = 8 * n
        while left:
            f.write(zeros[: min(left, len(zeros))])
            left -= min(left, len(zeros))
        f.write(table)  # 8 * n is a multiple of the alignment: same padding
    return path


def cases(d: Path) -> dict[str, Callable[[], Path]]:
    def file(name: str, data: bytes) -> Path:
        (d / name).write_bytes(data)
        return d / name

    def fifo() -> Path:
        p = d / "fifo.gguf"
        if not p.exists():
            os.mkfifo(p)
        return p

    t = minimal_tensors()
    return {
        "block_count 10^9": lambda: file(
            "l9.gguf", gguf_bytes(minimal_kv(block_count=("u64", 10**9)), t)
        ),
        "gemma3 block_count 10^9": lambda: file(
            "g9.gguf",
            gguf_bytes(
                [
                    *minimal_kv("gemma3", block_count=("u64", 10**9)),
                    ("gemma3.attention.sliding_window", "u32", 512),
                ],
                t,
            ),
        ),
        "block_count 10^12": lambda: file(
            "l12.gguf", gguf_bytes(minimal_kv(block_count=("u64", 10**12)), t)
        ),
        "head_count -4": lambda: file(
            "hneg.gguf", gguf_bytes(minimal_kv(attention__head_count=("i32", -4)), t)
        ),
        "context_length 0": lambda: file(
            "ctx0.gguf", gguf_bytes(minimal_kv(context_length=("u32", 0)), t)
        ),
        "arrays nested 10,000 deep": lambda: file(
            "deep.gguf", gguf_bytes([*minimal_kv(), ("deep.key", "array", nested_array(10_000))], t)
        ),
        "key count 2^40": lambda: file("nkv.gguf", gguf_bytes(minimal_kv(), t, n_kv=1 << 40)),
        "16M empty vocabulary strings": lambda: big_vocab(d / "vocab.gguf", 1 << 24),
        "FIFO": fifo,
    }


AS_LIMIT_BYTES = 3 << 30  # a runaway child stops here (MemoryError) instead of hurting the host


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT_BYTES, AS_LIMIT_BYTES))


def run_one(python: str, src: str | None, path: Path, cap_s: float) -> tuple[int, float, str, int]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    argv = [python, "-c", "from slmguard.cli import main; main()", "plan", "--model", str(path),
            "--board", "rpi5-8g", "--json"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        preexec_fn=_limit_memory,
    )
    assert proc.stderr is not None
    os.set_blocking(proc.stderr.fileno(), False)
    err = b""
    code = None
    while code is None:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        chunk = proc.stderr.read() or b""
        err += chunk[:4096]
        if pid:
            code = os.waitstatus_to_exitcode(status)
            rss_kib = usage.ru_maxrss
            break
        if time.monotonic() - start > cap_s:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            code = -9
            rss_kib = usage.ru_maxrss
            break
        time.sleep(0.05)
    proc.returncode = code
    elapsed = time.monotonic() - start
    lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
    first = lines[-1] if code == 1 and lines else (lines[0] if lines else "")
    return code, elapsed, first[:110], rss_kib


def table(python: str, src: str | None, cap_s: float) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in cases(Path(tmp)).items():
            code, elapsed, first, rss = run_one(python, src, make(), cap_s)
            shown = "killed at cap" if code == -9 else str(code)
            rows.append(f"| {name} | {shown} | {elapsed:.2f} | {rss / 1024:.0f} | `{first}` |")
            print(rows[-1], flush=True)
    return ["| header | exit | s | peak RSS MiB | stderr |", "|---|---|---|---|---|", *rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument(
        "--before-src", default=None, help="also run this checkout's src (the code before)"
    )
    ap.add_argument("--cap-s", type=float, default=20.0)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    out = [
        SECTION,
        "",
        f"`benchmarks/hostile_headers.py` on {datetime.date.today().isoformat()}: `slmguard plan "
        "--model FILE --board rpi5-8g --json` on crafted headers (`tests/ggufcraft.py`), one "
        f"child each, killed after {args.cap_s:g} s, address space capped at "
        f"{AS_LIMIT_BYTES >> 30} GiB (RLIMIT_AS); peak RSS is the child's ru_maxrss (the "
        "interpreter with gguf and numpy imported is about 40 MiB of it).",
        "",
    ]
    if args.before_src:
        print(f"before ({args.before_src}):")
        out += [f"Before (`--before-src {args.before_src}`):", "",
                *table(args.python, args.before_src, args.cap_s), ""]  # fmt: skip
        print("this tree:")
    out += ["This tree:", "", *table(args.python, None, args.cap_s)]
    if args.write_results:
        write_section(SECTION, "\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
