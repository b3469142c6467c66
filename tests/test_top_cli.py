"""`slmguard top` as a table: arguments -> exit code + output substrings; and what it imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hosttree import build_tree
from slmguard.cli import main
from toptrees import FIXTURES, RK3588_TOP, SERVICE, StandIn, contract_routes, stand_in

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    base = tmp_path_factory.mktemp("top-cli")
    root = build_tree(base / "root", RK3588_TOP)
    (base / "admin-token").write_text("adm\n")
    (base / "empty-token").write_text("\n")
    (base / "bad-plan.json").write_text("{not json")
    with stand_in(contract_routes()) as srv:
        with stand_in() as gone:
            closed = gone.url
        yield {
            "url": srv.url,
            "closed": closed,
            "root": str(root),
            "cgroup": str(root / SERVICE),
            "plan": str(FIXTURES / "plan-rk3588-4g.json"),
            "bad_plan": str(base / "bad-plan.json"),
            "token": str(base / "admin-token"),
            "no_file": str(base / "nope"),
            "state": str(base / "state"),
        }


COMMON = ["--root", "{root}", "--state-dir", "{state}", "--interval", "0.1", "--local"]
CASES = [
    # (arguments, exit code, substrings of stdout+stderr)
    (["--once", "--server", "{url}", "--cgroup", "{cgroup}"], 0,
     ["DEGRADE for 12s", "THROTTLED [!!]", "157 / 512", "working set", "no plan"]),
    (["--once", "--server", "{url}", "--cgroup", "{cgroup}", "--plan", "{plan}"], 0,
     ["plan {plan}:", "kv_cache", "service total"]),
    (["--once", "--json", "--server", "{url}"], 0, ['"schema": "slmguard.top/1"']),
    (["--once", "--server", "{closed}"], 69, ["UNREACHABLE", "Connection refused", "Board"]),
    (["--once", "--json", "--server", "{closed}"], 69, ['"reachable": false']),
    (["--json", "--server", "{url}"], 64, ["--json needs --once"]),
    (["--once", "--server", "ftp://x"], 78, ["use http:// or https://"]),
    (["--once", "--server", "{url}", "--interval", "0"], 78, ["--interval must be"]),
    (["--once", "--server", "{url}", "--keep-recent", "-1"], 78, ["--keep-recent"]),
    (["--once", "--server", "{url}", "--cgroup", "{root}"], 64, ["not a cgroup directory"]),
    (["--once", "--server", "{url}", "--plan", "{no_file}"], 78, ["plan file not found"]),
    (["--once", "--server", "{url}", "--plan", "{bad_plan}"], 78, ["not valid JSON"]),
    (["--once", "--server", "{url}", "--admin-token-file", "{no_file}"], 74, ["token file"]),
    (["--once", "--interval", "x"], 64, ["invalid float value"]),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "code", "expect"), CASES)
def test_cli_table(
    env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    code: int,
    expect: list[str],
) -> None:
    args = ["top", *(a.format(**env) for a in COMMON + argv)]
    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    text = out.out + out.err
    assert exc.value.code == code, text
    for s in expect:
        assert s.format(**env) in text, (s, text)
    assert "Traceback" not in text


def test_json_snapshot_fields(env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["top", *(a.format(**env) for a in COMMON),
              "--once", "--json", "--server", env["url"], "--cgroup", env["cgroup"]])  # fmt: skip
    assert exc.value.code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["server"]["governor"]["level"] == "degrade"
    assert data["server"]["engine"]["unavailable_503"] == 15
    assert data["memory"]["high_bytes"] == 384 << 20
    assert data["board"]["cores"][4]["throttled"] is True
    assert data["plan"] is None


def test_token_sources(
    env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--admin-token-file, else $CREDENTIALS_DIRECTORY/admin-token; the API key from the env."""
    from slmguard.commands.top import build
    from slmguard.top.config import TopConfig, admin_token_path

    args = _args(["top", "--once", "--server", env["url"], "--no-local"])
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "admin-token").write_text("from-credential\n")
    _, collector = build(args, {"CREDENTIALS_DIRECTORY": str(creds), "SLMGUARD_API_KEY": "k1"})
    assert collector.client.admin_token == "from-credential"
    assert collector.client.api_key == "k1"
    args = _args(["top", "--once", "--server", env["url"], "--admin-token-file", env["token"]])
    _, collector = build(args, {"CREDENTIALS_DIRECTORY": str(creds)})
    assert collector.client.admin_token == "adm" and collector.client.api_key is None
    assert admin_token_path(TopConfig(), {"CREDENTIALS_DIRECTORY": str(tmp_path)}) is None
    args = _args(["top", "--once", "--admin-token-file", str(tmp_path / "creds" / "x")])
    (creds / "x").write_text("\n")
    _, collector = build(args, {})
    assert collector.client.admin_token is None  # an empty file is no token


def _args(argv: list[str]) -> object:
    from slmguard.cli import build_parser

    return build_parser().parse_args(argv)


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + str(REPO / "tests"))
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env,
        check=False,
    )  # fmt: skip


def test_other_verbs_never_import_the_ui() -> None:
    code = (
        "import sys\n"
        "from slmguard.cli import build_parser\n"
        "build_parser()\n"
        "from slmguard.commands import plan, doctor, render, apply, top\n"
        "from slmguard.top import sources, view, text, server\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'rich'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stdout + done.stderr


def test_once_runs_without_the_ui_library(env: dict[str, str]) -> None:
    """--once with textual and rich unimportable (a board with only `pip install slmguard`)."""
    code = (
        "import sys\n"
        "sys.modules['textual'] = None; sys.modules['rich'] = None\n"
        "from slmguard.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    done = _python(code, "top", "--once", "--server", env["url"], "--no-local")
    assert done.returncode == 0, done.stderr
    assert "DEGRADE" in done.stdout
    # The live view needs the library: exit 69 and say what to install.
    done = _python(code, "top", "--server", env["url"], "--no-local")
    assert done.returncode == 69
    assert "terminal UI library" in done.stderr
    assert ".venv/bin/pip install -e '.[top]'" in done.stderr
    # Never a line that fails as typed: slmguard is on no index (issue 38).
    assert "pip install 'slmguard[top]'" not in done.stderr
    # The extra and its library by name, not rich (the first import that failed).
    assert "textual (the `top` extra)" in done.stderr and "rich" not in done.stderr
    assert "Traceback" not in done.stderr


def test_trim_goes_with_the_admin_token(env: dict[str, str]) -> None:
    from slmguard.commands.top import build

    with stand_in(contract_routes()) as srv:
        _, c = build(_args(["top", "--server", srv.url, "--admin-token-file", env["token"],
                            "--no-local"]), {})  # fmt: skip
        result = c.trim(512)
        assert result.ok
        _assert_trim(srv)
    assert any(e.kind == "trim" and "2 session(s)" in e.message for e in c.events)


def _assert_trim(srv: StandIn) -> None:
    assert srv.auth["/api/v1/context/trim"] == ["Bearer adm"]
    assert json.loads(srv.bodies[-1]) == {"keep_recent": 512}
