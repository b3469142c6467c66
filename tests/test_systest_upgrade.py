"""The power cut during a package upgrade (issue 40): the benchmark's record of each run
(benchmarks/systest_upgrade_cut.py), from a step record as the scenario writes it; no VM."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import systest_upgrade_cut as bench  # noqa: E402

RECORD: dict[str, Any] = {
    "step": "power-cut-upgrade",
    "status": "pass",
    "duration_s": 1234.5,
    "reason": "cut with dpkg at ...",
    "details": {
        "at_cut": {"status": "install ok half-configured|0.1.0-1",
                   "opener": "/opt/slmguard-venvs/ab-1/bin/python -m pip install"},
        "booted": {"status": "install ok half-configured|0.1.0-1", "cli": "slmguard 0.0.99",
                   "recover": {"Result": "success"}},
        "serving": {"chat": 200, "engine_ctx": "512"},
        "session": {"integrity_ok": True, "roles": ["user", "assistant"]},
        "repair": {"exit": 0, "status": "install ok installed|0.1.0-1", "took_s": 300.0,
                   "cli": "slmguard 0.1.0", "serving": {"chat": 200}},
        "messages_removed": 4,
    },
}  # fmt: skip


def test_a_run_row_says_where_dpkg_was_cut_and_what_the_boot_found() -> None:
    row = bench.run_row(RECORD, {"started": "2026-12-06 11:00 UTC", "exit": 0})
    assert row["cut_status"] == "install ok half-configured 0.1.0-1"
    assert row["booted_cli"] == "slmguard 0.0.99" and row["chat_after_boot"] == 200
    assert row["repair_status"] == "install ok installed 0.1.0-1" and row["removed"] == 4
    missing = bench.run_row(None, {"exit": 1})
    assert missing["status"] == "missing" and missing["exit"] == 1


def test_the_section_is_written_from_every_kept_run(tmp_path: Path) -> None:
    share = tmp_path / "run" / "share"
    share.mkdir(parents=True)
    keep = tmp_path / "upgrade-cut-runs"
    keep.mkdir()
    for status in ("fail", "pass"):
        event = {"event": "power-cut", "step": "power-cut-upgrade"}  # before the result
        lines = [json.dumps(event), json.dumps({**RECORD, "status": status})]
        (share / "results.jsonl").write_text("\n".join(lines) + "\n")
        bench.keep_run(tmp_path, keep, {"started": status, "exit": int(status == "fail")})
    rows = bench.kept_rows(keep)
    assert [r["status"] for r in rows] == ["fail", "pass"]
    text = bench.section(rows)
    assert text.startswith(bench.SECTION + "\n") and "**1 of 2 runs passed.**" in text
    assert "`install ok installed 0.1.0-1`, 300.0" in text
