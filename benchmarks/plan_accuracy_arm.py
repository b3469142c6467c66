"""How close `slmguard plan`'s board budgets are to the aarch64 engine, under qemu-user.

`make arm` cross-builds llama-server for aarch64 (engine/build-arm.sh) per CPU
profile; this script starts each build under qemu-aarch64 with a ``-cpu`` model
matching the boards, with the exact command line `serve` uses
(:func:`slmguard.serve.llamaserver.engine_argv`) and the engine settings of
`slmguard plan --board B` for the model, loads the model, runs one completion
whose prompt fills one full ubatch, and compares what it measured with the
plan's budget for that board.

What is measured, and why this way: under qemu-user the guest and the
translator share one process, so /proc/PID/status counts qemu's own memory
too. The sampler reads /proc/PID/smaps instead and leaves out what is
qemu's: its binary's mappings, its ``[heap]`` (the guest's brk is emulated
with anonymous mappings, so the host heap is the translator's), and its
translated-code buffer (the one anonymous mapping with execute permission:
guest pages are never mapped executable on the host). What remains is the
guest's: its anonymous memory and its file pages (the mapped GGUF and its
libraries). The residue qemu allocates through malloc's mmap path cannot be
told apart; the baseline run (a guest that only prints its version) bounds
it. The engine's own buffer reports (its load log: CPU_REPACK and CPU_Mapped
model buffers, KV, compute, output) are exact and do not depend on emulation,
so the weights, KV and compute cells compare those; the RSS columns compare
the guest's resident memory.

Usage (writes nothing unless --write-results):
    .venv/bin/python benchmarks/plan_accuracy_arm.py --build dotprod=DIR \\
        --build armv8=DIR --build i8mm=DIR [--write-results] [--json cells.json]
    .venv/bin/python benchmarks/plan_accuracy_arm.py --from-json cells.json --write-results

--from-json re-predicts cells measured earlier with the current budget (the
measurements do not change when the budget's rules do).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from results_md import write_section

SECTION = "## plan accuracy on aarch64 (emulated)"
SYSROOT = Path("/usr/aarch64-linux-gnu")
QEMU = "qemu-aarch64-static"
MODEL = Path("/var/lib/slmguard/models/gemma-3-270m-q4_k_m.gguf")
MiB = 1 << 20


@dataclass(frozen=True)
class CpuProfile:
    """One emulated CPU: which build, which qemu model, which boards it stands for."""

    name: str
    build: str  # key of --build
    qemu_cpu: str
    isa: str  # the budget's REPACK_RULES key the plan would use for this CPU
    boards: tuple[str, ...]
    what: str


PROFILES = (
    CpuProfile(
        "a76-dotprod",
        "dotprod",
        "cortex-a76",
        "arm_dotprod",
        ("rk3588-4g", "rk3588-8g", "rpi5-8g"),
        "Cortex-A76 (RK3588 big cores, Pi 5): dotprod, fp16, no i8mm",
    ),
    CpuProfile(
        "n1-dotprod",
        "dotprod",
        "neoverse-n1",
        "arm_dotprod",
        ("jetson-orin-nano-8g",),
        "Neoverse-N1 (A76-class, stands in for Orin's Cortex-A78AE: v8.2 dotprod, no i8mm)",
    ),
    CpuProfile(
        "a72-armv8",
        "armv8",
        "cortex-a72",
        "none",
        ("rk3588-4g",),
        "Cortex-A72 running a plain armv8-a build (a distribution's generic llama.cpp)",
    ),
    CpuProfile(
        "max-i8mm",
        "i8mm",
        "max",
        "arm_i8mm",
        ("rk3588-4g",),
        "qemu max (i8mm, SVE, bf16) running an armv8.6-a+i8mm build (Armv9 boards)",
    ),
)


@dataclass
class Peak:
    """Peak guest memory (bytes) and what qemu held beside it at that time."""

    anon: int = 0
    file: int = 0
    qemu_anon: int = 0
    qemu_file: int = 0
    samples: int = 0


def classify_smaps(text: str, qemu_path: str) -> dict[str, int]:
    """Guest and qemu anonymous/file resident bytes from /proc/PID/smaps (pure)."""
    out = {"anon": 0, "file": 0, "qemu_anon": 0, "qemu_file": 0}
    owner = "guest"
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            perms = head[1]
            name = head[5] if len(head) > 5 else ""
            is_qemu = (
                name == qemu_path
                or name == "[heap]"
                or name == "[stack]"  # the host thread's stack; the guest's is a plain mapping
                or (not name and "x" in perms)  # the translated-code buffer
            )
            owner = "qemu" if is_qemu else "guest"
            continue
        key, _, value = line.partition(":")
        if key not in ("Anonymous", "Rss"):
            continue
        kib = int(value.split()[0]) * 1024
        prefix = "qemu_" if owner == "qemu" else ""
        if key == "Anonymous":
            out[prefix + "anon"] += kib
            out[prefix + "file"] -= kib  # Rss counts both; file = Rss - Anonymous
        else:
            out[prefix + "file"] += kib
    return out


def _sample(pid: int, qemu_path: str, peak: Peak, stop: threading.Event) -> None:
    path = f"/proc/{pid}/smaps"
    while not stop.is_set():
        try:
            with open(path) as f:
                got = classify_smaps(f.read(), qemu_path)
        except (OSError, ValueError):
            got = None
        if got is not None:
            peak.samples += 1
            if got["anon"] > peak.anon:
                peak.anon, peak.qemu_anon = got["anon"], got["qemu_anon"]
            if got["file"] > peak.file:
                peak.file, peak.qemu_file = got["file"], got["qemu_file"]
        stop.wait(0.05)


_LOG = {
    "repack_mib": r"CPU_REPACK model buffer size =\s+([\d.]+) MiB",
    "mapped_mib": r"CPU_Mapped model buffer size =\s+([\d.]+) MiB",
    "kv_mib": r"CPU KV buffer size =\s+([\d.]+) MiB",
    "compute_mib": r"CPU compute buffer size =\s+([\d.]+) MiB",
    "output_mib": r"CPU\s+output buffer size =\s+([\d.]+) MiB",
}


def parse_log(text: str) -> dict[str, Any]:
    """The engine's buffer reports (MiB) and the CPU features it says it was built for."""
    out: dict[str, Any] = {}
    for key, pattern in _LOG.items():
        found = [float(x) for x in re.findall(pattern, text)]
        if key == "compute_mib":
            found = found[-1:]  # the last reservation is the one kept
        out[key] = round(sum(found), 2)
    sysinfo = re.search(r"system_info:.*", text)
    out["system_info"] = sysinfo.group(0)[:400] if sysinfo else ""
    out["features"] = sorted(set(re.findall(r"\b([A-Z0-9_]+) = 1\b", out["system_info"])))
    return out


