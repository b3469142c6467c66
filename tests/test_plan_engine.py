"""The budget against the real llama-server.

Two kinds of check. The recorded cells of ``benchmarks/plan_accuracy.py``
(``benchmarks/plan_accuracy_cells.json``, measured on the engine as ``serve``
starts it; RESULTS.md says when and how) are re-predicted with the current
budget: every cell's peak anonymous and file-backed RSS and commit charge
within 5 %, and the engine's own buffer reports equal to the rules. Then, with
the engine binary present (marker ``engine``), two small cells are measured
live and must be within 10 %.
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


def _recorded(model: Path) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = json.loads(CELLS.read_text())
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
