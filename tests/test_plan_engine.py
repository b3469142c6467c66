"""The budget against the real engine: two small cells of benchmarks/plan_accuracy.py.

Each cell loads the default model in a fresh llama-cpp-python process, runs a
prompt that fills the context and samples the peak RSS; the prediction must
be within 10 % (the benchmark's goal is 5 % on every cell, see RESULTS.md),
and the engine's own buffer reports must match the budget's rules.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

MiB = 1 << 20
BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "plan_accuracy.py"

pytestmark = pytest.mark.engine


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plan_accuracy", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("plan_accuracy", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model() -> Path:
    # find_spec, not import: the engine only ever runs in the child processes.
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    return ensure_default_model(paths.model_dir())


@pytest.mark.parametrize(("n_ctx", "n_batch"), [(512, 64), (512, 512)])
def test_prediction_within_10_percent(model: Path, n_ctx: int, n_batch: int) -> None:
    bench = _bench()
    cell: dict[str, Any] = bench.run_cell(model, n_ctx, n_batch, threads=2, max_fill=n_ctx)
    fill = cell["phases"]["filled"]["fill_tokens"]
    assert fill == n_ctx - 4
    budget = bench.predict(model, n_ctx, n_batch, 2, fill)
    peak = cell["peak"]
    assert abs(budget.engine_anon_peak_bytes - peak.anon) <= 0.10 * peak.anon, (budget, peak)
    assert abs(budget.engine_file_bytes - peak.file) <= 0.10 * peak.file, (budget, peak)
    # The engine's own buffer reports (MiB) against the rules in slmguard.plan.budget.
    log = cell["log"]
    kv = budget.part("kv_cache")
    assert kv is not None and log["kv_mib"] == kv.bytes / MiB
    repacked = budget.part("weights_repacked")
    assert repacked is not None and round(repacked.bytes / MiB, 2) == log["repack_mib"]
    assert (
        abs(budget.compute_reserved_bytes / MiB - log["compute_mib"]) <= 0.01 * log["compute_mib"]
    )
    out = budget.part("output_buffer")
    assert out is not None and out.bytes / MiB == log["output_mib"]
