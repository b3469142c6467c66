"""The soak's short form (issue 40): ``benchmarks/soak.py --quick`` against the real
``slmguard serve`` and ``slmguard watch``, a minute of the whole traffic rotation (chat,
completions, streams, dropped streams, hostile bodies, sessions, trims) and an engine
kill, then a few idle seconds. No timing asserts: it checks that the soak runs and that
nothing answered an internal error or broke a connection; the figures come from the long
run (``benchmarks/RESULTS.md``, section ``## soak``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from serveproc import engine_available

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parent.parent


def test_the_soaks_short_form_runs_clean(tmp_path: Path) -> None:
    if not engine_available():
        pytest.skip("the llama-server binary is not there (run `make`)")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import soak
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    out = tmp_path / "soak.json"
    assert soak.main(["--quick", "--json", str(out), "--state-root", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    summary, samples = result["summary"], result["samples"]
    assert summary["requests"] > 0 and len(samples) >= 2
    assert summary["server_exit"] is None  # it served to the end
    outcomes = summary["outcomes"]
    assert outcomes.get("200", 0) > 0
    # 503s and streams cut short come with the engine kill; an internal error or a broken
    # connection never should.
    broken = {k: n for k, n in outcomes.items() if k.startswith(("500", "502", "504", "transp"))}
    assert not broken, outcomes
    # Every 429 and 503 tells the client when to come back (the official clients wait so).
    assert not summary["no_retry_after"], summary["no_retry_after"]
    last = samples[-1]
    assert last["front_private_bytes"] and last["front_fds"]
    assert last["sqlite_bytes"] > 0 and summary["idle"] is not None
