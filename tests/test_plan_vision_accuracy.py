"""The projector's budget against the recorded vision cells (no engine needed).

``benchmarks/plan_accuracy_vision_cells.json`` holds the cells measured on the real
llama-server with the projectors of ``tests/visionmodel.py`` (RESULTS.md, "plan
accuracy with images", says when and how); they are re-predicted with the current
``plan.projector`` and ``plan.budget``: every cell's text peak and peak with images within
5 %, the encoder's compute buffer within [0, 0.76] MiB above the engine's own report
(1.5 MiB below for one shape, SigLIP-base at 256 patches with flash attention,
where the engine reserves what it reserves without it: noted in RESULTS.md), and
the tokens per image equal to the engine's.
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
CELLS = BENCH / "plan_accuracy_vision_cells.json"


def _bench() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(
        "plan_accuracy_vision", BENCH / "plan_accuracy_vision.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    model = ensure_default_model(paths.model_dir())
    entries = json.loads(CELLS.read_text())
    for e in entries:
        e["model"] = str(model)  # recorded on /var/lib/slmguard/models; same file
    return _bench().report_rows(entries)  # type: ignore[no-any-return]


def test_the_recorded_cells_cover_the_grid(rows: list[dict[str, Any]]) -> None:
    have = {json.dumps({k: r[k] for k in ("shape", "image_size", "flash_attn", "pixels")},
                       sort_keys=True) for r in rows}  # fmt: skip
    grid = {json.dumps(c, sort_keys=True) for c in _bench().cell_grid()}
    assert have == grid


def test_every_cell_within_five_percent(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        assert abs(r["text_err"]) <= 5.0, r
        assert abs(r["peak_err"]) <= 5.0, r


def test_the_engine_reports_match_the_rules(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        assert r["tokens"] == r["tokens_pred"], r
        over = r["compute_pred"] / MiB - r["compute_mib"]
        low = -1.51 if (r["shape"], r["image_size"], r["flash_attn"]) == ("base", 224, True) else 0
        assert low - 0.01 <= over <= 0.76, r
