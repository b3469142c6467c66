"""Start the real llama-server exactly as ``serve`` does, and watch its memory.

Shared by ``plan_accuracy.py`` (and the engine tests through it). The command
line is :func:`slmguard.serve.llamaserver.engine_argv` for the given
:class:`~slmguard.serve.llamaserver.EngineConfig`, plus ``--log-verbosity 4``
so that the engine prints its buffer sizes (a logging level only: it changes
no allocation). The child listens on a unix socket in a private temporary
folder with a random API key, as under ``serve``. The binary is started
through a symlink with a private name (:data:`PRIVATE_NAME`, same file) so
that a broad ``pkill llama-server`` elsewhere on a shared machine does not
end a measurement.

What is measured, from outside the process:

* peak ``RssAnon`` / ``RssFile`` / ``VmHWM`` from ``/proc/PID/status``, sampled
  every few milliseconds from the spawn to the end of the fill;
* the commit charge: the sum of the private writable mappings in
  ``/proc/PID/maps`` (what ``vm.overcommit_memory=2`` accounts; the same
  ranges ``/proc/PID/smaps`` lists, read without its per-page counters),
  sampled every 100 ms, peak kept;
* the engine's own buffer reports from its load log (:func:`parse_engine_log`).

No pytest, no slmguard internals beyond ``engine_argv`` and the commit-charge
parser doctor uses (``host.process.parse_commit_bytes``): a plain script module.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard.engines import UnixHTTPConnection
from slmguard.host.process import parse_commit_bytes
from slmguard.serve.llamaserver import EngineConfig, engine_argv

LOG_ARGS = ["--log-verbosity", "4"]
PRIVATE_NAME = "plan-probe-engine"
UNIT_TEXT = "The quick brown fox jumps over the lazy dog while the river runs to the sea. " * 16


@dataclass
class Peak:
    """Peaks over the process's life (bytes). With a Vulkan log (lavapipe, see
    gpu_memory.py): the device allocations, their resident bytes and the host side,
    RssAnon without them, sampled together every 200 ms."""

    anon: int = 0
    file: int = 0
    hwm: int = 0
    commit: int = 0
    threads: int = 0
    device_allocated: int = 0
    device_resident: int = 0
    host_anon: int = 0


def status_fields(text: str) -> dict[str, int]:
    """``/proc/PID/status`` sizes in bytes (kB lines) and the thread count."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        value = rest.split()
        if not value:
            continue
        if key == "Threads":
            out[key] = int(value[0])
        elif len(value) == 2 and value[1] == "kB":
            out[key] = int(value[0]) * 1024
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the benchmark dies (PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def _sample_device(pid: int, peak: Peak, device: Any) -> None:
    """One joint sample of the device allocations and the process's RssAnon."""
    device.update()
    resident = device.resident(pid)
    anon = status_fields(Path(f"/proc/{pid}/status").read_text()).get("RssAnon", 0)
    peak.device_allocated = max(peak.device_allocated, device.allocated)
    peak.device_resident = max(peak.device_resident, resident)
    peak.host_anon = max(peak.host_anon, anon - resident)


def _sample(pid: int, peak: Peak, stop: threading.Event, device: Any = None) -> None:
    status, maps = Path(f"/proc/{pid}/status"), Path(f"/proc/{pid}/maps")
    last_maps = last_device = 0.0
    while not stop.is_set():
        try:
            st = status_fields(status.read_text())
            peak.anon = max(peak.anon, st.get("RssAnon", 0))
            peak.file = max(peak.file, st.get("RssFile", 0))
            peak.hwm = max(peak.hwm, st.get("VmHWM", 0))
            peak.threads = max(peak.threads, st.get("Threads", 0))
            now = time.monotonic()
            if now - last_maps >= 0.1:
                peak.commit = max(peak.commit, parse_commit_bytes(maps.read_text()))
                last_maps = now
            if device is not None and now - last_device >= 0.2:
                _sample_device(pid, peak, device)
                last_device = now
        except (OSError, ValueError):
            pass
        stop.wait(0.004)


# The engine's buffer reports; sizes in MiB with two decimals.
_LOG_PATTERNS = {
    "mapped_mib": r"CPU_Mapped model buffer size =\s+([\d.]+) MiB",
    "repack_mib": r"CPU_REPACK model buffer size =\s+([\d.]+) MiB",
    "cpu_model_mib": r"\bCPU model buffer size =\s+([\d.]+) MiB",
    "output_mib": r"CPU\s+output buffer size =\s+([\d.]+) MiB",
    "kv_mib": r"CPU KV buffer size =\s+([\d.]+) MiB",
    "compute_mib": r"CPU compute buffer size =\s+([\d.]+) MiB",
}


def parse_engine_log(text: str) -> dict[str, Any]:
    """The engine's own reports: buffer sizes (MiB, summed by kind), n_ctx,
    n_ctx_seq, and the cells of each KV cache it created (``kv_caches``:
    ``[cells, layers, seqs]`` per ``llama_kv_cache: size = ...`` line)."""
    out: dict[str, Any] = {}
    for key, pattern in _LOG_PATTERNS.items():
        found = re.findall(pattern, text)
        if key == "compute_mib":
            found = found[-1:]  # the last reservation is the one in use
        out[key] = round(sum(float(x) for x in found), 2)
    for key in ("n_ctx", "n_ctx_seq", "n_seq_max", "n_outputs_max"):
        m = re.search(rf"llama_context: {key}\s+= (\d+)", text)
        out[key] = int(m.group(1)) if m else None
    out["kv_caches"] = [
        [int(c), int(n_layers), int(seqs)]
        for c, n_layers, seqs in re.findall(
            r"llama_kv_cache: size =\s+[\d.]+ MiB \(\s*(\d+) cells,\s+(\d+) layers,"
            r"\s+\d+/(\d+) seqs",
            text,
        )
    ]
    # Every buffer report by backend buffer type (Vulkan0, Vulkan_Host, CPU, ...): the
    # last compute reservation of each type, the sum of the others.
    buffers: dict[str, float] = {}
    for name, kind, mib in re.findall(
        r"\b([A-Za-z0-9_]+)\s+(model|KV|compute|output) buffer size =\s+([\d.]+) MiB", text
    ):
        key = f"{name} {kind}"
        buffers[key] = float(mib) + (buffers.get(key, 0.0) if kind != "compute" else 0.0)
    out["buffers"] = {k: round(v, 2) for k, v in sorted(buffers.items())}
    offloaded = re.search(r"offloaded (\d+)/(\d+) layers to GPU", text)
    out["offloaded_layers"] = [int(g) for g in offloaded.groups()] if offloaded else None
    # llama.cpp's own --fit projection for the same settings (at --log-verbosity 4)
    fit = re.search(
        r"projected to use (\d+) MiB of device memory vs\. (\d+) MiB of free device memory", text
    )
    out["fit_projected_mib"] = [int(g) for g in fit.groups()] if fit else None
    out["full_swa"] = "using full-size SWA cache" in text
    out["http_threads"] = (
        int(m.group(1)) if (m := re.search(r"using (\d+) threads for HTTP", text)) else None
    )
    return out


@dataclass
class Engine:
    """A running llama-server child and its sampler."""

    proc: subprocess.Popen[bytes]
    sock: Path
    key: str
    log_path: Path
    peak: Peak
    stop: threading.Event
    sampler: threading.Thread
    argv: list[str]
    started: float = field(default_factory=time.monotonic)

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 3600
    ) -> tuple[int, Any]:
        conn = UnixHTTPConnection(self.sock, timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw else None)
        finally:
            conn.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def snapshot(self) -> dict[str, int]:
        pid = self.proc.pid
        st = status_fields(Path(f"/proc/{pid}/status").read_text())
        st["commit"] = parse_commit_bytes(Path(f"/proc/{pid}/maps").read_text())
        return st

    def close(self) -> None:
        self.stop.set()
        self.sampler.join()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_engine(
    binary: Path,
    cfg: EngineConfig,
    workdir: Path,
    ready_s: float = 600,
    env: dict[str, str] | None = None,
    device: Any = None,
) -> Engine:
    """Spawn llama-server via engine_argv and wait until it answers ``/health``
    (``env``: extra environment variables for the child; ``device``: a
    gpu_memory.DeviceMemory to sample with the rest)."""
    key = secrets.token_hex(16)
    key_file = workdir / "api.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    sock = workdir / "engine.sock"
    sock.unlink(missing_ok=True)
    # The same binary under a private name: on a shared machine another session's
    # `pkill llama-server` must not end a measurement half way.
    private = workdir / PRIVATE_NAME
    private.unlink(missing_ok=True)
    private.symlink_to(binary.resolve())
    argv = engine_argv(private, cfg, socket_path=sock, api_key_file=key_file, alias="probe")
    argv += LOG_ARGS
    log_path = workdir / "engine.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
    peak, stop = Peak(), threading.Event()
    sampler = threading.Thread(target=_sample, args=(proc.pid, peak, stop, device), daemon=True)
    sampler.start()
    eng = Engine(proc, sock, key, log_path, peak, stop, sampler, argv)
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            eng.close()
            raise RuntimeError(f"llama-server exited {proc.returncode}: {eng.log()[-3000:]}")
        if sock.exists():
            try:
                status, _ = eng.request("GET", "/health", timeout=5)
                if status == 200:
                    return eng
            except OSError:
                pass
        time.sleep(0.05)
    eng.close()
    raise RuntimeError(f"llama-server not ready after {ready_s} s: {eng.log()[-3000:]}")


