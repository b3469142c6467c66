"""``slmguard serve`` failure paths through the real CLI: one error line, documented exit code."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from serveproc import REQUEST_TIMEOUT_S, default_model_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the backport (the test extra installs it there)
    import tomli as tomllib

SLMGUARD = str(Path(sys.executable).with_name("slmguard"))
DEFAULT_MODEL = default_model_path()


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "HOME": "/root", "SLMGUARD_STATE_DIR": "/tmp/slmguard-cli"}
    return subprocess.run(
        [SLMGUARD, *args],
        capture_output=True,
        text=True,
        timeout=REQUEST_TIMEOUT_S,
        env={**base, **(env or {})},
    )


@pytest.fixture
def models(tmp_path: Path) -> Path:
    (tmp_path / "text.gguf").write_text("this is not a model\n")
    (tmp_path / "empty.gguf").write_bytes(b"")
    if DEFAULT_MODEL.exists():
        with DEFAULT_MODEL.open("rb") as f:
            (tmp_path / "truncated.gguf").write_bytes(f.read(3 << 20))
    else:  # a valid GGUF magic and version, then nothing
        (tmp_path / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    (tmp_path / "plan-bad.json").write_text("{not json")
    (tmp_path / "empty-key").write_text("\n")
    return tmp_path


CASES = [
    # args ({d} = fixture directory), env, exit code, substrings of stderr
    (["serve", "--model", "{d}/missing.gguf"], {}, 66, ["missing.gguf", "no such file"]),
    (["serve", "--model", "{d}/text.gguf"], {}, 65, ["text.gguf"]),
    (["serve", "--model", "{d}/empty.gguf"], {}, 65, ["empty.gguf"]),
    (["serve", "--model", "{d}/truncated.gguf"], {}, 65, ["truncated.gguf"]),
    (["serve", "--host", "0.0.0.0"], {}, 78, ["refusing to listen on 0.0.0.0", "hint:"]),
    (["serve", "--host", "192.0.2.1", "--api-key-file", "{d}/empty-key"], {}, 78, ["empty"]),
    (["serve", "--host", "::", "--api-key-file", "{d}/nokey"], {}, 78, ["nokey"]),
    (["serve", "--plan", "{d}/plan-missing.json"], {}, 78, ["plan file not found"]),
    (["serve", "--plan", "{d}/plan-bad.json"], {}, 78, ["not valid JSON"]),
    (["serve", "--n-ctx", "0"], {}, 78, ["--n-ctx must be > 0"]),
    (["serve", "--port", "70000"], {}, 78, ["--port must be 1-65535"]),
    (["serve"], {"SLMGUARD_N_CTX": "lots"}, 78, ["SLMGUARD_N_CTX='lots'"]),
    (["serve", "--kv-type", "q5_1"], {}, 64, ["invalid choice"]),
    (["serve", "--n-ctx", "many"], {}, 64, ["invalid int value"]),
    (["serve", "--kv-type", "q8_0"], {}, 78, ["needs --flash-attn"]),
    (["serve", "--n-parallel", "0"], {}, 78, ["--n-parallel must be > 0"]),
    (["serve", "--n-ctx", "512", "--n-parallel", "1024"], {}, 78, ["no context for 1024 slots"]),
    (["serve", "--cache-ram-mib", "-1"], {}, 78, ["--cache-ram-mib must be >= 0"]),
    # Planned for this host before the engine starts: the numbers, exit 78.
    (["serve", "--ctx", "999999999"], {}, 78, ["999999999", "trained context of 32768"]),
    (["serve", "--n-ctx", "999999999"], {}, 78, ["--n-ctx / SLMGUARD_N_CTX is deprecated",
                                                 "give --ctx", "trained context of 32768"]),
    (["serve", "--ctx", "0"], {}, 78, ["--ctx must be > 0"]),
    (["serve", "--ctx", "512", "--n-ctx", "1024"], {}, 78, ["not both"]),
    (["serve"], {"SLMGUARD_CTX": "512", "SLMGUARD_N_CTX": "512"}, 78, ["not both"]),
    (["serve", "--n-parallel", "65"], {}, 78, ["--n-parallel must be 1 to 64"]),
    (["serve", "--llama-server", "{d}/no-such-binary"], {}, 69,
     ["no-such-binary", "--llama-server"]),
    (["serve", "--llama-server", "{d}/text.gguf"], {}, 69, ["not an executable file"]),
    (["serve", "--llama-server", "/bin/false"], {}, 69, ["--version` exited 1"]),
]  # fmt: skip


@pytest.mark.parametrize(("args", "env", "code", "needles"), CASES)
def test_serve_failure(
    models: Path, args: list[str], env: dict[str, str], code: int, needles: list[str]
) -> None:
    result = run([a.format(d=models) for a in args], env)
    assert result.returncode == code, result.stderr
    for needle in needles:
        assert needle in result.stderr
    assert "Traceback" not in result.stderr
    if code != 64:  # one error line (after the plan's line and a deprecation notice)
        notices = ("is deprecated", "planned for this host")
        lines = [ln for ln in result.stderr.splitlines() if not any(n in ln for n in notices)]
        assert lines[0].startswith("slmguard: error: "), result.stderr


def test_port_in_use(models: Path) -> None:
    if not DEFAULT_MODEL.exists():
        pytest.skip("default model not prepared (run `slmguard model prepare`)")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = run(["serve", "--model", str(DEFAULT_MODEL), "--port", str(port)])
    assert result.returncode == 78
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def unknown_arch_gguf(path: Path) -> Path:
    """A small, well-formed GGUF of an architecture llama.cpp does not know."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "nonesuch")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(1)
    w.add_context_length(64)
    w.add_token_list([f"t{i}" for i in range(4)])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_model_the_engine_cannot_load_is_65_at_once(tmp_path: Path) -> None:
    """The header reads well but llama.cpp refuses the model: exit 65, no restart loop."""
    from serveproc import engine_available, free_port

    if not engine_available():
        pytest.skip("the llama-server binary is not there (run `make`)")
    model = unknown_arch_gguf(tmp_path / "nonesuch.gguf")
    result = run(
        ["serve", "--model", str(model), "--port", str(free_port()), "--restart-max", "5"],
        {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    assert result.returncode == 65, result.stderr[-2000:]
    assert "nonesuch.gguf" in result.stderr and "could not load" in result.stderr
    assert "restarted" not in result.stderr and "Traceback" not in result.stderr


def test_a_context_over_the_plans_beyond_the_trained_one_is_78(tmp_path: Path) -> None:
    """--plan with a --ctx beyond the model's trained context: refused before the engine."""
    from serveproc import engine_available

    if not engine_available() or not DEFAULT_MODEL.exists():
        pytest.skip("needs the engine binary and the default model (run `make`)")
    plan = tmp_path / "plan.json"
    made = run(["plan", "--model", str(DEFAULT_MODEL), "--ctx", "1024", "--json", "--out",
                str(plan)], {"PATH": os.environ.get("PATH", "/usr/bin:/bin")})  # fmt: skip
    assert made.returncode == 0, made.stderr
    result = run(["serve", "--plan", str(plan), "--ctx", "40000"],
                 {"PATH": os.environ.get("PATH", "/usr/bin:/bin")})  # fmt: skip
    assert result.returncode == 78, result.stderr
    assert "40,000 tokens per slot" in result.stderr and "32,768 tokens" in result.stderr
    assert "hint: give --ctx 32768 or less" in result.stderr


def test_help_has_example_and_env_names() -> None:
    result = run(["serve", "--help"])
    assert result.returncode == 0
    assert "Example:" in result.stdout
    assert "SLMGUARD_N_CTX" in result.stdout and "--queue-size" in result.stdout


def test_the_modules_serve_requires_are_the_serve_extras() -> None:
    """serve's up-front check names only what `pip install slmguard[serve]` installs
    (it once required httpx after the front stopped using it: a board without it
    could not start), and each of them is what the front imports."""
    from importlib.metadata import packages_distributions

    from slmguard.serve.startup import SERVE_MODULES

    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    serve_extra = {
        req.split("==")[0].split(">")[0].strip().lower().replace("_", "-")
        for req in pyproject["project"]["optional-dependencies"]["serve"]
    }
    dists = packages_distributions()
    for module, _ in SERVE_MODULES:
        names = {d.lower().replace("_", "-") for d in dists.get(module, [])}
        assert names & serve_extra, f"{module} ({names}) is not in the serve extra"


def test_serve_without_the_serve_extra_is_one_line_and_69(tmp_path: Path) -> None:
    """No site-packages (-S): the web stack is missing, and serve says so before any
    model or engine work, as the user sees it on a board with only the core install."""
    src = Path(__file__).parent.parent / "src"
    code = (
        f"import sys; sys.path.insert(0, {str(src)!r}); from slmguard.cli import main; "
        f"sys.exit(main(['serve', '--state-dir', {str(tmp_path / 'state')!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 69, proc.stderr
    assert (
        proc.stderr.splitlines()[0] == "slmguard: error: the web stack (fastapi) is not installed"
    )
    assert "Traceback" not in proc.stderr
