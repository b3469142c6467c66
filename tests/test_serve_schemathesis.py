"""Property-based run of schemathesis against /openapi.json of a real server.

Real engine, with ``--max-tokens-cap 2`` so generated requests stay cheap, and an
API key so the authentication checks run too. Bounded and seeded: the same
cases every run. Every check schemathesis runs by default must pass (no 5xx,
responses match the schema, invalid auth is refused, a schema-valid request is
accepted, ...); ``fixtures/schemathesis.toml`` says where the last one cannot hold.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from serveproc import ServeFactory

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SCHEMATHESIS = str(Path(sys.executable).with_name("schemathesis"))
KEY = "schemathesis-key"
CONFIG = Path(__file__).parent / "fixtures" / "schemathesis.toml"


def test_openapi_fuzzing_finds_no_failures(serve_factory: ServeFactory, tmp_path: Path) -> None:
    s = serve_factory("--max-tokens-cap", "2", api_key=KEY)
    result = subprocess.run(
        [
            SCHEMATHESIS, "--config-file", str(CONFIG), "run", s.url + "/openapi.json",
            "--header", f"Authorization: Bearer {KEY}",
            "--max-examples", "6", "--seed", "20261130",
            "--phases", "examples,fuzzing", "--request-timeout", "60",
            "--report-dir", str(tmp_path / "report"),
        ],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    summary = result.stdout[-12000:]
    assert result.returncode == 0, summary
    assert "Failures:" not in summary  # warnings (admin views 403, no session to delete) are fine
    health = s.health()
    assert health is not None and health["state"] == "ready"
    assert health["engine"]["restarts"] == 0