def fill_tokens(eng: Engine, n_tokens: int) -> list[int]:
    """``n_tokens`` prompt tokens: BOS and the unit text repeated."""
    _, bos = eng.request("POST", "/tokenize", {"content": "", "add_special": True})
    _, unit = eng.request("POST", "/tokenize", {"content": UNIT_TEXT, "add_special": False})
    head: list[int] = bos["tokens"][:1]
    body: list[int] = unit["tokens"]
    need = max(0, n_tokens - len(head))
    return head + (body * (need // len(body) + 1))[:need]


def fill_slots(eng: Engine, n_slots: int, n_tokens: int) -> dict[str, Any]:
    """Every slot at once: one ``/completion`` whose ``prompt`` is a list of
    ``n_slots`` prompts of ``n_tokens`` each (2 tokens out). llama-server queues
    their tasks together, so every run batches them the same way (separate
    requests race: a slot that starts alone runs smaller ubatches)."""
    prompt = fill_tokens(eng, n_tokens)
    body = {
        "prompt": [prompt] * n_slots if n_slots > 1 else prompt,
        "n_predict": 2,
        "temperature": 0.0,
        "cache_prompt": False,
    }
    started = time.monotonic()
    status, data = eng.request("POST", "/completion", body)
    if status != 200:
        raise RuntimeError(f"/completion: {status} {data}")
    results = data if isinstance(data, list) else [data]
    if len(results) != n_slots:
        raise RuntimeError(f"/completion: {len(results)} results for {n_slots} prompts")
    return {
        "fill_s": time.monotonic() - started,
        "prompt_tokens": [r.get("tokens_evaluated", 0) for r in results],
    }


def probe(
    binary: Path,
    cfg: EngineConfig,
    fill_per_slot: int | None,
    *,
    env: dict[str, str] | None = None,
    vulkan_shim: Path | None = None,
) -> dict[str, Any]:
    """Load (and, unless ``fill_per_slot`` is None, fill every slot), then report.

    ``vulkan_shim``: vkmemlog.so, preloaded to measure the device side (lavapipe)."""
    from gpu_memory import DeviceMemory

    with tempfile.TemporaryDirectory(prefix="slmguard-probe-") as tmp:
        env = dict(env or {})
        device = None
        if vulkan_shim is not None:
            device = DeviceMemory(Path(tmp) / "vkmem.log")
            env |= {"LD_PRELOAD": str(vulkan_shim), "VKMEMLOG": str(device.log)}
        eng = start_engine(binary, cfg, Path(tmp), env=env, device=device)
        try:
            loaded = eng.snapshot()
            loaded["t_s"] = round(time.monotonic() - eng.started, 2)
            filled: dict[str, Any] | None = None
            fill: dict[str, Any] | None = None
            if fill_per_slot:
                fill = fill_slots(eng, cfg.n_parallel, fill_per_slot)
                filled = eng.snapshot()
            log = eng.log()
        finally:
            eng.close()
        out = {
            "argv": eng.argv[1:],
            "loaded": loaded,
            "filled": filled,
            "fill": fill,
            "peak": vars(eng.peak),
            "log": parse_engine_log(log),
        }
        if device is not None:
            out["device"] = {"allocations": device.count, "calls": device.calls}
            out["env"] = {k: v for k, v in env.items() if k.startswith("GGML_")}
        return out
