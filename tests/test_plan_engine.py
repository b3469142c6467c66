"""The budget against the real llama-server.

Two kinds of check. The recorded cells of ``benchmarks/plan_accuracy.py``
(``benchmarks/plan_accuracy_cells.json``, measured on the engine as ``serve``
starts it; RESULTS.md says when and how) are re-predicted with the current
budget: every cell's peak anonymous and file-backed RSS and commit charge
within 5 %, and the engine's own buffer reports equal to the rules; so are the
CPU build's cells filled with 16 tokens, the offload cells' fill
(``plan_accuracy_gpu_cpu_build_cells.json``), which the Vulkan build's
``--device none`` cells are compared with. Then, with the engine binary present
(marker ``engine``), two small cells are measured live and must be within 10 %.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

MiB = 1 << 20
BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
CELLS = BENCH / "plan_accuracy_cells.json"
SHORT = BENCH / "plan_accuracy_gpu_cpu_build_cells.json"  # the CPU build, 16-token fills
GPU = BENCH / "plan_accuracy_gpu_cells.json"  # the Vulkan build on lavapipe, warm


def _bench() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("plan_accuracy", BENCH / "plan_accuracy.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("plan_accuracy", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model() -> Path:
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    return ensure_default_model(paths.model_dir())


def _recorded(model: Path, cells: Path = CELLS) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = json.loads(cells.read_text())
    for e in entries:
        e["model"] = str(model)  # recorded on /var/lib/slmguard/models; same file
    return entries


def test_recorded_cells_cover_the_issue_grid(model: Path) -> None:
    bench = _bench()
    have = {json.dumps(e["cell"], sort_keys=True) for e in _recorded(model)}
    grid = {json.dumps(c, sort_keys=True) for c in bench.cell_grid()}
    assert have <= grid and len(have) >= 24  # at least the in-sample cells
    for e in _recorded(model):
        assert "0c1e570" in e["engine"] and e["argv"][-2:] == ["--log-verbosity", "4"]
        assert "--cache-ram" in e["argv"] and "--no-context-shift" in e["argv"]


def test_recorded_cells_within_five_percent(model: Path) -> None:
    bench = _bench()
    for row in bench.report_rows(_recorded(model)):
        for col in ("anon_err", "file_err", "commit_err"):
            assert abs(row[col]) <= 5.0, (col, row)


def test_recorded_engine_reports_match_the_rules(model: Path) -> None:
    bench = _bench()
    for e in _recorded(model):
        b = bench.predict(e)
        log = e["log"]
        kv, out, rep = b.part("kv_cache"), b.part("output_buffer"), b.part("weights_repacked")
        assert kv is not None and abs(kv.bytes / MiB - log["kv_mib"]) < 0.01
        assert out is not None and abs(out.bytes / MiB - log["output_mib"]) < 0.01
        assert rep is not None and round(rep.bytes / MiB, 2) == log["repack_mib"]
        assert -4.1 <= b.compute_reserved_bytes / MiB - log["compute_mib"] <= 7
        assert (b.cells.n_ctx, b.cells.n_ctx_slot) == (log["n_ctx"], log["n_ctx_seq"])


def test_short_prompts_within_five_percent(model: Path) -> None:
    """A 16-token prompt runs a 16-token ubatch, whose graph touches a few pages of the
    compute buffer; the rule at a full ubatch said +7 to +20 % on these cells."""
    bench = _bench()
    entries = _recorded(model, SHORT)
    rows = bench.report_rows(entries)
    assert {r["fill"] for r in rows} == {16} and {r["n_ctx"] for r in rows} == {2048, 8192}
    for row in rows:
        for col in ("anon_err", "file_err", "commit_err"):
            assert abs(row[col]) <= 5.0, (col, row)
    for e in entries:
        b = bench.predict(e)
        compute = b.part("compute_buffer")
        assert compute is not None and compute.bytes < 2 * MiB < b.compute_reserved_bytes


def test_a_vulkan_build_without_a_device_holds_its_vulkan_instance(model: Path) -> None:
    """The Vulkan build with --device none against the CPU build, same settings, after
    load: the anonymous memory it holds more is the Vulkan instance the budget adds
    (plan.offload.VULKAN_INSTANCE_BYTES), within 1 MiB, at every context."""
    from slmguard.plan.offload import VULKAN_INSTANCE_BYTES

    cpu = {
        e["cell"]["n_ctx"]: e["loaded"]["RssAnon"]
        for e in _recorded(model, SHORT)
        if e["cell"]["kv_type"] == "f16" and not e["cell"]["flash_attn"]
    }
    none = [
        e
        for e in _recorded(model, GPU)
        if e["cell"]["device"] == "none" and not e["cell"]["flash_attn"]
    ]
    assert {e["cell"]["n_ctx"] for e in none} == set(cpu) == {2048, 8192}
    for e in none:
        more = e["loaded"]["RssAnon"] - cpu[e["cell"]["n_ctx"]]
        assert abs(more - VULKAN_INSTANCE_BYTES) <= MiB, (e["cell"], more / MiB)


def test_recorded_offload_cells_within_five_percent(model: Path) -> None:
    """The offload cells on lavapipe, every one measured in the steady state (Mesa's shader
    cache primed first): device side, host side and file within 5 % (issue 25's goal)."""
    _bench()
    import plan_accuracy_offload as off

    entries = _recorded(model, GPU)
    assert entries and all(e["shader_cache"] == "warm" for e in entries)
    for row in off.rows(entries):
        for col in ("device_err", "host_err", "file_err"):
            assert abs(row[col]) <= 5.0, (col, row["n_ctx"], row["n_gpu_layers"], row[col])


@pytest.mark.engine
@pytest.mark.parametrize("slots", [1, 4])
def test_live_cell_within_10_percent(model: Path, slots: int) -> None:
    from slmguard.errors import EngineUnavailableError
    from slmguard.serve.llamaserver import EngineConfig, find_llama_server

    try:
        binary = find_llama_server()
    except EngineUnavailableError as err:
        pytest.skip(f"no llama-server: {err.message}")
    sys.path.insert(0, str(BENCH))
    from engine_probe import probe

    bench = _bench()
    cell = {
        "n_ctx": 512,
        "n_batch": 64,
        "n_ubatch": 64,
        "n_parallel": slots,
        "kv_type": "f16",
        "flash_attn": True,
    }
    fill = bench.fill_per_slot(cell, 512)
    result = probe(binary, EngineConfig(model_path=str(model), n_threads=2, **cell), fill)
    assert result["fill"]["prompt_tokens"] == [fill] * slots
    entry = {"cell": cell, "threads": 2, "model": str(model), "fill_per_slot": fill, **result}
    b = bench.predict(entry)
    pk = result["peak"]
    assert abs(b.engine_anon_peak_bytes - pk["anon"]) <= 0.10 * pk["anon"], (b, pk)
    assert abs(b.engine_file_bytes - pk["file"]) <= 0.10 * pk["file"], (b, pk)
    assert abs(b.engine_commit_bytes - pk["commit"]) <= 0.10 * pk["commit"], (b, pk)
    kv = b.part("kv_cache")
    assert kv is not None and result["log"]["kv_mib"] == kv.bytes / MiB