def _engine_config(plan: Any, model: Path) -> Any:
    from slmguard.serve.llamaserver import EngineConfig

    e = plan.engine
    return EngineConfig(
        model_path=str(model),
        n_ctx=e.n_ctx,
        n_batch=e.n_batch,
        n_ubatch=e.n_ubatch,
        n_threads=e.n_threads,
        kv_type=e.kv_type,
        use_mmap=e.use_mmap,
        use_mlock=e.use_mlock,
        swa_full=e.swa_full,
        n_parallel=e.n_parallel,
        kv_unified=e.kv_unified,
        flash_attn=e.flash_attn,
        cache_ram_mib=e.cache_ram_mib,
    )


def _client(sock: Path, timeout_s: float) -> Any:
    import httpx

    return httpx.Client(
        transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine", timeout=timeout_s
    )


def run_engine(
    binary: Path,
    qemu_cpu: str,
    cfg: Any,
    fill: int,
    load_timeout_s: float,
    keep_log: Path | None = None,
) -> dict[str, Any]:
    """Start the emulated engine, load, fill one prompt, stop; return what was seen."""
    from slmguard.serve.llamaserver import engine_argv

    qemu_path = subprocess.run(
        ["sh", "-c", f"command -v {QEMU}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="slmguard-arm-") as tmp:
        sock, keyfile = Path(tmp) / "engine.sock", Path(tmp) / "key"
        key = secrets.token_hex(16)
        keyfile.write_text(key)
        keyfile.chmod(0o600)
        # serve's command line, plus log verbosity 4: llama.cpp's own load log (the
        # buffer sizes) is INFO, which llama-server prints only from verbosity 4 on.
        serve_argv = engine_argv(binary, cfg, socket_path=sock, api_key_file=keyfile, alias="bench")
        argv = [qemu_path, "-cpu", qemu_cpu, "-L", str(SYSROOT), *serve_argv, "--verbosity", "4"]
        log = open(Path(tmp) / "engine.log", "w+")  # noqa: SIM115 (read back below)
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        peak, stop = Peak(), threading.Event()
        sampler = threading.Thread(target=_sample, args=(proc.pid, qemu_path, peak, stop))
        sampler.start()
        phases: dict[str, Any] = {}
        try:
            with _client(sock, 30.0) as c:
                while True:
                    if proc.poll() is not None:
                        log.seek(0)
                        raise RuntimeError(f"engine exited {proc.returncode}: {log.read()[-3000:]}")
                    if time.monotonic() - started > load_timeout_s:
                        raise RuntimeError(f"engine not ready after {load_timeout_s:.0f} s")
                    try:
                        if c.get("/health").status_code == 200:
                            break
                    except Exception:  # not listening yet
                        pass
                    time.sleep(1.0)
                phases["loaded"] = {"t_s": round(time.monotonic() - started, 1), **asdict(peak)}
                auth = {"Authorization": f"Bearer {key}"}
                text = "The quick brown fox jumps over the lazy dog while the river runs. " * 40
                unit = c.post("/tokenize", json={"content": text}, headers=auth).json()["tokens"]
                tokens = (unit * (fill // len(unit) + 1))[:fill]
                t0 = time.monotonic()
                with _client(sock, 3600.0) as slow:
                    r = slow.post(
                        "/completion",
                        json={"prompt": tokens, "n_predict": 2, "temperature": 0.0},
                        headers=auth,
                    )
                r.raise_for_status()
                body = r.json()
                phases["filled"] = {
                    "fill_tokens": body.get("tokens_evaluated", len(tokens)),
                    "fill_s": round(time.monotonic() - t0, 1),
                    **asdict(peak),
                }
        finally:
            stop.set()
            sampler.join()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.seek(0)
            text_log = log.read()
            log.close()
            if keep_log is not None:
                keep_log.write_text(text_log + f"\n[exit {proc.returncode}]\n")
    return {"phases": phases, "peak": asdict(peak), "log": parse_log(text_log)}


def qemu_baseline(binary: Path, qemu_cpu: str) -> dict[str, int]:
    """What the classification leaves to the guest of a run that loads nothing."""
    qemu_path = subprocess.run(
        ["sh", "-c", f"command -v {QEMU}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    proc = subprocess.Popen(
        [qemu_path, "-cpu", qemu_cpu, "-L", str(SYSROOT), str(binary), "--version"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    peak, stop = Peak(), threading.Event()
    sampler = threading.Thread(target=_sample, args=(proc.pid, qemu_path, peak, stop))
    sampler.start()
    proc.wait()
    stop.set()
    sampler.join()
    return asdict(peak)


def predict(model: Path, engine: dict[str, Any], isa: str, fill: int) -> Any:
    """The budget for the engine settings a cell ran with, this ISA and the tokens filled."""
    from slmguard.plan.budget import compute_budget
    from slmguard.plan.modelfacts import read_model_facts
    from slmguard.plan.parts import BudgetInput
    from slmguard.plan.schema import BudgetBoard, EngineSettings

    settings = EngineSettings(
        n_ctx=engine["n_ctx"],
        n_batch=engine["n_batch"],
        n_ubatch=engine["n_ubatch"],
        n_threads=engine["n_threads"],
        n_parallel=engine.get("n_parallel", 1),
        kv_unified=engine.get("kv_unified", False),
        kv_type=engine["kv_type"],
        flash_attn=engine.get("flash_attn", False),
        swa_full=engine["swa_full"],
        cache_ram_mib=engine.get("cache_ram_mib", 0),
        use_mmap=engine.get("use_mmap", True),
        use_mlock=engine["use_mlock"],
    )
    # what the emulated engine saw as its CPUs: this host's
    board = BudgetBoard(isa=isa, n_cpus=os.cpu_count() or 1)
    return compute_budget(
        BudgetInput(read_model_facts(model), settings, board, front_process=False, fill_tokens=fill)
    )


def repack_by_type(model: Path) -> dict[str, int]:
    """Bytes of 2-D weights (not token_embd) per ggml type with rows divisible by 4 and 8."""
    from slmguard.plan.modelfacts import read_model_facts

    out: dict[str, int] = {}
    for t in read_model_facts(model).tensors:
        if len(t.shape) != 2 or t.name == "token_embd.weight":
            continue
        for mult in (4, 8):
            if t.shape[1] % mult == 0:
                out[f"{t.type_name}%{mult}"] = out.get(f"{t.type_name}%{mult}", 0) + t.n_bytes
    return out


@dataclass
class Cell:
    profile: str
    qemu_cpu: str
    build: str
    boards: tuple[str, ...]
    engine: dict[str, Any]
    measured: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


def _plan(model: Path, board: str) -> Any:
    from slmguard.plan.inputs import plan_for

    plan, _ = plan_for(Path("/"), model=model, board=board)
    return plan


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def _err(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas * 100:+.1f}%" if meas else "n/a"


def rows_for(cell: Cell, model: Path) -> list[dict[str, Any]]:
    """One comparison row per board the cell stands for."""
    rows = []
    m = cell.measured
    log, peak = m["log"], m["peak"]
    fill = m["phases"]["filled"]["fill_tokens"]
    for board in cell.boards:
        profile = next(p for p in PROFILES if p.name == cell.profile)
        b = predict(model, cell.engine, profile.isa, fill)

        def part(name: str, budget: Any = b) -> int:
            p = budget.part(name)
            return p.bytes if p else 0

        rows.append(
            {
                "profile": cell.profile,
                "board": board,
                "isa": profile.isa,
                "repack": (part("weights_repacked"), log["repack_mib"] * MiB),
                # CPU_Mapped spans every tensor's file range, repacked ones included.
                "mapped": (
                    part("weights_mapped") + part("weights_mapped_cold"),
                    log["mapped_mib"] * MiB,
                ),
                "kv": (part("kv_cache"), log["kv_mib"] * MiB),
                "compute_reserved": (b.compute_reserved_bytes, log["compute_mib"] * MiB),
                "anon": (b.engine_anon_peak_bytes, peak["anon"]),
                "file": (b.engine_file_bytes, peak["file"]),
                "fill": fill,
            }
        )
    return rows


COLUMNS = ("repack", "mapped", "kv", "compute_reserved", "anon", "file")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build", action="append", default=[], help="PROFILE=DIR of a build")
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--fill", type=int, default=None, help="prompt tokens (default: n_ubatch)")
    ap.add_argument("--profile", action="append", default=None, help="only these CPU profiles")
    ap.add_argument("--load-timeout", type=float, default=1800.0)
    ap.add_argument("--logs", type=Path, default=None, help="keep each engine log here")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also dump the raw cells here")
    ap.add_argument("--from-json", type=Path, default=None, help="re-predict earlier cells")
    args = ap.parse_args(argv)
    builds = dict(b.split("=", 1) for b in args.build)
    cells: list[Cell] = []
    if args.from_json:
        for raw in json.loads(args.from_json.read_text()):
            raw["boards"] = tuple(raw["boards"])
            cells.append(Cell(**raw))
    else:
        for prof in PROFILES:
            if args.profile and prof.name not in args.profile:
                continue
            if prof.build not in builds:
                print(f"skip {prof.name}: no --build {prof.build}=DIR", file=sys.stderr)
                continue
            binary = Path(builds[prof.build]) / "bin" / "llama-server"
            plan = _plan(args.model, prof.boards[0])
            cfg = _engine_config(plan, args.model)
            fill = args.fill or min(cfg.n_ubatch, cfg.n_ctx - 4)
            t0 = time.monotonic()
            cell = Cell(prof.name, prof.qemu_cpu, prof.build, prof.boards, asdict(cfg))
            cell.baseline = qemu_baseline(binary, prof.qemu_cpu)
            keep = args.logs / f"{prof.name}.log" if args.logs else None
            cell.measured = run_engine(binary, prof.qemu_cpu, cfg, fill, args.load_timeout, keep)
            cell.wall_s = round(time.monotonic() - t0, 1)
            cells.append(cell)
            print(
                f"{prof.name}: {cell.wall_s} s, log {cell.measured['log']}, "
                f"peak {cell.measured['peak']}, baseline {cell.baseline}",
                flush=True,
            )
    rows = [r for c in cells for r in rows_for(c, args.model)]
    for r in rows:
        print(
            f"{r['profile']:<12} {r['board']:<20} "
            + " ".join(f"{k} {_mib(r[k][1])}/{_mib(r[k][0])} ({_err(*r[k])})" for k in COLUMNS)
        )
    if args.json and not args.from_json:
        args.json.write_text(json.dumps([asdict(c) for c in cells], indent=1))
    if args.write_results:
        write_results(cells, rows, args, argv if argv is not None else sys.argv[1:])
    return 0


def write_results(
    cells: list[Cell], rows: list[dict[str, Any]], args: Any, argv: list[str]
) -> None:
    from slmguard.plan.allocation import REPACK_RULES

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = subprocess.run(
        ["git", "log", "-1", "--format=%h %cs", "--", "src/slmguard/plan/allocation.py"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,
    ).stdout.strip()
    by_type = repack_by_type(args.model)
    from slmguard.plan.modelfacts import read_model_facts

    embd = next(
        (t.type_name, t.n_bytes)
        for t in read_model_facts(args.model).tensors
        if t.name == "token_embd.weight"
    )
    e = cells[0].engine if cells else {}
    settings = (
        f"n_ctx {e.get('n_ctx')}, {e.get('n_parallel', 1)} slot(s), n_ubatch {e.get('n_ubatch')}, "
        f"{e.get('kv_type')} KV, flash attention {'on' if e.get('flash_attn') else 'off'}"
    )
    lines = [
        SECTION,
        "",
        f"{'Written' if args.from_json else 'Measured'} {date} on this machine "
        f"({os.cpu_count()} x86-64 CPUs, shared), model `{args.model.name}`, llama-server "
        "cross-built for aarch64 from the pinned llama.cpp (`make arm`), run under "
        "qemu-aarch64 (qemu-user 7.2) with the command line `serve` builds "
        f"(`engine_argv`) and the engine settings recorded in each cell ({settings}).",
        f"Command: `.venv/bin/python benchmarks/plan_accuracy_arm.py {' '.join(argv)}`",
        "",
    ]
    if args.from_json:
        lines += [
            "The cells were measured by runs of this script, one per CPU profile "
            "(`--build B=DIR --profile P --json FILE`), and predicted here from their dumps "
            "with the budget named below; wall times are those runs' (the machine was shared, "
            "so they vary 7x).",
            "",
        ]
    lines += [
        f"Budget compared against: `src/slmguard/plan/allocation.py` as of {head or 'unknown'}.",
        "",
        "CPU profiles (the build decides the repacking: llama.cpp at this version picks "
        "repack layouts from compile-time features, `ggml_cpu_has_dotprod()` is "
        "`__ARM_FEATURE_DOTPROD`, so the qemu CPU only has to run the build):",
        "",
        "| profile | qemu -cpu | build (-march) | stands for | engine says (system_info) | "
        "wall time |",
        "|---|---|---|---|---|---:|",
    ]
    marches = {
        "dotprod": "armv8.2-a+dotprod+fp16",
        "armv8": "armv8-a",
        "i8mm": "armv8.6-a+dotprod+fp16+i8mm",
    }
    for c in cells:
        prof = next(p for p in PROFILES if p.name == c.profile)
        feats = " ".join(c.measured["log"]["features"]) or "n/a"
        lines.append(
            f"| {c.profile} | {c.qemu_cpu} | {c.build} ({marches.get(c.build, '?')}) | "
            f"{prof.what} | {feats} | {c.wall_s:.0f} s |"
        )
    lines += [
        "",
        "Engine buffers (its load log) against the plan's parts, then the guest's peak RSS "
        "(qemu's own mappings left out, see the script's docstring) against the plan's "
        "engine totals. MiB, measured / planned (plan error).",
        "",
        "| profile | board | plan isa | CPU_REPACK | CPU_Mapped | KV | compute (reserved) | "
        "anon peak | file peak | prompt tokens |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells_txt = " | ".join(
            f"{_mib(r[k][1])} / {_mib(r[k][0])} ({_err(*r[k])})"
            for k in ("repack", "mapped", "kv", "compute_reserved", "anon", "file")
        )
        lines.append(f"| {r['profile']} | {r['board']} | {r['isa']} | {cells_txt} | {r['fill']} |")
    lines += [
        "",
        "qemu's share at the guest's anon peak, and the baseline run (`llama-server "
        "--version`, nothing loaded) the classification leaves to the guest:",
        "",
        "| profile | qemu anon at peak | qemu file at peak | baseline guest anon | "
        "baseline guest file | samples |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        p, bl = c.measured["peak"], c.baseline
        lines.append(
            f"| {c.profile} | {_mib(p['qemu_anon'])} | {_mib(p['qemu_file'])} | "
            f"{_mib(bl['anon'])} | {_mib(bl['file'])} | {p['samples']} |"
        )
    lines += [
        "",
        "Repack candidates in this model (2-D weights other than token_embd, bytes by ggml "
        "type and row divisibility): "
        + ", ".join(f"{k} {_mib(v)}" for k, v in sorted(by_type.items()))
        + ". The budget's rules on this branch: "
        + "; ".join(f"{k}: {dict(v)}" for k, v in REPACK_RULES.items() if k.startswith("arm"))
        + f". token_embd ({embd[0]}, {_mib(embd[1])} MiB) has no output.weight beside it "
        "(tied), so it is the output matmul as well.",
        "",
        "Reading the tables: the engine's own buffers (CPU_REPACK, CPU_Mapped, KV) match "
        "the budget exactly on every profile, the compute reservation within 0.1%: a "
        "dotprod or i8mm build repacks Q4_K, Q6_K and Q8_0 here, the tied token embedding "
        "included (it is the output matmul too, and stays mapped for GET_ROWS); a plain "
        "armv8-a build repacks nothing. The compute reservation is the same on every "
        "profile (not an ARM rule). The guest's resident memory is what the RSS columns "
        "compare; their residue (the anon peak a few per cent low, the file peak a few per "
        "cent high) is the server runtime and binary constants, fitted on x86-64. Runs add "
        "`--verbosity 4` to serve's command line (llama.cpp's own load log is printed from "
        "4 on; it changes no allocation).",
        "",
    ]
    write_section(SECTION, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
